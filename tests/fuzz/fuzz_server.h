// What the store-backed fuzz targets share: one in-process kvkeepd per
// process (KvKeepServer, built as kvkeepd builds itself, through
// tests/testing/test_server.h) over a small pool, the framing that cuts a
// fuzz input into messages, and the end-of-input check that the store is
// back to empty.
//
// Not thread-safe: a fuzz target runs one input at a time.
#ifndef KVKEEP_TESTS_FUZZ_FUZZ_SERVER_H_
#define KVKEEP_TESTS_FUZZ_FUZZ_SERVER_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "grpcpp/support/status.h"
#include "tests/testing/test_server.h"

namespace kvkeep::fuzz {

// The layouts every store-backed target serves: "fuzz" (f32, 2 layers, 2 kv
// / 4 query heads, head_dim 8, 4-token pages) and "fuzz-bf16" (the same in
// bf16, keys before RoPE), 48 pages each, so that pool exhaustion is near.
ModelLayout FuzzLayout();
ModelLayout FuzzBf16Layout();
constexpr int64_t kFuzzPoolPages = 48;

// What a target's server has beside the pools: tenants "alice" and "bob"
// (tokens kAliceToken, kBobToken), or none; a data socket on loopback.
struct ServerKind {
  bool tenants = false;
  bool data_socket = false;
};
constexpr char kAliceToken[] = "alice-token";
constexpr char kBobToken[] = "bob-token";

// The process's server, started on first use and never destroyed (a fuzz
// target exits without tearing down gRPC): `kind`, no /metrics, pools
// shared (MapPool). A target asks for one kind only.
testing::TestServer& Server(ServerKind kind = {});

// A fuzz input as messages: each frame is a kind byte, a little-endian u16
// length and that many bytes (the last frame takes what is left). The
// seed writer (make_corpus.cc) writes inputs the same way.
struct Frame {
  uint8_t kind = 0;
  std::string_view bytes;
};
std::vector<Frame> Frames(const uint8_t* data, size_t size);
std::string FrameBytes(uint8_t kind, std::string_view bytes);

// Unpublishes every prefix and closes every session left in the store, and
// aborts (a finding) if its pools do not get every page back within a few
// seconds: a call that failed or was abandoned must leave nothing behind.
void ExpectStoreEmpty(CacheStore& store);

// With KVKEEP_FUZZ_TRACE set, prints what a call answered (for writing
// seeds: replay one with the variable set to see how far it gets).
void Trace(std::string_view call, const grpc::Status& status);

// Aborts, printing `what`: a fuzz finding that is not a sanitizer's.
[[noreturn]] void Fail(std::string_view what);

}  // namespace kvkeep::fuzz

#endif  // KVKEEP_TESTS_FUZZ_FUZZ_SERVER_H_
