// Where a call's handling time goes, phase by phase, without a line per
// call (SPECSTATE_TRACE's per-call logging slows the very path it measures).
// Off unless SPECSTATE_PROFILE=1; then every `window` calls it logs the
// median of each phase and of the whole, and starts over.
//
//   static PhaseProfile profile("Verify", {"resolve", "submit", "reply"});
//   PhaseProfile::Timer t(profile);   // starts the first phase
//   ...; t.Mark();                    // ends "resolve"
//   ...; t.Mark();                    // ends "submit"
//   ...; t.Mark();                    // ends "reply": one sample recorded
//
// A Timer whose phases were not all marked (an early return) records
// nothing.
#ifndef SPECSTATE_SERVER_ENGINE_PHASE_PROFILE_H_
#define SPECSTATE_SERVER_ENGINE_PHASE_PROFILE_H_

#include <chrono>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace specstate {
namespace server {

class PhaseProfile {
 public:
  PhaseProfile(std::string name, std::vector<std::string> phases, int window = 2000);

  // SPECSTATE_PROFILE=1 in the environment.
  static bool Enabled();

  class Timer {
   public:
    explicit Timer(PhaseProfile& profile);
    // Ends the current phase; after the last, records the sample.
    void Mark();

   private:
    PhaseProfile* profile_;  // null when profiling is off
    std::vector<double> us_;
    std::chrono::steady_clock::time_point start_, last_;
  };

 private:
  void Record(const std::vector<double>& phases_us, double total_us);

  const std::string name_;
  const std::vector<std::string> phases_;
  const int window_;
  absl::Mutex mu_;
  std::vector<std::vector<double>> samples_ ABSL_GUARDED_BY(mu_);  // per phase, then the total
};

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_ENGINE_PHASE_PROFILE_H_
