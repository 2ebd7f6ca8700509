// Commit mode DEFERRED on the CPU backend (docs/semantics.md, "Deferred
// commit"): Verify replays a row's pending tokens first and writes its
// checkpoint once; Commit leaves rows pending on their checkpoint blocks and
// replays the rest (and what the previous commit left that no Verify took);
// Flush materializes or forgets pending blocks. Each runs its checks first,
// writes its call's DeviceStatus and mirror, keeps the pending journal when
// the table has one, and writes nothing when a check fails; the arguments
// must have passed the host checks (deferred_checks.h).
//
//   deferred::VerifyCpu(args);  // then DeviceStatusToStatus(*args.status, "Verify")
#ifndef SPECSTATE_KERNELS_DEFERRED_DEFERRED_CPU_H_
#define SPECSTATE_KERNELS_DEFERRED_DEFERRED_CPU_H_

#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace deferred {

void VerifyCpu(const VerifyArgs& args);
void CommitCpu(const CommitArgs& args);
void FlushCpu(const FlushArgs& args);

}  // namespace deferred
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_DEFERRED_DEFERRED_CPU_H_
