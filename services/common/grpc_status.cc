#include "services/common/grpc_status.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvkeep {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  absl::string_view message = status.message();
  std::string text(message.substr(0, kMaxStatusMessageBytes));
  if (message.size() > kMaxStatusMessageBytes) {
    absl::StrAppend(&text, "... (", message.size() - kMaxStatusMessageBytes,
                    " more bytes)");
  }
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::move(text));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

}  // namespace kvkeep
