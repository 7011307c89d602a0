// The receiving side of a session transfer: the ReceiveSession reactor,
// registered as a raw method so that chunk messages are read in place
// (chunk_wire.h) while the rest is parsed as generated; the wire is the
// .proto's either way. It reserves the session's pages (CacheStore::
// PrepareImport), takes the transport the sender offered that this store
// can use (NCCL, then the data socket, else chunk messages), writes every
// slot into the reserved pages checking each chunk's CRC32C, and commits.
// Pages that come beside the stream (NCCL, data socket) are received on a
// thread of their own, which the commit waits for.
//
// Thread-safe: each reactor serves one call, on gRPC's threads.
#ifndef KVKEEP_SERVICES_TRANSFER_SESSION_RECEIVER_H_
#define KVKEEP_SERVICES_TRANSFER_SESSION_RECEIVER_H_

#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "cache_store/cache_store.h"
#include "grpcpp/support/byte_buffer.h"
#include "kvkeep/v1/kvkeep.grpc.pb.h"
#include "services/transfer/nccl_transport.h"
#include "services/transfer/session_state.h"
#include "services/transfer/tcp_transport.h"

namespace kvkeep {

// A reactor for one ReceiveSession call from a caller of `tenant` (or the
// error that authenticating it gave, with which the call ends). `nccl` and
// `tcp` may be null (that transport is not taken here); `store`, `log` and
// those must outlive the call. `replica`: this store's replica name, which
// READY and COMMITTED carry (TransferReply.replica).
grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* NewReceiveReactor(
    CacheStore* store, TransferLog* log, grpc::CallbackServerContext* ctx,
    absl::StatusOr<std::string> tenant, bool tenants_configured,
    TransferObserver observer, NcclTransport* nccl, TcpTransport* tcp,
    std::string replica = "");

// ReceiveSession's index among KvKeep's methods, and a handler for it that
// makes raw reactors with `make`: a service derived from the generated
// CallbackService switches to the raw receiver in its constructor with
//   MarkMethodRawCallback(ReceiveSessionMethodIndex(),
//                         RawReceiveSessionHandler([this](auto* ctx) {...}));
int ReceiveSessionMethodIndex();
grpc::internal::MethodHandler* RawReceiveSessionHandler(
    std::function<grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>*(
        grpc::CallbackServerContext*)>
        make);

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_TRANSFER_SESSION_RECEIVER_H_
