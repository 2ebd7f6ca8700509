// Commit mode DEFERRED's host checks: what the kernel interface's Validate*
// (kda_kernels.h) adds for a DEFERRED call after the checks every mode
// shares (its pending table, replay lists and second records buffer).
// Each returns INVALID_ARGUMENT or OUT_OF_RANGE "In <op>: ..." naming the
// field and the bound.
//
//   absl::Status st = deferred::ValidateVerify(args);  // after the shared checks
#ifndef SPECSTATE_KERNELS_DEFERRED_DEFERRED_CHECKS_H_
#define SPECSTATE_KERNELS_DEFERRED_DEFERRED_CHECKS_H_

#include "absl/status/status.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace deferred {

// DEFERRED replays a row's pending tokens and verifies its window in one
// pass: at most kMaxSpecQueryLen tokens, so Q <= kMaxSpecQueryLen / 2
// (kda_kernels.h's ValidateDeferredWindow).
absl::Status ValidateWindow(int spec_query_len);

absl::Status ValidateVerify(const VerifyArgs& args);
absl::Status ValidateCommit(const CommitArgs& args);
absl::Status ValidateFlush(const FlushArgs& args);

}  // namespace deferred
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_DEFERRED_DEFERRED_CHECKS_H_
