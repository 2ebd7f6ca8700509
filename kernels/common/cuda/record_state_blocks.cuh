// RecordStateBlocks on CUDA (align mode, after the commit): one block checks
// every row, then writes each request's state column and accepted count.
#ifndef SPECSTATE_KERNELS_COMMON_CUDA_RECORD_STATE_BLOCKS_CUH_
#define SPECSTATE_KERNELS_COMMON_CUDA_RECORD_STATE_BLOCKS_CUH_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "kernels/checks/block_checker.cuh"
#include "kernels/checks/record_rows.h"
#include "kernels/common/cuda/launch.cuh"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace {

__device__ void RecordStateBlocks(const RecordStateBlocksArgs& a) {
  if (threadIdx.x == 0) *a.status = internal::OkStatus();
  __syncthreads();
  if (!internal::BlockCheckPrerequisites(a.prerequisites, a.status)) return;
  // The checked rows go to the workspace: the cross-row pass and the writes
  // read them, not the caller's tensors again.
  const internal::RecordWorkspace ws =
      internal::RecordWorkspaceLayout(a.workspace, a.workspace_bytes);
  if (!internal::BlockCheckRows(a.num_rows, a.status, [&](int i) {
        return internal::CheckRecordRow(a, i, &ws.rows[i]);
      })) {
    return;
  }
  if (!internal::BlockCheckCrossRow(
          a.num_rows, ws.owner, a.status,
          [&](int i, auto fn) { internal::ForEachRecordWrite(ws.rows[i], fn); },
          [](int, auto) {})) {
    return;
  }
  for (int i = threadIdx.x; i < a.num_rows; i += blockDim.x) {
    const internal::RecordRow row = ws.rows[i];
    if (row.request_row < 0) continue;
    a.state_idx[row.request_row] = row.state_column;
    a.num_accepted[row.request_row] = 1;
  }
}

__global__ void __launch_bounds__(kCheckThreads)
    RecordStateBlocksKernel(const RecordStateBlocksArgs a) {
  RecordStateBlocks(a);
  internal::BlockPublishStatus(a.status, a.status_mirror);
}

// Each value loaded once, staged, checked; copied to the layer only when all

absl::Status LaunchRecordStateBlocks(const RecordStateBlocksArgs& a, cudaStream_t s) {
  RecordStateBlocksKernel<<<1, kCheckThreads, 0, s>>>(a);
  return LaunchStatus(cudaGetLastError(), "RecordStateBlocks");
}

}  // namespace
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_COMMON_CUDA_RECORD_STATE_BLOCKS_CUH_
