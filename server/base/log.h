// Minimal logging to stderr: one timestamped line per message. (Debian's
// Abseil 20220623 has no absl/log.) Errors are logged where they are handled,
// never from inside macros.
#ifndef SPECSTATE_SERVER_BASE_LOG_H_
#define SPECSTATE_SERVER_BASE_LOG_H_

#include <string>

#include "absl/strings/string_view.h"

namespace specstate {
namespace server {

void LogInfo(absl::string_view message);
void LogError(absl::string_view message);

// SPECSTATE_TRACE=1 in the environment: log where slow calls spend their
// time (diagnostics; off by default).
bool TraceEnabled();

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_BASE_LOG_H_
