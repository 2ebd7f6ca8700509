// fast_bench: times commit mode FAST's CUDA kernels (kernels/fast/cuda) per
// layer per step against our stock spec-path kernel, in one run with the
// device-to-device copy bandwidth, and prints a markdown table.
//
//   fast_bench [--shapes=kimi_linear,kimi_k3,qwen3_next] [--ns=1,16,64,256] [--iters=20]
//
// Per shape and N (one layer, every row a window of Q tokens, bf16
// activations, fp32 state):
//  - stock: the stock spec-path kernel (reads a state, writes Q states a row);
//  - FAST verify: from the checkpoint, the ring and the window, the ring at
//    the fills of a steady state (below);
//  - FAST commit, no fold: every row's accepted tokens join its ring;
//  - FAST fold: every row's ring folded (a ring one window short of full
//    plus its accepted tokens);
//  - FAST step, fold amortized: verify + commit over S consecutive steps of
//    a steady state (accepted counts uniform in [1, Q], rings filling and
//    folding as Commit leaves them), the mean per step: folds come at the
//    rate these counts give.
// Each time is the median of --iters replays of a CUDA graph of one call,
// with a warm L2 and with a cold one (a 256 MiB buffer written before each
// run, outside the timed window), as kda_bench. Calls that change the
// cursors have them restored before every run, outside the timed window.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "kernels/fast/cuda/fast_cuda.h"
#include "kernels/fast/fast_args.h"
#include "kernels/kda_kernels.h"
#include "kernels/numeric.h"
#include "tests/bench/cuda_check.h"
#include "tests/bench/timing.h"

ABSL_FLAG(std::string, shapes, "kimi_linear,kimi_k3,qwen3_next", "shapes to run");
ABSL_FLAG(std::string, ns, "1,16,64,256", "request counts");
ABSL_FLAG(int, iters, 20, "timed runs per measurement");
ABSL_FLAG(int, snapshots, 8, "steady-state steps averaged for the amortized step");
ABSL_FLAG(std::string, fold_every, "4,8", "F values");
ABSL_FLAG(bool, verify_only, false,
          "run FAST verify (Kimi-Linear, N = 256, F = 4) a few times and exit (for ncu)");

namespace specstate {
namespace {

using bench::CheckOk;
using bench::CopyBandwidth;
using bench::DeviceAlloc;
using bench::FillRandom;
using bench::TimeGraphOnly;
using bench::Upload;
using kernels::FastCursor;
using kernels::KdaShape;
using kernels::fast::FastCommitArgs;
using kernels::fast::FastLayer;
using kernels::fast::FastNumerics;
using kernels::fast::FastVerifyArgs;

struct Shape {
  std::string name;
  int H, K, Q;
  kernels::LayerKind kind = kernels::LayerKind::kKda;
  int HV = 0;
  int value_heads() const { return HV > 0 ? HV : H; }
  bool gdn() const { return kind == kernels::LayerKind::kGdn; }
};

const Shape kKimiLinear{"Kimi-Linear-48B-A3B", 32, 128, 4};
const Shape kKimiK3{"Kimi-K3 (TP8)", 12, 128, 8};
const Shape kQwen3Next{"Qwen3-Next-80B-A3B", 16, 128, 4, kernels::LayerKind::kGdn, 32};

// One shape at N rows: the activations, a FAST pool (a checkpoint a row)
// with rings of capacity F * Q, and a stock pool (Q blocks a row).
struct Bench {
  Shape s;
  int N, F, R;
  int64_t T, HK, VW, GW, HV, state_elems;
  KdaShape kda;
  void *q, *k, *v, *g, *beta, *out;
  float* params;
  FastLayer layer;
  int32_t *qsl, *checkpoints, *accepted;
  FastCursor* saved_cursors;
  std::vector<void*> owned;
};

Bench Make(const Shape& s, int N, int F, std::mt19937& rng) {
  Bench b;
  b.s = s;
  b.N = N;
  b.F = F;
  b.R = kernels::fast::FastRingCapacity(F, s.Q);
  b.T = int64_t{N} * s.Q;
  b.HK = int64_t{s.H} * s.K;
  b.HV = s.value_heads();
  b.VW = b.HV * s.K;
  b.GW = s.gdn() ? b.HV : b.HK;
  b.state_elems = b.VW * s.K;
  b.kda = KdaShape{s.H, s.K, DType::kBFloat16, DType::kFloat32, -5.0f, s.kind, int(b.HV)};
  auto alloc = [&](size_t bytes) {
    void* p = DeviceAlloc(bytes);
    b.owned.push_back(p);
    return p;
  };
  const int64_t blocks = 1 + N;
  b.layer.state = kernels::StatePool{alloc(blocks * b.state_elems * 4), blocks, b.state_elems};
  FillRandom(b.layer.state.data, blocks * b.state_elems, false, -0.5f, 0.5f, rng);
  b.layer.rings.k = alloc(kernels::fast::FastRingKBytes(b.kda, blocks, b.R));
  b.layer.rings.u = static_cast<float*>(alloc(kernels::fast::FastRingUBytes(b.kda, blocks, b.R)));
  b.layer.rings.log_decay =
      static_cast<float*>(alloc(kernels::fast::FastRingLogDecayBytes(b.kda, blocks, b.R)));
  b.layer.rings.cursors = static_cast<FastCursor*>(alloc(kernels::fast::FastCursorBytes(blocks)));
  b.layer.rings.num_blocks = blocks;
  b.layer.rings.capacity = b.R;
  FillRandom(b.layer.rings.k, blocks * b.R * b.HK, true, -1, 1, rng);
  FillRandom(b.layer.rings.u, blocks * b.R * b.VW, false, -0.1f, 0.1f, rng);
  FillRandom(b.layer.rings.log_decay, blocks * b.R * b.GW, false, -0.5f, -0.01f, rng);
  b.params = static_cast<float*>(alloc((s.H + b.HK) * 4));
  FillRandom(b.params, s.H, false, -2.0f, 0.5f, rng);
  FillRandom(b.params + s.H, b.HK, false, -1, 1, rng);
  b.layer.params = kernels::LayerParams{b.params, b.params + s.H};
  for (void** p : {&b.q, &b.k}) {
    *p = alloc(b.T * b.HK * 2);
    FillRandom(*p, b.T * b.HK, true, -1, 1, rng);
  }
  for (void** p : {&b.v, &b.out}) {
    *p = alloc(b.T * b.VW * 2);
    FillRandom(*p, b.T * b.VW, true, -1, 1, rng);
  }
  b.g = alloc(b.T * b.GW * 2);
  FillRandom(b.g, b.T * b.GW, true, s.gdn() ? -0.5f : -1.0f, s.gdn() ? -0.01f : 1.0f, rng);
  b.beta = alloc(b.T * b.HV * 2);
  FillRandom(b.beta, b.T * b.HV, true, s.gdn() ? 0.0f : -3.0f, s.gdn() ? 1.0f : 3.0f, rng);
  std::vector<int32_t> qsl(N + 1), checkpoints(N);
  for (int i = 0; i < N; ++i) {
    qsl[i + 1] = qsl[i] + s.Q;
    checkpoints[i] = 1 + i;
  }
  b.qsl = Upload(qsl);
  b.checkpoints = Upload(checkpoints);
  b.accepted = static_cast<int32_t*>(alloc(N * 4));
  b.saved_cursors = static_cast<FastCursor*>(alloc(blocks * sizeof(FastCursor)));
  b.owned.push_back(b.qsl);
  b.owned.push_back(b.checkpoints);
  return b;
}

void Free(Bench& b) {
  for (void* p : b.owned) CHECK_CUDA(cudaFree(p));
}

// Sets the cursors (and keeps them to restore) and the accepted counts.
void SetState(Bench& b, const std::vector<FastCursor>& cursors, const std::vector<int32_t>& acc) {
  std::vector<FastCursor> all(b.N + 1, FastCursor{0, 0});
  std::copy(cursors.begin(), cursors.end(), all.begin() + 1);
  CHECK_CUDA(cudaMemcpy(b.saved_cursors, all.data(), all.size() * sizeof(FastCursor),
                        cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(b.layer.rings.cursors, all.data(), all.size() * sizeof(FastCursor),
                        cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(b.accepted, acc.data(), acc.size() * 4, cudaMemcpyHostToDevice));
}

void Restore(const Bench& b, cudaStream_t stream) {
  CHECK_CUDA(cudaMemcpyAsync(b.layer.rings.cursors, b.saved_cursors,
                             (b.N + 1) * sizeof(FastCursor), cudaMemcpyDeviceToDevice, stream));
}

FastVerifyArgs VerifyOf(const Bench& b) {
  FastVerifyArgs a;
  a.shape = b.kda;
  a.q = {b.q, b.HK};
  a.k = {b.k, b.HK};
  a.v = {b.v, b.VW};
  a.g = {b.g, b.GW};
  a.beta = {b.beta, b.HV};
  a.num_tokens = b.T;
  a.out = b.out;
  a.state = b.layer.state;
  a.rings = b.layer.rings;
  a.params = b.layer.params;
  a.spec_query_len = b.s.Q;
  a.num_rows = b.N;
  a.query_start_loc = b.qsl;
  a.state_indices = b.checkpoints;
  return a;
}

FastCommitArgs CommitOf(const Bench& b) {
  FastCommitArgs a;
  a.shape = b.kda;
  a.spec_query_len = b.s.Q;
  a.num_layers = 1;
  a.layers = &b.layer;
  a.num_rows = b.N;
  a.query_start_loc = b.qsl;
  a.state_indices = kernels::IndexMatrix{b.checkpoints, 1, 1};
  a.batch = b.N;
  a.num_accepted = b.accepted;
  return a;
}

// Bytes per ring token (k bf16, u fp32, gamma fp32), and a token's inputs.
double RingTokenBytes(const Bench& b) { return 2.0 * b.HK + 4.0 * b.VW + 4.0 * b.GW; }
double InputTokenBytes(const Bench& b) { return 2.0 * (2 * b.HK + b.VW + b.GW + b.HV); }

double VerifyBytes(const Bench& b, double mean_ring_tokens) {
  return b.N * (4.0 * b.state_elems + mean_ring_tokens * RingTokenBytes(b)) +
         b.T * (InputTokenBytes(b) + 2.0 * b.VW + RingTokenBytes(b));
}
double FoldBytes(const Bench& b, double mean_tokens) {
  return b.N * (8.0 * b.state_elems + mean_tokens * RingTokenBytes(b));
}

struct Row {
  std::string what;
  double warm_us, cold_us, bytes;
};

// The steady state of every row's ring under accepted counts uniform in
// [1, Q]: `warmup` steps, then `count` snapshots (cursors before the step's
// Verify, and the step's accepted counts); folds per row per step.
struct Steady {
  std::vector<std::vector<FastCursor>> cursors;
  std::vector<std::vector<int32_t>> accepted;
  double fold_rate = 0;
};

Steady Simulate(int N, int Q, int R, int count, std::mt19937& rng) {
  std::uniform_int_distribution<int> acc(1, Q);
  std::vector<int> tokens(N, 0);
  Steady st;
  int folds = 0, steps = 0;
  for (int step = 0; step < 200 + count; ++step) {
    std::vector<FastCursor> cur(N);
    std::vector<int32_t> a(N);
    for (int i = 0; i < N; ++i) {
      cur[i] = FastCursor{tokens[i], Q};
      a[i] = acc(rng);
      tokens[i] += a[i];
      if (tokens[i] + Q > R) {
        tokens[i] = 0;
        if (step >= 200) ++folds;
      }
    }
    if (step >= 200) {
      st.cursors.push_back(cur);
      st.accepted.push_back(a);
      ++steps;
    }
  }
  st.fold_rate = double(folds) / (double(steps) * N);
  return st;
}

double StockUs(const Shape& s, int N, cudaStream_t stream, int iters, bool cold,
               std::mt19937& rng, double* bytes) {
  const int64_t HK = int64_t{s.H} * s.K, HV = s.value_heads(), VW = HV * s.K;
  const int64_t GW = s.gdn() ? HV : HK, T = int64_t{N} * s.Q, state = VW * s.K;
  std::vector<void*> owned;
  auto alloc = [&](size_t bytes) {
    void* p = DeviceAlloc(bytes);
    owned.push_back(p);
    return p;
  };
  kernels::StockArgs a;
  a.shape = KdaShape{s.H, s.K, DType::kBFloat16, DType::kFloat32, -5.0f, s.kind, int(HV)};
  void *q = alloc(T * HK * 2), *k = alloc(T * HK * 2), *v = alloc(T * VW * 2),
       *g = alloc(T * GW * 2), *beta = alloc(T * HV * 2), *out = alloc(T * VW * 2);
  FillRandom(q, T * HK, true, -1, 1, rng);
  FillRandom(k, T * HK, true, -1, 1, rng);
  FillRandom(v, T * VW, true, -1, 1, rng);
  FillRandom(g, T * GW, true, s.gdn() ? -0.5f : -1.0f, s.gdn() ? -0.01f : 1.0f, rng);
  FillRandom(beta, T * HV, true, s.gdn() ? 0.0f : -3.0f, s.gdn() ? 1.0f : 3.0f, rng);
  const int64_t blocks = 1 + T;
  void* pool = alloc(blocks * state * 4);
  FillRandom(pool, blocks * state, false, -0.5f, 0.5f, rng);
  float* params = static_cast<float*>(alloc((s.H + HK) * 4));
  FillRandom(params, s.H, false, -2.0f, 0.5f, rng);
  FillRandom(params + s.H, HK, false, -1, 1, rng);
  std::vector<int32_t> qsl(N + 1), indices(T), acc(N);
  std::uniform_int_distribution<int> accd(1, s.Q);
  for (int i = 0; i < N; ++i) {
    qsl[i + 1] = qsl[i] + s.Q;
    for (int c = 0; c < s.Q; ++c) indices[int64_t{i} * s.Q + c] = 1 + i * s.Q + c;
    acc[i] = accd(rng);
  }
  int32_t *d_qsl = Upload(qsl), *d_indices = Upload(indices), *d_acc = Upload(acc);
  owned.insert(owned.end(), {d_qsl, d_indices, d_acc});
  a.q = {q, HK};
  a.k = {k, HK};
  a.v = {v, VW};
  a.g = {g, GW};
  a.beta = {beta, HV};
  a.num_tokens = T;
  a.out = out;
  a.state = kernels::StatePool{pool, blocks, state};
  a.params = kernels::LayerParams{params, params + s.H};
  a.num_rows = N;
  a.query_start_loc = d_qsl;
  a.ssm_state_indices = {d_indices, s.Q, s.Q};
  a.num_accepted_tokens = d_acc;
  a.workspace_bytes = kernels::StockWorkspaceBytes(blocks);
  a.workspace = alloc(a.workspace_bytes);
  CHECK_CUDA(cudaMemset(a.workspace, 0, a.workspace_bytes));
  a.status = static_cast<kernels::DeviceStatus*>(alloc(sizeof(kernels::DeviceStatus)));
  const kernels::KdaKernels& kk = *kernels::CudaKdaKernels().value();
  const double us =
      TimeGraphOnly(stream, iters, [&] { CheckOk(kk.Stock(a, stream), "Stock"); }, cold);
  kernels::DeviceStatus st;
  CHECK_CUDA(cudaMemcpy(&st, a.status, sizeof(st), cudaMemcpyDeviceToHost));
  CheckOk(kernels::DeviceStatusToStatus(st, "Stock"), "Stock");
  *bytes = double(N) * state * 4 + double(T) * state * 4 +
           double(T) * (2.0 * (2 * HK + VW + GW + HV) + 2.0 * VW);
  for (void* p : owned) CHECK_CUDA(cudaFree(p));
  return us;
}

void RunShape(const Shape& s, const std::vector<int>& ns, const std::vector<int>& fs,
              int iters, int snapshots, cudaStream_t stream, double copy_bps) {
  std::printf("\n### %s (H=%d, HV=%d, K=V=%d, Q=%d, bf16 activations, fp32 state)\n\n",
              s.name.c_str(), s.H, s.value_heads(), s.K, s.Q);
  std::printf("| N | kernel | graph, warm L2 (us) | graph, cold L2 (us) | bytes (MB) | %% of copy "
              "(cold) | per layer / stock (cold) |\n|---:|---|---:|---:|---:|---:|---:|\n");
  std::mt19937 rng(23);
  for (int N : ns) {
    std::vector<Row> rows;
    double stock_bytes = 0;
    const double stock_warm = StockUs(s, N, stream, iters, false, rng, &stock_bytes);
    const double stock_cold = StockUs(s, N, stream, iters, true, rng, &stock_bytes);
    rows.push_back({"stock spec path (exact)", stock_warm, stock_cold, stock_bytes});
    for (int F : fs) {
      Bench b = Make(s, N, F, rng);
      const Steady st = Simulate(N, s.Q, b.R, snapshots, rng);
      const FastVerifyArgs verify = VerifyOf(b);
      const FastCommitArgs commit = CommitOf(b);
      const auto run_verify = [&] { CheckOk(FastVerifyCuda(verify, FastNumerics{}, stream), "Verify"); };
      const auto run_commit = [&] { CheckOk(FastCommitCuda(commit, FastNumerics{}, stream), "Commit"); };
      const auto restore = [&] { Restore(b, stream); };
      // The amortized step, and verify alone, over the steady state's snapshots.
      double v_warm = 0, v_cold = 0, c_warm = 0, c_cold = 0, ring_tokens = 0, commit_bytes = 0;
      for (int i = 0; i < snapshots; ++i) {
        SetState(b, st.cursors[i], st.accepted[i]);
        for (const FastCursor& c : st.cursors[i]) ring_tokens += double(c.tokens) / N;
        v_warm += TimeGraphOnly(stream, iters, run_verify, false);
        v_cold += TimeGraphOnly(stream, iters, run_verify, true);
        c_warm += TimeGraphOnly(stream, iters, run_commit, false, restore);
        c_cold += TimeGraphOnly(stream, iters, run_commit, true, restore);
        for (int r = 0; r < N; ++r) {
          const int n = st.cursors[i][r].tokens + st.accepted[i][r];
          if (n + s.Q > b.R) commit_bytes += 8.0 * b.state_elems + n * RingTokenBytes(b);
        }
      }
      v_warm /= snapshots, v_cold /= snapshots, c_warm /= snapshots, c_cold /= snapshots;
      ring_tokens /= snapshots;
      commit_bytes /= snapshots;
      const std::string f = absl::StrFormat("F=%d", F);
      rows.push_back({absl::StrFormat("FAST verify, %s (ring %.1f tokens on average)", f, ring_tokens),
                      v_warm, v_cold, VerifyBytes(b, ring_tokens)});
      // Commit without a fold: every ring empty, Q candidates.
      std::vector<FastCursor> empty(N, FastCursor{0, s.Q});
      std::vector<int32_t> acc(N);
      std::uniform_int_distribution<int> accd(1, s.Q);
      for (int32_t& a : acc) a = accd(rng);
      SetState(b, empty, acc);
      rows.push_back({"FAST commit, no fold, " + f,
                      TimeGraphOnly(stream, iters, run_commit, false, restore),
                      TimeGraphOnly(stream, iters, run_commit, true, restore), 16.0 * N});
      // Every row folds: a ring one window short of full, then its accepted tokens.
      std::vector<FastCursor> full(N, FastCursor{b.R - s.Q, s.Q});
      SetState(b, full, acc);
      double fold_tokens = 0;
      for (int32_t a : acc) fold_tokens += double(b.R - s.Q + a) / N;
      rows.push_back({absl::StrFormat("FAST commit, every row folds (%.1f tokens), %s",
                                      fold_tokens, f),
                      TimeGraphOnly(stream, iters, run_commit, false, restore),
                      TimeGraphOnly(stream, iters, run_commit, true, restore),
                      FoldBytes(b, fold_tokens)});
      rows.push_back({absl::StrFormat("**FAST step, fold amortized, %s** (folds: %.3f a row a step)",
                                      f, st.fold_rate),
                      v_warm + c_warm, v_cold + c_cold,
                      VerifyBytes(b, ring_tokens) + commit_bytes});
      Free(b);
    }
    for (const Row& r : rows) {
      const double bps = r.bytes / (r.cold_us * 1e-6);
      std::printf("| %d | %s | %.1f | %.1f | %.2f | %.0f%% | %.2fx |\n", N, r.what.c_str(),
                  r.warm_us, r.cold_us, r.bytes / 1e6, 100.0 * bps / copy_bps,
                  r.cold_us / stock_cold);
    }
    std::fflush(stdout);
  }
}

int Main() {
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int iters = absl::GetFlag(FLAGS_iters);
  if (absl::GetFlag(FLAGS_verify_only)) {
    std::mt19937 rng(5);
    Bench b = Make(kKimiLinear, 256, 4, rng);
    const Steady st = Simulate(256, kKimiLinear.Q, b.R, 1, rng);
    SetState(b, st.cursors[0], st.accepted[0]);
    const FastVerifyArgs verify = VerifyOf(b);
    for (int i = 0; i < 3; ++i) CheckOk(FastVerifyCuda(verify, FastNumerics{}, stream), "Verify");
    CHECK_CUDA(cudaStreamSynchronize(stream));
    return 0;
  }
  const double copy_bps = CopyBandwidth(stream, iters);
  std::printf("## fast_bench on %s (%d SMs), CUDA graph replays, median of %d runs\n\n", prop.name,
              prop.multiProcessorCount, iters);
  std::printf("Device-to-device copy, measured in this run: %.0f GB/s (bytes read + written)\n",
              copy_bps / 1e9);
  std::vector<int> ns, fs;
  for (absl::string_view n : absl::StrSplit(absl::GetFlag(FLAGS_ns), ',')) {
    ns.push_back(std::stoi(std::string(n)));
  }
  for (absl::string_view f : absl::StrSplit(absl::GetFlag(FLAGS_fold_every), ',')) {
    fs.push_back(std::stoi(std::string(f)));
  }
  const int snapshots = absl::GetFlag(FLAGS_snapshots);
  for (absl::string_view name : absl::StrSplit(absl::GetFlag(FLAGS_shapes), ',')) {
    if (name == "kimi_linear") RunShape(kKimiLinear, ns, fs, iters, snapshots, stream, copy_bps);
    if (name == "kimi_k3") RunShape(kKimiK3, ns, fs, iters, snapshots, stream, copy_bps);
    if (name == "qwen3_next") RunShape(kQwen3Next, ns, fs, iters, snapshots, stream, copy_bps);
  }
  return 0;
}

}  // namespace
}  // namespace specstate

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return specstate::Main();
}
