#include "tests/integration/server_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "client/lib/client.h"

namespace specstate {
namespace testing {

std::string RunfilePath(const std::string& relative) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  if (srcdir != nullptr) return absl::StrCat(srcdir, "/specstate/", relative);
  return relative;  // run by hand from the workspace's bazel-bin
}

namespace {

pid_t Spawn(const std::vector<std::string>& argv, int out_fd, int err_fd) {
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    if (out_fd >= 0) dup2(out_fd, 1);
    if (err_fd >= 0) dup2(err_fd, 2);
    // The test may block SIGTERM/SIGINT; the child starts with defaults.
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  return pid;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ServerProcess>> ServerProcess::Start(
    std::vector<std::string> flags, const std::string& address) {
  std::unique_ptr<ServerProcess> p(new ServerProcess());
  char tmpl[] = "/tmp/ssXXXXXX";
  if (mkdtemp(tmpl) == nullptr) return absl::InternalError("mkdtemp failed");
  p->dir_ = tmpl;
  p->address_ = address.empty() ? absl::StrCat("unix://", p->dir_, "/s.sock") : address;
  p->log_path_ = absl::StrCat(p->dir_, "/server.log");
  const int log = open(p->log_path_.c_str(), O_CREAT | O_WRONLY | O_TRUNC, 0600);
  std::vector<std::string> argv = {RunfilePath("server/specstated"),
                                   absl::StrCat("--listen=", p->address_)};
  argv.insert(argv.end(), flags.begin(), flags.end());
  p->pid_ = Spawn(argv, log, log);
  close(log);
  if (p->pid_ < 0) return absl::InternalError("fork failed");
  absl::StatusOr<std::unique_ptr<client::Client>> c =
      client::Client::Connect(p->address_, absl::Seconds(20));
  if (!c.ok()) {
    return absl::UnavailableError(
        absl::StrCat("specstated did not come up: ", c.status().message(), "\n", p->Log()));
  }
  return p;
}

ServerProcess::~ServerProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGTERM);
    int status = 0;
    waitpid(pid_, &status, 0);
  }
  unlink(log_path_.c_str());
  rmdir(dir_.c_str());
}

std::string ServerProcess::Log() const {
  std::ifstream in(log_path_);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

absl::StatusOr<ProcessResult> RunProcess(const std::vector<std::string>& argv) {
  int fds[2];
  if (pipe(fds) != 0) return absl::InternalError("pipe failed");
  const pid_t pid = Spawn(argv, fds[1], fds[1]);
  close(fds[1]);
  ProcessResult result;
  result.pid = pid;
  char buf[4096];
  ssize_t n;
  while ((n = read(fds[0], buf, sizeof(buf))) > 0) result.output.append(buf, n);
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) result.signal = WTERMSIG(status);
  return result;
}

}  // namespace testing
}  // namespace specstate
