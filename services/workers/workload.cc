// The generator of workload.h: Workload::Create precomputes per-head
// directions and per-distance tables, step by step; Fill and its helpers
// then build each token's query, key and value from them. The spec's
// families and validation are in workload_spec.cc, the reference attention
// in reference_attention.cc, the deterministic math and PRNG in
// workload_math.h.
#include "services/workers/workload.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "services/workers/workload_geometry.h"
#include "services/workers/workload_math.h"

namespace kvkeep::workers {

using workload_internal::DetExp;
using workload_internal::DetLog;
using workload_internal::DetSinCos;
using workload_internal::FirstQuestionStep;
using workload_internal::Gaussians;
using workload_internal::kFirstNeedleDir;
using workload_internal::kHeavyHitterDir;
using workload_internal::kSinkDir;
using workload_internal::kTwoPi;
using workload_internal::LocalKvHeads;
using workload_internal::NeedlePosition;
using workload_internal::RotaryDims;
using workload_internal::SplitMix64;
using workload_internal::Stream;
using workload_internal::StreamKey;
using workload_internal::UniformAt;

namespace {

// The logit a content component is sized for; the key and the query split it
// evenly, so neither side's norm dwarfs the other's.
constexpr double kContentLogitScale = 8.0;

}  // namespace

// ---------------------------------------------------------------------------
// Creation

absl::StatusOr<Workload> Workload::Create(const WorkloadSpec& spec) {
  if (absl::Status st = ValidateSpec(spec); !st.ok()) return st;
  Workload w(spec);
  w.SizeComponents();
  w.BuildRopeTables();
  w.BuildHeadDirections();
  w.PlaceNeedles();
  w.DrawHeavyHitters();
  return w;
}

void Workload::SizeComponents() {
  const int32_t d = spec_.head_dim;
  const double sqrt_d = std::sqrt(static_cast<double>(d));
  rotary_dims_ = RotaryDims(spec_);
  content_dims_ = d - rotary_dims_;
  content_dirs_ = kFirstNeedleDir + spec_.needles;
  // Noise lives in the content dims less the content directions (m dims):
  // per element std sigma with sigma^4 m / d = noise_logit_std^2, so the
  // logit noise q_noise . k_noise / sqrt(d) has that standard deviation.
  const int32_t noise_dims = content_dims_ - content_dirs_;
  noise_elem_std_ = std::sqrt(spec_.noise_logit_std *
                              std::sqrt(static_cast<double>(d) / noise_dims));
  key_content_norm_ = std::sqrt(kContentLogitScale * sqrt_d);
  query_hh_norm_ = key_content_norm_;
  // q.k / sqrt(d) of the locality parts is amp^2 c / sqrt(d) = B c.
  amp_retrieval_ = std::sqrt(spec_.locality * sqrt_d);
  amp_local_ = std::sqrt(spec_.local_head_locality * sqrt_d);
  // It is independent from key to key, so the partition over many keys is
  // near its mean: E[e^noise] = e^(std^2 / 2) (Gaussian).
  log_noise_mgf_ = 0.5 * spec_.noise_logit_std * spec_.noise_logit_std;
}

void Workload::BuildRopeTables() {
  const int64_t total = total_tokens();
  const int32_t pairs = rotary_dims_ / 2;
  const double ln_base = DetLog(spec_.rope_base);
  theta_.resize(pairs);
  for (int32_t i = 0; i < pairs; ++i) {
    theta_[i] = DetExp(-(2.0 * i / rotary_dims_) * ln_base);
  }
  profile_.assign(total, 0.0);
  for (int64_t dist = 0; dist < total && pairs > 0; ++dist) {
    double sum = 0;
    for (int32_t i = 0; i < pairs; ++i) {
      double sn = 0, cs = 0;
      DetSinCos(static_cast<double>(dist) * theta_[i], &sn, &cs);
      sum += cs;
    }
    profile_[dist] = sum / pairs;
  }
  for (int type = 0; type < 2; ++type) {
    const double b = type == 0 ? spec_.locality : spec_.local_head_locality;
    std::vector<double>& sum = locality_sum_[type];
    std::vector<double>& sum2 = locality_sum2_[type];
    sum.assign(total + 1, 0.0);
    sum2.assign(total + 1, 0.0);
    for (int64_t dist = 0; dist < total; ++dist) {
      const double weight = DetExp(b * profile_[dist]);
      sum[dist + 1] = sum[dist] + weight;
      sum2[dist + 1] = sum2[dist] + weight * weight;
    }
  }
}

void Workload::BuildHeadDirections() {
  const int64_t heads = static_cast<int64_t>(spec_.num_layers) * spec_.kv_heads;
  const int32_t local = LocalKvHeads(spec_);
  local_.assign(heads, 0);
  locality_dir_.assign(heads * rotary_dims_, 0.0);
  content_dir_.assign(heads * content_dirs_ * content_dims_, 0.0);
  for (int32_t layer = 0; layer < spec_.num_layers; ++layer) {
    for (int32_t g = 0; g < spec_.kv_heads; ++g) {
      local_[HeadIndex(layer, g)] = (g + layer) % spec_.kv_heads < local;
      BuildLocalityDirection(layer, g);
      BuildContentDirections(layer, g);
    }
  }
}

void Workload::BuildLocalityDirection(int32_t layer, int32_t kv_head) {
  // Unit norm, the same energy in every rotary pair (so the logit is
  // B * mean_i cos(distance theta_i)), random phases.
  const int64_t hi = HeadIndex(layer, kv_head);
  const int32_t pairs = rotary_dims_ / 2;
  SplitMix64 phases(
      StreamKey(spec_.seed, Stream::kLocalityPhase, layer, kv_head, 0));
  for (int32_t i = 0; i < pairs; ++i) {
    double sn = 0, cs = 0;
    DetSinCos(kTwoPi * phases.Uniform(), &sn, &cs);
    const double norm = 1.0 / std::sqrt(static_cast<double>(pairs));
    locality_dir_[hi * rotary_dims_ + 2 * i] = cs * norm;
    locality_dir_[hi * rotary_dims_ + 2 * i + 1] = sn * norm;
  }
}

void Workload::BuildContentDirections(int32_t layer, int32_t kv_head) {
  // Gram-Schmidt on Gaussian vectors in the non-rotary dims (modified,
  // twice, for orthogonality to ~1e-16).
  const int64_t hi = HeadIndex(layer, kv_head);
  for (int32_t a = 0; a < content_dirs_; ++a) {
    double* dir = &content_dir_[(hi * content_dirs_ + a) * content_dims_];
    Gaussians(StreamKey(spec_.seed, Stream::kContentDir, layer, kv_head, a),
              dir, content_dims_);
    for (int pass = 0; pass < 2; ++pass) {
      for (int32_t b = 0; b < a; ++b) {
        const double* other = ContentDir(hi, b);
        double dot = 0;
        for (int32_t i = 0; i < content_dims_; ++i) dot += dir[i] * other[i];
        for (int32_t i = 0; i < content_dims_; ++i) dir[i] -= dot * other[i];
      }
    }
    double norm2 = 0;
    for (int32_t i = 0; i < content_dims_; ++i) norm2 += dir[i] * dir[i];
    const double inv = 1.0 / std::sqrt(norm2);
    for (int32_t i = 0; i < content_dims_; ++i) dir[i] *= inv;
  }
}

void Workload::PlaceNeedles() {
  const int64_t total = total_tokens();
  for (int32_t i = 0; i < spec_.needles; ++i) {
    Needle n;
    n.position = NeedlePosition(spec_, i);
    if (spec_.needle_period > 0) {
      for (int64_t t = n.position + spec_.needle_period; t < total;
           t += spec_.needle_period) {
        n.query_tokens.push_back(t);
      }
    } else {
      const int64_t first = FirstQuestionStep(spec_);
      const int64_t gap = (spec_.decode_steps - first) / spec_.needles;
      n.query_tokens.push_back(spec_.prompt_tokens + first + i * gap);
    }
    needles_.push_back(std::move(n));
  }
}

void Workload::DrawHeavyHitters() {
  // The heavy hitters of each layer (after the needles: a needle is never
  // one) and e^bonus - 1 per kv head, the excess weight they add to a
  // retrieval query's partition.
  const int64_t total = total_tokens();
  const double f = spec_.heavy_hitter_fraction;
  hh_positions_.resize(spec_.num_layers);
  hh_excess_.resize(spec_.num_layers);
  for (int32_t layer = 0; layer < spec_.num_layers && f > 0; ++layer) {
    for (int64_t j = 0; j < total; ++j) {
      if (!IsHeavyHitter(layer, j)) continue;
      hh_positions_[layer].push_back(j);
      for (int32_t g = 0; g < spec_.kv_heads; ++g) {
        hh_excess_[layer].push_back(DetExp(HeavyHitterBonus(layer, g, j)) -
                                    1.0);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Generation

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

}  // namespace kvkeep::workers
