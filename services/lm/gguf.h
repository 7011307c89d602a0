// GgufFile reads a GGUF model file (the format of ggml / llama.cpp, version 2
// or 3): the header, the metadata key/value pairs, the tensor infos and the
// tensor data, which stays in the read-only mapping of the file. Tensors of
// type F32, F16, BF16, Q8_0, Q4_0 and Q4_1 dequantise to float32; any other
// type is refused when it is dequantised (the file itself may hold it).
//
// Every malformed file is refused with INVALID_ARGUMENT and a message naming
// the file and what was wrong (wrong magic or version, a section that runs
// past the end, counts or sizes that do not add up, a tensor whose data lies
// outside the file); a file that cannot be opened or mapped is NOT_FOUND or
// the errno's status. Nothing is read outside the mapping.
//
// The format, for reference (all little-endian):
//   u32 magic "GGUF", u32 version, u64 tensor_count, u64 kv_count,
//   kv_count x { string key, u32 type, value },
//   tensor_count x { string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type,
//                    u64 offset },
//   padding to `general.alignment` (default 32), then the data section; each
//   tensor's offset is relative to the data section and a multiple of the
//   alignment. A string is u64 length + bytes (no terminator).
//
// Thread-safety: immutable after Open; every const method is thread-safe.
#ifndef KVKEEP_SERVICES_LM_GGUF_H_
#define KVKEEP_SERVICES_LM_GGUF_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace kvkeep::lm {

// ggml's tensor types that kvkeep dequantises (ggml.h's numbering).
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ8_0 = 8,
  kBF16 = 30,
};

// A metadata value. Integers of every width are widened to int64 (uint64
// values above INT64_MAX are refused), floats to double; arrays keep their
// element kind (arrays of arrays are refused).
using GgufValue = std::variant<int64_t, double, bool, std::string,
                               std::vector<int64_t>, std::vector<double>,
                               std::vector<bool>, std::vector<std::string>>;

struct GgufTensor {
  std::string name;
  // ggml order: shape[0] is the innermost (contiguous) dimension. A 2-D
  // weight of a linear layer y = W x with x of size n_in has shape
  // {n_in, n_out}: row r (an output) is shape[0] consecutive elements.
  std::vector<int64_t> shape;
  uint32_t type = 0;    // a GgmlType value, or another ggml type
  uint64_t offset = 0;  // in the data section
  uint64_t bytes = 0;   // size of the data (from the type and shape)
  const std::byte* data = nullptr;  // inside the mapping

  int64_t elements() const;
};

class GgufFile {
 public:
  // Maps `path` read-only and parses it.
  static absl::StatusOr<std::unique_ptr<GgufFile>> Open(
      const std::string& path);
  // Parses `bytes` (kept by the GgufFile): for tests and in-memory files.
  static absl::StatusOr<std::unique_ptr<GgufFile>> FromBytes(
      std::string bytes, std::string name = "<memory>");

  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;
  ~GgufFile();

  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  const std::string& name() const { return name_; }  // the path

  const std::map<std::string, GgufValue, std::less<>>& metadata() const {
    return metadata_;
  }
  // Typed look-ups: NOT_FOUND naming the key when it is absent,
  // INVALID_ARGUMENT when it has another type.
  absl::StatusOr<int64_t> GetInt(std::string_view key) const;
  absl::StatusOr<double> GetFloat(std::string_view key) const;  // or an int
  absl::StatusOr<std::string> GetString(std::string_view key) const;
  absl::StatusOr<const std::vector<std::string>*> GetStringArray(
      std::string_view key) const;
  absl::StatusOr<const std::vector<int64_t>*> GetIntArray(
      std::string_view key) const;
  absl::StatusOr<const std::vector<double>*> GetFloatArray(
      std::string_view key) const;

  const std::vector<GgufTensor>& tensors() const { return tensors_; }
  // NOT_FOUND naming the tensor when absent.
  absl::StatusOr<const GgufTensor*> Tensor(std::string_view name) const;

  // Dequantises all of `tensor` into `out` (exactly tensor.elements()
  // floats, in ggml order). INVALID_ARGUMENT for a type kvkeep does not
  // dequantise (naming it) or a wrong output size.
  static absl::Status Dequantize(const GgufTensor& tensor,
                                 absl::Span<float> out);
  // Dequantises into a new vector.
  static absl::StatusOr<std::vector<float>> Dequantize(
      const GgufTensor& tensor);

 private:
  GgufFile() = default;
  absl::Status Parse();

  std::string name_;
  std::string owned_;        // FromBytes
  void* mapping_ = nullptr;  // Open
  size_t mapping_bytes_ = 0;
  const std::byte* base_ = nullptr;
  size_t size_ = 0;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  std::map<std::string, GgufValue, std::less<>> metadata_;
  std::vector<GgufTensor> tensors_;
};

// Bytes of `elements` elements of a ggml type (a multiple of its block
// size), or INVALID_ARGUMENT for an unknown type or a partial block.
absl::StatusOr<uint64_t> GgmlTypeBytes(uint32_t type, int64_t elements);
// "f32", "q4_1", ... or "type N".
std::string GgmlTypeName(uint32_t type);

}  // namespace kvkeep::lm

#endif  // KVKEEP_SERVICES_LM_GGUF_H_
