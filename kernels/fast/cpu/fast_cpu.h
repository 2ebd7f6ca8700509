// The FAST kernels' work on the CPU once every check has passed: what
// FastVerifyCpu, FastCommitCpu and FastMaterializeCpu (fast_kernels.h) run
// after their checks, and what the CPU backend of the kernel interface
// (cpu/interface_cpu.cc, commit mode FAST) runs after its own device
// checks, which are the same functions of kernels/checks/ and checks.h. Nothing
// here checks anything: the arguments must have passed those checks.
//
//   // after ValidateFastVerifyArgs and checks.h's row, cursor and window checks:
//   RunFastVerifyCpu(args, FastNumerics());
#ifndef SPECSTATE_KERNELS_FAST_CPU_FAST_CPU_H_
#define SPECSTATE_KERNELS_FAST_CPU_FAST_CPU_H_

#include "kernels/fast/fast_args.h"
#include "kernels/fast/fast_kernels.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace fast {

// Every row's outputs and its window's candidates (each row's token count
// from query_start_loc; rows whose block is null are skipped).
void RunFastVerifyCpu(const FastVerifyArgs& args, const FastNumerics& numerics);

// The commit of every layer along `plan` [args.num_rows] (internal::PlanCommitRow's).
void RunFastCommitCpu(const FastCommitArgs& args, const CommitPlanRow* plan,
                      const FastNumerics& numerics);

// The folds (or, with discard, the emptying) of args.blocks.
void RunFastMaterializeCpu(const FastMaterializeArgs& args, const FastNumerics& numerics);

}  // namespace fast
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_FAST_CPU_FAST_CPU_H_
