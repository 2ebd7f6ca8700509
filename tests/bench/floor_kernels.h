// Floors for kda_bench's per-layer times: what the timing harness and the
// memory system cost before any RecoverSSM math, measured in the same run as
// the kernels they bound (docs/benchmarks.md, "What bounds each mode").
#ifndef SPECSTATE_TESTS_BENCH_FLOOR_KERNELS_H_
#define SPECSTATE_TESTS_BENCH_FLOOR_KERNELS_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace specstate {
namespace bench {

// One block of one warp that does nothing: a launch's own cost.
cudaError_t LaunchEmptyKernel(cudaStream_t stream);

// The least a Verify must do with a row's checkpoint: find it, read it once,
// write a result. Grid (rows, value_heads, splits), 256 threads a block; a
// block reads state rows [K / splits * z, K / splits * (z + 1)) of its
// (row, value head)'s K x K slice, every 16-byte load issued before any is
// used, and writes each state row's sum to out[(row * value_heads + hv) * K
// + v]. The slice's block comes after `dependent_loads` loads in a chain:
// 1: block = indices[row]; 2: then hops[block] added to it (as a Verify
// reads the row's cursor before its ring and state; hops holds zeros).
// `state` holds blocks of `block_stride` elements (fp32, or bf16 where
// bf16_state), each value head's K x K slice at hv * K * K. K: 64 or 128;
// splits: 1, 2, 4 or 8. Asynchronous on `stream`.
cudaError_t LaunchCheckpointReadFloor(const void* state, bool bf16_state, int64_t block_stride,
                                      int K, const int32_t* indices, const int32_t* hops,
                                      int dependent_loads, int rows, int value_heads, int splits,
                                      float* out, cudaStream_t stream);

}  // namespace bench
}  // namespace specstate

#endif  // SPECSTATE_TESTS_BENCH_FLOOR_KERNELS_H_
