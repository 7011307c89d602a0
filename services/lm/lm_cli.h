// What kvkeep-lm's commands share (services/lm/lm_main.cc defines it, the
// `answer` command is in lm_answer_command.cc): the runs the flags name, and
// the model with its caches. Not a library: the flags are the process's.
#ifndef KVKEEP_SERVICES_LM_LM_CLI_H_
#define KVKEEP_SERVICES_LM_LM_CLI_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "services/client/kvkeep_client.h"
#include "services/lm/gguf.h"
#include "services/lm/lm_sequence.h"
#include "services/lm/model.h"
#include "services/lm/tokenizer.h"

ABSL_DECLARE_FLAG(std::string, positions);
ABSL_DECLARE_FLAG(int64_t, chunk);

namespace kvkeep::lm {

// One sequence of the batch.
struct RunSpec {
  std::string policy = "full";
  std::map<std::string, std::string> params;
  int64_t budget_tokens = 0;
  std::string label;
  std::string spec;  // as written: "h2o:sinks=4@25%"
};

// The model with its caches: kvkeepd sessions, or the worker's own.
struct Setup {
  std::unique_ptr<GgufFile> file;
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<Tokenizer> tokenizer;
  std::vector<std::unique_ptr<Sequence>> sequences;
  std::string where;      // "kvkeepd ADDR (layout L, access)" or "local"
  std::string kv_format;  // KvFormat::Name() of the caches
  ModelConfig config;
  DType local_dtype = DType::kF32;             // --local
  std::optional<Emulation> emulation;          // --local --emulate
  std::optional<client::KvKeepClient> client;  // kvkeepd
  v1::ServerInfo info;
  StoreSequenceOptions base;  // the flags' and the layout's

  ~Setup() {
    for (auto& s : sequences) s->Close().IgnoreError();
  }
};

absl::StatusOr<std::string> ReadFile(const std::string& path);

// The runs --runs (or --policy, --params, --budget) name; budgets given as a
// share are of `text_tokens`.
absl::StatusOr<std::vector<RunSpec>> RunsFromFlags(int64_t text_tokens);

// Maps the model file and reads its tokenizer.
absl::Status OpenFile(Setup& setup);

// Loads the model for the caches' dtype: the layout's (found on the
// server, which stays connected) or --kv_dtype's (--local).
absl::Status Connect(Setup& setup);

// One sequence per run, each for up to `tokens` tokens.
absl::StatusOr<std::vector<std::unique_ptr<Sequence>>> OpenSequences(
    Setup& setup, const std::vector<RunSpec>& runs, int64_t tokens);

// kvkeep-lm answer (lm_answer_command.cc).
absl::Status AnswerCommand();
// kvkeep-lm quant-error (lm_quant_error.cc).
absl::Status QuantErrorCommand();

}  // namespace kvkeep::lm

#endif  // KVKEEP_SERVICES_LM_LM_CLI_H_
