// Tests of the GGUF reader against files built byte by byte here (every
// metadata type, every dequantised tensor type, odd alignments), malformed
// files of every kind, and the real model when it is present.
#include "services/lm/gguf.h"

#include <gtest/gtest.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

namespace kvkeep::lm {
namespace {

using Ints = std::vector<int64_t>;
using Floats = std::vector<double>;
using Strings = std::vector<std::string>;

::testing::AssertionResult Contains(absl::string_view text,
                                    absl::string_view part) {
  if (absl::StrContains(text, part)) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
         << "\"" << text << "\" does not contain \"" << part << "\"";
}

// GGUF metadata value types.
enum : uint32_t {
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

// ggml type ids that the reader knows the size of but does not dequantise.
constexpr uint32_t kQ5_0 = 6;
constexpr uint32_t kQ4_K = 12;
constexpr uint32_t kQ6_K = 14;
constexpr uint32_t kI32Type = 26;

uint32_t Id(GgmlType t) { return static_cast<uint32_t>(t); }

template <typename T>
std::string Le(T value) {
  std::string s(sizeof(T), '\0');
  std::memcpy(s.data(), &value, sizeof(T));
  return s;
}

std::string Str(std::string_view s) {
  return Le<uint64_t>(s.size()) + std::string(s);
}

// An encoded array value: element type, count, elements.
template <typename T>
std::string Array(uint32_t element_type, const std::vector<T>& values) {
  std::string s = Le(element_type) + Le<uint64_t>(values.size());
  for (const T& v : values) s += Le(v);
  return s;
}

std::string StrArray(const std::vector<std::string>& values) {
  std::string s = Le(kString) + Le<uint64_t>(values.size());
  for (const std::string& v : values) s += Str(v);
  return s;
}

// GgufWriter builds the bytes of a GGUF file: metadata, tensor infos, and a
// data section where each tensor goes at its given offset or, by default, at
// the next multiple of the alignment. Nothing follows the last tensor, so
// cutting any byte off the file makes it invalid.
class GgufWriter {
 public:
  explicit GgufWriter(uint32_t version = 3) : version_(version) {}

  // `value` is already encoded (Le, Str, Array ...).
  GgufWriter& Kv(std::string_view key, uint32_t type, std::string value) {
    kvs_ += Str(key) + Le(type) + value;
    ++kv_count_;
    return *this;
  }
  // Writes general.alignment (u32) and lays the data out with it.
  GgufWriter& Alignment(uint32_t alignment) {
    alignment_ = alignment;
    return Kv("general.alignment", kU32, Le(alignment));
  }
  GgufWriter& Tensor(std::string_view name, std::vector<uint64_t> shape,
                     uint32_t type, std::string data,
                     std::optional<uint64_t> offset = std::nullopt) {
    const uint64_t at =
        offset.value_or((data_end_ + alignment_ - 1) / alignment_ * alignment_);
    data_end_ = std::max(data_end_, at + data.size());
    tensors_.push_back(
        {std::string(name), std::move(shape), type, at, std::move(data)});
    return *this;
  }
  // A tensor info with no data written for it.
  GgufWriter& TensorInfoOnly(std::string_view name, std::vector<uint64_t> shape,
                             uint32_t type, uint64_t offset) {
    tensors_.push_back({std::string(name), std::move(shape), type, offset, ""});
    return *this;
  }

  std::string Build() const {
    std::string out = "GGUF" + Le(version_) + Le<uint64_t>(tensors_.size()) +
                      Le<uint64_t>(kv_count_) + kvs_;
    for (const TensorEntry& t : tensors_) {
      out += Str(t.name) + Le<uint32_t>(t.shape.size());
      for (const uint64_t d : t.shape) out += Le(d);
      out += Le(t.type) + Le(t.offset);
    }
    if (tensors_.empty()) return out;
    out.resize((out.size() + alignment_ - 1) / alignment_ * alignment_, '\0');
    std::string data(data_end_, '\0');
    for (const TensorEntry& t : tensors_) {
      if (!t.data.empty()) data.replace(t.offset, t.data.size(), t.data);
    }
    return out + data;
  }

  // Byte offsets of header fields, for tests that patch them.
  static constexpr size_t kVersionAt = 4;
  static constexpr size_t kTensorCountAt = 8;
  static constexpr size_t kKvCountAt = 16;
  static constexpr size_t kHeaderBytes = 24;

 private:
  struct TensorEntry {
    std::string name;
    std::vector<uint64_t> shape;
    uint32_t type;
    uint64_t offset;
    std::string data;
  };

  uint32_t version_;
  uint64_t alignment_ = 32;
  uint64_t kv_count_ = 0;
  std::string kvs_;
  std::vector<TensorEntry> tensors_;
  uint64_t data_end_ = 0;
};

template <typename T>
void Patch(std::string& bytes, size_t at, T value) {
  std::memcpy(bytes.data() + at, &value, sizeof(T));
}

constexpr char kName[] = "test.gguf";

absl::StatusOr<std::unique_ptr<GgufFile>> Parse(std::string bytes) {
  return GgufFile::FromBytes(std::move(bytes), kName);
}

// Requires `bytes` to be refused with INVALID_ARGUMENT, naming the file and
// saying `what`.
void ExpectRefused(std::string bytes, absl::string_view what) {
  const auto file = Parse(std::move(bytes));
  ASSERT_FALSE(file.ok()) << "accepted; wanted an error about " << what;
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument)
      << file.status();
  EXPECT_TRUE(absl::StartsWith(file.status().message(), kName))
      << file.status().message();
  EXPECT_TRUE(Contains(file.status().message(), what));
}

// --- Tensor data with values the test knows independently -----------------

// f16 bit patterns and the floats they hold exactly.
struct F16Value {
  uint16_t bits;
  float value;
};
constexpr std::array<F16Value, 8> kF16Values = {{
    {0x0000, 0.0f},
    {0x3C00, 1.0f},
    {0x3E00, 1.5f},
    {0xB400, -0.25f},
    {0xC000, -2.0f},
    {0x7BFF, 65504.0f},
    {0x0001, 5.9604644775390625e-08f},  // 2^-24, the smallest subnormal
    {0x2E66, 0.0999755859375f},         // (1 + 614/1024) * 2^-4
}};

// Scales for the quantised blocks: f16 bits and value.
constexpr std::array<F16Value, 4> kScales = {{
    {0x3800, 0.5f},
    {0x2E66, 0.0999755859375f},
    {0xB400, -0.25f},
    {0x4A00, 12.0f},
}};

// A deterministic nibble / byte pattern.
uint8_t Pattern(size_t i, int mod) {
  return static_cast<uint8_t>((i * 7 + 3) % mod);
}

struct Quantized {
  std::string bytes;
  std::vector<float> expected;
};

// Q4_0: f16 d, then byte j holds element j (low nibble) and j + 16 (high);
// x = (q - 8) * d.
Quantized MakeQ4_0(size_t blocks) {
  Quantized q;
  for (size_t b = 0; b < blocks; ++b) {
    const F16Value d = kScales[b % kScales.size()];
    std::array<uint8_t, 32> nib;
    for (size_t j = 0; j < 32; ++j) nib[j] = Pattern(b * 32 + j, 16);
    q.bytes += Le(d.bits);
    for (size_t j = 0; j < 16; ++j) q.bytes += char(nib[j] | nib[j + 16] << 4);
    for (size_t j = 0; j < 32; ++j) {
      q.expected.push_back(static_cast<float>(nib[j] - 8) * d.value);
    }
  }
  return q;
}

// Q4_1: f16 d, f16 m, nibbles as in Q4_0; x = q * d + m.
Quantized MakeQ4_1(size_t blocks) {
  Quantized q;
  for (size_t b = 0; b < blocks; ++b) {
    const F16Value d = kScales[b % kScales.size()];
    const F16Value m = kF16Values[(b + 3) % kF16Values.size()];
    std::array<uint8_t, 32> nib;
    for (size_t j = 0; j < 32; ++j) nib[j] = Pattern(b * 32 + j + 5, 16);
    q.bytes += Le(d.bits) + Le(m.bits);
    for (size_t j = 0; j < 16; ++j) q.bytes += char(nib[j] | nib[j + 16] << 4);
    for (size_t j = 0; j < 32; ++j) {
      q.expected.push_back(static_cast<float>(nib[j]) * d.value + m.value);
    }
  }
  return q;
}

// Q8_0: f16 d, 32 int8; x = q * d.
Quantized MakeQ8_0(size_t blocks) {
  Quantized q;
  for (size_t b = 0; b < blocks; ++b) {
    const F16Value d = kScales[(b + 1) % kScales.size()];
    q.bytes += Le(d.bits);
    for (size_t j = 0; j < 32; ++j) {
      const int8_t v = static_cast<int8_t>(Pattern(b * 32 + j, 256) - 128);
      q.bytes += static_cast<char>(v);
      q.expected.push_back(static_cast<float>(v) * d.value);
    }
  }
  if (blocks > 0) {  // the extremes
    q.bytes[2] = static_cast<char>(-128);
    q.bytes[3] = static_cast<char>(127);
    const float d = kScales[1].value;
    q.expected[0] = -128.0f * d;
    q.expected[1] = 127.0f * d;
  }
  return q;
}

Quantized MakeF32(size_t n) {
  Quantized q;
  for (size_t i = 0; i < n; ++i) {
    const float v = (static_cast<float>(i) - 7.25f) * 0.375f;
    q.bytes += Le(v);
    q.expected.push_back(v);
  }
  q.bytes.replace(0, 4, Le(std::numeric_limits<float>::infinity()));
  q.expected[0] = std::numeric_limits<float>::infinity();
  return q;
}

Quantized MakeF16(size_t n) {
  Quantized q;
  for (size_t i = 0; i < n; ++i) {
    const F16Value v = kF16Values[i % kF16Values.size()];
    q.bytes += Le(v.bits);
    q.expected.push_back(v.value);
  }
  return q;
}

// bf16 is the top half of a float32: floats whose low 16 bits are zero.
Quantized MakeBf16(size_t n) {
  Quantized q;
  for (size_t i = 0; i < n; ++i) {
    const float v = std::ldexp(static_cast<float>(i % 13) - 6.0f,
                               static_cast<int>(i % 9) - 4);
    const uint32_t bits = std::bit_cast<uint32_t>(v);
    EXPECT_EQ(bits & 0xffffu, 0u);
    q.bytes += Le(static_cast<uint16_t>(bits >> 16));
    q.expected.push_back(v);
  }
  return q;
}

void ExpectSameFloats(const std::vector<float>& got,
                      const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i]))
        << "element " << i << ": " << got[i] << " vs " << want[i];
  }
}

// A file with one tensor of each dequantised type (plus a Q5_0 one) and a
// few metadata values, laid out with `alignment` (0: the default, unwritten).
struct Sample {
  std::string bytes;
  std::vector<std::pair<std::string, Quantized>> tensors;  // name, data
};

Sample MakeSample(uint32_t alignment, uint32_t version = 3) {
  GgufWriter w(version);
  if (alignment != 0) w.Alignment(alignment);
  w.Kv("general.architecture", kString, Str("llama"));
  w.Kv("llama.block_count", kU32, Le<uint32_t>(2));
  w.Kv("tokenizer.ggml.tokens", kArray, StrArray({"<s>", "a", ""}));
  Sample s;
  s.tensors = {{"f32", MakeF32(5)},    {"f16", MakeF16(6)},
               {"bf16", MakeBf16(14)}, {"q8_0", MakeQ8_0(3)},
               {"q4_0", MakeQ4_0(4)},  {"q4_1", MakeQ4_1(6)}};
  w.Tensor("f32", {5}, Id(GgmlType::kF32), s.tensors[0].second.bytes);
  w.Tensor("f16", {3, 2}, Id(GgmlType::kF16), s.tensors[1].second.bytes);
  w.Tensor("bf16", {7, 1, 2}, Id(GgmlType::kBF16), s.tensors[2].second.bytes);
  w.Tensor("q8_0", {32, 3}, Id(GgmlType::kQ8_0), s.tensors[3].second.bytes);
  w.Tensor("q5_0", {64}, kQ5_0, std::string(2 * 22, '\x11'));
  w.Tensor("q4_0", {64, 1, 2}, Id(GgmlType::kQ4_0), s.tensors[4].second.bytes);
  w.Tensor("q4_1", {32, 3, 1, 2}, Id(GgmlType::kQ4_1),
           s.tensors[5].second.bytes);
  s.bytes = w.Build();
  return s;
}

void ExpectSampleReadsBack(const GgufFile& file, const Sample& s,
                           uint64_t alignment) {
  EXPECT_EQ(file.alignment(), alignment);
  EXPECT_EQ(file.tensors().size(), 7u);
  EXPECT_EQ(*file.GetString("general.architecture"), "llama");
  for (const auto& [name, q] : s.tensors) {
    SCOPED_TRACE(name);
    const auto t = file.Tensor(name);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ((*t)->offset % alignment, 0u);
    EXPECT_EQ((*t)->bytes, q.bytes.size());
    const auto values = GgufFile::Dequantize(**t);
    ASSERT_TRUE(values.ok()) << values.status();
    ExpectSameFloats(*values, q.expected);
  }
  const auto q5 = file.Tensor("q5_0");
  ASSERT_TRUE(q5.ok());
  EXPECT_EQ((*q5)->bytes, 44u);
  EXPECT_EQ((*q5)->type, kQ5_0);
}

// --- Reading valid files ---------------------------------------------------

TEST(GgufTest, ReadsEveryTensorTypeAtEveryAlignment) {
  for (const uint32_t alignment : {0u, 1u, 2u, 8u, 32u, 64u, 256u}) {
    SCOPED_TRACE(alignment);
    const Sample s = MakeSample(alignment);
    const auto file = Parse(s.bytes);
    ASSERT_TRUE(file.ok()) << file.status();
    EXPECT_EQ((*file)->version(), 3u);
    EXPECT_EQ((*file)->name(), kName);
    ExpectSampleReadsBack(**file, s, alignment == 0 ? 32 : alignment);
  }
}

TEST(GgufTest, ReadsVersion2) {
  const Sample s = MakeSample(16, /*version=*/2);
  const auto file = Parse(s.bytes);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->version(), 2u);
  ExpectSampleReadsBack(**file, s, 16);
}

TEST(GgufTest, KeepsShapeTypeAndPlacement) {
  const Sample s = MakeSample(64);
  const auto file = Parse(s.bytes);
  ASSERT_TRUE(file.ok()) << file.status();
  const GgufTensor& q41 = **(*file)->Tensor("q4_1");
  EXPECT_EQ(q41.shape, (Ints{32, 3, 1, 2}));
  EXPECT_EQ(q41.elements(), 192);
  EXPECT_EQ(q41.type, Id(GgmlType::kQ4_1));
  EXPECT_EQ(q41.bytes, 6u * 20u);
  const GgufTensor& bf16 = **(*file)->Tensor("bf16");
  EXPECT_EQ(bf16.shape, (Ints{7, 1, 2}));
  // The tensors follow one another in the order written.
  std::vector<std::string> names;
  for (const GgufTensor& t : (*file)->tensors()) names.push_back(t.name);
  EXPECT_EQ(names,
            (Strings{"f32", "f16", "bf16", "q8_0", "q5_0", "q4_0", "q4_1"}));
  // The data points into the bytes at the data section.
  const GgufTensor& f32 = (*file)->tensors()[0];
  float first;
  std::memcpy(&first, f32.data, sizeof first);
  EXPECT_EQ(first, std::numeric_limits<float>::infinity());
}

TEST(GgufTest, ReadsEveryMetadataType) {
  GgufWriter w;
  w.Kv("u8", kU8, Le<uint8_t>(200))
      .Kv("i8", kI8, Le<int8_t>(-100))
      .Kv("u16", kU16, Le<uint16_t>(60000))
      .Kv("i16", kI16, Le<int16_t>(-30000))
      .Kv("u32", kU32, Le<uint32_t>(4000000000u))
      .Kv("i32", kI32, Le<int32_t>(-2000000000))
      .Kv("f32", kF32, Le<float>(1.5f))
      .Kv("bool_true", kBool, Le<uint8_t>(1))
      .Kv("bool_false", kBool, Le<uint8_t>(0))
      .Kv("string", kString, Str("héllo"))
      .Kv("empty_string", kString, Str(""))
      .Kv("u64", kU64, Le<uint64_t>(std::numeric_limits<int64_t>::max()))
      .Kv("i64", kI64, Le<int64_t>(std::numeric_limits<int64_t>::min()))
      .Kv("f64", kF64, Le<double>(0.1))
      .Kv("a_u8", kArray, Array<uint8_t>(kU8, {0, 255}))
      .Kv("a_i8", kArray, Array<int8_t>(kI8, {-128, 127}))
      .Kv("a_u16", kArray, Array<uint16_t>(kU16, {65535}))
      .Kv("a_i16", kArray, Array<int16_t>(kI16, {-32768}))
      .Kv("a_u32", kArray, Array<uint32_t>(kU32, {4294967295u, 0}))
      .Kv("a_i32", kArray, Array<int32_t>(kI32, {-5, 6, -7}))
      .Kv("a_u64", kArray, Array<uint64_t>(kU64, {1ull << 62}))
      .Kv("a_i64", kArray, Array<int64_t>(kI64, {-(1ll << 62)}))
      .Kv("a_f32", kArray, Array<float>(kF32, {0.25f, -3.0f}))
      .Kv("a_f64", kArray, Array<double>(kF64, {1e300, -0.1}))
      .Kv("a_bool", kArray, Array<uint8_t>(kBool, {1, 0, 1}))
      .Kv("a_string", kArray, StrArray({"x", "", "yz"}))
      .Kv("a_empty", kArray, Array<uint32_t>(kU32, {}));
  const auto parsed = Parse(w.Build());
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  const GgufFile& f = **parsed;
  EXPECT_EQ(f.metadata().size(), 27u);
  EXPECT_TRUE(f.tensors().empty());
  EXPECT_EQ(*f.GetInt("u8"), 200);
  EXPECT_EQ(*f.GetInt("i8"), -100);
  EXPECT_EQ(*f.GetInt("u16"), 60000);
  EXPECT_EQ(*f.GetInt("i16"), -30000);
  EXPECT_EQ(*f.GetInt("u32"), 4000000000);
  EXPECT_EQ(*f.GetInt("i32"), -2000000000);
  EXPECT_EQ(*f.GetFloat("f32"), 1.5);
  EXPECT_EQ(std::get<bool>(f.metadata().find("bool_true")->second), true);
  EXPECT_EQ(std::get<bool>(f.metadata().find("bool_false")->second), false);
  EXPECT_EQ(*f.GetString("string"), "héllo");
  EXPECT_EQ(*f.GetString("empty_string"), "");
  EXPECT_EQ(*f.GetInt("u64"), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(*f.GetInt("i64"), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(*f.GetFloat("f64"), 0.1);
  EXPECT_EQ(*f.GetFloat("u16"), 60000.0);  // an integer reads as a float
  EXPECT_EQ(**f.GetIntArray("a_u8"), (Ints{0, 255}));
  EXPECT_EQ(**f.GetIntArray("a_i8"), (Ints{-128, 127}));
  EXPECT_EQ(**f.GetIntArray("a_u16"), (Ints{65535}));
  EXPECT_EQ(**f.GetIntArray("a_i16"), (Ints{-32768}));
  EXPECT_EQ(**f.GetIntArray("a_u32"), (Ints{4294967295, 0}));
  EXPECT_EQ(**f.GetIntArray("a_i32"), (Ints{-5, 6, -7}));
  EXPECT_EQ(**f.GetIntArray("a_u64"), (Ints{1ll << 62}));
  EXPECT_EQ(**f.GetIntArray("a_i64"), (Ints{-(1ll << 62)}));
  EXPECT_EQ(**f.GetFloatArray("a_f32"), (Floats{0.25, -3.0}));
  EXPECT_EQ(**f.GetFloatArray("a_f64"), (Floats{1e300, -0.1}));
  EXPECT_EQ(std::get<std::vector<bool>>(f.metadata().find("a_bool")->second),
            (std::vector<bool>{true, false, true}));
  EXPECT_EQ(**f.GetStringArray("a_string"), (Strings{"x", "", "yz"}));
  EXPECT_TRUE((*f.GetIntArray("a_empty"))->empty());
}

TEST(GgufTest, TypedLookupsSayWhatIsWrong) {
  const auto file = Parse(MakeSample(0).bytes);
  ASSERT_TRUE(file.ok()) << file.status();
  const GgufFile& f = **file;
  const auto missing = f.GetInt("llama.nope");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Contains(missing.status().message(), "llama.nope"));
  const auto wrong = f.GetInt("general.architecture");
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(wrong.status().message(), "general.architecture"));
  EXPECT_TRUE(Contains(wrong.status().message(), "a string"));
  EXPECT_EQ(f.GetFloat("general.architecture").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(f.GetString("llama.block_count").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(f.GetIntArray("tokenizer.ggml.tokens").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(f.GetFloatArray("tokenizer.ggml.tokens").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(f.GetStringArray("llama.block_count").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(f.GetStringArray("absent").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(**f.GetStringArray("tokenizer.ggml.tokens"),
            (Strings{"<s>", "a", ""}));
  const auto no_tensor = f.Tensor("output.weight");
  EXPECT_EQ(no_tensor.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Contains(no_tensor.status().message(), "output.weight"));
}

TEST(GgufTest, OpensAFileOnDisk) {
  const Sample s = MakeSample(64);
  const std::string path = ::testing::TempDir() + "/gguf_test_open.gguf";
  {
    std::ofstream out(path, std::ios::binary);
    out.write(s.bytes.data(), static_cast<std::streamsize>(s.bytes.size()));
  }
  const auto file = GgufFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->name(), path);
  ExpectSampleReadsBack(**file, s, 64);
  std::remove(path.c_str());
}

TEST(GgufTest, OpenRefusesMissingEmptyAndDirectory) {
  const std::string missing = ::testing::TempDir() + "/gguf_test_absent.gguf";
  const auto absent = GgufFile::Open(missing);
  EXPECT_EQ(absent.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Contains(absent.status().message(), missing));

  const std::string empty = ::testing::TempDir() + "/gguf_test_empty.gguf";
  std::ofstream(empty, std::ios::binary).close();
  const auto e = GgufFile::Open(empty);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(e.status().message(), empty));
  std::remove(empty.c_str());

  const auto dir = GgufFile::Open(::testing::TempDir());
  EXPECT_EQ(dir.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(GgufTest, ParsesUnsupportedTypesButRefusesToDequantizeThem) {
  GgufWriter w;
  w.Tensor("q5_0", {32, 2}, kQ5_0, std::string(44, '\0'))
      .Tensor("q4_k", {256}, kQ4_K, std::string(144, '\0'))
      .Tensor("q6_k", {512}, kQ6_K, std::string(420, '\0'))
      .Tensor("i32", {3}, kI32Type, std::string(12, '\0'));
  const auto file = Parse(w.Build());
  ASSERT_TRUE(file.ok()) << file.status();
  for (const auto& [name, type_name] :
       std::vector<std::pair<std::string, std::string>>{{"q5_0", "q5_0"},
                                                        {"q4_k", "q4_K"},
                                                        {"q6_k", "q6_K"},
                                                        {"i32", "i32"}}) {
    const GgufTensor& t = **(*file)->Tensor(name);
    const auto values = GgufFile::Dequantize(t);
    EXPECT_EQ(values.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(Contains(values.status().message(), type_name));
    EXPECT_TRUE(Contains(values.status().message(), name));
  }
}

TEST(GgufTest, DequantizeChecksTheOutputSize) {
  const auto file = Parse(MakeSample(0).bytes);
  ASSERT_TRUE(file.ok()) << file.status();
  const GgufTensor& t = **(*file)->Tensor("q4_1");
  std::vector<float> out(t.elements() - 1);
  const absl::Status s = GgufFile::Dequantize(t, absl::MakeSpan(out));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s.message(), "q4_1"));
  out.resize(t.elements() + 1);
  EXPECT_FALSE(GgufFile::Dequantize(t, absl::MakeSpan(out)).ok());
  // A hand-made tensor whose byte count does not match is refused too.
  GgufTensor bad = t;
  bad.bytes -= 1;
  EXPECT_FALSE(GgufFile::Dequantize(bad).ok());
  // ... and one whose shape is absurd, before anything is allocated.
  GgufTensor huge = t;
  huge.type = Id(GgmlType::kF32);
  huge.shape = {1ll << 40, 1ll << 40};
  EXPECT_EQ(GgufFile::Dequantize(huge).status().code(),
            absl::StatusCode::kInvalidArgument);
  GgufTensor no_data = t;
  no_data.data = nullptr;
  EXPECT_FALSE(GgufFile::Dequantize(no_data).ok());
}

TEST(GgufTest, TypeSizesAndNames) {
  struct Case {
    uint32_t type;
    int64_t elements;
    uint64_t bytes;
    std::string_view name;
  };
  // Block sizes from ggml-common.h.
  for (const Case& c :
       std::vector<Case>{{0, 3, 12, "f32"},      {1, 3, 6, "f16"},
                         {2, 64, 36, "q4_0"},    {3, 64, 40, "q4_1"},
                         {6, 32, 22, "q5_0"},    {7, 32, 24, "q5_1"},
                         {8, 96, 102, "q8_0"},   {9, 32, 36, "q8_1"},
                         {10, 256, 84, "q2_K"},  {11, 256, 110, "q3_K"},
                         {12, 512, 288, "q4_K"}, {13, 256, 176, "q5_K"},
                         {14, 256, 210, "q6_K"}, {15, 256, 292, "q8_K"},
                         {24, 5, 5, "i8"},       {25, 5, 10, "i16"},
                         {26, 5, 20, "i32"},     {27, 5, 40, "i64"},
                         {28, 5, 40, "f64"},     {30, 5, 10, "bf16"}}) {
    SCOPED_TRACE(c.name);
    EXPECT_EQ(*GgmlTypeBytes(c.type, c.elements), c.bytes);
    EXPECT_EQ(GgmlTypeName(c.type), c.name);
  }
  EXPECT_FALSE(GgmlTypeBytes(2, 48).ok());  // a partial block
  EXPECT_FALSE(GgmlTypeBytes(0, -1).ok());
  EXPECT_FALSE(GgmlTypeBytes(28, std::numeric_limits<int64_t>::max()).ok());
  for (const uint32_t unknown : {4u, 5u, 31u, 36u, 1000u}) {
    const auto bytes = GgmlTypeBytes(unknown, 32);
    EXPECT_EQ(bytes.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(Contains(bytes.status().message(), std::to_string(unknown)));
    EXPECT_EQ(GgmlTypeName(unknown), "type " + std::to_string(unknown));
  }
}

// --- Malformed files -------------------------------------------------------

TEST(GgufTest, RefusesEveryTruncation) {
  for (const uint32_t alignment : {0u, 1u, 64u}) {
    const std::string bytes = MakeSample(alignment).bytes;
    ASSERT_TRUE(Parse(bytes).ok());
    for (size_t n = 0; n < bytes.size(); ++n) {
      const auto file = Parse(bytes.substr(0, n));
      ASSERT_FALSE(file.ok()) << "a prefix of " << n << " of " << bytes.size()
                              << " bytes was accepted";
      ASSERT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument)
          << file.status();
      ASSERT_TRUE(absl::StartsWith(file.status().message(), kName))
          << file.status().message();
    }
  }
}

TEST(GgufTest, RefusesEveryTruncationOfMetadata) {
  GgufWriter w;
  w.Kv("a", kU64, Le<uint64_t>(1))
      .Kv("b", kString, Str("text"))
      .Kv("c", kArray, StrArray({"p", "qr"}))
      .Kv("d", kArray, Array<double>(kF64, {1.0, 2.0}))
      .Kv("e", kBool, Le<uint8_t>(1));
  const std::string bytes = w.Build();
  ASSERT_TRUE(Parse(bytes).ok());
  for (size_t n = 0; n < bytes.size(); ++n) {
    const auto file = Parse(bytes.substr(0, n));
    ASSERT_FALSE(file.ok()) << n;
    ASSERT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(GgufTest, RefusesWrongMagicAndVersions) {
  std::string bytes = MakeSample(0).bytes;
  std::string wrong_magic = bytes;
  wrong_magic[0] = 'g';
  ExpectRefused(wrong_magic, "magic");
  for (const uint32_t version : {0u, 4u, 0x03000000u}) {
    std::string b = bytes;
    Patch(b, GgufWriter::kVersionAt, version);
    ExpectRefused(b, "version " + std::to_string(version));
  }
  std::string v1 = bytes;
  Patch<uint32_t>(v1, GgufWriter::kVersionAt, 1);
  ExpectRefused(v1, "version 1 is not supported");
}

TEST(GgufTest, RefusesAbsurdCounts) {
  const std::string bytes = MakeSample(0).bytes;
  std::string kvs = bytes;
  Patch<uint64_t>(kvs, GgufWriter::kKvCountAt, 1ull << 60);
  ExpectRefused(kvs, "kv_count");
  std::string tensors = bytes;
  Patch<uint64_t>(tensors, GgufWriter::kTensorCountAt, 1ull << 60);
  ExpectRefused(tensors, "tensor_count");
  Patch<uint64_t>(tensors, GgufWriter::kTensorCountAt, ~0ull);
  ExpectRefused(tensors, "tensor_count");
  // Too many tensors that would fit, but the infos run out.
  Patch<uint64_t>(tensors, GgufWriter::kTensorCountAt, 9);
  ExpectRefused(tensors, "");

  GgufWriter big_array;
  big_array.Kv("a", kArray, Le(kU32) + Le<uint64_t>(1ull << 60));
  ExpectRefused(big_array.Build(), "array of 1152921504606846976 elements");
  GgufWriter big_strings;
  big_strings.Kv("a", kArray, Le(kString) + Le<uint64_t>(~0ull) + Str("x"));
  ExpectRefused(big_strings.Build(), "array of");
}

TEST(GgufTest, RefusesStringsPastTheEnd) {
  GgufWriter key;
  key.Kv("k", kU8, Le<uint8_t>(1));
  std::string bytes = key.Build();
  Patch<uint64_t>(bytes, GgufWriter::kHeaderBytes, ~0ull);  // key length
  ExpectRefused(bytes, "truncated");

  GgufWriter value;
  value.Kv("k", kString, Le<uint64_t>(1ull << 40) + "abc");
  ExpectRefused(value.Build(), "truncated");

  GgufWriter name;
  name.TensorInfoOnly("t", {4}, 0, 0);
  bytes = name.Build();
  Patch<uint64_t>(bytes, GgufWriter::kHeaderBytes, 1ull << 50);
  ExpectRefused(bytes, "truncated");
}

TEST(GgufTest, RefusesBadMetadataValues) {
  ExpectRefused(GgufWriter()
                    .Kv("nested", kArray,
                        Le(kArray) + Le<uint64_t>(1) + Array<uint8_t>(kU8, {1}))
                    .Build(),
                "arrays of arrays");
  ExpectRefused(GgufWriter().Kv("t", 13, Le<uint32_t>(0)).Build(),
                "unknown value type 13");
  ExpectRefused(
      GgufWriter().Kv("a", kArray, Le<uint32_t>(77) + Le<uint64_t>(0)).Build(),
      "unknown array element type 77");
  ExpectRefused(GgufWriter().Kv("b", kBool, Le<uint8_t>(2)).Build(), "bool");
  ExpectRefused(GgufWriter().Kv("big", kU64, Le<uint64_t>(1ull << 63)).Build(),
                "does not fit in an int64");
  ExpectRefused(
      GgufWriter().Kv("big", kArray, Array<uint64_t>(kU64, {~0ull})).Build(),
      "does not fit in an int64");
  ExpectRefused(GgufWriter()
                    .Kv("dup", kU8, Le<uint8_t>(1))
                    .Kv("dup", kString, Str("x"))
                    .Build(),
                "duplicate metadata 'dup'");
}

TEST(GgufTest, RefusesInvalidAlignment) {
  for (const uint32_t alignment : {0u, 3u, 48u, 0x80000001u}) {
    GgufWriter w;
    w.Kv("general.alignment", kU32, Le(alignment));
    ExpectRefused(w.Build(), "general.alignment " + std::to_string(alignment));
  }
  GgufWriter negative;
  negative.Kv("general.alignment", kI32, Le<int32_t>(-32));
  ExpectRefused(negative.Build(), "general.alignment -32");
  GgufWriter text;
  text.Kv("general.alignment", kString, Str("32"));
  ExpectRefused(text.Build(), "general.alignment is not an integer");
}

TEST(GgufTest, RefusesBadShapes) {
  const uint32_t f32 = Id(GgmlType::kF32);
  ExpectRefused(GgufWriter().TensorInfoOnly("t", {}, f32, 0).Build(),
                "tensor 't': n_dims 0");
  ExpectRefused(
      GgufWriter().TensorInfoOnly("t", {1, 1, 1, 1, 1}, f32, 0).Build(),
      "n_dims 5");
  ExpectRefused(GgufWriter().TensorInfoOnly("t", {4, 0}, f32, 0).Build(),
                "dimension 1 is 0");
  ExpectRefused(GgufWriter().TensorInfoOnly("t", {~0ull}, f32, 0).Build(),
                "dimension 0 is -1");
  ExpectRefused(GgufWriter()
                    .TensorInfoOnly("t", {1ull << 32, 1ull << 32}, f32, 0)
                    .Build(),
                "overflows");
  // 2^61 f32 elements: a valid size of 2^63 bytes, far past the end.
  ExpectRefused(GgufWriter()
                    .TensorInfoOnly("t", {1ull << 30, 1ull << 31}, f32, 0)
                    .Build(),
                "run past the end");
  // 2^62 f64 elements fit an int64 but their 2^65 bytes do not fit a u64.
  ExpectRefused(GgufWriter()
                    .TensorInfoOnly("t", {1ull << 61, 2}, 28, 0)  // f64
                    .Build(),
                "overflow a byte count");
  ExpectRefused(
      GgufWriter().TensorInfoOnly("t", {48}, Id(GgmlType::kQ4_0), 0).Build(),
      "shape[0] 48 is not a multiple of q4_0's block of 32");
}

TEST(GgufTest, RefusesUnknownTypes) {
  for (const uint32_t type : {4u, 33u, 38u, 40u, 0xffffffffu}) {
    ExpectRefused(GgufWriter().TensorInfoOnly("t", {32}, type, 0).Build(),
                  "unknown ggml type " + std::to_string(type));
  }
}

TEST(GgufTest, RefusesDuplicateTensors) {
  GgufWriter w;
  w.Tensor("t", {4}, 0, std::string(16, '\0'))
      .Tensor("t", {4}, 0, std::string(16, '\0'));
  ExpectRefused(w.Build(), "duplicate tensor 't'");
}

TEST(GgufTest, RefusesMisalignedOffsets) {
  GgufWriter w;
  w.Alignment(64).Tensor("a", {4}, 0, std::string(16, '\0'), 32);
  ExpectRefused(w.Build(), "offset 32 is not a multiple of the alignment 64");
  GgufWriter odd;
  odd.Tensor("a", {4}, 0, std::string(16, '\0'), 1);
  ExpectRefused(odd.Build(), "offset 1 is not a multiple");
}

TEST(GgufTest, RefusesOverlappingData) {
  GgufWriter w;
  w.Alignment(16)
      .Tensor("a", {8}, 0, std::string(32, '\0'), 0)
      .Tensor("b", {8}, 0, std::string(32, '\0'), 64)
      .Tensor("c", {8}, 0, std::string(32, '\0'), 16);
  ExpectRefused(w.Build(), "tensor 'c' at offset 16 overlaps tensor 'a'");
  GgufWriter same;
  same.Tensor("a", {8}, 0, std::string(32, '\0'), 0)
      .Tensor("b", {8}, 0, std::string(32, '\0'), 0);
  ExpectRefused(same.Build(), "overlaps");
  // Touching is fine.
  GgufWriter touching;
  touching.Alignment(16)
      .Tensor("a", {8}, 0, std::string(32, '\0'), 32)
      .Tensor("b", {8}, 0, std::string(32, '\0'), 0);
  EXPECT_TRUE(Parse(touching.Build()).ok());
}

TEST(GgufTest, RefusesDataOutsideTheFile) {
  GgufWriter far;
  far.Tensor("a", {4}, 0, std::string(16, '\0'))
      .TensorInfoOnly("b", {4}, 0, 1ull << 40);
  ExpectRefused(far.Build(), "tensor 'b': 16 bytes at offset 1099511627776");
  GgufWriter wraps;
  wraps.Tensor("a", {4}, 0, std::string(16, '\0'))
      .TensorInfoOnly("b", {4}, 0, ~0ull - 31);
  ExpectRefused(wraps.Build(), "run past the end");
}

// Random byte flips of a valid file: each is accepted or refused, never read
// out of bounds (ASan) nor crashes; what is accepted dequantises or refuses.
TEST(GgufTest, SurvivesRandomCorruption) {
  const std::string bytes = MakeSample(8).bytes;
  std::mt19937 rng(1234);
  std::uniform_int_distribution<size_t> at(0, bytes.size() - 1);
  std::uniform_int_distribution<int> byte(0, 255);
  int accepted = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    std::string b = bytes;
    const int flips = 1 + trial % 4;
    for (int i = 0; i < flips; ++i) b[at(rng)] = static_cast<char>(byte(rng));
    const auto file = Parse(b);
    if (!file.ok()) {
      ASSERT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument)
          << file.status();
      continue;
    }
    ++accepted;
    for (const GgufTensor& t : (*file)->tensors()) {
      (void)GgufFile::Dequantize(t);
    }
  }
  EXPECT_GT(accepted, 0);  // flips inside tensor data keep the file valid
}

// --- The real model --------------------------------------------------------

TEST(GgufTest, ReadsTheRealModel) {
  const char* env = std::getenv("KVKEEP_MODEL");
  const std::string path =
      env != nullptr && *env != '\0'
          ? env
          : ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!std::ifstream(path).good()) {
    GTEST_SKIP() << "model absent: run scripts/fetch-model (looked for " << path
                 << ")";
  }
  const auto file = GgufFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const GgufFile& f = **file;
  EXPECT_EQ(*f.GetString("general.architecture"), "llama");
  EXPECT_EQ(*f.GetInt("llama.block_count"), 30);
  EXPECT_EQ(*f.GetInt("llama.attention.head_count"), 9);
  EXPECT_EQ(*f.GetInt("llama.attention.head_count_kv"), 3);
  const int64_t embed = *f.GetInt("llama.embedding_length");
  EXPECT_EQ(embed, 576);
  const auto tokens = f.GetStringArray("tokenizer.ggml.tokens");
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  const auto token_embd = f.Tensor("token_embd.weight");
  ASSERT_TRUE(token_embd.ok()) << token_embd.status();
  EXPECT_EQ((*token_embd)->shape,
            (Ints{embed, static_cast<int64_t>((*tokens)->size())}));
  EXPECT_EQ((*tokens)->size(), 49152u);

  int dequantized = 0;
  for (const GgufTensor& t : f.tensors()) {
    SCOPED_TRACE(t.name + " (" + GgmlTypeName(t.type) + ")");
    const auto values = GgufFile::Dequantize(t);
    switch (static_cast<GgmlType>(t.type)) {
      case GgmlType::kF32:
      case GgmlType::kF16:
      case GgmlType::kBF16:
      case GgmlType::kQ4_0:
      case GgmlType::kQ4_1:
      case GgmlType::kQ8_0: {
        ASSERT_TRUE(values.ok()) << values.status();
        size_t finite = 0;
        for (const float v : *values) finite += std::isfinite(v) ? 1 : 0;
        EXPECT_EQ(finite, values->size());
        ++dequantized;
        break;
      }
      default:
        EXPECT_EQ(values.status().code(), absl::StatusCode::kInvalidArgument);
        EXPECT_TRUE(Contains(values.status().message(), GgmlTypeName(t.type)));
    }
  }
  EXPECT_GT(dequantized, 0);
  EXPECT_EQ(f.tensors().size(), 2 + 9 * 30u);  // SmolLM2: tied output
}

}  // namespace
}  // namespace kvkeep::lm
