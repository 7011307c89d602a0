#include "tests/fuzz/fuzz_server.h"

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvkeep::fuzz {

ModelLayout FuzzLayout() { return testing::SmallLayout("fuzz"); }

ModelLayout FuzzBf16Layout() {
  ModelLayout l = FuzzLayout();
  l.name = "fuzz-bf16";
  l.dtype = DType::kBF16;
  l.keys_pre_rope = true;
  return l;
}

testing::TestServer& Server(ServerKind kind) {
  // Never destroyed: a fuzz target ends with exit(), and a gRPC server torn
  // down from a static destructor races gRPC's own shutdown.
  static testing::TestServer* const server = [kind] {
    ServerConfig config =
        testing::TestServerConfig({PoolSpec{FuzzLayout(), kFuzzPoolPages},
                                   PoolSpec{FuzzBf16Layout(), kFuzzPoolPages}});
    config.share_pools = true;  // MapPool answers (host pools in /dev/shm)
    config.allow_public_prefixes = true;
    if (kind.data_socket) config.transfer_listen = "127.0.0.1:0";
    if (kind.tenants) {
      config.tenants = {{"alice", kAliceToken}, {"bob", kBobToken}};
    }
    absl::StatusOr<std::unique_ptr<testing::TestServer>> started =
        testing::TestServer::Start(config);
    if (!started.ok()) Fail(started.status().ToString());
    return started->release();
  }();
  return *server;
}

std::vector<Frame> Frames(const uint8_t* data, size_t size) {
  std::vector<Frame> frames;
  size_t at = 0;
  while (at + 3 <= size) {
    const uint8_t kind = data[at];
    const size_t length = data[at + 1] | (size_t{data[at + 2]} << 8);
    at += 3;
    const size_t n = std::min(length, size - at);
    frames.push_back(
        {kind, std::string_view(reinterpret_cast<const char*>(data + at), n)});
    at += n;
  }
  return frames;
}

std::string FrameBytes(uint8_t kind, std::string_view bytes) {
  if (bytes.size() > 0xFFFF) Fail("a frame over 64 KiB");
  std::string out;
  out.push_back(static_cast<char>(kind));
  out.push_back(static_cast<char>(bytes.size() & 0xFF));
  out.push_back(static_cast<char>(bytes.size() >> 8));
  out.append(bytes);
  return out;
}

void ExpectStoreEmpty(CacheStore& store) {
  for (const PrefixInfo& prefix : store.Prefixes(std::nullopt)) {
    if (!prefix.published) continue;
    const absl::Status unpublished =
        store.UnpublishPrefix(prefix.tenant, prefix.name, prefix.is_public)
            .status();
    if (!unpublished.ok()) {
      Fail(absl::StrCat("unpublishing prefix ", prefix.name, " of tenant '",
                        prefix.tenant, "': ", unpublished.ToString()));
    }
  }
  for (SessionId id : store.ListSessions()) {
    // A session being transferred may refuse; it is tried again below.
    (void)store.CloseSession(id);
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (true) {
    int64_t used = 0;
    for (const LayoutStats& s : store.Layouts()) used += s.pool.used_pages;
    const size_t sessions = store.ListSessions().size();
    if (used == 0 && sessions == 0) return;
    if (absl::Now() > deadline) {
      Fail(absl::StrCat("after the input and closing every session, ", used,
                        " pages are still in use and ", sessions,
                        " sessions are open"));
    }
    absl::SleepFor(absl::Milliseconds(5));
    for (SessionId id : store.ListSessions()) (void)store.CloseSession(id);
  }
}

void Trace(std::string_view call, const grpc::Status& status) {
  static const bool on = std::getenv("KVKEEP_FUZZ_TRACE") != nullptr;
  if (!on) return;
  std::fprintf(stderr, "%.*s: %d %s\n", static_cast<int>(call.size()),
               call.data(), static_cast<int>(status.error_code()),
               status.error_message().substr(0, 200).c_str());
}

void Fail(std::string_view what) {
  std::fprintf(stderr, "kvkeep fuzz finding: %.*s\n",
               static_cast<int>(what.size()), what.data());
  std::abort();
}

}  // namespace kvkeep::fuzz
