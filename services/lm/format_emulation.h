// Keys or values through a stored format and back, on the CPU twins
// (kernels/quantize.h): what a cache in that format would hand the model.
// For measuring formats against each other on the real model — the stored
// per-token formats, and KIVI's per-channel keys, which the store does not
// have (docs/quantization.md) — in kvkeep-lm quant-error and in the local
// cache's --emulate mode (emulated_kv.h).
#ifndef KVKEEP_SERVICES_LM_FORMAT_EMULATION_H_
#define KVKEEP_SERVICES_LM_FORMAT_EMULATION_H_

#include <cstdint>
#include <vector>

#include "kernels/page_layout.h"

namespace kvkeep::lm {

// n tokens of kv_heads x head_dim elements, token-major: [n][width].
struct TokenBlock {
  int64_t n = 0;
  int32_t kv_heads = 0, head_dim = 0;
  int64_t width() const { return int64_t{kv_heads} * head_dim; }
};

// x through `dtype`'s per-token records (groups of `group` elements along
// head_dim) and back; a float dtype rounds to bf16 (the only float format
// compared). Bits per element, scales and zero points counted, into *bits.
// Empty when x holds a value the format cannot (not finite).
std::vector<float> ThroughPerToken(const TokenBlock& s, DType dtype,
                                   int32_t group, const std::vector<float>& x,
                                   double* bits);

// x through asymmetric integer groups of `code_bits` (4 or 2; binary16 scale
// and a zero point a group, as the store's int4) of `group` consecutive
// elements of each token; the emulation's int2, which is not a stored
// format. Bits per element into *bits; empty as above.
std::vector<float> ThroughPerTokenInt(int32_t code_bits, int32_t group,
                                      const std::vector<float>& x,
                                      double* bits);

// KIVI's keys: asymmetric integers of `code_bits` (4 or 2, as above) per
// channel over groups of `group` consecutive tokens; the tokens after the
// last whole group rounded to bf16 (KIVI's full-precision recent window).
// Bits per element into *bits; empty as above.
std::vector<float> ThroughPerChannel(const TokenBlock& s, int32_t code_bits,
                                     int32_t group, const std::vector<float>& x,
                                     double* bits);

}  // namespace kvkeep::lm

#endif  // KVKEEP_SERVICES_LM_FORMAT_EMULATION_H_
