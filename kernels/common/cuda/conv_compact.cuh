// A commit's conv compaction on CUDA (every mode's Commit step 2), after the
// call's plan kernel, as its programmatic dependent.
#ifndef SPECSTATE_KERNELS_COMMON_CUDA_CONV_COMPACT_CUH_
#define SPECSTATE_KERNELS_COMMON_CUDA_CONV_COMPACT_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/checks/commit_plan.h"
#include "kernels/common/cuda/launch.cuh"
#include "kernels/internal/dispatch.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace {

constexpr int kConvThreads = 256;

// docs/semantics.md, Commit step 2: one thread per (layer, row, conv channel) reads
// the row's windows into registers before it writes them (the final or
// boundary block may be the source).
template <typename Act>
__global__ void __launch_bounds__(kConvThreads)
    ConvCompactKernel(const CommitArgs a, int64_t num_blocks, int dim_blocks, int history_len) {
  LetDependentsLaunch();
  WaitForPrerequisiteGrid();
  if (a.status->failed) return;
  const int64_t block = blockIdx.x;
  const int dim_block = static_cast<int>(block % dim_blocks);
  const int i = static_cast<int>((block / dim_blocks) % a.num_rows);
  const int l = static_cast<int>(block / (int64_t{dim_blocks} * a.num_rows));
  const int d = dim_block * kConvThreads + threadIdx.x;
  const internal::CommitWorkspace ws =
      internal::CommitWorkspaceLayout(a.workspace, a.num_rows, num_blocks);
  const CommitPlanRow plan = ws.plan[i];
  const ConvPool c = a.device_layers[l].conv;
  if (!internal::CommitsAnything(plan) || d >= c.dim) return;
  const bool boundary = a.block_table.data != nullptr && internal::IsBlock(plan.boundary_block);
  Act* const base = static_cast<Act*>(c.data);
  const Act* src = base + int64_t{plan.source} * c.block_stride + d * c.dim_stride;
  Act final_window[kMaxConvHistory];
  Act boundary_window[kMaxConvHistory];
#pragma unroll
  for (int x = 0; x < kMaxConvHistory; ++x) {
    if (x < history_len) {
      final_window[x] = src[int64_t(plan.commit_len - 1 + x) * c.token_stride];
      if (boundary) boundary_window[x] = src[int64_t(plan.boundary_len - 1 + x) * c.token_stride];
    }
  }
  Act* dst = base + int64_t{plan.final_block} * c.block_stride + d * c.dim_stride;
  Act* bdst = base + int64_t{plan.boundary_block} * c.block_stride + d * c.dim_stride;
#pragma unroll
  for (int x = 0; x < kMaxConvHistory; ++x) {
    if (x < history_len) {
      if (boundary) bdst[x * c.token_stride] = boundary_window[x];
      dst[x * c.token_stride] = final_window[x];
    }
  }
}

// Every layer's and row's conv windows along the plan in the workspace.
absl::Status LaunchConvCompact(const CommitArgs& a, int64_t num_blocks, cudaStream_t s) {
  const int history_len = a.layers[0].conv.width - a.spec_query_len + 1;
  const int dim_blocks = (a.layers[0].conv.dim + kConvThreads - 1) / kConvThreads;
  cudaError_t conv_err = cudaSuccess;
  const int64_t conv_blocks = int64_t{dim_blocks} * a.num_rows * a.num_layers;
  internal::DispatchAct(a.shape.act_dtype, [&](auto act) {
    conv_err = LaunchDependent(ConvCompactKernel<typename decltype(act)::type>,
                               static_cast<unsigned>(conv_blocks), kConvThreads, 0, s, a,
                               num_blocks, dim_blocks, history_len);
  });
  return LaunchStatus(conv_err != cudaSuccess ? conv_err : cudaGetLastError(), "Commit");
}

}  // namespace
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_COMMON_CUDA_CONV_COMPACT_CUH_
