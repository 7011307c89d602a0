// kvkeep-lm quant-error: what each quantised page format does to the real
// model's keys and values (docs/quantization.md). The first --max_tokens
// tokens of --text go through the model as one chunk on a float32 cache
// (keys after RoPE, as the store holds them); per layer, each format
// quantises that layer's K and V with the CPU twins (kernels/quantize.h)
// and reads them back, and attention over them is compared with float32's:
//   rel_err(K), rel_err(V): ||X - X'||_F / ||X||_F
//   rel_err(P): sum |P - P'| / sum P over the softmax rows of the queries
//   rel_err(O): ||P V - P' V'||_F / ||P V||_F
// (bench/quant_error_bench's definitions, there on synthetic data), for the
// real queries of --queries positions spread evenly over the text's second
// half, every query head, each attending causally to the tokens up to its
// own. Besides the stored formats (per-token groups of --group_size along
// head_dim), "kivi_int4" quantises keys per channel over groups of
// --group_size consecutive tokens (KIVI), the tokens after the last whole
// group kept in bf16 (its full-precision recent window), and values as int4
// does: the same bits per element as int4 for keys, on average.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "services/lm/contiguous_kv.h"
#include "services/lm/format_emulation.h"
#include "services/lm/lm_cli.h"

ABSL_DECLARE_FLAG(std::string, text);
ABSL_DECLARE_FLAG(int64_t, max_tokens);
ABSL_DECLARE_FLAG(bool, json);
ABSL_FLAG(int32_t, group_size, 32, "quant-error: elements per scale group");
ABSL_FLAG(int32_t, queries, 64,
          "quant-error: query positions (over the text's second half)");

namespace kvkeep::lm {
namespace {

// One layer's float32 keys and values ([n][kv_heads][head_dim]) and the
// queries of the measured positions ([queries][query_heads][head_dim]).
struct LayerData {
  std::vector<float> keys, values, queries;
};

struct Shape {
  int64_t n = 0;
  int32_t kv_heads = 0, query_heads = 0, head_dim = 0;
  std::vector<int64_t> query_positions;
  int64_t width() const { return int64_t{kv_heads} * head_dim; }
};

double RelErr(const std::vector<float>& x, const std::vector<float>& y) {
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    num += (double{x[i]} - y[i]) * (double{x[i]} - y[i]);
    den += double{x[i]} * x[i];
  }
  return den > 0 ? std::sqrt(num / den) : 0.0;
}

// Causal attention of the measured queries: probs [q][query_heads][n]
// (zero past the query's position), out [q][query_heads][head_dim].
void Attend(const Shape& s, const std::vector<float>& queries,
            const std::vector<float>& k, const std::vector<float>& v,
            std::vector<double>* probs, std::vector<double>* out) {
  const int32_t d = s.head_dim, group = s.query_heads / s.kv_heads;
  const int64_t rows = static_cast<int64_t>(s.query_positions.size());
  probs->assign(rows * s.query_heads * s.n, 0.0);
  out->assign(rows * s.query_heads * d, 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t last = s.query_positions[r];
    for (int32_t h = 0; h < s.query_heads; ++h) {
      const float* q = &queries[(r * s.query_heads + h) * d];
      double* p = &(*probs)[(r * s.query_heads + h) * s.n];
      const int32_t g = h / group;
      double mx = -1e300;
      for (int64_t t = 0; t <= last; ++t) {
        const float* key = &k[t * s.width() + int64_t{g} * d];
        double dot = 0;
        for (int32_t i = 0; i < d; ++i) dot += double{q[i]} * key[i];
        p[t] = dot * scale;
        mx = std::max(mx, p[t]);
      }
      double sum = 0;
      for (int64_t t = 0; t <= last; ++t) sum += (p[t] = std::exp(p[t] - mx));
      double* o = &(*out)[(r * s.query_heads + h) * d];
      for (int64_t t = 0; t <= last; ++t) {
        p[t] /= sum;
        const float* val = &v[t * s.width() + int64_t{g} * d];
        for (int32_t i = 0; i < d; ++i) o[i] += p[t] * val[i];
      }
    }
  }
}

struct Row {
  std::string format;
  int32_t layer = 0;
  double bits_k = 0, bits_v = 0, k = 0, v = 0, p = 0, o = 0;
};

absl::Status MeasureLayer(const Shape& s, int32_t layer, const LayerData& d,
                          int32_t group, std::vector<Row>* rows) {
  std::vector<double> p_ref, o_ref;
  Attend(s, d.queries, d.keys, d.values, &p_ref, &o_ref);
  const TokenBlock block{s.n, s.kv_heads, s.head_dim};
  struct Format {
    std::string name;
    DType dtype;
    bool kivi;
  };
  const std::string g = absl::StrCat("/g", group);
  for (const Format& f : {Format{"bf16", DType::kBF16, false},
                          Format{"fp8_e4m3" + g, DType::kFp8E4M3, false},
                          Format{"int8" + g, DType::kInt8, false},
                          Format{"int4" + g, DType::kInt4, false},
                          Format{"kivi_int4" + g, DType::kInt4, true}}) {
    Row row{f.name, layer};
    const std::vector<float> k =
        f.kivi ? ThroughPerChannel(block, 4, group, d.keys, &row.bits_k)
               : ThroughPerToken(block, f.dtype, group, d.keys, &row.bits_k);
    const std::vector<float> v =
        ThroughPerToken(block, f.dtype, group, d.values, &row.bits_v);
    if (k.empty() || v.empty()) {
      return absl::InternalError(absl::StrCat(
          "layer ", layer, ": ", f.name, " cannot hold the model's K or V"));
    }
    std::vector<double> p, o;
    Attend(s, d.queries, k, v, &p, &o);
    double dp = 0, sp = 0, dox = 0, so = 0;
    for (size_t i = 0; i < p.size(); ++i) {
      dp += std::fabs(p[i] - p_ref[i]);
      sp += p_ref[i];
    }
    for (size_t i = 0; i < o.size(); ++i) {
      dox += (o[i] - o_ref[i]) * (o[i] - o_ref[i]);
      so += o_ref[i] * o_ref[i];
    }
    row.k = RelErr(d.keys, k);
    row.v = RelErr(d.values, v);
    row.p = dp / sp;
    row.o = std::sqrt(dox / so);
    rows->push_back(row);
  }
  return absl::OkStatus();
}

// The text's tokens through the model in one chunk: every layer's K, V and
// the measured positions' queries.
absl::StatusOr<std::vector<LayerData>> RunModel(const LlamaModel& model,
                                                const std::vector<int32_t>& ids,
                                                const Shape& s) {
  ContiguousKv cache(model.config(), DType::kF32, s.n);
  std::vector<int64_t> positions(s.n);
  for (int64_t i = 0; i < s.n; ++i) positions[i] = i;
  SequenceStep step;
  step.tokens = ids;
  step.positions = positions;
  step.cache = &cache;
  step.attention = AttentionOutput::kQueries;
  step.no_logits = true;
  if (absl::Status st = model.Forward(absl::MakeSpan(&step, 1)); !st.ok()) {
    return st;
  }
  std::vector<LayerData> layers(model.config().layers);
  const int64_t q_width = int64_t{s.query_heads} * s.head_dim;
  for (size_t l = 0; l < layers.size(); ++l) {
    LayerData& d = layers[l];
    d.keys.resize(s.n * s.width());
    d.values.resize(d.keys.size());
    std::memcpy(d.keys.data(), step.keys[l].data(), d.keys.size() * 4);
    std::memcpy(d.values.data(), step.values[l].data(), d.values.size() * 4);
    for (int64_t t : s.query_positions) {
      const float* q = &step.attention_out[l][t * q_width];
      d.queries.insert(d.queries.end(), q, q + q_width);
    }
  }
  return layers;
}

void Print(const std::vector<Row>& rows, const Shape& s, int32_t layers) {
  if (absl::GetFlag(FLAGS_json)) {
    nlohmann::json out = nlohmann::json::array();
    for (const Row& r : rows) {
      out.push_back({{"format", r.format},
                     {"layer", r.layer},
                     {"tokens", s.n},
                     {"queries", s.query_positions.size()},
                     {"bits_per_element_k", r.bits_k},
                     {"bits_per_element_v", r.bits_v},
                     {"rel_err_k", r.k},
                     {"rel_err_v", r.v},
                     {"rel_err_p", r.p},
                     {"rel_err_o", r.o}});
    }
    std::printf("%s\n", out.dump(1).c_str());
    return;
  }
  std::printf("%lld tokens, %zu query positions x %d query heads, %d layers\n",
              static_cast<long long>(s.n), s.query_positions.size(),
              s.query_heads, layers);
  std::printf("%-16s %5s %6s %6s %10s %10s %10s %10s\n", "format", "layer",
              "bits K", "bits V", "rel_err(K)", "rel_err(V)", "rel_err(P)",
              "rel_err(O)");
  for (const Row& r : rows) {
    std::printf("%-16s %5d %6.3f %6.3f %10.2e %10.2e %10.2e %10.2e\n",
                r.format.c_str(), r.layer, r.bits_k, r.bits_v, r.k, r.v, r.p,
                r.o);
  }
}

}  // namespace

absl::Status QuantErrorCommand() {
  if (absl::GetFlag(FLAGS_text).empty()) {
    return absl::InvalidArgumentError("quant-error needs --text=FILE");
  }
  Setup setup;
  if (absl::Status st = OpenFile(setup); !st.ok()) return st;
  absl::StatusOr<std::string> text = ReadFile(absl::GetFlag(FLAGS_text));
  if (!text.ok()) return text.status();
  std::vector<int32_t> ids = setup.tokenizer->Encode(*text, false);
  const int64_t max_tokens = absl::GetFlag(FLAGS_max_tokens);
  if (max_tokens > 0 && static_cast<int64_t>(ids.size()) > max_tokens) {
    ids.resize(max_tokens);
  }
  absl::StatusOr<std::unique_ptr<LlamaModel>> model =
      LlamaModel::Load(*setup.file, DType::kF32, PositionMode::kOriginal);
  if (!model.ok()) return model.status();
  const ModelConfig& c = (*model)->config();
  const int32_t group = absl::GetFlag(FLAGS_group_size);
  const int32_t queries = absl::GetFlag(FLAGS_queries);
  Shape s{static_cast<int64_t>(ids.size()), c.kv_heads, c.query_heads,
          c.head_dim};
  if (group <= 0 || group % 2 != 0 || c.head_dim % group != 0 || queries < 1 ||
      s.n < 2 * std::max(queries, group)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "quant-error: --group_size=", group, " must be even and divide ",
        c.head_dim, ", and the text's ", s.n, " tokens at least twice ",
        "--queries=", queries, " and the group"));
  }
  for (int32_t i = 0; i < queries; ++i) {
    s.query_positions.push_back(s.n / 2 + (s.n - s.n / 2) * (i + 1) / queries -
                                1);
  }
  absl::StatusOr<std::vector<LayerData>> layers = RunModel(**model, ids, s);
  if (!layers.ok()) return layers.status();
  std::vector<Row> rows;
  for (int32_t l = 0; l < c.layers; ++l) {
    if (absl::Status st = MeasureLayer(s, l, (*layers)[l], group, &rows);
        !st.ok()) {
      return st;
    }
  }
  Print(rows, s, c.layers);
  return absl::OkStatus();
}

}  // namespace kvkeep::lm
