// FAST's Flush through the kernel interface on CUDA: the check kernel (the
// block list into its checked copy, then the cursor of every listed block,
// or without a list of every block, in every covered layer; then, in place
// with kept pools, the fold journal's list and start), kernels/fast/cuda's
// Materialize in place (or into the copy, FlushArgs::copy: its `out`),
// gated on its status, and the fold journal marked idle.
#ifndef SPECSTATE_KERNELS_FAST_CUDA_INTERFACE_FLUSH_CUH_
#define SPECSTATE_KERNELS_FAST_CUDA_INTERFACE_FLUSH_CUH_

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/checks/block_checker.cuh"
#include "kernels/checks/rows.h"
#include "kernels/common/cuda/launch.cuh"
#include "kernels/fast/checks.h"
#include "kernels/fast/cuda/fast_cuda.h"
#include "kernels/fast/fold_journal.h"
#include "kernels/fast/from_interface.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace {

// (cpu/interface_cpu.cc's RunFlush, on one block.)
__global__ void __launch_bounds__(kCheckThreads) FastFlushCheckKernel(const FlushArgs a) {
  if (threadIdx.x == 0) *a.status = internal::OkStatus();
  __syncthreads();
  const int64_t num_blocks = a.device_layers[0].state.num_blocks;
  bool passed = internal::BlockChecker::Rows(a.num_blocks_given, a.status, [&](int i) {
    return internal::CheckListedBlock(a.blocks, a.checked_blocks, i, num_blocks);
  });
  if (passed) {
    const bool listed = a.blocks != nullptr;
    const int count = listed ? a.num_blocks_given : static_cast<int>(num_blocks);
    const int layers = a.layer >= 0 ? 1 : a.num_layers;
    passed = internal::BlockChecker::Items(
        count * layers, a.status,
        [&](int x) {
          const int32_t block = listed ? a.checked_blocks[x / layers] : x / layers;
          const int l = a.layer >= 0 ? a.layer : x % layers;
          return internal::IsBlock(block) ? fast::CheckFastCursor(a.device_layers[l].fast, block, l)
                                          : internal::NoFault();
        },
        [](int) { return -1; });
  }
  const FoldJournal& j = a.fold_journal;
  if (passed && j.record != nullptr && a.copy.data == nullptr) {
    // Before the first write: the listed blocks, or every block whose ring
    // holds tokens or candidates in a covered layer (those the fold writes).
    __shared__ int listed;
    if (threadIdx.x == 0) listed = 0;
    __syncthreads();
    if (a.blocks != nullptr) {
      for (int i = threadIdx.x; i < a.num_blocks_given; i += blockDim.x) {
        fast::FoldJournalList(j, i, a.checked_blocks[i]);
      }
      if (threadIdx.x == 0) listed = a.num_blocks_given;
    } else {
      for (int64_t b = 1 + threadIdx.x; b < num_blocks; b += blockDim.x) {
        for (int l = 0; l < a.num_layers; ++l) {
          if (a.layer >= 0 && l != a.layer) continue;
          const FastCursor c = a.device_layers[l].fast.cursors[b];
          if (c.tokens != 0 || c.candidates != 0) {
            fast::FoldJournalList(j, atomicAdd(&listed, 1), static_cast<int32_t>(b));
            break;
          }
        }
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) fast::FoldJournalMarkStarted(j, a.discard, listed, a.layer);
  }
  internal::BlockPublishStatus(a.status, a.status_mirror);
}

// After the fold's last write (stream order): the fold journal idle. (Where
// the checks failed it was never started: idle already.)
__global__ void FastFoldJournalDoneKernel(const FoldJournal j) { fast::FoldJournalMarkDone(j); }

absl::Status LaunchFastInterfaceFlush(const FlushArgs& a, cudaStream_t s) {
  FastFlushCheckKernel<<<1, kCheckThreads, 0, s>>>(a);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return LaunchStatus(err, "Flush");
  }
  const std::vector<fast::FastLayer> layers = fast::FastLayersOf(a.layers, a.num_layers);
  fast::FastMaterializeArgs m;
  m.shape = a.shape;
  m.num_layers = a.num_layers;
  m.layers = layers.data();
  m.every_block = a.blocks == nullptr;
  if (!m.every_block) {
    m.blocks = a.checked_blocks;
    m.num_blocks_given = a.num_blocks_given;
  }
  m.layer = a.layer;
  m.discard = a.discard;
  if (a.copy.data != nullptr) {  // into a copy: Materialize's `out`, from block 1
    m.out = static_cast<char*>(a.copy.data) +
            a.copy.block_stride * int64_t(DTypeSize(a.shape.state_dtype));
  }
  m.gate = a.status;
  const absl::Status st = fast::RunFastMaterializeCuda(m, s);
  if (!st.ok() || a.fold_journal.record == nullptr || a.copy.data != nullptr) return st;
  FastFoldJournalDoneKernel<<<1, 1, 0, s>>>(a.fold_journal);
  return LaunchStatus(cudaGetLastError(), "Flush");
}

}  // namespace
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_FAST_CUDA_INTERFACE_FLUSH_CUH_
