#include "server/api/metrics.h"

#include <algorithm>
#include <exception>
#include <limits>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "prometheus/client_metric.h"
#include "prometheus/collectable.h"
#include "prometheus/exposer.h"
#include "prometheus/metric_type.h"
#include "prometheus/text_serializer.h"

namespace specstate {
namespace server {

// Renders one snapshot per scrape: the exposer holds it by weak_ptr and
// calls Collect() on its own thread.
class Metrics::Collector final : public prometheus::Collectable {
 public:
  explicit Collector(StatsSource source) : source_(std::move(source)) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    return Families(source_());
  }

 private:
  const StatsSource source_;
};

namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

MetricFamily Family(std::string name, std::string help, MetricType type) {
  MetricFamily f;
  f.name = std::move(name);
  f.help = std::move(help);
  f.type = type;
  return f;
}

ClientMetric Sample(MetricType type, double value,
                    std::vector<ClientMetric::Label> labels = {}) {
  ClientMetric m;
  m.label = std::move(labels);
  if (type == MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  return m;
}

MetricFamily Single(std::string name, std::string help, MetricType type, double value) {
  MetricFamily f = Family(std::move(name), std::move(help), type);
  f.metric.push_back(Sample(type, value));
  return f;
}

// A counter with one label, one sample per (value, count).
MetricFamily ByLabel(std::string name, std::string help, const std::string& label,
                     std::vector<std::pair<std::string, uint64_t>> values) {
  MetricFamily f = Family(std::move(name), std::move(help), MetricType::Counter);
  for (auto& [value, count] : values) {
    f.metric.push_back(Sample(MetricType::Counter, double(count), {{label, std::move(value)}}));
  }
  return f;
}

// The service's latency histogram (microsecond bounds, per-bucket counts,
// the last bucket open) as a Prometheus one (seconds, cumulative, +Inf).
// Divided, not multiplied by 1e-6: 10 / 1e6 is the double nearest 1e-05,
// so `le` reads "1e-05", not "9.999999999999999e-06".
ClientMetric Histogram(const v1::LatencyHistogram& h, const std::string& method) {
  ClientMetric m;
  m.label = {{"method", method}};
  m.histogram.sample_count = h.count();
  m.histogram.sample_sum = h.sum_us() / 1e6;
  uint64_t cumulative = 0;
  for (int i = 0; i < h.counts_size(); ++i) {
    cumulative += h.counts(i);
    ClientMetric::Bucket b;
    b.cumulative_count = cumulative;
    b.upper_bound = i < h.bounds_us_size() ? h.bounds_us(i) / 1e6
                                           : std::numeric_limits<double>::infinity();
    m.histogram.bucket.push_back(b);
  }
  if (h.counts_size() <= h.bounds_us_size()) {  // always end with +Inf
    ClientMetric::Bucket b;
    b.cumulative_count = h.count();
    b.upper_bound = std::numeric_limits<double>::infinity();
    m.histogram.bucket.push_back(b);
  }
  return m;
}

}  // namespace

absl::Status Metrics::CheckListen(absl::string_view listen) {
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("--metrics_listen=", listen, ": ", why,
                                                   " (expected HOST:PORT, e.g. 0.0.0.0:9464)"));
  };
  const size_t colon = listen.rfind(':');
  if (colon == absl::string_view::npos) return bad("no port");
  const absl::string_view host = listen.substr(0, colon);
  const absl::string_view port = listen.substr(colon + 1);
  if (host.empty()) return bad("no host");
  for (char c : host) {
    // Commas and spaces would reach civetweb as a list of ports; an IPv6
    // address needs brackets to keep its colons apart from the port's.
    if (c == ',' || absl::ascii_isspace(static_cast<unsigned char>(c))) {
      return bad("the host has a comma or a space");
    }
  }
  if (host.find(':') != absl::string_view::npos &&
      !(host.front() == '[' && host.back() == ']')) {
    return bad("an IPv6 host must be in brackets");
  }
  uint32_t number = 0;
  if (port.empty() || !std::all_of(port.begin(), port.end(), absl::ascii_isdigit) ||
      !absl::SimpleAtoi(port, &number)) {
    return bad("the port is not a decimal number");
  }
  if (number > 65535) return bad(absl::StrCat("port ", number, " is over 65535"));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Metrics>> Metrics::Serve(const std::string& listen,
                                                        StatsSource source) {
  if (absl::Status st = CheckListen(listen); !st.ok()) return st;
  std::unique_ptr<Metrics> m(new Metrics());
  m->host_ = listen.substr(0, listen.rfind(':'));
  try {
    m->exposer_ = std::make_unique<prometheus::Exposer>(listen, /*num_threads=*/2);
  } catch (const std::exception& e) {  // civetweb's CivetException
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", listen,
                     ": the port is in use, or the address is not this host's (", e.what(), ")"));
  }
  const std::vector<int> ports = m->exposer_->GetListeningPorts();
  if (ports.empty()) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", listen,
                                               ": the HTTP server listens on no port"));
  }
  m->port_ = ports.front();
  m->collector_ = std::make_shared<Collector>(std::move(source));
  m->exposer_->RegisterCollectable(m->collector_);
  return m;
}

// The exposer first: it stops serving (and calling the collector) before
// the collector goes.
Metrics::~Metrics() { exposer_.reset(); }

std::string Metrics::url() const { return absl::StrCat("http://", host_, ":", port_, "/metrics"); }

std::vector<MetricFamily> Metrics::Families(const v1::Stats& stats) {
  std::vector<MetricFamily> out;
  out.push_back(Single("specstate_up",
                       "1 while the service reports SERVING, 0 while NOT_SERVING (a sticky "
                       "device error or a stuck queue)",
                       MetricType::Gauge, stats.health() == "SERVING" ? 1 : 0));
  out.push_back(Single("specstate_uptime_seconds", "Seconds since specstated started",
                       MetricType::Gauge, stats.uptime_s()));

  MetricFamily rpcs = Family("specstate_rpcs_total",
                             "RPCs answered, by method and status code (Ping not counted)",
                             MetricType::Counter);
  MetricFamily latency = Family("specstate_rpc_latency_seconds",
                                "Time from an RPC's arrival to its answer, by method",
                                MetricType::Histogram);
  for (const v1::RpcStats& r : stats.rpcs()) {
    std::vector<std::pair<std::string, uint64_t>> codes(r.errors().begin(), r.errors().end());
    std::sort(codes.begin(), codes.end());
    uint64_t errors = 0;
    for (const auto& [code, n] : codes) errors += n;
    codes.insert(codes.begin(), {"OK", r.calls() >= errors ? r.calls() - errors : 0});
    for (auto& [code, n] : codes) {
      rpcs.metric.push_back(Sample(MetricType::Counter, double(n),
                                   {{"method", r.method()}, {"code", std::move(code)}}));
    }
    latency.metric.push_back(Histogram(r.latency(), r.method()));
  }
  out.push_back(std::move(rpcs));
  out.push_back(std::move(latency));

  out.push_back(ByLabel("specstate_steps_total",
                        "Decode steps: verified (started by their first Verify), committed, "
                        "failed (a call of the step failed)",
                        "phase",
                        {{"verified", stats.steps_verified()},
                         {"committed", stats.steps_committed()},
                         {"failed", stats.steps_failed()}}));
  out.push_back(ByLabel("specstate_rows_total", "Request rows verified and committed", "phase",
                        {{"verified", stats.rows_verified()},
                         {"committed", stats.rows_committed()}}));
  out.push_back(ByLabel("specstate_tokens_total",
                        "Tokens verified (draft windows) and committed (accepted)", "phase",
                        {{"verified", stats.tokens_verified()},
                         {"committed", stats.tokens_committed()}}));
  out.push_back(Single("specstate_state_bytes_saved",
                       "Recurrent-state bytes the stock speculative path would hold beyond this "
                       "service for the latest step's rows ((Q - 1) blocks per row, every layer)",
                       MetricType::Gauge, double(stats.state_bytes_saved())));
  out.push_back(Single("specstate_sessions", "Open sessions", MetricType::Gauge,
                       stats.sessions()));
  out.push_back(Single("specstate_regions", "Registered regions", MetricType::Gauge,
                       stats.regions()));
  out.push_back(Single("specstate_device_check_failures_total",
                       "Calls answered with the error of a device-side check of their inputs",
                       MetricType::Counter, double(stats.device_check_failures())));
  if (stats.has_host_tier()) {
    const v1::HostTierStats& t = stats.host_tier();
    out.push_back(Single("specstate_host_tier_keys", "Blocks saved in the host tier now",
                         MetricType::Gauge, double(t.keys())));
    out.push_back(Single("specstate_host_tier_capacity", "Blocks the host tier holds at most",
                         MetricType::Gauge, double(t.capacity())));
    out.push_back(Single("specstate_host_tier_bytes",
                         "Host memory of the saved blocks now (keys x bytes a block)",
                         MetricType::Gauge, double(t.keys()) * double(t.entry_bytes())));
    out.push_back(ByLabel("specstate_host_tier_blocks_total",
                          "Host tier: blocks saved, restored, evicted (least recently used), "
                          "dropped, and blocks of failed saves",
                          "event",
                          {{"saved", t.saves()},
                           {"restored", t.restores()},
                           {"evicted", t.evictions()},
                           {"dropped", t.drops()},
                           {"failed_save", t.failed_saves()},
                           {"sent", t.sent()},
                           {"fetched", t.fetched()}}));
  }
  return out;
}

std::string Metrics::Text(const v1::Stats& stats) {
  return prometheus::TextSerializer().Serialize(Families(stats));
}

}  // namespace server
}  // namespace specstate
