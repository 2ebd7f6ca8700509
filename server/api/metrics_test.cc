#include "server/api/metrics.h"

#include <atomic>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/testing/http_get_for_test.h"

namespace specstate {
namespace server {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// A snapshot with every field set to a distinct value.
v1::Stats SampleStats() {
  v1::Stats s;
  s.set_steps_verified(11);
  s.set_steps_committed(10);
  s.set_steps_failed(1);
  s.set_rows_verified(33);
  s.set_rows_committed(30);
  s.set_tokens_verified(66);
  s.set_tokens_committed(50);
  s.set_state_bytes_saved(123456789);
  s.set_device_check_failures(2);
  s.set_sessions(3);
  s.set_regions(4);
  s.set_uptime_s(12.5);
  s.set_health("SERVING");
  v1::RpcStats* r = s.add_rpcs();
  r->set_method("Verify");
  r->set_calls(10);
  (*r->mutable_errors())["OUT_OF_RANGE"] = 2;
  (*r->mutable_errors())["INVALID_ARGUMENT"] = 1;
  // Four buckets: <= 1 us, <= 10 us, <= 100 ms, open; 4 + 5 + 0 + 1 calls.
  v1::LatencyHistogram* h = r->mutable_latency();
  h->add_bounds_us(1);
  h->add_bounds_us(10);
  h->add_bounds_us(100000);
  h->add_counts(4);
  h->add_counts(5);
  h->add_counts(0);
  h->add_counts(1);
  h->set_count(10);
  h->set_sum_us(25);
  return s;
}

TEST(MetricsTest, CheckListen) {
  for (const char* good : {"0.0.0.0:9464", "127.0.0.1:0", "localhost:65535", "[::1]:9464"}) {
    EXPECT_TRUE(Metrics::CheckListen(good).ok()) << good;
  }
  const struct {
    const char* listen;
    const char* message;
  } bad[] = {
      {"9464", "no port"},
      {":9464", "no host"},
      {"host:", "the port is not a decimal number"},
      {"host:80s", "the port is not a decimal number"},
      {"host:-1", "the port is not a decimal number"},
      {"host:65536", "port 65536 is over 65535"},
      {"host:99999999999", "the port is not a decimal number"},
      {"a,b:80", "comma or a space"},
      {"a b:80", "comma or a space"},
      {"::1:80", "an IPv6 host must be in brackets"},
  };
  for (const auto& b : bad) {
    const absl::Status st = Metrics::CheckListen(b.listen);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << b.listen;
    EXPECT_THAT(std::string(st.message()), HasSubstr(absl::StrCat("--metrics_listen=", b.listen)));
    EXPECT_THAT(std::string(st.message()), HasSubstr(b.message));
  }
}

TEST(MetricsTest, TextHasEveryFamilyWithTheSnapshotsValues) {
  const std::string text = Metrics::Text(SampleStats());
  for (const char* line : {
           "# TYPE specstate_up gauge\nspecstate_up 1\n",
           "specstate_uptime_seconds 12.5\n",
           "# TYPE specstate_rpcs_total counter\n",
           "specstate_rpcs_total{method=\"Verify\",code=\"OK\"} 7\n",
           "specstate_rpcs_total{method=\"Verify\",code=\"INVALID_ARGUMENT\"} 1\n",
           "specstate_rpcs_total{method=\"Verify\",code=\"OUT_OF_RANGE\"} 2\n",
           "# TYPE specstate_rpc_latency_seconds histogram\n",
           "specstate_rpc_latency_seconds_count{method=\"Verify\"} 10\n",
           "specstate_rpc_latency_seconds_sum{method=\"Verify\"} 2.5e-05\n",
           // Cumulative, in seconds, ending at +Inf.
           "specstate_rpc_latency_seconds_bucket{method=\"Verify\",le=\"1e-06\"} 4\n",
           "specstate_rpc_latency_seconds_bucket{method=\"Verify\",le=\"1e-05\"} 9\n",
           "specstate_rpc_latency_seconds_bucket{method=\"Verify\",le=\"0.1\"} 9\n",
           "specstate_rpc_latency_seconds_bucket{method=\"Verify\",le=\"+Inf\"} 10\n",
           "specstate_steps_total{phase=\"verified\"} 11\n",
           "specstate_steps_total{phase=\"committed\"} 10\n",
           "specstate_steps_total{phase=\"failed\"} 1\n",
           "specstate_rows_total{phase=\"verified\"} 33\n",
           "specstate_rows_total{phase=\"committed\"} 30\n",
           "specstate_tokens_total{phase=\"verified\"} 66\n",
           "specstate_tokens_total{phase=\"committed\"} 50\n",
           "specstate_state_bytes_saved 123456789\n",
           "specstate_sessions 3\n",
           "specstate_regions 4\n",
           "# TYPE specstate_device_check_failures_total counter\n"
           "specstate_device_check_failures_total 2\n",
       }) {
    EXPECT_THAT(text, HasSubstr(line));
  }
  // One +Inf bucket per histogram, none doubled.
  EXPECT_EQ(text.find("le=\"+Inf\""), text.rfind("le=\"+Inf\""));
}

TEST(MetricsTest, NotServingIsUpZero) {
  v1::Stats s = SampleStats();
  s.set_health("NOT_SERVING: the device failed and cannot recover: ...");
  EXPECT_THAT(Metrics::Text(s), HasSubstr("\nspecstate_up 0\n"));
}

TEST(MetricsTest, AnEmptySnapshotStillHasEveryFamily) {
  const std::string text = Metrics::Text(v1::Stats());
  EXPECT_THAT(text, HasSubstr("specstate_up 0\n"));  // no health: not SERVING
  EXPECT_THAT(text, HasSubstr("specstate_steps_total{phase=\"verified\"} 0\n"));
  EXPECT_THAT(text, HasSubstr("specstate_device_check_failures_total 0\n"));
  EXPECT_THAT(text, Not(HasSubstr("specstate_rpcs_total{")));
}

TEST(MetricsTest, ServesAFreshSnapshotOnEachScrape) {
  std::atomic<int> scrapes{0};
  absl::StatusOr<std::unique_ptr<Metrics>> m = Metrics::Serve("127.0.0.1:0", [&] {
    v1::Stats s = SampleStats();
    s.set_steps_verified(100 + scrapes.fetch_add(1));
    return s;
  });
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_GT((*m)->port(), 0);
  EXPECT_EQ((*m)->url(), absl::StrCat("http://127.0.0.1:", (*m)->port(), "/metrics"));
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<HttpResponse> r = HttpGet("127.0.0.1", (*m)->port(), "/metrics");
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->status, 200) << r->headers;
    EXPECT_THAT(r->headers, HasSubstr("text/plain"));
    EXPECT_THAT(r->body, HasSubstr(absl::StrCat("specstate_steps_total{phase=\"verified\"} ",
                                                100 + i, "\n")));
  }
  EXPECT_EQ(scrapes.load(), 2);
  // Only /metrics.
  absl::StatusOr<HttpResponse> other = HttpGet("127.0.0.1", (*m)->port(), "/other");
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(other->status, 404);

  // A second server on the same port is refused, naming the address.
  const std::string taken = absl::StrCat("127.0.0.1:", (*m)->port());
  absl::StatusOr<std::unique_ptr<Metrics>> second =
      Metrics::Serve(taken, [] { return v1::Stats(); });
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(second.status().message()),
              HasSubstr(absl::StrCat("cannot serve metrics on ", taken,
                                     ": the port is in use, or the address is not this host's")));

  // Gone with the object: nothing listens any more.
  const int port = (*m)->port();
  m->reset();
  EXPECT_EQ(HttpGet("127.0.0.1", port, "/metrics").status().code(),
            absl::StatusCode::kUnavailable);
}

TEST(MetricsTest, ServeRefusesAMalformedAddress) {
  absl::StatusOr<std::unique_ptr<Metrics>> m = Metrics::Serve("9464", [] { return v1::Stats(); });
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("--metrics_listen=9464: no port"));
}

}  // namespace
}  // namespace server
}  // namespace specstate
