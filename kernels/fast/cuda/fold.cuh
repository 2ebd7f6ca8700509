// FAST's folds on CUDA (fast_cuda.h: FastCommitCuda, FastMaterializeCuda):
// the kernel family and its launchers.
// Fold (Commit, Materialize): 512-thread blocks per (layer, value head,
// tile of FoldRows(K) state rows: the whole head at K <= 128) striding
// over the rows (Commit: FoldLaunchPlan::blocks_per_head of them, testing
// their rows in parallel and folding only those that fold; Materialize: one
// per listed block, or 16 over every block); the ring's log-decays, keys and
// values staged in shared memory by every thread; exponents a thread per
// column from the near end; each thread's register tile of 8 columns
// (FoldTile) x 1-4 rows advanced by the chain of ring tokens. How a job
// reads its inputs is the FastFoldSchedule (fold_plan.h): a chain of loads
// (kOff), one round of copies (kOn), or that round double-buffered across a
// block's jobs (kPipelined); the same sums in the same order under each.
#ifndef SPECSTATE_KERNELS_FAST_CUDA_FOLD_CUH_
#define SPECSTATE_KERNELS_FAST_CUDA_FOLD_CUH_

#include "kernels/common/cuda/cp_async.cuh"
#include "kernels/fast/cuda/device_math.cuh"
#include "kernels/fast/fold_plan.h"

namespace specstate {
namespace kernels {
namespace fast {
namespace {

// ---------------------------------------------------------------------------
// Folds.

enum class FoldMode { kCommit, kMaterialize };

// Layers per fold launch: their pools and rings travel in the kernel's
// parameters (a commit's launches do not grow with the number of layers
// below this; 48 layers take two).
constexpr int kLayersPerLaunch = 24;

// A fold block (fold_plan.h): kFoldThreads threads, FoldRows(K) state rows
// of one value head, each thread a tile of kFoldCols columns of 1-4 rows.
constexpr int kFoldWarps = kFoldThreads / 32;

struct FoldParams {
  KdaShape shape;
  FastLayer layers[kLayersPerLaunch];
  int num_layers;      // of this launch
  int spec_query_len;
  // Rows (kCommit), listed blocks or, with every_block, the pool's blocks
  // (kMaterialize).
  int rows;
  // kCommit: the checked plan, or (null) the plan's inputs to plan from.
  const CommitPlanRow* plan;
  CommitArgs plan_args;
  // kMaterialize.
  const int32_t* blocks;
  bool every_block;
  void* out;
  const DeviceStatus* gate;
};

// Row i's commit plan: the checked one, or planned here (the direct calls).
__device__ __forceinline__ bool CommitPlanOf(const FoldParams& f, int64_t num_blocks, int i,
                                             CommitPlanRow* p) {
  if (f.plan != nullptr) {
    *p = f.plan[i];
    return true;
  }
  return internal::PlanCommitRow(f.plan_args, num_blocks, i, p).problem == 0;
}

// A row's (or a listed block's) folds: the state after the first n[t] ring
// tokens of `block`, stored to dst[t] (a pool block or `out`). Two in align
// mode when a commit crosses a boundary: [0] the boundary state, [1] the
// final one (FastFoldKernel folds the final one first).
struct FoldJob {
  int32_t block = 0;
  int count = 0;
  int n[2] = {0, 0};
  void* dst[2] = {nullptr, nullptr};
};

// dst[e] = value(e) for e < count, a fold block's threads striding, four
// loads of a thread in flight before their stores (a plain strided loop
// waits on each load before its store: the fold's staging showed as the
// largest stall after its products, ncu, docs/results/).
template <typename Value>
__device__ __forceinline__ void StageToShared(float* dst, int count, int tid, Value value) {
  constexpr int kInFlight = 4;
  for (int e0 = tid; e0 < count; e0 += kInFlight * kFoldThreads) {
    float x[kInFlight];
#pragma unroll
    for (int q = 0; q < kInFlight; ++q) {
      const int e = e0 + q * kFoldThreads;
      x[q] = e < count ? value(e) : 0.0f;
    }
#pragma unroll
    for (int q = 0; q < kInFlight; ++q) {
      if (e0 + q * kFoldThreads < count) dst[e0 + q * kFoldThreads] = x[q];
    }
  }
}

// Fold `target`'s tokens and destination (0 or 1), read with constant
// indices.
__device__ __forceinline__ int TokensOf(const FoldJob& job, int target) {
  return target == 0 ? job.n[0] : job.n[1];
}
__device__ __forceinline__ void* DestinationOf(const FoldJob& job, int target) {
  return target == 0 ? job.dst[0] : job.dst[1];
}

// Commit (fast_args.h, FastCommitArgs): within the checkpoint's block the
// ring folds only when the next window might not fit; align mode leaving
// the block or crossing a boundary folds the boundary and final states.
// Materialize: each listed block (listed twice: once), into `out` or in place.
template <FoldMode kMode>
__device__ bool FoldJobOf(const FoldParams& f, const FastLayer& layer, int i, FoldJob* job,
                          int64_t block_elems, int state_bytes) {
  const FastRings& rings = layer.rings;
  const int64_t num_blocks = layer.state.num_blocks;
  char* const pool = static_cast<char*>(layer.state.data);
  const auto block_at = [&](int32_t b) {
    return pool + int64_t{b} * layer.state.block_stride * state_bytes;
  };
  if constexpr (kMode == FoldMode::kCommit) {
    CommitPlanRow p;
    if (!CommitPlanOf(f, num_blocks, i, &p)) return false;
    if (!internal::CommitsAnything(p) || p.source >= rings.num_blocks) return false;
    const FastCursor cur = rings.cursors[p.source];
    if (p.commit_len > cur.candidates) return false;  // (the direct calls' unchecked misuse)
    job->block = p.source;
    const int n = cur.tokens + p.commit_len;
    if (p.final_block == p.source && !IsBlock(p.boundary_block)) {
      if (n + f.spec_query_len <= rings.capacity || n > rings.capacity) return false;
      job->count = 1;
      job->n[0] = n;
      job->dst[0] = block_at(p.source);
      return true;
    }
    // (Constant indices only, here and in the folds: a FoldJob indexed by
    // a variable lives in local memory.)
    if (IsBlock(p.boundary_block) && p.boundary_len < p.commit_len) {
      job->count = 2;
      job->n[0] = cur.tokens + p.boundary_len;
      job->dst[0] = block_at(p.boundary_block);
      job->n[1] = n;
      job->dst[1] = block_at(p.final_block);
    } else {
      job->count = 1;
      job->n[0] = n;
      job->dst[0] = block_at(p.final_block);
    }
    return true;
  } else {
    const int32_t b = f.every_block ? i : f.blocks[i];
    if (!IsBlock(b) || b >= num_blocks || b >= rings.num_blocks) return false;
    if (!f.every_block) {
      for (int x = 0; x < i; ++x) {
        if (f.blocks[x] == b && f.out == nullptr) return false;  // listed twice: folded once
      }
    }
    const int n = rings.cursors[b].tokens;
    if (n < 0 || n > rings.capacity) return false;
    job->block = b;
    job->count = 1;
    job->n[0] = n;
    if (f.out != nullptr) {
      job->dst[0] = static_cast<char*>(f.out) + int64_t{i} * block_elems * state_bytes;
      return true;
    }
    job->dst[0] = block_at(b);
    return n > 0;
  }
}

// A thread's tile of a fold block: kRowsEach rows r0.. by kFoldCols
// columns. Staged jobs (kRuns, shared memory) take them in two runs of four,
// c0.. and c0 + K / 2.. (c0 = 4 (tid % (K / 8))): the lanes that share rows
// read consecutive runs, so their shared-memory reads hit distinct banks
// (one run of eight a thread read with two-way bank conflicts), and each
// store covers whole 32-byte sectors. The unstaged job (loads from global
// memory; Commit's folds of one row, Materialize's, and rings too large for
// two buffers) keeps one run of eight (c0 = 8 (tid % (K / 8))): with two
// runs its kernel spilled more (224 -> 288 bytes of stores, Kimi-Linear's
// instantiation) and folded 3-11% slower at N = 256 (one H100,
// docs/benchmarks.md "Fold tiles in two runs"). Each element's sums are the
// same whichever thread forms them.
template <int K, bool kRuns>
struct FoldTile {
  static constexpr int kColGroups = K / kFoldCols;  // threads sharing a row
  static constexpr int kRun = kRuns ? kFoldCols / 2 : kFoldCols;
  static constexpr int kRunStride = K / 2;  // kRuns: the second run's offset
  static_assert(!kRuns || (kRun == 4 && kColGroups * kRun == K / 2), "two runs of four columns");
  static __device__ __forceinline__ int FirstColumn(int tid) { return (tid % kColGroups) * kRun; }
  // The column of tile column c (a constant offset after unrolling).
  static __device__ __forceinline__ int Column(int c0, int c) {
    return c < kRun ? c0 + c : c0 + kRunStride + (c - kRun);
  }
  // The tile's columns of one row: global memory (LoadCols), shared memory
  // (SharedStateCols), or floats of shared memory (SmemCols).
  template <typename State>
  static __device__ __forceinline__ void Load(const State* row, int c0, float (&out)[kFoldCols]) {
    if constexpr (kRuns) {
      float a[kRun], b[kRun];
      LoadCols<kRun>(row + c0, a);
      LoadCols<kRun>(row + c0 + kRunStride, b);
      Join(a, b, out);
    } else {
      LoadCols<kFoldCols>(row + c0, out);
    }
  }
  template <typename State>
  static __device__ __forceinline__ void LoadShared(const State* row, int c0,
                                                    float (&out)[kFoldCols]) {
    if constexpr (kRuns) {
      float a[kRun], b[kRun];
      SharedStateCols<kRun>(row + c0, a);
      SharedStateCols<kRun>(row + c0 + kRunStride, b);
      Join(a, b, out);
    } else {
      SharedStateCols<kFoldCols>(row + c0, out);
    }
  }
  static __device__ __forceinline__ void LoadFloats(const float* row, int c0,
                                                    float (&out)[kFoldCols]) {
    if constexpr (kRuns) {
      float a[kRun], b[kRun];
      SmemCols<kRun>(row + c0, a);
      SmemCols<kRun>(row + c0 + kRunStride, b);
      Join(a, b, out);
    } else {
      SmemCols<kFoldCols>(row + c0, out);
    }
  }
  template <typename State>
  static __device__ __forceinline__ void Store(const float (&x)[kFoldCols], State* row, int c0) {
    if constexpr (kRuns) {
      float a[kRun], b[kRun];
#pragma unroll
      for (int c = 0; c < kRun; ++c) {
        a[c] = x[c];
        b[c] = x[kRun + c];
      }
      StoreCols<kRun>(a, row + c0);
      StoreCols<kRun>(b, row + c0 + kRunStride);
    } else {
      StoreCols<kFoldCols>(x, row + c0);
    }
  }

 private:
  static __device__ __forceinline__ void Join(const float (&a)[kRun], const float (&b)[kRun],
                                              float (&out)[kFoldCols]) {
#pragma unroll
    for (int c = 0; c < kRun; ++c) {
      out[c] = a[c];
      out[kRun + c] = b[c];
    }
  }
};

// A ring token's terms on a thread's tile, the fold's step for every
// schedule: acc[r][c] += u_i[r0 + r] * kr_i[column c], `kr` the token's
// decayed key (K floats) and `u` its value at row r0 (shared memory).
template <typename Tile, int kRowsEach>
__device__ __forceinline__ void AddRingToken(const float* kr, int c0, const float* u,
                                             float (&acc)[kRowsEach][kFoldCols]) {
  float kv[kFoldCols], uv[kRowsEach];
  Tile::LoadFloats(kr, c0, kv);
  SmemCols<kRowsEach>(u, uv);
#pragma unroll
  for (int r = 0; r < kRowsEach; ++r) {
#pragma unroll
    for (int c = 0; c < kFoldCols; ++c) acc[r][c] = kda::MulAdd(uv[r], kv[c], acc[r][c]);
  }
}

// A thread's tile stored to its rows r0.. of `dst` (a value head's rows).
template <typename Tile, int K, int kRowsEach, typename State>
__device__ __forceinline__ void StoreTile(const float (&acc)[kRowsEach][kFoldCols], State* dst,
                                          int r0, int c0) {
#pragma unroll
  for (int r = 0; r < kRowsEach; ++r) Tile::Store(acc[r], dst + int64_t{r0 + r} * K, c0);
}

// The staged folds (FastFoldSchedule kOn, kPipelined): the same sums as the
// unstaged job in FastFoldKernel, in the same order, from inputs copied to
// shared memory (StagedFoldSmem) in one round a job instead of a chain of
// phases each waiting on its own loads:
//  1. StageFoldJob: the block's checkpoint rows and every ring token's raw
//     key, log-decays and values the job's folds read (cp.async, every
//     thread) into a buffer;
//  2. FoldFromShared: each token's key norm (a warp a token, as
//     WarpNormalize); per fold (align mode: the final state first, then the
//     boundary's, from log-decays loaded again: the first fold's pass
//     overwrote KDA's), the exponents a thread per column from the newest
//     token back, each key normalized and decayed as it goes (KDA: in place
//     of its log-decays), and Gc; then each thread's tile: the checkpoint
//     decayed, plus the ring's terms oldest first, stored.

// A staged job's buffer (one of kPipelined's two) in shared memory.
template <typename Act, typename State>
struct FoldBuffer {
  State* rows;   // the block's checkpoint rows [rows][K]
  Act* raw_k;    // [R][K]
  float* keys;   // [R][K]: KDA's log-decays, then the decayed keys
  float* gdn_g;  // GDN: [R]
  float* u;      // [R][rows]
  __device__ FoldBuffer(const StagedFoldSmem& m, char* at)
      : rows(reinterpret_cast<State*>(at)),
        raw_k(reinterpret_cast<Act*>(at + m.CheckpointBytes())),
        keys(reinterpret_cast<float*>(at + m.CheckpointBytes() + m.RawKeyBytes())),
        gdn_g(reinterpret_cast<float*>(at + m.CheckpointBytes() + m.RawKeyBytes() +
                                       m.KeyBytes())),
        u(reinterpret_cast<float*>(at + m.CheckpointBytes() + m.RawKeyBytes() + m.KeyBytes() +
                                   m.GdnLogDecayBytes())) {}
};

template <typename Act, typename State, int K>
__device__ __forceinline__ StagedFoldSmem StagedLayout(const FoldParams& f,
                                                       const FastRings& rings) {
  return StagedFoldSmem{K, rings.capacity, int(sizeof(Act)), int(sizeof(State)),
                        f.shape.kind == LayerKind::kGdn};
}

// The ring tokens any of a job's folds reads.
__device__ __forceinline__ int TokensRead(const FoldJob& job) {
  return max(job.n[0], TokensOf(job, job.count - 1));
}

// 1. Issues a job's copies into `buf` (not committed: the caller commits
// the group and waits for it).
template <typename Act, typename State, int K>
__device__ __forceinline__ void StageFoldJob(const FoldParams& f, const FastLayer& layer,
                                             const FoldJob& job, FoldBuffer<Act, State> buf,
                                             int hv, int v0, int tid) {
  constexpr int kRows = FoldRows(K);
  const KdaShape& s = f.shape;
  const FastRings& rings = layer.rings;
  const bool gdn = s.kind == LayerKind::kGdn;
  const int h = KeyHeadOf(s, hv);
  const int64_t kw_width = RingKWidth(s), g_width = RingLogDecayWidth(s), u_width = RingUWidth(s);
  const int n_all = TokensRead(job);
  const State* s0 = static_cast<const State*>(layer.state.data) +
                    int64_t{job.block} * layer.state.block_stride + int64_t{hv} * K * K;
  const Act* ring_k = static_cast<const Act*>(rings.k);
  constexpr int kRowChunks = K * int(sizeof(State)) / 16, kPerRowChunk = 16 / int(sizeof(State));
  for (int x = tid; x < kRows * kRowChunks; x += kFoldThreads) {
    const int r = x / kRowChunks, e = x % kRowChunks;
    CpAsync16(buf.rows + r * K + e * kPerRowChunk, s0 + int64_t{v0 + r} * K + e * kPerRowChunk);
  }
  constexpr int kKeyChunks = K * int(sizeof(Act)) / 16, kPerKeyChunk = 16 / int(sizeof(Act));
  for (int x = tid; x < n_all * kKeyChunks; x += kFoldThreads) {
    const int i = x / kKeyChunks, e = x % kKeyChunks;
    CpAsync16(buf.raw_k + i * K + e * kPerKeyChunk,
              ring_k + RingAt(rings, job.block, i, kw_width) + int64_t{h} * K + e * kPerKeyChunk);
  }
  if (gdn) {
    for (int i = tid; i < n_all; i += kFoldThreads) {
      CpAsync4(buf.gdn_g + i, rings.log_decay + RingAt(rings, job.block, i, g_width) + hv);
    }
  } else {
    for (int x = tid; x < n_all * (K / 4); x += kFoldThreads) {
      const int i = x / (K / 4), e = x % (K / 4);
      CpAsync16(buf.keys + i * K + 4 * e,
                rings.log_decay + RingAt(rings, job.block, i, g_width) + int64_t{h} * K + 4 * e);
    }
  }
  for (int x = tid; x < n_all * (kRows / 4); x += kFoldThreads) {
    const int i = x / (kRows / 4), e = x % (kRows / 4);
    CpAsync16(buf.u + i * kRows + 4 * e,
              rings.u + RingAt(rings, job.block, i, u_width) + int64_t{hv} * K + v0 + 4 * e);
  }
}

// 2. A job's folds from its staged buffer, once the copies landed and a
// barrier made them visible. `norms` [R] and `gc` [K]: shared memory of
// the block's own. Ends with the stores issued; the caller's barrier must
// come before the buffer (or norms, gc) is written again.
template <typename Act, typename State, int K>
__device__ __forceinline__ void FoldFromShared(const FoldParams& f, const FastLayer& layer,
                                               const FoldJob& job, FoldBuffer<Act, State> buf,
                                               float* norms, float* gc, int hv, int v0, int tid,
                                               int lane, int warp) {
  constexpr int kRows = FoldRows(K);
  const KdaShape& s = f.shape;
  const FastRings& rings = layer.rings;
  const bool gdn = s.kind == LayerKind::kGdn;
  const int h = KeyHeadOf(s, hv);
  const int n_all = TokensRead(job);
  for (int i = warp; i < n_all; i += kFoldWarps) {
    const float norm = WarpNormOf<Act, K>(buf.raw_k + i * K, lane);
    if (lane == 0) norms[i] = norm;
  }
  // A thread's tile (FoldTile: two runs of four columns).
  using Tile = FoldTile<K, true>;
  constexpr int kColGroups = Tile::kColGroups;
  constexpr int kRowGroups = kFoldThreads / kColGroups;
  constexpr int kRowsEach = kRows / kRowGroups;
  const int c0 = Tile::FirstColumn(tid), r0 = (tid / kColGroups) * kRowsEach;
  for (int target = job.count - 1; target >= 0; --target) {
    const int n = TokensOf(job, target);
    if (target != job.count - 1) {
      __syncthreads();  // the previous fold's reads of the keys done
      if (!gdn) {       // its log-decays again, where its keys were (a boundary: rare)
        const int64_t g_width = RingLogDecayWidth(s);
        for (int x = tid; x < n * K; x += kFoldThreads) {
          buf.keys[x] = rings.log_decay[RingAt(rings, job.block, x / K, g_width) +
                                        int64_t{h} * K + x % K];
        }
      }
    }
    __syncthreads();  // the norms (and log-decays) in place
    // Exponents from the newest token back; each key normalized and
    // decayed by the sum over the tokens after it (KDA: over its own
    // log-decay, read first).
    if (tid < K) {
      float e = 0.0f;
      for (int i = n - 1; i >= 0; --i) {
        const float g = gdn ? buf.gdn_g[i] : buf.keys[i * K + tid];
        buf.keys[i * K + tid] = ::specstate::fast::Decayed(
            kda::Normalize(ToFloat(buf.raw_k[i * K + tid]), norms[i], 1.0f), e);
        e += g;
      }
      gc[tid] = e;
    }
    __syncthreads();
    float acc[kRowsEach][kFoldCols];
#pragma unroll
    for (int r = 0; r < kRowsEach; ++r) {
      Tile::LoadShared(buf.rows + (r0 + r) * K, c0, acc[r]);
#pragma unroll
      for (int c = 0; c < kFoldCols; ++c) {
        acc[r][c] = ::specstate::fast::Decayed(acc[r][c], gc[Tile::Column(c0, c)]);
      }
    }
    for (int i = 0; i < n; ++i) {
      AddRingToken<Tile>(buf.keys + i * K, c0, buf.u + i * kRows + r0, acc);
    }
    State* const dst = static_cast<State*>(DestinationOf(job, target)) + int64_t{hv} * K * K;
    StoreTile<Tile, K>(acc, dst, v0 + r0, c0);
  }
}

// The listed jobs of a block under kOn (one buffer: copy, wait, fold) or
// kPipelined (two: job li + 1's copies in flight while job li folds).
template <typename Act, typename State, int K, FoldMode kMode, bool kPipelined>
__device__ __forceinline__ void StagedFoldJobs(const FoldParams& f, const FastLayer& layer,
                                               const int* fold_rows, int listed,
                                               int64_t block_elems, int hv, int v0, int tid,
                                               int lane, int warp) {
  extern __shared__ float smem[];
  const StagedFoldSmem m = StagedLayout<Act, State, K>(f, layer.rings);
  char* base = reinterpret_cast<char*>(smem);
  constexpr int kBuffers = kPipelined ? 2 : 1;
  float* norms = reinterpret_cast<float*>(base + kBuffers * m.BufferBytes());
  float* gc = reinterpret_cast<float*>(base + kBuffers * m.BufferBytes() + m.NormBytes());
  const auto buffer = [&](int li) {
    return FoldBuffer<Act, State>(m, base + (kPipelined ? li & 1 : 0) * m.BufferBytes());
  };
  const auto job_of = [&](int li) {
    FoldJob job;
    FoldJobOf<kMode>(f, layer, fold_rows[li], &job, block_elems, sizeof(State));
    return job;
  };
  if (listed == 0) return;
  __syncthreads();  // the previous list's reads of the buffers done
  FoldJob job = job_of(0);
  StageFoldJob<Act, State, K>(f, layer, job, buffer(0), hv, v0, tid);
  CpAsyncCommit();
  for (int li = 0; li < listed; ++li) {
    FoldJob next;
    if (kPipelined && li + 1 < listed) {
      next = job_of(li + 1);
      StageFoldJob<Act, State, K>(f, layer, next, buffer(li + 1), hv, v0, tid);
      CpAsyncCommit();
      CpAsyncWait<1>();  // job li's group, not the one just issued
    } else {
      CpAsyncWait<0>();
    }
    __syncthreads();  // job li's copies visible to the block
    FoldFromShared<Act, State, K>(f, layer, job, buffer(li), norms, gc, hv, v0, tid, lane, warp);
    __syncthreads();  // its buffer, norms and Gc read before they are written again
    if (kPipelined) {
      job = next;
    } else if (li + 1 < listed) {
      job = job_of(li + 1);
      StageFoldJob<Act, State, K>(f, layer, job, buffer(li + 1), hv, v0, tid);
      CpAsyncCommit();
    }
  }
}

// The folds of one layer's jobs, one value head, FoldRows(K) state rows:
// out[v][j] = S0[v][j] exp(Gc[j]) + sum_i u_i[v] kr_i[j]. Grid: x strides
// over the jobs, y the value heads, z (layer, tile of state rows).
// Two blocks an SM (64 registers, a few spilled). H200, kda_bench,
// Kimi-Linear F = 4, the commit of 20 layers: 5067 -> 3929 us at N = 256,
// 413 -> 306 us at N = 16, against 256-thread blocks of 32 rows (each tile
// redoing the ring's exponents and keys); 64 rows a block (16 accumulators,
// two tiles a head) measured 5854 / 524 us (docs/results/fast_fold_bounds_h200.md).
// Register tiles, the log-decays staged in shared memory and staging loads
// four in flight: 3894 -> 3340 us at N = 256, 809 -> 740 us at N = 64, cold
// L2 (docs/results/fast_tensor_cores_h200.md).
// kStaging kOn, kPipelined: the listed jobs StagedFoldJobs' (one round of
// copies a job, then the sums; pipelined, one block an SM).
template <typename Act, typename State, int K, FoldMode kMode, FastFoldSchedule::Staging kStaging>
__global__ void __launch_bounds__(kFoldThreads,
                                  kStaging == FastFoldSchedule::Staging::kPipelined ? 1 : 2)
    FastFoldKernel(const FoldParams f) {
  using Staging = FastFoldSchedule::Staging;
  extern __shared__ float smem[];
  if (GateFailed(f.gate)) return;
  constexpr int kRows = FoldRows(K);
  constexpr int kTiles = K / kRows;
  const FastLayer& layer = f.layers[blockIdx.z / kTiles];
  const int hv = blockIdx.y, v0 = (blockIdx.z % kTiles) * kRows;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const KdaShape& s = f.shape;
  const int HV = ValueHeads(s);
  const int64_t block_elems = int64_t{HV} * K * K;
  // Blocks stride over the jobs (kCommit: gridDim.x is small, so that a
  // commit with no fold costs one parallel plan read per block, not a block
  // per row and head): the block's threads test kFoldThreads of its jobs at
  // once, the ones that fold listed in shared memory, then folded one after
  // the other.
  __shared__ int fold_rows[kFoldThreads];
  __shared__ int fold_count;
  const int per_block = (f.rows - int(blockIdx.x) + int(gridDim.x) - 1) / int(gridDim.x);
  for (int m0 = 0; m0 < per_block; m0 += kFoldThreads) {
    __syncthreads();  // the previous list and shared memory reads done
    if (tid == 0) fold_count = 0;
    __syncthreads();
    {
      const int m = m0 + tid;
      const int row = blockIdx.x + m * gridDim.x;
      FoldJob job;
      if (m < per_block && FoldJobOf<kMode>(f, layer, row, &job, block_elems, sizeof(State))) {
        fold_rows[atomicAdd(&fold_count, 1)] = row;
      }
    }
    __syncthreads();
    const int listed = fold_count;
    if constexpr (kStaging != Staging::kOff) {
      StagedFoldJobs<Act, State, K, kMode, kStaging == Staging::kPipelined>(
          f, layer, fold_rows, listed, block_elems, hv, v0, tid, lane, warp);
    } else {
      for (int li = 0; li < listed; ++li) {
        FoldJob job;
        FoldJobOf<kMode>(f, layer, fold_rows[li], &job, block_elems, sizeof(State));
        const FastRings& rings = layer.rings;
        const bool gdn = s.kind == LayerKind::kGdn;
        const int h = KeyHeadOf(s, hv);
        const int R = rings.capacity;
        float* kr = smem;
        float* uc = kr + kRingChunk * K;
        float* bound = uc + kRingChunk * kRows;
        float* gc = bound + (R / kRingChunk + 1) * K;
        const int64_t kw_width = RingKWidth(s), g_width = RingLogDecayWidth(s),
                      u_width = RingUWidth(s);
        float* gs = gc + K;
        static_assert(K <= kFoldThreads, "a thread per column");
        // Tokens [i0, i1)'s log-decays into gs [i - i0][column], every thread
        // loading at once (GDN: the head's one value, repeated per column).
        const auto stage_log_decays = [&](int i0, int i1) {
          StageToShared(gs, (i1 - i0) * K, tid, [&](int e) {
            const float* g = rings.log_decay + RingAt(rings, job.block, i0 + e / K, g_width);
            return gdn ? g[hv] : g[int64_t{h} * K + e % K];
          });
        };
        // A thread's tile (FoldTile: one run of eight columns): kRowsEach
        // rows x kFoldCols columns (one 16-byte load of u's rows and two of
        // kr's columns a ring token, not a shared-memory load per product).
        using Tile = FoldTile<K, false>;
        constexpr int kColGroups = Tile::kColGroups;
        constexpr int kRowGroups = kFoldThreads / kColGroups;
        constexpr int kRowsEach = kRows / kRowGroups;  // 1, 4, 2 at K = 64, 128, 256
        static_assert(kRowsEach * kRowGroups == kRows && kRowsEach * kFoldCols <= 32 &&
                          (kRowsEach == 1 || kRowsEach == 2 || kRowsEach == 4),
                      "32 accumulators at most; u's rows one load");
        const int c0 = Tile::FirstColumn(tid), r0 = (tid / kColGroups) * kRowsEach;
        const State* s0 = static_cast<const State*>(layer.state.data) +
                          int64_t{job.block} * layer.state.block_stride + int64_t{hv} * K * K;
        // Align mode's two folds, the final state first: the boundary state
        // goes to the checkpoint's own block (the block the request's state
        // was in), which the final fold reads; the final block is never the
        // checkpoint when there is a boundary (the plan's checks). Each
        // thread reads only the elements it stores.
        for (int target = job.count - 1; target >= 0; --target) {
          const int n = TokensOf(job, target);
          const int chunks = (n + kRingChunk - 1) / kRingChunk;
          __syncthreads();  // the previous fold's shared memory reads done
          // Exponents per column from the newest token back, over each chunk's
          // log-decays staged in shared memory by every thread (the sums
          // themselves a thread per column, in order); each chunk's starting
          // value (the sum over the tokens after it) kept.
          float exponent = 0.0f;
          for (int chunk = chunks - 1; chunk >= 0; --chunk) {
            const int i0 = chunk * kRingChunk, i1 = min(n, i0 + kRingChunk);
            stage_log_decays(i0, i1);
            __syncthreads();
            if (tid < K) {
              for (int i = i1 - 1; i >= i0; --i) {
                if ((i + 1) % kRingChunk == 0 || i == n - 1) bound[chunk * K + tid] = exponent;
                exponent += gs[(i - i0) * K + tid];
              }
            }
            __syncthreads();  // gs read before it is staged again
          }
          if (tid < K) gc[tid] = exponent;
          __syncthreads();
          // (Loaded before the exponent pass, the accumulators spilled.)
          float acc[kRowsEach][kFoldCols];
#pragma unroll
          for (int r = 0; r < kRowsEach; ++r) {
            Tile::Load(s0 + int64_t{v0 + r0 + r} * K, c0, acc[r]);
#pragma unroll
            for (int c = 0; c < kFoldCols; ++c) {
              acc[r][c] = ::specstate::fast::Decayed(acc[r][c], gc[Tile::Column(c0, c)]);
            }
          }
          const Act* ring_k = static_cast<const Act*>(rings.k);
          for (int chunk = 0; chunk < chunks; ++chunk) {
            const int i0 = chunk * kRingChunk, i1 = min(n, i0 + kRingChunk);
            __syncthreads();
            for (int i = i0 + warp; i < i1; i += kFoldWarps) {
              WarpNormalize<Act, K>(ring_k + RingAt(rings, job.block, i, kw_width) + int64_t{h} * K,
                                    1.0f, kr + (i - i0) * K, lane);
            }
            StageToShared(uc, (i1 - i0) * kRows, tid, [&](int e) {
              return rings.u[RingAt(rings, job.block, i0 + e / kRows, u_width) + int64_t{hv} * K + v0 +
                             e % kRows];
            });
            if (chunks > 1) stage_log_decays(i0, i1);  // one chunk: still staged
            __syncthreads();
            if (tid < K) {
              float e = bound[chunk * K + tid];
              for (int i = i1 - 1; i >= i0; --i) {
                kr[(i - i0) * K + tid] = ::specstate::fast::Decayed(kr[(i - i0) * K + tid], e);
                e += gs[(i - i0) * K + tid];
              }
            }
            __syncthreads();
            for (int i = i0; i < i1; ++i) {
              AddRingToken<Tile>(kr + (i - i0) * K, c0, uc + (i - i0) * kRows + r0, acc);
            }
          }
          State* const dst =
              static_cast<State*>(DestinationOf(job, target)) + int64_t{hv} * K * K;
          StoreTile<Tile, K>(acc, dst, v0 + r0, c0);
        }
      }
    }
  }
}

// Commit's cursors, after the folds: a thread per (row, layer of the launch).
//  - within the checkpoint's block: tokens += commit_len, emptied by a fold;
//  - align mode otherwise: the boundary and final blocks' rings empty (they
//    hold real states), the checkpoint's unchanged;
// every row's candidates forgotten.
__global__ void FastCommitCursorKernel(const FoldParams f) {
  if (GateFailed(f.gate)) return;
  const int x = blockIdx.x * blockDim.x + threadIdx.x;
  if (x >= f.rows * f.num_layers) return;
  const int i = x % f.rows;
  const FastRings& rings = f.layers[x / f.rows].rings;
  CommitPlanRow p;
  if (!CommitPlanOf(f, f.layers[0].state.num_blocks, i, &p)) return;
  if (!IsBlock(p.source) || p.source >= rings.num_blocks) return;
  FastCursor& cur = rings.cursors[p.source];
  if (!internal::CommitsAnything(p) || p.commit_len > cur.candidates) {
    cur.candidates = 0;
    return;
  }
  cur.candidates = 0;
  if (p.final_block == p.source && !IsBlock(p.boundary_block)) {
    cur.tokens += p.commit_len;
    if (cur.tokens + f.spec_query_len > rings.capacity) cur.tokens = 0;
    return;
  }
  if (IsBlock(p.boundary_block) && p.boundary_len < p.commit_len) {
    rings.cursors[p.boundary_block] = FastCursor{0, 0};
  }
  rings.cursors[p.final_block] = FastCursor{0, 0};
}

// Materialize's cursors, after the folds: a block per (listed block, layer
// of the launch). Discard, or the candidates moved to the ring's start
// (each thread one element of a token, copied oldest first: the destination
// never passes its source) and the ring emptied.
template <typename Act>
__global__ void FastMaterializeCursorKernel(const FoldParams f, bool discard) {
  if (GateFailed(f.gate)) return;
  const int i = blockIdx.x;
  const KdaShape& s = f.shape;
  const FastRings& rings = f.layers[blockIdx.y].rings;
  const int32_t b = f.every_block ? i : f.blocks[i];
  if (!IsBlock(b) || b >= rings.num_blocks) return;
  if (!f.every_block) {
    for (int x = 0; x < i; ++x) {
      if (f.blocks[x] == b) return;
    }
  }
  FastCursor& cur = rings.cursors[b];
  if (discard) {
    if (threadIdx.x == 0) cur = FastCursor{0, 0};
    return;
  }
  const int from = cur.tokens, count = cur.candidates;
  if (from <= 0) return;
  const int64_t kw = RingKWidth(s), uw = RingUWidth(s), gw = RingLogDecayWidth(s);
  Act* k = static_cast<Act*>(rings.k);
  for (int64_t e = threadIdx.x; e < kw; e += blockDim.x) {
    for (int t = 0; t < count; ++t) k[RingAt(rings, b, t, kw) + e] = k[RingAt(rings, b, from + t, kw) + e];
  }
  for (int64_t e = threadIdx.x; e < uw; e += blockDim.x) {
    for (int t = 0; t < count; ++t) {
      rings.u[RingAt(rings, b, t, uw) + e] = rings.u[RingAt(rings, b, from + t, uw) + e];
    }
  }
  for (int64_t e = threadIdx.x; e < gw; e += blockDim.x) {
    for (int t = 0; t < count; ++t) {
      rings.log_decay[RingAt(rings, b, t, gw) + e] = rings.log_decay[RingAt(rings, b, from + t, gw) + e];
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) cur.tokens = 0;
}

static_assert(sizeof(FoldParams) <= 4096, "a fold launch's layers fit in its parameters");


template <typename Act, typename State, int K, FoldMode kMode>
cudaError_t LaunchFold(const FoldParams& f, const FoldLaunchPlan& plan, int grid_x,
                       cudaStream_t stream) {
  using Staging = FastFoldSchedule::Staging;
  auto kernel = plan.staging == Staging::kPipelined
                    ? FastFoldKernel<Act, State, K, kMode, Staging::kPipelined>
                : plan.staging == Staging::kOn ? FastFoldKernel<Act, State, K, kMode, Staging::kOn>
                                               : FastFoldKernel<Act, State, K, kMode, Staging::kOff>;
  if (plan.smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(plan.smem));
    if (err != cudaSuccess) return err;
  }
  const dim3 grid(std::min(grid_x, f.rows), ValueHeads(f.shape),
                  (K / FoldRows(K)) * f.num_layers);
  kernel<<<grid, kFoldThreads, plan.smem, stream>>>(f);
  return cudaGetLastError();
}

// The fold schedule of `layers` (rings of one capacity: the kernel interface
// sizes every layer's alike; the largest is planned for) on the current
// device.
absl::StatusOr<FoldLaunchPlan> PlanFoldLaunch(const char* op, const KdaShape& shape,
                                              const FastLayer* layers, int num_layers, int rows,
                                              const FastFoldSchedule& schedule) {
  int sms = 0, smem_optin = 0;
  const cudaError_t err = CurrentDeviceLimits(&sms, &smem_optin);
  if (err != cudaSuccess) return CudaStatus(err, absl::StrCat("In ", op, ": CUDA device query"));
  int capacity = 0;
  for (int l = 0; l < num_layers; ++l) capacity = std::max(capacity, layers[l].rings.capacity);
  return PlanFastFold(shape, capacity, rows, schedule, smem_optin);
}

// Calls launch(f) for the layers `covers` selects, kLayersPerLaunch at a time.
template <typename Covers, typename Launch>
cudaError_t ForLayerBatches(FoldParams f, const FastLayer* layers, int num_layers, Covers covers,
                            Launch launch) {
  f.num_layers = 0;
  for (int l = 0; l < num_layers; ++l) {
    if (!covers(l)) continue;
    f.layers[f.num_layers++] = layers[l];
    if (f.num_layers == kLayersPerLaunch) {
      if (const cudaError_t err = launch(f); err != cudaSuccess) return err;
      f.num_layers = 0;
    }
  }
  return f.num_layers > 0 ? launch(f) : cudaSuccess;
}

absl::Status LaunchFastCommit(const FastCommitArgs& a, cudaStream_t stream,
                              const FastFoldSchedule& schedule) {
  constexpr const char* op = "FastCommit";
  if (a.num_rows == 0) return absl::OkStatus();
  const absl::StatusOr<FoldLaunchPlan> plan =
      PlanFoldLaunch(op, a.shape, a.layers, a.num_layers, a.num_rows, schedule);
  if (!plan.ok()) return plan.status();
  FoldParams f{};
  f.shape = a.shape;
  f.spec_query_len = a.spec_query_len;
  f.rows = a.num_rows;
  f.plan = a.plan;
  f.plan_args = PlanArgsOf(a);
  f.gate = a.gate;
  const cudaError_t err = ForLayerBatches(
      f, a.layers, a.num_layers, [](int) { return true; }, [&](const FoldParams& batch) {
        cudaError_t e = cudaSuccess;
        DispatchKda(a.shape, [&](auto act, auto state, auto head_dim) {
          using Act = typename decltype(act)::type;
          using State = typename decltype(state)::type;
          constexpr int K = decltype(head_dim)::value;
          // The plan's blocks per (head, tile), striding over the rows
          // (fold_plan.h: 16 unstaged keep a no-fold commit at a few
          // microseconds and still fill the GPU when every row folds).
          e = LaunchFold<Act, State, K, FoldMode::kCommit>(batch, *plan, plan->blocks_per_head,
                                                           stream);
        });
        if (e != cudaSuccess) return e;
        const int threads = a.num_rows * batch.num_layers;
        FastCommitCursorKernel<<<(threads + 255) / 256, 256, 0, stream>>>(batch);
        return cudaGetLastError();
      });
  if (err != cudaSuccess) return CudaStatus(err, absl::StrCat("In ", op, ": CUDA kernel launch"));
  return absl::OkStatus();
}

absl::Status LaunchFastMaterialize(const FastMaterializeArgs& a, cudaStream_t stream,
                                   const FastFoldSchedule& schedule) {
  constexpr const char* op = "FastMaterialize";
  const int64_t jobs = a.every_block ? a.layers[0].state.num_blocks : a.num_blocks_given;
  if (jobs == 0) return absl::OkStatus();
  // kAuto's pipeline was measured on Commit's folds; a Materialize list
  // runs a block an entry (one job each: nothing to pipeline), so it stays
  // unstaged unless asked.
  FastFoldSchedule chosen = schedule;
  if (chosen.staging == FastFoldSchedule::Staging::kAuto) {
    chosen.staging = FastFoldSchedule::Staging::kOff;
  }
  const absl::StatusOr<FoldLaunchPlan> plan =
      PlanFoldLaunch(op, a.shape, a.layers, a.num_layers, int(jobs), chosen);
  if (!plan.ok()) return plan.status();
  FoldParams f{};
  f.shape = a.shape;
  f.blocks = a.blocks;
  f.every_block = a.every_block;
  f.rows = static_cast<int>(jobs);
  f.out = a.out;
  f.gate = a.gate;
  const cudaError_t err = ForLayerBatches(
      f, a.layers, a.num_layers, [&](int l) { return a.layer < 0 || l == a.layer; },
      [&](const FoldParams& batch) {
        cudaError_t e = cudaSuccess;
        DispatchKda(a.shape, [&](auto act, auto state, auto head_dim) {
          using Act = typename decltype(act)::type;
          using State = typename decltype(state)::type;
          constexpr int K = decltype(head_dim)::value;
          if (!a.discard || a.out != nullptr) {
            // Every block: strided blocks that test their share in parallel
            // (most rings are empty); a list: a block per entry.
            e = LaunchFold<Act, State, K, FoldMode::kMaterialize>(
                batch, *plan, a.every_block ? kMaterializeFoldGridX : f.rows, stream);
            if (e != cudaSuccess) return;
          }
          if (a.out == nullptr) {
            FastMaterializeCursorKernel<Act>
                <<<dim3(f.rows, batch.num_layers), kThreads, 0, stream>>>(batch, a.discard);
            e = cudaGetLastError();
          }
        });
        return e;
      });
  if (err != cudaSuccess) return CudaStatus(err, absl::StrCat("In ", op, ": CUDA kernel launch"));
  return absl::OkStatus();
}

}  // namespace
}  // namespace fast
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_FAST_CUDA_FOLD_CUH_
