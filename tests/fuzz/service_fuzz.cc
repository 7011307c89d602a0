// Every request of kvkeep.v1.KvKeep (but the store-to-store pair, see
// receive_session_fuzz and the note below) through a real in-process
// kvkeepd: the input is a script of calls, each frame a method (its kind)
// and the request's bytes, run in order against a fresh session of the
// "fuzz" layout, on a store with two tenants. The requests reach the store
// through the service's own handlers (authenticate, authorize, convert,
// validate, map the status), as a client's would; consecutive AppendPrefill
// or Decode frames of the same kind share one stream. The kind's quotient
// by the number of methods says who calls: 0 alice (who owns the input's
// session), 1 bob, 2 nobody (no token), 3 a malformed authorization, more
// an unknown token. A session_id of "$" names the input's session (the one
// the last successful CreateSession or ForkSession made, so the calls after
// a fork work on the child and its copy-on-write pages). After the input every
// session is closed and the pools must have every page back.
//
// TransferSession dials its target: a target that is not empty becomes a
// unix socket that does not exist, so the call goes through its checks,
// freezes the session, fails to connect and thaws it, all at once.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/client_context.h"
#include "kvkeep/v1/kvkeep.grpc.pb.h"
#include "tests/fuzz/fuzz_server.h"

namespace kvkeep::fuzz {
namespace {

enum Method : uint8_t {
  kGetServerInfo,
  kCreateSession,
  kCloseSession,
  kGetSessionStats,
  kListSessions,
  kAppend,
  kAppendPrefill,
  kDecode,
  kCompressPrompt,
  kGetBlockTables,
  kReadKv,
  kMapPool,
  kTransferSession,
  kForkSession,
  kWatchEvents,
  kKeepAlive,
  kPublishPrefix,
  kUnpublishPrefix,
  kListPrefixes,
  kMethods
};

constexpr char kThisSession[] = "$";
constexpr char kNowhere[] = "unix:/nonexistent/kvkeep-fuzz-target";

class Script {
 public:
  explicit Script(v1::KvKeep::Stub& stub) : stub_(stub) {}

  void Run(const std::vector<Frame>& frames) {
    v1::CreateSessionRequest create;
    create.set_layout("fuzz");
    create.mutable_budget()->set_tokens(8);
    v1::CreateSessionResponse created;
    std::unique_ptr<grpc::ClientContext> ctx = Context();
    Check(stub_.CreateSession(ctx.get(), create, &created), "CreateSession");
    session_ = created.session_id();
    if (session_.empty()) Fail("the input's session could not be created");

    for (size_t i = 0; i < frames.size();) {
      const auto method = static_cast<Method>(frames[i].kind % kMethods);
      if (method == kAppendPrefill || method == kDecode) {
        size_t end = i;
        while (end < frames.size() && frames[end].kind == frames[i].kind) {
          ++end;
        }
        std::vector<Frame> stream(frames.begin() + i, frames.begin() + end);
        caller_ = frames[i].kind / kMethods;
        method == kDecode ? Decode(stream) : AppendPrefill(stream);
        i = end;
      } else {
        caller_ = frames[i].kind / kMethods;
        Unary(method, frames[i].bytes);
        ++i;
      }
    }
  }

 private:
  // A call by caller_, with a deadline far longer than any call takes: a
  // call that runs out hung.
  std::unique_ptr<grpc::ClientContext> Context() const {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() +
                      std::chrono::seconds(10));
    switch (caller_) {
      case 0:
        ctx->AddMetadata("authorization", absl::StrCat("Bearer ", kAliceToken));
        break;
      case 1:
        ctx->AddMetadata("authorization", absl::StrCat("Bearer ", kBobToken));
        break;
      case 2:
        break;
      case 3:
        ctx->AddMetadata("authorization", kAliceToken);
        break;
      default:
        ctx->AddMetadata("authorization", "Bearer nobody");
        break;
    }
    return ctx;
  }

  static void Check(const grpc::Status& status, const char* method) {
    Trace(method, status);
    if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      Fail(absl::StrCat(method, " hung: ", status.error_message()));
    }
  }

  // Parses a request; "$" becomes the input's session.
  template <typename Request>
  bool Parse(std::string_view bytes, Request& req) {
    if (!req.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
      return false;  // protobuf's parser is not under test here
    }
    if constexpr (requires { req.session_id(); }) {
      if (req.session_id() == kThisSession) req.set_session_id(session_);
    }
    return true;
  }

  template <typename Request, typename Response, typename Call>
  void Call(std::string_view bytes, const char* method, Call call,
            Response& resp) {
    Request req;
    if (!Parse(bytes, req)) return;
    std::unique_ptr<grpc::ClientContext> ctx = Context();
    Check((stub_.*call)(ctx.get(), req, &resp), method);
  }

  void Unary(Method method, std::string_view bytes) {
    switch (method) {
      case kGetServerInfo: {
        v1::ServerInfo resp;
        Call<v1::GetServerInfoRequest>(bytes, "GetServerInfo",
                                       &v1::KvKeep::Stub::GetServerInfo, resp);
        break;
      }
      case kCreateSession: {
        v1::CreateSessionResponse resp;
        Call<v1::CreateSessionRequest>(bytes, "CreateSession",
                                       &v1::KvKeep::Stub::CreateSession, resp);
        if (!resp.session_id().empty()) session_ = resp.session_id();
        break;
      }
      case kForkSession: {
        v1::ForkSessionResponse resp;
        Call<v1::ForkSessionRequest>(bytes, "ForkSession",
                                     &v1::KvKeep::Stub::ForkSession, resp);
        if (!resp.session_id().empty()) session_ = resp.session_id();
        break;
      }
      case kKeepAlive: {
        v1::KeepAliveResponse resp;
        Call<v1::KeepAliveRequest>(bytes, "KeepAlive",
                                   &v1::KvKeep::Stub::KeepAlive, resp);
        break;
      }
      case kPublishPrefix: {
        v1::PrefixInfo resp;
        Call<v1::PublishPrefixRequest>(bytes, "PublishPrefix",
                                       &v1::KvKeep::Stub::PublishPrefix, resp);
        break;
      }
      case kUnpublishPrefix: {
        v1::UnpublishPrefixResponse resp;
        Call<v1::UnpublishPrefixRequest>(
            bytes, "UnpublishPrefix", &v1::KvKeep::Stub::UnpublishPrefix, resp);
        break;
      }
      case kListPrefixes: {
        v1::ListPrefixesResponse resp;
        Call<v1::ListPrefixesRequest>(bytes, "ListPrefixes",
                                      &v1::KvKeep::Stub::ListPrefixes, resp);
        break;
      }
      case kCloseSession: {
        v1::CloseSessionResponse resp;
        Call<v1::CloseSessionRequest>(bytes, "CloseSession",
                                      &v1::KvKeep::Stub::CloseSession, resp);
        break;
      }
      case kGetSessionStats: {
        v1::SessionStats resp;
        Call<v1::GetSessionStatsRequest>(
            bytes, "GetSessionStats", &v1::KvKeep::Stub::GetSessionStats, resp);
        break;
      }
      case kListSessions: {
        v1::ListSessionsResponse resp;
        Call<v1::ListSessionsRequest>(bytes, "ListSessions",
                                      &v1::KvKeep::Stub::ListSessions, resp);
        break;
      }
      case kAppend: {
        v1::StepResult resp;
        Call<v1::AppendRequest>(bytes, "Append", &v1::KvKeep::Stub::Append,
                                resp);
        break;
      }
      case kCompressPrompt: {
        v1::StepResult resp;
        Call<v1::CompressPromptRequest>(
            bytes, "CompressPrompt", &v1::KvKeep::Stub::CompressPrompt, resp);
        break;
      }
      case kGetBlockTables: {
        v1::GetBlockTablesResponse resp;
        Call<v1::GetBlockTablesRequest>(
            bytes, "GetBlockTables", &v1::KvKeep::Stub::GetBlockTables, resp);
        break;
      }
      case kMapPool: {
        v1::MapPoolResponse resp;
        Call<v1::MapPoolRequest>(bytes, "MapPool", &v1::KvKeep::Stub::MapPool,
                                 resp);
        break;
      }
      case kTransferSession: {
        v1::TransferSessionRequest req;
        if (!Parse(bytes, req)) return;
        if (!req.target().empty()) req.set_target(kNowhere);
        std::unique_ptr<grpc::ClientContext> ctx = Context();
        v1::TransferSessionResponse resp;
        Check(stub_.TransferSession(ctx.get(), req, &resp), "TransferSession");
        if (!resp.session_id().empty()) Fail("a transfer to nowhere succeeded");
        break;
      }
      case kWatchEvents: {
        // The first message (and whatever a resume point brings at once),
        // then the watcher leaves: a watch never ends by itself.
        v1::WatchEventsRequest req;
        if (!Parse(bytes, req)) return;
        std::unique_ptr<grpc::ClientContext> ctx = Context();
        std::unique_ptr<grpc::ClientReader<v1::WatchEventsResponse>> reader =
            stub_.WatchEvents(ctx.get(), req);
        v1::WatchEventsResponse resp;
        if (reader->Read(&resp)) ctx->TryCancel();
        const grpc::Status status = reader->Finish();
        if (status.error_code() != grpc::StatusCode::CANCELLED) {
          Check(status, "WatchEvents");
        }
        break;
      }
      case kReadKv: {
        v1::ReadKvRequest req;
        if (!Parse(bytes, req)) return;
        std::unique_ptr<grpc::ClientContext> ctx = Context();
        std::unique_ptr<grpc::ClientReader<v1::KvChunk>> reader =
            stub_.ReadKv(ctx.get(), req);
        v1::KvChunk chunk;
        while (reader->Read(&chunk)) {
        }
        Check(reader->Finish(), "ReadKv");
        break;
      }
      default:
        break;
    }
  }

  void AppendPrefill(const std::vector<Frame>& frames) {
    std::unique_ptr<grpc::ClientContext> ctx = Context();
    v1::AppendPrefillResponse resp;
    std::unique_ptr<grpc::ClientWriter<v1::AppendRequest>> writer =
        stub_.AppendPrefill(ctx.get(), &resp);
    for (const Frame& f : frames) {
      v1::AppendRequest req;
      if (!Parse(f.bytes, req)) continue;
      if (!writer->Write(req)) break;  // the server ended the call
    }
    writer->WritesDone();
    Check(writer->Finish(), "AppendPrefill");
  }

  void Decode(const std::vector<Frame>& frames) {
    std::unique_ptr<grpc::ClientContext> ctx = Context();
    std::unique_ptr<
        grpc::ClientReaderWriter<v1::DecodeStep, v1::DecodeStepResult>>
        stream = stub_.Decode(ctx.get());
    v1::DecodeStepResult result;
    for (const Frame& f : frames) {
      v1::DecodeStep step;
      if (!Parse(f.bytes, step)) continue;
      // One reply per step, read before the next step as a worker does.
      if (!stream->Write(step) || !stream->Read(&result)) break;
    }
    stream->WritesDone();
    while (stream->Read(&result)) {
    }
    Check(stream->Finish(), "Decode");
  }

  v1::KvKeep::Stub& stub_;
  std::string session_;
  int caller_ = 0;  // the current frame's (above)
};

}  // namespace
}  // namespace kvkeep::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvkeep::fuzz;
  kvkeep::testing::TestServer& server = Server({.tenants = true});
  Script(server.stub()).Run(Frames(data, size));
  ExpectStoreEmpty(server.store());
  return 0;
}
