// The CUDA Verify's launch rules (verify_plan.h), without a GPU: which
// schedule each grid gets, the shared memory it takes, and the schedules
// refused. (That every schedule writes the same bits needs a GPU:
// cuda/fast_cuda_gpu_test.cc.)
#include "kernels/fast/verify_plan.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace specstate {
namespace kernels {
namespace fast {
namespace {

using ::testing::HasSubstr;
using Staging = FastVerifySchedule::Staging;
using Piping = FastVerifySchedule::Piping;

constexpr int kSms = 132;              // an H100 or H200
constexpr int kSmemOptin = 227 * 1024;  // their largest block

// A layer of `heads` KDA heads of head dim k, bf16 activations, Q = 4, a ring
// of F = 4 windows.
FastVerifyArgs Layer(int heads, int k, DType state = DType::kFloat32, int q = 4) {
  FastVerifyArgs a;
  a.shape.num_heads = heads;
  a.shape.head_dim = k;
  a.shape.act_dtype = DType::kBFloat16;
  a.shape.state_dtype = state;
  a.spec_query_len = q;
  a.rings.capacity = 4 * q;
  return a;
}

size_t StagedBytes(const FastVerifyArgs& a, int splits) {
  const int k = a.shape.head_dim;
  return VerifySmem{k, a.spec_query_len, a.rings.capacity, true}.Bytes() +
         StagedSmem{k, a.rings.capacity, k / splits, 2, a.shape.state_dtype == DType::kFloat32 ? 4 : 2,
                    false}
             .Bytes();
}

FastVerifySchedule SpreadRingValues(FastVerifySchedule s) {
  s.ring_values = FastVerifySchedule::RingValues::kSpread;
  return s;
}

FastVerifySchedule WindowBeforeCursor(FastVerifySchedule s) {
  s.window_loads = FastVerifySchedule::WindowLoads::kBeforeCursor;
  return s;
}

FastVerifySchedule ShortWindow(FastVerifySchedule s) {
  s.window_bound = FastVerifySchedule::WindowBound::kShort;
  return s;
}

VerifyLaunchPlan Plan(const FastVerifyArgs& a, int64_t blocks, FastVerifySchedule s = {},
                      bool tensor_cores = true) {
  absl::StatusOr<VerifyLaunchPlan> plan = PlanFastVerify(a, s, tensor_cores, blocks, kSms, kSmemOptin);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.ok() ? *plan : VerifyLaunchPlan{};
}

TEST(VerifyPlanTest, SmallGridsAreStagedAndSplitAsFarAsTheSmsTake) {
  const FastVerifyArgs kimi_linear = Layer(32, 128);
  // N = 1: 32 heads, four blocks a head fill 128 of 132 SMs.
  VerifyLaunchPlan p = Plan(kimi_linear, 32);
  EXPECT_TRUE(p.staged);
  EXPECT_TRUE(p.early);
  EXPECT_EQ(p.splits, 4);
  EXPECT_EQ(p.smem, StagedBytes(kimi_linear, 4));
  // N = 4: 128 blocks already.
  p = Plan(kimi_linear, 128);
  EXPECT_TRUE(p.staged);
  EXPECT_EQ(p.splits, 1);
  // Kimi-K3 at TP8, N = 1: 12 heads, eight blocks a head (the most: 16 rows each).
  p = Plan(Layer(12, 128, DType::kFloat32, 8), 12);
  EXPECT_TRUE(p.staged);
  EXPECT_EQ(p.splits, 8);
  // K = 64: at most four (16 rows a block).
  EXPECT_EQ(Plan(Layer(2, 64), 2).splits, 4);
}

TEST(VerifyPlanTest, MidGridsRunTheKernelThatStartsEarly) {
  const FastVerifyArgs a = Layer(32, 128);
  const size_t early_bytes = VerifySmem{128, 4, 16, true}.Bytes();
  const size_t plain_bytes = VerifySmem{128, 4, 16, false}.Bytes();
  EXPECT_EQ(early_bytes, plain_bytes + 4 * 128 * sizeof(float));  // the kept gammas
  const size_t piped_bytes = PipedSmem::Bytes(kVerifyWarps);
  EXPECT_EQ(piped_bytes, 16u * 1024);  // a warp's fp32 column group: 16 rows x 32 columns
  // N = 16: 512 blocks, at most four an SM.
  VerifyLaunchPlan p = Plan(a, 512);
  EXPECT_FALSE(p.staged);
  EXPECT_TRUE(p.early);
  EXPECT_FALSE(p.piped);
  EXPECT_EQ(p.splits, 1);
  EXPECT_EQ(p.smem, early_bytes);
  // One more than four an SM: the kernel of large grids.
  p = Plan(a, 4 * kSms + 1);
  EXPECT_FALSE(p.staged);
  EXPECT_FALSE(p.early);
  EXPECT_FALSE(p.piped);  // fp32 state rows: not piped unless asked
  EXPECT_EQ(p.smem, plain_bytes);
  // Piped: four blocks an SM still fit (228 KiB an SM, 1 KiB reserved a block).
  FastVerifySchedule piped;
  piped.piped_checkpoint = Piping::kOn;
  p = Plan(a, 4 * kSms + 1, piped);
  EXPECT_TRUE(p.piped);
  EXPECT_EQ(p.smem, plain_bytes + piped_bytes);
  EXPECT_LE(4 * (p.smem + 1024), 228u * 1024);
  // ... but not in the early-start kernel.
  EXPECT_FALSE(Plan(a, 512, piped).piped);
  // early_start false keeps it everywhere.
  FastVerifySchedule no_early;
  no_early.early_start = false;
  EXPECT_FALSE(Plan(a, 512, no_early).early);
  p = Plan(a, 32, FastVerifySchedule{Staging::kOff, 1, false});
  EXPECT_FALSE(p.staged || p.early);
}

TEST(VerifyPlanTest, ThePipedPassIsTheLargeGridKernelsAtHeadDim128) {
  const FastVerifyArgs a = Layer(32, 128);
  FastVerifySchedule piped;
  piped.piped_checkpoint = Piping::kOn;
  EXPECT_FALSE(Plan(a, 4096).piped);  // fp32 state rows: not by default
  EXPECT_TRUE(Plan(a, 4096, piped).piped);
  // bf16 state rows: the same buffers (two column groups a warp).
  EXPECT_TRUE(Plan(Layer(32, 128, DType::kBFloat16), 4096, piped).piped);
  // Not on CUDA cores, nor at other head dims, nor staged, nor (above) early.
  EXPECT_FALSE(Plan(a, 4096, piped, /*tensor_cores=*/false).piped);
  EXPECT_FALSE(Plan(Layer(32, 64), 4096, piped).piped);
  EXPECT_FALSE(Plan(Layer(32, 256), 4096, piped).piped);
  const VerifyLaunchPlan p = Plan(a, 32, piped);
  EXPECT_TRUE(p.staged);
  EXPECT_FALSE(p.piped);
}

TEST(VerifyPlanTest, AutoPipesBf16StateRowsWhereFourBlocksAnSmFit) {
  // The default.
  EXPECT_EQ(FastVerifySchedule{}.piped_checkpoint, Piping::kAuto);
  EXPECT_TRUE(Plan(Layer(32, 128, DType::kBFloat16), 4096).piped);
  FastVerifySchedule automatic;
  automatic.piped_checkpoint = Piping::kAuto;
  // Kimi-Linear and Qwen3-Next (Q = 4): piped with bf16 state rows, not fp32.
  const FastVerifyArgs bf16 = Layer(32, 128, DType::kBFloat16);
  VerifyLaunchPlan p = Plan(bf16, 4096, automatic);
  EXPECT_TRUE(p.piped);
  const size_t plain_bytes = VerifySmem{128, 4, 16, false}.Bytes();
  EXPECT_EQ(p.smem, plain_bytes + PipedSmem::Bytes(kVerifyWarps));
  EXPECT_LE(4 * (p.smem + 1024), size_t(kSmemOptin) + 1024);
  EXPECT_FALSE(Plan(Layer(32, 128), 4096, automatic).piped);
  // Kimi-K3 at TP8 (Q = 8, a ring of 32): the buffers would leave three blocks an SM.
  const FastVerifyArgs k3 = Layer(12, 128, DType::kBFloat16, 8);
  p = Plan(k3, 4096, automatic);
  EXPECT_FALSE(p.piped);
  const size_t k3_piped_bytes =
      VerifySmem{128, 8, 32, false}.Bytes() + PipedSmem::Bytes(kVerifyWarps);
  EXPECT_GT(4 * (k3_piped_bytes + 1024), size_t(kSmemOptin) + 1024);
  FastVerifySchedule on;
  on.piped_checkpoint = Piping::kOn;
  EXPECT_TRUE(Plan(k3, 4096, on).piped);  // asked for: piped at three blocks an SM
  // Not the early-start kernel, nor on CUDA cores.
  EXPECT_FALSE(Plan(bf16, 512, automatic).piped);
  EXPECT_FALSE(Plan(bf16, 4096, automatic, /*tensor_cores=*/false).piped);
}

TEST(VerifyPlanTest, BulkCopiesArePipedPassesWithTheirBarriers) {
  using Copies = FastVerifySchedule::PipeCopies;
  EXPECT_EQ(FastVerifySchedule{}.pipe_copies, Copies::kLanes);  // not served
  for (DType state : {DType::kFloat32, DType::kBFloat16}) {
    const FastVerifyArgs a = Layer(32, 128, state);
    FastVerifySchedule bulk;
    bulk.piped_checkpoint = Piping::kOn;
    bulk.pipe_copies = Copies::kBulk;
    const VerifyLaunchPlan p = Plan(a, 4096, bulk);
    EXPECT_TRUE(p.piped && p.bulk_copies);
    // Two 8-byte mbarriers a warp after the lanes' buffers.
    const size_t lanes_bytes =
        VerifySmem{128, 4, 16, false}.Bytes() + PipedSmem::Bytes(kVerifyWarps);
    EXPECT_EQ(p.smem, lanes_bytes + 2 * 8 * kVerifyWarps);
    // The barriers start right after the buffers (cuda/checkpoint_pass.cuh,
    // PipedBarrier), where an mbarrier's 8-byte alignment must hold.
    EXPECT_EQ(lanes_bytes % 8, 0u);
    // Only where the pass is piped: not unpiped, early, staged, nor at head dim 64.
    bulk.piped_checkpoint = Piping::kOff;
    EXPECT_FALSE(Plan(a, 4096, bulk).bulk_copies);
    bulk.piped_checkpoint = Piping::kOn;
    EXPECT_FALSE(Plan(a, 512, bulk).bulk_copies);
    EXPECT_FALSE(Plan(a, 32, bulk).bulk_copies);
    EXPECT_FALSE(Plan(Layer(32, 64, state), 4096, bulk).bulk_copies);
    // The lanes' copies take no barriers.
    bulk.pipe_copies = Copies::kLanes;
    EXPECT_FALSE(Plan(a, 4096, bulk).bulk_copies);
    EXPECT_EQ(Plan(a, 4096, bulk).smem + 2 * 8 * kVerifyWarps, p.smem);
  }
}

TEST(VerifyPlanTest, TheCheckpointPrefetchIsTheUnpipedLargeGridKernels) {
  using Prefetch = FastVerifySchedule::CheckpointPrefetch;
  const FastVerifyArgs a = Layer(32, 128);
  EXPECT_EQ(Plan(a, 4096).checkpoint_prefetch, Prefetch::kNone);  // not served
  FastVerifySchedule s;
  s.checkpoint_prefetch = Prefetch::kAfterRing;
  VerifyLaunchPlan p = Plan(a, 4096, s);
  EXPECT_EQ(p.checkpoint_prefetch, Prefetch::kAfterRing);
  EXPECT_EQ(p.smem, Plan(a, 4096).smem);  // no shared memory of its own
  EXPECT_EQ(Plan(a, 4096, s, /*tensor_cores=*/false).checkpoint_prefetch, Prefetch::kAfterRing);
  // Not where the pass is piped, nor in the early-start or staged kernels.
  s.piped_checkpoint = FastVerifySchedule::Piping::kOn;
  EXPECT_EQ(Plan(a, 4096, s).checkpoint_prefetch, Prefetch::kNone);
  s.piped_checkpoint = FastVerifySchedule::Piping::kOff;
  EXPECT_EQ(Plan(a, 512, s).checkpoint_prefetch, Prefetch::kNone);
  EXPECT_EQ(Plan(a, 32, s).checkpoint_prefetch, Prefetch::kNone);
}

TEST(VerifyPlanTest, CudaCoresNeitherStageNorStartEarly) {
  for (int64_t blocks : {1, 32, 512, 4096}) {
    const VerifyLaunchPlan p = Plan(Layer(32, 128), blocks, {}, /*tensor_cores=*/false);
    EXPECT_FALSE(p.staged || p.early) << blocks;
    EXPECT_EQ(p.splits, 1);
  }
}

TEST(VerifyPlanTest, CopiesThatDoNotFitSplitFurther) {
  // K = 256, fp32 state: unsplit, a head's 256 KiB of rows cannot be staged.
  const FastVerifyArgs a = Layer(1, 256);
  ASSERT_GT(StagedBytes(a, 1), size_t(kSmemOptin));
  // 100 blocks: the SMs take no split, the shared memory needs one.
  const VerifyLaunchPlan p = Plan(a, 100);
  EXPECT_TRUE(p.staged);
  EXPECT_GT(p.splits, 1);
  EXPECT_LE(p.smem, size_t(kSmemOptin));
  EXPECT_GT(StagedBytes(a, p.splits / 2), size_t(kSmemOptin));
  // Forced unsplit: refused, with the bytes.
  const absl::StatusOr<VerifyLaunchPlan> forced =
      PlanFastVerify(a, {Staging::kOn, 1, true}, true, 100, kSms, kSmemOptin);
  EXPECT_EQ(forced.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(forced.status().message()),
              HasSubstr("the staged schedule with value_splits 1 needs " +
                        std::to_string(StagedBytes(a, 1)) +
                        " bytes of shared memory a block; the device allows 232448"));
}

TEST(VerifyPlanTest, StagedKernelsSpreadTheRingValuesUnlessAskedPerRow) {
  const FastVerifyArgs a = Layer(32, 128);
  // kAuto: spread wherever the kernel is staged, its choice or forced.
  VerifyLaunchPlan p = Plan(a, 32);
  EXPECT_TRUE(p.staged);
  EXPECT_TRUE(p.spread_ring_values);
  EXPECT_TRUE(Plan(a, 32, {Staging::kOn, 2, true}).spread_ring_values);
  // kSpread: the staged kernel, at any split, and kAuto's staged grids.
  p = Plan(a, 32, SpreadRingValues({Staging::kOn, 4, true}));
  EXPECT_TRUE(p.staged);
  EXPECT_TRUE(p.spread_ring_values);
  EXPECT_EQ(p.smem, StagedBytes(a, 4));  // the sums reuse the ring chunk's buffer
  EXPECT_TRUE(Plan(a, 32, SpreadRingValues({})).spread_ring_values);
  // kPerRow: each state row's owner sums its own, at any split.
  for (int splits : {1, 2, 4, 8}) {
    FastVerifySchedule per_row{Staging::kOn, splits, true};
    per_row.ring_values = FastVerifySchedule::RingValues::kPerRow;
    p = Plan(a, 32, per_row);
    EXPECT_TRUE(p.staged);
    EXPECT_FALSE(p.spread_ring_values) << splits;
  }
  // The grids kAuto runs unstaged sum per row, whatever was asked.
  p = Plan(a, 32 * 64, SpreadRingValues({}));
  EXPECT_FALSE(p.staged);
  EXPECT_FALSE(p.spread_ring_values);
  EXPECT_FALSE(Plan(a, 32 * 64).spread_ring_values);
}

TEST(VerifyPlanTest, StagedKernelsLoadTheWindowWithTheCursorUnlessAskedAfter) {
  const FastVerifyArgs a = Layer(32, 128);
  // kAuto: with the cursor wherever the kernel is staged, chosen or forced.
  VerifyLaunchPlan p = Plan(a, 32);
  EXPECT_TRUE(p.staged);
  EXPECT_TRUE(p.window_before_cursor);
  EXPECT_TRUE(Plan(a, 32, {Staging::kOn, 2, true}).window_before_cursor);
  for (int splits : {1, 2, 4, 8}) {
    p = Plan(a, 32, WindowBeforeCursor({Staging::kOn, splits, true}));
    EXPECT_TRUE(p.staged);
    EXPECT_TRUE(p.window_before_cursor) << splits;
    EXPECT_EQ(p.smem, StagedBytes(a, splits));  // registers, not shared memory
    FastVerifySchedule after{Staging::kOn, splits, true};
    after.window_loads = FastVerifySchedule::WindowLoads::kAfterCursor;
    EXPECT_FALSE(Plan(a, 32, after).window_before_cursor) << splits;
  }
  // The grids kAuto runs unstaged load after the cursor, whatever was asked.
  p = Plan(a, 32 * 64, WindowBeforeCursor({}));
  EXPECT_FALSE(p.staged);
  EXPECT_FALSE(p.window_before_cursor);
  EXPECT_FALSE(Plan(a, 32 * 64).window_before_cursor);
}

TEST(VerifyPlanTest, TheShortWindowKernelsRunWhereAskedForWindowsOfFourOrFewer) {
  const FastVerifySchedule short_window = ShortWindow({});
  FastVerifySchedule full;
  full.window_bound = FastVerifySchedule::WindowBound::kFull;
  // Every grid (staged at N = 1, early at N = 16, the kernel of large
  // grids at N = 256): kShort with Q = 4 or 2; not by default (kAuto) or kFull.
  for (int64_t blocks : {32, 512, 8192}) {
    EXPECT_TRUE(Plan(Layer(32, 128), blocks, short_window).short_window) << blocks;
    EXPECT_TRUE(Plan(Layer(32, 128, DType::kFloat32, 2), blocks, short_window).short_window)
        << blocks;
    EXPECT_FALSE(Plan(Layer(32, 128), blocks).short_window) << blocks;
    EXPECT_FALSE(Plan(Layer(32, 128), blocks, full).short_window) << blocks;
    EXPECT_FALSE(Plan(Layer(12, 128, DType::kFloat32, 8), blocks).short_window) << blocks;
  }
}

TEST(VerifyPlanTest, SchedulesItCannotRunAreRefusedByName) {
  struct Refusal {
    FastVerifyArgs args;
    FastVerifySchedule schedule;
    bool tensor_cores;
    std::string says;
  };
  const Refusal refusals[] = {
      {Layer(32, 128), {Staging::kOn, 3, true}, true,
       "In FastVerify: schedule.value_splits 3 is not 0 (chosen), 1, 2, 4 or 8"},
      {Layer(32, 128), {Staging::kAuto, 16, true}, true, "value_splits 16 is not 0"},
      {Layer(2, 64), {Staging::kOn, 8, true}, true,
       "value_splits 8 leaves 8 state rows a block; head dim 64 takes at most 4"},
      {Layer(32, 128), {Staging::kOff, 2, true}, true,
       "value_splits 2 needs the staged schedule (staging kOn)"},
      {Layer(32, 128), {Staging::kAuto, 2, true}, false,
       "value_splits 2 needs the staged schedule (staging kOn), which needs the checkpoint's "
       "products on tensor cores"},
      {Layer(32, 128), {Staging::kOn, 1, true}, false,
       "staging kOn needs the checkpoint's products on tensor cores"},
      {Layer(32, 128), SpreadRingValues({Staging::kOff, 1, true}), true,
       "schedule.ring_values kSpread needs the staged schedule (staging kOn or kAuto)"},
      {Layer(32, 128), WindowBeforeCursor({Staging::kOff, 1, true}), true,
       "schedule.window_loads kBeforeCursor needs the staged schedule (staging kOn or kAuto)"},
      {Layer(12, 128, DType::kFloat32, 8), ShortWindow({}), true,
       "schedule.window_bound kShort needs spec_query_len <= 4; it is 8"},
      {Layer(32, 128), ShortWindow({}), false,
       "schedule.window_bound kShort needs the checkpoint's products on tensor cores"},
  };
  for (const Refusal& r : refusals) {
    const absl::StatusOr<VerifyLaunchPlan> plan =
        PlanFastVerify(r.args, r.schedule, r.tensor_cores, 32, kSms, kSmemOptin);
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << r.says;
    EXPECT_THAT(std::string(plan.status().message()), HasSubstr(r.says));
  }
}

TEST(VerifyPlanTest, StagedRowsFallInDistinctBanks) {
  // MmaCheckpointPass's lanes g = 0, 1 read 16 bytes at columns 8 t4 of two
  // consecutive rows: the second row must start 16 banks (bf16) or 4 banks
  // (fp32, two 16-byte loads a lane) past a multiple of 32.
  for (int k : {64, 128, 256}) {
    EXPECT_EQ(StagedSmem::RowStride(k, 4) % 32, 4) << k;
    EXPECT_EQ((StagedSmem::RowStride(k, 2) / 2) % 32, 16) << k;
  }
  // Every region starts on 16 bytes.
  const StagedSmem s{128, 12, 32, 2, 2, true};
  for (size_t bytes : {s.RingKBytes(), s.RingGBytes(), s.RingUBytes(), s.SliceBytes(),
                       VerifySmem{128, 3, 12, false}.Bytes()}) {
    EXPECT_EQ(bytes % 16, 0u);
  }
}

}  // namespace
}  // namespace fast
}  // namespace kernels
}  // namespace specstate
