// A GPU kernel that stands in for the rest of a model's layer: it keeps the
// stream busy for a given time (one block, so it moves no memory).
#ifndef SPECSTATE_TESTS_BENCH_SPIN_KERNEL_H_
#define SPECSTATE_TESTS_BENCH_SPIN_KERNEL_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace specstate {
namespace bench {

// Enqueues a kernel that spins for `us` microseconds on `stream`.
cudaError_t LaunchSpin(double us, cudaStream_t stream);

// Enqueues a one-warp kernel that polls until *counter >= value (the wrapping
// compare of CU_STREAM_WAIT_VALUE_GEQ): a stream wait done by a kernel.
cudaError_t LaunchPollGeq(const uint32_t* counter, uint32_t value, cudaStream_t stream);

}  // namespace bench
}  // namespace specstate

#endif  // SPECSTATE_TESTS_BENCH_SPIN_KERNEL_H_
