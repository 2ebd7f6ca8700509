// kda_bench's world: the models' shapes, everything one shape needs on the
// device at N rows (pools, records, activations, DEFERRED's bookkeeping,
// FAST's rings and steady-state cursors), the kernel interface's arguments
// over it, as the service builds them, and the bytes each call must move.
#ifndef SPECSTATE_TESTS_BENCH_KDA_BENCH_SETUP_H_
#define SPECSTATE_TESTS_BENCH_KDA_BENCH_SETUP_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/kda_args.h"

namespace specstate {
namespace kda_bench {

struct Shape {
  std::string name;
  int H, K, Q, L, conv_dim, conv_kernel;
  kernels::LayerKind kind = kernels::LayerKind::kKda;
  int HV = 0;  // value heads (GDN); 0: = H
  DType state = DType::kFloat32;  // the recurrent state's rows (fp32 or bf16)
  int value_heads() const { return HV > 0 ? HV : H; }
  bool bf16_state() const { return state == DType::kBFloat16; }
  int state_size() const { return bf16_state() ? 2 : 4; }
  bool gdn() const { return kind == kernels::LayerKind::kGdn; }
};

// The models' shapes: the service's presets (server/config/presets.cc, where each
// field's source is cited; specstated --model takes the same names).
const Shape& KimiLinear();
const Shape& KimiK3();
// Gated DeltaNet: 16 key heads, 32 value heads, conv dim 2 H K + HV V.
const Shape& Qwen3Next();

// Everything one shape needs at N rows: per-layer pools (two blocks per row:
// the checkpoint and, in align mode, the next), records and parameters; one
// layer's activations; a stock pool with Q blocks per row for the stock path.
struct Bench {
  Shape shape;
  int N;
  int64_t T;
  int64_t HK;           // key width (q, k per token)
  int64_t VW, GW, HV;   // value width (v, o), gate width (g), value heads (beta)
  int64_t state_bytes;  // one block
  int64_t num_blocks;
  int conv_width;
  kernels::KdaShape kda;
  std::vector<kernels::CommitLayer> layers;
  kernels::CommitLayer* device_layers;
  void *q, *k, *v, *g, *beta, *out;
  void* stock_pool;
  int32_t *qsl, *checkpoints, *stock_indices, *stock_accepted, *accepted, *block_table, *computed;
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
  std::vector<double> ring_tokens;            // a step's mean ring tokens a row
  std::vector<std::vector<int>> fold_tokens;  // a step's folds: tokens folded a row (0: none)
};

// Allocates and fills shape `s` at N rows (device memory; ends the run on an error).
Bench Make(const Shape& s, int N, std::mt19937& rng);

// FAST's rings and steady-state cursors. Each row's ring follows accepted
// counts uniform in [1, Q] from empty for 200 steps, then `snapshots` steps
// are kept; the commit's accepted counts are the bench's (b.accepted), so a
// step folds the rows whose ring then has no room for another window (the
// schedule the service serves: Commit's folds).
void MakeFast(Bench& b, int fold_every, int snapshots, std::mt19937& rng);

// FAST's rings and snapshots (MakeFast's), so that another MakeFast can run.
void FreeFast(Bench& b);

// Everything Make and MakeFast allocated.
void Free(Bench& b);

// EAGER's verify of layer 0, as a step's later Verify calls are: checked
// against the step's snapshot.
kernels::VerifyArgs VerifyOf(const Bench& b);

// DEFERRED's verify of layer 0: every row replays its pending tokens first.
kernels::VerifyArgs DeferredVerifyOf(const Bench& b);

// Puts the bookkeeping back as the last commit left it: before a DEFERRED
// verify, every row pending; before a DEFERRED commit, as this step's
// verify calls leave it (every entry taken).
void RestorePending(const Bench& b, bool taken, cudaStream_t stream);

// The stock kernel on its own pool (Q blocks a row).
kernels::StockArgs StockOf(const Bench& b);

// EAGER's (DEFERRED's) commit of every layer, mode none or align.
kernels::CommitArgs CommitOf(const Bench& b, bool align);
kernels::CommitArgs DeferredCommitOf(const Bench& b, bool align);

// FAST's verify of layer 0 and its commit of every layer (the layers'
// rings set), as the service calls them.
kernels::VerifyArgs FastVerifyOf(const Bench& b);

kernels::CommitArgs FastCommitOf(const Bench& b, bool align);

// Puts steady-state step x's cursors in place: layer 0's as before the
// step's Verify, or every layer's as its Verify calls leave them.
void RestoreCursors(const Bench& b, int x, bool verified, cudaStream_t stream);

// Ends the run when the last call's device checks failed.
void CheckDevice(const Bench& b, const char* what);

// Bytes each kernel must move (every state, input and output once).
// A token's k, v, g and beta (what a record token holds), and its q (bytes).
double RecordTokenBytes(const Bench& b);

double QueryBytes(const Bench& b);

double OutputBytes(const Bench& b);

double VerifyBytes(const Bench& b);

// DEFERRED's fused verify: each row's pending records read, its checkpoint
// read and written once, then verify's own traffic.
double DeferredVerifyBytes(const Bench& b);

// DEFERRED's commit moves the conv windows only (no row crosses a boundary
// in mode none), and reads the pending table of the rows' blocks.
double DeferredCommitBytes(const Bench& b);

// FAST: a ring token's raw k (bf16), u and log-decay (fp32).
double RingTokenBytes(const Bench& b);

// FAST verify: each row's checkpoint and ring tokens read, its window's
// inputs read, outputs and candidates written.
double FastVerifyBytes(const Bench& b, double ring_tokens);

// FAST commit: the conv windows (as DEFERRED's) and each fold's state read
// and written and ring read, every layer.
double FastCommitBytes(const Bench& b, const std::vector<int>& fold_tokens);
// FAST's folds alone over every layer (each folding row's state read and
// written, its ring tokens read): FastCommitBytes less the conv windows.
double FastFoldBytes(const Bench& b, const std::vector<int>& fold_tokens);

double StockBytes(const Bench& b);

double CommitBytes(const Bench& b, bool align);

}  // namespace kda_bench
}  // namespace specstate

#endif  // SPECSTATE_TESTS_BENCH_KDA_BENCH_SETUP_H_
