// The client's calls: KvKeepClient, Session and DecodeStream, each an RPC
// (or a stream of them) through the shared Connection (connection.h: token,
// deadlines, retries). BlockTableMirror is in block_table_mirror.cc.
#include "services/client/kvkeep_client.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "services/client/connection.h"
#include "services/common/dtype_proto.h"
#include "services/common/grpc_status.h"

namespace kvkeep::client {
namespace {

int64_t DTypeBytes(v1::DType dtype) {
  absl::StatusOr<DType> d = DTypeFromProto(dtype);
  return d.ok() ? kvkeep::DTypeBytes(*d) : 0;
}

// Bytes of one token's keys (or values) in one layer, as appended and as
// ReadKv returns them (the append dtype: dequantised for a quantised layout).
int64_t TokenBytes(const v1::Layout& layout) {
  return int64_t{layout.kv_heads()} * layout.head_dim() *
         DTypeBytes(AppendDTypeOf(layout));
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

// A read-only call that names one session: retried on UNAVAILABLE.
template <typename Request, typename Response>
absl::StatusOr<Response> SessionRead(
    const Connection& connection, const char* method,
    const std::string& session_id,
    grpc::Status (v1::KvKeep::Stub::*rpc)(grpc::ClientContext*, const Request&,
                                          Response*)) {
  Request request;
  request.set_session_id(session_id);
  Response response;
  absl::Status s = connection.Call(
      method, Retry::kOnUnavailable, [&](grpc::ClientContext& context, int) {
        return (connection.stub().*rpc)(&context, request, &response);
      });
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<v1::SessionStats> Stats(const Connection& connection,
                                       const std::string& session_id) {
  return SessionRead(connection, "GetSessionStats", session_id,
                     &v1::KvKeep::Stub::GetSessionStats);
}

// A renewal twice is a renewal: retried as a read.
absl::StatusOr<v1::KeepAliveResponse> KeepAlive(const Connection& connection,
                                                const std::string& session_id) {
  return SessionRead(connection, "KeepAlive", session_id,
                     &v1::KvKeep::Stub::KeepAlive);
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
    // The session moved, or is being moved (fleet mode: a TransferSession,
    // a drain): the refused step changed nothing, so it goes again on a new
    // stream, to the new replica once the move is done.
    std::optional<absl::Time> moving_since;
    for (bool followed = false;;) {
      if (s.code() == absl::StatusCode::kNotFound && !followed &&
          connection_->FollowMove(*context_)) {
        followed = true;
      } else if (s.code() != absl::StatusCode::kUnavailable ||
                 !connection_->WaitWhileMoving(*context_, &moving_since)) {
        break;
      }
      step.set_session_id(session_id_);  // a new stream's first message
      context_ = std::make_unique<grpc::ClientContext>();
      connection_->Prepare(*context_, connection_->options().stream_deadline);
      stream_ = connection_->stub().Decode(context_.get());
      ended_ = false;
      if (stream_->Write(step) && stream_->Read(&result)) return result;
      s = End();
    }
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
  for (bool followed = false;; followed = true) {
    result.chunk_tokens.clear();
    response.Clear();
    grpc::ClientContext context;
    connection_->Prepare(context, connection_->options().stream_deadline);
    std::unique_ptr<grpc::ClientWriter<v1::AppendRequest>> writer =
        connection_->stub().AppendPrefill(&context, &response);
    for (int64_t first = 0; first < n; first += chunk) {
      const int64_t count = std::min(chunk, n - first);
      v1::AppendRequest message;
      if (first == 0) message.set_session_id(id_);
      message.mutable_positions()->Add(
          prompt.positions.begin() + first,
          prompt.positions.begin() + first + count);
      for (const LayerBytes& l : prompt.layers) {
        v1::LayerKv* layer = message.add_layers();
        layer->set_keys(l.keys.data() + first * token_bytes,
                        count * token_bytes);
        layer->set_values(l.values.data() + first * token_bytes,
                          count * token_bytes);
      }
      result.chunk_tokens.push_back(count);
      // A failed write means the server ended the call; Finish says why.
      if (!writer->Write(message)) break;
    }
    writer->WritesDone();
    const absl::Status s = FromGrpcStatus(writer->Finish());
    // A session that moved (fleet mode) refused the first chunk, so nothing
    // was appended: the prompt goes once more, to its new replica.
    if (s.code() == absl::StatusCode::kNotFound && !followed &&
        response.chunks_size() == 0 && connection_->FollowMove(context)) {
      continue;
    }
    if (!s.ok()) return s;
    break;
  }
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

namespace {

// Adds one page of a GetBlockTables answer to `whole`: a table part that
// does not start at slot 0 continues the last table.
absl::Status AddBlockTablePage(v1::GetBlockTablesResponse& page,
                               v1::GetBlockTablesResponse& whole) {
  for (v1::BlockTable& part : *page.mutable_tables()) {
    if (part.first_slot() == 0) {
      *whole.add_tables() = std::move(part);
      continue;
    }
    v1::BlockTable* last =
        whole.tables_size() > 0
            ? whole.mutable_tables()->Mutable(whole.tables_size() - 1)
            : nullptr;
    if (last == nullptr || last->layer() != part.layer() ||
        last->version() != part.version() ||
        last->positions_size() != part.first_slot()) {
      return absl::InternalError(absl::StrCat(
          "GetBlockTables: a part of layer ", part.layer(), " from slot ",
          part.first_slot(), " continues no table received"));
    }
    last->mutable_pages()->Add(part.pages().begin(), part.pages().end());
    last->mutable_positions()->Add(part.positions().begin(),
                                   part.positions().end());
    last->mutable_cache_positions()->Add(part.cache_positions().begin(),
                                         part.cache_positions().end());
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::GetBlockTablesResponse> Session::GetBlockTables(
    absl::Span<const int32_t> layers) const {
  v1::GetBlockTablesRequest request;
  request.set_session_id(id_);
  request.mutable_layers()->Add(layers.begin(), layers.end());
  // A large answer comes in pages; a layer that changes between them makes
  // the server answer ABORTED, and the whole answer is asked for again.
  v1::GetBlockTablesResponse whole;
  for (int attempt = 0;; ++attempt) {
    whole.Clear();
    request.clear_page_token();
    absl::Status s;
    do {
      v1::GetBlockTablesResponse page;
      s = connection_->Call("GetBlockTables", Retry::kOnUnavailable,
                            [&](grpc::ClientContext& context, int) {
                              page.Clear();
                              return connection_->stub().GetBlockTables(
                                  &context, request, &page);
                            });
      if (s.ok()) s = AddBlockTablePage(page, whole);
      request.set_page_token(page.next_page_token());
    } while (s.ok() && !request.page_token().empty());
    if (s.code() != absl::StatusCode::kAborted || attempt == 2) {
      if (!s.ok()) return s;
      return whole;
    }
  }
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
  request.set_dtype(AppendDTypeOf(layout_));
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

absl::StatusOr<v1::KeepAliveResponse> Session::KeepAlive() const {
  return client::KeepAlive(*connection_, id_);
}

absl::StatusOr<v1::PrefixInfo> Session::Publish(const std::string& name,
                                                bool is_public) const {
  v1::PublishPrefixRequest request;
  request.set_session_id(id_);
  request.set_name(name);
  request.set_is_public(is_public);
  v1::PrefixInfo response;
  absl::Status s = connection_->Call(
      "PublishPrefix", Retry::kNo, [&](grpc::ClientContext& context, int) {
        return connection_->stub().PublishPrefix(&context, request, &response);
      });
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<Session> Session::Fork(v1::ForkSessionRequest request) const {
  request.set_session_id(id_);
  v1::ForkSessionResponse response;
  absl::Status s = connection_->Call(
      "ForkSession",
      request.idempotency_key().empty() ? Retry::kNo : Retry::kOnUnavailable,
      [&](grpc::ClientContext& context, int) {
        response.Clear();
        return connection_->stub().ForkSession(&context, request, &response);
      });
  if (!s.ok()) return s;
  return Session(
      Connection::ForSession(connection_), response.session_id(), layout_,
      {response.layer_budgets().begin(), response.layer_budgets().end()},
      max_message_bytes_);
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
  if (absl::Status s = CheckClientOptions(options); !s.ok()) return s;
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
      MakeChannel(options, options.address);
  if (!channel.ok()) return channel.status();
  return KvKeepClient(std::make_shared<const Connection>(options, *channel));
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
  return Session(Connection::ForSession(connection_), std::move(id),
                 *std::move(info->layout), std::move(budgets),
                 info->max_message_bytes);
}

absl::StatusOr<Session> KvKeepClient::CreateSession(
    const v1::CreateSessionRequest& request) const {
  // The layout first: a session created and then unusable for want of its
  // layout would leak. (From a prefix without a layout, the server names
  // it in the response: one of those ServerInfo lists.)
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
      response.session_id(),
      response.layout().empty() ? request.layout() : response.layout(),
      {response.layer_budgets().begin(), response.layer_budgets().end()});
}

absl::StatusOr<int64_t> KvKeepClient::UnpublishPrefix(const std::string& name,
                                                      bool is_public) const {
  v1::UnpublishPrefixRequest request;
  request.set_name(name);
  request.set_is_public(is_public);
  v1::UnpublishPrefixResponse response;
  absl::Status s = connection_->Call(
      "UnpublishPrefix", Retry::kNo, [&](grpc::ClientContext& context, int) {
        return connection_->stub().UnpublishPrefix(&context, request,
                                                   &response);
      });
  if (!s.ok()) return s;
  return response.holders();
}

absl::StatusOr<std::vector<v1::PrefixInfo>> KvKeepClient::ListPrefixes() const {
  v1::ListPrefixesResponse response;
  absl::Status s =
      connection_->Call("ListPrefixes", Retry::kOnUnavailable,
                        [&](grpc::ClientContext& context, int) {
                          response.Clear();
                          return connection_->stub().ListPrefixes(
                              &context, v1::ListPrefixesRequest(), &response);
                        });
  if (!s.ok()) return s;
  return std::vector<v1::PrefixInfo>(response.prefixes().begin(),
                                     response.prefixes().end());
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

absl::StatusOr<v1::KeepAliveResponse> KvKeepClient::KeepAlive(
    const std::string& session_id) const {
  return client::KeepAlive(*connection_, session_id);
}

EventWatch KvKeepClient::WatchEvents(v1::WatchEventsRequest request) const {
  return EventWatch(connection_, std::move(request));
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

}  // namespace kvkeep::client
