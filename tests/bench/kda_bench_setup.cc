#include "tests/bench/kda_bench_setup.h"

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "kernels/fast/fast_args.h"
#include "kernels/kda_kernels.h"
#include "server/config/presets.h"
#include "tests/bench/cuda_check.h"
#include "tests/bench/timing.h"

namespace specstate {
namespace kda_bench {
namespace {

using bench::CheckOk;
using bench::DeviceAlloc;
using bench::FillRandom;
using bench::Upload;

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

}  // namespace

const Shape& KimiLinear() {
  static const Shape* const s = new Shape(FromPreset("kimi-linear-48b-a3b", "Kimi-Linear-48B-A3B"));
  return *s;
}
const Shape& KimiK3() {
  static const Shape* const s = new Shape(FromPreset("kimi-k3-tp8", "Kimi-K3 (TP8)"));
  return *s;
}
const Shape& Qwen3Next() {
  static const Shape* const s = new Shape(FromPreset("qwen3-next-80b-a3b", "Qwen3-Next-80B-A3B"));
  return *s;
}

Bench Make(const Shape& s, int N, std::mt19937& rng) {
  Bench b;
  b.shape = s;
  b.N = N;
  b.T = int64_t{N} * s.Q;
  b.HK = int64_t{s.H} * s.K;
  b.VW = int64_t{s.value_heads()} * s.K;
  b.GW = s.gdn() ? s.value_heads() : b.HK;
  b.HV = s.value_heads();
  b.state_bytes = b.VW * s.K * s.state_size();
  b.num_blocks = 1 + 2 * int64_t{N};
  b.conv_width = s.conv_kernel - 1 + s.Q - 1;
  b.kda = kernels::KdaShape{s.H,   s.K,    DType::kBFloat16, s.state,
                            -5.0f, s.kind, static_cast<int>(b.HV)};
  for (int l = 0; l < s.L; ++l) {
    kernels::CommitLayer layer;
    layer.state = kernels::StatePool{DeviceAlloc(b.num_blocks * b.state_bytes), b.num_blocks,
                                     b.VW * s.K};
    FillRandom(layer.state.data, b.num_blocks * b.VW * s.K, s.bf16_state(), -0.5f, 0.5f, rng);
    const int64_t conv_block = int64_t{s.conv_dim} * b.conv_width;
    layer.conv = kernels::ConvPool{DeviceAlloc(b.num_blocks * conv_block * 2), b.num_blocks,
                                   conv_block, b.conv_width, 1, s.conv_dim, b.conv_width};
    FillRandom(layer.conv.data, b.num_blocks * conv_block, true, -1, 1, rng);
    float* params = static_cast<float*>(DeviceAlloc((s.H + b.HK) * 4));
    FillRandom(params, s.H, false, -2.0f, 0.5f, rng);
    FillRandom(params + s.H, b.HK, false, -1, 1, rng);
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
    FillRandom(*p, b.T * b.HK, true, -1, 1, rng);
  }
  for (void** p : {&b.v, &b.out}) {
    *p = DeviceAlloc(b.T * b.VW * 2);
    FillRandom(*p, b.T * b.VW, true, -1, 1, rng);
  }
  b.g = DeviceAlloc(b.T * b.GW * 2 + 16);
  // GDN's g is a log-decay: negative.
  FillRandom(b.g, b.T * b.GW, true, s.gdn() ? -0.5f : -1.0f, s.gdn() ? -0.01f : 1.0f, rng);
  b.beta = DeviceAlloc(b.T * b.HV * 2 + 16);
  FillRandom(b.beta, b.T * b.HV, true, s.gdn() ? 0.0f : -3.0f, s.gdn() ? 1.0f : 3.0f, rng);
  b.stock_pool = DeviceAlloc((1 + int64_t{N} * s.Q) * b.state_bytes);
  FillRandom(b.stock_pool, (1 + int64_t{N} * s.Q) * b.VW * s.K, s.bf16_state(), -0.5f, 0.5f,
             rng);

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
    // A packed kernels::deferred::PendingEntry: record row i, buffer 0, its tokens.
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
    FillRandom(r.k, k_bytes / 2, true, -1, 1, rng);
    FillRandom(r.u, u_bytes / 4, false, -0.1f, 0.1f, rng);
    FillRandom(r.log_decay, g_bytes / 4, false, -0.5f, -0.01f, rng);
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
  a.mode = kernels::CommitMode::kDeferred;
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
  a.mode = kernels::CommitMode::kDeferred;
  a.pending = b.pending;
  a.jobs = b.jobs;
  return a;
}

// FAST's verify of layer 0 and its commit of every layer (the layers'
// rings set), as the service calls them.
kernels::VerifyArgs FastVerifyOf(const Bench& b) {
  kernels::VerifyArgs a = VerifyOf(b);
  a.mode = kernels::CommitMode::kFast;
  a.fast = b.fast_layers[0].fast;
  a.workspace = b.verify_workspace;
  a.workspace_bytes = kernels::VerifyWorkspaceBytes(b.num_blocks);
  return a;
}

kernels::CommitArgs FastCommitOf(const Bench& b, bool align) {
  kernels::CommitArgs a = CommitOf(b, align);
  a.layers = b.fast_layers.data();
  a.device_layers = b.device_fast_layers;
  a.mode = kernels::CommitMode::kFast;
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
  // Every channel's whole window (conv_kernel - 1 + Q - 1 bf16 columns) read
  // and written: the columns moved share every 32-byte sector with the rest.
  return double(b.N) * b.shape.L * (2.0 * b.conv_width * b.shape.conv_dim * 2.0 + 2 * 4);
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
double FastFoldBytes(const Bench& b, const std::vector<int>& fold_tokens) {
  double folds = 0;
  for (int n : fold_tokens) {
    if (n > 0) folds += 2.0 * b.state_bytes + n * RingTokenBytes(b);
  }
  return folds * b.shape.L;
}

double FastCommitBytes(const Bench& b, const std::vector<int>& fold_tokens) {
  return DeferredCommitBytes(b) + FastFoldBytes(b, fold_tokens);
}

double StockBytes(const Bench& b) {
  return double(b.N) * b.state_bytes + double(b.T) * b.state_bytes  // read 1, write T states
         + double(b.T) * (QueryBytes(b) + RecordTokenBytes(b) + OutputBytes(b));
}

double CommitBytes(const Bench& b, bool align) {
  const double act = 2.0;
  const double window = double(b.conv_width) * b.shape.conv_dim * act;  // a row's conv window
  double per_layer = 0;
  for (int i = 0; i < b.N; ++i) {
    const int c = b.accepted_host[i];
    per_layer += 2.0 * b.state_bytes;                                         // read + write
    per_layer += double(c) * RecordTokenBytes(b);                             // records k, v, g, beta
    per_layer += 2.0 * window;  // conv window read, compacted and written (as DeferredCommitBytes)
    if (align && i % 2 == 0 && c > b.shape.Q / 2) {  // crosses before its last token
      per_layer += b.state_bytes + 2.0 * window;                              // boundary state
    }
  }
  return per_layer * b.shape.L;
}

}  // namespace kda_bench
}  // namespace specstate
