// Verify's checkpoint pass in its four forms (verify.cuh picks one,
// CheckpointPassKind): S0[v] . kc_t and S0[v] . qc_t for the window's tokens
// t and the state rows v, on CUDA cores (CheckpointPass,
// RowOwnerCheckpointPass) or on tensor cores (MmaCheckpointPass: tf32 or
// 3xTF32, from global or shared memory, any contiguous run of rows).
#ifndef SPECSTATE_KERNELS_FAST_CUDA_CHECKPOINT_PASS_CUH_
#define SPECSTATE_KERNELS_FAST_CUDA_CHECKPOINT_PASS_CUH_

#include "kernels/common/cuda/bulk_copy.cuh"
#include "kernels/common/cuda/cp_async.cuh"
#include "kernels/fast/cuda/device_math.cuh"

namespace specstate {
namespace kernels {
namespace fast {
namespace {

// Verify's checkpoint pass for window tokens t0 .. t0 + kW - 1 (those < T):
// S0[v] . kc_t into kn[t][v], S0[v] . qc_t into qn[t][v], every state row v.
// Each warp owns K / 8 consecutive rows; a lane holds K / 32 consecutive
// columns of kc_t and qc_t for those t in registers (read from shared memory
// once, not once per row), loads kRows rows at a time (their loads in flight
// together; the slice was prefetched into L2 at the kernel's start) and
// reduces the batch's 2 kW kRows = 16 partial sums together
// (TransposeWarpSum). Products summed in column order per lane, as before.
template <typename State, int K, int kW>
__device__ __forceinline__ void CheckpointPass(const State* s0, int t0, int T, const float* kc_s,
                                               const float* qc_s, float* kn, float* qn, int lane,
                                               int warp) {
  constexpr int C = K / 32;                 // columns per lane
  constexpr int kSums = 16;
  constexpr int kRows = kSums / (2 * kW);   // rows per batch
  constexpr int kWarpRows = K / kWarps;     // rows per warp
  static_assert(kWarpRows % kRows == 0, "whole batches");
  float kc[kW][C], qc[kW][C];
#pragma unroll
  for (int t = 0; t < kW; ++t) {
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const bool in = t0 + t < T;
      kc[t][c] = in ? kc_s[(t0 + t) * K + lane * C + c] : 0.0f;
      qc[t][c] = in ? qc_s[(t0 + t) * K + lane * C + c] : 0.0f;
    }
  }
  const int v_base = warp * kWarpRows;
#pragma unroll 1
  for (int v0 = v_base; v0 < v_base + kWarpRows; v0 += kRows) {
    float row[kRows][C];
#pragma unroll
    for (int r = 0; r < kRows; ++r) LoadCols<C>(s0 + int64_t{v0 + r} * K + lane * C, row[r]);
    // Sum index (r * 2 + which) * kW + t; which 0: kc, 1: qc.
    float x[kSums];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int t = 0; t < kW; ++t) {
        float sk = 0.0f, sq = 0.0f;
#pragma unroll
        for (int c = 0; c < C; ++c) {
          sk = kda::MulAdd(row[r][c], kc[t][c], sk);
          sq = kda::MulAdd(row[r][c], qc[t][c], sq);
        }
        x[(r * 2) * kW + t] = sk;
        x[(r * 2 + 1) * kW + t] = sq;
      }
    }
    const float sum = TransposeWarpSum<kSums>(x, lane);
    // Lanes 2 i and 2 i + 1 hold sum i.
    const int idx = lane >> 1;
    const int r = idx / (2 * kW), which = (idx / kW) % 2, t = t0 + idx % kW;
    if ((lane & 1) == 0 && t < T) (which ? qn : kn)[t * K + v0 + r] = sum;
  }
}

// Verify's checkpoint pass at larger grids, K >= 128: S0[v] . kc_t into
// kn[t][v], S0[v] . qc_t into qn[t][v]. A thread owns one state row v and
// K / kParts of its columns (kParts = kThreads / K): it reads its row 32
// bytes at a time (a whole sector) and sums in its registers, so no
// shuffles; a warp's 32 threads read the same columns of kc_t, qc_t at each
// step (broadcast shared-memory loads). The parts' sums meet in `scratch`
// (2 T K floats a part after the first) and are added in column order.
// (The warp-per-row pass it replaces spent 4x the shared-memory wavefronts,
// re-reading kc, qc per row, and 2T WarpSums per row.)
template <typename State, int K>
__device__ __forceinline__ void RowOwnerCheckpointPass(const State* s0, int T, const float* kc_s,
                                                       const float* qc_s, float* kn, float* qn,
                                                       float* scratch, int tid) {
  constexpr int kParts = kThreads / K;
  constexpr int kCols = K / kParts;
  static_assert(kParts >= 1 && kCols % 8 == 0, "8 columns a step");
  static_assert((kParts - 1) * 2 * kMaxWindow <= kRingChunk, "the parts' sums fit in kr");
  const int v = tid % K, part = tid / K;
  float sk[kMaxWindow], sq[kMaxWindow];
#pragma unroll
  for (int t = 0; t < kMaxWindow; ++t) sk[t] = sq[t] = 0.0f;
  const State* row = s0 + int64_t{v} * K + part * kCols;
  const float* kc0 = kc_s + part * kCols;
  const float* qc0 = qc_s + part * kCols;
#pragma unroll 2
  for (int c = 0; c < kCols; c += 8) {
    float x[8];
    LoadCols<8>(row + c, x);
#pragma unroll
    for (int t = 0; t < kMaxWindow; ++t) {
      if (t < T) {
        const float4 k0 = *reinterpret_cast<const float4*>(kc0 + t * K + c);
        const float4 k1 = *reinterpret_cast<const float4*>(kc0 + t * K + c + 4);
        const float4 q0 = *reinterpret_cast<const float4*>(qc0 + t * K + c);
        const float4 q1 = *reinterpret_cast<const float4*>(qc0 + t * K + c + 4);
        const float kk[8] = {k0.x, k0.y, k0.z, k0.w, k1.x, k1.y, k1.z, k1.w};
        const float qq[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          sk[t] = kda::MulAdd(x[e], kk[e], sk[t]);
          sq[t] = kda::MulAdd(x[e], qq[e], sq[t]);
        }
      }
    }
  }
  if constexpr (kParts > 1) {
    if (part > 0) {
      float* mine = scratch + (part - 1) * 2 * kMaxWindow * K;
#pragma unroll
      for (int t = 0; t < kMaxWindow; ++t) {
        if (t < T) {
          mine[t * K + v] = sk[t];
          mine[(kMaxWindow + t) * K + v] = sq[t];
        }
      }
    }
    __syncthreads();
    if (part > 0) return;
#pragma unroll
    for (int p = 1; p < kParts; ++p) {
      const float* theirs = scratch + (p - 1) * 2 * kMaxWindow * K;
#pragma unroll
      for (int t = 0; t < kMaxWindow; ++t) {
        if (t < T) {
          sk[t] += theirs[t * K + v];
          sq[t] += theirs[(kMaxWindow + t) * K + v];
        }
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kMaxWindow; ++t) {
    if (t < T) {
      kn[t * K + v] = sk[t];
      qn[t * K + v] = sq[t];
    }
  }
}

// ---------------------------------------------------------------------------
// Tensor cores: the checkpoint's products with mma.sync m16n8k8 (tf32
// operands in 32-bit registers, fp32 accumulation).

// x rounded to tf32 (10-bit mantissa, to nearest, ties away from zero).
__device__ __forceinline__ uint32_t Tf32Bits(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

// d += a b: A 16 x 8 (row), B 8 x 8 (col), per the PTX fragment layout
// (g = lane / 4, t = lane % 4): a = (g, t), (g + 8, t), (g, t + 4),
// (g + 8, t + 4); b = (t, g), (t + 4, g); d = (g, 2t), (g, 2t + 1),
// (g + 8, 2t), (g + 8, 2t + 1).
__device__ __forceinline__ void MmaTf32(float (&d)[4], const uint32_t (&a)[4],
                                        const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Splits x into tf32 hi + lo (lo = tf32(x - hi); x - hi is exact in fp32).
template <int M>
__device__ __forceinline__ void SplitTf32(const float (&x)[M], uint32_t (&hi)[M],
                                          uint32_t (&lo)[M]) {
#pragma unroll
  for (int e = 0; e < M; ++e) {
    hi[e] = Tf32Bits(x[e]);
    lo[e] = Tf32Bits(x[e] - BitsToFloat(hi[e]));
  }
}

// One column group (32 columns) of a 16-row tile into the accumulators:
// a0, a1 hold lane (g, t4)'s columns grp * 32 + 8 t4 .. + 7 of rows g and
// g + 8. Each accumulator takes its column groups in order, whichever pass
// loads them, so every pass writes the same bits.
template <int K, bool kSplit, bool kStateLo>
__device__ __forceinline__ void MmaColumnGroup(float (&acc)[2][4], const float (&a0)[8],
                                               const float (&a1)[8], int grp, int T,
                                               const float* kc_s, const float* qc_s, int lane) {
  const int g = lane >> 2, t4 = lane & 3;
  const int per_kind = T <= 4 ? 4 : 8;  // vectors of each kind, padded
  const int n_tiles = per_kind / 4;
  const int col = grp * 32 + 8 * t4;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    if (nt >= n_tiles) break;
    const int idx = nt * 8 + g, tok = idx % per_kind;
    float b[8];
    if (tok < T) {
      const float* src = (idx < per_kind ? kc_s : qc_s) + tok * K + col;
      const float4 lo4 = *reinterpret_cast<const float4*>(src);
      const float4 hi4 = *reinterpret_cast<const float4*>(src + 4);
      b[0] = lo4.x, b[1] = lo4.y, b[2] = lo4.z, b[3] = lo4.w;
      b[4] = hi4.x, b[5] = hi4.y, b[6] = hi4.z, b[7] = hi4.w;
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) b[e] = 0.0f;
    }
    // Split at use, a k-step at a time (few registers live).
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const float af[4] = {a0[2 * s], a1[2 * s], a0[2 * s + 1], a1[2 * s + 1]};
      const float bf[2] = {b[2 * s], b[2 * s + 1]};
      uint32_t ah[4], al[4], bh[2], bl[2];
      SplitTf32<4>(af, ah, al);
      SplitTf32<2>(bf, bh, bl);
      if constexpr (kSplit) {  // the small products first
        MmaTf32(acc[nt], ah, bl);
        if constexpr (kStateLo) MmaTf32(acc[nt], al, bh);
      }
      MmaTf32(acc[nt], ah, bh);
    }
  }
}

// A tile's accumulators into kn[t][v] (kc) and qn[t][v] (qc), v from
// v_lo + tile * 16.
__device__ __forceinline__ void StoreTileSums(const float (&acc)[2][4], int v_lo, int tile, int T,
                                              float* kn, float* qn, int K, int lane) {
  const int g = lane >> 2, t4 = lane & 3;
  const int per_kind = T <= 4 ? 4 : 8;
  const int n_tiles = per_kind / 4;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    if (nt >= n_tiles) break;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int v = v_lo + tile * 16 + g + (e >= 2 ? 8 : 0);
      const int idx = nt * 8 + 2 * t4 + (e & 1), tok = idx % per_kind;
      if (tok < T) (idx < per_kind ? kn : qn)[tok * K + v] = acc[nt][e];
    }
  }
}

// Verify's checkpoint pass on tensor cores (FastNumerics::Operands kTf32, or
// kTf32Split = 3xTF32 with kSplit): S0[v] . kc_t into kn[t][v], S0[v] . qc_t
// into qn[t][v]. A warp owns 16-row tiles of the slice (K / 16 of them, warp
// w tiles w, w + 8, ...); the B operand's 8 columns are the vectors kc_0 ..
// kc_{P-1}, qc_0 .. qc_{P-1} (P = 4 for T <= 4, else 8 and two n-tiles;
// columns t >= T zero). The dot products run over the columns in a
// permuted order, the same for both operands: in each 32-column group lane
// (g, t) loads 8 consecutive columns 8t .. 8t + 7 of rows g and g + 8 (two
// 16-byte loads a row for fp32), and k-step s takes columns 8t + 2s,
// 8t + 2s + 1 as its k indices t, t + 4. 3xTF32: each k-step's hi*lo and
// lo*hi, then hi*hi, into one fp32 accumulator; a bf16 state is exact in
// tf32, so its lo*hi is skipped.
//
// The pass covers state rows v_lo .. v_lo + rows - 1 (a multiple of 16):
// `slice` points at row v_lo, rows kRowStride elements apart, in global
// memory or (kShared, Verify's staged schedule) in shared memory. Which rows
// and where they are read from change nothing in a row's sums.
template <typename State, int K, bool kSplit, bool kShared, int kRowStride>
__device__ __forceinline__ void MmaCheckpointPass(const State* slice, int v_lo, int rows, int T,
                                                  const float* kc_s,
                                                  const float* qc_s, float* kn, float* qn,
                                                  int lane, int warp) {
  constexpr int kGroups = K / 32;
  constexpr bool kStateLo = kSplit && std::is_same<State, float>::value;
  // Column groups whose loads are in flight together: two, one where
  // 3xTF32 splits an fp32 state (two spilled 104 bytes at 64 registers).
  constexpr int kBatch = kStateLo ? 1 : 2;
  static_assert(kGroups % kBatch == 0, "whole batches of column groups");
  const int g = lane >> 2, t4 = lane & 3;
  for (int tile = warp; tile < rows / 16; tile += kWarps) {
    float acc[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[nt][e] = 0.0f;
    }
    const State* row0 = slice + int64_t{tile * 16 + g} * kRowStride + 8 * t4;
    const State* row1 = row0 + 8 * kRowStride;
#pragma unroll 1
    for (int grp0 = 0; grp0 < kGroups; grp0 += kBatch) {
      float a0[kBatch][8], a1[kBatch][8];
#pragma unroll
      for (int x = 0; x < kBatch; ++x) {
        if constexpr (kShared) {
          SharedStateCols<8>(row0 + (grp0 + x) * 32, a0[x]);
          SharedStateCols<8>(row1 + (grp0 + x) * 32, a1[x]);
        } else {
          LoadCols<8>(row0 + (grp0 + x) * 32, a0[x]);
          LoadCols<8>(row1 + (grp0 + x) * 32, a1[x]);
        }
      }
#pragma unroll
      for (int x = 0; x < kBatch; ++x) {
        MmaColumnGroup<K, kSplit, kStateLo>(acc, a0[x], a1[x], grp0 + x, T, kc_s, qc_s, lane);
      }
    }
    StoreTileSums(acc, v_lo, tile, T, kn, qn, K, lane);
  }
}

// ---------------------------------------------------------------------------
// The piped checkpoint pass (FastVerifySchedule::piped_checkpoint; head dim
// 128, unstaged: warp w's tile is rows 16 w .. 16 w + 15 of the head's
// slice, four column groups of 32 columns). PipedSmem in verify_plan.h.
//  - fp32: a group is 16 rows of 128 bytes. The warp copies whole lines (8
//    lanes a row: a lane copying only the 16-byte halves of the sectors it
//    reads, which likely sends each sector to L2 twice, ran 20% slower than
//    the loads it replaced; whole lines still run 9-12% slower, so fp32 is
//    not piped by default), so lanes read each other's copies: a __syncwarp
//    after each wait, and before a buffer is refilled. A row's 16-byte
//    chunk c is stored at chunk c ^ (row % 8): the readers' rows g, g + 8
//    and columns 8 t4 then fall in distinct banks.
//  - bf16: a lane's row g and g + 8 columns 8 t4 .. + 7 are one 16-byte
//    piece each, four lanes a row's 64 bytes: each lane copies and reads its
//    own pieces (piece p of every lane together, 512 bytes), no barrier.
// Those are PipeCopy::kLanes (FastVerifySchedule::PipeCopies). kBulk copies
// through the TMA instead: a row of a group (fp32 128 bytes, bf16 64) is one
// cp.async.bulk, a lane a row, completing on one of the warp's two
// mbarriers (`own`'s buffer, `freed`'s; PipedSmem::kBarrierBytesPerWarp),
// which the warp waits on. Rows are stored in order (a 1D bulk copy cannot
// swizzle): bf16's layout above is that already; fp32 readers take their
// row's two chunks in opposite orders for even and odd g, which keeps the
// 8 lanes of each 16-byte load phase (rows g, g + 1) in distinct banks.

// How the piped pass copies (kNone: the pass is not piped).
enum class PipeCopy { kNone, kLanes, kBulk };

template <typename State>
struct PipedGroup {
  static constexpr int kBytes = 16 * 32 * int(sizeof(State));  // a warp's group
};

// Column group `grp` of warp `warp`'s tile, from the head's slice
// (row-major [128][128]) into `buffer` (cp.async; the caller commits).
template <typename State>
__device__ __forceinline__ void PipedCopyGroup(char* buffer, const State* slice, int warp,
                                               int grp, int lane) {
  constexpr int K = PipedSmem::kHeadDim;
  const State* tile = slice + int64_t{warp * 16} * K + grp * 32;
  if constexpr (sizeof(State) == 4) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int q = i * 32 + lane, row = q >> 3, chunk = q & 7;
      CpAsync16(buffer + row * 128 + ((chunk ^ (row & 7)) << 4), tile + int64_t{row} * K + chunk * 4);
    }
  } else {
    const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      CpAsync16(buffer + p * 512 + lane * 16, tile + int64_t{g + 8 * p} * K + 8 * t4);
    }
  }
}

// The lane's columns of a group from its buffer, as LoadCols<8> of rows g
// and g + 8 would give them.
template <typename State>
__device__ __forceinline__ void PipedReadGroup(const char* buffer, int lane, float (&a0)[8],
                                               float (&a1)[8]) {
  const int g = lane >> 2, t4 = lane & 3;
  if constexpr (sizeof(State) == 4) {
    float4 x[4];  // row g then g + 8, columns 8 t4 .. + 3 then + 4 .. + 7
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const int row = g + 8 * (p >> 1), chunk = 2 * t4 + (p & 1);
      x[p] = *reinterpret_cast<const float4*>(buffer + row * 128 + ((chunk ^ (row & 7)) << 4));
    }
    a0[0] = x[0].x, a0[1] = x[0].y, a0[2] = x[0].z, a0[3] = x[0].w;
    a0[4] = x[1].x, a0[5] = x[1].y, a0[6] = x[1].z, a0[7] = x[1].w;
    a1[0] = x[2].x, a1[1] = x[2].y, a1[2] = x[2].z, a1[3] = x[2].w;
    a1[4] = x[3].x, a1[5] = x[3].y, a1[6] = x[3].z, a1[7] = x[3].w;
  } else {
    SharedStateCols<8>(reinterpret_cast<const State*>(buffer + 0 * 512 + lane * 16), a0);
    SharedStateCols<8>(reinterpret_cast<const State*>(buffer + 1 * 512 + lane * 16), a1);
  }
}

// Where warp `warp`'s groups go: fp32 (2 KB a group) groups 0 and 2 in
// `own` (PipedSmem), 1 and 3 in `freed` (the ring chunk buffer); bf16 (1 KB)
// groups 0, 1 in `own`, 2, 3 in `freed`.
template <typename State>
__device__ __forceinline__ char* PipedBuffer(char* own, char* freed, int warp, int grp) {
  constexpr size_t kWarp = PipedSmem::kBytesPerWarp;
  if constexpr (sizeof(State) == 4) {
    return ((grp & 1) ? freed : own) + warp * kWarp;
  } else {
    return ((grp & 2) ? freed : own) + warp * kWarp + (grp & 1) * PipedGroup<State>::kBytes;
  }
}

// kBulk: the lane's columns of a group, as PipedReadGroup gives them from
// the rows-in-order layout.
template <typename State>
__device__ __forceinline__ void PipedBulkReadGroup(const char* buffer, int lane, float (&a0)[8],
                                                   float (&a1)[8]) {
  if constexpr (sizeof(State) == 4) {
    const int g = lane >> 2, t4 = lane & 3;
    const bool odd = g & 1;
    // Rows g, g + 8: the chunk 2 t4 + odd first, then the other.
    float4 x[4];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const char* row = buffer + (g + 8 * half) * 128;
      x[2 * half] = *reinterpret_cast<const float4*>(row + (2 * t4 + odd) * 16);
      x[2 * half + 1] = *reinterpret_cast<const float4*>(row + (2 * t4 + !odd) * 16);
    }
    const float4 r0lo = odd ? x[1] : x[0], r0hi = odd ? x[0] : x[1];
    const float4 r1lo = odd ? x[3] : x[2], r1hi = odd ? x[2] : x[3];
    a0[0] = r0lo.x, a0[1] = r0lo.y, a0[2] = r0lo.z, a0[3] = r0lo.w;
    a0[4] = r0hi.x, a0[5] = r0hi.y, a0[6] = r0hi.z, a0[7] = r0hi.w;
    a1[0] = r1lo.x, a1[1] = r1lo.y, a1[2] = r1lo.z, a1[3] = r1lo.w;
    a1[4] = r1hi.x, a1[5] = r1hi.y, a1[6] = r1hi.z, a1[7] = r1hi.w;
  } else {
    PipedReadGroup<State>(buffer, lane, a0, a1);
  }
}

// kBulk: warp `warp`'s barrier for `own`'s buffer (which 0) or `freed`'s
// (which 1), after every warp's buffers.
__device__ __forceinline__ uint64_t* PipedBarrier(char* own, int warp, int which) {
  return reinterpret_cast<uint64_t*>(own + PipedSmem::Bytes(kWarps)) + 2 * warp + which;
}

// kBulk: column groups grp .. grp + groups - 1 of the warp's tile into
// their buffers, a row a lane, on `bar`, armed here for their bytes. The
// buffers' earlier readers and writers are done (the caller's barrier).
template <typename State>
__device__ __forceinline__ void PipedBulkCopyGroups(char* own, char* freed, const State* slice,
                                                    int warp, int grp, int groups, uint64_t* bar,
                                                    int lane) {
  constexpr int K = PipedSmem::kHeadDim;
  constexpr int kRowBytes = 32 * int(sizeof(State));
  if (lane == 0) MbarArriveExpectTx(bar, uint32_t(groups * PipedGroup<State>::kBytes));
  __syncwarp();
  if (lane < 16 * groups) {
    const int g = grp + lane / 16, row = lane % 16;
    FenceProxyAsyncShared();
    BulkCopyToShared(PipedBuffer<State>(own, freed, warp, g) + row * kRowBytes,
                     slice + int64_t{warp * 16 + row} * K + g * 32, kRowBytes, bar);
  }
}

// At the block's start: the groups `own` holds first (fp32: 0; bf16: 0, 1);
// kLanes: one commit group; kBulk: the warp's barriers set up, then the
// copies on `own`'s.
template <typename State, PipeCopy kCopy>
__device__ __forceinline__ void PipedCopyFirst(char* own, const State* slice, int warp, int lane) {
  constexpr int kGroups = sizeof(State) == 4 ? 1 : 2;
  if constexpr (kCopy == PipeCopy::kBulk) {
    uint64_t* bars = PipedBarrier(own, warp, 0);
    if (lane == 0) {
      MbarInit(bars, 1);
      MbarInit(bars + 1, 1);
      FenceMbarInit();
    }
    __syncwarp();
    PipedBulkCopyGroups<State>(own, nullptr, slice, warp, 0, kGroups, bars, lane);
  } else {
    for (int grp = 0; grp < kGroups; ++grp) {
      PipedCopyGroup<State>(PipedBuffer<State>(own, nullptr, warp, grp), slice, warp, grp, lane);
    }
    CpAsyncCommit();
  }
}

// Once the ring's phase has freed `freed`: fp32 group 1; bf16 groups 2, 3;
// kLanes: one commit group; kBulk: on `freed`'s barrier.
template <typename State, PipeCopy kCopy>
__device__ __forceinline__ void PipedCopySecond(char* own, char* freed, const State* slice,
                                                int warp, int lane) {
  constexpr int kGroups = sizeof(State) == 4 ? 1 : 2;
  if constexpr (kCopy == PipeCopy::kBulk) {
    PipedBulkCopyGroups<State>(own, freed, slice, warp, kGroups, kGroups,
                               PipedBarrier(own, warp, 1), lane);
  } else {
    for (int grp = kGroups; grp < 2 * kGroups; ++grp) {
      PipedCopyGroup<State>(PipedBuffer<State>(own, freed, warp, grp), slice, warp, grp, lane);
    }
    CpAsyncCommit();
  }
}

// The pass, after PipedCopyFirst and PipedCopySecond: fp32 refills each
// buffer with the group two ahead once the warp has read it. The same sums,
// in the same order, as MmaCheckpointPass over the whole slice.
template <typename State, bool kSplit, PipeCopy kCopy>
__device__ __forceinline__ void PipedMmaCheckpointPass(char* own, char* freed, const State* slice,
                                                       int T, const float* kc_s,
                                                       const float* qc_s, float* kn, float* qn,
                                                       int lane, int warp) {
  constexpr int K = PipedSmem::kHeadDim;
  constexpr bool kStateLo = kSplit && std::is_same<State, float>::value;
  static_assert(K / 16 == kWarps, "a tile a warp");
  float acc[2][4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.0f;
  }
  const auto group = [&](int grp) {
    float a0[8], a1[8];
    if constexpr (kCopy == PipeCopy::kBulk) {
      PipedBulkReadGroup<State>(PipedBuffer<State>(own, freed, warp, grp), lane, a0, a1);
    } else {
      PipedReadGroup<State>(PipedBuffer<State>(own, freed, warp, grp), lane, a0, a1);
    }
    MmaColumnGroup<K, kSplit, kStateLo>(acc, a0, a1, grp, T, kc_s, qc_s, lane);
  };
  if constexpr (kCopy == PipeCopy::kBulk) {
    // Each barrier's phase 0 holds its first copies, fp32's phase 1 the
    // refill (after every lane has read the buffer).
    uint64_t* own_bar = PipedBarrier(own, warp, 0);
    uint64_t* freed_bar = own_bar + 1;
    if constexpr (sizeof(State) == 4) {
      MbarWait(own_bar, 0);
      group(0);
      __syncwarp();
      PipedBulkCopyGroups<State>(own, freed, slice, warp, 2, 1, own_bar, lane);
      MbarWait(freed_bar, 0);
      group(1);
      __syncwarp();
      PipedBulkCopyGroups<State>(own, freed, slice, warp, 3, 1, freed_bar, lane);
      MbarWait(own_bar, 1);
      group(2);
      MbarWait(freed_bar, 1);
      group(3);
    } else {
      MbarWait(own_bar, 0);
      group(0);
      group(1);
      MbarWait(freed_bar, 0);
      group(2);
      group(3);
    }
  } else if constexpr (sizeof(State) == 4) {
    CpAsyncWait<1>();  // group 0 (the lane's copies; the warp's after the barrier)
    __syncwarp();
    group(0);
    __syncwarp();      // every lane has read it before the refill lands
    PipedCopyGroup<State>(PipedBuffer<State>(own, freed, warp, 2), slice, warp, 2, lane);
    CpAsyncCommit();
    CpAsyncWait<1>();  // group 1
    __syncwarp();
    group(1);
    __syncwarp();
    PipedCopyGroup<State>(PipedBuffer<State>(own, freed, warp, 3), slice, warp, 3, lane);
    CpAsyncCommit();
    CpAsyncWait<1>();  // group 2
    __syncwarp();
    group(2);
    CpAsyncWait<0>();  // group 3
    __syncwarp();
    group(3);
  } else {
    CpAsyncWait<1>();  // groups 0, 1
    group(0);
    group(1);
    CpAsyncWait<0>();  // groups 2, 3
    group(2);
    group(3);
  }
  StoreTileSums(acc, 0, warp, T, kn, qn, K, lane);
}

}  // namespace
}  // namespace fast
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_FAST_CUDA_CHECKPOINT_PASS_CUH_
