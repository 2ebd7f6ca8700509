// Prometheus metrics of the service, served over HTTP for a Prometheus
// server to pull (`specstated --metrics_listen=HOST:PORT`, off by default).
// Nothing is recorded for them: each scrape takes one snapshot of what
// GetStats reports (SpecStateService::CollectStats(): the engine's counters,
// the per-RPC counts and latency histograms the service already keeps,
// sessions, regions, health) and renders it in Prometheus' text format, so
// the calls themselves do no extra work whether metrics are served or not.
//
//   absl::StatusOr<std::unique_ptr<Metrics>> metrics =
//       Metrics::Serve("0.0.0.0:9464", [&service] { return service.CollectStats(); });
//   if (!metrics.ok()) return metrics.status();
//   LogInfo(absl::StrCat("metrics on ", (*metrics)->url()));   // http://0.0.0.0:9464/metrics
//
// The families (every name starts with specstate_; units in the names):
//   specstate_up                          gauge    1 SERVING, 0 NOT_SERVING
//   specstate_uptime_seconds              gauge
//   specstate_rpcs_total{method,code}     counter  calls by status code name ("OK", ...)
//   specstate_rpc_latency_seconds{method} histogram 1 us .. 10 s (the GetStats buckets)
//   specstate_steps_total{phase}          counter  phase = verified | committed | failed
//   specstate_rows_total{phase}           counter  phase = verified | committed
//   specstate_tokens_total{phase}         counter  phase = verified | committed
//   specstate_state_bytes_saved           gauge    Stats.state_bytes_saved
//   specstate_sessions                    gauge
//   specstate_regions                     gauge
//   specstate_device_check_failures_total counter
#ifndef SPECSTATE_SERVER_API_METRICS_H_
#define SPECSTATE_SERVER_API_METRICS_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "prometheus/metric_family.h"
#include "specstate/v1/specstate.pb.h"

namespace prometheus {
class Exposer;
}  // namespace prometheus

namespace specstate {
namespace server {

class Metrics {
 public:
  // Called on the exposer's thread at each scrape; must be thread-safe.
  using StatsSource = std::function<v1::Stats()>;

  // Checks the form of a --metrics_listen value: HOST:PORT with a decimal
  // PORT of at most 65535 (0: a free port, chosen when serving).
  // \returns INVALID_ARGUMENT naming the value and what is expected.
  static absl::Status CheckListen(absl::string_view listen);

  // Serves `source`'s metrics at http://`listen`/metrics until destroyed.
  // \returns INVALID_ARGUMENT for a malformed `listen` (CheckListen);
  //   UNAVAILABLE when the address cannot be bound (in use, not this host's).
  static absl::StatusOr<std::unique_ptr<Metrics>> Serve(const std::string& listen,
                                                        StatsSource source);
  ~Metrics();

  // The port it listens on (the chosen one for port 0).
  int port() const { return port_; }
  // http://HOST:PORT/metrics, the port as chosen.
  std::string url() const;

  // The families of one snapshot (what a scrape returns).
  static std::vector<prometheus::MetricFamily> Families(const v1::Stats& stats);
  // Families() in Prometheus' text exposition format (version 0.0.4).
  static std::string Text(const v1::Stats& stats);

 private:
  class Collector;
  Metrics() = default;

  std::string host_;
  int port_ = 0;
  std::shared_ptr<Collector> collector_;
  std::unique_ptr<prometheus::Exposer> exposer_;
};

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_API_METRICS_H_
