// `kvkeep demo`: creates a session, prefills a random prompt, streams decode
// steps with synthetic KV and attention scores, prints what each step
// evicted, checks the client's BlockTableMirror against the store's block
// tables and closes the session (docs/cli.md). Reads no flags: kvkeep_cli.cc
// fills DemoOptions from them. Not thread-safe (prints to stdout/stderr).
#ifndef KVKEEP_SERVICES_CLI_DEMO_H_
#define KVKEEP_SERVICES_CLI_DEMO_H_

#include <cstdint>
#include <string>

#include "services/client/kvkeep_client.h"

namespace kvkeep::cli {

// The demo's flags (kvkeep_cli.cc holds their defaults and help).
struct DemoOptions {
  std::string layout;         // empty: the server's first
  std::string policy;         // empty: the server's default
  std::string params;         // policy parameters, "name=value,..."
  int64_t budget_tokens = 0;  // per layer
  int64_t prompt_tokens = 0;  // appended first, on one AppendPrefill
  int64_t steps = 0;          // decode steps
  std::string scores;         // what a step sends: reduced, per_head, queries
  uint32_t seed = 0;          // of the KV and the scores
  bool keep = false;          // leave the session open
  bool json = false;          // one JSON document instead of tables
};

// Runs the demo; returns the exit status: 0, kExitFailure (the server
// refused, or the mirror differs from the store's tables; the session is
// closed first unless options.keep) or kExitUsage (output.h).
int Demo(const client::KvKeepClient& kv, const DemoOptions& options);

}  // namespace kvkeep::cli

#endif  // KVKEEP_SERVICES_CLI_DEMO_H_
