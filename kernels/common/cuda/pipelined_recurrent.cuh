// The production recurrent kernel (stock, verify and replay): a persistent
// grid that keeps memory busy while it computes.
//
// Work item: (layer, row, head, chunk of kRows state rows). Each block of
// kThreads threads takes a contiguous range of items (the four chunks of a
// head usually land in one block, so a head's token inputs are prepared
// once, not once per chunk) and runs them as a
// two-stage pipeline: while item i computes, item i + 1's state slice is on
// its way into shared memory (cp.async: each thread copies exactly the
// quads it will own, so the state needs no block barrier). The grid is as
// large as the GPU holds at once (occupancy x SMs), or the item count when
// smaller, so at N=1 every item has an SM of its own.
//
// The per-token math is kda_math.h's TokenStep, two state rows a lane
// (PipelinedTraits); stock, verify and replay share this template, so
// verify's outputs and the replayed states equal the stock kernel's bit for
// bit. Mode kReplayVerify is DEFERRED's Verify: it reads the pending entries
// of kernels/deferred/pending.h.
//
//   RecurrentLaunch p = VerifyLaunchOf(args);  // recurrent_launch.cuh
//   absl::Status s = LaunchRecurrent<Mode::kVerify>(args.shape, p, 1, stream, "Verify");
#ifndef SPECSTATE_KERNELS_COMMON_CUDA_PIPELINED_RECURRENT_CUH_
#define SPECSTATE_KERNELS_COMMON_CUDA_PIPELINED_RECURRENT_CUH_

#include <cuda_runtime.h>

#include <atomic>
#include <climits>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kernels/checks/commit_plan.h"
#include "kernels/checks/rows.h"
#include "kernels/common/cuda/cp_async.cuh"
#include "kernels/common/cuda/launch.cuh"
#include "kernels/common/cuda/recurrent_launch.cuh"
#include "kernels/deferred/pending.h"
#include "kernels/internal/dispatch.h"
#include "kernels/kda_args.h"
#include "kernels/kda_math.h"
#include "kernels/numeric.h"

namespace specstate {
namespace kernels {
namespace {

// One lane's quad of a state row in a stage buffer, to and from fp32.
template <typename State>
struct StageIo;

template <>
struct StageIo<float> {
  static __device__ __forceinline__ void Copy(float* smem, const float* gmem) {
    CpAsync16(smem, gmem);
  }
  static __device__ __forceinline__ kda::Quad Load(const float* smem) {
    const float4 f = *reinterpret_cast<const float4*>(smem);
    return kda::Quad{{f.x, f.y, f.z, f.w}};
  }
};

template <>
struct StageIo<BFloat16> {
  static __device__ __forceinline__ void Copy(BFloat16* smem, const BFloat16* gmem) {
    CpAsync8(smem, gmem);
  }
  static __device__ __forceinline__ kda::Quad Load(const BFloat16* smem) {
    const uint2 u = *reinterpret_cast<const uint2*>(smem);
    return kda::Quad{{BitsToFloat(u.x << 16), BitsToFloat(u.x & 0xffff0000u),
                      BitsToFloat(u.y << 16), BitsToFloat(u.y & 0xffff0000u)}};
  }
};

// The pipelined kernel's thread layout: 128 threads an item; kLanes128
// lanes share a state row at K <= 128 (twice as many at K = 256, so that a
// lane's share of a row is no larger than at K = 128), and each lane
// holds its share of kRowsPer rows, rows g + r * (128 / kLanes) of the item
// for lane group g. A token input a lane loads from shared memory serves all
// its rows, and a row's sums take log2(kLanes) shuffles: more rows a lane
// means fewer shared-memory loads and fewer items (docs/benchmarks.md).
template <int kLanes128_, int kRowsPer_, int kMinBlocks_>
struct PipelineLayout {
  static constexpr int kLanes128 = kLanes128_;
  static constexpr int kRowsPer = kRowsPer_;
  static constexpr int kMinBlocks = kMinBlocks_;
};

template <int K, typename Layout>
struct PipelinedTraits {
  static constexpr int kThreads = 128;
  static constexpr int kLanes = K >= 256 ? 2 * Layout::kLanes128 : Layout::kLanes128;
  static constexpr int kRowsPer = Layout::kRowsPer;
  static constexpr int kGroups = kThreads / kLanes;  // lane groups
  static constexpr int kRows = kGroups * kRowsPer;   // state rows an item
  static constexpr int kChunks = K / kRows;          // items a head
  static constexpr int kSeg = K / kLanes;            // columns a lane owns
  static_assert(K % kRows == 0 && kSeg % 4 == 0, "the layout does not tile the head");
};

// A stage buffer row holds K state elements and 16 of padding (rows then
// start in different banks).
template <int K>
__host__ __device__ constexpr int StageRowStride() {
  return K + 16;
}

// Shared memory of one block:
//   two stage buffers [kRows][K + 16] State (an item's state slice);
//   two input buffers (a head's raw q, k, g [T][K] and v [T][V], activation
//   dtype): the next head's arrive while the current one's are in use;
//   the prepared inputs q, k, decay [T][K], v [T][V], beta [T] and GDN's
//   gate g [T] (floats); the raw beta [T] and
//   GDN's raw g [T] for verify's records.
template <Mode M, typename Act, typename State, int K, typename Layout>
struct PipelinedSmem {
  static constexpr size_t kStage = sizeof(State) * PipelinedTraits<K, Layout>::kRows * StageRowStride<K>();
  static __host__ __device__ constexpr size_t Inputs(int t) {  // one buffer, bytes, 16-aligned
    return ((sizeof(Act) * size_t(t) * 4 * K + 15) / 16) * 16;
  }
  static __host__ __device__ constexpr size_t Floats(int t) {
    return size_t(t) * (3 * K + K + 1);
  }
  static __host__ __device__ constexpr size_t Bytes(int t) {
    return 2 * kStage + 2 * Inputs(t) + sizeof(float) * (Floats(t) + t) +
           2 * sizeof(Act) * size_t(t) + 16;
  }
};

// What one item is: its coordinates, and where its row's tokens and blocks
// are. A block walks its items in order, so the coordinates advance by
// carries (Advance) instead of being divided out of the item number again:
// 64-bit divisions per item cost more instructions than a token step.
struct PipelinedItem {
  int layer, n, h, chunk;
  int64_t bos;
  int tokens;
  int32_t source;
  const int32_t* idx;  // the row's indices (stock and replay store by them)
  int inputs;          // the input buffer holding its head
  int head;            // (layer, n, h) as one number: items of a head share its inputs
  int buffer;          // replay: the records buffer of its tokens
  // kReplayVerify: tokens a commit left pending on the checkpoint, replayed
  // first from record tokens [pending_bos, pending_bos + pending).
  int pending;
  int64_t pending_bos;
  __host__ __device__ int total() const { return pending + tokens; }
  __host__ __device__ bool active() const { return total() > 0 && internal::IsBlock(source); }
};

// Where one of an item's tokens is read: through which view, at which token.
struct TokenSource {
  const LayerView* view;
  int64_t token;
};

// Fills the row-dependent fields of `it` from its coordinates.
template <Mode M>
__device__ __forceinline__ void LocateRow(const RecurrentLaunch& p, PipelinedItem& it) {
  it.head = (it.layer * p.num_rows + it.n) * p.num_heads + it.h;
  it.inputs = 0;
  it.buffer = 0;
  it.pending = 0;
  it.pending_bos = 0;
  if (M == Mode::kReplay) {
    if (p.jobs != nullptr) {  // row n is job n, of its own layer and records
      const ReplayJob& job = p.jobs[it.n];
      it.layer = job.layer;
      it.head = it.n * p.num_heads + it.h;
      it.idx = job.indices;
      it.bos = int64_t{job.record_row} * p.window;
      it.buffer = job.buffer;
    } else {
      it.idx = p.indices + it.n * p.indices_stride;
      it.bos = int64_t{it.n} * p.window;
    }
    it.source = it.idx[p.window];
    it.tokens = internal::ReplayTokens(it.idx, p.window);
  } else {
    it.idx = p.indices + it.n * p.indices_stride;
    it.bos = p.qsl[it.n];
    it.tokens = static_cast<int>(p.qsl[it.n + 1] - it.bos);
    const int first_col =
        (M == Mode::kStock && p.num_accepted != nullptr) ? p.num_accepted[it.n] - 1 : 0;
    it.source = it.total() > 0 || M == Mode::kReplayVerify ? it.idx[first_col] : kNullBlock;
    if (M == Mode::kReplayVerify) {
      const int32_t entry = p.replay_plan[it.n];
      if (entry != 0) {
        const deferred::PendingEntry e = deferred::UnpackPending(entry);
        it.pending = e.tokens;
        it.pending_bos = int64_t{e.record_row} * p.window;
      }
    }
  }
}

// Item number `item` (fewer than 2^31 items: the launcher checks).
template <Mode M, int kChunks>
__device__ __forceinline__ PipelinedItem ItemOf(const RecurrentLaunch& p, int item) {
  PipelinedItem it;
  it.chunk = item % kChunks;
  item /= kChunks;
  it.h = item % p.num_heads;
  item /= p.num_heads;
  it.n = item % p.num_rows;
  it.layer = item / p.num_rows;
  LocateRow<M>(p, it);
  return it;
}

// The item after `it`.
template <Mode M, int kChunks>
__device__ __forceinline__ PipelinedItem Advance(const RecurrentLaunch& p, PipelinedItem it) {
  if (++it.chunk < kChunks) {
    it.inputs = 0;
    return it;
  }
  it.chunk = 0;
  if (++it.h == p.num_heads) {
    it.h = 0;
    if (++it.n == p.num_rows) {
      it.n = 0;
      ++it.layer;
    }
  }
  LocateRow<M>(p, it);
  return it;
}

// K = 256 holds twice the state per thread, and its shared memory fits two
// blocks an SM: it gets the registers of two.
template <int K, typename Layout>
constexpr int PipelinedMinBlocks() {
  return K >= 256 ? 2 : Layout::kMinBlocks;
}

template <Mode M, typename Act, typename State, int K, typename Layout>
__global__ void __launch_bounds__(PipelinedTraits<K, Layout>::kThreads, (PipelinedMinBlocks<K, Layout>()))
    PipelinedRecurrentKernel(const RecurrentLaunch p, int num_items) {
  using Traits = PipelinedTraits<K, Layout>;
  constexpr int kLanes = Traits::kLanes;
  constexpr int kThreads = Traits::kThreads;
  constexpr int kRows = Traits::kRows;
  constexpr int kRowsPer = Traits::kRowsPer;
  constexpr int kGroups = Traits::kGroups;
  constexpr int V = K;
  constexpr int kSeg = Traits::kSeg;
  constexpr int kChunks = Traits::kChunks;
  constexpr int kStride = StageRowStride<K>();
  constexpr int kPerCopy = 16 / sizeof(Act);  // elements of one 16-byte copy
  static_assert(K % kPerCopy == 0, "a head slice is whole 16-byte copies");
  constexpr bool kWantOutput = M != Mode::kReplay;
  constexpr bool kRecords = M == Mode::kVerify || M == Mode::kReplayVerify;
  using Smem = PipelinedSmem<M, Act, State, K, Layout>;
  // Launched as a dependent of the call's check kernel: everything it
  // writes (the status, Verify's first snapshot, the commit plan) is read
  // only after the wait. Verify's later calls load their first item first.
  constexpr bool kMayLoadEarly = M == Mode::kVerify || M == Mode::kReplayVerify;
  if (!(kMayLoadEarly && p.early_loads)) WaitForPrerequisiteGrid();
  // A replay list's length is known on the device only (written by the
  // call's first kernel, which also failed the call or not).
  if (M == Mode::kReplay && p.jobs != nullptr) {
    if (p.status->failed) return;
    const int jobs = *p.job_count < p.num_rows ? *p.job_count : p.num_rows;
    num_items = jobs * p.num_heads * kChunks;
  }

  // This block's items: a contiguous range.
  const int per_block = (num_items + gridDim.x - 1) / gridDim.x;
  const int first = blockIdx.x * per_block;
  const int last = first + per_block < num_items ? first + per_block : num_items;
  if (first >= last) return;

  const int tid = threadIdx.x;
  const int group = tid / kLanes;  // this thread's rows: group + r * kGroups
  const int lane = tid % kLanes;
  const int T = p.max_tokens;
  const int H = p.num_heads;          // value heads: the items'
  const int Hk = p.num_key_heads;     // key heads: q, k (and KDA's g)
  const int per_key = H / Hk;         // value heads per key head
  const bool gdn = p.kind == LayerKind::kGdn;
  // Where the window's records go: verify's records; kReplayVerify's, the
  // buffer that does not hold the pending tokens, which it reads through
  // `pending_view`.
  const int pending_buffer = M == Mode::kReplayVerify ? *p.pending_buffer : 0;
  Act* const rec_kv = static_cast<Act*>(
      M == Mode::kReplayVerify ? p.records[1 - pending_buffer].kv : p.layer.rec_kv);
  Act* const rec_g = static_cast<Act*>(
      M == Mode::kReplayVerify ? p.records[1 - pending_buffer].g : p.layer.rec_g);
  Act* const rec_beta = static_cast<Act*>(
      M == Mode::kReplayVerify ? p.records[1 - pending_buffer].beta : p.layer.rec_beta);
  LayerView pending_view{};
  if constexpr (M == Mode::kReplayVerify) {
    pending_view = RecordsView<Act>(p.records[pending_buffer], p, K);
  }
  const bool records_aligned =
      kRecords &&
      ((reinterpret_cast<uintptr_t>(rec_kv) | reinterpret_cast<uintptr_t>(rec_g)) % 16) == 0;

  extern __shared__ float4 smem_raw[];
  char* const base = reinterpret_cast<char*>(smem_raw);
  // Stage buffer b, and input buffer b (q, k, g [T][K] then v [T][V], raw),
  // as offsets from `base` (not an array of pointers, which the compiler
  // turns into generic loads: slower than shared-memory ones).
  const auto stage = [&](int b) {
    return reinterpret_cast<State*>(base + (b ? Smem::kStage : 0));
  };
  const auto inputs = [&](int b) {
    return reinterpret_cast<Act*>(base + 2 * Smem::kStage + (b ? Smem::Inputs(T) : 0));
  };
  float* const sq = reinterpret_cast<float*>(base + 2 * Smem::kStage + 2 * Smem::Inputs(T));
  float* const sk = sq + T * K;
  float* const sdecay = sk + T * K;
  float* const sv = sdecay + T * K;  // [T][V]
  float* const sbeta = sv + T * V;
  float* const sg = sbeta + T;                           // GDN's g
  Act* const raw_beta = reinterpret_cast<Act*>(sg + T);  // verify's records
  Act* const raw_g = raw_beta + T;                       // GDN's, for the records

  // The layer's view: stock and verify have one (in the launch's
  // parameters); replay reads its layer's (and records buffer's) when they
  // change.
  LayerView replay_view{};
  int view_key = -1;
  const auto view_of = [&](const PipelinedItem& it) -> const LayerView& {
    if constexpr (M == Mode::kReplay) {
      if (2 * it.layer + it.buffer != view_key) {
        replay_view = ReplayView<Act>(p.replay_layers[it.layer], it.buffer, p, K);
        view_key = 2 * it.layer + it.buffer;
      }
      return replay_view;
    } else {
      return p.layer;
    }
  };
  // A view for the copies of another item than the current one (replay:
  // its layer's, by value, so that the current item's view stays).
  const auto fetch_view = [&](const PipelinedItem& it) -> LayerView {
    if constexpr (M == Mode::kReplay) {
      return ReplayView<Act>(p.replay_layers[it.layer], it.buffer, p, K);
    } else {
      return p.layer;
    }
  };
  // Token t of item `it`'s (pending tokens first, then its window): the view
  // it is read through and its token index there.
  const auto token_source = [&](const PipelinedItem& it, const LayerView& view,
                                int t) -> TokenSource {
    if (M == Mode::kReplayVerify && t < it.pending) {
      return TokenSource{&pending_view, it.pending_bos + t};
    }
    return TokenSource{&view, it.bos + (t - it.pending)};
  };

  // Starts the copy of item `it`'s state slice (this thread's quads of its
  // rows) into `dst`.
  const auto fetch_state = [&](const PipelinedItem& it, const LayerView& view, State* dst) {
#pragma unroll
    for (int r = 0; r < kRowsPer; ++r) {
      const int row = group + r * kGroups;
      const int v = it.chunk * kRows + row;
      const State* src = static_cast<const State*>(view.state) +
                         int64_t{it.source} * view.block_stride + (int64_t{it.h} * V + v) * K;
#pragma unroll
      for (int i = 0; i < kSeg / 4; ++i) {
        const int col = kda::QuadColumn<kLanes>(lane, i);
        StageIo<State>::Copy(dst + row * kStride + col, src + col);
      }
    }
  };
  // Starts the copy of item `it`'s head's raw q, k, g and v into `dst`
  // (16 bytes at a time), or loads them when they are not 16-byte aligned.
  const auto fetch_inputs = [&](const PipelinedItem& it, const LayerView& view, Act* dst) {
    const int pieces = it.total() * (K / kPerCopy);
    const int64_t kh = it.h / per_key;
#pragma unroll
    for (int which = 0; which < 4; ++which) {  // 0 q, 1 k, 2 g (KDA), 3 v
      if (which == 2 && gdn) continue;
      for (int y = tid; y < pieces; y += kThreads) {
        const int t = y / (K / kPerCopy);
        const int j = (y % (K / kPerCopy)) * kPerCopy;
        const TokenSource ts = token_source(it, view, t);
        const LayerView* const from = ts.view;
        const int64_t tok = ts.token;
        const Act* src =
            which == 0   ? static_cast<const Act*>(from->q) + tok * from->q_stride + kh * K + j
            : which == 1 ? static_cast<const Act*>(from->k) + tok * from->k_stride + kh * K + j
            : which == 2 ? static_cast<const Act*>(from->g) + (tok * Hk + kh) * K + j
                         : static_cast<const Act*>(from->v) + tok * from->v_stride +
                               int64_t{it.h} * V + j;
        Act* out = dst + (which * T + t) * K + j;
        if (p.async_inputs) {
          CpAsync16(out, src);
        } else {
#pragma unroll
          for (int e = 0; e < kPerCopy; ++e) out[e] = src[e];
        }
      }
    }
  };

  static_assert(kMaxSpecQueryLen <= kThreads, "a thread holds each token's beta");
  Act held_beta[2] = {}, held_g[2] = {};  // per input buffer (indexed by constants only)
  PipelinedItem cur = ItemOf<M, kChunks>(p, first);
  int fetched_key = -1;  // the head whose inputs were copied last, into fetched_buf
  int fetched_buf = 1;
  const auto fetch = [&](PipelinedItem& it, int stage_index, bool with_state = true) {
    if (!it.active()) return;
    const LayerView view = fetch_view(it);
    if (with_state) fetch_state(it, view, stage(stage_index));
    if (it.head != fetched_key) {
      // The other buffer: its head's last reader passed the barrier of the
      // prepared head's set-up (see below) before this is issued.
      fetched_buf ^= 1;
      fetched_key = it.head;
      fetch_inputs(it, view, inputs(fetched_buf));
      // Token t's beta (and GDN's g) into thread t's registers, an item
      // ahead of their use like the copies.
      if (tid < it.total()) {
        const TokenSource ts = token_source(it, view, tid);
        const LayerView* const from = ts.view;
        const int64_t tok = ts.token;
        const Act b = static_cast<const Act*>(from->beta)[tok * from->beta_stride + it.h];
        const Act gg = gdn ? static_cast<const Act*>(from->g)[tok * H + it.h] : Act{};
        if (fetched_buf) {
          held_beta[1] = b;
          held_g[1] = gg;
        } else {
          held_beta[0] = b;
          held_g[0] = gg;
        }
      }
    }
    it.inputs = fetched_buf;
  };
  // Without early loads the checks have finished (the wait above): a failed
  // call loads nothing. Early loads (Verify against the step's snapshot,
  // before the check kernel is done) stay inside the call's tensors whatever
  // the indices say: bounded here, decided by the check after the wait.
  const bool early = kMayLoadEarly && p.early_loads;
  if (!early && p.status->failed) return;
  if (M == Mode::kReplayVerify && early) {
    // Only the checkpoint goes early: which tokens a row replays (and so
    // which inputs it needs) is known once the checks have taken them.
    const bool state_early = internal::IsBlock(cur.source) && cur.source < p.num_blocks;
    if (state_early) fetch_state(cur, p.layer, stage(0));
    CpAsyncCommit();
    WaitForPrerequisiteGrid();
    if (p.status->failed) {
      CpAsyncWait<0>();
      return;
    }
    const int32_t early_source = state_early ? cur.source : kNullBlock;
    cur = ItemOf<M, kChunks>(p, first);  // with its replay plan
    if (cur.active()) fetch(cur, 0, /*with_state=*/cur.source != early_source);
    CpAsyncCommit();
  } else if (!early || (cur.tokens <= p.window && cur.bos >= 0 &&
                        cur.bos + cur.tokens <= p.num_tokens && cur.source < p.num_blocks)) {
    fetch(cur, 0);
    CpAsyncCommit();
  } else {
    cur.tokens = 0;  // reloaded below, after the wait
    CpAsyncCommit();
  }
  if (M == Mode::kVerify && early) {
    WaitForPrerequisiteGrid();
    if (p.status->failed) {
      CpAsyncWait<0>();
      return;
    }
    if (cur.tokens == 0) {
      cur = ItemOf<M, kChunks>(p, first);  // the checks passed: these values are valid
      if (cur.active()) fetch(cur, 0);
      CpAsyncCommit();
    }
  }
  int prepared = -1;  // the head whose inputs are prepared in shared memory
  int s = 0;
  for (int item = first; item < last; ++item) {
    const LayerView& view = view_of(cur);
    const int h = cur.h;
    const int tokens = cur.tokens;  // the window's (verify), after `pending` replayed ones
    const int pending = cur.pending;
    const int total = cur.total();
    const int64_t bos = cur.bos;
    const int64_t rec0 = int64_t{cur.n} * p.window;
    const Act* const raw = inputs(cur.inputs);
    const int kh = h / per_key;
    if (cur.active() && cur.head != prepared) {
      // Everything this block copied for this item has landed, and every
      // thread is done with the previous head.
      CpAsyncWait<0>();
      __syncthreads();
      const kda::GateRule rule{p.kind, p.gate, gdn ? 0.0f : expf(view.a_log[kh]), p.lower_bound};
      // Per token: beta, and GDN's scalar gate.
      if (tid < total) {
        const int t = tid;
        const Act b_raw = cur.inputs ? held_beta[1] : held_beta[0];
        sbeta[t] = rule.Beta(ToFloat(b_raw));
        if (kRecords) raw_beta[t] = b_raw;
        if (gdn) {
          const Act g_raw = cur.inputs ? held_g[1] : held_g[0];
          sg[t] = ToFloat(g_raw);
          if (kRecords) raw_g[t] = g_raw;
        }
      }
      if (gdn) __syncthreads();
      // Warp w prepares tokens w, w + 4, ...: lane l holds columns
      // l + 32 c, sums their squares and adds the sums over the warp, then
      // writes the normalized q and k, the decay factors and v.
      const float scale = kda::QueryScale(K);
      for (int t = tid / 32; t < total; t += kThreads / 32) {
        constexpr int kPerLane = K / 32;
        float xq[kPerLane], xk[kPerLane];
        float sum_q = 0.0f, sum_k = 0.0f;
#pragma unroll
        for (int c = 0; c < kPerLane; ++c) {
          const int j = (tid & 31) + 32 * c;
          xq[c] = ToFloat(raw[(0 * T + t) * K + j]);
          xk[c] = ToFloat(raw[(1 * T + t) * K + j]);
          sum_q = kda::MulAdd(xq[c], xq[c], sum_q);
          sum_k = kda::MulAdd(xk[c], xk[c], sum_k);
        }
        const float norm_q = kda::L2Norm(WarpSum(sum_q));
        const float norm_k = kda::L2Norm(WarpSum(sum_k));
#pragma unroll
        for (int c = 0; c < kPerLane; ++c) {
          const int j = (tid & 31) + 32 * c;
          sq[t * K + j] = kda::Normalize(xq[c], norm_q, scale);
          sk[t * K + j] = kda::Normalize(xk[c], norm_k, 1.0f);
          sdecay[t * K + j] =
              gdn ? rule.Decay(sg[t], 0.0f)
                  : rule.Decay(ToFloat(raw[(2 * T + t) * K + j]), view.dt_bias[kh * K + j]);
          sv[t * V + j] = ToFloat(raw[(3 * T + t) * K + j]);  // V = K
        }
      }
      __syncthreads();
      prepared = cur.head;
    }

    // The next item's state (and its head's inputs when it starts a head)
    // are on their way while this one computes.
    PipelinedItem next{};
    next.tokens = 0;
    if (item + 1 < last) {
      next = Advance<M, kChunks>(p, cur);
      fetch(next, s ^ 1);
    }
    CpAsyncCommit();
    if (!cur.active()) {
      cur = next;
      s ^= 1;
      continue;
    }

    // Records (verify): the row's raw inputs, bit for bit, each token's
    // [H * K + HV * V] of kv: k (and KDA's g) once per key head (by chunk 0
    // of its first value head), beta (and GDN's g) by chunk 0 of each value
    // head, v by each chunk for its rows. (kReplayVerify: the window's
    // tokens, after the pending ones in the shared-memory buffers.)
    if (kRecords) {
      // (Shadows the item's `raw`: token t of the window at raw + t * K.)
      const Act* const raw = inputs(cur.inputs) + pending * K;
      const Act* const raw_beta_w = raw_beta + pending;
      const Act* const raw_g_w = raw_g + pending;
      const int64_t width = int64_t{Hk} * K + int64_t{H} * V;
      // 16 bytes at a time where the records allow (service-owned records
      // are 256-byte aligned; the shared-memory side always is).
      constexpr int kPer = 16 / sizeof(Act);
      const auto copy16 = [](Act* dst, const Act* src) {
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
      };
      if (cur.chunk == 0 && h % per_key == 0) {
        if (records_aligned) {
          for (int x = tid; x < tokens * (K / kPer); x += kThreads) {
            const int t = x / (K / kPer);
            const int j = (x % (K / kPer)) * kPer;
            copy16(rec_kv + (rec0 + t) * width + int64_t{kh} * K + j, raw + (1 * T + t) * K + j);
            if (!gdn) copy16(rec_g + ((rec0 + t) * Hk + kh) * K + j, raw + (2 * T + t) * K + j);
          }
        } else {
          for (int x = tid; x < tokens * K; x += kThreads) {
            const int t = x / K;
            rec_kv[(rec0 + t) * width + int64_t{kh} * K + x % K] = raw[(1 * T + t) * K + x % K];
            if (!gdn) rec_g[((rec0 + t) * Hk + kh) * K + x % K] = raw[(2 * T + t) * K + x % K];
          }
        }
      }
      if (cur.chunk == 0) {
        for (int t = tid; t < tokens; t += kThreads) {
          rec_beta[(rec0 + t) * H + h] = raw_beta_w[t];
          if (gdn) rec_g[(rec0 + t) * H + h] = raw_g_w[t];
        }
      }
      Act* const rec_v = rec_kv + int64_t{Hk} * K + int64_t{h} * V + cur.chunk * kRows;
      const Act* const raw_v = raw + 3 * T * K + cur.chunk * kRows;
      if (records_aligned) {
        for (int x = tid; x < tokens * (kRows / kPer); x += kThreads) {
          const int t = x / (kRows / kPer);
          const int v = (x % (kRows / kPer)) * kPer;
          copy16(rec_v + (rec0 + t) * width + v, raw_v + t * K + v);
        }
      } else {
        for (int x = tid; x < tokens * kRows; x += kThreads) {
          const int t = x / kRows;
          rec_v[(rec0 + t) * width + x % kRows] = raw_v[t * K + x % kRows];
        }
      }
    }

    // The state slice, once this thread's copies of it have landed.
    CpAsyncWait<1>();
    float st[kRowsPer * kSeg];
#pragma unroll
    for (int r = 0; r < kRowsPer; ++r) {
      const State* const mine = stage(s) + (group + r * kGroups) * kStride;
#pragma unroll
      for (int i = 0; i < kSeg / 4; ++i) {
        const kda::Quad quad = StageIo<State>::Load(mine + kda::QuadColumn<kLanes>(lane, i));
#pragma unroll
        for (int c = 0; c < 4; ++c) st[r * kSeg + 4 * i + c] = quad.x[c];
      }
    }

    const int v0 = cur.chunk * kRows + group;  // row r is v0 + r * kGroups
    State* const state = static_cast<State*>(view.state);
    // This item's rows of block `dst` get the state in registers.
    const auto store_state = [&](int32_t dst) {
#pragma unroll
      for (int r = 0; r < kRowsPer; ++r) {
        State* d =
            state + int64_t{dst} * view.block_stride + (int64_t{h} * V + v0 + r * kGroups) * K;
#pragma unroll
        for (int i = 0; i < kSeg / 4; ++i) {
          StateIo<State>::Store(d + kda::QuadColumn<kLanes>(lane, i), st + r * kSeg + 4 * i);
        }
      }
    };
    // kReplayVerify: the pending tokens first, exactly as the commit's
    // replay runs them (no outputs), then the checkpoint is stored once and
    // the state continues as a later Verify would load it (rounded to the
    // state dtype); kVerify has none.
    if constexpr (M == Mode::kReplayVerify) {
      for (int t = 0; t < pending; ++t) {
        const kda::TokenInputs tok{sq + t * K, sk + t * K, sdecay + t * K, sbeta[t]};
        float vin[kRowsPer], o[kRowsPer];
#pragma unroll
        for (int r = 0; r < kRowsPer; ++r) vin[r] = sv[t * V + v0 + r * kGroups];
        kda::TokenStep<kSeg, kLanes, kRowsPer>(
            st, lane, tok, vin, [](float x) { return LaneSum<kLanes>(x); }, false, o);
      }
      if (pending > 0) {
        store_state(cur.source);
#pragma unroll
        for (int i = 0; i < kRowsPer * kSeg; ++i) st[i] = ToFloat(FromFloat<State>(st[i]));
      }
    }
    // This item's outputs of token t: out_item[t * H * V + r * kGroups].
    Act* const out_item = static_cast<Act*>(view.out) + (bos * H + h) * V + v0;
    for (int t = 0; t < tokens; ++t) {
      const int at = pending + t;  // its inputs in shared memory
      const kda::TokenInputs tok{sq + at * K, sk + at * K, sdecay + at * K, sbeta[at]};
      float vin[kRowsPer], o[kRowsPer];
#pragma unroll
      for (int r = 0; r < kRowsPer; ++r) vin[r] = sv[at * V + v0 + r * kGroups];
      kda::TokenStep<kSeg, kLanes, kRowsPer>(
          st, lane, tok, vin, [](float x) { return LaneSum<kLanes>(x); }, kWantOutput, o);
      if (kWantOutput && lane == 0) {
#pragma unroll
        for (int r = 0; r < kRowsPer; ++r) {
          out_item[int64_t{t} * H * V + r * kGroups] = FromFloat<Act>(o[r]);
        }
      }
      if (!kRecords) {
        const int32_t dst = cur.idx[t];
        if (internal::IsBlock(dst)) store_state(dst);
      }
    }
    cur = next;
    s ^= 1;
  }
  CpAsyncWait<0>();
}

// Launches the pipelined kernel over every item of `num_layers` layers,
// with as many blocks as the GPU runs at once (or one per item).
template <Mode M, typename Act, typename State, int K, typename Layout>
cudaError_t LaunchPipelined(const RecurrentLaunch& p, int num_layers, cudaStream_t stream) {
  constexpr int kChunks = PipelinedTraits<K, Layout>::kChunks;
  const int64_t items = int64_t{num_layers} * p.num_rows * p.num_heads * kChunks;
  if (items == 0) return cudaSuccess;
  if (items > INT_MAX) return cudaErrorInvalidValue;  // int item numbers
  const size_t smem = PipelinedSmem<M, Act, State, K, Layout>::Bytes(p.max_tokens);
  auto kernel = PipelinedRecurrentKernel<M, Act, State, K, Layout>;
  // Per (device, token window): the attribute and the occupancy, once.
  static std::atomic<int> resident[16][kMaxSpecQueryLen + 1] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < 0 || device >= 16 || p.max_tokens < 1 || p.max_tokens > kMaxSpecQueryLen) {
    return cudaErrorInvalidValue;
  }
  int blocks_at_once = resident[device][p.max_tokens].load(std::memory_order_relaxed);
  if (blocks_at_once == 0) {
    // A failed query must not linger as the thread's last error (the next
    // launch's check would report it).
    const auto failed = [](cudaError_t e) {
      cudaGetLastError();
      return e;
    };
    // The attribute is the most any launch of the kernel may use: set for the
    // longest window the device's shared memory holds, so that no window's
    // launch exceeds another's setting.
    int optin = 0, sms = 0;
    err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (err != cudaSuccess) return failed(err);
    const size_t most = PipelinedSmem<M, Act, State, K, Layout>::Bytes(kMaxSpecQueryLen);
    if (smem > size_t(optin)) return cudaErrorInvalidValue;  // this window does not fit
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               int(most < size_t(optin) ? most : size_t(optin)));
    if (err != cudaSuccess) return failed(err);
    int per_sm = 0;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel,
                                                        PipelinedTraits<K, Layout>::kThreads, smem);
    if (err != cudaSuccess) return failed(err);
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return failed(err);
    if (per_sm < 1) return cudaErrorInvalidConfiguration;
    blocks_at_once = per_sm * sms;
    resident[device][p.max_tokens].store(blocks_at_once, std::memory_order_relaxed);
  }
  const int cap = p.small_grid ? blocks_at_once / PipelinedMinBlocks<K, Layout>() : blocks_at_once;
  const int64_t blocks = items < cap ? items : cap;
  err = LaunchDependent(kernel, static_cast<unsigned>(blocks), PipelinedTraits<K, Layout>::kThreads, smem,
                        stream, p, static_cast<int>(items));
  return err != cudaSuccess ? err : cudaGetLastError();
}

// The pipelined kernel served: 8 lanes a row, 2 rows a lane, 4 blocks of
// 128 threads per SM (shared memory holds two stage buffers each; 128
// registers a thread).
using PipelinedLayout = PipelineLayout<8, 2, 4>;

// The recurrent kernel in mode M over `num_layers` layers' items of `p`,
// for the call's dtypes and head dim; errors named after `op`.
template <Mode M>
absl::Status LaunchRecurrent(const KdaShape& shape, const RecurrentLaunch& p, int num_layers,
                             cudaStream_t stream, absl::string_view op) {
  cudaError_t err = cudaErrorInvalidValue;
  const bool ok = internal::DispatchKda(shape, [&](auto act, auto state, auto head_dim) {
    err = LaunchPipelined<M, typename decltype(act)::type, typename decltype(state)::type,
                          decltype(head_dim)::value, PipelinedLayout>(p, num_layers, stream);
  });
  return ok ? LaunchStatus(err, op) : Unsupported(op);
}

}  // namespace
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_COMMON_CUDA_PIPELINED_RECURRENT_CUH_
