#include "services/lm/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>
#include <string_view>
#include <type_traits>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "kernels/dtype.h"
#include "services/lm/ggml_types.h"

namespace kvkeep::lm {
namespace {

static_assert(std::endian::native == std::endian::little,
              "GGUF is read by copying little-endian bytes as they are");

// Status plumbing for this file only: the parse is a long chain of reads,
// each of which may fail.
#define GGUF_RETURN_IF_ERROR(expr)                                \
  do {                                                            \
    if (absl::Status gguf_status_ = (expr); !gguf_status_.ok()) { \
      return gguf_status_;                                        \
    }                                                             \
  } while (false)
#define GGUF_CONCAT_INNER(a, b) a##b
#define GGUF_CONCAT(a, b) GGUF_CONCAT_INNER(a, b)
#define GGUF_ASSIGN_OR_RETURN(lhs, expr) \
  GGUF_ASSIGN_OR_RETURN_IMPL(GGUF_CONCAT(gguf_statusor_, __LINE__), lhs, expr)
#define GGUF_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return std::move(tmp).status();   \
  lhs = *std::move(tmp)

constexpr uint32_t kDefaultAlignment = 32;
constexpr int kMaxDims = 4;  // GGML_MAX_DIMS
// The smallest encodings, to refuse absurd counts before allocating:
// a key/value pair is a key (u64 length) + u32 type + at least one byte; a
// tensor info is a name (u64 length) + u32 n_dims + one u64 dimension + u32
// type + u64 offset.
constexpr uint64_t kMinKvBytes = 8 + 4 + 1;
constexpr uint64_t kMinTensorInfoBytes = 8 + 4 + 8 + 4 + 8;

// ByteReader reads little-endian values from [data, data + size) and refuses
// every read that would pass the end; errors name the file and the offset.
class ByteReader {
 public:
  ByteReader(const std::byte* data, size_t size, absl::string_view file)
      : data_(data), size_(size), file_(file) {}

  absl::string_view file() const { return file_; }
  size_t offset() const { return offset_; }
  size_t remaining() const { return size_ - offset_; }

  // INVALID_ARGUMENT "<file>: <message> (at byte <offset>)".
  absl::Status Error(absl::string_view message) const {
    return absl::InvalidArgumentError(
        absl::StrCat(file_, ": ", message, " (at byte ", offset_, ")"));
  }

  template <typename T>
  absl::StatusOr<T> Read(absl::string_view what) {
    static_assert(std::is_trivially_copyable_v<T>);
    GGUF_RETURN_IF_ERROR(Need(sizeof(T), what));
    T value;
    std::memcpy(&value, data_ + offset_, sizeof(T));
    offset_ += sizeof(T);
    return value;
  }

  // A GGUF string: u64 length, then that many bytes.
  absl::StatusOr<std::string> ReadString(absl::string_view what) {
    GGUF_ASSIGN_OR_RETURN(const uint64_t length, Read<uint64_t>(what));
    GGUF_RETURN_IF_ERROR(Need(length, what));
    std::string s(reinterpret_cast<const char*>(data_ + offset_), length);
    offset_ += length;
    return s;
  }

 private:
  absl::Status Need(uint64_t bytes, absl::string_view what) const {
    if (bytes <= remaining()) return absl::OkStatus();
    return Error(absl::StrCat("truncated: ", what, " needs ", bytes,
                              " bytes but the file has ", remaining(),
                              " left"));
  }

  const std::byte* data_;
  size_t size_;
  size_t offset_ = 0;
  absl::string_view file_;
};

// GGUF metadata value types (gguf.h's gguf_type).
enum ValueType : uint32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kU64 = 10,
  kI64 = 11,
  kF64 = 12,
};

enum class Kind { kInt, kFloat, kBool, kString, kArray, kUnknown };

Kind KindOf(uint32_t type) {
  switch (type) {
    case kU8:
    case kI8:
    case kU16:
    case kI16:
    case kU32:
    case kI32:
    case kU64:
    case kI64:
      return Kind::kInt;
    case kF32:
    case kF64:
      return Kind::kFloat;
    case kBool:
      return Kind::kBool;
    case kString:
      return Kind::kString;
    case kArray:
      return Kind::kArray;
    default:
      return Kind::kUnknown;
  }
}

// Bytes of the smallest encoding of one value of a scalar type.
uint64_t MinValueBytes(uint32_t type) {
  switch (type) {
    case kU16:
    case kI16:
      return 2;
    case kU32:
    case kI32:
    case kF32:
      return 4;
    case kU64:
    case kI64:
    case kF64:
    case kString:  // the length
      return 8;
    default:
      return 1;
  }
}

absl::StatusOr<int64_t> ReadInt(ByteReader& r, uint32_t type,
                                absl::string_view what) {
  switch (type) {
    case kU8:
      return r.Read<uint8_t>(what);
    case kI8:
      return r.Read<int8_t>(what);
    case kU16:
      return r.Read<uint16_t>(what);
    case kI16:
      return r.Read<int16_t>(what);
    case kU32:
      return r.Read<uint32_t>(what);
    case kI32:
      return r.Read<int32_t>(what);
    case kI64:
      return r.Read<int64_t>(what);
    default: {
      GGUF_ASSIGN_OR_RETURN(const uint64_t v, r.Read<uint64_t>(what));
      if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return r.Error(
            absl::StrCat(what, ": u64 value ", v, " does not fit in an int64"));
      }
      return static_cast<int64_t>(v);
    }
  }
}

absl::StatusOr<double> ReadFloat(ByteReader& r, uint32_t type,
                                 absl::string_view what) {
  if (type == kF32) return r.Read<float>(what);
  return r.Read<double>(what);
}

absl::StatusOr<bool> ReadBool(ByteReader& r, absl::string_view what) {
  GGUF_ASSIGN_OR_RETURN(const uint8_t b, r.Read<uint8_t>(what));
  if (b > 1) {
    return r.Error(absl::StrCat(what, ": bool byte is ", b, ", not 0 or 1"));
  }
  return b == 1;
}

// Reads `count` values with `read_one` into a std::vector<T>.
template <typename T, typename ReadOne>
absl::StatusOr<GgufValue> ReadVector(uint64_t count, ReadOne read_one) {
  std::vector<T> values;
  values.reserve(count);
  for (uint64_t i = 0; i < count; ++i) {
    GGUF_ASSIGN_OR_RETURN(T value, read_one());
    values.push_back(std::move(value));
  }
  return GgufValue(std::move(values));
}

// An array value: u32 element type, u64 count, the elements.
absl::StatusOr<GgufValue> ReadArray(ByteReader& r, absl::string_view what) {
  GGUF_ASSIGN_OR_RETURN(const uint32_t type, r.Read<uint32_t>(what));
  GGUF_ASSIGN_OR_RETURN(const uint64_t count, r.Read<uint64_t>(what));
  const Kind kind = KindOf(type);
  if (kind == Kind::kArray) {
    return r.Error(absl::StrCat(what, ": arrays of arrays are not supported"));
  }
  if (kind == Kind::kUnknown) {
    return r.Error(absl::StrCat(what, ": unknown array element type ", type));
  }
  if (count > r.remaining() / MinValueBytes(type)) {
    return r.Error(absl::StrCat(what, ": array of ", count,
                                " elements cannot fit in the ", r.remaining(),
                                " bytes left"));
  }
  switch (kind) {
    case Kind::kInt:
      return ReadVector<int64_t>(count, [&] { return ReadInt(r, type, what); });
    case Kind::kFloat:
      return ReadVector<double>(count,
                                [&] { return ReadFloat(r, type, what); });
    case Kind::kBool:
      return ReadVector<bool>(count, [&] { return ReadBool(r, what); });
    default:
      return ReadVector<std::string>(count, [&] { return r.ReadString(what); });
  }
}

absl::StatusOr<GgufValue> ReadValue(ByteReader& r, uint32_t type,
                                    absl::string_view what) {
  switch (KindOf(type)) {
    case Kind::kInt:
      return ReadInt(r, type, what);
    case Kind::kFloat:
      return ReadFloat(r, type, what);
    case Kind::kBool:
      return ReadBool(r, what);
    case Kind::kString:
      return r.ReadString(what);
    case Kind::kArray:
      return ReadArray(r, what);
    case Kind::kUnknown:
      break;
  }
  return r.Error(absl::StrCat(what, ": unknown value type ", type));
}

struct Header {
  uint32_t version = 0;
  uint64_t tensor_count = 0;
  uint64_t kv_count = 0;
};

absl::StatusOr<Header> ReadHeader(ByteReader& r) {
  GGUF_ASSIGN_OR_RETURN(const auto magic,
                        (r.Read<std::array<char, 4>>("the magic")));
  if (absl::string_view(magic.data(), magic.size()) != "GGUF") {
    return r.Error(absl::StrCat(
        "not a GGUF file: magic is \"",
        absl::CHexEscape(absl::string_view(magic.data(), magic.size())),
        "\", not \"GGUF\""));
  }
  Header h;
  GGUF_ASSIGN_OR_RETURN(h.version, r.Read<uint32_t>("the version"));
  if (h.version == 1) {
    return r.Error("GGUF version 1 is not supported (only 2 and 3)");
  }
  if (h.version != 2 && h.version != 3) {
    return r.Error(absl::StrCat("unsupported GGUF version ", h.version,
                                " (only 2 and 3)"));
  }
  GGUF_ASSIGN_OR_RETURN(h.tensor_count, r.Read<uint64_t>("tensor_count"));
  GGUF_ASSIGN_OR_RETURN(h.kv_count, r.Read<uint64_t>("kv_count"));
  return h;
}

absl::Status ReadMetadata(
    ByteReader& r, uint64_t kv_count,
    std::map<std::string, GgufValue, std::less<>>& metadata) {
  if (kv_count > r.remaining() / kMinKvBytes) {
    return r.Error(absl::StrCat("kv_count ", kv_count, " cannot fit in the ",
                                r.remaining(), " bytes left"));
  }
  for (uint64_t i = 0; i < kv_count; ++i) {
    GGUF_ASSIGN_OR_RETURN(std::string key,
                          r.ReadString(absl::StrCat("metadata key ", i)));
    const std::string what = absl::StrCat("metadata '", key, "'");
    GGUF_ASSIGN_OR_RETURN(const uint32_t type, r.Read<uint32_t>(what));
    GGUF_ASSIGN_OR_RETURN(GgufValue value, ReadValue(r, type, what));
    if (!metadata.emplace(std::move(key), std::move(value)).second) {
      return r.Error(absl::StrCat("duplicate ", what));
    }
  }
  return absl::OkStatus();
}

// general.alignment, or 32: a power of two.
absl::StatusOr<uint64_t> FindAlignment(
    const std::map<std::string, GgufValue, std::less<>>& metadata,
    absl::string_view file) {
  const auto it = metadata.find("general.alignment");
  if (it == metadata.end()) return kDefaultAlignment;
  const int64_t* alignment = std::get_if<int64_t>(&it->second);
  if (alignment == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": general.alignment is not an integer"));
  }
  if (*alignment <= 0 ||
      !std::has_single_bit(static_cast<uint64_t>(*alignment))) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": general.alignment ", *alignment,
                     " is not a nonzero power of two"));
  }
  return static_cast<uint64_t>(*alignment);
}

// One tensor info: name, n_dims, ne[n_dims], type, offset. Checks the shape
// and the type; the offset is checked once the data section is known.
absl::Status ReadTensorInfo(ByteReader& r, GgufTensor& t) {
  GGUF_ASSIGN_OR_RETURN(t.name, r.ReadString("a tensor name"));
  const std::string what = absl::StrCat("tensor '", t.name, "'");
  GGUF_ASSIGN_OR_RETURN(const uint32_t n_dims, r.Read<uint32_t>(what));
  if (n_dims == 0 || n_dims > kMaxDims) {
    return r.Error(
        absl::StrCat(what, ": n_dims ", n_dims, " is not in 1..", kMaxDims));
  }
  int64_t elements = 1;
  for (uint32_t d = 0; d < n_dims; ++d) {
    // A u64 in the file; above INT64_MAX it reads as negative, refused.
    GGUF_ASSIGN_OR_RETURN(const auto ne, r.Read<int64_t>(what));
    if (ne <= 0) {
      return r.Error(
          absl::StrCat(what, ": dimension ", d, " is ", ne, ", not positive"));
    }
    if (elements > std::numeric_limits<int64_t>::max() / ne) {
      return r.Error(absl::StrCat(what, ": the element count overflows"));
    }
    elements *= ne;
    t.shape.push_back(ne);
  }
  GGUF_ASSIGN_OR_RETURN(t.type, r.Read<uint32_t>(what));
  const ggml::TypeTraits* traits = ggml::FindTypeTraits(t.type);
  if (traits == nullptr) {
    return r.Error(absl::StrCat(what, ": unknown ggml type ", t.type));
  }
  if (t.shape[0] % traits->block_elements != 0) {
    return r.Error(absl::StrCat(what, ": shape[0] ", t.shape[0],
                                " is not a multiple of ", traits->name,
                                "'s block of ", traits->block_elements));
  }
  absl::StatusOr<uint64_t> bytes = GgmlTypeBytes(t.type, elements);
  if (!bytes.ok()) {
    return r.Error(absl::StrCat(what, ": ", bytes.status().message()));
  }
  t.bytes = *bytes;
  GGUF_ASSIGN_OR_RETURN(t.offset, r.Read<uint64_t>(what));
  return absl::OkStatus();
}

absl::Status ReadTensorInfos(ByteReader& r, uint64_t tensor_count,
                             std::vector<GgufTensor>& tensors) {
  if (tensor_count > r.remaining() / kMinTensorInfoBytes) {
    return r.Error(absl::StrCat("tensor_count ", tensor_count,
                                " cannot fit in the ", r.remaining(),
                                " bytes left"));
  }
  tensors.resize(tensor_count);
  std::set<absl::string_view> names;
  for (GgufTensor& t : tensors) {
    GGUF_RETURN_IF_ERROR(ReadTensorInfo(r, t));
    if (!names.insert(t.name).second) {
      return r.Error(absl::StrCat("duplicate tensor '", t.name, "'"));
    }
  }
  return absl::OkStatus();
}

// The data section starts at the first multiple of `alignment` after the
// tensor infos (where `r` stands); each tensor's offset is relative to it, a
// multiple of the alignment, and its data lies inside the file.
absl::Status PlaceTensors(const ByteReader& r, uint64_t alignment,
                          const std::byte* base,
                          std::vector<GgufTensor>& tensors) {
  const uint64_t infos_end = r.offset();
  const uint64_t padding = (alignment - infos_end % alignment) % alignment;
  if (padding > r.remaining()) {
    return r.Error(absl::StrCat("truncated: the data section starts ", padding,
                                " bytes on, past the end"));
  }
  const uint64_t data_start = infos_end + padding;
  const uint64_t data_bytes = r.remaining() - padding;
  for (GgufTensor& t : tensors) {
    if (t.offset % alignment != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(r.file(), ": tensor '", t.name, "': offset ", t.offset,
                       " is not a multiple of the alignment ", alignment));
    }
    if (t.offset > data_bytes || t.bytes > data_bytes - t.offset) {
      return absl::InvalidArgumentError(absl::StrCat(
          r.file(), ": tensor '", t.name, "': ", t.bytes, " bytes at offset ",
          t.offset, " run past the end of the ", data_bytes,
          "-byte data section"));
    }
    t.data = base + data_start + t.offset;
  }
  return absl::OkStatus();
}

absl::Status CheckNoOverlap(absl::string_view file,
                            const std::vector<GgufTensor>& tensors) {
  std::vector<const GgufTensor*> by_offset;
  by_offset.reserve(tensors.size());
  for (const GgufTensor& t : tensors) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const GgufTensor* a, const GgufTensor* b) {
              return a->offset < b->offset;
            });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const GgufTensor& prev = *by_offset[i - 1];
    const GgufTensor& next = *by_offset[i];
    if (next.offset < prev.offset + prev.bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(file, ": tensor '", next.name, "' at offset ",
                       next.offset, " overlaps tensor '", prev.name, "' at [",
                       prev.offset, ", ", prev.offset + prev.bytes, ")"));
    }
  }
  return absl::OkStatus();
}

// The header speaks std::string_view; Abseil's StrCat may want its own.
absl::string_view AsAbsl(std::string_view s) { return {s.data(), s.size()}; }

absl::string_view KindName(const GgufValue& value) {
  static constexpr std::array<absl::string_view, 8> kNames = {
      "an integer",       "a float",       "a bool",       "a string",
      "an integer array", "a float array", "a bool array", "a string array"};
  static_assert(std::variant_size_v<GgufValue> == kNames.size());
  return kNames[value.index()];
}

// Finds `key` holding a T: NOT_FOUND or INVALID_ARGUMENT naming it.
template <typename T>
absl::StatusOr<const T*> Lookup(
    const std::map<std::string, GgufValue, std::less<>>& metadata,
    absl::string_view file, std::string_view key, absl::string_view want) {
  const auto it = metadata.find(key);
  if (it == metadata.end()) {
    return absl::NotFoundError(
        absl::StrCat(file, ": no metadata key '", AsAbsl(key), "'"));
  }
  const T* value = std::get_if<T>(&it->second);
  if (value == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": metadata '", AsAbsl(key), "' is ",
                     KindName(it->second), ", not ", want));
  }
  return value;
}

// A tensor kvkeep dequantises: of a supported type, its bytes those of its
// type and shape, and its data present.
absl::Status CheckDequantizable(const GgufTensor& tensor) {
  switch (static_cast<GgmlType>(tensor.type)) {
    case GgmlType::kF32:
    case GgmlType::kF16:
    case GgmlType::kBF16:
    case GgmlType::kQ4_0:
    case GgmlType::kQ4_1:
    case GgmlType::kQ8_0:
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", tensor.name, "' has type ", GgmlTypeName(tensor.type),
          ", which kvkeep does not dequantize (only f32, f16, bf16, q8_0, "
          "q4_0 and q4_1)"));
  }
  const absl::StatusOr<uint64_t> bytes =
      GgmlTypeBytes(tensor.type, tensor.elements());
  if (!bytes.ok() || *bytes != tensor.bytes || tensor.data == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", tensor.name, "' (", GgmlTypeName(tensor.type),
                     "): its data does not match its type and shape"));
  }
  return absl::OkStatus();
}

}  // namespace

int64_t GgufTensor::elements() const {
  uint64_t n = 1;  // unsigned: a hand-made shape may overflow, without UB
  for (const int64_t d : shape) n *= static_cast<uint64_t>(d);
  return static_cast<int64_t>(n);
}

GgufFile::~GgufFile() {
  if (mapping_ != nullptr) munmap(mapping_, mapping_bytes_);
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::Open(
    const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int error = errno;  // ENOENT: NOT_FOUND
    return absl::ErrnoToStatus(error, absl::StrCat(path, ": cannot open"));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int error = errno;
    close(fd);
    return absl::ErrnoToStatus(error, absl::StrCat(path, ": cannot stat"));
  }
  if (!S_ISREG(st.st_mode)) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not a regular file"));
  }
  std::unique_ptr<GgufFile> file(new GgufFile());
  file->name_ = path;
  if (st.st_size > 0) {  // mmap refuses 0 bytes; Parse refuses the file
    void* mapping = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ,
                         MAP_PRIVATE, fd, 0);
    if (mapping == MAP_FAILED) {
      const int error = errno;
      close(fd);
      return absl::ErrnoToStatus(error, absl::StrCat(path, ": cannot mmap"));
    }
    file->mapping_ = mapping;
    file->mapping_bytes_ = static_cast<size_t>(st.st_size);
    file->base_ = static_cast<const std::byte*>(mapping);
    file->size_ = file->mapping_bytes_;
  }
  close(fd);  // the mapping stays valid
  GGUF_RETURN_IF_ERROR(file->Parse());
  return file;
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::FromBytes(
    std::string bytes, std::string name) {
  std::unique_ptr<GgufFile> file(new GgufFile());
  file->name_ = std::move(name);
  file->owned_ = std::move(bytes);
  file->base_ = reinterpret_cast<const std::byte*>(file->owned_.data());
  file->size_ = file->owned_.size();
  GGUF_RETURN_IF_ERROR(file->Parse());
  return file;
}

absl::Status GgufFile::Parse() {
  ByteReader r(base_, size_, name_);
  GGUF_ASSIGN_OR_RETURN(const Header header, ReadHeader(r));
  version_ = header.version;
  GGUF_RETURN_IF_ERROR(ReadMetadata(r, header.kv_count, metadata_));
  GGUF_ASSIGN_OR_RETURN(alignment_, FindAlignment(metadata_, name_));
  GGUF_RETURN_IF_ERROR(ReadTensorInfos(r, header.tensor_count, tensors_));
  if (tensors_.empty()) return absl::OkStatus();  // no data section needed
  GGUF_RETURN_IF_ERROR(PlaceTensors(r, alignment_, base_, tensors_));
  return CheckNoOverlap(name_, tensors_);
}

absl::StatusOr<int64_t> GgufFile::GetInt(std::string_view key) const {
  GGUF_ASSIGN_OR_RETURN(const int64_t* v,
                        Lookup<int64_t>(metadata_, name_, key, "an integer"));
  return *v;
}

absl::StatusOr<double> GgufFile::GetFloat(std::string_view key) const {
  const auto it = metadata_.find(key);
  if (it != metadata_.end()) {
    if (const int64_t* v = std::get_if<int64_t>(&it->second)) {
      return static_cast<double>(*v);
    }
  }
  GGUF_ASSIGN_OR_RETURN(const double* v,
                        Lookup<double>(metadata_, name_, key, "a number"));
  return *v;
}

absl::StatusOr<std::string> GgufFile::GetString(std::string_view key) const {
  GGUF_ASSIGN_OR_RETURN(const std::string* v,
                        Lookup<std::string>(metadata_, name_, key, "a string"));
  return *v;
}

absl::StatusOr<const std::vector<std::string>*> GgufFile::GetStringArray(
    std::string_view key) const {
  return Lookup<std::vector<std::string>>(metadata_, name_, key,
                                          "a string array");
}

absl::StatusOr<const std::vector<int64_t>*> GgufFile::GetIntArray(
    std::string_view key) const {
  return Lookup<std::vector<int64_t>>(metadata_, name_, key,
                                      "an integer array");
}

absl::StatusOr<const std::vector<double>*> GgufFile::GetFloatArray(
    std::string_view key) const {
  return Lookup<std::vector<double>>(metadata_, name_, key, "a float array");
}

absl::StatusOr<const GgufTensor*> GgufFile::Tensor(
    std::string_view name) const {
  for (const GgufTensor& t : tensors_) {
    if (t.name == name) return &t;
  }
  return absl::NotFoundError(
      absl::StrCat(name_, ": no tensor '", AsAbsl(name), "'"));
}

absl::Status GgufFile::Dequantize(const GgufTensor& tensor,
                                  absl::Span<float> out) {
  GGUF_RETURN_IF_ERROR(CheckDequantizable(tensor));
  if (out.size() != static_cast<uint64_t>(tensor.elements())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", tensor.name, "' (", GgmlTypeName(tensor.type), ") has ",
        tensor.elements(), " elements; the output holds ", out.size()));
  }
  const std::byte* data = tensor.data;
  switch (static_cast<GgmlType>(tensor.type)) {
    case GgmlType::kF32:
      std::memcpy(out.data(), data, tensor.bytes);
      break;
    case GgmlType::kF16:
      for (size_t i = 0; i < out.size(); ++i) {
        out[i] = F16ToFloat(ggml::LoadU16(data + 2 * i));
      }
      break;
    case GgmlType::kBF16:
      for (size_t i = 0; i < out.size(); ++i) {
        out[i] = Bf16ToFloat(ggml::LoadU16(data + 2 * i));
      }
      break;
    case GgmlType::kQ4_0:
      ggml::DequantizeQ4_0(data, out);
      break;
    case GgmlType::kQ4_1:
      ggml::DequantizeQ4_1(data, out);
      break;
    case GgmlType::kQ8_0:
      ggml::DequantizeQ8_0(data, out);
      break;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> GgufFile::Dequantize(
    const GgufTensor& tensor) {
  GGUF_RETURN_IF_ERROR(CheckDequantizable(tensor));  // before allocating
  std::vector<float> out(static_cast<size_t>(tensor.elements()));
  GGUF_RETURN_IF_ERROR(Dequantize(tensor, absl::MakeSpan(out)));
  return out;
}

#undef GGUF_ASSIGN_OR_RETURN_IMPL
#undef GGUF_ASSIGN_OR_RETURN
#undef GGUF_CONCAT
#undef GGUF_CONCAT_INNER
#undef GGUF_RETURN_IF_ERROR

}  // namespace kvkeep::lm
