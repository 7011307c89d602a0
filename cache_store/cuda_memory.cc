// The CUDA PageMemory: one cudaMalloc arena per pool on one device, a stream
// of its own, and pinned host staging through which every host buffer goes
// in and out in one copy each way. Built only with the CUDA backend.
//
// A session call's batch (step_batch.h) is staged whole in one pinned
// buffer and uploaded with one copy; then, stage by stage, the page copies
// (copy-on-write: one device-to-device cudaMemcpyAsync each), the compaction
// moves of every layer run as one LaunchCompactLayers, each write as a
// LaunchWriteSlots, the stage's kivi_int4 key blocks as one
// LaunchWriteKeyBlocks and each scoring as a LaunchQueryAttention; every
// scoring output comes back with one copy, and the host waits for the
// stream once.
// Only a batch whose scoring outputs and workspace outgrow kStagingBound
// (a long prefill chunk scored at once) is cut into segments, each staged,
// run and waited for in turn. When RunStep returns, the session's state on
// the host and the bytes on the device agree.
//
// Each call runs on a lane (a stream and its staging) that no other call
// holds, so calls of different sessions overlap on the device and in
// staging; a mutex guards only the lanes' list. Calls that touch the same
// pages are ordered by their callers (one session's calls are serialised,
// and a page is freed only after the batch that last touched it waited).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <span>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "cache_store/cuda_status.h"
#include "cache_store/page_memory.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/compaction.h"
#include "kernels/cuda/slot_copy.h"

namespace kvkeep {
namespace {

constexpr size_t kAlign = 256;
// Query scoring's logits per launch, at most (one row may need more).
constexpr int64_t kWorkspaceBytes = int64_t{256} << 20;

size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Where each array of one call sits in the staging buffers (the same offset
// in the pinned and the device buffer).
class StagingPlan {
 public:
  size_t Add(size_t bytes) {
    const size_t offset = total_;
    total_ = AlignUp(total_ + bytes);
    return offset;
  }
  size_t total() const { return total_; }

 private:
  size_t total_ = 0;
};

// Staging one segment of a batch may use, workspace included; a piece that
// needs more gets a segment of its own.
constexpr size_t kStagingBound = size_t{256} << 20;

// One launch of a batch: a stage's page copies (one device-to-device copy
// each, nothing staged), a stage's compaction moves (every layer in one
// LaunchCompactLayers), one write, a stage's key blocks (one
// LaunchWriteKeyBlocks), or a group of one scoring's rows.
struct Piece {
  enum class Kind : uint8_t { kCopies, kMoves, kWrite, kKeyBlocks, kScoring };
  Kind kind = Kind::kWrite;
  // kCopies, kMoves, kKeyBlocks: the stage's first entry of that kind, and
  // its number of entries; else the entry, and 1.
  size_t entry = 0;
  size_t entries = 1;
  int32_t first_row = 0;  // kScoring: rows [first_row, first_row + rows)
  int32_t rows = 0;
};

// Where a piece's arrays sit in its segment's staging.
struct PieceAt {
  size_t first = 0;   // kMoves: CompactLayer[entries]; else the block table
  size_t second = 0;  // kWrite: keys; kKeyBlocks: blocks; kScoring: queries
  size_t third = 0;   // kWrite: values; kScoring: row order
  size_t order = 0;   // kScoring: the slots' order, if any
  size_t out = 0;     // kScoring: the rows' output
};

// Where a moves entry's arrays sit: block table, moves, move count.
struct MovesAt {
  size_t pages = 0;
  size_t moves = 0;
  size_t count = 0;
};

// Rows of a scoring that one launch takes: its logits stay near
// kWorkspaceBytes.
int32_t ScoringGroup(const StepBatch::Scoring& e) {
  const int64_t row_bytes = int64_t{e.query_heads} * e.slots * sizeof(float);
  // At most 65535 rows a launch (the kernel's grid limit).
  return static_cast<int32_t>(
      std::clamp<int64_t>(kWorkspaceBytes / std::max<int64_t>(row_bytes, 1), 1,
                          std::min<int64_t>(e.rows, 65535)));
}

size_t QueryRowBytes(const StepBatch& b, const StepBatch::Scoring& e) {
  return sizeof(float) * static_cast<size_t>(e.query_heads) *
         static_cast<size_t>(b.layout().head_dim);
}

// The batch's launches in order: per stage, its page copies, its moves, its
// writes, its key blocks, its scorings.
std::vector<Piece> PlanPieces(const StepBatch& b) {
  std::vector<Piece> pieces;
  size_t c = 0, m = 0, w = 0, k = 0, s = 0;
  for (int32_t stage = 0; stage < b.stages(); ++stage) {
    const size_t first_copy = c;
    while (c < b.copies().size() && b.copies()[c].stage == stage) ++c;
    if (c > first_copy) {
      pieces.push_back(Piece{Piece::Kind::kCopies, first_copy, c - first_copy});
    }
    const size_t first_moves = m;
    while (m < b.moves().size() && b.moves()[m].stage == stage) ++m;
    if (m > first_moves) {
      pieces.push_back(
          Piece{Piece::Kind::kMoves, first_moves, m - first_moves});
    }
    for (; w < b.writes().size() && b.writes()[w].stage == stage; ++w) {
      pieces.push_back(Piece{Piece::Kind::kWrite, w});
    }
    const size_t first_block = k;
    while (k < b.key_blocks().size() && b.key_blocks()[k].stage == stage) ++k;
    if (k > first_block) {
      pieces.push_back(
          Piece{Piece::Kind::kKeyBlocks, first_block, k - first_block});
    }
    for (; s < b.scorings().size() && b.scorings()[s].stage == stage; ++s) {
      const StepBatch::Scoring& e = b.scorings()[s];
      const int32_t group = ScoringGroup(e);
      for (int32_t r = 0; r < e.rows; r += group) {
        pieces.push_back(
            Piece{Piece::Kind::kScoring, s, 1, r, std::min(group, e.rows - r)});
      }
    }
  }
  return pieces;
}

// Bytes of a write's keys: none for kivi_int4's values-only writes.
size_t WriteKeyBytes(const PageLayout& layout, const StepBatch::Write& e) {
  return e.keys == nullptr
             ? 0
             : static_cast<size_t>(layout.key_run_bytes(e.first, e.n));
}

size_t WorkspaceBytes(const StepBatch& b, const Piece& p) {
  if (p.kind != Piece::Kind::kScoring) return 0;
  const StepBatch::Scoring& e = b.scorings()[p.entry];
  return cuda::QueryAttentionWorkspaceBytes(p.rows, e.query_heads, e.slots);
}

// Places a piece's inputs in `plan` (moves entries' in `entries_at`).
void PlaceInputs(const StepBatch& b, const Piece& p, StagingPlan& plan,
                 PieceAt& at, std::vector<MovesAt>& entries_at) {
  switch (p.kind) {
    case Piece::Kind::kCopies:
      return;
    case Piece::Kind::kMoves:
      at.first = plan.Add(sizeof(cuda::CompactLayer) * p.entries);
      for (size_t i = p.entry; i < p.entry + p.entries; ++i) {
        const StepBatch::Moves& e = b.moves()[i];
        entries_at[i] = MovesAt{plan.Add(sizeof(PageId) * e.pages.size),
                                plan.Add(sizeof(SlotMove) * e.moves.size),
                                plan.Add(sizeof(int32_t))};
      }
      return;
    case Piece::Kind::kWrite: {
      const StepBatch::Write& e = b.writes()[p.entry];
      at.first = plan.Add(sizeof(PageId) * e.pages.size);
      at.second = plan.Add(WriteKeyBytes(b.layout(), e));
      at.third = plan.Add(static_cast<size_t>(e.n * b.layout().token_bytes()));
      return;
    }
    case Piece::Kind::kKeyBlocks:
      at.first = plan.Add(sizeof(PageId) * p.entries);
      at.second = plan.Add(static_cast<size_t>(b.layout().key_block_bytes()) *
                           p.entries);
      return;
    case Piece::Kind::kScoring: {
      const StepBatch::Scoring& e = b.scorings()[p.entry];
      at.first = plan.Add(sizeof(PageId) * e.pages.size);
      at.second = plan.Add(QueryRowBytes(b, e) * p.rows);
      at.third = plan.Add(sizeof(int64_t) * p.rows);
      if (e.order != nullptr) {
        at.order = plan.Add(sizeof(int64_t) * static_cast<size_t>(e.slots));
      }
      return;
    }
  }
}

// Places a piece's outputs in `plan`.
void PlaceOutputs(const StepBatch& b, const Piece& p, StagingPlan& plan,
                  PieceAt& at) {
  if (p.kind != Piece::Kind::kScoring) return;
  const StepBatch::Scoring& e = b.scorings()[p.entry];
  at.out = plan.Add(sizeof(float) * p.rows * static_cast<size_t>(e.slots));
}

// A stream of its own and the pinned and device staging that feed it: what
// one call of the CUDA memory runs on. Not thread-safe: the memory lends a
// lane to one call at a time.
class Lane {
 public:
  static absl::StatusOr<std::unique_ptr<Lane>> Create(int32_t ordinal,
                                                      std::byte* arena) {
    std::unique_ptr<Lane> lane(new Lane(ordinal, arena));
    if (absl::Status s = CudaStatus(
            cudaStreamCreateWithFlags(&lane->stream_, cudaStreamNonBlocking),
            absl::StrCat("creating a stream on cuda:", ordinal));
        !s.ok()) {
      return s;
    }
    return lane;
  }
  ~Lane() {
    // As ~CudaMemory: errors here have no one to go to.
    cudaSetDevice(ordinal_);
    if (stream_ != nullptr) {
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
    cudaFree(device_staging_);
    cudaFreeHost(pinned_staging_);
  }
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;

  // Runs `batch` (step_batch.h): one segment, one wait, unless its scoring
  // outgrows kStagingBound.
  absl::Status Run(const StepBatch& batch) {
    if (absl::Status s = CudaStatus(cudaSetDevice(ordinal_), "selecting");
        !s.ok()) {
      return s;
    }
    const std::vector<Piece> pieces = PlanPieces(batch);
    entries_at_.resize(batch.moves().size());
    size_t begin = 0;
    while (begin < pieces.size()) {
      // As many pieces as fit the bound: the whole batch, for a decode step.
      size_t end = begin;
      size_t io = 0, workspace = 0;
      for (; end < pieces.size(); ++end) {
        StagingPlan sizing;
        PieceAt at;
        PlaceInputs(batch, pieces[end], sizing, at, entries_at_);
        PlaceOutputs(batch, pieces[end], sizing, at);
        const size_t next_io = io + sizing.total();
        const size_t next_workspace =
            std::max(workspace, WorkspaceBytes(batch, pieces[end]));
        if (end > begin && next_io + next_workspace > kStagingBound) break;
        io = next_io;
        workspace = next_workspace;
      }
      if (absl::Status s = RunSegment(
              batch,
              std::span<const Piece>(pieces).subspan(begin, end - begin));
          !s.ok()) {
        return s;
      }
      begin = end;
    }
    return absl::OkStatus();
  }

  // Reads slots [first, first + n) of `pages` into host `keys` and `values`
  // (ReadSlotBytes), with one download, and waits for the stream.
  absl::Status Read(const PageLayout& layout, std::span<const PageId> pages,
                    int64_t first, int64_t n, std::byte* keys,
                    std::byte* values) {
    const size_t key_bytes =
        keys == nullptr ? 0
                        : static_cast<size_t>(layout.key_run_bytes(first, n));
    const size_t value_bytes = static_cast<size_t>(n * layout.token_bytes());
    StagingPlan plan;
    const size_t pages_at = plan.Add(pages.size_bytes());
    const size_t keys_at = plan.Add(key_bytes);
    const size_t values_at = plan.Add(value_bytes);
    // keys and values are adjacent in staging: one download brings both.
    return Gather(
        pages, plan.total(), keys_at,
        [&] {
          return cuda::LaunchReadSlots(
              arena_, layout, DevicePtr<PageId>(pages_at), first, n,
              keys == nullptr ? nullptr : device_staging_ + keys_at,
              device_staging_ + values_at, stream_);
        },
        "reading slots",
        [&] {
          if (keys != nullptr) {
            std::memcpy(keys, pinned_staging_ + keys_at, key_bytes);
          }
          std::memcpy(values, pinned_staging_ + values_at, value_bytes);
        });
  }

  // Reads the key blocks of `pages` into host `blocks` (ReadKeyBlockBytes),
  // with one download, and waits for the stream.
  absl::Status ReadKeyBlocks(const PageLayout& layout,
                             std::span<const PageId> pages, std::byte* blocks) {
    const size_t bytes =
        static_cast<size_t>(layout.key_block_bytes()) * pages.size();
    StagingPlan plan;
    const size_t pages_at = plan.Add(pages.size_bytes());
    const size_t blocks_at = plan.Add(bytes);
    return Gather(
        pages, plan.total(), blocks_at,
        [&] {
          return cuda::LaunchReadKeyBlocks(
              arena_, layout, DevicePtr<PageId>(pages_at),
              static_cast<int64_t>(pages.size()), device_staging_ + blocks_at,
              stream_);
        },
        "reading key blocks",
        [&] { std::memcpy(blocks, pinned_staging_ + blocks_at, bytes); });
  }

 private:
  Lane(int32_t ordinal, std::byte* arena) : ordinal_(ordinal), arena_(arena) {}

  // A read of pages: uploads the block table `pages` (staged first), runs
  // launch(), downloads staging [output_at, total), waits, then copy_out().
  template <typename LaunchFn, typename CopyOut>
  absl::Status Gather(std::span<const PageId> pages, size_t total,
                      size_t output_at, LaunchFn launch, absl::string_view what,
                      CopyOut copy_out) {
    if (absl::Status s = CudaStatus(cudaSetDevice(ordinal_), "selecting");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = Reserve(total); !s.ok()) return s;
    std::memcpy(pinned_staging_, pages.data(), pages.size_bytes());
    if (absl::Status s = Upload(0, output_at); !s.ok()) return s;
    if (absl::Status s = Finish(launch(), what, output_at, total - output_at);
        !s.ok()) {
      return s;
    }
    copy_out();
    return absl::OkStatus();
  }

  // Stages `pieces` of `b` with one upload, launches them in order, brings
  // every output back with one download and waits for the stream once.
  absl::Status RunSegment(const StepBatch& b, std::span<const Piece> pieces) {
    StagingPlan plan;
    piece_at_.assign(pieces.size(), PieceAt{});
    for (size_t i = 0; i < pieces.size(); ++i) {
      PlaceInputs(b, pieces[i], plan, piece_at_[i], entries_at_);
    }
    const size_t inputs_end = plan.total();
    size_t workspace = 0;
    for (size_t i = 0; i < pieces.size(); ++i) {
      PlaceOutputs(b, pieces[i], plan, piece_at_[i]);
      workspace = std::max(workspace, WorkspaceBytes(b, pieces[i]));
    }
    const size_t outputs_end = plan.total();
    const size_t workspace_at = plan.Add(workspace);
    if (absl::Status s = Reserve(plan.total()); !s.ok()) return s;
    for (size_t i = 0; i < pieces.size(); ++i) {
      FillInputs(b, pieces[i], piece_at_[i]);
    }
    if (absl::Status s = Upload(0, inputs_end); !s.ok()) return s;
    for (size_t i = 0; i < pieces.size(); ++i) {
      const cudaError_t launched =
          Launch(b, pieces[i], piece_at_[i], device_staging_ + workspace_at);
      if (launched != cudaSuccess) {
        // What was enqueued still reads staging: let it finish first.
        cudaStreamSynchronize(stream_);
        return CudaStatus(
            launched,
            absl::StrCat("launching a step batch on cuda:", ordinal_));
      }
    }
    if (absl::Status s = Finish(cudaSuccess, "running a step batch", inputs_end,
                                outputs_end - inputs_end);
        !s.ok()) {
      return s;
    }
    for (size_t i = 0; i < pieces.size(); ++i) {
      const Piece& p = pieces[i];
      if (p.kind != Piece::Kind::kScoring) continue;
      const StepBatch::Scoring& e = b.scorings()[p.entry];
      std::memcpy(e.out + static_cast<size_t>(p.first_row) * e.slots,
                  pinned_staging_ + piece_at_[i].out,
                  sizeof(float) * p.rows * static_cast<size_t>(e.slots));
    }
    return absl::OkStatus();
  }

  // Copies a piece's inputs into pinned staging (for moves, with the
  // CompactLayer records that point into device staging).
  void FillInputs(const StepBatch& b, const Piece& p, const PieceAt& at) {
    switch (p.kind) {
      case Piece::Kind::kCopies:
        return;
      case Piece::Kind::kMoves:
        for (size_t k = 0; k < p.entries; ++k) {
          const StepBatch::Moves& e = b.moves()[p.entry + k];
          const MovesAt& where = entries_at_[p.entry + k];
          const std::span<const PageId> pages = b.pages(e.pages);
          const std::span<const SlotMove> moves = b.slot_moves(e.moves);
          std::memcpy(pinned_staging_ + where.pages, pages.data(),
                      pages.size_bytes());
          std::memcpy(pinned_staging_ + where.moves, moves.data(),
                      moves.size_bytes());
          const int32_t count = static_cast<int32_t>(moves.size());
          std::memcpy(pinned_staging_ + where.count, &count, sizeof count);
          const cuda::CompactLayer layer{DevicePtr<PageId>(where.pages),
                                         DevicePtr<SlotMove>(where.moves),
                                         DevicePtr<int32_t>(where.count),
                                         nullptr,
                                         nullptr,
                                         nullptr,
                                         nullptr};
          std::memcpy(pinned_staging_ + at.first + k * sizeof layer, &layer,
                      sizeof layer);
        }
        return;
      case Piece::Kind::kWrite: {
        const StepBatch::Write& e = b.writes()[p.entry];
        const std::span<const PageId> pages = b.pages(e.pages);
        std::memcpy(pinned_staging_ + at.first, pages.data(),
                    pages.size_bytes());
        if (e.keys != nullptr) {
          std::memcpy(pinned_staging_ + at.second, e.keys,
                      WriteKeyBytes(b.layout(), e));
        }
        std::memcpy(pinned_staging_ + at.third, e.values,
                    static_cast<size_t>(e.n * b.layout().token_bytes()));
        return;
      }
      case Piece::Kind::kKeyBlocks: {
        const size_t bytes = static_cast<size_t>(b.layout().key_block_bytes());
        auto* pages = reinterpret_cast<PageId*>(pinned_staging_ + at.first);
        for (size_t k = 0; k < p.entries; ++k) {
          const StepBatch::KeyBlock& e = b.key_blocks()[p.entry + k];
          pages[k] = e.page;
          std::memcpy(pinned_staging_ + at.second + k * bytes, e.block, bytes);
        }
        return;
      }
      case Piece::Kind::kScoring: {
        const StepBatch::Scoring& e = b.scorings()[p.entry];
        const std::span<const PageId> pages = b.pages(e.pages);
        const size_t row_bytes = QueryRowBytes(b, e);
        std::memcpy(pinned_staging_ + at.first, pages.data(),
                    pages.size_bytes());
        std::memcpy(pinned_staging_ + at.second,
                    reinterpret_cast<const std::byte*>(e.queries) +
                        row_bytes * p.first_row,
                    row_bytes * p.rows);
        std::memcpy(pinned_staging_ + at.third,
                    b.row_order(e.row_order).data() + p.first_row,
                    sizeof(int64_t) * p.rows);
        if (e.order != nullptr) {
          std::memcpy(pinned_staging_ + at.order, e.order,
                      sizeof(int64_t) * static_cast<size_t>(e.slots));
        }
        return;
      }
    }
  }

  // Enqueues a staged piece; `workspace` is the segment's scoring workspace.
  cudaError_t Launch(const StepBatch& b, const Piece& p, const PieceAt& at,
                     std::byte* workspace) {
    switch (p.kind) {
      case Piece::Kind::kCopies: {
        const size_t page_bytes = static_cast<size_t>(b.layout().page_bytes());
        for (size_t k = p.entry; k < p.entry + p.entries; ++k) {
          const StepBatch::PageCopy& e = b.copies()[k];
          const cudaError_t copied =
              cudaMemcpyAsync(arena_ + static_cast<size_t>(e.to) * page_bytes,
                              arena_ + static_cast<size_t>(e.from) * page_bytes,
                              page_bytes, cudaMemcpyDeviceToDevice, stream_);
          if (copied != cudaSuccess) return copied;
        }
        return cudaSuccess;
      }
      case Piece::Kind::kMoves: {
        size_t max_moves = 0;
        for (size_t k = 0; k < p.entries; ++k) {
          max_moves = std::max(max_moves, b.moves()[p.entry + k].moves.size);
        }
        return cuda::LaunchCompactLayers(
            arena_, b.layout(), DevicePtr<cuda::CompactLayer>(at.first),
            static_cast<int32_t>(p.entries), static_cast<int32_t>(max_moves),
            stream_);
      }
      case Piece::Kind::kWrite: {
        const StepBatch::Write& e = b.writes()[p.entry];
        return cuda::LaunchWriteSlots(
            arena_, b.layout(), DevicePtr<PageId>(at.first), e.first, e.n,
            e.keys == nullptr ? nullptr : device_staging_ + at.second,
            device_staging_ + at.third, stream_);
      }
      case Piece::Kind::kKeyBlocks:
        return cuda::LaunchWriteKeyBlocks(arena_, b.layout(),
                                          DevicePtr<PageId>(at.first),
                                          static_cast<int64_t>(p.entries),
                                          device_staging_ + at.second, stream_);
      case Piece::Kind::kScoring: {
        const StepBatch::Scoring& e = b.scorings()[p.entry];
        const cuda::DevicePagedKeys keys{
            arena_, b.layout(), DevicePtr<PageId>(at.first),
            e.order == nullptr ? nullptr : DevicePtr<int64_t>(at.order),
            e.slots};
        return cuda::LaunchQueryAttention(
            keys, DevicePtr<float>(at.second), DevicePtr<int64_t>(at.third),
            p.rows, e.query_heads, DevicePtr<float>(at.out), workspace,
            stream_);
      }
    }
    return cudaErrorInvalidValue;
  }

  template <typename T>
  T* DevicePtr(size_t offset) {
    return reinterpret_cast<T*>(device_staging_ + offset);
  }

  // Grows both staging buffers to at least `bytes` (doubling, so a
  // session's steady state allocates nothing).
  absl::Status Reserve(size_t bytes) {
    if (absl::Status s = CudaStatus(cudaSetDevice(ordinal_), "selecting");
        !s.ok()) {
      return s;
    }
    if (bytes <= staging_bytes_) return absl::OkStatus();
    const size_t want = std::max(bytes, 2 * staging_bytes_);
    const cudaError_t freed_device = cudaFree(device_staging_);
    const cudaError_t freed_pinned = cudaFreeHost(pinned_staging_);
    device_staging_ = nullptr;
    pinned_staging_ = nullptr;
    staging_bytes_ = 0;
    if (absl::Status s = CudaStatus(freed_device, "freeing staging"); !s.ok()) {
      return s;
    }
    if (absl::Status s = CudaStatus(freed_pinned, "freeing pinned staging");
        !s.ok()) {
      return s;
    }
    void* device = nullptr;
    void* pinned = nullptr;
    if (absl::Status s =
            CudaStatus(cudaMalloc(&device, want),
                       absl::StrCat("reserving ", want, " bytes of staging"));
        !s.ok()) {
      return s;
    }
    device_staging_ = static_cast<std::byte*>(device);
    if (absl::Status s = CudaStatus(
            cudaMallocHost(&pinned, want),
            absl::StrCat("reserving ", want, " bytes of pinned staging"));
        !s.ok()) {
      return s;
    }
    pinned_staging_ = static_cast<std::byte*>(pinned);
    staging_bytes_ = want;
    return absl::OkStatus();
  }

  // Copies staging [from, from + bytes) to the device.
  absl::Status Upload(size_t from, size_t bytes) {
    if (bytes == 0) return absl::OkStatus();
    return CudaStatus(
        cudaMemcpyAsync(device_staging_ + from, pinned_staging_ + from, bytes,
                        cudaMemcpyHostToDevice, stream_),
        "uploading to staging");
  }

  // Checks the launch, downloads staging [from, from + bytes) and waits for
  // the stream.
  absl::Status Finish(cudaError_t launch, absl::string_view what, size_t from,
                      size_t bytes) {
    const std::string where = absl::StrCat(what, " on cuda:", ordinal_);
    if (absl::Status s = CudaStatus(launch, where); !s.ok()) return s;
    if (bytes > 0) {
      if (absl::Status s = CudaStatus(
              cudaMemcpyAsync(pinned_staging_ + from, device_staging_ + from,
                              bytes, cudaMemcpyDeviceToHost, stream_),
              where);
          !s.ok()) {
        return s;
      }
    }
    return CudaStatus(cudaStreamSynchronize(stream_), where);
  }

  const int32_t ordinal_;
  std::byte* const arena_;
  cudaStream_t stream_ = nullptr;
  std::byte* device_staging_ = nullptr;
  std::byte* pinned_staging_ = nullptr;
  size_t staging_bytes_ = 0;
  // Reused per batch: where each piece and each moves entry is staged.
  std::vector<PieceAt> piece_at_;
  std::vector<MovesAt> entries_at_;
};

// Lanes a pool keeps at most: calls beyond that many at once wait for one.
// Each holds staging as large as the largest call it ran.
constexpr size_t kMaxLanes = 4;

class CudaMemory final : public PageMemory {
 public:
  static absl::StatusOr<std::unique_ptr<PageMemory>> Create(int32_t ordinal,
                                                            int64_t bytes) {
    const std::string where = absl::StrCat("cuda:", ordinal);
    if (absl::Status s = CudaStatus(cudaSetDevice(ordinal),
                                    absl::StrCat("selecting ", where));
        !s.ok()) {
      return s;
    }
    std::unique_ptr<CudaMemory> memory(new CudaMemory(ordinal, bytes));
    void* arena = nullptr;
    if (absl::Status s = CudaStatus(
            cudaMalloc(&arena, static_cast<size_t>(bytes)),
            absl::StrCat("reserving a pool of ", bytes, " bytes on ", where));
        !s.ok()) {
      return s;
    }
    memory->arena_ = static_cast<std::byte*>(arena);
    return std::unique_ptr<PageMemory>(std::move(memory));
  }

  ~CudaMemory() override {
    // Errors here have no one to go to (a destructor cannot fail, and the
    // process is letting the device go); the calls before it reported any
    // error the device had. The lanes wait for their streams first.
    {
      absl::MutexLock lock(&mu_);
      free_lanes_.clear();
      lanes_.clear();
    }
    cudaSetDevice(ordinal_);
    cudaFree(arena_);
  }

  Device device() const override {
    return Device{Device::Kind::kCuda, ordinal_};
  }
  absl::Status CheckLayout(const PageLayout& layout) const override {
    if (!cuda::QueryAttentionSupportsHeadDim(layout.head_dim)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "head_dim ", layout.head_dim,
          " has no CUDA query-scoring kernel (built for 64, 80, 96, 128 and "
          "256)"));
    }
    return absl::OkStatus();
  }
  int64_t bytes() const override { return bytes_; }
  std::byte* device_arena() override { return arena_; }

  absl::Status WriteSlots(const PageLayout& layout,
                          std::span<const PageId> pages, int64_t first,
                          int64_t n, const std::byte* keys,
                          const std::byte* values) override {
    StepBatch batch(layout);
    batch.AddWrite(pages, first, n, keys, values);
    return batch.empty() ? absl::OkStatus() : DoRunStep(batch);
  }

  absl::Status ReadSlots(const PageLayout& layout,
                         std::span<const PageId> pages, int64_t first,
                         int64_t n, std::byte* keys,
                         std::byte* values) override {
    if (n <= 0) return absl::OkStatus();
    return WithLane([&](Lane& lane) {
      return lane.Read(layout, pages, first, n, keys, values);
    });
  }

  absl::Status ReadKeyBlocks(const PageLayout& layout,
                             std::span<const PageId> pages,
                             std::byte* blocks) override {
    if (pages.empty()) return absl::OkStatus();
    return WithLane(
        [&](Lane& lane) { return lane.ReadKeyBlocks(layout, pages, blocks); });
  }

  absl::StatusOr<SharedPool> Share() const override {
    cudaIpcMemHandle_t handle;
    if (absl::Status s =
            CudaStatus(cudaSetDevice(ordinal_), "selecting the pool's device");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = CudaStatus(cudaIpcGetMemHandle(&handle, arena_),
                                    "taking the pool's IPC handle");
        !s.ok()) {
      return s;
    }
    return SharedPool{
        "", std::string(reinterpret_cast<const char*>(&handle), sizeof handle)};
  }

 protected:
  absl::Status DoRunStep(const StepBatch& batch) override {
    return WithLane([&](Lane& lane) { return lane.Run(batch); });
  }

 private:
  CudaMemory(int32_t ordinal, int64_t bytes)
      : ordinal_(ordinal), bytes_(bytes) {}

  // Runs use(lane) on a lane no other call holds: a free one, a new one
  // while there are fewer than kMaxLanes, else the first to come free.
  template <typename Use>
  absl::Status WithLane(Use use) ABSL_LOCKS_EXCLUDED(mu_) {
    Lane* lane = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (free_lanes_.empty() && lanes_.size() < kMaxLanes) {
        absl::StatusOr<std::unique_ptr<Lane>> made =
            Lane::Create(ordinal_, arena_);
        if (!made.ok()) return made.status();
        lanes_.push_back(*std::move(made));
        free_lanes_.push_back(lanes_.back().get());
      }
      mu_.Await(absl::Condition(this, &CudaMemory::HasFreeLane));
      lane = free_lanes_.back();
      free_lanes_.pop_back();
    }
    absl::Status status = use(*lane);
    absl::MutexLock lock(&mu_);
    free_lanes_.push_back(lane);
    return status;
  }
  bool HasFreeLane() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !free_lanes_.empty();
  }

  const int32_t ordinal_;
  const int64_t bytes_;
  std::byte* arena_ = nullptr;

  absl::Mutex mu_;
  std::vector<std::unique_ptr<Lane>> lanes_ ABSL_GUARDED_BY(mu_);
  std::vector<Lane*> free_lanes_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

int CudaDeviceCount() {
  int count = 0;
  // Any error (no driver, no device) means: nothing usable.
  if (cudaGetDeviceCount(&count) != cudaSuccess) return 0;
  return count;
}

absl::StatusOr<std::unique_ptr<PageMemory>> NewCudaMemory(int32_t ordinal,
                                                          int64_t bytes) {
  if (bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("page memory of ", bytes, " bytes"));
  }
  if (ordinal < 0 || ordinal >= CudaDeviceCount()) {
    return absl::FailedPreconditionError(
        absl::StrCat("device cuda:", ordinal, ": this machine has ",
                     CudaDeviceCount(), " usable CUDA device(s)"));
  }
  return CudaMemory::Create(ordinal, bytes);
}

}  // namespace kvkeep
