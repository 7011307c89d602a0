#include "services/lm/emulated_kv.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "kernels/kivi.h"
#include "kernels/quant_format.h"
#include "services/lm/format_emulation.h"

namespace kvkeep::lm {
namespace {

bool ParseCount(const std::string& text, char prefix, int32_t* out) {
  return text.size() > 1 && text[0] == prefix &&
         absl::SimpleAtoi(text.substr(1), out) && *out > 0;
}

}  // namespace

absl::StatusOr<Emulation> Emulation::Parse(const std::string& text) {
  const std::vector<std::string> parts = absl::StrSplit(text, '/');
  const auto bad = [&](const char* why) {
    return absl::InvalidArgumentError(
        absl::StrCat("--emulate=", text, ": ", why,
                     " (expected int8/g32, fp8_e4m3/g32, int4/g32, int2/g32, "
                     "kivi_int4/g32/t32 or kivi_int2/g32/t32)"));
  };
  Emulation e;
  absl::string_view format = parts[0];
  const bool kivi = absl::ConsumePrefix(&format, "kivi_");
  if (format == "int4") {
    e.dtype = DType::kInt4;
  } else if (format == "int2") {
    e.code_bits = 2;
  } else if (format == "int8" && !kivi) {
    e.dtype = DType::kInt8;
  } else if (format == "fp8_e4m3" && !kivi) {
    e.dtype = DType::kFp8E4M3;
  } else {
    return bad("unknown format");
  }
  e.store_pages =
      kivi && parts.size() == 4 && parts[3] == "store" && e.code_bits == 0;
  if (parts.size() != (kivi ? (e.store_pages ? 4u : 3u) : 2u) ||
      !ParseCount(parts[1], 'g', &e.group_size) ||
      (kivi && !ParseCount(parts[2], 't', &e.key_group_tokens))) {
    return bad("no group size");
  }
  if (e.group_size % 2 != 0 || e.key_group_tokens % 2 != 0) {
    return bad("groups of an even size");
  }
  return e;
}

std::string Emulation::Name() const {
  const std::string format =
      code_bits == 2 ? "int2" : std::string(DTypeName(dtype));
  if (key_group_tokens > 0) {
    return absl::StrCat("kivi_", format, "/g", group_size, "/t",
                        key_group_tokens, store_pages ? "/store" : "",
                        " (emulated)");
  }
  return absl::StrCat(format, "/g", group_size, " (emulated)");
}

int64_t Emulation::TokenBytes(int32_t kv_heads, int32_t head_dim) const {
  if (code_bits == 2) {
    // 4 codes a byte; a binary16 scale and a zero point (3 bytes) a group.
    const int64_t width = int64_t{kv_heads} * head_dim;
    return width / 4 + width / group_size * 3;
  }
  return PageLayout{1, kv_heads, head_dim, dtype, group_size}.token_bytes();
}

EmulatedKv::EmulatedKv(const ModelConfig& config, const Emulation& emulation,
                       int64_t capacity_tokens)
    : emulation_(emulation),
      layers_(config.layers),
      kv_heads_(config.kv_heads),
      head_dim_(config.head_dim),
      cache_(config, DType::kF32, capacity_tokens),
      staging_(config.layers) {}

float* EmulatedKv::Tokens(int32_t layer, int kv, int64_t first) {
  // ContiguousKv's arena: [2 (K, V)][capacity][kv_heads][head_dim] floats.
  const int64_t width = int64_t{kv_heads_} * head_dim_;
  float* arena = reinterpret_cast<float*>(cache_.mutable_arena(layer));
  return arena + (kv * cache_.capacity_tokens() + first) * width;
}

absl::Status EmulatedKv::Append(const SequenceStep& step) {
  // Refused before anything is appended (the formats hold finite values).
  for (size_t l = 0; l < step.keys.size() && l < step.values.size(); ++l) {
    for (const std::string* x : {&step.keys[l], &step.values[l]}) {
      for (size_t i = 0; i + sizeof(float) <= x->size(); i += sizeof(float)) {
        float v;
        std::memcpy(&v, x->data() + i, sizeof v);
        if (!std::isfinite(v)) {
          return absl::InvalidArgumentError(
              absl::StrCat("layer ", l, " holds a value ", emulation_.Name(),
                           " cannot (not finite)"));
        }
      }
    }
  }
  const int64_t first = resident();
  if (absl::Status s = cache_.Append(step); !s.ok()) return s;
  const int64_t n = resident() - first;
  if (absl::Status s = RoundNew(first, n); !s.ok()) return s;
  const int64_t g = emulation_.key_group_tokens;
  if (g > 0 && emulation_.store_pages) return RoundOpenGroups(first, n);
  if (g > 0) {
    for (int64_t end = (first / g + 1) * g; end <= first + n; end += g) {
      if (absl::Status s = RoundKeyGroup(end - g); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

absl::Status EmulatedKv::RoundNew(int64_t first, int64_t n) {
  const TokenBlock block{n, kv_heads_, head_dim_};
  std::vector<float> x(n * block.width());
  for (int32_t l = 0; l < layers_; ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      float* tokens = Tokens(l, kv, first);
      for (size_t i = 0; i < x.size(); ++i) {
        x[i] = Bf16ToFloat(FloatToBf16(tokens[i]));
      }
      double bits = 0;
      const bool window = kv == 0 && emulation_.key_group_tokens > 0;
      const std::vector<float> y =
          window ? x
          : emulation_.code_bits == 2
              ? ThroughPerTokenInt(2, emulation_.group_size, x, &bits)
              : ThroughPerToken(block, emulation_.dtype, emulation_.group_size,
                                x, &bits);
      if (y.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("layer ", l, " holds a value ", emulation_.Name(),
                         " cannot (not finite)"));
      }
      std::memcpy(tokens, y.data(), y.size() * sizeof(float));
    }
  }
  return absl::OkStatus();
}

absl::Status EmulatedKv::RoundKeyGroup(int64_t first) {
  const int32_t g = emulation_.key_group_tokens;
  const TokenBlock block{g, kv_heads_, head_dim_};
  for (int32_t l = 0; l < layers_; ++l) {
    float* keys = Tokens(l, 0, first);
    const std::vector<float> x(keys, keys + g * block.width());
    double bits = 0;
    const std::vector<float> y =
        ThroughPerChannel(block, emulation_.key_bits(), g, x, &bits);
    if (y.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer ", l, " holds keys ", emulation_.Name(), " cannot"));
    }
    std::memcpy(keys, y.data(), y.size() * sizeof(float));
  }
  return absl::OkStatus();
}

absl::Status EmulatedKv::RoundOpenGroups(int64_t first, int64_t n) {
  const int32_t g = emulation_.key_group_tokens;
  const PageLayout page{g, kv_heads_, head_dim_, DType::kKiviInt4,
                        emulation_.group_size};
  const int64_t width = page.token_elements();
  std::vector<std::byte> block(page.key_block_bytes());
  for (int32_t l = 0; l < layers_; ++l) {
    std::vector<float>& open = staging_[l];  // tokens [first - open, first)
    for (int64_t begin = first - static_cast<int64_t>(open.size()) / width;
         begin < first + n; begin += g) {
      const int64_t end = std::min<int64_t>(begin + g, first + n);
      const float* fresh = Tokens(l, 0, std::max(begin, first));
      open.insert(open.end(), fresh,
                  fresh + (end - std::max(begin, first)) * width);
      const auto count = static_cast<int32_t>(end - begin);
      if (!QuantizeKiviKeys(page, open.data(), count, block.data()).ok()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "layer ", l, " holds keys ", emulation_.Name(), " cannot"));
      }
      DequantizeKiviKeys(page, block.data(), 0, count, DType::kF32,
                         Tokens(l, 0, begin));
      if (count == g) open.clear();
    }
  }
  return absl::OkStatus();
}

int64_t EmulatedKv::held_bytes() const {
  const int64_t width = int64_t{kv_heads_} * head_dim_;
  const int64_t n = resident();
  const int64_t token_bytes = emulation_.TokenBytes(kv_heads_, head_dim_);
  int64_t keys = n * token_bytes;
  if (const int64_t g = emulation_.key_group_tokens;
      g > 0 && emulation_.store_pages) {
    // The store's pages: a key block a page, open or full, and a page of
    // float32 keys while one is open.
    const int64_t pages = (n + g - 1) / g;
    keys =
        pages * (g * width / 2 + width * 3) + (n % g != 0 ? g * width * 4 : 0);
  } else if (g > 0) {
    // Per group: key_bits codes a channel a token, and a binary16 scale and
    // a zero point (3 bytes) a channel; the tokens after it in bf16.
    const int64_t whole = n / g * g;
    keys = whole * width * emulation_.key_bits() / 8 + whole / g * width * 3 +
           (n - whole) * width * 2;
  }
  return layers_ * (keys + n * token_bytes);
}

}  // namespace kvkeep::lm
