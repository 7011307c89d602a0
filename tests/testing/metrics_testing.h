// Test helpers for kvkeepd's metrics: an HTTP GET over loopback, a parser of
// the Prometheus text format, and a decode loop that makes a session evict.
// Header-only; each function is thread-safe.
#ifndef KVKEEP_TESTS_TESTING_METRICS_TESTING_H_
#define KVKEEP_TESTS_TESTING_METRICS_TESTING_H_

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "services/client/kvkeep_client.h"

namespace kvkeep::metrics_testing {

// The body of http://HOST:PORT`path` (HTTP/1.0, so the server closes the
// connection at the end), sending `headers` ("Name: value\r\n" each); an
// error for a connection failure or a status other than 200.
inline absl::StatusOr<std::string> HttpGet(const std::string& host_port,
                                           const std::string& path,
                                           const std::string& headers = "") {
  const size_t colon = host_port.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("no port in ", host_port));
  }
  const std::string host = host_port.substr(0, colon);
  const std::string port = host_port.substr(colon + 1);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &found) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot resolve ", host_port));
  }
  const int fd = socket(found->ai_family, found->ai_socktype, 0);
  if (fd < 0 || connect(fd, found->ai_addr, found->ai_addrlen) != 0) {
    const int e = errno;
    freeaddrinfo(found);
    if (fd >= 0) close(fd);
    return absl::ErrnoToStatus(e, absl::StrCat("connect ", host_port));
  }
  freeaddrinfo(found);
  const std::string request = absl::StrCat(
      "GET ", path, " HTTP/1.0\r\nHost: ", host_port, "\r\n", headers, "\r\n");
  for (size_t sent = 0; sent < request.size();) {
    const ssize_t n =
        send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) {
      const int e = errno;
      close(fd);
      return absl::ErrnoToStatus(e, "send");
    }
    sent += static_cast<size_t>(n);
  }
  std::string response;
  char buffer[65536];
  while (true) {
    const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    response.append(buffer, static_cast<size_t>(n));
  }
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  if (body == std::string::npos) {
    return absl::UnavailableError(
        absl::StrCat("no HTTP response from ", host_port, path));
  }
  const std::string status_line = response.substr(0, response.find("\r\n"));
  if (!absl::StrContains(status_line, " 200")) {
    return absl::UnavailableError(absl::StrCat(
        host_port, path, ": ", status_line, "\n", response.substr(body + 4)));
  }
  return response.substr(body + 4);
}

// One sample of the text exposition format.
struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

// Parses "name{a="x",b="y"} value" lines; comments and blank lines are
// skipped. Label values here never hold quotes or commas.
inline std::vector<Sample> ParseExposition(absl::string_view text) {
  std::vector<Sample> out;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    if (space == absl::string_view::npos) continue;
    Sample s;
    absl::string_view series = line.substr(0, space);
    const absl::string_view value = line.substr(space + 1);
    if (!absl::SimpleAtod(value, &s.value)) continue;  // "Nan" and the like
    const size_t brace = series.find('{');
    s.name = std::string(series.substr(0, brace));
    if (brace != absl::string_view::npos) {
      absl::string_view labels =
          series.substr(brace + 1, series.size() - brace - 2);
      for (absl::string_view pair :
           absl::StrSplit(labels, ',', absl::SkipEmpty())) {
        const size_t eq = pair.find('=');
        if (eq == absl::string_view::npos) continue;
        absl::string_view v = pair.substr(eq + 1);
        if (v.size() >= 2) v = v.substr(1, v.size() - 2);  // quotes
        s.labels[std::string(pair.substr(0, eq))] = std::string(v);
      }
    }
    out.push_back(std::move(s));
  }
  return out;
}

// The samples named `name` whose labels include every one of `labels`.
inline std::vector<Sample> Select(
    const std::vector<Sample>& samples, absl::string_view name,
    const std::map<std::string, std::string>& labels = {}) {
  std::vector<Sample> out;
  for (const Sample& s : samples) {
    if (s.name != name) continue;
    bool match = true;
    for (const auto& [k, v] : labels) {
      auto it = s.labels.find(k);
      match = match && it != s.labels.end() && it->second == v;
    }
    if (match) out.push_back(s);
  }
  return out;
}

// The value of the one sample that matches; nullopt if none or several do.
inline std::optional<double> Value(
    const std::vector<Sample>& samples, absl::string_view name,
    const std::map<std::string, std::string>& labels = {}) {
  const std::vector<Sample> found = Select(samples, name, labels);
  if (found.size() != 1) return std::nullopt;
  return found[0].value;
}

// The metric names listed in deploy/metrics.txt (one per line; '#' starts a
// comment): every name the dashboard and the alert rules use.
inline std::vector<std::string> DeployedMetricNames(
    const std::string& source_dir) {
  std::ifstream in(source_dir + "/deploy/metrics.txt");
  std::vector<std::string> names;
  std::string line;
  while (std::getline(in, line)) {
    line = line.substr(0, line.find('#'));
    absl::StripAsciiWhitespace(&line);
    if (!line.empty()) names.push_back(line);
  }
  return names;
}

// Creates a session of `layout` with `policy` and a uniform budget.
inline absl::StatusOr<client::Session> OpenSession(
    const client::KvKeepClient& client, const std::string& layout,
    const std::string& policy, int64_t budget) {
  v1::CreateSessionRequest request;
  request.set_layout(layout);
  request.set_policy(policy);
  request.mutable_budget()->set_tokens(budget);
  return client.CreateSession(request);
}

// Random f32 K/V for `positions` of every layer of a session's layout.
inline client::KvTokens RandomTokens(const v1::Layout& layout,
                                     std::vector<int64_t> positions,
                                     std::mt19937& rng) {
  std::normal_distribution<float> normal;
  client::KvTokens t;
  t.positions = std::move(positions);
  const size_t floats =
      t.positions.size() * layout.kv_heads() * layout.head_dim();
  t.layers.resize(layout.num_layers());
  for (client::LayerBytes& l : t.layers) {
    for (std::string* bytes : {&l.keys, &l.values}) {
      std::vector<float> v(floats);
      for (float& x : v) x = normal(rng);
      bytes->assign(reinterpret_cast<const char*>(v.data()), floats * 4);
    }
  }
  return t;
}

// Decodes `steps` tokens (positions from `first_position` on) on one Decode
// stream, each step with random queries for every layer (the store scores
// them; `with_queries` false for a content-blind policy), following the
// session's block tables. An f32 layout.
inline absl::Status DecodeWithQueries(const client::Session& session, int steps,
                                      int64_t first_position, std::mt19937& rng,
                                      bool with_queries = true) {
  const v1::Layout& layout = session.layout();
  absl::StatusOr<client::BlockTableMirror> mirror = session.Mirror();
  if (!mirror.ok()) return mirror.status();
  std::normal_distribution<float> normal;
  client::DecodeStream stream = session.Decode();
  std::vector<float> q(layout.query_heads() * layout.head_dim());
  for (int step = 0; step < steps; ++step) {
    const client::KvTokens token =
        RandomTokens(layout, {first_position + step}, rng);
    std::vector<v1::LayerScores> scores;
    for (int32_t l = 0; with_queries && l < layout.num_layers(); ++l) {
      for (float& x : q) x = normal(rng);
      scores.push_back(client::QueryScores(l, mirror->version(l), q));
    }
    absl::StatusOr<v1::DecodeStepResult> r = stream.Step(token, scores);
    if (!r.ok()) return r.status();
    if (absl::Status s = mirror->ApplyDecode(*r, token.positions); !s.ok()) {
      return s;
    }
  }
  return stream.Finish();
}

}  // namespace kvkeep::metrics_testing

#endif  // KVKEEP_TESTS_TESTING_METRICS_TESTING_H_
