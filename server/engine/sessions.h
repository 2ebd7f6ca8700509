// Client sessions: leases, and which session drives the steps.
//
// A session lives while its stream is open and its lease is renewed. When it
// ends (stream closed, lease expired) the manager runs the service's
// `on_end` callback, which releases the session's regions and waits. One
// session at most drives; the pools outlive every session, so a restarted
// scheduler opens a new driving session and finds them as they were.
//
// A session id is a capability: whoever knows it acts as the session. It
// holds 128 random bits and only its owner is told it; everything shown to
// other clients (errors, stats) names a session by its label ("s3").
//
//   SessionManager sessions(lease, max_lease,
//                           /*on_open=*/[&](const std::string& id) { ... },
//                           /*on_end=*/[&](const std::string& id, SessionEnd why) { ... });
//   absl::StatusOr<SessionInfo> s = sessions.Open("vllm-0", 10000, /*drive=*/true);
//   absl::Status ok = sessions.CheckDriver(s->id);
#ifndef SPECSTATE_SERVER_ENGINE_SESSIONS_H_
#define SPECSTATE_SERVER_ENGINE_SESSIONS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace specstate {
namespace server {

enum class SessionEnd { kClosed, kExpired };

struct SessionInfo {
  std::string id;     // secret: "s<n>-" and 32 hex digits of randomness
  std::string label;  // public: "s<n>"
  std::string client_name;
  absl::Duration lease;
  bool driving = false;
};

class SessionManager {
 public:
  // `on_open(id)` runs when a session opens, under the manager's lock, so
  // that it happens before anything can end the session; `on_end(id, why)`
  // runs (without the manager's lock) when a session ends.
  SessionManager(absl::Duration default_lease, absl::Duration max_lease,
                 std::function<void(const std::string&)> on_open,
                 std::function<void(const std::string&, SessionEnd)> on_end);
  ~SessionManager();

  // Opens a session. With `drive`, FAILED_PRECONDITION naming the holder if
  // another session drives.
  absl::StatusOr<SessionInfo> Open(const std::string& client_name, uint32_t lease_ms, bool drive);

  // Extends the lease. NOT_FOUND once the session has ended.
  absl::StatusOr<SessionInfo> Renew(const std::string& id);

  // Ends the session (its stream closed). No-op if it already ended.
  void Close(const std::string& id, SessionEnd why = SessionEnd::kClosed);

  // OK if `id` is a live session (regions need one).
  absl::Status CheckLive(const std::string& id) const;
  // OK if `id` is the driving session; FAILED_PRECONDITION naming the driver
  // (or saying none drives) otherwise.
  absl::Status CheckDriver(const std::string& id) const;

  int Count() const;
  std::string DriverDescription() const;  // "" when nobody drives

  // Ends sessions whose lease ran out. Called by the manager's own thread
  // every 50 ms; public for tests.
  void ExpireLeases();

 private:
  struct Entry {
    SessionInfo info;
    absl::Time expires;
  };

  std::string Describe(const Entry& e) const;

  const absl::Duration default_lease_;
  const absl::Duration max_lease_;
  const std::function<void(const std::string&)> on_open_;
  const std::function<void(const std::string&, SessionEnd)> on_end_;
  mutable absl::Mutex mu_;
  std::map<std::string, Entry> sessions_ ABSL_GUARDED_BY(mu_);
  std::string driver_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread expiry_;
};

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_ENGINE_SESSIONS_H_
