#include "bench/grpc_e2e_setup.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "bench/process_usage.h"
#include "grpcpp/client_context.h"
#include "kernels/dtype.h"

namespace kvkeep::e2e {
namespace {

using Clock = std::chrono::steady_clock;
using bench::ProcessUsage;
using bench::Usage;

// Creates an h2o session and appends `tokens` (at most the budget) of
// prompt through AppendPrefill.
absl::StatusOr<StreamState> CreateAndPrefill(v1::KvKeep::Stub& stub,
                                             const Inputs& in, int64_t tokens) {
  v1::CreateSessionRequest create;
  create.set_layout("bench");
  create.set_policy("h2o");
  (*create.mutable_policy_params())["sinks"] = "4";
  (*create.mutable_policy_params())["recent"] = "64";
  (*create.mutable_policy_params())["slack"] = absl::StrCat(kSlack);
  create.mutable_budget()->set_tokens(in.budget);
  v1::CreateSessionResponse created;
  {
    grpc::ClientContext ctx;
    if (absl::Status s = FromGrpc(stub.CreateSession(&ctx, create, &created),
                                  "CreateSession");
        !s.ok()) {
      return s;
    }
  }
  StreamState st;
  st.session_id = created.session_id();
  v1::AppendRequest chunk;
  for (int32_t l = 0; l < kLayers; ++l) {
    v1::LayerKv* kv = chunk.add_layers();
    kv->set_keys(in.chunk_kv);
    kv->set_values(in.chunk_kv);
  }
  grpc::ClientContext ctx;
  v1::AppendPrefillResponse prefilled;
  std::unique_ptr<grpc::ClientWriter<v1::AppendRequest>> writer =
      stub.AppendPrefill(&ctx, &prefilled);
  for (int64_t first = 0; first < tokens; first += kPrefillChunk) {
    const int64_t n = std::min(kPrefillChunk, tokens - first);
    chunk.set_session_id(first == 0 ? st.session_id : "");
    chunk.clear_positions();
    for (int64_t i = 0; i < n; ++i) chunk.add_positions(first + i);
    if (n < kPrefillChunk) {
      const size_t bytes = n * in.token_kv.size();
      for (v1::LayerKv& kv : *chunk.mutable_layers()) {
        kv.mutable_keys()->resize(bytes);
        kv.mutable_values()->resize(bytes);
      }
    }
    if (!writer->Write(chunk)) break;  // Finish says why
  }
  writer->WritesDone();
  if (absl::Status s = FromGrpc(writer->Finish(), "AppendPrefill"); !s.ok()) {
    return s;
  }
  v1::GetSessionStatsRequest stats_req;
  stats_req.set_session_id(st.session_id);
  v1::SessionStats stats;
  grpc::ClientContext stats_ctx;
  if (absl::Status s = FromGrpc(
          stub.GetSessionStats(&stats_ctx, stats_req, &stats), "GetStats");
      !s.ok()) {
    return s;
  }
  st.next_position = tokens;
  st.version.assign(stats.layer_version().begin(), stats.layer_version().end());
  st.resident.assign(stats.layer_resident().begin(),
                     stats.layer_resident().end());
  if (static_cast<int32_t>(st.resident.size()) != kLayers ||
      st.resident[0] != tokens) {
    return absl::InternalError(
        absl::StrCat("session ", st.session_id, " holds ",
                     st.resident.empty() ? -1 : st.resident[0],
                     " tokens after prefill, expected ", tokens));
  }
  return st;
}

// AppendPrefill's share: allocations, minor faults and CPU per chunk over
// the whole prefill (CreateSession and GetSessionStats included, a few calls
// per session next to budget / 128 chunks).
void PrintPrefillUsage(const RunConfig& c, double seconds, const Usage& u) {
  int64_t chunks = 0;
  int64_t tokens = 0;
  for (int i = 0; i < c.sessions; ++i) {
    const int64_t t = PrefillTokens(c.budget, i);
    tokens += t;
    chunks += (t + kPrefillChunk - 1) / kPrefillChunk;
  }
  const double kv_bytes = 2.0 * kKvHeads * kHeadDim * 2 * kLayers * tokens;
  std::printf(
      "# AppendPrefill: %lld chunks of up to %lld tokens (%.0f MiB): per "
      "chunk %.1f allocations, %.1f minor faults (%.2f per 4 KiB of KV), "
      "%.1f ms CPU; %.2f GB/s of KV (process-wide, clients included)\n",
      static_cast<long long>(chunks), static_cast<long long>(kPrefillChunk),
      kPrefillChunk * 2.0 * kKvHeads * kHeadDim * 2 * kLayers / 1048576.0,
      u.allocations / chunks, u.minor_faults / chunks,
      u.minor_faults / (kv_bytes / 4096), 1e3 * u.cpu_s / chunks,
      kv_bytes / seconds / 1e9);
  std::fflush(stdout);
}

}  // namespace

const char* FormName(Form f) {
  switch (f) {
    case Form::kReduced:
      return "reduced";
    case Form::kPerHead:
      return "per_head";
    case Form::kQueries:
      return "queries";
  }
  return "?";
}

ModelLayout BenchLayout() {
  ModelLayout layout;
  layout.name = "bench";
  layout.num_layers = kLayers;
  layout.kv_heads = kKvHeads;
  layout.query_heads = kQueryHeads;
  layout.head_dim = kHeadDim;
  layout.dtype = DType::kBF16;
  layout.page_tokens = kPageTokens;
  return layout;
}

Inputs MakeInputs(int64_t budget) {
  Inputs in;
  in.budget = budget;
  std::mt19937 rng(42);
  std::normal_distribution<float> normal;
  const int64_t row = budget + 1;
  in.per_head.resize(kQueryHeads * row);
  in.reduced.assign(row, 0.0f);
  std::vector<double> e(row);
  for (int32_t h = 0; h < kQueryHeads; ++h) {
    double sum = 0;
    for (int64_t j = 0; j < row; ++j) {
      const double heavy = (j % 61 == 0) ? 3.0 : 0.0;
      e[j] = std::exp(normal(rng) + heavy);
      sum += e[j];
    }
    // 0.999: float rounding must not push a row's sum past 1.
    for (int64_t j = 0; j < row; ++j) {
      const float p = static_cast<float>(0.999 * e[j] / sum);
      in.per_head[h * row + j] = p;
      in.reduced[j] += p;
    }
  }
  in.queries.resize(int64_t{kLayers} * kQueryHeads * kHeadDim);
  for (float& q : in.queries) q = normal(rng);
  const int64_t token_elems = int64_t{kKvHeads} * kHeadDim;
  in.token_kv.resize(token_elems * 2);
  for (int64_t i = 0; i < token_elems; ++i) {
    StoreFromFloat(DType::kBF16, in.token_kv.data(), i, normal(rng));
  }
  in.chunk_kv.resize(kPrefillChunk * token_elems * 2);
  for (int64_t i = 0; i < kPrefillChunk * token_elems; ++i) {
    StoreFromFloat(DType::kBF16, in.chunk_kv.data(), i, normal(rng));
  }
  return in;
}

absl::Status FromGrpc(const grpc::Status& s, absl::string_view what) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(what, ": ", s.error_message()));
}

int64_t PrefillTokens(int64_t budget, int session) {
  return budget - (session % (kSlack + 1));
}

absl::StatusOr<std::vector<StreamState>> PrefillAll(
    const Options& opt, const RunConfig& c, const Inputs& in,
    const std::vector<std::unique_ptr<v1::KvKeep::Stub>>& store_stubs,
    const CacheStore& store) {
  const Clock::time_point prefill_start = Clock::now();
  const Usage prefill_usage0 = ProcessUsage();
  std::vector<StreamState> states(c.sessions);
  std::vector<absl::Status> prefill_status(c.sessions);
  std::atomic<int> next{0};
  std::vector<std::thread> prefillers;
  for (int t = 0; t < opt.prefill_threads; ++t) {
    prefillers.emplace_back([&] {
      for (int i = next++; i < c.sessions; i = next++) {
        absl::StatusOr<StreamState> st =
            CreateAndPrefill(*store_stubs[i], in, PrefillTokens(c.budget, i));
        if (st.ok()) {
          states[i] = *std::move(st);
        } else {
          prefill_status[i] = st.status();
        }
      }
    });
  }
  for (std::thread& t : prefillers) t.join();
  for (const absl::Status& s : prefill_status) {
    if (!s.ok()) return s;
  }
  const double prefill_s =
      std::chrono::duration<double>(Clock::now() - prefill_start).count();
  const Usage prefill_usage = ProcessUsage() - prefill_usage0;
  const LayoutStats layout_stats = store.Layouts().front();
  std::printf(
      "# %d session(s), budget %lld: prefilled %lld..%lld tokens x %d "
      "layers each (staggered) through AppendPrefill in %.1f s; pool "
      "%lld/%lld pages (%.2f GiB used)\n",
      c.sessions, static_cast<long long>(c.budget),
      static_cast<long long>(PrefillTokens(
          c.budget, std::min(c.sessions - 1, static_cast<int>(kSlack)))),
      static_cast<long long>(c.budget), kLayers, prefill_s,
      static_cast<long long>(layout_stats.pool.used_pages),
      static_cast<long long>(layout_stats.pool.capacity_pages),
      layout_stats.pool.used_pages * layout_stats.pool.page_bytes /
          1073741824.0);
  PrintPrefillUsage(c, prefill_s, prefill_usage);

  return states;
}

absl::Status MeasureReadKv(v1::KvKeep::Stub& stub, const StreamState& st) {
  Usage use;
  int64_t chunks = 0;
  double bytes = 0, seconds = 0;
  for (int read = 0; read < 2; ++read) {
    chunks = 0;
    bytes = 0;
    v1::ReadKvRequest req;
    req.set_session_id(st.session_id);
    grpc::ClientContext ctx;
    const Clock::time_point t0 = Clock::now();
    const Usage u0 = ProcessUsage();
    std::unique_ptr<grpc::ClientReader<v1::KvChunk>> reader =
        stub.ReadKv(&ctx, req);
    v1::KvChunk chunk;
    while (reader->Read(&chunk)) {
      ++chunks;
      bytes += static_cast<double>(chunk.keys().size() + chunk.values().size());
    }
    if (absl::Status s = FromGrpc(reader->Finish(), "ReadKv"); !s.ok()) {
      return s;
    }
    use = ProcessUsage() - u0;
    seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  }
  std::printf(
      "# ReadKv of one session (%lld chunks, %.0f MiB): per chunk %.1f "
      "allocations, %.1f minor faults, %.2f ms CPU; %.2f GB/s (process-wide, "
      "the client included)\n",
      static_cast<long long>(chunks), bytes / 1048576.0,
      use.allocations / chunks, use.minor_faults / chunks,
      1e3 * use.cpu_s / chunks, bytes / seconds / 1e9);
  std::fflush(stdout);
  return absl::OkStatus();
}

}  // namespace kvkeep::e2e
