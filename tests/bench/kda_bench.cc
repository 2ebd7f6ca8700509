// kda_bench: times the CUDA RecoverSSM kernels against the device-to-device
// copy bandwidth measured in the same run, and prints markdown tables.
//
//   kda_bench [--shapes=kimi_linear,kimi_k3] [--iters=30] [--cold]
//
// For each shape and N requests: the stock spec-path kernel on one layer,
// verify on one layer, and the commit of every layer (mode none, and one row
// in align mode), each as the median of --iters runs timed with CUDA events
// (launched from the host, and replayed from a CUDA graph), with the bytes
// each must move: every state, input and output counted once. Then the same
// step in commit mode DEFERRED: the fused verify (every row replays its
// pending accepted tokens, uniform in [1, Q], writes its checkpoint once and
// verifies) and the conv-only commit; then commit mode FAST (issue 23,
// --fold_every F): its verify from the checkpoint and the ring, and its
// commit of every layer, through the kernel interface as the service calls
// them (device checks included), averaged over --fast_snapshots steps of the
// steady state of rings under accepted counts uniform in [1, Q] (so folds
// come at their measured rate); and the per-layer step of each mode against
// the stock kernel.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "kernels/fast/cuda/fast_cuda.h"
#include "kernels/fast/fast_args.h"
#include "kernels/fast/fast_kernels.h"
#include "kernels/fast/from_interface.h"
#include "kernels/kda_kernels.h"
#include "kernels/numeric.h"
#include "server/presets.h"
#include "tests/bench/cuda_check.h"

ABSL_FLAG(std::string, shapes, "kimi_linear,kimi_k3,qwen3_next", "shapes to run");
ABSL_FLAG(int, iters, 30, "timed runs per measurement");
// Retired with the kernels they timed (the layout variants of the recurrent
// kernel left the product: docs/benchmarks.md); accepted so that older
// command lines (tools/gpu/*.sh pass --sweep=false --before=false) still run.
ABSL_FLAG(bool, sweep, false, "retired, ignored: the layout sweep is no longer built");
ABSL_FLAG(bool, before, false, "retired, ignored: the kernel before the pipelined one is gone");
ABSL_FLAG(std::string, ns, "1,16,64,256", "request counts");
ABSL_FLAG(bool, cold, true,
          "also time with a cold L2 (a buffer larger than L2 written before every run)");
ABSL_FLAG(int, fold_every, 4, "commit mode FAST's F: rings of F * Q tokens (0: no FAST rows)");
ABSL_FLAG(int, fast_snapshots, 6,
          "FAST: steady-state steps timed; their mean is the step with folds amortized");
ABSL_FLAG(bool, fast_checkpoint_numerics, true,
          "FAST: also time Verify's checkpoint products on CUDA cores (fp32) and on tensor "
          "cores (3xTF32, tf32), through the kernel launcher (no device checks)");
ABSL_FLAG(bool, eager, true,
          "time EAGER's verify and commit (with --eager=false only the stock kernel and DEFERRED's "
          "rows run: what profile_kernels.sh profiles)");

namespace specstate {
namespace {

using kernels::KdaKernels;

void CheckOk(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

struct Shape {
  std::string name;
  int H, K, Q, L, conv_dim, conv_kernel;
  kernels::LayerKind kind = kernels::LayerKind::kKda;
  int HV = 0;  // value heads (GDN); 0: = H
  int value_heads() const { return HV > 0 ? HV : H; }
  bool gdn() const { return kind == kernels::LayerKind::kGdn; }
};

// The models' shapes: the service's presets (server/presets.cc, where each
// field's source is cited; specstated --model takes the same names).
Shape FromPreset(const char* preset, const char* label) {
  const server::ModelPreset* p = server::FindModelPreset(preset);
  if (p == nullptr) {
    std::fprintf(stderr, "kda_bench: no model preset %s\n", preset);
    std::exit(2);
  }
  Shape s;
  s.name = label;
  s.H = p->num_heads;
  s.K = p->head_dim;
  s.Q = p->num_spec + 1;
  s.L = p->num_layers;
  s.conv_dim = p->conv_dim;
  s.conv_kernel = p->conv_kernel;
  s.kind = p->layer_kind == v1::GDN ? kernels::LayerKind::kGdn : kernels::LayerKind::kKda;
  s.HV = p->num_value_heads;
  return s;
}

const Shape kKimiLinear = FromPreset("kimi-linear-48b-a3b", "Kimi-Linear-48B-A3B");
const Shape kKimiK3 = FromPreset("kimi-k3-tp8", "Kimi-K3 (TP8)");
// Gated DeltaNet: 16 key heads, 32 value heads, conv dim 2 H K + HV V.
const Shape kQwen3Next = FromPreset("qwen3-next-80b-a3b", "Qwen3-Next-80B-A3B");

void* DeviceAlloc(size_t bytes) {
  void* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, bytes));
  return p;
}

template <typename T>
T* Upload(const std::vector<T>& host) {
  T* p = static_cast<T*>(DeviceAlloc(host.size() * sizeof(T) + 16));
  CHECK_CUDA(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

// Random values: up to 8 MiB generated on the host, larger buffers tiled with
// device copies of that (gigabytes of pools would take minutes to generate).
template <typename Convert>
void FillRandom(void* dst, size_t count, size_t elem, float lo, float hi, std::mt19937& rng,
                Convert convert) {
  std::uniform_real_distribution<float> dist(lo, hi);
  const size_t chunk = std::min(count, (size_t{8} << 20) / elem);
  std::vector<char> host(chunk * elem);
  for (size_t i = 0; i < chunk; ++i) convert(dist(rng), host.data() + i * elem);
  CHECK_CUDA(cudaMemcpy(dst, host.data(), host.size(), cudaMemcpyHostToDevice));
  for (size_t done = chunk; done < count; done += chunk) {
    const size_t n = std::min(chunk, count - done);
    CHECK_CUDA(cudaMemcpy(static_cast<char*>(dst) + done * elem, dst, n * elem,
                          cudaMemcpyDeviceToDevice));
  }
}

void FillRandomBf16(void* dst, size_t count, float lo, float hi, std::mt19937& rng) {
  FillRandom(dst, count, 2, lo, hi, rng, [](float x, char* out) {
    const uint16_t bits = FromFloat<BFloat16>(x).bits;
    std::memcpy(out, &bits, 2);
  });
}

void FillRandomF32(void* dst, size_t count, float lo, float hi, std::mt19937& rng) {
  FillRandom(dst, count, 4, lo, hi, rng, [](float x, char* out) { std::memcpy(out, &x, 4); });
}

// Median time (us) of `iters` runs of `fn`, each timed with CUDA events; and
// the same for replays of a CUDA graph of one run.
struct Timing {
  double launched_us;
  double graph_us;
  double best() const { return std::min(launched_us, graph_us); }
};

// In a decode step the model's weights pass through L2 between two calls of
// a layer: a cold-L2 run writes this buffer (larger than the H200's 60 MiB L2)
// first, outside the timed window.
void* L2Flush() {
  static void* const buffer = [] {
    void* p = nullptr;
    CHECK_CUDA(cudaMalloc(&p, size_t{256} << 20));
    return p;
  }();
  return buffer;
}

// `prepare` (optional) runs on the stream before every timed run, outside
// the timed window: what a run consumes (DEFERRED's pending entries) is put
// back.
Timing Time(cudaStream_t stream, int iters, const std::function<void()>& fn, bool cold = false,
            const std::function<void()>& prepare = nullptr) {
  const auto flush = [&] {
    if (prepare) prepare();
    if (cold) CHECK_CUDA(cudaMemsetAsync(L2Flush(), 0x3f, size_t{256} << 20, stream));
  };
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) {
    flush();
    fn();
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    flush();
    CHECK_CUDA(cudaEventRecord(a, stream));
    fn();
    CHECK_CUDA(cudaEventRecord(b, stream));
    CHECK_CUDA(cudaEventSynchronize(b));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  Timing timing{ms[ms.size() / 2] * 1000.0, 0};

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  flush();
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  fn();
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 3; ++i) {
    flush();
    CHECK_CUDA(cudaGraphLaunch(exec, stream));
  }
  ms.clear();
  for (int i = 0; i < iters; ++i) {
    flush();
    CHECK_CUDA(cudaEventRecord(a, stream));
    CHECK_CUDA(cudaGraphLaunch(exec, stream));
    CHECK_CUDA(cudaEventRecord(b, stream));
    CHECK_CUDA(cudaEventSynchronize(b));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  timing.graph_us = ms[ms.size() / 2] * 1000.0;
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  CHECK_CUDA(cudaEventDestroy(a));
  CHECK_CUDA(cudaEventDestroy(b));
  return timing;
}

// Device-to-device copy bandwidth (bytes read + written per second).
double CopyBandwidth(cudaStream_t stream, int iters) {
  const size_t bytes = size_t{2} << 30;
  void* a = DeviceAlloc(bytes);
  void* b = DeviceAlloc(bytes);
  CHECK_CUDA(cudaMemset(a, 1, bytes));
  const Timing t = Time(stream, iters, [&] {
    CHECK_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream));
  });
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaFree(b));
  return 2.0 * bytes / (t.launched_us * 1e-6);
}

// Everything one shape needs at N rows: per-layer pools (two blocks per row:
// the checkpoint and, in align mode, the next), records and parameters; one
// layer's activations; a stock pool with Q blocks per row for the stock path.
struct Bench {
  Shape shape;
  int N;
  int64_t T;
  int64_t HK;  // key width (q, k per token)
  int64_t VW, GW, HV;  // value width (v, o), gate width (g), value heads (beta)
  int64_t state_bytes;  // one block
  int64_t num_blocks;
  int conv_width;
  kernels::KdaShape kda;
  std::vector<kernels::CommitLayer> layers;
  kernels::CommitLayer* device_layers;
  void *q, *k, *v, *g, *beta, *out;
  void* stock_pool;
  int32_t *qsl, *checkpoints, *stock_indices, *stock_accepted, *accepted, *block_table,
      *computed;
  void *workspace, *stock_workspace;
  size_t workspace_bytes, stock_workspace_bytes;
  kernels::DeviceStatus* status;
  std::vector<int> accepted_host;
  // DEFERRED: the bookkeeping as a commit of every row leaves it (each
  // row's checkpoint pending with its accepted tokens, in every layer,
  // records in buffer 0), and the copies runs restore it from.
  kernels::PendingBlocks pending;
  int32_t *entries_committed, *header_committed;
  size_t entries_bytes, header_bytes;
  void* verify_workspace;
  int32_t* replay_plan;
  kernels::ReplayJobs jobs;
  // FAST: per layer a ring of fast_capacity tokens a block (the layers'
  // `fast`, in fast_layers and its device copy); the cursors of a steady
  // state's steps, before each step's Verify (candidates 0) and as it leaves
  // them (candidates Q), [num_blocks] each, on the device.
  int fast_capacity = 0;
  std::vector<kernels::CommitLayer> fast_layers;
  kernels::CommitLayer* device_fast_layers = nullptr;
  std::vector<kernels::FastCursor*> cursors_before, cursors_verified;
  std::vector<double> ring_tokens;       // a step's mean ring tokens a row
  std::vector<std::vector<int>> fold_tokens;  // a step's folds: tokens folded a row (0: none)
};

Bench Make(const Shape& s, int N, std::mt19937& rng) {
  Bench b;
  b.shape = s;
  b.N = N;
  b.T = int64_t{N} * s.Q;
  b.HK = int64_t{s.H} * s.K;
  b.VW = int64_t{s.value_heads()} * s.K;
  b.GW = s.gdn() ? s.value_heads() : b.HK;
  b.HV = s.value_heads();
  b.state_bytes = b.VW * s.K * 4;
  b.num_blocks = 1 + 2 * int64_t{N};
  b.conv_width = s.conv_kernel - 1 + s.Q - 1;
  b.kda = kernels::KdaShape{s.H, s.K, DType::kBFloat16, DType::kFloat32, -5.0f, s.kind, b.HV};
  for (int l = 0; l < s.L; ++l) {
    kernels::CommitLayer layer;
    layer.state = kernels::StatePool{DeviceAlloc(b.num_blocks * b.state_bytes), b.num_blocks,
                                     b.VW * s.K};
    FillRandomF32(layer.state.data, b.num_blocks * b.VW * s.K, -0.5f, 0.5f, rng);
    const int64_t conv_block = int64_t{s.conv_dim} * b.conv_width;
    layer.conv = kernels::ConvPool{DeviceAlloc(b.num_blocks * conv_block * 2), b.num_blocks,
                                   conv_block, b.conv_width, 1, s.conv_dim, b.conv_width};
    FillRandomBf16(layer.conv.data, b.num_blocks * conv_block, -1, 1, rng);
    float* params = static_cast<float*>(DeviceAlloc((s.H + b.HK) * 4));
    FillRandomF32(params, s.H, -2.0f, 0.5f, rng);
    FillRandomF32(params + s.H, b.HK, -1, 1, rng);
    layer.params = kernels::LayerParams{params, params + s.H};
    const int64_t tokens = b.T;
    layer.records = kernels::Records{DeviceAlloc(tokens * (b.HK + b.VW) * 2),
                                     DeviceAlloc(tokens * b.GW * 2 + 16),
                                     DeviceAlloc(tokens * b.HV * 2 + 16), N, s.Q};
    layer.records_alt = kernels::Records{DeviceAlloc(tokens * (b.HK + b.VW) * 2),
                                         DeviceAlloc(tokens * b.GW * 2 + 16),
                                         DeviceAlloc(tokens * b.HV * 2 + 16), N, s.Q};
    b.layers.push_back(layer);
  }
  b.device_layers = Upload(b.layers);
  for (void** p : {&b.q, &b.k}) {
    *p = DeviceAlloc(b.T * b.HK * 2);
    FillRandomBf16(*p, b.T * b.HK, -1, 1, rng);
  }
  for (void** p : {&b.v, &b.out}) {
    *p = DeviceAlloc(b.T * b.VW * 2);
    FillRandomBf16(*p, b.T * b.VW, -1, 1, rng);
  }
  b.g = DeviceAlloc(b.T * b.GW * 2 + 16);
  // GDN's g is a log-decay: negative.
  FillRandomBf16(b.g, b.T * b.GW, s.gdn() ? -0.5f : -1.0f, s.gdn() ? -0.01f : 1.0f, rng);
  b.beta = DeviceAlloc(b.T * b.HV * 2 + 16);
  FillRandomBf16(b.beta, b.T * b.HV, s.gdn() ? 0.0f : -3.0f, s.gdn() ? 1.0f : 3.0f, rng);
  b.stock_pool = DeviceAlloc((1 + int64_t{N} * s.Q) * b.state_bytes);
  FillRandomF32(b.stock_pool, (1 + int64_t{N} * s.Q) * b.VW * s.K, -0.5f, 0.5f, rng);

  std::vector<int32_t> qsl(N + 1), checkpoints(N), stock_indices(int64_t{N} * s.Q), stock_acc(N),
      accepted(N), table(int64_t{N} * 2), computed(N);
  std::uniform_int_distribution<int> acc(1, s.Q);
  for (int i = 0; i < N; ++i) {
    qsl[i + 1] = qsl[i] + s.Q;
    checkpoints[i] = 1 + 2 * i;
    for (int c = 0; c < s.Q; ++c) stock_indices[int64_t{i} * s.Q + c] = 1 + i * s.Q + c;
    stock_acc[i] = acc(rng);
    accepted[i] = acc(rng);
    table[2 * i] = 1 + 2 * i;
    table[2 * i + 1] = 2 + 2 * i;
    // Align mode: half the rows cross a block boundary during the step.
    computed[i] = i % 2 == 0 ? 64 - s.Q / 2 : 3;
  }
  b.accepted_host = accepted;
  b.qsl = Upload(qsl);
  b.checkpoints = Upload(checkpoints);
  b.stock_indices = Upload(stock_indices);
  b.stock_accepted = Upload(stock_acc);
  b.accepted = Upload(accepted);
  b.block_table = Upload(table);
  b.computed = Upload(computed);
  b.workspace_bytes = kernels::CommitWorkspaceBytes(N, s.Q, b.num_blocks);
  b.workspace = DeviceAlloc(b.workspace_bytes);
  CHECK_CUDA(cudaMemset(b.workspace, 0, b.workspace_bytes));
  b.stock_workspace_bytes = kernels::StockWorkspaceBytes(1 + int64_t{N} * s.Q);
  b.stock_workspace = DeviceAlloc(b.stock_workspace_bytes);
  CHECK_CUDA(cudaMemset(b.stock_workspace, 0, b.stock_workspace_bytes));
  b.status = static_cast<kernels::DeviceStatus*>(DeviceAlloc(sizeof(kernels::DeviceStatus)));

  b.pending = kernels::PendingBlocks{nullptr, nullptr, s.L, b.num_blocks, N};
  std::vector<int32_t> entries(int64_t{s.L} * b.num_blocks, 0), header(2 + N, 0);
  header[1] = N;
  for (int i = 0; i < N; ++i) {
    header[2 + i] = checkpoints[i];
    // A packed kernels::internal::PendingEntry: record row i, buffer 0, its tokens.
    for (int l = 0; l < s.L; ++l) {
      entries[int64_t{l} * b.num_blocks + checkpoints[i]] = ((i + 1) << 6) | accepted[i];
    }
  }
  b.entries_bytes = entries.size() * 4;
  b.header_bytes = header.size() * 4;
  b.entries_committed = Upload(entries);
  b.header_committed = Upload(header);
  b.pending.entries = Upload(entries);
  b.pending.header = Upload(header);
  b.verify_workspace = DeviceAlloc(kernels::VerifyWorkspaceBytes(b.num_blocks));
  CHECK_CUDA(cudaMemset(b.verify_workspace, 0, kernels::VerifyWorkspaceBytes(b.num_blocks)));
  b.replay_plan = static_cast<int32_t*>(DeviceAlloc(int64_t{N} * 4));
  b.jobs.capacity = static_cast<int>(kernels::CommitJobsCapacity(N, s.L));
  b.jobs.jobs = static_cast<kernels::ReplayJob*>(
      DeviceAlloc(b.jobs.capacity * sizeof(kernels::ReplayJob)));
  b.jobs.count = static_cast<int32_t*>(DeviceAlloc(4));
  return b;
}

// FAST's rings and steady-state cursors. Each row's ring follows accepted
// counts uniform in [1, Q] from empty for 200 steps, then `snapshots` steps
// are kept; the commit's accepted counts are the bench's (b.accepted), so a
// step folds the rows whose ring then has no room for another window (the
// schedule the service serves: Commit's folds).
void MakeFast(Bench& b, int fold_every, int snapshots, std::mt19937& rng) {
  const Shape& s = b.shape;
  const int Q = s.Q;
  b.fast_capacity = kernels::fast::FastRingCapacity(fold_every, Q);
  const int R = b.fast_capacity;
  const size_t k_bytes = kernels::fast::FastRingKBytes(b.kda, b.num_blocks, R);
  const size_t u_bytes = kernels::fast::FastRingUBytes(b.kda, b.num_blocks, R);
  const size_t g_bytes = kernels::fast::FastRingLogDecayBytes(b.kda, b.num_blocks, R);
  const size_t cursor_bytes = kernels::fast::FastCursorBytes(b.num_blocks);
  b.fast_layers = b.layers;
  for (int l = 0; l < s.L; ++l) {
    kernels::FastRings& r = b.fast_layers[l].fast;
    r.k = DeviceAlloc(k_bytes);
    r.u = static_cast<float*>(DeviceAlloc(u_bytes));
    r.log_decay = static_cast<float*>(DeviceAlloc(g_bytes));
    r.cursors = static_cast<kernels::FastCursor*>(DeviceAlloc(cursor_bytes));
    r.num_blocks = b.num_blocks;
    r.capacity = R;
    FillRandomBf16(r.k, k_bytes / 2, -1, 1, rng);
    FillRandomF32(r.u, u_bytes / 4, -0.1f, 0.1f, rng);
    FillRandomF32(r.log_decay, g_bytes / 4, -0.5f, -0.01f, rng);
  }
  b.device_fast_layers = Upload(b.fast_layers);
  std::uniform_int_distribution<int> acc(1, Q);
  std::vector<int> tokens(b.N, 0);
  for (int step = 0; step < 200 + snapshots; ++step) {
    if (step >= 200) {
      std::vector<kernels::FastCursor> before(b.num_blocks, kernels::FastCursor{0, 0});
      std::vector<kernels::FastCursor> verified = before;
      std::vector<int> folds(b.N, 0);
      double held = 0;
      for (int i = 0; i < b.N; ++i) {
        const int32_t block = 1 + 2 * i;  // the row's checkpoint (Make)
        before[block] = kernels::FastCursor{tokens[i], 0};
        verified[block] = kernels::FastCursor{tokens[i], Q};
        held += tokens[i];
        const int after = tokens[i] + b.accepted_host[i];
        if (after + Q > R) folds[i] = after;
      }
      b.cursors_before.push_back(Upload(before));
      b.cursors_verified.push_back(Upload(verified));
      b.ring_tokens.push_back(held / b.N);
      b.fold_tokens.push_back(folds);
    }
    for (int i = 0; i < b.N; ++i) {
      tokens[i] += acc(rng);
      if (tokens[i] + Q > R) tokens[i] = 0;
    }
  }
}

// FAST's rings and snapshots (MakeFast's), so that another MakeFast can run.
void FreeFast(Bench& b) {
  for (size_t l = 0; l < b.fast_layers.size(); ++l) {
    const kernels::FastRings& r = b.fast_layers[l].fast;
    for (void* p : {r.k, static_cast<void*>(r.u), static_cast<void*>(r.log_decay),
                    static_cast<void*>(r.cursors)}) {
      cudaFree(p);
    }
  }
  for (size_t x = 0; x < b.cursors_before.size(); ++x) {
    cudaFree(b.cursors_before[x]);
    cudaFree(b.cursors_verified[x]);
  }
  b.fast_layers.clear();
  if (b.device_fast_layers != nullptr) cudaFree(b.device_fast_layers);
  b.device_fast_layers = nullptr;
  b.cursors_before.clear();
  b.cursors_verified.clear();
  b.ring_tokens.clear();
  b.fold_tokens.clear();
}

void Free(Bench& b) {
  FreeFast(b);
  for (auto& l : b.layers) {
    cudaFree(l.state.data);
    cudaFree(l.conv.data);
    cudaFree(const_cast<float*>(l.params.a_log));
    for (const kernels::Records& r : {l.records, l.records_alt}) {
      cudaFree(r.kv);
      cudaFree(r.g);
      cudaFree(r.beta);
    }
  }
  for (void* p : {static_cast<void*>(b.entries_committed), static_cast<void*>(b.header_committed),
                  static_cast<void*>(b.pending.entries), static_cast<void*>(b.pending.header),
                  b.verify_workspace, static_cast<void*>(b.replay_plan),
                  static_cast<void*>(b.jobs.jobs), static_cast<void*>(b.jobs.count)}) {
    cudaFree(p);
  }
  for (void* p : {static_cast<void*>(b.device_layers), b.q, b.k, b.v, b.g, b.beta, b.out,
                  b.stock_pool, static_cast<void*>(b.qsl), static_cast<void*>(b.checkpoints),
                  static_cast<void*>(b.stock_indices), static_cast<void*>(b.stock_accepted),
                  static_cast<void*>(b.accepted), static_cast<void*>(b.block_table),
                  static_cast<void*>(b.computed), b.workspace, b.stock_workspace,
                  static_cast<void*>(b.status)}) {
    cudaFree(p);
  }
}

kernels::VerifyArgs VerifyOf(const Bench& b) {
  kernels::VerifyArgs a;
  a.shape = b.kda;
  a.q = {b.q, b.HK};
  a.k = {b.k, b.HK};
  a.v = {b.v, b.VW};
  a.g = {b.g, b.GW};
  a.beta = {b.beta, b.HV};
  a.num_tokens = b.T;
  a.out = b.out;
  a.state = b.layers[0].state;
  a.params = b.layers[0].params;
  a.records = b.layers[0].records;
  a.num_rows = b.N;
  a.query_start_loc = b.qsl;
  a.state_indices = {b.checkpoints, 1, 1};
  // As a step's later Verify calls are: checked against the step's snapshot.
  a.expected_query_start_loc = b.qsl;
  a.expected_state_indices = b.checkpoints;
  a.status = b.status;
  return a;
}

// DEFERRED's verify of layer 0: every row replays its pending tokens first.
kernels::VerifyArgs DeferredVerifyOf(const Bench& b) {
  kernels::VerifyArgs a = VerifyOf(b);
  a.pending = b.pending;
  a.layer = 0;
  a.records_alt = b.layers[0].records_alt;
  a.replay_plan = b.replay_plan;
  a.workspace = b.verify_workspace;
  a.workspace_bytes = kernels::VerifyWorkspaceBytes(b.num_blocks);
  return a;
}

// Puts the bookkeeping back as the last commit left it: before a DEFERRED
// verify, every row pending; before a DEFERRED commit, as this step's
// verify calls leave it (every entry taken).
void RestorePending(const Bench& b, bool taken, cudaStream_t stream) {
  if (taken) {
    CHECK_CUDA(cudaMemsetAsync(b.pending.entries, 0, b.entries_bytes, stream));
  } else {
    CHECK_CUDA(cudaMemcpyAsync(b.pending.entries, b.entries_committed, b.entries_bytes,
                               cudaMemcpyDeviceToDevice, stream));
  }
  CHECK_CUDA(cudaMemcpyAsync(b.pending.header, b.header_committed, b.header_bytes,
                             cudaMemcpyDeviceToDevice, stream));
}

kernels::StockArgs StockOf(const Bench& b) {
  kernels::StockArgs a;
  a.shape = b.kda;
  a.q = {b.q, b.HK};
  a.k = {b.k, b.HK};
  a.v = {b.v, b.VW};
  a.g = {b.g, b.GW};
  a.beta = {b.beta, b.HV};
  a.num_tokens = b.T;
  a.out = b.out;
  a.state = kernels::StatePool{b.stock_pool, 1 + int64_t{b.N} * b.shape.Q, b.VW * b.shape.K};
  a.params = b.layers[0].params;
  a.num_rows = b.N;
  a.query_start_loc = b.qsl;
  a.ssm_state_indices = {b.stock_indices, b.shape.Q, b.shape.Q};
  a.num_accepted_tokens = b.stock_accepted;
  a.workspace = b.stock_workspace;
  a.workspace_bytes = b.stock_workspace_bytes;
  a.status = b.status;
  return a;
}

kernels::CommitArgs CommitOf(const Bench& b, bool align) {
  kernels::CommitArgs a;
  a.shape = b.kda;
  a.spec_query_len = b.shape.Q;
  a.num_layers = b.shape.L;
  a.layers = b.layers.data();
  a.device_layers = b.device_layers;
  a.num_rows = b.N;
  a.query_start_loc = b.qsl;
  a.state_indices = {b.checkpoints, 1, 1};
  a.batch = b.N;
  a.num_accepted = b.accepted;
  if (align) {
    a.block_table = {b.block_table, 2, 2};
    a.num_computed_tokens = b.computed;
    a.mamba_block_size = 64;
  }
  a.workspace = b.workspace;
  a.workspace_bytes = b.workspace_bytes;
  a.status = b.status;
  return a;
}

kernels::CommitArgs DeferredCommitOf(const Bench& b, bool align) {
  kernels::CommitArgs a = CommitOf(b, align);
  a.pending = b.pending;
  a.jobs = b.jobs;
  return a;
}

// FAST's verify of layer 0 and its commit of every layer (the layers'
// rings set), as the service calls them.
kernels::VerifyArgs FastVerifyOf(const Bench& b) {
  kernels::VerifyArgs a = VerifyOf(b);
  a.fast = b.fast_layers[0].fast;
  a.workspace = b.verify_workspace;
  a.workspace_bytes = kernels::VerifyWorkspaceBytes(b.num_blocks);
  return a;
}

kernels::CommitArgs FastCommitOf(const Bench& b, bool align) {
  kernels::CommitArgs a = CommitOf(b, align);
  a.layers = b.fast_layers.data();
  a.device_layers = b.device_fast_layers;
  a.fast = true;
  return a;
}

// Puts steady-state step x's cursors in place: layer 0's as before the
// step's Verify, or every layer's as its Verify calls leave them.
void RestoreCursors(const Bench& b, int x, bool verified, cudaStream_t stream) {
  const size_t bytes = kernels::fast::FastCursorBytes(b.num_blocks);
  for (int l = 0; l < (verified ? b.shape.L : 1); ++l) {
    CHECK_CUDA(cudaMemcpyAsync(b.fast_layers[l].fast.cursors,
                               verified ? b.cursors_verified[x] : b.cursors_before[x], bytes,
                               cudaMemcpyDeviceToDevice, stream));
  }
}

void CheckDevice(const Bench& b, const char* what) {
  kernels::DeviceStatus st;
  CHECK_CUDA(cudaMemcpy(&st, b.status, sizeof(st), cudaMemcpyDeviceToHost));
  CheckOk(kernels::DeviceStatusToStatus(st, what), what);
}

// Bytes each kernel must move (every state, input and output once).
// A token's k, v, g and beta (what a record token holds), and its q (bytes).
double RecordTokenBytes(const Bench& b) { return 2.0 * (b.HK + b.VW + b.GW + b.HV); }
double QueryBytes(const Bench& b) { return 2.0 * b.HK; }
double OutputBytes(const Bench& b) { return 2.0 * b.VW; }

double VerifyBytes(const Bench& b) {
  return double(b.N) * b.state_bytes                                    // checkpoint states read
         + double(b.T) * (QueryBytes(b) + RecordTokenBytes(b))          // q, k, v, g, beta read
         + double(b.T) * OutputBytes(b)                                 // o written
         + double(b.T) * RecordTokenBytes(b);                           // records written
}

// DEFERRED's fused verify: each row's pending records read, its checkpoint
// read and written once, then verify's own traffic.
double DeferredVerifyBytes(const Bench& b) {
  double pending_tokens = 0;
  for (int c : b.accepted_host) pending_tokens += c;
  return VerifyBytes(b) + double(b.N) * b.state_bytes + pending_tokens * RecordTokenBytes(b);
}

// DEFERRED's commit moves the conv windows only (no row crosses a boundary
// in mode none), and reads the pending table of the rows' blocks.
double DeferredCommitBytes(const Bench& b) {
  const int hl = b.shape.conv_kernel - 1;
  return double(b.N) * b.shape.L * (2.0 * hl * b.shape.conv_dim * 2.0 + 2 * 4);
}

// FAST: a ring token's raw k (bf16), u and log-decay (fp32).
double RingTokenBytes(const Bench& b) { return 2.0 * b.HK + 4.0 * b.VW + 4.0 * b.GW; }

// FAST verify: each row's checkpoint and ring tokens read, its window's
// inputs read, outputs and candidates written.
double FastVerifyBytes(const Bench& b, double ring_tokens) {
  return double(b.N) * (b.state_bytes + ring_tokens * RingTokenBytes(b)) +
         double(b.T) * (QueryBytes(b) + RecordTokenBytes(b) + OutputBytes(b) + RingTokenBytes(b));
}

// FAST commit: the conv windows (as DEFERRED's) and each fold's state read
// and written and ring read, every layer.
double FastCommitBytes(const Bench& b, const std::vector<int>& fold_tokens) {
  double folds = 0;
  for (int n : fold_tokens) {
    if (n > 0) folds += 2.0 * b.state_bytes + n * RingTokenBytes(b);
  }
  return DeferredCommitBytes(b) + folds * b.shape.L;
}

double StockBytes(const Bench& b) {
  return double(b.N) * b.state_bytes + double(b.T) * b.state_bytes  // read 1, write T states
         + double(b.T) * (QueryBytes(b) + RecordTokenBytes(b) + OutputBytes(b));
}

double CommitBytes(const Bench& b, bool align) {
  const double act = 2.0;
  const int hl = b.shape.conv_kernel - 1;
  double per_layer = 0;
  for (int i = 0; i < b.N; ++i) {
    const int c = b.accepted_host[i];
    per_layer += 2.0 * b.state_bytes;                                         // read + write
    per_layer += double(c) * RecordTokenBytes(b);                             // records k, v, g, beta
    per_layer += 2.0 * hl * b.shape.conv_dim * act;                           // conv window moved
    if (align && i % 2 == 0 && c > b.shape.Q / 2) {  // crosses before its last token
      per_layer += b.state_bytes + hl * b.shape.conv_dim * act;               // boundary state
    }
  }
  return per_layer * b.shape.L;
}

struct Row {
  std::string what;
  int N;
  Timing t;       // warm L2
  Timing cold;    // cold L2 (0: not measured)
  double bytes;
  double per_layer_of = 1;  // layers the row covers (the ratio to stock is per layer)
  double stock_us = 0;      // the stock kernel at this N, 1 layer, warm
};

void PrintRows(const std::vector<Row>& rows, double copy_bps) {
  std::printf("| kernel | N | time (us) | CUDA graph (us) | cold L2, graph (us) | bytes moved "
              "(MB) | GB/s | %% of copy | per layer / stock |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const Row& r : rows) {
    const double bps = r.bytes / (r.t.best() * 1e-6);
    const auto opt = [](double us) { return us > 0 ? absl::StrFormat("%.1f", us) : std::string("-"); };
    std::printf("| %s | %d | %.1f | %.1f | %s | %.1f | %.0f | %.0f%% | %.2fx |\n", r.what.c_str(),
                r.N, r.t.launched_us, r.t.graph_us, opt(r.cold.graph_us).c_str(), r.bytes / 1e6,
                bps / 1e9, 100.0 * bps / copy_bps, r.t.best() / r.per_layer_of / r.stock_us);
  }
}

// One measurement of `call(kernels)`: warm and cold L2. `prepare` as in
// Time(). (The kernel before the pipelined one, and the sweep of the
// recurrent kernel's thread layouts, are no longer built: their last
// measurements are in docs/benchmarks.md.)
Row Measure(const std::string& what, int N, double bytes, int iters, cudaStream_t stream,
            const std::function<void(const KdaKernels&)>& call,
            const std::function<void()>& prepare = nullptr) {
  const KdaKernels& now = *kernels::CudaKdaKernels().value();
  Row r{what, N, Time(stream, iters, [&] { call(now); }, false, prepare), {}, bytes};
  if (absl::GetFlag(FLAGS_cold)) {
    r.cold = Time(stream, iters, [&] { call(now); }, /*cold=*/true, prepare);
  }
  return r;
}

// The targets of the kernels' issue, by shape, N and row: at most this many
// microseconds (CUDA graph, warm L2), or at least this share of copy.
struct Target {
  const char* shape;
  const char* what;  // prefix of the row
  int N;
  double max_us;     // 0: none
  double min_copy;   // 0: none
};
constexpr Target kTargets[] = {
    {"Kimi-Linear-48B-A3B", "verify", 256, 165, 0.80},
    {"Kimi-Linear-48B-A3B", "verify", 64, 45, 0},
    {"Kimi-Linear-48B-A3B", "verify", 1, 6, 0},
    {"Kimi-Linear-48B-A3B", "commit, 20 layers", 256, 6600, 0.80},
    {"Kimi-Linear-48B-A3B", "commit, 20 layers", 1, 30, 0},
    {"Kimi-K3 (TP8)", "commit, 69 layers", 1, 38, 0},
    {"Kimi-K3 (TP8)", "verify", 256, 0, 0.70},
    {"Qwen3-Next-80B-A3B", "verify", 256, 0, 0.80},
    {"Qwen3-Next-80B-A3B", "commit, 36 layers", 256, 0, 0.80},
    // Commit mode DEFERRED (issue 22).
    {"Kimi-Linear-48B-A3B", "DEFERRED verify", 1, 10, 0},
    {"Kimi-Linear-48B-A3B", "DEFERRED commit, 20 layers", 1, 8, 0},
    // Commit mode FAST (issue 23): the verify's share of copy (the step
    // targets follow the per-layer tables).
    {"Kimi-Linear-48B-A3B", "FAST verify", 256, 0, 0.75},
};

void PrintTargets(const Shape& s, const std::vector<Row>& rows, double copy_bps) {
  std::printf("\n| target (%s) | N | wanted | measured (graph, warm) | cold L2 | %% of copy | |\n"
              "|---|---:|---:|---:|---:|---:|---|\n",
              s.name.c_str());
  for (const Target& t : kTargets) {
    if (s.name != t.shape) continue;
    for (const Row& r : rows) {
      if (r.N != t.N || r.what.rfind(t.what, 0) != 0 || absl::StrContains(r.what, "align")) continue;
      const double us = r.t.graph_us;
      const double share = r.bytes / (r.t.best() * 1e-6) / copy_bps;
      const bool met = (t.max_us == 0 || us <= t.max_us) && (t.min_copy == 0 || share >= t.min_copy);
      std::string wanted;
      if (t.max_us > 0) wanted = absl::StrFormat("<= %.0f us", t.max_us);
      if (t.min_copy > 0) {
        wanted += absl::StrFormat("%s>= %.0f%% of copy", wanted.empty() ? "" : ", ", 100 * t.min_copy);
      }
      std::printf("| %s | %d | %s | %.1f us | %s | %.0f%% | %s |\n", r.what.c_str(), r.N,
                  wanted.c_str(), us,
                  r.cold.graph_us > 0 ? absl::StrFormat("%.1f us", r.cold.graph_us).c_str() : "-",
                  100 * share, met ? "met" : "missed");
    }
  }
}

// The mean of rows measured over FAST's steady-state steps, as one row.
Row MeanOf(const std::string& what, const std::vector<Row>& rows) {
  Row m{what, rows[0].N, {0, 0}, {0, 0}, 0, rows[0].per_layer_of, rows[0].stock_us};
  for (const Row& r : rows) {
    m.t.launched_us += r.t.launched_us / rows.size();
    m.t.graph_us += r.t.graph_us / rows.size();
    m.cold.launched_us += r.cold.launched_us / rows.size();
    m.cold.graph_us += r.cold.graph_us / rows.size();
    m.bytes += r.bytes / rows.size();
  }
  return m;
}

// Commit mode FAST on bench `b`: verify (layer 0) and commit (every layer)
// at each steady-state step, through the kernel interface, cursors restored
// before every run; the rows are the means over the steps. (The fold ahead
// schedule this once compared is gone: docs/benchmarks.md, "Fold ahead".)
void MeasureFast(Bench& b, int fold_every, bool align_too, int iters, cudaStream_t stream,
                 double stock_us, std::mt19937& rng, std::vector<Row>* rows) {
  const Shape& s = b.shape;
  const int steps = absl::GetFlag(FLAGS_fast_snapshots);
  FreeFast(b);
  MakeFast(b, fold_every, steps, rng);
  const std::string schedule = "Commit's folds";
  const std::string prefix = "FAST ";
  const kernels::VerifyArgs verify = FastVerifyOf(b);
  const kernels::CommitArgs commit = FastCommitOf(b, false);
  const kernels::CommitArgs commit_align = FastCommitOf(b, true);
  std::vector<Row> verifies, commits, aligned;
  double ring_tokens = 0, folds = 0;
  for (int x = 0; x < steps; ++x) {
    ring_tokens += b.ring_tokens[x] / steps;
    for (int n : b.fold_tokens[x]) folds += n > 0 ? 1.0 / (steps * double(b.N)) : 0.0;
    verifies.push_back(Measure(
        "", b.N, FastVerifyBytes(b, b.ring_tokens[x]), iters, stream,
        [&](const KdaKernels& k) { CheckOk(k.Verify(verify, stream), "FAST Verify"); },
        [&] { RestoreCursors(b, x, false, stream); }));
    CheckDevice(b, "FAST Verify");
    commits.push_back(Measure(
        "", b.N, FastCommitBytes(b, b.fold_tokens[x]), iters, stream,
        [&](const KdaKernels& k) { CheckOk(k.Commit(commit, stream), "FAST Commit"); },
        [&] { RestoreCursors(b, x, true, stream); }));
    commits.back().per_layer_of = s.L;
    CheckDevice(b, "FAST Commit");
    if (align_too) {
      aligned.push_back(Measure(
          "", b.N, FastCommitBytes(b, b.fold_tokens[x]), iters, stream,
          [&](const KdaKernels& k) { CheckOk(k.Commit(commit_align, stream), "FAST Commit"); },
          [&] { RestoreCursors(b, x, true, stream); }));
      aligned.back().per_layer_of = s.L;
      CheckDevice(b, "FAST Commit (align)");
    }
  }
  rows->push_back(MeanOf(absl::StrFormat("%sverify (F=%d, %s, ring %.1f tokens a row on "
                                         "average), 1 layer",
                                         prefix, fold_every, schedule, ring_tokens),
                         verifies));
  rows->back().stock_us = stock_us;
  if (absl::GetFlag(FLAGS_fast_checkpoint_numerics)) {
    // The checkpoint's products S0 . kc, S0 . qc on CUDA cores and on tensor
    // cores, side by side (their errors: docs/semantics.md, "FAST numerics").
    using Operands = kernels::fast::FastNumerics::Operands;
    const kernels::fast::FastVerifyArgs direct = kernels::fast::FastVerifyArgsOf(verify);
    const std::pair<Operands, const char*> kinds[] = {{Operands::kFp32, "fp32, CUDA cores"},
                                                      {Operands::kTf32Split, "3xTF32, tensor cores"},
                                                      {Operands::kTf32, "tf32, tensor cores"}};
    for (const auto& [ops, name] : kinds) {
      kernels::fast::FastNumerics num;
      num.checkpoint = ops;
      std::vector<Row> runs;
      for (int x = 0; x < steps; ++x) {
        runs.push_back(Measure(
            "", b.N, FastVerifyBytes(b, b.ring_tokens[x]), iters,
            stream,
            [&](const KdaKernels&) {
              CheckOk(kernels::fast::FastVerifyCuda(direct, num, stream), "FAST Verify (launcher)");
            },
            [&] { RestoreCursors(b, x, false, stream); }));
        CheckDevice(b, "FAST Verify (launcher)");
      }
      rows->push_back(MeanOf(
          absl::StrFormat("FAST verify launcher, checkpoint %s (F=%d), 1 layer", name, fold_every),
          runs));
      rows->back().stock_us = stock_us;
    }
  }
  rows->push_back(MeanOf(absl::StrFormat("%scommit, %d layers (F=%d, %s, %.3f folds a row a "
                                         "step)",
                                         prefix, s.L, fold_every, schedule, folds),
                         commits));
  rows->back().stock_us = stock_us;
  if (align_too) {
    rows->push_back(MeanOf(absl::StrFormat("FAST commit, %d layers, align mode (F=%d)", s.L,
                                           fold_every),
                           aligned));
    rows->back().stock_us = stock_us;
  }
}

void RunShape(const Shape& s, const std::vector<int>& ns, int iters, cudaStream_t stream,
              double copy_bps) {
  std::printf("\n### %s: %s, H=%d, HV=%d, K=V=%d, Q=%d, fp32 state, bf16 activations, conv "
              "dim %d, conv kernel %d, commit over %d layers\n\n",
              s.name.c_str(), s.gdn() ? "Gated DeltaNet" : "KDA", s.H, s.value_heads(), s.K, s.Q,
              s.conv_dim, s.conv_kernel, s.L);
  std::vector<Row> rows;
  std::mt19937 rng(7);
  for (int N : ns) {
    Bench b = Make(s, N, rng);
    const kernels::StockArgs stock = StockOf(b);
    const kernels::VerifyArgs verify = VerifyOf(b);
    const kernels::CommitArgs commit = CommitOf(b, false);
    const kernels::CommitArgs commit_align = CommitOf(b, true);
    Row stock_row = Measure("stock spec path, 1 layer", N, StockBytes(b), iters, stream,
                            [&](const KdaKernels& k) { CheckOk(k.Stock(stock, stream), "Stock"); });
    CheckDevice(b, "Stock");
    const double stock_us = stock_row.t.best();
    stock_row.stock_us = stock_us;
    rows.push_back(stock_row);
    const bool eager = absl::GetFlag(FLAGS_eager);
    if (eager) {
      rows.push_back(Measure("verify, 1 layer", N, VerifyBytes(b), iters, stream,
                             [&](const KdaKernels& k) { CheckOk(k.Verify(verify, stream), "Verify"); }));
      rows.back().stock_us = stock_us;
      CheckDevice(b, "Verify");
    }
    // Every layer's records hold the step (verify writes them).
    const KdaKernels& k = *kernels::CudaKdaKernels().value();
    for (int l = 0; l < s.L; ++l) {
      kernels::VerifyArgs v = verify;
      v.state = b.layers[l].state;
      v.params = b.layers[l].params;
      v.records = b.layers[l].records;
      CheckOk(k.Verify(v, stream), "Verify");
    }
    if (eager) {
      rows.push_back(Measure(absl::StrFormat("commit, %d layers", s.L), N, CommitBytes(b, false),
                             iters, stream, [&](const KdaKernels& k) {
                               CheckOk(k.Commit(commit, stream), "Commit");
                             }));
      rows.back().per_layer_of = s.L;
      rows.back().stock_us = stock_us;
      CheckDevice(b, "Commit");
    }
    if (eager && N == ns.back()) {
      rows.push_back(Measure(absl::StrFormat("commit, %d layers, align mode", s.L), N,
                             CommitBytes(b, true), iters, stream, [&](const KdaKernels& k) {
                               CheckOk(k.Commit(commit_align, stream), "Commit (align)");
                             }));
      rows.back().per_layer_of = s.L;
      rows.back().stock_us = stock_us;
      CheckDevice(b, "Commit (align)");
    }

    // DEFERRED: the same step. Its verify replays each row's pending tokens
    // (restored before every run), its commit finds them all taken.
    const kernels::VerifyArgs deferred_verify = DeferredVerifyOf(b);
    rows.push_back(Measure(
        "DEFERRED verify (replay + verify), 1 layer", N, DeferredVerifyBytes(b), iters, stream,
        [&](const KdaKernels& k) { CheckOk(k.Verify(deferred_verify, stream), "Verify"); },
        [&] { RestorePending(b, false, stream); }));
    rows.back().stock_us = stock_us;
    CheckDevice(b, "DEFERRED Verify");
    RestorePending(b, false, stream);
    for (int l = 0; l < s.L; ++l) {  // every layer's window recorded in the other buffer
      kernels::VerifyArgs v = deferred_verify;
      v.layer = l;
      v.state = b.layers[l].state;
      v.params = b.layers[l].params;
      v.records = b.layers[l].records;
      v.records_alt = b.layers[l].records_alt;
      CheckOk(k.Verify(v, stream), "Verify");
    }
    const kernels::CommitArgs deferred_commit = DeferredCommitOf(b, false);
    rows.push_back(Measure(
        absl::StrFormat("DEFERRED commit, %d layers", s.L), N, DeferredCommitBytes(b), iters,
        stream,
        [&](const KdaKernels& k) { CheckOk(k.Commit(deferred_commit, stream), "Commit"); },
        [&] { RestorePending(b, true, stream); }));
    rows.back().per_layer_of = s.L;
    rows.back().stock_us = stock_us;
    CheckDevice(b, "DEFERRED Commit");
    if (N == ns.back()) {
      const kernels::CommitArgs deferred_align = DeferredCommitOf(b, true);
      rows.push_back(Measure(
          absl::StrFormat("DEFERRED commit, %d layers, align mode", s.L), N,
          DeferredCommitBytes(b), iters, stream,
          [&](const KdaKernels& k) { CheckOk(k.Commit(deferred_align, stream), "Commit"); },
          [&] { RestorePending(b, true, stream); }));
      rows.back().per_layer_of = s.L;
      rows.back().stock_us = stock_us;
      CheckDevice(b, "DEFERRED Commit (align)");
    }
    const int fold_every = absl::GetFlag(FLAGS_fold_every);
    if (fold_every > 0 && s.Q <= kernels::kMaxFastQueryLen) {
      MeasureFast(b, fold_every, N == ns.back(), iters, stream, stock_us, rng, &rows);
    }
    CHECK_CUDA(cudaStreamSynchronize(stream));
    Free(b);
  }
  PrintRows(rows, copy_bps);

  // Per-layer cost of a step, each mode against the stock path: EAGER verify
  // + commit / layers, DEFERRED fused verify + its commit / layers.
  const auto find = [&](int N, const std::string& prefix) -> const Row* {
    for (const Row& r : rows) {
      if (r.N == N && r.what.rfind(prefix, 0) == 0 && !absl::StrContains(r.what, "align")) return &r;
    }
    return nullptr;
  };
  // `time` picks a row's time: warm L2 (the better of launched and graph),
  // or cold L2 (graph replays).
  // FAST's step per layer at each N (0: not measured).
  std::map<int, double> fast_cold;
  const auto table = [&](const char* header, const std::function<double(const Row&)>& time,
                         bool cold) {
    std::printf("%s|---:|---:|---:|---:|---:|---:|---:|---:|\n", header);
    for (int N : ns) {
      const Row* stock = find(N, "stock");
      const Row* verify = find(N, "verify");
      const Row* commit = find(N, "commit");
      const Row* dverify = find(N, "DEFERRED verify");
      const Row* dcommit = find(N, "DEFERRED commit");
      const Row* fverify = find(N, "FAST verify");
      const Row* fcommit = find(N, "FAST commit");
      if (!stock || !verify || !commit || !dverify || !dcommit || time(*stock) <= 0) continue;
      const double eager = time(*verify) + time(*commit) / s.L;
      const double deferred = time(*dverify) + time(*dcommit) / s.L;
      std::string fast = "- | -";
      if (fverify && fcommit) {
        const double f = time(*fverify) + time(*fcommit) / s.L;
        fast = absl::StrFormat("%.1f | %.2fx", f, f / time(*stock));
        if (cold) fast_cold[N] = f;
      }
      std::printf("| %d | %.1f | %.1f | %.2fx | %.1f | %.2fx | %s |\n", N, time(*stock), eager,
                  eager / time(*stock), deferred, deferred / time(*stock), fast.c_str());
    }
  };
  table("\n| N | stock, 1 layer (us) | EAGER: verify + commit/layer (us) | ratio | "
        "DEFERRED: verify + commit/layer (us) | ratio | FAST: verify + commit/layer, folds "
        "amortized (us) | ratio |\n",
        [](const Row& r) { return r.t.best(); }, false);
  table("\n| N (cold L2) | stock (us) | EAGER step/layer (us) | ratio | DEFERRED step/layer "
        "(us) | ratio | FAST step/layer (us) | ratio |\n",
        [](const Row& r) { return r.cold.graph_us; }, true);
  PrintTargets(s, rows, copy_bps);
  // FAST's step targets (issue 23), cold L2, CUDA graph.
  if (s.name == kKimiLinear.name && !fast_cold.empty()) {
    std::printf("\n| FAST step per layer (cold L2) | N | wanted | measured | |\n"
                "|---|---:|---:|---:|---|\n");
    const Row* stock256 = find(256, "stock");
    for (const auto& [N, wanted_us, wanted_ratio] :
         {std::make_tuple(256, 0.0, 0.30), std::make_tuple(64, 60.0, 0.0),
          std::make_tuple(1, 8.0, 0.0)}) {
      if (fast_cold.count(N) == 0) continue;
      const double us = fast_cold[N];
      if (wanted_ratio > 0 && stock256 != nullptr) {
        const double ratio = us / stock256->cold.graph_us;
        std::printf("| step / stock | %d | <= %.2fx | %.2fx (%.1f us) | %s |\n", N, wanted_ratio,
                    ratio, us, ratio <= wanted_ratio ? "met" : "missed");
      } else if (wanted_us > 0) {
        std::printf("| step | %d | <= %.0f us | %.1f us | %s |\n", N, wanted_us, us,
                    us <= wanted_us ? "met" : "missed");
      }
    }
  }
}

int Main() {
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int iters = absl::GetFlag(FLAGS_iters);
  const double copy_bps = CopyBandwidth(stream, iters);
  std::printf("## kda_bench on %s (%d SMs, %.0f GiB), CUDA events, median of %d runs\n\n",
              prop.name, prop.multiProcessorCount, prop.totalGlobalMem / double(1 << 30), iters);
  std::printf("Device-to-device copy, measured in this run: %.0f GB/s (bytes read + written)\n",
              copy_bps / 1e9);
  if (absl::GetFlag(FLAGS_sweep) || absl::GetFlag(FLAGS_before)) {
    std::printf("\n(--sweep and --before are ignored: the recurrent kernel's other thread layouts "
                "and the kernel before the pipelined one are no longer built; their last "
                "measurements are in docs/benchmarks.md.)\n");
  }
  std::vector<int> ns;
  for (absl::string_view n : absl::StrSplit(absl::GetFlag(FLAGS_ns), ',')) {
    ns.push_back(std::stoi(std::string(n)));
  }
  for (absl::string_view name : absl::StrSplit(absl::GetFlag(FLAGS_shapes), ',')) {
    if (name == "kimi_linear") RunShape(kKimiLinear, ns, iters, stream, copy_bps);
    if (name == "kimi_k3") RunShape(kKimiK3, ns, iters, stream, copy_bps);
    if (name == "qwen3_next") RunShape(kQwen3Next, ns, iters, stream, copy_bps);
  }
  return 0;
}

}  // namespace
}  // namespace specstate

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return specstate::Main();
}
