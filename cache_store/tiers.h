// Tiers: where a session goes when it leaves its layout's pool, whole, and
// comes back from on its next call (docs/tiers.md). Below the pool (host
// memory on a CPU store, a GPU's memory on a CUDA store) a layout may have a
// host tier (the session's bytes in host memory, up to a byte budget) and a
// disk tier (one file per session in a directory, written to a temporary
// name, fsync'd, renamed; checksummed, tier_file.h). The store decides when
// a session moves (CacheStore::DemoteIdle, a full pool); this file holds the
// mechanism: the options, one session's copy in a tier, and the counts.
//
// A TierCopy owns its bytes: destroying it frees the memory or deletes the
// file, and keeps the layout's TierCounters true. TierCounters is
// thread-safe (atomics); a TierCopy is used under its session's lock.
#ifndef KVKEEP_CACHE_STORE_TIERS_H_
#define KVKEEP_CACHE_STORE_TIERS_H_

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "cache_store/session_types.h"

namespace kvkeep {

// The tiers of one layout, fastest first. The values index TierStats.
enum class Tier : uint8_t { kPool = 0, kHost = 1, kDisk = 2 };
inline constexpr int kTierCount = 3;
absl::string_view TierName(Tier tier);  // "pool" | "host" | "disk"

struct TierOptions {
  // The host tier's budget for sessions' bytes (their encoded size); 0: no
  // host tier.
  int64_t host_bytes = 0;
  // The disk tier's directory (made if missing; leftover tier files in it
  // are removed when the store starts: sessions do not outlive a restart);
  // empty: no disk tier.
  std::string disk_dir;
  // A session no call has named for this long moves down a tier
  // (CacheStore::DemoteIdle); ZeroDuration: only a full pool moves one.
  absl::Duration idle_after = absl::ZeroDuration();
  // Whether a call that finds the pool full moves the least recently used
  // other session of the layout down and tries again, instead of answering
  // RESOURCE_EXHAUSTED.
  bool demote_when_full = true;

  bool enabled() const { return host_bytes > 0 || !disk_dir.empty(); }
};

// INVALID_ARGUMENT naming the layout unless the options are usable (no
// negative budget or idle time; idle_after or demote_when_full needs a
// tier); for a disk tier, makes the directory and clears old tier files
// (FAILED_PRECONDITION, with the system's reason, if it cannot).
absl::Status PrepareTiers(const TierOptions& options, absl::string_view layout);

// Sessions and bytes in each tier below the pool, and what moved. Pool
// counts are the store's (CacheStore::Layouts fills them in).
struct TierStats {
  std::array<int64_t, kTierCount> sessions{};
  std::array<int64_t, kTierCount> bytes{};
  int64_t moves_down = 0;    // sessions moved out of the pool
  int64_t restores = 0;      // sessions moved back by a call
  int64_t failed_moves = 0;  // moves down refused (no room, disk errors)
  int64_t corrupt = 0;       // copies found damaged on restore
};

// One layout's live counts. Thread-safe.
class TierCounters {
 public:
  TierStats Snapshot() const;
  void CountMove() { moves_down_.fetch_add(1, std::memory_order_relaxed); }
  void CountRestore() { restores_.fetch_add(1, std::memory_order_relaxed); }
  void CountFailedMove() { failed_.fetch_add(1, std::memory_order_relaxed); }
  void CountCorrupt() { corrupt_.fetch_add(1, std::memory_order_relaxed); }

 private:
  friend class TierCopy;
  std::array<std::atomic<int64_t>, kTierCount> sessions_{};
  std::array<std::atomic<int64_t>, kTierCount> bytes_{};
  std::atomic<int64_t> moves_down_{0};
  std::atomic<int64_t> restores_{0};
  std::atomic<int64_t> failed_{0};
  std::atomic<int64_t> corrupt_{0};
};

// One session's encoded state (tier_file.h) in the host or disk tier.
class TierCopy {
 public:
  // Keeps `bytes` in host memory if the host tier's budget
  // (`budget_bytes`) has room for them: RESOURCE_EXHAUSTED otherwise.
  static absl::StatusOr<std::unique_ptr<TierCopy>> InHost(
      std::vector<std::byte> bytes, int64_t budget_bytes,
      TierCounters* counters);
  // Writes `bytes` to `dir`/<session>.kvt through a temporary file, fsync'd
  // and renamed (and the directory fsync'd), so the file is whole or
  // absent. RESOURCE_EXHAUSTED when the disk is full; FAILED_PRECONDITION
  // when the directory cannot be written; the message names the file and
  // the system's reason. A failed write leaves no file behind.
  static absl::StatusOr<std::unique_ptr<TierCopy>> OnDisk(
      const std::string& dir, SessionId id, std::span<const std::byte> bytes,
      TierCounters* counters);
  ~TierCopy();  // frees the memory or deletes the file
  TierCopy(const TierCopy&) = delete;
  TierCopy& operator=(const TierCopy&) = delete;

  Tier tier() const { return tier_; }
  int64_t bytes() const { return bytes_; }
  const std::string& path() const { return path_; }  // disk only
  // The bytes as kept: DATA_LOSS if the file is gone or shorter than
  // written; UNAVAILABLE for a read error (the message says which).
  absl::StatusOr<std::vector<std::byte>> Read() const;

 private:
  TierCopy(Tier tier, int64_t bytes, TierCounters* counters);
  const Tier tier_;
  const int64_t bytes_;
  TierCounters* const counters_;
  std::vector<std::byte> host_;  // kHost
  std::string path_;             // kDisk
};

}  // namespace kvkeep

#endif  // KVKEEP_CACHE_STORE_TIERS_H_
