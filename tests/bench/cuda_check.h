// What the GPU benchmarks share: a check that ends the run on a CUDA error,
// and the driver's stream memory operations (the service's doorbells),
// reached through the runtime's entry-point query (no -lcuda).
#ifndef SPECSTATE_TESTS_BENCH_CUDA_CHECK_H_
#define SPECSTATE_TESTS_BENCH_CUDA_CHECK_H_

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "kernels/cuda_status.h"

// Prints "file:line: CODE: expr: description (cudaErrorName)" and exits.
#define CHECK_CUDA(expr)                                                                   \
  do {                                                                                     \
    const cudaError_t bench_err = (expr);                                                  \
    if (bench_err != cudaSuccess) {                                                        \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__,                              \
                   ::specstate::kernels::CudaStatus(bench_err, #expr).ToString().c_str()); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

namespace specstate {
namespace bench {

// cuStreamWaitValue32 (GEQ) and cuStreamWriteValue32 on `stream`; each ends
// the run if the driver refuses. LoadStreamValueOps() first, once.
void LoadStreamValueOps();
void WaitGeq(cudaStream_t stream, const uint32_t* counter, uint32_t value);
void Ring(cudaStream_t stream, uint32_t* counter, uint32_t value);

}  // namespace bench
}  // namespace specstate

#endif  // SPECSTATE_TESTS_BENCH_CUDA_CHECK_H_
