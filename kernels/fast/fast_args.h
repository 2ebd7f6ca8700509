// Arguments of the FAST commit mode's kernels (issue 23): a checkpoint every
// few steps, outputs from the checkpoint and a ring of the accepted tokens.
//
// Per (layer, state block) FAST keeps
//  - the checkpoint: the block's state in the pool ([HV, V, K], the state
//    dtype, as in every mode);
//  - a ring of the tokens accepted since the checkpoint, `capacity` R >=
//    F * Q tokens (F = fold_every, Q = spec_query_len): per token its raw k
//    (activation dtype, the bits the caller gave), u = beta * (v - S k) in
//    fp32, and its log-decay gamma in fp32 (KDA: per column, [H, K]; GDN: per
//    value head, [HV]);
//  - a cursor: how many ring tokens are real (`tokens`), and how many
//    candidates the last Verify wrote after them (`candidates`).
// The block's current state is the checkpoint advanced by its ring tokens
// (docs/semantics.md, "Fast mode (FAST)"):
//
//   S = S0 * exp(G) + sum_i u_i (k_i * exp(G - G_i))^T
//
// with G_i the cumulative log-decay up to ring token i and G that of the
// last one (per column for KDA).
//
//   FastRings rings{k, u, log_decay, cursors, num_blocks, FastRingCapacity(8, 4)};
//   FastVerifyArgs v;   // q, k, v, g, beta of each row's window; its checkpoint block
//   FastVerifyCpu(v);   // outputs; candidates in ring slots [tokens, tokens + T)
//   FastCommitArgs c;   // the plan's inputs, as for the EAGER Commit
//   FastCommitCpu(c);   // tokens += commit_len; a fold when the next window may not fit
//
// Pointers are in the backend's memory (host memory for the CPU backend).
// The ring buffers are zeroed once when allocated (cursors all zero: empty
// rings); only these kernels write them.
#ifndef SPECSTATE_KERNELS_FAST_FAST_ARGS_H_
#define SPECSTATE_KERNELS_FAST_FAST_ARGS_H_

#include <cstddef>
#include <cstdint>

#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace fast {

// The rings (FastRings: per block of a layer, its ring and cursor) are
// defined in kernels/kda_args.h, where the kernel interface's VerifyArgs and
// CommitLayer carry them (commit mode FAST through KdaKernels).
using ::specstate::kernels::FastCursor;
using ::specstate::kernels::FastRings;

// Elements per ring token of each buffer.
SPECSTATE_HD int64_t RingKWidth(const KdaShape& s) { return KeyWidth(s); }
SPECSTATE_HD int64_t RingUWidth(const KdaShape& s) { return ValueWidth(s); }
SPECSTATE_HD int64_t RingLogDecayWidth(const KdaShape& s) { return GateWidth(s); }

// The ring a mode with fold_every F needs: F windows of Q tokens.
inline int FastRingCapacity(int fold_every, int spec_query_len) {
  return fold_every * spec_query_len;
}

// The largest ring the service allocates (Layout.fold_every * Q): Verify
// reads a block's whole ring every step, so its cost grows with R, and the
// accuracy tables (docs/semantics.md) cover R up to 128 (F = 16, Q = 8).
inline constexpr int kMaxFastRingCapacity = 256;
// fold_every when a layout leaves it at 0.
inline constexpr int kDefaultFoldEvery = 4;

// Bytes of each ring buffer for `num_blocks` blocks of capacity R.
size_t FastRingKBytes(const KdaShape& shape, int64_t num_blocks, int capacity);
size_t FastRingUBytes(const KdaShape& shape, int64_t num_blocks, int capacity);
size_t FastRingLogDecayBytes(const KdaShape& shape, int64_t num_blocks, int capacity);
size_t FastCursorBytes(int64_t num_blocks);

// FAST Verify (one layer): per row, the outputs of its window from its
// checkpoint block, the block's ring tokens and the window (the chunked
// form), and the window's ring candidates (raw k, u, gamma of each token)
// written to ring slots [tokens, tokens + T). No state is written; the
// candidates become ring tokens only when a Commit accepts them.
struct FastVerifyArgs {
  KdaShape shape;
  Activation q, k, v, g, beta;  // as VerifyArgs: [T, H, K], [T, HV, V], g, beta
  int64_t num_tokens = 0;
  void* out = nullptr;  // o [num_tokens, HV, V], dense, activation dtype
  StatePool state;      // the checkpoints
  FastRings rings;
  LayerParams params;   // KDA only
  int spec_query_len = 0;                    // Q: every row has at most Q tokens
  int num_rows = 0;                          // N
  const int32_t* query_start_loc = nullptr;  // [N + 1]
  const int32_t* state_indices = nullptr;    // [N]: each row's checkpoint block (<= 0: idle row)
  // CUDA, through the kernel interface: the status its checks wrote; the
  // kernels do nothing when it says they failed. Null: no gate. (The CPU
  // calls check before they run and ignore it.)
  const DeviceStatus* gate = nullptr;
  // The row metadata (query_start_loc, state_indices) and the cursors were
  // in place before the gate's checks began (the service's own expected
  // values: a step's later Verify): the CUDA Verify kernels that may start
  // early (verify_plan.h) read and compute while the checks run, and wait
  // for them before their first write.
  bool rows_before_checks = false;
};

// One layer of a FAST Commit or Materialize.
struct FastLayer {
  StatePool state;
  FastRings rings;
  LayerParams params;
};

// FAST Commit of every layer of a group: the plan of docs/semantics.md
// (Commit step 1; the same commit_len, final and boundary blocks as EAGER),
// then per row and layer:
//  - mode none, or align mode within the checkpoint's block (final block ==
//    checkpoint, no boundary): the ring takes the row's first commit_len
//    candidates (tokens += commit_len). When the ring then has no room for
//    another window (tokens + Q > R), the ring is folded into the
//    checkpoint, in fp32, stored in the state dtype, and emptied.
//  - align mode otherwise: the boundary state (after boundary_len tokens)
//    and the final state (after commit_len) are folded from the checkpoint,
//    its ring and the candidates, stored to the boundary and final blocks,
//    and those blocks' rings are empty: prefix-cache blocks hold real states.
// Every row's candidates are forgotten (rejected drafts cost nothing).
// Conv windows are the EAGER Commit's business (it compacts them); FAST
// changes only the recurrent state.
struct FastCommitArgs {
  KdaShape shape;
  int spec_query_len = 0;  // Q
  int num_layers = 0;
  const FastLayer* layers = nullptr;
  int num_rows = 0;                          // N spec rows, as verified
  const int32_t* query_start_loc = nullptr;  // [N + 1], as verified
  IndexMatrix state_indices;                 // [N, >= 1]: column 0, as verified
  int batch = 0;                             // rows of num_accepted (and align metadata)
  const int32_t* num_accepted = nullptr;     // [batch]
  const int32_t* request_indices = nullptr;  // [N] spec row -> batch row; null: identity
  // Align mode: all of block_table.data, num_computed_tokens and
  // mamba_block_size, or none of them (mode "none").
  IndexMatrix block_table;                       // [batch, width]
  const int32_t* num_computed_tokens = nullptr;  // [batch]
  int mamba_block_size = 0;
  // CUDA, through the kernel interface: its checked plan [num_rows] (the
  // backend's memory) and the status its checks wrote (the kernels do
  // nothing when it failed). Null: the kernels plan each row themselves, no
  // gate. The CPU calls plan and check before they run and ignore both.
  const CommitPlanRow* plan = nullptr;
  const DeviceStatus* gate = nullptr;
  // Tests only, CPU: called after each layer's rows ("layer"; the commit
  // journal's hook), so a test can kill the process between layers' folds.
  void (*test_hook)(const char* phase) = nullptr;
};

// The CommitArgs that the commit plan and the checks of
// kernels/checks/ read, from a FAST Commit's (both backends).
inline CommitArgs PlanArgsOf(const FastCommitArgs& a) {
  CommitArgs p;
  p.shape = a.shape;
  p.spec_query_len = a.spec_query_len;
  p.num_rows = a.num_rows;
  p.query_start_loc = a.query_start_loc;
  p.state_indices = a.state_indices;
  p.batch = a.batch;
  p.num_accepted = a.num_accepted;
  p.request_indices = a.request_indices;
  p.block_table = a.block_table;
  p.num_computed_tokens = a.num_computed_tokens;
  p.mamba_block_size = a.mamba_block_size;
  return p;
}

// FAST Materialize: the current state of given blocks (Flush, ReadState, a
// block about to be handed to another request).
//  - `out` null: folds each block's ring into its checkpoint in place and
//    empties the ring (the pool then holds the current state). The
//    candidates of the block's last Verify stay, moved to the ring's start
//    (u was computed against the state they follow, which the fold does
//    not change): a Flush or ReadState between a step's Verify and its
//    Commit changes no result of the step.
//  - `out` set (one layer): writes each block's current state to
//    out[i] ([HV, V, K], the state dtype, as the pool would hold it after a
//    fold) and changes nothing.
struct FastMaterializeArgs {
  KdaShape shape;
  int num_layers = 0;
  const FastLayer* layers = nullptr;
  const int32_t* blocks = nullptr;  // [num_blocks_given]; <= 0 entries are skipped
  int num_blocks_given = 0;
  int layer = -1;       // only this layer; -1: every layer (not with `out`)
  void* out = nullptr;  // [num_blocks_given, HV, V, K], state dtype
  bool discard = false; // with `out` null: empty the rings (candidates too) without folding
  // Instead of `blocks`: every block whose ring holds tokens or candidates
  // in a covered layer (`blocks` null, num_blocks_given 0, `out` null).
  bool every_block = false;
  const DeviceStatus* gate = nullptr;  // as FastVerifyArgs::gate
  // Tests only, CPU, in place: called once the first covered layer's blocks
  // are folded ("flush:taken"; the fold journal's hook).
  void (*test_hook)(const char* point) = nullptr;
};

}  // namespace fast
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_FAST_FAST_ARGS_H_
