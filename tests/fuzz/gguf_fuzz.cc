// The GGUF reader (services/lm/gguf.h) over any bytes: a malformed file is
// refused with a status and nothing is read outside it. A file it takes is
// walked the way the model loader walks one: every metadata key through the
// typed look-ups, every tensor's size, and the dequantisation of each
// tensor small enough to (its data must lie inside the file).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "services/lm/gguf.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvkeep::lm;
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::FromBytes(
      std::string(reinterpret_cast<const char*>(data), size), "fuzz.gguf");
  if (!file.ok()) return 0;
  for (const auto& [key, value] : (*file)->metadata()) {
    (void)(*file)->GetInt(key);
    (void)(*file)->GetFloat(key);
    (void)(*file)->GetString(key);
    (void)(*file)->GetStringArray(key);
    (void)(*file)->GetIntArray(key);
    (void)(*file)->GetFloatArray(key);
  }
  for (const GgufTensor& t : (*file)->tensors()) {
    (void)(*file)->Tensor(t.name);
    (void)GgmlTypeName(t.type);
    const int64_t elements = t.elements();
    (void)GgmlTypeBytes(t.type, elements);
    if (elements < 0 || elements > (int64_t{1} << 16)) continue;
    std::vector<float> out(static_cast<size_t>(elements));
    (void)GgufFile::Dequantize(t, absl::MakeSpan(out));
  }
  return 0;
}
