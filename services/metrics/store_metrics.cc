#include "services/metrics/store_metrics.h"

#include <cmath>
#include <utility>

#include "absl/time/time.h"
#include "cache_store/policy_registry.h"
#include "prometheus/client_metric.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/metric_family.h"

namespace kvkeep {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

// A family built at scrape time.
MetricFamily Family(std::string name, std::string help, MetricType type) {
  MetricFamily f;
  f.name = std::move(name);
  f.help = std::move(help);
  f.type = type;
  return f;
}

void AddSample(MetricFamily& family, std::vector<ClientMetric::Label> labels,
               double value) {
  ClientMetric m;
  m.label = std::move(labels);
  if (family.type == MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  family.metric.push_back(std::move(m));
}

// Per session: the tracked ones still open (one may close mid-scrape).
std::vector<MetricFamily> SessionFamilies(
    CacheStore& store, const StoreMetrics& metrics,
    const std::function<std::string(SessionId)>& session_name) {
  constexpr MetricType kGauge = MetricType::Gauge;
  constexpr MetricType kCounter = MetricType::Counter;
  MetricFamily tokens = Family("kvkeep_session_resident_tokens",
                               "Resident tokens, summed over layers", kGauge);
  MetricFamily bytes = Family("kvkeep_session_resident_bytes",
                              "Bytes of the pages the session holds", kGauge);
  MetricFamily pages =
      Family("kvkeep_session_pages", "Pages the session holds", kGauge);
  MetricFamily evicted =
      Family("kvkeep_session_evicted_tokens_total",
             "Tokens evicted from the session, summed over layers", kCounter);
  MetricFamily mass =
      Family("kvkeep_session_evicted_attention_mass_total",
             "Policy scores of the session's evicted tokens, summed", kCounter);
  MetricFamily updates =
      Family("kvkeep_session_score_updates_total",
             "Layer score updates applied to the session", kCounter);
  for (SessionId id : metrics.TrackedSessions()) {
    // A scrape is not a call on the session: it does not renew its lease.
    absl::StatusOr<SessionStats> s = store.GetStats(id, /*renew_lease=*/false);
    if (!s.ok()) continue;
    const std::vector<ClientMetric::Label> labels{{"session", session_name(id)},
                                                  {"tenant", s->tenant},
                                                  {"policy", s->policy}};
    AddSample(tokens, labels, static_cast<double>(s->resident_tokens));
    AddSample(bytes, labels, static_cast<double>(s->bytes));
    AddSample(pages, labels, static_cast<double>(s->pages));
    AddSample(evicted, labels, static_cast<double>(s->evicted_tokens));
    AddSample(mass, labels, s->evicted_score);
    AddSample(updates, labels, static_cast<double>(s->score_updates));
  }

  return {std::move(tokens),  std::move(bytes), std::move(pages),
          std::move(evicted), std::move(mass),  std::move(updates)};
}

// Named prefixes (docs/prefixes.md), per layout: how many the store holds
// (published, or unpublished and still held), the pages they hold, and how
// many of those sessions started from them share.
std::vector<MetricFamily> PrefixFamilies(const CacheStore& store) {
  constexpr MetricType kGauge = MetricType::Gauge;
  MetricFamily held =
      Family("kvkeep_prefixes",
             "Named prefixes held: published, or unpublished and still held by "
             "sessions started from them",
             kGauge);
  MetricFamily pages =
      Family("kvkeep_prefix_pages", "Pages the named prefixes hold", kGauge);
  MetricFamily shared = Family(
      "kvkeep_prefix_shared_pages",
      "Pages of named prefixes that sessions (their source, the sessions "
      "started from them) hold too",
      kGauge);
  MetricFamily holders = Family(
      "kvkeep_prefix_holders",
      "Open sessions started from a named prefix (and their forks)", kGauge);
  const std::vector<PrefixInfo> prefixes = store.Prefixes(std::nullopt);
  for (const LayoutStats& l : store.Layouts()) {
    int64_t n = 0, p = 0, s = 0, h = 0;
    for (const PrefixInfo& info : prefixes) {
      if (info.layout != l.layout.name) continue;
      ++n;
      p += info.pages;
      s += info.shared_pages;
      h += info.holders;
    }
    const std::vector<ClientMetric::Label> labels{{"layout", l.layout.name}};
    AddSample(held, labels, static_cast<double>(n));
    AddSample(pages, labels, static_cast<double>(p));
    AddSample(shared, labels, static_cast<double>(s));
    AddSample(holders, labels, static_cast<double>(h));
  }
  return {std::move(held), std::move(pages), std::move(shared),
          std::move(holders)};
}

// Tiers (docs/tiers.md), per layout: sessions and bytes in each tier, and
// what moved between them.
std::vector<MetricFamily> TierFamilies(const CacheStore& store) {
  constexpr MetricType kGauge = MetricType::Gauge;
  constexpr MetricType kCounter = MetricType::Counter;
  MetricFamily sessions =
      Family("kvkeep_tier_sessions",
             "Open sessions of the layout by where their state is: pool, "
             "host or disk",
             kGauge);
  MetricFamily bytes = Family(
      "kvkeep_tier_bytes",
      "Bytes of the layout's sessions by tier (pool: pages in use; host, "
      "disk: the sessions' encoded state)",
      kGauge);
  MetricFamily demotions =
      Family("kvkeep_tier_demotions_total",
             "Sessions moved out of the pool (idle, or the least recently "
             "used when the pool was full)",
             kCounter);
  MetricFamily restores = Family(
      "kvkeep_tier_restores_total",
      "Sessions a call brought back into the pool from a lower tier", kCounter);
  MetricFamily failed = Family(
      "kvkeep_tier_failed_moves_total",
      "Moves out of the pool refused (no tier had room, disk errors); the "
      "session stayed in the pool",
      kCounter);
  MetricFamily corrupt =
      Family("kvkeep_tier_corrupt_total",
             "Tier copies found damaged (checksum) or missing on restore; "
             "their sessions are lost",
             kCounter);
  for (const LayoutStats& l : store.Layouts()) {
    const std::vector<ClientMetric::Label> labels{{"layout", l.layout.name}};
    for (int t = 0; t < kTierCount; ++t) {
      const std::vector<ClientMetric::Label> tier{
          {"layout", l.layout.name},
          {"tier", std::string(TierName(static_cast<Tier>(t)))}};
      AddSample(sessions, tier, static_cast<double>(l.tiers.sessions[t]));
      AddSample(bytes, tier, static_cast<double>(l.tiers.bytes[t]));
    }
    AddSample(demotions, labels, static_cast<double>(l.tiers.moves_down));
    AddSample(restores, labels, static_cast<double>(l.tiers.restores));
    AddSample(failed, labels, static_cast<double>(l.tiers.failed_moves));
    AddSample(corrupt, labels, static_cast<double>(l.tiers.corrupt));
  }
  MetricFamily forks = Family("kvkeep_sessions_forked_total",
                              "Sessions made by ForkSession", kCounter);
  AddSample(forks, {}, static_cast<double>(store.forks()));
  return {std::move(sessions), std::move(bytes),  std::move(demotions),
          std::move(restores), std::move(failed), std::move(corrupt),
          std::move(forks)};
}

}  // namespace

const prometheus::Histogram::BucketBoundaries& StoreLatencyBuckets() {
  // 1 us .. 1 s: a decode step's store work is microseconds; a prompt's
  // eviction or query scoring over a long context can take milliseconds.
  static const auto* const kBuckets =
      new prometheus::Histogram::BucketBoundaries{
          1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4,
          1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1,  0.25,   1.0};
  return *kBuckets;
}

const prometheus::Histogram::BucketBoundaries& RpcLatencyBuckets() {
  // 100 us .. 60 s: unary calls are sub-millisecond on loopback; a stream's
  // latency is its lifetime.
  static const auto* const kBuckets =
      new prometheus::Histogram::BucketBoundaries{
          1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
          0.1,  0.25,   0.5,  1.0,  2.5,    5.0,  10.0, 30.0,   60.0};
  return *kBuckets;
}

StoreMetrics::StoreMetrics(prometheus::Registry& registry,
                           int64_t max_session_series,
                           const std::string& version)
    : max_session_series_(max_session_series) {
  auto& opened = prometheus::BuildCounter()
                     .Name("kvkeep_sessions_opened_total")
                     .Help("Sessions created, by policy")
                     .Register(registry);
  auto& closed = prometheus::BuildCounter()
                     .Name("kvkeep_sessions_closed_total")
                     .Help("Sessions closed, by policy")
                     .Register(registry);
  auto& evicted_tokens =
      prometheus::BuildCounter()
          .Name("kvkeep_evicted_tokens_total")
          .Help(
              "Tokens evicted (summed over layers), by policy; includes "
              "closed sessions")
          .Register(registry);
  auto& evicted_mass =
      prometheus::BuildCounter()
          .Name("kvkeep_evicted_attention_mass_total")
          .Help(
              "Policy scores of evicted tokens (accumulated attention for "
              "h2o-like policies), summed, by policy")
          .Register(registry);
  auto& score_updates = prometheus::BuildCounter()
                            .Name("kvkeep_score_updates_total")
                            .Help("Layer score updates applied, by policy")
                            .Register(registry);
  auto& eviction_seconds =
      prometheus::BuildHistogram()
          .Name("kvkeep_eviction_duration_seconds")
          .Help(
              "Time one store operation spent choosing victims, compacting "
              "and freeing pages (all layers), when it evicted")
          .Register(registry);
  auto& score_update_seconds =
      prometheus::BuildHistogram()
          .Name("kvkeep_score_update_duration_seconds")
          .Help(
              "Time one store operation spent validating and folding "
              "attention scores (all layers; query scoring included)")
          .Register(registry);
  auto& operation_seconds =
      prometheus::BuildHistogram()
          .Name("kvkeep_store_operation_duration_seconds")
          .Help(
              "Time in the store of one successful operation on a session, "
              "by operation (append, step, scores, compress)")
          .Register(registry);
  auto& tier_move_seconds =
      prometheus::BuildHistogram()
          .Name("kvkeep_tier_move_duration_seconds")
          .Help(
              "Time to move one session between tiers, whole (from, to: pool, "
              "host, disk); a move to the pool is the restore a call waits "
              "for")
          .Register(registry);
  for (Tier below : {Tier::kHost, Tier::kDisk}) {
    for (bool down : {true, false}) {
      const Tier from = down ? Tier::kPool : below;
      const Tier to = down ? below : Tier::kPool;
      tier_move_seconds_[static_cast<int>(from)][static_cast<int>(to)] =
          &tier_move_seconds.Add({{"from", std::string(TierName(from))},
                                  {"to", std::string(TierName(to))}},
                                 RpcLatencyBuckets());
    }
  }
  prometheus::BuildGauge()
      .Name("kvkeep_build_info")
      .Help("Always 1; the version label is kvkeepd's")
      .Register(registry)
      .Add({{"version", version}})
      .Set(1);

  for (absl::string_view name : PolicyNames()) {
    const prometheus::Labels labels{{"policy", std::string(name)}};
    policies_.emplace(
        std::string(name),
        PolicySeries{&opened.Add(labels), &closed.Add(labels),
                     &evicted_tokens.Add(labels), &evicted_mass.Add(labels),
                     &score_updates.Add(labels),
                     &eviction_seconds.Add(labels, StoreLatencyBuckets()),
                     &score_update_seconds.Add(labels, StoreLatencyBuckets())});
  }
  for (StoreOperation op : kAllStoreOperations) {
    const size_t index = static_cast<size_t>(op);
    if (operation_seconds_.size() <= index) {
      operation_seconds_.resize(index + 1);
    }
    operation_seconds_[index] = &operation_seconds.Add(
        {{"operation", std::string(OperationName(op))}}, StoreLatencyBuckets());
  }
}

StoreMetrics::PolicySeries* StoreMetrics::Series(const std::string& policy) {
  auto it = policies_.find(policy);
  return it == policies_.end() ? nullptr : &it->second;
}

void StoreMetrics::SessionOpened(const SessionInfo& session) {
  if (PolicySeries* s = Series(session.policy)) s->opened->Increment();
  absl::MutexLock lock(&mu_);
  if (static_cast<int64_t>(tracked_.size()) < max_session_series_) {
    tracked_.insert(session.id);
  } else {
    ++untracked_;
  }
}

void StoreMetrics::SessionClosed(const SessionInfo& session) {
  if (PolicySeries* s = Series(session.policy)) s->closed->Increment();
  absl::MutexLock lock(&mu_);
  if (tracked_.erase(session.id) == 0) --untracked_;
}

void StoreMetrics::WorkDone(const WorkReport& report) {
  operation_seconds_[static_cast<size_t>(report.operation)]->Observe(
      absl::ToDoubleSeconds(report.duration));
  PolicySeries* s = Series(report.session->policy);
  if (s == nullptr) return;
  const SessionWork& w = report.work;
  if (w.evicted_tokens > 0) {
    s->evicted_tokens->Increment(static_cast<double>(w.evicted_tokens));
    // A server-wide counter that became NaN (or went down) would stay so
    // for every tenant's dashboards: the store validates what it scores,
    // and this keeps the counter sound even if a value slipped through.
    if (std::isfinite(w.evicted_score) && w.evicted_score > 0) {
      s->evicted_mass->Increment(w.evicted_score);
    }
    s->eviction_seconds->Observe(absl::ToDoubleSeconds(w.eviction_time));
  }
  if (w.score_updates > 0) {
    s->score_updates->Increment(static_cast<double>(w.score_updates));
    s->score_update_seconds->Observe(absl::ToDoubleSeconds(w.scoring_time));
  }
}

void StoreMetrics::TierMoved(const TierMove& move) {
  prometheus::Histogram* h = tier_move_seconds_[static_cast<int>(move.from)]
                                               [static_cast<int>(move.to)];
  if (h != nullptr) h->Observe(absl::ToDoubleSeconds(move.duration));
}

std::vector<SessionId> StoreMetrics::TrackedSessions() const {
  absl::MutexLock lock(&mu_);
  return std::vector<SessionId>(tracked_.begin(), tracked_.end());
}

int64_t StoreMetrics::UntrackedSessions() const {
  absl::MutexLock lock(&mu_);
  return untracked_;
}

StoreCollector::StoreCollector(
    CacheStore& store, const StoreMetrics& metrics,
    std::function<std::string(SessionId)> session_name)
    : store_(store),
      metrics_(metrics),
      session_name_(session_name ? std::move(session_name) : [](SessionId id) {
        return SessionName(id);
      }) {}

std::vector<MetricFamily> StoreCollector::Collect() const {
  constexpr MetricType kGauge = MetricType::Gauge;
  constexpr MetricType kCounter = MetricType::Counter;

  std::vector<MetricFamily> out =
      SessionFamilies(store_, metrics_, session_name_);
  MetricFamily capacity_pages = Family("kvkeep_pool_capacity_pages",
                                       "Pages in the layout's pool", kGauge);
  MetricFamily used_pages =
      Family("kvkeep_pool_used_pages", "Pages held by sessions", kGauge);
  MetricFamily capacity_bytes = Family("kvkeep_pool_capacity_bytes",
                                       "Bytes of the layout's pool", kGauge);
  MetricFamily used_bytes = Family(
      "kvkeep_pool_used_bytes", "Bytes of the pages held by sessions", kGauge);
  MetricFamily pool_sessions =
      Family("kvkeep_pool_sessions", "Open sessions of the layout", kGauge);
  MetricFamily shared_pages = Family(
      "kvkeep_pool_shared_pages",
      "Pages held by more than one session (forks, copy-on-write)", kGauge);
  MetricFamily saved_bytes = Family(
      "kvkeep_pool_shared_saved_bytes",
      "Bytes the sessions would hold beyond used_bytes if nothing were shared",
      kGauge);
  MetricFamily failures =
      Family("kvkeep_pool_allocation_failures_total",
             "Page requests refused because the pool was full", kCounter);
  int64_t open_sessions = 0;
  for (const LayoutStats& l : store_.Layouts()) {
    const std::vector<ClientMetric::Label> labels{{"layout", l.layout.name}};
    const PoolStats& p = l.pool;
    AddSample(capacity_pages, labels, static_cast<double>(p.capacity_pages));
    AddSample(used_pages, labels, static_cast<double>(p.used_pages));
    AddSample(capacity_bytes, labels,
              static_cast<double>(p.capacity_pages * p.page_bytes));
    AddSample(used_bytes, labels,
              static_cast<double>(p.used_pages * p.page_bytes));
    AddSample(pool_sessions, labels, static_cast<double>(l.sessions));
    AddSample(shared_pages, labels, static_cast<double>(p.shared_pages));
    AddSample(
        saved_bytes, labels,
        static_cast<double>((p.page_references - p.used_pages) * p.page_bytes));
    AddSample(failures, labels, static_cast<double>(p.allocation_failures));
    open_sessions += l.sessions;
  }

  MetricFamily tenant_sessions =
      Family("kvkeep_tenant_sessions", "Open sessions of the tenant", kGauge);
  MetricFamily tenant_bytes = Family(
      "kvkeep_tenant_bytes", "Bytes of the pages the tenant holds", kGauge);
  MetricFamily rejections = Family(
      "kvkeep_tenant_quota_rejections_total",
      "Requests refused by the tenant's session or byte limit", kCounter);
  MetricFamily tenant_expired = Family(
      "kvkeep_tenant_sessions_expired_total",
      "Sessions of the tenant closed by the store when their lease ran out",
      kCounter);
  int64_t expired = 0;
  for (const TenantStats& t : store_.Tenants()) {
    const std::vector<ClientMetric::Label> labels{{"tenant", t.tenant}};
    AddSample(tenant_sessions, labels, static_cast<double>(t.sessions));
    AddSample(tenant_bytes, labels, static_cast<double>(t.bytes));
    AddSample(rejections, labels, static_cast<double>(t.quota_rejections));
    AddSample(tenant_expired, labels, static_cast<double>(t.expired_sessions));
    expired += t.expired_sessions;
  }
  MetricFamily sessions_expired =
      Family("kvkeep_sessions_expired_total",
             "Sessions closed by the store when their lease ran out (idle "
             "past their timeout)",
             kCounter);
  AddSample(sessions_expired, {}, static_cast<double>(expired));

  MetricFamily sessions = Family("kvkeep_sessions", "Open sessions", kGauge);
  AddSample(sessions, {}, static_cast<double>(open_sessions));
  MetricFamily untracked =
      Family("kvkeep_sessions_untracked",
             "Open sessions without per-session series (over the "
             "metrics_session_series cap)",
             kGauge);
  AddSample(untracked, {}, static_cast<double>(metrics_.UntrackedSessions()));

  for (MetricFamily* f :
       {&capacity_pages, &used_pages, &capacity_bytes, &used_bytes,
        &pool_sessions, &shared_pages, &saved_bytes, &failures,
        &tenant_sessions, &tenant_bytes, &rejections, &tenant_expired,
        &sessions_expired, &sessions, &untracked}) {
    out.push_back(std::move(*f));
  }
  for (MetricFamily& f : PrefixFamilies(store_)) out.push_back(std::move(f));
  for (MetricFamily& f : TierFamilies(store_)) out.push_back(std::move(f));
  return out;
}

}  // namespace kvkeep
