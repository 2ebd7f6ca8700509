// The CUDA backend (sm_90).
//
// One kernel template, PipelinedRecurrentKernel<Mode> (pipelined_recurrent.cuh),
// is the stock spec-path kernel, RecoverSSM verify and the commit's replay:
// all three run the per-token math of kernels/kda_math.h with the same
// thread layout and reduction order, so verify's outputs equal the stock
// kernel's and the replayed states equal the stock kernel's stored states
// bit for bit.
//
// Every call starts with a single-block check kernel (the values it checks
// live in device memory); the kernels that follow read its DeviceStatus
// first and return at once when it failed, so a rejected call writes nothing.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda_status.h"
#include "kernels/fast/cuda/fast_cuda.h"
#include "kernels/fast/fast_args.h"
#include "kernels/fast/from_interface.h"
#include "kernels/internal/checks.h"
#include "kernels/internal/dispatch.h"
#include "kernels/internal/journal.h"
#include "kernels/kda_args.h"
#include "kernels/kda_kernels.h"
#include "kernels/kda_math.h"
#include "kernels/numeric.h"

namespace specstate {
namespace kernels {
namespace {

using internal::IsBlock;
using internal::RowFault;

constexpr int kCheckThreads = 1024;
constexpr int kConvThreads = 256;

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
    u.x = uint32_t{FromFloat<BFloat16>(s[0]).bits} | (uint32_t{FromFloat<BFloat16>(s[1]).bits} << 16);
    u.y = uint32_t{FromFloat<BFloat16>(s[2]).bits} | (uint32_t{FromFloat<BFloat16>(s[3]).bits} << 16);
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
  void* out;                                         // null: outputs discarded
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

// Programmatic dependent launch (sm_90): a call's kernels after the first
// are launched while the one before runs (LaunchDependent), start early, and
// wait for it (WaitForPrerequisiteGrid: its work done and visible) before
// they read what it wrote or write anything. Kernels launched plainly see
// both as no-ops.
__device__ __forceinline__ void WaitForPrerequisiteGrid() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}
__device__ __forceinline__ void LetDependentsLaunch() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

__device__ __forceinline__ float WarpSum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// Launches `kernel` as a programmatic dependent of the stream's last kernel.
template <typename... KernelArgs, typename... Args>
cudaError_t LaunchDependent(void (*kernel)(KernelArgs...), unsigned blocks, unsigned threads,
                            size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace
}  // namespace kernels
}  // namespace specstate

#include "kernels/cuda/pipelined_recurrent.cuh"

namespace specstate {
namespace kernels {
namespace {

// The pipelined kernel: 8 lanes a row, 2 rows a lane, 4 blocks of 128
// threads per SM (shared memory holds two stage buffers each; 128
// registers a thread).
using PipelinedLayout = PipelineLayout<8, 2, 4>;

// ---------------------------------------------------------------------------
// Single-block checks.

// Runs check(x) over items 0 .. count - 1; the fault of the lowest failing
// item goes to `status`, reported for row row_of(x). Returns (to every
// thread) whether all items passed.
template <typename Check, typename RowOf>
__device__ bool BlockCheckItems(int count, DeviceStatus* status, Check check, RowOf row_of) {
  __shared__ int lowest;
  if (threadIdx.x == 0) lowest = INT_MAX;
  __syncthreads();
  RowFault fault = internal::NoFault();
  int fault_item = INT_MAX;
  for (int x = threadIdx.x; x < count; x += blockDim.x) {
    const RowFault f = check(x);
    if (f.problem != 0) {
      fault = f;
      fault_item = x;
      break;  // items grow with the loop: this is the thread's lowest
    }
  }
  if (fault_item != INT_MAX) atomicMin(&lowest, fault_item);
  __syncthreads();
  const int result = lowest;
  if (fault_item != INT_MAX && fault_item == result) {
    *status = internal::StatusFromFault(fault, row_of(fault_item), -1);
  }
  __syncthreads();
  return result == INT_MAX;
}

// Runs check(n) over all rows; the fault of the lowest failing row goes to
// `status`. Returns (to every thread) whether all rows passed.
template <typename Check>
__device__ bool BlockCheckRows(int num_rows, DeviceStatus* status, Check check) {
  return BlockCheckItems(num_rows, status, check, [](int n) { return n; });
}

// FAST: no two rows use one block (block_of(n); null blocks skipped), on one
// block (kda_cpu.cc's CheckOneRowABlock): the lowest row using a block owns
// it, and the lowest other row using it is the fault. `owner` is zero on
// entry and on return.
template <typename BlockOf>
__device__ bool BlockCheckOneRowABlock(int num_rows, int32_t* owner, DeviceStatus* status,
                                       BlockOf block_of) {
  __shared__ int lowest;
  if (threadIdx.x == 0) lowest = INT_MAX;
  for (int n = threadIdx.x; n < num_rows; n += blockDim.x) {
    const int32_t b = block_of(n);
    if (IsBlock(b)) atomicMax(&owner[b], internal::OwnerTag(n));
  }
  __syncthreads();
  int fault_row = INT_MAX, other_row = -1;
  for (int n = threadIdx.x; n < num_rows; n += blockDim.x) {
    const int32_t b = block_of(n);
    if (!IsBlock(b)) continue;
    const int user = internal::OwnerRow(__ldcg(&owner[b]));
    if (user != n) {
      fault_row = n;  // rows grow with the loop: this is the thread's lowest
      other_row = user;
      break;
    }
  }
  if (fault_row != INT_MAX) atomicMin(&lowest, fault_row);
  __syncthreads();
  const int failed = lowest;
  if (fault_row != INT_MAX && fault_row == failed) {
    *status = internal::StatusFromFault(internal::FastSharedFault(block_of(fault_row), fault_row),
                                        fault_row, other_row);
  }
  for (int n = threadIdx.x; n < num_rows; n += blockDim.x) {
    const int32_t b = block_of(n);
    if (IsBlock(b)) owner[b] = 0;
  }
  __syncthreads();
  return failed == INT_MAX;
}

// A thread's share of the prerequisites, loaded into registers: each
// dependent round of global loads costs a check kernel about half a
// microsecond, so every load of the checks is issued before any is used.
struct PrerequisiteLoads {
  // Thread 0's: the cancellation, else the input fault (which no device
  // memory can raise: the word is for the CPU backend; read for symmetry).
  internal::RowFault cancelled = internal::NoFault();
  int lowest_failed = INT_MAX;                         // this thread's statuses
};

__device__ PrerequisiteLoads LoadPrerequisites(const Prerequisites& p) {
  PrerequisiteLoads loads;
  if (threadIdx.x == 0) {
    loads.cancelled = internal::CheckCancelled(p);
    if (loads.cancelled.problem == 0) loads.cancelled = internal::CheckInputFault(p.input_fault);
  }
  for (int i = threadIdx.x; i < p.count; i += blockDim.x) {
    if (p.statuses[i].failed != 0) {
      loads.lowest_failed = i;
      break;  // i grows with the loop: this is the thread's lowest
    }
  }
  return loads;
}

// False (to every thread, with the status written) when a prerequisite failed.
__device__ bool BlockResolvePrerequisites(const PrerequisiteLoads& loads, DeviceStatus* status) {
  __shared__ int lowest_failed;
  __shared__ bool cancelled;
  if (threadIdx.x == 0) {
    lowest_failed = INT_MAX;
    cancelled = loads.cancelled.problem != 0;
    if (cancelled) *status = internal::StatusFromFault(loads.cancelled, -1, -1);
  }
  __syncthreads();
  if (cancelled) return false;
  if (loads.lowest_failed != INT_MAX) atomicMin(&lowest_failed, loads.lowest_failed);
  __syncthreads();
  const int failed = lowest_failed;
  if (failed != INT_MAX && threadIdx.x == 0) {
    *status = internal::StatusFromFault(
        internal::MakeFault(CheckedField::kPrerequisites, CheckProblem::kPrerequisiteFailed,
                            failed, -1, 0, 0),
        -1, -1);
  }
  __syncthreads();
  return failed == INT_MAX;
}

__device__ bool BlockCheckPrerequisites(const Prerequisites& p, DeviceStatus* status) {
  return BlockResolvePrerequisites(LoadPrerequisites(p), status);
}

// The cross-row pass of checks.h on one block. `owner` is zero on entry and on return.
template <typename Writes, typename Reads>
__device__ bool BlockCheckCrossRow(int num_rows, int32_t* owner, DeviceStatus* status,
                                   Writes writes, Reads reads) {
  __shared__ int lowest;
  if (threadIdx.x == 0) lowest = INT_MAX;
  for (int n = threadIdx.x; n < num_rows; n += blockDim.x) {
    writes(n, [&](int32_t b, CheckedField, int32_t, int32_t) {
      atomicMax(&owner[b], internal::OwnerTag(n));
    });
  }
  __syncthreads();
  RowFault fault = internal::NoFault();
  int fault_row = INT_MAX;
  int other_row = -1;
  for (int n = threadIdx.x; n < num_rows && fault_row == INT_MAX; n += blockDim.x) {
    writes(n, [&](int32_t b, CheckedField field, int32_t index, int32_t col) {
      const int other = internal::OwnerRow(__ldcg(&owner[b]));
      if (fault_row == INT_MAX && other != n) {
        fault = internal::MakeFault(field, CheckProblem::kDuplicateWrite, index, col, b, 0);
        fault_row = n;
        other_row = other;
      }
    });
    reads(n, [&](int32_t b, CheckedField field, int32_t index, int32_t col) {
      const int32_t tag = __ldcg(&owner[b]);
      if (fault_row == INT_MAX && tag != 0 && internal::OwnerRow(tag) != n) {
        fault = internal::MakeFault(field, CheckProblem::kWriteOfRead, index, col, b, 0);
        fault_row = n;
        other_row = internal::OwnerRow(tag);
      }
    });
  }
  if (fault_row != INT_MAX) atomicMin(&lowest, fault_row);
  __syncthreads();
  const int result = lowest;
  if (fault_row != INT_MAX && fault_row == result) {
    *status = internal::StatusFromFault(fault, fault_row, other_row);
  }
  for (int n = threadIdx.x; n < num_rows; n += blockDim.x) {
    writes(n, [&](int32_t b, CheckedField, int32_t, int32_t) { owner[b] = 0; });
  }
  __syncthreads();
  return result == INT_MAX;
}

__global__ void __launch_bounds__(kCheckThreads) StockCheckKernel(const StockArgs a) {
  LetDependentsLaunch();
  if (threadIdx.x == 0) *a.status = internal::OkStatus();
  __syncthreads();
  internal::StockRow unused;
  if (!BlockCheckRows(a.num_rows, a.status,
                      [&](int n) { return internal::CheckStockRow(a, n, &unused); })) {
    return;
  }
  BlockCheckCrossRow(
      a.num_rows, static_cast<int32_t*>(a.workspace), a.status,
      [&](int n, auto fn) {
        internal::StockRow row;
        internal::CheckStockRow(a, n, &row);
        internal::ForEachStockWrite(a, row, n, fn);
      },
      [&](int n, auto fn) {
        internal::StockRow row;
        internal::CheckStockRow(a, n, &row);
        internal::ForEachStockRead(row, n, fn);
      });
}

// Copies the call's final status to its host mirror. Every thread of the
// block calls it, after the checks (which return block-uniformly).
// The status mirror's contract (kda_args.h): written only when a check failed.
__device__ void PublishStatus(const DeviceStatus* status, DeviceStatus* mirror) {
  __syncthreads();
  if (mirror != nullptr && threadIdx.x == 0 && status->failed != 0) *mirror = *status;
}

// Whether every check passed (to every thread). The prerequisites and the
// caller's indices are loaded in one round (phase one of checks.h: each
// index once, into the snapshot or against the expected values); the
// barrier in resolving the prerequisites makes the snapshot visible to the
// whole block, and phase two checks it.
__device__ bool VerifyChecks(const VerifyArgs& a) {
  if (threadIdx.x == 0) *a.status = internal::OkStatus();
  const PrerequisiteLoads prerequisites = LoadPrerequisites(a.prerequisites);
  internal::RowFault mismatch = internal::NoFault();
  int mismatch_row = INT_MAX;
  for (int n = threadIdx.x; n < a.num_rows; n += blockDim.x) {
    const internal::RowFault f = internal::SnapshotVerifyRow(a, n, internal::LoadVerifyRow(a, n));
    if (f.problem != 0 && mismatch_row == INT_MAX) {
      mismatch = f;
      mismatch_row = n;
    }
  }
  // Its barrier orders the OK status before any fault's.
  if (!BlockResolvePrerequisites(prerequisites, a.status)) return false;
  internal::VerifyRow unused;
  return BlockCheckRows(a.num_rows, a.status, [&](int n) {
    return n == mismatch_row ? mismatch : internal::CheckVerifyRow(a, n, &unused);
  });
}

// DEFERRED Verify, after the other checks (kda_cpu.cc's TakePendingTokens,
// on one block): no two rows may verify from a block with pending tokens in
// the layer; then each row takes its block's entry and the table forgets it.
__device__ bool BlockTakePendingTokens(const VerifyArgs& a) {
  int32_t* const entries = internal::PendingEntriesOf(a.pending, a.layer);
  int32_t* const owner = static_cast<int32_t*>(a.workspace);
  const int32_t* const source = internal::VerifiedStateIndices(a);
  __shared__ int lowest;
  if (threadIdx.x == 0) lowest = INT_MAX;
  for (int n = threadIdx.x; n < a.num_rows; n += blockDim.x) {
    if (IsBlock(source[n])) atomicMax(&owner[source[n]], internal::OwnerTag(n));
  }
  __syncthreads();
  int fault_row = INT_MAX, other_row = -1;
  for (int n = threadIdx.x; n < a.num_rows; n += blockDim.x) {
    const int32_t b = source[n];
    if (!IsBlock(b) || entries[b] == 0) continue;
    const int lowest_reader = internal::OwnerRow(__ldcg(&owner[b]));
    if (lowest_reader != n) {
      fault_row = n;  // rows grow with the loop: this is the thread's lowest
      other_row = lowest_reader;
      break;
    }
  }
  if (fault_row != INT_MAX) atomicMin(&lowest, fault_row);
  __syncthreads();
  const int failed = lowest;
  if (fault_row != INT_MAX && fault_row == failed) {
    *a.status = internal::StatusFromFault(internal::PendingSharedFault(source[fault_row], fault_row),
                                          fault_row, other_row);
  }
  for (int n = threadIdx.x; n < a.num_rows; n += blockDim.x) {
    if (IsBlock(source[n])) owner[source[n]] = 0;
  }
  __syncthreads();
  if (failed != INT_MAX) return false;
  if (a.pending.journal != nullptr) {  // before the table or a checkpoint changes
    __shared__ int journaled;
    if (threadIdx.x == 0) journaled = 0;
    __syncthreads();
    for (int n = threadIdx.x; n < a.num_rows; n += blockDim.x) {
      if (IsBlock(source[n]) && entries[source[n]] != 0) {
        internal::PendingJournalList(a.pending, atomicAdd(&journaled, 1), source[n]);
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      internal::PendingJournalMarkStarted(a.pending, kPendingVerify, journaled, a.layer, 0);
    }
    __syncthreads();
  }
  for (int n = threadIdx.x; n < a.num_rows; n += blockDim.x) {
    a.replay_plan[n] = IsBlock(source[n]) ? entries[source[n]] : 0;
  }
  __syncthreads();  // rows sharing a block (with nothing pending) read it before it is cleared
  for (int n = threadIdx.x; n < a.num_rows; n += blockDim.x) {
    if (IsBlock(source[n])) entries[source[n]] = 0;
  }
  return true;
}

__global__ void __launch_bounds__(kCheckThreads) VerifyCheckKernel(const VerifyArgs a) {
  LetDependentsLaunch();
  // The block knows whether it failed: no reload of its status to decide.
  bool passed = VerifyChecks(a);
  if (passed && a.pending.entries != nullptr) passed = BlockTakePendingTokens(a);
  if (!passed && a.status_mirror != nullptr && threadIdx.x == 0) *a.status_mirror = *a.status;
}

// FAST Verify's checks (kda_cpu.cc's RunVerify and RunFastVerify): every
// Verify's, then each row's block has a cursor a Commit leaves and room in
// its ring for the window, and no two rows verify from one block (their
// candidates would share its ring's slots).
__global__ void __launch_bounds__(kCheckThreads) FastVerifyCheckKernel(const VerifyArgs a) {
  bool passed = VerifyChecks(a);
  if (passed) {
    passed = BlockCheckRows(a.num_rows, a.status, [&](int n) {
      internal::VerifyRow row;
      internal::CheckVerifyRow(a, n, &row);  // passed above: reads the checked snapshot
      return internal::CheckFastVerifyRow(a.fast, n, row.source, row.tokens);
    });
  }
  if (passed) {
    passed = BlockCheckOneRowABlock(a.num_rows, static_cast<int32_t*>(a.workspace), a.status,
                                    [&](int n) { return internal::VerifiedStateIndices(a)[n]; });
  }
  if (!passed && a.status_mirror != nullptr && threadIdx.x == 0) *a.status_mirror = *a.status;
}

// FAST Flush's checks (kda_cpu.cc's RunFlush and RunFastFlush): the block
// list (into its checked copy), then the cursor of every listed block (or,
// without a list, of every block) in every covered layer.
__global__ void __launch_bounds__(kCheckThreads) FastFlushCheckKernel(const FlushArgs a) {
  if (threadIdx.x == 0) *a.status = internal::OkStatus();
  __syncthreads();
  const int64_t num_blocks = a.device_layers[0].state.num_blocks;
  bool passed = BlockCheckRows(a.num_blocks_given, a.status, [&](int i) {
    return internal::CheckListedBlock(a.blocks, a.checked_blocks, i, num_blocks);
  });
  if (passed) {
    const bool listed = a.blocks != nullptr;
    const int count = listed ? a.num_blocks_given : static_cast<int>(num_blocks);
    const int layers = a.layer >= 0 ? 1 : a.num_layers;
    passed = BlockCheckItems(
        count * layers, a.status,
        [&](int x) {
          const int32_t block = listed ? a.checked_blocks[x / layers] : x / layers;
          const int l = a.layer >= 0 ? a.layer : x % layers;
          return IsBlock(block) ? internal::CheckFastCursor(a.device_layers[l].fast, block, l)
                                : internal::NoFault();
        },
        [](int) { return -1; });
  }
  PublishStatus(a.status, a.status_mirror);
}

// DEFERRED Commit, after its checks (kda_cpu.cc's DeferCommit, on one block):
// the replay list (what the previous commit left pending that no Verify
// took; the rows that are not deferred), then the deferred rows' pending
// entries, in the records buffer this step's Verify calls wrote.
__device__ void BlockDeferCommit(const CommitArgs& a, const CommitPlanRow* plan) {
  const PendingBlocks& p = a.pending;
  const int q = a.spec_query_len;
  const int L = a.num_layers;
  const int32_t buffer = *internal::PendingBufferWord(p);  // the previous commit's records
  const int32_t listed = *internal::PendingListSize(p);
  int32_t* const list = internal::PendingList(p);
  __shared__ int jobs, newly_listed;
  if (threadIdx.x == 0) jobs = newly_listed = 0;
  __syncthreads();
  for (int x = threadIdx.x; x < listed * L; x += blockDim.x) {
    const int32_t block = list[x / L];
    const int l = x % L;
    const int32_t entry = atomicExch(&internal::PendingEntriesOf(p, l)[block], 0);
    if (entry != 0) {
      a.jobs.jobs[atomicAdd(&jobs, 1)] =
          internal::PendingJob(l, block, internal::UnpackPending(entry), q);
    }
  }
  for (int x = threadIdx.x; x < a.num_rows * L; x += blockDim.x) {
    const int i = x / L;
    if (internal::CommitsAnything(plan[i]) && !internal::DefersCommit(plan[i])) {
      a.jobs.jobs[atomicAdd(&jobs, 1)] = internal::CommitJob(x % L, plan[i], i, 1 - buffer, q);
    }
  }
  __syncthreads();  // the old list and entries are read before the new ones are written
  for (int i = threadIdx.x; i < a.num_rows; i += blockDim.x) {
    if (internal::DefersCommit(plan[i])) list[atomicAdd(&newly_listed, 1)] = plan[i].source;
  }
  for (int x = threadIdx.x; x < a.num_rows * L; x += blockDim.x) {
    const CommitPlanRow& row = plan[x / L];
    if (internal::DefersCommit(row)) {
      internal::PendingEntriesOf(p, x % L)[row.source] =
          internal::PackPending(x / L, 1 - buffer, row.commit_len);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    *internal::PendingListSize(p) = newly_listed;
    *internal::PendingBufferWord(p) = 1 - buffer;
    *a.jobs.count = jobs;
  }
}

// DEFERRED Flush: checks the block list (into its checked copy) and lists
// the replays of the blocks' pending tokens (kda_cpu.cc's RunFlush).
__global__ void __launch_bounds__(kCheckThreads) FlushPlanKernel(const FlushArgs a) {
  LetDependentsLaunch();
  if (threadIdx.x == 0) *a.status = internal::OkStatus();
  __syncthreads();
  if (BlockCheckRows(a.num_blocks_given, a.status,
                     [&](int i) { return internal::CheckFlushBlock(a, i); })) {
    __shared__ int jobs;
    if (threadIdx.x == 0) jobs = 0;
    __syncthreads();
    const bool listed = a.blocks == nullptr;
    const int count = listed ? *internal::PendingListSize(a.pending) : a.num_blocks_given;
    const int32_t* const blocks = listed ? internal::PendingList(a.pending) : a.checked_blocks;
    const int layers = a.layer >= 0 ? 1 : a.num_layers;
    if (a.pending.journal != nullptr) {  // before the table or a state changes
      __shared__ int journaled;
      if (threadIdx.x == 0) journaled = 0;
      __syncthreads();
      for (int i = threadIdx.x; i < count; i += blockDim.x) {
        const int32_t block = blocks[i];
        if (!IsBlock(block)) continue;
        for (int y = 0; y < layers; ++y) {
          const int l = a.layer >= 0 ? a.layer : y;
          if (internal::PendingEntriesOf(a.pending, l)[block] != 0) {
            internal::PendingJournalList(a.pending, atomicAdd(&journaled, 1), block);
            break;
          }
        }
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        internal::PendingJournalMarkStarted(
            a.pending, a.discard ? kPendingDiscard : kPendingFlush, journaled, a.layer, 0);
      }
      __syncthreads();
    }
    for (int x = threadIdx.x; x < count * layers; x += blockDim.x) {
      const int32_t block = blocks[x / layers];
      const int l = a.layer >= 0 ? a.layer : x % layers;
      if (!IsBlock(block)) continue;
      // One taker per entry, though a block may be listed twice.
      const int32_t entry = atomicExch(&internal::PendingEntriesOf(a.pending, l)[block], 0);
      if (entry != 0 && !a.discard) {
        a.jobs.jobs[atomicAdd(&jobs, 1)] =
            internal::PendingJob(l, block, internal::UnpackPending(entry), a.spec_query_len);
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) *a.jobs.count = jobs;
  }
  PublishStatus(a.status, a.status_mirror);
}

// DEFERRED with kept pools, before the commit's first write (kda_cpu.cc's
// ListDeferredCommit, on one block): the pending journal lists the old
// pending list and every block a row writes, and is marked started.
__device__ void BlockListDeferredCommit(const CommitArgs& a, const CommitPlanRow* plan) {
  const PendingBlocks& p = a.pending;
  const int listed = *internal::PendingListSize(p);
  const int32_t* const list = internal::PendingList(p);
  __shared__ int journaled;
  if (threadIdx.x == 0) journaled = listed;
  for (int j = threadIdx.x; j < listed; j += blockDim.x) {
    internal::PendingJournalList(p, j, list[j]);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < a.num_rows; i += blockDim.x) {
    internal::ForEachCommitWrite(a, plan[i], i, [&](int32_t b, CheckedField, int32_t, int32_t) {
      internal::PendingJournalList(p, atomicAdd(&journaled, 1), b);
    });
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    internal::PendingJournalMarkStarted(p, kPendingCommit, journaled, -1, a.journal.step);
  }
}

// After a Verify's or a Flush's last write (plain stream order): the
// pending journal is idle again.
__global__ void PendingJournalDoneKernel(const PendingBlocks p) {
  internal::PendingJournalMarkDone(p);
}

// Checks, plans and writes the replay indices of a commit.
__device__ void CommitPlan(const CommitArgs& a, int64_t num_blocks) {
  if (threadIdx.x == 0) *a.status = internal::OkStatus();
  __syncthreads();
  if (!BlockCheckPrerequisites(a.prerequisites, a.status)) return;
  const internal::CommitWorkspace ws =
      internal::CommitWorkspaceLayout(a.workspace, a.num_rows, num_blocks);
  if (!BlockCheckRows(a.num_rows, a.status, [&](int i) {
        return internal::PlanCommitRow(a, num_blocks, i, &ws.plan[i]);
      })) {
    return;
  }
  if (!BlockCheckCrossRow(
          a.num_rows, ws.owner, a.status,
          [&](int i, auto fn) { internal::ForEachCommitWrite(a, ws.plan[i], i, fn); },
          [&](int i, auto fn) { internal::ForEachCommitRead(ws.plan[i], i, fn); })) {
    return;
  }
  const bool deferred = a.pending.entries != nullptr;
  // DEFERRED's own checks come first: a commit whose checks fail leaves
  // the journals alone.
  if (deferred && !BlockCheckRows(a.num_rows, a.status, [&](int i) {
        return internal::CheckDeferredCommitRow(a, ws.plan[i], i);
      })) {
    return;
  }
  // FAST: every layer's cursors and candidates, each written block's ring
  // empty (an item per row and layer, in the CPU's order), one row a
  // checkpoint block.
  if (a.fast && !BlockCheckItems(
                    a.num_rows * a.num_layers, a.status,
                    [&](int x) {
                      const int i = x / a.num_layers, l = x % a.num_layers;
                      return internal::CheckFastCommitRow(a, a.device_layers[l].fast, l,
                                                          ws.plan[i], i);
                    },
                    [&](int x) { return x / a.num_layers; })) {
    return;
  }
  if (a.fast && !BlockCheckOneRowABlock(a.num_rows, ws.owner, a.status,
                                        [&](int i) { return ws.plan[i].source; })) {
    return;
  }
  if (a.journal.record != nullptr) {  // before the commit's first write
    __syncthreads();
    for (int i = threadIdx.x; i < a.num_rows; i += blockDim.x) {
      internal::JournalListRow(a, ws.plan[i], i);
    }
    if (deferred && a.pending.journal != nullptr) BlockListDeferredCommit(a, ws.plan);
    __syncthreads();
    if (threadIdx.x == 0) internal::JournalMarkStarted(a.journal, a.num_rows);
    __syncthreads();
  }
  const int q = a.spec_query_len;
  if (deferred) {
    BlockDeferCommit(a, ws.plan);
    return;
  }
  for (int item = threadIdx.x; item < a.num_rows * (q + 1); item += blockDim.x) {
    const int i = item / (q + 1);
    ws.replay_indices[item] = internal::ReplayIndex(ws.plan[i], q, item % (q + 1));
  }
}

__global__ void __launch_bounds__(kCheckThreads) CommitPlanKernel(const CommitArgs a,
                                                                  int64_t num_blocks) {
  LetDependentsLaunch();
  CommitPlan(a, num_blocks);
  PublishStatus(a.status, a.status_mirror);
}

// After the commit's last write (plain stream order, no programmatic
// dependency): the listed blocks' records, then "committed". Does nothing
// when the record does not hold this commit, started (its checks failed).
__global__ void __launch_bounds__(kCheckThreads)
    JournalFinishKernel(const CommitJournal j, const PendingBlocks pending, int64_t num_blocks) {
  if (!internal::JournalOpenFor(j)) return;  // the same for every thread
  if (pending.journal != nullptr && threadIdx.x == 0) internal::PendingJournalMarkDone(pending);
  const uint64_t sequence = j.record->commits + 1;
  const int rows = internal::JournalRows(j);
  for (int e = threadIdx.x; e < 2 * rows; e += blockDim.x) {
    internal::JournalRecordEntry(j, num_blocks, e, j.step, sequence);
  }
  __syncthreads();
  if (threadIdx.x == 0) internal::JournalMarkCommitted(j, sequence);
}

// docs/semantics.md, Commit step 2: one thread per (layer, row, conv channel) reads
// the row's windows into registers before it writes them (the final or
// boundary block may be the source).
template <typename Act>
__global__ void __launch_bounds__(kConvThreads)
    ConvCompactKernel(const CommitArgs a, int64_t num_blocks, int dim_blocks, int history_len) {
  LetDependentsLaunch();
  WaitForPrerequisiteGrid();
  if (a.status->failed) return;
  const int64_t block = blockIdx.x;
  const int dim_block = static_cast<int>(block % dim_blocks);
  const int i = static_cast<int>((block / dim_blocks) % a.num_rows);
  const int l = static_cast<int>(block / (int64_t{dim_blocks} * a.num_rows));
  const int d = dim_block * kConvThreads + threadIdx.x;
  const internal::CommitWorkspace ws =
      internal::CommitWorkspaceLayout(a.workspace, a.num_rows, num_blocks);
  const CommitPlanRow plan = ws.plan[i];
  const ConvPool c = a.device_layers[l].conv;
  if (!internal::CommitsAnything(plan) || d >= c.dim) return;
  const bool boundary = a.block_table.data != nullptr && IsBlock(plan.boundary_block);
  Act* const base = static_cast<Act*>(c.data);
  const Act* src = base + int64_t{plan.source} * c.block_stride + d * c.dim_stride;
  Act final_window[kMaxConvHistory];
  Act boundary_window[kMaxConvHistory];
#pragma unroll
  for (int x = 0; x < kMaxConvHistory; ++x) {
    if (x < history_len) {
      final_window[x] = src[int64_t(plan.commit_len - 1 + x) * c.token_stride];
      if (boundary) boundary_window[x] = src[int64_t(plan.boundary_len - 1 + x) * c.token_stride];
    }
  }
  Act* dst = base + int64_t{plan.final_block} * c.block_stride + d * c.dim_stride;
  Act* bdst = base + int64_t{plan.boundary_block} * c.block_stride + d * c.dim_stride;
#pragma unroll
  for (int x = 0; x < kMaxConvHistory; ++x) {
    if (x < history_len) {
      if (boundary) bdst[x * c.token_stride] = boundary_window[x];
      dst[x * c.token_stride] = final_window[x];
    }
  }
}

__device__ void RecordStateBlocks(const RecordStateBlocksArgs& a) {
  if (threadIdx.x == 0) *a.status = internal::OkStatus();
  __syncthreads();
  if (!BlockCheckPrerequisites(a.prerequisites, a.status)) return;
  // The checked rows go to the workspace: the cross-row pass and the writes
  // read them, not the caller's tensors again.
  const internal::RecordWorkspace ws =
      internal::RecordWorkspaceLayout(a.workspace, a.workspace_bytes);
  if (!BlockCheckRows(a.num_rows, a.status,
                      [&](int i) { return internal::CheckRecordRow(a, i, &ws.rows[i]); })) {
    return;
  }
  if (!BlockCheckCrossRow(
          a.num_rows, ws.owner, a.status,
          [&](int i, auto fn) { internal::ForEachRecordWrite(ws.rows[i], fn); },
          [](int, auto) {})) {
    return;
  }
  for (int i = threadIdx.x; i < a.num_rows; i += blockDim.x) {
    const internal::RecordRow row = ws.rows[i];
    if (row.request_row < 0) continue;
    a.state_idx[row.request_row] = row.state_column;
    a.num_accepted[row.request_row] = 1;
  }
}

__global__ void __launch_bounds__(kCheckThreads)
    RecordStateBlocksKernel(const RecordStateBlocksArgs a) {
  RecordStateBlocks(a);
  PublishStatus(a.status, a.status_mirror);
}

// Each value loaded once, staged, checked; copied to the layer only when all
// of them are finite.
__global__ void __launch_bounds__(kCheckThreads) LoadParamsKernel(const LoadParamsArgs a) {
  if (threadIdx.x == 0) *a.status = internal::OkStatus();
  const int count = a.num_heads + a.num_heads * a.head_dim;
  RowFault fault = internal::NoFault();
  int fault_index = INT_MAX;
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    const float x = i < a.num_heads ? a.a_log[i] : a.dt_bias[i - a.num_heads];
    a.staging[i] = x;
    const RowFault f = internal::CheckParamValue(x, i, a.num_heads);
    if (f.problem != 0 && fault_index == INT_MAX) {
      fault = f;
      fault_index = i;
    }
  }
  __shared__ int lowest;
  if (threadIdx.x == 0) lowest = INT_MAX;
  __syncthreads();
  if (fault_index != INT_MAX) atomicMin(&lowest, fault_index);
  __syncthreads();
  const int failed = lowest;
  if (failed != INT_MAX) {
    if (fault_index == failed) *a.status = internal::StatusFromFault(fault, -1, -1);
  } else {
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
      if (i < a.num_heads) {
        a.dst_a_log[i] = a.staging[i];
      } else {
        a.dst_dt_bias[i - a.num_heads] = a.staging[i];
      }
    }
  }
  PublishStatus(a.status, a.status_mirror);
}

// ---------------------------------------------------------------------------

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

void SetHeads(const KdaShape& shape, RecurrentLaunch* p) {
  p->num_heads = ValueHeads(shape);
  p->num_key_heads = shape.num_heads;
  p->kind = shape.kind;
  p->gate = shape.gate;
  p->lower_bound = shape.lower_bound;
}

// Whether every token's head slice of q, k, g and v starts on a 16-byte
// boundary (the pipelined kernel then copies them asynchronously).
// (GDN's g is a scalar per head, loaded, never copied.)
bool InputsAligned(const void* q, int64_t q_stride, const void* k, int64_t k_stride, const void* v,
                   int64_t v_stride, const void* g, const KdaShape& shape, size_t elem) {
  const auto ok = [&](const void* p, int64_t stride) {
    return Aligned16(p) && (stride * int64_t(elem)) % 16 == 0;
  };
  return ok(q, q_stride) && ok(k, k_stride) && ok(v, v_stride) &&
         (shape.kind == LayerKind::kGdn || ok(g, GateWidth(shape))) &&
         (shape.head_dim * elem) % 16 == 0;
}

bool ViewInputsAligned(const LayerView& l, const KdaShape& shape, size_t elem) {
  return InputsAligned(l.q, l.q_stride, l.k, l.k_stride, l.v, l.v_stride, l.g, shape, elem);
}

// The records as the replay reads them: q = k = kv[:, 0], v = kv[:, 1], g.
bool RecordsAligned(const Records& r, const KdaShape& shape, size_t elem) {
  const int64_t width = RecordTokenWidth(shape);
  return InputsAligned(r.kv, width, r.kv, width,
                       static_cast<const char*>(r.kv) + KeyWidth(shape) * elem, width, r.g, shape,
                       elem);
}

// A failed launch (or an earlier fault it reports), named like the kernels'
// other errors: "In Verify: CUDA kernel launch: <description> (<name>)".
absl::Status LaunchStatus(cudaError_t err, absl::string_view op) {
  if (err == cudaSuccess) return absl::OkStatus();
  return CudaStatus(err, absl::StrCat("In ", op, ": CUDA kernel launch"));
}

absl::Status Unsupported(absl::string_view op) {
  return absl::InvalidArgumentError(absl::StrCat("In ", op, ": unsupported dtype or head dim"));
}

LayerView ViewOf(const Activation& q, const Activation& k, const Activation& v,
                 const Activation& g, const Activation& beta, void* out, const StatePool& state,
                 const LayerParams& params) {
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

// The production recurrent kernel (pipelined_recurrent.cuh) of mode M.
template <Mode M, typename Act, typename State, int K>
cudaError_t Recurrent(const RecurrentLaunch& p, int num_layers, cudaStream_t stream) {
  return LaunchPipelined<M, Act, State, K, PipelinedLayout>(p, num_layers, stream);
}

// Commit mode FAST (kda_args.h, FastRings): kernels/fast/cuda's kernels,
// gated on the status of this backend's checks.
absl::Status LaunchFastVerify(const VerifyArgs& a, cudaStream_t s) {
  FastVerifyCheckKernel<<<1, kCheckThreads, 0, s>>>(a);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess || a.num_rows == 0) {
    return LaunchStatus(err, "Verify");
  }
  fast::FastVerifyArgs f = fast::FastVerifyArgsOf(a);
  f.gate = a.status;
  return fast::RunFastVerifyCuda(f, s, fast::ServedCheckpointOperands(a.shape));
}

// After the commit's plan kernel (its checks) and the conv compaction.
absl::Status LaunchFastCommit(const CommitArgs& a, int64_t num_blocks, cudaStream_t s) {
  const std::vector<fast::FastLayer> layers = fast::FastLayersOf(a.layers, a.num_layers);
  fast::FastCommitArgs f = fast::FastCommitArgsOf(a, layers.data());
  f.plan = internal::CommitWorkspaceLayout(a.workspace, a.num_rows, num_blocks).plan;
  f.gate = a.status;
  return fast::RunFastCommitCuda(f, s);
}

absl::Status LaunchFastFlush(const FlushArgs& a, cudaStream_t s) {
  FastFlushCheckKernel<<<1, kCheckThreads, 0, s>>>(a);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return LaunchStatus(err, "Flush");
  }
  const std::vector<fast::FastLayer> layers = fast::FastLayersOf(a.layers, a.num_layers);
  fast::FastMaterializeArgs m;
  m.shape = a.shape;
  m.num_layers = a.num_layers;
  m.layers = layers.data();
  m.every_block = a.blocks == nullptr;
  if (!m.every_block) {
    m.blocks = a.checked_blocks;
    m.num_blocks_given = a.num_blocks_given;
  }
  m.layer = a.layer;
  m.discard = a.discard;
  m.gate = a.status;
  return fast::RunFastMaterializeCuda(m, s);
}

class CudaKernels final : public KdaKernels {
 public:
  Backend backend() const override { return Backend::kCuda; }

 protected:
  absl::Status LaunchStock(const StockArgs& a, Stream stream) const override {
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    StockCheckKernel<<<1, kCheckThreads, 0, s>>>(a);
    if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess || a.num_rows == 0) {
      return LaunchStatus(err, "Stock");
    }
    RecurrentLaunch p{};
    p.num_rows = a.num_rows;
    SetHeads(a.shape, &p);
    p.qsl = a.query_start_loc;
    p.indices = a.ssm_state_indices.data;
    p.indices_stride = a.ssm_state_indices.row_stride;
    p.num_accepted = a.num_accepted_tokens;
    p.max_tokens = internal::StockMaxTokens(a.ssm_state_indices.cols);
    p.status = a.status;
    p.layer = ViewOf(a.q, a.k, a.v, a.g, a.beta, a.out, a.state, a.params);
    p.async_inputs = ViewInputsAligned(p.layer, a.shape, DTypeSize(a.shape.act_dtype));
    cudaError_t err = cudaErrorInvalidValue;
    const bool ok = internal::DispatchKda(a.shape, [&](auto act, auto state, auto head_dim) {
      err = Recurrent<Mode::kStock, typename decltype(act)::type,
                      typename decltype(state)::type, decltype(head_dim)::value>(p, 1, s);
    });
    return ok ? LaunchStatus(err, "Stock") : Unsupported("Stock");
  }

  absl::Status LaunchVerify(const VerifyArgs& a, Stream stream) const override {
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (a.fast.cursors != nullptr) return LaunchFastVerify(a, s);
    VerifyCheckKernel<<<1, kCheckThreads, 0, s>>>(a);
    if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess || a.num_rows == 0) {
      return LaunchStatus(err, "Verify");
    }
    const bool deferred = a.pending.entries != nullptr;
    RecurrentLaunch p{};
    p.num_rows = a.num_rows;
    SetHeads(a.shape, &p);
    // The snapshot the checks validated, never the caller's indices.
    // (DEFERRED loads only the checkpoint early: the checks say what each
    // row replays.)
    p.early_loads = a.expected_query_start_loc != nullptr;
    p.num_tokens = a.num_tokens;
    p.num_blocks = a.state.num_blocks;
    p.qsl = internal::VerifiedQueryStartLoc(a);
    p.indices = internal::VerifiedStateIndices(a);
    p.indices_stride = 1;
    p.window = a.records.q;
    p.max_tokens = deferred ? 2 * a.records.q : a.records.q;
    p.status = a.status;
    p.layer = ViewOf(a.q, a.k, a.v, a.g, a.beta, a.out, a.state, a.params);
    p.layer.rec_kv = a.records.kv;
    p.layer.rec_g = a.records.g;
    p.layer.rec_beta = a.records.beta;
    const size_t elem = DTypeSize(a.shape.act_dtype);
    p.async_inputs = ViewInputsAligned(p.layer, a.shape, elem);
    if (deferred) {
      p.replay_plan = a.replay_plan;
      p.pending_buffer = internal::PendingBufferWord(a.pending);
      p.records[0] = a.records;
      p.records[1] = a.records_alt;
      p.async_inputs = p.async_inputs && RecordsAligned(a.records, a.shape, elem) &&
                       RecordsAligned(a.records_alt, a.shape, elem);
    }
    cudaError_t err = cudaErrorInvalidValue;
    const bool ok = internal::DispatchKda(a.shape, [&](auto act, auto state, auto head_dim) {
      using Act = typename decltype(act)::type;
      using State = typename decltype(state)::type;
      constexpr int K = decltype(head_dim)::value;
      err = deferred ? Recurrent<Mode::kReplayVerify, Act, State, K>(p, 1, s)
                     : Recurrent<Mode::kVerify, Act, State, K>(p, 1, s);
    });
    return ok ? LaunchStatus(err, "Verify") : Unsupported("Verify");
  }

  absl::Status LaunchCommit(const CommitArgs& a, Stream stream) const override {
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const int64_t num_blocks = a.layers[0].state.num_blocks;
    const int history_len = a.layers[0].conv.width - a.spec_query_len + 1;
    CommitPlanKernel<<<1, kCheckThreads, 0, s>>>(a, num_blocks);
    const bool deferred = a.pending.entries != nullptr;
    if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess || a.num_rows == 0) {
      // A DEFERRED commit without rows still materializes what the previous
      // one left pending.
      if (err != cudaSuccess || !deferred) return LaunchStatus(err, "Commit");
      return LaunchReplayJobs(a.shape, a.spec_query_len, a.num_layers, a.layers, a.device_layers,
                              a.jobs, a.status, s, "Commit",
                              /*usually_empty=*/a.block_table.data == nullptr);
    }

    const int dim_blocks = (a.layers[0].conv.dim + kConvThreads - 1) / kConvThreads;
    cudaError_t conv_err = cudaSuccess;
    const int64_t conv_blocks = int64_t{dim_blocks} * a.num_rows * a.num_layers;
    internal::DispatchAct(a.shape.act_dtype, [&](auto act) {
      conv_err = LaunchDependent(ConvCompactKernel<typename decltype(act)::type>,
                                 static_cast<unsigned>(conv_blocks), kConvThreads, 0, s, a,
                                 num_blocks, dim_blocks, history_len);
    });
    if (const cudaError_t err = conv_err != cudaSuccess ? conv_err : cudaGetLastError();
        err != cudaSuccess) {
      return LaunchStatus(err, "Commit");
    }

    if (deferred) {
      return LaunchReplayJobs(a.shape, a.spec_query_len, a.num_layers, a.layers, a.device_layers,
                              a.jobs, a.status, s, "Commit",
                              /*usually_empty=*/a.block_table.data == nullptr);
    }
    if (a.fast) return LaunchFastCommit(a, num_blocks, s);
    RecurrentLaunch p{};
    p.num_rows = a.num_rows;
    SetHeads(a.shape, &p);
    p.num_layers = a.num_layers;
    p.indices = internal::CommitWorkspaceLayout(a.workspace, a.num_rows, num_blocks).replay_indices;
    p.indices_stride = a.spec_query_len + 1;
    p.window = a.spec_query_len;
    p.max_tokens = a.spec_query_len;
    p.status = a.status;
    p.replay_layers = a.device_layers;
    // The replay reads the records: q = k = kv[:, 0], v = kv[:, 1], g.
    p.async_inputs = true;
    const size_t elem = DTypeSize(a.shape.act_dtype);
    for (int l = 0; l < a.num_layers; ++l) {
      p.async_inputs = p.async_inputs && RecordsAligned(a.layers[l].records, a.shape, elem);
    }
    cudaError_t err = cudaErrorInvalidValue;
    const bool ok = internal::DispatchKda(a.shape, [&](auto act, auto state, auto head_dim) {
      err = Recurrent<Mode::kReplay, typename decltype(act)::type,
                      typename decltype(state)::type, decltype(head_dim)::value>(p, a.num_layers, s);
    });
    return ok ? LaunchStatus(err, "Commit") : Unsupported("Commit");
  }

  absl::Status LaunchJournalFinish(const CommitArgs& a, Stream stream) const override {
    JournalFinishKernel<<<1, kCheckThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        a.journal, a.pending, a.layers[0].state.num_blocks);
    return LaunchStatus(cudaGetLastError(), "Commit");
  }

  absl::Status LaunchPendingFinish(const PendingBlocks& p, Stream stream) const override {
    PendingJournalDoneKernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(p);
    return LaunchStatus(cudaGetLastError(), "pending journal");
  }

  absl::Status LaunchFlush(const FlushArgs& a, Stream stream) const override {
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (a.fast) return LaunchFastFlush(a, s);
    FlushPlanKernel<<<1, kCheckThreads, 0, s>>>(a);
    if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess || a.discard) {
      return LaunchStatus(err, "Flush");
    }
    return LaunchReplayJobs(a.shape, a.spec_query_len, a.num_layers, a.layers, a.device_layers,
                            a.jobs, a.status, s, "Flush", /*usually_empty=*/false);
  }

  // The replay of a list the call's first kernel wrote (DEFERRED): every
  // job from its own layer and records buffer, as many as the list holds.
  absl::Status LaunchReplayJobs(const KdaShape& shape, int q, int num_layers,
                                const CommitLayer* layers, const CommitLayer* device_layers,
                                const ReplayJobs& jobs, const DeviceStatus* status,
                                cudaStream_t s, const char* op, bool usually_empty) const {
    RecurrentLaunch p{};
    p.small_grid = usually_empty;
    p.num_rows = jobs.capacity;
    SetHeads(shape, &p);
    p.num_layers = 1;
    p.jobs = jobs.jobs;
    p.job_count = jobs.count;
    p.window = q;
    p.max_tokens = q;
    p.status = status;
    p.replay_layers = device_layers;
    p.async_inputs = true;
    const size_t elem = DTypeSize(shape.act_dtype);
    for (int l = 0; l < num_layers; ++l) {
      p.async_inputs = p.async_inputs && RecordsAligned(layers[l].records, shape, elem) &&
                       RecordsAligned(layers[l].records_alt, shape, elem);
    }
    cudaError_t err = cudaErrorInvalidValue;
    const bool ok = internal::DispatchKda(shape, [&](auto act, auto state, auto head_dim) {
      err = Recurrent<Mode::kReplay, typename decltype(act)::type, typename decltype(state)::type,
                      decltype(head_dim)::value>(p, 1, s);
    });
    return ok ? LaunchStatus(err, op) : Unsupported(op);
  }

  absl::Status LaunchRecordStateBlocks(const RecordStateBlocksArgs& a,
                                       Stream stream) const override {
    RecordStateBlocksKernel<<<1, kCheckThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
    return LaunchStatus(cudaGetLastError(), "RecordStateBlocks");
  }

  absl::Status LaunchLoadParams(const LoadParamsArgs& a, Stream stream) const override {
    LoadParamsKernel<<<1, kCheckThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
    return LaunchStatus(cudaGetLastError(), "LoadParams");
  }
};

// Grid-stride: a readback is a few kilobytes on the hot path (a step's
// indices, a commit's plan), megabytes only for ReadState. Whole words when
// both ends are aligned.
__global__ void __launch_bounds__(256) CopyToHostKernel(char* dst, const char* src, uint64_t bytes) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  const uint64_t first = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes) % 4 == 0) {
    for (uint64_t i = first; i < bytes / 4; i += stride) {
      reinterpret_cast<uint32_t*>(dst)[i] = reinterpret_cast<const uint32_t*>(src)[i];
    }
  } else {
    for (uint64_t i = first; i < bytes; i += stride) dst[i] = src[i];
  }
}

}  // namespace

absl::Status CopyToHostOnStream(void* host, const void* device, uint64_t bytes, Stream stream) {
  if (bytes == 0) return absl::OkStatus();
  if (host == nullptr || device == nullptr) {
    return absl::InvalidArgumentError("CopyToHostOnStream: a null pointer");
  }
  const uint64_t blocks = std::min<uint64_t>((bytes / 4 + 255) / 256, 256);
  CopyToHostKernel<<<static_cast<unsigned>(std::max<uint64_t>(blocks, 1)), 256, 0,
                     static_cast<cudaStream_t>(stream)>>>(
      static_cast<char*>(host), static_cast<const char*>(device), bytes);
  return LaunchStatus(cudaGetLastError(), "CopyToHostOnStream");
}

absl::StatusOr<const KdaKernels*> CudaKdaKernels() {
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0) {
    return absl::UnavailableError(absl::StrCat(
        "no CUDA device is available (",
        err != cudaSuccess ? DescribeCudaError(err) : "no devices", ")"));
  }
  static const CudaKernels* const kernels = new CudaKernels();
  return kernels;
}

bool BuiltWithCuda() { return true; }

}  // namespace kernels
}  // namespace specstate
