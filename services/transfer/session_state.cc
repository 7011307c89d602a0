#include "services/transfer/session_state.h"

#include <cmath>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cache_store/quote.h"

namespace kvkeep {
namespace {

// SessionState.format: token records, or kivi_int4's key blocks and staging.
constexpr uint32_t kRecordsFormat = 1;
constexpr uint32_t kKiviFormat = 2;

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
  if (s.idle_timeout.has_value()) {
    out->set_idle_timeout_seconds(absl::ToDoubleSeconds(*s.idle_timeout));
  }
  if (s.policy.protect_first > 0) {
    out->set_protect_first(s.policy.protect_first);
  }
  if (s.kivi) out->set_format(kKiviFormat);
  for (const LayerSnapshot& l : s.layers) {
    v1::LayerState* p = out->add_layers();
    p->mutable_positions()->Add(l.position.begin(), l.position.end());
    p->mutable_arrivals()->Add(l.arrival.begin(), l.arrival.end());
    p->mutable_scores()->Add(l.score.begin(), l.score.end());
    p->mutable_history()->Add(l.history.begin(), l.history.end());
    p->set_appended(l.appended);
    p->set_version(l.version);
    p->set_budget(l.budget);
    p->mutable_kivi_staging()->Add(l.kivi_staging.begin(),
                                   l.kivi_staging.end());
  }
}

absl::StatusOr<SessionSnapshot> StateFromProto(const v1::SessionState& p) {
  const std::optional<SessionId> id = ParseSessionName(p.session_id());
  if (!id.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "session_id ", Quote(p.session_id()), " is not a kvkeep session id"));
  }
  if (p.format() > kKiviFormat) {
    return absl::InvalidArgumentError(
        absl::StrCat("session state format ", p.format(),
                     " is newer than this store reads (", kRecordsFormat,
                     ": token records, ", kKiviFormat, ": kivi_int4)"));
  }
  SessionSnapshot s;
  s.id = *id;
  s.kivi = p.format() == kKiviFormat;
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
  if (p.has_idle_timeout_seconds()) {
    const double seconds = p.idle_timeout_seconds();
    if (!std::isfinite(seconds) || seconds < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("idle_timeout_seconds ", seconds,
                       " is not a lease length (0: it never expires)"));
    }
    // Too long for a Duration saturates; the import clamps to its maximum.
    s.idle_timeout = absl::Seconds(seconds);
  }
  if (p.protect_first() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("protect_first ", p.protect_first(),
                     " is negative (0: no token is protected)"));
  }
  s.policy.protect_first = p.protect_first();
  for (const v1::LayerState& l : p.layers()) {
    LayerSnapshot layer;
    layer.position.assign(l.positions().begin(), l.positions().end());
    layer.arrival.assign(l.arrivals().begin(), l.arrivals().end());
    layer.score.assign(l.scores().begin(), l.scores().end());
    layer.history.assign(l.history().begin(), l.history().end());
    layer.appended = l.appended();
    layer.version = l.version();
    layer.budget = l.budget();
    layer.kivi_staging.assign(l.kivi_staging().begin(), l.kivi_staging().end());
    s.layers.push_back(std::move(layer));
  }
  return s;
}

uint64_t TransferLog::Begin(const std::string& transfer_id) {
  absl::MutexLock lock(&mu_);
  Receiving& r = receiving_[transfer_id];
  ++r.count;
  return r.fence;
}

void TransferLog::End(const std::string& transfer_id) {
  absl::MutexLock lock(&mu_);
  auto it = receiving_.find(transfer_id);
  if (it != receiving_.end() && --it->second.count <= 0) receiving_.erase(it);
}

absl::StatusOr<SessionId> TransferLog::Commit(
    const std::string& transfer_id, uint64_t fence, const std::string& tenant,
    const std::function<absl::StatusOr<SessionId>()>& commit) {
  absl::MutexLock lock(&mu_);
  auto it = receiving_.find(transfer_id);
  if (it != receiving_.end() && it->second.fence != fence) {
    return absl::AbortedError(
        absl::StrCat("transfer ", transfer_id,
                     " was aborted: its source asked about it and was told "
                     "it did not commit"));
  }
  absl::StatusOr<SessionId> id = commit();
  if (!id.ok()) return id;
  if (ids_.emplace(transfer_id, Committed{*id, tenant}).second) {
    order_.push_back(transfer_id);
    while (order_.size() > capacity_) {
      ids_.erase(order_.front());
      order_.pop_front();
    }
  }
  return id;
}

absl::StatusOr<bool> TransferLog::Resolve(const std::string& transfer_id,
                                          const std::string& tenant) {
  absl::MutexLock lock(&mu_);
  auto it = ids_.find(transfer_id);
  if (it != ids_.end()) {
    if (it->second.tenant != tenant) {
      return absl::PermissionDeniedError(
          "the transfer belongs to another tenant than the target token's");
    }
    return true;
  }
  auto r = receiving_.find(transfer_id);
  if (r != receiving_.end()) ++r->second.fence;
  return false;
}

bool TransferLog::Contains(const std::string& transfer_id) const {
  absl::MutexLock lock(&mu_);
  return ids_.contains(transfer_id);
}

}  // namespace kvkeep
