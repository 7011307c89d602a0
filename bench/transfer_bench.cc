// Host-path session transfer throughput next to a raw TCP copy of the same
// bytes over loopback, in the same run.
//
// Two kvkeepd services in this process, each with its own store, loopback
// port and data socket: a session of ~GIB GiB of keys and values (32
// layers, 8 kv heads, head_dim 128, bf16, 16-token pages) moves from one to
// the other with TransferSession (freeze, header, 4 MiB chunks with CRC32C,
// commit), once per transport named (default: tcp, the data socket, then
// host, chunk messages on the gRPC stream; each moves the session back to
// the other store). Two baselines copy the same number of bytes from one
// thread to another over a loopback TCP socket, 4 MiB per write: from one
// hot 4 MiB buffer into another (the socket's best case), and from one
// memory-resident copy of the bytes into another (what any copy of the
// session must at least do: read it from memory and write it to memory).
// Prints each (wall time, and the CPU seconds the process spent, steadier
// on a busy machine), over several rounds, then each one's median and each
// transfer's throughput as a ratio of each baseline's (of the medians).
// The process sets kvkeepd's malloc options, and the target's pool is warm
// (touched by an earlier session) unless --cold (then only the first
// transfer meets a cold pool: use --rounds=1).
//
// --nccl (a machine with two GPUs): the pools are on cuda:0 and cuda:1 and
// the session moves over NCCL; the baseline is cudaMemcpyPeer of the same
// bytes between the two devices in the same run (the link's measured peak).
//
// --tls=CERT,KEY (PEM files of a certificate for 127.0.0.1): both stores
// serve TLS with it and trust it as their peers' CA, as two TLS stores do
// (docs/security.md): they have no data socket, so only "host" runs, over
// the encrypted store-to-store channel. Compare with a plaintext run.
//
// --dtype=int8|fp8_e4m3|int4|kivi_int4 (default bf16): the pages store that
// format (groups of 32, appended as bf16; kivi_int4: keys per channel by
// page, moved as the pages' key blocks with each layer's open-page staging
// in the header); the session has the same tokens as the bf16 one of GIB,
// in fewer bytes.
//
//   build/bin/transfer_bench [GIB] [--cold] [--nccl] [--transports=tcp,host]
//                            [--rounds=5] [--tls=CERT,KEY] [--dtype=bf16]
#include <arpa/inet.h>
#include <malloc.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cache_store/cache_store.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "kernels/dtype.h"
#include "services/kvkeepd/kvkeep_server.h"

#if defined(KVKEEP_HAVE_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace kvkeep {
namespace {

constexpr int kMessageBytes = 64 << 20;

// Stored as `dtype`: bf16, or a quantised dtype (groups of 32, appended as
// bf16).
ModelLayout Layout(DType dtype) {
  ModelLayout l;
  l.name = "big";
  l.num_layers = 32;
  l.kv_heads = 8;
  l.query_heads = 32;
  l.head_dim = 128;
  l.dtype = dtype;
  if (IsQuantized(dtype)) {
    l.group_size = 32;
    l.append_dtype = DType::kBF16;
  }
  l.page_tokens = 16;
  return l;
}

// A kvkeepd (KvKeepServer) on 127.0.0.1 with its data socket.
class Server {
 public:
  // With `tls` (certificate and key files), TLS as docs/security.md says.
  Server(const ModelLayout& layout, int64_t pages, Device device,
         const std::vector<std::string>& tls = {}) {
    ServerConfig config;
    if (tls.size() == 2) {
      config.tls.cert_file = tls[0];
      config.tls.key_file = tls[1];
      config.peers.ca_file = tls[0];
    }
    config.listen = "127.0.0.1:0";
    config.metrics_listen = "off";
    config.transfer_listen = tls.empty() ? "127.0.0.1:0" : "";
    config.pools.push_back(PoolSpec{layout, pages});
    config.device = device.name();
    config.max_message_bytes = kMessageBytes;
    config.peers.token = "transfer-bench-peer-token";
    absl::StatusOr<std::unique_ptr<KvKeepServer>> server =
        KvKeepServer::Start(config);
    if (!server.ok()) {
      std::fprintf(stderr, "%s\n", server.status().ToString().c_str());
      std::exit(1);
    }
    server_ = *std::move(server);
  }
  CacheStore& store() { return server_->store(); }
  const std::string& address() const { return server_->address(); }

 private:
  std::unique_ptr<KvKeepServer> server_;
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
// the seconds from the first write to the last byte read. With `from` and
// `to` (each `bytes` long), the bytes are written from `from` and read into
// `to`; without, from one 4 MiB buffer into another, over and over.
double RawTcp(int64_t bytes, const char* from = nullptr, char* to = nullptr) {
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
      const ssize_t n =
          to != nullptr
              ? read(fd, to + got, std::min<int64_t>(in.size(), bytes - got))
              : read(fd, in.data(), in.size());
      if (n <= 0) break;
      got += n;
    }
    close(fd);
  });
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  const auto start = std::chrono::steady_clock::now();
  for (int64_t sent = 0; sent < bytes;) {
    const ssize_t n = write(fd, from != nullptr ? from + sent : out.data(),
                            std::min<int64_t>(out.size(), bytes - sent));
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
  std::vector<std::string> transports = {"tcp", "host"};
  int rounds = 5;
  std::vector<std::string> tls;  // certificate and key files
  DType dtype = DType::kBF16;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (absl::StartsWith(arg, "--dtype=")) {
      const std::string name = arg.substr(8);
      bool found = false;
      for (DType d : {DType::kBF16, DType::kInt8, DType::kFp8E4M3, DType::kInt4,
                      DType::kKiviInt4}) {
        if (name == DTypeName(d)) dtype = d, found = true;
      }
      if (!found) {
        std::fprintf(stderr,
                     "--dtype: bf16, int8, fp8_e4m3, int4 or kivi_int4\n");
        return 2;
      }
      continue;
    }
    if (absl::StartsWith(arg, "--tls=")) {
      tls = absl::StrSplit(arg.substr(6), ',');
      transports = {"host"};
    } else if (arg == "--cold") {
      cold = true;
    } else if (arg == "--nccl") {
      nccl = true;
      transports = {"nccl"};
    } else if (absl::StartsWith(arg, "--transports=")) {
      transports = absl::StrSplit(arg.substr(13), ',');
    } else if (absl::StartsWith(arg, "--rounds=")) {
      rounds = std::max(1, std::atoi(arg.substr(9).c_str()));
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
  const ModelLayout layout = Layout(dtype);
  // One token's keys (or values) as stored, and as appended (bf16). The
  // session's tokens are what GIB holds in bf16, whatever the dtype: the
  // same session, in fewer bytes when quantised.
  const int64_t token_bytes = layout.page_layout().token_bytes();
  const int64_t append_bytes = int64_t{layout.kv_heads} * layout.head_dim * 2;
  const int64_t tokens = static_cast<int64_t>(gib * (1 << 30)) /
                         (2 * append_bytes * layout.num_layers);
  const int64_t pages = (tokens + layout.page_tokens - 1) / layout.page_tokens *
                        layout.num_layers;
  if (!tls.empty() && tls.size() != 2) {
    std::fprintf(stderr, "--tls=CERT,KEY names two files\n");
    return 2;
  }
  Server source(layout, pages, nccl ? Device{Device::Kind::kCuda, 0} : Device{},
                tls);
  Server target(layout, pages, nccl ? Device{Device::Kind::kCuda, 1} : Device{},
                tls);
  std::shared_ptr<grpc::ChannelCredentials> credentials =
      grpc::InsecureChannelCredentials();
  if (!tls.empty()) {
    grpc::SslCredentialsOptions trust;
    trust.pem_root_certs = ReadConfigFile(tls[0]).value_or("");
    credentials = grpc::SslCredentials(trust);
  }

  SessionSpec spec{"big", {"full", {}}, {}};
  std::mt19937 rng(1);
  // Finite bf16 values (a quantised layout refuses anything else).
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::byte> kv(1024 * append_bytes);
  for (size_t i = 0; i < kv.size(); i += 2) {
    const uint16_t h = FloatToBf16(normal(rng));
    kv[i] = static_cast<std::byte>(h & 0xff);
    kv[i + 1] = static_cast<std::byte>(h >> 8);
  }
  // A session of `tokens` random tokens in `store`.
  auto fill = [&](CacheStore& store) -> SessionId {
    const SessionId id = *store.CreateSession(spec);
    for (int64_t first = 0; first < tokens; first += 1024) {
      const int64_t n = std::min<int64_t>(1024, tokens - first);
      std::vector<int64_t> positions(n);
      for (int64_t i = 0; i < n; ++i) positions[i] = first + i;
      const std::span<const std::byte> bytes(kv.data(), n * append_bytes);
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
  // Keys and values as they move: kivi_int4's keys are whole key blocks.
  const PageLayout page_layout = layout.page_layout();
  const int64_t key_bytes = IsKivi(dtype) ? (tokens + layout.page_tokens - 1) /
                                                layout.page_tokens *
                                                page_layout.key_block_bytes()
                                          : tokens * token_bytes;
  const int64_t moved_bytes =
      (key_bytes + tokens * token_bytes) * layout.num_layers;
  std::printf(
      "session: %lld tokens x %d layers, %s, %.3f GiB of keys and values\n",
      static_cast<long long>(tokens), layout.num_layers,
      std::string(DTypeName(dtype)).c_str(), moved_bytes / double(1 << 30));

  // Rounds of: the baselines, then each transport (each moving the session
  // to the other store). The machine's noise moves single runs by tens of
  // percent, so the summary is each one's median over the rounds, and the
  // ratio of those medians (throughput, transfer over baseline).
  struct Run {
    double seconds = 0, cpu = 0;
  };
  auto measure = [](auto&& copy) -> Run {
    const double cpu = CpuSeconds();
    const double seconds = copy();
    return Run{seconds, CpuSeconds() - cpu};
  };
  const std::vector<std::string> baseline_names =
      nccl ? std::vector<std::string>{"cudaMemcpyPeer cuda:0 -> cuda:1"}
           : std::vector<std::string>{"raw TCP copy, hot 4 MiB buffers",
                                      "raw TCP copy, memory to memory"};
  // Resident copies of the bytes at both ends, touched before any copy.
  std::vector<char> resident_from, resident_to;
  if (!nccl) {
    resident_from.assign(moved_bytes, 'k');
    resident_to.assign(moved_bytes, 'v');
  }
  // [round][baseline or transport]
  std::vector<std::vector<Run>> baselines(rounds), transfers(rounds);
  Server* from = &source;
  Server* to = &target;
  for (int round = 0; round < rounds; ++round) {
    for (size_t b = 0; b < baseline_names.size(); ++b) {
      const Run run = measure([&] {
        if (nccl) return PeerCopy(moved_bytes);
        return b == 0 ? RawTcp(moved_bytes)
                      : RawTcp(moved_bytes, resident_from.data(),
                               resident_to.data());
      });
      if (run.seconds <= 0) {
        std::fprintf(stderr, "the baseline copy failed\n");
        return 1;
      }
      std::printf("round %d: %-32s %.3f s, %5.2f GB/s, %.2f CPU s\n", round,
                  baseline_names[b].c_str(), run.seconds,
                  moved_bytes / run.seconds / 1e9, run.cpu);
      baselines[round].push_back(run);
    }
    for (const std::string& transport : transports) {
      grpc::ChannelArguments args;
      args.SetMaxReceiveMessageSize(kMessageBytes);
      auto stub = v1::KvKeep::NewStub(
          grpc::CreateCustomChannel(from->address(), credentials, args));
      grpc::ClientContext ctx;
      v1::TransferSessionRequest request;
      request.set_session_id(SessionName(id));
      request.set_target(to->address());
      request.set_transport(transport);
      v1::TransferSessionResponse response;
      grpc::Status s;
      const Run run = measure([&] {
        const auto start = std::chrono::steady_clock::now();
        s = stub->TransferSession(&ctx, request, &response);
        return Seconds(start);
      });
      if (!s.ok() || response.transport() != transport) {
        std::fprintf(stderr, "transfer over %s failed: %s (went over '%s')\n",
                     transport.c_str(), s.error_message().c_str(),
                     response.transport().c_str());
        return 1;
      }
      std::printf(
          "round %d: TransferSession over %-5s %.3f s, %5.2f GB/s "
          "(server-side %.3f s), %.2f CPU s\n",
          round, transport.c_str(), run.seconds,
          moved_bytes / run.seconds / 1e9, response.seconds(), run.cpu);
      transfers[round].push_back(run);
      std::swap(from, to);  // the next one moves it back
    }
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 == 1 ? v[v.size() / 2]
                             : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  };
  auto column = [&](const std::vector<std::vector<Run>>& runs, size_t i,
                    auto&& of) {
    std::vector<double> v;
    for (const std::vector<Run>& r : runs) v.push_back(of(r[i]));
    return v;
  };
  std::printf("\nmedians over %d rounds (%s target pool at first%s):\n", rounds,
              cold ? "cold" : "warm",
              tls.empty() ? "" : "; TLS between the stores");
  for (size_t b = 0; b < baseline_names.size(); ++b) {
    const double sec =
        median(column(baselines, b, [](const Run& r) { return r.seconds; }));
    std::printf(
        "  %-40s %.3f s, %5.2f GB/s, %.2f CPU s\n", baseline_names[b].c_str(),
        sec, moved_bytes / sec / 1e9,
        median(column(baselines, b, [](const Run& r) { return r.cpu; })));
  }
  for (size_t t = 0; t < transports.size(); ++t) {
    const double sec =
        median(column(transfers, t, [](const Run& r) { return r.seconds; }));
    std::printf(
        "  TransferSession over %-19s %.3f s, %5.2f GB/s, %.2f CPU s",
        transports[t].c_str(), sec, moved_bytes / sec / 1e9,
        median(column(transfers, t, [](const Run& r) { return r.cpu; })));
    for (size_t b = 0; b < baseline_names.size(); ++b) {
      const double base =
          median(column(baselines, b, [](const Run& r) { return r.seconds; }));
      std::printf("; %.2f of %s", base / sec,
                  b == 0 ? (nccl ? "the peer copy" : "the hot copy")
                         : "memory to memory");
    }
    std::printf("\n");
  }
  return 0;
}

}  // namespace
}  // namespace kvkeep

int main(int argc, char** argv) { return kvkeep::Main(argc, argv); }
