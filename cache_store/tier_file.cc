#include "cache_store/tier_file.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "services/common/crc32c.h"

namespace kvkeep {
namespace {

constexpr char kMagic[8] = {'K', 'V', 'K', 'T', 'I', 'E', 'R', '1'};
// 1: token records; 2: kivi_int4 (key blocks, then each layer's staging
// after its values). Format 1 is still written for every other session, so
// older builds read what they always read, and refuse a kivi_int4 file by
// its format instead of misreading it.
constexpr uint32_t kFormat = 1;
constexpr uint32_t kKiviFormat = 2;
constexpr size_t kHeaderBytes = sizeof(kMagic) + 4 + 4 + 8;

class Writer {
 public:
  explicit Writer(std::vector<std::byte>& out) : out_(out) {}
  template <typename T>
  void Put(T v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const size_t at = out_.size();
    out_.resize(at + sizeof(T));
    std::memcpy(out_.data() + at, &v, sizeof(T));
  }
  template <typename T>
  void PutArray(std::span<const T> v) {
    Put<uint64_t>(v.size());
    const size_t at = out_.size();
    out_.resize(at + v.size_bytes());
    if (!v.empty()) std::memcpy(out_.data() + at, v.data(), v.size_bytes());
  }
  void PutString(const std::string& s) {
    PutArray(std::span<const char>(s.data(), s.size()));
  }

 private:
  std::vector<std::byte>& out_;
};

// Reads fields in order; the first read past the end sets `ok` false and
// every later read returns zeros.
class Reader {
 public:
  explicit Reader(std::span<const std::byte> in) : in_(in) {}
  bool ok() const { return ok_; }
  template <typename T>
  T Get() {
    T v{};
    if (!Take(sizeof(T))) return v;
    std::memcpy(&v, in_.data() + at_ - sizeof(T), sizeof(T));
    return v;
  }
  template <typename T>
  std::vector<T> GetArray() {
    const uint64_t n = Get<uint64_t>();
    std::vector<T> v;
    // Checked against the bytes left before allocating anything.
    if (!ok_ || n > (in_.size() - at_) / sizeof(T)) {
      ok_ = false;
      return v;
    }
    v.resize(n);
    if (n > 0) std::memcpy(v.data(), in_.data() + at_, n * sizeof(T));
    at_ += n * sizeof(T);
    return v;
  }
  std::string GetString() {
    const std::vector<char> c = GetArray<char>();
    return std::string(c.begin(), c.end());
  }
  size_t left() const { return in_.size() - at_; }

 private:
  bool Take(size_t n) {
    if (!ok_ || in_.size() - at_ < n) {
      ok_ = false;
      return false;
    }
    at_ += n;
    return true;
  }
  std::span<const std::byte> in_;
  size_t at_ = 0;
  bool ok_ = true;
};

void EncodeLayer(const LayerSnapshot& l, bool kivi, Writer& w) {
  w.PutArray(std::span<const int64_t>(l.position));
  w.PutArray(std::span<const int64_t>(l.arrival));
  w.PutArray(std::span<const float>(l.score));
  w.PutArray(std::span<const uint64_t>(l.history));
  w.Put<int64_t>(l.appended);
  w.Put<uint64_t>(l.version);
  w.Put<int64_t>(l.budget);
  w.PutArray(std::span<const std::byte>(l.keys));
  w.PutArray(std::span<const std::byte>(l.values));
  if (kivi) w.PutArray(std::span<const float>(l.kivi_staging));
}

LayerSnapshot DecodeLayer(bool kivi, Reader& r) {
  LayerSnapshot l;
  l.position = r.GetArray<int64_t>();
  l.arrival = r.GetArray<int64_t>();
  l.score = r.GetArray<float>();
  l.history = r.GetArray<uint64_t>();
  l.appended = r.Get<int64_t>();
  l.version = r.Get<uint64_t>();
  l.budget = r.Get<int64_t>();
  l.keys = r.GetArray<std::byte>();
  l.values = r.GetArray<std::byte>();
  if (kivi) l.kivi_staging = r.GetArray<float>();
  return l;
}

void EncodePayload(const SessionSnapshot& s, Writer& w) {
  w.Put<uint64_t>(s.id);
  w.PutString(s.layout);
  w.PutString(s.policy.name);
  w.Put<uint64_t>(s.policy.params.size());
  for (const auto& [key, value] : s.policy.params) {
    w.PutString(key);
    w.PutString(value);
  }
  w.Put<int64_t>(s.policy.protect_first);
  w.PutString(s.tenant);
  w.Put<int64_t>(s.last_position);
  w.Put<uint8_t>(s.compressed ? 1 : 0);
  w.Put<int64_t>(s.work.evicted_tokens);
  w.Put<double>(s.work.evicted_score);
  w.Put<int64_t>(s.work.score_updates);
  w.Put<int64_t>(s.work.evictions);
  w.Put<int64_t>(s.work.pages_copied);
  w.Put<uint8_t>(s.idle_timeout.has_value() ? 1 : 0);
  w.Put<int64_t>(s.idle_timeout.has_value()
                     ? absl::ToInt64Nanoseconds(*s.idle_timeout)
                     : 0);
  w.Put<uint64_t>(s.layers.size());
  for (const LayerSnapshot& l : s.layers) EncodeLayer(l, s.kivi, w);
}

SessionSnapshot DecodePayload(bool kivi, Reader& r) {
  SessionSnapshot s;
  s.kivi = kivi;
  s.id = r.Get<uint64_t>();
  s.layout = r.GetString();
  s.policy.name = r.GetString();
  const uint64_t params = r.Get<uint64_t>();
  for (uint64_t i = 0; i < params && r.ok(); ++i) {
    std::string key = r.GetString();
    s.policy.params[std::move(key)] = r.GetString();
  }
  s.policy.protect_first = r.Get<int64_t>();
  s.tenant = r.GetString();
  s.last_position = r.Get<int64_t>();
  s.compressed = r.Get<uint8_t>() != 0;
  s.work.evicted_tokens = r.Get<int64_t>();
  s.work.evicted_score = r.Get<double>();
  s.work.score_updates = r.Get<int64_t>();
  s.work.evictions = r.Get<int64_t>();
  s.work.pages_copied = r.Get<int64_t>();
  const bool has_timeout = r.Get<uint8_t>() != 0;
  const int64_t timeout_ns = r.Get<int64_t>();
  if (has_timeout) s.idle_timeout = absl::Nanoseconds(timeout_ns);
  const uint64_t layers = r.Get<uint64_t>();
  // No reserve: a damaged count stops at the first read past the end.
  for (uint64_t l = 0; l < layers && r.ok(); ++l) {
    s.layers.push_back(DecodeLayer(kivi, r));
  }
  return s;
}

}  // namespace

std::vector<std::byte> EncodeTierFile(const SessionSnapshot& snapshot) {
  std::vector<std::byte> out(kHeaderBytes);
  Writer payload(out);
  EncodePayload(snapshot, payload);
  const std::span<const std::byte> body =
      std::span<const std::byte>(out).subspan(kHeaderBytes);
  const uint32_t crc = Crc32c(0, body);
  const uint64_t size = body.size();
  const uint32_t format = snapshot.kivi ? kKiviFormat : kFormat;
  std::memcpy(out.data(), kMagic, sizeof(kMagic));
  std::memcpy(out.data() + 8, &format, 4);
  std::memcpy(out.data() + 12, &crc, 4);
  std::memcpy(out.data() + 16, &size, 8);
  return out;
}

absl::StatusOr<SessionSnapshot> DecodeTierFile(
    std::span<const std::byte> bytes) {
  if (bytes.size() < kHeaderBytes ||
      std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    return absl::DataLossError(absl::StrCat(
        "not a kvkeep tier file (", bytes.size(), " bytes, no header)"));
  }
  uint32_t format = 0;
  uint32_t crc = 0;
  uint64_t size = 0;
  std::memcpy(&format, bytes.data() + 8, 4);
  std::memcpy(&crc, bytes.data() + 12, 4);
  std::memcpy(&size, bytes.data() + 16, 8);
  if (format != kFormat && format != kKiviFormat) {
    return absl::DataLossError(
        absl::StrCat("tier file format ", format, "; this build reads ",
                     kFormat, " and ", kKiviFormat, " (kivi_int4)"));
  }
  const std::span<const std::byte> body = bytes.subspan(kHeaderBytes);
  if (size != body.size()) {
    return absl::DataLossError(absl::StrCat("tier file payload is ",
                                            body.size(),
                                            " bytes; its header says ", size));
  }
  if (const uint32_t actual = Crc32c(0, body); actual != crc) {
    return absl::DataLossError(
        absl::StrFormat("tier file checksum mismatch: CRC32C %08x, written "
                        "%08x",
                        actual, crc));
  }
  Reader r(body);
  SessionSnapshot snapshot = DecodePayload(format == kKiviFormat, r);
  if (!r.ok() || r.left() != 0) {
    return absl::DataLossError(
        "tier file payload does not parse (a length past its end or bytes "
        "left over)");
  }
  return snapshot;
}

}  // namespace kvkeep
