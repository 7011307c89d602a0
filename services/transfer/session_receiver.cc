#include "services/transfer/session_receiver.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"
#include "services/common/crc32c.h"
#include "services/common/grpc_status.h"
#include "services/transfer/chunk_wire.h"
#include "services/transfer/session_state.h"

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

size_t TotalBytes(const std::vector<std::span<const std::byte>>& pieces) {
  size_t n = 0;
  for (const auto& p : pieces) n += p.size();
  return n;
}

// Key and value bytes of slots [first, first + n) of a layer as they travel:
// kivi_int4's keys are the whole key blocks of the pages the slots touch.
int64_t SlotRunBytes(const PageLayout& layout, int64_t first, int64_t n) {
  return layout.key_run_bytes(first, n) + n * layout.token_bytes();
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
  Transport transport = Transport::kTcp;  // kNccl or kTcp
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
      absl::StatusOr<Chunk> header = stream.ReceiveChunkHeader();
      if (!header.ok()) return header.status();
      if (header->layer != layer || header->first_slot != done ||
          header->slots < 1 || header->slots > resident[l] - done) {
        return absl::InvalidArgumentError(absl::StrCat(
            "data socket: a chunk of layer ", header->layer, " slots [",
            header->first_slot, ", +", header->slots, ") where layer ", layer,
            " slot ", done, " (of ", resident[l], ") was due"));
      }
      absl::Status s = receive.pending->Fill(
          layer, header->slots,
          [&](PageMemory& memory, const PageLayout& page_layout,
              std::span<const PageId> pages, int64_t first,
              int64_t n) -> absl::Status {
            SlotSpans spans;
            if (IsKivi(page_layout.dtype) &&
                first % page_layout.page_tokens != 0) {
              return absl::InvalidArgumentError(absl::StrCat(
                  "data socket: a kivi_int4 chunk of layer ", layer,
                  " starts at slot ", first,
                  ", not on a page's first slot (its key blocks move whole)"));
            }
            receive.bytes += SlotRunBytes(page_layout, first, n);
            if (std::byte* arena = memory.host_data(); arena != nullptr) {
              HostSlotSpans(arena, page_layout, pages, first, n, &spans);
              return stream.ReceiveChunk(*header, spans);
            }
            const int64_t bytes = SlotRunBytes(page_layout, first, n);
            if (bytes > kMaxStagedChunkBytes) {
              return absl::InvalidArgumentError(
                  absl::StrCat("data socket: a chunk of ", bytes,
                               " bytes; a device pool takes at most ",
                               kMaxStagedChunkBytes));
            }
            const int64_t key_bytes = page_layout.key_run_bytes(first, n);
            staging.resize(static_cast<size_t>(bytes));
            const std::span<std::byte> all(staging);
            spans.keys.push_back(all.first(key_bytes));
            spans.values.push_back(all.subspan(key_bytes));
            if (absl::Status r = stream.ReceiveChunk(*header, spans); !r.ok()) {
              return r;
            }
            return memory.WriteSlots(page_layout, pages, first, n,
                                     staging.data(),
                                     staging.data() + key_bytes);
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

// The ReceiveSession reactor, over the messages' bytes: chunks are read in
// place (chunk_wire.h), everything else is parsed as generated.
class ReceiveReactor final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
  using Base = grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>;

 public:
  ReceiveReactor(CacheStore* store, TransferLog* log,
                 grpc::CallbackServerContext* ctx,
                 absl::StatusOr<std::string> tenant, bool tenants_configured,
                 TransferObserver observer, NcclTransport* nccl,
                 TcpTransport* tcp, std::string replica)
      : store_(store),
        log_(log),
        tenants_configured_(tenants_configured),
        observer_(std::move(observer)),
        nccl_(nccl),
        tcp_(tcp),
        replica_(std::move(replica)),
        deadline_(std::min(absl::FromChrono(ctx->deadline()),
                           absl::Now() + kSidePatience)),
        start_(absl::Now()) {
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
      bool own = false;
      response_.Clear();  // the serializer writes into an empty buffer
      // A small, valid message: serializing it cannot fail.
      static_cast<void>(grpc::SerializationTraits<v1::TransferReply>::Serialize(
          reply_, &response_, &own));
      this->StartWrite(&response_);
    } else {
      this->StartRead(&request_);
    }
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the sender went away"));
      return;
    }
    if (reply_.phase() == v1::TransferReply::COMMITTED || resolving_) {
      Finish(grpc::Status::OK);
      return;
    }
    this->StartRead(&request_);
  }

  void OnDone() override {
    // A no-op unless the call ended without a commit.
    Abandon(end_code_ == absl::StatusCode::kOk ? absl::StatusCode::kCancelled
                                               : end_code_);
    if (begun_) log_->End(transfer_id_);
    if (observer_ && started_ && !resolving_ && !reported_) {
      observer_(TransferReport{
          receive_ != nullptr ? receive_->transport : Transport::kHost,
          /*outgoing=*/false, committed_ ? absl::StatusCode::kOk : end_code_,
          bytes_, absl::Now() - start_, committed_id_});
    }
    delete this;
  }

 private:
  void Finish(const grpc::Status& status) {
    end_code_ = static_cast<absl::StatusCode>(status.error_code());
    Base::Finish(status);
  }

  absl::Status Handle() {
    absl::StatusOr<std::optional<Chunk>> chunk = DecodeChunk(request_);
    if (!chunk.ok()) return chunk.status();
    if (chunk->has_value()) return TakeChunk(**chunk);
    v1::TransferMessage message;
    if (!grpc::SerializationTraits<v1::TransferMessage>::Deserialize(&request_,
                                                                     &message)
             .ok()) {
      return absl::InvalidArgumentError("a malformed transfer message");
    }
    return Handle(message);
  }

  absl::Status Handle(const v1::TransferMessage& message) {
    switch (message.kind_case()) {
      case v1::TransferMessage::kHeader:
        return Header(message);
      case v1::TransferMessage::kChunk: {
        const v1::TransferChunk& c = message.chunk();
        Chunk chunk;
        chunk.layer = c.layer();
        chunk.first_slot = c.first_slot();
        chunk.crc32c = c.crc32c();
        chunk.keys.push_back(std::as_bytes(std::span(c.keys())));
        chunk.values.push_back(std::as_bytes(std::span(c.values())));
        return TakeChunk(chunk);
      }
      case v1::TransferMessage::kCommit:
        return Commit();
      case v1::TransferMessage::kResolve:
        return Resolve(message.transfer_id());
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
    absl::StatusOr<SessionSnapshot> snapshot = StateFromProto(message.header());
    if (!snapshot.ok()) return snapshot.status();
    // The session's owner here is a tenant this store knows: with tenants,
    // the one the caller's token names, which must be the session's; without,
    // the one anonymous tenant every caller is (the header's name is the
    // source's, and means nothing here).
    if (tenants_configured_ && snapshot->tenant != tenant_) {
      return absl::PermissionDeniedError(
          absl::StrCat("the session belongs to another tenant than the "
                       "target token's ('",
                       tenant_, "')"));
    }
    snapshot->tenant = tenant_;
    // Only after the tenant check: a stranger learns nothing of others'
    // transfers.
    if (log_->Contains(transfer_id_)) {  // a retry of a committed transfer
      return Reply(v1::TransferReply::COMMITTED);
    }
    fence_ = log_->Begin(transfer_id_);
    begun_ = true;
    for (const LayoutStats& l : store_->Layouts()) {
      if (l.layout.name == snapshot->layout) {
        page_layout_ = l.layout.page_layout();
        token_bytes_ = static_cast<size_t>(page_layout_.token_bytes());
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
    reply_.set_transport(std::string(TransportName(Transport::kHost)));
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
    receive->transport = Transport::kNccl;
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
    reply_.set_transport(std::string(TransportName(Transport::kNccl)));
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
    receive->transport = Transport::kTcp;
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
    reply_.set_transport(std::string(TransportName(Transport::kTcp)));
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
    if (receive_->transport == Transport::kTcp) {
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
    if (receive_->transport == Transport::kTcp) {
      tcp_->RunAside(std::move(cleanup));
    } else {
      nccl_->RunAside(std::move(cleanup));
    }
  }

  // A data-socket receive whose sender sent chunk messages (or the commit)
  // instead, having never connected: it ends, and the chunks are taken as
  // messages. False if the sender did connect.
  bool FellBackFromTcp() {
    if (receive_->transport != Transport::kTcp ||
        !tcp_->Withdraw(receive_->ticket)) {
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
  absl::Status TakeChunk(const Chunk& chunk) {
    if (pending_ == nullptr) {
      return absl::FailedPreconditionError("a chunk before the header");
    }
    if (receive_ != nullptr && !FellBackFromTcp()) {
      return absl::FailedPreconditionError(
          absl::StrCat("a chunk message in a transfer that moves its pages "
                       "over ",
                       receive_->transport));
    }
    if (IsKivi(page_layout_.dtype)) return TakeKiviChunk(chunk);
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
    if (Crc32cCombine(keys_crc, values_crc, kv_bytes) !=
        chunk.crc32c.value_or(0)) {
      return absl::DataLossError(absl::StrCat(
          "transfer ", transfer_id_, ": layer ", chunk.layer, " slot ",
          chunk.first_slot, ": the chunk's CRC32C does not match its bytes"));
    }
    bytes_ += static_cast<int64_t>(2 * kv_bytes);
    return absl::OkStatus();
  }

  // A kivi_int4 chunk (SessionState.format 2): the whole key blocks of the
  // pages its value records cover. Both are gathered, checked against the
  // CRC32C and only then written (Write refuses a chunk that does not start
  // on a page's first slot).
  absl::Status TakeKiviChunk(const Chunk& chunk) {
    const size_t key_bytes = TotalBytes(chunk.keys);
    const size_t value_bytes = TotalBytes(chunk.values);
    const size_t p = static_cast<size_t>(page_layout_.page_tokens);
    const size_t block_bytes =
        static_cast<size_t>(page_layout_.key_block_bytes());
    const size_t tokens = value_bytes / token_bytes_;
    if (tokens == 0 || value_bytes != tokens * token_bytes_ ||
        key_bytes != (tokens + p - 1) / p * block_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "transfer ", transfer_id_, ": layer ", chunk.layer, " slot ",
          chunk.first_slot, ": ", key_bytes, " key and ", value_bytes,
          " value bytes are not whole kivi_int4 pages (a key block of ",
          block_bytes, " bytes a page of ", p, " tokens, ", token_bytes_,
          " value bytes a token)"));
    }
    kivi_keys_.resize(key_bytes);
    kivi_values_.resize(value_bytes);
    Pieces keys(chunk.keys);
    Pieces values(chunk.values);
    keys.Gather(kivi_keys_);
    values.Gather(kivi_values_);
    if (Crc32c(Crc32c(0, kivi_keys_), kivi_values_) !=
        chunk.crc32c.value_or(0)) {
      return absl::DataLossError(absl::StrCat(
          "transfer ", transfer_id_, ": layer ", chunk.layer, " slot ",
          chunk.first_slot, ": the chunk's CRC32C does not match its bytes"));
    }
    if (absl::Status s = pending_->Write(chunk.layer, kivi_keys_, kivi_values_);
        !s.ok()) {
      return s;
    }
    bytes_ += static_cast<int64_t>(key_bytes + value_bytes);
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
    // Unless the source, its commit in doubt, was told it did not commit.
    absl::StatusOr<SessionId> id =
        log_->Commit(transfer_id_, fence_, tenant_,
                     [&] { return store_->CommitImport(std::move(pending_)); });
    if (receive_ != nullptr && receive_->channel != nullptr) {
      receive_->channel->Done(id.ok());
    }
    if (!id.ok()) return id.status();
    committed_ = true;
    committed_id_ = *id;
    return Reply(v1::TransferReply::COMMITTED);
  }

  // A source's question about a transfer whose commit was in doubt.
  absl::Status Resolve(const std::string& transfer_id) {
    if (started_) {
      return absl::InvalidArgumentError("a resolve comes alone on its stream");
    }
    started_ = true;
    if (transfer_id.empty()) {
      return absl::InvalidArgumentError("a resolve needs a transfer_id");
    }
    absl::StatusOr<bool> committed = log_->Resolve(transfer_id, tenant_);
    if (!committed.ok()) return committed.status();
    // The call ends with this reply, as after COMMITTED.
    resolving_ = true;
    return Reply(*committed ? v1::TransferReply::COMMITTED
                            : v1::TransferReply::ABORTED);
  }

  absl::Status Reply(v1::TransferReply::Phase phase) {
    reply_.set_phase(phase);
    reply_.set_replica(replica_);
    reply_ready_ = true;
    return absl::OkStatus();
  }

  CacheStore* const store_;
  TransferLog* const log_;
  const bool tenants_configured_;
  const TransferObserver observer_;
  NcclTransport* const nccl_;  // may be null
  TcpTransport* const tcp_;    // may be null
  const std::string replica_;  // this store's replica name, or empty
  const absl::Time deadline_;  // for the NCCL link and the data socket
  const absl::Time start_;
  int64_t bytes_ = 0;
  bool committed_ = false;
  SessionId committed_id_ = 0;
  bool reported_ = false;  // to the observer, by Abandon's cleanup
  absl::StatusCode end_code_ = absl::StatusCode::kOk;
  std::string tenant_;
  std::string transfer_id_;
  bool started_ = false;
  bool begun_ = false;      // log_->Begin was called
  uint64_t fence_ = 0;      // what it returned
  bool resolving_ = false;  // the stream carried a resolve
  PageLayout page_layout_;  // of the session's layout, once the header came
  size_t token_bytes_ = 0;  // one token's keys (or values) in one layer
  // kivi_int4: a chunk's key blocks and values, gathered.
  std::vector<std::byte> kivi_keys_;
  std::vector<std::byte> kivi_values_;
  std::unique_ptr<CacheStore::PendingImport> pending_;
  std::shared_ptr<SideReceive> receive_;
  std::vector<std::byte> straddle_;  // one token's keys and values
  grpc::ByteBuffer request_;
  v1::TransferReply reply_;
  grpc::ByteBuffer response_;  // reply_'s bytes
  bool reply_ready_ = false;
};

}  // namespace

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* NewReceiveReactor(
    CacheStore* store, TransferLog* log, grpc::CallbackServerContext* ctx,
    absl::StatusOr<std::string> tenant, bool tenants_configured,
    TransferObserver observer, NcclTransport* nccl, TcpTransport* tcp,
    std::string replica) {
  return new ReceiveReactor(store, log, ctx, std::move(tenant),
                            tenants_configured, std::move(observer), nccl, tcp,
                            std::move(replica));
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
