// How FAST's CUDA fold (Commit's and Materialize's) lays a job out
// (FastFoldSchedule) and the shared memory each layout takes. Plain C++: the
// launcher's rule is tested without a GPU (fold_plan_test), and the kernel
// (cuda/fold.cuh) carves its shared memory from the same structs.
//
//   absl::StatusOr<FoldLaunchPlan> plan = PlanFastFold(
//       shape, rings.capacity, num_rows, FastFoldSchedule{}, smem_optin);
#ifndef SPECSTATE_KERNELS_FAST_FOLD_PLAN_H_
#define SPECSTATE_KERNELS_FAST_FOLD_PLAN_H_

#include <cstddef>

#include "absl/status/statusor.h"
#include "kernels/fast/verify_plan.h"  // kRingChunk
#include "kernels/kda_args.h"
#include "kernels/numeric.h"

namespace specstate {
namespace kernels {
namespace fast {

// How a fold job (one ring folded into one value head's rows of its
// checkpoint) reads its inputs, never what it computes: every schedule
// writes the same bits (fast_cuda_gpu_test checks it).
struct FastFoldSchedule {
  enum class Staging {
    // Commit: kPipelined for 2 rows or more where its two buffers fit a
    // block, one block a head up to 32 rows, four beyond; otherwise (and
    // for Materialize) kOff. Measured on an H100
    // (docs/benchmarks.md, "FAST's folds staged and pipelined"): its folds
    // and cursors 10-32% faster than kOff's at N = 16 with one block a
    // head, 1-15% faster at N = 64 with four (two runs), for every shape
    // and state dtype; at N = 256, with four blocks a head, 4% faster for
    // Kimi-K3 before the fold tiles' two runs and 11-24% for Kimi-Linear
    // and Qwen3-Next after ("Fold tiles in two runs").
    kAuto,
    // A chain of phases, each loading from global memory when it needs
    // it: the exponent pass's log-decays, then the checkpoint's rows, then
    // each ring chunk's keys and values. Two blocks an SM.
    kOff,
    // One round of copies a job (cp.async): the block's checkpoint rows
    // and every ring token's key, log-decays and values into shared memory
    // at the job's start, every later phase reading them there. Two blocks
    // an SM, one buffer each.
    kOn,
    // kOn's copies double-buffered: a block's next job's copies in flight
    // while it computes and stores the current one. One block an SM.
    kPipelined,
  };
  Staging staging = Staging::kAuto;
  // Commit's fold blocks per (value head, tile of rows, layer), each
  // striding over the rows: 0 lets the launcher choose (16 unstaged or
  // kOn: a no-fold commit stays a few microseconds; pipelined, 1 up to 32
  // rows, every job of a (head, layer) in one block's pipeline, and 4
  // beyond).
  int blocks_per_head = 0;
};

// A fold block: kFoldThreads threads own FoldRows(K) state rows of one value
// head (all of them at K <= 128, so that the ring's exponents and decayed
// keys are computed once per head, not once per tile of rows), each thread
// a tile of kFoldCols columns of 1-4 rows (FoldTile, fold.cuh: staged jobs
// in two runs of four, K / 2 apart; the unstaged one in one run).
inline constexpr int kFoldThreads = 512;
inline constexpr int kFoldCols = 8;
SPECSTATE_HD constexpr int FoldRows(int k) { return k <= 128 ? k : 16 * kFoldThreads / k; }
// A fold block's static shared memory (its list of rows that fold, and
// their count): what its dynamic shared memory shares an SM with.
inline constexpr size_t kFoldStaticSmemBytes = kFoldThreads * sizeof(int) + sizeof(int);

// The unstaged fold's shared memory (floats), ring capacity r: a chunk's
// normalized keys [kRingChunk][K] and values [kRingChunk][rows], the chunk
// boundaries' exponents [r / kRingChunk + 1][K], Gc [K], a chunk's
// log-decays [kRingChunk][K].
SPECSTATE_HD size_t UnstagedFoldSmemFloats(int k, int r) {
  return size_t(kRingChunk) * k + size_t(kRingChunk) * FoldRows(k) +
         size_t(r / kRingChunk + 1) * k + k + size_t(kRingChunk) * k;
}

// The staged fold's shared memory, ring capacity r, each part 16-byte
// aligned. What a job's copies fill (a buffer; kPipelined has two): the
// block's checkpoint rows [rows][K] (state dtype), every ring token's raw
// key [r][K] (activation dtype), the keys [r][K] (floats: KDA's log-decays
// as copied, each replaced by its token's decayed key as the exponent pass
// goes; GDN's decayed keys), GDN's log-decays [r] (one a token), the values
// [r][rows]; then, once, the keys' norms [r] and Gc [K] (floats).
struct StagedFoldSmem {
  int k, r;
  int act_bytes, state_bytes;  // element sizes
  bool gdn;
  static SPECSTATE_HD size_t Align16(size_t bytes) { return (bytes + 15) / 16 * 16; }
  SPECSTATE_HD int Rows() const { return FoldRows(k); }
  SPECSTATE_HD size_t CheckpointBytes() const {
    return Align16(size_t(Rows()) * k * state_bytes);
  }
  SPECSTATE_HD size_t RawKeyBytes() const { return Align16(size_t(r) * k * act_bytes); }
  SPECSTATE_HD size_t KeyBytes() const { return Align16(size_t(r) * k * sizeof(float)); }
  SPECSTATE_HD size_t GdnLogDecayBytes() const {
    return gdn ? Align16(size_t(r) * sizeof(float)) : 0;
  }
  SPECSTATE_HD size_t ValueBytes() const { return Align16(size_t(r) * Rows() * sizeof(float)); }
  SPECSTATE_HD size_t NormBytes() const { return Align16(size_t(r) * sizeof(float)); }
  SPECSTATE_HD size_t GcBytes() const { return Align16(size_t(k) * sizeof(float)); }
  // One buffer: what a job's copies fill.
  SPECSTATE_HD size_t BufferBytes() const {
    return CheckpointBytes() + RawKeyBytes() + KeyBytes() + GdnLogDecayBytes() + ValueBytes();
  }
  SPECSTATE_HD size_t Bytes(int buffers = 1) const {
    return buffers * BufferBytes() + NormBytes() + GcBytes();
  }
};

// A fold launch: how its jobs read (never kAuto), the dynamic shared memory
// of a block, and Commit's blocks per (value head, tile, layer).
struct FoldLaunchPlan {
  FastFoldSchedule::Staging staging = FastFoldSchedule::Staging::kOff;
  size_t smem = 0;
  int blocks_per_head = 16;
};

// `schedule` made concrete for folds of `shape` with rings of `capacity`
// tokens over `rows` rows (Commit) or blocks (Materialize), on a GPU whose
// blocks take at most `smem_optin` bytes of shared memory (an SM: that plus
// the 1 KiB the runtime reserves a block): kAuto pipelines 2 rows or more
// where the two buffers fit one block (one block a head up to 32 rows, four
// beyond); kOn runs where one buffer fits (two blocks an SM when two fit),
// kPipelined where two do.
// \returns INVALID_ARGUMENT naming the field and its bound for a schedule
//   the launch cannot run.
absl::StatusOr<FoldLaunchPlan> PlanFastFold(const KdaShape& shape, int capacity, int rows,
                                            const FastFoldSchedule& schedule, int smem_optin);

}  // namespace fast
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_FAST_FOLD_PLAN_H_
