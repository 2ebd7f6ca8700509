// LoadParams on every backend: a layer's gate parameters (A_log, dt_bias)
// are copied only when every element is finite, which the device checks.
#include <cmath>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/device_status.h"
#include "kernels/kda_args.h"
#include "kernels/testing/backend_memory.h"
#include "kernels/testing/kernel_harness.h"

namespace specstate {
namespace kernels {
namespace testing {
namespace {

using ::testing::HasSubstr;

// LoadParams copies finite parameters, and refuses a NaN or an infinity in
// either tensor naming its element, leaving the destination as it was.
TEST_P(KdaKernelsTest, LoadParamsChecksFinitenessOnTheDevice) {
  const int H = rng().Int(1, 6);
  const int K = 64;
  const int count = H + H * K;
  std::vector<float> src(count), old(count);
  for (float& x : src) x = rng().Uniform(-2.0f, 2.0f);
  for (float& x : old) x = rng().Uniform(-2.0f, 2.0f);
  Tensor staging = Zeroed(count * sizeof(float));
  Tensor dst = Upload(ToBytes(old));
  BackendBuffer status = Must(BackendBuffer::Allocate(backend(), sizeof(DeviceStatus)), "status");
  const auto run = [&](const std::vector<float>& values) {
    Tensor source = Upload(ToBytes(values));
    LoadParamsArgs a;
    a.num_heads = H;
    a.head_dim = K;
    a.a_log = source.As<float>();
    a.dt_bias = source.As<float>() + H;
    a.staging = staging.As<float>();
    a.dst_a_log = dst.As<float>();
    a.dst_dt_bias = dst.As<float>() + H;
    a.status = status.As<DeviceStatus>();
    a.status_mirror = ZeroedMirror();
    return Finish(kernels_->LoadParams(a, stream()), "LoadParams", status.As<DeviceStatus>());
  };
  for (float bad : {std::nanf(""), INFINITY, -INFINITY}) {
    const int at = rng().Int(0, count - 1);
    SCOPED_TRACE(absl::StrCat(bad, " at ", at));
    std::vector<float> values = src;
    values[at] = bad;
    const CallResult r = run(values);
    ASSERT_TRUE(r.launch.ok()) << r.launch;
    EXPECT_EQ(r.device.code(), absl::StatusCode::kInvalidArgument) << r.device;
    const std::string element =
        at < H ? absl::StrCat("a_log[", at, "]") : absl::StrCat("dt_bias[", at - H, "]");
    EXPECT_THAT(std::string(r.device.message()), HasSubstr(element + " is not finite"));
    EXPECT_EQ(FromBytes<float>(dst.Read()), old);
  }
  ASSERT_TRUE(CallOk(run(src)));
  EXPECT_EQ(FromBytes<float>(dst.Read()), src);
}

}  // namespace
}  // namespace testing
}  // namespace kernels
}  // namespace specstate
