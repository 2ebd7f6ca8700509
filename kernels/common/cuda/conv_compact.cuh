// A commit's conv compaction on CUDA (every mode's Commit step 2), after the
// call's plan kernel, as its programmatic dependent.
#ifndef SPECSTATE_KERNELS_COMMON_CUDA_CONV_COMPACT_CUH_
#define SPECSTATE_KERNELS_COMMON_CUDA_CONV_COMPACT_CUH_

#include <cuda_runtime.h>

#include <cstdint>
#include <numeric>

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
// boundary block may be the source). Any strides; the dense layout takes
// ConvCompactDenseKernel.
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

// The dense layout (the service's: a block's windows one run of dim x width
// elements, channel after channel, 16-byte aligned): the same copies at copy
// speed. A thread block takes a chunk of whole channels of one (layer, row):
// it loads the chunk of the source block (and of the final and boundary
// blocks where they differ from it; their columns past the history keep
// their bytes) into shared memory in 16-byte vectors, coalesced, then
// writes whole vectors, boundary first, as ConvCompactKernel. (That kernel
// moved 2 bytes a load and reached ~22% of copy bandwidth at N = 256.)
template <typename Act>
__global__ void __launch_bounds__(kConvThreads)
    ConvCompactDenseKernel(const CommitArgs a, int64_t num_blocks, int chunks, int chunk_vecs,
                           int history_len) {
  extern __shared__ uint4 conv_chunks[];  // source, final, boundary: chunk_vecs each
  LetDependentsLaunch();
  WaitForPrerequisiteGrid();
  if (a.status->failed) return;
  const int64_t block = blockIdx.x;
  const int chunk = static_cast<int>(block % chunks);
  const int i = static_cast<int>((block / chunks) % a.num_rows);
  const int l = static_cast<int>(block / (int64_t{chunks} * a.num_rows));
  const internal::CommitWorkspace ws =
      internal::CommitWorkspaceLayout(a.workspace, a.num_rows, num_blocks);
  const CommitPlanRow plan = ws.plan[i];
  if (!internal::CommitsAnything(plan)) return;
  const ConvPool c = a.device_layers[l].conv;
  constexpr int kPerVec = 16 / sizeof(Act);
  const int64_t region_vecs = int64_t{c.dim} * c.width / kPerVec;
  const int64_t first = int64_t{chunk} * chunk_vecs;
  const int n = static_cast<int>(region_vecs - first < chunk_vecs ? region_vecs - first : chunk_vecs);
  if (n <= 0) return;
  const bool boundary = a.block_table.data != nullptr && internal::IsBlock(plan.boundary_block);
  const bool final_is_source = plan.final_block == plan.source;
  const bool boundary_is_source = plan.boundary_block == plan.source;
  const bool boundary_is_final = plan.boundary_block == plan.final_block;
  uint4* const pool = static_cast<uint4*>(c.data);
  const int64_t block_vecs = c.block_stride / kPerVec;
  uint4* const src = pool + plan.source * block_vecs + first;
  uint4* const dst = pool + plan.final_block * block_vecs + first;
  uint4* const bdst = pool + plan.boundary_block * block_vecs + first;
  uint4* const s_src = conv_chunks;
  uint4* const s_dst = s_src + chunk_vecs;
  uint4* const s_bnd = s_dst + chunk_vecs;
  for (int j = threadIdx.x; j < n; j += kConvThreads) {
    s_src[j] = src[j];
    if (!final_is_source) s_dst[j] = dst[j];
    if (boundary && !boundary_is_source && !boundary_is_final) s_bnd[j] = bdst[j];
  }
  __syncthreads();
  const Act* const e_src = reinterpret_cast<const Act*>(s_src);
  const Act* const e_dst = final_is_source ? e_src : reinterpret_cast<const Act*>(s_dst);
  const Act* const e_bnd = boundary_is_source  ? e_src
                           : boundary_is_final ? e_dst
                                               : reinterpret_cast<const Act*>(s_bnd);
  const int W = c.width;
  for (int j = threadIdx.x; j < n; j += kConvThreads) {
    alignas(16) Act out[kPerVec];
    alignas(16) Act bout[kPerVec];
#pragma unroll
    for (int e = 0; e < kPerVec; ++e) {
      const int idx = j * kPerVec + e;  // in the chunk, which starts a channel
      const int ch = idx / W, x = idx - ch * W;
      const bool moved = x < history_len;
      out[e] = moved ? e_src[ch * W + plan.commit_len - 1 + x] : e_dst[idx];
      if (boundary) bout[e] = moved ? e_src[ch * W + plan.boundary_len - 1 + x] : e_bnd[idx];
    }
    if (boundary) bdst[j] = *reinterpret_cast<const uint4*>(bout);
    dst[j] = *reinterpret_cast<const uint4*>(out);
  }
}

// Whether every layer's conv pool has the dense layout, 16-byte aligned.
inline bool ConvPoolsDense(const CommitArgs& a, int elem_bytes) {
  for (int l = 0; l < a.num_layers; ++l) {
    const ConvPool& c = a.layers[l].conv;
    if (c.token_stride != 1 || c.dim_stride != c.width ||
        reinterpret_cast<uintptr_t>(c.data) % 16 != 0 || (c.block_stride * elem_bytes) % 16 != 0 ||
        (int64_t{c.dim} * c.width * elem_bytes) % 16 != 0) {
      return false;
    }
  }
  return true;
}

// Every layer's and row's conv windows along the plan in the workspace.
absl::Status LaunchConvCompact(const CommitArgs& a, int64_t num_blocks, cudaStream_t s) {
  const ConvPool& c0 = a.layers[0].conv;
  const int history_len = c0.width - a.spec_query_len + 1;
  cudaError_t conv_err = cudaSuccess;
  internal::DispatchAct(a.shape.act_dtype, [&](auto act) {
    using Act = typename decltype(act)::type;
    constexpr int kBytes = sizeof(Act);
    if (ConvPoolsDense(a, kBytes)) {
      // Chunks of about 2 vectors a thread, whole channels, 16-byte aligned:
      // a multiple of lcm(channel bytes, 16) / 16 vectors.
      const int unit = std::lcm(c0.width * kBytes, 16) / 16;
      const int64_t region_vecs = int64_t{c0.dim} * c0.width * kBytes / 16;
      const int64_t chunks = (region_vecs + 2 * kConvThreads - 1) / (2 * kConvThreads);
      int64_t chunk_vecs = (region_vecs + chunks - 1) / chunks;
      chunk_vecs = (chunk_vecs + unit - 1) / unit * unit;
      const int64_t blocks = chunks * a.num_rows * a.num_layers;
      conv_err = LaunchDependent(ConvCompactDenseKernel<Act>, static_cast<unsigned>(blocks),
                                 kConvThreads, 3 * chunk_vecs * sizeof(uint4), s, a, num_blocks,
                                 static_cast<int>(chunks), static_cast<int>(chunk_vecs),
                                 history_len);
      return;
    }
    const int dim_blocks = (c0.dim + kConvThreads - 1) / kConvThreads;
    const int64_t blocks = int64_t{dim_blocks} * a.num_rows * a.num_layers;
    conv_err = LaunchDependent(ConvCompactKernel<Act>, static_cast<unsigned>(blocks), kConvThreads,
                               0, s, a, num_blocks, dim_blocks, history_len);
  });
  return LaunchStatus(conv_err != cudaSuccess ? conv_err : cudaGetLastError(), "Commit");
}

}  // namespace
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_COMMON_CUDA_CONV_COMPACT_CUH_
