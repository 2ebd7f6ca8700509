// Commit mode FAST's host checks: the rings' (shared by the kernel
// interface and kernels/fast's direct calls, fast_kernels.h), and what the
// interface's Validate* (kda_kernels.h) adds for a FAST call after the
// checks every mode shares (the rings of each layer, the window's bound, a
// Flush's fold journal). Each returns INVALID_ARGUMENT or OUT_OF_RANGE "In <op>: ..."
// naming the field and the bound.
//
//   absl::Status st = fast::ValidateInterfaceVerify(args);  // after the shared checks
#ifndef SPECSTATE_KERNELS_FAST_INTERFACE_CHECKS_H_
#define SPECSTATE_KERNELS_FAST_INTERFACE_CHECKS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace fast {

// One layer's rings (`name`: the field that holds them, "fast" or "rings"),
// for a pool of `num_blocks` blocks and windows of `q` tokens: every buffer
// set, a ring per block, room for one window.
absl::Status CheckRings(absl::string_view op, const FastRings& rings, int64_t num_blocks, int q,
                        absl::string_view where, absl::string_view name);

absl::Status ValidateInterfaceVerify(const VerifyArgs& args);
absl::Status ValidateInterfaceCommit(const CommitArgs& args);
absl::Status ValidateInterfaceFlush(const FlushArgs& args);

}  // namespace fast
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_FAST_INTERFACE_CHECKS_H_
