// Runs the real specstated (or any test binary) as a child process for
// integration tests: a short socket path under /tmp (Unix socket paths are
// limited to 107 bytes, and Bazel's test directories are deep), a wait until
// it answers, SIGTERM and reaping on destruction.
//
//   auto server = ServerProcess::Start({"--blocks=128"}).value();
//   auto client = Client::Connect(server->address()).value();
#ifndef SPECSTATE_TESTS_INTEGRATION_SERVER_PROCESS_H_
#define SPECSTATE_TESTS_INTEGRATION_SERVER_PROCESS_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace specstate {
namespace testing {

// Path of a binary in this test's runfiles, e.g. "server/specstated".
std::string RunfilePath(const std::string& relative);

class ServerProcess {
 public:
  // Starts specstated with `flags` (plus --listen) and waits until it serves.
  // With `address`, listens there (a restarted server on the same socket).
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Start(std::vector<std::string> flags,
                                                              const std::string& address = "");
  ~ServerProcess();

  const std::string& address() const { return address_; }
  pid_t pid() const { return pid_; }
  // Everything the server wrote to stdout and stderr so far.
  std::string Log() const;

 private:
  ServerProcess() = default;
  std::string dir_;
  std::string address_;
  std::string log_path_;
  pid_t pid_ = -1;
};

// Runs `argv` to completion and returns its exit status and output.
struct ProcessResult {
  int exit_code = -1;    // -1 when killed by a signal
  int signal = 0;        // the signal, when killed
  pid_t pid = -1;
  std::string output;    // stdout and stderr
};
absl::StatusOr<ProcessResult> RunProcess(const std::vector<std::string>& argv);

}  // namespace testing
}  // namespace specstate

#endif  // SPECSTATE_TESTS_INTEGRATION_SERVER_PROCESS_H_
