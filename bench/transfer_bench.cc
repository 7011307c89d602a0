// Host-path session transfer throughput next to a raw TCP copy of the same
// bytes over loopback, in the same run.
//
// Two kvkeepd services in this process, each with its own store and
// loopback port: a session of ~GIB GiB of keys and values (32 layers, 8 kv
// heads, head_dim 128, bf16, 16-token pages) moves from one to the other
// with TransferSession (freeze, header, 4 MiB chunks with CRC32C, commit).
// The baseline sends the same number of bytes from one thread to another
// over a loopback TCP socket, 4 MiB per write. Prints both (wall time, and
// the CPU seconds the process spent, steadier on a busy machine) and the
// ratio.
// The process sets kvkeepd's malloc options, and the target's pool is warm
// (touched by an earlier session) unless --cold.
//
//   build/bin/transfer_bench [GIB] [--cold]   (default 1, a warm target pool)
#include <arpa/inet.h>
#include <malloc.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache_store/cache_store.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "services/kvkeepd/kvkeep_service.h"

namespace kvkeep {
namespace {

constexpr int kMessageBytes = 64 << 20;

ModelLayout Layout() {
  ModelLayout l;
  l.name = "big";
  l.num_layers = 32;
  l.kv_heads = 8;
  l.query_heads = 32;
  l.head_dim = 128;
  l.dtype = DType::kBF16;
  l.page_tokens = 16;
  return l;
}

class Server {
 public:
  explicit Server(int64_t pages) {
    StoreOptions o;
    o.pools.push_back(PoolSpec{Layout(), pages});
    store_ = *CacheStore::Create(o);
    ServiceOptions so;
    so.max_message_bytes = kMessageBytes;
    service_ = std::make_unique<KvKeepService>(store_.get(), so);
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.SetMaxReceiveMessageSize(kMessageBytes);
    b.AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 16 << 20);
    b.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 20);
    b.SetMaxSendMessageSize(kMessageBytes);
    b.RegisterService(service_.get());
    server_ = b.BuildAndStart();
    address_ = absl::StrCat("127.0.0.1:", port);
  }
  ~Server() {
    server_->Shutdown();
    server_->Wait();
  }
  CacheStore& store() { return *store_; }
  const std::string& address() const { return address_; }

 private:
  std::unique_ptr<CacheStore> store_;
  std::unique_ptr<KvKeepService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since)
      .count();
}

// CPU seconds (user and system) this process has used: the cost of a copy
// whatever else the machine is doing, where wall time depends on the load.
double CpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_utime.tv_usec / 1e6 + u.ru_stime.tv_sec +
         u.ru_stime.tv_usec / 1e6;
}

// Sends `bytes` over a loopback TCP connection, 4 MiB per write; returns
// the seconds from the first write to the last byte read.
double RawTcp(int64_t bytes) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len);
  listen(listener, 1);
  std::vector<char> out(4 << 20, 'x');
  double seconds = 0;
  std::thread reader([&] {
    const int fd = accept(listener, nullptr, nullptr);
    std::vector<char> in(4 << 20);
    int64_t got = 0;
    while (got < bytes) {
      const ssize_t n = read(fd, in.data(), in.size());
      if (n <= 0) break;
      got += n;
    }
    close(fd);
  });
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  const auto start = std::chrono::steady_clock::now();
  for (int64_t sent = 0; sent < bytes;) {
    const ssize_t n =
        write(fd, out.data(), std::min<int64_t>(out.size(), bytes - sent));
    if (n <= 0) break;
    sent += n;
  }
  close(fd);
  reader.join();
  seconds = Seconds(start);
  close(listener);
  return seconds;
}

int Main(int argc, char** argv) {
  // As kvkeepd does (services/kvkeepd/main.cc): message buffers of a few
  // MiB stay in the heap instead of being fresh mappings the kernel must
  // zero and fault in on every chunk.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  const double gib = argc > 1 ? std::atof(argv[1]) : 1.0;
  const ModelLayout layout = Layout();
  const int64_t token_bytes = layout.page_layout().token_bytes();  // K only
  const int64_t tokens = static_cast<int64_t>(gib * (1 << 30)) /
                         (2 * token_bytes * layout.num_layers);
  const int64_t pages = (tokens + layout.page_tokens - 1) / layout.page_tokens *
                        layout.num_layers;
  Server source(pages), target(pages);

  SessionSpec spec{"big", {"full", {}}, {}};
  std::mt19937 rng(1);
  std::vector<std::byte> kv(1024 * token_bytes);
  for (std::byte& b : kv) b = static_cast<std::byte>(rng());
  // A session of `tokens` random tokens in `store`.
  auto fill = [&](CacheStore& store) -> SessionId {
    const SessionId id = *store.CreateSession(spec);
    for (int64_t first = 0; first < tokens; first += 1024) {
      const int64_t n = std::min<int64_t>(1024, tokens - first);
      std::vector<int64_t> positions(n);
      for (int64_t i = 0; i < n; ++i) positions[i] = first + i;
      const std::span<const std::byte> bytes(kv.data(), n * token_bytes);
      std::vector<LayerKv> layers(layout.num_layers, LayerKv{bytes, bytes});
      if (!store.Append(id, AppendRequest{positions, layers}).ok()) {
        std::fprintf(stderr, "append failed\n");
        std::exit(1);
      }
    }
    return id;
  };
  const SessionId id = fill(source.store());
  // A store that has served for a while has touched its pool: fill and
  // close a session on the target first, so the transfer writes into pages
  // the kernel has already mapped (a cold pool's first touch costs the
  // page faults and zeroing of the whole session; --cold measures that).
  const bool cold = argc > 2 && std::string(argv[2]) == "--cold";
  if (!cold) {
    const SessionId warm = fill(target.store());
    if (!target.store().CloseSession(warm).ok()) return 1;
  }
  const int64_t moved_bytes = 2 * tokens * token_bytes * layout.num_layers;
  std::printf("session: %lld tokens x %d layers, %.2f GiB of keys and values\n",
              static_cast<long long>(tokens), layout.num_layers,
              moved_bytes / double(1 << 30));

  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMessageBytes);
  auto stub = v1::KvKeep::NewStub(grpc::CreateCustomChannel(
      source.address(), grpc::InsecureChannelCredentials(), args));
  grpc::ClientContext ctx;
  v1::TransferSessionRequest request;
  request.set_session_id(SessionName(id));
  request.set_target(target.address());
  v1::TransferSessionResponse response;
  const double transfer_cpu_start = CpuSeconds();
  const auto start = std::chrono::steady_clock::now();
  const grpc::Status s = stub->TransferSession(&ctx, request, &response);
  const double transfer_seconds = Seconds(start);
  const double transfer_cpu = CpuSeconds() - transfer_cpu_start;
  if (!s.ok()) {
    std::fprintf(stderr, "transfer failed: %s\n", s.error_message().c_str());
    return 1;
  }
  const double raw_cpu_start = CpuSeconds();
  const double raw_seconds = RawTcp(moved_bytes);
  const double raw_cpu = CpuSeconds() - raw_cpu_start;
  const double transfer_gbps = moved_bytes / transfer_seconds / 1e9;
  const double raw_gbps = moved_bytes / raw_seconds / 1e9;
  std::printf(
      "TransferSession (host, %s target pool): %.3f s, %.2f GB/s "
      "(server-side %.3f s), %.2f CPU s\n",
      cold ? "cold" : "warm", transfer_seconds, transfer_gbps,
      response.seconds(), transfer_cpu);
  std::printf("raw TCP copy:           %.3f s, %.2f GB/s, %.2f CPU s\n",
              raw_seconds, raw_gbps, raw_cpu);
  std::printf("ratio: %.2f of the raw copy's throughput\n",
              transfer_gbps / raw_gbps);
  return 0;
}

}  // namespace
}  // namespace kvkeep

int main(int argc, char** argv) { return kvkeep::Main(argc, argv); }
