#include "server/base/log.h"

#include <cstdio>
#include <cstdlib>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace specstate {
namespace server {
namespace {

void Write(char level, absl::string_view message) {
  const std::string when = absl::FormatTime("%Y-%m-%d %H:%M:%E3S", absl::Now(), absl::UTCTimeZone());
  std::fprintf(stderr, "%c %s specstated: %.*s\n", level, when.c_str(),
               static_cast<int>(message.size()), message.data());
  std::fflush(stderr);
}

}  // namespace

void LogInfo(absl::string_view message) { Write('I', message); }

bool TraceEnabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("SPECSTATE_TRACE");
    return v != nullptr && *v != '\0' && *v != '0';
  }();
  return enabled;
}
void LogError(absl::string_view message) { Write('E', message); }

}  // namespace server
}  // namespace specstate
