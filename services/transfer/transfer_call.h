// TransferCall: one ReceiveSession call from the sending store's side, over
// raw bytes (the chunk messages are built by chunk_wire.h, the rest
// serialized as generated).
#ifndef KVKEEP_SERVICES_TRANSFER_TRANSFER_CALL_H_
#define KVKEEP_SERVICES_TRANSFER_TRANSFER_CALL_H_

#include <cstddef>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/client_context.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "kvkeep/v1/kvkeep.grpc.pb.h"

namespace kvkeep {

// One ReceiveSession call from the sender's side, over raw bytes. The
// sending thread drives it and waits for what it needs; gRPC's callbacks
// record what happened and start each queued write as the one before it
// is done. A hold keeps the call until the sender is done issuing
// operations. Thread-safe.
class TransferCall final
    : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  // Starts the call (its answer comes with the first reply).
  // `token` is the caller's bearer token for the target (a tenant's), and
  // `peer_token` this store's (session_sender.h); either may be empty.
  static std::shared_ptr<TransferCall> Start(grpc::GenericStub& stub,
                                             absl::Time deadline,
                                             const std::string& token,
                                             const std::string& peer_token) {
    std::shared_ptr<TransferCall> call(new TransferCall);
    {
      absl::MutexLock lock(&call->mu_);
      call->self_ = call;
    }
    if (deadline != absl::InfiniteFuture()) {
      call->ctx_.set_deadline(absl::ToChronoTime(deadline));
    }
    if (!token.empty()) {
      call->ctx_.AddMetadata("authorization", "Bearer " + token);
    }
    if (!peer_token.empty()) {
      call->ctx_.AddMetadata("kvkeep-peer-token", peer_token);
    }
    stub.PrepareBidiStreamingCall(
        &call->ctx_,
        absl::StrCat("/", v1::KvKeep::service_full_name(), "/ReceiveSession"),
        grpc::StubOptions(), call.get());
    call->AddHold();
    call->StartCall();
    return call;
  }

  // Queues `message` behind those before it. The one on the wire starts
  // the next as it is done, on gRPC's thread, so building chunks and
  // writing them to the socket run on different threads; Write blocks while
  // kQueued wait. False, without queueing, if the stream broke or the
  // target ended the call (a reply asked for has come, or the call ended).
  bool Write(grpc::ByteBuffer message) ABSL_LOCKS_EXCLUDED(mu_) {
    mu_.LockWhen(absl::Condition(this, &TransferCall::Writable));
    if (Ended()) {
      mu_.Unlock();
      return false;
    }
    if (writing_) {
      queue_.push_back(std::move(message));
      mu_.Unlock();
      return true;
    }
    writing_ = true;
    write_ = std::move(message);
    mu_.Unlock();
    StartWrite(&write_);
    return true;
  }
  // Cancels the call from any thread (its waits end; a no-op once done).
  void Cancel() { ctx_.TryCancel(); }
  // Whether the stream broke or the target ended the call already.
  bool Broken() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return Ended();
  }

  // Asks for the target's next reply, which AwaitReply waits for.
  void StartReading() ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      reading_ = true;
      read_asked_ = true;
    }
    StartRead(&read_);
  }
  // The reply asked for, or nullopt if the call ended instead.
  std::optional<v1::TransferReply> AwaitReply() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_, absl::Condition(this, &TransferCall::Replied));
    read_asked_ = false;
    return std::exchange(reply_, std::nullopt);
  }

  // Ends the call from this side: cancels it, or (once the queued writes
  // are done) half-closes it and lets the target answer; then waits for its
  // status. Every call started is finished once (it holds itself until
  // then).
  grpc::Status Finish(bool cancel) ABSL_LOCKS_EXCLUDED(mu_) {
    if (cancel) {
      ctx_.TryCancel();
    } else {
      mu_.LockWhen(absl::Condition(this, &TransferCall::Written));
      mu_.Unlock();
      StartWritesDone();
    }
    RemoveHold();
    std::shared_ptr<TransferCall> self;
    absl::MutexLock lock(&mu_, absl::Condition(&done_));
    // The call's last reference is never let go on a gRPC thread: its
    // context holds the channel, and a channel that ends on one of gRPC's
    // callback threads may end that thread's own completion queue (gRPC
    // 1.51 then aborts: "assertion failed: prior > 0"). The caller's
    // reference outlives this one.
    self = std::move(self_);
    return status_;
  }

  void OnWriteDone(bool ok) override ABSL_LOCKS_EXCLUDED(mu_) {
    mu_.Lock();
    write_.Clear();
    if (ok && !queue_.empty()) {
      // writing_ stays set: Write queues behind this one, and nothing else
      // touches write_ until its OnWriteDone.
      write_ = std::move(queue_.front());
      queue_.pop_front();
      mu_.Unlock();
      StartWrite(&write_);
      return;
    }
    if (!ok) {
      broken_ = true;
      queue_.clear();
    }
    writing_ = false;
    mu_.Unlock();
  }
  void OnReadDone(bool ok) override ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    reading_ = false;
    v1::TransferReply reply;
    if (ok && grpc::SerializationTraits<v1::TransferReply>::Deserialize(&read_,
                                                                        &reply)
                  .ok()) {
      reply_ = std::move(reply);
    } else {
      broken_ = true;
    }
  }
  void OnDone(const grpc::Status& status) override ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    status_ = status;
    done_ = true;  // Finish lets `self_` go
  }

 private:
  static constexpr size_t kQueued = 2;

  TransferCall() = default;
  bool Ended() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return broken_ || (!reading_ && read_asked_);
  }
  bool Writable() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return queue_.size() < kQueued || Ended();
  }
  bool Written() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !writing_; }
  bool Replied() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !reading_; }

  grpc::ClientContext ctx_;
  absl::Mutex mu_;
  std::shared_ptr<TransferCall> self_ ABSL_GUARDED_BY(mu_);  // until Finish
  // The message on the wire, and those after it.
  grpc::ByteBuffer write_ ABSL_GUARDED_BY(mu_);
  std::deque<grpc::ByteBuffer> queue_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ByteBuffer read_;  // the reply being read (gRPC's until OnReadDone)
  bool reading_ ABSL_GUARDED_BY(mu_) = false;
  // A reply was asked for and not yet awaited.
  bool read_asked_ ABSL_GUARDED_BY(mu_) = false;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<v1::TransferReply> reply_ ABSL_GUARDED_BY(mu_);
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
};

// A message's bytes as protobuf serializes them.
grpc::ByteBuffer Serialize(const v1::TransferMessage& message);

}  // namespace kvkeep

#endif  // KVKEEP_SERVICES_TRANSFER_TRANSFER_CALL_H_
