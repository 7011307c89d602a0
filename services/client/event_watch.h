// EventWatch: a WatchEvents stream (docs/events.md) that remembers where it
// is, so a watcher can reconnect and get every later event once, in order.
// Not thread-safe, except Cancel; movable. Made by KvKeepClient::
// WatchEvents.
#ifndef KVKEEP_SERVICES_CLIENT_EVENT_WATCH_H_
#define KVKEEP_SERVICES_CLIENT_EVENT_WATCH_H_

#include <cstdint>
#include <deque>
#include <memory>

#include "absl/status/statusor.h"
#include "grpcpp/client_context.h"
#include "grpcpp/support/sync_stream.h"
#include "kvkeep/v1/kvkeep.pb.h"

namespace kvkeep::client {

class Connection;

class EventWatch {
 public:
  EventWatch(EventWatch&&) noexcept;
  EventWatch& operator=(EventWatch&&) noexcept;
  ~EventWatch();  // cancels an open stream

  // Opens the stream and reads its first message: OK once the server
  // watches (events published from then on will come), or how it refused
  // (OUT_OF_RANGE: the resume point is no longer held, or another
  // incarnation's). A reconnect after the stream ended resumes after the
  // last event Next returned, of the same incarnation.
  absl::Status Start();
  // The next event, blocking until one comes; the stream's end status
  // (never OK) once it ended: then Start again to resume.
  absl::StatusOr<v1::Event> Next();
  // Ends a blocked Next from another thread (it returns CANCELLED).
  void Cancel();

  uint64_t incarnation() const { return incarnation_; }
  uint64_t last_sequence() const { return last_sequence_; }

 private:
  friend class KvKeepClient;
  using Reader = grpc::ClientReader<v1::WatchEventsResponse>;
  EventWatch(std::shared_ptr<const Connection> connection,
             v1::WatchEventsRequest request);
  absl::Status End();  // the open stream's status; closes it

  std::shared_ptr<const Connection> connection_;
  v1::WatchEventsRequest request_;  // kinds; the resume point is ours
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<Reader> reader_;
  std::deque<v1::Event> pending_;
  uint64_t incarnation_ = 0;
  uint64_t last_sequence_ = 0;
};

}  // namespace kvkeep::client

#endif  // KVKEEP_SERVICES_CLIENT_EVENT_WATCH_H_
