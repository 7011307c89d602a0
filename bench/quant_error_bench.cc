// Quantised page formats: what they cost in accuracy and what they save in
// bytes, and how fast the CPU twins quantise (append) and dequantise
// (ReadKv). Prints two tables; nothing here is a test.
//
// Data: synthetic keys and values shaped like a small model's (SmolLM2-135M:
// 3 kv heads, 9 query heads, head_dim 64): values ~ N(0, 1); keys ~ N(0, 1)
// plus, per (head, channel), a fixed bias, and a few outlier channels of one
// sign scaled 10-40x (the outlier channels real keys have, KIVI section 3).
// Queries are N(0, 1), 0.3x on the outlier channels, so the outliers shape
// attention without saturating it. For each format (and the symmetric /
// asymmetric variants of the integer formats, which is how the stored ones were
// chosen):
//   rel_err(K), rel_err(V): ||X - X'||_F / ||X||_F
//   rel_err(P): sum |P - P'| / sum P over every query's softmax row
//   rel_err(O): ||P V - P' V'||_F / ||P V||_F
// with P = softmax(q K^T / sqrt(d)) per query head (GQA: head h reads kv
// head h / 3). bits/elem counts the scales and zero points.
//
// Run: build/bench/quant_error_bench [tokens, default 2048]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/dtype.h"
#include "kernels/kivi.h"
#include "kernels/page_layout.h"
#include "kernels/quantize.h"

namespace kvkeep {
namespace {

constexpr int32_t kKvHeads = 3;
constexpr int32_t kQueryHeads = 9;
constexpr int32_t kHeadDim = 64;
constexpr int32_t kQueries = 32;

struct Data {
  int64_t n = 0;
  std::vector<float> keys, values;  // [n][kv_heads][head_dim]
  std::vector<float> queries;       // [queries][query_heads][head_dim]
};

Data Synthetic(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  const int64_t per = int64_t{kKvHeads} * kHeadDim;
  std::vector<float> bias(per), scale(per, 1.0f);
  for (int64_t c = 0; c < per; ++c) {
    bias[c] = 0.5f * normal(rng);
    if (c % kHeadDim == 3 || c % kHeadDim == 37) scale[c] = 10.0f;
    if (c % kHeadDim == 21) {
      scale[c] = 40.0f;
      bias[c] = 2.0f;  // one-signed: an outlier channel of positive keys
    }
  }
  Data d;
  d.n = n;
  d.keys.resize(n * per);
  d.values.resize(n * per);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t c = 0; c < per; ++c) {
      d.keys[t * per + c] = scale[c] * (bias[c] + normal(rng));
      d.values[t * per + c] = normal(rng);
    }
  }
  d.queries.resize(int64_t{kQueries} * kQueryHeads * kHeadDim);
  for (int64_t i = 0; i < static_cast<int64_t>(d.queries.size()); ++i) {
    const int64_t c = i % kHeadDim;
    d.queries[i] = (c == 3 || c == 21 || c == 37 ? 0.3f : 1.0f) * normal(rng);
  }
  return d;
}

double RelErr(const std::vector<float>& x, const std::vector<float>& y) {
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    num += (double{x[i]} - y[i]) * (double{x[i]} - y[i]);
    den += double{x[i]} * x[i];
  }
  return std::sqrt(num / den);
}

// probs: [queries][query_heads][n]; out: [queries][query_heads][head_dim].
void Attention(const Data& d, const std::vector<float>& k,
               const std::vector<float>& v, std::vector<double>* probs,
               std::vector<double>* out) {
  const int64_t n = d.n;
  const int32_t group = kQueryHeads / kKvHeads;
  probs->assign(int64_t{kQueries} * kQueryHeads * n, 0.0);
  out->assign(int64_t{kQueries} * kQueryHeads * kHeadDim, 0.0);
  const double scale = 1.0 / std::sqrt(double{kHeadDim});
  for (int32_t r = 0; r < kQueries; ++r) {
    for (int32_t h = 0; h < kQueryHeads; ++h) {
      const float* q =
          d.queries.data() + (int64_t{r} * kQueryHeads + h) * kHeadDim;
      double* p = probs->data() + (int64_t{r} * kQueryHeads + h) * n;
      const int32_t g = h / group;
      double mx = -1e300;
      for (int64_t s = 0; s < n; ++s) {
        const float* key = k.data() + (s * kKvHeads + g) * kHeadDim;
        double dot = 0;
        for (int32_t i = 0; i < kHeadDim; ++i) dot += double{q[i]} * key[i];
        p[s] = dot * scale;
        mx = std::max(mx, p[s]);
      }
      double sum = 0;
      for (int64_t s = 0; s < n; ++s) sum += (p[s] = std::exp(p[s] - mx));
      double* o = out->data() + (int64_t{r} * kQueryHeads + h) * kHeadDim;
      for (int64_t s = 0; s < n; ++s) {
        p[s] /= sum;
        const float* val = v.data() + (s * kKvHeads + g) * kHeadDim;
        for (int32_t i = 0; i < kHeadDim; ++i) o[i] += p[s] * val[i];
      }
    }
  }
}

struct Format {
  std::string name;
  DType dtype;     // what the layout stores (bf16: no quantisation)
  QuantSpec spec;  // the variant measured
  int32_t group = 0;
};

std::vector<float> RoundTrip(const Format& f, const std::vector<float>& x,
                             int64_t n, int64_t* token_bytes) {
  const PageLayout layout{16, kKvHeads, kHeadDim, f.dtype, f.group};
  std::vector<float> out(x.size());
  if (f.dtype == DType::kBF16) {
    for (size_t i = 0; i < x.size(); ++i)
      out[i] = Bf16ToFloat(FloatToBf16(x[i]));
    *token_bytes = layout.token_bytes();
    return out;
  }
  // The variant's record size (asymmetric adds a zero byte per group).
  // One token at a time into a record with room for zero points either
  // way: the codes, scales and zeros sit at the layout's offsets.
  *token_bytes = layout.code_bytes() + layout.groups() * f.spec.meta_bytes();
  const int64_t step = layout.code_bytes() + 3 * layout.groups();
  std::vector<std::byte> records(n * step);
  for (int64_t t = 0; t < n; ++t) {
    std::byte* rec = records.data() + t * step;
    const QuantizeResult r =
        QuantizeTokensWith(layout, f.spec, DType::kF32,
                           x.data() + t * layout.token_elements(), 1, rec);
    if (!r.ok()) {
      std::fprintf(stderr, "%s: quantisation failed\n", f.name.c_str());
      std::exit(1);
    }
    DequantizeTokensWith(layout, f.spec, rec, 1, DType::kF32,
                         out.data() + t * layout.token_elements());
  }
  return out;
}

void ErrorTable(const Data& d) {
  const QuantSpec int8_sym{8, false, false}, int8_asym{8, false, true};
  const QuantSpec int4_sym{4, false, false}, int4_asym{4, false, true};
  const QuantSpec fp8{8, true, false};
  std::vector<Format> formats = {{"bf16", DType::kBF16, {}, 0}};
  for (int32_t g : {32, 64}) {
    const std::string gs = "/g" + std::to_string(g);
    formats.push_back({"fp8_e4m3" + gs, DType::kFp8E4M3, fp8, g});
    formats.push_back({"int8_sym" + gs, DType::kInt8, int8_sym, g});
    formats.push_back({"int8_asym" + gs, DType::kInt8, int8_asym, g});
    formats.push_back({"int4_sym" + gs, DType::kInt4, int4_sym, g});
    formats.push_back({"int4_asym" + gs, DType::kInt4, int4_asym, g});
  }
  std::vector<double> p_ref, o_ref;
  Attention(d, d.keys, d.values, &p_ref, &o_ref);
  std::printf("tokens %lld, %d kv heads, %d query heads, head_dim %d\n",
              static_cast<long long>(d.n), kKvHeads, kQueryHeads, kHeadDim);
  std::printf("%-16s %9s %10s %10s %10s %10s %s\n", "format", "bits/elem",
              "rel_err(K)", "rel_err(V)", "rel_err(P)", "rel_err(O)",
              "stored as");
  for (const Format& f : formats) {
    int64_t tb = 0;
    const std::vector<float> k = RoundTrip(f, d.keys, d.n, &tb);
    const std::vector<float> v = RoundTrip(f, d.values, d.n, &tb);
    std::vector<double> p, o;
    Attention(d, k, v, &p, &o);
    double dp = 0, sp = 0, dox = 0, so = 0;
    for (size_t i = 0; i < p.size(); ++i) {
      dp += std::fabs(p[i] - p_ref[i]);
      sp += p_ref[i];
    }
    for (size_t i = 0; i < o.size(); ++i) {
      dox += (o[i] - o_ref[i]) * (o[i] - o_ref[i]);
      so += o_ref[i] * o_ref[i];
    }
    const bool stored = f.dtype == DType::kBF16 ||
                        (SpecOf(f.dtype).asymmetric == f.spec.asymmetric);
    std::printf("%-16s %9.3f %10.2e %10.2e %10.2e %10.2e %s\n", f.name.c_str(),
                8.0 * tb / (double{kKvHeads} * kHeadDim), RelErr(d.keys, k),
                RelErr(d.values, v), dp / sp, std::sqrt(dox / so),
                stored ? std::string(DTypeName(f.dtype)).c_str() : "");
  }
}

template <typename Fn>
double BestSeconds(Fn fn) {
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    const auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
  }
  return best;
}

// kivi_int4's keys (kernels/kivi.h), as the store handles them: the bf16
// input widened to float32, then quantised per channel by page, token by
// token as a decode appends (each append re-quantises the open page from
// its tokens so far) and a page at a time as a prefill does; ReadKv
// dequantises whole pages. On either backend this runs on the host (a CUDA
// pool is sent the blocks).
void KiviSpeed(const std::vector<uint16_t>& bf16, int64_t n, double gb) {
  const PageLayout layout{16, kKvHeads, kHeadDim, DType::kKiviInt4, 32};
  const int64_t e = layout.token_elements();
  const int64_t pages = n / layout.page_tokens;
  std::vector<float> keys(n * e);
  std::vector<std::byte> blocks(pages * layout.key_block_bytes());
  std::vector<uint16_t> back(n * e);
  const auto widen = [&] {
    for (int64_t i = 0; i < n * e; ++i) keys[i] = Bf16ToFloat(bf16[i]);
  };
  const double decode = BestSeconds([&] {
    widen();
    KiviOpenPage open(layout);
    for (int64_t t = 0; t < pages * layout.page_tokens; ++t) {
      open.Append(
          keys.data() + t * e, 1,
          blocks.data() + t / layout.page_tokens * layout.key_block_bytes());
    }
  });
  // The baseline: each append quantises the open page whole again (what
  // KiviOpenPage did before it coded incrementally).
  const double whole = BestSeconds([&] {
    widen();
    for (int64_t t = 0; t < pages * layout.page_tokens; ++t) {
      const int64_t first = t / layout.page_tokens * layout.page_tokens;
      QuantizeKiviKeys(
          layout, keys.data() + first * e, static_cast<int32_t>(t - first + 1),
          blocks.data() + t / layout.page_tokens * layout.key_block_bytes());
    }
  });
  const double prefill = BestSeconds([&] {
    widen();
    for (int64_t p = 0; p < pages; ++p) {
      QuantizeKiviKeys(layout, keys.data() + p * layout.page_tokens * e,
                       layout.page_tokens,
                       blocks.data() + p * layout.key_block_bytes());
    }
  });
  const double read = BestSeconds([&] {
    for (int64_t p = 0; p < pages; ++p) {
      DequantizeKiviKeys(layout, blocks.data() + p * layout.key_block_bytes(),
                         0, layout.page_tokens, DType::kBF16,
                         back.data() + p * layout.page_tokens * e);
    }
  });
  const double used = gb * static_cast<double>(pages * layout.page_tokens) /
                      static_cast<double>(n);
  const double tokens = static_cast<double>(pages * layout.page_tokens);
  std::printf(
      "%-10s %12.2f %12.2f   (keys, a token at a time: %.2f us a "
      "token)\n",
      "kivi_int4", used / decode, used / read, 1e6 * decode / tokens);
  std::printf(
      "%-10s %12.2f %12s   (keys, a token at a time, the page "
      "re-quantised whole: %.2f us a token; x%.2f)\n",
      "kivi_int4", used / whole, "", 1e6 * whole / tokens, whole / decode);
  std::printf("%-10s %12.2f %12s   (keys, a page at a time)\n", "kivi_int4",
              used / prefill, "");
}

// GB/s of the bf16 input quantised (append) and of the bf16 output
// dequantised (ReadKv as bf16), against a bf16 copy in the same run.
void SpeedTable(const Data& d) {
  const int64_t n = d.n;
  const int64_t count = n * kKvHeads * kHeadDim;
  std::vector<uint16_t> bf16(count), back(count);
  for (int64_t i = 0; i < count; ++i) bf16[i] = FloatToBf16(d.keys[i]);
  const double gb = 2.0 * count / 1e9;  // bf16 bytes either way
  const double copy =
      BestSeconds([&] { std::memcpy(back.data(), bf16.data(), 2 * count); });
  std::printf(
      "\nCPU twins, one core, %lld tokens x %d elements (bf16 in/out)\n",
      static_cast<long long>(n), kKvHeads * kHeadDim);
  std::printf("%-10s %12s %12s   (bf16 memcpy: %.2f GB/s)\n", "format",
              "append GB/s", "ReadKv GB/s", gb / copy);
  for (DType dtype : {DType::kInt8, DType::kFp8E4M3, DType::kInt4}) {
    const PageLayout layout{16, kKvHeads, kHeadDim, dtype, 32};
    std::vector<std::byte> records(n * layout.token_bytes());
    const double q = BestSeconds([&] {
      QuantizeTokens(layout, DType::kBF16, bf16.data(), n, records.data());
    });
    const double dq = BestSeconds([&] {
      DequantizeTokens(layout, records.data(), n, DType::kBF16, back.data());
    });
    std::printf("%-10s %12.2f %12.2f\n", std::string(DTypeName(dtype)).c_str(),
                gb / q, gb / dq);
  }
  KiviSpeed(bf16, n, gb);
}

}  // namespace
}  // namespace kvkeep

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : 2048;
  const kvkeep::Data d = kvkeep::Synthetic(n, 1234);
  kvkeep::ErrorTable(d);
  kvkeep::SpeedTable(d);
  return 0;
}
