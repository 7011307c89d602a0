// Test certificates made with the system's openssl: a self-signed P-256
// certificate (its own CA) for a name, with the subject alternative names
// localhost and 127.0.0.1, so a loopback server can present it and a client
// (or another store) can check it. Header-only; thread-compatible.
#ifndef KVKEEP_TESTS_TESTING_TLS_TESTING_H_
#define KVKEEP_TESTS_TESTING_TLS_TESTING_H_

#include <sys/wait.h>
#include <unistd.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "tests/testing/child_process.h"

namespace kvkeep::tls_testing {

inline constexpr char kOpenssl[] = "/usr/bin/openssl";

inline bool HaveOpenssl() { return access(kOpenssl, X_OK) == 0; }

// Writes DIR/NAME.pem and DIR/NAME.key: a certificate for CN=`common_name`
// with the SANs DNS:localhost and IP:127.0.0.1, signed by its own key.
inline absl::Status MakeCertificate(const std::string& dir,
                                    const std::string& name,
                                    const std::string& common_name) {
  absl::StatusOr<std::unique_ptr<child_process::Child>> openssl =
      child_process::Child::Spawn(
          {kOpenssl, "req", "-x509", "-newkey", "ec", "-pkeyopt",
           "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2", "-subj",
           "/CN=" + common_name, "-addext",
           "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout",
           absl::StrCat(dir, "/", name, ".key"), "-out",
           absl::StrCat(dir, "/", name, ".pem")});
  if (!openssl.ok()) return openssl.status();
  absl::StatusOr<int> status = (*openssl)->Wait(absl::Seconds(120));
  if (!status.ok()) return status.status();
  if (!WIFEXITED(*status) || WEXITSTATUS(*status) != 0) {
    return absl::InternalError(
        absl::StrCat("openssl: ", child_process::DescribeWaitStatus(*status),
                     (*openssl)->Output()));
  }
  return absl::OkStatus();
}

}  // namespace kvkeep::tls_testing

#endif  // KVKEEP_TESTS_TESTING_TLS_TESTING_H_
