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

TransferCoordinator::~TransferCoordinator() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](int64_t* n) { return *n == 0; }, &sending_));
}

void TransferCoordinator::Send(
    OutgoingTransfer transfer,
    std::function<void(const TransferOutcome&)> done) {
  {
    absl::MutexLock lock(&mu_);
    ++sending_;
  }
  std::thread([this, transfer = std::move(transfer), done = std::move(done)] {
    std::string transfer_id = transfer.transfer_id;
    if (transfer_id.empty()) {
      absl::BitGen rng;
      transfer_id = absl::StrFormat("%016x%016x", absl::Uniform<uint64_t>(rng),
                                    absl::Uniform<uint64_t>(rng));
    }
    const absl::Time start = absl::Now();
    TransferOutcome outcome = Run(transfer, transfer_id);
    outcome.transfer_id = transfer_id;
    outcome.duration = absl::Now() - start;
    done(outcome);
    absl::MutexLock lock(&mu_);
    --sending_;
  }).detach();
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>*
TransferCoordinator::Receive(grpc::CallbackServerContext* ctx,
                             absl::StatusOr<std::string> tenant) {
  return NewReceiveReactor(store_, &log_, ctx, std::move(tenant),
                           options_.tenants_configured, options_.on_transfer,
                           &nccl_, options_.tcp);
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
  absl::StatusOr<v1::NcclOffer> made = nccl_.Offer(
      transfer.target, *pool.memory, pool.page_layout.token_bytes(), required);
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
  SendOptions options;
  options.target = transfer.target;
  options.target_token = transfer.target_token;
  options.peer_token = options_.peer_token;
  options.credentials = options_.peer_credentials;
  options.transfer_id = transfer_id;
  options.deadline = transfer.deadline;
  options.max_message_bytes = options_.max_message_bytes;
  options.chunk_bytes =
      std::min<int64_t>(4 << 20, options_.max_message_bytes / 2);
  options.token_bytes = pool->page_layout.token_bytes();
  options.wrap = options_.wrap_sender;
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
                           pool->memory->device().ordinal, transfer.deadline);
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
  const SendResult sent = SendSession(*snapshot, source, options);
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
  outcome.status = Settle(id, transfer_id, sent);
  return outcome;
}

absl::Status TransferCoordinator::Settle(SessionId id,
                                         const std::string& transfer_id,
                                         const SendResult& sent) {
  absl::MutexLock lock(&mu_);
  if (sent.status.ok()) {
    outgoing_.erase(id);
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
  outgoing_[id].running = false;
  return absl::UnavailableError(
      absl::StrCat(SessionLabel(id), ": the answer to the commit was lost (",
                   sent.status.message(),
                   "); the session stays frozen here until "
                   "TransferSession is retried with transfer_id ",
                   transfer_id));
}

}  // namespace kvkeep
