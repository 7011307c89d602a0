// The CUDA memory's RunStep against the host memory's (cache_store/
// step_batch.h), batch for batch: after the same batches both arenas hold
// the same bytes, byte for byte, and the scoring rows agree to float32
// rounding (LaunchQueryAttention against its twin); over awkward page sizes,
// head dims and dtypes, several layers and stages. Calls from several threads
// on one pool (each on a lane of its own) give the bytes the host gives. A
// scoring too big for one staging segment gives exactly what the same rows
// give in small batches.
// kivi_int4 batches (key blocks, values-only writes) as on the host too.
// Skipped without a CUDA device (the session-level cases of
// tests/step_batch_test.cc run on the GPU through KVKEEP_TEST_DEVICE).
#include "cache_store/step_batch.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <thread>
#include <tuple>
#include <vector>

#include "cache_store/page_memory.h"
#include "gpu/gpu_testing.h"
#include "gtest/gtest.h"
#include "kernels/compaction.h"
#include "kernels/dtype.h"
#include "kernels/kivi.h"
#include "kernels/quantize.h"

namespace kvkeep {
namespace {

constexpr int32_t kLayers = 4;
constexpr int32_t kKvHeads = 2;
constexpr int32_t kQueryHeads = 8;
constexpr int64_t kMaxSlots = 64;  // per layer, room for every new token

// One layer as the batch sees it: a block table and the slots in use.
struct TestLayer {
  std::vector<PageId> pages;
  std::vector<int64_t> arrival;  // per slot, for scorings that need order
  int64_t size = 0;
};

// Both memories over the same arena contents, and the layers on them.
class Memories {
 public:
  Memories(const PageLayout& layout, std::mt19937& rng) : layout_(layout) {
    const int64_t pages_per_layer =
        (kMaxSlots + layout.page_tokens - 1) / layout.page_tokens;
    capacity_ = pages_per_layer * kLayers;
    host_ = *NewHostMemory(capacity_ * layout.page_bytes(), false);
    cuda_ = *NewCudaMemory(0, capacity_ * layout.page_bytes());
    std::vector<PageId> ids(capacity_);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    for (int32_t l = 0; l < kLayers; ++l) {
      TestLayer layer;
      layer.pages.assign(ids.begin() + l * pages_per_layer,
                         ids.begin() + (l + 1) * pages_per_layer);
      layer.size = std::uniform_int_distribution<int64_t>(20, 48)(rng);
      layer.arrival.resize(layer.size);
      std::iota(layer.arrival.begin(), layer.arrival.end(), 0);
      layers_.push_back(std::move(layer));
    }
    // Every slot of every page starts with the same random tokens.
    const std::vector<std::byte> bytes =
        Tokens(capacity_ * layout.page_tokens, rng);
    const std::vector<PageId> all = AllPages();
    const int64_t n = capacity_ * layout.page_tokens;
    EXPECT_TRUE(
        host_->WriteSlots(layout, all, 0, n, bytes.data(), bytes.data()).ok());
    EXPECT_TRUE(
        cuda_->WriteSlots(layout, all, 0, n, bytes.data(), bytes.data()).ok());
  }

  // n tokens of random finite values in the layout's dtype.
  std::vector<std::byte> Tokens(int64_t n, std::mt19937& rng) const {
    const int64_t elements = n * layout_.kv_heads * layout_.head_dim;
    std::vector<std::byte> out(elements * DTypeBytes(layout_.dtype));
    std::uniform_real_distribution<float> value(-1.0f, 1.0f);
    for (int64_t i = 0; i < elements; ++i) {
      StoreFromFloat(layout_.dtype, out.data(), i, value(rng));
    }
    return out;
  }

  std::vector<PageId> AllPages() const {
    std::vector<PageId> all(capacity_);
    std::iota(all.begin(), all.end(), 0);
    return all;
  }

  // Every arena byte of both memories is the same.
  void ExpectSameArenas() const {
    const std::vector<PageId> all = AllPages();
    const int64_t n = capacity_ * layout_.page_tokens;
    const size_t bytes = static_cast<size_t>(n * layout_.token_bytes());
    std::vector<std::byte> hk(bytes), hv(bytes), ck(bytes), cv(bytes);
    ASSERT_TRUE(
        host_->ReadSlots(layout_, all, 0, n, hk.data(), hv.data()).ok());
    ASSERT_TRUE(
        cuda_->ReadSlots(layout_, all, 0, n, ck.data(), cv.data()).ok());
    const auto first_difference = [](const std::vector<std::byte>& a,
                                     const std::vector<std::byte>& b) {
      return std::mismatch(a.begin(), a.end(), b.begin()).first - a.begin();
    };
    EXPECT_EQ(first_difference(hk, ck), static_cast<ptrdiff_t>(bytes))
        << "keys differ at byte " << first_difference(hk, ck);
    EXPECT_EQ(first_difference(hv, cv), static_cast<ptrdiff_t>(bytes))
        << "values differ at byte " << first_difference(hv, cv);
  }

  PageMemory& host() { return *host_; }
  PageMemory& cuda() { return *cuda_; }
  std::vector<TestLayer>& layers() { return layers_; }

 private:
  const PageLayout layout_;
  int64_t capacity_ = 0;
  std::unique_ptr<PageMemory> host_;
  std::unique_ptr<PageMemory> cuda_;
  std::vector<TestLayer> layers_;
};

// Evicts `k` random slots of a layer: the moves, and the layer shrunk.
std::vector<SlotMove> EvictRandom(TestLayer& layer, int64_t k,
                                  std::mt19937& rng) {
  std::vector<int32_t> slots(layer.size);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  slots.resize(k);
  std::vector<uint8_t> scratch;
  std::vector<SlotMove> moves = PlanCompaction(slots, layer.size, scratch);
  MoveSlotValues(layer.arrival, moves, layer.size - k);
  layer.size -= k;
  return moves;
}

void ExpectRowsNear(const std::vector<float>& host,
                    const std::vector<float>& cuda) {
  ASSERT_EQ(host.size(), cuda.size());
  for (size_t i = 0; i < host.size(); ++i) {
    // As tests/gpu/attention_kernels_test.cc allows the kernel its twin.
    ASSERT_NEAR(cuda[i], host[i], 1e-4 * std::fabs(host[i]) + 1e-6)
        << "element " << i;
  }
}

class StepBatchGpuTest
    : public ::testing::TestWithParam<std::tuple<int32_t, int32_t, DType>> {};

// Three decode-like steps of every layer: stage 0 evicts, writes new tokens
// and scores (one row, no order; or three rows in causal order), stage 1
// evicts what the scores chose. Both memories must agree after each.
TEST_P(StepBatchGpuTest, CudaBatchEqualsHostBatch) {
  KVKEEP_REQUIRE_GPU();
  const auto [page_tokens, head_dim, dtype] = GetParam();
  const PageLayout layout{page_tokens, kKvHeads, head_dim, dtype};
  std::mt19937 rng(static_cast<uint32_t>(page_tokens * 1000 + head_dim));
  Memories memories(layout, rng);
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  for (int step = 0; step < 3; ++step) {
    std::vector<std::vector<std::byte>> tokens(kLayers);
    std::vector<std::vector<float>> queries(kLayers);
    // The stage-0 slot orders: borrowed by the batches until they run.
    std::vector<std::vector<int64_t>> orders(kLayers);
    std::vector<std::vector<float>> host_out(kLayers), cuda_out(kLayers);
    StepBatch host_batch(layout), cuda_batch(layout);
    const auto record = [&](auto&& add) {
      add(host_batch, host_out);
      add(cuda_batch, cuda_out);
    };
    for (int32_t l = 0; l < kLayers; ++l) {
      TestLayer& layer = memories.layers()[l];
      const std::vector<SlotMove> moves = EvictRandom(layer, 1 + l % 3, rng);
      const int64_t first = layer.size, n = 1 + (l + step) % 3;
      tokens[l] = memories.Tokens(n, rng);
      const int64_t newest = layer.arrival.empty() ? 0 : layer.arrival.back();
      for (int64_t t = 0; t < n; ++t) layer.arrival.push_back(newest + 1 + t);
      layer.size += n;
      const int32_t rows = l == 1 ? 3 : 1;
      queries[l].resize(rows * kQueryHeads * head_dim);
      for (float& q : queries[l]) q = value(rng);
      std::vector<int64_t> row_order(rows);
      for (int32_t r = 0; r < rows; ++r) {
        row_order[r] = layer.arrival.back() - (rows - 1 - r);
      }
      orders[l] = layer.arrival;
      record([&](StepBatch& b, std::vector<std::vector<float>>& out) {
        out[l].assign(rows * layer.size, -1.0f);
        b.AddMoves(layer.pages, moves);
        b.AddWrite(layer.pages, first, n, tokens[l].data(), tokens[l].data());
        b.AddScoring(layer.pages,
                     rows == 1 ? std::span<const int64_t>() : orders[l],
                     layer.size, queries[l].data(), row_order, kQueryHeads,
                     out[l].data());
      });
    }
    record([](StepBatch& b, auto&) { b.NextStage(); });
    for (int32_t l = 0; l < kLayers; ++l) {
      TestLayer& layer = memories.layers()[l];
      const std::vector<SlotMove> moves = EvictRandom(layer, 2, rng);
      record([&](StepBatch& b, auto&) { b.AddMoves(layer.pages, moves); });
    }
    const int64_t cuda_batches = memories.cuda().batches_run();
    ASSERT_TRUE(memories.host().RunStep(host_batch).ok());
    const absl::Status ran = memories.cuda().RunStep(cuda_batch);
    ASSERT_TRUE(ran.ok()) << ran;
    EXPECT_EQ(memories.cuda().batches_run(), cuda_batches + 1);
    memories.ExpectSameArenas();
    for (int32_t l = 0; l < kLayers; ++l) {
      ExpectRowsNear(host_out[l], cuda_out[l]);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, StepBatchGpuTest,
                         ::testing::Combine(::testing::Values(1, 3, 7, 16, 17),
                                            ::testing::Values(64, 128),
                                            ::testing::Values(DType::kBF16,
                                                              DType::kF32)));

// Copy-on-write page copies (a forked session's first write into a shared
// page): each runs before the stage's moves and writes, which then see the
// copy; a later stage copies what an earlier one wrote. Byte for byte as
// the host, over awkward page sizes.
TEST(StepBatchGpuCopyTest, PageCopiesRunFirstInTheirStageAsOnTheHost) {
  KVKEEP_REQUIRE_GPU();
  for (int32_t page_tokens : {1, 3, 16, 17}) {
    const PageLayout layout{page_tokens, kKvHeads, 64, DType::kBF16};
    constexpr int64_t kPages = 16;
    std::mt19937 rng(static_cast<uint32_t>(page_tokens));
    std::unique_ptr<PageMemory> host =
        *NewHostMemory(kPages * layout.page_bytes(), false);
    std::unique_ptr<PageMemory> cuda =
        *NewCudaMemory(0, kPages * layout.page_bytes());
    std::vector<PageId> all(kPages);
    std::iota(all.begin(), all.end(), 0);
    const int64_t slots = kPages * page_tokens;
    std::vector<std::byte> bytes(slots * layout.token_bytes());
    std::uniform_real_distribution<float> value(-1.0f, 1.0f);
    for (int64_t i = 0; i < slots * kKvHeads * layout.head_dim; ++i) {
      StoreFromFloat(layout.dtype, bytes.data(), i, value(rng));
    }
    for (PageMemory* m : {host.get(), cuda.get()}) {
      ASSERT_TRUE(
          m->WriteSlots(layout, all, 0, slots, bytes.data(), bytes.data())
              .ok());
    }
    const std::vector<std::byte> token(layout.token_bytes(), std::byte{7});
    // A layer whose pages were 2 and 5: copied to 9 and 10, compacted into
    // the copies, a token written into the second; then 9 copied again.
    const std::vector<PageId> copied = {9, 10};
    const std::vector<SlotMove> moves = {{2 * page_tokens - 1, 0}};
    const std::vector<PageId> again = {11, 10};
    StepBatch batch(layout);
    batch.AddPageCopy(2, 9);
    batch.AddPageCopy(5, 10);
    batch.AddMoves(copied, moves);
    batch.AddWrite(copied, page_tokens, 1, token.data(), token.data());
    batch.NextStage();
    batch.AddPageCopy(9, 11);
    batch.AddMoves(again, std::vector<SlotMove>{{page_tokens, 0}});
    ASSERT_TRUE(host->RunStep(batch).ok());
    const absl::Status ran = cuda->RunStep(batch);
    ASSERT_TRUE(ran.ok()) << ran;
    std::vector<std::byte> hk(bytes.size()), hv(bytes.size()), ck(bytes.size()),
        cv(bytes.size());
    ASSERT_TRUE(
        host->ReadSlots(layout, all, 0, slots, hk.data(), hv.data()).ok());
    ASSERT_TRUE(
        cuda->ReadSlots(layout, all, 0, slots, ck.data(), cv.data()).ok());
    EXPECT_TRUE(hk == ck) << "page_tokens " << page_tokens;
    EXPECT_TRUE(hv == cv) << "page_tokens " << page_tokens;
    // The copies' sources are untouched.
    EXPECT_EQ(0,
              std::memcmp(ck.data() + 2 * page_tokens * layout.token_bytes(),
                          bytes.data() + 2 * page_tokens * layout.token_bytes(),
                          page_tokens * layout.token_bytes()));
  }
}

// kivi_int4 (keys one block a page): a batch's moves and writes carry
// values only, its key blocks land after the stage's writes (and after the
// stage's page copies), and scoring reads the blocks; byte for byte and row
// for row as on the host. Whole-page reads and ReadKeyBlocks agree too.
TEST(StepBatchGpuKiviTest, KeyBlocksValuesAndScoringAsOnTheHost) {
  KVKEEP_REQUIRE_GPU();
  for (int32_t page_tokens : {1, 7, 16}) {
    SCOPED_TRACE(::testing::Message() << "page_tokens " << page_tokens);
    const PageLayout layout{page_tokens, kKvHeads, 64, DType::kKiviInt4, 32};
    constexpr int64_t kPages = 12;
    const int64_t p = page_tokens;
    const int64_t e_count = layout.token_elements();
    const int64_t block_bytes = layout.key_block_bytes();
    std::mt19937 rng(static_cast<uint32_t>(500 + page_tokens));
    std::uniform_real_distribution<float> value(-1.0f, 1.0f);
    const auto floats = [&](int64_t n) {
      std::vector<float> v(n * e_count);
      for (float& x : v) x = value(rng);
      return v;
    };
    const auto block_of = [&](std::byte* out) {
      const std::vector<float> keys = floats(p);
      ASSERT_TRUE(QuantizeKiviKeys(layout, keys.data(), page_tokens, out).ok());
    };
    const auto records = [&](int64_t n) {
      std::vector<std::byte> out(n * layout.token_bytes());
      const std::vector<float> v = floats(n);
      EXPECT_TRUE(
          QuantizeTokens(layout, DType::kF32, v.data(), n, out.data()).ok());
      return out;
    };
    std::unique_ptr<PageMemory> host =
        *NewHostMemory(kPages * layout.page_bytes(), false);
    std::unique_ptr<PageMemory> cuda =
        *NewCudaMemory(0, kPages * layout.page_bytes());
    std::vector<PageId> all(kPages);
    std::iota(all.begin(), all.end(), 0);
    const int64_t slots = kPages * p;
    std::vector<std::byte> blocks(kPages * block_bytes);
    for (int64_t b = 0; b < kPages; ++b)
      block_of(blocks.data() + b * block_bytes);
    const std::vector<std::byte> values = records(slots);
    for (PageMemory* m : {host.get(), cuda.get()}) {
      ASSERT_TRUE(
          m->WriteSlots(layout, all, 0, slots, blocks.data(), values.data())
              .ok());
    }
    // A layer of 8 shuffled pages, 3 slots short of full; pages 8-11 spare.
    std::vector<PageId> layer(all.begin(), all.begin() + 8);
    std::shuffle(layer.begin(), layer.end(), rng);
    int64_t size = 8 * p - 3;
    std::vector<int32_t> victims(size);
    std::iota(victims.begin(), victims.end(), 0);
    std::shuffle(victims.begin(), victims.end(), rng);
    victims.resize(std::min<int64_t>(size / 2, 5));
    std::vector<uint8_t> scratch;
    const std::vector<SlotMove> moves = PlanCompaction(victims, size, scratch);
    size -= static_cast<int64_t>(victims.size());
    const std::vector<std::byte> written = records(2);
    std::vector<std::byte> new_blocks(3 * block_bytes);
    for (int64_t b = 0; b < 3; ++b) {
      block_of(new_blocks.data() + b * block_bytes);
    }
    std::vector<float> queries(2 * kQueryHeads * layout.head_dim);
    for (float& q : queries) q = value(rng);
    std::vector<int64_t> order(size + 2);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    const std::vector<int64_t> row_order = {size, size + 1};
    std::vector<float> host_out(2 * (size + 2), -1.0f), cuda_out = host_out;
    const auto record = [&](StepBatch& batch, std::vector<float>& out) {
      batch.AddMoves(layer, moves);
      batch.AddWrite(layer, size, 2, nullptr, written.data());
      batch.AddKeyBlock(layer[0], new_blocks.data());
      batch.AddKeyBlock(layer[size / p], new_blocks.data() + block_bytes);
      batch.AddScoring(layer, order, size + 2, queries.data(), row_order,
                       kQueryHeads, out.data());
      batch.NextStage();
      // A copy-on-write copy, then a block over the copy: copies first.
      batch.AddPageCopy(layer[1], 9);
      batch.AddKeyBlock(9, new_blocks.data() + 2 * block_bytes);
    };
    StepBatch host_batch(layout), cuda_batch(layout);
    record(host_batch, host_out);
    record(cuda_batch, cuda_out);
    ASSERT_TRUE(host->RunStep(host_batch).ok());
    const absl::Status ran = cuda->RunStep(cuda_batch);
    ASSERT_TRUE(ran.ok()) << ran;
    std::vector<std::byte> hk(blocks.size()), hv(values.size()),
        ck(blocks.size()), cv(values.size());
    ASSERT_TRUE(
        host->ReadSlots(layout, all, 0, slots, hk.data(), hv.data()).ok());
    ASSERT_TRUE(
        cuda->ReadSlots(layout, all, 0, slots, ck.data(), cv.data()).ok());
    EXPECT_TRUE(hk == ck);
    EXPECT_TRUE(hv == cv);
    std::vector<std::byte> by_page(blocks.size());
    ASSERT_TRUE(cuda->ReadKeyBlocks(layout, all, by_page.data()).ok());
    EXPECT_TRUE(by_page == hk);
    EXPECT_EQ(0, std::memcmp(hk.data() + 9 * block_bytes,
                             new_blocks.data() + 2 * block_bytes, block_bytes));
    ExpectRowsNear(host_out, cuda_out);
  }
}

// Sessions sharing a pool run their batches at once, each on a lane of its
// own (layers here, like sessions, own disjoint pages): the bytes are those
// of the same batches run one after another on the host.
TEST(StepBatchGpuConcurrencyTest, CallsOnOnePoolOverlapAndMatchTheHost) {
  KVKEEP_REQUIRE_GPU();
  const PageLayout layout{16, kKvHeads, 128, DType::kBF16};
  std::mt19937 rng(11);
  Memories memories(layout, rng);
  constexpr int kSteps = 25;
  // Every layer's steps, recorded first; the batches borrow the tokens.
  std::vector<std::vector<std::vector<std::byte>>> tokens(kLayers);
  std::vector<std::vector<StepBatch>> steps(kLayers);
  for (int32_t l = 0; l < kLayers; ++l) {
    TestLayer& layer = memories.layers()[l];
    tokens[l].resize(kSteps);
    for (int step = 0; step < kSteps; ++step) {
      const std::vector<SlotMove> moves = EvictRandom(layer, 2, rng);
      tokens[l][step] = memories.Tokens(2, rng);
      StepBatch batch(layout);
      batch.AddMoves(layer.pages, moves);
      batch.AddWrite(layer.pages, layer.size, 2, tokens[l][step].data(),
                     tokens[l][step].data());
      layer.size += 2;
      steps[l].push_back(std::move(batch));
    }
  }
  std::vector<absl::Status> failed(kLayers);
  std::vector<std::thread> threads;
  for (int32_t l = 0; l < kLayers; ++l) {
    threads.emplace_back([&, l] {
      for (const StepBatch& batch : steps[l]) {
        if (absl::Status s = memories.cuda().RunStep(batch); !s.ok()) {
          failed[l] = s;
          return;
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int32_t l = 0; l < kLayers; ++l) {
    ASSERT_TRUE(failed[l].ok()) << "layer " << l << ": " << failed[l];
    for (const StepBatch& batch : steps[l]) {
      ASSERT_TRUE(memories.host().RunStep(batch).ok());
    }
  }
  memories.ExpectSameArenas();
}

// A scoring whose logits outgrow one staging segment (rows x query heads x
// slots x 4 bytes > 256 MiB) runs in several, each waited for; its rows are
// exactly the rows the same queries give one at a time.
TEST(StepBatchGpuSegmentsTest, ALongScoringIsCutIntoSegmentsExactly) {
  KVKEEP_REQUIRE_GPU();
  const PageLayout layout{16, 1, 64, DType::kBF16};
  constexpr int32_t kHeads = 64;
  constexpr int64_t kSlots = 1024;
  constexpr int32_t kRows = 1100;  // 1100 x 64 x 1024 x 4 B = 275 MiB
  std::mt19937 rng(7);
  const int64_t pages = kSlots / layout.page_tokens;
  absl::StatusOr<std::unique_ptr<PageMemory>> cuda =
      NewCudaMemory(0, pages * layout.page_bytes());
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  std::vector<PageId> table(pages);
  std::iota(table.begin(), table.end(), 0);
  std::vector<std::byte> keys(kSlots * layout.token_bytes());
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  for (int64_t i = 0; i < kSlots * layout.head_dim; ++i) {
    StoreFromFloat(layout.dtype, keys.data(), i, value(rng));
  }
  ASSERT_TRUE(
      (*cuda)
          ->WriteSlots(layout, table, 0, kSlots, keys.data(), keys.data())
          .ok());
  std::vector<float> queries(int64_t{kRows} * kHeads * layout.head_dim);
  for (float& q : queries) q = value(rng);
  std::vector<int64_t> order(kSlots), row_order(kRows);
  std::iota(order.begin(), order.end(), 0);
  for (int32_t r = 0; r < kRows; ++r) row_order[r] = r % kSlots;

  std::vector<float> whole(int64_t{kRows} * kSlots);
  StepBatch batch(layout);
  batch.AddScoring(table, order, kSlots, queries.data(), row_order, kHeads,
                   whole.data());
  ASSERT_TRUE((*cuda)->RunStep(batch).ok());

  std::vector<float> row(kSlots);
  for (int32_t r = 0; r < kRows; r += 97) {
    batch.Clear();
    batch.AddScoring(table, order, kSlots,
                     queries.data() + int64_t{r} * kHeads * layout.head_dim,
                     std::span<const int64_t>(&row_order[r], 1), kHeads,
                     row.data());
    ASSERT_TRUE((*cuda)->RunStep(batch).ok());
    ASSERT_EQ(0, std::memcmp(row.data(), whole.data() + int64_t{r} * kSlots,
                             sizeof(float) * kSlots))
        << "row " << r;
  }
}

}  // namespace
}  // namespace kvkeep
