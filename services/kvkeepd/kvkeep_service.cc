#include "services/kvkeepd/kvkeep_service.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <thread>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cache_store/policy_registry.h"
#include "cache_store/quote.h"
#include "services/common/convert.h"
#include "services/common/dtype_proto.h"
#include "services/common/fleet_names.h"
#include "services/common/grpc_status.h"
#include "services/kvkeepd/block_table_pages.h"
#include "services/transfer/session_receiver.h"

#ifndef KVKEEP_VERSION
#define KVKEEP_VERSION "dev"
#endif

namespace kvkeep {
namespace {

// A value in a logfmt line: double-quoted, C-escaped (a client cannot end
// the line or forge a field), at most 512 bytes of it.
std::string LogValue(absl::string_view s) {
  constexpr size_t kMax = 512;
  return absl::StrCat("\"", absl::CHexEscape(s.substr(0, kMax)),
                      s.size() > kMax ? "..." : "", "\"");
}

TransferOptions TransferOptionsOf(const ServiceOptions& options,
                                  KvKeepService* service) {
  TransferOptions t;
  t.time_limit = options.transfer_time_limit;
  t.keepalive = options.peer_keepalive;
  t.resolve_attempts = options.transfer_resolve_attempts;
  t.resolve_wait = options.transfer_resolve_wait;
  t.on_resolved = [service](SessionId id, const std::string& transfer_id,
                            bool committed) {
    service->LogEvent(
        "transfer_resolved",
        absl::StrCat("session=", service->SessionIdOf(id),
                     " transfer=", transfer_id,
                     committed ? " committed=true" : " committed=false"));
  };
  t.max_message_bytes = options.max_message_bytes;
  t.tenants_configured = !options.tenants_by_token.empty();
  // Told first (metrics); then a received session's start is published.
  t.on_transfer =
      [service, observer = options.on_transfer](const TransferReport& report) {
        if (observer) observer(report);
        if (!report.outgoing && report.session != 0) {
          service->PublishMovedIn(report.session);
        }
      };
  t.tcp = options.tcp;
  t.wrap_sender = options.wrap_transfer_sender;
  t.peer_token = options.peer_token;
  t.peer_credentials = options.peer_credentials;
  t.plaintext_data = options.plaintext_data;
  t.replica = options.replica_name;
  return t;
}

}  // namespace

KvKeepService::KvKeepService(CacheStore* store, ServiceOptions options)
    : store_(store),
      options_(std::move(options)),
      moved_(options_.remembered_moves),
      events_(EventOptionsFor(options_, store)),
      transfers_(store, TransferOptionsOf(options_, this)) {
  // ReceiveSession reads each chunk in place (session_receiver.h).
  MarkMethodRawCallback(
      ReceiveSessionMethodIndex(),
      RawReceiveSessionHandler([this](grpc::CallbackServerContext* ctx) {
        if (absl::Status peer = AuthenticatePeer(*ctx); !peer.ok()) {
          LogEvent("error", absl::StrCat("method=ReceiveSession code=",
                                         absl::StatusCodeToString(peer.code()),
                                         " message=", Quote(peer.message())));
          return transfers_.Receive(ctx, peer);
        }
        return transfers_.Receive(ctx, Authenticate(*ctx));
      }));
}

void KvKeepService::LogExpired(const ExpiredSession& session) const {
  // Always written: an expiry is what an operator looks for when a client
  // forgot its sessions (one line per session, not per call).
  WriteEvent("session_expired",
             absl::StrCat("session=", SessionIdOf(session.info.id),
                          " tenant=", LogValue(session.info.tenant),
                          " idle_timeout_seconds=",
                          absl::ToDoubleSeconds(session.idle_timeout),
                          " freed_pages=", session.freed_pages));
}

void KvKeepService::LogEvent(absl::string_view event,
                             absl::string_view fields) const {
  if (options_.log_events) WriteEvent(event, fields);
}

void KvKeepService::WriteEvent(absl::string_view event,
                               absl::string_view fields) {
  const std::string line = absl::StrCat(
      "ts=",
      absl::FormatTime(absl::RFC3339_full, absl::Now(), absl::UTCTimeZone()),
      " event=", event, " ", fields, "\n");
  std::fputs(line.c_str(), stderr);
}

grpc::Status KvKeepService::Finish(absl::string_view method,
                                   const absl::Status& raw) {
  const absl::Status status = WithSessionIds(raw);
  if (!status.ok()) {
    LogEvent("error", absl::StrCat("method=", method, " code=",
                                   absl::StatusCodeToString(status.code()),
                                   " message=", LogValue(status.message())));
  }
  return ToGrpcStatus(status);
}

absl::Status KvKeepService::WithSessionIds(const absl::Status& status) const {
  // The store's "session <key>: ..." (session_types.h) becomes "session
  // <replica>.<key>: ...": the id clients know, so they can search for it.
  constexpr absl::string_view kPrefix = "session ";
  const absl::string_view message = status.message();
  if (options_.replica_name.empty() || !absl::StartsWith(message, kPrefix) ||
      status.GetPayload(kNamedAsCalledPayload).has_value()) {
    return status;
  }
  const absl::string_view key = message.substr(kPrefix.size(), 16);
  const absl::string_view after = message.substr(kPrefix.size() + key.size());
  if (!ParseSessionName(std::string_view(key.data(), key.size())).has_value() ||
      !(after.empty() || after[0] == ':' || after[0] == ' ')) {
    return status;
  }
  absl::Status named(status.code(), absl::StrCat(kPrefix, options_.replica_name,
                                                 ".", key, after));
  status.ForEachPayload(
      [&named](absl::string_view url, const absl::Cord& payload) {
        named.SetPayload(url, payload);
      });
  return named;
}

grpc::Status KvKeepService::Finish(grpc::CallbackServerContext* ctx,
                                   absl::string_view method,
                                   const absl::Status& status) {
  for (const auto& [key, value] : MovedSessions::MovedMetadata(status)) {
    ctx->AddTrailingMetadata(key, value);
  }
  return Finish(method, status);
}

std::string KvKeepService::SessionIdOf(SessionId key) const {
  return FleetSessionId(options_.replica_name, key);
}

grpc::ServerUnaryReactor* KvKeepService::Unary(
    grpc::CallbackServerContext* ctx, absl::string_view method,
    const std::function<absl::Status()>& fn) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(Finish(ctx, method, fn()));
  return reactor;
}

grpc::ServerUnaryReactor* KvKeepService::CreateSession(
    grpc::CallbackServerContext* ctx, const v1::CreateSessionRequest* req,
    v1::CreateSessionResponse* resp) {
  return Unary(ctx, "CreateSession", [&]() -> absl::Status {
    absl::StatusOr<std::string> tenant = Authenticate(*ctx);
    if (!tenant.ok()) return tenant.status();
    if (draining()) return DrainingRefusal("CreateSession");
    if (!std::isfinite(req->idle_timeout_seconds())) {
      return absl::InvalidArgumentError(
          absl::StrCat("idle_timeout_seconds must be a finite number, not ",
                       req->idle_timeout_seconds()));
    }
    SessionSpec spec = SpecFromProto(*req);
    spec.tenant = *tenant;
    if (spec.policy.name.empty()) {
      spec.policy = options_.default_policy;
      // Parameters sent without a policy name refine the default's.
      for (const auto& [key, value] : req->policy_params()) {
        spec.policy.params[key] = value;
      }
    }
    absl::StatusOr<SessionId> id = store_->CreateSession(spec);
    if (!id.ok()) return id.status();
    absl::StatusOr<SessionStats> stats = store_->GetStats(*id);
    if (!stats.ok()) return stats.status();
    NewSessionToProto(*stats, resp);
    resp->set_layout(stats->layout);
    resp->set_session_id(SessionIdOf(*id));
    events_.SessionStarted(v1::EVENT_SESSION_CREATED, *id,
                           SessionEventOf(*stats));
    LogEvent(
        "session_create",
        absl::StrCat("session=", SessionIdOf(*id),
                     " tenant=", LogValue(*tenant), " layout=", stats->layout,
                     " policy=", spec.policy.name, " idle_timeout_seconds=",
                     absl::ToDoubleSeconds(stats->idle_timeout)));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvKeepService::CloseSession(
    grpc::CallbackServerContext* ctx, const v1::CloseSessionRequest* req,
    v1::CloseSessionResponse* resp) {
  return Unary(ctx, "CloseSession", [&]() -> absl::Status {
    absl::StatusOr<SessionId> id = CallerSession(*ctx, req->session_id());
    if (!id.ok()) return id.status();
    absl::StatusOr<SessionStats> stats = store_->GetStats(*id);
    if (!stats.ok()) return stats.status();
    if (absl::Status s = store_->CloseSession(*id); !s.ok()) return s;
    resp->set_freed_pages(stats->pages);
    events_.SessionEnded(v1::EVENT_SESSION_CLOSED, *id, SessionEventOf(*stats));
    LogEvent("session_close",
             absl::StrCat("session=", req->session_id(),
                          " tenant=", LogValue(stats->tenant),
                          " evicted_tokens=", stats->evicted_tokens));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvKeepService::ForkSession(
    grpc::CallbackServerContext* ctx, const v1::ForkSessionRequest* req,
    v1::ForkSessionResponse* resp) {
  return Unary(ctx, "ForkSession", [&]() -> absl::Status {
    absl::StatusOr<SessionId> parent = CallerSession(*ctx, req->session_id());
    if (!parent.ok()) return parent.status();
    if (draining()) return DrainingRefusal("ForkSession");
    absl::StatusOr<ForkSpec> spec = ForkSpecFromProto(*req);
    if (!spec.ok()) return spec.status();
    absl::StatusOr<SessionId> id = store_->ForkSession(*parent, *spec);
    if (!id.ok()) return id.status();
    absl::StatusOr<SessionStats> stats = store_->GetStats(*id);
    if (!stats.ok()) return stats.status();
    NewSessionToProto(*stats, resp);
    resp->set_session_id(SessionIdOf(*id));
    resp->set_shared_pages(stats->shared_pages);
    events_.SessionStarted(v1::EVENT_SESSION_FORKED, *id,
                           SessionEventOf(*stats, req->session_id()));
    LogEvent(
        "session_fork",
        absl::StrCat(
            "session=", SessionIdOf(*id), " parent=", req->session_id(),
            " tenant=", LogValue(stats->tenant), " policy=", stats->policy,
            " shared_pages=", stats->shared_pages, " idle_timeout_seconds=",
            absl::ToDoubleSeconds(stats->idle_timeout)));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvKeepService::GetSessionStats(
    grpc::CallbackServerContext* ctx, const v1::GetSessionStatsRequest* req,
    v1::SessionStats* resp) {
  return Unary(ctx, "GetSessionStats", [&]() -> absl::Status {
    absl::StatusOr<SessionId> id = CallerSession(*ctx, req->session_id());
    if (!id.ok()) return id.status();
    absl::StatusOr<SessionStats> stats = store_->GetStats(*id);
    if (!stats.ok()) return stats.status();
    StatsToProto(*stats, resp);
    resp->set_session_id(SessionIdOf(*id));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvKeepService::KeepAlive(
    grpc::CallbackServerContext* ctx, const v1::KeepAliveRequest* req,
    v1::KeepAliveResponse* resp) {
  return Unary(ctx, "KeepAlive", [&]() -> absl::Status {
    absl::StatusOr<SessionId> id = CallerSession(*ctx, req->session_id());
    if (!id.ok()) return id.status();
    absl::StatusOr<LeaseStatus> lease = store_->KeepAlive(*id);
    if (!lease.ok()) return lease.status();
    resp->set_idle_timeout_seconds(absl::ToDoubleSeconds(lease->idle_timeout));
    resp->set_lease_seconds_left(absl::ToDoubleSeconds(lease->left));
    resp->set_lease_held(lease->held);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvKeepService::ListSessions(
    grpc::CallbackServerContext* ctx, const v1::ListSessionsRequest*,
    v1::ListSessionsResponse* resp) {
  return Unary(ctx, "ListSessions", [&]() -> absl::Status {
    absl::StatusOr<std::string> tenant = Authenticate(*ctx);
    if (!tenant.ok()) return tenant.status();
    const bool all = options_.tenants_by_token.empty();
    for (const SessionInfo& info : store_->Sessions()) {
      if (!all && info.tenant != *tenant) continue;
      // A listing is not a call on the session: it does not renew leases.
      absl::StatusOr<SessionStats> stats =
          store_->GetStats(info.id, /*renew_lease=*/false);
      if (!stats.ok()) continue;  // closed since the listing
      v1::SessionStats* out = resp->add_sessions();
      StatsToProto(*stats, out);
      out->set_session_id(SessionIdOf(info.id));
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvKeepService::Append(
    grpc::CallbackServerContext* ctx, const v1::AppendRequest* req,
    v1::StepResult* resp) {
  return Unary(ctx, "Append", [&]() -> absl::Status {
    absl::StatusOr<SessionId> id = CallerSession(*ctx, req->session_id());
    if (!id.ok()) return id.status();
    std::vector<LayerKv> layers;
    absl::StatusOr<StepResult> result =
        store_->Append(*id, AppendFromProto(*req, layers));
    if (!result.ok()) return result.status();
    events_.RecordWork(*id, *result);
    StepResultToProto(*result, resp);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvKeepService::CompressPrompt(
    grpc::CallbackServerContext* ctx, const v1::CompressPromptRequest* req,
    v1::StepResult* resp) {
  return Unary(ctx, "CompressPrompt", [&]() -> absl::Status {
    absl::StatusOr<SessionId> id = CallerSession(*ctx, req->session_id());
    if (!id.ok()) return id.status();
    absl::StatusOr<std::vector<LayerScores>> window =
        ScoresFromProto(req->window());
    if (!window.ok()) return InSession(*id, window.status());
    absl::StatusOr<StepResult> result = store_->CompressPrompt(*id, *window);
    if (!result.ok()) return result.status();
    events_.RecordWork(*id, *result);
    StepResultToProto(*result, resp);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvKeepService::GetBlockTables(
    grpc::CallbackServerContext* ctx, const v1::GetBlockTablesRequest* req,
    v1::GetBlockTablesResponse* resp) {
  return Unary(ctx, "GetBlockTables", [&]() -> absl::Status {
    absl::StatusOr<SessionId> id = CallerSession(*ctx, req->session_id());
    if (!id.ok()) return id.status();
    std::vector<int32_t> layers(req->layers().begin(), req->layers().end());
    if (layers.empty()) {
      absl::StatusOr<SessionStats> stats = store_->GetStats(*id);
      if (!stats.ok()) return stats.status();
      for (size_t l = 0; l < stats->layer_resident.size(); ++l) {
        layers.push_back(static_cast<int32_t>(l));
      }
    }
    if (req->max_page_bytes() != 0 &&
        req->max_page_bytes() < kMinBlockTablePageBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "max_page_bytes ", req->max_page_bytes(),
          " is under the smallest page, ", kMinBlockTablePageBytes, " bytes"));
    }
    const int64_t limit = options_.max_message_bytes;
    return FillBlockTablePage(*store_, *id, layers, req->page_token(),
                              req->max_page_bytes() > 0
                                  ? std::min(req->max_page_bytes(), limit)
                                  : limit,
                              resp);
  });
}

grpc::ServerUnaryReactor* KvKeepService::MapPool(
    grpc::CallbackServerContext* ctx, const v1::MapPoolRequest* req,
    v1::MapPoolResponse* resp) {
  return Unary(ctx, "MapPool", [&]() -> absl::Status {
    std::string layout = req->layout();
    std::optional<SessionStats> session;
    if (!req->session_id().empty()) {
      absl::StatusOr<SessionId> id = CallerSession(*ctx, req->session_id());
      if (!id.ok()) return id.status();
      absl::StatusOr<SessionStats> stats = store_->GetStats(*id);
      if (!stats.ok()) return stats.status();
      if (!layout.empty() && layout != stats->layout) {
        return absl::InvalidArgumentError(
            absl::StrCat(SessionLabel(*id), " has layout '", stats->layout,
                         "', not ", Quote(layout)));
      }
      layout = stats->layout;
      session = *std::move(stats);
    } else {
      if (absl::StatusOr<std::string> t = Authenticate(*ctx); !t.ok()) {
        return t.status();
      }
      if (layout.empty()) {
        return absl::InvalidArgumentError(
            "MapPool needs a layout or a session_id");
      }
    }
    absl::StatusOr<PoolMapping> mapping = store_->SharePool(layout);
    if (!mapping.ok()) return mapping.status();
    LayoutToProto(mapping->layout, resp->mutable_layout());
    resp->set_device(mapping->device.name());
    resp->set_arena_bytes(mapping->arena_bytes);
    resp->set_capacity_pages(mapping->capacity_pages);
    if (!mapping->handle.cuda_ipc_handle.empty()) {
      resp->set_cuda_ipc_handle(mapping->handle.cuda_ipc_handle);
    } else {
      resp->set_shm_name(mapping->handle.shm_name);
    }
    resp->set_server_pid(static_cast<int32_t>(getpid()));
    if (session.has_value()) {
      for (size_t l = 0; l < session->layer_resident.size(); ++l) {
        absl::StatusOr<BlockTable> table =
            store_->GetBlockTable(session->id, static_cast<int32_t>(l));
        if (!table.ok()) return table.status();
        BlockTableToProto(*table, resp->add_tables());
      }
    }
    return absl::OkStatus();
  });
}

namespace {

// Binds a client stream to the one session its first message names; later
// messages may repeat the id or leave it empty. Holds the session's lease
// while the stream is open (it is the stream's activity).
class StreamBinding {
 public:
  StreamBinding(KvKeepService* service, std::string tenant,
                absl::string_view method)
      : service_(service), tenant_(std::move(tenant)), method_(method) {}

  // The session for a message naming `session_id` (or nothing).
  absl::StatusOr<SessionId> Resolve(const std::string& session_id) {
    if (name_.empty()) {
      if (session_id.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the first message of ", method_, " must name session_id"));
      }
      absl::StatusOr<SessionId> id = service_->Authorize(tenant_, session_id);
      if (!id.ok()) return id.status();
      absl::StatusOr<std::unique_ptr<CacheStore::LeaseHold>> hold =
          service_->store().HoldLease(*id);
      if (!hold.ok()) return hold.status();
      hold_ = *std::move(hold);
      name_ = session_id;
      id_ = *id;
    } else if (!session_id.empty() && session_id != name_) {
      return absl::InvalidArgumentError(
          absl::StrCat(method_, " serves one session (", name_,
                       "); a message named ", session_id));
    }
    return id_;
  }

 private:
  KvKeepService* const service_;
  const std::string tenant_;
  const absl::string_view method_;
  std::string name_;
  SessionId id_ = 0;
  std::unique_ptr<CacheStore::LeaseHold> hold_;
};

// AppendPrefill: appends each chunk as it arrives; the reply lists one
// result per chunk. The first failing chunk ends the call with its status;
// the chunks before it stay appended (the message says how many).
class PrefillReactor final : public grpc::ServerReadReactor<v1::AppendRequest> {
 public:
  PrefillReactor(KvKeepService* service, grpc::CallbackServerContext* ctx,
                 v1::AppendPrefillResponse* resp)
      : service_(service), ctx_(ctx), resp_(resp) {
    absl::StatusOr<std::string> tenant = service_->Authenticate(*ctx);
    if (!tenant.ok()) {
      Finish(service_->Finish("AppendPrefill", tenant.status()));
      return;
    }
    binding_.emplace(service_, *std::move(tenant), "AppendPrefill");
    StartRead(&chunk_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client finished sending
      Finish(grpc::Status::OK);
      return;
    }
    if (absl::Status s = AppendChunk(); !s.ok()) {
      absl::Status status(
          s.code(),
          absl::StrCat("chunk ", resp_->chunks_size(), ": ", s.message(), " (",
                       resp_->chunks_size(), " earlier chunks were appended)"));
      // A moved session's new place (MovedSessions) travels on.
      s.ForEachPayload(
          [&status](absl::string_view url, const absl::Cord& payload) {
            status.SetPayload(url, payload);
          });
      Finish(service_->Finish(ctx_, "AppendPrefill", status));
      return;
    }
    StartRead(&chunk_);
  }

  void OnDone() override { delete this; }

 private:
  absl::Status AppendChunk() {
    absl::StatusOr<SessionId> id = binding_->Resolve(chunk_.session_id());
    if (!id.ok()) return id.status();
    absl::StatusOr<StepResult> result =
        service_->store().Append(*id, AppendFromProto(chunk_, layers_));
    if (!result.ok()) return result.status();
    service_->events().RecordWork(*id, *result);
    StepResultToProto(*result, resp_->add_chunks());
    return absl::OkStatus();
  }

  KvKeepService* const service_;
  grpc::CallbackServerContext* const ctx_;
  v1::AppendPrefillResponse* const resp_;
  std::optional<StreamBinding> binding_;  // set once authenticated
  v1::AppendRequest chunk_;
  std::vector<LayerKv> layers_;
};

// Decode: one reply per step, in order. A failing step ends the stream with
// its status and changes nothing (Session::Step checks it whole).
class DecodeReactor final
    : public grpc::ServerBidiReactor<v1::DecodeStep, v1::DecodeStepResult> {
 public:
  DecodeReactor(KvKeepService* service, grpc::CallbackServerContext* ctx)
      : service_(service), ctx_(ctx) {
    absl::StatusOr<std::string> tenant = service_->Authenticate(*ctx);
    if (!tenant.ok()) {
      Finish(service_->Finish("Decode", tenant.status()));
      return;
    }
    binding_.emplace(service_, *std::move(tenant), "Decode");
    StartRead(&step_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status::OK);
      return;
    }
    if (absl::Status s = RunStep(); !s.ok()) {
      Finish(service_->Finish(ctx_, "Decode", s));
      return;
    }
    StartWrite(&result_);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "client went away"));
      return;
    }
    StartRead(&step_);
  }

  void OnDone() override { delete this; }

 private:
  absl::Status RunStep() {
    absl::StatusOr<SessionId> id = binding_->Resolve(step_.session_id());
    if (!id.ok()) return id.status();
    if (absl::Status s = ScoresFromProto(step_.scores(), scores_); !s.ok()) {
      return InSession(*id, s);
    }
    if (step_.has_append() && step_.append().positions_size() == 0) {
      return InSession(*id, absl::InvalidArgumentError(
                                "the step's append has no tokens (leave "
                                "append unset for a scores-only step)"));
    }
    const AppendRequest append = AppendFromProto(step_.append(), layers_);
    if (absl::Status s = service_->store().Step(*id, append, scores_, outcome_);
        !s.ok()) {
      return service_->WhereItWent(*id, s);
    }
    service_->events().RecordWork(*id, outcome_.append, outcome_.scores);
    // Cleared in place: DecodeStepResult::Clear() would delete both
    // results and with them every LayerChange message and its buffers.
    if (step_.has_append()) {
      result_.mutable_append()->Clear();
      StepResultToProto(outcome_.append, result_.mutable_append());
    } else {
      result_.clear_append();
    }
    result_.mutable_scores()->Clear();
    StepResultToProto(outcome_.scores, result_.mutable_scores());
    return absl::OkStatus();
  }

  KvKeepService* const service_;
  grpc::CallbackServerContext* const ctx_;
  std::optional<StreamBinding> binding_;  // set once authenticated
  // The stream's messages and the store's views and results of them, kept
  // for its life: a steady-state step reuses their buffers.
  v1::DecodeStep step_;
  v1::DecodeStepResult result_;
  std::vector<LayerKv> layers_;
  std::vector<LayerScores> scores_;
  StepOutcome outcome_;
};

// ReadKv: each requested layer's resident K/V in slot order, in chunks that
// keep every message well under the server's message limit.
class ReadKvReactor final : public grpc::ServerWriteReactor<v1::KvChunk> {
 public:
  ReadKvReactor(KvKeepService* service, grpc::CallbackServerContext* ctx,
                const v1::ReadKvRequest* req)
      : service_(service) {
    if (absl::Status s = Start(*ctx, *req); !s.ok()) {
      Finish(service_->Finish(ctx, "ReadKv", s));
      return;
    }
    Next();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "client went away"));
      return;
    }
    Next();
  }

  void OnDone() override { delete this; }

 private:
  absl::Status Start(const grpc::CallbackServerContext& ctx,
                     const v1::ReadKvRequest& req) {
    absl::StatusOr<SessionId> id =
        service_->CallerSession(ctx, req.session_id());
    if (!id.ok()) return id.status();
    id_ = *id;
    absl::StatusOr<std::unique_ptr<CacheStore::LeaseHold>> hold =
        service_->store().HoldLease(id_);
    if (!hold.ok()) return hold.status();
    hold_ = *std::move(hold);
    if (req.dtype() != v1::DTYPE_UNSPECIFIED) {
      absl::StatusOr<DType> dtype = DTypeFromProto(req.dtype());
      if (!dtype.ok()) return dtype.status();
      dtype_ = *dtype;
    }
    layers_.assign(req.layers().begin(), req.layers().end());
    absl::StatusOr<SessionStats> stats = service_->store().GetStats(id_);
    if (!stats.ok()) return stats.status();
    if (layers_.empty()) {
      for (size_t l = 0; l < stats->layer_resident.size(); ++l) {
        layers_.push_back(static_cast<int32_t>(l));
      }
    }
    return absl::OkStatus();
  }

  // Writes the next chunk, or finishes.
  void Next() {
    while (next_slot_ >= static_cast<int64_t>(copy_.positions.size())) {
      if (next_layer_ >= layers_.size()) {
        Finish(grpc::Status::OK);
        return;
      }
      layer_ = layers_[next_layer_++];
      absl::StatusOr<LayerKvCopy> copy =
          dtype_ ? service_->store().ReadLayerAs(id_, layer_, *dtype_)
                 : service_->store().ReadLayer(id_, layer_);
      if (!copy.ok()) {
        Finish(service_->Finish("ReadKv", copy.status()));
        return;
      }
      copy_ = *std::move(copy);
      next_slot_ = 0;
      if (copy_.positions.empty()) {  // an empty layer still gets a message
        chunk_.Clear();
        chunk_.set_layer(layer_);
        chunk_.set_version(copy_.version);
        chunk_.set_dtype(DTypeToProto(copy_.dtype));
        StartWrite(&chunk_);
        return;
      }
    }
    const int64_t n = static_cast<int64_t>(copy_.positions.size());
    const int64_t token_bytes =
        static_cast<int64_t>(copy_.keys.size()) / std::max<int64_t>(n, 1);
    const int64_t budget = std::min<int64_t>(
        kChunkBytes, service_->options().max_message_bytes / 4);
    const int64_t tokens =
        std::max<int64_t>(1, budget / std::max<int64_t>(1, 2 * token_bytes));
    const int64_t end = std::min(n, next_slot_ + tokens);
    chunk_.Clear();
    chunk_.set_layer(layer_);
    chunk_.set_version(copy_.version);
    chunk_.set_first_slot(next_slot_);
    chunk_.set_dtype(DTypeToProto(copy_.dtype));
    chunk_.mutable_positions()->Add(copy_.positions.begin() + next_slot_,
                                    copy_.positions.begin() + end);
    const auto* k = reinterpret_cast<const char*>(copy_.keys.data());
    const auto* v = reinterpret_cast<const char*>(copy_.values.data());
    chunk_.set_keys(k + next_slot_ * token_bytes,
                    (end - next_slot_) * token_bytes);
    chunk_.set_values(v + next_slot_ * token_bytes,
                      (end - next_slot_) * token_bytes);
    next_slot_ = end;
    StartWrite(&chunk_);
  }

  static constexpr int64_t kChunkBytes = 1 << 20;

  KvKeepService* const service_;
  SessionId id_ = 0;
  std::unique_ptr<CacheStore::LeaseHold> hold_;  // while the stream is open
  std::vector<int32_t> layers_;
  std::optional<DType> dtype_;  // unset: the stored bytes
  size_t next_layer_ = 0;
  int32_t layer_ = 0;
  LayerKvCopy copy_;
  int64_t next_slot_ = 0;
  v1::KvChunk chunk_;
};

}  // namespace

grpc::ServerReadReactor<v1::AppendRequest>* KvKeepService::AppendPrefill(
    grpc::CallbackServerContext* ctx, v1::AppendPrefillResponse* resp) {
  return new PrefillReactor(this, ctx, resp);
}

grpc::ServerBidiReactor<v1::DecodeStep, v1::DecodeStepResult>*
KvKeepService::Decode(grpc::CallbackServerContext* ctx) {
  return new DecodeReactor(this, ctx);
}

grpc::ServerWriteReactor<v1::KvChunk>* KvKeepService::ReadKv(
    grpc::CallbackServerContext* ctx, const v1::ReadKvRequest* req) {
  return new ReadKvReactor(this, ctx, req);
}

}  // namespace kvkeep
