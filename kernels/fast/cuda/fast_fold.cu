// FAST's folds on CUDA (fast_cuda.h): FastCommitCuda and FastMaterializeCuda,
// and their launches without host checks for the kernel interface. The
// kernels are in fold.cuh.
#include "kernels/fast/cuda/fast_cuda.h"
#include "kernels/fast/cuda/fold.cuh"

namespace specstate {
namespace kernels {
namespace fast {

absl::Status FastCommitCuda(const FastCommitArgs& a, const FastNumerics& num, cudaStream_t stream,
                            const FastFoldSchedule& schedule) {
  if (absl::Status st = ValidateFastCommitArgs(a); !st.ok()) return st;
  if (!DefaultNumerics(num)) return NumericsUnimplemented("FastCommit");
  return RunFastCommitCuda(a, stream, schedule);
}

absl::Status RunFastCommitCuda(const FastCommitArgs& a, cudaStream_t stream,
                               const FastFoldSchedule& schedule) {
  return LaunchFastCommit(a, stream, schedule);
}

absl::Status FastMaterializeCuda(const FastMaterializeArgs& a, const FastNumerics& num,
                                 cudaStream_t stream, const FastFoldSchedule& schedule) {
  if (absl::Status st = ValidateFastMaterializeArgs(a); !st.ok()) return st;
  if (!DefaultNumerics(num)) return NumericsUnimplemented("FastMaterialize");
  return RunFastMaterializeCuda(a, stream, schedule);
}

absl::Status RunFastMaterializeCuda(const FastMaterializeArgs& a, cudaStream_t stream,
                                    const FastFoldSchedule& schedule) {
  return LaunchFastMaterialize(a, stream, schedule);
}

}  // namespace fast
}  // namespace kernels
}  // namespace specstate
