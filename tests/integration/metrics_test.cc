// The Prometheus endpoint of the real specstated (CPU backend): started with
// --metrics_listen, driven over its Unix socket, its /metrics read over TCP
// with a plain HTTP/1.0 GET and checked against what the test did and
// against GetStats; without the flag, the process listens on no TCP port.
#include <dirent.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/lib/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/testing/http_get_for_test.h"
#include "tests/integration/server_process.h"
#include "tests/integration/test_scheduler.h"

namespace specstate {
namespace {

using client::Client;
using server::HttpGet;
using server::HttpResponse;
using testing::ExpectError;
using testing::RunfilePath;
using testing::RunProcess;
using testing::Scheduler;
using testing::ServerProcess;
using testing::ValueOrDie;
using ::testing::HasSubstr;
using ::testing::Not;

// The TCP ports `pid` listens on: its socket inodes (/proc/PID/fd) matched
// with the LISTEN entries (state 0A) of /proc/net/tcp and tcp6.
std::set<int> ListeningTcpPorts(pid_t pid) {
  std::set<std::string> inodes;
  const std::string fd_dir = absl::StrCat("/proc/", pid, "/fd");
  if (DIR* dir = opendir(fd_dir.c_str())) {
    while (dirent* e = readdir(dir)) {
      char target[256];
      const ssize_t n =
          readlink(absl::StrCat(fd_dir, "/", e->d_name).c_str(), target, sizeof(target) - 1);
      if (n <= 0) continue;
      const std::string link(target, n);
      if (link.rfind("socket:[", 0) == 0) inodes.insert(link.substr(8, link.size() - 9));
    }
    closedir(dir);
  }
  EXPECT_FALSE(inodes.empty()) << "no sockets seen in " << fd_dir << " (the gRPC one at least)";
  std::set<int> ports;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
      // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
      if (f.size() < 10 || f[3] != "0A" || inodes.count(f[9]) == 0) continue;
      int port = 0;
      if (absl::SimpleHexAtoi(f[1].substr(f[1].find(':') + 1), &port)) ports.insert(port);
    }
  }
  return ports;
}

// The value of the sample `series` (name and labels exactly as exposed),
// or -1 when the exposition has no such line.
double Sample(const std::string& text, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.size() > series.size() && line.substr(0, series.size()) == series &&
        line[series.size()] == ' ') {
      double v = -1;
      if (absl::SimpleAtod(line.substr(series.size() + 1), &v)) return v;
    }
  }
  return -1;
}

class MetricsTest : public ::testing::Test {
 protected:
  void Start(std::vector<std::string> flags) {
    flags.push_back("--backend=cpu");
    server_ = ValueOrDie(ServerProcess::Start(std::move(flags)));
    client_ = ValueOrDie(Client::Connect(server_->address()));
  }
  void TearDown() override {
    if (HasFailure() && server_ != nullptr) {
      std::fprintf(stderr, "server log:\n%s", server_->Log().c_str());
    }
  }
  // The port the log names ("metrics: serving on http://127.0.0.1:PORT/metrics").
  int LoggedPort() {
    const std::string log = server_->Log();
    const std::string prefix = "metrics: serving on http://127.0.0.1:";
    const size_t at = log.find(prefix);
    if (at == std::string::npos) return -1;
    int port = -1;
    const size_t begin = at + prefix.size();
    if (!absl::SimpleAtoi(log.substr(begin, log.find('/', begin) - begin), &port)) return -1;
    return port;
  }
  std::string Scrape(int port) {
    absl::StatusOr<HttpResponse> r = HttpGet("127.0.0.1", port, "/metrics");
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return "";
    EXPECT_EQ(r->status, 200) << r->headers;
    return r->body;
  }
  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<Client> client_;
};

TEST_F(MetricsTest, TheEndpointCountsWhatTheSchedulerDid) {
  Start({"--metrics_listen=127.0.0.1:0"});
  const int port = LoggedPort();
  ASSERT_GT(port, 0) << server_->Log();
  EXPECT_EQ(ListeningTcpPorts(server_->pid()), std::set<int>{port});

  Scheduler s(*client_);  // 4 layers: 4 LoadLayerParams
  const int layers = s.layout().num_layers();
  constexpr int kSteps = 3;
  for (int step = 1; step <= kSteps; ++step) {
    ASSERT_OK(s.VerifyAll(step));
    ASSERT_OK(s.session().Commit(s.Commit(step)).status());  // accepts 1 + 2 + 2
  }
  std::string text = Scrape(port);
  EXPECT_EQ(Sample(text, "specstate_up"), 1) << text;
  EXPECT_EQ(Sample(text, "specstate_steps_total{phase=\"verified\"}"), kSteps) << text;
  EXPECT_EQ(Sample(text, "specstate_steps_total{phase=\"committed\"}"), kSteps);
  EXPECT_EQ(Sample(text, "specstate_steps_total{phase=\"failed\"}"), 0);
  EXPECT_EQ(Sample(text, "specstate_rows_total{phase=\"verified\"}"), kSteps * Scheduler::kRows);
  EXPECT_EQ(Sample(text, "specstate_rows_total{phase=\"committed\"}"), kSteps * Scheduler::kRows);
  EXPECT_EQ(Sample(text, "specstate_tokens_total{phase=\"verified\"}"),
            kSteps * Scheduler::kRows * Scheduler::kTokensPerRow);
  EXPECT_EQ(Sample(text, "specstate_tokens_total{phase=\"committed\"}"), kSteps * (1 + 2 + 2));
  EXPECT_EQ(Sample(text, "specstate_rpcs_total{method=\"Verify\",code=\"OK\"}"),
            kSteps * layers);
  EXPECT_EQ(Sample(text, "specstate_rpcs_total{method=\"Commit\",code=\"OK\"}"), kSteps);
  EXPECT_EQ(Sample(text, "specstate_rpcs_total{method=\"LoadLayerParams\",code=\"OK\"}"), layers);
  EXPECT_EQ(Sample(text, "specstate_rpc_latency_seconds_count{method=\"Verify\"}"),
            kSteps * layers);
  EXPECT_EQ(Sample(text, "specstate_rpc_latency_seconds_bucket{method=\"Verify\",le=\"+Inf\"}"),
            kSteps * layers);
  EXPECT_GT(Sample(text, "specstate_rpc_latency_seconds_sum{method=\"Verify\"}"), 0);
  EXPECT_EQ(Sample(text, "specstate_sessions"), 1);
  EXPECT_GE(Sample(text, "specstate_regions"), 1);  // the scheduler's activations
  EXPECT_GT(Sample(text, "specstate_state_bytes_saved"), 0);
  EXPECT_EQ(Sample(text, "specstate_device_check_failures_total"), 0);
  EXPECT_GT(Sample(text, "specstate_uptime_seconds"), 0);

  // Two bad calls: one the host refuses, one only the device's checks catch.
  v1::VerifyRequest unknown_region = s.Verify(kSteps + 1, 0);
  unknown_region.mutable_v()->set_region("nope");
  ExpectError(s.session().Verify(unknown_region).status(), absl::StatusCode::kNotFound,
              "v: no region \"nope\"");
  v1::VerifyRequest past_the_pool = s.Verify(kSteps + 1, 0);  // the step did not start
  past_the_pool.mutable_state_indices()->mutable_values()->set_values(1, 9999);
  ExpectError(s.session().Verify(past_the_pool).status(), absl::StatusCode::kOutOfRange,
              "state_indices[1] = 9999");

  text = Scrape(port);
  EXPECT_EQ(Sample(text, "specstate_rpcs_total{method=\"Verify\",code=\"OK\"}"),
            kSteps * layers);
  EXPECT_EQ(Sample(text, "specstate_rpcs_total{method=\"Verify\",code=\"NOT_FOUND\"}"), 1) << text;
  EXPECT_EQ(Sample(text, "specstate_rpcs_total{method=\"Verify\",code=\"OUT_OF_RANGE\"}"), 1);
  EXPECT_EQ(Sample(text, "specstate_rpc_latency_seconds_count{method=\"Verify\"}"),
            kSteps * layers + 2);
  EXPECT_EQ(Sample(text, "specstate_device_check_failures_total"), 1);

  // The same numbers as GetStats (nothing runs in between but the scrape).
  const v1::Stats stats = ValueOrDie(client_->GetStats());
  EXPECT_EQ(stats.device_check_failures(), 1u);
  EXPECT_EQ(Sample(text, "specstate_steps_total{phase=\"verified\"}"), stats.steps_verified());
  EXPECT_EQ(Sample(text, "specstate_steps_total{phase=\"failed\"}"), stats.steps_failed());
  EXPECT_GE(stats.steps_failed(), 1u);  // the step whose Verify failed on the device
  EXPECT_EQ(Sample(text, "specstate_regions"), stats.regions());
  EXPECT_EQ(Sample(text, "specstate_state_bytes_saved"), stats.state_bytes_saved());
  // GetStats is counted too, from the next scrape on.
  EXPECT_EQ(Sample(Scrape(port), "specstate_rpcs_total{method=\"GetStats\",code=\"OK\"}"), 1);

  // The session's end shows.
  s.session_ptr().reset();
  double sessions = -1;
  for (int i = 0; i < 100 && sessions != 0; ++i) {
    sessions = Sample(Scrape(port), "specstate_sessions");
    if (sessions != 0) usleep(20000);
  }
  EXPECT_EQ(sessions, 0);
}

TEST_F(MetricsTest, OffByDefault) {
  Start({});
  ASSERT_OK(client_->Health().status());
  EXPECT_EQ(LoggedPort(), -1);
  EXPECT_THAT(server_->Log(), Not(HasSubstr("metrics")));
  EXPECT_TRUE(ListeningTcpPorts(server_->pid()).empty());
}

TEST_F(MetricsTest, ABadAddressStopsTheStartWithItsReason) {
  Start({"--metrics_listen=127.0.0.1:0"});
  const int taken = LoggedPort();
  ASSERT_GT(taken, 0);
  const std::string socket = "--listen=unix:///tmp/specstate-metrics-unused.sock";
  const testing::ProcessResult malformed = ValueOrDie(RunProcess(
      {RunfilePath("server/specstated"), "--backend=cpu", socket, "--metrics_listen=9464"}));
  EXPECT_EQ(malformed.exit_code, 2) << malformed.output;
  EXPECT_THAT(malformed.output, HasSubstr("--metrics_listen=9464: no port"));
  const testing::ProcessResult in_use = ValueOrDie(
      RunProcess({RunfilePath("server/specstated"), "--backend=cpu", socket,
                  absl::StrCat("--metrics_listen=127.0.0.1:", taken)}));
  EXPECT_EQ(in_use.exit_code, 1) << in_use.output;
  EXPECT_THAT(in_use.output, HasSubstr(absl::StrCat("cannot serve metrics on 127.0.0.1:", taken,
                                                    ": the port is in use")));
  EXPECT_THAT(in_use.output, Not(HasSubstr("specstated: serving on")));
  ASSERT_OK(client_->Health().status());  // the first one still serves
}

TEST_F(MetricsTest, HelpListsTheFlag) {
  const testing::ProcessResult help =
      ValueOrDie(RunProcess({RunfilePath("server/specstated"), "--help"}));
  EXPECT_THAT(help.output, HasSubstr("--metrics_listen (serve Prometheus metrics over HTTP"));
  EXPECT_THAT(help.output, HasSubstr("off when empty); default: \"\";"));
}

}  // namespace
}  // namespace specstate
