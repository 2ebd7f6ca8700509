// Reads have no side effects (issue 35), over a real socket on the CPU
// backend, in every commit mode: a decode loop run on two services, with
// ReadState calls interleaved on one of them, leaves every pool byte of the
// two equal, and what ReadState returned is what a Flush then leaves
// (tests/integration/reads_loop.h). gpu_service_test's
// ReadsChangeNoPoolByte runs the same on CUDA.
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/integration/reads_loop.h"

namespace specstate {
namespace {

class ReadsTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ReadsTest, ReadsChangeNoPoolByte) {
  std::vector<std::string> flags = {"--backend=cpu", "--commit_mode=" + GetParam()};
  if (GetParam() == "fast") flags.push_back("--fold_every=3");
  testing::ExpectReadsChangeNoPoolByte(flags, v1::CPU, 24);
}

INSTANTIATE_TEST_SUITE_P(EveryMode, ReadsTest, ::testing::Values("eager", "deferred", "fast"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace specstate
