// The replays on CUDA: the recurrent kernel's kReplay items over the
// records, the stock kernel's math, after the call's first kernel (which
// wrote what they replay). Rows by replay indices (a commit's plan, every
// layer: EAGER's Commit step 3), or by a list of (layer, block) replays
// whose length only the device knows (DEFERRED's Commit and Flush).
#ifndef SPECSTATE_KERNELS_COMMON_CUDA_REPLAY_CUH_
#define SPECSTATE_KERNELS_COMMON_CUDA_REPLAY_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/checks/commit_plan.h"
#include "kernels/common/cuda/pipelined_recurrent.cuh"
#include "kernels/common/cuda/recurrent_launch.cuh"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace {

// Every row's replay indices in the commit's workspace, every layer: Q
// tokens a row from the records, reading the source at column Q and storing
// only the planned columns.
absl::Status LaunchReplayRows(const CommitArgs& a, int64_t num_blocks, cudaStream_t s) {
  RecurrentLaunch p{};
  p.num_rows = a.num_rows;
  SetHeads(a.shape, &p);
  p.num_layers = a.num_layers;
  p.indices = internal::CommitWorkspaceLayout(a.workspace, a.num_rows, num_blocks).replay_indices;
  p.indices_stride = a.spec_query_len + 1;
  p.window = a.spec_query_len;
  p.max_tokens = a.spec_query_len;
  p.status = a.status;
  p.replay_layers = a.device_layers;
  // The replay reads the records: q = k = kv[:, 0], v = kv[:, 1], g.
  p.async_inputs = true;
  const size_t elem = DTypeSize(a.shape.act_dtype);
  for (int l = 0; l < a.num_layers; ++l) {
    p.async_inputs = p.async_inputs && RecordsAligned(a.layers[l].records, a.shape, elem);
  }
  return LaunchRecurrent<Mode::kReplay>(a.shape, p, a.num_layers, s, "Commit");
}

// The replay of a list the call's first kernel wrote: every job from its
// own layer and records buffer, as many as the list holds.
absl::Status LaunchReplayList(const KdaShape& shape, int q, int num_layers,
                              const CommitLayer* layers, const CommitLayer* device_layers,
                              const ReplayJobs& jobs, const DeviceStatus* status, cudaStream_t s,
                              const char* op, bool usually_empty) {
  RecurrentLaunch p{};
  p.small_grid = usually_empty;
  p.num_rows = jobs.capacity;
  SetHeads(shape, &p);
  p.num_layers = 1;
  p.jobs = jobs.jobs;
  p.job_count = jobs.count;
  p.window = q;
  p.max_tokens = q;
  p.status = status;
  p.replay_layers = device_layers;
  p.async_inputs = true;
  const size_t elem = DTypeSize(shape.act_dtype);
  for (int l = 0; l < num_layers; ++l) {
    p.async_inputs = p.async_inputs && RecordsAligned(layers[l].records, shape, elem) &&
                     RecordsAligned(layers[l].records_alt, shape, elem);
  }
  return LaunchRecurrent<Mode::kReplay>(shape, p, 1, s, op);
}

}  // namespace
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_COMMON_CUDA_REPLAY_CUH_
