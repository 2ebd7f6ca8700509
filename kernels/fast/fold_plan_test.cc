// The CUDA fold's launch rule (fold_plan.h), without a GPU: which shapes are
// staged, the shared memory each layout takes, and the schedules refused.
// (That both schedules write the same bits needs a GPU:
// cuda/fast_cuda_gpu_test.cc.)
#include "kernels/fast/fold_plan.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace specstate {
namespace kernels {
namespace fast {
namespace {

using ::testing::HasSubstr;
using Staging = FastFoldSchedule::Staging;

constexpr int kSmemOptin = 227 * 1024;  // an H100's or H200's largest block

KdaShape Shape(int heads, int k, DType state = DType::kFloat32, LayerKind kind = LayerKind::kKda) {
  KdaShape s;
  s.num_heads = heads;
  s.head_dim = k;
  s.act_dtype = DType::kBFloat16;
  s.state_dtype = state;
  s.kind = kind;
  if (kind == LayerKind::kGdn) s.num_value_heads = 2 * heads;
  return s;
}

FoldLaunchPlan Plan(const KdaShape& s, int capacity, Staging staging = Staging::kAuto) {
  absl::StatusOr<FoldLaunchPlan> plan = PlanFastFold(s, capacity, {staging}, kSmemOptin);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.ok() ? *plan : FoldLaunchPlan{};
}

TEST(FoldPlanTest, TheServedShapesAreStagedTwoBlocksAnSm) {
  // Kimi-Linear (Q = 4, F = 4: 16 tokens): 64 KiB of checkpoint rows, the
  // ring's bf16 keys 4 KiB, its log-decays (then decayed keys) and values
  // 8 KiB each, the norms and Gc.
  FoldLaunchPlan p = Plan(Shape(32, 128), 16);
  EXPECT_TRUE(p.staged);
  EXPECT_EQ(p.smem, 64u * 1024 + 4 * 1024 + 2 * 8 * 1024 + 64 + 512);
  // Kimi-K3 at TP8 (Q = 8: 32 tokens): 64 + 8 + 2 x 16 KiB, two still fit.
  p = Plan(Shape(12, 128), 32);
  EXPECT_TRUE(p.staged);
  EXPECT_EQ(p.smem, 64u * 1024 + 8 * 1024 + 2 * 16 * 1024 + 128 + 512);
  EXPECT_LE(2 * (p.smem + kFoldStaticSmemBytes + 1024), size_t(kSmemOptin) + 1024);
  // Qwen3-Next (GDN: a log-decay a token), bf16 state rows: 32 KiB of rows.
  p = Plan(Shape(16, 128, DType::kBFloat16, LayerKind::kGdn), 16);
  EXPECT_TRUE(p.staged);
  EXPECT_EQ(p.smem, 32u * 1024 + 4 * 1024 + 8 * 1024 + 64 + 8 * 1024 + 64 + 512);
}

TEST(FoldPlanTest, AutoFallsBackWhereTwoBlocksDoNotFit) {
  // A ring of 64 tokens: 64 + 16 + 2 x 32 KiB = 144 KiB, one block an SM.
  const KdaShape s = Shape(32, 128);
  FoldLaunchPlan p = Plan(s, 64);
  EXPECT_FALSE(p.staged);
  EXPECT_EQ(p.smem, UnstagedFoldSmemFloats(128, 64) * sizeof(float));
  p = Plan(s, 64, Staging::kOn);  // asked for: one block an SM
  EXPECT_TRUE(p.staged);
  EXPECT_EQ(p.smem, StagedFoldSmem({128, 64, 2, 4, false}).Bytes());
  EXPECT_GT(2 * (p.smem + kFoldStaticSmemBytes + 1024), size_t(kSmemOptin) + 1024);
  // kOff: the chain of phases, whatever fits.
  EXPECT_FALSE(Plan(Shape(32, 128), 16, Staging::kOff).staged);
}

TEST(FoldPlanTest, HeadDim256TilesItsRows) {
  // K = 256: 32 rows a block (16 accumulators a thread's 512), 32 KiB of rows.
  EXPECT_EQ(FoldRows(256), 32);
  const StagedFoldSmem layout{256, 16, 2, 4, false};
  EXPECT_EQ(layout.CheckpointBytes(), 32u * 256 * 4);
  EXPECT_EQ(layout.ValueBytes(), 16u * 32 * 4);
  EXPECT_TRUE(Plan(Shape(8, 256), 16).staged);
}

TEST(FoldPlanTest, EveryPartStartsSixteenByteAligned) {
  // cp.async's 16-byte copies land on 16-byte boundaries: every part's size
  // is a multiple of 16, for odd capacities and GDN's one log-decay a token.
  for (int r : {1, 3, 5, 16, 17, 33}) {
    for (bool gdn : {false, true}) {
      for (int state_bytes : {2, 4}) {
        const StagedFoldSmem m{128, r, 2, state_bytes, gdn};
        for (size_t part : {m.CheckpointBytes(), m.RawKeyBytes(), m.KeyBytes(),
                            m.GdnLogDecayBytes(), m.ValueBytes(), m.NormBytes(), m.GcBytes()}) {
          EXPECT_EQ(part % 16, 0u) << "r " << r << " gdn " << gdn;
        }
      }
    }
  }
}

TEST(FoldPlanTest, StagingThatCannotFitIsRefusedNamingTheBound) {
  // A ring of 256 tokens: 64 + 64 + 2 x 128 KiB, past any block's 227 KiB.
  const absl::StatusOr<FoldLaunchPlan> plan =
      PlanFastFold(Shape(32, 128), 256, {Staging::kOn}, kSmemOptin);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(plan.status().message()), HasSubstr("schedule.staging kOn"));
  EXPECT_THAT(std::string(plan.status().message()), HasSubstr("at most 232448"));
  // kAuto runs it unstaged.
  EXPECT_FALSE(Plan(Shape(32, 128), 256).staged);
}

}  // namespace
}  // namespace fast
}  // namespace kernels
}  // namespace specstate
