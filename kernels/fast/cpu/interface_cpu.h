// Commit mode FAST through the kernel interface on the CPU backend
// (kda_kernels.h: the CPU backend's Verify, Commit and Flush in FAST): the
// checks every call of the interface runs, FAST's own (cursors, room in the
// ring, one row a block), then kernels/fast's work (cpu/fast_cpu.h). Each
// writes its call's DeviceStatus and mirror and nothing else when a check
// fails; the arguments must have passed the host checks (interface_checks.h).
//
//   fast::InterfaceVerifyCpu(args);  // then DeviceStatusToStatus(*args.status, "Verify")
#ifndef SPECSTATE_KERNELS_FAST_CPU_INTERFACE_CPU_H_
#define SPECSTATE_KERNELS_FAST_CPU_INTERFACE_CPU_H_

#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace fast {

void InterfaceVerifyCpu(const VerifyArgs& args);
void InterfaceCommitCpu(const CommitArgs& args);
void InterfaceFlushCpu(const FlushArgs& args);

}  // namespace fast
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_FAST_CPU_INTERFACE_CPU_H_
