#include "tests/bench/spin_kernel.h"

namespace specstate {
namespace bench {
namespace {

__global__ void Spin(long long nanoseconds) {
  long long start;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (;;) {
    long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start >= nanoseconds) break;
  }
}

__global__ void PollGeq(const uint32_t* counter, uint32_t value) {
  const volatile uint32_t* c = counter;
  while (static_cast<int32_t>(*c - value) < 0) {
  }
  __threadfence();  // what follows on the stream reads after the ring
}

}  // namespace

cudaError_t LaunchPollGeq(const uint32_t* counter, uint32_t value, cudaStream_t stream) {
  PollGeq<<<1, 32, 0, stream>>>(counter, value);
  return cudaGetLastError();
}

cudaError_t LaunchSpin(double us, cudaStream_t stream) {
  Spin<<<1, 32, 0, stream>>>(static_cast<long long>(us * 1000.0));
  return cudaGetLastError();
}

}  // namespace bench
}  // namespace specstate
