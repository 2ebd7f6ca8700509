// FAST's Verify on CUDA (fast_cuda.h): FastVerifyCuda and its launch
// without host checks for the kernel interface. The kernels are in
// verify.cuh; the folds in fast_fold.cu (their own translation unit, so the
// two compile in parallel).
#include "kernels/fast/cuda/fast_cuda.h"
#include "kernels/fast/cuda/verify.cuh"

namespace specstate {
namespace kernels {
namespace fast {

absl::Status FastVerifyCuda(const FastVerifyArgs& a, const FastNumerics& num, cudaStream_t stream,
                            const FastVerifySchedule& schedule) {
  if (absl::Status st = ValidateFastVerifyArgs(a); !st.ok()) return st;
  // Verify runs the checkpoint's products on tensor cores when asked to
  // (tf32 or 3xTF32); every other product stays fp32.
  FastNumerics rest = num;
  rest.checkpoint = FastNumerics::Operands::kFp32;
  const bool tensor_cores = num.checkpoint == FastNumerics::Operands::kTf32 ||
                            num.checkpoint == FastNumerics::Operands::kTf32Split;
  if (!DefaultNumerics(rest) ||
      (!tensor_cores && num.checkpoint != FastNumerics::Operands::kFp32)) {
    return NumericsUnimplemented("FastVerify");
  }
  return RunFastVerifyCuda(a, stream, num.checkpoint, schedule);
}

absl::Status RunFastVerifyCuda(const FastVerifyArgs& a, cudaStream_t stream,
                               FastNumerics::Operands checkpoint,
                               const FastVerifySchedule& schedule) {
  return LaunchFastVerify(a, stream, checkpoint, schedule);
}

}  // namespace fast
}  // namespace kernels
}  // namespace specstate
