// Commit mode EAGER on the CPU backend: Verify (outputs and records, no
// state written) and Commit (plan, conv windows, the replay of every
// committed row through the stock kernel, the commit journal). Each runs its
// checks first, writes its call's DeviceStatus and mirror, and writes
// nothing when a check fails; the arguments must have passed the host checks
// (eager_checks.h, through kda_kernels.h's Validate*).
//
//   eager::VerifyCpu(args);  // then DeviceStatusToStatus(*args.status, "Verify")
#ifndef SPECSTATE_KERNELS_EAGER_EAGER_CPU_H_
#define SPECSTATE_KERNELS_EAGER_EAGER_CPU_H_

#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace eager {

void VerifyCpu(const VerifyArgs& args);
void CommitCpu(const CommitArgs& args);

}  // namespace eager
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_EAGER_EAGER_CPU_H_
