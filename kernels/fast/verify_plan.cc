#include "kernels/fast/verify_plan.h"

#include "absl/strings/str_cat.h"
#include "kernels/dtype.h"

namespace specstate {
namespace kernels {
namespace fast {

absl::StatusOr<VerifyLaunchPlan> PlanFastVerify(const FastVerifyArgs& a,
                                                const FastVerifySchedule& schedule,
                                                bool tensor_cores, int64_t blocks, int sms,
                                                int smem_optin) {
  using Staging = FastVerifySchedule::Staging;
  constexpr const char* op = "FastVerify";
  const int K = a.shape.head_dim;
  const auto base_bytes = [&](bool early) {
    return VerifySmem{K, a.spec_query_len, a.rings.capacity, early}.Bytes();
  };
  const auto staged_bytes = [&](int splits) {
    const StagedSmem staged{K,
                            a.rings.capacity,
                            K / splits,
                            int(DTypeSize(a.shape.act_dtype)),
                            int(DTypeSize(a.shape.state_dtype)),
                            a.shape.kind == LayerKind::kGdn};
    return base_bytes(true) + staged.Bytes();
  };
  const int s = schedule.value_splits;
  if (s != 0 && s != 1 && s != 2 && s != 4 && s != 8) {
    return absl::InvalidArgumentError(absl::StrCat(
        "In ", op, ": schedule.value_splits ", s, " is not 0 (chosen), 1, 2, 4 or 8"));
  }
  if (s > 1 && K / s < 16) {
    return absl::InvalidArgumentError(absl::StrCat("In ", op, ": schedule.value_splits ", s,
                                                   " leaves ", K / s, " state rows a block; head "
                                                   "dim ", K, " takes at most ", K / 16));
  }
  const bool early = tensor_cores && schedule.early_start && blocks <= 4 * int64_t{sms};
  using Piping = FastVerifySchedule::Piping;
  const bool bulk = schedule.pipe_copies == FastVerifySchedule::PipeCopies::kBulk;
  const size_t piped_bytes = base_bytes(false) + PipedSmem::Bytes(kVerifyWarps, bulk);
  // An SM's shared memory is its largest block's plus the 1 KiB the runtime
  // reserves a block (Hopper: 227 + 1 KiB; Ampere: 163 + 1).
  constexpr size_t kReservedPerBlock = 1024;
  const bool four_fit_piped =
      4 * (piped_bytes + kReservedPerBlock) <= size_t(smem_optin) + kReservedPerBlock;
  const bool piped =
      tensor_cores && K == PipedSmem::kHeadDim && !early &&
      (schedule.piped_checkpoint == Piping::kOn ||
       (schedule.piped_checkpoint == Piping::kAuto && a.shape.state_dtype == DType::kBFloat16 &&
        four_fit_piped));
  using Prefetch = FastVerifySchedule::CheckpointPrefetch;
  const bool short_window = schedule.window_bound == FastVerifySchedule::WindowBound::kShort;
  if (short_window && a.spec_query_len > kShortWindow) {
    return absl::InvalidArgumentError(absl::StrCat(
        "In ", op, ": schedule.window_bound kShort needs spec_query_len <= ", kShortWindow,
        "; it is ", a.spec_query_len));
  }
  if (short_window && !tensor_cores) {
    return absl::InvalidArgumentError(absl::StrCat(
        "In ", op, ": schedule.window_bound kShort needs the checkpoint's products on tensor "
        "cores (FastNumerics::checkpoint kTf32Split)"));
  }
  VerifyLaunchPlan unstaged{false,
                            1,
                            piped ? piped_bytes : base_bytes(early),
                            early,
                            piped,
                            early || piped ? Prefetch::kNone : schedule.checkpoint_prefetch,
                            piped && bulk};
  unstaged.short_window = short_window;
  using RingValues = FastVerifySchedule::RingValues;
  if (schedule.ring_values == RingValues::kSpread && schedule.staging == Staging::kOff) {
    return absl::InvalidArgumentError(absl::StrCat(
        "In ", op, ": schedule.ring_values kSpread needs the staged schedule (staging kOn or "
        "kAuto); the unstaged kernels sum the ring's values per state row"));
  }
  using WindowLoads = FastVerifySchedule::WindowLoads;
  if (schedule.window_loads == WindowLoads::kBeforeCursor && schedule.staging == Staging::kOff) {
    return absl::InvalidArgumentError(absl::StrCat(
        "In ", op, ": schedule.window_loads kBeforeCursor needs the staged schedule (staging kOn "
        "or kAuto); the unstaged kernels load their window after the cursor"));
  }
  const auto staged_plan = [&](int splits) {
    VerifyLaunchPlan plan{true, splits, staged_bytes(splits), true};
    plan.spread_ring_values = schedule.ring_values != RingValues::kPerRow;
    plan.window_before_cursor = schedule.window_loads != WindowLoads::kAfterCursor;
    plan.short_window = short_window;
    return plan;
  };
  if (schedule.staging == Staging::kOff || (schedule.staging == Staging::kAuto && !tensor_cores)) {
    if (s > 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "In ", op, ": schedule.value_splits ", s, " needs the staged schedule (staging kOn)",
          tensor_cores ? "" : ", which needs the checkpoint's products on tensor cores"));
    }
    return unstaged;
  }
  if (!tensor_cores) {
    return absl::InvalidArgumentError(absl::StrCat(
        "In ", op, ": schedule.staging kOn needs the checkpoint's products on tensor cores "
        "(FastNumerics::checkpoint kTf32 or kTf32Split)"));
  }
  if (schedule.staging == Staging::kOn) {
    const int splits = s == 0 ? 1 : s;
    if (staged_bytes(splits) > size_t(smem_optin)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "In ", op, ": the staged schedule with value_splits ", splits, " needs ",
          staged_bytes(splits), " bytes of shared memory a block; the device allows ", smem_optin));
    }
    return staged_plan(splits);
  }
  // kAuto with tensor cores.
  if (blocks > sms) return unstaged;
  int splits = s != 0 ? s : 1;
  if (s == 0) {
    while (splits < 8 && K / (2 * splits) >= 16 && blocks * 2 * splits <= sms) splits *= 2;
  }
  while (staged_bytes(splits) > size_t(smem_optin) && splits < 8 && K / (2 * splits) >= 16) {
    splits *= 2;
  }
  if (staged_bytes(splits) > size_t(smem_optin)) return unstaged;
  return staged_plan(splits);
}

}  // namespace fast
}  // namespace kernels
}  // namespace specstate
