#include "server/engine/phase_profile.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/base/log.h"

namespace specstate {
namespace server {

PhaseProfile::PhaseProfile(std::string name, std::vector<std::string> phases, int window)
    : name_(std::move(name)), phases_(std::move(phases)), window_(window) {
  samples_.resize(phases_.size() + 1);
}

bool PhaseProfile::Enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("SPECSTATE_PROFILE");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return enabled;
}

PhaseProfile::Timer::Timer(PhaseProfile& profile)
    : profile_(Enabled() ? &profile : nullptr) {
  if (profile_ == nullptr) return;
  us_.reserve(profile.phases_.size());
  start_ = last_ = std::chrono::steady_clock::now();
}

void PhaseProfile::Timer::Mark() {
  if (profile_ == nullptr || us_.size() == profile_->phases_.size()) return;
  const auto now = std::chrono::steady_clock::now();
  us_.push_back(std::chrono::duration<double, std::micro>(now - last_).count());
  last_ = now;
  if (us_.size() == profile_->phases_.size()) {
    profile_->Record(us_, std::chrono::duration<double, std::micro>(now - start_).count());
  }
}

void PhaseProfile::Record(const std::vector<double>& phases_us, double total_us) {
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < phases_us.size(); ++i) samples_[i].push_back(phases_us[i]);
  samples_.back().push_back(total_us);
  if (static_cast<int>(samples_.back().size()) < window_) return;
  const auto median = [](std::vector<double>& v) {
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  };
  std::string line = absl::StrCat("profile: ", name_, ", medians of ", window_, " calls (us):");
  for (size_t i = 0; i < phases_.size(); ++i) {
    absl::StrAppend(&line, " ", phases_[i], " ", absl::StrFormat("%.2f", median(samples_[i])));
  }
  absl::StrAppend(&line, "; whole ", absl::StrFormat("%.2f", median(samples_.back())));
  for (auto& s : samples_) s.clear();
  LogInfo(line);
}

}  // namespace server
}  // namespace specstate
