// FAST's Verify on CUDA (fast_cuda.h, FastVerifyCuda): the kernel family
// and its launcher.
// The FAST kernels on CUDA (fast_cuda.h): the math of
// kernels/fast/fast_math.h (docs/semantics.md, "Fast mode (FAST)"), fp32 on
// CUDA cores except Verify's checkpoint products, which run on tensor cores
// when asked to (3xTF32, what the kernel interface serves, or tf32).
//
// Verify: one thread block per (row, value head), 256 threads (8 warps):
//  1. the window: every input of a token loaded at once, q, k normalized (a
//     warp per token), gammas, v, beta; the window's pair coefficients a, b
//     (a warp per pair, exponents summed from token s + 1 on, as
//     WindowExponents);
//  2. the ring, in chunks from the newest token back: raw k normalized (a
//     warp's tokens loaded together), decayed by H_i (a thread per column,
//     summing gammas from the near end, as RingExponents, kLoadBatch tokens'
//     loads at a time), and its coefficients kw_t . kr_i, qw_t . kr_i (a
//     warp per pair);
//  3. kc_t, qc_t; the checkpoint's S0[v] . kc_t, S0[v] . qc_t (the
//     checkpoint read once): on tensor cores MmaCheckpointPass (mma.sync
//     m16n8k8, a warp per 16-row tile); on CUDA cores, at most one block per
//     SM (N = 1) CheckpointPass (kc, qc in registers, rows batched, the
//     slice prefetched into L2 at the start), otherwise K >= 128
//     RowOwnerCheckpointPass, K = 64 a warp per state row; then the ring's
//     values sum_i A_r[t][i] u_i[v] (a thread per state row, oldest first);
//  4. the forward substitution (SolveWindowRow, its arrays in registers)
//     per state row: outputs and the candidates' u.
// Schedules (FastVerifySchedule, chosen by the launcher): at a grid of at
// most one (row, value head) an SM the kernel is staged (the ring and its
// checkpoint rows copied to shared memory up front) and a head's rows split
// over up to eight blocks; up to four an SM it may start early (every phase
// while its check kernel runs, the writes after); larger grids run the one
// kernel that waits for its checks first, at K = 128 with its checkpoint
// pass piped (its tiles copied to shared memory ahead of it) where the
// schedule says (FastVerifySchedule::Piping, by default kAuto: bf16 state
// rows where four blocks an SM still fit). All write the same bits.
#ifndef SPECSTATE_KERNELS_FAST_CUDA_VERIFY_CUH_
#define SPECSTATE_KERNELS_FAST_CUDA_VERIFY_CUH_

#include "absl/status/statusor.h"
#include "kernels/common/cuda/cp_async.cuh"
#include "kernels/common/cuda/launch.cuh"
#include "kernels/fast/cuda/checkpoint_pass.cuh"
#include "kernels/fast/cuda/device_math.cuh"
#include "kernels/fast/cuda/fast_cuda.h"

namespace specstate {
namespace kernels {
namespace fast {
namespace {

// ---------------------------------------------------------------------------
// Verify.

// How Verify forms the checkpoint's products S0 . kc_t, S0 . qc_t.
enum class CheckpointPassKind {
  kRowBatch,   // CUDA cores, CheckpointPass (at most one block per SM)
  kRowOwner,   // CUDA cores, RowOwnerCheckpointPass (K >= 128; K = 64 a warp a row)
  kMmaTf32,    // tensor cores, tf32 operands (FastNumerics::Operands::kTf32)
  kMmaTf32x3,  // tensor cores, 3xTF32 (FastNumerics::Operands::kTf32Split)
};

// small_grid (at most one block per SM: N = 1): the checkpoint slice
// prefetched into L2 at the block's start; on CUDA cores, kRowBatch
// (CheckpointPass: kc, qc in registers) there, kRowOwner otherwise.
// Measured on an H200, Kimi-Linear verify F=4 cold L2
// (docs/results/fast_cuda_h200.md): N = 1 34.3 us first version, 29.8 us
// CheckpointPass, 25.8 us CheckpointPass + prefetch; N = 16 / 64 / 256 51.4 /
// 173.6 / 623.5 us first version against 64.8 / 197.5 / 672.3 us
// CheckpointPass (and 68.1 / 202.0 / 705.5 us with the prefetch). Four blocks
// per SM at K <= 128 (64 registers; three would make N = 16's 512 blocks two
// waves: 76.6 us).
//
// kStaged (FastVerifySchedule): the ring tokens the block reads and its
// rows of the checkpoint are copied to shared memory (cp.async) as soon as
// the block knows its row, in flight while the window's phase runs, and
// every later phase reads them there; and a (row, value head)'s state rows
// may be split over gridDim.z blocks (blockIdx.z takes rows K / gridDim.z
// * z onward). Every block of a split recomputes the window's and ring's
// coefficients, which do not depend on the rows; block z = 0 writes the
// candidates' k and gammas and the cursor. Each state row's arithmetic is
// the same under every schedule, so are its bits. spread_ring_values
// (RingValues::kSpread, staged only): the ring's values summed by every
// thread, one a (side, window token, state row), not by each row's owner.
// window_before_cursor (WindowLoads::kBeforeCursor, staged only): each
// warp's window token loaded before the row's cursor, in the same memory
// round trip.
//
// kEarly: may start before its checks end (rows_before_checks, below); the
// staged kernel always may. An instantiation of its own unstaged, served at
// mid-sized grids only: at large ones the same code in the one kernel cost
// 3-5% (docs/results/fast_verify_late_writes_h100_20261206.md).
//
// kPipe (the kernel of large grids, K = 128, tensor cores): the checkpoint
// pass reads each warp's tile from shared memory, copied ahead (PipedSmem)
// by its lanes (kLanes) or the TMA (kBulk): its first column group at the
// block's start, the next once the ring's phase frees its buffer, the rest
// as the pass frees theirs (PipedMmaCheckpointPass).
//
// kWindow: the most tokens a window of this launch may have (the launch's
// spec_query_len <= kWindow <= kMaxWindow), what the per-row arrays of the
// ring's values and the solve are sized and unrolled to. Each row's sums are
// the same MulAdds in the same order whatever the bound.
template <typename Act, typename State, int K, CheckpointPassKind kPass, bool kStaged,
          bool kEarly, PipeCopy kPipe = PipeCopy::kNone, int kWindow = kMaxWindow>
__global__ void __launch_bounds__(kThreads, kStaged ? (K <= 128 ? 2 : 1) : (K <= 128 ? 4 : 1))
    FastVerifyKernel(FastVerifyArgs a, bool small_grid,
                     FastVerifySchedule::CheckpointPrefetch checkpoint_prefetch,
                     bool spread_ring_values, bool window_before_cursor) {
  constexpr bool kMma =
      kPass == CheckpointPassKind::kMmaTf32 || kPass == CheckpointPassKind::kMmaTf32x3;
  constexpr bool kPiped = kPipe != PipeCopy::kNone;
  static_assert(kMma || !kStaged, "the staged schedule runs the tensor-core checkpoint pass");
  static_assert(kEarly || !kStaged, "the staged kernel may start early");
  static_assert(!kPiped || (kMma && !kStaged && !kEarly && K == PipedSmem::kHeadDim),
                "the piped pass: the kernel of large grids, tensor cores, head dim 128");
  static_assert(kWindow >= 1 && kWindow <= kMaxWindow, "a window bound of 1 .. kMaxWindow");
  extern __shared__ float smem[];
  const int n = blockIdx.x, hv = blockIdx.y;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // This block's state rows v_lo .. v_lo + rows - 1 (every row unless
  // split; constants unstaged, which keeps that kernel's registers).
  const int rows = kStaged ? K / int(gridDim.z) : K;
  const int v_lo = kStaged ? int(blockIdx.z) * rows : 0;
  const bool lead = !kStaged || blockIdx.z == 0;
  // Launched as the check kernel's programmatic dependent (through the
  // kernel interface): resident while the checks run, it waits for them
  // before it reads their gate and snapshot. (A plain launch: no wait.)
  // A kEarly kernel given the service's own row metadata
  // (rows_before_checks) reads and computes first and waits before its
  // first write: the checks' time is spent on every phase but the writes.
  // Every read is bounded by the guards below whatever the checks find.
  const bool early = kEarly && a.rows_before_checks;
  if (!early) {
    WaitForPrerequisiteGrid();
    if (GateFailed(a.gate)) return;
  }
  const KdaShape& s = a.shape;
  const int h = KeyHeadOf(s, hv);
  // The loads that need no other one, issued together before any check:
  // the row's block and tokens and the head's gate. Two memory round trips
  // to the cursor's value where there were three (the block; its tokens
  // and cursor; the gate: Nsight Compute,
  // docs/results/ncu_fast_verify_staged_n1_spread_h100_20261207.md); 1.3-3.5%
  // off the served Verify at N = 1 (docs/results/fast_verify_hoist_ab_h100_20261207.md).
  const int32_t block = a.state_indices[n];
  const int64_t bos = a.query_start_loc[n];
  const int T = a.query_start_loc[n + 1] - bos;
  const kda::GateRule rule = RuleOf(s, a.params, h);
  if (!IsBlock(block) || block >= a.state.num_blocks || block >= a.rings.num_blocks) return;
  const int Q = a.spec_query_len, R = a.rings.capacity;
  if (Q > kWindow || T < 0 || T > Q || bos < 0 || bos + T > a.num_tokens) return;
  // A window token's inputs, lane columns lane + 32 e (phase 1).
  constexpr int kLaneCols = K / 32;
  struct TokenInputs {
    Act k_act[kLaneCols];
    float qv[kLaneCols], gv[kLaneCols], bias[kLaneCols], vv[kLaneCols];
    float g0_raw, beta_raw;
  };
  const bool gdn = s.kind == LayerKind::kGdn;
  // Every input of token t loaded before any is used (one memory round
  // trip, not one per input).
  const auto load_token = [&](int t, TokenInputs& in) {
    const int64_t tok = bos + t;
    const Act* q_raw = static_cast<const Act*>(a.q.data) + tok * a.q.token_stride + int64_t{h} * K;
    const Act* k_raw = static_cast<const Act*>(a.k.data) + tok * a.k.token_stride + int64_t{h} * K;
    const Act* g = static_cast<const Act*>(a.g.data) + tok * a.g.token_stride +
                   (gdn ? int64_t{hv} : int64_t{h} * K);
    const Act* v = static_cast<const Act*>(a.v.data) + tok * a.v.token_stride + int64_t{hv} * K;
#pragma unroll
    for (int e = 0; e < kLaneCols; ++e) {
      const int j = lane + 32 * e;
      in.qv[e] = ToFloat(q_raw[j]);
      in.k_act[e] = k_raw[j];
      in.vv[e] = ToFloat(v[j]);
      in.gv[e] = gdn ? 0.0f : ToFloat(g[j]);
      in.bias[e] = gdn ? 0.0f : a.params.dt_bias[int64_t{h} * K + j];
    }
    in.g0_raw = gdn ? ToFloat(g[0]) : 0.0f;
    in.beta_raw = ToFloat(static_cast<const Act*>(a.beta.data)[tok * a.beta.token_stride + hv]);
  };
  // kBeforeCursor: this warp's token (T <= Q <= kMaxWindow = kWarps: one a
  // warp) in flight with the cursor's load.
  static_assert(kMaxWindow <= kWarps, "a window token a warp");
  const bool preloaded = kStaged && window_before_cursor;
  TokenInputs preload;
  if (preloaded && warp < T) load_token(warp, preload);
  FastCursor* cursor = a.rings.cursors + block;
  const int c = cursor->tokens;
  if (c < 0 || c + T > R) return;
  if (T == 0) {
    if (early) {
      WaitForPrerequisiteGrid();
      if (GateFailed(a.gate)) return;
    }
    if (hv == 0 && lead && tid == 0) cursor->candidates = 0;
    return;
  }
  const int HV = ValueHeads(s), H = s.num_heads;
  const bool first_of_group = hv % (HV / H) == 0;

  const VerifySmem layout{K, Q, R, kEarly};
  const StagedSmem staged{K, R, rows, int(sizeof(Act)), int(sizeof(State)), gdn};
  Act* ring_k = static_cast<Act*>(a.rings.k);
  const int64_t kw_width = RingKWidth(s), g_width = RingLogDecayWidth(s);
  const int64_t u_width = RingUWidth(s);
  // The staged copies (StagedSmem), after the floats rounded to 16 bytes.
  // (The piped pass's buffers, PipedSmem, start there too.)
  char* staged_base = reinterpret_cast<char*>(smem) + layout.Bytes();
  Act* ring_k_s = reinterpret_cast<Act*>(staged_base);
  float* ring_g_s = reinterpret_cast<float*>(staged_base + staged.RingKBytes());
  float* ring_u_s = reinterpret_cast<float*>(staged_base + staged.RingKBytes() + staged.RingGBytes());
  State* slice_s = reinterpret_cast<State*>(staged_base + staged.RingKBytes() +
                                            staged.RingGBytes() + staged.RingUBytes());
  // The checkpoint's slice of this (row, value head); formed where it is
  // used (a register held through every phase would spill unstaged).
  const auto checkpoint_slice = [&] {
    return static_cast<const State*>(a.state.data) + int64_t{block} * a.state.block_stride +
           int64_t{hv} * K * K;
  };
  // The checkpoint slice into L2, a line a thread a step.
  const auto prefetch_checkpoint = [&] {
    const char* slice = reinterpret_cast<const char*>(checkpoint_slice());
    constexpr int kSliceBytes = K * K * int(sizeof(State));
    for (int off = tid * 128; off < kSliceBytes; off += kThreads * 128) PrefetchL2(slice + off);
  };
  using Prefetch = FastVerifySchedule::CheckpointPrefetch;
  if constexpr (kStaged) {
    // Group 1: the ring tokens 0 .. c - 1 (raw k of key head h, gammas,
    // this block's rows of u); group 2: its rows of the checkpoint. Slots
    // c and later, which this kernel writes, are not read.
    constexpr int kKChunks = K * int(sizeof(Act)) / 16;
    for (int x = tid; x < c * kKChunks; x += kThreads) {
      const int i = x / kKChunks, e = x % kKChunks;
      CpAsync16(ring_k_s + i * K + e * (16 / int(sizeof(Act))),
                ring_k + RingAt(a.rings, block, i, kw_width) + int64_t{h} * K + e * (16 / int(sizeof(Act))));
    }
    if (gdn) {
      for (int i = tid; i < c; i += kThreads) {
        CpAsync4(ring_g_s + i, a.rings.log_decay + RingAt(a.rings, block, i, g_width) + hv);
      }
    } else {
      for (int x = tid; x < c * (K / 4); x += kThreads) {
        const int i = x / (K / 4), e = x % (K / 4);
        CpAsync16(ring_g_s + i * K + 4 * e,
                  a.rings.log_decay + RingAt(a.rings, block, i, g_width) + int64_t{h} * K + 4 * e);
      }
    }
    for (int x = tid; x < c * (rows / 4); x += kThreads) {
      const int i = x / (rows / 4), e = x % (rows / 4);
      CpAsync16(ring_u_s + i * rows + 4 * e,
                a.rings.u + RingAt(a.rings, block, i, u_width) + int64_t{hv} * K + v_lo + 4 * e);
    }
    CpAsyncCommit();
    constexpr int kRowChunks = K * int(sizeof(State)) / 16, kPerChunk = 16 / int(sizeof(State));
    const State* s0 = checkpoint_slice();
    for (int x = tid; x < rows * kRowChunks; x += kThreads) {
      const int r = x / kRowChunks, e = x % kRowChunks;
      CpAsync16(slice_s + r * StagedSmem::RowStride(K, int(sizeof(State))) + e * kPerChunk,
                s0 + int64_t{v_lo + r} * K + e * kPerChunk);
    }
    CpAsyncCommit();
  } else if constexpr (kPiped) {
    PipedCopyFirst<State, kPipe>(staged_base, checkpoint_slice(), warp, lane);
  } else if (small_grid) {
    // small_grid: the checkpoint slice this block reads in its last phase,
    // into L2 now, while the window and ring phases run (a line per thread
    // per step). At larger grids it cost more than it hid (N = 256: DRAM 28%
    // of peak against 23%, prefetched lines evicted before use).
    prefetch_checkpoint();
  }

  float* qn = smem;
  float* kn = qn + layout.Window();
  float* gam = kn + layout.Window();
  float* vw = gam + layout.Window();
  float* kx = vw + layout.Window();
  float* qx = kx + layout.Window();
  float* kr = qx + layout.Window();
  float* ar = kr + kRingChunk * K;
  float* br = ar + Q * R;
  float* aw = br + Q * R;
  float* bw = aw + kMaxWindow * kMaxWindow;
  float* beta = bw + kMaxWindow * kMaxWindow;
  float* gc = beta + kMaxWindow;
  float* kept_gammas = gc + K;  // kEarly: the candidates' gammas until the checks end

  // 1. The window (a warp per token), and its candidates' k and gamma.
  for (int t = warp; t < T; t += kWarps) {
    TokenInputs in;
    if (preloaded) {
      in = preload;  // t == warp
    } else {
      load_token(t, in);
    }
    const Act* k_act = in.k_act;
    const float* qv = in.qv;
    const float* vv = in.vv;
    const float* bias = in.bias;
    float* gv = in.gv;
    float kv[kLaneCols];
#pragma unroll
    for (int e = 0; e < kLaneCols; ++e) kv[e] = ToFloat(k_act[e]);
    const float g0_raw = in.g0_raw, beta_raw = in.beta_raw;
    // q, k normalized as WarpNormalize (squares summed in column order a lane).
    float sq = 0.0f, sk = 0.0f;
#pragma unroll
    for (int e = 0; e < kLaneCols; ++e) {
      sq = kda::MulAdd(qv[e], qv[e], sq);
      sk = kda::MulAdd(kv[e], kv[e], sk);
    }
    const float q_norm = kda::L2Norm(WarpSum(sq)), k_norm = kda::L2Norm(WarpSum(sk));
    const float g0 = gdn ? rule.LogDecay(g0_raw, 0.0f) : 0.0f;
#pragma unroll
    for (int e = 0; e < kLaneCols; ++e) {
      const int j = lane + 32 * e;
      qn[t * K + j] = kda::Normalize(qv[e], q_norm, kda::QueryScale(K));
      kn[t * K + j] = kda::Normalize(kv[e], k_norm, 1.0f);
      gv[e] = gdn ? g0 : rule.LogDecay(gv[e], bias[e]);
      gam[t * K + j] = gv[e];
      if (early) kept_gammas[t * K + j] = gv[e];
      vw[t * K + j] = vv[e];
    }
    if (lane == 0) beta[t] = rule.Beta(beta_raw);
    // Candidates: raw k and (KDA) gammas once per key head; GDN's gamma per value head.
    if (first_of_group && lead && !early) {
      Act* dst = ring_k + RingAt(a.rings, block, c + t, kw_width) + int64_t{h} * K;
#pragma unroll
      for (int e = 0; e < kLaneCols; ++e) dst[lane + 32 * e] = k_act[e];
      if (!gdn) {
        float* gd = a.rings.log_decay + RingAt(a.rings, block, c + t, g_width) + int64_t{h} * K;
#pragma unroll
        for (int e = 0; e < kLaneCols; ++e) gd[lane + 32 * e] = gv[e];
      }
    }
    if (gdn && lead && !early && lane == 0) {
      a.rings.log_decay[RingAt(a.rings, block, c + t, g_width) + hv] = g0;
    }
  }
  __syncthreads();
  if (!kStaged && !kPiped && checkpoint_prefetch == Prefetch::kAfterWindow) prefetch_checkpoint();

  // The window's pairs (t, s), s <= t: a warp per pair.
  const int pairs = T * (T + 1) / 2;
  for (int p = warp; p < pairs; p += kWarps) {
    int t = 0;
    while ((t + 1) * (t + 2) / 2 <= p) ++t;
    const int x = p - t * (t + 1) / 2;  // s
    float sa = 0.0f, sb = 0.0f;
    for (int j = lane; j < K; j += 32) {
      float e = 0.0f;
      for (int r = x + 1; r <= t; ++r) e += gam[r * K + j];
      const float ks = kn[x * K + j] * (x < t ? expf(e) : 1.0f);
      sa = kda::MulAdd(kn[t * K + j], ks, sa);
      sb = kda::MulAdd(qn[t * K + j], ks, sb);
    }
    sa = WarpSum(sa);
    sb = WarpSum(sb);
    if (lane == 0) {
      if (x < t) aw[t * kMaxWindow + x] = sa;
      bw[t * kMaxWindow + x] = sb;
    }
  }
  __syncthreads();

  // W_t per column (in place of the gammas), kw_t and qw_t.
  for (int j = tid; j < K; j += kThreads) {
    float acc = 0.0f;
    for (int t = 0; t < T; ++t) {
      acc += gam[t * K + j];
      gam[t * K + j] = acc;
      kx[t * K + j] = ::specstate::fast::Decayed(kn[t * K + j], acc);
      qx[t * K + j] = ::specstate::fast::Decayed(qn[t * K + j], acc);
    }
  }

  // 2. The ring, newest chunk first: kr_i, then A_r, B_r.
  float col_acc[K / kThreads > 0 ? K / kThreads : 1];
  for (int x = 0; x < (K + kThreads - 1) / kThreads; ++x) col_acc[x] = 0.0f;
  if constexpr (kStaged) CpAsyncWait<1>();  // the ring's copies (the loop's barrier shares them)
  for (int i1 = c; i1 > 0; i1 -= kRingChunk) {
    const int i0 = max(0, i1 - kRingChunk);
    __syncthreads();  // kr free; kx, qx ready
    {
      // A warp's tokens (i0 + warp + 8 m) loaded together, then normalized
      // as WarpNormalize.
      constexpr int kPerWarp = kRingChunk / kWarps;
      float x[kPerWarp][kLaneCols];
#pragma unroll
      for (int m = 0; m < kPerWarp; ++m) {
        const int i = i0 + warp + m * kWarps;
        const Act* raw = kStaged ? ring_k_s + min(i, i1 - 1) * K
                                 : ring_k + RingAt(a.rings, block, min(i, i1 - 1), kw_width) +
                                       int64_t{h} * K;
#pragma unroll
        for (int e = 0; e < kLaneCols; ++e) x[m][e] = i < i1 ? ToFloat(raw[lane + 32 * e]) : 0.0f;
      }
#pragma unroll
      for (int m = 0; m < kPerWarp; ++m) {
        const int i = i0 + warp + m * kWarps;
        if (i >= i1) break;
        float sum = 0.0f;
#pragma unroll
        for (int e = 0; e < kLaneCols; ++e) sum = kda::MulAdd(x[m][e], x[m][e], sum);
        const float norm = kda::L2Norm(WarpSum(sum));
#pragma unroll
        for (int e = 0; e < kLaneCols; ++e) {
          kr[(i - i0) * K + lane + 32 * e] = kda::Normalize(x[m][e], norm, 1.0f);
        }
      }
    }
    __syncthreads();
    for (int j = tid, x = 0; j < K; j += kThreads, ++x) {
      float acc = col_acc[x];
      // kLoadBatch tokens' log-decays loaded together (a round trip a
      // batch, not a token), then summed in the same order.
      for (int i = i1 - 1; i >= i0; i -= kLoadBatch) {
        float gi[kLoadBatch];
        if constexpr (kStaged) {
#pragma unroll
          for (int e = 0; e < kLoadBatch; ++e) {
            gi[e] = i - e >= i0 ? ring_g_s[gdn ? i - e : (i - e) * K + j] : 0.0f;
          }
        } else {
          LoadLogDecays(a.rings, block, i, i0, gdn, g_width,
                        gdn ? int64_t{hv} : int64_t{h} * K + j, gi);
        }
#pragma unroll
        for (int e = 0; e < kLoadBatch; ++e) {
          if (i - e < i0) break;
          float& kv = kr[(i - e - i0) * K + j];
          kv = ::specstate::fast::Decayed(kv, acc);
          acc += gi[e];
        }
      }
      col_acc[x] = acc;
    }
    __syncthreads();
    const int count = (i1 - i0) * T;
    for (int p = warp; p < count; p += kWarps) {
      const int t = p / (i1 - i0), i = i0 + p % (i1 - i0);
      float sa = 0.0f, sb = 0.0f;
      for (int j = lane; j < K; j += 32) {
        const float kv = kr[(i - i0) * K + j];
        sa = kda::MulAdd(kx[t * K + j], kv, sa);
        sb = kda::MulAdd(qx[t * K + j], kv, sb);
      }
      sa = WarpSum(sa);
      sb = WarpSum(sb);
      if (lane == 0) {
        ar[t * R + i] = sa;
        br[t * R + i] = sb;
      }
    }
  }
  for (int j = tid, x = 0; j < K; j += kThreads, ++x) gc[j] = col_acc[x];
  __syncthreads();
  if (!kStaged && !kPiped && checkpoint_prefetch == Prefetch::kAfterRing) prefetch_checkpoint();
  // kr is free: the piped pass's next column groups, in flight through kc, qc.
  if constexpr (kPiped) {
    PipedCopySecond<State, kPipe>(staged_base, reinterpret_cast<char*>(kr), checkpoint_slice(),
                                  warp, lane);
  }

  // 3. kc_t, qc_t (in place of kw, qw).
  for (int j = tid; j < K; j += kThreads) {
    for (int t = 0; t < T; ++t) {
      const float e = gc[j] + gam[t * K + j];
      kx[t * K + j] = ::specstate::fast::Decayed(kn[t * K + j], e);
      qx[t * K + j] = ::specstate::fast::Decayed(qn[t * K + j], e);
    }
  }
  if constexpr (kStaged) CpAsyncWait<0>();  // the checkpoint's rows
  __syncthreads();  // kc, qc ready; qn, kn free (staged: the rows too)

  // The checkpoint: S0[v] . kc_t into kn[t][v], S0[v] . qc_t into qn[t][v]
  // (CheckpointPass: kc, qc in registers, several rows in flight per warp).
  const State* s0 = checkpoint_slice();
  if constexpr (kMma) {
    constexpr bool kSplit = kPass == CheckpointPassKind::kMmaTf32x3;
    if constexpr (kPiped) {
      PipedMmaCheckpointPass<State, kSplit, kPipe>(staged_base, reinterpret_cast<char*>(kr),
                                                   checkpoint_slice(), T, kx, qx, kn, qn, lane,
                                                   warp);
    } else if constexpr (kStaged) {
      constexpr int kStride = StagedSmem::RowStride(K, int(sizeof(State)));
      MmaCheckpointPass<State, K, kSplit, true, kStride>(slice_s, v_lo, rows, T, kx, qx, kn, qn,
                                                         lane, warp);
    } else {
      MmaCheckpointPass<State, K, kSplit, false, K>(s0, 0, K, T, kx, qx, kn, qn, lane, warp);
    }
  } else if constexpr (kPass == CheckpointPassKind::kRowBatch) {
    if (T <= 2) {
      CheckpointPass<State, K, 2>(s0, 0, T, kx, qx, kn, qn, lane, warp);
    } else {
      // kc, qc for four tokens at a time in registers (a second pass over
      // the slice, from L2, for windows of more than four).
      for (int t0 = 0; t0 < T; t0 += 4) {
        CheckpointPass<State, K, 4>(s0, t0, T, kx, qx, kn, qn, lane, warp);
      }
    }
  } else if constexpr (K >= 128) {
    RowOwnerCheckpointPass<State, K>(s0, T, kx, qx, kn, qn, kr, tid);
  } else {
    // The first version's pass: a warp per state row, kc_t, qc_t re-read
    // from shared memory for each row (16-byte loads), 2T WarpSums per row.
    // A lane's columns of a row: 4 * (lane + 32 x) .. + 3 (K >= 128), or
    // 2 lane, 2 lane + 1 (K = 64).
    constexpr int kQuads = K >= 128 ? K / 128 : 1;
    for (int v = warp; v < K; v += kWarps) {
      float4 row[kQuads];
      if constexpr (K >= 128) {
#pragma unroll
        for (int x = 0; x < kQuads; ++x) row[x] = Load4(s0 + int64_t{v} * K + 4 * (lane + 32 * x));
      } else {
        row[0] = make_float4(ToFloat(s0[int64_t{v} * K + 2 * lane]),
                             ToFloat(s0[int64_t{v} * K + 2 * lane + 1]), 0.0f, 0.0f);
      }
      float sk[kMaxWindow], sq[kMaxWindow];
#pragma unroll
      for (int t = 0; t < kMaxWindow; ++t) {
        sk[t] = sq[t] = 0.0f;
        if (t < T) {
          if constexpr (K >= 128) {
#pragma unroll
            for (int x = 0; x < kQuads; ++x) {
              const int j = 4 * (lane + 32 * x);
              const float4 kc = *reinterpret_cast<const float4*>(kx + t * K + j);
              const float4 qc = *reinterpret_cast<const float4*>(qx + t * K + j);
              sk[t] = kda::MulAdd(row[x].x, kc.x, sk[t]);
              sk[t] = kda::MulAdd(row[x].y, kc.y, sk[t]);
              sk[t] = kda::MulAdd(row[x].z, kc.z, sk[t]);
              sk[t] = kda::MulAdd(row[x].w, kc.w, sk[t]);
              sq[t] = kda::MulAdd(row[x].x, qc.x, sq[t]);
              sq[t] = kda::MulAdd(row[x].y, qc.y, sq[t]);
              sq[t] = kda::MulAdd(row[x].z, qc.z, sq[t]);
              sq[t] = kda::MulAdd(row[x].w, qc.w, sq[t]);
            }
          } else {
            const int j = 2 * lane;
            sk[t] = kda::MulAdd(row[0].y, kx[t * K + j + 1], kda::MulAdd(row[0].x, kx[t * K + j], 0.0f));
            sq[t] = kda::MulAdd(row[0].y, qx[t * K + j + 1], kda::MulAdd(row[0].x, qx[t * K + j], 0.0f));
          }
        }
      }
#pragma unroll
      for (int t = 0; t < kMaxWindow; ++t) {
        if (t < T) {
          sk[t] = WarpSum(sk[t]);
          sq[t] = WarpSum(sq[t]);
        }
      }
      if (lane == 0) {
#pragma unroll
        for (int t = 0; t < kMaxWindow; ++t) {
          if (t < T) {
            kn[t * K + v] = sk[t];
            qn[t * K + v] = sq[t];
          }
        }
      }
    }
  }
  __syncthreads();

  // The ring's values: a thread per state row, oldest token first (after
  // the checkpoint pass, so that rk, rq hold no registers during it).
  float rk[kWindow], rq[kWindow];
  const int v_own = v_lo + tid;
  const bool owns_row = tid < rows;
  if (kStaged && spread_ring_values) {
    // RingValues::kSpread: a thread a (side, window token, state row), its
    // sum oldest first as the row's owner would (the same MulAdds in the
    // same order), into kr (free since the checkpoint pass): [2][T][rows].
    for (int x = tid; x < 2 * T * rows; x += kThreads) {
      const int r = x % rows, t = (x / rows) % T;
      const float* coefficient = (x < T * rows ? ar : br) + t * R;
      float sum = 0.0f;
#pragma unroll 4
      for (int i = 0; i < c; ++i) sum = kda::MulAdd(coefficient[i], ring_u_s[i * rows + r], sum);
      kr[x] = sum;
    }
    __syncthreads();
    if (owns_row) {
#pragma unroll
      for (int t = 0; t < kWindow; ++t) {
        rk[t] = t < T ? kr[t * rows + tid] : 0.0f;
        rq[t] = t < T ? kr[(T + t) * rows + tid] : 0.0f;
      }
    }
  } else if (owns_row) {
#pragma unroll
    for (int t = 0; t < kWindow; ++t) rk[t] = rq[t] = 0.0f;
    for (int i0 = 0; i0 < c; i0 += kLoadBatch) {
      float ui[kLoadBatch];  // loaded together, summed oldest first
#pragma unroll
      for (int e = 0; e < kLoadBatch; ++e) {
        if (i0 + e >= c) {
          ui[e] = 0.0f;
        } else if constexpr (kStaged) {
          ui[e] = ring_u_s[(i0 + e) * rows + tid];
        } else {
          ui[e] = a.rings.u[RingAt(a.rings, block, i0 + e, u_width) + int64_t{hv} * K + v_own];
        }
      }
#pragma unroll
      for (int e = 0; e < kLoadBatch; ++e) {
        if (i0 + e >= c) break;
#pragma unroll
        for (int t = 0; t < kWindow; ++t) {
          if (t < T) {
            rk[t] = kda::MulAdd(ar[t * R + i0 + e], ui[e], rk[t]);
            rq[t] = kda::MulAdd(br[t * R + i0 + e], ui[e], rq[t]);
          }
        }
      }
    }
  }
  if (early) {
    // Every phase but the writes is done: the checks' end, then the
    // candidates' k (raw, read again: L2) and gammas (kept) as phase 1
    // writes them otherwise.
    WaitForPrerequisiteGrid();
    if (GateFailed(a.gate)) {  // every thread alike
      CpAsyncWait<0>();        // no copy may land after the block ends
      return;
    }
    for (int t = warp; t < T && lead; t += kWarps) {
      const int64_t tok = bos + t;
      if (first_of_group) {
        const Act* k_raw =
            static_cast<const Act*>(a.k.data) + tok * a.k.token_stride + int64_t{h} * K;
        Act* dst = ring_k + RingAt(a.rings, block, c + t, kw_width) + int64_t{h} * K;
        for (int j = lane; j < K; j += 32) dst[j] = k_raw[j];
        if (!gdn) {
          float* gd = a.rings.log_decay + RingAt(a.rings, block, c + t, g_width) + int64_t{h} * K;
          for (int j = lane; j < K; j += 32) gd[j] = kept_gammas[t * K + j];
        }
      }
      if (gdn && lane == 0) {
        a.rings.log_decay[RingAt(a.rings, block, c + t, g_width) + hv] = kept_gammas[t * K];
      }
    }
  }
  // 4. The forward substitution per state row: outputs and u.
  if (owns_row) {
    // Loops unrolled to kWindow (T a predicate): the arrays stay in registers.
    float sk[kWindow], sq[kWindow], vr[kWindow], u[kWindow], o[kWindow];
#pragma unroll
    for (int t = 0; t < kWindow; ++t) {
      sk[t] = t < T ? kn[t * K + v_own] : 0.0f;
      sq[t] = t < T ? qn[t * K + v_own] : 0.0f;
      vr[t] = t < T ? vw[t * K + v_own] : 0.0f;
    }
    SolveWindowRow<kWindow>(T, sk, sq, rk, rq, aw, bw, vr, beta, u, o);
    Act* out = static_cast<Act*>(a.out);
#pragma unroll
    for (int t = 0; t < kWindow; ++t) {
      if (t < T) {
        out[((bos + t) * HV + hv) * K + v_own] = FromFloat<Act>(o[t]);
        a.rings.u[RingAt(a.rings, block, c + t, u_width) + int64_t{hv} * K + v_own] = u[t];
      }
    }
  }
  if (hv == 0 && lead && tid == 0) cursor->candidates = T;
}

absl::Status LaunchFastVerify(const FastVerifyArgs& a, cudaStream_t stream,
                              FastNumerics::Operands checkpoint,
                              const FastVerifySchedule& schedule) {
  constexpr const char* op = "FastVerify";
  using O = FastNumerics::Operands;
  if (checkpoint != O::kFp32 && checkpoint != O::kTf32 && checkpoint != O::kTf32Split) {
    return NumericsUnimplemented(op);
  }
  if (schedule.window_bound == FastVerifySchedule::WindowBound::kShort &&
      checkpoint != O::kTf32Split) {
    return absl::InvalidArgumentError(absl::StrCat(
        "In ", op, ": schedule.window_bound kShort needs 3xTF32 operands "
        "(FastNumerics::checkpoint kTf32Split)"));
  }
  if (a.num_rows == 0) return absl::OkStatus();
  int sms = 0, smem_optin = 0;
  cudaError_t err = CurrentDeviceLimits(&sms, &smem_optin);
  if (err != cudaSuccess) return CudaStatus(err, absl::StrCat("In ", op, ": CUDA device query"));
  const int64_t blocks = int64_t{a.num_rows} * ValueHeads(a.shape);
  const absl::StatusOr<VerifyLaunchPlan> plan =
      PlanFastVerify(a, schedule, /*tensor_cores=*/checkpoint != O::kFp32, blocks, sms, smem_optin);
  if (!plan.ok()) return plan.status();
  const bool small_grid = blocks <= sms;
  DispatchKda(a.shape, [&](auto act, auto state, auto head_dim) {
    using Act = typename decltype(act)::type;
    using State = typename decltype(state)::type;
    constexpr int K = decltype(head_dim)::value;
    using P = CheckpointPassKind;
    // Staged (always early), unstaged early, or the one kernel of large
    // grids, at K = 128 piped or not; its window bound kW (FastVerifyKernel's
    // kWindow).
    const auto mma_kernel = [&](auto pass, auto window) {
      constexpr P kPass = decltype(pass)::value;
      constexpr int kW = decltype(window)::value;
      constexpr bool kCanPipe = K == PipedSmem::kHeadDim;
      constexpr PipeCopy kNone = PipeCopy::kNone;
      constexpr PipeCopy kLanes = kCanPipe ? PipeCopy::kLanes : kNone;
      constexpr PipeCopy kBulk = kCanPipe ? PipeCopy::kBulk : kNone;
      const bool piped = kCanPipe && plan->piped;
      return plan->staged  ? FastVerifyKernel<Act, State, K, kPass, true, true, kNone, kW>
             : plan->early ? FastVerifyKernel<Act, State, K, kPass, false, true, kNone, kW>
             : piped && plan->bulk_copies
                 ? FastVerifyKernel<Act, State, K, kPass, false, false, kBulk, kW>
             : piped ? FastVerifyKernel<Act, State, K, kPass, false, false, kLanes, kW>
                     : FastVerifyKernel<Act, State, K, kPass, false, false, kNone, kW>;
    };
    // 3xTF32 (what the kernel interface serves) has kernels of its own for
    // windows of at most kShortWindow tokens (plan->short_window,
    // WindowBound::kShort): half the solve's and the ring values' unrolled
    // code and registers.
    using FullWindow = std::integral_constant<int, kMaxWindow>;
    using ShortWindow = std::integral_constant<int, kShortWindow>;
    const auto split = std::integral_constant<P, P::kMmaTf32x3>{};
    auto kernel = checkpoint == O::kTf32Split
                      ? (plan->short_window ? mma_kernel(split, ShortWindow{})
                                            : mma_kernel(split, FullWindow{}))
                  : checkpoint == O::kTf32
                      ? mma_kernel(std::integral_constant<P, P::kMmaTf32>{}, FullWindow{})
                  : small_grid ? FastVerifyKernel<Act, State, K, P::kRowBatch, false, false>
                               : FastVerifyKernel<Act, State, K, P::kRowOwner, false, false>;
    if (plan->smem > 48 * 1024) {
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 int(plan->smem));
      if (err != cudaSuccess) return;
    }
    const dim3 grid(a.num_rows, ValueHeads(a.shape), plan->splits);
    err = LaunchDependent(kernel, grid, kThreads, plan->smem, stream, a, small_grid,
                          plan->checkpoint_prefetch, plan->spread_ring_values,
                          plan->window_before_cursor);
    if (err == cudaSuccess) err = cudaGetLastError();
  });
  if (err != cudaSuccess) return CudaStatus(err, absl::StrCat("In ", op, ": CUDA kernel launch"));
  return absl::OkStatus();
}

}  // namespace
}  // namespace fast
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_FAST_CUDA_VERIFY_CUH_
