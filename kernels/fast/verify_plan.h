// How FAST's CUDA Verify lays a launch out (FastVerifySchedule) and the
// shared memory each layout takes. Plain C++: the launcher's rules are
// tested without a GPU (verify_plan_test), and the kernel
// (cuda/verify.cuh) carves its shared memory from the same structs.
//
//   absl::StatusOr<VerifyLaunchPlan> plan =
//       PlanFastVerify(args, FastVerifySchedule{}, /*tensor_cores=*/true,
//                      args.num_rows * ValueHeads(args.shape), sms, smem_optin);
#ifndef SPECSTATE_KERNELS_FAST_VERIFY_PLAN_H_
#define SPECSTATE_KERNELS_FAST_VERIFY_PLAN_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "kernels/fast/fast_args.h"
#include "kernels/kda_args.h"
#include "kernels/numeric.h"

namespace specstate {
namespace kernels {
namespace fast {

// How FAST's Verify is laid out on the GPU, never what it computes: every
// schedule writes the same bits (fast_cuda_gpu_test checks it).
struct FastVerifySchedule {
  enum class Staging {
    // Staged where the grid has at most one (row, value head) an SM and
    // the copies fit in shared memory, split as far as the SMs take.
    kAuto,
    // Each phase loads the ring and the checkpoint from global memory; a
    // block per (row, value head).
    kOff,
    // The ring tokens a block reads and its rows of the checkpoint are
    // copied to shared memory as soon as it starts, in flight while the
    // window's phase runs (needs the checkpoint's products on tensor
    // cores).
    kOn,
  };
  Staging staging = Staging::kAuto;
  // Blocks per (row, value head), each taking K / value_splits of the state
  // rows (at least 16): 1, 2, 4 or 8 with staging; 0 lets the launcher
  // choose. Small batches split so that N = 1 fills the GPU.
  int value_splits = 0;
  // Unstaged with tensor cores at a grid of at most four (row, value head)s
  // an SM: the kernel that, where the arguments allow it
  // (FastVerifyArgs::rows_before_checks), reads and computes while its
  // checks run (the staged one always may). false: the kernel of larger
  // grids, which waits for its checks first.
  bool early_start = true;
  // The kernel of large grids (unstaged, not the early-start one) at head
  // dim 128 with tensor cores may pipe its checkpoint pass: each warp's
  // tile of the checkpoint copied to shared memory (cp.async) ahead of the
  // pass, its first column group at the block's start (in flight through
  // the window and ring phases), the next ones into the ring's freed buffer
  // and as the pass frees them (PipedSmem). Otherwise the pass loads each
  // column group from global memory when it needs it. Not in the
  // early-start kernel: at one wave of blocks the copy at the start slowed
  // N = 16 (bf16 state, H100, 2026-12-06).
  enum class Piping {
    // Piped for bf16 state rows where four blocks an SM still fit with the
    // buffers: measured on an H100 (docs/benchmarks.md, "FAST's checkpoint
    // pass piped"), 4-6% faster at N = 256 for Kimi-Linear and Qwen3-Next;
    // slower with fp32 state rows (+8-12%) and where the buffers cost a
    // block an SM (Kimi-K3's Q = 8: +5-8%).
    kAuto,
    kOff,
    kOn,  // wherever the kernel of large grids runs at head dim 128
  };
  // (fast_cuda_gpu_test's bf16 state cases at head dim 128 compare the
  // piped pass's bf16 layout with the loaded pass: passed on an H100,
  // 2026-12-07.)
  Piping piped_checkpoint = Piping::kAuto;
  // The kernel of large grids not piped: its checkpoint slice prefetched
  // into L2 part way through the block's chain, so that the pass's loads
  // wait on L2, not DRAM. (At the block's start it cost more than it hid at
  // N = 256: lines evicted before use.) Not served: after the ring, -2.4% to
  // +1.1% at N = 64 and 256 on an H100 (2026-12-07), fp32 within -1.3% to
  // +1.1%: no gain beyond the runs' spread.
  enum class CheckpointPrefetch {
    kNone,
    kAfterWindow,  // once the window's phase ends
    kAfterRing,    // once the ring's phase ends, as kc and qc are formed
  };
  CheckpointPrefetch checkpoint_prefetch = CheckpointPrefetch::kNone;
  // How the piped pass copies its tiles: each lane its 16-byte pieces
  // (cp.async, kLanes), or the TMA's bulk copies, a tile row of a column
  // group each, completing on two mbarriers a warp (kBulk, sm_90; fp32
  // rows stored unswizzled). The same sums either way. kBulk is not
  // served: 6-14% slower than the lanes' copies on an H100 (2026-12-07).
  enum class PipeCopies { kLanes, kBulk };
  PipeCopies pipe_copies = PipeCopies::kLanes;
  // The staged kernel's ring values, sum_i A_r[t][i] u_i[v] (the forward
  // substitution's rk and rq), summed by each state row's own thread, its
  // loop unrolled over the tokens and the window (kPerRow: at a split of
  // four, one warp of the block's eight, through a long stretch of cold
  // code), or spread over every thread of the block, one a (k or q side,
  // window token, state row), into shared memory (kSpread). The same sums
  // in the same order. The unstaged kernels always sum per row; kSpread
  // with staging kOff is refused. kAuto: kSpread wherever the kernel is
  // staged (an H100 at N = 1, 2026-12-07, launcher's split: 0.2-2.3 us a
  // layer faster for every shape and state dtype, up to 10% for Kimi-K3;
  // docs/results/kda_bench_h100_20261207_ring_values.md).
  enum class RingValues { kAuto, kPerRow, kSpread };
  RingValues ring_values = RingValues::kAuto;
  // When the staged kernel loads its window's tokens (q, k, v, gate inputs,
  // beta: one a warp): after the row's cursor, whose value its checks need
  // (kAfterCursor), or before it, in flight together (kBeforeCursor: one
  // memory round trip fewer ahead of the window's phase; the cursor's
  // checks still come before anything is written or the ring is read).
  // The same values. The unstaged kernels load after the cursor;
  // kBeforeCursor with staging kOff is refused. kAuto: kBeforeCursor
  // wherever the kernel is staged (an H100 at N = 1, 2026-12-07, cold L2,
  // launcher's split: 0.1-1.3 us a layer faster for every shape and state
  // dtype, 9% for Kimi-Linear and Qwen3-Next with fp32 state rows;
  // docs/results/kda_bench_h100_20261207_window_loads_n1.md).
  enum class WindowLoads { kAuto, kAfterCursor, kBeforeCursor };
  WindowLoads window_loads = WindowLoads::kAuto;
  // What the per-row arrays of the ring's values and the forward
  // substitution are sized and unrolled to: kMaxFastQueryLen tokens (kFull),
  // or kShortWindow (kShort: windows of at most that many tokens, 3xTF32
  // operands only; the served kernel of large grids at Kimi-Linear's shape
  // has 24% less code, tools/ptxas_usage.py,
  // docs/results/ptxas_short_window_20261208.md). The same sums in the
  // same order. kAuto is kFull until kShort is timed on a GPU (kda_bench's
  // verify schedule rows time it beside the launcher's choice).
  enum class WindowBound { kAuto, kFull, kShort };
  WindowBound window_bound = WindowBound::kAuto;
};

// The window bound of WindowBound::kShort: Kimi-Linear's and Qwen3-Next's
// Q = 4.
inline constexpr int kShortWindow = 4;

// Ring tokens per chunk of Verify's and the fold's shared memory.
inline constexpr int kRingChunk = 32;
// Warps of a Verify block (256 threads: cuda/device_math.cuh's kThreads).
inline constexpr int kVerifyWarps = 8;

// Shared memory of one Verify block (floats), Q window tokens at most, ring
// capacity R.
struct VerifySmem {
  int k, q, r;
  bool early = false;  // a kEarly kernel: the window's gammas kept [Q][K]
  SPECSTATE_HD int Window() const { return q * k; }
  // qn, kn, gam (then W), v, kx (kw then kc), qx (qw then qc), kr chunk
  // (also RowOwnerCheckpointPass's parts' sums), ar, br [Q][R], a, b [8][8],
  // beta [8], gc [K], then (early) the kept gammas.
  SPECSTATE_HD size_t Floats() const {
    return size_t(early ? 7 : 6) * Window() + size_t(kRingChunk) * k + size_t(2) * q * r +
           2 * kMaxFastQueryLen * kMaxFastQueryLen + kMaxFastQueryLen + k;
  }
  // Floats() in bytes, rounded up to 16 (the staged copies follow).
  SPECSTATE_HD size_t Bytes() const { return (Floats() + 3) / 4 * 4 * sizeof(float); }
};

// The staged schedule's copies (FastVerifySchedule), after VerifySmem's
// bytes: the ring's raw k [R][K] (activation dtype), log-decays [R][K]
// (GDN: [R]), the block's rows of u [R][rows], and its rows of the
// checkpoint [rows][RowStride] (state dtype), each 16-byte aligned.
// RowStride pads a row so that MmaCheckpointPass's 16-byte loads (lanes g
// = 0, 1 and 8t4 columns apart) fall in distinct banks: fp32 rows 4 words
// past a multiple of 32, bf16 rows 16.
struct StagedSmem {
  int k, r, rows;
  int act_bytes, state_bytes;  // element sizes
  bool gdn;
  static SPECSTATE_HD constexpr int RowStride(int k, int state_bytes) {
    return state_bytes == 4 ? k + 4 : k + 32;
  }
  static SPECSTATE_HD size_t Align16(size_t bytes) { return (bytes + 15) / 16 * 16; }
  SPECSTATE_HD size_t RingKBytes() const { return Align16(size_t(r) * k * act_bytes); }
  SPECSTATE_HD size_t RingGBytes() const {
    return Align16(size_t(r) * (gdn ? 1 : k) * sizeof(float));
  }
  SPECSTATE_HD size_t RingUBytes() const { return Align16(size_t(r) * rows * sizeof(float)); }
  SPECSTATE_HD size_t SliceBytes() const {
    return Align16(size_t(rows) * RowStride(k, state_bytes) * state_bytes);
  }
  SPECSTATE_HD size_t Bytes() const {
    return RingKBytes() + RingGBytes() + RingUBytes() + SliceBytes();
  }
};

// The piped checkpoint pass's buffers (FastVerifySchedule::
// piped_checkpoint, head dim 128 only), after VerifySmem's bytes: per warp
// kBytesPerWarp, one column group of its 16-row tile in fp32 (16 rows x 32
// columns) or two in bf16. The pass also uses the ring chunk buffer (kr,
// VerifySmem: 32 x 128 floats, kBytesPerWarp a warp), free once the ring's
// phase ends. The layouts within a group: cuda/checkpoint_pass.cuh,
// "The piped checkpoint pass".
struct PipedSmem {
  static constexpr int kHeadDim = 128;
  static constexpr size_t kBytesPerWarp = 2048;
  // PipeCopies::kBulk: two mbarriers a warp, after every warp's buffers.
  static constexpr size_t kBarrierBytesPerWarp = 16;
  static SPECSTATE_HD size_t Bytes(int warps) { return kBytesPerWarp * size_t(warps); }
  static SPECSTATE_HD size_t Bytes(int warps, bool bulk) {
    return Bytes(warps) + (bulk ? kBarrierBytesPerWarp * size_t(warps) : 0);
  }
};

// A schedule the launcher runs: staged or not, blocks per (row, value
// head), the kernel that may start early or not, the piped checkpoint pass
// or not.
struct VerifyLaunchPlan {
  bool staged = false;
  int splits = 1;
  size_t smem = 0;     // bytes a block
  bool early = false;  // the kEarly instantiation (staged: always)
  bool piped = false;  // unstaged only: PipedSmem, the piped checkpoint pass
  // The kernel of large grids, not piped: where its checkpoint slice is
  // prefetched into L2.
  FastVerifySchedule::CheckpointPrefetch checkpoint_prefetch =
      FastVerifySchedule::CheckpointPrefetch::kNone;
  bool bulk_copies = false;  // piped: the TMA's bulk copies (PipeCopies::kBulk)
  bool spread_ring_values = false;  // staged: RingValues::kSpread
  bool window_before_cursor = false;  // staged: WindowLoads::kBeforeCursor
  // The window's arrays sized to kShortWindow (WindowBound::kShort).
  bool short_window = false;
};

// `schedule` made concrete for a launch of `blocks` (row, value head) pairs
// on `sms` SMs whose blocks take at most `smem_optin` bytes of shared
// memory: kAuto stages a grid of at most one block an SM, split as far as
// the SMs take (at least 16 rows a block: one tensor-core tile; further
// where the copies would not fit); unstaged, a grid of at most four blocks
// an SM runs the kernel that may start early (schedule.early_start), a
// larger one the kernel of large grids, piped as schedule.piped_checkpoint
// says (kAuto: bf16 state rows, four blocks an SM fitting).
// Staging and splits need the checkpoint's products on tensor cores
// (`tensor_cores`).
// \returns INVALID_ARGUMENT naming the field and its bound for a schedule
//   the launch cannot run.
absl::StatusOr<VerifyLaunchPlan> PlanFastVerify(const FastVerifyArgs& args,
                                                const FastVerifySchedule& schedule,
                                                bool tensor_cores, int64_t blocks, int sms,
                                                int smem_optin);

}  // namespace fast
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_FAST_VERIFY_PLAN_H_
