// The launch of the recurrent kernel (pipelined_recurrent.cuh), which runs
// the stock kernel, Verify (EAGER's and DEFERRED's) and every replay: its
// modes, where one layer's inputs and outputs are (LayerView), what a launch
// covers (RecurrentLaunch), and the host helpers that fill them from the
// kernels' arguments.
#ifndef SPECSTATE_KERNELS_COMMON_CUDA_RECURRENT_LAUNCH_CUH_
#define SPECSTATE_KERNELS_COMMON_CUDA_RECURRENT_LAUNCH_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/checks/verify_rows.h"
#include "kernels/kda_args.h"
#include "kernels/kda_math.h"
#include "kernels/numeric.h"

namespace specstate {
namespace kernels {
namespace {

// ---------------------------------------------------------------------------
// State quads: 4 consecutive state elements as fp32.

template <typename State>
struct StateIo;

template <>
struct StateIo<float> {
  static __device__ __forceinline__ kda::Quad Load(const float* p) {
    const float4 f = __ldcs(reinterpret_cast<const float4*>(p));
    return kda::Quad{{f.x, f.y, f.z, f.w}};
  }
  static __device__ __forceinline__ void Store(float* p, const float* s) {
    __stcs(reinterpret_cast<float4*>(p), make_float4(s[0], s[1], s[2], s[3]));
  }
};

template <>
struct StateIo<BFloat16> {
  static __device__ __forceinline__ kda::Quad Load(const BFloat16* p) {
    const uint2 u = __ldcs(reinterpret_cast<const uint2*>(p));
    return kda::Quad{{BitsToFloat(u.x << 16), BitsToFloat(u.x & 0xffff0000u),
                      BitsToFloat(u.y << 16), BitsToFloat(u.y & 0xffff0000u)}};
  }
  static __device__ __forceinline__ void Store(BFloat16* p, const float* s) {
    uint2 u;
    u.x =
        uint32_t{FromFloat<BFloat16>(s[0]).bits} | (uint32_t{FromFloat<BFloat16>(s[1]).bits} << 16);
    u.y =
        uint32_t{FromFloat<BFloat16>(s[2]).bits} | (uint32_t{FromFloat<BFloat16>(s[3]).bits} << 16);
    __stcs(reinterpret_cast<uint2*>(p), u);
  }
};

// ---------------------------------------------------------------------------
// The recurrent kernel.

// kReplayVerify is DEFERRED's Verify: a row first replays the tokens a
// commit left pending on its checkpoint (as kReplay would have at that
// commit), stores the checkpoint once, then verifies its window from the
// state in registers (as kVerify).
enum class Mode { kStock, kVerify, kReplay, kReplayVerify };

// Where one layer's inputs and outputs are.
struct LayerView {
  const void* q;
  const void* k;
  const void* v;
  const void* g;
  const void* beta;
  int64_t q_stride, k_stride, v_stride, beta_stride;  // token strides; g is dense
  void* out;                                          // null: outputs discarded
  void* state;
  int64_t block_stride;
  const float* a_log;
  const float* dt_bias;
  void* rec_kv;  // verify: where the raw inputs go
  void* rec_g;
  void* rec_beta;
};

struct RecurrentLaunch {
  int num_rows;
  int num_heads;      // value heads (HV): the work items' heads
  int num_key_heads;  // H: q and k (KDA's g)
  LayerKind kind;
  KdaGate gate;
  int num_layers;
  // The pipelined kernel copies a head's q, k, v and g asynchronously when
  // every token's head slice starts on a 16-byte boundary (else it loads them).
  bool async_inputs;
  float lower_bound;
  // Verify checked against the step's snapshot (expected values): the
  // pipelined kernel may load its first item's inputs before the check kernel
  // has finished, bounded by these (the check decides afterwards).
  bool early_loads;
  int64_t num_tokens;
  int64_t num_blocks;
  // Stock and verify: tokens of row n are [qsl[n], qsl[n + 1]). Replay: row
  // n's tokens are records [n * window, n * window + window).
  const int32_t* qsl;
  const int32_t* indices;  // ssm_state_indices / state_indices / replay indices
  int64_t indices_stride;
  const int32_t* num_accepted;  // stock, optional
  int window;                   // Q: records per row (verify, replay)
  int max_tokens;               // bound on tokens per row (shared memory)
  const DeviceStatus* status;
  LayerView layer;                   // stock and verify
  const CommitLayer* replay_layers;  // replay: the group's layers
  // Replay of a list (DEFERRED commit, Flush): row n is job n, at most
  // num_rows of them, *job_count in fact (the call's first kernel wrote it).
  const ReplayJob* jobs;
  const int32_t* job_count;
  // kReplayVerify: each row's pending entry (the checks' replay_plan), the
  // word naming the records buffer of the pending tokens, and both buffers
  // (the window's records go to the other one).
  const int32_t* replay_plan;
  const int32_t* pending_buffer;
  Records records[2];
  // A replay list that is usually empty (a DEFERRED commit in mode none):
  // one block an SM, not as many as fit, so that an empty list costs little.
  bool small_grid;
};

// The replay reads the records as the stock kernel's inputs: q = k = the
// recorded k, v = the recorded v (each token's [H * K + HV * V] of kv), g and
// beta as recorded.
template <typename Act>
__device__ __forceinline__ LayerView RecordsView(const Records& r, const RecurrentLaunch& p,
                                                 int head_dim) {
  const int64_t hk = int64_t{p.num_key_heads} * head_dim;
  const int64_t width = hk + int64_t{p.num_heads} * head_dim;
  LayerView view{};
  view.k = r.kv;
  view.q = r.kv;
  view.v = static_cast<const Act*>(r.kv) + hk;
  view.g = r.g;
  view.beta = r.beta;
  view.q_stride = width;
  view.k_stride = width;
  view.v_stride = width;
  view.beta_stride = p.num_heads;
  return view;
}

// A layer's replay: its records buffer `buffer` (0: records, 1:
// records_alt) as inputs, its pool and parameters.
template <typename Act>
__device__ __forceinline__ LayerView ReplayView(const CommitLayer& l, int buffer,
                                                const RecurrentLaunch& p, int head_dim) {
  LayerView view = RecordsView<Act>(buffer == 0 ? l.records : l.records_alt, p, head_dim);
  view.out = nullptr;
  view.state = l.state.data;
  view.block_stride = l.state.block_stride;
  view.a_log = l.params.a_log;
  view.dt_bias = l.params.dt_bias;
  view.rec_kv = view.rec_g = view.rec_beta = nullptr;
  return view;
}

// The sum over a row's kLanes consecutive lanes, in a fixed butterfly order;
// every lane gets the total.
template <int kLanes>
__device__ __forceinline__ float LaneSum(float x) {
#pragma unroll
  for (int offset = 1; offset < kLanes; offset <<= 1) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}

__device__ __forceinline__ float WarpSum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// ---------------------------------------------------------------------------
// The host's side.

inline bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

inline void SetHeads(const KdaShape& shape, RecurrentLaunch* p) {
  p->num_heads = ValueHeads(shape);
  p->num_key_heads = shape.num_heads;
  p->kind = shape.kind;
  p->gate = shape.gate;
  p->lower_bound = shape.lower_bound;
}

// Whether every token's head slice of q, k, g and v starts on a 16-byte
// boundary (the pipelined kernel then copies them asynchronously).
// (GDN's g is a scalar per head, loaded, never copied.)
inline bool InputsAligned(const void* q, int64_t q_stride, const void* k, int64_t k_stride,
                          const void* v, int64_t v_stride, const void* g, const KdaShape& shape,
                          size_t elem) {
  const auto ok = [&](const void* p, int64_t stride) {
    return Aligned16(p) && (stride * int64_t(elem)) % 16 == 0;
  };
  return ok(q, q_stride) && ok(k, k_stride) && ok(v, v_stride) &&
         (shape.kind == LayerKind::kGdn || ok(g, GateWidth(shape))) &&
         (shape.head_dim * elem) % 16 == 0;
}

inline bool ViewInputsAligned(const LayerView& l, const KdaShape& shape, size_t elem) {
  return InputsAligned(l.q, l.q_stride, l.k, l.k_stride, l.v, l.v_stride, l.g, shape, elem);
}

// The records as the replay reads them: q = k = kv[:, 0], v = kv[:, 1], g.
inline bool RecordsAligned(const Records& r, const KdaShape& shape, size_t elem) {
  const int64_t width = RecordTokenWidth(shape);
  return InputsAligned(r.kv, width, r.kv, width,
                       static_cast<const char*>(r.kv) + KeyWidth(shape) * elem, width, r.g, shape,
                       elem);
}

// A failed launch (or an earlier fault it reports), named like the kernels'

inline LayerView ViewOf(const Activation& q, const Activation& k, const Activation& v,
                        const Activation& g, const Activation& beta, void* out,
                        const StatePool& state, const LayerParams& params) {
  LayerView view{};
  view.q = q.data;
  view.k = k.data;
  view.v = v.data;
  view.g = g.data;
  view.beta = beta.data;
  view.q_stride = q.token_stride;
  view.k_stride = k.token_stride;
  view.v_stride = v.token_stride;
  view.beta_stride = beta.token_stride;
  view.out = out;
  view.state = state.data;
  view.block_stride = state.block_stride;
  view.a_log = params.a_log;
  view.dt_bias = params.dt_bias;
  return view;
}

// A Verify's launch (EAGER's and DEFERRED's): its rows from the snapshot
// the checks validated, never the caller's indices; the window's records to
// `records`. DEFERRED adds its pending tokens (replay_plan, the records
// buffers) and a window of twice the tokens.
inline RecurrentLaunch VerifyLaunchOf(const VerifyArgs& a) {
  RecurrentLaunch p{};
  p.num_rows = a.num_rows;
  SetHeads(a.shape, &p);
  // (DEFERRED loads only the checkpoint early: the checks say what each row
  // replays.)
  p.early_loads = a.expected_query_start_loc != nullptr;
  p.num_tokens = a.num_tokens;
  p.num_blocks = a.state.num_blocks;
  p.qsl = internal::VerifiedQueryStartLoc(a);
  p.indices = internal::VerifiedStateIndices(a);
  p.indices_stride = 1;
  p.window = a.records.q;
  p.max_tokens = a.records.q;
  p.status = a.status;
  p.layer = ViewOf(a.q, a.k, a.v, a.g, a.beta, a.out, a.state, a.params);
  p.layer.rec_kv = a.records.kv;
  p.layer.rec_g = a.records.g;
  p.layer.rec_beta = a.records.beta;
  p.async_inputs = ViewInputsAligned(p.layer, a.shape, DTypeSize(a.shape.act_dtype));
  return p;
}

}  // namespace
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_COMMON_CUDA_RECURRENT_LAUNCH_CUH_
