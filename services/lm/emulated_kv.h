// A local cache (no kvkeepd) that holds float32 but hands the model what a
// quantised cache would: for comparing a format the store does not have
// (KIVI's per-channel keys) with one it has, on the real model and on equal
// terms (docs/quantization.md). Every appended token goes to bf16 first (a
// worker sends bf16 to kvkeepd's quantised layouts), then its values, and
// its keys, through a per-token format (format_emulation.h); with KIVI's
// keys, each group of `key_group_tokens` consecutive tokens goes through
// per-channel int4 once it is whole, its keys held in bf16 until then; or,
// as the store's kivi_int4 layout does (".../store"), the open group's keys
// quantised per channel over the tokens it holds after every append, from
// their bf16 inputs (kernels/kivi.h, the store's own twin).
#ifndef KVKEEP_SERVICES_LM_EMULATED_KV_H_
#define KVKEEP_SERVICES_LM_EMULATED_KV_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "services/lm/contiguous_kv.h"
#include "services/lm/model.h"

namespace kvkeep::lm {

struct Emulation {
  // Per-token groups of group_size elements along head_dim: values, and keys
  // unless KIVI's. A stored format (dtype, through the store's CPU twins),
  // or with code_bits 2, int2: asymmetric 2-bit groups, binary16 scale and a
  // zero point each (not a stored format).
  DType dtype = DType::kInt4;
  int32_t code_bits = 0;
  int32_t group_size = 32;
  // > 0: KIVI's keys, per channel over this many tokens, in int4 (int2 with
  // code_bits 2).
  int32_t key_group_tokens = 0;
  // KIVI's keys as kvkeepd's kivi_int4 holds them (int4 only): the open
  // group quantised as it fills, never held in full precision.
  bool store_pages = false;

  // "int8/g32", "fp8_e4m3/g32", "int4/g32" (the stored formats), "int2/g32",
  // or "kivi_int4/g32/t32", "kivi_int2/g32/t32" (per-channel keys over 32
  // tokens; values as int4/g32, int2/g32), "kivi_int4/g32/t16/store" (the
  // store's layout). INVALID_ARGUMENT naming what is wrong otherwise.
  static absl::StatusOr<Emulation> Parse(const std::string& text);
  std::string Name() const;  // the text Parse reads, and " (emulated)"
  int32_t key_bits() const { return code_bits == 2 ? 2 : 4; }
  // One token's per-token records (keys or values), scales included.
  int64_t TokenBytes(int32_t kv_heads, int32_t head_dim) const;
};

class EmulatedKv : public KvSource {
 public:
  EmulatedKv(const ModelConfig& config, const Emulation& emulation,
             int64_t capacity_tokens);

  // As ContiguousKv::Append (float32 keys and values); INVALID_ARGUMENT,
  // nothing appended, when a value is not finite.
  absl::Status Append(const SequenceStep& step);

  int64_t resident() const { return cache_.resident(); }
  // What the format would hold for the resident tokens, every layer's keys
  // and values, scales and zero points counted.
  int64_t held_bytes() const;

  ResidentKv Layer(int32_t layer) const override { return cache_.Layer(layer); }

 private:
  // Tokens [first, first + n) of every layer's keys (0) or values (1)
  // through the format, in place: per token, or (keys of KIVI) as bf16.
  absl::Status RoundNew(int64_t first, int64_t n);
  // KIVI: the keys of the group starting at `first`, per channel.
  absl::Status RoundKeyGroup(int64_t first);
  // store_pages: the keys of tokens [first, first + n), just appended (bf16
  // in place), and of the open group before them (staging_) quantised per
  // group over the tokens present, in place.
  absl::Status RoundOpenGroups(int64_t first, int64_t n);
  float* Tokens(int32_t layer, int kv, int64_t first);

  Emulation emulation_;
  int32_t layers_, kv_heads_, head_dim_;
  ContiguousKv cache_;                       // float32
  std::vector<std::vector<float>> staging_;  // [layer]: the open group's keys
};

}  // namespace kvkeep::lm

#endif  // KVKEEP_SERVICES_LM_EMULATED_KV_H_
