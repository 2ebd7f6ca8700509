#include "kernels/fast/fold_plan.h"

#include "absl/strings/str_cat.h"
#include "kernels/dtype.h"

namespace specstate {
namespace kernels {
namespace fast {

absl::StatusOr<FoldLaunchPlan> PlanFastFold(const KdaShape& shape, int capacity,
                                            const FastFoldSchedule& schedule, int smem_optin) {
  using Staging = FastFoldSchedule::Staging;
  constexpr const char* op = "FastFold";
  const int K = shape.head_dim;
  const FoldLaunchPlan unstaged{false, UnstagedFoldSmemFloats(K, capacity) * sizeof(float)};
  if (schedule.staging == Staging::kOff) return unstaged;
  const size_t staged_bytes = StagedFoldSmem{K, capacity, int(DTypeSize(shape.act_dtype)),
                                             int(DTypeSize(shape.state_dtype)),
                                             shape.kind == LayerKind::kGdn}
                                  .Bytes();
  // An SM's shared memory is its largest block's plus the 1 KiB the runtime
  // reserves a block (Hopper: 227 + 1 KiB), each block's static part too.
  constexpr size_t kReservedPerBlock = 1024;
  const size_t per_block = staged_bytes + kFoldStaticSmemBytes + kReservedPerBlock;
  const bool one_fits = staged_bytes + kFoldStaticSmemBytes <= size_t(smem_optin);
  const bool two_fit = 2 * per_block <= size_t(smem_optin) + kReservedPerBlock;
  if (schedule.staging == Staging::kAuto) {
    return two_fit ? FoldLaunchPlan{true, staged_bytes} : unstaged;
  }
  if (!one_fits) {
    return absl::InvalidArgumentError(absl::StrCat(
        "In ", op, ": schedule.staging kOn needs ", staged_bytes + kFoldStaticSmemBytes,
        " bytes of shared memory a block (head dim ", K, ", ring capacity ", capacity,
        "); the device gives at most ", smem_optin));
  }
  return FoldLaunchPlan{true, staged_bytes};
}

}  // namespace fast
}  // namespace kernels
}  // namespace specstate
