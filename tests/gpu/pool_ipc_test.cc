// CUDA IPC: a second process maps a store's GPU pool with the handle the
// store shares and reads, at the offsets the block tables give, exactly the
// bytes the store was sent (after evictions compacted the slots). Also the
// CUDA page memory itself against the host one: the same session driven on
// both holds the same bytes. Skipped without a CUDA device.
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache_store/cache_store.h"
#include "gtest/gtest.h"
#include "tests/gpu/gpu_testing.h"
#include "tests/token_data.h"

extern char** environ;

namespace kvkeep {
namespace {

ModelLayout IpcLayout(DType dtype, int32_t page_tokens) {
  ModelLayout l;
  l.name = "ipc";
  l.num_layers = 3;
  l.kv_heads = 2;
  l.query_heads = 8;
  l.head_dim = 80;
  l.dtype = dtype;
  l.page_tokens = page_tokens;
  return l;
}

// Drives a store's session through `steps` decode steps of one token with
// h2o over a small budget, so slots are evicted and compacted.
SessionId Drive(CacheStore& store, const ModelLayout& layout, int steps) {
  SessionSpec spec{layout.name, PolicySpec{"h2o", {{"recent", "3"}}},
                   BudgetSpec{.tokens = 11}};
  const SessionId id = *store.CreateSession(spec);
  for (int64_t pos = 0; pos < steps; ++pos) {
    const std::vector<int64_t> positions = {pos};
    std::vector<std::vector<std::byte>> keys, values;
    std::vector<LayerKv> kv;
    for (int32_t l = 0; l < layout.num_layers; ++l) {
      keys.push_back(test_data::TokenBytes(layout, l, positions, false));
      values.push_back(test_data::TokenBytes(layout, l, positions, true));
    }
    for (int32_t l = 0; l < layout.num_layers; ++l) {
      kv.push_back(LayerKv{keys[l], values[l]});
    }
    const SessionStats stats = *store.GetStats(id);
    std::vector<std::vector<float>> rows;
    std::vector<LayerScores> scores;
    for (int32_t l = 0; l < layout.num_layers; ++l) {
      const int64_t slots = stats.layer_resident[l] + 1;
      std::vector<float> row(slots);
      for (int64_t s = 0; s < slots; ++s) {
        row[s] = static_cast<float>((s * 7 + pos * 3 + l) % 11) /
                 static_cast<float>(11 * slots);
      }
      rows.push_back(std::move(row));
    }
    for (int32_t l = 0; l < layout.num_layers; ++l) {
      scores.push_back(LayerScores{l, stats.layer_version[l],
                                   ScoreSource::kReduced, 1, rows[l]});
    }
    absl::StatusOr<StepOutcome> step =
        store.Step(id, AppendRequest{positions, kv}, scores);
    EXPECT_TRUE(step.ok()) << step.status();
  }
  return id;
}

std::unique_ptr<CacheStore> Store(const ModelLayout& layout, Device device) {
  StoreOptions options;
  options.pools = {PoolSpec{layout, 64}};
  options.device = device;
  options.share_pools = true;
  absl::StatusOr<std::unique_ptr<CacheStore>> store =
      CacheStore::Create(options);
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? *std::move(store) : nullptr;
}

class PoolIpcTest : public ::testing::TestWithParam<DType> {};

TEST_P(PoolIpcTest, ASecondProcessReadsTheStoredBytesThroughTheHandle) {
  KVKEEP_REQUIRE_GPU();
  const ModelLayout layout = IpcLayout(GetParam(), 7);
  std::unique_ptr<CacheStore> store =
      Store(layout, Device{Device::Kind::kCuda, 0});
  ASSERT_NE(store, nullptr);
  const SessionId id = Drive(*store, layout, 40);
  absl::StatusOr<PoolMapping> mapping = store->SharePool(layout.name);
  ASSERT_TRUE(mapping.ok()) << mapping.status();
  ASSERT_EQ(mapping->handle.cuda_ipc_handle.size(), sizeof(cudaIpcMemHandle_t));
  std::string hex;
  for (unsigned char c : mapping->handle.cuda_ipc_handle) {
    absl::StrAppend(&hex, absl::Hex(c, absl::kZeroPad2));
  }

  // Ask for every resident slot's K and V, in layer then slot order.
  const PageLayout pl = layout.page_layout();
  std::vector<std::string> argv = {KVKEEP_IPC_READER, "0", hex,
                                   ::testing::TempDir() + "ipc_read.bin"};
  std::string expected;
  for (int32_t l = 0; l < layout.num_layers; ++l) {
    const BlockTable table = *store->GetBlockTable(id, l);
    ASSERT_EQ(table.positions.size(), 11u);
    for (size_t s = 0; s < table.positions.size(); ++s) {
      const PageId page = table.pages[s / layout.page_tokens];
      const int32_t in_page = static_cast<int32_t>(s % layout.page_tokens);
      argv.push_back(
          absl::StrCat(pl.key_offset(page, in_page), ":", pl.token_bytes()));
      argv.push_back(
          absl::StrCat(pl.value_offset(page, in_page), ":", pl.token_bytes()));
      const std::vector<int64_t> position = {table.positions[s]};
      for (bool values : {false, true}) {
        const std::vector<std::byte> bytes =
            test_data::TokenBytes(layout, l, position, values);
        expected.append(reinterpret_cast<const char*>(bytes.data()),
                        bytes.size());
      }
    }
  }
  std::vector<char*> args;
  for (std::string& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  pid_t pid;
  ASSERT_EQ(posix_spawn(&pid, args[0], nullptr, nullptr, args.data(), environ),
            0);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "gpu_ipc_reader exited with status " << status;
  std::ifstream in(argv[3], std::ios::binary);
  const std::string read((std::istreambuf_iterator<char>(in)),
                         std::istreambuf_iterator<char>());
  EXPECT_EQ(read.size(), expected.size());
  EXPECT_TRUE(read == expected) << "the mapped pool holds other bytes";
}

// The CUDA memory against the host memory: the same inputs leave the same
// session (block tables, bytes) on both, for awkward page sizes.
TEST_P(PoolIpcTest, TheCudaPoolHoldsWhatTheHostPoolHolds) {
  KVKEEP_REQUIRE_GPU();
  for (int32_t page_tokens : {1, 3, 16, 17}) {
    const ModelLayout layout = IpcLayout(GetParam(), page_tokens);
    std::unique_ptr<CacheStore> host = Store(layout, Device{});
    std::unique_ptr<CacheStore> gpu =
        Store(layout, Device{Device::Kind::kCuda, 0});
    ASSERT_NE(host, nullptr);
    ASSERT_NE(gpu, nullptr);
    const SessionId a = Drive(*host, layout, 30);
    const SessionId b = Drive(*gpu, layout, 30);
    for (int32_t l = 0; l < layout.num_layers; ++l) {
      const LayerKvCopy x = *host->ReadLayer(a, l);
      const LayerKvCopy y = *gpu->ReadLayer(b, l);
      EXPECT_EQ(x.positions, y.positions) << "page_tokens " << page_tokens;
      EXPECT_TRUE(x.keys == y.keys) << "page_tokens " << page_tokens;
      EXPECT_TRUE(x.values == y.values) << "page_tokens " << page_tokens;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(DTypes, PoolIpcTest,
                         ::testing::Values(DType::kF32, DType::kF16,
                                           DType::kBF16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(DTypeName(info.param));
                         });

}  // namespace
}  // namespace kvkeep
