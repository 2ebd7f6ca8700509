// The stock spec-path kernel on CUDA: its check kernel (each row, then the
// cross-row pass) and its launcher, which runs the recurrent kernel's
// kStock items after it.
#ifndef SPECSTATE_KERNELS_COMMON_CUDA_STOCK_CUH_
#define SPECSTATE_KERNELS_COMMON_CUDA_STOCK_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/checks/block_checker.cuh"
#include "kernels/checks/stock_rows.h"
#include "kernels/common/cuda/launch.cuh"
#include "kernels/common/cuda/pipelined_recurrent.cuh"
#include "kernels/common/cuda/recurrent_launch.cuh"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace {

// Each row, then the cross-row pass (no block written twice, none written
// and read by two rows).
__global__ void __launch_bounds__(kCheckThreads) StockCheckKernel(const StockArgs a) {
  LetDependentsLaunch();
  if (threadIdx.x == 0) *a.status = internal::OkStatus();
  __syncthreads();
  internal::StockRow unused;
  if (!internal::BlockCheckRows(a.num_rows, a.status,
                                [&](int n) { return internal::CheckStockRow(a, n, &unused); })) {
    return;
  }
  internal::BlockCheckCrossRow(
      a.num_rows, static_cast<int32_t*>(a.workspace), a.status,
      [&](int n, auto fn) {
        internal::StockRow row;
        internal::CheckStockRow(a, n, &row);
        internal::ForEachStockWrite(a, row, n, fn);
      },
      [&](int n, auto fn) {
        internal::StockRow row;
        internal::CheckStockRow(a, n, &row);
        internal::ForEachStockRead(row, n, fn);
      });
}

// The stock kernel: its checks, then the recurrent kernel's kStock items.
absl::Status LaunchStock(const StockArgs& a, cudaStream_t s) {
  StockCheckKernel<<<1, kCheckThreads, 0, s>>>(a);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess || a.num_rows == 0) {
    return LaunchStatus(err, "Stock");
  }
  RecurrentLaunch p{};
  p.num_rows = a.num_rows;
  SetHeads(a.shape, &p);
  p.qsl = a.query_start_loc;
  p.indices = a.ssm_state_indices.data;
  p.indices_stride = a.ssm_state_indices.row_stride;
  p.num_accepted = a.num_accepted_tokens;
  p.max_tokens = internal::StockMaxTokens(a.ssm_state_indices.cols);
  p.status = a.status;
  p.layer = ViewOf(a.q, a.k, a.v, a.g, a.beta, a.out, a.state, a.params);
  p.async_inputs = ViewInputsAligned(p.layer, a.shape, DTypeSize(a.shape.act_dtype));
  return LaunchRecurrent<Mode::kStock>(a.shape, p, 1, s, "Stock");
}

}  // namespace
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_COMMON_CUDA_STOCK_CUH_
