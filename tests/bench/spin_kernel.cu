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

}  // namespace

cudaError_t LaunchSpin(double us, cudaStream_t stream) {
  Spin<<<1, 32, 0, stream>>>(static_cast<long long>(us * 1000.0));
  return cudaGetLastError();
}

}  // namespace bench
}  // namespace specstate
