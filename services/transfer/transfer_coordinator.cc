#include "services/transfer/transfer_coordinator.h"

#include <algorithm>
#include <thread>
#include <utility>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "cache_store/quote.h"
#include "services/transfer/session_receiver.h"

namespace kvkeep {

TransferCoordinator::TransferCoordinator(CacheStore* store,
                                         TransferOptions options)
    : store_(store), options_(std::move(options)) {}

namespace {

// The longest wait between two questions about a commit in doubt.
constexpr absl::Duration kMaxResolveWait = absl::Minutes(1);

}  // namespace

TransferCoordinator::~TransferCoordinator() {
  Drain(absl::InfinitePast());
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](int64_t* n) { return *n == 0; }, &sending_));
}

void TransferCoordinator::Drain(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  stopping_ = true;
  mu_.AwaitWithDeadline(absl::Condition(
                            +[](int64_t* n) { return *n == 0; }, &sends_),
                        deadline);
  for (const std::shared_ptr<TransferCancel>& cancel : cancels_) {
    cancel->Cancel(absl::UnavailableError(
        "the store is stopping (its drain_seconds passed)"));
  }
  // Cancelled sends end promptly; each answers its caller (`done`), which
  // for TransferSession finishes a call of the gRPC server: that must
  // happen before the server goes away.
  mu_.Await(absl::Condition(
      +[](int64_t* n) { return *n == 0; }, &sends_));
}

void TransferCoordinator::Send(
    OutgoingTransfer transfer,
    std::function<void(const TransferOutcome&)> done) {
  if (transfer.cancel == nullptr) {
    transfer.cancel = std::make_shared<TransferCancel>();
  }
  std::string transfer_id = transfer.transfer_id;
  if (transfer_id.empty()) {
    absl::BitGen rng;
    transfer_id = absl::StrFormat("%016x%016x", absl::Uniform<uint64_t>(rng),
                                  absl::Uniform<uint64_t>(rng));
  }
  bool stopping = false;
  {
    absl::MutexLock lock(&mu_);
    stopping = stopping_;
    if (!stopping) {
      ++sending_;
      ++sends_;
      cancels_.insert(transfer.cancel);
    }
  }
  if (stopping) {
    TransferOutcome refused;
    refused.transfer_id = transfer_id;
    refused.status = absl::UnavailableError("the store is stopping");
    done(refused);
    return;
  }
  std::thread([this, transfer = std::move(transfer), transfer_id,
               done = std::move(done)] {
    const absl::Time start = absl::Now();
    TransferOutcome outcome = Run(transfer, transfer_id);
    outcome.transfer_id = transfer_id;
    outcome.duration = absl::Now() - start;
    done(outcome);
    {
      absl::MutexLock lock(&mu_);
      --sends_;
      cancels_.erase(transfer.cancel);
    }
    if (outcome.doubt > 0) Resolve(transfer, transfer_id, outcome.doubt);
    absl::MutexLock lock(&mu_);
    --sending_;
  }).detach();
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>*
TransferCoordinator::Receive(grpc::CallbackServerContext* ctx,
                             absl::StatusOr<std::string> tenant) {
  return NewReceiveReactor(store_, &log_, ctx, std::move(tenant),
                           options_.tenants_configured, options_.on_transfer,
                           &nccl_, options_.tcp, options_.replica);
}

absl::StatusOr<TransferCoordinator::Pool> TransferCoordinator::PoolOf(
    SessionId id) {
  absl::StatusOr<SessionStats> stats = store_->GetStats(id);
  if (!stats.ok()) return stats.status();
  Pool pool;
  for (const LayoutStats& l : store_->Layouts()) {
    if (l.layout.name == stats->layout)
      pool.page_layout = l.layout.page_layout();
  }
  absl::StatusOr<PageMemory*> memory = store_->MemoryOf(stats->layout);
  if (!memory.ok()) return memory.status();
  pool.memory = *memory;
  return pool;
}

absl::StatusOr<std::optional<v1::NcclOffer>> TransferCoordinator::NcclOffer(
    const OutgoingTransfer& transfer, const Pool& pool) {
  if (transfer.transport != Transport::kAuto &&
      transfer.transport != Transport::kNccl) {
    return std::nullopt;
  }
  const bool required = transfer.transport == Transport::kNccl;
  absl::StatusOr<v1::NcclOffer> made =
      nccl_.Offer(transfer.target, *pool.memory, pool.page_layout, required);
  if (made.ok()) return *std::move(made);
  if (!required) return std::nullopt;
  return absl::Status(
      made.status().code(),
      absl::StrCat("transport 'nccl': ", made.status().message()));
}

absl::StatusOr<SessionSnapshot> TransferCoordinator::Freeze(
    SessionId id, const std::string& transfer_id) {
  absl::MutexLock lock(&mu_);
  auto it = outgoing_.find(id);
  if (it == outgoing_.end()) {
    absl::StatusOr<SessionSnapshot> snapshot = store_->FreezeForTransfer(id);
    if (snapshot.ok()) outgoing_[id] = Outgoing{transfer_id, true};
    return snapshot;
  }
  if (it->second.running || it->second.transfer_id != transfer_id) {
    return absl::FailedPreconditionError(
        absl::StrCat(SessionLabel(id), " is being transferred (transfer ",
                     Quote(it->second.transfer_id), ")"));
  }
  it->second.running = true;
  return store_->ExportSession(id, /*with_bytes=*/false);
}

TransferOutcome TransferCoordinator::Run(const OutgoingTransfer& transfer,
                                         const std::string& transfer_id) {
  TransferOutcome outcome;
  const bool tcp_usable =
      options_.plaintext_data && TargetHost(transfer.target).has_value();
  if (transfer.transport == Transport::kTcp && !options_.plaintext_data) {
    outcome.status = absl::FailedPreconditionError(
        "transport 'tcp': this store has TLS and the data socket is "
        "plaintext; its transfers move pages encrypted on the gRPC stream "
        "(transport 'host' or 'auto')");
    return outcome;
  }
  if (transfer.transport == Transport::kTcp && !tcp_usable) {
    outcome.status = absl::FailedPreconditionError(
        absl::StrCat("transport 'tcp': the target ", Quote(transfer.target),
                     " names no TCP host for a data socket"));
    return outcome;
  }
  absl::StatusOr<Pool> pool = PoolOf(transfer.id);
  if (!pool.ok()) {
    outcome.status = pool.status();
    return outcome;
  }
  absl::StatusOr<std::optional<v1::NcclOffer>> offer =
      NcclOffer(transfer, *pool);
  if (!offer.ok()) {
    outcome.status = offer.status();
    return outcome;
  }
  absl::StatusOr<SessionSnapshot> snapshot = Freeze(transfer.id, transfer_id);
  if (!snapshot.ok()) {
    if (offer->has_value()) nccl_.Withdraw(**offer);
    outcome.status = snapshot.status();
    return outcome;
  }
  const SessionId id = transfer.id;
  store_->NoteTransfer(id, absl::StrCat("transfer ", transfer_id))
      .IgnoreError();
  SendOptions options = SendOptionsFor(transfer, transfer_id);
  // The time limit, when the caller's deadline is later (or none).
  const absl::Time limit = absl::Now() + options_.time_limit;
  options.deadline = std::min(transfer.deadline, limit);
  options.cancel = transfer.cancel.get();
  options.token_bytes = pool->page_layout.token_bytes();
  if (IsKivi(pool->page_layout.dtype)) {
    options.chunk_slot_multiple = pool->page_layout.page_tokens;
    options.key_block_bytes = pool->page_layout.key_block_bytes();
  }
  // The session is frozen: its block tables hold still while it moves.
  std::vector<std::optional<BlockTable>> tables(snapshot->layers.size());
  auto pages_of =
      [&](int32_t layer) -> absl::StatusOr<std::span<const PageId>> {
    if (!tables[layer].has_value()) {
      absl::StatusOr<BlockTable> table = store_->GetBlockTable(id, layer);
      if (!table.ok()) return table.status();
      tables[layer] = *std::move(table);
    }
    return std::span<const PageId>(tables[layer]->pages);
  };
  if (offer->has_value()) {
    options.nccl_offer = *offer;
    options.nccl_connect = [&] {
      return nccl_.Connect(transfer.target, **offer,
                           pool->memory->device().ordinal, options.deadline);
    };
    options.nccl_move = [&](NcclChannel& channel, int32_t layer, int64_t first,
                            int64_t n) -> absl::Status {
      absl::StatusOr<std::span<const PageId>> pages = pages_of(layer);
      if (!pages.ok()) return pages.status();
      return channel.Move(*pool->memory, pool->page_layout, *pages, first, n);
    };
  }
  if ((transfer.transport == Transport::kAuto ||
       transfer.transport == Transport::kTcp) &&
      tcp_usable) {
    options.tcp_offer = true;
    options.tcp_required = transfer.transport == Transport::kTcp;
  }
  SlotSource source;
  // A host pool's frozen pages are sent as they lie, without a copy.
  if (pool->memory->host_data() != nullptr) {
    source.spans = [&](int32_t layer, int64_t first, int64_t n) {
      return store_->FrozenSlotSpans(id, layer, first, n);
    };
  }
  source.read = [&](int32_t layer, int64_t first, int64_t n,
                    std::span<std::byte> keys, std::span<std::byte> values) {
    return store_->ReadSlots(id, layer, first, n, keys, values);
  };
  const absl::Time start = absl::Now();
  SendResult sent = SendSession(*snapshot, source, options);
  if (sent.status.code() == absl::StatusCode::kDeadlineExceeded &&
      limit < transfer.deadline) {
    sent.status = absl::DeadlineExceededError(
        absl::StrCat("the transfer's time limit (transfer_timeout_seconds: ",
                     absl::ToDoubleSeconds(options_.time_limit), ") passed (",
                     sent.status.message(), ")"));
  }
  // An offer the target did not take: a reused link it named is dropped.
  if (offer->has_value() && sent.transport != Transport::kNccl) {
    nccl_.Withdraw(**offer);
  }
  if (options_.on_transfer) {
    options_.on_transfer(TransferReport{sent.transport, /*outgoing=*/true,
                                        sent.status.code(), sent.bytes,
                                        absl::Now() - start});
  }
  outcome.transport = sent.transport;
  outcome.bytes = sent.bytes;
  outcome.target_replica = sent.target_replica;
  outcome.status = Settle(transfer, transfer_id, sent, &outcome.doubt);
  return outcome;
}

SendOptions TransferCoordinator::SendOptionsFor(
    const OutgoingTransfer& transfer, const std::string& transfer_id) const {
  SendOptions options;
  options.target = transfer.target;
  options.target_token = transfer.target_token;
  options.peer_token = options_.peer_token;
  options.credentials = options_.peer_credentials;
  options.transfer_id = transfer_id;
  options.deadline = transfer.deadline;
  options.keepalive = options_.keepalive;
  options.max_message_bytes = options_.max_message_bytes;
  options.chunk_bytes =
      std::min<int64_t>(4 << 20, options_.max_message_bytes / 2);
  options.wrap = options_.wrap_sender;
  return options;
}

absl::Status TransferCoordinator::Settle(const OutgoingTransfer& transfer,
                                         const std::string& transfer_id,
                                         const SendResult& sent,
                                         int64_t* doubt) {
  const SessionId id = transfer.id;
  absl::MutexLock lock(&mu_);
  if (sent.status.ok()) {
    outgoing_.erase(id);
    if (transfer.on_commit) transfer.on_commit(sent.target_replica);
    store_->FinishTransfer(id, /*committed=*/true).IgnoreError();
    return absl::OkStatus();
  }
  if (!sent.in_doubt) {
    // Nothing was committed: the session serves here again, unchanged.
    outgoing_.erase(id);
    store_->FinishTransfer(id, /*committed=*/false).IgnoreError();
    return absl::Status(
        sent.status.code(),
        absl::StrCat(SessionLabel(id), " stays here: ", sent.status.message()));
  }
  Outgoing& out = outgoing_[id];
  out.running = false;
  *doubt = ++out.doubt;
  store_
      ->NoteTransfer(id, absl::StrCat("transfer ", transfer_id,
                                      ": its commit is in doubt; this store "
                                      "is asking the target"))
      .IgnoreError();
  return absl::UnavailableError(absl::StrCat(
      SessionLabel(id), ": the answer to the commit was lost (",
      sent.status.message(),
      "); the session stays frozen here while this store asks the target "
      "whether it committed transfer ",
      transfer_id,
      " (then it is closed here, or serves here again), or until "
      "TransferSession is retried with that transfer_id"));
}

bool TransferCoordinator::InDoubt(SessionId id, const std::string& transfer_id,
                                  int64_t doubt) const {
  auto it = outgoing_.find(id);
  return it != outgoing_.end() && !it->second.running &&
         it->second.transfer_id == transfer_id && it->second.doubt == doubt;
}

void TransferCoordinator::Resolve(const OutgoingTransfer& transfer,
                                  const std::string& transfer_id,
                                  int64_t doubt) {
  const SessionId id = transfer.id;
  absl::Duration wait = options_.resolve_wait;
  for (int attempt = 0; attempt < options_.resolve_attempts; ++attempt) {
    auto cancel = std::make_shared<TransferCancel>();
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stopping_), wait);
      if (stopping_ || !InDoubt(id, transfer_id, doubt)) return;
      cancels_.insert(cancel);
    }
    wait = std::min(2 * wait, kMaxResolveWait);
    SendOptions ask = SendOptionsFor(transfer, transfer_id);
    // Long enough for keepalive to notice a frozen target.
    ask.deadline =
        absl::Now() + std::max(absl::Seconds(2), 2 * options_.keepalive);
    ask.cancel = cancel.get();
    const absl::StatusOr<bool> committed = AskCommitted(ask);
    absl::MutexLock lock(&mu_);
    cancels_.erase(cancel);
    if (!committed.ok()) continue;
    if (!InDoubt(id, transfer_id, doubt)) return;
    // The target said: closed here (it holds the session), or serving here
    // again (it never will).
    outgoing_.erase(id);
    if (*committed && transfer.on_commit) transfer.on_commit("");
    store_->FinishTransfer(id, *committed).IgnoreError();
    if (options_.on_resolved) options_.on_resolved(id, transfer_id, *committed);
    return;
  }
  absl::MutexLock lock(&mu_);
  if (!InDoubt(id, transfer_id, doubt)) return;
  store_
      ->NoteTransfer(id, absl::StrCat("transfer ", transfer_id,
                                      ": its commit is in doubt and the "
                                      "target could not be asked; retry "
                                      "TransferSession with that transfer_id"))
      .IgnoreError();
}

}  // namespace kvkeep
