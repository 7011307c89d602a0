// KvKeepService::TransferSession: parses the call, hands the transfer to
// the TransferCoordinator, passes the caller's cancel on, and answers with
// the outcome, naming the transfer id (docs/transfer.md).
#include <algorithm>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "cache_store/quote.h"
#include "services/common/fleet_names.h"
#include "services/kvkeepd/kvkeep_service.h"
#include "services/transfer/transfer_cancel.h"

namespace kvkeep {

namespace {

// Bytes a caller's transfer_id may have, at most.
constexpr size_t kMaxTransferIdBytes = 128;

absl::Status CheckTransferId(absl::string_view id) {
  const bool printable = std::all_of(
      id.begin(), id.end(), [](char c) { return c > ' ' && c < 0x7f; });
  if (id.size() > kMaxTransferIdBytes || !printable) {
    return absl::InvalidArgumentError(absl::StrCat(
        "transfer_id ", Quote(id), " must be at most ", kMaxTransferIdBytes,
        " printable ASCII characters without spaces"));
  }
  return absl::OkStatus();
}

// One TransferSession call: the caller's cancel (or deadline) cancels the
// transfer (TransferCoordinator: unless it committed already).
class TransferReactor final : public grpc::ServerUnaryReactor {
 public:
  TransferReactor() : cancel_(std::make_shared<TransferCancel>()) {}
  const std::shared_ptr<TransferCancel>& cancel() const { return cancel_; }
  void OnCancel() override {
    cancel_->Cancel(
        absl::CancelledError("the caller cancelled TransferSession (or its "
                             "deadline passed)"));
  }
  void OnDone() override { delete this; }

 private:
  const std::shared_ptr<TransferCancel> cancel_;
};

}  // namespace

grpc::ServerUnaryReactor* KvKeepService::TransferSession(
    grpc::CallbackServerContext* ctx, const v1::TransferSessionRequest* req,
    v1::TransferSessionResponse* resp) {
  auto* reactor = new TransferReactor;
  absl::StatusOr<SessionId> id = CallerSession(*ctx, req->session_id());
  absl::StatusOr<std::string> tenant =
      id.ok() ? store_->TenantOf(*id) : id.status();
  if (!tenant.ok()) {
    reactor->Finish(Finish(ctx, "TransferSession", tenant.status()));
    return reactor;
  }
  if (req->target().empty()) {
    reactor->Finish(Finish("TransferSession",
                           absl::InvalidArgumentError(
                               "TransferSession needs a target host:port")));
    return reactor;
  }
  absl::StatusOr<Transport> transport = ParseTransport(req->transport());
  if (!transport.ok()) {
    reactor->Finish(Finish("TransferSession", transport.status()));
    return reactor;
  }
  // It is named in messages and in trailing metadata: short, printable.
  if (absl::Status s = CheckTransferId(req->transfer_id()); !s.ok()) {
    reactor->Finish(Finish("TransferSession", s));
    return reactor;
  }
  OutgoingTransfer transfer;
  transfer.id = *id;
  transfer.target = req->target();
  transfer.target_token = req->target_token();
  transfer.transfer_id = req->transfer_id();
  transfer.transport = *transport;
  transfer.deadline = absl::FromChrono(ctx->deadline());
  transfer.cancel = reactor->cancel();
  const std::string target = req->target();
  Send(std::move(transfer), *std::move(tenant),
       [this, ctx, reactor, resp](const TransferOutcome& outcome,
                                  const std::string& new_id) {
         // The transfer id, also when this store made it and the transfer
         // failed.
         ctx->AddTrailingMetadata(kTransferIdMetadata, outcome.transfer_id);
         if (!outcome.status.ok()) {
           reactor->Finish(Finish("TransferSession", outcome.status));
           return;
         }
         resp->set_session_id(new_id);
         resp->set_transfer_id(outcome.transfer_id);
         resp->set_transport(std::string(TransportName(outcome.transport)));
         resp->set_bytes(outcome.bytes);
         resp->set_seconds(absl::ToDoubleSeconds(outcome.duration));
         reactor->Finish(grpc::Status::OK);
       });
  return reactor;
}

void KvKeepService::Send(
    OutgoingTransfer transfer, std::string tenant,
    std::function<void(const TransferOutcome&, const std::string& new_id)>
        done) {
  const SessionId id = transfer.id;
  const std::string target = transfer.target;
  // What the moved-out event says of it, read before it moves.
  v1::SessionEvent moved;
  if (absl::StatusOr<SessionStats> s = store_->GetStats(id, false); s.ok()) {
    moved = SessionEventOf(*s);
  }
  moved.set_peer(target);
  // Calls on the old id here are redirected from the commit on
  // (docs/fleet.md): the move is remembered before the session closes.
  transfer.on_commit = [this, id, tenant = std::move(tenant),
                        target](const std::string& replica) {
    moved_.Add(id, MovedSessions::Move{tenant, replica, target});
  };
  transfers_.Send(std::move(transfer), [this, id, target,
                                        moved = std::move(moved),
                                        done = std::move(done)](
                                           const TransferOutcome& outcome) {
    if (!outcome.status.ok()) {
      TransferOutcome named = outcome;
      if (!absl::StrContains(named.status.message(), outcome.transfer_id)) {
        named.status = absl::Status(
            named.status.code(), absl::StrCat("transfer ", outcome.transfer_id,
                                              ": ", named.status.message()));
      }
      done(named, "");
      return;
    }
    const std::string new_id = FleetSessionId(outcome.target_replica, id);
    events_.SessionEnded(v1::EVENT_SESSION_MOVED_OUT, id, moved);
    LogEvent("transfer",
             absl::StrCat("session=", SessionIdOf(id), " target=", target,
                          " new_id=", new_id, " transfer=", outcome.transfer_id,
                          " bytes=", outcome.bytes));
    done(outcome, new_id);
  });
}

}  // namespace kvkeep
