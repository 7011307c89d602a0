#include "services/kvkeepd/session_transfer.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <memory>
#include <optional>
#include <thread>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "services/common/crc32c.h"
#include "services/common/grpc_status.h"

namespace kvkeep {
namespace {

// Checksums and copies move this many bytes of keys (and as many of
// values) at a time, so a piece is still in the core's cache when the
// next pass over it comes.
constexpr size_t kPassBytes = 128 << 10;
// How long a target waits at most for pages that come beside the stream
// (joining an NCCL link and each run of slots; the data socket's connection
// and chunks), when the call's own deadline is later or unset.
constexpr absl::Duration kSidePatience = absl::Minutes(5);
// How long a sender tries to connect to the target's data socket at most
// before giving up on it (and sending chunk messages, unless tcp was
// required).
constexpr absl::Duration kConnectPatience = absl::Seconds(10);

// Field tags (field number << 3 | wire type) of the messages ChunkMessage
// and ReadChunk handle by hand.
constexpr uint8_t kVarint = 0, kFixed64 = 1, kLength = 2, kFixed32 = 5;
constexpr uint8_t Tag(int field, uint8_t wire_type) {
  return static_cast<uint8_t>(field << 3 | wire_type);
}
// TransferMessage
constexpr uint8_t kHeaderTag = Tag(2, kLength);
constexpr uint8_t kChunkTag = Tag(3, kLength);
constexpr uint8_t kCommitTag = Tag(4, kVarint);
// TransferChunk
constexpr uint8_t kLayerTag = Tag(1, kVarint);
constexpr uint8_t kFirstSlotTag = Tag(2, kVarint);
constexpr uint8_t kKeysTag = Tag(3, kLength);
constexpr uint8_t kValuesTag = Tag(4, kLength);
constexpr uint8_t kCrcTag = Tag(5, kFixed32);
// The framing before the keys: the chunk's tag and length, layer,
// first_slot, and the keys' tag and length, at most.
constexpr size_t kMaxPrefixBytes = (1 + 10) * 5;

size_t VarintBytes(uint64_t v) {
  size_t n = 1;
  for (; v >= 0x80; v >>= 7) ++n;
  return n;
}

std::byte* PutVarint(std::byte* p, uint64_t v) {
  for (; v >= 0x80; v >>= 7) *p++ = static_cast<std::byte>(v | 0x80);
  *p++ = static_cast<std::byte>(v);
  return p;
}

// Bytes of a length-delimited field of `n` bytes, with its tag and length.
size_t LengthFieldBytes(uint64_t n) { return 1 + VarintBytes(n) + n; }

// A cursor over a message's slices, for ReadChunk.
class SliceReader {
 public:
  explicit SliceReader(const std::vector<grpc::Slice>& slices)
      : slices_(slices) {
    for (const grpc::Slice& s : slices) left_ += s.size();
    Settle();
  }
  size_t left() const { return left_; }

  bool ReadVarint(uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (left_ == 0) return false;
      const uint8_t b = At();
      Advance(1);
      *v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  }
  bool ReadFixed32(uint32_t* v) {
    if (left_ < 4) return false;
    *v = 0;
    for (int i = 0; i < 4; ++i) {
      *v |= static_cast<uint32_t>(At()) << (8 * i);
      Advance(1);
    }
    return true;
  }
  // Skips `n` bytes, appending the pieces they lie in to `pieces` if given.
  bool Take(uint64_t n, std::vector<std::span<const std::byte>>* pieces) {
    if (n > left_) return false;
    while (n > 0) {
      const grpc::Slice& s = slices_[slice_];
      const size_t here = std::min<uint64_t>(n, s.size() - offset_);
      if (pieces != nullptr) {
        pieces->emplace_back(
            reinterpret_cast<const std::byte*>(s.begin()) + offset_, here);
      }
      Advance(here);
      n -= here;
    }
    return true;
  }

 private:
  uint8_t At() const { return slices_[slice_].begin()[offset_]; }
  void Advance(size_t n) {
    offset_ += n;
    left_ -= n;
    Settle();
  }
  // Moves past spent (and empty) slices.
  void Settle() {
    while (slice_ < slices_.size() && offset_ == slices_[slice_].size()) {
      ++slice_;
      offset_ = 0;
    }
  }

  const std::vector<grpc::Slice>& slices_;
  size_t slice_ = 0;
  size_t offset_ = 0;
  size_t left_ = 0;
};

// Skips a field of `wire_type` whose tag was read; false for groups
// (deprecated; left to protobuf) and malformed input.
bool SkipField(SliceReader& in, uint8_t wire_type) {
  uint64_t v;
  switch (wire_type) {
    case kVarint:
      return in.ReadVarint(&v);
    case kFixed64:
      return in.Take(8, nullptr);
    case kLength:
      return in.ReadVarint(&v) && in.Take(v, nullptr);
    case kFixed32:
      return in.Take(4, nullptr);
    default:
      return false;
  }
}

size_t TotalBytes(const std::vector<std::span<const std::byte>>& pieces) {
  size_t n = 0;
  for (const auto& p : pieces) n += p.size();
  return n;
}

// Walks a list of pieces (ChunkView's keys or values) from the front.
class Pieces {
 public:
  explicit Pieces(const std::vector<std::span<const std::byte>>& pieces)
      : pieces_(pieces) {
    Settle();
  }
  // The rest of the current piece.
  std::span<const std::byte> contiguous() const {
    return index_ < pieces_.size() ? pieces_[index_].subspan(offset_)
                                   : std::span<const std::byte>();
  }
  void Skip(size_t n) {
    offset_ += n;
    Settle();
  }
  // Copies the next out.size() bytes, across pieces.
  void Gather(std::span<std::byte> out) {
    while (!out.empty()) {
      const std::span<const std::byte> here =
          contiguous().first(std::min(out.size(), contiguous().size()));
      std::memcpy(out.data(), here.data(), here.size());
      out = out.subspan(here.size());
      Skip(here.size());
    }
  }

 private:
  void Settle() {
    while (index_ < pieces_.size() && offset_ == pieces_[index_].size()) {
      ++index_;
      offset_ = 0;
    }
  }
  const std::vector<std::span<const std::byte>>& pieces_;
  size_t index_ = 0;
  size_t offset_ = 0;
};

// Pages that arrive beside the gRPC stream (over NCCL or a data socket):
// the receiving thread and what it did.
struct SideReceive {
  std::string transport;  // "nccl" or "tcp"
  std::thread thread;
  bool joined = false;                           // by the reactor
  CacheStore::PendingImport* pending = nullptr;  // owned by the reactor
  std::unique_ptr<NcclChannel> channel;          // nccl
  std::string ticket;                            // tcp
  // tcp: the connection while the thread uses it, so that an abandoning
  // reactor can shut it down.
  absl::Mutex mu;
  bool cancelled ABSL_GUARDED_BY(mu) = false;
  DataSocket* socket ABSL_GUARDED_BY(mu) = nullptr;
  // It failed on its own, before any cancel.
  bool failed_first ABSL_GUARDED_BY(mu) = false;
  // The thread's; read once it is joined.
  absl::Status status;
  int64_t bytes = 0;
};

// Larger chunks for a pool in device memory are refused: each is staged in
// host memory whole.
constexpr int64_t kMaxStagedChunkBytes = int64_t{64} << 20;

// Every resident slot of every layer into the reserved pages, chunk by
// chunk as the sender's headers say, each checked against its CRC32C.
absl::Status ReceiveChunks(SlotStream& stream, SideReceive& receive,
                           const std::vector<int64_t>& resident) {
  std::vector<std::byte> staging;  // device pools only
  for (size_t l = 0; l < resident.size(); ++l) {
    const int32_t layer = static_cast<int32_t>(l);
    for (int64_t done = 0; done < resident[l];) {
      absl::StatusOr<SlotStream::ChunkHeader> header =
          stream.ReceiveChunkHeader();
      if (!header.ok()) return header.status();
      if (header->layer != layer || header->first != done ||
          header->slots < 1 || header->slots > resident[l] - done) {
        return absl::InvalidArgumentError(absl::StrCat(
            "data socket: a chunk of layer ", header->layer, " slots [",
            header->first, ", +", header->slots, ") where layer ", layer,
            " slot ", done, " (of ", resident[l], ") was due"));
      }
      absl::Status s = receive.pending->Fill(
          layer, header->slots,
          [&](PageMemory& memory, const PageLayout& page_layout,
              std::span<const PageId> pages, int64_t first,
              int64_t n) -> absl::Status {
            SlotSpans spans;
            receive.bytes += 2 * n * page_layout.token_bytes();
            if (std::byte* arena = memory.host_data(); arena != nullptr) {
              HostSlotSpans(arena, page_layout, pages, first, n, &spans);
              return stream.ReceiveChunk(*header, spans);
            }
            const int64_t bytes = n * page_layout.token_bytes();
            if (2 * bytes > kMaxStagedChunkBytes) {
              return absl::InvalidArgumentError(
                  absl::StrCat("data socket: a chunk of ", 2 * bytes,
                               " bytes; a device pool takes at most ",
                               kMaxStagedChunkBytes));
            }
            staging.resize(static_cast<size_t>(2 * bytes));
            const std::span<std::byte> all(staging);
            spans.keys.push_back(all.first(bytes));
            spans.values.push_back(all.subspan(bytes));
            if (absl::Status r = stream.ReceiveChunk(*header, spans); !r.ok()) {
              return r;
            }
            return memory.WriteSlots(page_layout, pages, first, n,
                                     staging.data(), staging.data() + bytes);
          });
      if (!s.ok()) return s;
      done += header->slots;
    }
  }
  return absl::OkStatus();
}

// The receiving thread of a data-socket transfer: waits for the sender's
// connection, takes every chunk, and answers with the verdict.
absl::Status ReceiveOverSocket(TcpTransport& tcp, SideReceive& receive,
                               const std::vector<int64_t>& resident,
                               absl::Time deadline) {
  absl::StatusOr<DataSocket> socket = tcp.Await(receive.ticket, deadline);
  if (!socket.ok()) return socket.status();
  {
    absl::MutexLock lock(&receive.mu);
    if (receive.cancelled) {
      return absl::CancelledError("the transfer was abandoned");
    }
    receive.socket = &*socket;
  }
  SlotStream stream(&*socket, deadline);
  const absl::Status s = ReceiveChunks(stream, receive, resident);
  if (!s.ok()) {
    // Before the verdict, on which the sender cancels the call.
    absl::MutexLock lock(&receive.mu);
    receive.failed_first = !receive.cancelled;
  }
  if (stream.SendVerdict(s).ok() && !s.ok()) stream.Drain();
  absl::MutexLock lock(&receive.mu);
  receive.socket = nullptr;
  return s;
}

// The ReceiveSession reactor over TransferMessage/TransferReply (as
// generated) or over their bytes (a raw method; chunks are read in place).
template <typename Request, typename Response>
class ReceiveReactor final : public grpc::ServerBidiReactor<Request, Response> {
  static constexpr bool kRaw = std::is_same_v<Request, grpc::ByteBuffer>;
  using Base = grpc::ServerBidiReactor<Request, Response>;

 public:
  ReceiveReactor(CacheStore* store, TransferLog* log,
                 grpc::CallbackServerContext* ctx, Authenticator authenticate,
                 bool tenants_configured, TransferObserver observer,
                 NcclTransport* nccl, TcpTransport* tcp)
      : store_(store),
        log_(log),
        tenants_configured_(tenants_configured),
        observer_(std::move(observer)),
        nccl_(nccl),
        tcp_(tcp),
        deadline_(std::min(absl::FromChrono(ctx->deadline()),
                           absl::Now() + kSidePatience)),
        start_(absl::Now()) {
    absl::StatusOr<std::string> tenant = authenticate(*ctx);
    if (!tenant.ok()) {
      Finish(ToGrpcStatus(tenant.status()));
      return;
    }
    tenant_ = *std::move(tenant);
    this->StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      // The sender went away before committing: the reservation goes back
      // as `pending_` is destroyed.
      Abandon(absl::StatusCode::kCancelled);
      Finish(grpc::Status(grpc::StatusCode::CANCELLED,
                          "the transfer ended before its commit"));
      return;
    }
    absl::Status s = Handle();
    if (!s.ok()) {
      Abandon(s.code());
      pending_.reset();
      Finish(ToGrpcStatus(s));
      return;
    }
    if (reply_ready_) {
      reply_ready_ = false;
      if constexpr (kRaw) {
        bool own = false;
        response_.Clear();  // the serializer writes into an empty buffer
        // A small, valid message: serializing it cannot fail.
        static_cast<void>(
            grpc::SerializationTraits<v1::TransferReply>::Serialize(
                reply_, &response_, &own));
        this->StartWrite(&response_);
      } else {
        this->StartWrite(&reply_);
      }
    } else {
      this->StartRead(&request_);
    }
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the sender went away"));
      return;
    }
    if (reply_.phase() == v1::TransferReply::COMMITTED) {
      Finish(grpc::Status::OK);
      return;
    }
    this->StartRead(&request_);
  }

  void OnDone() override {
    // A no-op unless the call ended without a commit.
    Abandon(end_code_ == absl::StatusCode::kOk ? absl::StatusCode::kCancelled
                                               : end_code_);
    if (observer_ && started_ && !reported_) {
      observer_(TransferReport{
          receive_ != nullptr ? receive_->transport : "host",
          /*outgoing=*/false, committed_ ? absl::StatusCode::kOk : end_code_,
          bytes_, absl::Now() - start_});
    }
    delete this;
  }

 private:
  void Finish(const grpc::Status& status) {
    end_code_ = static_cast<absl::StatusCode>(status.error_code());
    Base::Finish(status);
  }

  absl::Status Handle() {
    if constexpr (kRaw) {
      absl::StatusOr<std::optional<ChunkView>> chunk = ReadChunk(request_);
      if (!chunk.ok()) return chunk.status();
      if (chunk->has_value()) return Chunk(**chunk);
      v1::TransferMessage message;
      if (!grpc::SerializationTraits<v1::TransferMessage>::Deserialize(
               &request_, &message)
               .ok()) {
        return absl::InvalidArgumentError("a malformed transfer message");
      }
      return Handle(message);
    } else {
      return Handle(request_);
    }
  }

  absl::Status Handle(const v1::TransferMessage& message) {
    switch (message.kind_case()) {
      case v1::TransferMessage::kHeader:
        return Header(message);
      case v1::TransferMessage::kChunk: {
        const v1::TransferChunk& c = message.chunk();
        ChunkView view;
        view.layer = c.layer();
        view.first_slot = c.first_slot();
        view.crc32c = c.crc32c();
        view.keys.push_back(std::as_bytes(std::span(c.keys())));
        view.values.push_back(std::as_bytes(std::span(c.values())));
        return Chunk(view);
      }
      case v1::TransferMessage::kCommit:
        return Commit();
      default:
        return absl::InvalidArgumentError("an empty transfer message");
    }
  }

  absl::Status Header(const v1::TransferMessage& message) {
    if (started_) {
      return absl::InvalidArgumentError("a transfer has one header");
    }
    started_ = true;
    transfer_id_ = message.transfer_id();
    if (transfer_id_.empty()) {
      return absl::InvalidArgumentError("a transfer needs a transfer_id");
    }
    if (log_->Contains(transfer_id_)) {  // a retry of a committed transfer
      return Reply(v1::TransferReply::COMMITTED);
    }
    absl::StatusOr<SessionSnapshot> snapshot = StateFromProto(message.header());
    if (!snapshot.ok()) return snapshot.status();
    if (tenants_configured_ && snapshot->tenant != tenant_) {
      return absl::PermissionDeniedError(
          absl::StrCat("the session belongs to tenant '", snapshot->tenant,
                       "'; this token is tenant '", tenant_, "'s"));
    }
    for (const LayoutStats& l : store_->Layouts()) {
      if (l.layout.name == snapshot->layout) {
        token_bytes_ =
            static_cast<size_t>(l.layout.page_layout().token_bytes());
      }
    }
    std::vector<int64_t> resident;
    for (const LayerSnapshot& l : snapshot->layers) {
      resident.push_back(l.resident());
    }
    const std::string layout = snapshot->layout;
    absl::StatusOr<std::unique_ptr<CacheStore::PendingImport>> pending =
        store_->PrepareImport(*std::move(snapshot));
    if (!pending.ok()) return pending.status();
    pending_ = *std::move(pending);
    reply_.set_transport("host");
    if (message.has_nccl()) {
      absl::Status s = AcceptNccl(message.nccl(), layout, resident);
      if (!s.ok() && message.nccl().required()) return s;
    }
    if (receive_ == nullptr && message.has_tcp()) {
      absl::Status s = AcceptTcp(layout, std::move(resident));
      if (!s.ok() && message.tcp().required()) return s;
    }
    return Reply(v1::TransferReply::READY);
  }

  // Takes an NCCL offer: the pages then arrive over the link, on a thread
  // of their own (joining the communicator waits for the sender, who joins
  // once it reads READY), and the commit waits for them.
  absl::Status AcceptNccl(const v1::NcclOffer& offer, const std::string& layout,
                          std::vector<int64_t> resident) {
    if (nccl_ == nullptr) {
      return absl::FailedPreconditionError(
          "this store does not take NCCL transfers");
    }
    absl::StatusOr<PageMemory*> memory = store_->MemoryOf(layout);
    if (!memory.ok()) return memory.status();
    if (absl::Status s = nccl_->Accept(offer, **memory); !s.ok()) return s;
    auto receive = std::make_shared<SideReceive>();
    receive->transport = "nccl";
    receive->pending = pending_.get();
    receive->thread = std::thread([receive, offer,
                                   resident = std::move(resident), nccl = nccl_,
                                   memory = *memory, deadline = deadline_] {
      absl::StatusOr<std::unique_ptr<NcclChannel>> channel =
          nccl->Join(offer, memory->device().ordinal, deadline);
      if (!channel.ok()) {
        receive->status = channel.status();
        return;
      }
      receive->channel = *std::move(channel);
      for (size_t l = 0; l < resident.size() && receive->status.ok(); ++l) {
        for (int64_t first = 0; first < resident[l] && receive->status.ok();
             first += offer.chunk_slots()) {
          const int64_t n = std::min(offer.chunk_slots(), resident[l] - first);
          receive->status = receive->pending->Fill(
              static_cast<int32_t>(l), n,
              [&](PageMemory& m, const PageLayout& layout,
                  std::span<const PageId> pages, int64_t at, int64_t count) {
                receive->bytes += 2 * count * layout.token_bytes();
                return receive->channel->Move(m, layout, pages, at, count);
              });
        }
      }
    });
    receive_ = std::move(receive);
    reply_.set_transport("nccl");
    return absl::OkStatus();
  }

  // Takes a data-socket offer: the pages then arrive over the connection
  // that presents the ticket READY carries, on a thread of their own, and
  // the commit waits for them (the sender commits only after the verdict
  // that they all arrived).
  absl::Status AcceptTcp(const std::string& layout,
                         std::vector<int64_t> resident) {
    if (tcp_ == nullptr) {
      return absl::FailedPreconditionError(
          "this store has no data socket (its transfer_listen is off)");
    }
    auto receive = std::make_shared<SideReceive>();
    receive->transport = "tcp";
    receive->pending = pending_.get();
    receive->ticket = tcp_->Expect();
    receive->thread = std::thread([receive, resident = std::move(resident),
                                   tcp = tcp_, transfer_id = transfer_id_,
                                   deadline = deadline_] {
      receive->status = ReceiveOverSocket(*tcp, *receive, resident, deadline);
      if (!receive->status.ok()) {
        receive->status = absl::Status(
            receive->status.code(), absl::StrCat("transfer ", transfer_id, ": ",
                                                 receive->status.message()));
      }
    });
    reply_.set_transport("tcp");
    reply_.set_data_port(tcp_->port());
    reply_.set_data_ticket(receive->ticket);
    receive_ = std::move(receive);
    return absl::OkStatus();
  }

  // Ends a side receive that will not be committed: its thread is stopped
  // (a data socket shut down) and joined off gRPC's thread (the transport
  // waits for that before the service goes), and then the reservation goes
  // back. The transfer is reported then, ended with `code`, or with the
  // receive's own failure if that came first (a corrupted chunk on the data
  // socket, whose sender then cancels the call).
  void Abandon(absl::StatusCode code) {
    if (receive_ == nullptr || receive_->joined) return;
    receive_->joined = true;
    if (receive_->transport == "tcp") {
      tcp_->Withdraw(receive_->ticket);
      absl::MutexLock lock(&receive_->mu);
      receive_->cancelled = true;
      if (receive_->socket != nullptr) receive_->socket->Shutdown();
    }
    auto pending = std::make_shared<std::unique_ptr<CacheStore::PendingImport>>(
        std::move(pending_));
    TransferObserver observer = started_ ? observer_ : nullptr;
    reported_ = true;
    auto cleanup = [receive = receive_, pending, observer, code,
                    start = start_] {
      receive->thread.join();
      if (receive->channel != nullptr) receive->channel->Done(false);
      pending->reset();
      if (observer) {
        const bool failed_first = [&] {
          absl::MutexLock lock(&receive->mu);
          return receive->failed_first;
        }();
        observer(TransferReport{receive->transport, /*outgoing=*/false,
                                failed_first ? receive->status.code() : code,
                                receive->bytes, absl::Now() - start});
      }
    };
    if (receive_->transport == "tcp") {
      tcp_->RunAside(std::move(cleanup));
    } else {
      nccl_->RunAside(std::move(cleanup));
    }
  }

  // A data-socket receive whose sender sent chunk messages (or the commit)
  // instead, having never connected: it ends, and the chunks are taken as
  // messages. False if the sender did connect.
  bool FellBackFromTcp() {
    if (receive_->transport != "tcp" || !tcp_->Withdraw(receive_->ticket)) {
      return false;
    }
    receive_->joined = true;
    receive_->thread.join();  // its Await returns at once
    receive_.reset();
    return true;
  }

  // Writes the chunk into the reserved pages a slot range at a time,
  // checksumming each range just before it is copied (so the bytes are read
  // from memory once), and then checks the checksum: a corrupted chunk
  // fails the transfer, whose pages are freed unseen.
  absl::Status Chunk(const ChunkView& chunk) {
    if (pending_ == nullptr) {
      return absl::FailedPreconditionError("a chunk before the header");
    }
    if (receive_ != nullptr && !FellBackFromTcp()) {
      return absl::FailedPreconditionError(
          absl::StrCat("a chunk message in a transfer that moves its pages "
                       "over ",
                       receive_->transport));
    }
    const size_t kv_bytes = TotalBytes(chunk.keys);
    if (kv_bytes != TotalBytes(chunk.values) || token_bytes_ == 0 ||
        kv_bytes % token_bytes_ != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "transfer ", transfer_id_, ": layer ", chunk.layer, " slot ",
          chunk.first_slot, ": ", kv_bytes, " key and ",
          TotalBytes(chunk.values), " value bytes are not whole tokens of ",
          token_bytes_, " bytes each"));
    }
    Pieces keys(chunk.keys);
    Pieces values(chunk.values);
    uint32_t keys_crc = 0;
    uint32_t values_crc = 0;
    for (size_t done = 0; done < kv_bytes;) {
      std::span<const std::byte> k = keys.contiguous();
      std::span<const std::byte> v = values.contiguous();
      size_t n = std::min({k.size(), v.size(), kPassBytes, kv_bytes - done});
      n -= n % token_bytes_;
      if (n == 0) {  // a token split between two slices: gather it
        straddle_.resize(2 * token_bytes_);
        const std::span<std::byte> buffer(straddle_);
        keys.Gather(buffer.first(token_bytes_));
        values.Gather(buffer.subspan(token_bytes_));
        k = buffer.first(token_bytes_);
        v = buffer.subspan(token_bytes_);
        n = token_bytes_;
      } else {
        keys.Skip(n);
        values.Skip(n);
      }
      keys_crc = Crc32c(keys_crc, k.first(n));
      values_crc = Crc32c(values_crc, v.first(n));
      if (absl::Status s = pending_->Write(chunk.layer, k.first(n), v.first(n));
          !s.ok()) {
        return s;
      }
      done += n;
    }
    if (Crc32cCombine(keys_crc, values_crc, kv_bytes) != chunk.crc32c) {
      return absl::DataLossError(absl::StrCat(
          "transfer ", transfer_id_, ": layer ", chunk.layer, " slot ",
          chunk.first_slot, ": the chunk's CRC32C does not match its bytes"));
    }
    bytes_ += static_cast<int64_t>(2 * kv_bytes);
    return absl::OkStatus();
  }

  absl::Status Commit() {
    if (pending_ == nullptr) {
      return absl::FailedPreconditionError("a commit before the header");
    }
    if (receive_ != nullptr && !FellBackFromTcp()) {
      // The sender commits once its sends completed (over tcp: once the
      // target's verdict said every slot arrived); the receives finish
      // moments later. This waits on gRPC's thread, for that short while.
      receive_->joined = true;
      receive_->thread.join();
      bytes_ = receive_->bytes;
      if (!receive_->status.ok()) return receive_->status;
    }
    absl::StatusOr<SessionId> id = store_->CommitImport(std::move(pending_));
    if (receive_ != nullptr && receive_->channel != nullptr) {
      receive_->channel->Done(id.ok());
    }
    if (!id.ok()) return id.status();
    log_->Add(transfer_id_, *id);
    committed_ = true;
    return Reply(v1::TransferReply::COMMITTED);
  }

  absl::Status Reply(v1::TransferReply::Phase phase) {
    reply_.set_phase(phase);
    reply_ready_ = true;
    return absl::OkStatus();
  }

  CacheStore* const store_;
  TransferLog* const log_;
  const bool tenants_configured_;
  const TransferObserver observer_;
  NcclTransport* const nccl_;  // may be null
  TcpTransport* const tcp_;    // may be null
  const absl::Time deadline_;  // for the NCCL link and the data socket
  const absl::Time start_;
  int64_t bytes_ = 0;
  bool committed_ = false;
  bool reported_ = false;  // to the observer, by Abandon's cleanup
  absl::StatusCode end_code_ = absl::StatusCode::kOk;
  std::string tenant_;
  std::string transfer_id_;
  bool started_ = false;
  size_t token_bytes_ = 0;  // one token's keys (or values) in one layer
  std::unique_ptr<CacheStore::PendingImport> pending_;
  std::shared_ptr<SideReceive> receive_;
  std::vector<std::byte> straddle_;  // one token's keys and values
  Request request_;
  v1::TransferReply reply_;
  Response response_;  // reply_'s bytes (raw); unused otherwise
  bool reply_ready_ = false;
};

// One ReceiveSession call from the sender's side, over raw bytes. The
// sending thread drives it and waits for what it needs; gRPC's callbacks
// record what happened and start each queued write as the one before it
// is done. A hold keeps the call until the sender is done issuing
// operations. Thread-safe.
class TransferCall final
    : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  // Starts the call (its answer comes with the first reply).
  static std::shared_ptr<TransferCall> Start(grpc::GenericStub& stub,
                                             const SendOptions& options) {
    std::shared_ptr<TransferCall> call(new TransferCall);
    {
      absl::MutexLock lock(&call->mu_);
      call->self_ = call;
    }
    if (options.deadline != absl::InfiniteFuture()) {
      call->ctx_.set_deadline(absl::ToChronoTime(options.deadline));
    }
    if (!options.target_token.empty()) {
      call->ctx_.AddMetadata("authorization", "Bearer " + options.target_token);
    }
    stub.PrepareBidiStreamingCall(
        &call->ctx_,
        absl::StrCat("/", v1::KvKeep::service_full_name(), "/ReceiveSession"),
        grpc::StubOptions(), call.get());
    call->AddHold();
    call->StartCall();
    return call;
  }

  // Queues `message` behind those before it. The one on the wire starts
  // the next as it is done, on gRPC's thread, so building chunks and
  // writing them to the socket run on different threads; Write blocks while
  // kQueued wait. False, without queueing, if the stream broke or the
  // target ended the call (a reply asked for has come, or the call ended).
  bool Write(grpc::ByteBuffer message) ABSL_LOCKS_EXCLUDED(mu_) {
    mu_.LockWhen(absl::Condition(this, &TransferCall::Writable));
    if (Ended()) {
      mu_.Unlock();
      return false;
    }
    if (writing_) {
      queue_.push_back(std::move(message));
      mu_.Unlock();
      return true;
    }
    writing_ = true;
    write_ = std::move(message);
    mu_.Unlock();
    StartWrite(&write_);
    return true;
  }
  // Whether the stream broke or the target ended the call already.
  bool Broken() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return Ended();
  }

  // Asks for the target's next reply, which AwaitReply waits for.
  void StartReading() ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      reading_ = true;
      read_asked_ = true;
    }
    StartRead(&read_);
  }
  // The reply asked for, or nullopt if the call ended instead.
  std::optional<v1::TransferReply> AwaitReply() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_, absl::Condition(this, &TransferCall::Replied));
    read_asked_ = false;
    return std::exchange(reply_, std::nullopt);
  }

  // Ends the call from this side: cancels it, or (once the queued writes
  // are done) half-closes it and lets the target answer; then waits for its
  // status.
  grpc::Status Finish(bool cancel) ABSL_LOCKS_EXCLUDED(mu_) {
    if (cancel) {
      ctx_.TryCancel();
    } else {
      mu_.LockWhen(absl::Condition(this, &TransferCall::Written));
      mu_.Unlock();
      StartWritesDone();
    }
    RemoveHold();
    absl::MutexLock lock(&mu_, absl::Condition(&done_));
    return status_;
  }

  void OnWriteDone(bool ok) override ABSL_LOCKS_EXCLUDED(mu_) {
    mu_.Lock();
    write_.Clear();
    if (ok && !queue_.empty()) {
      // writing_ stays set: Write queues behind this one, and nothing else
      // touches write_ until its OnWriteDone.
      write_ = std::move(queue_.front());
      queue_.pop_front();
      mu_.Unlock();
      StartWrite(&write_);
      return;
    }
    if (!ok) {
      broken_ = true;
      queue_.clear();
    }
    writing_ = false;
    mu_.Unlock();
  }
  void OnReadDone(bool ok) override ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    reading_ = false;
    v1::TransferReply reply;
    if (ok && grpc::SerializationTraits<v1::TransferReply>::Deserialize(&read_,
                                                                        &reply)
                  .ok()) {
      reply_ = std::move(reply);
    } else {
      broken_ = true;
    }
  }
  void OnDone(const grpc::Status& status) override ABSL_LOCKS_EXCLUDED(mu_) {
    std::shared_ptr<TransferCall> self;
    {
      absl::MutexLock lock(&mu_);
      status_ = status;
      done_ = true;
      self = std::move(self_);
    }
    // `self` may be the last reference: the call ends here.
  }

 private:
  static constexpr size_t kQueued = 2;

  TransferCall() = default;
  bool Ended() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return broken_ || (!reading_ && read_asked_);
  }
  bool Writable() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return queue_.size() < kQueued || Ended();
  }
  bool Written() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !writing_; }
  bool Replied() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !reading_; }

  grpc::ClientContext ctx_;
  absl::Mutex mu_;
  std::shared_ptr<TransferCall> self_ ABSL_GUARDED_BY(mu_);  // until OnDone
  // The message on the wire, and those after it.
  grpc::ByteBuffer write_ ABSL_GUARDED_BY(mu_);
  std::deque<grpc::ByteBuffer> queue_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ByteBuffer read_;  // the reply being read (gRPC's until OnReadDone)
  bool reading_ ABSL_GUARDED_BY(mu_) = false;
  // A reply was asked for and not yet awaited.
  bool read_asked_ ABSL_GUARDED_BY(mu_) = false;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<v1::TransferReply> reply_ ABSL_GUARDED_BY(mu_);
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
};

grpc::ByteBuffer Serialize(const v1::TransferMessage& message) {
  grpc::ByteBuffer out;
  bool own = false;
  // Fails only past 2 GiB, far beyond any message sent here.
  static_cast<void>(grpc::SerializationTraits<v1::TransferMessage>::Serialize(
      message, &out, &own));
  return out;
}

// A chunk as its message would carry it (with the CRC32C of its bytes),
// after the test-only fault hook has had it.
v1::TransferChunk FaultedChunk(const SendOptions& options, int64_t index,
                               int32_t layer, int64_t first,
                               const SlotSpans& spans) {
  v1::TransferChunk chunk;
  chunk.set_layer(layer);
  chunk.set_first_slot(first);
  uint32_t crc = 0;
  for (auto [side, out] : {std::pair{&spans.keys, chunk.mutable_keys()},
                           std::pair{&spans.values, chunk.mutable_values()}}) {
    for (std::span<const std::byte> piece : *side) {
      crc = Crc32c(crc, piece);
      out->append(reinterpret_cast<const char*>(piece.data()), piece.size());
    }
  }
  chunk.set_crc32c(crc);
  options.fault(index, chunk);
  return chunk;
}

// The target's data socket, connected and told which transfer it carries.
absl::StatusOr<DataSocket> ConnectData(const SendOptions& options,
                                       const v1::TransferReply& ready) {
  const std::optional<std::string> host = TargetHost(options.target);
  if (!host.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the target ", options.target, " has no TCP host for a data socket"));
  }
  const absl::Time patience =
      std::min(options.deadline, absl::Now() + kConnectPatience);
  absl::StatusOr<DataSocket> socket =
      DataSocket::Connect(*host, ready.data_port(), patience);
  if (!socket.ok()) return socket.status();
  SlotStream stream(&*socket, options.deadline);
  if (absl::Status s = stream.SendHello(ready.data_ticket()); !s.ok()) {
    return s;
  }
  // A store behind the same address that is not the target (a load
  // balancer's other replica) turns the ticket away: not connected.
  if (absl::Status s = stream.AwaitWelcome(patience); !s.ok()) return s;
  return socket;
}

// Every resident slot over the data socket, a chunk at a time, straight from
// the pages when `options.spans` says where they are; then the target's
// verdict. `bytes` counts what was sent.
absl::Status SendOverSocket(const SessionSnapshot& snapshot,
                            const SlotReader& read, const SendOptions& options,
                            DataSocket& socket, int64_t* bytes) {
  SlotStream stream(&socket, options.deadline);
  const int64_t token_bytes = options.token_bytes;
  const int64_t slots_per_chunk =
      std::max<int64_t>(1, options.chunk_bytes / (2 * token_bytes));
  std::vector<std::byte> buffer;  // without `spans`: a chunk read out
  int64_t chunk_index = 0;
  std::optional<absl::Status> verdict;  // once the target has sent it
  for (size_t l = 0; l < snapshot.layers.size(); ++l) {
    const int32_t layer = static_cast<int32_t>(l);
    const int64_t resident = snapshot.layers[l].resident();
    for (int64_t first = 0; first < resident; first += slots_per_chunk) {
      const int64_t n = std::min(slots_per_chunk, resident - first);
      SlotSpans spans;
      if (options.spans) {
        if (absl::Status s = options.spans(layer, first, n, &spans); !s.ok()) {
          return s;
        }
      } else {
        buffer.resize(static_cast<size_t>(2 * n * token_bytes));
        const std::span<std::byte> all(buffer);
        spans.keys.push_back(all.first(n * token_bytes));
        spans.values.push_back(all.subspan(n * token_bytes));
        if (absl::Status s =
                read(layer, first, n, spans.keys[0], spans.values[0]);
            !s.ok()) {
          return s;
        }
      }
      // The fault hook sees the chunk as a message would carry it; what it
      // leaves is sent, with the checksum it leaves.
      v1::TransferChunk faulty;
      std::optional<uint32_t> claimed;
      if (options.fault) {
        faulty = FaultedChunk(options, chunk_index, layer, first, spans);
        claimed = faulty.crc32c();
        spans.keys = {
            std::as_writable_bytes(std::span(*faulty.mutable_keys()))};
        spans.values = {
            std::as_writable_bytes(std::span(*faulty.mutable_values()))};
      }
      ++chunk_index;
      if (verdict.has_value()) {  // an OK verdict, and yet a chunk to send
        return absl::InternalError(
            "the target's verdict came before the last chunk");
      }
      absl::Status s = stream.SendChunk(layer, first, n, spans, claimed);
      // A target that failed says why before it stops reading.
      verdict = stream.EarlyVerdict();
      if (verdict.has_value() && !verdict->ok()) return *verdict;
      if (!s.ok()) return s;
      *bytes += 2 * n * token_bytes;
    }
  }
  return verdict.has_value() ? *verdict : stream.AwaitVerdict();
}

}  // namespace

ChunkMessage::ChunkMessage(int32_t layer, int64_t first_slot, int64_t kv_bytes)
    : layer_(layer),
      first_slot_(first_slot),
      kv_bytes_(static_cast<size_t>(kv_bytes)),
      keys_at_(kMaxPrefixBytes) {
  // [room for the prefix][keys][values' tag and length][values][crc]
  values_at_ = keys_at_ + kv_bytes_ + 1 + VarintBytes(kv_bytes_);
  buffer_.reset(new std::byte[values_at_ + kv_bytes_ + 5]);
}

grpc::ByteBuffer ChunkMessage::Finish(uint32_t crc32c) && {
  // proto3 leaves out fields holding their default (zero, empty), and
  // protobuf writes fields in field-number order: so do we.
  const uint64_t layer = static_cast<uint64_t>(static_cast<int64_t>(layer_));
  const uint64_t first_slot = static_cast<uint64_t>(first_slot_);
  size_t chunk_bytes = 0;
  if (layer != 0) chunk_bytes += 1 + VarintBytes(layer);
  if (first_slot != 0) chunk_bytes += 1 + VarintBytes(first_slot);
  if (kv_bytes_ != 0) chunk_bytes += 2 * LengthFieldBytes(kv_bytes_);
  if (crc32c != 0) chunk_bytes += 1 + 4;

  std::byte prefix[kMaxPrefixBytes];
  std::byte* p = prefix;
  *p++ = std::byte{kChunkTag};
  p = PutVarint(p, chunk_bytes);
  if (layer != 0) {
    p = PutVarint(p, kLayerTag);
    p = PutVarint(p, layer);
  }
  if (first_slot != 0) {
    p = PutVarint(p, kFirstSlotTag);
    p = PutVarint(p, first_slot);
  }
  std::byte* buffer = buffer_.get();
  size_t end = keys_at_;
  if (kv_bytes_ != 0) {
    p = PutVarint(p, kKeysTag);
    p = PutVarint(p, kv_bytes_);
    std::byte* q = buffer + keys_at_ + kv_bytes_;
    *q++ = std::byte{kValuesTag};
    PutVarint(q, kv_bytes_);
    end = values_at_ + kv_bytes_;
  }
  if (crc32c != 0) {
    buffer[end++] = std::byte{kCrcTag};
    for (int i = 0; i < 4; ++i) {
      buffer[end++] = static_cast<std::byte>(crc32c >> (8 * i));
    }
  }
  const size_t prefix_bytes = static_cast<size_t>(p - prefix);
  const size_t begin = keys_at_ - prefix_bytes;
  std::memcpy(buffer + begin, prefix, prefix_bytes);
  // The slice owns the buffer from here; gRPC frees it once it is sent.
  grpc::Slice slice(
      buffer + begin, end - begin,
      [](void* b) { delete[] static_cast<std::byte*>(b); }, buffer);
  buffer_.release();
  return grpc::ByteBuffer(&slice, 1);
}

absl::StatusOr<std::optional<ChunkView>> ReadChunk(
    const grpc::ByteBuffer& message) {
  ChunkView view;
  if (!message.Dump(&view.slices).ok()) {
    return absl::InvalidArgumentError("an unreadable transfer message");
  }
  const auto malformed = [] {
    return absl::InvalidArgumentError("a malformed transfer message");
  };
  SliceReader in(view.slices);
  bool chunk = false;
  while (in.left() > 0) {
    uint64_t tag;
    if (!in.ReadVarint(&tag) || tag >> 3 == 0) return malformed();
    const uint8_t wire_type = tag & 7;
    if (tag == kHeaderTag || tag == kCommitTag || wire_type == 3 ||
        wire_type == 4) {
      return std::nullopt;  // not a chunk, or not one read here
    }
    if (tag != kChunkTag) {  // transfer_id, or a field newer than us
      if (!SkipField(in, wire_type)) return malformed();
      continue;
    }
    if (chunk) return std::nullopt;  // protobuf would merge the two
    chunk = true;
    uint64_t chunk_bytes;
    if (!in.ReadVarint(&chunk_bytes) || chunk_bytes > in.left()) {
      return malformed();
    }
    const size_t end = in.left() - chunk_bytes;
    while (in.left() > end) {
      uint64_t field;
      uint64_t v;
      if (!in.ReadVarint(&field) || field >> 3 == 0) return malformed();
      if (field == kLayerTag) {
        if (!in.ReadVarint(&v)) return malformed();
        view.layer = static_cast<int32_t>(v);
      } else if (field == kFirstSlotTag) {
        if (!in.ReadVarint(&v)) return malformed();
        view.first_slot = static_cast<int64_t>(v);
      } else if (field == kKeysTag || field == kValuesTag) {
        auto& pieces = field == kKeysTag ? view.keys : view.values;
        pieces.clear();  // a repeated field: the last one counts
        if (!in.ReadVarint(&v) || !in.Take(v, &pieces)) return malformed();
      } else if (field == kCrcTag) {
        if (!in.ReadFixed32(&view.crc32c)) return malformed();
      } else if ((field & 7) == 3 || (field & 7) == 4) {
        return std::nullopt;
      } else if (!SkipField(in, field & 7)) {
        return malformed();
      }
      if (in.left() < end) return malformed();  // overran the chunk
    }
  }
  if (!chunk) return std::nullopt;
  return view;
}

void StateToProto(const SessionSnapshot& s, v1::SessionState* out) {
  out->set_session_id(SessionName(s.id));
  out->set_layout(s.layout);
  out->set_policy(s.policy.name);
  for (const auto& [k, v] : s.policy.params) {
    (*out->mutable_policy_params())[k] = v;
  }
  out->set_tenant(s.tenant);
  out->set_last_position(s.last_position);
  out->set_compressed(s.compressed);
  out->set_evicted_tokens(s.work.evicted_tokens);
  out->set_evicted_score(s.work.evicted_score);
  out->set_score_updates(s.work.score_updates);
  out->set_evictions(s.work.evictions);
  for (const LayerSnapshot& l : s.layers) {
    v1::LayerState* p = out->add_layers();
    p->mutable_positions()->Add(l.position.begin(), l.position.end());
    p->mutable_arrivals()->Add(l.arrival.begin(), l.arrival.end());
    p->mutable_scores()->Add(l.score.begin(), l.score.end());
    p->mutable_history()->Add(l.history.begin(), l.history.end());
    p->set_appended(l.appended);
    p->set_version(l.version);
    p->set_budget(l.budget);
  }
}

absl::StatusOr<SessionSnapshot> StateFromProto(const v1::SessionState& p) {
  const std::optional<SessionId> id = ParseSessionName(p.session_id());
  if (!id.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "session_id '", p.session_id(), "' is not a kvkeep session id"));
  }
  SessionSnapshot s;
  s.id = *id;
  s.layout = p.layout();
  s.policy.name = p.policy();
  for (const auto& [k, v] : p.policy_params()) s.policy.params[k] = v;
  s.tenant = p.tenant();
  s.last_position = p.last_position();
  s.compressed = p.compressed();
  s.work.evicted_tokens = p.evicted_tokens();
  s.work.evicted_score = p.evicted_score();
  s.work.score_updates = p.score_updates();
  s.work.evictions = p.evictions();
  for (const v1::LayerState& l : p.layers()) {
    LayerSnapshot layer;
    layer.position.assign(l.positions().begin(), l.positions().end());
    layer.arrival.assign(l.arrivals().begin(), l.arrivals().end());
    layer.score.assign(l.scores().begin(), l.scores().end());
    layer.history.assign(l.history().begin(), l.history().end());
    layer.appended = l.appended();
    layer.version = l.version();
    layer.budget = l.budget();
    s.layers.push_back(std::move(layer));
  }
  return s;
}

void TransferLog::Add(const std::string& transfer_id, SessionId id) {
  absl::MutexLock lock(&mu_);
  if (!ids_.emplace(transfer_id, id).second) return;
  order_.push_back(transfer_id);
  while (order_.size() > capacity_) {
    ids_.erase(order_.front());
    order_.pop_front();
  }
}

bool TransferLog::Contains(const std::string& transfer_id) const {
  absl::MutexLock lock(&mu_);
  return ids_.contains(transfer_id);
}

SendResult SendSession(const SessionSnapshot& snapshot, const SlotReader& read,
                       const SendOptions& options) {
  SendResult result;
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  args.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  // Bulk bytes: large HTTP/2 frames and a deep flow-control window, so a
  // chunk is a few writes rather than hundreds of 16 KiB frames.
  args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 16 << 20);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 20);
  args.SetInt(GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE, 16 << 20);
  grpc::GenericStub stub(grpc::CreateCustomChannel(
      options.target, grpc::InsecureChannelCredentials(), args));
  const std::shared_ptr<TransferCall> call = TransferCall::Start(stub, options);
  bool commit_sent = false;
  auto end = [&](absl::string_view what) {
    const grpc::Status s = call->Finish(/*cancel=*/false);
    result.status = s.ok() ? absl::UnavailableError(absl::StrCat(
                                 "transfer to ", options.target, ": ", what))
                           : FromGrpcStatus(s);
    // Only a broken stream leaves a sent commit's fate open; a refusal is
    // the target's own answer.
    const absl::StatusCode code = result.status.code();
    result.in_doubt =
        commit_sent && (code == absl::StatusCode::kUnavailable ||
                        code == absl::StatusCode::kCancelled ||
                        code == absl::StatusCode::kDeadlineExceeded ||
                        code == absl::StatusCode::kUnknown ||
                        code == absl::StatusCode::kInternal);
    return result;
  };

  v1::TransferMessage header;
  header.set_transfer_id(options.transfer_id);
  StateToProto(snapshot, header.mutable_header());
  if (options.nccl_offer.has_value()) {
    *header.mutable_nccl() = *options.nccl_offer;
  }
  if (options.tcp_offer)
    header.mutable_tcp()->set_required(options.tcp_required);
  if (!call->Write(Serialize(header))) {
    return end("the target did not answer the header");
  }
  call->StartReading();
  std::optional<v1::TransferReply> reply = call->AwaitReply();
  if (!reply.has_value()) return end("the target did not answer the header");
  if (reply->phase() == v1::TransferReply::COMMITTED) {  // a retry
    result.status = FromGrpcStatus(call->Finish(/*cancel=*/false));
    result.in_doubt = !result.status.ok();
    return result;
  }
  // From here a reply is always asked for: the next one is the commit's,
  // and an early end (the target refused a chunk) stops the sending.
  call->StartReading();
  std::unique_ptr<NcclChannel> channel;
  if (reply->transport() == "nccl") {
    if (!options.nccl_offer.has_value()) {
      static_cast<void>(call->Finish(/*cancel=*/true));
      result.status = absl::InternalError(
          "the target chose NCCL, which this sender did not offer");
      return result;
    }
    result.transport = "nccl";
    absl::StatusOr<std::unique_ptr<NcclChannel>> connected =
        options.nccl_connect();
    if (!connected.ok()) {
      static_cast<void>(call->Finish(/*cancel=*/true));
      result.status = connected.status();
      return result;
    }
    channel = *std::move(connected);
  }
  std::optional<DataSocket> socket;
  if (reply->transport() == "tcp") {
    if (!options.tcp_offer) {
      static_cast<void>(call->Finish(/*cancel=*/true));
      result.status = absl::InternalError(
          "the target chose tcp, which this sender did not offer");
      return result;
    }
    absl::StatusOr<DataSocket> connected = ConnectData(options, *reply);
    if (connected.ok()) {
      socket = *std::move(connected);
      result.transport = "tcp";
    } else if (options.tcp_required) {
      static_cast<void>(call->Finish(/*cancel=*/true));
      result.status = absl::Status(
          connected.status().code(),
          absl::StrCat("transport 'tcp': ", connected.status().message()));
      return result;
    }
    // Otherwise the chunks go as messages, which the target takes instead.
  }
  const size_t token_bytes = static_cast<size_t>(options.token_bytes);
  const int64_t slots_per_chunk =
      std::max<int64_t>(1, options.chunk_bytes / (2 * options.token_bytes));
  const int64_t slots_per_pass = std::max<int64_t>(1, kPassBytes / token_bytes);
  int64_t chunk_index = 0;
  // The pages go over NCCL, in runs of the offer's size, over the data
  // socket, or as chunk messages.
  if (socket.has_value()) {
    if (absl::Status s =
            SendOverSocket(snapshot, read, options, *socket, &result.bytes);
        !s.ok()) {
      static_cast<void>(call->Finish(/*cancel=*/true));
      result.status = s;
      return result;
    }
  } else if (channel != nullptr) {
    for (size_t l = 0; l < snapshot.layers.size(); ++l) {
      const int64_t run = options.nccl_offer->chunk_slots();
      const int64_t resident = snapshot.layers[l].resident();
      for (int64_t first = 0; first < resident; first += run) {
        const int64_t n = std::min(run, resident - first);
        if (absl::Status s =
                options.nccl_move(*channel, static_cast<int32_t>(l), first, n);
            !s.ok()) {
          channel->Done(false);
          static_cast<void>(call->Finish(/*cancel=*/true));
          result.status = s;
          return result;
        }
        result.bytes += 2 * n * options.token_bytes;
      }
    }
  } else {
    for (size_t l = 0; l < snapshot.layers.size(); ++l) {
      const LayerSnapshot& layer = snapshot.layers[l];
      const int32_t layer_index = static_cast<int32_t>(l);
      for (int64_t first = 0; first < layer.resident();
           first += slots_per_chunk) {
        const int64_t n = std::min(slots_per_chunk, layer.resident() - first);
        ChunkMessage m(layer_index, first, n * options.token_bytes);
        // A pass at a time, so its checksum reads the bytes from cache.
        uint32_t keys_crc = 0;
        uint32_t values_crc = 0;
        for (int64_t i = 0; i < n; i += slots_per_pass) {
          const int64_t count = std::min(slots_per_pass, n - i);
          const std::span<std::byte> keys =
              m.keys().subspan(i * token_bytes, count * token_bytes);
          const std::span<std::byte> values =
              m.values().subspan(i * token_bytes, count * token_bytes);
          if (absl::Status s =
                  read(layer_index, first + i, count, keys, values);
              !s.ok()) {
            static_cast<void>(call->Finish(/*cancel=*/true));
            result.status = s;
            return result;
          }
          keys_crc = Crc32c(keys_crc, keys);
          values_crc = Crc32c(values_crc, values);
        }
        const uint32_t crc =
            Crc32cCombine(keys_crc, values_crc, n * options.token_bytes);
        grpc::ByteBuffer bytes;
        if (options.fault) {
          v1::TransferMessage faulty;
          *faulty.mutable_chunk() =
              FaultedChunk(options, chunk_index, layer_index, first,
                           SlotSpans{{m.keys()}, {m.values()}});
          bytes = Serialize(faulty);
        } else {
          bytes = std::move(m).Finish(crc);
        }
        ++chunk_index;
        result.bytes += 2 * n * options.token_bytes;
        if (!call->Write(std::move(bytes))) {
          return end("the target stopped taking chunks");
        }
      }
    }
  }
  if (call->Broken()) return end("the target stopped taking chunks");
  v1::TransferMessage commit;
  commit.set_commit(true);
  // From here the outcome may be unknown: a commit that fails to send may
  // still have reached the target.
  commit_sent = true;
  if (!call->Write(Serialize(commit))) {
    return end("the stream broke at the commit");
  }
  reply = call->AwaitReply();
  const bool committed =
      reply.has_value() && reply->phase() == v1::TransferReply::COMMITTED;
  if (channel != nullptr) channel->Done(committed);
  if (!committed) return end("no answer to the commit");
  result.status = FromGrpcStatus(call->Finish(/*cancel=*/false));
  result.in_doubt = !result.status.ok();
  return result;
}

grpc::ServerBidiReactor<v1::TransferMessage, v1::TransferReply>*
NewReceiveReactor(CacheStore* store, TransferLog* log,
                  grpc::CallbackServerContext* ctx, Authenticator authenticate,
                  bool tenants_configured, TransferObserver observer,
                  NcclTransport* nccl, TcpTransport* tcp) {
  return new ReceiveReactor<v1::TransferMessage, v1::TransferReply>(
      store, log, ctx, std::move(authenticate), tenants_configured,
      std::move(observer), nccl, tcp);
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>*
NewRawReceiveReactor(CacheStore* store, TransferLog* log,
                     grpc::CallbackServerContext* ctx,
                     Authenticator authenticate, bool tenants_configured,
                     TransferObserver observer, NcclTransport* nccl,
                     TcpTransport* tcp) {
  return new ReceiveReactor<grpc::ByteBuffer, grpc::ByteBuffer>(
      store, log, ctx, std::move(authenticate), tenants_configured,
      std::move(observer), nccl, tcp);
}

int ReceiveSessionMethodIndex() {
  // The generated code numbers a service's methods as the .proto lists them.
  return google::protobuf::DescriptorPool::generated_pool()
      ->FindServiceByName(v1::KvKeep::service_full_name())
      ->FindMethodByName("ReceiveSession")
      ->index();
}

grpc::internal::MethodHandler* RawReceiveSessionHandler(
    std::function<grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>*(
        grpc::CallbackServerContext*)>
        make) {
  return new grpc::internal::CallbackBidiHandler<grpc::ByteBuffer,
                                                 grpc::ByteBuffer>(
      std::move(make));
}

}  // namespace kvkeep
