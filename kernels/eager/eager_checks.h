// Commit mode EAGER's host checks: what the kernel interface's Validate*
// (kda_kernels.h) adds for an EAGER call after the checks every mode shares
// (its records buffers; no other mode's tables; no Flush: nothing is ever
// pending).
//
//   absl::Status st = eager::ValidateVerify(args);  // after the shared checks
#ifndef SPECSTATE_KERNELS_EAGER_EAGER_CHECKS_H_
#define SPECSTATE_KERNELS_EAGER_EAGER_CHECKS_H_

#include "absl/status/status.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace eager {

absl::Status ValidateVerify(const VerifyArgs& args);
absl::Status ValidateCommit(const CommitArgs& args);
// INVALID_ARGUMENT: an EAGER commit leaves nothing to flush.
absl::Status ValidateFlush(const FlushArgs& args);

}  // namespace eager
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_EAGER_EAGER_CHECKS_H_
