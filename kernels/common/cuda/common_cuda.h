// What every commit mode shares on the CUDA backend (common_cuda.cu): the
// verbs without a mode, and the kernels a mode's Commit or Flush runs after
// its own plan kernel (conv compaction, replays). Each launches on the
// caller's stream and never synchronizes; the arguments must have passed the
// host checks (kda_kernels.h, Validate*). The recurrent kernel's kStock and
// kReplay instantiations are compiled once, here.
//
//   absl::Status s = common::LaunchStockCuda(args, stream);
#ifndef SPECSTATE_KERNELS_COMMON_CUDA_COMMON_CUDA_H_
#define SPECSTATE_KERNELS_COMMON_CUDA_COMMON_CUDA_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace common {

// The verbs without a mode: their check kernel, then their work.
absl::Status LaunchStockCuda(const StockArgs& args, cudaStream_t stream);
absl::Status LaunchRecordStateBlocksCuda(const RecordStateBlocksArgs& args, cudaStream_t stream);
absl::Status LaunchLoadParamsCuda(const LoadParamsArgs& args, cudaStream_t stream);
// kda_kernels.h's CopyToHostOnStream.
absl::Status CopyToHostCuda(void* host, const void* device, uint64_t bytes, cudaStream_t stream);

// After a commit's plan kernel (the plan in args.workspace): Commit step 2,
// the conv windows of every layer and row.
absl::Status LaunchConvCompactCuda(const CommitArgs& args, int64_t num_blocks, cudaStream_t stream);
// After EAGER's plan kernel: the replay of every row's replay indices
// (Commit step 3), every layer.
absl::Status LaunchReplayRowsCuda(const CommitArgs& args, int64_t num_blocks, cudaStream_t stream);
// After the kernel that wrote `jobs` (DEFERRED's Commit or Flush): the
// replays it lists. `usually_empty`: a grid of one block an SM.
absl::Status LaunchReplayListCuda(const KdaShape& shape, int q, int num_layers,
                                  const CommitLayer* layers, const CommitLayer* device_layers,
                                  const ReplayJobs& jobs, const DeviceStatus* status,
                                  cudaStream_t stream, const char* op, bool usually_empty);

}  // namespace common
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_COMMON_CUDA_COMMON_CUDA_H_
