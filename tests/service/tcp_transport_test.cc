// The data-socket transport of session transfer (tcp_transport.h), without a
// store or a gRPC server: HostSlotSpans against a slot-by-slot gather over
// awkward page sizes; SlotStream chunks and verdicts over a real loopback
// connection, byte for byte, checksums included, and their wire form as the
// header writes it; DataSocket deadlines, peer closes and Shutdown;
// TcpTransport tickets (expected, welcomed, awaited, withdrawn, spent,
// forged) and its shutdown; TargetHost over gRPC target forms.
#include "services/transfer/tcp_transport.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cache_store/slot_spans.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "kernels/page_layout.h"
#include "services/common/crc32c.h"

namespace kvkeep {
namespace {

// `chunk`, sent with `crc` as its checksum whatever its bytes.
Chunk Claiming(Chunk chunk, uint32_t crc) {
  chunk.crc32c = crc;
  return chunk;
}

using ::testing::HasSubstr;
using ::testing::StartsWith;

// Generous: only a broken transport gets anywhere near it.
absl::Time Deadline() { return absl::Now() + absl::Seconds(30); }
// For the tests about deadlines, which assert the status code only.
absl::Time ShortDeadline() { return absl::Now() + absl::Milliseconds(250); }

// An arena of `pages` pages of `layout` whose every 4-byte word holds its own
// index plus one, so no two slots' bytes are alike (and none is zero).
std::vector<std::byte> PatternArena(const PageLayout& layout, int64_t pages) {
  std::vector<std::byte> arena(
      static_cast<size_t>(pages * layout.page_bytes()));
  for (size_t w = 0; w < arena.size() / 4; ++w) {
    const uint32_t v = static_cast<uint32_t>(w + 1);
    std::memcpy(arena.data() + 4 * w, &v, 4);
  }
  return arena;
}

// `count` distinct page ids out of [0, arena_pages), shuffled.
std::vector<PageId> ShuffledPages(int64_t arena_pages, int64_t count,
                                  uint32_t seed) {
  std::vector<PageId> all(static_cast<size_t>(arena_pages));
  std::iota(all.begin(), all.end(), 0);
  std::mt19937 rng(seed);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(static_cast<size_t>(count));
  return all;
}

// Slots [first, first + n) of the block table `pages`, gathered a slot at a
// time: their keys (or values) in slot order.
std::vector<std::byte> Gather(const std::byte* arena, const PageLayout& layout,
                              std::span<const PageId> pages, int64_t first,
                              int64_t n, bool values) {
  std::vector<std::byte> out;
  for (int64_t s = first; s < first + n; ++s) {
    const PageId page = pages[s / layout.page_tokens];
    const int32_t in_page = static_cast<int32_t>(s % layout.page_tokens);
    const int64_t at = values ? layout.value_offset(page, in_page)
                              : layout.key_offset(page, in_page);
    out.insert(out.end(), arena + at, arena + at + layout.token_bytes());
  }
  return out;
}

std::vector<std::byte> Concat(const std::vector<std::span<std::byte>>& side) {
  std::vector<std::byte> out;
  for (std::span<std::byte> piece : side) {
    out.insert(out.end(), piece.begin(), piece.end());
  }
  return out;
}

std::vector<std::byte> Bytes(absl::string_view s) {
  const auto b = std::as_bytes(std::span(s.data(), s.size()));
  return {b.begin(), b.end()};
}

absl::Status SendBytes(DataSocket& socket, absl::string_view bytes,
                       absl::Time deadline) {
  iovec v{const_cast<char*>(bytes.data()), bytes.size()};
  return socket.Send({&v, 1}, deadline);
}

absl::StatusOr<std::string> ReceiveBytes(DataSocket& socket, size_t n,
                                         absl::Time deadline) {
  std::string out(n, '\0');
  iovec v{out.data(), out.size()};
  if (absl::Status s = socket.Receive({&v, 1}, deadline); !s.ok()) return s;
  return out;
}

uint32_t Le32(const std::string& b, size_t at) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) {
    v |= static_cast<uint32_t>(static_cast<uint8_t>(b[at + i])) << (8 * i);
  }
  return v;
}
uint64_t Le64(const std::string& b, size_t at) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) {
    v |= static_cast<uint64_t>(static_cast<uint8_t>(b[at + i])) << (8 * i);
  }
  return v;
}

// The CRC32C of the keys, then the values, of `spans`.
uint32_t SpansCrc(const SlotSpans& spans) {
  uint32_t crc = 0;
  for (const auto* side : {&spans.keys, &spans.values}) {
    for (std::span<const std::byte> piece : *side) crc = Crc32c(crc, piece);
  }
  return crc;
}

// ---------------------------------------------------------------------------
// HostSlotSpans

TEST(HostSlotSpansTest, PiecesHoldTheSlotsInSlotOrder) {
  for (const int32_t page_tokens : {1, 3, 7, 16, 17}) {
    SCOPED_TRACE(absl::StrCat("page_tokens ", page_tokens));
    const PageLayout layout{page_tokens, /*kv_heads=*/2, /*head_dim=*/4,
                            DType::kF32};
    ASSERT_EQ(layout.token_bytes(), 32);
    constexpr int64_t kArenaPages = 13;
    constexpr int64_t kTablePages = 9;
    std::vector<std::byte> arena = PatternArena(layout, kArenaPages);
    const std::vector<PageId> pages = ShuffledPages(
        kArenaPages, kTablePages, static_cast<uint32_t>(page_tokens));
    const int64_t capacity = kTablePages * page_tokens;
    const int64_t p = page_tokens;
    const std::vector<std::pair<int64_t, int64_t>> ranges = {
        {0, capacity},       // everything
        {0, 1},              // the first slot
        {capacity - 1, 1},   // the last
        {p - 1, 2},          // the end of one page and the start of the next
        {1, p},              // from mid-page, across one boundary
        {p / 2, 2 * p + 1},  // from mid-page, across two or more
        {p + 1, 3 * p - 2},  // mid-page to mid-page
        {2 * p, p},          // exactly one page
        {3, 0},              // nothing
        {capacity - p - 1, p + 1},
    };
    for (const auto& [first, n] : ranges) {
      if (first < 0 || n < 0 || first + n > capacity) continue;
      SCOPED_TRACE(absl::StrCat("slots [", first, ", +", n, ")"));
      SlotSpans spans;
      HostSlotSpans(arena.data(), layout, pages, first, n, &spans);
      EXPECT_EQ(Concat(spans.keys),
                Gather(arena.data(), layout, pages, first, n, false));
      EXPECT_EQ(Concat(spans.values),
                Gather(arena.data(), layout, pages, first, n, true));
      // One piece per page touched: a page's keys never run on into another
      // page's keys (its values lie between), nor values into values across
      // pages of a shuffled table.
      const size_t touched =
          n == 0 ? 0 : static_cast<size_t>((first + n - 1) / p - first / p + 1);
      EXPECT_EQ(spans.keys.size(), touched);
      EXPECT_EQ(spans.values.size(), touched);
      for (const auto* side : {&spans.keys, &spans.values}) {
        for (std::span<std::byte> piece : *side) {
          EXPECT_GE(piece.data(), arena.data());
          EXPECT_LE(piece.data() + piece.size(), arena.data() + arena.size());
          EXPECT_EQ(piece.size() % layout.token_bytes(), 0u);
        }
      }
    }
  }
}

TEST(HostSlotSpansTest, SpansAreWritable) {
  // The receiving side writes through the spans: they must be the arena's
  // own bytes, not copies.
  const PageLayout layout{3, 2, 4, DType::kF32};
  std::vector<std::byte> arena(static_cast<size_t>(4 * layout.page_bytes()));
  const std::vector<PageId> pages = {2, 0, 3};
  SlotSpans spans;
  HostSlotSpans(arena.data(), layout, pages, 1, 6, &spans);
  for (std::span<std::byte> piece : spans.keys) {
    for (std::byte& b : piece) b = std::byte{1};
  }
  for (std::span<std::byte> piece : spans.values) {
    for (std::byte& b : piece) b = std::byte{2};
  }
  const std::vector<std::byte> keys(6 * layout.token_bytes(), std::byte{1});
  const std::vector<std::byte> values(6 * layout.token_bytes(), std::byte{2});
  EXPECT_EQ(Gather(arena.data(), layout, pages, 1, 6, false), keys);
  EXPECT_EQ(Gather(arena.data(), layout, pages, 1, 6, true), values);
  // Slot 0 and page 1 (not in the table) were not touched.
  const std::vector<std::byte> zero(layout.token_bytes(), std::byte{0});
  EXPECT_EQ(Gather(arena.data(), layout, pages, 0, 1, false), zero);
  const std::vector<PageId> unused = {1};
  EXPECT_EQ(Gather(arena.data(), layout, unused, 0, 3, false),
            std::vector<std::byte>(3 * layout.token_bytes()));
}

// ---------------------------------------------------------------------------
// A connected pair of data sockets: the sender's, from DataSocket::Connect,
// and the target's, handed over by a TcpTransport's Await; both set up as
// the transfer sets them up.

class ConnectedPairTest : public testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<TcpTransport>> t =
        TcpTransport::Listen("127.0.0.1:0");
    ASSERT_TRUE(t.ok()) << t.status();
    transport_ = *std::move(t);
    const std::string ticket = transport_->Expect();
    absl::StatusOr<DataSocket> c =
        DataSocket::Connect("127.0.0.1", transport_->port(), Deadline());
    ASSERT_TRUE(c.ok()) << c.status();
    sender_ = *std::move(c);
    SlotStream hello(&sender_, Deadline());
    ASSERT_TRUE(hello.SendHello(ticket).ok());
    const absl::Status welcome = hello.AwaitWelcome(Deadline());
    ASSERT_TRUE(welcome.ok()) << welcome;
    absl::StatusOr<DataSocket> s = transport_->Await(ticket, Deadline());
    ASSERT_TRUE(s.ok()) << s.status();
    target_ = *std::move(s);
  }

  std::unique_ptr<TcpTransport> transport_;
  DataSocket sender_;
  DataSocket target_;
};

// ---------------------------------------------------------------------------
// SlotStream

class SlotStreamTest : public ConnectedPairTest {};

TEST_F(SlotStreamTest, ChunksArriveSlotForSlotIntoAnotherBlockTable) {
  // 1 KiB a token, 7 a page: a page's keys (7 KiB) do not divide the 512 KiB
  // pass, so the large chunk's passes split pieces.
  const PageLayout layout{7, /*kv_heads=*/4, /*head_dim=*/64, DType::kF32};
  const std::vector<int64_t> layer_slots = {40, 1000, 10};
  struct Run {
    int32_t layer;
    int64_t first;
    int64_t slots;
  };
  const std::vector<Run> chunks = {
      {0, 0, 3}, {0, 3, 37}, {1, 0, 1000}, {2, 0, 4}, {2, 4, 6}};
  ASSERT_GT(2 * 1000 * layout.token_bytes(), 512 * 1024);

  int64_t table_pages = 0;
  for (int64_t n : layer_slots) table_pages += (n + 6) / 7;
  const int64_t arena_pages = table_pages + 5;
  std::vector<std::byte> a = PatternArena(layout, arena_pages);
  std::vector<std::byte> b(a.size());
  // Each arena's pages, shuffled differently, dealt out to the layers.
  const std::vector<PageId> a_order =
      ShuffledPages(arena_pages, arena_pages, 1);
  const std::vector<PageId> b_order =
      ShuffledPages(arena_pages, arena_pages, 2);
  std::vector<std::vector<PageId>> a_tables, b_tables;
  size_t dealt = 0;
  for (int64_t n : layer_slots) {
    const size_t count = static_cast<size_t>((n + 6) / 7);
    a_tables.emplace_back(a_order.begin() + dealt,
                          a_order.begin() + dealt + count);
    b_tables.emplace_back(b_order.begin() + dealt,
                          b_order.begin() + dealt + count);
    dealt += count;
  }

  absl::Status sent;
  absl::Status verdict = absl::UnknownError("not awaited");
  std::thread sender([&] {
    SlotStream out(&sender_, Deadline());
    for (const Run& c : chunks) {
      SlotSpans spans;
      HostSlotSpans(a.data(), layout, a_tables[c.layer], c.first, c.slots,
                    &spans);
      sent = out.SendChunk(ChunkOf(c.layer, c.first, c.slots, spans));
      if (!sent.ok()) return;
    }
    verdict = out.AwaitVerdict();
  });

  SlotStream in(&target_, Deadline());
  bool all_ok = true;
  for (const Run& c : chunks) {
    SCOPED_TRACE(absl::StrCat("layer ", c.layer, " slot ", c.first));
    absl::StatusOr<Chunk> header = in.ReceiveChunkHeader();
    all_ok = header.ok();
    EXPECT_TRUE(header.ok()) << header.status();
    if (!all_ok) break;
    EXPECT_EQ(header->layer, c.layer);
    EXPECT_EQ(header->first_slot, c.first);
    EXPECT_EQ(header->slots, c.slots);
    SlotSpans spans;
    HostSlotSpans(b.data(), layout, b_tables[c.layer], c.first, c.slots,
                  &spans);
    const absl::Status r = in.ReceiveChunk(*header, spans);
    all_ok = r.ok();
    EXPECT_TRUE(r.ok()) << r;
    if (!all_ok) break;
  }
  if (all_ok) {
    EXPECT_TRUE(in.SendVerdict(absl::OkStatus()).ok());
  } else {
    target_.Shutdown();  // the sender's wait ends now
  }
  sender.join();
  EXPECT_TRUE(sent.ok()) << sent;
  EXPECT_TRUE(verdict.ok()) << verdict;

  // B holds A's slots where B's tables say, and nothing anywhere else.
  std::vector<std::byte> expected(b.size());
  for (size_t l = 0; l < layer_slots.size(); ++l) {
    for (int64_t s = 0; s < layer_slots[l]; ++s) {
      for (const bool values : {false, true}) {
        const std::vector<std::byte> slot =
            Gather(a.data(), layout, a_tables[l], s, 1, values);
        const PageId page = b_tables[l][s / 7];
        const int64_t at = values ? layout.value_offset(page, s % 7)
                                  : layout.key_offset(page, s % 7);
        std::copy(slot.begin(), slot.end(), expected.begin() + at);
      }
    }
  }
  EXPECT_TRUE(b == expected) << "the target arena differs from the source";
}

TEST_F(SlotStreamTest, ChunkWireForm) {
  const PageLayout layout{3, 2, 4, DType::kF32};
  std::vector<std::byte> arena = PatternArena(layout, 3);
  const std::vector<PageId> pages = {2, 0};
  SlotSpans spans;
  HostSlotSpans(arena.data(), layout, pages, 1, 4, &spans);
  ASSERT_TRUE(SlotStream(&sender_, Deadline())
                  .SendChunk(ChunkOf(-3, 1, 4, spans))
                  .ok());

  const size_t kv = 4 * layout.token_bytes();
  absl::StatusOr<std::string> wire =
      ReceiveBytes(target_, 24 + 2 * kv + 4, Deadline());
  ASSERT_TRUE(wire.ok()) << wire.status();
  EXPECT_EQ(wire->substr(0, 4), "CKVK");
  EXPECT_EQ(Le32(*wire, 0), 0x4B564B43u);
  EXPECT_EQ(static_cast<int32_t>(Le32(*wire, 4)), -3);
  EXPECT_EQ(static_cast<int64_t>(Le64(*wire, 8)), 1);
  EXPECT_EQ(static_cast<int64_t>(Le64(*wire, 16)), 4);
  const std::vector<std::byte> keys =
      Gather(arena.data(), layout, pages, 1, 4, false);
  const std::vector<std::byte> values =
      Gather(arena.data(), layout, pages, 1, 4, true);
  EXPECT_EQ(Bytes(wire->substr(24, kv)), keys);
  EXPECT_EQ(Bytes(wire->substr(24 + kv, kv)), values);
  std::vector<std::byte> both = keys;
  both.insert(both.end(), values.begin(), values.end());
  EXPECT_EQ(Le32(*wire, 24 + 2 * kv), Crc32c(0, both));
  // Nothing more was sent.
  EXPECT_FALSE(target_.Readable());
}

TEST_F(SlotStreamTest, HelloWireFormAndReceiveHello) {
  const std::string ticket = "0123456789abcdef";
  SlotStream out(&sender_, Deadline());
  ASSERT_TRUE(out.SendHello(ticket).ok());
  absl::StatusOr<std::string> wire = ReceiveBytes(target_, 24, Deadline());
  ASSERT_TRUE(wire.ok()) << wire.status();
  EXPECT_EQ(*wire, "KVKDATA1" + ticket);

  ASSERT_TRUE(out.SendHello(ticket).ok());
  absl::StatusOr<std::string> got =
      SlotStream::ReceiveHello(target_, Deadline());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, ticket);
}

TEST_F(SlotStreamTest, AwaitWelcomeRefusesAnythingElse) {
  ASSERT_TRUE(SendBytes(target_, "NOPE", Deadline()).ok());
  const absl::Status welcome =
      SlotStream(&sender_, Deadline()).AwaitWelcome(Deadline());
  EXPECT_FALSE(welcome.ok());
}

TEST_F(SlotStreamTest, ReceiveHelloRefusesGarbage) {
  ASSERT_TRUE(
      SendBytes(sender_, "GET / HTTP/1.1\r\nHost: x\r\n", Deadline()).ok());
  absl::StatusOr<std::string> got =
      SlotStream::ReceiveHello(target_, Deadline());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument)
      << got.status();
}

TEST_F(SlotStreamTest, ClaimedCrcIsSentAndChecked) {
  const PageLayout layout{3, 2, 4, DType::kF32};
  std::vector<std::byte> a = PatternArena(layout, 4);
  std::vector<std::byte> b(a.size());
  const std::vector<PageId> a_pages = {3, 1, 0};
  const std::vector<PageId> b_pages = {0, 2, 1};
  SlotSpans out_spans, in_spans;
  HostSlotSpans(a.data(), layout, a_pages, 2, 5, &out_spans);
  HostSlotSpans(b.data(), layout, b_pages, 2, 5, &in_spans);
  const uint32_t crc = SpansCrc(out_spans);

  SlotStream out(&sender_, Deadline());
  SlotStream in(&target_, Deadline());
  // The true checksum, claimed: the chunk checks out.
  ASSERT_TRUE(out.SendChunk(Claiming(ChunkOf(0, 2, 5, out_spans), crc)).ok());
  absl::StatusOr<Chunk> header = in.ReceiveChunkHeader();
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_TRUE(in.ReceiveChunk(*header, in_spans).ok());
  EXPECT_EQ(Concat(in_spans.keys), Concat(out_spans.keys));

  // Any other: DATA_LOSS, saying which check failed; the stream stays
  // framed, so the next chunk is read from its header on.
  ASSERT_TRUE(
      out.SendChunk(Claiming(ChunkOf(1, 2, 5, out_spans), crc ^ 0x00010000u))
          .ok());
  ASSERT_TRUE(out.SendChunk(ChunkOf(2, 2, 5, out_spans)).ok());
  header = in.ReceiveChunkHeader();
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_EQ(header->layer, 1);
  const absl::Status bad = in.ReceiveChunk(*header, in_spans);
  EXPECT_EQ(bad.code(), absl::StatusCode::kDataLoss) << bad;
  EXPECT_THAT(bad.message(), HasSubstr("CRC32C"));
  header = in.ReceiveChunkHeader();
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_EQ(header->layer, 2);
  EXPECT_TRUE(in.ReceiveChunk(*header, in_spans).ok());
}

TEST_F(SlotStreamTest, GarbageInsteadOfAChunkHeader) {
  const std::string garbage = "this is no chunk header!";
  ASSERT_EQ(garbage.size(), 24u);
  ASSERT_TRUE(SendBytes(sender_, garbage, Deadline()).ok());
  absl::StatusOr<Chunk> header =
      SlotStream(&target_, Deadline()).ReceiveChunkHeader();
  EXPECT_EQ(header.status().code(), absl::StatusCode::kInvalidArgument)
      << header.status();
}

TEST_F(SlotStreamTest, OkVerdict) {
  ASSERT_TRUE(
      SlotStream(&target_, Deadline()).SendVerdict(absl::OkStatus()).ok());
  const absl::Status verdict = SlotStream(&sender_, Deadline()).AwaitVerdict();
  EXPECT_TRUE(verdict.ok()) << verdict;
}

TEST_F(SlotStreamTest, FailedVerdictKeepsCodeAndMessage) {
  ASSERT_TRUE(SlotStream(&target_, Deadline())
                  .SendVerdict(absl::DataLossError("x y"))
                  .ok());
  const absl::Status verdict = SlotStream(&sender_, Deadline()).AwaitVerdict();
  EXPECT_EQ(verdict.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(verdict.message(), "x y");
}

TEST_F(SlotStreamTest, VerdictWireForm) {
  ASSERT_TRUE(SlotStream(&target_, Deadline())
                  .SendVerdict(absl::DataLossError("x y"))
                  .ok());
  absl::StatusOr<std::string> wire = ReceiveBytes(sender_, 15, Deadline());
  ASSERT_TRUE(wire.ok()) << wire.status();
  EXPECT_EQ(wire->substr(0, 4), "VKVK");
  EXPECT_EQ(Le32(*wire, 4), static_cast<uint32_t>(absl::StatusCode::kDataLoss));
  EXPECT_EQ(Le32(*wire, 8), 3u);
  EXPECT_EQ(wire->substr(12), "x y");
}

TEST_F(SlotStreamTest, LongVerdictMessageIsCutNotRefused) {
  const std::string message(20000, 'm');
  ASSERT_TRUE(SlotStream(&target_, Deadline())
                  .SendVerdict(absl::ResourceExhaustedError(message))
                  .ok());
  const absl::Status verdict = SlotStream(&sender_, Deadline()).AwaitVerdict();
  EXPECT_EQ(verdict.code(), absl::StatusCode::kResourceExhausted) << verdict;
  EXPECT_FALSE(verdict.message().empty());
  EXPECT_THAT(message, StartsWith(std::string(verdict.message())));
}

TEST_F(SlotStreamTest, MalformedVerdictIsAFailure) {
  ASSERT_TRUE(SendBytes(target_, "not a verdict", Deadline()).ok());
  EXPECT_FALSE(SlotStream(&sender_, Deadline()).AwaitVerdict().ok());
}

TEST_F(SlotStreamTest, EarlyVerdictOnlyOnceSent) {
  SlotStream out(&sender_, Deadline());
  EXPECT_FALSE(out.EarlyVerdict().has_value());
  ASSERT_TRUE(SlotStream(&target_, Deadline())
                  .SendVerdict(absl::DataLossError("x y"))
                  .ok());
  // Sent is not yet arrived: look until it has (a broken EarlyVerdict fails
  // at the deadline, not here).
  std::optional<absl::Status> verdict;
  const absl::Time deadline = Deadline();
  while (!(verdict = out.EarlyVerdict()).has_value() &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_TRUE(verdict.has_value());
  EXPECT_EQ(verdict->code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(verdict->message(), "x y");
}

TEST_F(SlotStreamTest, NoVerdictWhenTheTargetCloses) {
  target_ = DataSocket();
  const absl::Status verdict = SlotStream(&sender_, Deadline()).AwaitVerdict();
  EXPECT_EQ(verdict.code(), absl::StatusCode::kUnavailable) << verdict;
  EXPECT_THAT(verdict.message(), HasSubstr("no verdict"));
}

TEST_F(SlotStreamTest, DrainLetsTheSenderFinishAndHearTheVerdict) {
  // More than loopback buffers hold, so the sender finishes only if the
  // target, having failed, reads and drops the rest.
  const PageLayout layout{16, 4, 64, DType::kF32};
  constexpr int64_t kSlots = 8192;  // 16 MiB of keys and values
  std::vector<std::byte> a = PatternArena(layout, kSlots / 16);
  std::vector<PageId> pages(kSlots / 16);
  std::iota(pages.begin(), pages.end(), 0);
  absl::Status sent, verdict;
  std::thread sender([&] {
    SlotStream out(&sender_, Deadline());
    SlotSpans spans;
    HostSlotSpans(a.data(), layout, pages, 0, kSlots, &spans);
    sent = out.SendChunk(ChunkOf(0, 0, kSlots, spans));
    verdict = out.AwaitVerdict();
    sender_ = DataSocket();  // the sender hangs up, ending the drain
  });
  SlotStream in(&target_, Deadline());
  const absl::Status told =
      in.SendVerdict(absl::InvalidArgumentError("refused"));
  EXPECT_TRUE(told.ok()) << told;
  in.Drain();
  sender.join();
  EXPECT_TRUE(sent.ok()) << sent;
  EXPECT_EQ(verdict.code(), absl::StatusCode::kInvalidArgument) << verdict;
  EXPECT_EQ(verdict.message(), "refused");
}

// ---------------------------------------------------------------------------
// DataSocket

class DataSocketTest : public ConnectedPairTest {};

TEST_F(DataSocketTest, BytesGoBothWays) {
  ASSERT_TRUE(SendBytes(sender_, "to the target", Deadline()).ok());
  ASSERT_TRUE(SendBytes(target_, "to the sender", Deadline()).ok());
  absl::StatusOr<std::string> got = ReceiveBytes(target_, 13, Deadline());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "to the target");
  got = ReceiveBytes(sender_, 13, Deadline());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "to the sender");
}

TEST_F(DataSocketTest, ManyPiecesInAndOut) {
  // More pieces than one sendmsg or readv takes (IOV_MAX, 1024 on Linux),
  // of odd sizes that differ between the two sides.
  std::vector<char> src(3000 * 7);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<char>(i * 31);
  std::vector<char> dst(src.size());
  auto cut = [](std::vector<char>& buffer, size_t period) {
    std::vector<iovec> pieces;
    size_t at = 0;
    for (size_t i = 0; at < buffer.size(); ++i) {
      const size_t n = std::min<size_t>(1 + i % period, buffer.size() - at);
      pieces.push_back({buffer.data() + at, n});
      at += n;
    }
    return pieces;
  };
  std::vector<iovec> out = cut(src, 13);
  std::vector<iovec> in = cut(dst, 11);
  ASSERT_GT(out.size(), 2000u);
  ASSERT_GT(in.size(), 2000u);
  absl::Status sent;
  std::thread t([&] { sent = sender_.Send(out, Deadline()); });
  const absl::Status received = target_.Receive(in, Deadline());
  t.join();
  ASSERT_TRUE(sent.ok()) << sent;
  ASSERT_TRUE(received.ok()) << received;
  EXPECT_TRUE(src == dst);
  // Both advanced their pieces in place: all of them are used up.
  for (const iovec& v : out) EXPECT_EQ(v.iov_len, 0u);
  for (const iovec& v : in) EXPECT_EQ(v.iov_len, 0u);
}

TEST_F(DataSocketTest, ReceiveDeadline) {
  std::byte b[1];
  iovec v{b, 1};
  const absl::Status s = target_.Receive({&v, 1}, ShortDeadline());
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
}

TEST_F(DataSocketTest, SendDeadlineWhenNobodyReads) {
  std::vector<std::byte> big(size_t{64} << 20);
  iovec v{big.data(), big.size()};
  const absl::Status s = sender_.Send({&v, 1}, ShortDeadline());
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
}

TEST_F(DataSocketTest, ReceiveAfterThePeerCloses) {
  target_ = DataSocket();
  std::byte b[1];
  iovec v{b, 1};
  const absl::Status s = sender_.Receive({&v, 1}, Deadline());
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
}

TEST_F(DataSocketTest, SendAfterThePeerClosesFailsWithoutSignal) {
  target_ = DataSocket();
  // The first sends may still be taken by the kernel; the peer's reset
  // fails a later one (as a status: no SIGPIPE ends the process).
  std::vector<std::byte> chunk(size_t{1} << 20);
  absl::Status s;
  for (int i = 0; i < 1000 && s.ok(); ++i) {
    iovec v{chunk.data(), chunk.size()};
    s = sender_.Send({&v, 1}, Deadline());
  }
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
}

TEST_F(DataSocketTest, ShutdownWakesABlockedReceive) {
  absl::Status s;
  std::thread t([&] {
    std::byte b[1];
    iovec v{b, 1};
    s = target_.Receive({&v, 1}, Deadline());
  });
  absl::SleepFor(absl::Milliseconds(100));  // most likely blocked by now
  target_.Shutdown();
  t.join();
  EXPECT_FALSE(s.ok());
  // And every later call fails at once.
  EXPECT_FALSE(SendBytes(target_, "x", Deadline()).ok());
  std::byte b[1];
  iovec v{b, 1};
  EXPECT_FALSE(target_.Receive({&v, 1}, Deadline()).ok());
}

TEST_F(DataSocketTest, Readable) {
  EXPECT_FALSE(target_.Readable());
  ASSERT_TRUE(SendBytes(sender_, "r", Deadline()).ok());
  const absl::Time deadline = Deadline();
  while (!target_.Readable() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_TRUE(target_.Readable());
  absl::StatusOr<std::string> got = ReceiveBytes(target_, 1, Deadline());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "r");
  EXPECT_FALSE(target_.Readable());
}

TEST_F(DataSocketTest, MovesCarryTheConnection) {
  EXPECT_FALSE(DataSocket().valid());
  DataSocket moved(std::move(target_));
  EXPECT_TRUE(moved.valid());
  EXPECT_FALSE(target_.valid());  // NOLINT(bugprone-use-after-move)
  ASSERT_TRUE(SendBytes(sender_, "m", Deadline()).ok());
  absl::StatusOr<std::string> got = ReceiveBytes(moved, 1, Deadline());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "m");
  // Assigning over a socket closes the one it held.
  moved = DataSocket();
  EXPECT_FALSE(moved.valid());
  std::byte b[1];
  iovec v{b, 1};
  EXPECT_EQ(sender_.Receive({&v, 1}, Deadline()).code(),
            absl::StatusCode::kUnavailable);
}

TEST(DataSocketOwnershipTest, TakesOwnershipOfItsDescriptor) {
  int fds[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
  { DataSocket owned(fds[0]); }
  // The other end sees the close (end of file), so the descriptor is gone.
  char c;
  EXPECT_EQ(read(fds[1], &c, 1), 0);
  close(fds[1]);
}

TEST(DataSocketConnectTest, NothingListening) {
  // A port bound and not listening: nothing accepts there, and nothing else
  // can take the port while this socket holds it.
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const int port = ntohs(addr.sin_port);
  absl::StatusOr<DataSocket> s =
      DataSocket::Connect("127.0.0.1", port, Deadline());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kUnavailable) << s.status();
  EXPECT_THAT(s.status().message(),
              HasSubstr(absl::StrCat("127.0.0.1:", port)));
  close(fd);
}

// ---------------------------------------------------------------------------
// TcpTransport

class TcpTransportTest : public testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<TcpTransport>> t =
        TcpTransport::Listen("127.0.0.1:0");
    ASSERT_TRUE(t.ok()) << t.status();
    transport_ = *std::move(t);
  }

  // A connection to the transport that has sent a hello with `ticket`.
  absl::StatusOr<DataSocket> Present(absl::string_view ticket) {
    absl::StatusOr<DataSocket> s =
        DataSocket::Connect("127.0.0.1", transport_->port(), Deadline());
    if (!s.ok()) return s.status();
    if (absl::Status h = SlotStream(&*s, Deadline()).SendHello(ticket);
        !h.ok()) {
      return h;
    }
    return s;
  }

  // Whether the transport took `connector`'s hello: OK once welcomed,
  // UNAVAILABLE once closed.
  static absl::Status Welcomed(DataSocket& connector) {
    return SlotStream(&connector, Deadline()).AwaitWelcome(Deadline());
  }

  std::unique_ptr<TcpTransport> transport_;
};

TEST_F(TcpTransportTest, ListensOnAPort) { EXPECT_GT(transport_->port(), 0); }

TEST_F(TcpTransportTest, TicketsAreSixteenDistinctBytes) {
  std::set<std::string> seen;
  for (int i = 0; i < 100; ++i) {
    const std::string ticket = transport_->Expect();
    EXPECT_EQ(ticket.size(), SlotStream::kTicketBytes);
    EXPECT_EQ(ticket.size(), 16u);
    seen.insert(ticket);
  }
  EXPECT_EQ(seen.size(), 100u);
}

TEST_F(TcpTransportTest, WelcomeWireForm) {
  const std::string ticket = transport_->Expect();
  absl::StatusOr<DataSocket> connector = Present(ticket);
  ASSERT_TRUE(connector.ok()) << connector.status();
  absl::StatusOr<std::string> wire = ReceiveBytes(*connector, 4, Deadline());
  ASSERT_TRUE(wire.ok()) << wire.status();
  EXPECT_EQ(*wire, "KVKA");
  EXPECT_TRUE(transport_->Await(ticket, Deadline()).ok());
}

TEST_F(TcpTransportTest, AwaitHandsOverTheConnectionThatPresentsTheTicket) {
  const std::string ticket = transport_->Expect();
  absl::StatusOr<DataSocket> connector = Present(ticket);
  ASSERT_TRUE(connector.ok()) << connector.status();
  const absl::Status welcome = Welcomed(*connector);
  EXPECT_TRUE(welcome.ok()) << welcome;
  absl::StatusOr<DataSocket> accepted = transport_->Await(ticket, Deadline());
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  ASSERT_TRUE(SendBytes(*connector, "page bytes", Deadline()).ok());
  absl::StatusOr<std::string> got = ReceiveBytes(*accepted, 10, Deadline());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "page bytes");
  ASSERT_TRUE(SendBytes(*accepted, "verdict", Deadline()).ok());
  got = ReceiveBytes(*connector, 7, Deadline());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "verdict");
}

TEST_F(TcpTransportTest, AwaitBeforeTheConnectionComes) {
  const std::string ticket = transport_->Expect();
  absl::StatusOr<DataSocket> accepted = absl::UnknownError("not awaited");
  std::thread waiter([&] { accepted = transport_->Await(ticket, Deadline()); });
  absl::StatusOr<DataSocket> connector = Present(ticket);
  if (!connector.ok()) transport_->Withdraw(ticket);  // end the wait
  waiter.join();
  ASSERT_TRUE(connector.ok()) << connector.status();
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  EXPECT_TRUE(Welcomed(*connector).ok());
  ASSERT_TRUE(SendBytes(*connector, "late", Deadline()).ok());
  absl::StatusOr<std::string> got = ReceiveBytes(*accepted, 4, Deadline());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "late");
}

TEST_F(TcpTransportTest, EachTicketGetsItsOwnConnection) {
  const std::string t1 = transport_->Expect();
  const std::string t2 = transport_->Expect();
  absl::StatusOr<DataSocket> c2 = Present(t2);
  absl::StatusOr<DataSocket> c1 = Present(t1);
  ASSERT_TRUE(c1.ok() && c2.ok());
  EXPECT_TRUE(Welcomed(*c1).ok());
  EXPECT_TRUE(Welcomed(*c2).ok());
  ASSERT_TRUE(SendBytes(*c1, "1", Deadline()).ok());
  ASSERT_TRUE(SendBytes(*c2, "2", Deadline()).ok());
  absl::StatusOr<DataSocket> a1 = transport_->Await(t1, Deadline());
  absl::StatusOr<DataSocket> a2 = transport_->Await(t2, Deadline());
  ASSERT_TRUE(a1.ok() && a2.ok());
  EXPECT_EQ(ReceiveBytes(*a1, 1, Deadline()).value_or("?"), "1");
  EXPECT_EQ(ReceiveBytes(*a2, 1, Deadline()).value_or("?"), "2");
}

TEST_F(TcpTransportTest, UnknownTicketIsClosedAndSatisfiesNoAwait) {
  const std::string ticket = transport_->Expect();
  std::string forged = ticket;
  forged[7] = static_cast<char>(forged[7] ^ 0x20);
  absl::StatusOr<DataSocket> connector = Present(forged);
  ASSERT_TRUE(connector.ok()) << connector.status();
  const absl::Status welcome = Welcomed(*connector);
  EXPECT_EQ(welcome.code(), absl::StatusCode::kUnavailable) << welcome;
  EXPECT_THAT(welcome.message(), HasSubstr("ticket"));
  absl::StatusOr<DataSocket> accepted =
      transport_->Await(ticket, ShortDeadline());
  EXPECT_EQ(accepted.status().code(), absl::StatusCode::kDeadlineExceeded)
      << accepted.status();
}

TEST_F(TcpTransportTest, GarbageIsClosedAndSatisfiesNoAwait) {
  const std::string ticket = transport_->Expect();
  absl::StatusOr<DataSocket> connector =
      DataSocket::Connect("127.0.0.1", transport_->port(), Deadline());
  ASSERT_TRUE(connector.ok()) << connector.status();
  ASSERT_TRUE(
      SendBytes(*connector, "GET / HTTP/1.1\r\nHost: x\r\n\r\n", Deadline())
          .ok());
  std::byte b[1];
  iovec v{b, 1};
  const absl::Status closed = connector->Receive({&v, 1}, Deadline());
  EXPECT_EQ(closed.code(), absl::StatusCode::kUnavailable) << closed;
  absl::StatusOr<DataSocket> accepted =
      transport_->Await(ticket, ShortDeadline());
  EXPECT_EQ(accepted.status().code(), absl::StatusCode::kDeadlineExceeded)
      << accepted.status();
}

TEST_F(TcpTransportTest, SilentConnectionIsClosedAndDoesNotStopOthers) {
  // A connection that never says hello holds the acceptor only for its
  // short limit; the one behind it is then served.
  absl::StatusOr<DataSocket> silent =
      DataSocket::Connect("127.0.0.1", transport_->port(), Deadline());
  ASSERT_TRUE(silent.ok()) << silent.status();
  const std::string ticket = transport_->Expect();
  absl::StatusOr<DataSocket> connector = Present(ticket);
  ASSERT_TRUE(connector.ok()) << connector.status();
  absl::StatusOr<DataSocket> accepted = transport_->Await(ticket, Deadline());
  EXPECT_TRUE(accepted.ok()) << accepted.status();
  EXPECT_TRUE(Welcomed(*connector).ok());
  const absl::Status closed = Welcomed(*silent);
  EXPECT_EQ(closed.code(), absl::StatusCode::kUnavailable) << closed;
}

// With a patience far longer than the test, the order of events shows
// what the acceptor does without timing anything.
class PatientTransportTest : public testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<TcpTransport>> t =
        TcpTransport::Listen("127.0.0.1:0", absl::Hours(1));
    ASSERT_TRUE(t.ok()) << t.status();
    transport_ = *std::move(t);
  }
  absl::StatusOr<DataSocket> Connect() {
    return DataSocket::Connect("127.0.0.1", transport_->port(), Deadline());
  }
  std::unique_ptr<TcpTransport> transport_;
};

// Silent connections (eight, as a port scanner might leave) do not hold up
// a hello behind them: each is read as it comes, not one after another.
TEST_F(PatientTransportTest, SilentConnectionsDoNotHoldUpAHello) {
  std::vector<DataSocket> silent;
  for (int i = 0; i < 8; ++i) {
    absl::StatusOr<DataSocket> s = Connect();
    ASSERT_TRUE(s.ok()) << s.status();
    silent.push_back(*std::move(s));
  }
  const std::string ticket = transport_->Expect();
  absl::StatusOr<DataSocket> connector = Connect();
  ASSERT_TRUE(connector.ok()) << connector.status();
  ASSERT_TRUE(SlotStream(&*connector, Deadline()).SendHello(ticket).ok());
  absl::StatusOr<DataSocket> accepted = transport_->Await(ticket, Deadline());
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  EXPECT_TRUE(
      SlotStream(&*connector, Deadline()).AwaitWelcome(Deadline()).ok());
  for (DataSocket& s : silent) EXPECT_FALSE(s.Readable()) << "still waiting";
}

// A hello that arrives a few bytes at a time is put together.
TEST_F(PatientTransportTest, AHelloInPiecesIsAssembled) {
  const std::string ticket = transport_->Expect();
  absl::StatusOr<DataSocket> connector = Connect();
  ASSERT_TRUE(connector.ok()) << connector.status();
  const std::string hello = "KVKDATA1" + ticket;
  for (size_t at = 0; at < hello.size(); at += 5) {
    ASSERT_TRUE(SendBytes(*connector, hello.substr(at, 5), Deadline()).ok());
    absl::SleepFor(absl::Milliseconds(5));
  }
  absl::StatusOr<DataSocket> accepted = transport_->Await(ticket, Deadline());
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  EXPECT_TRUE(
      SlotStream(&*connector, Deadline()).AwaitWelcome(Deadline()).ok());
}

// At most kMaxPendingHellos connections wait for their hello: one more
// closes the oldest (long before its patience), and a hello still gets in.
TEST_F(PatientTransportTest, TooManySilentConnectionsCloseTheOldest) {
  std::vector<DataSocket> silent;
  for (size_t i = 0; i <= TcpTransport::kMaxPendingHellos; ++i) {
    absl::StatusOr<DataSocket> s = Connect();
    ASSERT_TRUE(s.ok()) << s.status();
    silent.push_back(*std::move(s));
  }
  std::byte b[1];
  iovec v{b, 1};
  const absl::Status closed = silent.front().Receive({&v, 1}, Deadline());
  EXPECT_EQ(closed.code(), absl::StatusCode::kUnavailable) << closed;
  EXPECT_FALSE(silent.back().Readable()) << "the newest still waits";
  const std::string ticket = transport_->Expect();
  absl::StatusOr<DataSocket> connector = Connect();
  ASSERT_TRUE(connector.ok()) << connector.status();
  ASSERT_TRUE(SlotStream(&*connector, Deadline()).SendHello(ticket).ok());
  absl::StatusOr<DataSocket> accepted = transport_->Await(ticket, Deadline());
  EXPECT_TRUE(accepted.ok()) << accepted.status();
}

TEST_F(TcpTransportTest, WithdrawBeforeAnyConnectionCancelsTheAwait) {
  const std::string ticket = transport_->Expect();
  absl::StatusOr<DataSocket> accepted = absl::UnknownError("not awaited");
  std::thread waiter([&] { accepted = transport_->Await(ticket, Deadline()); });
  // Whether the waiter is waiting yet or not, the ticket is still expected:
  // its Await cannot end before the 30 s deadline unless withdrawn.
  EXPECT_TRUE(transport_->Withdraw(ticket));
  waiter.join();
  EXPECT_EQ(accepted.status().code(), absl::StatusCode::kCancelled)
      << accepted.status();
  // Withdrawn is spent: a connection presenting it now is closed.
  absl::StatusOr<DataSocket> connector = Present(ticket);
  ASSERT_TRUE(connector.ok()) << connector.status();
  EXPECT_EQ(Welcomed(*connector).code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(transport_->Withdraw(ticket));
}

TEST_F(TcpTransportTest, WithdrawAfterAwaitReturned) {
  const std::string timed_out = transport_->Expect();
  EXPECT_EQ(transport_->Await(timed_out, ShortDeadline()).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_FALSE(transport_->Withdraw(timed_out));

  const std::string used = transport_->Expect();
  absl::StatusOr<DataSocket> connector = Present(used);
  ASSERT_TRUE(connector.ok()) << connector.status();
  EXPECT_TRUE(Welcomed(*connector).ok());
  absl::StatusOr<DataSocket> accepted = transport_->Await(used, Deadline());
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  EXPECT_FALSE(transport_->Withdraw(used));
  // The connection handed over is the caller's, untouched by the withdraw.
  ASSERT_TRUE(SendBytes(*connector, "ok", Deadline()).ok());
  EXPECT_EQ(ReceiveBytes(*accepted, 2, Deadline()).value_or("?"), "ok");
}

TEST_F(TcpTransportTest, TicketIsSpentAfterAwait) {
  const std::string ticket = transport_->Expect();
  absl::StatusOr<DataSocket> first = Present(ticket);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<DataSocket> accepted = transport_->Await(ticket, Deadline());
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  absl::StatusOr<DataSocket> second = Present(ticket);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(Welcomed(*second).code(), absl::StatusCode::kUnavailable);
  // And a second Await finds nothing to wait for.
  EXPECT_FALSE(transport_->Await(ticket, ShortDeadline()).ok());
}

TEST_F(TcpTransportTest, TicketIsSpentAfterAwaitTimedOut) {
  const std::string ticket = transport_->Expect();
  EXPECT_EQ(transport_->Await(ticket, ShortDeadline()).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  absl::StatusOr<DataSocket> late = Present(ticket);
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_EQ(Welcomed(*late).code(), absl::StatusCode::kUnavailable);
}

TEST_F(TcpTransportTest, SecondConnectionWithTheSameTicketIsClosed) {
  const std::string ticket = transport_->Expect();
  absl::StatusOr<DataSocket> first = Present(ticket);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(Welcomed(*first).ok());
  absl::StatusOr<DataSocket> second = Present(ticket);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(Welcomed(*second).code(), absl::StatusCode::kUnavailable);
  absl::StatusOr<DataSocket> accepted = transport_->Await(ticket, Deadline());
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  ASSERT_TRUE(SendBytes(*first, "1st", Deadline()).ok());
  EXPECT_EQ(ReceiveBytes(*accepted, 3, Deadline()).value_or("?"), "1st");
}

TEST_F(TcpTransportTest, DestroyingTheTransportCancelsAWaitingAwait) {
  const std::string ticket = transport_->Expect();
  absl::StatusOr<DataSocket> accepted = absl::UnknownError("not awaited");
  TcpTransport* transport = transport_.get();
  std::thread waiter([&] { accepted = transport->Await(ticket, Deadline()); });
  absl::SleepFor(absl::Milliseconds(200));  // let it wait
  transport_.reset();
  waiter.join();
  EXPECT_EQ(accepted.status().code(), absl::StatusCode::kCancelled)
      << accepted.status();
}

TEST_F(TcpTransportTest, ConnectionsWaitingForTheirAwaitAreClosedWithIt) {
  const std::string ticket = transport_->Expect();
  absl::StatusOr<DataSocket> connector = Present(ticket);
  ASSERT_TRUE(connector.ok()) << connector.status();
  EXPECT_TRUE(Welcomed(*connector).ok());  // held for its Await
  transport_.reset();
  std::byte b[1];
  iovec v{b, 1};
  EXPECT_EQ(connector->Receive({&v, 1}, Deadline()).code(),
            absl::StatusCode::kUnavailable);
}

TEST(TcpTransportListenTest, BadAddresses) {
  absl::StatusOr<std::unique_ptr<TcpTransport>> t =
      TcpTransport::Listen("nonsense");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument)
      << t.status();
  EXPECT_THAT(t.status().message(), HasSubstr("nonsense"));

  t = TcpTransport::Listen("127.0.0.1:not-a-port");
  EXPECT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(), HasSubstr("127.0.0.1:not-a-port"));
}

TEST(TcpTransportListenTest, PortInUse) {
  absl::StatusOr<std::unique_ptr<TcpTransport>> first =
      TcpTransport::Listen("127.0.0.1:0");
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string address = absl::StrCat("127.0.0.1:", (*first)->port());
  absl::StatusOr<std::unique_ptr<TcpTransport>> second =
      TcpTransport::Listen(address);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable)
      << second.status();
  EXPECT_THAT(second.status().message(), HasSubstr(address));
}

// ---------------------------------------------------------------------------
// TargetHost

TEST(TargetHostTest, HostsOfTcpTargets) {
  EXPECT_EQ(TargetHost("10.0.0.1:50051"), "10.0.0.1");
  EXPECT_EQ(TargetHost("[::1]:5"), "::1");
  EXPECT_EQ(TargetHost("dns:///kvkeep-decode:50051"), "kvkeep-decode");
  EXPECT_EQ(TargetHost("dns:///[::1]:50051"), "::1");
  EXPECT_EQ(TargetHost("ipv4:127.0.0.1:9"), "127.0.0.1");
  EXPECT_EQ(TargetHost("ipv6:[::1]:9"), "::1");
  EXPECT_EQ(TargetHost("localhost:1"), "localhost");
  EXPECT_EQ(TargetHost("localhost"), "localhost");  // gRPC's default port
  // A DNS server named in the authority is not the target.
  EXPECT_EQ(TargetHost("dns://8.8.8.8/kvkeep-decode:5"), "kvkeep-decode");
  // Of a list of addresses, the first.
  EXPECT_EQ(TargetHost("ipv4:1.2.3.4:5,5.6.7.8:6"), "1.2.3.4");
  EXPECT_EQ(TargetHost("::1"), "::1");  // a bare IPv6 address, no port
}

TEST(TargetHostTest, NoHostForUnixSockets) {
  EXPECT_EQ(TargetHost("unix:/tmp/s"), std::nullopt);
  EXPECT_EQ(TargetHost("unix:///tmp/s"), std::nullopt);
  EXPECT_EQ(TargetHost("unix-abstract:kvkeep"), std::nullopt);
}

}  // namespace
}  // namespace kvkeep
