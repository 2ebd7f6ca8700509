// Commit mode DEFERRED's Flush on CUDA: the plan kernel (the block list
// checked into its copy, the pending journal started, the blocks' entries
// taken into a replay list) and the replay of the list (kernels/common);
// with `discard`, the entries are forgotten and nothing is replayed. Into a
// copy (FlushArgs::copy): the plan kernel lists the replays without taking
// the entries or journaling, a copy kernel copies the blocks' bytes into the
// copy, and the same replay runs there.
#ifndef SPECSTATE_KERNELS_DEFERRED_FLUSH_CUH_
#define SPECSTATE_KERNELS_DEFERRED_FLUSH_CUH_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "kernels/checks/block_checker.cuh"
#include "kernels/common/cuda/common_cuda.h"
#include "kernels/common/cuda/launch.cuh"
#include "kernels/deferred/pending.h"
#include "kernels/deferred/pending_journal.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace {

// Checks the block list (into its checked copy) and lists the replays of
// the blocks' pending tokens (deferred_cpu.cc's RunFlush).
__global__ void __launch_bounds__(kCheckThreads) FlushPlanKernel(const FlushArgs a) {
  LetDependentsLaunch();
  if (threadIdx.x == 0) *a.status = internal::OkStatus();
  __syncthreads();
  if (internal::BlockCheckRows(a.num_blocks_given, a.status,
                               [&](int i) { return deferred::CheckFlushBlock(a, i); })) {
    __shared__ int jobs;
    if (threadIdx.x == 0) jobs = 0;
    __syncthreads();
    if (a.copy.data != nullptr) {
      // Into a copy (deferred_cpu.cc's FlushIntoCopy): the replays of the
      // listed blocks' pending tokens in the layer, each into its copy
      // block (copy_layer's block i + 1); the table and the journal as they are.
      const int32_t* entries = deferred::PendingEntriesOf(a.pending, a.layer);
      for (int i = threadIdx.x; i < a.num_blocks_given; i += blockDim.x) {
        const int32_t block = a.checked_blocks[i];
        const int32_t entry = internal::IsBlock(block) ? entries[block] : 0;
        if (entry != 0) {
          a.jobs.jobs[atomicAdd(&jobs, 1)] =
              deferred::PendingJob(0, i + 1, deferred::UnpackPending(entry), a.spec_query_len);
        }
      }
      __syncthreads();
      if (threadIdx.x == 0) *a.jobs.count = jobs;
      internal::BlockPublishStatus(a.status, a.status_mirror);
      return;
    }
    const bool listed = a.blocks == nullptr;
    const int count = listed ? *deferred::PendingListSize(a.pending) : a.num_blocks_given;
    const int32_t* const blocks = listed ? deferred::PendingList(a.pending) : a.checked_blocks;
    const int layers = a.layer >= 0 ? 1 : a.num_layers;
    if (a.pending.journal != nullptr) {  // before the table or a state changes
      __shared__ int journaled;
      if (threadIdx.x == 0) journaled = 0;
      __syncthreads();
      for (int i = threadIdx.x; i < count; i += blockDim.x) {
        const int32_t block = blocks[i];
        if (!internal::IsBlock(block)) continue;
        for (int y = 0; y < layers; ++y) {
          const int l = a.layer >= 0 ? a.layer : y;
          if (deferred::PendingEntriesOf(a.pending, l)[block] != 0) {
            deferred::PendingJournalList(a.pending, atomicAdd(&journaled, 1), block);
            break;
          }
        }
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        deferred::PendingJournalMarkStarted(a.pending, a.discard ? kPendingDiscard : kPendingFlush,
                                            journaled, a.layer, 0);
      }
      __syncthreads();
    }
    for (int x = threadIdx.x; x < count * layers; x += blockDim.x) {
      const int32_t block = blocks[x / layers];
      const int l = a.layer >= 0 ? a.layer : x % layers;
      if (!internal::IsBlock(block)) continue;
      // One taker per entry, though a block may be listed twice.
      const int32_t entry = atomicExch(&deferred::PendingEntriesOf(a.pending, l)[block], 0);
      if (entry != 0 && !a.discard) {
        a.jobs.jobs[atomicAdd(&jobs, 1)] =
            deferred::PendingJob(l, block, deferred::UnpackPending(entry), a.spec_query_len);
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) *a.jobs.count = jobs;
  }
  internal::BlockPublishStatus(a.status, a.status_mirror);
}

// Into a copy, after the plan kernel (gated on its status): grid (list
// element, slice of the block), each listed block's bytes in the layer to
// its copy block, 16 bytes a thread (blocks start on 16-byte boundaries and
// hold a multiple of 16 bytes: head dims 64-256).
constexpr int kCopyThreads = 256;
constexpr int kCopySlices = 8;
__global__ void __launch_bounds__(kCopyThreads)
    FlushCopyBlocksKernel(const FlushArgs a, const char* pool, int64_t block_bytes,
                          int64_t stride_bytes) {
  if (a.status->failed != 0) return;
  const int i = blockIdx.x;
  const int32_t block = a.checked_blocks[i];
  if (!internal::IsBlock(block)) return;
  const uint4* src = reinterpret_cast<const uint4*>(pool + block * stride_bytes);
  uint4* dst = reinterpret_cast<uint4*>(static_cast<char*>(a.copy.data) + (i + 1) * stride_bytes);
  const int64_t words = block_bytes / 16;
  for (int64_t w = int64_t{blockIdx.y} * kCopyThreads + threadIdx.x; w < words;
       w += int64_t{kCopySlices} * kCopyThreads) {
    dst[w] = src[w];
  }
}

absl::Status LaunchDeferredFlush(const FlushArgs& a, cudaStream_t s) {
  FlushPlanKernel<<<1, kCheckThreads, 0, s>>>(a);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess || a.discard) {
    return LaunchStatus(err, "Flush");
  }
  if (a.copy.data != nullptr) {
    const int64_t elem = DTypeSize(a.shape.state_dtype);
    FlushCopyBlocksKernel<<<dim3(a.num_blocks_given, kCopySlices), kCopyThreads, 0, s>>>(
        a, static_cast<const char*>(a.layers[a.layer].state.data),
        ValueWidth(a.shape) * a.shape.head_dim * elem, a.copy.block_stride * elem);
    if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
      return LaunchStatus(err, "Flush");
    }
    return common::LaunchReplayListCuda(a.shape, a.spec_query_len, 1, a.copy_layer,
                                        a.device_copy_layer, a.jobs, a.status, s, "Flush",
                                        /*usually_empty=*/false);
  }
  return common::LaunchReplayListCuda(a.shape, a.spec_query_len, a.num_layers, a.layers,
                                      a.device_layers, a.jobs, a.status, s, "Flush",
                                      /*usually_empty=*/false);
}

}  // namespace
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_DEFERRED_FLUSH_CUH_
