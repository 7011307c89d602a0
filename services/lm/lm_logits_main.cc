// kvkeep-lm-logits: runs token ids through the model as one prefill chunk
// (positions 0..n-1, an empty in-memory cache) and writes the logits of
// every position, float32 little-endian [n][vocab], to a file. For holding
// the forward pass against a reference (Hugging Face transformers).
//
//   kvkeep-lm-logits --model=SmolLM2-135M-Instruct.Q4_1.gguf --ids=1,2,3
//       --out=logits.f32 [--kv_dtype=f32|f16|bf16]
//       [--positions=original|cache]
#include <bit>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "services/lm/contiguous_kv.h"
#include "services/lm/gguf.h"
#include "services/lm/model.h"

ABSL_FLAG(std::string, model, "", "the GGUF model file");
ABSL_FLAG(std::string, ids, "", "token ids, comma-separated");
ABSL_FLAG(std::string, out, "", "where to write the logits [n][vocab] (f32)");
ABSL_FLAG(std::string, kv_dtype, "f32", "the KV cache's dtype: f32, f16, bf16");
ABSL_FLAG(std::string, positions, "original",
          "RoPE positions: original or cache (StreamingLLM's re-indexing)");

namespace kvkeep::lm {
namespace {

absl::StatusOr<std::vector<int32_t>> ParseIds(const std::string& text) {
  std::vector<int32_t> ids;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int32_t id;
    if (!absl::SimpleAtoi(part, &id)) {
      return absl::InvalidArgumentError(absl::StrCat("--ids: bad id ", part));
    }
    ids.push_back(id);
  }
  if (ids.empty()) return absl::InvalidArgumentError("--ids: no ids");
  return ids;
}

absl::StatusOr<DType> ParseDType(const std::string& text) {
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    if (DTypeName(t) == text) return t;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--kv_dtype: ", text, " is not f32, f16 or bf16"));
}

absl::StatusOr<PositionMode> ParsePositions(const std::string& text) {
  if (text == "original") return PositionMode::kOriginal;
  if (text == "cache") return PositionMode::kCachePosition;
  return absl::InvalidArgumentError(
      absl::StrCat("--positions: ", text, " is not original or cache"));
}

absl::Status Run() {
  static_assert(std::endian::native == std::endian::little,
                "the output is the host's float32 bytes");
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) return absl::InvalidArgumentError("--out is required");
  absl::StatusOr<std::vector<int32_t>> ids = ParseIds(absl::GetFlag(FLAGS_ids));
  if (!ids.ok()) return ids.status();
  absl::StatusOr<DType> dtype = ParseDType(absl::GetFlag(FLAGS_kv_dtype));
  if (!dtype.ok()) return dtype.status();
  absl::StatusOr<PositionMode> mode =
      ParsePositions(absl::GetFlag(FLAGS_positions));
  if (!mode.ok()) return mode.status();
  absl::StatusOr<std::unique_ptr<GgufFile>> file =
      GgufFile::Open(absl::GetFlag(FLAGS_model));
  if (!file.ok()) return file.status();
  absl::StatusOr<std::unique_ptr<LlamaModel>> model =
      LlamaModel::Load(**file, *dtype, *mode);
  if (!model.ok()) return model.status();

  const int64_t n = static_cast<int64_t>(ids->size());
  ContiguousKv cache((*model)->config(), *dtype, n);
  std::vector<int64_t> positions(n);
  for (int64_t i = 0; i < n; ++i) positions[i] = i;
  SequenceStep step;
  step.tokens = *ids;
  step.positions = positions;
  step.cache = &cache;
  step.all_logits = true;
  if (absl::Status s = (*model)->Forward(absl::MakeSpan(&step, 1)); !s.ok()) {
    return s;
  }
  std::ofstream f(out, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(step.logits.data()),
          static_cast<std::streamsize>(step.logits.size() * sizeof(float)));
  f.close();
  if (!f) return absl::UnavailableError(absl::StrCat("cannot write ", out));
  return absl::OkStatus();
}

}  // namespace
}  // namespace kvkeep::lm

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "writes the model's logits [n][vocab] (float32) for --ids to --out");
  absl::ParseCommandLine(argc, argv);
  if (absl::Status s = kvkeep::lm::Run(); !s.ok()) {
    std::fprintf(stderr, "kvkeep-lm-logits: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
