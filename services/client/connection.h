// Connection: what a KvKeepClient and every handle it made (Session,
// DecodeStream) share: the options, the channel and its stub, the retry
// machinery every call goes through, and a cache of the server's ServerInfo.
// Internal to the client library (kvkeep_client.h forward-declares it);
// handles hold it by shared_ptr, so they may outlive the client.
//
// Retries. Call() runs an attempt with a fresh context (token, deadline) and
// sends it again after a jittered, doubling backoff while it fails with
// UNAVAILABLE, the call is Retry::kOnUnavailable and attempts remain
// (ClientOptions::retries); which calls are retried is listed in
// kvkeep_client.h.
//
// Redirects (fleet mode, docs/fleet.md). A connection made with a Redirect
// follows a moved session: when a call fails NOT_FOUND with the trailing
// metadata kvkeep-moved-to, it asks the Redirect for a channel to that
// replica, makes it its own from then on, and sends the call there once
// more. A fleet client gives each session a connection of its own.
//
// Thread-safe: the options and channel are immutable; the ServerInfo cache
// is guarded by mu_, the current stub by route_mu_ (every stub this
// connection has used stays alive while it does, so a reference stub()
// returned before a redirect stays valid).
#ifndef KVKEEP_SERVICES_CLIENT_CONNECTION_H_
#define KVKEEP_SERVICES_CLIENT_CONNECTION_H_

#include <algorithm>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/random/random.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "kvkeep/v1/kvkeep.grpc.pb.h"
#include "services/client/kvkeep_client.h"
#include "services/common/grpc_status.h"

namespace kvkeep::client {

// What one call does about UNAVAILABLE.
enum class Retry { kNo, kOnUnavailable };

// INVALID_ARGUMENT for negative retries or backoff, max_backoff < backoff,
// or a deadline that is not positive.
absl::Status CheckClientOptions(const ClientOptions& options);
// A channel to `target` with `options`' credentials, reconnect backoff and
// message limit; `round_robin`: spread over every address it resolves to.
absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(
    const ClientOptions& options, const std::string& target,
    bool round_robin = false);

// A channel to the replica a session moved to: its name (kvkeep-moved-to)
// and the address its old replica sent it to (kvkeep-moved-to-address).
using Redirect = std::function<absl::StatusOr<std::shared_ptr<grpc::Channel>>(
    const std::string& replica, const std::string& address)>;

// Shared by a client and every handle it made, so handles may outlive it.
class Connection {
 public:
  // `replica`: the fleet replica this connection reaches (named in its
  // UNAVAILABLE errors), or empty.
  Connection(ClientOptions options, std::shared_ptr<grpc::Channel> channel,
             Redirect redirect = nullptr, std::string replica = "")
      : options_(std::move(options)),
        channel_(std::move(channel)),
        redirect_(std::move(redirect)),
        replica_(std::move(replica)) {
    stubs_.push_back(v1::KvKeep::NewStub(channel_));
    route_ = Route{channel_, replica_, options_.address};
  }

  const ClientOptions& options() const { return options_; }
  v1::KvKeep::Stub& stub() const ABSL_LOCKS_EXCLUDED(route_mu_) {
    absl::MutexLock lock(&route_mu_);
    return *stubs_.back();
  }
  // After a call ended with `context`: if it names a session's new replica
  // (kvkeep-moved-to) and this connection follows moves, switches to that
  // replica and returns true. Call() follows at most one move per call.
  bool FollowMove(const grpc::ClientContext& context) const
      ABSL_LOCKS_EXCLUDED(route_mu_);
  // After a call failed UNAVAILABLE with `context`: in a connection that
  // follows moves, if the server said the session is being moved
  // (kvkeep-moving: nothing was applied), waits a backoff and returns true
  // (send it again) until options().move_wait has passed since `*since`
  // (set at the first refusal).
  bool WaitWhileMoving(const grpc::ClientContext& context,
                       std::optional<absl::Time>* since) const;
  // `status` (an UNAVAILABLE of `context`) with the payload
  // kDrainingMetadata (the replica's name) when a draining replica refused
  // the call: FleetClient places elsewhere.
  static absl::Status MarkDraining(const grpc::ClientContext& context,
                                   absl::Status status);
  // Starts the ServerInfo cache (a fleet client has read it already).
  void SeedServerInfo(v1::ServerInfo info) const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    info_ = std::move(info);
  }

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

  // A connection of its own for one session's handle, at `shared`'s current
  // replica, with its options, redirects and cached ServerInfo: a handle
  // that follows its session's move must not take other sessions' handles
  // with it (a fork stays on the replica where it was made). A connection
  // that does not follow moves is shared as it is.
  static std::shared_ptr<const Connection> ForSession(
      const std::shared_ptr<const Connection>& shared);

  // Runs attempt(context, attempt_number) with a fresh context per attempt,
  // retrying UNAVAILABLE as `retry` and the options allow.
  template <typename Attempt>
  absl::Status Call(absl::string_view method, Retry retry,
                    Attempt&& attempt) const {
    absl::Duration wait = options_.backoff;
    std::optional<absl::BitGen> jitter;
    bool followed = false;
    std::optional<absl::Time> moving_since;
    for (int n = 1;; ++n) {
      grpc::ClientContext context;
      Prepare(context, options_.deadline);
      absl::Status status = FromGrpcStatus(attempt(context, n));
      if (status.code() == absl::StatusCode::kNotFound && !followed &&
          FollowMove(context)) {
        followed = true;  // once: a second move is the caller's to see
        continue;
      }
      if (status.code() == absl::StatusCode::kUnavailable) {
        status = MarkDraining(context, std::move(status));
        if (WaitWhileMoving(context, &moving_since)) {
          --n;  // not a retry: the server applied nothing
          continue;
        }
      }
      if (status.code() != absl::StatusCode::kUnavailable ||
          retry == Retry::kNo || n > options_.retries) {
        if (status.code() == absl::StatusCode::kUnavailable &&
            (n > 1 || !replica_.empty())) {
          const Route route = CurrentRoute();
          return absl::UnavailableError(absl::StrCat(
              method, " to ",
              route.replica.empty()
                  ? ""
                  : absl::StrCat("replica ", route.replica, " at "),
              route.address, " failed after ", n,
              n == 1 ? " attempt: " : " attempts: ", status.message()));
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
  absl::StatusOr<LayoutInfo> FindLayout(const std::string& name) const;

  absl::StatusOr<v1::ServerInfo> GetServerInfo() const;

 private:
  // Where calls go now: the replica (empty outside a fleet) and its address,
  // moved by FollowMove.
  struct Route {
    std::shared_ptr<grpc::Channel> channel;
    std::string replica;
    std::string address;
  };
  Route CurrentRoute() const ABSL_LOCKS_EXCLUDED(route_mu_) {
    absl::MutexLock lock(&route_mu_);
    return route_;
  }
  static std::optional<v1::Layout> Lookup(const v1::ServerInfo& info,
                                          const std::string& name);

  const ClientOptions options_;
  const std::shared_ptr<grpc::Channel> channel_;
  const Redirect redirect_;  // null: moves are not followed
  const std::string replica_;
  mutable absl::Mutex route_mu_;
  // The current stub last; earlier ones (before a redirect) stay alive.
  mutable std::vector<std::unique_ptr<v1::KvKeep::Stub>> stubs_
      ABSL_GUARDED_BY(route_mu_);
  mutable Route route_ ABSL_GUARDED_BY(route_mu_);
  mutable absl::Mutex mu_;
  // Layouts and limits do not change while a server runs.
  mutable std::optional<v1::ServerInfo> info_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvkeep::client

#endif  // KVKEEP_SERVICES_CLIENT_CONNECTION_H_
