// ModelConfig (model.h): the hyper-parameters read from a GGUF file's
// llama.* metadata and checked against its tensors; KvFormat, the KV cache's
// format for such a model.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "services/lm/model.h"
#include "services/lm/model_ops.h"

namespace kvkeep::lm {
namespace {

// An int32 metadata value; a missing required key is INVALID_ARGUMENT (the
// file does not describe a model), a missing optional one `fallback`.
absl::StatusOr<int32_t> MetaInt(const GgufFile& file, std::string_view key,
                                std::optional<int32_t> fallback) {
  absl::StatusOr<int64_t> v = file.GetInt(key);
  if (absl::IsNotFound(v.status()) && fallback.has_value()) return *fallback;
  if (!v.ok()) return absl::InvalidArgumentError(v.status().message());
  if (*v < 0 || *v > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(
        file.name(), ": ", std::string(key), " = ", *v, " is out of range"));
  }
  return static_cast<int32_t>(*v);
}

absl::StatusOr<float> MetaFloat(const GgufFile& file, std::string_view key,
                                std::optional<float> fallback) {
  absl::StatusOr<double> v = file.GetFloat(key);
  if (absl::IsNotFound(v.status()) && fallback.has_value()) return *fallback;
  if (!v.ok()) return absl::InvalidArgumentError(v.status().message());
  return static_cast<float>(*v);
}

#define KVKEEP_ASSIGN(lhs, expr)      \
  do {                                \
    auto _v = (expr);                 \
    if (!_v.ok()) return _v.status(); \
    lhs = *std::move(_v);             \
  } while (0)

}  // namespace

std::string ModelConfig::LayerTensor(int32_t layer, std::string_view what) {
  return absl::StrCat("blk.", layer, ".", std::string(what), ".weight");
}

std::vector<std::pair<std::string, std::vector<int64_t>>>
ModelConfig::TensorShapes() const {
  const ModelConfig& c = *this;
  const int64_t e = c.embed, q = int64_t{c.query_heads} * c.head_dim,
                kv = int64_t{c.kv_heads} * c.head_dim, f = c.ffn;
  std::vector<std::pair<std::string, std::vector<int64_t>>> t = {
      {"token_embd.weight", {e, c.vocab}}, {"output_norm.weight", {e}}};
  if (!c.tied_output) t.push_back({"output.weight", {e, c.vocab}});
  for (int32_t l = 0; l < c.layers; ++l) {
    t.push_back({LayerTensor(l, "attn_norm"), {e}});
    t.push_back({LayerTensor(l, "attn_q"), {e, q}});
    t.push_back({LayerTensor(l, "attn_k"), {e, kv}});
    t.push_back({LayerTensor(l, "attn_v"), {e, kv}});
    t.push_back({LayerTensor(l, "attn_output"), {q, e}});
    t.push_back({LayerTensor(l, "ffn_norm"), {e}});
    t.push_back({LayerTensor(l, "ffn_gate"), {e, f}});
    t.push_back({LayerTensor(l, "ffn_up"), {e, f}});
    t.push_back({LayerTensor(l, "ffn_down"), {f, e}});
  }
  return t;
}

absl::Status ModelConfig::Check() const {
  const ModelConfig& c = *this;
  if (c.layers <= 0 || c.embed <= 0 || c.ffn <= 0 || c.query_heads <= 0 ||
      c.kv_heads <= 0 || c.head_dim <= 0 || c.vocab <= 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "model config: a size is not positive (layers %d embed %d ffn %d "
        "heads %d/%d head_dim %d vocab %d)",
        c.layers, c.embed, c.ffn, c.query_heads, c.kv_heads, c.head_dim,
        c.vocab));
  }
  if (c.query_heads % c.kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("llama.attention.head_count_kv (%d) does not divide "
                        "llama.attention.head_count (%d)",
                        c.kv_heads, c.query_heads));
  }
  if (c.head_dim % 2 != 0 || c.head_dim > internal::kMaxHeadDim) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "head_dim %d: RoPE needs an even head_dim of at most %d", c.head_dim,
        internal::kMaxHeadDim));
  }
  if (!(c.rope_theta > 0) || !(c.rms_eps > 0)) {
    return absl::InvalidArgumentError(
        "llama.rope.freq_base and the RMS epsilon must be positive");
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelConfig> ModelConfig::FromGguf(const GgufFile& file) {
  ModelConfig c;
  KVKEEP_ASSIGN(c.architecture, file.GetString("general.architecture"));
  if (c.architecture != "llama") {
    return absl::InvalidArgumentError(
        absl::StrCat(file.name(), ": general.architecture is \"",
                     c.architecture, "\", not \"llama\""));
  }
  c.name = file.GetString("general.name").value_or("");
  KVKEEP_ASSIGN(c.layers, MetaInt(file, "llama.block_count", {}));
  KVKEEP_ASSIGN(c.embed, MetaInt(file, "llama.embedding_length", {}));
  KVKEEP_ASSIGN(c.ffn, MetaInt(file, "llama.feed_forward_length", {}));
  KVKEEP_ASSIGN(c.query_heads, MetaInt(file, "llama.attention.head_count", {}));
  KVKEEP_ASSIGN(c.kv_heads,
                MetaInt(file, "llama.attention.head_count_kv", c.query_heads));
  KVKEEP_ASSIGN(c.context, MetaInt(file, "llama.context_length", 0));
  KVKEEP_ASSIGN(c.rope_theta, MetaFloat(file, "llama.rope.freq_base", 10000));
  KVKEEP_ASSIGN(c.rms_eps,
                MetaFloat(file, "llama.attention.layer_norm_rms_epsilon", {}));
  if (c.query_heads > 0) c.head_dim = c.embed / c.query_heads;
  KVKEEP_ASSIGN(c.head_dim,
                MetaInt(file, "llama.attention.key_length", c.head_dim));
  int32_t rope_dims;
  KVKEEP_ASSIGN(rope_dims,
                MetaInt(file, "llama.rope.dimension_count", c.head_dim));
  int32_t value_dims;
  KVKEEP_ASSIGN(value_dims,
                MetaInt(file, "llama.attention.value_length", c.head_dim));
  if (rope_dims != c.head_dim || value_dims != c.head_dim) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: llama.rope.dimension_count %d / llama.attention.value_length %d "
        "differ from head_dim %d (partial RoPE is not supported)",
        file.name(), rope_dims, value_dims, c.head_dim));
  }
  const std::string scaling =
      file.GetString("llama.rope.scaling.type").value_or("none");
  if (scaling != "none") {
    return absl::InvalidArgumentError(
        absl::StrCat(file.name(), ": llama.rope.scaling.type \"", scaling,
                     "\" is not supported"));
  }
  absl::StatusOr<const GgufTensor*> embd = file.Tensor("token_embd.weight");
  if (!embd.ok()) return absl::InvalidArgumentError(embd.status().message());
  if ((*embd)->shape.size() != 2 || (*embd)->shape[1] > INT32_MAX) {
    return absl::InvalidArgumentError("token_embd.weight is not 2-D");
  }
  c.vocab = static_cast<int32_t>((*embd)->shape[1]);
  c.tied_output = !file.Tensor("output.weight").ok();
  if (absl::Status s = c.Check(); !s.ok()) return s;
  for (const auto& [name, shape] : c.TensorShapes()) {
    absl::StatusOr<const GgufTensor*> t = file.Tensor(name);
    if (!t.ok()) return absl::InvalidArgumentError(t.status().message());
    if ((*t)->shape != shape) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: tensor %s has shape {%s}, the metadata implies {%s}",
          file.name(), name, absl::StrJoin((*t)->shape, ", "),
          absl::StrJoin(shape, ", ")));
    }
  }
  return c;
}

KvFormat KvFormat::Quantized(DType dtype, DType append_dtype,
                             int32_t group_size) {
  KvFormat f(dtype);
  f.append_dtype = append_dtype;
  f.group_size = group_size;
  return f;
}

PageLayout KvFormat::Layout(const ModelConfig& config) const {
  PageLayout layout;
  layout.kv_heads = config.kv_heads;
  layout.head_dim = config.head_dim;
  layout.dtype = dtype;
  layout.group_size = IsQuantized(dtype) ? group_size : 0;
  return layout;
}

std::string KvFormat::Name() const {
  if (!IsQuantized(dtype)) return std::string(DTypeName(dtype));
  return absl::StrCat(std::string(DTypeName(dtype)), "/g", group_size,
                      " (from ", std::string(DTypeName(append_dtype)), ")");
}

absl::Status KvFormat::Check(const ModelConfig& config) const {
  if (IsKivi(dtype)) {
    return absl::UnimplementedError(
        "KV format kivi_int4: the forward pass reads its pages decoded to "
        "f32 (KvFormat::Forward)");
  }
  if (IsQuantized(append_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV format ", Name(), ": the append dtype must be f32, f16 or bf16"));
  }
  if (!IsQuantized(dtype)) {
    if (append_dtype != dtype) {
      return absl::InvalidArgumentError(
          absl::StrCat("KV format ", std::string(DTypeName(dtype)),
                       ": appended as ", std::string(DTypeName(append_dtype)),
                       " (a float cache takes its own dtype)"));
    }
    return absl::OkStatus();
  }
  if (group_size <= 0 || config.head_dim % group_size != 0 ||
      (dtype == DType::kInt4 && group_size % 2 != 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV format ", Name(), ": group size ", group_size,
                     " does not divide head_dim ", config.head_dim,
                     dtype == DType::kInt4 ? " into even groups" : ""));
  }
  return absl::OkStatus();
}

}  // namespace kvkeep::lm
