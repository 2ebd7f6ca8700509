// The FAST commit mode's kernels (issue 23) on CUDA: the same arguments as
// the CPU reference (fast_kernels.h), with device pointers, launched on the
// caller's stream; no launcher synchronizes.
//
//   FastVerifyArgs v = ...;  // device pointers
//   absl::Status s = FastVerifyCuda(v, FastNumerics{}, stream);
//   FastCommitArgs c = ...;  // `layers` in host memory, their buffers on the device
//   s = FastCommitCuda(c, FastNumerics{}, stream);
//
// The arithmetic is fp32 on CUDA cores, in the CPU reference's order
// wherever that order is serial (the exponent sums from the near end, the
// forward substitution, the fold's chain over ring tokens); dot products
// are reduced across a warp, so results differ from the CPU's by rounding.
// Verify's checkpoint products S0 . kc, S0 . qc can run on tensor cores
// (FastNumerics::checkpoint kTf32Split, "3xTF32", or kTf32); the kernel
// interface serves 3xTF32 for 16-bit activations (ServedCheckpointOperands).
//
// Checks: the host-visible arguments (the Validate* functions of
// fast_kernels.h). The values in device buffers (query_start_loc, indices,
// cursors) are checked by the kernel interface's CUDA backend in commit mode
// FAST (interface_cuda.h) with the device checks of kernels/checks and
// fast/checks.h, which then calls the Run* launchers below with `gate` set
// to its status. Called directly, a row whose block, window or cursor is
// out of bounds is skipped, so memory is never touched out of bounds, but no
// fault is reported.
#ifndef SPECSTATE_KERNELS_FAST_CUDA_FAST_CUDA_H_
#define SPECSTATE_KERNELS_FAST_CUDA_FAST_CUDA_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "kernels/fast/fast_args.h"
#include "kernels/fast/fast_kernels.h"
#include "kernels/fast/fold_plan.h"    // FastFoldSchedule
#include "kernels/fast/verify_plan.h"  // FastVerifySchedule

namespace specstate {
namespace kernels {
namespace fast {

// FAST Verify of one layer (fast_args.h): outputs, and the window's
// candidates in ring slots [tokens, tokens + T).
// `numerics`: the default (fp32 throughout), or with `checkpoint` kTf32 or
// kTf32Split (3xTF32), the checkpoint's products on tensor cores.
// \returns INVALID_ARGUMENT as ValidateFastVerifyArgs, or for a schedule
//   the launch cannot run (named), UNIMPLEMENTED for other numerics, a CUDA
//   launch error.
absl::Status FastVerifyCuda(const FastVerifyArgs& args, const FastNumerics& numerics,
                            cudaStream_t stream, const FastVerifySchedule& schedule = {});

// FAST Commit of every layer (fast_args.h): each row's accepted candidates
// join its ring; a ring that has no room for another window is folded into
// its checkpoint (fp32, stored in the state dtype); align mode leaving the
// block or crossing a boundary stores real boundary and final states.
// `args.layers` is host memory (its pools and rings device memory); the
// launches do not grow with the number of layers up to 24.
// `schedule`: how each fold reads its inputs (the same bits either way).
// \returns INVALID_ARGUMENT as ValidateFastCommitArgs, or for a schedule the
//   launch cannot run (named), UNIMPLEMENTED for non-default numerics, a
//   launch error.
absl::Status FastCommitCuda(const FastCommitArgs& args, const FastNumerics& numerics,
                            cudaStream_t stream, const FastFoldSchedule& schedule = {});

// FAST Materialize (fast_args.h): folds the given blocks in place (keeping
// the last Verify's candidates, moved to the ring's start), writes their
// current states to `out`, or with `discard` empties their rings.
// `args.layers` is host memory, `args.blocks` device memory.
absl::Status FastMaterializeCuda(const FastMaterializeArgs& args, const FastNumerics& numerics,
                                 cudaStream_t stream, const FastFoldSchedule& schedule = {});

// The launches of the three calls above without their host checks (fp32
// numerics): for the kernel interface, after its own validation; `gate` set
// to its checks' status.
// RunFastVerifyCuda's `checkpoint`: kFp32 (CUDA cores), kTf32 or kTf32Split
// (tensor cores) for the checkpoint's products; UNIMPLEMENTED for the rest.
absl::Status RunFastVerifyCuda(const FastVerifyArgs& args, cudaStream_t stream,
                               FastNumerics::Operands checkpoint,
                               const FastVerifySchedule& schedule = {});

// What the kernel interface's CUDA backend serves, chosen by measurement on
// an H200 (docs/benchmarks.md, "Commit mode FAST on CUDA"): 3xTF32 on tensor
// cores for 16-bit activations (Kimi-Linear verify at N = 256: 351 us
// against 435 us on CUDA cores, the simulator's accuracy verdicts PASS);
// fp32 on CUDA cores for fp32 activations, whose outputs under 3xTF32 came
// to 3.0-3.8x the exact path's error, past the contract's 2x (the tensor
// cores' sums do not round as fp32 FMAs do: the CPU's emulation predicted
// 1.2x). Plain tf32 is faster still and ~500x fp32's error.
inline FastNumerics::Operands ServedCheckpointOperands(const KdaShape& shape) {
  return shape.act_dtype == DType::kFloat32 ? FastNumerics::Operands::kFp32
                                            : FastNumerics::Operands::kTf32Split;
}
absl::Status RunFastCommitCuda(const FastCommitArgs& args, cudaStream_t stream,
                               const FastFoldSchedule& schedule = {});
absl::Status RunFastMaterializeCuda(const FastMaterializeArgs& args, cudaStream_t stream,
                                    const FastFoldSchedule& schedule = {});

}  // namespace fast
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_FAST_CUDA_FAST_CUDA_H_
