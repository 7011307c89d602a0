#include "services/kvkeepd/session_transfer.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "services/common/crc32c.h"
#include "services/common/grpc_status.h"

namespace kvkeep {
namespace {

uint32_t ChunkCrc(const v1::TransferChunk& chunk) {
  const uint32_t keys = Crc32c(
      0, std::as_bytes(std::span(chunk.keys().data(), chunk.keys().size())));
  return Crc32c(keys, std::as_bytes(std::span(chunk.values().data(),
                                              chunk.values().size())));
}

class ReceiveReactor final
    : public grpc::ServerBidiReactor<v1::TransferMessage, v1::TransferReply> {
 public:
  ReceiveReactor(CacheStore* store, TransferLog* log,
                 grpc::CallbackServerContext* ctx, Authenticator authenticate,
                 bool tenants_configured, TransferObserver observer)
      : store_(store),
        log_(log),
        tenants_configured_(tenants_configured),
        observer_(std::move(observer)),
        start_(absl::Now()) {
    absl::StatusOr<std::string> tenant = authenticate(*ctx);
    if (!tenant.ok()) {
      Finish(ToGrpcStatus(tenant.status()));
      return;
    }
    tenant_ = *std::move(tenant);
    StartRead(&message_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      // The sender went away before committing: the reservation goes back
      // as `pending_` is destroyed.
      Finish(grpc::Status(grpc::StatusCode::CANCELLED,
                          "the transfer ended before its commit"));
      return;
    }
    absl::Status s = Handle();
    if (!s.ok()) {
      pending_.reset();
      Finish(ToGrpcStatus(s));
      return;
    }
    if (reply_ready_) {
      reply_ready_ = false;
      StartWrite(&reply_);
    } else {
      StartRead(&message_);
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
    StartRead(&message_);
  }

  void OnDone() override {
    if (observer_ && started_) {
      observer_(TransferReport{"host", /*outgoing=*/false,
                               committed_ ? absl::StatusCode::kOk : end_code_,
                               bytes_, absl::Now() - start_});
    }
    delete this;
  }

 private:
  void Finish(const grpc::Status& status) {
    end_code_ = static_cast<absl::StatusCode>(status.error_code());
    grpc::ServerBidiReactor<v1::TransferMessage, v1::TransferReply>::Finish(
        status);
  }

  absl::Status Handle() {
    switch (message_.kind_case()) {
      case v1::TransferMessage::kHeader:
        return Header();
      case v1::TransferMessage::kChunk:
        return Chunk();
      case v1::TransferMessage::kCommit:
        return Commit();
      default:
        return absl::InvalidArgumentError("an empty transfer message");
    }
  }

  absl::Status Header() {
    if (started_) {
      return absl::InvalidArgumentError("a transfer has one header");
    }
    started_ = true;
    transfer_id_ = message_.transfer_id();
    if (transfer_id_.empty()) {
      return absl::InvalidArgumentError("a transfer needs a transfer_id");
    }
    if (log_->Contains(transfer_id_)) {  // a retry of a committed transfer
      return Reply(v1::TransferReply::COMMITTED);
    }
    absl::StatusOr<SessionSnapshot> snapshot =
        StateFromProto(message_.header());
    if (!snapshot.ok()) return snapshot.status();
    if (tenants_configured_ && snapshot->tenant != tenant_) {
      return absl::PermissionDeniedError(
          absl::StrCat("the session belongs to tenant '", snapshot->tenant,
                       "'; this token is tenant '", tenant_, "'s"));
    }
    absl::StatusOr<std::unique_ptr<CacheStore::PendingImport>> pending =
        store_->PrepareImport(*std::move(snapshot));
    if (!pending.ok()) return pending.status();
    pending_ = *std::move(pending);
    return Reply(v1::TransferReply::READY);
  }

  absl::Status Chunk() {
    if (pending_ == nullptr) {
      return absl::FailedPreconditionError("a chunk before the header");
    }
    const v1::TransferChunk& chunk = message_.chunk();
    if (ChunkCrc(chunk) != chunk.crc32c()) {
      return absl::DataLossError(absl::StrCat(
          "transfer ", transfer_id_, ": layer ", chunk.layer(), " slot ",
          chunk.first_slot(), ": the chunk's CRC32C does not match its bytes"));
    }
    bytes_ += static_cast<int64_t>(chunk.keys().size() + chunk.values().size());
    return pending_->Write(
        chunk.layer(),
        std::as_bytes(std::span(chunk.keys().data(), chunk.keys().size())),
        std::as_bytes(std::span(chunk.values().data(), chunk.values().size())));
  }

  absl::Status Commit() {
    if (pending_ == nullptr) {
      return absl::FailedPreconditionError("a commit before the header");
    }
    absl::StatusOr<SessionId> id = store_->CommitImport(std::move(pending_));
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
  const absl::Time start_;
  int64_t bytes_ = 0;
  bool committed_ = false;
  absl::StatusCode end_code_ = absl::StatusCode::kOk;
  std::string tenant_;
  std::string transfer_id_;
  bool started_ = false;
  std::unique_ptr<CacheStore::PendingImport> pending_;
  v1::TransferMessage message_;
  v1::TransferReply reply_;
  bool reply_ready_ = false;
};

}  // namespace

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
  auto channel = grpc::CreateCustomChannel(
      options.target, grpc::InsecureChannelCredentials(), args);
  auto stub = v1::KvKeep::NewStub(channel);
  grpc::ClientContext ctx;
  if (options.deadline != absl::InfiniteFuture()) {
    ctx.set_deadline(absl::ToChronoTime(options.deadline));
  }
  if (!options.target_token.empty()) {
    ctx.AddMetadata("authorization", "Bearer " + options.target_token);
  }
  auto stream = stub->ReceiveSession(&ctx);
  bool commit_sent = false;
  auto end = [&](absl::string_view what) {
    stream->WritesDone();
    grpc::Status s = stream->Finish();
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

  v1::TransferMessage message;
  message.set_transfer_id(options.transfer_id);
  StateToProto(snapshot, message.mutable_header());
  v1::TransferReply reply;
  if (!stream->Write(message) || !stream->Read(&reply)) {
    return end("the target did not answer the header");
  }
  if (reply.phase() == v1::TransferReply::COMMITTED) {  // a retry
    result.status = FromGrpcStatus(stream->Finish());
    result.in_doubt = !result.status.ok();
    return result;
  }
  const int64_t token_bytes = options.token_bytes;
  const int64_t slots_per_chunk =
      std::max<int64_t>(1, options.chunk_bytes / (2 * token_bytes));
  int64_t chunk_index = 0;
  for (size_t l = 0; l < snapshot.layers.size(); ++l) {
    const LayerSnapshot& layer = snapshot.layers[l];
    for (int64_t first = 0; first < layer.resident();
         first += slots_per_chunk) {
      const int64_t n = std::min(slots_per_chunk, layer.resident() - first);
      v1::TransferMessage m;
      v1::TransferChunk* chunk = m.mutable_chunk();
      chunk->set_layer(static_cast<int32_t>(l));
      chunk->set_first_slot(first);
      std::string* keys = chunk->mutable_keys();
      std::string* values = chunk->mutable_values();
      keys->resize(n * token_bytes);
      values->resize(n * token_bytes);
      if (absl::Status s = read(
              static_cast<int32_t>(l), first, n,
              std::as_writable_bytes(std::span(keys->data(), keys->size())),
              std::as_writable_bytes(
                  std::span(values->data(), values->size())));
          !s.ok()) {
        result.status = s;
        stream->WritesDone();
        stream->Finish().IgnoreError();
        return result;
      }
      chunk->set_crc32c(ChunkCrc(*chunk));
      if (options.fault) options.fault(chunk_index, *chunk);
      ++chunk_index;
      result.bytes += 2 * n * token_bytes;
      if (!stream->Write(m)) return end("the target stopped taking chunks");
    }
  }
  v1::TransferMessage commit;
  commit.set_commit(true);
  // From here the outcome may be unknown: a commit that fails to send may
  // still have reached the target.
  commit_sent = true;
  if (!stream->Write(commit)) return end("the stream broke at the commit");
  if (!stream->Read(&reply) || reply.phase() != v1::TransferReply::COMMITTED) {
    return end("no answer to the commit");
  }
  result.status = FromGrpcStatus(stream->Finish());
  result.in_doubt = !result.status.ok();
  return result;
}

grpc::ServerBidiReactor<v1::TransferMessage, v1::TransferReply>*
NewReceiveReactor(CacheStore* store, TransferLog* log,
                  grpc::CallbackServerContext* ctx, Authenticator authenticate,
                  bool tenants_configured, TransferObserver observer) {
  return new ReceiveReactor(store, log, ctx, std::move(authenticate),
                            tenants_configured, std::move(observer));
}

}  // namespace kvkeep
