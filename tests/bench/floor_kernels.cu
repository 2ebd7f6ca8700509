#include "tests/bench/floor_kernels.h"

#include <cuda_bf16.h>

namespace specstate {
namespace bench {
namespace {

constexpr int kFloorThreads = 256;

__global__ void EmptyKernel() {}

__device__ __forceinline__ float SumOf(const uint4& x, float) {
  return __uint_as_float(x.x) + __uint_as_float(x.y) + __uint_as_float(x.z) +
         __uint_as_float(x.w);
}

__device__ __forceinline__ float SumOf(const uint4& x, __nv_bfloat16) {
  // A bf16 is the high half of the float with the same bits.
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) sum += __uint_as_float(w[i] << 16) + __uint_as_float(w[i] & 0xffff0000u);
  return sum;
}

template <typename State, int K>
__global__ void __launch_bounds__(kFloorThreads)
    CheckpointReadFloor(const State* state, int64_t block_stride, const int32_t* indices,
                        const int32_t* hops, int dependent_loads, float* out) {
  constexpr int kPerLoad = 16 / int(sizeof(State));     // elements a 16-byte load
  constexpr int kLoadsPerRow = K / kPerLoad;            // 32 or 16 (K = 128), 16 or 8 (K = 64)
  constexpr int kMaxLoads = K * K / kPerLoad / kFloorThreads;  // a thread's share, unsplit
  static_assert(kLoadsPerRow <= 32 && 32 % kLoadsPerRow == 0, "a state row's loads in one warp");
  const int n = blockIdx.x, hv = blockIdx.y;
  const int rows = K / int(gridDim.z), v_lo = int(blockIdx.z) * rows;
  int32_t block = indices[n];
  if (dependent_loads > 1) block += hops[block];
  const uint4* slice = reinterpret_cast<const uint4*>(state + int64_t{block} * block_stride +
                                                      int64_t{hv} * K * K + int64_t{v_lo} * K);
  const int loads = rows * kLoadsPerRow;
  uint4 x[kMaxLoads];
#pragma unroll
  for (int i = 0; i < kMaxLoads; ++i) {
    const int at = threadIdx.x + i * kFloorThreads;
    x[i] = at < loads ? __ldg(slice + at) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int i = 0; i < kMaxLoads; ++i) {
    const int at = threadIdx.x + i * kFloorThreads;
    if (at >= loads) break;  // the same for a whole row's lanes
    float sum = SumOf(x[i], State{});
#pragma unroll
    for (int o = kLoadsPerRow / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (at % kLoadsPerRow == 0) out[(int64_t{n} * gridDim.y + hv) * K + v_lo + at / kLoadsPerRow] = sum;
  }
}

template <typename State>
cudaError_t LaunchFloorOf(const void* state, int64_t block_stride, int K, const int32_t* indices,
                          const int32_t* hops, int dependent_loads, dim3 grid, float* out,
                          cudaStream_t stream) {
  const State* s = static_cast<const State*>(state);
  if (K == 128) {
    CheckpointReadFloor<State, 128>
        <<<grid, kFloorThreads, 0, stream>>>(s, block_stride, indices, hops, dependent_loads, out);
  } else {
    CheckpointReadFloor<State, 64>
        <<<grid, kFloorThreads, 0, stream>>>(s, block_stride, indices, hops, dependent_loads, out);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchEmptyKernel(cudaStream_t stream) {
  EmptyKernel<<<1, 32, 0, stream>>>();
  return cudaGetLastError();
}

cudaError_t LaunchCheckpointReadFloor(const void* state, bool bf16_state, int64_t block_stride,
                                      int K, const int32_t* indices, const int32_t* hops,
                                      int dependent_loads, int rows, int value_heads, int splits,
                                      float* out, cudaStream_t stream) {
  if ((K != 64 && K != 128) || (splits != 1 && splits != 2 && splits != 4 && splits != 8) ||
      rows <= 0 || value_heads <= 0 || dependent_loads < 1 || dependent_loads > 2 ||
      (dependent_loads == 2 && hops == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(rows, value_heads, splits);
  return bf16_state ? LaunchFloorOf<__nv_bfloat16>(state, block_stride, K, indices, hops,
                                                   dependent_loads, grid, out, stream)
                    : LaunchFloorOf<float>(state, block_stride, K, indices, hops,
                                           dependent_loads, grid, out, stream);
}

}  // namespace bench
}  // namespace specstate
