// CacheStore's named prefixes (docs/prefixes.md): publishing a session's
// state as an immutable prefix, sessions that start from one, unpublishing,
// and listings.
//
// A prefix is a session no call reaches, forked from its source at publish
// time (so it shares the source's pages copy-on-write). A session started
// from it is a fork of it, and holds it (a PrefixHold in its Entry, passed on
// to the session's own forks): the prefix, and its pages, live until it is
// unpublished and the last session holding it is freed. Its pages are
// charged to the publisher's tenant all that time: the prefix's session
// carries that tenant's quota and is the last to let its pages go.
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cache_store/budget.h"
#include "cache_store/cache_store.h"
#include "cache_store/policy_registry.h"
#include "cache_store/quote.h"

namespace kvkeep {

struct CacheStore::Prefix {
  Prefix(PrefixInfo fixed, SessionId owner_id)
      : info(std::move(fixed)), owner(owner_id) {}
  // Name, tenant, visibility, layout and source: fixed at publish.
  const PrefixInfo info;
  const SessionId owner;  // its session's id (an owner in the pool)
  std::atomic<bool> published{true};
  std::atomic<int64_t> holders{0};  // PrefixHolds alive
  // Forks from the session one at a time (Fork marks it shared).
  mutable absl::Mutex mu;
  // Null until the publish has forked it.
  std::unique_ptr<Session> session ABSL_GUARDED_BY(mu);
  int64_t tokens ABSL_GUARDED_BY(mu) = 0;
  // The prefix the source started from, if any: this one shares its pages.
  std::shared_ptr<PrefixHold> parent;
};

class CacheStore::PrefixHold {
 public:
  explicit PrefixHold(std::shared_ptr<Prefix> prefix)
      : prefix_(std::move(prefix)) {
    ++prefix_->holders;
  }
  ~PrefixHold() { --prefix_->holders; }
  PrefixHold(const PrefixHold&) = delete;
  PrefixHold& operator=(const PrefixHold&) = delete;
  const std::shared_ptr<Prefix>& prefix() const { return prefix_; }

 private:
  const std::shared_ptr<Prefix> prefix_;
};

namespace {

absl::Status PrefixNotFound(const std::string& name) {
  return absl::NotFoundError(
      absl::StrCat("prefix ", Quote(name), " not found"));
}

}  // namespace

std::shared_ptr<CacheStore::PrefixHold> CacheStore::HoldAgain(
    const PrefixHold& other) {
  return std::make_shared<PrefixHold>(other.prefix());
}

std::shared_ptr<CacheStore::Prefix> CacheStore::FindPrefix(
    const std::string& tenant, const std::string& name) const {
  auto own = prefixes_.find(PrefixKey(false, tenant, name));
  if (own != prefixes_.end()) return own->second;
  auto shared = prefixes_.find(PrefixKey(true, "", name));
  if (shared != prefixes_.end()) return shared->second;
  return nullptr;
}

PrefixInfo CacheStore::InfoOf(const Prefix& prefix) {
  PrefixInfo info = prefix.info;
  info.published = prefix.published;
  info.holders = prefix.holders;
  absl::MutexLock lock(&prefix.mu);
  info.tokens = prefix.tokens;
  if (prefix.session != nullptr) {
    const SessionStats stats = prefix.session->stats();
    info.resident_tokens = stats.resident_tokens;
    info.pages = stats.pages;
    info.shared_pages = stats.shared_pages;
  }
  return info;
}

absl::StatusOr<PrefixInfo> CacheStore::PublishPrefix(SessionId source,
                                                     const PrefixSpec& spec) {
  if (absl::Status s = ValidatePrefixName(spec.name); !s.ok()) return s;
  if (spec.is_public && !options_.allow_public_prefixes) {
    return absl::FailedPreconditionError(
        "this store does not allow public prefixes (the operator turns them "
        "on with allow_public_prefixes); publish it as the tenant's own");
  }
  absl::StatusOr<std::shared_ptr<Entry>> found = Find(source);
  if (!found.ok()) return found.status();
  Entry& entry = **found;
  if (entry.info.tenant != spec.tenant) return NotFound(source);
  const PrefixKey key(spec.is_public, spec.is_public ? "" : spec.tenant,
                      spec.name);
  auto taken = [&] {
    return absl::AlreadyExistsError(absl::StrCat(
        spec.is_public ? "a public prefix" : "a prefix of this tenant",
        " is already named ", Quote(spec.name),
        "; unpublish it first or choose another name"));
  };
  std::shared_ptr<Prefix> prefix;
  std::shared_ptr<PageQuota> quota;
  {
    absl::MutexLock lock(&mu_);
    if (prefixes_.contains(key)) return taken();
    // The prefix's owner id in the pool is reserved before the fork.
    prefix = std::make_shared<Prefix>(
        PrefixInfo{spec.name, spec.tenant, spec.is_public, true,
                   entry.info.layout, source},
        NewSessionId());
    prefix_owners_.emplace(prefix->owner, prefix);
    quota = tenants_[spec.tenant].quota;
  }
  absl::Status forked = ForkPrefix(entry, *prefix, quota);
  absl::MutexLock lock(&mu_);
  absl::erase_if(prefix_owners_,
                 [](const auto& owner) { return owner.second.expired(); });
  if (forked.ok() && prefixes_.contains(key)) forked = taken();
  if (!forked.ok()) {
    prefix_owners_.erase(prefix->owner);
    return forked;
  }
  prefixes_.emplace(key, prefix);
  return InfoOf(*prefix);
}

absl::Status CacheStore::ForkPrefix(Entry& source, Prefix& prefix,
                                    std::shared_ptr<PageQuota> quota) {
  absl::MutexLock entry_lock(&source.mu);
  // A session in a lower tier comes back first, as for any call.
  if (absl::Status s = EnsureResident(source); !s.ok()) return s;
  if (source.session == nullptr) return NotFound(source.info.id);
  if (source.transferring) {
    return absl::UnavailableError(
        absl::StrCat(SessionLabel(source.info.id), source.Transferring(),
                     "; publish it once the transfer is done"));
  }
  absl::StatusOr<std::unique_ptr<Session>> made =
      source.session->Fork(prefix.owner, nullptr, {}, std::move(quota));
  if (!made.ok()) return made.status();
  if (source.prefix != nullptr) prefix.parent = HoldAgain(*source.prefix);
  absl::MutexLock prefix_lock(&prefix.mu);
  prefix.tokens = (*made)->appended_tokens();
  prefix.session = *std::move(made);
  return absl::OkStatus();
}

absl::StatusOr<PrefixInfo> CacheStore::UnpublishPrefix(
    const std::string& tenant, const std::string& name, bool is_public) {
  if (absl::Status s = ValidatePrefixName(name); !s.ok()) return s;
  std::shared_ptr<Prefix> gone;  // freed here, if nothing holds it
  {
    absl::MutexLock lock(&mu_);
    auto it =
        prefixes_.find(PrefixKey(is_public, is_public ? "" : tenant, name));
    if (it == prefixes_.end()) return PrefixNotFound(name);
    if (it->second->info.tenant != tenant) {
      return absl::PermissionDeniedError(
          absl::StrCat("public prefix ", Quote(name),
                       " was published by another tenant; only it may "
                       "unpublish it"));
    }
    gone = std::move(it->second);
    prefixes_.erase(it);
    gone->published = false;
    // Forget the prefixes that are gone (this one stays listed until its
    // last holder is freed).
    absl::erase_if(prefix_owners_,
                   [](const auto& owner) { return owner.second.expired(); });
  }
  return InfoOf(*gone);
}

absl::StatusOr<SessionId> CacheStore::CreateFromPrefix(
    const SessionSpec& spec) {
  if (absl::Status s = ValidatePrefixName(spec.prefix); !s.ok()) return s;
  std::shared_ptr<Prefix> prefix;
  {
    absl::ReaderMutexLock lock(&mu_);
    prefix = FindPrefix(spec.tenant, spec.prefix);
  }
  if (prefix == nullptr) return PrefixNotFound(spec.prefix);
  const std::string& layout = prefix->info.layout;
  if (!spec.layout.empty() && spec.layout != layout) {
    return absl::FailedPreconditionError(absl::StrCat(
        "prefix ", Quote(spec.prefix), " holds keys and values of layout '",
        layout, "', not of layout ", Quote(spec.layout),
        " the request names (name the prefix's layout, or none)"));
  }
  absl::StatusOr<const Pool*> pool = FindPool(layout);
  if (!pool.ok()) return pool.status();
  int64_t tokens = 0;
  {
    absl::MutexLock lock(&prefix->mu);
    tokens = prefix->tokens;
  }
  PolicySpec policy_spec = spec.policy;
  if (!spec.prefix_evictable) policy_spec.protect_first = tokens;
  // A budget that cannot keep the protected prefix says so.
  auto in_prefix = [&](const absl::Status& s) {
    if (s.ok() || spec.prefix_evictable) return s;
    return absl::Status(
        s.code(), absl::StrCat("starting from prefix ", Quote(spec.prefix),
                               ", whose ", tokens,
                               " tokens are protected (as sinks; "
                               "prefix_evictable lifts that): ",
                               s.message()));
  };
  absl::StatusOr<PolicyPtr> policy = NewPolicy(policy_spec);
  if (!policy.ok()) return in_prefix(policy.status());
  absl::StatusOr<std::vector<int64_t>> budgets = LayerBudgets(
      spec.budget, (*pool)->layout.num_layers, (*policy)->protected_tokens());
  if (!budgets.ok()) return in_prefix(budgets.status());
  absl::StatusOr<absl::Duration> idle_timeout =
      ResolveIdleTimeout(options_.lease, spec.tenant, spec.idle_timeout);
  if (!idle_timeout.ok()) return idle_timeout.status();
  absl::StatusOr<Admission> admitted =
      AdmitNew(spec.tenant, spec.idempotency_key);
  if (!admitted.ok()) return admitted.status();
  if (admitted->existing) return admitted->id;
  absl::StatusOr<std::unique_ptr<Session>> made = [&] {
    absl::MutexLock lock(&prefix->mu);
    return prefix->session->Fork(admitted->id, *std::move(policy),
                                 *std::move(budgets), admitted->quota);
  }();
  if (!made.ok()) return in_prefix(made.status());
  return Enroll(*std::move(made), spec.tenant, std::move(policy_spec),
                spec.idempotency_key, *idle_timeout,
                std::make_shared<PrefixHold>(prefix));
}

std::vector<PrefixInfo> CacheStore::Prefixes(
    const std::optional<std::string>& tenant) const {
  std::vector<std::shared_ptr<Prefix>> seen;
  {
    absl::ReaderMutexLock lock(&mu_);
    for (const auto& [owner, weak] : prefix_owners_) {
      std::shared_ptr<Prefix> p = weak.lock();
      if (p == nullptr) continue;
      const bool own = tenant.has_value() && p->info.tenant == *tenant;
      if (!tenant.has_value() || own || (p->info.is_public && p->published)) {
        seen.push_back(std::move(p));
      }
    }
  }
  std::vector<PrefixInfo> out;
  for (const std::shared_ptr<Prefix>& p : seen) out.push_back(InfoOf(*p));
  std::sort(out.begin(), out.end(),
            [&](const PrefixInfo& a, const PrefixInfo& b) {
              return std::tuple(a.name, a.is_public, a.tenant) <
                     std::tuple(b.name, b.is_public, b.tenant);
            });
  return out;
}

}  // namespace kvkeep
