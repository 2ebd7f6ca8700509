// The FAST commit mode's kernels (issue 23) on the CPU: Verify from a
// checkpoint and a ring of accepted tokens, Commit that advances the ring and
// folds it into the checkpoint when the next window might not fit, and
// Materialize (Flush, ReadState). The service reaches the same work through
// the kernel interface (kda_kernels.h, mode kFast: VerifyArgs::fast and the
// layers' rings; its CPU backend, cpu/interface_cpu.h, runs cpu/fast_cpu.h
// after its device checks); the CUDA implementation is tested against this
// one. See fast_args.h for the data and docs/semantics.md, "Fast mode
// (FAST)", for the math.
//
//   FastVerifyArgs v = ...;  // host pointers
//   absl::Status s = FastVerifyCpu(v);
//   // INVALID_ARGUMENT, OUT_OF_RANGE or FAILED_PRECONDITION naming the field,
//   // the row and the bound; nothing is written when a check fails.
//   FastCommitArgs c = ...;
//   s = FastCommitCpu(c);
//
// Each call checks its host-visible arguments (Validate*), then every value
// it reads from the buffers (query_start_loc, indices, cursors, the plan's
// inputs) with the device checks of kernels/checks/ and fast/checks.h, as
// the kernel interface does (the same faults, the same messages), and
// writes nothing unless all pass. Errors start "In FastVerify: ", "In FastCommit: " or
// "In FastMaterialize: ".
#ifndef SPECSTATE_KERNELS_FAST_FAST_KERNELS_H_
#define SPECSTATE_KERNELS_FAST_FAST_KERNELS_H_

#include "absl/status/status.h"
#include "kernels/fast/fast_args.h"

namespace specstate {
namespace kernels {
namespace fast {

// How the CPU rounds the operands of the FAST math, to measure what a
// tensor-core implementation (bf16 operands, fp32 accumulation) or a smaller
// ring would cost in error. The default is fp32 throughout, what the CPU
// backend runs; anything else is for measurements (fast_error_curves) only.
struct FastNumerics {
  enum class Operands {
    kFp32,        // fp32 operands (CUDA cores)
    kBf16,        // both operands rounded to bf16
    kBf16SplitA,  // the first operand as bf16 hi + bf16 lo (2 products), the second bf16
    kBf16Split,   // both as bf16 hi + lo (3 products: hi*hi + hi*lo + lo*hi)
    kTf32,        // both operands rounded to tf32 (10-bit mantissa)
    kTf32Split,   // both as tf32 hi + lo (3 products, "3xTF32")
  };
  // Storage of the ring.
  bool ring_k_normalized_bf16 = false;  // k stored normalized, in bf16 (instead of raw)
  bool ring_u_bf16 = false;             // u stored in bf16 (instead of fp32)
  // The ring stores the cumulative log-decay G_i from the checkpoint (fp32)
  // and exponents are differences G_c - G_i (instead of per-token gammas
  // summed from the near end).
  bool ring_cumulative_log_decay = false;
  // Products: the ring's key coefficients (kw . kr, qw . kr), the ring's
  // values (those coefficients times u), the checkpoint's (S0 . kc, S0 . qc:
  // the state is the first operand), the fold's (u kr^T). The window's own
  // T x T products stay fp32 (CUDA cores).
  Operands ring_keys = Operands::kFp32;
  Operands ring_values = Operands::kFp32;
  Operands checkpoint = Operands::kFp32;
  Operands fold = Operands::kFp32;
};

absl::Status ValidateFastVerifyArgs(const FastVerifyArgs& args);
absl::Status ValidateFastCommitArgs(const FastCommitArgs& args);
absl::Status ValidateFastMaterializeArgs(const FastMaterializeArgs& args);

// FAST Verify of one layer (fast_args.h).
// \returns INVALID_ARGUMENT for malformed arguments or two rows verifying
//   from one block (their candidates would share ring slots), OUT_OF_RANGE for
//   an index past its bound or a window that does not fit in its ring,
//   FAILED_PRECONDITION for a cursor that no Commit could have left.
absl::Status FastVerifyCpu(const FastVerifyArgs& args, const FastNumerics& numerics = {});

// FAST Commit of every layer (fast_args.h).
// \returns INVALID_ARGUMENT / OUT_OF_RANGE as the EAGER Commit's checks (the
//   same plan), FAILED_PRECONDITION when a row commits more tokens than its
//   block's last Verify left candidates in some layer (every layer's Verify
//   must come first), for a cursor no Commit leaves, or for a final or
//   boundary block (other than the row's checkpoint) whose ring holds tokens
//   (another request's, not flushed).
absl::Status FastCommitCpu(const FastCommitArgs& args, const FastNumerics& numerics = {});

// FAST Materialize (fast_args.h).
// \returns OUT_OF_RANGE for a block past the pool or a layer past the group,
//   FAILED_PRECONDITION for a cursor no Commit leaves.
absl::Status FastMaterializeCpu(const FastMaterializeArgs& args,
                                const FastNumerics& numerics = {});

}  // namespace fast
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_FAST_FAST_KERNELS_H_
