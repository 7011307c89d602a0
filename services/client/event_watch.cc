#include "services/client/event_watch.h"

#include <utility>

#include "services/client/connection.h"
#include "services/common/grpc_status.h"

namespace kvkeep::client {

EventWatch::EventWatch(std::shared_ptr<const Connection> connection,
                       v1::WatchEventsRequest request)
    : connection_(std::move(connection)), request_(std::move(request)) {
  incarnation_ = request_.incarnation();
  last_sequence_ = request_.after_sequence();
}

EventWatch::EventWatch(EventWatch&&) noexcept = default;

EventWatch& EventWatch::operator=(EventWatch&& other) noexcept {
  if (this != &other) {
    if (reader_ != nullptr) {
      context_->TryCancel();
      reader_->Finish();
    }
    connection_ = std::move(other.connection_);
    request_ = std::move(other.request_);
    context_ = std::move(other.context_);
    reader_ = std::move(other.reader_);
    pending_ = std::move(other.pending_);
    incarnation_ = other.incarnation_;
    last_sequence_ = other.last_sequence_;
  }
  return *this;
}

EventWatch::~EventWatch() {
  if (reader_ != nullptr) {
    context_->TryCancel();
    reader_->Finish();
  }
}

absl::Status EventWatch::End() {
  absl::Status status = FromGrpcStatus(reader_->Finish());
  reader_.reset();
  if (status.ok()) {
    status = absl::UnavailableError("the server ended the event stream");
  }
  return status;
}

absl::Status EventWatch::Start() {
  if (reader_ != nullptr) {
    context_->TryCancel();
    reader_->Finish();
    reader_.reset();
  }
  pending_.clear();
  v1::WatchEventsRequest request = request_;
  request.set_incarnation(incarnation_);
  request.set_after_sequence(last_sequence_);
  context_ = std::make_unique<grpc::ClientContext>();
  connection_->Prepare(*context_, connection_->options().stream_deadline);
  reader_ = connection_->stub().WatchEvents(context_.get(), request);
  v1::WatchEventsResponse first;
  if (!reader_->Read(&first)) return End();
  incarnation_ = first.incarnation();
  if (last_sequence_ == 0) last_sequence_ = first.latest_sequence();
  for (v1::Event& event : *first.mutable_events()) {
    pending_.push_back(std::move(event));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::Event> EventWatch::Next() {
  while (pending_.empty()) {
    if (reader_ == nullptr) {
      return absl::FailedPreconditionError(
          "the event stream is not open: Start it");
    }
    v1::WatchEventsResponse message;
    if (!reader_->Read(&message)) return End();
    for (v1::Event& event : *message.mutable_events()) {
      pending_.push_back(std::move(event));
    }
  }
  v1::Event event = std::move(pending_.front());
  pending_.pop_front();
  last_sequence_ = event.sequence();
  return event;
}

void EventWatch::Cancel() {
  if (context_ != nullptr) context_->TryCancel();
}

}  // namespace kvkeep::client
