#include "services/workers/quality.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace kvkeep::workers {
namespace {

absl::Status CheckShape(const HeadShape& shape) {
  if (shape.kv_heads < 1 || shape.head_dim < 1 ||
      shape.query_heads < shape.kv_heads ||
      shape.query_heads % shape.kv_heads != 0) {
    return absl::InvalidArgumentError(
        "quality: query_heads must be a positive multiple of kv_heads");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<HeadQuality>> MeasureStep(
    const HeadShape& shape, std::span<const float> queries,
    const FullCache& full, std::span<const int64_t> resident, int32_t top_k) {
  if (absl::Status st = CheckShape(shape); !st.ok()) return st;
  const int64_t n = full.tokens;
  const size_t d = shape.head_dim;
  if (n < 1 || top_k < 1) {
    return absl::InvalidArgumentError("quality: tokens and top_k must be >= 1");
  }
  const size_t kv_size = static_cast<size_t>(n) * shape.kv_heads * d;
  if (queries.size() != shape.query_heads * d || full.keys.size() != kv_size ||
      full.values.size() != kv_size) {
    return absl::InvalidArgumentError(
        "quality: queries [query_heads][head_dim], keys and values "
        "[tokens][kv_heads][head_dim]");
  }
  std::vector<char> in_s(n, 0);
  for (int64_t p : resident) {
    if (p < 0 || p >= n || in_s[p]) {
      return absl::InvalidArgumentError(
          absl::StrCat("quality: resident position ", p,
                       " is out of [0, tokens) or repeated"));
    }
    in_s[p] = 1;
  }
  const bool all_resident = static_cast<int64_t>(resident.size()) == n;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const int64_t k = std::min<int64_t>(top_k, n);

  std::vector<HeadQuality> out(shape.query_heads);
  std::vector<double> logits(n), weights(n), o_full(d), o_s(d);
  std::vector<int64_t> order(n);
  for (int32_t h = 0; h < shape.query_heads; ++h) {
    const float* q = queries.data() + h * d;
    const int32_t g = h / shape.group();
    double max_all = -std::numeric_limits<double>::infinity();
    double max_s = max_all;
    for (int64_t j = 0; j < n; ++j) {
      const float* key = full.keys.data() + (j * shape.kv_heads + g) * d;
      double dot = 0;
      for (size_t i = 0; i < d; ++i) {
        dot += static_cast<double>(q[i]) * static_cast<double>(key[i]);
      }
      logits[j] = dot * scale;
      max_all = std::max(max_all, logits[j]);
      if (in_s[j]) max_s = std::max(max_s, logits[j]);
    }
    // Full softmax and output. The resident set's pass below repeats the
    // same arithmetic in the same order, so S = all gives exactly 0 error.
    double z = 0;
    std::fill(o_full.begin(), o_full.end(), 0.0);
    for (int64_t j = 0; j < n; ++j) {
      weights[j] = std::exp(logits[j] - max_all);
      z += weights[j];
      const float* v = full.values.data() + (j * shape.kv_heads + g) * d;
      for (size_t i = 0; i < d; ++i) o_full[i] += weights[j] * v[i];
    }
    for (size_t i = 0; i < d; ++i) o_full[i] /= z;

    HeadQuality& hq = out[h];
    double lost = 0;
    for (int64_t j = 0; j < n; ++j) {
      if (!in_s[j]) lost += weights[j] / z;
    }
    hq.attention_loss = lost;

    std::iota(order.begin(), order.end(), int64_t{0});
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int64_t a, int64_t b) {
                        if (logits[a] != logits[b])
                          return logits[a] > logits[b];
                        return a < b;
                      });
    int64_t hits = 0;
    for (int64_t r = 0; r < k; ++r) hits += in_s[order[r]];
    hq.top_recall = static_cast<double>(hits) / static_cast<double>(k);

    std::fill(o_s.begin(), o_s.end(), 0.0);
    if (all_resident) {
      o_s = o_full;
    } else if (!resident.empty()) {
      double z_s = 0;
      for (int64_t j = 0; j < n; ++j) {
        if (!in_s[j]) continue;
        const double w = std::exp(logits[j] - max_s);
        z_s += w;
        const float* v = full.values.data() + (j * shape.kv_heads + g) * d;
        for (size_t i = 0; i < d; ++i) o_s[i] += w * v[i];
      }
      for (size_t i = 0; i < d; ++i) o_s[i] /= z_s;
    }
    double diff2 = 0, norm2 = 0;
    for (size_t i = 0; i < d; ++i) {
      diff2 += (o_full[i] - o_s[i]) * (o_full[i] - o_s[i]);
      norm2 += o_full[i] * o_full[i];
    }
    if (norm2 > 0) {
      hq.output_error = std::sqrt(diff2 / norm2);
    } else {
      hq.output_error =
          diff2 > 0 ? std::numeric_limits<double>::infinity() : 0.0;
    }
  }
  return out;
}

std::vector<bool> Survives(std::span<const int64_t> positions,
                           std::span<const int64_t> resident) {
  std::vector<int64_t> sorted(resident.begin(), resident.end());
  std::sort(sorted.begin(), sorted.end());
  std::vector<bool> out;
  out.reserve(positions.size());
  for (int64_t p : positions) {
    out.push_back(std::binary_search(sorted.begin(), sorted.end(), p));
  }
  return out;
}

double NearestRankPercentile(std::span<const double> samples, double q) {
  if (samples.empty()) return 0.0;
  std::vector<double> sorted(samples.begin(), samples.end());
  const double n = static_cast<double>(sorted.size());
  int64_t rank = static_cast<int64_t>(std::ceil(q * n));  // 1-based
  rank = std::clamp<int64_t>(rank, 1, static_cast<int64_t>(sorted.size()));
  std::nth_element(sorted.begin(), sorted.begin() + (rank - 1), sorted.end());
  return sorted[rank - 1];
}

Distribution Summarize(std::span<const double> samples) {
  Distribution d;
  if (samples.empty()) return d;
  d.count = static_cast<int64_t>(samples.size());
  double sum = 0;
  d.max = -std::numeric_limits<double>::infinity();
  d.min = std::numeric_limits<double>::infinity();
  for (double x : samples) {
    sum += x;
    d.max = std::max(d.max, x);
    d.min = std::min(d.min, x);
  }
  d.mean = sum / static_cast<double>(d.count);
  d.p95 = NearestRankPercentile(samples, 0.95);
  return d;
}

void QualityAggregator::Add(const HeadQuality& q) {
  loss_.push_back(q.attention_loss);
  recall_.push_back(q.top_recall);
  error_.push_back(q.output_error);
}

void QualityAggregator::Add(std::span<const HeadQuality> qs) {
  for (const HeadQuality& q : qs) Add(q);
}

absl::Status AccumulateAttention(const HeadShape& shape,
                                 std::span<const float> queries,
                                 std::span<const float> keys, int64_t tokens,
                                 std::span<double> mass) {
  if (tokens < 0 || mass.size() < static_cast<size_t>(tokens)) {
    return absl::InvalidArgumentError(
        "AccumulateAttention: mass must hold `tokens` entries");
  }
  std::vector<double> probs(static_cast<size_t>(tokens) *
                            std::max(shape.query_heads, 0));
  if (absl::Status st = AttentionF64(shape, queries, keys, tokens, probs);
      !st.ok()) {
    return st;
  }
  for (int32_t h = 0; h < shape.query_heads; ++h) {
    const double* row = probs.data() + static_cast<int64_t>(h) * tokens;
    for (int64_t j = 0; j < tokens; ++j) mass[j] += row[j];
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<double>> FutureAttentionMass(
    const Workload& workload, int32_t layer, int64_t from_token) {
  const int64_t total = workload.total_tokens();
  if (from_token < 0) from_token = workload.spec().prompt_tokens;
  if (from_token > total) {
    return absl::InvalidArgumentError("FutureAttentionMass: from_token");
  }
  absl::StatusOr<LayerStream> stream = workload.Materialize(layer, total);
  if (!stream.ok()) return stream.status();
  const HeadShape shape = workload.shape();
  const size_t qn = static_cast<size_t>(shape.query_heads) * shape.head_dim;
  const size_t kn = static_cast<size_t>(shape.kv_heads) * shape.head_dim;
  std::vector<double> mass(total, 0.0);
  for (int64_t t = from_token; t < total; ++t) {
    const std::span<const float> q =
        std::span<const float>(stream->q).subspan(t * qn, qn);
    const std::span<const float> k =
        std::span<const float>(stream->k).subspan(0, (t + 1) * kn);
    if (absl::Status st = AccumulateAttention(shape, q, k, t + 1, mass);
        !st.ok()) {
      return st;
    }
  }
  return mass;
}

namespace {

// a ranks above b: more mass, ties to the lower position.
bool RanksAbove(std::span<const double> mass, int64_t a, int64_t b) {
  if (mass[a] != mass[b]) return mass[a] > mass[b];
  return a < b;
}

}  // namespace

std::vector<int64_t> TopByMass(std::span<const double> mass, int64_t seen,
                               int64_t budget) {
  seen = std::clamp<int64_t>(seen, 0, static_cast<int64_t>(mass.size()));
  std::vector<int64_t> order(seen);
  std::iota(order.begin(), order.end(), int64_t{0});
  const int64_t keep = std::clamp<int64_t>(budget, 0, seen);
  std::partial_sort(
      order.begin(), order.begin() + keep, order.end(),
      [&](int64_t a, int64_t b) { return RanksAbove(mass, a, b); });
  order.resize(keep);
  std::sort(order.begin(), order.end());
  return order;
}

OracleCache::OracleCache(std::vector<double> future_mass, int64_t budget)
    : remaining_(std::move(future_mass)),
      budget_(std::max<int64_t>(budget, 1)) {
  resident_.reserve(budget_ + 1);
}

int64_t OracleCache::Admit() {
  if (arrived_ >= static_cast<int64_t>(remaining_.size())) return -1;
  resident_.push_back(arrived_++);
  if (static_cast<int64_t>(resident_.size()) <= budget_) return -1;
  // The lowest-ranked resident token: least remaining mass, ties to the
  // higher position.
  size_t worst = 0;
  for (size_t i = 1; i < resident_.size(); ++i) {
    if (RanksAbove(remaining_, resident_[worst], resident_[i])) worst = i;
  }
  const int64_t evicted = resident_[worst];
  resident_[worst] = resident_.back();
  resident_.pop_back();
  return evicted;
}

absl::Status OracleCache::Consume(std::span<const double> step_mass) {
  if (static_cast<int64_t>(step_mass.size()) > arrived_) {
    return absl::InvalidArgumentError(
        absl::StrCat("OracleCache::Consume: ", step_mass.size(),
                     " entries but only ", arrived_, " tokens arrived"));
  }
  for (size_t j = 0; j < step_mass.size(); ++j) remaining_[j] -= step_mass[j];
  return absl::OkStatus();
}

std::vector<int64_t> OracleCache::Resident() const {
  std::vector<int64_t> out = resident_;
  std::sort(out.begin(), out.end());
  return out;
}

double BestPossibleLoss(std::span<const double> head_summed,
                        int32_t query_heads, int64_t budget) {
  std::vector<double> sorted(head_summed.begin(), head_summed.end());
  const int64_t keep =
      std::clamp<int64_t>(budget, 0, static_cast<int64_t>(sorted.size()));
  std::partial_sort(sorted.begin(), sorted.begin() + keep, sorted.end(),
                    std::greater<double>());
  double kept = 0;
  for (int64_t i = 0; i < keep; ++i) kept += sorted[i];
  return 1.0 - kept / query_heads;
}

}  // namespace kvkeep::workers
