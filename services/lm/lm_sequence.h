// One sequence of kvkeep-lm and where its KV cache lives: in the worker
// (LocalSequence, --local: the baseline that measures what the store costs)
// or in a kvkeepd session (StoreSequence), whose policy evicts as the
// sequence grows; its layout may be quantised (the store quantises what the
// worker appends, the worker reads the records through the CPU twin; a
// kivi_int4 session's pages it decodes to float32, kivi_kv.h). A forward
// pass (model.h) reads the sequence's cache(), computes the attention() the
// policy takes, and Commit hands the step's new keys, values and attention to
// the cache; afterwards cache() holds exactly what the cache kept.
//
// A StoreSequence sends every step on one Decode stream (its tokens, then,
// for a policy that scores by attention, each layer's attention at the
// version the forward pass read) and follows every LayerChange, either
// reading the store's pool in place (a host pool mapped through MapPool:
// no byte copied) or keeping a mirror of the bytes it sent (SlotCache).
// snapkv's prompt ends with CompressPrompt and the observation window's
// attention.
//
// Not thread-safe: one thread drives a sequence.
#ifndef KVKEEP_SERVICES_LM_LM_SEQUENCE_H_
#define KVKEEP_SERVICES_LM_LM_SEQUENCE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "services/client/kvkeep_client.h"
#include "services/lm/contiguous_kv.h"
#include "services/lm/emulated_kv.h"
#include "services/lm/kv_caches.h"
#include "services/lm/model.h"

namespace kvkeep::lm {

// When a policy takes attention (ServerInfo.policy_info).
enum class PolicyInput { kNone, kPerStep, kCompress };

// Where a step sits in the sequence: snapkv compresses at the prompt's end.
enum class StepKind { kPrompt, kPromptEnd, kDecode };

// What a sequence's cache holds now.
struct CacheUsage {
  double resident_tokens_per_layer = 0;  // mean over layers
  int64_t resident_tokens = 0;           // summed over layers
  int64_t bytes = 0;  // the store: its pages; local: the tokens' K and V
};

class Sequence {
 public:
  virtual ~Sequence() = default;
  virtual const KvSource& cache() const = 0;
  // What the forward pass must hand back for a step of `kind`.
  virtual AttentionOutput attention(StepKind kind) const = 0;
  // Hands the computed step (tokens, positions, keys, values, attention)
  // to the cache.
  virtual absl::Status Commit(const SequenceStep& step, StepKind kind) = 0;
  virtual absl::StatusOr<CacheUsage> Usage() const = 0;
  // Frees the cache (the store's session). Idempotent.
  virtual absl::Status Close() = 0;
  // A short name for reports ("h2o@256").
  virtual const std::string& label() const = 0;
  // Where cache() reads: "local", "mapped" (kvkeepd's pool, in place) or
  // "mirror" (the worker's copy of the session's bytes).
  virtual std::string_view access() const = 0;
  // The fewest tokens the prompt's last step may hold (snapkv: its
  // observation window, which that step's attention must cover).
  virtual int64_t min_prompt_end_tokens() const { return 1; }

  // A new sequence whose cache starts as this one's now: for the store, a
  // forked session (ForkSession) sharing its pages copy-on-write, so tasks
  // whose prompts begin alike stream the common part once (lm_answer.h).
  // The caller closes it. UNIMPLEMENTED where the cache cannot fork.
  virtual absl::StatusOr<std::unique_ptr<Sequence>> Fork() const {
    return absl::UnimplementedError(
        absl::StrCat(label(), ": this cache cannot fork"));
  }
  // What decides how the cache evolves on given tokens (layout, policy, its
  // parameters, budget, score form, access): two sequences with the same
  // non-empty key hold the same after the same steps, so a fork of one
  // stands for the other. Empty: never shared.
  virtual std::string share_key() const { return ""; }
};

// The worker's own cache (contiguous_kv.h) for up to `capacity_tokens`
// tokens; evicts nothing (policy "full"). A step past the capacity is
// OUT_OF_RANGE.
std::unique_ptr<Sequence> NewLocalSequence(const ModelConfig& config,
                                           DType kv_dtype, std::string label,
                                           int64_t capacity_tokens);
// The same on an emulated quantised cache (emulated_kv.h): its usage is the
// bytes the format would hold.
std::unique_ptr<Sequence> NewEmulatedSequence(const ModelConfig& config,
                                              const Emulation& emulation,
                                              std::string label,
                                              int64_t capacity_tokens);

// How a store sequence reads its cache.
enum class CacheAccess {
  kAuto,    // the mapped pool when kvkeepd shares it, else a mirror
  kMapped,  // the mapped pool, or an error
  kMirror,  // a mirror of the bytes sent
};

// How a store sequence hands attention to a policy that scores by it.
enum class ScoreForm { kReduced, kPerHead, kQueries };

struct StoreSequenceOptions {
  std::string layout;  // a layout of the server matching the model
  std::string policy = "full";
  std::map<std::string, std::string> params;
  int64_t budget_tokens = 0;  // per layer; 0: the server's rule for full
  CacheAccess access = CacheAccess::kAuto;
  ScoreForm scores = ScoreForm::kReduced;
  std::string label;
};

// Creates the session; what its policy takes comes from `info` (the
// server's ServerInfo). NOT_FOUND for a policy the server does not
// describe; FAILED_PRECONDITION for query scores the policy or the layout
// refuses, or kMapped where the pool cannot be mapped.
absl::StatusOr<std::unique_ptr<Sequence>> NewStoreSequence(
    const client::KvKeepClient& client, const v1::ServerInfo& info,
    const ModelConfig& config, const StoreSequenceOptions& options);

// The server's layout for `config` whose keys_pre_rope matches `positions`
// (or the one named `name`, checked against the model). NOT_FOUND when
// none fits, listing what the server has.
absl::StatusOr<v1::Layout> FindLayout(const v1::ServerInfo& info,
                                      const ModelConfig& config,
                                      PositionMode positions,
                                      const std::string& name = "");
// The layout's KV format: its dtype, and for a quantised one the append
// dtype and group size (INVALID_ARGUMENT naming the layout for a dtype this
// build does not know).
absl::StatusOr<KvFormat> FormatOf(const v1::Layout& layout);

}  // namespace kvkeep::lm

#endif  // KVKEEP_SERVICES_LM_LM_SEQUENCE_H_
