// The CUDA fold's launch rule (fold_plan.h), without a GPU: which shapes are
// staged and pipelined, the shared memory each layout takes, and the
// schedules refused. (That every schedule writes the same bits needs a GPU:
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

// A commit of 16 rows unless told.
FoldLaunchPlan Plan(const KdaShape& s, int capacity, FastFoldSchedule schedule = {},
                    int rows = 16) {
  absl::StatusOr<FoldLaunchPlan> plan = PlanFastFold(s, capacity, rows, schedule, kSmemOptin);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.ok() ? *plan : FoldLaunchPlan{};
}

TEST(FoldPlanTest, TwoRowsOrMoreArePipelined) {
  const KdaShape kimi_linear = Shape(32, 128);
  EXPECT_EQ(Plan(kimi_linear, 16, {}, 1).staging, Staging::kOff);  // nothing to overlap
  FoldLaunchPlan p = Plan(kimi_linear, 16, {}, 2);
  EXPECT_EQ(p.staging, Staging::kPipelined);
  EXPECT_EQ(p.blocks_per_head, 1);
  EXPECT_EQ(Plan(kimi_linear, 16, {}, 32).blocks_per_head, 1);
  p = Plan(kimi_linear, 16, {}, 33);  // four blocks a head from here (N = 64: 1-15% faster)
  EXPECT_EQ(p.staging, Staging::kPipelined);
  EXPECT_EQ(p.blocks_per_head, 4);
  EXPECT_EQ(Plan(kimi_linear, 16, {}, 64).blocks_per_head, 4);
  p = Plan(kimi_linear, 16, {}, 256);  // N = 256: 11-24% faster than kOff with two-run tiles
  EXPECT_EQ(p.staging, Staging::kPipelined);
  EXPECT_EQ(p.blocks_per_head, 4);
  // Asked for, at any number of rows.
  p = Plan(kimi_linear, 16, {Staging::kOff}, 256);
  EXPECT_EQ(p.staging, Staging::kOff);
  EXPECT_EQ(p.blocks_per_head, 16);
  EXPECT_EQ(p.smem, UnstagedFoldSmemFloats(128, 16) * sizeof(float));
  EXPECT_EQ(Plan(kimi_linear, 16, {Staging::kPipelined}, 1).staging, Staging::kPipelined);
  EXPECT_EQ(Plan(kimi_linear, 16, {Staging::kOn}, 1).staging, Staging::kOn);
}

TEST(FoldPlanTest, TheServedShapesArePipelinedAtSixteenRows) {
  // Kimi-Linear (Q = 4, F = 4: 16 tokens): a buffer holds 64 KiB of
  // checkpoint rows, the ring's bf16 keys (4 KiB), its log-decays (then
  // decayed keys) and values (8 KiB each); two of them, the norms and Gc.
  const size_t kimi_linear_buffer = 64u * 1024 + 4 * 1024 + 2 * 8 * 1024;
  FoldLaunchPlan p = Plan(Shape(32, 128), 16);
  EXPECT_EQ(p.staging, Staging::kPipelined);
  EXPECT_EQ(p.smem, 2 * kimi_linear_buffer + 64 + 512);
  EXPECT_EQ(p.blocks_per_head, 1);
  // Kimi-K3 at TP8 (Q = 8: 32 tokens): two buffers of 64 + 8 + 2 x 16 KiB.
  p = Plan(Shape(12, 128), 32);
  EXPECT_EQ(p.staging, Staging::kPipelined);
  EXPECT_EQ(p.smem, 2 * (64u * 1024 + 8 * 1024 + 2 * 16 * 1024) + 128 + 512);
  EXPECT_LE(p.smem + kFoldStaticSmemBytes, size_t(kSmemOptin));
  // Qwen3-Next (GDN: a log-decay a token), bf16 state rows: 32 KiB of rows.
  p = Plan(Shape(16, 128, DType::kBFloat16, LayerKind::kGdn), 16);
  EXPECT_EQ(p.staging, Staging::kPipelined);
  EXPECT_EQ(p.smem, 2 * (32u * 1024 + 4 * 1024 + 8 * 1024 + 64 + 8 * 1024) + 64 + 512);
  // One buffer (kOn): two blocks an SM still fit for Kimi-Linear.
  p = Plan(Shape(32, 128), 16, {Staging::kOn});
  EXPECT_EQ(p.staging, Staging::kOn);
  EXPECT_EQ(p.smem, kimi_linear_buffer + 64 + 512);
  EXPECT_EQ(p.blocks_per_head, 16);
  EXPECT_LE(2 * (p.smem + kFoldStaticSmemBytes + 1024), size_t(kSmemOptin) + 1024);
}

TEST(FoldPlanTest, AutoFallsBackWhereTwoBuffersDoNotFit) {
  // A ring of 64 tokens: a buffer of 64 + 16 + 2 x 32 KiB = 144 KiB; one fits.
  const KdaShape s = Shape(32, 128);
  FoldLaunchPlan p = Plan(s, 64);
  EXPECT_EQ(p.staging, Staging::kOff);
  EXPECT_EQ(p.smem, UnstagedFoldSmemFloats(128, 64) * sizeof(float));
  EXPECT_EQ(p.blocks_per_head, 16);
  p = Plan(s, 64, {Staging::kOn});  // asked for: one block an SM
  EXPECT_EQ(p.staging, Staging::kOn);
  EXPECT_EQ(p.smem, StagedFoldSmem({128, 64, 2, 4, false}).Bytes());
  // kOff: the chain of phases, whatever fits; blocks as asked.
  p = Plan(Shape(32, 128), 16, {Staging::kOff, 4});
  EXPECT_EQ(p.staging, Staging::kOff);
  EXPECT_EQ(p.blocks_per_head, 4);
}

// fast_cuda_gpu_test compares the pipelined folds (Commit's and
// Materialize's) with the served ones wherever they fit, and expects them
// to fit its rings of 32 tokens or fewer: they must, at every head dim and
// state dtype it runs.
TEST(FoldPlanTest, RingsOf32TokensFitThePipeline) {
  for (int k : {64, 128, 256}) {
    for (DType state : {DType::kFloat32, DType::kBFloat16}) {
      for (LayerKind kind : {LayerKind::kKda, LayerKind::kGdn}) {
        for (int capacity : {16, 32}) {
          const absl::StatusOr<FoldLaunchPlan> plan = PlanFastFold(
              Shape(2, k, state, kind), capacity, 3, {Staging::kPipelined, 1}, kSmemOptin);
          EXPECT_TRUE(plan.ok()) << "K " << k << ", ring " << capacity << ": " << plan.status();
        }
      }
    }
  }
}

TEST(FoldPlanTest, HeadDim256TilesItsRows) {
  // K = 256: 32 rows a block (16 accumulators a thread's 512), 32 KiB of rows.
  EXPECT_EQ(FoldRows(256), 32);
  const StagedFoldSmem layout{256, 16, 2, 4, false};
  EXPECT_EQ(layout.CheckpointBytes(), 32u * 256 * 4);
  EXPECT_EQ(layout.ValueBytes(), 16u * 32 * 4);
  EXPECT_EQ(Plan(Shape(8, 256), 16).staging, Staging::kPipelined);
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

TEST(FoldPlanTest, SchedulesThatCannotRunAreRefusedNamingTheBound) {
  // A ring of 128 tokens: a buffer of 64 + 32 + 2 x 64 KiB, 2 bytes past
  // one block's 227 KiB with the static part; two buffers far past.
  for (Staging staging : {Staging::kOn, Staging::kPipelined}) {
    const absl::StatusOr<FoldLaunchPlan> plan =
        PlanFastFold(Shape(32, 128), 128, 16, {staging}, kSmemOptin);
    ASSERT_FALSE(plan.ok());
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(plan.status().message()),
                HasSubstr(staging == Staging::kOn ? "schedule.staging kOn needs 232452 bytes"
                                                  : "schedule.staging kPipelined needs"));
    EXPECT_THAT(std::string(plan.status().message()), HasSubstr("at most 232448"));
  }
  // kAuto runs it unstaged.
  EXPECT_EQ(Plan(Shape(32, 128), 128).staging, Staging::kOff);
  const absl::StatusOr<FoldLaunchPlan> negative =
      PlanFastFold(Shape(32, 128), 16, 16, {Staging::kOff, -1}, kSmemOptin);
  ASSERT_FALSE(negative.ok());
  EXPECT_THAT(std::string(negative.status().message()),
              HasSubstr("schedule.blocks_per_head -1 is negative"));
}

}  // namespace
}  // namespace fast
}  // namespace kernels
}  // namespace specstate
