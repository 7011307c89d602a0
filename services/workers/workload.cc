#include "services/workers/workload.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace kvkeep::workers {
namespace {

// Bounds that keep per-call scratch on the stack and tables small.
constexpr int64_t kMaxTotalTokens = int64_t{1} << 24;
// The shares of sinks and needles leave at least this much to the rest.
constexpr double kMaxReservedShare = 0.95;
// Content direction indices (after them: one per needle).
constexpr int32_t kSinkDir = 0;
constexpr int32_t kHeavyHitterDir = 1;
constexpr int32_t kFirstNeedleDir = 2;
// The logit a content component is sized for; the key and the query split it
// evenly, so neither side's norm dwarfs the other's.
constexpr double kContentLogitScale = 8.0;

// ---------------------------------------------------------------------------
// Deterministic float64 math: only + - * /, sqrt, floor, frexp and ldexp
// (all exactly specified by IEEE 754 / the C standard), so the results do not
// depend on the platform's libm. Accurate to a few ulps, which is plenty; what
// matters is that they are the same everywhere.

constexpr double kLn2Hi = 6.93147180369123816490e-01;  // fdlibm's split of ln 2
constexpr double kLn2Lo = 1.90821492927058770002e-10;
constexpr double kInvLn2 = 1.44269504088896338700e+00;
constexpr double kTwoPi = 6.28318530717958647692e+00;
constexpr double kTwoOverPi = 6.36619772367581382433e-01;
constexpr double kPio2_1 = 1.57079632673412561417e+00;  // fdlibm's pi/2 split
constexpr double kPio2_2 = 6.07710050630396597660e-11;
constexpr double kPio2_2t = 2.02226624879595063154e-21;

// 1 / n, and 1 / (n (n - 1)), folded by the compiler (IEEE division, so the
// same constants everywhere); the series below multiply by them.
constexpr std::array<double, 24> kInv = [] {
  std::array<double, 24> a{};
  for (int n = 1; n < 24; ++n) a[n] = 1.0 / n;
  return a;
}();
constexpr std::array<double, 24> kInvFall2 = [] {
  std::array<double, 24> a{};
  for (int n = 2; n < 24; ++n) a[n] = 1.0 / (n * (n - 1));
  return a;
}();

double DetExp(double x) {
  if (x > 709.0) return std::numeric_limits<double>::infinity();
  if (x < -745.0) return 0.0;
  const double k = std::floor(x * kInvLn2 + 0.5);
  const double r = (x - k * kLn2Hi) - k * kLn2Lo;  // |r| <= ~0.347
  double p = 1.0;  // e^r = 1 + r (1 + r/2 (1 + r/3 (...))), to r^15
  for (int n = 15; n >= 1; --n) p = 1.0 + r * p * kInv[n];
  return std::ldexp(p, static_cast<int>(k));
}

// x > 0.
double DetLog(double x) {
  int e = 0;
  double m = std::frexp(x, &e);  // x = m * 2^e, m in [0.5, 1)
  if (m < 0.70710678118654752440) {
    m *= 2.0;
    --e;
  }
  // ln m = 2 atanh(s) = 2 (s + s^3/3 + s^5/5 + ...), s = (m - 1) / (m + 1),
  // |s| <= 0.1716.
  const double s = (m - 1.0) / (m + 1.0);
  const double s2 = s * s;
  double p = 0.0;
  for (int n = 23; n >= 3; n -= 2) p = s2 * (kInv[n] + p);
  const double ln_m = 2.0 * s * (1.0 + p);
  return e * kLn2Hi + (e * kLn2Lo + ln_m);
}

void DetSinCos(double x, double* sin_out, double* cos_out) {
  const double k = std::floor(x * kTwoOverPi + 0.5);
  const double r = ((x - k * kPio2_1) - k * kPio2_2) - k * kPio2_2t;
  const double r2 = r * r;  // |r| <= ~pi/4
  double s = 1.0;  // sin r = r (1 - r2/3! (1 - r2/(5 4) (...))), to r^19
  for (int n = 19; n >= 3; n -= 2) s = 1.0 - r2 * s * kInvFall2[n];
  s = r * s;
  double c = 1.0;  // cos r = 1 - r2/2! (1 - r2/(4 3) (...)), to r^20
  for (int n = 20; n >= 2; n -= 2) c = 1.0 - r2 * c * kInvFall2[n];
  const int64_t quadrant = static_cast<int64_t>(k) & 3;  // two's complement
  switch (quadrant) {
    case 0:
      *sin_out = s;
      *cos_out = c;
      break;
    case 1:
      *sin_out = c;
      *cos_out = -s;
      break;
    case 2:
      *sin_out = -s;
      *cos_out = -c;
      break;
    default:
      *sin_out = -c;
      *cos_out = s;
      break;
  }
}

// ---------------------------------------------------------------------------
// PRNG: splitmix64 (Steele, Lea, Flood 2014), keyed per stream.

uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// What a stream is for: part of its key, so streams never collide.
enum class Stream : uint64_t {
  kKeyNoise = 1,
  kQueryNoise,
  kValue,
  kHeavyHitter,
  kHeavyHitterBonus,
  kLocalityPhase,
  kContentDir,
};

uint64_t StreamKey(uint64_t seed, Stream stream, uint64_t layer, uint64_t head,
                   uint64_t index) {
  uint64_t x = Mix64(seed + 0x9E3779B97F4A7C15ull);
  x = Mix64(x ^ (static_cast<uint64_t>(stream) * 0xD1B54A32D192ED03ull));
  x = Mix64(x ^ ((layer + 1) * 0x8CB92BA72F3D8DD7ull));
  x = Mix64(x ^ ((head + 1) * 0xAEF17502108EF2D9ull));
  return Mix64(x ^ ((index + 1) * 0xF1357AEA2E62A9C5ull));
}

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t key) : state_(key) {}
  uint64_t Next() {
    state_ += 0x9E3779B97F4A7C15ull;
    return Mix64(state_);
  }
  // Uniform in (0, 1): the 53-bit grid shifted by half a step.
  double Uniform() {
    return (static_cast<double>(Next() >> 11) + 0.5) * 0x1.0p-53;
  }

 private:
  uint64_t state_;
};

// out[0..n) = independent standard normals: Box-Muller in Marsaglia's polar
// form (a pair from a point drawn uniformly in the unit disc, no sin/cos).
void Gaussians(uint64_t key, double* out, int32_t n) {
  SplitMix64 rng(key);
  for (int32_t i = 0; i < n; i += 2) {
    double u = 0, v = 0, r2 = 0;
    do {
      u = 2.0 * rng.Uniform() - 1.0;
      v = 2.0 * rng.Uniform() - 1.0;
      r2 = u * u + v * v;
    } while (r2 >= 1.0 || r2 == 0.0);
    const double f = std::sqrt(-2.0 * DetLog(r2) / r2);
    out[i] = u * f;
    if (i + 1 < n) out[i + 1] = v * f;
  }
}

double UniformAt(uint64_t key) { return SplitMix64(key).Uniform(); }

absl::Status Invalid(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("workload spec: ", what));
}

bool Finite(double x) { return std::isfinite(x); }

int32_t RotaryDims(const WorkloadSpec& spec) {
  const double half = std::floor(spec.rotary_fraction * spec.head_dim / 2.0);
  return 2 * static_cast<int32_t>(std::clamp(half, 0.0, spec.head_dim / 2.0));
}

int32_t LocalKvHeads(const WorkloadSpec& spec) {
  return static_cast<int32_t>(
      std::floor(spec.local_head_fraction * spec.kv_heads + 0.5));
}

int64_t NeedlePosition(const WorkloadSpec& spec, int32_t i) {
  return spec.prompt_tokens * (i + 1) / (spec.needles + 1);
}

int64_t FirstQuestionStep(const WorkloadSpec& spec) {
  return spec.needle_question_step >= 0 ? spec.needle_question_step
                                        : spec.decode_steps * 3 / 4;
}

constexpr std::array<WorkloadFamily, 7> kFamilies = {
    WorkloadFamily::kSinks,        WorkloadFamily::kLocality,
    WorkloadFamily::kHeavyHitters, WorkloadFamily::kNeedleRepeated,
    WorkloadFamily::kNeedleOnce,   WorkloadFamily::kHeadTypes,
    WorkloadFamily::kMixed,
};

}  // namespace

std::span<const WorkloadFamily> AllFamilies() { return kFamilies; }

std::string_view FamilyName(WorkloadFamily family) {
  switch (family) {
    case WorkloadFamily::kSinks:
      return "sinks";
    case WorkloadFamily::kLocality:
      return "locality";
    case WorkloadFamily::kHeavyHitters:
      return "heavy_hitters";
    case WorkloadFamily::kNeedleRepeated:
      return "needle_repeated";
    case WorkloadFamily::kNeedleOnce:
      return "needle_once";
    case WorkloadFamily::kHeadTypes:
      return "head_types";
    case WorkloadFamily::kMixed:
      return "mixed";
  }
  return "unknown";
}

absl::StatusOr<WorkloadFamily> ParseFamily(std::string_view name) {
  for (WorkloadFamily f : kFamilies) {
    if (FamilyName(f) == name) return f;
  }
  // std::string: this Abseil's string_view may not be std::string_view.
  std::vector<std::string> names;
  for (WorkloadFamily f : kFamilies) names.emplace_back(FamilyName(f));
  return absl::InvalidArgumentError(
      absl::StrCat("unknown workload family '", std::string(name),
                   "'; known: ", absl::StrJoin(names, ", ")));
}

WorkloadSpec DefaultSpec(WorkloadFamily family) {
  WorkloadSpec s;  // kMixed's values
  s.family = family;
  // Start from a blank slate: every content knob off, mild locality.
  s.sink_tokens = 0;
  s.sink_share = 0;
  s.locality = 4.0;
  s.heavy_hitter_fraction = 0;
  s.needles = 0;
  switch (family) {
    case WorkloadFamily::kSinks:
      s.sink_tokens = 1;
      s.sink_share = 0.4;
      break;
    case WorkloadFamily::kLocality:
      s.locality = 12.0;
      break;
    case WorkloadFamily::kHeavyHitters:
      s.locality = 2.0;
      s.heavy_hitter_fraction = 0.02;
      s.heavy_hitter_logit = 3.0;
      s.heavy_hitter_tail = 0.5;
      break;
    case WorkloadFamily::kNeedleRepeated:
      s.needles = 1;
      s.needle_share = 0.5;
      s.needle_period = 4;
      break;
    case WorkloadFamily::kNeedleOnce:
      s.needles = 1;
      s.needle_share = 0.5;
      s.needle_period = 0;
      break;
    case WorkloadFamily::kHeadTypes:
      s.local_head_fraction = 0.5;
      s.local_head_locality = 16.0;
      s.locality = 2.0;
      s.sink_tokens = 1;
      s.sink_share = 0.3;
      s.heavy_hitter_fraction = 0.02;
      s.needles = 1;
      s.needle_share = 0.5;
      s.needle_period = 16;
      break;
    case WorkloadFamily::kMixed:
      s = WorkloadSpec{};
      break;
  }
  return s;
}

absl::Status ValidateSpec(const WorkloadSpec& s) {
  if (s.num_layers < 1) return Invalid("num_layers must be >= 1");
  if (s.kv_heads < 1) return Invalid("kv_heads must be >= 1");
  if (s.query_heads < s.kv_heads || s.query_heads % s.kv_heads != 0) {
    return Invalid("query_heads must be a positive multiple of kv_heads");
  }
  if (s.head_dim < 4 || s.head_dim > kMaxHeadDim) {
    return Invalid(absl::StrCat("head_dim must be in [4, ", kMaxHeadDim, "]"));
  }
  if (s.prompt_tokens < 1) return Invalid("prompt_tokens must be >= 1");
  if (s.decode_steps < 0) return Invalid("decode_steps must be >= 0");
  if (s.prompt_tokens > kMaxTotalTokens - s.decode_steps) {
    return Invalid(absl::StrCat("prompt_tokens + decode_steps must be <= ",
                                kMaxTotalTokens));
  }
  if (!Finite(s.noise_logit_std) || s.noise_logit_std < 0) {
    return Invalid("noise_logit_std must be >= 0");
  }
  if (s.sink_tokens < 0 || s.sink_tokens >= s.prompt_tokens) {
    return Invalid("sink_tokens must be in [0, prompt_tokens)");
  }
  if (!Finite(s.sink_share) || s.sink_share < 0 ||
      s.sink_share >= kMaxReservedShare) {
    return Invalid("sink_share must be in [0, 0.95)");
  }
  if ((s.sink_tokens > 0) != (s.sink_share > 0)) {
    return Invalid("sink_tokens and sink_share are both zero or both > 0");
  }
  if (!Finite(s.rope_base) || s.rope_base <= 1) {
    return Invalid("rope_base must be > 1");
  }
  if (!Finite(s.rotary_fraction) || s.rotary_fraction < 0 ||
      s.rotary_fraction > 1) {
    return Invalid("rotary_fraction must be in [0, 1]");
  }
  if (!Finite(s.locality) || s.locality < 0 || !Finite(s.local_head_locality) ||
      s.local_head_locality < 0) {
    return Invalid("locality and local_head_locality must be >= 0");
  }
  if (!Finite(s.local_head_fraction) || s.local_head_fraction < 0 ||
      s.local_head_fraction > 1) {
    return Invalid("local_head_fraction must be in [0, 1]");
  }
  const int32_t rotary = RotaryDims(s);
  const int32_t local = LocalKvHeads(s);
  if (rotary < 2 &&
      (s.locality > 0 || (local > 0 && s.local_head_locality > 0))) {
    return Invalid("locality needs at least one rotary pair (rotary_fraction)");
  }
  if (!Finite(s.heavy_hitter_fraction) || s.heavy_hitter_fraction < 0 ||
      s.heavy_hitter_fraction >= 1) {
    return Invalid("heavy_hitter_fraction must be in [0, 1)");
  }
  if (!Finite(s.heavy_hitter_logit) || s.heavy_hitter_logit < 0 ||
      s.heavy_hitter_logit > 30) {
    return Invalid("heavy_hitter_logit must be in [0, 30]");
  }
  if (!Finite(s.heavy_hitter_tail) || s.heavy_hitter_tail < 0 ||
      s.heavy_hitter_tail >= 1) {
    return Invalid("heavy_hitter_tail must be in [0, 1)");
  }
  if (s.needles < 0 || s.needles > kMaxNeedles) {
    return Invalid(absl::StrCat("needles must be in [0, ", kMaxNeedles, "]"));
  }
  if (s.head_dim - rotary < kFirstNeedleDir + s.needles + 1) {
    return Invalid(absl::StrCat(
        "the non-rotary dimensions (", s.head_dim - rotary,
        ") must hold 2 + needles content directions and noise: lower "
        "rotary_fraction"));
  }
  if (s.needles > 0) {
    if (!Finite(s.needle_share) || s.needle_share <= 0 ||
        s.sink_share + s.needle_share >= kMaxReservedShare) {
      return Invalid(
          "needle_share must be > 0 and sink_share + needle_share "
          "< 0.95");
    }
    if (local == s.kv_heads) {
      return Invalid(
          "needles need at least one retrieval head "
          "(local_head_fraction < 1)");
    }
    for (int32_t i = 0; i < s.needles; ++i) {
      const int64_t p = NeedlePosition(s, i);
      if (p < s.sink_tokens || (i > 0 && p == NeedlePosition(s, i - 1))) {
        return Invalid("prompt too short for its sinks and needles");
      }
    }
    if (s.needle_period < 0) return Invalid("needle_period must be >= 0");
    if (s.needle_period == 0) {
      if (s.decode_steps < 1) {
        return Invalid("needle_once needs decode_steps >= 1");
      }
      if (s.needle_question_step >= s.decode_steps ||
          s.needle_question_step < -1) {
        return Invalid(
            "needle_question_step must be -1 or in "
            "[0, decode_steps)");
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Workload> Workload::Create(const WorkloadSpec& spec) {
  if (absl::Status st = ValidateSpec(spec); !st.ok()) return st;
  Workload w(spec);
  const int32_t d = spec.head_dim;
  const double sqrt_d = std::sqrt(static_cast<double>(d));
  const int64_t total = w.total_tokens();
  w.rotary_dims_ = RotaryDims(spec);
  w.content_dims_ = d - w.rotary_dims_;
  w.content_dirs_ = kFirstNeedleDir + spec.needles;
  // Noise lives in the content dims less the content directions (m dims):
  // per element std sigma with sigma^4 m / d = noise_logit_std^2, so the
  // logit noise q_noise . k_noise / sqrt(d) has that standard deviation.
  const int32_t noise_dims = w.content_dims_ - w.content_dirs_;
  w.noise_elem_std_ = std::sqrt(spec.noise_logit_std *
                                std::sqrt(static_cast<double>(d) / noise_dims));
  w.key_content_norm_ = std::sqrt(kContentLogitScale * sqrt_d);
  w.query_hh_norm_ = w.key_content_norm_;
  // q.k / sqrt(d) of the locality parts is amp^2 c / sqrt(d) = B c.
  w.amp_retrieval_ = std::sqrt(spec.locality * sqrt_d);
  w.amp_local_ = std::sqrt(spec.local_head_locality * sqrt_d);
  // It is independent from key to key, so the partition over many keys is
  // near its mean: E[e^noise] = e^(std^2 / 2) (Gaussian).
  w.log_noise_mgf_ = 0.5 * spec.noise_logit_std * spec.noise_logit_std;
  const int32_t pairs = w.rotary_dims_ / 2;
  const double ln_base = DetLog(spec.rope_base);
  w.theta_.resize(pairs);
  for (int32_t i = 0; i < pairs; ++i) {
    w.theta_[i] = DetExp(-(2.0 * i / w.rotary_dims_) * ln_base);
  }
  w.profile_.assign(total, 0.0);
  for (int64_t dist = 0; dist < total && pairs > 0; ++dist) {
    double sum = 0;
    for (int32_t i = 0; i < pairs; ++i) {
      double sn = 0, cs = 0;
      DetSinCos(static_cast<double>(dist) * w.theta_[i], &sn, &cs);
      sum += cs;
    }
    w.profile_[dist] = sum / pairs;
  }
  for (int type = 0; type < 2; ++type) {
    const double b = type == 0 ? spec.locality : spec.local_head_locality;
    std::vector<double>& sum = w.locality_sum_[type];
    std::vector<double>& sum2 = w.locality_sum2_[type];
    sum.assign(total + 1, 0.0);
    sum2.assign(total + 1, 0.0);
    for (int64_t dist = 0; dist < total; ++dist) {
      const double weight = DetExp(b * w.profile_[dist]);
      sum[dist + 1] = sum[dist] + weight;
      sum2[dist + 1] = sum2[dist] + weight * weight;
    }
  }

  const int64_t heads = static_cast<int64_t>(spec.num_layers) * spec.kv_heads;
  const int32_t local = LocalKvHeads(spec);
  const double f = spec.heavy_hitter_fraction;
  w.local_.assign(heads, 0);
  w.locality_dir_.assign(heads * w.rotary_dims_, 0.0);
  w.content_dir_.assign(heads * w.content_dirs_ * w.content_dims_, 0.0);
  for (int32_t layer = 0; layer < spec.num_layers; ++layer) {
    for (int32_t g = 0; g < spec.kv_heads; ++g) {
      const int64_t hi = w.HeadIndex(layer, g);
      w.local_[hi] = (g + layer) % spec.kv_heads < local;
      // Locality direction: unit norm, the same energy in every rotary pair
      // (so the logit is B * mean_i cos(distance theta_i)), random phases.
      SplitMix64 phases(
          StreamKey(spec.seed, Stream::kLocalityPhase, layer, g, 0));
      for (int32_t i = 0; i < pairs; ++i) {
        double sn = 0, cs = 0;
        DetSinCos(kTwoPi * phases.Uniform(), &sn, &cs);
        const double norm = 1.0 / std::sqrt(static_cast<double>(pairs));
        w.locality_dir_[hi * w.rotary_dims_ + 2 * i] = cs * norm;
        w.locality_dir_[hi * w.rotary_dims_ + 2 * i + 1] = sn * norm;
      }
      // Content directions: Gram-Schmidt on Gaussian vectors in the
      // non-rotary dims (modified, twice, for orthogonality to ~1e-16).
      for (int32_t a = 0; a < w.content_dirs_; ++a) {
        double* dir =
            &w.content_dir_[(hi * w.content_dirs_ + a) * w.content_dims_];
        Gaussians(StreamKey(spec.seed, Stream::kContentDir, layer, g, a), dir,
                  w.content_dims_);
        for (int pass = 0; pass < 2; ++pass) {
          for (int32_t b = 0; b < a; ++b) {
            const double* other = w.ContentDir(hi, b);
            double dot = 0;
            for (int32_t i = 0; i < w.content_dims_; ++i) {
              dot += dir[i] * other[i];
            }
            for (int32_t i = 0; i < w.content_dims_; ++i) {
              dir[i] -= dot * other[i];
            }
          }
        }
        double norm2 = 0;
        for (int32_t i = 0; i < w.content_dims_; ++i) norm2 += dir[i] * dir[i];
        const double inv = 1.0 / std::sqrt(norm2);
        for (int32_t i = 0; i < w.content_dims_; ++i) dir[i] *= inv;
      }
    }
  }

  for (int32_t i = 0; i < spec.needles; ++i) {
    Needle n;
    n.position = NeedlePosition(spec, i);
    if (spec.needle_period > 0) {
      for (int64_t t = n.position + spec.needle_period; t < total;
           t += spec.needle_period) {
        n.query_tokens.push_back(t);
      }
    } else {
      const int64_t first = FirstQuestionStep(spec);
      const int64_t gap = (spec.decode_steps - first) / spec.needles;
      n.query_tokens.push_back(spec.prompt_tokens + first + i * gap);
    }
    w.needles_.push_back(std::move(n));
  }

  // The heavy hitters of each layer (after the needles: a needle is never
  // one) and e^bonus - 1 per kv head, the excess weight they add to a
  // retrieval query's partition.
  w.hh_positions_.resize(spec.num_layers);
  w.hh_excess_.resize(spec.num_layers);
  for (int32_t layer = 0; layer < spec.num_layers && f > 0; ++layer) {
    for (int64_t j = 0; j < total; ++j) {
      if (!w.IsHeavyHitter(layer, j)) continue;
      w.hh_positions_[layer].push_back(j);
      for (int32_t g = 0; g < spec.kv_heads; ++g) {
        w.hh_excess_[layer].push_back(DetExp(w.HeavyHitterBonus(layer, g, j)) -
                                      1.0);
      }
    }
  }
  return w;
}

const double* Workload::ContentDir(int64_t head_index, int32_t dir) const {
  return &content_dir_[(head_index * content_dirs_ + dir) * content_dims_];
}

HeadType Workload::kv_head_type(int32_t layer, int32_t kv_head) const {
  return local_[HeadIndex(layer, kv_head)] ? HeadType::kLocal
                                           : HeadType::kRetrieval;
}

bool Workload::IsHeavyHitter(int32_t layer, int64_t position) const {
  if (spec_.heavy_hitter_fraction <= 0 || position < spec_.sink_tokens) {
    return false;
  }
  for (const Needle& n : needles_) {
    if (n.position == position) return false;
  }
  return UniformAt(StreamKey(spec_.seed, Stream::kHeavyHitter, layer, 0,
                             position)) < spec_.heavy_hitter_fraction;
}

double Workload::HeavyHitterBonus(int32_t layer, int32_t kv_head,
                                  int64_t position) const {
  const double e = -DetLog(UniformAt(StreamKey(
      spec_.seed, Stream::kHeavyHitterBonus, layer, kv_head, position)));
  return spec_.heavy_hitter_logit + spec_.heavy_hitter_tail * e;
}

bool Workload::AsksNeedle(int32_t needle, int64_t t) const {
  const Needle& n = needles_[needle];
  if (spec_.needle_period > 0) {
    return t > n.position && (t - n.position) % spec_.needle_period == 0;
  }
  return t == n.query_tokens.front();
}

std::vector<int32_t> Workload::NeedlesAskedAt(int64_t t) const {
  std::vector<int32_t> out;
  for (int32_t i = 0; i < static_cast<int32_t>(needles_.size()); ++i) {
    if (AsksNeedle(i, t)) out.push_back(i);
  }
  return out;
}

double Workload::LocalityProfile(int64_t distance) const {
  if (distance < 0 || theta_.empty()) return 0.0;
  if (distance < static_cast<int64_t>(profile_.size())) {
    return profile_[distance];
  }
  double sum = 0;
  for (double th : theta_) {
    double sn = 0, cs = 0;
    DetSinCos(static_cast<double>(distance) * th, &sn, &cs);
    sum += cs;
  }
  return sum / static_cast<double>(theta_.size());
}

// Sizes the query's content components so that each sink gets sink_share /
// sink_tokens and each asked needle needle_share / asked of the attention.
// The other keys j (positions sink_tokens..t) have weights
//   W_j e^noise,  W_j = e^{B c(t - j)} (times e^bonus_j for the heavy
//   hitters, in retrieval heads),
// with mean M = sum W * E[e^noise]. When a few keys dominate (large B, heavy
// hitters) that sum is skewed: its typical value is below M. Taken as
// lognormal with M's mean and variance (Fenton-Wilkinson), its median is
//   M / sqrt(1 + (e^{std^2} - 1) sum W^2 / (sum W)^2),
// and that median is the partition `rest` the shares are sized for: a key of
// logit L gets share p when e^L = p rest / other, other = 1 - (the shares of
// the sinks and the asked needles).
Workload::QueryPlan Workload::PlanQuery(int64_t t, int32_t layer,
                                        int32_t kv_head, int32_t asked) const {
  QueryPlan plan;
  const bool local = local_[HeadIndex(layer, kv_head)];
  const int64_t rest_keys = std::max<int64_t>(0, t - spec_.sink_tokens + 1);
  const int type = local ? 1 : 0;
  double sum = locality_sum_[type][rest_keys];
  if (sum <= 0) return plan;  // t is itself a sink
  double sum2 = locality_sum2_[type][rest_keys];
  if (!local) {
    // The heavy hitters seen so far, with their realised bonuses: O(number
    // of heavy hitters up to t).
    const std::vector<int64_t>& pos = hh_positions_[layer];
    const double* excess = hh_excess_[layer].data();
    for (size_t i = 0; i < pos.size() && pos[i] <= t; ++i) {
      const double w = DetExp(spec_.locality * LocalityProfile(t - pos[i]));
      const double e = excess[i * spec_.kv_heads + kv_head];  // e^b - 1
      sum += w * e;
      sum2 += w * w * e * (e + 2.0);  // (e^b)^2 - 1
    }
  }
  const double mean = sum * DetExp(log_noise_mgf_);
  const double rel_var =
      (DetExp(2.0 * log_noise_mgf_) - 1.0) * sum2 / (sum * sum);
  plan.rest_mass = mean / std::sqrt(1.0 + rel_var);
  const double needle_share = (!local && asked > 0) ? spec_.needle_share : 0;
  const double other = 1.0 - spec_.sink_share - needle_share;
  if (spec_.sink_tokens > 0) {
    plan.sink_logit =
        DetLog(spec_.sink_share / spec_.sink_tokens * plan.rest_mass / other);
  }
  if (needle_share > 0) {
    plan.needle_logit = DetLog(needle_share / asked * plan.rest_mass / other);
  }
  return plan;
}

void Workload::Rotate(const RopeAngles& rope, double* x) const {
  for (size_t i = 0; i < theta_.size(); ++i) {
    const double a = x[2 * i];
    const double b = x[2 * i + 1];
    x[2 * i] = a * rope.cos[i] - b * rope.sin[i];
    x[2 * i + 1] = a * rope.sin[i] + b * rope.cos[i];
  }
}

void Workload::ProjectOutContent(int64_t head_index, double* content) const {
  for (int32_t a = 0; a < content_dirs_; ++a) {
    const double* dir = ContentDir(head_index, a);
    double dot = 0;
    for (int32_t i = 0; i < content_dims_; ++i) dot += content[i] * dir[i];
    for (int32_t i = 0; i < content_dims_; ++i) content[i] -= dot * dir[i];
  }
}

void Workload::KeyNoise(int64_t t, int32_t layer, int32_t kv_head,
                        double* content) const {
  Gaussians(StreamKey(spec_.seed, Stream::kKeyNoise, layer, kv_head, t),
            content, content_dims_);
  for (int32_t i = 0; i < content_dims_; ++i) content[i] *= noise_elem_std_;
  ProjectOutContent(HeadIndex(layer, kv_head), content);
}

void Workload::FillKey(int64_t t, int32_t layer, int32_t kv_head,
                       const RopeAngles& rope, float* out) const {
  const int32_t d = spec_.head_dim;
  const int64_t hi = HeadIndex(layer, kv_head);
  std::array<double, kMaxHeadDim> x{};
  if (IsSink(t)) {
    // A sink key is its content direction alone: its logit is exactly what
    // the query's sink component asks for, whatever the query's noise.
    const double* dir = ContentDir(hi, kSinkDir);
    for (int32_t i = 0; i < content_dims_; ++i) {
      x[rotary_dims_ + i] = key_content_norm_ * dir[i];
    }
  } else {
    double* content = x.data() + rotary_dims_;
    KeyNoise(t, layer, kv_head, content);
    const double amp = local_[hi] ? amp_local_ : amp_retrieval_;
    const double* u = &locality_dir_[hi * rotary_dims_];
    for (int32_t i = 0; i < rotary_dims_; ++i) x[i] += amp * u[i];
    auto add = [&](int32_t dir_index, double norm) {
      const double* dir = ContentDir(hi, dir_index);
      for (int32_t i = 0; i < content_dims_; ++i) content[i] += norm * dir[i];
    };
    for (int32_t n = 0; n < static_cast<int32_t>(needles_.size()); ++n) {
      if (needles_[n].position == t)
        add(kFirstNeedleDir + n, key_content_norm_);
    }
    if (IsHeavyHitter(layer, t)) {
      add(kHeavyHitterDir, HeavyHitterBonus(layer, kv_head, t) *
                               std::sqrt(static_cast<double>(d)) /
                               query_hh_norm_);
    }
    Rotate(rope, x.data());
  }
  for (int32_t i = 0; i < d; ++i) out[i] = static_cast<float>(x[i]);
}

void Workload::FillQuery(int64_t t, int32_t layer, int32_t query_head,
                         const RopeAngles& rope, const QueryPlan& plan,
                         std::span<const int32_t> asked, float* out) const {
  const int32_t d = spec_.head_dim;
  const double sqrt_d = std::sqrt(static_cast<double>(d));
  const int32_t kv_head = query_head / (spec_.query_heads / spec_.kv_heads);
  const int64_t hi = HeadIndex(layer, kv_head);
  const bool local = local_[hi];
  std::array<double, kMaxHeadDim> x{};
  double* content = x.data() + rotary_dims_;
  Gaussians(StreamKey(spec_.seed, Stream::kQueryNoise, layer, query_head, t),
            content, content_dims_);
  for (int32_t i = 0; i < content_dims_; ++i) content[i] *= noise_elem_std_;
  ProjectOutContent(hi, content);
  const double amp = local ? amp_local_ : amp_retrieval_;
  const double* u = &locality_dir_[hi * rotary_dims_];
  for (int32_t i = 0; i < rotary_dims_; ++i) x[i] += amp * u[i];
  // The question aims at the needle's key exactly: it cancels its own noise
  // against that key's (q_noise . k_noise / sqrt(d)), so the needle's share
  // varies only with the rest of the keys.
  std::array<double, kMaxNeedles> needle_noise_logit{};
  if (!local) {
    std::array<double, kMaxHeadDim> key_noise{};
    for (size_t a = 0; a < asked.size(); ++a) {
      KeyNoise(needles_[asked[a]].position, layer, kv_head, key_noise.data());
      double dot = 0;
      for (int32_t i = 0; i < content_dims_; ++i) {
        dot += content[i] * key_noise[i];
      }
      needle_noise_logit[a] = dot / sqrt_d;
    }
  }
  auto add = [&](int32_t dir_index, double norm) {
    const double* dir = ContentDir(hi, dir_index);
    for (int32_t i = 0; i < content_dims_; ++i) content[i] += norm * dir[i];
  };
  // A component of norm m along a direction whose key part has norm kappa
  // adds m kappa / sqrt(d) to that key's logit.
  if (spec_.sink_tokens > 0) {
    add(kSinkDir, plan.sink_logit * sqrt_d / key_content_norm_);
  }
  if (!local) {
    if (spec_.heavy_hitter_fraction > 0) add(kHeavyHitterDir, query_hh_norm_);
    for (size_t a = 0; a < asked.size(); ++a) {
      const int32_t n = asked[a];
      const double locality_term =
          spec_.locality * LocalityProfile(t - needles_[n].position);
      add(kFirstNeedleDir + n,
          (plan.needle_logit - locality_term - needle_noise_logit[a]) * sqrt_d /
              key_content_norm_);
    }
  }
  Rotate(rope, x.data());
  for (int32_t i = 0; i < d; ++i) out[i] = static_cast<float>(x[i]);
}

void Workload::FillValue(int64_t t, int32_t layer, int32_t kv_head,
                         float* out) const {
  std::array<double, kMaxHeadDim> x{};
  Gaussians(StreamKey(spec_.seed, Stream::kValue, layer, kv_head, t), x.data(),
            spec_.head_dim);
  for (int32_t i = 0; i < spec_.head_dim; ++i) {
    out[i] = static_cast<float>(x[i]);
  }
}

absl::Status Workload::Fill(int64_t t, int32_t layer, std::span<float> q,
                            std::span<float> k, std::span<float> v) const {
  if (t < 0 || t >= total_tokens()) {
    return absl::InvalidArgumentError(
        absl::StrCat("token ", t, " out of range [0, ", total_tokens(), ")"));
  }
  if (layer < 0 || layer >= spec_.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " out of range"));
  }
  const size_t d = spec_.head_dim;
  if (q.size() != spec_.query_heads * d || k.size() != spec_.kv_heads * d ||
      v.size() != spec_.kv_heads * d) {
    return absl::InvalidArgumentError(
        "Fill: q must hold query_heads * head_dim floats, k and v kv_heads * "
        "head_dim");
  }
  // RoPE: pair i of every head turns by t * theta_i.
  RopeAngles rope;
  for (size_t i = 0; i < theta_.size(); ++i) {
    DetSinCos(static_cast<double>(t) * theta_[i], &rope.sin[i], &rope.cos[i]);
  }
  for (int32_t g = 0; g < spec_.kv_heads; ++g) {
    FillKey(t, layer, g, rope, k.data() + g * d);
    FillValue(t, layer, g, v.data() + g * d);
  }
  std::array<int32_t, kMaxNeedles> asked_buf{};
  int32_t asked = 0;
  for (int32_t i = 0; i < static_cast<int32_t>(needles_.size()); ++i) {
    if (AsksNeedle(i, t)) asked_buf[asked++] = i;
  }
  const std::span<const int32_t> asked_span(asked_buf.data(), asked);
  const int32_t group = spec_.query_heads / spec_.kv_heads;
  for (int32_t g = 0; g < spec_.kv_heads; ++g) {
    const QueryPlan plan = PlanQuery(t, layer, g, asked);
    for (int32_t h = g * group; h < (g + 1) * group; ++h) {
      FillQuery(t, layer, h, rope, plan, asked_span, q.data() + h * d);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<TokenVectors> Workload::Token(int64_t t, int32_t layer) const {
  TokenVectors out;
  const size_t d = spec_.head_dim;
  out.q.resize(spec_.query_heads * d);
  out.k.resize(spec_.kv_heads * d);
  out.v.resize(spec_.kv_heads * d);
  if (absl::Status st = Fill(t, layer, out.q, out.k, out.v); !st.ok()) {
    return st;
  }
  return out;
}

absl::StatusOr<LayerStream> Workload::Materialize(int32_t layer,
                                                  int64_t tokens) const {
  if (tokens < 0 || tokens > total_tokens()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Materialize: tokens ", tokens, " out of range"));
  }
  LayerStream out;
  out.tokens = tokens;
  const size_t qn = static_cast<size_t>(spec_.query_heads) * spec_.head_dim;
  const size_t kn = static_cast<size_t>(spec_.kv_heads) * spec_.head_dim;
  out.q.resize(tokens * qn);
  out.k.resize(tokens * kn);
  out.v.resize(tokens * kn);
  for (int64_t t = 0; t < tokens; ++t) {
    if (absl::Status st =
            Fill(t, layer, std::span<float>(out.q).subspan(t * qn, qn),
                 std::span<float>(out.k).subspan(t * kn, kn),
                 std::span<float>(out.v).subspan(t * kn, kn));
        !st.ok()) {
      return st;
    }
  }
  return out;
}

namespace {

absl::Status CheckAttentionSizes(const HeadShape& shape, size_t queries,
                                 size_t keys, int64_t tokens, size_t probs) {
  if (shape.kv_heads < 1 || shape.head_dim < 1 ||
      shape.query_heads < shape.kv_heads ||
      shape.query_heads % shape.kv_heads != 0) {
    return absl::InvalidArgumentError(
        "attention: query_heads must be a positive multiple of kv_heads");
  }
  const size_t d = shape.head_dim;
  if (tokens < 0 || queries != shape.query_heads * d ||
      keys != static_cast<size_t>(tokens) * shape.kv_heads * d ||
      probs != static_cast<size_t>(tokens) * shape.query_heads) {
    return absl::InvalidArgumentError(
        "attention: queries [query_heads][head_dim], keys "
        "[tokens][kv_heads][head_dim], probs [query_heads][tokens]");
  }
  return absl::OkStatus();
}

template <typename Out>
void AttentionImpl(const HeadShape& shape, const float* queries,
                   const float* keys, int64_t tokens, Out* probs,
                   std::vector<double>& logits) {
  const int32_t d = shape.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  logits.resize(tokens);
  for (int32_t h = 0; h < shape.query_heads; ++h) {
    const float* q = queries + static_cast<int64_t>(h) * d;
    const int32_t g = h / shape.group();
    double max_logit = -std::numeric_limits<double>::infinity();
    for (int64_t j = 0; j < tokens; ++j) {
      const float* k = keys + (j * shape.kv_heads + g) * d;
      double dot = 0;
      for (int32_t i = 0; i < d; ++i) {
        dot += static_cast<double>(q[i]) * static_cast<double>(k[i]);
      }
      logits[j] = dot * scale;
      max_logit = std::max(max_logit, logits[j]);
    }
    double sum = 0;
    for (int64_t j = 0; j < tokens; ++j) {
      logits[j] = std::exp(logits[j] - max_logit);
      sum += logits[j];
    }
    Out* row = probs + static_cast<int64_t>(h) * tokens;
    for (int64_t j = 0; j < tokens; ++j) {
      row[j] = static_cast<Out>(logits[j] / sum);
    }
  }
}

}  // namespace

absl::Status Attention(const HeadShape& shape, std::span<const float> queries,
                       std::span<const float> keys, int64_t tokens,
                       std::span<float> probs) {
  if (absl::Status st = CheckAttentionSizes(shape, queries.size(), keys.size(),
                                            tokens, probs.size());
      !st.ok()) {
    return st;
  }
  std::vector<double> scratch;
  AttentionImpl(shape, queries.data(), keys.data(), tokens, probs.data(),
                scratch);
  return absl::OkStatus();
}

absl::Status AttentionF64(const HeadShape& shape,
                          std::span<const float> queries,
                          std::span<const float> keys, int64_t tokens,
                          std::span<double> probs) {
  if (absl::Status st = CheckAttentionSizes(shape, queries.size(), keys.size(),
                                            tokens, probs.size());
      !st.ok()) {
    return st;
  }
  std::vector<double> scratch;
  AttentionImpl(shape, queries.data(), keys.data(), tokens, probs.data(),
                scratch);
  return absl::OkStatus();
}

}  // namespace kvkeep::workers
