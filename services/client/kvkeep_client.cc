#include "services/client/kvkeep_client.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "services/common/dtype_proto.h"
#include "services/common/grpc_status.h"

namespace kvkeep::client {

// What one call does about UNAVAILABLE.
enum class Retry { kNo, kOnUnavailable };

// Shared by a client and every handle it made, so handles may outlive it.
class Connection {
 public:
  Connection(ClientOptions options, std::shared_ptr<grpc::Channel> channel)
      : options_(std::move(options)),
        channel_(std::move(channel)),
        stub_(v1::KvKeep::NewStub(channel_)) {}

  const ClientOptions& options() const { return options_; }
  v1::KvKeep::Stub& stub() const { return *stub_; }

  // Sets the token and a deadline `timeout` from now on a call's context.
  void Prepare(grpc::ClientContext& context, absl::Duration timeout) const {
    if (!options_.token.empty()) {
      context.AddMetadata("authorization",
                          absl::StrCat("Bearer ", options_.token));
    }
    if (timeout != absl::InfiniteDuration()) {
      context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    }
  }

  // Runs attempt(context, attempt_number) with a fresh context per attempt,
  // retrying UNAVAILABLE as `retry` and the options allow.
  template <typename Attempt>
  absl::Status Call(absl::string_view method, Retry retry,
                    Attempt&& attempt) const {
    absl::Duration wait = options_.backoff;
    std::optional<absl::BitGen> jitter;
    for (int n = 1;; ++n) {
      grpc::ClientContext context;
      Prepare(context, options_.deadline);
      absl::Status status = FromGrpcStatus(attempt(context, n));
      if (status.code() != absl::StatusCode::kUnavailable ||
          retry == Retry::kNo || n > options_.retries) {
        if (status.code() == absl::StatusCode::kUnavailable && n > 1) {
          return absl::UnavailableError(
              absl::StrCat(method, " to ", options_.address, " failed after ",
                           n, " attempts: ", status.message()));
        }
        return status;
      }
      if (options_.on_retry) options_.on_retry(method, n, status);
      if (!jitter.has_value()) jitter.emplace();
      absl::SleepFor(wait * absl::Uniform(*jitter, 0.8, 1.2));
      wait = std::min(wait * 2, options_.max_backoff);
    }
  }

  // A layout the server serves and its message limit, from a cached
  // ServerInfo (fetched again when the name is not in it). nullopt if the
  // server does not serve it.
  struct LayoutInfo {
    std::optional<v1::Layout> layout;
    int64_t max_message_bytes = 0;
  };
  absl::StatusOr<LayoutInfo> FindLayout(const std::string& name) const {
    {
      absl::MutexLock lock(&mu_);
      if (info_.has_value()) {
        if (std::optional<v1::Layout> l = Lookup(*info_, name)) {
          return LayoutInfo{std::move(l), info_->max_message_bytes()};
        }
      }
    }
    absl::StatusOr<v1::ServerInfo> info = GetServerInfo();
    if (!info.ok()) return info.status();
    LayoutInfo found{Lookup(*info, name), info->max_message_bytes()};
    absl::MutexLock lock(&mu_);
    info_ = *std::move(info);
    return found;
  }

  absl::StatusOr<v1::ServerInfo> GetServerInfo() const {
    v1::ServerInfo info;
    absl::Status s = Call("GetServerInfo", Retry::kOnUnavailable,
                          [&](grpc::ClientContext& context, int) {
                            return stub_->GetServerInfo(
                                &context, v1::GetServerInfoRequest(), &info);
                          });
    if (!s.ok()) return s;
    return info;
  }

 private:
  static std::optional<v1::Layout> Lookup(const v1::ServerInfo& info,
                                          const std::string& name) {
    for (const v1::Layout& l : info.layouts()) {
      if (l.name() == name) return l;
    }
    return std::nullopt;
  }

  const ClientOptions options_;
  const std::shared_ptr<grpc::Channel> channel_;
  const std::unique_ptr<v1::KvKeep::Stub> stub_;
  mutable absl::Mutex mu_;
  // Layouts and limits do not change while a server runs.
  mutable std::optional<v1::ServerInfo> info_ ABSL_GUARDED_BY(mu_);
};

namespace {

int64_t DTypeBytes(v1::DType dtype) {
  absl::StatusOr<DType> d = DTypeFromProto(dtype);
  return d.ok() ? kvkeep::DTypeBytes(*d) : 0;
}

// Bytes of one token's keys (or values) in one layer.
int64_t TokenBytes(const v1::Layout& layout) {
  return int64_t{layout.kv_heads()} * layout.head_dim() *
         DTypeBytes(layout.dtype());
}

// The server's default receive limit, when ServerInfo gives none.
constexpr int64_t kDefaultMessageBytes = 4 << 20;

v1::LayerScores MakeScores(int32_t layer, uint64_t version) {
  v1::LayerScores s;
  s.set_layer(layer);
  s.set_version(version);
  return s;
}

// Closes a session, treating NOT_FOUND after a lost attempt as closed.
absl::StatusOr<int64_t> Close(const Connection& connection,
                              const std::string& session_id) {
  v1::CloseSessionRequest request;
  request.set_session_id(session_id);
  v1::CloseSessionResponse response;
  bool unknown = false;
  absl::Status s = connection.Call(
      "CloseSession", Retry::kOnUnavailable,
      [&](grpc::ClientContext& context, int attempt) {
        grpc::Status status =
            connection.stub().CloseSession(&context, request, &response);
        if (attempt > 1 && status.error_code() == grpc::StatusCode::NOT_FOUND) {
          unknown = true;
          return grpc::Status::OK;
        }
        return status;
      });
  if (!s.ok()) return s;
  return unknown ? Session::kUnknownFreedPages : response.freed_pages();
}

absl::StatusOr<v1::SessionStats> Stats(const Connection& connection,
                                       const std::string& session_id) {
  v1::GetSessionStatsRequest request;
  request.set_session_id(session_id);
  v1::SessionStats stats;
  absl::Status s = connection.Call("GetSessionStats", Retry::kOnUnavailable,
                                   [&](grpc::ClientContext& context, int) {
                                     return connection.stub().GetSessionStats(
                                         &context, request, &stats);
                                   });
  if (!s.ok()) return s;
  return stats;
}

}  // namespace

v1::LayerScores PerHeadScores(int32_t layer, uint64_t version,
                              absl::Span<const float> values, int32_t rows) {
  v1::LayerScores s = MakeScores(layer, version);
  s.mutable_per_head()->set_rows(rows);
  s.mutable_per_head()->mutable_values()->Add(values.begin(), values.end());
  return s;
}

v1::LayerScores ReducedScores(int32_t layer, uint64_t version,
                              absl::Span<const float> values, int32_t rows) {
  v1::LayerScores s = MakeScores(layer, version);
  s.mutable_reduced()->set_rows(rows);
  s.mutable_reduced()->mutable_values()->Add(values.begin(), values.end());
  return s;
}

v1::LayerScores QueryScores(int32_t layer, uint64_t version,
                            absl::Span<const float> values, int32_t rows) {
  v1::LayerScores s = MakeScores(layer, version);
  s.mutable_queries()->set_rows(rows);
  s.mutable_queries()->mutable_values()->Add(values.begin(), values.end());
  return s;
}

void TokensToProto(const KvTokens& tokens, v1::AppendRequest* out) {
  out->mutable_positions()->Add(tokens.positions.begin(),
                                tokens.positions.end());
  for (const LayerBytes& l : tokens.layers) {
    v1::LayerKv* layer = out->add_layers();
    layer->set_keys(l.keys);
    layer->set_values(l.values);
  }
}

// ---------------------------------------------------------------------------
// DecodeStream

DecodeStream::DecodeStream(std::shared_ptr<const Connection> connection,
                           std::string session_id)
    : connection_(std::move(connection)),
      session_id_(std::move(session_id)),
      context_(std::make_unique<grpc::ClientContext>()) {
  connection_->Prepare(*context_, connection_->options().stream_deadline);
  stream_ = connection_->stub().Decode(context_.get());
}

DecodeStream::DecodeStream(DecodeStream&&) noexcept = default;

DecodeStream& DecodeStream::operator=(DecodeStream&& other) noexcept {
  if (this != &other) {
    if (stream_ != nullptr && !ended_) {
      context_->TryCancel();
      stream_->Finish();
    }
    connection_ = std::move(other.connection_);
    session_id_ = std::move(other.session_id_);
    context_ = std::move(other.context_);
    stream_ = std::move(other.stream_);
    sent_first_ = other.sent_first_;
    ended_ = other.ended_;
    final_status_ = std::move(other.final_status_);
  }
  return *this;
}

DecodeStream::~DecodeStream() {
  if (stream_ != nullptr && !ended_) {
    context_->TryCancel();
    stream_->Finish();
  }
}

absl::Status DecodeStream::End() {
  if (!ended_) {
    ended_ = true;
    final_status_ = FromGrpcStatus(stream_->Finish());
  }
  return final_status_;
}

absl::StatusOr<v1::DecodeStepResult> DecodeStream::Step(
    absl::Span<const v1::LayerScores> scores) {
  v1::DecodeStep step;
  step.mutable_scores()->Add(scores.begin(), scores.end());
  return Step(std::move(step));
}

absl::StatusOr<v1::DecodeStepResult> DecodeStream::Step(
    const KvTokens& append, absl::Span<const v1::LayerScores> scores) {
  v1::DecodeStep step;
  TokensToProto(append, step.mutable_append());
  step.mutable_scores()->Add(scores.begin(), scores.end());
  return Step(std::move(step));
}

absl::StatusOr<v1::DecodeStepResult> DecodeStream::Step(v1::DecodeStep step) {
  if (stream_ == nullptr) {
    return absl::FailedPreconditionError("the decode stream was moved from");
  }
  if (ended_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the decode stream of session ", session_id_, " has ended (",
        final_status_.ok() ? "finished" : final_status_.ToString(),
        "); open another"));
  }
  if (!sent_first_ && step.session_id().empty()) {
    step.set_session_id(session_id_);
  }
  sent_first_ = true;
  v1::DecodeStepResult result;
  if (!stream_->Write(step) || !stream_->Read(&result)) {
    absl::Status s = End();
    if (s.ok()) {  // the server must answer every step or fail the stream
      final_status_ = absl::InternalError(
          absl::StrCat("the server ended the decode stream of session ",
                       session_id_, " without answering a step"));
      return final_status_;
    }
    return s;
  }
  return result;
}

absl::Status DecodeStream::Finish() {
  if (stream_ == nullptr) return absl::OkStatus();
  if (!ended_) stream_->WritesDone();
  return End();
}

// ---------------------------------------------------------------------------
// Session

Session::Session(std::shared_ptr<const Connection> connection, std::string id,
                 v1::Layout layout, std::vector<int64_t> layer_budgets,
                 int64_t max_message_bytes)
    : connection_(std::move(connection)),
      id_(std::move(id)),
      layout_(std::move(layout)),
      layer_budgets_(std::move(layer_budgets)),
      max_message_bytes_(max_message_bytes) {}

absl::StatusOr<v1::StepResult> Session::Append(const KvTokens& tokens) const {
  v1::AppendRequest request;
  request.set_session_id(id_);
  TokensToProto(tokens, &request);
  v1::StepResult result;
  absl::Status s = connection_->Call(
      "Append", Retry::kNo, [&](grpc::ClientContext& context, int) {
        return connection_->stub().Append(&context, request, &result);
      });
  if (!s.ok()) return s;
  return result;
}

absl::StatusOr<PrefillResult> Session::AppendPrefill(
    const KvTokens& prompt, int64_t max_chunk_tokens) const {
  const int64_t n = static_cast<int64_t>(prompt.positions.size());
  const int64_t token_bytes = TokenBytes(layout_);
  const int64_t num_layers = static_cast<int64_t>(prompt.layers.size());
  if (n == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("session ", id_, ": AppendPrefill of zero tokens"));
  }
  // Chunks slice every layer by token, so the sizes must agree first.
  for (int64_t l = 0; l < num_layers; ++l) {
    const LayerBytes& kv = prompt.layers[l];
    if (static_cast<int64_t>(kv.keys.size()) != n * token_bytes ||
        static_cast<int64_t>(kv.values.size()) != n * token_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "session ", id_, ": layer ", l, " keys/values have ", kv.keys.size(),
          "/", kv.values.size(), " bytes, expected ", n * token_bytes,
          " each (", n, " tokens of layout '", layout_.name(), "')"));
    }
  }
  // A bound on a message of t tokens: per token, its keys and values in
  // every layer and a position varint (at most 10 bytes); fixed, the
  // session id and the length-delimited field headers (at most 6 bytes
  // each: tag and a 5-byte length).
  const int64_t limit =
      max_message_bytes_ > 0 ? max_message_bytes_ : kDefaultMessageBytes;
  const int64_t fixed =
      2 + static_cast<int64_t>(id_.size()) + 6 + num_layers * 3 * 6;
  const int64_t per_token = num_layers * 2 * token_bytes + 10;
  int64_t chunk = (limit - fixed) / per_token;
  if (chunk < 1) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "session ", id_, ": one token of layout '", layout_.name(), "' (",
        per_token + fixed, " bytes with its message) exceeds the server's ",
        limit, "-byte message limit"));
  }
  if (max_chunk_tokens > 0) chunk = std::min(chunk, max_chunk_tokens);

  PrefillResult result;
  v1::AppendPrefillResponse response;
  grpc::ClientContext context;
  connection_->Prepare(context, connection_->options().stream_deadline);
  std::unique_ptr<grpc::ClientWriter<v1::AppendRequest>> writer =
      connection_->stub().AppendPrefill(&context, &response);
  for (int64_t first = 0; first < n; first += chunk) {
    const int64_t count = std::min(chunk, n - first);
    v1::AppendRequest message;
    if (first == 0) message.set_session_id(id_);
    message.mutable_positions()->Add(prompt.positions.begin() + first,
                                     prompt.positions.begin() + first + count);
    for (const LayerBytes& l : prompt.layers) {
      v1::LayerKv* layer = message.add_layers();
      layer->set_keys(l.keys.data() + first * token_bytes, count * token_bytes);
      layer->set_values(l.values.data() + first * token_bytes,
                        count * token_bytes);
    }
    result.chunk_tokens.push_back(count);
    // A failed write means the server ended the call; Finish says why.
    if (!writer->Write(message)) break;
  }
  writer->WritesDone();
  if (absl::Status s = FromGrpcStatus(writer->Finish()); !s.ok()) return s;
  if (response.chunks_size() != static_cast<int>(result.chunk_tokens.size())) {
    return absl::InternalError(absl::StrCat(
        "session ", id_, ": AppendPrefill sent ", result.chunk_tokens.size(),
        " chunks, the server answered ", response.chunks_size()));
  }
  result.chunks.assign(response.chunks().begin(), response.chunks().end());
  return result;
}

absl::StatusOr<v1::StepResult> Session::CompressPrompt(
    absl::Span<const v1::LayerScores> window) const {
  v1::CompressPromptRequest request;
  request.set_session_id(id_);
  request.mutable_window()->Add(window.begin(), window.end());
  v1::StepResult result;
  absl::Status s = connection_->Call(
      "CompressPrompt", Retry::kNo, [&](grpc::ClientContext& context, int) {
        return connection_->stub().CompressPrompt(&context, request, &result);
      });
  if (!s.ok()) return s;
  return result;
}

DecodeStream Session::Decode() const { return DecodeStream(connection_, id_); }

absl::StatusOr<v1::GetBlockTablesResponse> Session::GetBlockTables(
    absl::Span<const int32_t> layers) const {
  v1::GetBlockTablesRequest request;
  request.set_session_id(id_);
  request.mutable_layers()->Add(layers.begin(), layers.end());
  v1::GetBlockTablesResponse response;
  absl::Status s = connection_->Call(
      "GetBlockTables", Retry::kOnUnavailable,
      [&](grpc::ClientContext& context, int) {
        response.Clear();
        return connection_->stub().GetBlockTables(&context, request, &response);
      });
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<v1::MapPoolResponse> Session::MapPool() const {
  v1::MapPoolRequest request;
  request.set_session_id(id_);
  v1::MapPoolResponse response;
  absl::Status s = connection_->Call(
      "MapPool", Retry::kOnUnavailable, [&](grpc::ClientContext& context, int) {
        response.Clear();
        return connection_->stub().MapPool(&context, request, &response);
      });
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<std::vector<LayerKvData>> Session::ReadKv(
    absl::Span<const int32_t> layers) const {
  v1::ReadKvRequest request;
  request.set_session_id(id_);
  request.mutable_layers()->Add(layers.begin(), layers.end());
  const int64_t token_bytes = TokenBytes(layout_);
  std::vector<LayerKvData> out;
  absl::Status s = connection_->Call(
      "ReadKv", Retry::kOnUnavailable, [&](grpc::ClientContext& context, int) {
        out.clear();
        std::unique_ptr<grpc::ClientReader<v1::KvChunk>> reader =
            connection_->stub().ReadKv(&context, request);
        v1::KvChunk chunk;
        grpc::Status bad;  // a reply that breaks the chunk contract
        while (bad.ok() && reader->Read(&chunk)) {
          const int64_t n = chunk.positions_size();
          if (static_cast<int64_t>(chunk.keys().size()) != n * token_bytes ||
              static_cast<int64_t>(chunk.values().size()) != n * token_bytes) {
            bad = grpc::Status(
                grpc::StatusCode::INTERNAL,
                absl::StrCat("ReadKv of session ", id_, ": a chunk of layer ",
                             chunk.layer(), " has ", n, " positions and ",
                             chunk.keys().size(), " key bytes"));
            break;
          }
          // A layer's data starts with a chunk at slot 0; later chunks
          // continue it in slot order.
          if (out.empty() || out.back().layer != chunk.layer() ||
              chunk.first_slot() == 0) {
            out.push_back(LayerKvData{chunk.layer(), chunk.version()});
          }
          LayerKvData& layer = out.back();
          if (chunk.first_slot() !=
                  static_cast<int64_t>(layer.positions.size()) ||
              chunk.version() != layer.version) {
            bad = grpc::Status(
                grpc::StatusCode::INTERNAL,
                absl::StrCat("ReadKv of session ", id_, ": layer ",
                             chunk.layer(), " chunk at slot ",
                             chunk.first_slot(), " version ", chunk.version(),
                             " does not continue slot ", layer.positions.size(),
                             " version ", layer.version));
            break;
          }
          layer.positions.insert(layer.positions.end(),
                                 chunk.positions().begin(),
                                 chunk.positions().end());
          layer.keys.append(chunk.keys());
          layer.values.append(chunk.values());
        }
        if (!bad.ok()) {
          context.TryCancel();
          reader->Finish();
          return bad;
        }
        return reader->Finish();
      });
  if (!s.ok()) return s;
  if (!layers.empty() && out.size() != layers.size()) {
    return absl::InternalError(absl::StrCat("ReadKv of session ", id_, ": ",
                                            layers.size(), " layers asked, ",
                                            out.size(), " came"));
  }
  return out;
}

absl::StatusOr<BlockTableMirror> Session::Mirror() const {
  absl::StatusOr<v1::GetBlockTablesResponse> tables = GetBlockTables();
  if (!tables.ok()) return tables.status();
  return BlockTableMirror::FromTables(*tables);
}

absl::StatusOr<v1::SessionStats> Session::Stats() const {
  return client::Stats(*connection_, id_);
}

absl::StatusOr<v1::ServerInfo> Session::GetServerInfo() const {
  return connection_->GetServerInfo();
}

absl::StatusOr<int64_t> Session::Close() const {
  return client::Close(*connection_, id_);
}

// ---------------------------------------------------------------------------
// KvKeepClient

absl::StatusOr<KvKeepClient> KvKeepClient::Connect(
    const ClientOptions& options) {
  if (options.address.empty()) {
    return absl::InvalidArgumentError("ClientOptions.address is empty");
  }
  if (options.retries < 0 || options.backoff < absl::ZeroDuration() ||
      options.max_backoff < options.backoff) {
    return absl::InvalidArgumentError(
        "ClientOptions: retries and backoff must be >= 0 and max_backoff >= "
        "backoff");
  }
  if (options.deadline <= absl::ZeroDuration() ||
      options.stream_deadline <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "ClientOptions: deadlines must be positive");
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (options.use_tls || !options.tls_root_certs_pem.empty()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_root_certs_pem;
    credentials = grpc::SslCredentials(ssl);
  } else {
    credentials = grpc::InsecureChannelCredentials();
  }
  grpc::ChannelArguments args;
  // Reconnect on the retry schedule: the default (1 s, growing to 120 s)
  // would leave a restarted server unseen long after it is back.
  const auto ms = [](absl::Duration d) {
    return static_cast<int>(
        std::clamp<int64_t>(absl::ToInt64Milliseconds(d), 1, 1 << 30));
  };
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, ms(options.backoff));
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, ms(options.max_backoff));
  args.SetMaxReceiveMessageSize(options.max_receive_message_bytes);
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel(options.address, credentials, args);
  if (channel == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot make a channel to ", options.address));
  }
  return KvKeepClient(std::make_shared<const Connection>(options, channel));
}

v1::KvKeep::Stub& KvKeepClient::stub() const { return connection_->stub(); }

const ClientOptions& KvKeepClient::options() const {
  return connection_->options();
}

absl::StatusOr<v1::ServerInfo> KvKeepClient::GetServerInfo() const {
  return connection_->GetServerInfo();
}

absl::StatusOr<Session> KvKeepClient::MakeSession(
    std::string id, const std::string& layout_name,
    std::vector<int64_t> budgets) const {
  absl::StatusOr<Connection::LayoutInfo> info =
      connection_->FindLayout(layout_name);
  if (!info.ok()) return info.status();
  if (!info->layout.has_value()) {
    return absl::InternalError(
        absl::StrCat("session ", id, " has layout '", layout_name,
                     "', which the server's ServerInfo does not list"));
  }
  return Session(connection_, std::move(id), *std::move(info->layout),
                 std::move(budgets), info->max_message_bytes);
}

absl::StatusOr<Session> KvKeepClient::CreateSession(
    const v1::CreateSessionRequest& request) const {
  // The layout first: a session created and then unusable for want of its
  // layout would leak.
  absl::StatusOr<Connection::LayoutInfo> layout =
      connection_->FindLayout(request.layout());
  if (!layout.ok()) return layout.status();
  v1::CreateSessionResponse response;
  absl::Status s = connection_->Call(
      "CreateSession",
      request.idempotency_key().empty() ? Retry::kNo : Retry::kOnUnavailable,
      [&](grpc::ClientContext& context, int) {
        return connection_->stub().CreateSession(&context, request, &response);
      });
  if (!s.ok()) return s;
  return MakeSession(
      response.session_id(), request.layout(),
      {response.layer_budgets().begin(), response.layer_budgets().end()});
}

absl::StatusOr<Session> KvKeepClient::OpenSession(
    const std::string& session_id) const {
  absl::StatusOr<v1::SessionStats> stats =
      client::Stats(*connection_, session_id);
  if (!stats.ok()) return stats.status();
  return MakeSession(
      session_id, stats->layout(),
      {stats->layer_budget().begin(), stats->layer_budget().end()});
}

absl::StatusOr<v1::SessionStats> KvKeepClient::GetSessionStats(
    const std::string& session_id) const {
  return client::Stats(*connection_, session_id);
}

absl::StatusOr<std::vector<v1::SessionStats>> KvKeepClient::ListSessions()
    const {
  v1::ListSessionsResponse response;
  absl::Status s =
      connection_->Call("ListSessions", Retry::kOnUnavailable,
                        [&](grpc::ClientContext& context, int) {
                          response.Clear();
                          return connection_->stub().ListSessions(
                              &context, v1::ListSessionsRequest(), &response);
                        });
  if (!s.ok()) return s;
  return std::vector<v1::SessionStats>(response.sessions().begin(),
                                       response.sessions().end());
}

absl::StatusOr<int64_t> KvKeepClient::CloseSession(
    const std::string& session_id) const {
  return client::Close(*connection_, session_id);
}

absl::StatusOr<v1::TransferSessionResponse> KvKeepClient::TransferSession(
    v1::TransferSessionRequest request) const {
  if (request.transfer_id().empty()) {
    absl::BitGen rng;
    request.set_transfer_id(absl::StrFormat("%016x%016x",
                                            absl::Uniform<uint64_t>(rng),
                                            absl::Uniform<uint64_t>(rng)));
  }
  v1::TransferSessionResponse response;
  absl::Status s =
      connection_->Call("TransferSession", Retry::kOnUnavailable,
                        [&](grpc::ClientContext& context, int) {
                          response.Clear();
                          return connection_->stub().TransferSession(
                              &context, request, &response);
                        });
  if (!s.ok()) return s;
  return response;
}

// ---------------------------------------------------------------------------
// BlockTableMirror

BlockTableMirror::BlockTableMirror(int32_t page_tokens,
                                   absl::Span<const uint64_t> versions)
    : page_tokens_(page_tokens), layers_(versions.size()) {
  for (size_t l = 0; l < versions.size(); ++l) {
    layers_[l].version = versions[l];
  }
}

absl::StatusOr<BlockTableMirror> BlockTableMirror::FromTables(
    const v1::GetBlockTablesResponse& tables) {
  if (tables.tables_size() == 0) {
    return absl::InvalidArgumentError("no block tables to mirror");
  }
  BlockTableMirror mirror(tables.tables(0).page_tokens());
  for (int l = 0; l < tables.tables_size(); ++l) {
    const v1::BlockTable& t = tables.tables(l);
    if (t.layer() != l) {
      return absl::InvalidArgumentError(
          absl::StrCat("block table ", l, " is of layer ", t.layer(),
                       ": a mirror needs every layer, in layer order"));
    }
    mirror.layers_.push_back(
        Layer{t.version(),
              {t.pages().begin(), t.pages().end()},
              {t.positions().begin(), t.positions().end()}});
  }
  return mirror;
}

namespace {

// The call's new tokens that a layer kept: new_positions minus the evicted
// ones (both ascending).
int64_t KeptNew(absl::Span<const int64_t> new_positions,
                const google::protobuf::RepeatedField<int64_t>& evicted) {
  int64_t kept = 0;
  for (int64_t p : new_positions) {
    kept += std::binary_search(evicted.begin(), evicted.end(), p) ? 0 : 1;
  }
  return kept;
}

}  // namespace

absl::Status BlockTableMirror::Check(
    const v1::StepResult& result,
    absl::Span<const int64_t> new_positions) const {
  if (result.layers_size() != num_layers()) {
    return absl::InvalidArgumentError(
        absl::StrCat("a result of ", result.layers_size(),
                     " layers for a mirror of ", num_layers()));
  }
  for (int32_t l = 0; l < num_layers(); ++l) {
    const v1::LayerChange& c = result.layers(l);
    const Layer& layer = layers_[l];
    const int64_t size = static_cast<int64_t>(layer.positions.size());
    const auto where = [&] { return absl::StrCat("layer ", l, ": "); };
    if (c.layer() != l) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), "the result names layer ", c.layer()));
    }
    for (const v1::SlotMove& m : c.moves()) {
      if (m.from_slot() < 0 || m.from_slot() >= size || m.to_slot() < 0 ||
          m.to_slot() >= size) {
        return absl::InvalidArgumentError(
            absl::StrCat(where(), "move ", m.from_slot(), " -> ", m.to_slot(),
                         " outside the ", size, " resident slots"));
      }
    }
    const int64_t kept_old =
        c.resident() - KeptNew(new_positions, c.evicted_positions());
    if (kept_old < 0 || kept_old > size) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), "resident ", c.resident(), " with ",
                       new_positions.size(), " new tokens from ", size));
    }
    const int64_t freed = c.pages_freed_size();
    const int64_t pages = static_cast<int64_t>(layer.pages.size());
    if (freed > pages ||
        !std::is_permutation(c.pages_freed().begin(), c.pages_freed().end(),
                             layer.pages.end() - freed)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where(), "the ", freed, " freed pages are not the last of ", pages));
    }
    if ((pages - freed + c.pages_added_size()) * page_tokens_ < c.resident()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), pages - freed + c.pages_added_size(),
                       " pages cannot hold ", c.resident(), " tokens"));
    }
  }
  return absl::OkStatus();
}

absl::Status BlockTableMirror::Apply(const v1::StepResult& result,
                                     absl::Span<const int64_t> new_positions) {
  if (absl::Status s = Check(result, new_positions); !s.ok()) return s;
  for (int32_t l = 0; l < num_layers(); ++l) {
    const v1::LayerChange& c = result.layers(l);
    Layer& layer = layers_[l];
    for (const v1::SlotMove& m : c.moves()) {
      layer.positions[m.to_slot()] = layer.positions[m.from_slot()];
    }
    const int64_t kept_new = KeptNew(new_positions, c.evicted_positions());
    layer.positions.resize(c.resident() - kept_new);
    layer.pages.resize(layer.pages.size() - c.pages_freed_size());
    layer.pages.insert(layer.pages.end(), c.pages_added().begin(),
                       c.pages_added().end());
    for (int64_t p : new_positions) {
      if (!std::binary_search(c.evicted_positions().begin(),
                              c.evicted_positions().end(), p)) {
        layer.positions.push_back(p);
      }
    }
    layer.version = c.version();
  }
  return absl::OkStatus();
}

absl::Status BlockTableMirror::ApplyDecode(
    const v1::DecodeStepResult& result,
    absl::Span<const int64_t> new_positions) {
  if (result.has_append()) {
    if (absl::Status s = Apply(result.append(), new_positions); !s.ok()) {
      return s;
    }
  } else if (!new_positions.empty()) {
    return absl::InvalidArgumentError(
        "new positions given for a decode step that appended nothing");
  }
  return Apply(result.scores());
}

absl::Status BlockTableMirror::ApplyPrefill(
    const PrefillResult& result, absl::Span<const int64_t> positions) {
  int64_t first = 0;
  for (size_t c = 0; c < result.chunks.size(); ++c) {
    const int64_t n = result.chunk_tokens[c];
    if (first + n > static_cast<int64_t>(positions.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("the prefill's chunks hold more than the ",
                       positions.size(), " positions given"));
    }
    if (absl::Status s = Apply(result.chunks[c], positions.subspan(first, n));
        !s.ok()) {
      return s;
    }
    first += n;
  }
  return absl::OkStatus();
}

std::vector<int64_t> BlockTableMirror::CachePositions(int32_t layer) const {
  const std::vector<int64_t>& positions = layers_[layer].positions;
  std::vector<int64_t> order(positions.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::sort(order.begin(), order.end(),
            [&](int64_t a, int64_t b) { return positions[a] < positions[b]; });
  std::vector<int64_t> rank(positions.size());
  for (size_t r = 0; r < order.size(); ++r) {
    rank[order[r]] = static_cast<int64_t>(r);
  }
  return rank;
}

v1::BlockTable BlockTableMirror::Table(int32_t layer) const {
  const Layer& l = layers_[layer];
  v1::BlockTable table;
  table.set_layer(layer);
  table.set_version(l.version);
  table.set_page_tokens(page_tokens_);
  table.mutable_pages()->Add(l.pages.begin(), l.pages.end());
  table.mutable_positions()->Add(l.positions.begin(), l.positions.end());
  const std::vector<int64_t> cache = CachePositions(layer);
  table.mutable_cache_positions()->Add(cache.begin(), cache.end());
  return table;
}

}  // namespace kvkeep::client
