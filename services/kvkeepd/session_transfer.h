// Session transfer between kvkeepd processes: the sending side
// (SendSession, run by TransferSession on the store holding the session) and
// the receiving side (the ReceiveSession reactors), plus the proto form of a
// session's state. The two-phase semantics live in the store
// (CacheStore::FreezeForTransfer / PrepareImport); this file moves the
// bytes: a header with the state on the gRPC stream, then the page bytes in
// chunks each with a CRC32C (as messages on the stream: the host transport;
// over the target's data socket: tcp, tcp_transport.h) or slot runs over
// NCCL, then a commit on the stream.
//
// The chunks are the bulk of a transfer, so they bypass the protobuf
// message on both ends while keeping its exact wire form (ChunkMessage,
// ReadChunk): the sender reads the page bytes once, into the buffer the
// message is sent from; the raw receiver checksums them and writes them into
// the reserved pages straight from the received slices.
//
// Thread-safe: TransferLog is; SendSession and a reactor each serve one
// transfer; ChunkMessage is not.
#ifndef KVKEEP_SERVICES_KVKEEPD_SESSION_TRANSFER_H_
#define KVKEEP_SERVICES_KVKEEPD_SESSION_TRANSFER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cache_store/cache_store.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "kvkeep/v1/kvkeep.grpc.pb.h"
#include "services/kvkeepd/nccl_transport.h"
#include "services/kvkeepd/tcp_transport.h"

namespace kvkeep {

// What one transfer did, for monitoring: sent from this store (outgoing)
// or received, how it ended, the key and value bytes moved, how long.
struct TransferReport {
  std::string transport = "host";
  bool outgoing = true;
  absl::StatusCode code = absl::StatusCode::kOk;
  int64_t bytes = 0;
  absl::Duration duration;
};
using TransferObserver = std::function<void(const TransferReport&)>;

// A snapshot's state without its bytes, and back (INVALID_ARGUMENT for a
// malformed one; the store checks the rest).
void StateToProto(const SessionSnapshot& snapshot, v1::SessionState* out);
absl::StatusOr<SessionSnapshot> StateFromProto(const v1::SessionState& state);

// The transfers a store committed as a target, by transfer id (the newest
// `capacity`): a retried transfer whose commit answer was lost is answered
// COMMITTED instead of making a second copy.
class TransferLog {
 public:
  explicit TransferLog(size_t capacity = 4096) : capacity_(capacity) {}
  void Add(const std::string& transfer_id, SessionId id);
  bool Contains(const std::string& transfer_id) const;

 private:
  const size_t capacity_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, SessionId> ids_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> order_ ABSL_GUARDED_BY(mu_);
};

struct SendOptions {
  int64_t token_bytes = 0;   // one token's keys (or values) in one layer
  std::string target;        // host:port
  std::string target_token;  // bearer token, or empty
  std::string transfer_id;
  absl::Time deadline = absl::InfiniteFuture();
  int64_t chunk_bytes = 4 << 20;  // keys + values per chunk, at most
  int64_t max_message_bytes = 64 << 20;
  // Test-only: may change a chunk after its checksum is computed (such a
  // chunk is then sent through the protobuf message, not ChunkMessage).
  std::function<void(int64_t chunk, v1::TransferChunk&)> fault;
  // The NCCL transport: offered with the header when set. If the target
  // takes it (READY with transport "nccl"), `nccl_connect` gives the
  // channel, and each layer's slots go over it in runs of the offer's
  // chunk_slots with `nccl_move`, instead of chunk messages.
  std::optional<v1::NcclOffer> nccl_offer;
  std::function<absl::StatusOr<std::unique_ptr<NcclChannel>>()> nccl_connect;
  std::function<absl::Status(NcclChannel& channel, int32_t layer, int64_t first,
                             int64_t n)>
      nccl_move;
  // The tcp transport: offered with the header when set (`tcp_required`:
  // the target must take it and the data socket must connect; otherwise the
  // chunks go as messages). `spans`, when set, gives where a chunk's slots
  // lie (a host pool's pages), so they are sent without a copy; unset, they
  // are read with the SlotReader into a buffer first.
  bool tcp_offer = false;
  bool tcp_required = false;
  std::function<absl::Status(int32_t layer, int64_t first, int64_t n,
                             SlotSpans* out)>
      spans;
};

// How a send ended. A failure `in_doubt` may have been committed by the
// target (the commit was sent and the stream then broke, with no answer);
// any other failure was not (the target answers every refusal with its own
// status, and commits only on the commit message).
struct SendResult {
  absl::Status status;
  bool in_doubt = false;
  int64_t bytes = 0;
  std::string transport = "host";  // how the pages went
};

// Reads slots [first, first + n) of a layer's keys and values into the
// buffers ([n][kv_heads][head_dim] each).
using SlotReader = std::function<absl::Status(
    int32_t layer, int64_t first, int64_t n, std::span<std::byte> keys,
    std::span<std::byte> values)>;

// Sends `state` (a snapshot without its bytes) to the target's
// ReceiveSession, reading each chunk's bytes with `read` straight into the
// buffer the chunk's message is sent from (no copy of the whole session is
// made, and none of a chunk but that one). While one chunk is on the wire
// the next is read and checksummed.
SendResult SendSession(const SessionSnapshot& state, const SlotReader& read,
                       const SendOptions& options);

// The ReceiveSession reactor: `authenticate` gives the caller's tenant (or
// an error); the log records commits. The typed one parses each message
// into a TransferMessage (a copy of every byte) and serves ReceiveSession
// as generated; the raw one, for ReceiveSession registered as a raw method
// (see RawReceiveSessionHandler), reads each chunk in place.
using Authenticator = std::function<absl::StatusOr<std::string>(
    const grpc::CallbackServerContext&)>;
// `nccl` answers NCCL offers and `tcp` takes data-socket offers; either may
// be null (that transport is not taken here).
grpc::ServerBidiReactor<v1::TransferMessage, v1::TransferReply>*
NewReceiveReactor(CacheStore* store, TransferLog* log,
                  grpc::CallbackServerContext* ctx, Authenticator authenticate,
                  bool tenants_configured, TransferObserver observer,
                  NcclTransport* nccl = nullptr, TcpTransport* tcp = nullptr);
grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>*
NewRawReceiveReactor(CacheStore* store, TransferLog* log,
                     grpc::CallbackServerContext* ctx,
                     Authenticator authenticate, bool tenants_configured,
                     TransferObserver observer, NcclTransport* nccl = nullptr,
                     TcpTransport* tcp = nullptr);

// ReceiveSession's index among KvKeep's methods, and a handler for it that
// makes raw reactors with `make`: a service derived from the generated
// CallbackService switches to the raw receiver in its constructor with
//   MarkMethodRawCallback(ReceiveSessionMethodIndex(),
//                         RawReceiveSessionHandler([this](auto* ctx) {...}));
// The wire form is the same either way: senders cannot tell.
int ReceiveSessionMethodIndex();
grpc::internal::MethodHandler* RawReceiveSessionHandler(
    std::function<grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>*(
        grpc::CallbackServerContext*)>
        make);

// The wire form of a chunk message, built and read without a
// v1::TransferMessage: the bytes are exactly what protobuf serializes for
// TransferMessage{chunk: {layer, first_slot, keys, values, crc32c}}, so any
// client generated from the .proto can send or read them.

// One chunk message being built: fill keys() and values() (ReadSlots
// straight into them), then Finish writes the framing around them and
// hands over the buffer without copying it. Not thread-safe.
class ChunkMessage {
 public:
  // `kv_bytes`: the bytes of the keys, and of the values.
  ChunkMessage(int32_t layer, int64_t first_slot, int64_t kv_bytes);
  ChunkMessage(ChunkMessage&&) = default;
  ChunkMessage& operator=(ChunkMessage&&) = default;

  std::span<std::byte> keys() { return {buffer_.get() + keys_at_, kv_bytes_}; }
  std::span<std::byte> values() {
    return {buffer_.get() + values_at_, kv_bytes_};
  }
  // The message, with its crc32c field; the ChunkMessage is spent.
  grpc::ByteBuffer Finish(uint32_t crc32c) &&;

 private:
  int32_t layer_;
  int64_t first_slot_;
  size_t kv_bytes_;
  size_t keys_at_;    // where the keys start in buffer_
  size_t values_at_;  // where the values start
  std::unique_ptr<std::byte[]> buffer_;
};

// A chunk read in place from a received message: its keys and values are
// the pieces of the message's slices they lie in, in order (a piece may end
// anywhere, even inside a token). `slices` keeps those bytes alive.
struct ChunkView {
  int32_t layer = 0;
  int64_t first_slot = 0;
  uint32_t crc32c = 0;
  std::vector<std::span<const std::byte>> keys;
  std::vector<std::span<const std::byte>> values;
  std::vector<grpc::Slice> slices;
};

// The chunk of `message` if it is a TransferMessage holding a chunk (and
// nothing else but perhaps a transfer_id and unknown fields); nullopt for
// any other message, which the caller parses as a TransferMessage;
// INVALID_ARGUMENT if it is not a well-formed message.
absl::StatusOr<std::optional<ChunkView>> ReadChunk(
    const grpc::ByteBuffer& message);

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_KVKEEPD_SESSION_TRANSFER_H_
