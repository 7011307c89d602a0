#include "services/transfer/tcp_transport.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "services/common/crc32c.h"

namespace kvkeep {
namespace {

constexpr char kHello[8] = {'K', 'V', 'K', 'D', 'A', 'T', 'A', '1'};
constexpr char kWelcome[4] = {'K', 'V', 'K', 'A'};
constexpr size_t kHelloBytes = sizeof(kHello) + SlotStream::kTicketBytes;
constexpr uint32_t kChunkMagic = 0x4B564B43;    // "CKVK" on the wire
constexpr uint32_t kVerdictMagic = 0x4B564B56;  // "VKVK"
constexpr size_t kChunkHeaderBytes = 24;
constexpr size_t kVerdictHeaderBytes = 12;
constexpr size_t kMaxVerdictMessage = 4096;
// Bytes checksummed and then sent (or received and then checksummed) at a
// time: small enough to stay in cache between the two.
constexpr size_t kPassBytes = size_t{512} << 10;
// How long a blocked send or receive waits before looking at the deadline.
constexpr absl::Duration kWake = absl::Milliseconds(200);

void Put32(std::byte* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<std::byte>(v >> (8 * i));
}
void Put64(std::byte* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<std::byte>(v >> (8 * i));
}
uint32_t Get32(const std::byte* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(p[i]) << (8 * i);
  return v;
}
uint64_t Get64(const std::byte* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

iovec Iov(std::span<const std::byte> s) {
  return iovec{const_cast<std::byte*>(s.data()), s.size()};
}

absl::Status Errno(absl::string_view what, int err) {
  return absl::UnavailableError(
      absl::StrCat("data socket: ", what, ": ", std::strerror(err)));
}

// Advances `pieces` past `n` bytes; the index of the first piece left.
size_t Advance(std::span<iovec> pieces, size_t at, size_t n) {
  while (n > 0) {
    iovec& v = pieces[at];
    if (n >= v.iov_len) {
      n -= v.iov_len;
      v.iov_len = 0;
      ++at;
    } else {
      v.iov_base = static_cast<std::byte*>(v.iov_base) + n;
      v.iov_len -= n;
      n = 0;
    }
  }
  while (at < pieces.size() && pieces[at].iov_len == 0) ++at;
  return at;
}

void SetTimeouts(int fd) {
  const timeval wake{
      0, static_cast<suseconds_t>(absl::ToInt64Microseconds(kWake))};
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &wake, sizeof(wake));
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &wake, sizeof(wake));
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// "host:port" split; the host may be bracketed ("[::1]:5").
absl::StatusOr<std::pair<std::string, std::string>> SplitHostPort(
    absl::string_view address) {
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", address, "' is not host:port"));
  }
  absl::string_view host = address.substr(0, colon);
  if (absl::StartsWith(host, "[") && absl::EndsWith(host, "]")) {
    host = host.substr(1, host.size() - 2);
  }
  return std::make_pair(std::string(host),
                        std::string(address.substr(colon + 1)));
}

// The pieces of `spans` (keys, then values) cut into passes of about
// kPassBytes: calls `pass` with each.
template <typename Spans, typename Fn>
absl::Status ForEachPass(const Spans& spans, Fn&& pass) {
  std::vector<std::span<const std::byte>> pieces;
  size_t bytes = 0;
  for (const auto* side : {&spans.keys, &spans.values}) {
    for (std::span<const std::byte> piece : *side) {
      while (!piece.empty()) {
        const size_t n = std::min(piece.size(), kPassBytes - bytes);
        pieces.push_back(piece.first(n));
        piece = piece.subspan(n);
        bytes += n;
        if (bytes == kPassBytes) {
          if (absl::Status s = pass(pieces, false); !s.ok()) return s;
          pieces.clear();
          bytes = 0;
        }
      }
    }
  }
  return pass(pieces, true);
}

template <typename Spans>
size_t TotalBytes(const Spans& spans) {
  size_t n = 0;
  for (const auto& p : spans.keys) n += p.size();
  for (const auto& p : spans.values) n += p.size();
  return n;
}

}  // namespace

std::optional<std::string> TargetHost(absl::string_view target) {
  for (absl::string_view scheme : {"unix:", "unix-abstract:", "vsock:"}) {
    if (absl::StartsWith(target, scheme)) return std::nullopt;
  }
  if (absl::ConsumePrefix(&target, "dns:")) {
    // dns:[//authority/]host[:port]: the authority is the DNS server.
    if (absl::ConsumePrefix(&target, "//")) {
      const size_t slash = target.find('/');
      if (slash == absl::string_view::npos) return std::nullopt;
      target.remove_prefix(slash + 1);
    }
  } else if (absl::ConsumePrefix(&target, "ipv4:") ||
             absl::ConsumePrefix(&target, "ipv6:")) {
    target = target.substr(0, target.find(','));  // the first address
  }
  if (target.empty()) return std::nullopt;
  if (absl::StartsWith(target, "[")) {  // [v6] or [v6]:port
    const size_t close = target.find(']');
    if (close == absl::string_view::npos) return std::nullopt;
    return std::string(target.substr(1, close - 1));
  }
  // More than one colon and no brackets: a bare IPv6 address, no port.
  if (std::count(target.begin(), target.end(), ':') > 1) {
    return std::string(target);
  }
  return std::string(target.substr(0, target.find(':')));
}

DataSocket& DataSocket::operator=(DataSocket&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) close(fd_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

DataSocket::~DataSocket() {
  if (fd_ >= 0) close(fd_);
}

absl::StatusOr<DataSocket> DataSocket::Connect(const std::string& host,
                                               int port, absl::Time deadline) {
  const std::string where = absl::StrCat(host, ":", port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string service = absl::StrCat(port);
  if (int e = getaddrinfo(host.c_str(), service.c_str(), &hints, &found);
      e != 0) {
    return absl::UnavailableError(absl::StrCat("data socket: cannot resolve ",
                                               host, ": ", gai_strerror(e)));
  }
  absl::Status last = absl::UnavailableError(
      absl::StrCat("data socket: no address for ", where));
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd =
        socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
               a->ai_protocol);
    if (fd < 0) {
      last = Errno("socket", errno);
      continue;
    }
    DataSocket s(fd);
    if (connect(fd, a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) {
      last = Errno(absl::StrCat("connect to ", where), errno);
      continue;
    }
    pollfd p{fd, POLLOUT, 0};
    const int64_t wait_ms =
        std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now()));
    const int ready =
        poll(&p, 1, static_cast<int>(std::min<int64_t>(wait_ms, INT_MAX)));
    int err = 0;
    socklen_t len = sizeof(err);
    if (ready <= 0) {
      last = absl::DeadlineExceededError(
          absl::StrCat("data socket: connect to ", where, " timed out"));
      continue;
    }
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      last = Errno(absl::StrCat("connect to ", where), err);
      continue;
    }
    const int flags = fcntl(fd, F_GETFL);
    fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
    freeaddrinfo(found);
    return s;
  }
  freeaddrinfo(found);
  return last;
}

DataSocket::DataSocket(int fd) : fd_(fd) { SetTimeouts(fd); }

absl::Status DataSocket::Send(std::span<iovec> pieces, absl::Time deadline) {
  return Move(pieces, deadline, /*sending=*/true);
}

absl::Status DataSocket::Receive(std::span<iovec> pieces, absl::Time deadline) {
  return Move(pieces, deadline, /*sending=*/false);
}

absl::Status DataSocket::Move(std::span<iovec> pieces, absl::Time deadline,
                              bool sending) {
  const char* what = sending ? "send" : "receive";
  for (size_t at = Advance(pieces, 0, 0); at < pieces.size();) {
    // Checked every time round: blocked calls wake every kWake to get here.
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("data socket: the deadline passed during a ", what));
    }
    const size_t count = std::min<size_t>(IOV_MAX, pieces.size() - at);
    ssize_t n;
    if (sending) {
      msghdr m{};
      m.msg_iov = &pieces[at];
      m.msg_iovlen = count;
      n = sendmsg(fd_, &m, MSG_NOSIGNAL);
    } else {
      n = readv(fd_, &pieces[at], static_cast<int>(count));
    }
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return Errno(what, errno);
    }
    if (n == 0 && !sending) {
      return absl::UnavailableError(
          "data socket: the peer closed the connection");
    }
    at = Advance(pieces, at, static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

bool DataSocket::Readable() const {
  pollfd p{fd_, POLLIN, 0};
  return poll(&p, 1, 0) > 0;
}

void DataSocket::Shutdown() {
  if (fd_ >= 0) shutdown(fd_, SHUT_RDWR);
}

absl::Status SlotStream::SendHello(absl::string_view ticket) {
  if (ticket.size() != kTicketBytes) {
    return absl::InvalidArgumentError(absl::StrCat("data socket: a ticket is ",
                                                   kTicketBytes, " bytes, not ",
                                                   ticket.size()));
  }
  std::byte hello[sizeof(kHello) + kTicketBytes];
  std::memcpy(hello, kHello, sizeof(kHello));
  std::memcpy(hello + sizeof(kHello), ticket.data(), kTicketBytes);
  iovec v = Iov(hello);
  return socket_->Send({&v, 1}, deadline_);
}

absl::Status SlotStream::AwaitWelcome(absl::Time deadline) {
  char welcome[sizeof(kWelcome)];
  iovec v{welcome, sizeof(welcome)};
  if (absl::Status s = socket_->Receive({&v, 1}, deadline); !s.ok()) {
    return absl::Status(s.code(),
                        absl::StrCat("the data socket did not take the "
                                     "transfer's ticket (",
                                     s.message(), ")"));
  }
  if (std::memcmp(welcome, kWelcome, sizeof(kWelcome)) != 0) {
    return absl::UnavailableError("data socket: not a kvkeep welcome");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> SlotStream::ReceiveHello(DataSocket& socket,
                                                     absl::Time deadline) {
  std::byte hello[sizeof(kHello) + kTicketBytes];
  iovec v = Iov(hello);
  if (absl::Status s = socket.Receive({&v, 1}, deadline); !s.ok()) return s;
  if (std::memcmp(hello, kHello, sizeof(kHello)) != 0) {
    return absl::InvalidArgumentError("data socket: not a kvkeep hello");
  }
  return std::string(reinterpret_cast<const char*>(hello) + sizeof(kHello),
                     kTicketBytes);
}

absl::Status SlotStream::SendChunk(const Chunk& chunk) {
  std::byte header[kChunkHeaderBytes];
  Put32(header, kChunkMagic);
  Put32(header + 4, static_cast<uint32_t>(chunk.layer));
  Put64(header + 8, static_cast<uint64_t>(chunk.first_slot));
  Put64(header + 16, static_cast<uint64_t>(chunk.slots));
  // Each pass is sent and then checksummed: the socket's copy reads it from
  // memory, and the checksum then finds it in cache (the frozen pages do
  // not change in between). The checksum goes last, in a trailer.
  uint32_t crc = 0;
  std::vector<iovec> iovs = {Iov(header)};
  absl::Status sent =
      ForEachPass(chunk,
                  [&](std::span<const std::span<const std::byte>> pieces,
                      bool) -> absl::Status {
                    for (std::span<const std::byte> p : pieces)
                      iovs.push_back(Iov(p));
                    absl::Status s = socket_->Send(iovs, deadline_);
                    iovs.clear();
                    if (!s.ok()) return s;
                    for (std::span<const std::byte> p : pieces)
                      crc = Crc32c(crc, p);
                    return absl::OkStatus();
                  });
  if (!sent.ok()) return sent;
  std::byte trailer[4];
  Put32(trailer, chunk.crc32c.value_or(crc));
  iovec v = Iov(trailer);
  return socket_->Send({&v, 1}, deadline_);
}

std::optional<absl::Status> SlotStream::EarlyVerdict() {
  if (!socket_->Readable()) return std::nullopt;
  return AwaitVerdict();
}

absl::Status SlotStream::AwaitVerdict() {
  std::byte header[kVerdictHeaderBytes];
  iovec v = Iov(header);
  if (absl::Status s = socket_->Receive({&v, 1}, deadline_); !s.ok()) {
    return absl::Status(
        s.code(), absl::StrCat("no verdict from the target: ", s.message()));
  }
  const uint32_t length = Get32(header + 8);
  if (Get32(header) != kVerdictMagic || length > kMaxVerdictMessage) {
    return absl::InternalError("data socket: a malformed verdict");
  }
  std::string message(length, '\0');
  iovec m{message.data(), message.size()};
  if (absl::Status s = socket_->Receive({&m, 1}, deadline_); !s.ok()) return s;
  const auto code = static_cast<absl::StatusCode>(Get32(header + 4));
  return code == absl::StatusCode::kOk ? absl::OkStatus()
                                       : absl::Status(code, message);
}

absl::StatusOr<Chunk> SlotStream::ReceiveChunkHeader() {
  std::byte header[kChunkHeaderBytes];
  iovec v = Iov(header);
  if (absl::Status s = socket_->Receive({&v, 1}, deadline_); !s.ok()) return s;
  if (Get32(header) != kChunkMagic) {
    return absl::InvalidArgumentError("data socket: not a chunk header");
  }
  Chunk h;
  h.layer = static_cast<int32_t>(Get32(header + 4));
  h.first_slot = static_cast<int64_t>(Get64(header + 8));
  h.slots = static_cast<int64_t>(Get64(header + 16));
  return h;
}

absl::Status SlotStream::ReceiveChunk(const Chunk& header,
                                      const SlotSpans& into) {
  std::byte trailer[4];
  uint32_t crc = 0;
  std::vector<iovec> iovs;
  absl::Status s =
      ForEachPass(into,
                  [&](std::span<const std::span<const std::byte>> pieces,
                      bool last) -> absl::Status {
                    for (std::span<const std::byte> p : pieces)
                      iovs.push_back(Iov(p));
                    if (last) iovs.push_back(Iov(trailer));
                    absl::Status r = socket_->Receive(iovs, deadline_);
                    iovs.clear();
                    if (!r.ok()) return r;
                    for (std::span<const std::byte> p : pieces)
                      crc = Crc32c(crc, p);
                    return absl::OkStatus();
                  });
  if (!s.ok()) return s;
  if (crc != Get32(trailer)) {
    return absl::DataLossError(
        absl::StrCat("layer ", header.layer, " slot ", header.first_slot,
                     ": the chunk's CRC32C does not match its bytes (",
                     TotalBytes(into), " bytes over the data socket)"));
  }
  return absl::OkStatus();
}

absl::Status SlotStream::SendVerdict(const absl::Status& status) {
  const std::string message(status.message().substr(
      0, std::min(status.message().size(), kMaxVerdictMessage)));
  std::byte header[kVerdictHeaderBytes];
  Put32(header, kVerdictMagic);
  Put32(header + 4, static_cast<uint32_t>(status.code()));
  Put32(header + 8, static_cast<uint32_t>(message.size()));
  iovec v[2] = {Iov(header), Iov(std::as_bytes(std::span(message)))};
  return socket_->Send(v, deadline_);
}

void SlotStream::Drain() {
  std::vector<std::byte> sink(size_t{1} << 20);
  while (true) {
    iovec v = Iov(sink);
    absl::Status s = socket_->Receive({&v, 1}, deadline_);
    if (!s.ok()) return;  // closed, reset, shut down or out of time
  }
}

absl::StatusOr<std::unique_ptr<TcpTransport>> TcpTransport::Listen(
    const std::string& address, absl::Duration hello_patience) {
  absl::StatusOr<std::pair<std::string, std::string>> split =
      SplitHostPort(address);
  if (!split.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("transfer_listen: ", split.status().message()));
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const char* host = split->first.empty() ? nullptr : split->first.c_str();
  if (int e = getaddrinfo(host, split->second.c_str(), &hints, &found);
      e != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "transfer_listen: cannot resolve '", address, "': ", gai_strerror(e)));
  }
  absl::Status last = absl::UnavailableError(
      absl::StrCat("transfer_listen: no address for '", address, "'"));
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd =
        socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK,
               a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, 64) != 0) {
      last = absl::UnavailableError(
          absl::StrCat("transfer_listen: cannot listen on '", address,
                       "': ", std::strerror(errno)));
      close(fd);
      continue;
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
    const int port =
        bound.ss_family == AF_INET6
            ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
            : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    freeaddrinfo(found);
    const int wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (wake < 0) {
      close(fd);
      return Errno("eventfd", errno);
    }
    return std::unique_ptr<TcpTransport>(
        new TcpTransport(fd, port, wake, hello_patience));
  }
  freeaddrinfo(found);
  return last;
}

struct TcpTransport::Pending {
  int fd = -1;
  absl::Time deadline;
  std::byte hello[kHelloBytes];
  size_t got = 0;  // bytes of the hello in
};

TcpTransport::TcpTransport(int listener, int port, int wake,
                           absl::Duration patience)
    : listener_(listener), port_(port), wake_(wake), hello_patience_(patience) {
  acceptor_ = std::thread([this] { AcceptLoop(); });
}

TcpTransport::~TcpTransport() {
  {
    absl::MutexLock lock(&mu_);
    closing_ = true;
    // Awaits return CANCELLED; none may still be inside when this goes.
    mu_.Await(absl::Condition(
        +[](int* awaiting) { return *awaiting == 0; }, &awaiting_));
  }
  const uint64_t one = 1;
  static_cast<void>(write(wake_, &one, sizeof(one)));  // the poll returns
  acceptor_.join();
  close(listener_);
  close(wake_);
}

// One thread polls the listener and every connection still sending its
// hello: a silent connection holds a slot (at most kMaxPendingHellos) for
// at most hello_patience_, and never the connections behind it.
void TcpTransport::AcceptLoop() {
  std::deque<Pending> pending;  // oldest first
  std::vector<pollfd> polls;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (closing_) break;
    }
    const absl::Time now = absl::Now();
    absl::Time next = absl::InfiniteFuture();
    std::erase_if(pending, [&](const Pending& p) {
      if (p.deadline > now) {
        next = std::min(next, p.deadline);
        return false;
      }
      close(p.fd);
      return true;
    });
    polls.assign({pollfd{wake_, POLLIN, 0}, pollfd{listener_, POLLIN, 0}});
    for (const Pending& p : pending) polls.push_back(pollfd{p.fd, POLLIN, 0});
    const int64_t wait_ms =
        next == absl::InfiniteFuture()
            ? -1
            : std::clamp<int64_t>(absl::ToInt64Milliseconds(next - now) + 1, 0,
                                  INT_MAX);
    if (poll(polls.data(), polls.size(), static_cast<int>(wait_ms)) < 0) {
      continue;  // EINTR
    }
    // Readable connections read what they sent; whole hellos are handed.
    for (size_t i = 2; i < polls.size(); ++i) {
      if (polls[i].revents == 0) continue;
      Pending& p = pending[i - 2];
      const ssize_t n =
          recv(p.fd, p.hello + p.got, sizeof(p.hello) - p.got, MSG_DONTWAIT);
      if (n > 0) p.got += static_cast<size_t>(n);
      if (p.got == sizeof(p.hello)) {
        Hand(p);  // takes p.fd
      } else if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
        close(p.fd);
        p.fd = -1;
      }
    }
    std::erase_if(pending, [](const Pending& p) { return p.fd < 0; });
    if (polls[1].revents != 0) AcceptAll(pending);
  }
  for (const Pending& p : pending) close(p.fd);
}

void TcpTransport::AcceptAll(std::deque<Pending>& pending) {
  while (true) {
    const int fd =
        accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        // EMFILE and the like: the sender's connect times out, or succeeds
        // once descriptors are free again.
        absl::SleepFor(absl::Milliseconds(10));
      }
      return;
    }
    if (pending.size() >= kMaxPendingHellos) {
      close(pending.front().fd);
      pending.pop_front();
    }
    Pending p;
    p.fd = fd;
    p.deadline = absl::Now() + hello_patience_;
    pending.push_back(p);
  }
}

void TcpTransport::Hand(Pending& connection) {
  const int fd = std::exchange(connection.fd, -1);
  if (std::memcmp(connection.hello, kHello, sizeof(kHello)) != 0) {
    close(fd);
    return;
  }
  const std::string ticket(
      reinterpret_cast<const char*>(connection.hello) + sizeof(kHello),
      SlotStream::kTicketBytes);
  auto waiting = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = expected_.find(ticket);
    return it != expected_.end() && !it->second.socket.has_value();
  };
  {
    absl::MutexLock lock(&mu_);
    if (!waiting()) {
      close(fd);
      return;
    }
  }
  // Welcomed before it is handed over (a fresh connection's send buffer
  // takes four bytes at once): from then on its transfer's thread owns it.
  if (send(fd, kWelcome, sizeof(kWelcome), MSG_NOSIGNAL | MSG_DONTWAIT) !=
      static_cast<ssize_t>(sizeof(kWelcome))) {
    close(fd);
    return;
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  DataSocket socket(fd);
  absl::MutexLock lock(&mu_);
  if (waiting()) expected_[ticket].socket = std::move(socket);
}

std::string TcpTransport::Expect() {
  std::string ticket(SlotStream::kTicketBytes, '\0');
  for (size_t got = 0; got < ticket.size();) {
    const ssize_t n = getrandom(ticket.data() + got, ticket.size() - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  absl::MutexLock lock(&mu_);
  expected_[ticket];
  return ticket;
}

absl::StatusOr<DataSocket> TcpTransport::Await(const std::string& ticket,
                                               absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  ++awaiting_;
  absl::StatusOr<DataSocket> result = AwaitLocked(ticket, deadline);
  --awaiting_;
  return result;
}

absl::StatusOr<DataSocket> TcpTransport::AwaitLocked(const std::string& ticket,
                                                     absl::Time deadline) {
  auto arrived = [this, &ticket]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = expected_.find(ticket);
    return closing_ || it == expected_.end() || it->second.socket.has_value();
  };
  mu_.AwaitWithDeadline(absl::Condition(&arrived), deadline);
  auto it = expected_.find(ticket);
  if (it == expected_.end()) {
    return absl::CancelledError("the data socket was not used");
  }
  // Forgotten whatever happens: a late connection presenting it is closed.
  std::optional<DataSocket> socket = std::move(it->second.socket);
  expected_.erase(it);
  if (socket.has_value()) return *std::move(socket);
  if (closing_) return absl::CancelledError("the store is shutting down");
  return absl::DeadlineExceededError(
      "the sender did not open the data socket in time");
}

bool TcpTransport::Withdraw(const std::string& ticket) {
  absl::MutexLock lock(&mu_);
  auto it = expected_.find(ticket);
  if (it == expected_.end()) return false;
  const bool unused = !it->second.socket.has_value();
  expected_.erase(it);
  return unused;
}

}  // namespace kvkeep
