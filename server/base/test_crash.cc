#include "server/base/test_crash.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace specstate {
namespace server {
namespace {

std::atomic<bool> g_set{false};
std::string* g_point = nullptr;  // written once, before serving
std::atomic<int64_t> g_remaining{0};

}  // namespace

absl::Status SetTestCrash(const std::string& spec) {
  if (spec.empty()) return absl::OkStatus();
  const size_t colon = spec.rfind(':');
  int64_t n = 0;
  if (colon == std::string::npos || colon == 0 || !absl::SimpleAtoi(spec.substr(colon + 1), &n) ||
      n < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--test_crash_at=", spec, ": expected POINT:N with N >= 1 (POINT one of verify, "
        "commit:enqueued, commit:started, commit:conv, commit:layer, commit:deferred, "
        "commit:replayed, verify:replayed, flush:taken, restore:layer)"));
  }
  const std::string point = spec.substr(0, colon);
  static const char* const kPoints[] = {
      "verify",          "commit:enqueued", "commit:started",  "commit:conv",   "commit:layer",
      "commit:deferred", "commit:replayed", "verify:replayed", "flush:taken", "restore:layer"};
  bool known = false;
  for (const char* p : kPoints) known |= point == p;
  if (!known) {
    return absl::InvalidArgumentError(absl::StrCat("--test_crash_at=", spec, ": unknown point \"",
                                                   point, "\""));
  }
  g_point = new std::string(point);
  g_remaining.store(n);
  g_set.store(true);
  return absl::OkStatus();
}

bool TestCrashSet() { return g_set.load(std::memory_order_relaxed); }

void TestCrashPoint(absl::string_view point) {
  if (!g_set.load(std::memory_order_relaxed) || point != *g_point) return;
  if (g_remaining.fetch_sub(1) != 1) return;
  const std::string line = absl::StrCat("specstated: test crash at ", point, "\n");
  ssize_t ignored = write(2, line.data(), line.size());
  (void)ignored;
  kill(getpid(), SIGKILL);
  pause();
}

void CommitTestHook(const char* phase) { TestCrashPoint(absl::StrCat("commit:", phase)); }

void PendingTestHook(const char* point) { TestCrashPoint(point); }

}  // namespace server
}  // namespace specstate
