// What the kvkeep CLI prints, whatever the command: the usage text, the exit
// statuses, failure reports, plain-text tables, and the text and JSON forms
// of the server's messages (layouts, session statistics, and the policies
// ServerInfo.policy_info describes). Reads no flags: the caller says whether
// output is JSON. Writes to stdout and stderr; not thread-safe.
#ifndef KVKEEP_SERVICES_CLI_OUTPUT_H_
#define KVKEEP_SERVICES_CLI_OUTPUT_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kvkeep/v1/kvkeep.pb.h"
#include "nlohmann/json.hpp"

namespace kvkeep::cli {

inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

// The usage text. absl's --help prints it after "kvkeep: ", so it does not
// name the program itself.
extern const char kUsage[];

// `problem` and the usage text on stderr; returns kExitUsage.
int Usage(absl::string_view problem);

// A failure: the status code name and message on stderr, and with
// `as_json` also as {"error": {"code", "message"}} on stdout; returns
// kExitFailure.
int Fail(absl::string_view command, const absl::Status& status, bool as_json);

// One JSON document on stdout, indented.
void Print(const nlohmann::json& doc);

// A plain-text table: columns right-aligned except the first.
class Table {
 public:
  explicit Table(std::vector<std::string> header) {
    rows_.push_back(std::move(header));
  }
  void Add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  void Print() const;

 private:
  std::vector<std::vector<std::string>> rows_;
};

// "f16", "bf16", "f32"; "unspecified" for anything else.
std::string DTypeName(v1::DType dtype);
// "512 B", "1.5 KiB", "2.0 MiB", "1.0 GiB".
std::string Bytes(int64_t bytes);
// A session's lease for a table cell: "never", "held" (by an open stream
// or a transfer) or the time left, e.g. "59m58s".
std::string LeaseText(const v1::SessionStats& s);

// A repeated field (or any range) as a JSON array.
template <typename Repeated>
nlohmann::json Array(const Repeated& values) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& v : values) out.push_back(v);
  return out;
}

nlohmann::json LayoutJson(const v1::Layout& l);
nlohmann::json StatsJson(const v1::SessionStats& s);
// A session's totals, then a table of its layers.
void PrintStats(const v1::SessionStats& s);

// The policy `name` as the server describes it; nullptr if it does not.
const v1::PolicyInfo* FindPolicy(const v1::ServerInfo& info,
                                 absl::string_view name);
nlohmann::json PolicyJson(const v1::PolicyInfo& p);
// Every policy: its summary, input, budget rule and parameters.
void PrintPolicies(const v1::ServerInfo& info);

}  // namespace kvkeep::cli

#endif  // KVKEEP_SERVICES_CLI_OUTPUT_H_
