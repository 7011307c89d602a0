// Writes the seed corpora of the fuzz targets: make_corpus DIR writes
// DIR/<target>/<seed> for every target (tests/fuzz/corpus is its output,
// committed). Requests are built as typed messages, the transfer's headers
// and chunks from a real session exported from a store of the fuzz layout,
// so that each seed goes deep (a commit, a decode step, a compression)
// before the fuzzer mutates it.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvkeep/v1/kvkeep.pb.h"
#include "services/common/crc32c.h"
#include "services/transfer/chunk_wire.h"
#include "services/transfer/session_state.h"
#include "tests/fuzz/fuzz_server.h"

namespace kvkeep::fuzz {
namespace {

std::filesystem::path root;

void Write(const std::string& target, const std::string& name,
           const std::string& bytes) {
  const std::filesystem::path dir = root / target;
  std::filesystem::create_directories(dir);
  std::ofstream(dir / name, std::ios::binary) << bytes;
}

template <typename T>
std::string Le(T v) {
  std::string s(sizeof(T), '\0');
  std::memcpy(s.data(), &v, sizeof(T));
  return s;
}

std::string Str(const google::protobuf::MessageLite& m) {
  return m.SerializeAsString();
}

std::string Flatten(grpc::ByteBuffer buffer) {
  std::vector<grpc::Slice> slices;
  if (!buffer.Dump(&slices).ok()) Fail("ByteBuffer::Dump");
  std::string out;
  for (const grpc::Slice& s : slices) {
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return out;
}

// Deterministic small floats: no NaN, no infinity.
std::string Floats(size_t n, float scale) {
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    out += Le<float>(scale * static_cast<float>((i * 37) % 17) / 17.0f);
  }
  return out;
}
std::string Bf16s(size_t n) {
  std::string out;
  for (size_t i = 0; i < n; ++i) out += Le<uint16_t>(0x3F80 + (i % 64));
  return out;
}

constexpr int kLayers = 2;
constexpr int kTokenFloats = 2 * 8;  // kv_heads x head_dim

v1::AppendRequest Append(const std::string& session, int64_t first, int n,
                         bool bf16 = false) {
  v1::AppendRequest a;
  a.set_session_id(session);
  for (int i = 0; i < n; ++i) a.add_positions(first + i);
  for (int l = 0; l < kLayers; ++l) {
    v1::LayerKv* kv = a.add_layers();
    const size_t values = static_cast<size_t>(n) * kTokenFloats;
    kv->set_keys(bf16 ? Bf16s(values) : Floats(values, 1.0f + l));
    kv->set_values(bf16 ? Bf16s(values) : Floats(values, 0.5f));
  }
  return a;
}

void Reduced(v1::LayerScores* s, int layer, uint64_t version, int rows,
             int resident) {
  s->set_layer(layer);
  s->set_version(version);
  s->mutable_reduced()->set_rows(rows);
  for (int i = 0; i < rows * resident; ++i) {
    s->mutable_reduced()->add_values(1.0f / static_cast<float>(resident));
  }
}

void ServiceSeeds() {
  enum : uint8_t {
    kInfo,
    kCreate,
    kClose,
    kStats,
    kList,
    kAppend,
    kPrefill,
    kDecode,
    kCompress,
    kTables,
    kReadKv,
    kMapPool,
    kTransfer,
    kFork,
    kWatch,
    kKeepAlive,
    kPublish,
    kUnpublish,
    kPrefixes,
    kMethods
  };
  const std::string t = "service_fuzz";
  Write(t, "info_list",
        FrameBytes(kInfo, "") + FrameBytes(kList, "") +
            FrameBytes(kStats, Str([] {
                         v1::GetSessionStatsRequest r;
                         r.set_session_id("$");
                         return r;
                       }())));

  {  // append, decode steps (probabilities, queries), read back, close
    std::string s = FrameBytes(kAppend, Str(Append("$", 0, 6)));
    v1::DecodeStep step;
    step.set_session_id("$");
    *step.mutable_append() = Append("", 6, 1);
    for (int l = 0; l < kLayers; ++l) Reduced(step.add_scores(), l, 2, 1, 7);
    s += FrameBytes(kDecode, Str(step));
    v1::DecodeStep q;
    *q.mutable_append() = Append("", 7, 3);
    for (int l = 0; l < kLayers; ++l) {
      v1::LayerScores* sc = q.add_scores();
      sc->set_layer(l);
      sc->set_version(3);
      sc->mutable_queries()->set_rows(1);
      for (int i = 0; i < 4 * 8; ++i) {
        sc->mutable_queries()->add_values(0.1f * static_cast<float>(i % 5));
      }
    }
    s += FrameBytes(kDecode, Str(q));
    v1::GetBlockTablesRequest tables;
    tables.set_session_id("$");
    s += FrameBytes(kTables, Str(tables));
    v1::ReadKvRequest read;
    read.set_session_id("$");
    read.add_layers(1);
    s += FrameBytes(kReadKv, Str(read));
    v1::CloseSessionRequest close;
    close.set_session_id("$");
    s += FrameBytes(kClose, Str(close));
    Write(t, "append_decode_read", s);
  }
  {  // a prefill stream in chunks, per-head probabilities
    std::string s = FrameBytes(kPrefill, Str(Append("$", 0, 4))) +
                    FrameBytes(kPrefill, Str(Append("", 4, 4)));
    v1::DecodeStep step;
    step.set_session_id("$");
    for (int l = 0; l < kLayers; ++l) {
      v1::LayerScores* sc = step.add_scores();
      sc->set_layer(l);
      sc->set_version(3);
      sc->mutable_per_head()->set_rows(1);
      for (int i = 0; i < 4 * 8; ++i)
        sc->mutable_per_head()->add_values(0.125f);
    }
    s += FrameBytes(kDecode, Str(step));
    v1::GetSessionStatsRequest stats;
    stats.set_session_id("$");
    s += FrameBytes(kStats, Str(stats));
    Write(t, "prefill_scores", s);
  }
  {  // snapkv: create, append a prompt, compress it
    v1::CreateSessionRequest c;
    c.set_layout("fuzz");
    c.set_policy("snapkv");
    (*c.mutable_policy_params())["window"] = "2";
    c.mutable_budget()->set_tokens(4);
    std::string s = FrameBytes(kCreate, Str(c)) +
                    FrameBytes(kAppend, Str(Append("$", 0, 10)));
    v1::CompressPromptRequest p;
    p.set_session_id("$");
    for (int l = 0; l < kLayers; ++l) Reduced(p.add_window(), l, 2, 2, 10);
    s += FrameBytes(kCompress, Str(p));
    Write(t, "snapkv_compress", s);
  }
  {  // bf16, a pyramid budget, a named policy with parameters, MapPool
    v1::CreateSessionRequest c;
    c.set_layout("fuzz-bf16");
    c.set_policy("streaming_llm");
    c.mutable_budget()->set_tokens(6);
    c.mutable_budget()->set_schedule("pyramid");
    c.set_idempotency_key("k");
    std::string s = FrameBytes(kCreate, Str(c)) +
                    FrameBytes(kAppend, Str(Append("$", 0, 9, true)));
    v1::MapPoolRequest m;
    m.set_layout("fuzz");
    s += FrameBytes(kMapPool, Str(m));
    m.set_session_id("$");
    s += FrameBytes(kMapPool, Str(m));
    Write(t, "bf16_pyramid_mappool", s);
  }
  {  // a transfer (to nowhere, service_fuzz.cc), then the session again
    v1::TransferSessionRequest x;
    x.set_session_id("$");
    x.set_target("127.0.0.1:1");
    x.set_transport("tcp");
    x.set_transfer_id("x1");
    v1::GetSessionStatsRequest stats;
    stats.set_session_id("$");
    std::string s = FrameBytes(kAppend, Str(Append("$", 0, 3))) +
                    FrameBytes(kTransfer, Str(x));
    x.set_transport("auto");
    s += FrameBytes(kTransfer, Str(x)) + FrameBytes(kStats, Str(stats)) +
         FrameBytes(kAppend, Str(Append("$", 3, 1)));
    Write(t, "transfer_nowhere", s);
  }
  {  // a fork, then the child (the new "$") appends, decodes and closes
    v1::ForkSessionRequest f;
    f.set_session_id("$");
    f.set_idempotency_key("b1");
    std::string s =
        FrameBytes(kAppend, Str(Append("$", 0, 6))) + FrameBytes(kFork, Str(f));
    v1::DecodeStep step;
    step.set_session_id("$");
    *step.mutable_append() = Append("", 6, 1);
    for (int l = 0; l < kLayers; ++l) Reduced(step.add_scores(), l, 2, 1, 7);
    s += FrameBytes(kDecode, Str(step));
    f.set_policy("window");
    f.mutable_budget()->set_tokens(3);
    f.set_idempotency_key("b2");
    s += FrameBytes(kFork, Str(f));
    v1::CloseSessionRequest close;
    close.set_session_id("$");
    s += FrameBytes(kClose, Str(close));
    Write(t, "fork_child", s);
  }
  {  // the event stream: from now, a resume with a kind filter (the
     // session created and closed before it), a sequence never published
    v1::CloseSessionRequest close;
    close.set_session_id("$");
    v1::WatchEventsRequest resume;
    resume.set_after_sequence(1);
    resume.add_kinds(v1::EVENT_SESSION_CLOSED);
    v1::WatchEventsRequest future;
    future.set_after_sequence(1000);
    Write(t, "watch_events",
          FrameBytes(kWatch, "") + FrameBytes(kClose, Str(close)) +
              FrameBytes(kWatch, Str(resume)) +
              FrameBytes(kWatch, Str(future)));
  }
  {  // a lease renewed; a prefix published (twice, then public), a session
     // started from it that evicts into it, the list, an unpublish while
     // that session holds it, and a public one left for the end's check
    v1::KeepAliveRequest keep;
    keep.set_session_id("$");
    v1::PublishPrefixRequest publish;
    publish.set_session_id("$");
    publish.set_name("system");
    v1::CreateSessionRequest child;
    child.set_layout("fuzz");
    child.set_prefix("system");
    child.mutable_budget()->set_tokens(6);
    v1::UnpublishPrefixRequest unpublish;
    unpublish.set_name("system");
    std::string s =
        FrameBytes(kKeepAlive, Str(keep)) +
        FrameBytes(kAppend, Str(Append("$", 0, 5))) +
        FrameBytes(kPublish, Str(publish)) +
        FrameBytes(kPublish, Str(publish)) + FrameBytes(kCreate, Str(child)) +
        FrameBytes(kAppend, Str(Append("$", 5, 4))) +
        FrameBytes(kPrefixes, "") + FrameBytes(kUnpublish, Str(unpublish)) +
        FrameBytes(kKeepAlive, Str(keep));
    publish.set_is_public(true);
    publish.set_name("public/system");
    s += FrameBytes(kPublish, Str(publish));
    Write(t, "lease_and_prefixes", s);
  }
  {  // other callers (service_fuzz.cc): bob, nobody, a malformed token
    auto as = [](int caller, uint8_t method) {
      return static_cast<uint8_t>(caller * kMethods + method);
    };
    v1::GetSessionStatsRequest stats;
    stats.set_session_id("$");
    v1::DecodeStep step;
    step.set_session_id("$");
    *step.mutable_append() = Append("", 0, 1);
    v1::CreateSessionRequest c;
    c.set_layout("fuzz");
    c.mutable_budget()->set_tokens(4);
    Write(t, "other_callers",
          FrameBytes(as(1, kStats), Str(stats)) +
              FrameBytes(as(1, kDecode), Str(step)) +
              FrameBytes(as(2, kStats), Str(stats)) +
              FrameBytes(as(3, kList), "") + FrameBytes(as(4, kInfo), "") +
              FrameBytes(as(1, kCreate), Str(c)) +
              FrameBytes(as(0, kStats), Str(stats)) +
              FrameBytes(as(1, kList), ""));
  }
  {  // ids that name nothing, or nothing at all
    v1::CloseSessionRequest close;
    close.set_session_id("0123456789abcdef");
    v1::GetSessionStatsRequest stats;
    stats.set_session_id("not-an-id");
    Write(t, "bad_ids",
          FrameBytes(kClose, Str(close)) + FrameBytes(kStats, Str(stats)) +
              FrameBytes(kAppend, Str(Append("", 0, 1))));
  }
}

// A real session of the fuzz layout: 5 tokens appended, one decode step
// of scores, exported.
SessionSnapshot ExportedSession() {
  StoreOptions options;
  options.pools = {PoolSpec{FuzzLayout(), kFuzzPoolPages}};
  absl::StatusOr<std::unique_ptr<CacheStore>> store =
      CacheStore::Create(options);
  if (!store.ok()) Fail(store.status().ToString());
  SessionSpec spec;
  spec.layout = "fuzz";
  spec.policy.name = "h2o";
  spec.budget.tokens = 8;
  absl::StatusOr<SessionId> id = (*store)->CreateSession(spec);
  if (!id.ok()) Fail(id.status().ToString());
  const int n = 5;
  std::vector<int64_t> positions = {0, 1, 2, 3, 4};
  std::vector<std::string> bytes;
  std::vector<LayerKv> layers;
  for (int l = 0; l < kLayers; ++l)
    bytes.push_back(Floats(n * kTokenFloats, 1));
  for (int l = 0; l < kLayers; ++l) {
    const auto* p = reinterpret_cast<const std::byte*>(bytes[l].data());
    layers.push_back(LayerKv{{p, bytes[l].size()}, {p, bytes[l].size()}});
  }
  absl::StatusOr<StepResult> appended =
      (*store)->Append(*id, AppendRequest{positions, layers});
  if (!appended.ok()) Fail(appended.status().ToString());
  absl::StatusOr<SessionSnapshot> snapshot = (*store)->ExportSession(*id);
  if (!snapshot.ok()) Fail(snapshot.status().ToString());
  snapshot->id = 0x6b766b6565700001;  // session ids are random: seeds are not
  return *std::move(snapshot);
}

std::string Span(const std::vector<std::byte>& v, size_t at, size_t n) {
  return std::string(reinterpret_cast<const char*>(v.data()) + at, n);
}

// TransferMessage{chunk} of slots [first, first + n) of `layer`, as the
// sender's EncodeChunk writes it.
std::string ChunkMessage(const SessionSnapshot& s, int layer, int64_t first,
                         int64_t n) {
  const size_t token = FuzzLayout().page_layout().token_bytes();
  const LayerSnapshot& l = s.layers[layer];
  Chunk chunk;
  chunk.layer = layer;
  chunk.first_slot = first;
  chunk.slots = n;
  chunk.keys.push_back(std::span(l.keys).subspan(first * token, n * token));
  chunk.values.push_back(std::span(l.values).subspan(first * token, n * token));
  return Flatten(EncodeChunk(chunk));
}

// The same slots on the data socket: header, keys, values, CRC32C.
std::string SocketChunk(const SessionSnapshot& s, int layer, int64_t first,
                        int64_t n) {
  const size_t token = FuzzLayout().page_layout().token_bytes();
  const LayerSnapshot& l = s.layers[layer];
  const std::string keys = Span(l.keys, first * token, n * token);
  const std::string values = Span(l.values, first * token, n * token);
  uint32_t crc = Crc32c(0, std::as_bytes(std::span(keys)));
  crc = Crc32c(crc, std::as_bytes(std::span(values)));
  return Le<uint32_t>(0x4B564B43) + Le<int32_t>(layer) + Le<int64_t>(first) +
         Le<int64_t>(n) + keys + values + Le<uint32_t>(crc);
}

void TransferSeeds() {
  const SessionSnapshot s = ExportedSession();
  v1::TransferMessage header;
  header.set_transfer_id("t");
  StateToProto(s, header.mutable_header());
  v1::TransferMessage commit;
  commit.set_commit(true);
  const int64_t resident = s.layers[0].resident();

  // receive_session_fuzz: kind 1 = a header made unique, 0 = raw.
  {
    const std::string t = "receive_session_fuzz";
    std::string whole = FrameBytes(1, Str(header));
    for (int l = 0; l < kLayers; ++l) {
      whole += FrameBytes(0, ChunkMessage(s, l, 0, resident));
    }
    Write(t, "commit", whole + FrameBytes(0, Str(commit)));
    std::string split = FrameBytes(1, Str(header));
    for (int l = 0; l < kLayers; ++l) {
      split += FrameBytes(0, ChunkMessage(s, l, 0, 2));
      split += FrameBytes(0, ChunkMessage(s, l, 2, resident - 2));
    }
    Write(t, "split_chunks", split + FrameBytes(0, Str(commit)));
    // As protobuf writes a chunk (transfer_id first): the generated path.
    v1::TransferMessage typed;
    typed.set_transfer_id("t");
    v1::TransferChunk* c = typed.mutable_chunk();
    c->set_layer(0);
    c->set_keys(Span(s.layers[0].keys, 0, s.layers[0].keys.size()));
    c->set_values(Span(s.layers[0].values, 0, s.layers[0].values.size()));
    c->set_crc32c(12345);  // wrong: DATA_LOSS
    Write(t, "bad_crc", FrameBytes(1, Str(header)) + FrameBytes(0, Str(typed)));
    v1::TransferMessage tcp = header;
    tcp.mutable_tcp()->set_required(true);  // this store has no data socket
    Write(t, "tcp_required", FrameBytes(1, Str(tcp)));
    Write(t, "chunk_first",
          FrameBytes(0, ChunkMessage(s, 0, 0, 1)) + FrameBytes(0, Str(commit)));
  }
  // data_socket_fuzz: byte 0 even = the target's side; odd = the sender's.
  {
    const std::string t = "data_socket_fuzz";
    std::string whole = std::string(1, '\0') + FrameBytes(0, Str(header));
    for (int l = 0; l < kLayers; ++l) {
      whole += FrameBytes(0, SocketChunk(s, l, 0, resident));
    }
    Write(t, "target_whole", whole);
    std::string split = std::string(1, '\0') + FrameBytes(0, Str(header));
    for (int l = 0; l < kLayers; ++l) {
      split += FrameBytes(0, SocketChunk(s, l, 0, 1));
      split += FrameBytes(0, SocketChunk(s, l, 1, resident - 1));
    }
    Write(t, "target_split", split);
    const std::string welcome = "KVKA";
    Write(t, "sender_ok",
          std::string(1, '\1') + welcome + Le<uint32_t>(0x4B564B56) +
              Le<int32_t>(0) + Le<uint32_t>(0));
    Write(t, "sender_refused",
          std::string(1, '\1') + welcome + Le<uint32_t>(0x4B564B56) +
              Le<int32_t>(15) + Le<uint32_t>(9) + "data loss");
  }
  // chunk_wire_fuzz: byte 0 = slices - 1, then the message.
  {
    const std::string t = "chunk_wire_fuzz";
    const std::string chunk = ChunkMessage(s, 1, 1, 3);
    Write(t, "chunk", std::string(1, '\0') + chunk);
    Write(t, "chunk_sliced", std::string(1, '\5') + chunk);
    v1::TransferMessage typed;
    typed.set_transfer_id("t");
    typed.mutable_chunk()->set_layer(1);
    typed.mutable_chunk()->set_first_slot(7);
    typed.mutable_chunk()->set_keys("kkkk");
    typed.mutable_chunk()->set_values("vvvv");
    typed.mutable_chunk()->set_crc32c(0xDEADBEEF);
    Write(t, "protobuf_chunk", std::string(1, '\2') + Str(typed));
    Write(t, "header", std::string(1, '\0') + Str(header));
    Write(t, "commit", std::string(1, '\0') + Str(commit));
  }
}

void JsonSeeds() {
  Write("config_json_fuzz", "full", R"({
  "listen": "127.0.0.1:50051", "metrics_listen": "off",
  "layouts": [{"name": "a", "num_layers": 2, "kv_heads": 2, "query_heads": 4,
    "head_dim": 16, "dtype": "f32", "page_tokens": 4, "keys_pre_rope": true,
    "pool_pages": 64}],
  "default_policy": {"name": "h2o", "params": {"sinks": "4", "recent": "8"}},
  "limits": {"max_sessions": 16, "max_message_bytes": 1048576,
    "max_sessions_per_tenant": 4, "max_bytes_per_tenant": 1048576},
  "tenants": [{"name": "a", "token": "ta"}, {"name": "b", "token": "tb"}],
  "drain_seconds": 1.5, "log_events": true, "device": "host",
  "share_pools": false, "transfer_listen": "127.0.0.1:0"
})");
  Write("config_json_fuzz", "tls",
        R"({"tls": {"cert_file": "c.pem", "key_file": "k.pem",
  "client_ca_file": "ca.pem"}, "tenants_file": "tenants.json",
  "metrics_session_series": 10})");
  Write("config_json_fuzz", "empty", "{}");
  Write(
      "tenants_json_fuzz", "two",
      R"([{"name": "team-a", "token": "a"}, {"name": "team-b", "token": "b"}])");
  Write("tenants_json_fuzz", "twice",
        R"([{"name": "x", "token": "t"}, {"name": "y", "token": "t"}])");
  Write("tenants_json_fuzz", "empty", "[]");
}

// GGUF: u32 magic, u32 version, u64 tensors, u64 kvs, the kvs, the tensor
// infos, padding to 32, the data.
void GgufSeeds() {
  auto str = [](std::string_view s) {
    return Le<uint64_t>(s.size()) + std::string(s);
  };
  std::string kvs;
  int kv_count = 0;
  auto kv = [&](std::string_view key, uint32_t type, const std::string& v) {
    kvs += str(key) + Le(type) + v;
    ++kv_count;
  };
  kv("general.architecture", 8, str("llama"));
  kv("general.alignment", 4, Le<uint32_t>(32));
  kv("llama.block_count", 4, Le<uint32_t>(2));
  kv("llama.rope.freq_base", 6, Le<float>(10000.0f));
  kv("tokenizer.ggml.tokens", 9,
     Le<uint32_t>(8) + Le<uint64_t>(3) + str("a") + str("b") + str("<s>"));
  kv("tokenizer.ggml.scores", 9,
     Le<uint32_t>(6) + Le<uint64_t>(2) + Le<float>(0.5f) + Le<float>(-1.0f));
  kv("tokenizer.ggml.token_type", 9,
     Le<uint32_t>(5) + Le<uint64_t>(2) + Le<int32_t>(1) + Le<int32_t>(3));
  kv("general.flag", 7, std::string(1, '\1'));
  kv("general.big", 10, Le<uint64_t>(uint64_t{1} << 40));
  kv("general.f64", 12, Le<double>(0.25));

  struct Tensor {
    std::string name;
    std::vector<uint64_t> shape;
    uint32_t type;
    std::string data;
  };
  std::string q8 = Le<uint16_t>(0x3C00);  // f16 scale 1.0, 32 int8s
  for (int i = 0; i < 32; ++i) q8 += static_cast<char>(i - 16);
  std::string q4_0 = Le<uint16_t>(0x3C00) + std::string(16, '\x5A');
  std::string q4_1 =
      Le<uint16_t>(0x3C00) + Le<uint16_t>(0x0000) + std::string(16, '\x3C');
  std::string f16;
  for (int i = 0; i < 4; ++i) f16 += Le<uint16_t>(0x3C00 + i);
  const std::vector<Tensor> tensors = {
      {"f32", {4, 2}, 0, Floats(8, 1.0f)},
      {"f16", {4}, 1, f16},
      {"q8_0", {32}, 8, q8},
      {"q4_0", {32}, 2, q4_0},
      {"q4_1", {32}, 3, q4_1},
      {"bf16", {4}, 30, Bf16s(4)},
  };
  std::string infos;
  std::string data;
  for (const Tensor& t : tensors) {
    data.resize((data.size() + 31) / 32 * 32, '\0');
    infos += str(t.name) + Le<uint32_t>(t.shape.size());
    for (uint64_t d : t.shape) infos += Le(d);
    infos += Le(t.type) + Le<uint64_t>(data.size());
    data += t.data;
  }
  std::string file = "GGUF" + Le<uint32_t>(3) + Le<uint64_t>(tensors.size()) +
                     Le<uint64_t>(kv_count) + kvs + infos;
  file.resize((file.size() + 31) / 32 * 32, '\0');
  Write("gguf_fuzz", "six_types", file + data);
  std::string meta_only =
      "GGUF" + Le<uint32_t>(2) + Le<uint64_t>(0) + Le<uint64_t>(kv_count) + kvs;
  Write("gguf_fuzz", "v2_metadata", meta_only);
}

}  // namespace
}  // namespace kvkeep::fuzz

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s tests/fuzz/corpus\n", argv[0]);
    return 2;
  }
  kvkeep::fuzz::root = argv[1];
  kvkeep::fuzz::ServiceSeeds();
  kvkeep::fuzz::TransferSeeds();
  kvkeep::fuzz::JsonSeeds();
  kvkeep::fuzz::GgufSeeds();
  return 0;
}
