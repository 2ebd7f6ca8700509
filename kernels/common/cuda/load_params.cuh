// LoadParams on CUDA: a layer's gate parameters staged, checked finite,
// copied to the layer only when all of them are.
#ifndef SPECSTATE_KERNELS_COMMON_CUDA_LOAD_PARAMS_CUH_
#define SPECSTATE_KERNELS_COMMON_CUDA_LOAD_PARAMS_CUH_

#include <cuda_runtime.h>

#include <climits>

#include "absl/status/status.h"
#include "kernels/checks/block_checker.cuh"
#include "kernels/checks/params.h"
#include "kernels/common/cuda/launch.cuh"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace {

// of them are finite.
__global__ void __launch_bounds__(kCheckThreads) LoadParamsKernel(const LoadParamsArgs a) {
  if (threadIdx.x == 0) *a.status = internal::OkStatus();
  const int count = a.num_heads + a.num_heads * a.head_dim;
  internal::RowFault fault = internal::NoFault();
  int fault_index = INT_MAX;
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    const float x = i < a.num_heads ? a.a_log[i] : a.dt_bias[i - a.num_heads];
    a.staging[i] = x;
    const internal::RowFault f = internal::CheckParamValue(x, i, a.num_heads);
    if (f.problem != 0 && fault_index == INT_MAX) {
      fault = f;
      fault_index = i;
    }
  }
  __shared__ int lowest;
  if (threadIdx.x == 0) lowest = INT_MAX;
  __syncthreads();
  if (fault_index != INT_MAX) atomicMin(&lowest, fault_index);
  __syncthreads();
  const int failed = lowest;
  if (failed != INT_MAX) {
    if (fault_index == failed) *a.status = internal::StatusFromFault(fault, -1, -1);
  } else {
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
      if (i < a.num_heads) {
        a.dst_a_log[i] = a.staging[i];
      } else {
        a.dst_dt_bias[i - a.num_heads] = a.staging[i];
      }
    }
  }
  internal::BlockPublishStatus(a.status, a.status_mirror);
}

absl::Status LaunchLoadParams(const LoadParamsArgs& a, cudaStream_t s) {
  LoadParamsKernel<<<1, kCheckThreads, 0, s>>>(a);
  return LaunchStatus(cudaGetLastError(), "LoadParams");
}

}  // namespace
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_COMMON_CUDA_LOAD_PARAMS_CUH_
