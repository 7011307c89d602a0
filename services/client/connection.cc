// Connection's ServerInfo cache (see connection.h).
#include "services/client/connection.h"

namespace kvkeep::client {

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
                          return stub_->GetServerInfo(
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
