// NcclLink: a session's slots move from a pool on one GPU to a pool on
// another over a two-rank NCCL communicator, byte for byte, for awkward page
// sizes and dtypes; a peer that never joins costs the deadline, not a hang.
// Needs NCCL (libnccl.so.2, or KVKEEP_NCCL_LIBRARY) and a GPU; moving pages
// needs two GPUs. Skipped otherwise.
#include <memory>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "cache_store/page_memory.h"
#include "gpu/gpu_testing.h"
#include "gtest/gtest.h"

#if defined(KVKEEP_HAVE_NCCL)
#include "cache_store/nccl_link.h"

namespace kvkeep {
namespace {

#define KVKEEP_REQUIRE_NCCL(devices)                                        \
  do {                                                                      \
    if (!NcclLink::Available()) GTEST_SKIP() << "NCCL cannot be loaded";    \
    if (CudaDeviceCount() < (devices)) {                                    \
      GTEST_SKIP() << "needs " << (devices) << " CUDA device(s), this has " \
                   << CudaDeviceCount();                                    \
    }                                                                       \
  } while (0)

TEST(NcclLinkTest, APeerThatNeverJoinsCostsTheDeadline) {
  KVKEEP_REQUIRE_NCCL(1);
  absl::StatusOr<std::string> id = NcclLink::NewUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  absl::StatusOr<std::unique_ptr<NcclLink>> link =
      NcclLink::Connect(*id, 0, 0, absl::Now() + absl::Seconds(2));
  EXPECT_EQ(link.status().code(), absl::StatusCode::kDeadlineExceeded)
      << link.status();
}

TEST(NcclLinkTest, RefusesBadIdsAndRanks) {
  KVKEEP_REQUIRE_NCCL(1);
  EXPECT_EQ(NcclLink::Connect("short", 0, 0, absl::Now() + absl::Seconds(1))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::string> id = NcclLink::NewUniqueId();
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(NcclLink::Connect(*id, 2, 0, absl::Now() + absl::Seconds(1))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

class NcclLinkMoveTest
    : public ::testing::TestWithParam<std::tuple<int32_t, DType>> {};

TEST_P(NcclLinkMoveTest, SlotsArriveByteForByteInAnotherPool) {
  KVKEEP_REQUIRE_NCCL(2);
  const auto [page_tokens, dtype] = GetParam();
  const PageLayout layout{page_tokens, 8, 128, dtype};
  const int64_t slots = 1000;
  const int64_t pages_needed = (slots + page_tokens - 1) / page_tokens;
  const int64_t capacity = 2 * pages_needed + 3;
  std::unique_ptr<PageMemory> a =
      *NewCudaMemory(0, capacity * layout.page_bytes());
  std::unique_ptr<PageMemory> b =
      *NewCudaMemory(1, capacity * layout.page_bytes());
  // Different, shuffled block tables on the two sides.
  std::mt19937 rng(page_tokens);
  std::vector<PageId> all(capacity);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  const std::vector<PageId> pages_a(all.begin(), all.begin() + pages_needed);
  std::shuffle(all.begin(), all.end(), rng);
  const std::vector<PageId> pages_b(all.begin(), all.begin() + pages_needed);
  std::vector<std::byte> keys(slots * layout.token_bytes());
  std::vector<std::byte> values(keys.size());
  for (std::byte& x : keys) x = static_cast<std::byte>(rng());
  for (std::byte& x : values) x = static_cast<std::byte>(rng());
  ASSERT_TRUE(
      a->WriteSlots(layout, pages_a, 0, slots, keys.data(), values.data())
          .ok());

  const std::string id = *NcclLink::NewUniqueId();
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  absl::Status sent, received;
  std::thread sender([&] {
    absl::StatusOr<std::unique_ptr<NcclLink>> link =
        NcclLink::Connect(id, 0, 0, deadline);
    sent = link.status();
    // In runs that do not line up with pages.
    for (int64_t first = 0; sent.ok() && first < slots; first += 333) {
      sent = (*link)->Send(*a, layout, pages_a, first,
                           std::min<int64_t>(333, slots - first), deadline);
    }
  });
  absl::StatusOr<std::unique_ptr<NcclLink>> link =
      NcclLink::Connect(id, 1, 1, deadline);
  received = link.status();
  for (int64_t first = 0; received.ok() && first < slots; first += 333) {
    received = (*link)->Recv(*b, layout, pages_b, first,
                             std::min<int64_t>(333, slots - first), deadline);
  }
  sender.join();
  ASSERT_TRUE(sent.ok()) << sent;
  ASSERT_TRUE(received.ok()) << received;
  std::vector<std::byte> got_keys(keys.size()), got_values(values.size());
  ASSERT_TRUE(b->ReadSlots(layout, pages_b, 0, slots, got_keys.data(),
                           got_values.data())
                  .ok());
  EXPECT_TRUE(got_keys == keys);
  EXPECT_TRUE(got_values == values);
}

INSTANTIATE_TEST_SUITE_P(PagesAndDTypes, NcclLinkMoveTest,
                         ::testing::Combine(::testing::Values(1, 7, 16, 17),
                                            ::testing::Values(DType::kF32,
                                                              DType::kBF16)));

}  // namespace
}  // namespace kvkeep

#else

TEST(NcclLinkTest, NotBuilt) {
  GTEST_SKIP() << "built without NCCL's header: no NCCL transport";
}

#endif  // KVKEEP_HAVE_NCCL
