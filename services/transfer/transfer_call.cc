#include "services/transfer/transfer_call.h"

namespace kvkeep {

grpc::ByteBuffer Serialize(const v1::TransferMessage& message) {
  grpc::ByteBuffer out;
  bool own = false;
  // Fails only past 2 GiB, far beyond any message sent here.
  static_cast<void>(grpc::SerializationTraits<v1::TransferMessage>::Serialize(
      message, &out, &own));
  return out;
}

}  // namespace kvkeep
