// The production recurrent kernel (stock, verify and replay): a persistent
// grid that keeps memory busy while it computes.
//
// Work item: (layer, row, head, chunk of kRows state rows), the old kernel's
// block. Each block of kThreads threads takes a contiguous range of items
// (the four chunks of a head usually land in one block, so a head's token
// inputs are prepared once, not once per chunk) and runs them as a
// two-stage pipeline: while item i computes, item i + 1's state slice is on
// its way into shared memory (cp.async: each thread copies exactly the
// quads it will own, so the state needs no block barrier). The grid is as
// large as the GPU holds at once (occupancy x SMs), or the item count when
// smaller, so at N=1 every item has an SM of its own.
//
// The per-token math is kda_math.h's TokenStep, two state rows a lane
// (PipelinedTraits); stock, verify and replay share this template, so
// verify's outputs and the replayed states equal the stock kernel's bit for
// bit. (Its reduction order over K differs from the one-block-per-item
// kernel's, which has 4 lanes a row: the two agree to rounding, not bits.)
#ifndef SPECSTATE_KERNELS_CUDA_PIPELINED_RECURRENT_CUH_
#define SPECSTATE_KERNELS_CUDA_PIPELINED_RECURRENT_CUH_

namespace specstate {
namespace kernels {
namespace {

__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void CpAsync8(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

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

// The thread layout: 128 threads an item; kLanes lanes share a state row
// (8, or 16 for K = 256, so that a lane's share stays 16 columns), and each
// lane holds its share of kRowsPer = 2 rows, rows g and g + kThreads / kLanes
// of the item for lane group g. A token input a lane loads from shared
// memory serves both rows: half the shared-memory traffic of one row a lane
// (which bounded the kernel: Nsight Compute, docs/benchmarks.md).
template <int K>
struct PipelinedTraits {
  static constexpr int kThreads = 128;
  static constexpr int kLanes = K >= 256 ? 16 : 8;
  static constexpr int kRowsPer = 2;
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
//   the prepared inputs q, k, decay [T][K], v [T][V], beta [T] and the partial
//   squares [2][T][K / 32], GDN's gate g [T] (floats); the raw beta [T] and
//   GDN's raw g [T] for verify's records.
template <Mode M, typename Act, typename State, int K, typename Layout>
struct PipelinedSmem {
  static constexpr size_t kStage = sizeof(State) * PipelinedTraits<K>::kRows * StageRowStride<K>();
  static __host__ __device__ constexpr size_t Inputs(int t) {  // one buffer, bytes, 16-aligned
    return ((sizeof(Act) * size_t(t) * 4 * K + 15) / 16) * 16;
  }
  static __host__ __device__ constexpr size_t Floats(int t) {
    return size_t(t) * (3 * K + K + 1 + 2 * (K / 32));
  }
  static __host__ __device__ constexpr size_t Bytes(int t) {
    return 2 * kStage + 2 * Inputs(t) + sizeof(float) * (Floats(t) + t) +
           2 * sizeof(Act) * size_t(t) + 16;
  }
};

// What one item is: where its row's tokens and blocks are.
struct PipelinedItem {
  int layer, n, h, chunk;
  int64_t bos;
  int tokens;
  int32_t source;
  const int32_t* idx;  // the row's indices (stock and replay store by them)
  int inputs;          // the input buffer holding its head
  __host__ __device__ bool active() const { return tokens > 0 && internal::IsBlock(source); }
};

template <Mode M, int kChunks>
__device__ __forceinline__ PipelinedItem ItemOf(const RecurrentLaunch& p, int64_t item) {
  PipelinedItem it;
  it.chunk = static_cast<int>(item % kChunks);
  item /= kChunks;
  it.h = static_cast<int>(item % p.num_heads);
  item /= p.num_heads;
  it.n = static_cast<int>(item % p.num_rows);
  it.layer = static_cast<int>(item / p.num_rows);
  it.idx = p.indices + it.n * p.indices_stride;
  it.inputs = 0;
  if (M == Mode::kReplay) {
    it.bos = int64_t{it.n} * p.window;
    it.source = it.idx[p.window];
    it.tokens = internal::ReplayTokens(it.idx, p.window);
  } else {
    it.bos = p.qsl[it.n];
    it.tokens = static_cast<int>(p.qsl[it.n + 1] - it.bos);
    const int first_col =
        (M == Mode::kStock && p.num_accepted != nullptr) ? p.num_accepted[it.n] - 1 : 0;
    it.source = it.tokens > 0 ? it.idx[first_col] : kNullBlock;
  }
  return it;
}

// K = 256 holds twice the state per thread, and its shared memory fits two
// blocks an SM: it gets the registers of two.
template <int K, typename Layout>
constexpr int PipelinedMinBlocks() {
  return K >= 256 ? 2 : Layout::kMinBlocks;
}

template <Mode M, typename Act, typename State, int K, typename Layout>
__global__ void __launch_bounds__(PipelinedTraits<K>::kThreads, (PipelinedMinBlocks<K, Layout>()))
    PipelinedRecurrentKernel(const RecurrentLaunch p, int64_t num_items) {
  using Traits = PipelinedTraits<K>;
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
  using Smem = PipelinedSmem<M, Act, State, K, Layout>;
  // Launched as a dependent of the call's check kernel: everything it
  // writes (the status, Verify's first snapshot, the commit plan) is read
  // only after the wait. Verify's later calls load their first item first.
  if (!(M == Mode::kVerify && p.early_loads)) WaitForPrerequisiteGrid();

  // This block's items: a contiguous range.
  const int64_t per_block = (num_items + gridDim.x - 1) / gridDim.x;
  const int64_t first = int64_t{blockIdx.x} * per_block;
  const int64_t last = first + per_block < num_items ? first + per_block : num_items;
  if (first >= last) return;

  const int tid = threadIdx.x;
  const int group = tid / kLanes;  // this thread's rows: group + r * kGroups
  const int lane = tid % kLanes;
  const int T = p.max_tokens;
  const int H = p.num_heads;          // value heads: the items'
  const int Hk = p.num_key_heads;     // key heads: q, k (and KDA's g)
  const int per_key = H / Hk;         // value heads per key head
  const bool gdn = p.kind == LayerKind::kGdn;

  extern __shared__ float4 smem_raw[];
  char* const base = reinterpret_cast<char*>(smem_raw);
  State* const stage[2] = {reinterpret_cast<State*>(base),
                           reinterpret_cast<State*>(base + Smem::kStage)};
  // Input buffer b: q, k, g [T][K] then v [T][V], raw.
  Act* const inputs[2] = {reinterpret_cast<Act*>(base + 2 * Smem::kStage),
                          reinterpret_cast<Act*>(base + 2 * Smem::kStage + Smem::Inputs(T))};
  float* const sq = reinterpret_cast<float*>(base + 2 * Smem::kStage + 2 * Smem::Inputs(T));
  float* const sk = sq + T * K;
  float* const sdecay = sk + T * K;
  float* const sv = sdecay + T * K;  // [T][V]
  float* const sbeta = sv + T * V;
  float* const spart_q = sbeta + T;
  float* const spart_k = spart_q + T * (K / 32);
  float* const sg = spart_k + T * (K / 32);              // GDN's g
  Act* const raw_beta = reinterpret_cast<Act*>(sg + T);  // verify's records
  Act* const raw_g = raw_beta + T;                       // GDN's, for the records

  // The layer's view: stock and verify have one (in the launch's
  // parameters); replay reads its layer's when the layer changes.
  LayerView replay_view{};
  int view_layer = -1;
  const auto view_of = [&](int layer) -> const LayerView& {
    if constexpr (M == Mode::kReplay) {
      if (layer != view_layer) {
        replay_view = ReplayView<Act>(p.replay_layers[layer], p, K);
        view_layer = layer;
      }
      return replay_view;
    } else {
      return p.layer;
    }
  };
  // A view for the copies of another item than the current one (replay:
  // its layer's, by value, so that the current item's view stays).
  const auto fetch_view = [&](int layer) -> LayerView {
    if constexpr (M == Mode::kReplay) {
      return ReplayView<Act>(p.replay_layers[layer], p, K);
    } else {
      return p.layer;
    }
  };
  const auto head_key = [&](const PipelinedItem& it) {
    return (int64_t{it.layer} * p.num_rows + it.n) * H + it.h;
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
    const Act* const q = static_cast<const Act*>(view.q);
    const Act* const k = static_cast<const Act*>(view.k);
    const Act* const g = static_cast<const Act*>(view.g);
    const Act* const v = static_cast<const Act*>(view.v);
    const int pieces = it.tokens * (K / kPerCopy);
    const int64_t kh = it.h / per_key;
    for (int x = tid; x < 4 * pieces; x += kThreads) {
      const int which = x / pieces;  // 0 q, 1 k, 2 g (KDA), 3 v
      if (which == 2 && gdn) continue;
      const int y = x % pieces;
      const int t = y / (K / kPerCopy);
      const int j = (y % (K / kPerCopy)) * kPerCopy;
      const int64_t tok = it.bos + t;
      const Act* src = which == 0   ? q + tok * view.q_stride + kh * K + j
                       : which == 1 ? k + tok * view.k_stride + kh * K + j
                       : which == 2 ? g + (tok * Hk + kh) * K + j
                                    : v + tok * view.v_stride + int64_t{it.h} * V + j;
      Act* out = dst + (which * T + t) * K + j;
      if (p.async_inputs) {
        CpAsync16(out, src);
      } else {
#pragma unroll
        for (int e = 0; e < kPerCopy; ++e) out[e] = src[e];
      }
    }
  };

  PipelinedItem cur = ItemOf<M, kChunks>(p, first);
  int64_t fetched_key = -1;  // the head whose inputs were copied last, into fetched_buf
  int fetched_buf = 1;
  const auto fetch = [&](PipelinedItem& it, int stage_index) {
    if (!it.active()) return;
    const LayerView view = fetch_view(it.layer);
    fetch_state(it, view, stage[stage_index]);
    if (head_key(it) != fetched_key) {
      // The other buffer: its head's last reader passed the barrier of the
      // prepared head's set-up (see below) before this is issued.
      fetched_buf ^= 1;
      fetched_key = head_key(it);
      fetch_inputs(it, view, inputs[fetched_buf]);
    }
    it.inputs = fetched_buf;
  };
  // Early loads (before the check kernel is done) stay inside the call's
  // tensors whatever the indices say: bounded here, decided by the check.
  const bool early = M == Mode::kVerify && p.early_loads;
  if (!early || (cur.tokens <= p.window && cur.bos >= 0 && cur.bos + cur.tokens <= p.num_tokens &&
                 cur.source < p.num_blocks)) {
    fetch(cur, 0);
  } else {
    cur.tokens = 0;  // reloaded below, after the wait
  }
  CpAsyncCommit();
  if (early) {
    WaitForPrerequisiteGrid();
    if (cur.tokens == 0) cur = ItemOf<M, kChunks>(p, first);  // let the checks decide
  }
  if (p.status->failed) {
    CpAsyncWait<0>();
    return;
  }
  if (early && cur.active() && fetched_key < 0) {
    fetch(cur, 0);  // its early loads were out of bounds, yet it passed the checks
    CpAsyncCommit();
  }
  int64_t prepared = -1;  // the head whose inputs are prepared in shared memory
  int s = 0;
  for (int64_t item = first; item < last; ++item) {
    const LayerView& view = view_of(cur.layer);
    const int h = cur.h;
    const int tokens = cur.tokens;
    const int64_t bos = cur.bos;
    const int64_t rec0 = int64_t{cur.n} * p.window;
    const Act* const raw = inputs[cur.inputs];
    const int kh = h / per_key;
    if (cur.active() && head_key(cur) != prepared) {
      // Everything this block copied for this item has landed, and every
      // thread is done with the previous head.
      CpAsyncWait<0>();
      __syncthreads();
      const kda::GateRule rule{p.kind, p.gate, gdn ? 0.0f : expf(view.a_log[kh]), p.lower_bound};
      // Per token: beta, and GDN's scalar gate.
      for (int t = tid; t < tokens; t += kThreads) {
        const Act b_raw = static_cast<const Act*>(view.beta)[(bos + t) * view.beta_stride + h];
        sbeta[t] = rule.Beta(ToFloat(b_raw));
        if (M == Mode::kVerify) raw_beta[t] = b_raw;
        if (gdn) {
          const Act g_raw = static_cast<const Act*>(view.g)[(bos + t) * H + h];
          sg[t] = ToFloat(g_raw);
          if (M == Mode::kVerify) raw_g[t] = g_raw;
        }
      }
      if (gdn) __syncthreads();
      // The decay factors and per-warp partial sums of squares (K is a
      // multiple of 32: the 32 items of a warp share one token).
      for (int x = tid; x < tokens * K; x += kThreads) {
        const int t = x / K;
        const int j = x % K;
        const float xq = ToFloat(raw[(0 * T + t) * K + j]);
        const float xk = ToFloat(raw[(1 * T + t) * K + j]);
        sq[x] = xq;
        sk[x] = xk;
        sdecay[x] = gdn ? rule.Decay(sg[t], 0.0f)
                        : rule.Decay(ToFloat(raw[(2 * T + t) * K + j]), view.dt_bias[kh * K + j]);
        const float sum_q = WarpSum(xq * xq);
        const float sum_k = WarpSum(xk * xk);
        if ((tid & 31) == 0) {
          spart_q[t * (K / 32) + j / 32] = sum_q;
          spart_k[t * (K / 32) + j / 32] = sum_k;
        }
      }
      for (int x = tid; x < tokens * V; x += kThreads) {
        sv[x] = ToFloat(raw[(3 * T + x / V) * K + x % V]);
      }
      __syncthreads();
      const float scale = kda::QueryScale(K);
      for (int x = tid; x < tokens * K; x += kThreads) {
        const int t = x / K;
        float sum_q = 0.0f, sum_k = 0.0f;
#pragma unroll
        for (int c = 0; c < K / 32; ++c) {
          sum_q += spart_q[t * (K / 32) + c];
          sum_k += spart_k[t * (K / 32) + c];
        }
        sq[x] = kda::Normalize(sq[x], kda::L2Norm(sum_q), scale);
        sk[x] = kda::Normalize(sk[x], kda::L2Norm(sum_k), 1.0f);
      }
      __syncthreads();
      prepared = head_key(cur);
    }

    // The next item's state (and its head's inputs when it starts a head)
    // are on their way while this one computes.
    PipelinedItem next{};
    next.tokens = 0;
    if (item + 1 < last) {
      next = ItemOf<M, kChunks>(p, item + 1);
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
    // head, v by each chunk for its rows.
    if (M == Mode::kVerify) {
      Act* const rec_kv = static_cast<Act*>(view.rec_kv);
      Act* const rec_g = static_cast<Act*>(view.rec_g);
      const int64_t width = int64_t{Hk} * K + int64_t{H} * V;
      if (cur.chunk == 0 && h % per_key == 0) {
        for (int x = tid; x < tokens * K; x += kThreads) {
          const int t = x / K;
          rec_kv[(rec0 + t) * width + int64_t{kh} * K + x % K] = raw[(1 * T + t) * K + x % K];
          if (!gdn) rec_g[((rec0 + t) * Hk + kh) * K + x % K] = raw[(2 * T + t) * K + x % K];
        }
      }
      if (cur.chunk == 0) {
        for (int t = tid; t < tokens; t += kThreads) {
          static_cast<Act*>(view.rec_beta)[(rec0 + t) * H + h] = raw_beta[t];
          if (gdn) rec_g[(rec0 + t) * H + h] = raw_g[t];
        }
      }
      for (int x = tid; x < tokens * kRows; x += kThreads) {
        const int t = x / kRows;
        const int v = cur.chunk * kRows + x % kRows;
        rec_kv[(rec0 + t) * width + int64_t{Hk} * K + int64_t{h} * V + v] =
            raw[(3 * T + t) * K + v];
      }
    }

    // The state slice, once this thread's copies of it have landed.
    CpAsyncWait<1>();
    float st[kRowsPer * kSeg];
#pragma unroll
    for (int r = 0; r < kRowsPer; ++r) {
      const State* const mine = stage[s] + (group + r * kGroups) * kStride;
#pragma unroll
      for (int i = 0; i < kSeg / 4; ++i) {
        const kda::Quad quad = StageIo<State>::Load(mine + kda::QuadColumn<kLanes>(lane, i));
#pragma unroll
        for (int c = 0; c < 4; ++c) st[r * kSeg + 4 * i + c] = quad.x[c];
      }
    }

    const int v0 = cur.chunk * kRows + group;  // row r is v0 + r * kGroups
    State* const state = static_cast<State*>(view.state);
    Act* const out = static_cast<Act*>(view.out);
    for (int t = 0; t < tokens; ++t) {
      const kda::TokenInputs tok{sq + t * K, sk + t * K, sdecay + t * K, sbeta[t]};
      float vin[kRowsPer], o[kRowsPer];
#pragma unroll
      for (int r = 0; r < kRowsPer; ++r) vin[r] = sv[t * V + v0 + r * kGroups];
      kda::TokenStep<kSeg, kLanes, kRowsPer>(
          st, lane, tok, vin, [](float x) { return LaneSum<kLanes>(x); }, kWantOutput, o);
      if (kWantOutput && lane == 0) {
#pragma unroll
        for (int r = 0; r < kRowsPer; ++r) {
          out[((bos + t) * H + h) * V + v0 + r * kGroups] = FromFloat<Act>(o[r]);
        }
      }
      if (M != Mode::kVerify) {
        const int32_t dst = cur.idx[t];
        if (internal::IsBlock(dst)) {
#pragma unroll
          for (int r = 0; r < kRowsPer; ++r) {
            State* d = state + int64_t{dst} * view.block_stride +
                       (int64_t{h} * V + v0 + r * kGroups) * K;
#pragma unroll
            for (int i = 0; i < kSeg / 4; ++i) {
              StateIo<State>::Store(d + kda::QuadColumn<kLanes>(lane, i), st + r * kSeg + 4 * i);
            }
          }
        }
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
  constexpr int kChunks = PipelinedTraits<K>::kChunks;
  const int64_t items = int64_t{num_layers} * p.num_rows * p.num_heads * kChunks;
  if (items == 0) return cudaSuccess;
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
                                                        PipelinedTraits<K>::kThreads, smem);
    if (err != cudaSuccess) return failed(err);
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return failed(err);
    if (per_sm < 1) return cudaErrorInvalidConfiguration;
    blocks_at_once = per_sm * sms;
    resident[device][p.max_tokens].store(blocks_at_once, std::memory_order_relaxed);
  }
  const int64_t blocks = items < blocks_at_once ? items : blocks_at_once;
  err = LaunchDependent(kernel, static_cast<unsigned>(blocks), PipelinedTraits<K>::kThreads, smem,
                        stream, p, items);
  return err != cudaSuccess ? err : cudaGetLastError();
}

}  // namespace
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_CUDA_PIPELINED_RECURRENT_CUH_
