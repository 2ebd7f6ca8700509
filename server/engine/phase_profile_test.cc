#include "server/engine/phase_profile.h"

#include <cstdlib>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace specstate {
namespace server {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Before any Enabled() call of this process: the switch is read once.
const bool kProfiling = [] { return setenv("SPECSTATE_PROFILE", "1", 1) == 0; }();

TEST(PhaseProfileTest, LogsEachPhasesMedianOnceAWindowIsFull) {
  ASSERT_TRUE(kProfiling);
  ASSERT_TRUE(PhaseProfile::Enabled());
  PhaseProfile profile("Example", {"first", "second"}, /*window=*/3);
  ::testing::internal::CaptureStderr();
  for (int i = 0; i < 2; ++i) {
    PhaseProfile::Timer t(profile);
    t.Mark();
    t.Mark();
  }
  EXPECT_THAT(::testing::internal::GetCapturedStderr(), Not(HasSubstr("profile:")));
  ::testing::internal::CaptureStderr();
  {
    PhaseProfile::Timer t(profile);
    t.Mark();
    t.Mark();
    t.Mark();  // past the last phase: ignored
  }
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(log, HasSubstr("profile: Example, medians of 3 calls (us): first "));
  EXPECT_THAT(log, HasSubstr(" second "));
  EXPECT_THAT(log, HasSubstr("; whole "));
}

TEST(PhaseProfileTest, ATimerNotMarkedThroughRecordsNothing) {
  PhaseProfile profile("Partial", {"a", "b"}, /*window=*/1);
  ::testing::internal::CaptureStderr();
  {
    PhaseProfile::Timer t(profile);
    t.Mark();  // an early return: "b" never ends
  }
  EXPECT_THAT(::testing::internal::GetCapturedStderr(), Not(HasSubstr("profile:")));
  ::testing::internal::CaptureStderr();
  {
    PhaseProfile::Timer t(profile);
    t.Mark();
    t.Mark();
  }
  EXPECT_THAT(::testing::internal::GetCapturedStderr(), HasSubstr("profile: Partial"));
}

}  // namespace
}  // namespace server
}  // namespace specstate
