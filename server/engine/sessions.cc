#include "server/engine/sessions.h"

#include <vector>

#include <sys/random.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace specstate {
namespace server {

SessionManager::SessionManager(absl::Duration default_lease, absl::Duration max_lease,
                               std::function<void(const std::string&)> on_open,
                               std::function<void(const std::string&, SessionEnd)> on_end)
    : default_lease_(default_lease),
      max_lease_(max_lease),
      on_open_(std::move(on_open)),
      on_end_(std::move(on_end)) {
  expiry_ = std::thread([this] {
    for (;;) {
      {
        absl::MutexLock lock(&mu_);
        auto stop = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_; };
        mu_.AwaitWithTimeout(absl::Condition(&stop), absl::Milliseconds(50));
        if (stopping_) return;
      }
      ExpireLeases();
    }
  });
}

SessionManager::~SessionManager() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  expiry_.join();
}

std::string SessionManager::Describe(const Entry& e) const {
  return absl::StrCat("session ", e.info.label, " (client \"", e.info.client_name, "\")");
}

namespace {

// 128 bits from the kernel's CSPRNG, as hex.
absl::StatusOr<std::string> RandomHex128() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(absl::StrCat("getrandom: ", std::strerror(errno)));
    }
    got += static_cast<size_t>(n);
  }
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

}  // namespace

absl::StatusOr<SessionInfo> SessionManager::Open(const std::string& client_name,
                                                 uint32_t lease_ms, bool drive) {
  absl::Duration lease = lease_ms == 0 ? default_lease_ : absl::Milliseconds(lease_ms);
  if (lease > max_lease_) lease = max_lease_;
  absl::MutexLock lock(&mu_);
  if (drive && !driver_.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "another session drives this service: ", Describe(sessions_.at(driver_)),
        "; it must end (close its stream or let its lease expire) before another can drive"));
  }
  absl::StatusOr<std::string> secret = RandomHex128();
  if (!secret.ok()) return secret.status();
  Entry e;
  e.info.label = absl::StrCat("s", next_id_++);
  e.info.id = absl::StrCat(e.info.label, "-", *secret);
  e.info.client_name = client_name;
  e.info.lease = lease;
  e.info.driving = drive;
  e.expires = absl::Now() + lease;
  if (drive) driver_ = e.info.id;
  sessions_.emplace(e.info.id, e);
  on_open_(e.info.id);
  return e.info;
}

absl::StatusOr<SessionInfo> SessionManager::Renew(const std::string& id) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return absl::NotFoundError(absl::StrCat("session ", id, " has ended"));
  it->second.expires = absl::Now() + it->second.info.lease;
  return it->second.info;
}

void SessionManager::Close(const std::string& id, SessionEnd why) {
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(id);
    if (it == sessions_.end()) return;
    if (driver_ == id) driver_.clear();
    sessions_.erase(it);
  }
  on_end_(id, why);
}

absl::Status SessionManager::CheckLive(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  if (id.empty()) {
    return absl::InvalidArgumentError("session_id is empty: open a session with the Session call");
  }
  if (sessions_.count(id) == 0) {
    return absl::FailedPreconditionError(absl::StrCat("session ", id, " does not exist or has ended"));
  }
  return absl::OkStatus();
}

absl::Status SessionManager::CheckDriver(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  if (id.empty()) {
    return absl::InvalidArgumentError(
        "session_id is empty: open a driving session with the Session call");
  }
  if (driver_ == id) return absl::OkStatus();
  if (sessions_.count(id) == 0) {
    return absl::FailedPreconditionError(absl::StrCat("session ", id, " does not exist or has ended"));
  }
  if (driver_.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", id, " does not drive: open it with drive=true"));
  }
  return absl::FailedPreconditionError(absl::StrCat("session ", id, " does not drive; ",
                                                    Describe(sessions_.at(driver_)), " does"));
}

int SessionManager::Count() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(sessions_.size());
}

std::string SessionManager::DriverDescription() const {
  absl::MutexLock lock(&mu_);
  if (driver_.empty()) return "";
  return Describe(sessions_.at(driver_));
}

void SessionManager::ExpireLeases() {
  std::vector<std::string> expired;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    for (const auto& [id, e] : sessions_) {
      if (e.expires < now) expired.push_back(id);
    }
  }
  for (const std::string& id : expired) Close(id, SessionEnd::kExpired);
}

}  // namespace server
}  // namespace specstate
