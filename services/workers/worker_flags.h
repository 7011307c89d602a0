// The flags the reference workers and kvkeep-eval share (server, token,
// workload), and what they build from them. Each binary that links this
// file has these flags.
#ifndef KVKEEP_SERVICES_WORKERS_WORKER_FLAGS_H_
#define KVKEEP_SERVICES_WORKERS_WORKER_FLAGS_H_

#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "services/client/kvkeep_client.h"
#include "services/workers/workload.h"

namespace kvkeep::workers {

// --seed, --prompt_tokens and --decode_steps in an otherwise default spec.
WorkloadSpec SizesFromFlags();
// A client for --server / --token.
absl::StatusOr<client::KvKeepClient> ClientFromFlags();
// --workload (a family's preset) with --seed, --prompt_tokens,
// --decode_steps, shaped like `layout`.
absl::StatusOr<Workload> WorkloadFromFlags(const v1::Layout& layout);
// The layout --layout names on the server (the first one when empty).
absl::StatusOr<v1::Layout> LayoutFromFlags(const client::KvKeepClient& client);
// "k=v,k=v" -> {k: v}; INVALID_ARGUMENT for an item without '='.
absl::StatusOr<std::map<std::string, std::string>> ParseParams(
    const std::string& text);

}  // namespace kvkeep::workers

#endif  // KVKEEP_SERVICES_WORKERS_WORKER_FLAGS_H_
