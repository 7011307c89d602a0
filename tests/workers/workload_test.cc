// Tests of services/workers/workload.h: the generator is deterministic, and
// every knob produces the statistic docs/workloads.md promises, measured with
// the real attention (softmax over the generated Q and K).
#include "services/workers/workload.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"

namespace kvkeep::workers {
namespace {

Workload Make(const WorkloadSpec& spec) {
  absl::StatusOr<Workload> w = Workload::Create(spec);
  EXPECT_TRUE(w.ok()) << w.status();
  return *std::move(w);
}

// The full-cache attention of every query token t in [from, total) of one
// layer over keys [0, t]: rows[t - from] is [query_heads][t + 1].
struct LayerAttention {
  int64_t from = 0;
  int32_t query_heads = 0;
  std::vector<std::vector<double>> rows;
  // The probability query head h of token t puts on key j.
  double P(int64_t t, int32_t h, int64_t j) const {
    if (t < from || j < 0 || j > t || h < 0 || h >= query_heads) {
      ADD_FAILURE() << "no attention of (t=" << t << ", h=" << h << ") on key "
                    << j;
      return 0;
    }
    return rows[t - from][static_cast<size_t>(h) * (t + 1) + j];
  }
};

LayerAttention AttendAll(const Workload& w, int32_t layer, int64_t from = 0) {
  const int64_t total = w.total_tokens();
  absl::StatusOr<LayerStream> s = w.Materialize(layer, total);
  EXPECT_TRUE(s.ok()) << s.status();
  const HeadShape shape = w.shape();
  const size_t qn = static_cast<size_t>(shape.query_heads) * shape.head_dim;
  const size_t kn = static_cast<size_t>(shape.kv_heads) * shape.head_dim;
  LayerAttention out;
  out.from = from;
  out.query_heads = shape.query_heads;
  for (int64_t t = from; t < total; ++t) {
    std::vector<double> probs(static_cast<size_t>(shape.query_heads) * (t + 1));
    const absl::Status st = AttentionF64(
        shape, std::span<const float>(s->q).subspan(t * qn, qn),
        std::span<const float>(s->k).subspan(0, (t + 1) * kn), t + 1, probs);
    EXPECT_TRUE(st.ok()) << st;
    out.rows.push_back(std::move(probs));
  }
  return out;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// --- Names, presets, validation --------------------------------------------

TEST(WorkloadSpecTest, FamilyNamesRoundTrip) {
  EXPECT_EQ(AllFamilies().size(), 7u);
  for (WorkloadFamily f : AllFamilies()) {
    absl::StatusOr<WorkloadFamily> parsed = ParseFamily(FamilyName(f));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, f);
    EXPECT_EQ(DefaultSpec(f).family, f);
  }
  EXPECT_EQ(ParseFamily("needle_once").value(), WorkloadFamily::kNeedleOnce);
  const absl::StatusOr<WorkloadFamily> bad = ParseFamily("needles");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("needle_repeated"), std::string::npos);
}

TEST(WorkloadSpecTest, EveryPresetIsValid) {
  for (WorkloadFamily f : AllFamilies()) {
    EXPECT_TRUE(ValidateSpec(DefaultSpec(f)).ok()) << FamilyName(f);
    EXPECT_TRUE(Workload::Create(DefaultSpec(f)).ok()) << FamilyName(f);
  }
}

TEST(WorkloadSpecTest, RejectsBadKnobs) {
  auto rejected = [](auto mutate) {
    WorkloadSpec s = DefaultSpec(WorkloadFamily::kMixed);
    mutate(s);
    const absl::Status st = ValidateSpec(s);
    return st.code() == absl::StatusCode::kInvalidArgument &&
           Workload::Create(s).status().code() ==
               absl::StatusCode::kInvalidArgument;
  };
  EXPECT_TRUE(rejected([](WorkloadSpec& s) { s.query_heads = 3; }));
  EXPECT_TRUE(rejected([](WorkloadSpec& s) { s.kv_heads = 0; }));
  EXPECT_TRUE(rejected([](WorkloadSpec& s) { s.head_dim = 2; }));
  EXPECT_TRUE(rejected([](WorkloadSpec& s) { s.prompt_tokens = 0; }));
  EXPECT_TRUE(rejected([](WorkloadSpec& s) { s.sink_share = 0; }));
  EXPECT_TRUE(rejected([](WorkloadSpec& s) { s.sink_tokens = 0; }));
  EXPECT_TRUE(rejected([](WorkloadSpec& s) { s.sink_share = 0.97; }));
  EXPECT_TRUE(rejected([](WorkloadSpec& s) { s.heavy_hitter_tail = 1.0; }));
  EXPECT_TRUE(rejected([](WorkloadSpec& s) { s.rope_base = 1.0; }));
  EXPECT_TRUE(rejected([](WorkloadSpec& s) { s.rotary_fraction = 0; }));
  EXPECT_TRUE(rejected([](WorkloadSpec& s) {
    s.needles = 1;
    s.needle_share = 0.7;  // + sink_share 0.3 leaves nothing for the rest
  }));
  EXPECT_TRUE(rejected([](WorkloadSpec& s) {
    s.needles = 40;  // 32 content dims cannot hold 42 directions
  }));
  EXPECT_TRUE(rejected([](WorkloadSpec& s) {
    s.needles = 1;
    s.local_head_fraction = 1.0;  // nobody would ask
  }));
  EXPECT_TRUE(rejected([](WorkloadSpec& s) {
    s.needles = 1;
    s.needle_period = 0;
    s.needle_question_step = s.decode_steps;
  }));
  EXPECT_TRUE(rejected([](WorkloadSpec& s) {
    s.needles = 1;
    s.needle_period = 0;
    s.decode_steps = 0;
  }));
}

TEST(WorkloadTest, FillChecksItsArguments) {
  const Workload w = Make(DefaultSpec(WorkloadFamily::kMixed));
  const HeadShape sh = w.shape();
  std::vector<float> q(sh.query_heads * sh.head_dim);
  std::vector<float> k(sh.kv_heads * sh.head_dim), v(k.size());
  EXPECT_TRUE(w.Fill(0, 0, q, k, v).ok());
  EXPECT_TRUE(w.Fill(w.total_tokens() - 1, 1, q, k, v).ok());
  EXPECT_EQ(w.Fill(w.total_tokens(), 0, q, k, v).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(w.Fill(-1, 0, q, k, v).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(w.Fill(0, 2, q, k, v).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(w.Fill(0, 0, k, k, v).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(w.Materialize(0, w.total_tokens() + 1).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// --- Determinism -------------------------------------------------------------

TEST(WorkloadTest, SameSpecGivesBitIdenticalTokensInAnyOrder) {
  WorkloadSpec spec = DefaultSpec(WorkloadFamily::kHeadTypes);
  spec.seed = 77;
  const Workload a = Make(spec);
  const Workload b = Make(spec);
  // b is read backwards, a forwards: random access gives the same vectors.
  std::vector<TokenVectors> forward;
  const std::vector<int64_t> ts = {0, 1, 5, 255, 256, 300, 511, 512, 575};
  for (int64_t t : ts) forward.push_back(a.Token(t, 1).value());
  for (size_t i = ts.size(); i-- > 0;) {
    const TokenVectors tb = b.Token(ts[i], 1).value();
    EXPECT_TRUE(SameBits(forward[i].q, tb.q)) << "t=" << ts[i];
    EXPECT_TRUE(SameBits(forward[i].k, tb.k)) << "t=" << ts[i];
    EXPECT_TRUE(SameBits(forward[i].v, tb.v)) << "t=" << ts[i];
  }
  // Materialize is the same stream.
  const LayerStream s = a.Materialize(1, a.total_tokens()).value();
  const size_t qn = static_cast<size_t>(spec.query_heads) * spec.head_dim;
  for (size_t i = 0; i < ts.size(); ++i) {
    const std::vector<float> row(s.q.begin() + ts[i] * qn,
                                 s.q.begin() + (ts[i] + 1) * qn);
    EXPECT_TRUE(SameBits(row, forward[i].q));
  }
}

TEST(WorkloadTest, AnotherSeedOrLayerDiffers) {
  WorkloadSpec spec = DefaultSpec(WorkloadFamily::kMixed);
  const Workload a = Make(spec);
  spec.seed += 1;
  const Workload b = Make(spec);
  for (int64_t t : {0, 3, 100}) {
    const TokenVectors ta = a.Token(t, 0).value();
    const TokenVectors tb = b.Token(t, 0).value();
    EXPECT_FALSE(SameBits(ta.q, tb.q));
    EXPECT_FALSE(SameBits(ta.v, tb.v));
    EXPECT_FALSE(SameBits(ta.k, tb.k));
    EXPECT_FALSE(SameBits(ta.v, a.Token(t, 1).value().v));
  }
}

// Golden values: a few elements of a few vectors, as bit patterns, recorded
// from this implementation (the same with GCC 12 and Clang 14, at -O0 and at
// -O3 -march=native). They pin the stream across compilers
// and machines (the generator promises bit-identical floats); if a deliberate
// change to the generator moves them, update them with the change.
TEST(WorkloadTest, GoldenBits) {
  WorkloadSpec spec = DefaultSpec(WorkloadFamily::kHeadTypes);
  spec.seed = 20240601;
  const Workload w = Make(spec);
  const TokenVectors t0 = w.Token(0, 0).value();
  const TokenVectors t1 = w.Token(300, 1).value();
  const TokenVectors t2 = w.Token(530, 0).value();
  const std::vector<uint32_t> got = {
      std::bit_cast<uint32_t>(t0.q[0]),  std::bit_cast<uint32_t>(t0.k[40]),
      std::bit_cast<uint32_t>(t0.v[3]),  std::bit_cast<uint32_t>(t1.q[7]),
      std::bit_cast<uint32_t>(t1.q[50]), std::bit_cast<uint32_t>(t1.k[33]),
      std::bit_cast<uint32_t>(t1.v[64]), std::bit_cast<uint32_t>(t2.q[200]),
      std::bit_cast<uint32_t>(t2.k[1]),  std::bit_cast<uint32_t>(t2.k[127]),
  };
  const std::vector<uint32_t> want = {
      3210955192, 1080161377, 3214265747, 3204917457, 3221369852,
      3212871402, 1056808530, 3212044848, 1063608526, 3210980149,
  };
  EXPECT_EQ(got, want);
}

// --- RoPE and locality
// --------------------------------------------------------

// Without noise or content, each logit is the locality term alone:
// B * c(t - j), which depends on positions only through their distance —
// the defining property of rotary embeddings.
TEST(WorkloadTest, RopeLogitsDependOnDistanceOnly) {
  WorkloadSpec spec = DefaultSpec(WorkloadFamily::kLocality);
  spec.noise_logit_std = 0;
  spec.num_layers = 1;
  spec.prompt_tokens = 300;
  spec.decode_steps = 0;
  const Workload w = Make(spec);
  const HeadShape sh = w.shape();
  const LayerStream s = w.Materialize(0, 300).value();
  const double scale = 1.0 / std::sqrt(static_cast<double>(sh.head_dim));
  for (int64_t t : {0, 17, 150, 299}) {
    for (int64_t j : {int64_t{0}, t / 2, t}) {
      for (int32_t h = 0; h < sh.query_heads; ++h) {
        const float* q = &s.q[(t * sh.query_heads + h) * sh.head_dim];
        const float* k = &s.k[(j * sh.kv_heads + h / sh.group()) * sh.head_dim];
        double dot = 0;
        for (int32_t i = 0; i < sh.head_dim; ++i) dot += q[i] * k[i];
        EXPECT_NEAR(dot * scale, spec.locality * w.LocalityProfile(t - j), 2e-4)
            << "t=" << t << " j=" << j;
      }
    }
  }
  EXPECT_DOUBLE_EQ(w.LocalityProfile(0), 1.0);
  // c is mean cos(dist * base^(-2i/rotary)) over the pairs.
  const int32_t pairs = w.rotary_dims() / 2;
  for (int64_t dist : {1, 10, 1000}) {
    double want = 0;
    for (int32_t i = 0; i < pairs; ++i) {
      want +=
          std::cos(dist * std::pow(spec.rope_base, -2.0 * i / w.rotary_dims()));
    }
    EXPECT_NEAR(w.LocalityProfile(dist), want / pairs, 1e-12);
  }
}

TEST(WorkloadTest, LocalityMeanAttentionDecreasesWithDistance) {
  WorkloadSpec spec = DefaultSpec(WorkloadFamily::kLocality);
  spec.num_layers = 1;
  const Workload w = Make(spec);
  const LayerAttention att = AttendAll(w, 0, /*from=*/256);
  // Mean attention per key in distance bins [0,1) [1,4) [4,16) [16,64)
  // [64,256) [256, ...).
  const std::vector<int64_t> edges = {0, 1, 4, 16, 64, 256, 1 << 20};
  std::vector<double> sum(edges.size() - 1, 0), count(edges.size() - 1, 0);
  for (int64_t t = att.from; t < w.total_tokens(); ++t) {
    for (int32_t h = 0; h < att.query_heads; ++h) {
      for (int64_t j = 0; j <= t; ++j) {
        const int64_t dist = t - j;
        size_t b = 0;
        while (dist >= edges[b + 1]) ++b;
        sum[b] += att.P(t, h, j);
        count[b] += 1;
      }
    }
  }
  std::vector<double> mean(sum.size());
  for (size_t b = 0; b < sum.size(); ++b) mean[b] = sum[b] / count[b];
  for (size_t b = 1; b < mean.size(); ++b) {
    EXPECT_LT(mean[b], mean[b - 1]) << "bin " << b;
  }
  EXPECT_GT(mean[0] / mean.back(), 100.0);
}

// --- Sinks -------------------------------------------------------------------

// The mean over queries (t >= 32, all heads of layer 0) of the sinks'
// total share is sink_share within 0.02.
double MeanSinkShare(WorkloadSpec spec, bool local_heads) {
  spec.num_layers = 1;
  const Workload w = Make(spec);
  double sum = 0, n = 0;
  for (int32_t layer = 0; layer < spec.num_layers; ++layer) {
    const LayerAttention att = AttendAll(w, layer, /*from=*/32);
    for (int64_t t = att.from; t < w.total_tokens(); ++t) {
      for (int32_t h = 0; h < spec.query_heads; ++h) {
        const bool local =
            w.kv_head_type(layer, h / w.shape().group()) == HeadType::kLocal;
        if (local != local_heads) continue;
        for (int64_t j = 0; j < spec.sink_tokens; ++j) sum += att.P(t, h, j);
        n += 1;
      }
    }
  }
  EXPECT_GT(n, 0);
  return sum / n;
}

TEST(WorkloadTest, SinksGetTheirShare) {
  WorkloadSpec spec = DefaultSpec(WorkloadFamily::kSinks);
  EXPECT_NEAR(MeanSinkShare(spec, false), spec.sink_share, 0.02);
  spec.sink_tokens = 4;
  spec.sink_share = 0.5;
  spec.locality = 8;
  EXPECT_NEAR(MeanSinkShare(spec, false), spec.sink_share, 0.02);
  // With heavy hitters and local heads (strong locality) as well.
  spec = DefaultSpec(WorkloadFamily::kHeadTypes);
  EXPECT_NEAR(MeanSinkShare(spec, false), spec.sink_share, 0.02);
  EXPECT_NEAR(MeanSinkShare(spec, true), spec.sink_share, 0.02);
  spec = DefaultSpec(WorkloadFamily::kMixed);
  EXPECT_NEAR(MeanSinkShare(spec, false), spec.sink_share, 0.02);
}

TEST(WorkloadTest, SinkKeysAreOnlyTheFirst) {
  const Workload w = Make(DefaultSpec(WorkloadFamily::kSinks));
  EXPECT_TRUE(w.IsSink(0));
  EXPECT_FALSE(w.IsSink(1));
  // Without sinks the first key is an ordinary one: far below 0.4.
  WorkloadSpec spec = DefaultSpec(WorkloadFamily::kLocality);
  spec.num_layers = 1;
  const Workload plain = Make(spec);
  const LayerAttention att = AttendAll(plain, 0, /*from=*/64);
  double sum = 0, n = 0;
  for (int64_t t = att.from; t < plain.total_tokens(); ++t) {
    for (int32_t h = 0; h < att.query_heads; ++h, n += 1) sum += att.P(t, h, 0);
  }
  EXPECT_LT(sum / n, 0.02);
}

// --- Heavy hitters
// -------------------------------------------------------------

TEST(WorkloadTest, HeavyHittersGetFarMoreThanAverage) {
  const WorkloadSpec spec = DefaultSpec(WorkloadFamily::kHeavyHitters);
  const Workload w = Make(spec);
  for (int32_t layer = 0; layer < spec.num_layers; ++layer) {
    int64_t hh = 0;
    for (int64_t j = 0; j < w.total_tokens(); ++j)
      hh += w.IsHeavyHitter(layer, j);
    const double frac = static_cast<double>(hh) / w.total_tokens();
    EXPECT_GT(frac, spec.heavy_hitter_fraction / 2);
    EXPECT_LT(frac, spec.heavy_hitter_fraction * 2);

    const LayerAttention att = AttendAll(w, layer, /*from=*/128);
    double hh_sum = 0, hh_n = 0, other_sum = 0, other_n = 0;
    for (int64_t t = att.from; t < w.total_tokens(); ++t) {
      for (int32_t h = 0; h < att.query_heads; ++h) {
        for (int64_t j = 0; j <= t; ++j) {
          if (w.IsHeavyHitter(layer, j)) {
            hh_sum += att.P(t, h, j);
            hh_n += 1;
          } else {
            other_sum += att.P(t, h, j);
            other_n += 1;
          }
        }
      }
    }
    // A heavy hitter's bonus averages e^3 * E[e^(0.5 E)] = 40 in weight.
    const double ratio = (hh_sum / hh_n) / (other_sum / other_n);
    EXPECT_GT(ratio, 10.0) << "layer " << layer;
    // ~2% of the keys take a large part of all attention.
    const double queries = (w.total_tokens() - att.from) * att.query_heads;
    EXPECT_GT(hh_sum / queries, 0.15) << "layer " << layer;
  }
}

// --- Needles
// -------------------------------------------------------------------

// Mean share of needle n over the retrieval heads' queries of token t.
double NeedleShare(const Workload& w, const LayerAttention& att, int32_t layer,
                   int64_t t, int64_t needle_pos, HeadType type) {
  double sum = 0, n = 0;
  for (int32_t h = 0; h < att.query_heads; ++h) {
    if (w.kv_head_type(layer, h / w.shape().group()) != type) continue;
    sum += att.P(t, h, needle_pos);
    n += 1;
  }
  return n > 0 ? sum / n : 0;
}

TEST(WorkloadTest, NeedleOnceIsAttendedOnlyByItsQuestion) {
  const WorkloadSpec spec = DefaultSpec(WorkloadFamily::kNeedleOnce);
  const Workload w = Make(spec);
  ASSERT_EQ(w.needles().size(), 1u);
  const Needle& needle = w.needles()[0];
  EXPECT_EQ(needle.position, spec.prompt_tokens / 2);
  ASSERT_EQ(needle.query_tokens.size(), 1u);
  const int64_t question = needle.query_tokens[0];
  EXPECT_EQ(question, spec.prompt_tokens + spec.decode_steps * 3 / 4);
  EXPECT_EQ(w.NeedlesAskedAt(question), std::vector<int32_t>{0});
  EXPECT_TRUE(w.NeedlesAskedAt(question - 1).empty());
  for (int32_t layer = 0; layer < spec.num_layers; ++layer) {
    const LayerAttention att = AttendAll(w, layer, needle.position);
    const double asked = NeedleShare(w, att, layer, question, needle.position,
                                     HeadType::kRetrieval);
    EXPECT_NEAR(asked, spec.needle_share, 0.06) << "layer " << layer;
    // Every other query treats it as an ordinary key: from 16 tokens on
    // (before, the next tokens attend it by locality alone) it gets what
    // its 32 neighbours get.
    double needle_sum = 0, neighbour_sum = 0, needle_max = 0, n = 0;
    for (int64_t t = needle.position + 16; t < w.total_tokens(); ++t) {
      if (t == question) continue;
      for (int32_t h = 0; h < att.query_heads; ++h) {
        needle_sum += att.P(t, h, needle.position);
        needle_max = std::max(needle_max, att.P(t, h, needle.position));
        for (int64_t j = needle.position - 16; j <= needle.position + 16; ++j) {
          if (j != needle.position) neighbour_sum += att.P(t, h, j) / 32;
        }
        n += 1;
      }
    }
    EXPECT_LT(needle_sum / n, 0.005) << "layer " << layer;
    EXPECT_LT(needle_sum, 2 * neighbour_sum) << "layer " << layer;
    EXPECT_GT(needle_sum, neighbour_sum / 2) << "layer " << layer;
    EXPECT_LT(needle_max, asked / 2) << "layer " << layer;
  }
}

TEST(WorkloadTest, NeedleRepeatedIsAttendedAtEveryPeriod) {
  const WorkloadSpec spec = DefaultSpec(WorkloadFamily::kNeedleRepeated);
  const Workload w = Make(spec);
  ASSERT_EQ(w.needles().size(), 1u);
  const Needle& needle = w.needles()[0];
  // Asked by prompt and decode tokens alike, every needle_period tokens.
  ASSERT_FALSE(needle.query_tokens.empty());
  EXPECT_EQ(needle.query_tokens.front(), needle.position + spec.needle_period);
  for (size_t i = 1; i < needle.query_tokens.size(); ++i) {
    EXPECT_EQ(needle.query_tokens[i] - needle.query_tokens[i - 1],
              spec.needle_period);
  }
  EXPECT_GE(needle.query_tokens.back() + spec.needle_period, w.total_tokens());
  EXPECT_LT(needle.query_tokens.front(), spec.prompt_tokens);

  const int32_t layer = 1;
  const LayerAttention att = AttendAll(w, layer, needle.position);
  double asked_sum = 0, asked_min = 1, asked_n = 0, other_sum = 0, other_n = 0;
  for (int64_t t = needle.position + 1; t < w.total_tokens(); ++t) {
    const double share =
        NeedleShare(w, att, layer, t, needle.position, HeadType::kRetrieval);
    if (!w.NeedlesAskedAt(t).empty()) {
      asked_sum += share;
      asked_min = std::min(asked_min, share);
      asked_n += 1;
    } else {
      other_sum += share;
      other_n += 1;
    }
  }
  EXPECT_EQ(asked_n, static_cast<double>(needle.query_tokens.size()));
  EXPECT_NEAR(asked_sum / asked_n, spec.needle_share, 0.02);
  EXPECT_GT(asked_min, 0.15);
  EXPECT_LT(other_sum / other_n, 0.005);
}

// What the families are for, in the terms of the scores a policy keeps: the
// attention a token accumulated before a step (H2O's score) against the
// attention it will receive (the oracle's). A needle asked once ranks low by
// the first and high by the second; a needle asked repeatedly ranks high by
// both.
int64_t RankOf(const std::vector<double>& score, int64_t pos) {
  int64_t above = 0;
  for (double s : score) above += s > score[pos];
  return above;  // 0 = the highest
}

TEST(WorkloadTest, NeedleFamiliesSeparateAccumulatedFromFutureAttention) {
  for (WorkloadFamily f :
       {WorkloadFamily::kNeedleOnce, WorkloadFamily::kNeedleRepeated}) {
    WorkloadSpec spec = DefaultSpec(f);
    spec.num_layers = 1;
    const Workload w = Make(spec);
    const LayerAttention att = AttendAll(w, 0);
    const int64_t total = w.total_tokens();
    const int64_t prompt = spec.prompt_tokens;
    const int64_t pos = w.needles()[0].position;
    // Accumulated over the prompt; future = over the decode.
    std::vector<double> past(prompt, 0.0), future(prompt, 0.0);
    for (int64_t t = 0; t < total; ++t) {
      for (int32_t h = 0; h < att.query_heads; ++h) {
        for (int64_t j = 0; j < std::min(t + 1, prompt); ++j) {
          (t < prompt ? past : future)[j] += att.P(t, h, j);
        }
      }
    }
    const int64_t budget = prompt / 5;  // 20%
    if (f == WorkloadFamily::kNeedleOnce) {
      EXPECT_GT(RankOf(past, pos), budget) << FamilyName(f);
    } else {
      EXPECT_LT(RankOf(past, pos), 5) << FamilyName(f);
    }
    EXPECT_LT(RankOf(future, pos), 5) << FamilyName(f);
  }
}

// --- Head types and GQA
// -------------------------------------------------------

TEST(WorkloadTest, LocalHeadsAttendRecentRetrievalHeadsAttendNeedles) {
  WorkloadSpec spec = DefaultSpec(WorkloadFamily::kHeadTypes);
  spec.kv_heads = 4;
  spec.query_heads = 8;
  const Workload w = Make(spec);
  for (int32_t layer = 0; layer < spec.num_layers; ++layer) {
    int32_t local = 0;
    for (int32_t g = 0; g < spec.kv_heads; ++g) {
      local += w.kv_head_type(layer, g) == HeadType::kLocal;
    }
    EXPECT_EQ(local, 2);
    const Needle& needle = w.needles()[0];
    const LayerAttention att = AttendAll(w, layer, /*from=*/128);
    // Mass on the 16 most recent tokens, per head type.
    double recent[2] = {0, 0}, n[2] = {0, 0};
    for (int64_t t = att.from; t < w.total_tokens(); ++t) {
      for (int32_t h = 0; h < att.query_heads; ++h) {
        const int type =
            w.kv_head_type(layer, h / w.shape().group()) == HeadType::kLocal;
        for (int64_t j = t - 15; j <= t; ++j) recent[type] += att.P(t, h, j);
        n[type] += 1;
      }
    }
    // Of the 70% left by the sink, local heads put most on the last 16.
    EXPECT_GT(recent[1] / n[1], 0.5) << "layer " << layer;
    EXPECT_LT(recent[0] / n[0], 0.2) << "layer " << layer;
    // Local heads ignore the needle's questions; retrieval heads answer.
    double asked_local = 0, asked_retrieval = 0;
    int64_t asked = 0;
    for (int64_t t : needle.query_tokens) {
      if (t < att.from) continue;
      asked_local +=
          NeedleShare(w, att, layer, t, needle.position, HeadType::kLocal);
      asked_retrieval +=
          NeedleShare(w, att, layer, t, needle.position, HeadType::kRetrieval);
      ++asked;
    }
    ASSERT_GT(asked, 0);
    EXPECT_LT(asked_local / asked, 0.01);
    EXPECT_GT(asked_retrieval / asked, 0.35);
  }
}

// Every query head of a group behaves as its kv head's type says: at the
// needle's question all four query heads of a retrieval kv head find it, and
// none of a local one does.
TEST(WorkloadTest, GqaGroupsShareTheirKvHeadsBehaviour) {
  WorkloadSpec spec = DefaultSpec(WorkloadFamily::kNeedleOnce);
  spec.kv_heads = 2;
  spec.query_heads = 8;
  spec.local_head_fraction = 0.5;
  spec.num_layers = 1;
  const Workload w = Make(spec);
  const int64_t pos = w.needles()[0].position;
  const int64_t question = w.needles()[0].query_tokens[0];
  const LayerAttention att = AttendAll(w, 0, question);
  for (int32_t h = 0; h < spec.query_heads; ++h) {
    const HeadType type = w.kv_head_type(0, h / 4);
    if (type == HeadType::kRetrieval) {
      EXPECT_GT(att.P(question, h, pos), 0.1) << "query head " << h;
    } else {
      EXPECT_LT(att.P(question, h, pos), 0.01) << "query head " << h;
    }
  }
}

// --- The reference attention
// ----------------------------------------------------

TEST(AttentionTest, HandComputedTwoTokens) {
  // d = 4, scale 1/2: logits (2 * 2) / 2 = 2 and 0.
  const HeadShape shape{1, 1, 4};
  const std::vector<float> q = {2, 0, 0, 0};
  const std::vector<float> k = {2, 0, 0, 0, /**/ 0, 5, 0, 0};
  std::vector<float> p(2);
  ASSERT_TRUE(Attention(shape, q, k, 2, p).ok());
  const double e2 = std::exp(2.0);
  EXPECT_FLOAT_EQ(p[0], static_cast<float>(e2 / (e2 + 1)));
  EXPECT_FLOAT_EQ(p[1], static_cast<float>(1 / (e2 + 1)));
}

TEST(AttentionTest, QueryHeadReadsKvHeadOfItsGroup) {
  // 2 kv heads, 4 query heads: heads 0-1 read kv head 0, heads 2-3 kv head 1.
  const HeadShape shape{2, 4, 4};
  const std::vector<float> q = {4, 0, 0, 0, /**/ 0, 4, 0, 0,
                                4, 0, 0, 0, /**/ 0, 4, 0, 0};
  // Token 0: kv0 = e0, kv1 = e1. Token 1: kv0 = e1, kv1 = e0.
  const std::vector<float> k = {1, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 1, 0, 0, 0};
  std::vector<double> p(8);
  ASSERT_TRUE(AttentionF64(shape, q, k, 2, p).ok());
  const double hi = std::exp(2.0) / (std::exp(2.0) + 1);  // logit 4 / 2 = 2
  EXPECT_NEAR(p[0 * 2 + 0], hi, 1e-12);  // head 0 (e0) on kv0: token 0
  EXPECT_NEAR(p[1 * 2 + 1], hi, 1e-12);  // head 1 (e1) on kv0: token 1
  EXPECT_NEAR(p[2 * 2 + 1], hi, 1e-12);  // head 2 (e0) on kv1: token 1
  EXPECT_NEAR(p[3 * 2 + 0], hi, 1e-12);  // head 3 (e1) on kv1: token 0
  // Large logits do not overflow (max-subtracted).
  const std::vector<float> big = {1000, 0, 0, 0, 0, 1000, 0, 0,
                                  1000, 0, 0, 0, 0, 1000, 0, 0};
  ASSERT_TRUE(AttentionF64(shape, big, k, 2, p).ok());
  EXPECT_NEAR(p[0], 1.0, 1e-12);
  EXPECT_EQ(Attention(shape, q, k, 3, std::span<float>()).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvkeep::workers
