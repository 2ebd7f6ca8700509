#include "kernels/fast/fold_plan.h"

#include "absl/strings/str_cat.h"
#include "kernels/dtype.h"

namespace specstate {
namespace kernels {
namespace fast {

absl::StatusOr<FoldLaunchPlan> PlanFastFold(const KdaShape& shape, int capacity, int rows,
                                            const FastFoldSchedule& schedule, int smem_optin) {
  using Staging = FastFoldSchedule::Staging;
  constexpr const char* op = "FastFold";
  const int K = shape.head_dim;
  if (schedule.blocks_per_head < 0) {
    return absl::InvalidArgumentError(absl::StrCat("In ", op, ": schedule.blocks_per_head ",
                                                   schedule.blocks_per_head,
                                                   " is negative (0: the launcher's choice)"));
  }
  const StagedFoldSmem staged{K, capacity, int(DTypeSize(shape.act_dtype)),
                              int(DTypeSize(shape.state_dtype)), shape.kind == LayerKind::kGdn};
  const auto fits = [&](int buffers) {
    return staged.Bytes(buffers) + kFoldStaticSmemBytes <= size_t(smem_optin);
  };
  const auto plan = [&](Staging staging, size_t smem) {
    const int chosen = staging != Staging::kPipelined ? 16 : rows <= 32 ? 1 : 4;
    return FoldLaunchPlan{staging, smem,
                          schedule.blocks_per_head > 0 ? schedule.blocks_per_head : chosen};
  };
  switch (schedule.staging) {
    case Staging::kOff:
      break;
    case Staging::kAuto:
      if (rows >= 2 && fits(2)) return plan(Staging::kPipelined, staged.Bytes(2));
      break;
    case Staging::kOn:
    case Staging::kPipelined: {
      const int buffers = schedule.staging == Staging::kOn ? 1 : 2;
      if (!fits(buffers)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "In ", op, ": schedule.staging ",
            schedule.staging == Staging::kOn ? "kOn" : "kPipelined", " needs ",
            staged.Bytes(buffers) + kFoldStaticSmemBytes,
            " bytes of shared memory a block (head dim ", K, ", ring capacity ", capacity,
            "); the device gives at most ", smem_optin));
      }
      return plan(schedule.staging, staged.Bytes(buffers));
    }
  }
  return plan(Staging::kOff, UnstagedFoldSmemFloats(K, capacity) * sizeof(float));
}

}  // namespace fast
}  // namespace kernels
}  // namespace specstate
