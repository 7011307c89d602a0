// WatchEvents through the gRPC API, on in-process kvkeepd servers
// (TestServer): every event once and in order across a reconnect; a resume
// from a sequence the ring no longer holds; a watcher that stops reading is
// dropped while another watcher and a session's decode steps go on;
// eviction summaries are batched and add up to the store's counts; tenants
// see only their own sessions; pool pressure; moves between two stores;
// expiry; the drain ends watch streams. Waits for an event are reads
// under a generous deadline (kPatience), so a missing event fails the test
// instead of blocking ctest.
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cache_store/clock.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "services/client/kvkeep_client.h"
#include "tests/testing/metrics_testing.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_server.h"

namespace kvkeep {
namespace {

using ::kvkeep::testing::ExpectError;

constexpr absl::Duration kPatience = absl::Seconds(60);

// n random tokens from `first` on, every layer of the session's layout.
client::KvTokens Tokens(const client::Session& s, int64_t first, int64_t n) {
  static std::mt19937 rng(7);
  std::vector<int64_t> positions(n);
  std::iota(positions.begin(), positions.end(), first);
  return metrics_testing::RandomTokens(s.layout(), std::move(positions), rng);
}

// A server of `pages` SmallLayout pages with `events` as its bus options
// (and tenants, if any).
std::unique_ptr<testing::TestServer> StartServer(
    int64_t pages, EventBusOptions events,
    std::vector<TenantToken> tenants = {}, const Clock* clock = nullptr) {
  ServerConfig config = testing::TestServerConfig(
      {PoolSpec{testing::SmallLayout("small"), pages}});
  config.tenants = std::move(tenants);
  ServerHooks hooks;
  hooks.clock = clock;
  hooks.edit_service_options = [events](ServiceOptions& o) {
    EventObserver* metrics = o.events.observer;
    o.events = events;
    o.events.observer = metrics;
  };
  absl::StatusOr<std::unique_ptr<testing::TestServer>> server =
      testing::TestServer::Start(config, std::move(hooks));
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? *std::move(server) : nullptr;
}

// Summaries only before a session's end (no ticks): counts exact.
EventBusOptions NoTicks() {
  EventBusOptions o;
  o.summary_interval = absl::InfiniteDuration();
  return o;
}

std::unique_ptr<client::KvKeepClient> Connect(const testing::TestServer& s,
                                              const std::string& token = "") {
  client::ClientOptions options;
  options.address = s.address();
  options.token = token;
  options.stream_deadline = kPatience;
  absl::StatusOr<client::KvKeepClient> c =
      client::KvKeepClient::Connect(options);
  EXPECT_TRUE(c.ok()) << c.status();
  return std::make_unique<client::KvKeepClient>(*std::move(c));
}

// A watch of `kinds` (every kind when empty) from now, started: the server
// watches once this returns.
client::EventWatch Watching(const client::KvKeepClient& c,
                            std::vector<v1::EventKind> kinds = {}) {
  v1::WatchEventsRequest request;
  for (v1::EventKind kind : kinds) request.add_kinds(kind);
  client::EventWatch watch = c.WatchEvents(request);
  const absl::Status started = watch.Start();
  EXPECT_TRUE(started.ok()) << started;
  return watch;
}

absl::StatusOr<client::Session> Create(const client::KvKeepClient& c,
                                       const std::string& policy = "window",
                                       int64_t budget = 8,
                                       double idle_timeout_seconds = 0) {
  v1::CreateSessionRequest request;
  request.set_layout("small");
  request.set_policy(policy);
  request.mutable_budget()->set_tokens(budget);
  request.set_idle_timeout_seconds(idle_timeout_seconds);
  return c.CreateSession(request);
}

// What the test expects of an event: its kind and session.
struct Seen {
  v1::EventKind kind;
  std::string session;
  bool operator==(const Seen&) const = default;
};

std::string SessionOf(const v1::Event& e) {
  if (e.has_session()) return e.session().session_id();
  if (e.has_evictions()) return e.evictions().session_id();
  return "";
}

// The next `n` events of `watch`, each one more than the last sequence
// (unless the watch filters: then only later).
std::vector<v1::Event> Read(client::EventWatch& watch, size_t n,
                            bool consecutive = true) {
  std::vector<v1::Event> events;
  while (events.size() < n) {
    const uint64_t last = watch.last_sequence();
    absl::StatusOr<v1::Event> e = watch.Next();
    EXPECT_TRUE(e.ok()) << e.status();
    if (!e.ok()) break;
    if (consecutive) {
      EXPECT_EQ(e->sequence(), last + 1) << e->DebugString();
    } else {
      EXPECT_GT(e->sequence(), last) << e->DebugString();
    }
    events.push_back(*std::move(e));
  }
  return events;
}

std::vector<Seen> Kinds(const std::vector<v1::Event>& events) {
  std::vector<Seen> seen;
  for (const v1::Event& e : events) seen.push_back({e.kind(), SessionOf(e)});
  return seen;
}

// Decode steps of one appended token each (window: evicts on append).
void DecodeSteps(const client::Session& s, int64_t first, int64_t n) {
  client::DecodeStream stream = s.Decode();
  for (int64_t p = first; p < first + n; ++p) {
    ASSERT_TRUE(stream.Step(Tokens(s, p, 1), {}).ok());
  }
  KV_ASSERT_OK(stream.Finish());
}

TEST(WatchEventsTest, EveryEventOnceInOrderAcrossAReconnect) {
  auto server = StartServer(256, NoTicks());
  ASSERT_NE(server, nullptr);
  auto c = Connect(*server);
  client::EventWatch watch = Watching(*c);
  const uint64_t start = watch.last_sequence();

  KV_ASSIGN_OR_FAIL(const client::Session a, Create(*c));
  KV_ASSIGN_OR_FAIL(const client::Session b, a.Fork());
  std::vector<v1::Event> first = Read(watch, 2);
  EXPECT_EQ(Kinds(first),
            (std::vector<Seen>{{v1::EVENT_SESSION_CREATED, a.id()},
                               {v1::EVENT_SESSION_FORKED, b.id()}}));
  EXPECT_EQ(first[0].sequence(), start + 1);
  EXPECT_EQ(first[1].session().parent_session_id(), a.id());
  EXPECT_EQ(first[0].session().layout(), "small");
  EXPECT_EQ(first[0].session().policy(), "window");

  // Disconnected: these happen while nobody watches.
  watch.Cancel();
  EXPECT_FALSE(watch.Next().ok());
  ASSERT_NO_FATAL_FAILURE(DecodeSteps(a, 0, 20));
  KV_ASSERT_OK(b.Close());
  KV_ASSERT_OK(a.Close());

  KV_ASSERT_OK(watch.Start());  // resumes after first[1]
  EXPECT_EQ(Kinds(Read(watch, 3)),
            (std::vector<Seen>{{v1::EVENT_SESSION_CLOSED, b.id()},
                               {v1::EVENT_EVICTIONS, a.id()},
                               {v1::EVENT_SESSION_CLOSED, a.id()}}));
  // And live again.
  KV_ASSIGN_OR_FAIL(const client::Session d, Create(*c));
  EXPECT_EQ(Kinds(Read(watch, 1)),
            (std::vector<Seen>{{v1::EVENT_SESSION_CREATED, d.id()}}));
}

TEST(WatchEventsTest, AResumeFromASequenceNoLongerHeldIsOutOfRange) {
  EventBusOptions options = NoTicks();
  options.ring_events = 8;
  auto server = StartServer(256, options);
  ASSERT_NE(server, nullptr);
  auto c = Connect(*server);
  for (int i = 0; i < 10; ++i) {  // 20 events: the ring holds 13..20
    KV_ASSIGN_OR_FAIL(const client::Session s, Create(*c));
    KV_ASSERT_OK(s.Close());
  }
  client::EventWatch watch = Watching(*c);
  ASSERT_EQ(watch.last_sequence(), 20);
  const uint64_t incarnation = watch.incarnation();

  v1::WatchEventsRequest request;
  request.set_after_sequence(3);
  client::EventWatch old = c->WatchEvents(request);
  ExpectError(old.Start(), absl::StatusCode::kOutOfRange,
              {"after sequence 3", "oldest held is 13", "ListSessions"});
  // The oldest one still held: every event from it on.
  request.set_after_sequence(12);
  client::EventWatch held = c->WatchEvents(request);
  KV_ASSERT_OK(held.Start());
  EXPECT_EQ(Read(held, 8).back().sequence(), 20);

  request.set_after_sequence(21);
  client::EventWatch future = c->WatchEvents(request);
  ExpectError(future.Start(), absl::StatusCode::kOutOfRange,
              {"never published", "latest is 20"});
  request.set_after_sequence(15);
  request.set_incarnation(incarnation + 1);
  client::EventWatch other = c->WatchEvents(request);
  ExpectError(other.Start(), absl::StatusCode::kOutOfRange,
              {"incarnation", "restarted"});
  request.set_incarnation(0);
  request.add_kinds(static_cast<v1::EventKind>(99));
  client::EventWatch bad = c->WatchEvents(request);
  ExpectError(bad.Start(), absl::StatusCode::kInvalidArgument,
              {"99 is not an event kind"});
}

TEST(WatchEventsTest, AWatcherThatStopsReadingIsDroppedWhileOthersGoOn) {
  EventBusOptions options = NoTicks();
  options.ring_events = 256;
  auto server = StartServer(256, options);
  ASSERT_NE(server, nullptr);
  auto c = Connect(*server);
  // The slow watcher's own channel, without BDP probing: its stream window
  // stays at the HTTP/2 default (64 KiB), so the server's writes to it
  // block soon after it stops reading.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(
      server->address(), grpc::InsecureChannelCredentials(), args);
  std::unique_ptr<v1::KvKeep::Stub> stub = v1::KvKeep::NewStub(channel);
  grpc::ClientContext slow_ctx;
  slow_ctx.set_deadline(absl::ToChronoTime(absl::Now() + kPatience));
  std::unique_ptr<grpc::ClientReader<v1::WatchEventsResponse>> slow =
      stub->WatchEvents(&slow_ctx, v1::WatchEventsRequest());
  v1::WatchEventsResponse message;
  ASSERT_TRUE(slow->Read(&message));  // watching from here; then no reads

  client::EventWatch good = Watching(*c);
  KV_ASSIGN_OR_FAIL(const client::Session decoding, Create(*c));
  ASSERT_EQ(Read(good, 1)[0].kind(), v1::EVENT_SESSION_CREATED);
  // 8000 events of about 70 bytes: far past the slow watcher's window and
  // the ring. The good watcher reads each round's 100 events (within the
  // ring), and the session decodes between rounds.
  for (int round = 0; round < 40; ++round) {
    for (int i = 0; i < 50; ++i) {
      KV_ASSIGN_OR_FAIL(const client::Session s, Create(*c));
      KV_ASSERT_OK(s.Close());
    }
    ASSERT_EQ(Read(good, 100).size(), 100u);
    ASSERT_NO_FATAL_FAILURE(DecodeSteps(decoding, round * 5, 5));
  }
  // The slow watcher reads what reached it, then hears why it ended.
  uint64_t last = 0;
  while (slow->Read(&message)) {
    for (const v1::Event& e : message.events()) {
      EXPECT_GT(e.sequence(), last);
      last = e.sequence();
    }
  }
  const grpc::Status status = slow->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << status.error_message();
  EXPECT_THAT(status.error_message(),
              ::testing::ContainsRegex("watcher fell [0-9]+ events behind"));
  EXPECT_LT(last, 8000u);
  // The good watcher and the store went on.
  KV_ASSERT_OK(decoding.Close());
  const std::vector<v1::Event> end = Read(good, 2);
  EXPECT_EQ(end[0].evictions().calls(), 200);
  EXPECT_EQ(end[1].kind(), v1::EVENT_SESSION_CLOSED);
}

TEST(WatchEventsTest, EvictionSummariesAreBatchedAndAddUpToTheStoreCounts) {
  auto server = StartServer(256, NoTicks());
  ASSERT_NE(server, nullptr);
  auto c = Connect(*server);
  client::EventWatch watch = Watching(*c, {v1::EVENT_EVICTIONS});
  KV_ASSIGN_OR_FAIL(const client::Session s, Create(*c, "window", 8));
  KV_ASSERT_OK(s.AppendPrefill(Tokens(s, 0, 30)));
  ASSERT_NO_FATAL_FAILURE(DecodeSteps(s, 30, 300));
  KV_ASSIGN_OR_FAIL(const v1::SessionStats stats, s.Stats());
  ASSERT_GT(stats.evicted_tokens(), 0);
  // A tick publishes what is pending: one summary for 301 calls.
  server->server().service()->events().Tick();
  ASSERT_NO_FATAL_FAILURE(DecodeSteps(s, 330, 10));
  KV_ASSIGN_OR_FAIL(const v1::SessionStats after, s.Stats());
  KV_ASSERT_OK(s.Close());

  const std::vector<v1::Event> summaries = Read(watch, 2, false);
  ASSERT_EQ(summaries.size(), 2u);
  const v1::EvictionSummary& one = summaries[0].evictions();
  const v1::EvictionSummary& two = summaries[1].evictions();
  EXPECT_EQ(one.session_id(), s.id());
  EXPECT_EQ(one.calls(), 301);
  EXPECT_EQ(one.evicted_tokens(), stats.evicted_tokens());
  EXPECT_EQ(one.resident_tokens(), stats.resident_tokens());
  EXPECT_EQ(two.calls(), 10);
  EXPECT_EQ(one.evicted_tokens() + two.evicted_tokens(),
            after.evicted_tokens());
  EXPECT_EQ(two.resident_tokens(), after.resident_tokens());
}

TEST(WatchEventsTest, ATenantSeesOnlyItsOwnSessions) {
  auto server =
      StartServer(256, NoTicks(), {{"a", "token-a", 0}, {"b", "token-b", 0}});
  ASSERT_NE(server, nullptr);
  auto a = Connect(*server, "token-a");
  auto b = Connect(*server, "token-b");
  client::EventWatch watch_a = Watching(*a);
  client::EventWatch watch_b = Watching(*b);
  KV_ASSIGN_OR_FAIL(const client::Session sb, Create(*b));
  KV_ASSERT_OK(sb.Append(Tokens(sb, 0, 20)));
  KV_ASSERT_OK(sb.Close());
  KV_ASSIGN_OR_FAIL(const client::Session sa, Create(*a));
  KV_ASSERT_OK(sa.Close());

  absl::StatusOr<v1::Event> e = watch_a.Next();
  KV_ASSERT_OK(e);
  EXPECT_EQ(Seen({e->kind(), SessionOf(*e)}),
            Seen({v1::EVENT_SESSION_CREATED, sa.id()}));
  EXPECT_EQ(e->session().tenant(), "a");
  e = watch_a.Next();
  KV_ASSERT_OK(e);
  EXPECT_EQ(Seen({e->kind(), SessionOf(*e)}),
            Seen({v1::EVENT_SESSION_CLOSED, sa.id()}));
  std::vector<v1::Event> seen_b = Read(watch_b, 3);
  for (const v1::Event& event : seen_b) EXPECT_EQ(SessionOf(event), sb.id());

  auto nobody = Connect(*server);
  client::EventWatch anonymous = nobody->WatchEvents();
  ExpectError(anonymous.Start(), absl::StatusCode::kUnauthenticated, {"token"});
}

TEST(WatchEventsTest, PoolPressureCrossesItsThresholds) {
  EventBusOptions options;
  options.summary_interval = absl::Milliseconds(20);
  auto server = StartServer(40, options);
  ASSERT_NE(server, nullptr);
  auto c = Connect(*server);
  client::EventWatch watch = Watching(*c, {v1::EVENT_POOL_PRESSURE});
  // 2 layers of 4-token pages: 64 tokens take 32 of the 40 pages (8 free,
  // 20%: LOW); 76 take 38 (2 free, 5%: CRITICAL).
  KV_ASSIGN_OR_FAIL(const client::Session s, Create(*c, "full", 1000));
  KV_ASSERT_OK(s.Append(Tokens(s, 0, 64)));
  absl::StatusOr<v1::Event> e = watch.Next();
  KV_ASSERT_OK(e);
  EXPECT_EQ(e->pool().level(), v1::PoolPressure::LEVEL_LOW);
  EXPECT_EQ(e->pool().free_pages(), 8);
  EXPECT_EQ(e->pool().capacity_pages(), 40);
  EXPECT_EQ(e->pool().layout(), "small");
  KV_ASSERT_OK(s.Append(Tokens(s, 64, 12)));
  e = watch.Next();
  KV_ASSERT_OK(e);
  EXPECT_EQ(e->pool().level(), v1::PoolPressure::LEVEL_CRITICAL);
  EXPECT_EQ(e->pool().free_pages(), 2);
  KV_ASSERT_OK(s.Close());
  e = watch.Next();
  KV_ASSERT_OK(e);
  EXPECT_EQ(e->pool().level(), v1::PoolPressure::LEVEL_OK);
  EXPECT_EQ(e->pool().free_pages(), 40);
}

TEST(WatchEventsTest, AMoveIsMovedOutHereAndMovedInThere) {
  auto source = StartServer(256, NoTicks());
  auto target = StartServer(256, NoTicks());
  ASSERT_NE(source, nullptr);
  ASSERT_NE(target, nullptr);
  auto from = Connect(*source);
  auto to = Connect(*target);
  client::EventWatch out = Watching(*from);
  client::EventWatch in = Watching(*to);
  KV_ASSIGN_OR_FAIL(const client::Session s, Create(*from));
  KV_ASSERT_OK(s.Append(Tokens(s, 0, 12)));
  v1::TransferSessionRequest request;
  request.set_session_id(s.id());
  request.set_target(target->address());
  request.set_transport("host");
  KV_ASSERT_OK(from->TransferSession(request));

  const std::vector<v1::Event> here = Read(out, 3);
  EXPECT_EQ(Kinds(here),
            (std::vector<Seen>{{v1::EVENT_SESSION_CREATED, s.id()},
                               {v1::EVENT_EVICTIONS, s.id()},
                               {v1::EVENT_SESSION_MOVED_OUT, s.id()}}));
  EXPECT_EQ(here[2].session().peer(), target->address());
  const std::vector<v1::Event> there = Read(in, 1);
  EXPECT_EQ(Kinds(there),
            (std::vector<Seen>{{v1::EVENT_SESSION_MOVED_IN, s.id()}}));
  EXPECT_EQ(there[0].session().layout(), "small");
}

TEST(WatchEventsTest, AnExpiredSessionIsAnEvent) {
  ManualClock clock;
  auto server = StartServer(256, NoTicks(), {}, &clock);
  ASSERT_NE(server, nullptr);
  auto c = Connect(*server);
  client::EventWatch watch = Watching(*c);
  KV_ASSIGN_OR_FAIL(const client::Session s, Create(*c, "window", 8, 5));
  KV_ASSERT_OK(s.Append(Tokens(s, 0, 10)));
  clock.Advance(absl::Seconds(6));  // the reaper closes it (1 s wakes)
  EXPECT_EQ(Kinds(Read(watch, 3)),
            (std::vector<Seen>{{v1::EVENT_SESSION_CREATED, s.id()},
                               {v1::EVENT_EVICTIONS, s.id()},
                               {v1::EVENT_SESSION_EXPIRED, s.id()}}));
}

TEST(WatchEventsTest, TheDrainEndsWatchStreams) {
  auto server = StartServer(256, NoTicks());
  ASSERT_NE(server, nullptr);
  auto c = Connect(*server);
  client::EventWatch watch = Watching(*c);
  server->Stop(absl::Seconds(30));
  ExpectError(watch.Next(), absl::StatusCode::kUnavailable, {"shutting down"});
}

}  // namespace
}  // namespace kvkeep
