// What every commit mode shares on the CUDA backend (common_cuda.h): one
// translation unit for the kernels of the verbs without a mode and for the
// recurrent kernel's kStock and kReplay instantiations.
#include "kernels/common/cuda/common_cuda.h"
#include "kernels/common/cuda/conv_compact.cuh"
#include "kernels/common/cuda/copy_to_host.cuh"
#include "kernels/common/cuda/load_params.cuh"
#include "kernels/common/cuda/record_state_blocks.cuh"
#include "kernels/common/cuda/replay.cuh"
#include "kernels/common/cuda/stock.cuh"

namespace specstate {
namespace kernels {
namespace common {

absl::Status LaunchStockCuda(const StockArgs& a, cudaStream_t s) { return LaunchStock(a, s); }

absl::Status LaunchRecordStateBlocksCuda(const RecordStateBlocksArgs& a, cudaStream_t s) {
  return LaunchRecordStateBlocks(a, s);
}

absl::Status LaunchLoadParamsCuda(const LoadParamsArgs& a, cudaStream_t s) {
  return LaunchLoadParams(a, s);
}

absl::Status CopyToHostCuda(void* host, const void* device, uint64_t bytes, cudaStream_t s) {
  return LaunchCopyToHost(host, device, bytes, s);
}

absl::Status LaunchConvCompactCuda(const CommitArgs& a, int64_t num_blocks, cudaStream_t s) {
  return LaunchConvCompact(a, num_blocks, s);
}

absl::Status LaunchReplayRowsCuda(const CommitArgs& a, int64_t num_blocks, cudaStream_t s) {
  return LaunchReplayRows(a, num_blocks, s);
}

absl::Status LaunchReplayListCuda(const KdaShape& shape, int q, int num_layers,
                                  const CommitLayer* layers, const CommitLayer* device_layers,
                                  const ReplayJobs& jobs, const DeviceStatus* status,
                                  cudaStream_t s, const char* op, bool usually_empty) {
  return LaunchReplayList(shape, q, num_layers, layers, device_layers, jobs, status, s, op,
                          usually_empty);
}

}  // namespace common
}  // namespace kernels
}  // namespace specstate
