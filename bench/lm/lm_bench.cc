// lm_bench: how fast the forward pass (services/lm/model.h) runs the real
// model on this machine's CPU, with its cache in plain memory
// (ContiguousKv).
//
//  - prefill: tokens/s filling each context in chunks of 128 tokens;
//  - decode: tokens/s of single-token steps once the cache holds the
//    context (the mean over --decode_steps steps), for --batch sequences
//    and for a batch of 4;
//  - for each matrix-product shape of a decode step and of a prefill chunk,
//    the GFLOP/s inside the forward pass next to plain cblas_sgemm /
//    cblas_sgemv of the same shape run here, over as many distinct weight
//    matrices as the model has layers so that neither reads its weights
//    from cache where the other could not.
//
//   lm_bench --model=.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
//       [--contexts=512,2048,8192] [--batch=1] [--kv_dtype=f32]
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "services/lm/contiguous_kv.h"
#include "services/lm/gguf.h"
#include "services/lm/model.h"

ABSL_FLAG(std::string, model, ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf",
          "the GGUF model file");
ABSL_FLAG(std::string, contexts, "512,2048,8192",
          "contexts (tokens in the cache) to measure decode at");
ABSL_FLAG(int32_t, batch, 1,
          "sequences per decode step (a batch of 4 is "
          "always measured too)");
ABSL_FLAG(int32_t, decode_steps, 16, "decode steps measured per context");
ABSL_FLAG(std::string, kv_dtype, "f32", "the cache's dtype: f32, f16, bf16");

namespace kvkeep::lm {
namespace {

constexpr int64_t kChunk = 128;

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

struct Sequence {
  std::unique_ptr<ContiguousKv> cache;
  std::vector<int32_t> tokens;
  std::vector<int64_t> positions;
};

// Runs tokens [first, first + n) of every sequence as one batched step and
// appends them to the caches.
absl::Status Step(const LlamaModel& model, std::vector<Sequence>& seqs,
                  int64_t first, int64_t n, ForwardProfile* profile) {
  std::vector<SequenceStep> batch(seqs.size());
  for (size_t b = 0; b < seqs.size(); ++b) {
    batch[b].tokens = absl::MakeConstSpan(seqs[b].tokens).subspan(first, n);
    batch[b].positions =
        absl::MakeConstSpan(seqs[b].positions).subspan(first, n);
    batch[b].cache = seqs[b].cache.get();
  }
  if (absl::Status s = model.Forward(absl::MakeSpan(batch), profile); !s.ok()) {
    return s;
  }
  for (size_t b = 0; b < seqs.size(); ++b) {
    if (absl::Status s = seqs[b].cache->Append(batch[b]); !s.ok()) return s;
  }
  return absl::OkStatus();
}

struct Row {
  int64_t context;
  int32_t batch;
  double prefill_tokens_per_s;
  double decode_tokens_per_s;
  double decode_attention_share;
};

// Fills `batch` caches to `context` tokens (chunks of 128, one sequence at
// a time) and then decodes; profiles the last prefill chunk and the decode
// steps into *prefill / *decode.
absl::StatusOr<Row> Measure(const LlamaModel& model, DType dtype,
                            int64_t context, int32_t batch_size, int32_t steps,
                            ForwardProfile* prefill, ForwardProfile* decode) {
  std::mt19937 rng(context);
  std::vector<Sequence> seqs(batch_size);
  for (Sequence& s : seqs) {
    s.cache =
        std::make_unique<ContiguousKv>(model.config(), dtype, context + steps);
    for (int64_t i = 0; i < context + steps; ++i) {
      s.tokens.push_back(static_cast<int32_t>(rng() % model.config().vocab));
      s.positions.push_back(i);
    }
  }
  Row row{context, batch_size, 0, 0, 0};
  const Clock::time_point start = Clock::now();
  for (Sequence& s : seqs) {
    std::vector<Sequence> one(1);
    one[0].cache = std::move(s.cache);
    one[0].tokens = s.tokens;
    one[0].positions = s.positions;
    for (int64_t first = 0; first < context; first += kChunk) {
      const bool last = first + kChunk >= context;
      if (absl::Status st =
              Step(model, one, first, std::min(kChunk, context - first),
                   last ? prefill : nullptr);
          !st.ok()) {
        return st;
      }
    }
    s.cache = std::move(one[0].cache);
  }
  row.prefill_tokens_per_s = context * batch_size / Since(start);
  ForwardProfile profile;
  for (int32_t t = 0; t < steps; ++t) {
    if (absl::Status st = Step(model, seqs, context + t, 1, &profile);
        !st.ok()) {
      return st;
    }
  }
  row.decode_tokens_per_s =
      steps * static_cast<double>(batch_size) / profile.total_seconds;
  row.decode_attention_share =
      profile.attention_seconds / profile.total_seconds;
  if (decode != nullptr) *decode = profile;
  return row;
}

// Seconds per call of plain OpenBLAS on the shape [rows][in] x [out][in]^T,
// cycling through `copies` distinct weight matrices.
double PlainSeconds(const ForwardProfile::Product& p, int32_t copies) {
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> dist(-1, 1);
  std::vector<std::vector<float>> weights(copies);
  for (std::vector<float>& w : weights) {
    w.resize(p.in * p.out);
    for (float& x : w) x = dist(rng);
  }
  std::vector<float> x(p.rows * p.in), y(p.rows * p.out);
  for (float& v : x) v = dist(rng);
  auto call = [&](const std::vector<float>& w) {
    if (p.rows == 1) {
      cblas_sgemv(CblasRowMajor, CblasNoTrans, p.out, p.in, 1.0f, w.data(),
                  p.in, x.data(), 1, 0.0f, y.data(), 1);
    } else {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, p.rows, p.out, p.in,
                  1.0f, x.data(), p.in, w.data(), p.in, 0.0f, y.data(), p.out);
    }
  };
  for (const std::vector<float>& w : weights) call(w);  // warm up
  const int64_t calls = std::max<int64_t>(2 * copies, 8);
  const Clock::time_point start = Clock::now();
  for (int64_t i = 0; i < calls; ++i) call(weights[i % copies]);
  return Since(start) / calls;
}

// The table of `profile`'s products next to plain OpenBLAS (run now, right
// after the profiled Forward calls, so both see the same machine).
std::string ProductTable(const std::string& what, const ForwardProfile& profile,
                         const ModelConfig& c) {
  std::string out = absl::StrFormat(
      "\n%s: matrix products, inside Forward vs plain OpenBLAS\n"
      "%-8s %6s %6s %6s %7s %12s %12s %7s\n",
      what, "call", "rows", "in", "out", "calls", "fwd GFLOP/s", "blas GFLOP/s",
      "ratio");
  const int blas_threads = openblas_get_num_threads();
  openblas_set_num_threads(
      static_cast<int>(std::thread::hardware_concurrency()));
  for (const ForwardProfile::Product& p : profile.products) {
    const double flops = 2.0 * p.rows * p.in * p.out;
    const double inside = flops * p.calls / p.seconds / 1e9;
    // Weights shared by every layer's call are distinct per layer; the
    // logits' weight is one matrix.
    const int32_t copies = p.out == c.vocab ? 1 : c.layers;
    const double plain = flops / PlainSeconds(p, copies) / 1e9;
    absl::StrAppendFormat(&out, "%-8s %6d %6d %6d %7d %12.1f %12.1f %6.0f%%\n",
                          p.rows == 1 ? "sgemv" : "sgemm", p.rows, p.in, p.out,
                          p.calls, inside, plain, 100 * inside / plain);
  }
  openblas_set_num_threads(blas_threads);
  double products = 0;
  for (const ForwardProfile::Product& p : profile.products)
    products += p.seconds;
  absl::StrAppendFormat(
      &out, "time: products %.1f%%, attention %.1f%%, other %.1f%%\n",
      100 * products / profile.total_seconds,
      100 * profile.attention_seconds / profile.total_seconds,
      100 *
          (1 - (products + profile.attention_seconds) / profile.total_seconds));
  return out;
}

int Run() {
  auto fail = [](const absl::Status& s) {
    std::fprintf(stderr, "lm_bench: %s\n", s.ToString().c_str());
    return 1;
  };
  std::vector<int64_t> contexts;
  for (absl::string_view part :
       absl::StrSplit(absl::GetFlag(FLAGS_contexts), ',', absl::SkipEmpty())) {
    int64_t c;
    if (!absl::SimpleAtoi(part, &c) || c <= 0) {
      return fail(absl::InvalidArgumentError("--contexts: bad context"));
    }
    contexts.push_back(c);
  }
  DType dtype = DType::kF32;
  const std::string dtype_name = absl::GetFlag(FLAGS_kv_dtype);
  if (dtype_name == "f16") dtype = DType::kF16;
  if (dtype_name == "bf16") dtype = DType::kBF16;
  absl::StatusOr<std::unique_ptr<GgufFile>> file =
      GgufFile::Open(absl::GetFlag(FLAGS_model));
  if (!file.ok()) return fail(file.status());
  const Clock::time_point load = Clock::now();
  absl::StatusOr<std::unique_ptr<LlamaModel>> model =
      LlamaModel::Load(**file, dtype, PositionMode::kOriginal);
  if (!model.ok()) return fail(model.status());
  std::printf("model %s: loaded in %.2f s; kv %s; %u hardware threads\n",
              (*model)->config().name.c_str(), Since(load),
              std::string(DTypeName(dtype)).c_str(),
              std::thread::hardware_concurrency());

  std::vector<int32_t> batches = {absl::GetFlag(FLAGS_batch)};
  if (batches[0] != 4) batches.push_back(4);
  const ModelConfig& c = (*model)->config();
  ForwardProfile prefill_profile, decode_profile;
  std::string tables;
  std::vector<Row> rows;
  for (int32_t batch : batches) {
    for (int64_t context : contexts) {
      const bool first = rows.empty();
      absl::StatusOr<Row> row = Measure(**model, dtype, context, batch,
                                        absl::GetFlag(FLAGS_decode_steps),
                                        first ? &prefill_profile : nullptr,
                                        first ? &decode_profile : nullptr);
      if (!row.ok()) return fail(row.status());
      rows.push_back(*row);
      if (first) {
        tables = ProductTable(absl::StrFormat("decode step (batch %d, context "
                                              "%d)",
                                              batch, context),
                              decode_profile, c) +
                 ProductTable(absl::StrFormat("prefill chunk (%d tokens, the "
                                              "last to %d)",
                                              kChunk, context),
                              prefill_profile, c);
      }
      std::fprintf(stderr, "context %lld batch %d done\n",
                   static_cast<long long>(context), batch);
    }
  }
  std::printf("\n%8s %6s %18s %18s %16s\n", "context", "batch",
              "prefill tokens/s", "decode tokens/s", "decode attn %");
  for (const Row& r : rows) {
    std::printf("%8lld %6d %18.1f %18.1f %15.1f%%\n",
                static_cast<long long>(r.context), r.batch,
                r.prefill_tokens_per_s, r.decode_tokens_per_s,
                100 * r.decode_attention_share);
  }
  std::printf("%s", tables.c_str());
  return 0;
}

}  // namespace
}  // namespace kvkeep::lm

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "prefill and decode tokens/s of the real model on the CPU");
  absl::ParseCommandLine(argc, argv);
  return kvkeep::lm::Run();
}
