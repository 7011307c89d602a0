// kvkeep-lm: runs SmolLM2-135M (any Llama-architecture GGUF) on the CPU with
// its KV cache in kvkeepd, the store's policy evicting as the text goes.
//
//   kvkeep-lm perplexity --server=127.0.0.1:50051 --text=FILE
//       --policy=h2o --params=sinks=4,recent=64 --budget=256
//   kvkeep-lm perplexity --server=... --text=FILE
//       --runs="full window@256 streaming_llm:sinks=4@256 h2o:sinks=4@25%"
//   kvkeep-lm perplexity --local --text=FILE        (no kvkeepd: the baseline)
//   kvkeep-lm generate --server=... --prompt="..." --chat --max_new_tokens=64
//   kvkeep-lm answer --server=... --tasks=TASKS.jsonl --runs="..."
//       (each task's context + question through every run, then a greedy
//       answer: exact match and the answer's log-probability, JSON Lines)
//   kvkeep-lm quant-error --text=FILE --max_tokens=1024
//       (each quantised format's error on the model's own K and V, per
//       layer; no kvkeepd)
//
// docs/lm.md has the whole story: layouts, positions, what each flag does;
// docs/lm-eval.md the evaluation that `answer` serves.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "nlohmann/json.hpp"
#include "services/client/kvkeep_client.h"
#include "services/lm/gguf.h"
#include "services/lm/lm_cli.h"
#include "services/lm/lm_runs.h"
#include "services/lm/lm_sequence.h"
#include "services/lm/model.h"
#include "services/lm/tokenizer.h"

ABSL_FLAG(std::string, model, "",
          "the GGUF file (default: $KVKEEP_MODEL, else "
          ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf; scripts/fetch-model "
          "puts it there)");
ABSL_FLAG(std::string, server, "127.0.0.1:50051", "kvkeepd's address");
ABSL_FLAG(std::string, token, "", "bearer token (servers with tenants)");
ABSL_FLAG(bool, local, false,
          "keep the cache in the worker, no kvkeepd (policy full only): the "
          "baseline that shows what the store costs");
ABSL_FLAG(std::string, layout, "",
          "the server's layout (default: the first that fits the model and "
          "--positions)");
ABSL_FLAG(std::string, positions, "original",
          "original: keys stored after RoPE at their original positions; "
          "cache: keys stored before RoPE, rotated at use by their rank in the "
          "cache (StreamingLLM's re-indexing; needs a keys_pre_rope layout)");
ABSL_FLAG(std::string, kv_dtype, "f32",
          "--local only: the cache's element type (f32, f16, bf16); with a "
          "server the layout's");
ABSL_FLAG(
    std::string, emulate, "",
    "--local only: hold the cache in float32 but hand the model what a "
    "quantised format would (int4/g32, int8/g32, fp8_e4m3/g32, or "
    "KIVI's per-channel int4 keys kivi_int4/g32/t32; docs/quantization.md)");
ABSL_FLAG(std::string, cache, "auto",
          "how the worker reads the session's cache: mapped (the store's host "
          "pool through MapPool, no copy), mirror (a copy kept from the "
          "replies), auto (mapped when the server shares its pools)");
ABSL_FLAG(std::string, scores, "reduced",
          "how attention goes to a policy that scores by it: reduced, "
          "per_head, queries");
ABSL_FLAG(std::string, policy, "full", "the eviction policy");
ABSL_FLAG(std::string, params, "", "policy parameters: k=v,k=v");
ABSL_FLAG(std::string, budget, "0",
          "tokens per layer, or a share of the text like 25%");
ABSL_FLAG(std::string, runs, "",
          "several sequences in one batch, space-separated "
          "POLICY[:k=v,k=v][@BUDGET], e.g. \"full h2o:sinks=4@25%\" (a "
          "share like 25% is of the text or prompt, for parameters too: "
          "recent=12.5%); "
          "overrides --policy, --params and --budget");
ABSL_FLAG(std::string, text, "", "perplexity: the text file");
ABSL_FLAG(int64_t, max_tokens, 0,
          "perplexity: the first T tokens of the text (0: all)");
ABSL_FLAG(int64_t, prompt_tokens, 0,
          "tokens fed as a prompt in chunks before going token by token "
          "(snapkv compresses at its end)");
ABSL_FLAG(int64_t, chunk, 128, "prompt tokens per forward pass");
ABSL_FLAG(std::string, prompt, "", "generate: the prompt");
ABSL_FLAG(std::string, prompt_file, "", "generate: the prompt, from a file");
ABSL_FLAG(bool, chat, false,
          "generate: wrap the prompt in the model's chat turns");
ABSL_FLAG(int64_t, max_new_tokens, 64, "generate: tokens to generate");
ABSL_FLAG(bool, json, false, "print the results as JSON");

namespace kvkeep::lm {

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

namespace {

std::string ModelPath() {
  std::string path = absl::GetFlag(FLAGS_model);
  if (path.empty()) {
    const char* env = std::getenv("KVKEEP_MODEL");
    path = env != nullptr && *env != '\0'
               ? env
               : ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf";
  }
  return path;
}

absl::StatusOr<std::unique_ptr<GgufFile>> OpenModel() {
  const std::string path = ModelPath();
  if (access(path.c_str(), R_OK) != 0) {
    return absl::NotFoundError(
        absl::StrCat("no model file at ", path,
                     ": run scripts/fetch-model (it prints the path) and pass "
                     "--model=PATH or set KVKEEP_MODEL"));
  }
  return GgufFile::Open(path);
}

absl::StatusOr<std::map<std::string, std::string>> ParseParams(
    absl::string_view text) {
  std::map<std::string, std::string> params;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    std::pair<std::string, std::string> kv = absl::StrSplit(item, '=');
    if (kv.first.empty() || item.find('=') == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("policy parameter '", item, "' is not k=v"));
    }
    params[kv.first] = kv.second;
  }
  return params;
}

// "256" or "25%" (of `text_tokens`).
absl::StatusOr<int64_t> ParseBudget(absl::string_view text,
                                    int64_t text_tokens) {
  double value = 0;
  const bool share = absl::ConsumeSuffix(&text, "%");
  if (!absl::SimpleAtod(text, &value) || value < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("budget '", text, "' is not a count or a percentage"));
  }
  return share ? static_cast<int64_t>(value / 100 * text_tokens)
               : static_cast<int64_t>(value);
}

}  // namespace

absl::StatusOr<std::vector<RunSpec>> RunsFromFlags(int64_t text_tokens) {
  std::vector<std::string> items;
  if (absl::GetFlag(FLAGS_runs).empty()) {
    std::string one = absl::GetFlag(FLAGS_policy);
    if (!absl::GetFlag(FLAGS_params).empty()) {
      absl::StrAppend(&one, ":", absl::GetFlag(FLAGS_params));
    }
    absl::StrAppend(&one, "@", absl::GetFlag(FLAGS_budget));
    items.push_back(one);
  } else {
    items = absl::StrSplit(absl::GetFlag(FLAGS_runs), ' ', absl::SkipEmpty());
  }
  std::vector<RunSpec> runs;
  for (const std::string& item : items) {
    RunSpec run;
    std::pair<std::string, std::string> at = absl::StrSplit(item, '@');
    std::pair<std::string, std::string> colon = absl::StrSplit(at.first, ':');
    run.policy = colon.first;
    absl::StatusOr<std::map<std::string, std::string>> params =
        ParseParams(colon.second);
    if (!params.ok()) return params.status();
    run.params = *params;
    // A parameter given as a share ("recent=12.5%") is of the text, too.
    for (auto& [key, value] : run.params) {
      if (!absl::EndsWith(value, "%")) continue;
      absl::StatusOr<int64_t> tokens = ParseBudget(value, text_tokens);
      if (!tokens.ok()) return tokens.status();
      value = absl::StrCat(*tokens);
    }
    absl::StatusOr<int64_t> budget =
        ParseBudget(at.second.empty() ? "0" : at.second, text_tokens);
    if (!budget.ok()) return budget.status();
    run.budget_tokens = *budget;
    run.spec = item;
    run.label = run.policy == "full" ? std::string("full")
                                     : absl::StrCat(at.first, "@", *budget);
    runs.push_back(run);
  }
  return runs;
}

namespace {

// The prompt's last step must hold every sequence's minimum (snapkv's
// observation window).
int64_t MinLastChunk(const std::vector<std::unique_ptr<Sequence>>& sequences) {
  int64_t min_last = 1;
  for (const auto& s : sequences) {
    min_last = std::max(min_last, s->min_prompt_end_tokens());
  }
  return min_last;
}

absl::StatusOr<PositionMode> PositionsFromFlags() {
  const std::string p = absl::GetFlag(FLAGS_positions);
  if (p == "original") return PositionMode::kOriginal;
  if (p == "cache") return PositionMode::kCachePosition;
  return absl::InvalidArgumentError(
      absl::StrCat("--positions=", p, ": expected original or cache"));
}

absl::StatusOr<DType> LocalDType() {
  const std::string d = absl::GetFlag(FLAGS_kv_dtype);
  if (d == "f32") return DType::kF32;
  if (d == "f16") return DType::kF16;
  if (d == "bf16") return DType::kBF16;
  return absl::InvalidArgumentError(
      absl::StrCat("--kv_dtype=", d, ": expected f32, f16 or bf16"));
}

absl::StatusOr<StoreSequenceOptions> StoreOptionsFromFlags() {
  StoreSequenceOptions o;
  const std::string cache = absl::GetFlag(FLAGS_cache);
  if (cache == "auto") {
    o.access = CacheAccess::kAuto;
  } else if (cache == "mapped") {
    o.access = CacheAccess::kMapped;
  } else if (cache == "mirror") {
    o.access = CacheAccess::kMirror;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--cache=", cache, ": expected auto, mapped or mirror"));
  }
  const std::string scores = absl::GetFlag(FLAGS_scores);
  if (scores == "reduced") {
    o.scores = ScoreForm::kReduced;
  } else if (scores == "per_head") {
    o.scores = ScoreForm::kPerHead;
  } else if (scores == "queries") {
    o.scores = ScoreForm::kQueries;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--scores=", scores, ": expected reduced, per_head or queries"));
  }
  return o;
}

absl::Status Load(Setup& setup, const KvFormat& kv, PositionMode positions) {
  absl::StatusOr<std::unique_ptr<LlamaModel>> model =
      LlamaModel::Load(*setup.file, kv, positions);
  if (!model.ok()) return model.status();
  setup.model = *std::move(model);
  return absl::OkStatus();
}

}  // namespace

// Maps the model file and reads its tokenizer.
absl::Status OpenFile(Setup& setup) {
  absl::StatusOr<std::unique_ptr<GgufFile>> file = OpenModel();
  if (!file.ok()) return file.status();
  setup.file = *std::move(file);
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer =
      Tokenizer::FromGguf(*setup.file);
  if (!tokenizer.ok()) return tokenizer.status();
  setup.tokenizer = *std::move(tokenizer);
  return absl::OkStatus();
}

// Loads the model for the caches' dtype: the layout's (found on the
// server, which stays connected) or --kv_dtype's (--local).
absl::Status Connect(Setup& setup) {
  absl::StatusOr<ModelConfig> config = ModelConfig::FromGguf(*setup.file);
  if (!config.ok()) return config.status();
  setup.config = *config;
  absl::StatusOr<PositionMode> positions = PositionsFromFlags();
  if (!positions.ok()) return positions.status();

  if (absl::GetFlag(FLAGS_local)) {
    absl::StatusOr<DType> dtype = LocalDType();
    if (!dtype.ok()) return dtype.status();
    setup.local_dtype = *dtype;
    setup.kv_format = KvFormat(*dtype).Name();
    if (const std::string e = absl::GetFlag(FLAGS_emulate); !e.empty()) {
      absl::StatusOr<Emulation> emulation = Emulation::Parse(e);
      if (!emulation.ok()) return emulation.status();
      if (*dtype != DType::kF32) {
        return absl::InvalidArgumentError(
            "--emulate holds the cache in f32: leave --kv_dtype at f32");
      }
      setup.emulation = *emulation;
      setup.kv_format = emulation->Name();
    }
    setup.where = absl::StrCat("local cache (", setup.kv_format, ")");
    return Load(setup, *dtype, *positions);
  }

  if (!absl::GetFlag(FLAGS_emulate).empty()) {
    return absl::InvalidArgumentError("--emulate needs --local");
  }
  client::ClientOptions options;
  options.address = absl::GetFlag(FLAGS_server);
  options.token = absl::GetFlag(FLAGS_token);
  options.retries = 1;
  absl::StatusOr<client::KvKeepClient> client =
      client::KvKeepClient::Connect(options);
  if (!client.ok()) return client.status();
  absl::StatusOr<v1::ServerInfo> info = client->GetServerInfo();
  if (!info.ok()) {
    return absl::Status(info.status().code(),
                        absl::StrCat("kvkeepd at ", options.address, ": ",
                                     info.status().message()));
  }
  absl::StatusOr<v1::Layout> layout =
      FindLayout(*info, *config, *positions, absl::GetFlag(FLAGS_layout));
  if (!layout.ok()) return layout.status();
  absl::StatusOr<KvFormat> format = FormatOf(*layout);
  if (!format.ok()) return format.status();
  absl::StatusOr<StoreSequenceOptions> base = StoreOptionsFromFlags();
  if (!base.ok()) return base.status();
  base->layout = layout->name();
  setup.client.emplace(*std::move(client));
  setup.info = *std::move(info);
  setup.base = *base;
  setup.kv_format = format->Name();
  setup.where = absl::StrCat("kvkeepd ", options.address, " (layout ",
                             layout->name(), " ", format->Name(), ", cache ");
  return Load(setup, format->Forward(), *positions);
}

// One sequence per run, each for up to `tokens` tokens.
absl::StatusOr<std::vector<std::unique_ptr<Sequence>>> OpenSequences(
    Setup& setup, const std::vector<RunSpec>& runs, int64_t tokens) {
  std::vector<std::unique_ptr<Sequence>> sequences;
  for (const RunSpec& run : runs) {
    if (!setup.client.has_value()) {
      if (run.policy != "full") {
        return absl::InvalidArgumentError(
            absl::StrCat("--local keeps every token (policy full); ",
                         run.policy, " needs kvkeepd"));
      }
      sequences.push_back(
          setup.emulation.has_value()
              ? NewEmulatedSequence(setup.config, *setup.emulation, run.label,
                                    tokens)
              : NewLocalSequence(setup.config, setup.local_dtype, run.label,
                                 tokens));
      continue;
    }
    StoreSequenceOptions o = setup.base;
    o.policy = run.policy;
    o.params = run.params;
    o.budget_tokens = run.budget_tokens;
    o.label = run.label;
    absl::StatusOr<std::unique_ptr<Sequence>> sequence =
        NewStoreSequence(*setup.client, setup.info, setup.config, o);
    if (!sequence.ok()) {
      for (auto& s : sequences) s->Close().IgnoreError();
      return absl::Status(
          sequence.status().code(),
          absl::StrCat(run.label, ": ", sequence.status().message()));
    }
    sequences.push_back(*std::move(sequence));
  }
  return sequences;
}

namespace {

// Connects, loads the model and opens one sequence per run, for up to
// `tokens` tokens.
absl::Status Prepare(Setup& setup, const std::vector<RunSpec>& runs,
                     int64_t tokens) {
  if (absl::Status s = Connect(setup); !s.ok()) return s;
  absl::StatusOr<std::vector<std::unique_ptr<Sequence>>> sequences =
      OpenSequences(setup, runs, tokens);
  if (!sequences.ok()) return sequences.status();
  setup.sequences = *std::move(sequences);
  if (setup.client.has_value()) {
    absl::StrAppend(&setup.where,
                    std::string(setup.sequences.front()->access()), ")");
  }
  return absl::OkStatus();
}

// A progress line on a terminal; nothing in a log file.
std::function<void(int64_t, int64_t)> Progress() {
  if (!isatty(STDERR_FILENO)) return nullptr;
  return [](int64_t done, int64_t total) {
    if (done != total && done % 16 != 0) return;
    std::fprintf(stderr, "\r%lld / %lld tokens%s", static_cast<long long>(done),
                 static_cast<long long>(total), done == total ? "\n" : "");
  };
}

absl::Status Perplexity() {
  if (absl::GetFlag(FLAGS_text).empty()) {
    return absl::InvalidArgumentError("perplexity needs --text=FILE");
  }
  absl::StatusOr<std::string> text = ReadFile(absl::GetFlag(FLAGS_text));
  if (!text.ok()) return text.status();
  Setup setup;
  if (absl::Status s = OpenFile(setup); !s.ok()) return s;
  std::vector<int32_t> ids = setup.tokenizer->Encode(*text, false);
  const int64_t max_tokens = absl::GetFlag(FLAGS_max_tokens);
  if (max_tokens > 0 && static_cast<int64_t>(ids.size()) > max_tokens) {
    ids.resize(max_tokens);
  }
  if (ids.size() < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the text has ", ids.size(), " tokens: perplexity needs at least 2"));
  }
  absl::StatusOr<std::vector<RunSpec>> runs =
      RunsFromFlags(static_cast<int64_t>(ids.size()));
  if (!runs.ok()) return runs.status();
  if (absl::Status s = Prepare(setup, *runs, static_cast<int64_t>(ids.size()));
      !s.ok()) {
    return s;
  }

  PerplexityOptions options;
  options.prompt_tokens = absl::GetFlag(FLAGS_prompt_tokens);
  options.chunk = absl::GetFlag(FLAGS_chunk);
  options.min_last_chunk = MinLastChunk(setup.sequences);
  options.progress = Progress();
  std::vector<Sequence*> sequences;
  for (auto& s : setup.sequences) sequences.push_back(s.get());
  absl::StatusOr<std::vector<PerplexityResult>> results =
      RunPerplexity(*setup.model, ids, sequences, options);
  if (!results.ok()) return results.status();

  const double tokens = static_cast<double>(ids.size());
  if (absl::GetFlag(FLAGS_json)) {
    nlohmann::json out = nlohmann::json::array();
    for (const PerplexityResult& r : *results) {
      out.push_back({{"run", r.label},
                     {"perplexity", r.perplexity},
                     {"tokens", ids.size()},
                     {"predictions", r.predictions},
                     {"nll_sum", r.nll_sum},
                     {"resident_tokens_per_layer",
                      r.final_usage.resident_tokens_per_layer},
                     {"resident_kv_bytes", r.final_usage.bytes},
                     {"seconds", r.seconds},
                     {"forward_seconds", r.forward_seconds},
                     {"cache_seconds", r.commit_seconds},
                     {"tokens_per_second", tokens / r.seconds},
                     {"decode_tokens", r.decode_tokens},
                     {"decode_tokens_per_second",
                      r.decode_tokens / std::max(r.decode_seconds, 1e-9)},
                     {"cache", setup.where},
                     {"kv_format", setup.kv_format},
                     {"positions", absl::GetFlag(FLAGS_positions)}});
    }
    std::printf("%s\n", out.dump(2).c_str());
    return absl::OkStatus();
  }
  std::printf("%s, %zu tokens, %zu sequence(s), positions %s\n",
              setup.where.c_str(), ids.size(), results->size(),
              absl::GetFlag(FLAGS_positions).c_str());
  std::printf("%-36s %12s %14s %14s\n", "run", "perplexity", "resident/layer",
              "resident KV");
  for (const PerplexityResult& r : *results) {
    std::printf("%-36s %12.4f %14.1f %10.1f MiB\n", r.label.c_str(),
                r.perplexity, r.final_usage.resident_tokens_per_layer,
                r.final_usage.bytes / 1048576.0);
  }
  const PerplexityResult& r = results->front();
  std::printf(
      "%.1f s: %.1f tokens/s per sequence, %.1f in all (forward %.1f s, "
      "cache %.1f s)\n",
      r.seconds, tokens / r.seconds, tokens * results->size() / r.seconds,
      r.forward_seconds, r.commit_seconds);
  return absl::OkStatus();
}

absl::Status GenerateCommand() {
  std::string prompt = absl::GetFlag(FLAGS_prompt);
  if (!absl::GetFlag(FLAGS_prompt_file).empty()) {
    absl::StatusOr<std::string> text =
        ReadFile(absl::GetFlag(FLAGS_prompt_file));
    if (!text.ok()) return text.status();
    prompt = *text;
  }
  if (prompt.empty()) {
    return absl::InvalidArgumentError(
        "generate needs --prompt=TEXT or --prompt_file=FILE");
  }
  absl::StatusOr<std::vector<RunSpec>> runs = RunsFromFlags(0);
  if (!runs.ok()) return runs.status();
  if (runs->size() != 1) {
    return absl::InvalidArgumentError("generate runs one sequence");
  }
  Setup setup;
  if (absl::Status s = OpenFile(setup); !s.ok()) return s;
  if (absl::GetFlag(FLAGS_chat)) {
    prompt = absl::StrCat("<|im_start|>user\n", prompt,
                          "<|im_end|>\n<|im_start|>assistant\n");
  }
  const std::vector<int32_t> ids = setup.tokenizer->Encode(prompt, true);
  GenerateOptions options;
  options.max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens);
  if (absl::Status s =
          Prepare(setup, *runs,
                  static_cast<int64_t>(ids.size()) + options.max_new_tokens);
      !s.ok()) {
    return s;
  }
  options.chunk = absl::GetFlag(FLAGS_chunk);
  options.min_last_chunk = MinLastChunk(setup.sequences);
  options.stop_ids = setup.tokenizer->StopIds();
  const Tokenizer& tok = *setup.tokenizer;
  options.on_token = [&](int32_t id) {
    absl::StatusOr<std::string> piece = tok.Decode({id});
    if (piece.ok()) std::fputs(piece->c_str(), stdout);
    std::fflush(stdout);
  };
  absl::StatusOr<GenerateResult> result =
      Generate(*setup.model, ids, *setup.sequences.front(), options);
  std::printf("\n");
  if (!result.ok()) return result.status();
  absl::StatusOr<CacheUsage> usage = setup.sequences.front()->Usage();
  if (!usage.ok()) return usage.status();
  std::fprintf(stderr,
               "%s: prompt %zu tokens in %.2f s, %zu new tokens at %.1f "
               "tokens/s, resident %.1f tokens/layer\n",
               setup.where.c_str(), ids.size(), result->prompt_seconds,
               result->ids.size(),
               result->ids.size() / std::max(result->decode_seconds, 1e-9),
               usage->resident_tokens_per_layer);
  return absl::OkStatus();
}

}  // namespace
}  // namespace kvkeep::lm

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "kvkeep-lm perplexity|generate|answer|quant-error [flags]: SmolLM2 on "
      "the CPU with "
      "its KV "
      "cache in kvkeepd (docs/lm.md)");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  const std::string command = args.size() > 1 ? args[1] : "";
  absl::Status status;
  if (command == "perplexity") {
    status = kvkeep::lm::Perplexity();
  } else if (command == "generate") {
    status = kvkeep::lm::GenerateCommand();
  } else if (command == "answer") {
    status = kvkeep::lm::AnswerCommand();
  } else if (command == "quant-error") {
    status = kvkeep::lm::QuantErrorCommand();
  } else {
    std::fprintf(
        stderr,
        "usage: kvkeep-lm perplexity|generate|answer|quant-error [flags] "
        "(kvkeep-lm --help)\n");
    return 2;
  }
  if (!status.ok()) {
    std::fprintf(stderr, "kvkeep-lm: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
