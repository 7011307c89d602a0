// Synthetic, deterministic Q/K/V streams for the reference workers and the
// evaluation harness, and the reference attention they are measured with.
//
// A Workload generates, for every token t (the prompt's tokens 0..P-1, then
// decode step s as token P + s) and every layer, the token's post-RoPE query
// [query_heads][head_dim], key and value [kv_heads][head_dim] as float32. Each
// vector is a function of (seed, t, layer, head) only, so tokens can be
// generated in any order, any number of times, without materialising the
// stream. The attention patterns the eviction policies exploit (sinks,
// locality, heavy hitters, needles, local vs retrieval heads) come out of real
// dot products: the generator shapes the vectors, never the probabilities.
// docs/workloads.md describes every knob and what it exposes.
//
// Geometry of a head: its rotary dims hold position only (a per-head
// direction, rotated by RoPE: the locality term); its other dims hold content
// (sink, heavy-hitter and needle directions, orthonormal) plus Gaussian noise
// orthogonal to them. Sizes of the content components are calibrated per
// query so the sinks and asked needles get their stated share of attention.
//
// Bit-identical on every IEEE-754 machine for the same spec: the generator
// uses its own PRNG (splitmix64), its own Box-Muller (Marsaglia's polar
// form), and its own exp, log, sin and cos built from + - * / and exact
// operations, in float64, compiled without floating-point contraction; only
// the final values are rounded to float32. Cost: about 20 ns per generated
// noise element (Fill of a token for 32 query heads of dim 128 and 8 kv heads
// takes ~80 us per layer); pre-generate for speed runs.
//
// A Workload is immutable once created: all its methods are const and it is
// thread-safe.
#ifndef KVKEEP_SERVICES_WORKERS_WORKLOAD_H_
#define KVKEEP_SERVICES_WORKERS_WORKLOAD_H_

#include <array>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvkeep::workers {

// The named presets of WorkloadSpec. The generator itself reads only the
// knobs; a family is a starting point (DefaultSpec) and a label in reports.
enum class WorkloadFamily {
  kSinks,           // an early key takes a fixed share of every query
  kLocality,        // RoPE locality only: recent tokens attended most
  kHeavyHitters,    // a few keys aligned with the mean query: power law
  kNeedleRepeated,  // a mid-context key asked again and again
  kNeedleOnce,      // a mid-context key asked once, late in the decode
  kHeadTypes,       // half the heads local, half retrieval
  kMixed,           // sinks + locality + heavy hitters
};

// Every family, in the order above.
std::span<const WorkloadFamily> AllFamilies();
// "sinks", "locality", "heavy_hitters", "needle_repeated", "needle_once",
// "head_types", "mixed".
std::string_view FamilyName(WorkloadFamily family);
// The inverse of FamilyName; INVALID_ARGUMENT (listing the names) otherwise.
absl::StatusOr<WorkloadFamily> ParseFamily(std::string_view name);

// The largest head_dim a workload may have (per-call scratch is on the stack).
inline constexpr int32_t kMaxHeadDim = 512;
// The most needles a workload may have.
inline constexpr int32_t kMaxNeedles = 64;

// The attention geometry of one layer. Query head h reads kv head
// h / (query_heads / kv_heads) (grouped-query attention).
struct HeadShape {
  int32_t kv_heads = 0;
  int32_t query_heads = 0;
  int32_t head_dim = 0;
  int32_t group() const { return query_heads / kv_heads; }
};

// Everything that determines a workload. Logit amplitudes are in units of
// the attention logit q.k / sqrt(head_dim). Defaults are those of kMixed.
struct WorkloadSpec {
  WorkloadFamily family = WorkloadFamily::kMixed;  // label only
  uint64_t seed = 1;

  int32_t num_layers = 2;
  int32_t kv_heads = 2;
  int32_t query_heads = 4;  // a multiple of kv_heads
  int32_t head_dim = 64;
  int64_t prompt_tokens = 512;
  int64_t decode_steps = 64;

  // Random part of the logits: Q and K get Gaussian noise in their content
  // dims (orthogonal to the content directions), scaled so that
  // q_noise . k_noise / sqrt(d) has this standard deviation.
  double noise_logit_std = 1.0;

  // Attention sinks: keys 0..sink_tokens-1 share `sink_share` of every
  // query's attention (expected; each sink gets sink_share / sink_tokens).
  // Both zero, or both positive.
  int32_t sink_tokens = 1;
  double sink_share = 0.3;

  // RoPE: the first rotary_fraction of each head's dimensions (rounded down
  // to pairs) are rotated pairwise, pair i by position * base^(-2i/rotary),
  // as in GPT-NeoX-style partial rotary. The rest carry content (sinks,
  // heavy hitters, needles) independently of position.
  double rope_base = 10000.0;
  double rotary_fraction = 0.5;
  // Logit amplitude B of a direction every query and key of a retrieval head
  // share before rotation: the logit gains B * c(distance), where
  // c(0) = 1 and c decays roughly like 1 - ln(distance) / ln(base). 0: none.
  double locality = 6.0;

  // Head types: round(local_head_fraction * kv_heads) kv heads per layer are
  // local (locality `local_head_locality`, they never ask for needles nor
  // align with heavy hitters); the others are retrieval heads (`locality`).
  // Which kv heads are local rotates with the layer.
  double local_head_fraction = 0.0;
  double local_head_locality = 16.0;

  // Heavy hitters: each position past the sinks is one with probability
  // heavy_hitter_fraction (the same positions in every head of a layer).
  // Its key aligns with the direction every retrieval query shares, for a
  // logit bonus of heavy_hitter_logit + heavy_hitter_tail * E, E ~ Exp(1)
  // drawn per head: attention weights with a Pareto tail of index
  // 1 / heavy_hitter_tail. heavy_hitter_tail must be < 1.
  double heavy_hitter_fraction = 0.02;
  double heavy_hitter_logit = 3.0;
  double heavy_hitter_tail = 0.5;

  // Needles: `needles` prompt positions, evenly spread in the prompt's middle
  // (position prompt_tokens * (i + 1) / (needles + 1)), each with its own
  // key direction. The retrieval heads' query of a token that asks for a
  // needle aligns with it, for an expected share `needle_share` (split among
  // the needles asked by the same token); no other query aligns with it.
  int32_t needles = 0;
  double needle_share = 0.5;
  // > 0: needle_repeated: asked by every needle_period-th token after it,
  //      prompt and decode tokens alike.
  // = 0: needle_once: asked once, by decode step `needle_question_step` for
  //      the first needle (-1: 3/4 of decode_steps), the others at later steps
  //      spread over the rest of the decode.
  int64_t needle_period = 0;
  int64_t needle_question_step = -1;
};

// The preset of a family (sizes and seed as in WorkloadSpec's defaults).
WorkloadSpec DefaultSpec(WorkloadFamily family);

// OK, or INVALID_ARGUMENT saying which knob is out of range.
absl::Status ValidateSpec(const WorkloadSpec& spec);

enum class HeadType { kRetrieval, kLocal };

// A needle: where its key is, and which tokens' queries ask for it.
struct Needle {
  int64_t position = 0;
  // Ascending token indices t (decode step = t - prompt_tokens when t >=
  // prompt_tokens) whose retrieval-head queries align with this needle.
  std::vector<int64_t> query_tokens;
};

// One token's vectors for one layer, float32.
struct TokenVectors {
  std::vector<float> q;  // [query_heads][head_dim], post-RoPE
  std::vector<float> k;  // [kv_heads][head_dim], post-RoPE
  std::vector<float> v;  // [kv_heads][head_dim]
};

// Tokens [0, tokens) of one layer, token-major: row t is token t.
struct LayerStream {
  int64_t tokens = 0;
  std::vector<float> q;  // [tokens][query_heads][head_dim]
  std::vector<float> k;  // [tokens][kv_heads][head_dim]
  std::vector<float> v;  // [tokens][kv_heads][head_dim]
};

// The generator. Creation precomputes per (layer, kv head) directions and
// per-distance tables (O(total_tokens) doubles); every token is then
// generated on the fly. Immutable and thread-safe.
class Workload {
 public:
  // INVALID_ARGUMENT if ValidateSpec rejects `spec`.
  static absl::StatusOr<Workload> Create(const WorkloadSpec& spec);

  const WorkloadSpec& spec() const { return spec_; }
  HeadShape shape() const {
    return {spec_.kv_heads, spec_.query_heads, spec_.head_dim};
  }
  int64_t total_tokens() const {
    return spec_.prompt_tokens + spec_.decode_steps;
  }
  int32_t rotary_dims() const { return rotary_dims_; }

  // Writes token t of `layer` into q [query_heads][head_dim], k and v
  // [kv_heads][head_dim]. Allocates nothing. INVALID_ARGUMENT if t or layer
  // is out of range or a span has the wrong size.
  absl::Status Fill(int64_t t, int32_t layer, std::span<float> q,
                    std::span<float> k, std::span<float> v) const;
  // The same, into new vectors.
  absl::StatusOr<TokenVectors> Token(int64_t t, int32_t layer) const;
  // Tokens [0, tokens) of `layer` (tokens <= total_tokens()).
  absl::StatusOr<LayerStream> Materialize(int32_t layer, int64_t tokens) const;

  HeadType kv_head_type(int32_t layer, int32_t kv_head) const;
  bool IsSink(int64_t position) const {
    return position >= 0 && position < spec_.sink_tokens;
  }
  // Whether `position`'s key is a heavy hitter in `layer` (all heads).
  bool IsHeavyHitter(int32_t layer, int64_t position) const;
  const std::vector<Needle>& needles() const { return needles_; }
  // Indices into needles() of the needles token t's query asks for.
  std::vector<int32_t> NeedlesAskedAt(int64_t t) const;

  // c(distance) = mean over rotary pairs i of cos(distance * theta_i): the
  // locality term's shape (1 at distance 0). 0 when there is no rotary pair.
  double LocalityProfile(int64_t distance) const;

 private:
  explicit Workload(const WorkloadSpec& spec) : spec_(spec) {}

  // Create's steps, in this order (each reads what the earlier ones set).
  // The dims, noise level and component norms.
  void SizeComponents();
  // theta_, profile_ and the locality sums.
  void BuildRopeTables();
  // local_, and per (layer, kv head) its locality and content directions.
  void BuildHeadDirections();
  void BuildLocalityDirection(int32_t layer, int32_t kv_head);
  void BuildContentDirections(int32_t layer, int32_t kv_head);
  void PlaceNeedles();
  // After PlaceNeedles: a needle is never a heavy hitter.
  void DrawHeavyHitters();

  // Per (layer, kv head): index layer * kv_heads + kv_head.
  int64_t HeadIndex(int32_t layer, int32_t kv_head) const {
    return static_cast<int64_t>(layer) * spec_.kv_heads + kv_head;
  }
  bool AsksNeedle(int32_t needle, int64_t t) const;
  // Logit targets of the query of token t in kv head `kv_head`'s group.
  struct QueryPlan {
    double sink_logit = 0;    // per sink key
    double needle_logit = 0;  // per asked needle, before its locality term
    double rest_mass = 0;     // typical partition of all other keys
  };
  QueryPlan PlanQuery(int64_t t, int32_t layer, int32_t kv_head,
                      int32_t asked) const;
  double HeavyHitterBonus(int32_t layer, int32_t kv_head,
                          int64_t position) const;
  // The content part of key t's noise, content_dims_ doubles: Gaussian,
  // orthogonal to the content directions.
  void KeyNoise(int64_t t, int32_t layer, int32_t kv_head,
                double* content) const;
  // cos and sin of t * theta_i for the rotary pairs of one token.
  struct RopeAngles {
    std::array<double, kMaxHeadDim / 2> cos;
    std::array<double, kMaxHeadDim / 2> sin;
  };
  void FillKey(int64_t t, int32_t layer, int32_t kv_head,
               const RopeAngles& rope, float* out) const;
  void FillQuery(int64_t t, int32_t layer, int32_t query_head,
                 const RopeAngles& rope, const QueryPlan& plan,
                 std::span<const int32_t> asked, float* out) const;
  void FillValue(int64_t t, int32_t layer, int32_t kv_head, float* out) const;
  // Rotates dims [0, rotary_dims_) of x pairwise by `rope`'s angles.
  void Rotate(const RopeAngles& rope, double* x) const;
  // Removes from x's content part its components along the content
  // directions of head `head_index` (so noise never touches them).
  void ProjectOutContent(int64_t head_index, double* content) const;
  const double* ContentDir(int64_t head_index, int32_t dir) const;

  WorkloadSpec spec_;
  int32_t rotary_dims_ = 0;   // even, <= head_dim
  int32_t content_dims_ = 0;  // head_dim - rotary_dims_
  int32_t content_dirs_ = 0;  // sink, heavy hitter, one per needle
  double noise_elem_std_ = 0;
  double key_content_norm_ = 0;  // norm of sink / needle key components
  double query_hh_norm_ = 0;     // retrieval queries' heavy-hitter part
  double amp_retrieval_ = 0;     // locality component norm, q and k
  double amp_local_ = 0;
  double log_noise_mgf_ = 0;     // ln E[exp(logit noise)]
  std::vector<double> theta_;    // [rotary_dims_ / 2]
  std::vector<double> profile_;  // c(distance), [total_tokens]
  // [retrieval, local][n]: sum over dist < n of e^{B c(dist)}, and of its
  // square; n in [0, total_tokens].
  std::array<std::vector<double>, 2> locality_sum_;
  std::array<std::vector<double>, 2> locality_sum2_;
  std::vector<double> locality_dir_;  // [layers * kv_heads][rotary_dims_]
  std::vector<double> content_dir_;   // [.. ][content_dirs_][content_dims_]
  std::vector<char> local_;           // [layers * kv_heads]
  // Per layer: the heavy hitters' positions (ascending) and, for each,
  // e^bonus - 1 per kv head: [count][kv_heads]. About
  // heavy_hitter_fraction * total_tokens entries.
  std::vector<std::vector<int64_t>> hh_positions_;
  std::vector<std::vector<double>> hh_excess_;
  std::vector<Needle> needles_;
};

// Reference attention of one token's queries over `tokens` keys:
//   probs[h][j] = softmax_j( q[h] . keys[j][h / group] / sqrt(head_dim) )
//   queries: [query_heads][head_dim], keys: [tokens][kv_heads][head_dim],
//   probs: [query_heads][tokens] (overwritten).
// Dot products, the max-subtracted softmax and its sum are computed in
// float64; only the probabilities are rounded to float32. No causal mask:
// pass exactly the keys the query may see. INVALID_ARGUMENT on bad sizes.
absl::Status Attention(const HeadShape& shape, std::span<const float> queries,
                       std::span<const float> keys, int64_t tokens,
                       std::span<float> probs);
// The same with float64 probabilities (what the quality metrics use).
absl::Status AttentionF64(const HeadShape& shape,
                          std::span<const float> queries,
                          std::span<const float> keys, int64_t tokens,
                          std::span<double> probs);

}  // namespace kvkeep::workers

#endif  // KVKEEP_SERVICES_WORKERS_WORKLOAD_H_
