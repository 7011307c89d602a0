// Connection's ServerInfo cache and redirects (see connection.h).
#include "services/client/connection.h"

#include <algorithm>

#include "absl/strings/cord.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "services/common/fleet_names.h"

namespace kvkeep::client {

namespace {

std::string TrailingValue(const grpc::ClientContext& context,
                          absl::string_view key) {
  const auto& metadata = context.GetServerTrailingMetadata();
  auto it = metadata.find(grpc::string_ref(key.data(), key.size()));
  if (it == metadata.end()) return "";
  return std::string(it->second.data(), it->second.size());
}

}  // namespace

absl::Status CheckClientOptions(const ClientOptions& options) {
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
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(
    const ClientOptions& options, const std::string& target, bool round_robin) {
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
  if (round_robin) args.SetLoadBalancingPolicyName("round_robin");
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel(target, credentials, args);
  if (channel == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot make a channel to ", target));
  }
  return channel;
}

bool Connection::FollowMove(const grpc::ClientContext& context) const {
  if (redirect_ == nullptr) return false;
  const std::string to = TrailingValue(context, kMovedToMetadata);
  if (to.empty()) return false;
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
      redirect_(to, TrailingValue(context, kMovedToAddressMetadata));
  if (!channel.ok()) return false;  // the caller sees the moved NOT_FOUND
  absl::MutexLock lock(&route_mu_);
  stubs_.push_back(v1::KvKeep::NewStub(*channel));
  const std::string address = TrailingValue(context, kMovedToAddressMetadata);
  route_ = Route{*channel, to, address.empty() ? route_.address : address};
  return true;
}

std::shared_ptr<const Connection> Connection::ForSession(
    const std::shared_ptr<const Connection>& shared) {
  if (shared->redirect_ == nullptr) return shared;
  const Route route = shared->CurrentRoute();
  ClientOptions options = shared->options_;
  options.address = route.address;
  auto own = std::make_shared<Connection>(std::move(options), route.channel,
                                          shared->redirect_, route.replica);
  absl::MutexLock lock(&shared->mu_);
  // Layouts and limits are a fleet's own: the same on every replica.
  if (shared->info_.has_value()) own->SeedServerInfo(*shared->info_);
  return own;
}

bool Connection::WaitWhileMoving(const grpc::ClientContext& context,
                                 std::optional<absl::Time>* since) const {
  if (redirect_ == nullptr || TrailingValue(context, kMovingMetadata).empty()) {
    return false;
  }
  const absl::Time now = absl::Now();
  if (!since->has_value()) *since = now;
  if (now - **since >= options_.move_wait) return false;
  absl::SleepFor(std::max(options_.backoff, absl::Milliseconds(1)));
  return true;
}

absl::Status Connection::MarkDraining(const grpc::ClientContext& context,
                                      absl::Status status) {
  const std::string replica = TrailingValue(context, kDrainingMetadata);
  if (!replica.empty())
    status.SetPayload(kDrainingMetadata, absl::Cord(replica));
  return status;
}

absl::StatusOr<Connection::LayoutInfo> Connection::FindLayout(
    const std::string& name) const {
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

absl::StatusOr<v1::ServerInfo> Connection::GetServerInfo() const {
  v1::ServerInfo info;
  absl::Status s = Call("GetServerInfo", Retry::kOnUnavailable,
                        [&](grpc::ClientContext& context, int) {
                          return stub().GetServerInfo(
                              &context, v1::GetServerInfoRequest(), &info);
                        });
  if (!s.ok()) return s;
  return info;
}

std::optional<v1::Layout> Connection::Lookup(const v1::ServerInfo& info,
                                             const std::string& name) {
  for (const v1::Layout& l : info.layouts()) {
    if (l.name() == name) return l;
  }
  return std::nullopt;
}

}  // namespace kvkeep::client
