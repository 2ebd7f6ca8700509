// kda_bench: times the CUDA RecoverSSM kernels against the device-to-device
// copy bandwidth measured in the same run, and prints markdown tables.
//
//   kda_bench [--shapes=kimi_linear,kimi_k3] [--state_dtypes=fp32,bf16] [--iters=30] [--cold]
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
// come at their measured rate), its folds alone under each fold schedule
// (--fast_fold_schedules) with what a folded row costs against its state's
// write at copy bandwidth; and the per-layer step of each mode against the
// stock kernel. With --floors (the default), the floors under every row: an
// empty kernel, and at each N the checkpoints read once with no math
// (tests/bench/floor_kernels.h).
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
#include "tests/bench/cuda_check.h"
#include "tests/bench/floor_kernels.h"
#include "tests/bench/kda_bench_setup.h"
#include "tests/bench/timing.h"

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
ABSL_FLAG(std::string, state_dtypes, "fp32,bf16",
          "the recurrent state's dtypes, each shape run once per dtype (fp32, bf16)");
ABSL_FLAG(int, fold_every, 4, "commit mode FAST's F: rings of F * Q tokens (0: no FAST rows)");
ABSL_FLAG(int, fast_snapshots, 6,
          "FAST: steady-state steps timed; their mean is the step with folds amortized");
ABSL_FLAG(bool, fast_checkpoint_numerics, true,
          "FAST: also time Verify's checkpoint products on CUDA cores (fp32) and on tensor "
          "cores (3xTF32, tf32), through the kernel launcher (no device checks)");
ABSL_FLAG(bool, fast_verify_schedules, true,
          "FAST's verify (3xTF32) under each FastVerifySchedule beside the served one");
ABSL_FLAG(bool, fast_bulk_copies, true,
          "with --fast_verify_schedules: also the piped pass with the TMA's bulk copies");
ABSL_FLAG(bool, fast_fold_schedules, true,
          "FAST's folds and cursors alone (the direct call) under each FastFoldSchedule, and "
          "what a folded row costs against its state's write at copy bandwidth");
ABSL_FLAG(bool, floors, true,
          "time the floors: an empty kernel, and each shape's checkpoint read once with no math "
          "(tests/bench/floor_kernels.h)");
ABSL_FLAG(bool, eager, true,
          "time EAGER's verify and commit (with --eager=false only the stock kernel and DEFERRED's "
          "rows run: what profile_kernels.sh profiles)");

namespace specstate {
namespace {

using bench::CheckOk;
using bench::CopyBandwidth;
using bench::LaunchCheckpointReadFloor;
using bench::LaunchEmptyKernel;
using bench::Time;
using bench::Timing;
using ::specstate::DType;
using kernels::KdaKernels;
using kda_bench::Bench;
using kda_bench::CheckDevice;
using kda_bench::CommitBytes;
using kda_bench::CommitOf;
using kda_bench::DeferredCommitBytes;
using kda_bench::DeferredCommitOf;
using kda_bench::DeferredVerifyBytes;
using kda_bench::DeferredVerifyOf;
using kda_bench::FastCommitBytes;
using kda_bench::FastCommitOf;
using kda_bench::FastVerifyBytes;
using kda_bench::FastVerifyOf;
using kda_bench::Free;
using kda_bench::FreeFast;
using kda_bench::KimiK3;
using kda_bench::KimiLinear;
using kda_bench::Make;
using kda_bench::MakeFast;
using kda_bench::Qwen3Next;
using kda_bench::RestoreCursors;
using kda_bench::RestorePending;
using kda_bench::Shape;
using kda_bench::StockBytes;
using kda_bench::StockOf;
using kda_bench::VerifyBytes;
using kda_bench::VerifyOf;

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
    // Issue 34: the conv-window compaction (DEFERRED's commit is its plan
    // kernel and the compaction) at copy speed.
    {"Kimi-Linear-48B-A3B", "DEFERRED commit, 20 layers", 256, 0, 0.70},
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

// What a fold costs under one FastFoldSchedule at one N: the direct call's
// folds and cursors per layer (cold L2, CUDA graph), the rows that fold a
// layer a step, and one state's bytes.
struct FoldCost {
  int N;
  std::string schedule;
  double us_per_layer;
  double folded_rows;
  double state_bytes;
};

// Commit mode FAST on bench `b`: verify (layer 0) and commit (every layer)
// at each steady-state step, through the kernel interface, cursors restored
// before every run; the rows are the means over the steps. (The fold ahead
// schedule this once compared is gone: docs/benchmarks.md, "Fold ahead".)
void MeasureFast(Bench& b, int fold_every, bool align_too, int iters, cudaStream_t stream,
                 double stock_us, std::mt19937& rng, std::vector<Row>* rows,
                 std::vector<FoldCost>* fold_costs) {
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
  if (absl::GetFlag(FLAGS_fast_verify_schedules)) {
    // The served numerics (3xTF32) under each schedule, side by side
    // (FastVerifySchedule: the same bits, laid out differently).
    using Staging = kernels::fast::FastVerifySchedule::Staging;
    using Piping = kernels::fast::FastVerifySchedule::Piping;
    using Prefetch = kernels::fast::FastVerifySchedule::CheckpointPrefetch;
    using Copies = kernels::fast::FastVerifySchedule::PipeCopies;
    const kernels::fast::FastVerifyArgs direct = kernels::fast::FastVerifyArgsOf(verify);
    kernels::fast::FastNumerics num;
    num.checkpoint = kernels::fast::FastNumerics::Operands::kTf32Split;
    std::vector<std::pair<kernels::fast::FastVerifySchedule, std::string>> schedules = {
        {{Staging::kAuto, 0, true}, "launcher's choice"},
        {{Staging::kOff, 1, false, Piping::kOff}, "unstaged"},
        {{Staging::kOff, 1, true}, "unstaged, early-start kernel"},
        {{Staging::kOff, 1, false, Piping::kOn}, "unstaged, piped checkpoint pass"},
        {{Staging::kOff, 1, false, Piping::kOff, Prefetch::kAfterWindow},
         "unstaged, checkpoint prefetched after the window"},
        {{Staging::kOff, 1, false, Piping::kOff, Prefetch::kAfterRing},
         "unstaged, checkpoint prefetched after the ring"}};
    if (absl::GetFlag(FLAGS_fast_bulk_copies)) {
      schedules.push_back({{Staging::kOff, 1, false, Piping::kOn, Prefetch::kNone, Copies::kBulk},
                           "unstaged, piped checkpoint pass, TMA bulk copies"});
    }
    for (int splits : {1, 2, 4, 8}) {
      if (b.shape.K / splits >= 16) {
        schedules.push_back(
            {{Staging::kOn, splits, true}, absl::StrCat("staged, ", splits, " a head")});
      }
    }
    // The ring's values summed per state row (RingValues::kPerRow; the
    // launcher spreads them over the block wherever it stages) at N = 1, a
    // grid the launcher stages: its choice of split, two and four.
    kernels::fast::FastVerifySchedule per_row;
    per_row.ring_values = kernels::fast::FastVerifySchedule::RingValues::kPerRow;
    if (b.N == 1) schedules.push_back({per_row, "launcher's choice, ring values per row"});
    for (int splits : {2, 4}) {
      if (b.N != 1 || b.shape.K / splits < 16) continue;
      per_row.staging = Staging::kOn;
      per_row.value_splits = splits;
      schedules.push_back(
          {per_row, absl::StrCat("staged, ", splits, " a head, ring values per row")});
    }
    // The staged kernel's window loaded after the row's cursor
    // (WindowLoads::kAfterCursor; the launcher loads it with the cursor) at
    // N = 1: the launcher's split, and four.
    kernels::fast::FastVerifySchedule window_after;
    window_after.window_loads = kernels::fast::FastVerifySchedule::WindowLoads::kAfterCursor;
    if (b.N == 1) {
      schedules.push_back({window_after, "launcher's choice, window loaded after the cursor"});
      if (b.shape.K / 4 >= 16) {
        window_after.staging = Staging::kOn;
        window_after.value_splits = 4;
        schedules.push_back({window_after, "staged, 4 a head, window loaded after the cursor"});
      }
    }
    // The launcher's choice with the per-row arrays unrolled to a window of
    // kShortWindow tokens (WindowBound::kShort; the launcher unrolls to the
    // full window): what the short-window kernels save.
    if (b.shape.Q <= kernels::fast::kShortWindow) {
      kernels::fast::FastVerifySchedule short_window;
      short_window.window_bound = kernels::fast::FastVerifySchedule::WindowBound::kShort;
      schedules.push_back({short_window, "launcher's choice, unrolled to a window of four"});
    }
    for (const auto& [schedule, name] : schedules) {
      std::vector<Row> runs;
      for (int x = 0; x < steps; ++x) {
        runs.push_back(Measure(
            "", b.N, FastVerifyBytes(b, b.ring_tokens[x]), iters, stream,
            [&](const KdaKernels&) {
              CheckOk(kernels::fast::FastVerifyCuda(direct, num, stream, schedule),
                      "FAST Verify (schedule)");
            },
            [&] { RestoreCursors(b, x, false, stream); }));
        CheckDevice(b, "FAST Verify (schedule)");
      }
      rows->push_back(MeanOf(
          absl::StrFormat("FAST verify 3xTF32, %s (F=%d), 1 layer", name, fold_every), runs));
      rows->back().stock_us = stock_us;
    }
  }
  if (absl::GetFlag(FLAGS_fast_fold_schedules)) {
    // The folds alone (and the cursors' kernel): the direct call, which
    // plans each row itself, under each fold schedule (the same bits, laid
    // out differently), the cursors restored before every run.
    using Staging = kernels::fast::FastFoldSchedule::Staging;
    const std::vector<kernels::fast::FastLayer> layers =
        kernels::fast::FastLayersOf(commit.layers, commit.num_layers);
    const kernels::fast::FastCommitArgs direct =
        kernels::fast::FastCommitArgsOf(commit, layers.data());
    const std::pair<kernels::fast::FastFoldSchedule, const char*> fold_schedules[] = {
        {{Staging::kOff, 16}, "unstaged, 16 blocks a head"},
        {{Staging::kOn, 16}, "staged, 16 blocks a head"},
        {{Staging::kPipelined, 1}, "pipelined, 1 block a head"},
        {{Staging::kPipelined, 2}, "pipelined, 2 blocks a head"},
        {{Staging::kPipelined, 4}, "pipelined, 4 blocks a head"}};
    for (const auto& [schedule, name] : fold_schedules) {
      std::vector<Row> runs;
      for (int x = 0; x < steps; ++x) {
        runs.push_back(Measure(
            "", b.N, FastFoldBytes(b, b.fold_tokens[x]), iters, stream,
            [&](const KdaKernels&) {
              CheckOk(kernels::fast::FastCommitCuda(direct, {}, stream, schedule),
                      "FAST Commit (direct)");
            },
            [&] { RestoreCursors(b, x, true, stream); }));
      }
      rows->push_back(MeanOf(absl::StrFormat("FAST folds and cursors, %s, direct call, %d layers "
                                             "(F=%d, %.3f folds a row a step)",
                                             name, s.L, fold_every, folds),
                             runs));
      rows->back().per_layer_of = s.L;
      rows->back().stock_us = stock_us;
      fold_costs->push_back({b.N, name, rows->back().cold.graph_us / s.L, folds * b.N,
                             double(b.state_bytes)});
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

// The checkpoint-read floors at b's N (floor_kernels.h): each row's slice of
// layer 0 read once, no math, after one dependent load (its block) and after
// two (its block, then a word of that block, as a Verify reads its cursor).
// The grid is split as the staged Verify splits one wave: (row, value head)
// blocks times the most splits (8, 4, 2) that stay within one block an SM.
void MeasureFloors(const Bench& b, int iters, cudaStream_t stream, double stock_us,
                   std::vector<Row>* rows) {
  const Shape& s = b.shape;
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int64_t heads = int64_t{b.N} * s.value_heads();
  int splits = 1;
  for (int x : {8, 4, 2}) {
    if (heads * x <= sms) {
      splits = x;
      break;
    }
  }
  int32_t* hops = nullptr;
  float* out = nullptr;
  CHECK_CUDA(cudaMalloc(&hops, sizeof(int32_t) * b.num_blocks));
  CHECK_CUDA(cudaMemset(hops, 0, sizeof(int32_t) * b.num_blocks));
  CHECK_CUDA(cudaMalloc(&out, sizeof(float) * heads * s.K));
  const double bytes = double(heads) * s.K * s.K * s.state_size() + double(heads) * s.K * 4;
  const kernels::StatePool& state = b.layers[0].state;
  for (int loads : {1, 2}) {
    rows->push_back(Measure(
        absl::StrFormat("floor: the checkpoint read once after %d dependent load%s, no math, "
                        "1 layer",
                        loads, loads > 1 ? "s" : ""),
        b.N, bytes, iters, stream, [&](const KdaKernels&) {
          CHECK_CUDA(LaunchCheckpointReadFloor(state.data, s.bf16_state(), state.block_stride,
                                               s.K, b.checkpoints, hops, loads, b.N,
                                               s.value_heads(), splits, out, stream));
        }));
    rows->back().stock_us = stock_us;
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  CHECK_CUDA(cudaFree(hops));
  CHECK_CUDA(cudaFree(out));
}

void RunShape(const Shape& s, const std::vector<int>& ns, int iters, cudaStream_t stream,
              double copy_bps) {
  std::printf("\n### %s: %s, H=%d, HV=%d, K=V=%d, Q=%d, %s state, bf16 activations, conv "
              "dim %d, conv kernel %d, commit over %d layers\n\n",
              s.name.c_str(), s.gdn() ? "Gated DeltaNet" : "KDA", s.H, s.value_heads(), s.K, s.Q,
              s.bf16_state() ? "bf16" : "fp32", s.conv_dim, s.conv_kernel, s.L);
  std::vector<Row> rows;
  std::vector<FoldCost> fold_costs;
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
    if (absl::GetFlag(FLAGS_floors)) MeasureFloors(b, iters, stream, stock_us, &rows);
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
      MeasureFast(b, fold_every, N == ns.back(), iters, stream, stock_us, rng, &rows,
                  &fold_costs);
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
  // What a folded row costs (issue 34: at most 1.5x its state's write at
  // copy bandwidth): the folds and cursors a layer over the rows that fold
  // a layer a step (the cursors' kernel and the plan reads included, so an
  // upper bound).
  if (!fold_costs.empty()) {
    std::printf("\n| fold schedule | N | folds and cursors a layer (us, cold L2) | rows folding "
                "a layer a step | us a folded row | its state's write at copy (us) | ratio |\n"
                "|---|---:|---:|---:|---:|---:|---:|\n");
    for (const FoldCost& f : fold_costs) {
      if (f.folded_rows <= 0) continue;
      const double per_row = f.us_per_layer / f.folded_rows;
      const double write_us = f.state_bytes / copy_bps * 1e6;
      std::printf("| %s | %d | %.1f | %.1f | %.2f | %.2f | %.2fx |\n", f.schedule.c_str(), f.N,
                  f.us_per_layer, f.folded_rows, per_row, write_us, per_row / write_us);
    }
  }
  // FAST's step targets (issue 23), cold L2, CUDA graph.
  if (s.name == KimiLinear().name && !fast_cold.empty()) {
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
  if (absl::GetFlag(FLAGS_floors)) {
    // What any kernel costs here: the harness's floor under every row.
    const Timing empty =
        Time(stream, iters, [&] { CHECK_CUDA(LaunchEmptyKernel(stream)); }, /*cold=*/true);
    std::printf("\nAn empty kernel (one warp), measured in this run: %.1f us replayed from a "
                "CUDA graph after the cold-L2 write, %.1f us launched\n",
                empty.graph_us, empty.launched_us);
  }
  if (absl::GetFlag(FLAGS_sweep) || absl::GetFlag(FLAGS_before)) {
    std::printf("\n(--sweep and --before are ignored: the recurrent kernel's other thread layouts "
                "and the kernel before the pipelined one are no longer built; their last "
                "measurements are in docs/benchmarks.md.)\n");
  }
  std::vector<int> ns;
  for (absl::string_view n : absl::StrSplit(absl::GetFlag(FLAGS_ns), ',')) {
    ns.push_back(std::stoi(std::string(n)));
  }
  for (absl::string_view dtype : absl::StrSplit(absl::GetFlag(FLAGS_state_dtypes), ',')) {
    if (dtype != "fp32" && dtype != "bf16") {
      std::fprintf(stderr, "kda_bench: --state_dtypes takes fp32 and bf16, not %s\n",
                   std::string(dtype).c_str());
      return 2;
    }
    for (absl::string_view name : absl::StrSplit(absl::GetFlag(FLAGS_shapes), ',')) {
      const Shape* preset = name == "kimi_linear" ? &KimiLinear()
                            : name == "kimi_k3"   ? &KimiK3()
                            : name == "qwen3_next" ? &Qwen3Next()
                                                   : nullptr;
      if (preset == nullptr) continue;
      Shape s = *preset;
      s.state = dtype == "bf16" ? DType::kBFloat16 : DType::kFloat32;
      RunShape(s, ns, iters, stream, copy_bps);
    }
  }
  return 0;
}

}  // namespace
}  // namespace specstate

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return specstate::Main();
}
