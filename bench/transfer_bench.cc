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
// --nccl (a machine with two GPUs): the pools are on cuda:0 and cuda:1 and
// the session moves over NCCL; the baseline is cudaMemcpyPeer of the same
// bytes between the two devices in the same run (the link's measured peak).
//
//   build/bin/transfer_bench [GIB] [--cold] [--nccl]   (default 1, warm, host)
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

#if defined(KVKEEP_HAVE_CUDA)
#include <cuda_runtime_api.h>
#endif

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
  Server(int64_t pages, Device device) {
    StoreOptions o;
    o.pools.push_back(PoolSpec{Layout(), pages});
    o.device = device;
    absl::StatusOr<std::unique_ptr<CacheStore>> store = CacheStore::Create(o);
    if (!store.ok()) {
      std::fprintf(stderr, "%s\n", store.status().ToString().c_str());
      std::exit(1);
    }
    store_ = *std::move(store);
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

// Copies `bytes` from cuda:0 to cuda:1 with cudaMemcpyPeer, 64 MiB at a
// time; returns the seconds, or a negative number if CUDA refused.
double PeerCopy(int64_t bytes) {
#if defined(KVKEEP_HAVE_CUDA)
  const size_t block = size_t{64} << 20;
  void* from = nullptr;
  void* to = nullptr;
  if (cudaSetDevice(0) != cudaSuccess ||
      cudaMalloc(&from, block) != cudaSuccess ||
      cudaSetDevice(1) != cudaSuccess ||
      cudaMalloc(&to, block) != cudaSuccess) {
    return -1;
  }
  cudaDeviceEnablePeerAccess(0, 0);  // may already be on, or unsupported
  cudaGetLastError();
  cudaMemcpyPeer(to, 1, from, 0, block);  // warm-up
  cudaDeviceSynchronize();
  const auto start = std::chrono::steady_clock::now();
  for (int64_t done = 0; done < bytes; done += block) {
    cudaMemcpyPeerAsync(to, 1, from, 0, std::min<int64_t>(block, bytes - done),
                        nullptr);
  }
  const bool ok = cudaDeviceSynchronize() == cudaSuccess;
  const double seconds = Seconds(start);
  cudaFree(to);
  cudaSetDevice(0);
  cudaFree(from);
  return ok ? seconds : -1;
#else
  return -1;
#endif
}

int Main(int argc, char** argv) {
  // As kvkeepd does (services/kvkeepd/main.cc): message buffers of a few
  // MiB stay in the heap instead of being fresh mappings the kernel must
  // zero and fault in on every chunk.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  double gib = 1.0;
  bool cold = false;
  bool nccl = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--cold") {
      cold = true;
    } else if (arg == "--nccl") {
      nccl = true;
    } else {
      gib = std::atof(argv[i]);
    }
  }
  if (nccl && CudaDeviceCount() < 2) {
    std::fprintf(stderr,
                 "transfer_bench --nccl needs two CUDA devices; this machine "
                 "has %d\n",
                 CudaDeviceCount());
    return 2;
  }
  const ModelLayout layout = Layout();
  const int64_t token_bytes = layout.page_layout().token_bytes();  // K only
  const int64_t tokens = static_cast<int64_t>(gib * (1 << 30)) /
                         (2 * token_bytes * layout.num_layers);
  const int64_t pages = (tokens + layout.page_tokens - 1) / layout.page_tokens *
                        layout.num_layers;
  Server source(pages, nccl ? Device{Device::Kind::kCuda, 0} : Device{});
  Server target(pages, nccl ? Device{Device::Kind::kCuda, 1} : Device{});

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
  request.set_transport(nccl ? "nccl" : "host");
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
  const double raw_seconds = nccl ? PeerCopy(moved_bytes) : RawTcp(moved_bytes);
  const double raw_cpu = CpuSeconds() - raw_cpu_start;
  if (raw_seconds <= 0) {
    std::fprintf(stderr, "the baseline copy failed\n");
    return 1;
  }
  const double transfer_gbps = moved_bytes / transfer_seconds / 1e9;
  const double raw_gbps = moved_bytes / raw_seconds / 1e9;
  std::printf(
      "TransferSession (%s, %s target pool): %.3f s, %.2f GB/s "
      "(server-side %.3f s), %.2f CPU s\n",
      response.transport().c_str(), cold ? "cold" : "warm", transfer_seconds,
      transfer_gbps, response.seconds(), transfer_cpu);
  std::printf(
      "%s %.3f s, %.2f GB/s, %.2f CPU s\n",
      nccl ? "cudaMemcpyPeer cuda:0 -> cuda:1:" : "raw TCP copy:          ",
      raw_seconds, raw_gbps, raw_cpu);
  std::printf("ratio: %.2f of the raw copy's throughput\n",
              transfer_gbps / raw_gbps);
  return 0;
}

}  // namespace
}  // namespace kvkeep

int main(int argc, char** argv) { return kvkeep::Main(argc, argv); }
