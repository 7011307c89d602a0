#include "services/transfer/session_sender.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache_store/quote.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "services/common/grpc_status.h"
#include "services/transfer/session_state.h"
#include "services/transfer/transfer_call.h"

namespace kvkeep {
namespace {

// How long a sender tries to connect to the target's data socket at most
// before giving up on it (and sending chunk messages, unless tcp was
// required).
constexpr absl::Duration kConnectPatience = absl::Seconds(10);

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

// The sender of the transport READY names: NCCL, the data socket, or chunk
// messages on `call` (also when the data socket did not connect and tcp was
// not required).
absl::StatusOr<std::unique_ptr<PageSender>> ChooseSender(
    const v1::TransferReply& ready, const SendOptions& options,
    TransferCall* call) {
  const int64_t multiple = options.chunk_slot_multiple;
  const int64_t slots_per_chunk = std::max<int64_t>(
      multiple,
      options.chunk_bytes / (2 * options.token_bytes) / multiple * multiple);
  absl::StatusOr<Transport> chosen = ParseTransport(ready.transport());
  if (!chosen.ok() || *chosen == Transport::kAuto) {
    return absl::InternalError(
        absl::StrCat("the target chose transport ", Quote(ready.transport())));
  }
  if (*chosen == Transport::kNccl) {
    if (!options.nccl_offer.has_value()) {
      return absl::InternalError(
          "the target chose NCCL, which this sender did not offer");
    }
    absl::StatusOr<std::unique_ptr<NcclChannel>> channel =
        options.nccl_connect();
    if (!channel.ok()) return channel.status();
    return NewNcclSender(*std::move(channel), options.nccl_move,
                         options.nccl_offer->chunk_slots());
  }
  if (*chosen == Transport::kTcp) {
    if (!options.tcp_offer) {
      return absl::InternalError(
          "the target chose tcp, which this sender did not offer");
    }
    absl::StatusOr<DataSocket> socket = ConnectData(options, ready);
    if (socket.ok()) {
      return NewTcpSender(*std::move(socket), options.deadline,
                          slots_per_chunk);
    }
    if (options.tcp_required) {
      return absl::Status(
          socket.status().code(),
          absl::StrCat("transport 'tcp': ", socket.status().message()));
    }
    // Otherwise the chunks go as messages, which the target takes instead.
  }
  return NewMessageSender(call, slots_per_chunk);
}

// Every resident slot of every layer through `sender`, a chunk at a time,
// with its bytes in place when the source says where they lie. `bytes`
// counts what was sent.
absl::Status SendPages(const SessionSnapshot& snapshot,
                       const SlotSource& source, const SendOptions& options,
                       PageSender& sender, int64_t* bytes) {
  const int64_t token_bytes = options.token_bytes;
  // Keys of n slots from a chunk's first (a multiple of the slot multiple).
  const auto key_bytes = [&](int64_t n) {
    if (options.key_block_bytes == 0) return n * token_bytes;
    const int64_t p = options.chunk_slot_multiple;
    return (n + p - 1) / p * options.key_block_bytes;
  };
  std::vector<std::byte> buffer;  // bytes read out, when not in place
  for (size_t l = 0; l < snapshot.layers.size(); ++l) {
    const int32_t layer = static_cast<int32_t>(l);
    const int64_t resident = snapshot.layers[l].resident();
    for (int64_t first = 0; first < resident; first += sender.chunk_slots()) {
      const int64_t n = std::min(sender.chunk_slots(), resident - first);
      SlotSpans spans;
      if (sender.needs_bytes() && source.spans) {
        absl::StatusOr<SlotSpans> in_place = source.spans(layer, first, n);
        if (!in_place.ok()) return in_place.status();
        spans = *std::move(in_place);
      } else if (sender.needs_bytes()) {
        buffer.resize(static_cast<size_t>(key_bytes(n) + n * token_bytes));
        const std::span<std::byte> all(buffer);
        spans.keys.push_back(all.first(key_bytes(n)));
        spans.values.push_back(all.subspan(key_bytes(n)));
        if (absl::Status s =
                source.read(layer, first, n, spans.keys[0], spans.values[0]);
            !s.ok()) {
          return s;
        }
      }
      const Chunk chunk = ChunkOf(layer, first, n, spans);
      if (absl::Status s = sender.Send(chunk); !s.ok()) return s;
      // What went (kivi_int4: key blocks and value records); NCCL reads no
      // bytes through the host and moves the same.
      *bytes += sender.needs_bytes()
                    ? static_cast<int64_t>(KeyBytes(chunk) + ValueBytes(chunk))
                    : key_bytes(n) + n * token_bytes;
    }
  }
  return sender.Finish();
}

std::shared_ptr<TransferCall> StartCall(
    const SendOptions& options, std::unique_ptr<grpc::GenericStub>* stub) {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  args.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  // Bulk bytes: large HTTP/2 frames and a deep flow-control window, so a
  // chunk is a few writes rather than hundreds of 16 KiB frames.
  args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 16 << 20);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 20);
  args.SetInt(GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE, 16 << 20);
  if (options.keepalive > absl::ZeroDuration()) {
    // A frozen target answers no ping: the connection drops, the call ends
    // UNAVAILABLE. Pings go on while no data moves (a frozen target takes
    // none), and between calls (a resolve may come on the same channel).
    const int ms =
        static_cast<int>(absl::ToInt64Milliseconds(options.keepalive));
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, ms);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, ms);
    args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  }
  *stub = std::make_unique<grpc::GenericStub>(grpc::CreateCustomChannel(
      options.target,
      options.credentials != nullptr ? options.credentials
                                     : grpc::InsecureChannelCredentials(),
      args));
  return TransferCall::Start(**stub, options.deadline, options.target_token,
                             options.peer_token);
}

// The send itself (SendSession adds the cancel's reason).
SendResult Send(const SessionSnapshot& snapshot, const SlotSource& source,
                const SendOptions& options);

}  // namespace

SendResult SendSession(const SessionSnapshot& snapshot,
                       const SlotSource& source, const SendOptions& options) {
  SendResult result = Send(snapshot, source, options);
  // A cancelled send says why it was cancelled, not how its waits ended.
  if (options.cancel != nullptr && !result.status.ok()) {
    if (absl::Status why = options.cancel->why(); !why.ok()) {
      result.status = absl::Status(
          why.code(),
          absl::StrCat(why.message(), " (", result.status.message(), ")"));
    }
  }
  return result;
}

absl::StatusOr<bool> AskCommitted(const SendOptions& options) {
  std::unique_ptr<grpc::GenericStub> stub;
  const std::shared_ptr<TransferCall> call = StartCall(options, &stub);
  TransferCancel::Binding binding(options.cancel, [call] { call->Cancel(); });
  v1::TransferMessage resolve;
  resolve.set_transfer_id(options.transfer_id);
  resolve.set_resolve(true);
  std::optional<v1::TransferReply> reply;
  if (call->Write(Serialize(resolve))) {
    call->StartReading();
    reply = call->AwaitReply();
  }
  const grpc::Status status = call->Finish(/*cancel=*/false);
  if (reply.has_value() && reply->phase() == v1::TransferReply::COMMITTED) {
    return true;
  }
  if (reply.has_value() && reply->phase() == v1::TransferReply::ABORTED) {
    return false;
  }
  if (!status.ok()) return FromGrpcStatus(status);
  return absl::UnavailableError(absl::StrCat(
      "the target ", Quote(options.target), " did not answer the resolve"));
}

namespace {

SendResult Send(const SessionSnapshot& snapshot, const SlotSource& source,
                const SendOptions& options) {
  SendResult result;
  std::unique_ptr<grpc::GenericStub> stub;
  const std::shared_ptr<TransferCall> call = StartCall(options, &stub);
  TransferCancel::Binding binding(options.cancel, [call] { call->Cancel(); });
  bool commit_sent = false;
  // The call ended (or broke) from the target's side: its status says why.
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
  // This side gives up before the commit: nothing was committed.
  auto cancel = [&](const absl::Status& why) {
    static_cast<void>(call->Finish(/*cancel=*/true));
    result.status = why;
    return result;
  };

  v1::TransferMessage header;
  header.set_transfer_id(options.transfer_id);
  StateToProto(snapshot, header.mutable_header());
  if (options.nccl_offer.has_value()) {
    *header.mutable_nccl() = *options.nccl_offer;
  }
  if (options.tcp_offer) {
    header.mutable_tcp()->set_required(options.tcp_required);
  }
  if (!call->Write(Serialize(header))) {
    return end("the target did not answer the header");
  }
  call->StartReading();
  std::optional<v1::TransferReply> reply = call->AwaitReply();
  if (!reply.has_value()) return end("the target did not answer the header");
  result.target_replica = reply->replica();
  if (reply->phase() == v1::TransferReply::COMMITTED) {  // a retry
    result.status = FromGrpcStatus(call->Finish(/*cancel=*/false));
    result.in_doubt = !result.status.ok();
    return result;
  }
  // From here a reply is always asked for: the next one is the commit's,
  // and an early end (the target refused a chunk) stops the sending.
  call->StartReading();
  absl::StatusOr<std::unique_ptr<PageSender>> sender =
      ChooseSender(*reply, options, call.get());
  if (!sender.ok()) return cancel(sender.status());
  if (options.wrap) *sender = options.wrap(*std::move(sender));
  // Unbound before the sender goes.
  TransferCancel::Binding abort(options.cancel,
                                [s = sender->get()] { s->Abort(); });
  result.transport = (*sender)->transport();
  if (absl::Status s =
          SendPages(snapshot, source, options, **sender, &result.bytes);
      !s.ok()) {
    if (call->Broken()) return end("the target stopped taking chunks");
    return cancel(s);
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
  (*sender)->Done(committed);
  if (!committed) return end("no answer to the commit");
  result.status = FromGrpcStatus(call->Finish(/*cancel=*/false));
  result.in_doubt = !result.status.ok();
  return result;
}

}  // namespace
}  // namespace kvkeep
