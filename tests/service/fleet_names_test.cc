// Session ids of a fleet (services/common/fleet_names.h) and the bounded
// record of moved sessions (services/kvkeepd/moved_sessions.h).
#include "services/common/fleet_names.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "services/kvkeepd/moved_sessions.h"

namespace kvkeep {
namespace {

using ::testing::HasSubstr;

TEST(FleetNamesTest, AnIdNamesItsReplicaAndKey) {
  EXPECT_EQ(FleetSessionId("kvkeep-0", 0xab), "kvkeep-0.00000000000000ab");
  absl::StatusOr<FleetSessionRef> ref =
      ParseFleetSessionId("kvkeep-0.00000000000000ab");
  ASSERT_TRUE(ref.ok()) << ref.status();
  EXPECT_EQ(ref->replica, "kvkeep-0");
  EXPECT_EQ(ref->key, 0xabu);
  EXPECT_EQ(RenameSessionId(*ref, "kvkeep-1"), "kvkeep-1.00000000000000ab");
  const uint64_t key = 0xfedcba9876543210u;
  EXPECT_EQ(ParseFleetSessionId(FleetSessionId("r", key))->key, key);
}

TEST(FleetNamesTest, ABareKeyFromAnUnnamedServerStillParses) {
  EXPECT_EQ(FleetSessionId("", 0x1234), "0000000000001234");
  absl::StatusOr<FleetSessionRef> ref = ParseFleetSessionId("0000000000001234");
  ASSERT_TRUE(ref.ok()) << ref.status();
  EXPECT_EQ(ref->replica, "");
  EXPECT_EQ(ref->key, 0x1234u);
}

TEST(FleetNamesTest, BadIdsAreRefusedSayingWhy) {
  for (const std::string& id : std::vector<std::string>{
           "", "00000000000000ab0", "00000000000000AB", "kvkeep-0.",
           "kvkeep-0.00000000000000g0", ".00000000000000ab",
           "Kvkeep-0.00000000000000ab", "-kvkeep.00000000000000ab",
           "kvkeep-.00000000000000ab", "a_b.00000000000000ab",
           "a.b.00000000000000ab",
           std::string(64, 'a') + ".00000000000000ab"}) {
    absl::StatusOr<FleetSessionRef> ref = ParseFleetSessionId(id);
    EXPECT_EQ(ref.status().code(), absl::StatusCode::kInvalidArgument) << id;
    EXPECT_THAT(std::string(ref.status().message()), HasSubstr("session_id"))
        << id;
  }
  EXPECT_THAT(std::string(ParseFleetSessionId("zz").status().message()),
              HasSubstr("16 lowercase hex digits"));
  EXPECT_THAT(
      std::string(ParseFleetSessionId("A.00000000000000ab").status().message()),
      HasSubstr("lowercase letters, digits and '-'"));
  // A very long id is quoted bounded.
  EXPECT_LT(
      ParseFleetSessionId(std::string(10000, 'x')).status().message().size(),
      400u);
}

TEST(FleetNamesTest, ReplicaNamesAreDnsLabels) {
  EXPECT_TRUE(CheckReplicaName("kvkeep-0").ok());
  EXPECT_TRUE(CheckReplicaName("a").ok());
  EXPECT_TRUE(CheckReplicaName(std::string(63, 'a')).ok());
  for (const std::string& bad : std::vector<std::string>{
           "", "-a", "a-", "A", "a.b", "a b", std::string(64, 'a')}) {
    EXPECT_EQ(CheckReplicaName(bad).code(), absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

TEST(MovedSessionsTest, AMoveIsFoundWithWhereItWent) {
  MovedSessions moved(8);
  moved.Add(7, {"t", "kvkeep-1", "10.0.0.2:50051"});
  std::optional<MovedSessions::Move> move = moved.Find(7);
  ASSERT_TRUE(move.has_value());
  EXPECT_EQ(move->tenant, "t");
  EXPECT_FALSE(moved.Find(8).has_value());
  const absl::Status status =
      MovedSessions::NotFound("kvkeep-0.0000000000000007", *move);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("moved to replica kvkeep-1 at 10.0.0.2:50051"));
  EXPECT_THAT(
      MovedSessions::MovedMetadata(status),
      ::testing::ElementsAre(
          std::pair<std::string, std::string>(kMovedToMetadata, "kvkeep-1"),
          std::pair<std::string, std::string>(kMovedToAddressMetadata,
                                              "10.0.0.2:50051")));
  // A target without a replica name: the address is where it went.
  EXPECT_EQ(MovedSessions::MovedMetadata(
                MovedSessions::NotFound("x", {"t", "", "10.0.0.3:1"}))[0]
                .second,
            "10.0.0.3:1");
  EXPECT_TRUE(MovedSessions::MovedMetadata(absl::NotFoundError("x")).empty());
}

TEST(MovedSessionsTest, TheOldestMoveIsForgottenPastTheCapacity) {
  MovedSessions moved(3);
  for (SessionId key = 1; key <= 5; ++key) {
    moved.Add(key, {"", "r", "a:1"});
  }
  EXPECT_EQ(moved.size(), 3);
  EXPECT_FALSE(moved.Find(1).has_value());
  EXPECT_FALSE(moved.Find(2).has_value());
  EXPECT_TRUE(moved.Find(5).has_value());
  // Moved again: one record, the latest.
  moved.Add(5, {"", "s", "b:1"});
  EXPECT_EQ(moved.size(), 3);
  EXPECT_EQ(moved.Find(5)->replica, "s");
  MovedSessions none(0);
  none.Add(1, {"", "r", "a:1"});
  EXPECT_EQ(none.size(), 0);
}

}  // namespace
}  // namespace kvkeep
