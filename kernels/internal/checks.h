// The per-row device checks and the commit plan, shared by the CPU and CUDA
// backends so that both accept, reject and plan exactly alike
// (docs/semantics.md, "Checks before anything is written").
//
// Each Check*/Plan* function looks at one row, reads only what that row
// uses, and returns the first fault it finds. The backends run them over all
// rows, report the fault of the lowest row, and only then run the
// cross-row pass (no two rows writing one block, no row writing a block
// another row reads) with a table of owners indexed by block.
#ifndef SPECSTATE_KERNELS_INTERNAL_CHECKS_H_
#define SPECSTATE_KERNELS_INTERNAL_CHECKS_H_

#include <math.h>

#include <cstdint>

#include "kernels/device_status.h"
#include "kernels/kda_args.h"
#include "kernels/numeric.h"

namespace specstate {
namespace kernels {
namespace internal {

struct RowFault {
  int32_t field;
  int32_t problem;  // 0: no fault
  int32_t index;
  int32_t col;
  int64_t value;
  int64_t bound;
};

SPECSTATE_HD RowFault NoFault() { return RowFault{0, 0, 0, -1, 0, 0}; }

SPECSTATE_HD RowFault MakeFault(CheckedField field, CheckProblem problem, int32_t index, int32_t col,
                                int64_t value, int64_t bound) {
  return RowFault{static_cast<int32_t>(field), static_cast<int32_t>(problem), index, col, value,
                  bound};
}

SPECSTATE_HD bool IsBlock(int32_t block) { return block > kNullBlock; }

SPECSTATE_HD DeviceStatus StatusFromFault(const RowFault& f, int32_t row, int32_t other_row) {
  DeviceStatus s;
  s.failed = f.problem != 0 ? 1 : 0;
  s.field = f.field;
  s.problem = f.problem;
  s.row = row;
  s.index = f.index;
  s.col = f.col;
  s.other_row = other_row;
  s.value = f.value;
  s.bound = f.bound;
  return s;
}

SPECSTATE_HD DeviceStatus OkStatus() {
  DeviceStatus s;
  s.failed = 0;
  s.field = 0;
  s.problem = 0;
  s.row = -1;
  s.index = -1;
  s.col = -1;
  s.other_row = -1;
  s.value = 0;
  s.bound = 0;
  return s;
}

// Row n's token count from query_start_loc, checking the entries it reads:
// qsl[0] == 0 (row 0), non-decreasing, at most `max_tokens` tokens, and the
// last offset within the `num_tokens` tokens of the activations.
SPECSTATE_HD RowFault CheckRowTokens(const int32_t* qsl, int n, int num_rows, int max_tokens,
                                     int64_t num_tokens, int* tokens) {
  *tokens = 0;
  const int64_t begin = qsl[n];
  const int64_t end = qsl[n + 1];
  if (n == 0 && begin != 0) {
    return MakeFault(CheckedField::kQueryStartLoc, CheckProblem::kNonZeroStart, 0, -1, begin, 0);
  }
  if (end < begin) {
    return MakeFault(CheckedField::kQueryStartLoc, CheckProblem::kDecreasing, n + 1, -1, end,
                     begin);
  }
  if (end - begin > max_tokens) {
    return MakeFault(CheckedField::kQueryStartLoc, CheckProblem::kTooManyTokens, n + 1, -1,
                     end - begin, max_tokens);
  }
  if (n == num_rows - 1 && end > num_tokens) {
    return MakeFault(CheckedField::kQueryStartLoc, CheckProblem::kPastLastToken, n + 1, -1, end,
                     num_tokens);
  }
  *tokens = static_cast<int>(end - begin);
  return NoFault();
}

// A block index the call will use: null (<= 0) or below the pool's size.
SPECSTATE_HD RowFault CheckBlock(CheckedField field, int32_t block, int64_t num_blocks,
                                 int32_t index, int32_t col) {
  if (block >= num_blocks) {
    return MakeFault(field, CheckProblem::kIndexTooLarge, index, col, block, num_blocks);
  }
  return NoFault();
}

// An index into a tensor of `bound` rows.
SPECSTATE_HD RowFault CheckRowIndex(CheckedField field, int32_t value, int64_t bound,
                                    int32_t index) {
  if (value < 0) return MakeFault(field, CheckProblem::kNegative, index, -1, value, bound);
  if (value >= bound) {
    return MakeFault(field, CheckProblem::kIndexTooLarge, index, -1, value, bound);
  }
  return NoFault();
}

// ---------------------------------------------------------------------------
// Stock kernel.

struct StockRow {
  int tokens;
  int first_col;   // column holding the initial state
  int32_t source;  // initial block; the row is idle unless IsBlock(source)
};

// A stock row runs at most one token per column of ssm_state_indices, and at
// most kMaxSpecQueryLen (the kernels stage a row's tokens in shared memory).
SPECSTATE_HD int StockMaxTokens(int cols) {
  return cols < kMaxSpecQueryLen ? cols : kMaxSpecQueryLen;
}

SPECSTATE_HD RowFault CheckStockRow(const StockArgs& a, int n, StockRow* row) {
  row->tokens = 0;
  row->first_col = 0;
  row->source = kNullBlock;
  const int cols = a.ssm_state_indices.cols;
  int tokens = 0;
  RowFault f = CheckRowTokens(a.query_start_loc, n, a.num_rows, StockMaxTokens(cols),
                              a.num_tokens, &tokens);
  if (f.problem != 0 || tokens == 0) return f;
  int first_col = 0;
  if (a.num_accepted_tokens != nullptr) {
    const int32_t accepted = a.num_accepted_tokens[n];
    if (accepted < 1 || accepted > cols) {
      return MakeFault(CheckedField::kNumAcceptedTokens, CheckProblem::kNumAcceptedRange, n, -1,
                       accepted, cols);
    }
    first_col = accepted - 1;
  }
  const int32_t* idx = a.ssm_state_indices.data + n * a.ssm_state_indices.row_stride;
  const int32_t source = idx[first_col];
  f = CheckBlock(CheckedField::kStateIndices, source, a.state.num_blocks, n, first_col);
  if (f.problem != 0 || !IsBlock(source)) return f;
  for (int t = 0; t < tokens; ++t) {
    f = CheckBlock(CheckedField::kStateIndices, idx[t], a.state.num_blocks, n, t);
    if (f.problem != 0) return f;
  }
  row->tokens = tokens;
  row->first_col = first_col;
  row->source = source;
  return NoFault();
}

// ---------------------------------------------------------------------------
// Verify: in two phases. The first loads each of the caller's index values
// once and copies it to the snapshot (or compares it with the step's first
// call's); the second checks the snapshot, which the caller cannot write.
// The kernels then read the snapshot too (VerifiedQueryStartLoc() and
// VerifiedStateIndices()).

struct VerifyRowLoads {
  int32_t start;   // query_start_loc[0] (row 0 only)
  int32_t end;     // query_start_loc[n + 1]
  int32_t source;  // state_indices[n, 0]
};

SPECSTATE_HD VerifyRowLoads LoadVerifyRow(const VerifyArgs& a, int n) {
  VerifyRowLoads in;
  in.start = n == 0 ? a.query_start_loc[0] : 0;
  in.end = a.query_start_loc[n + 1];
  in.source = a.state_indices.data[n * a.state_indices.row_stride];
  return in;
}

SPECSTATE_HD const int32_t* VerifiedQueryStartLoc(const VerifyArgs& a) {
  return a.expected_query_start_loc != nullptr ? a.expected_query_start_loc
                                               : a.snapshot_query_start_loc;
}
SPECSTATE_HD const int32_t* VerifiedStateIndices(const VerifyArgs& a) {
  return a.expected_state_indices != nullptr ? a.expected_state_indices
                                             : a.snapshot_state_indices;
}

// Phase one for row n: its loads into the snapshot, or against the expected
// values (a mismatch is the row's fault).
SPECSTATE_HD RowFault SnapshotVerifyRow(const VerifyArgs& a, int n, const VerifyRowLoads& in) {
  const int32_t* const expected_qsl = a.expected_query_start_loc;
  if (expected_qsl == nullptr) {
    if (n == 0) a.snapshot_query_start_loc[0] = in.start;
    a.snapshot_query_start_loc[n + 1] = in.end;
    a.snapshot_state_indices[n] = in.source;
    return NoFault();
  }
  const int32_t expected_start = n == 0 ? expected_qsl[0] : 0;
  const int32_t expected_end = expected_qsl[n + 1];
  const int32_t expected_source = a.expected_state_indices[n];
  if (n == 0 && in.start != expected_start) {
    return MakeFault(CheckedField::kQueryStartLoc, CheckProblem::kMismatch, 0, -1, in.start,
                     expected_start);
  }
  if (in.end != expected_end) {
    return MakeFault(CheckedField::kQueryStartLoc, CheckProblem::kMismatch, n + 1, -1, in.end,
                     expected_end);
  }
  if (in.source != expected_source) {
    return MakeFault(CheckedField::kStateIndices, CheckProblem::kMismatch, n, -1, in.source,
                     expected_source);
  }
  return NoFault();
}

struct VerifyRow {
  int tokens;
  int32_t source;
};

// Phase two for row n, on the snapshot only.
SPECSTATE_HD RowFault CheckVerifyRow(const VerifyArgs& a, int n, VerifyRow* row) {
  row->tokens = 0;
  row->source = kNullBlock;
  const int32_t source = VerifiedStateIndices(a)[n];
  int tokens = 0;
  RowFault f = CheckRowTokens(VerifiedQueryStartLoc(a), n, a.num_rows, a.records.q, a.num_tokens,
                              &tokens);
  if (f.problem != 0) return f;
  f = CheckBlock(CheckedField::kStateIndices, source, a.state.num_blocks, n, -1);
  if (f.problem != 0) return f;
  row->tokens = tokens;
  row->source = source;
  return NoFault();
}

// ---------------------------------------------------------------------------
// Prerequisites.

// Whether reading the call's inputs faulted (Prerequisites::input_fault).
SPECSTATE_HD RowFault CheckInputFault(const uint32_t* input_fault) {
  if (input_fault != nullptr && *static_cast<const volatile uint32_t*>(input_fault) != 0) {
    return MakeFault(CheckedField::kInputs, CheckProblem::kInputFault, -1, -1, 0, 0);
  }
  return NoFault();
}

// Whether the step was cancelled. A volatile read: on CUDA another stream
// wrote the word, just before the write that released this call.
SPECSTATE_HD RowFault CheckCancelled(const Prerequisites& p) {
  if (p.cancelled != nullptr && p.generation != 0 &&
      *static_cast<const volatile uint32_t*>(p.cancelled) == p.generation) {
    return MakeFault(CheckedField::kPrerequisites, CheckProblem::kCancelled, -1, -1,
                     p.generation, 0);
  }
  return NoFault();
}

// The step's cancellation, else the first failed prerequisite, if any.
SPECSTATE_HD RowFault CheckPrerequisites(const Prerequisites& p) {
  const RowFault cancelled = CheckCancelled(p);
  if (cancelled.problem != 0) return cancelled;
  for (int i = 0; i < p.count; ++i) {
    if (p.statuses[i].failed != 0) {
      return MakeFault(CheckedField::kPrerequisites, CheckProblem::kPrerequisiteFailed, i, -1, 0,
                       0);
    }
  }
  return NoFault();
}

// Whether the row changes anything: conv compaction and replay both need a
// real source, a token to commit and a real final block.
SPECSTATE_HD bool CommitsAnything(const CommitPlanRow& p) {
  return IsBlock(p.source) && p.commit_len > 0 && IsBlock(p.final_block);
}

SPECSTATE_HD int64_t MinI64(int64_t a, int64_t b) { return a < b ? a : b; }
SPECSTATE_HD int64_t MaxI64(int64_t a, int64_t b) { return a > b ? a : b; }

// Row i's plan. It reads each of the caller's values it uses once and keeps
// what the later passes and kernels need in the plan (service memory).
SPECSTATE_HD RowFault PlanCommitRow(const CommitArgs& a, int64_t num_blocks, int i,
                                    CommitPlanRow* plan) {
  *plan = CommitPlanRow{kNullBlock, 0, kNullBlock, kNullBlock, 0, i};
  const int q = a.spec_query_len;
  int tokens = 0;
  RowFault f = CheckRowTokens(a.query_start_loc, i, a.num_rows, q, INT64_MAX, &tokens);
  if (f.problem != 0) return f;
  int32_t r = i;
  if (a.request_indices != nullptr) {
    r = a.request_indices[i];
    f = CheckRowIndex(CheckedField::kRequestIndices, r, a.batch, i);
    if (f.problem != 0) return f;
  }
  plan->request_row = r;
  const int32_t source = a.state_indices.data[i * a.state_indices.row_stride];
  f = CheckBlock(CheckedField::kStateIndices, source, num_blocks, i, -1);
  if (f.problem != 0) return f;
  plan->source = source;
  const int64_t accepted = a.num_accepted[r];
  const int32_t commit_len =
      static_cast<int32_t>(MinI64(MinI64(MaxI64(accepted, 0), tokens), q));
  if (!IsBlock(source) || commit_len <= 0) return NoFault();

  int32_t final_block = source;
  int32_t boundary_block = kNullBlock;
  int32_t boundary_len = 0;
  if (a.block_table.data != nullptr) {
    const int64_t computed = a.num_computed_tokens[r];
    if (computed < 0) {
      return MakeFault(CheckedField::kNumComputedTokens, CheckProblem::kNegative, r, -1, computed,
                       0);
    }
    const int64_t bs = a.mamba_block_size;
    const int width = a.block_table.cols;
    const int32_t* table = a.block_table.data + r * a.block_table.row_stride;
    const int64_t final_computed = computed + commit_len;
    const int32_t final_col =
        static_cast<int32_t>(MinI64(MaxI64(final_computed - 1, 0) / bs, width - 1));
    final_block = table[final_col];
    f = CheckBlock(CheckedField::kBlockTable, final_block, num_blocks, r, final_col);
    if (f.problem != 0) return f;
    const int64_t next_boundary = (computed / bs + 1) * bs;
    boundary_len = static_cast<int32_t>(next_boundary - computed);
    if (final_computed >= next_boundary) {
      const int64_t boundary_col = next_boundary / bs - 1;
      if (boundary_col >= width) {
        return MakeFault(CheckedField::kBlockTable, CheckProblem::kColumnPastWidth, r, -1,
                         boundary_col, width);
      }
      boundary_block = table[boundary_col];
      f = CheckBlock(CheckedField::kBlockTable, boundary_block, num_blocks, r,
                     static_cast<int32_t>(boundary_col));
      if (f.problem != 0) return f;
    }
    if (IsBlock(final_block) && IsBlock(boundary_block) && boundary_block == final_block &&
        boundary_len < commit_len) {
      return MakeFault(CheckedField::kBlockTable, CheckProblem::kTwoStatesOneBlock, r,
                       static_cast<int32_t>(next_boundary / bs - 1), boundary_block, 0);
    }
  }
  plan->commit_len = commit_len;
  plan->final_block = final_block;
  plan->boundary_block = boundary_block;
  plan->boundary_len = boundary_len;
  return NoFault();
}

// Column `col` (0..Q) of the row's replay indices (docs/semantics.md, Commit step 3).
SPECSTATE_HD int32_t ReplayIndex(const CommitPlanRow& p, int q, int col) {
  if (!CommitsAnything(p)) return kNullBlock;
  if (col == q) return p.source;
  if (col == p.boundary_len - 1 && p.boundary_len < p.commit_len && IsBlock(p.boundary_block)) {
    return p.boundary_block;
  }
  if (col == p.commit_len - 1) return p.final_block;
  return kNullBlock;
}

// ---------------------------------------------------------------------------
// RecordStateBlocks.

// What the checks read of spec row i, kept (service memory) for the
// cross-row pass and the writes, which read nothing of the caller's again.
struct RecordRow {
  int32_t batch_row;
  int32_t request_row;  // < 0: skipped
  int32_t state_column; // what state_idx[request_row] gets
};

SPECSTATE_HD RowFault CheckRecordRow(const RecordStateBlocksArgs& a, int i, RecordRow* row) {
  row->batch_row = i;
  row->request_row = -1;
  row->state_column = 0;
  int32_t b = i;
  if (a.request_indices != nullptr) {
    b = a.request_indices[i];
    const RowFault f = CheckRowIndex(CheckedField::kRequestIndices, b, a.batch, i);
    if (f.problem != 0) return f;
  }
  row->batch_row = b;
  const int32_t r = a.idx_mapping[b];
  if (r < 0) return NoFault();
  if (r >= a.num_requests) {
    return MakeFault(CheckedField::kIdxMapping, CheckProblem::kIndexTooLarge, b, -1, r,
                     a.num_requests);
  }
  const int32_t computed = a.num_computed_tokens[b];
  const int32_t sampled = a.num_sampled[b];
  if (computed < 0) {
    return MakeFault(CheckedField::kNumComputedTokens, CheckProblem::kNegative, b, -1, computed, 0);
  }
  row->request_row = r;
  // The block-table column now holding the request's running state.
  const int64_t last = MaxI64(int64_t{computed} + sampled - 1, 0);
  row->state_column =
      static_cast<int32_t>(MinI64(last / a.mamba_block_size, a.block_table_width - 1));
  return NoFault();
}

// Workspace of a RecordStateBlocks call: the owner table of the cross-row
// pass, then the checked rows, each for `capacity` rows, the capacity being
// what the workspace's size holds. The owner table's place and size do not
// depend on the call (it must stay zero between calls).
struct RecordWorkspace {
  int capacity;     // most spec rows and request rows a call may have
  int32_t* owner;   // [capacity]
  RecordRow* rows;  // [capacity]
};

SPECSTATE_HD size_t AlignUp(size_t bytes);

SPECSTATE_HD int RecordWorkspaceCapacity(size_t bytes) {
  static_assert(sizeof(RecordRow) == 12, "owner + row = 16 bytes a row");
  return bytes < 256 ? 0 : static_cast<int>((bytes - 256) / 16);
}

SPECSTATE_HD RecordWorkspace RecordWorkspaceLayout(void* base, size_t bytes) {
  char* p = static_cast<char*>(base);
  RecordWorkspace w;
  w.capacity = RecordWorkspaceCapacity(bytes);
  w.owner = reinterpret_cast<int32_t*>(p);
  w.rows = reinterpret_cast<RecordRow*>(p + AlignUp(static_cast<size_t>(w.capacity) * 4));
  return w;
}

// ---------------------------------------------------------------------------
// LoadParams: element i of the staged parameters, a_log [H] then dt_bias [H * K].

SPECSTATE_HD RowFault CheckParamValue(float x, int i, int num_heads) {
  if (isfinite(x)) return NoFault();
  const bool a_log = i < num_heads;
  return MakeFault(a_log ? CheckedField::kALog : CheckedField::kDtBias, CheckProblem::kNotFinite,
                   a_log ? i : i - num_heads, -1, 0, 0);
}

// ---------------------------------------------------------------------------
// Cross-row pass. `owner` has one int32 per block (or request row), zero
// outside a call. Writers claim their blocks with a max of (INT32_MAX - row),
// so after the claims each block names its lowest writer whatever the order
// of the claims; every other writer, and every row reading the block, then
// reports a conflict with that lowest writer.

SPECSTATE_HD int32_t OwnerTag(int row) { return INT32_MAX - row; }
SPECSTATE_HD int32_t OwnerRow(int32_t tag) { return INT32_MAX - tag; }

// The blocks each row writes and reads, for the cross-row pass:
// fn(block, field, index, col) for every block, naming where it came from.

template <typename Fn>
SPECSTATE_HD void ForEachStockWrite(const StockArgs& a, const StockRow& row, int n, Fn fn) {
  if (!IsBlock(row.source)) return;
  const int32_t* idx = a.ssm_state_indices.data + n * a.ssm_state_indices.row_stride;
  for (int t = 0; t < row.tokens; ++t) {
    if (IsBlock(idx[t])) fn(idx[t], CheckedField::kStateIndices, n, t);
  }
}

template <typename Fn>
SPECSTATE_HD void ForEachStockRead(const StockRow& row, int n, Fn fn) {
  if (IsBlock(row.source)) fn(row.source, CheckedField::kStateIndices, n, row.first_col);
}

template <typename Fn>
SPECSTATE_HD void ForEachCommitWrite(const CommitArgs& a, const CommitPlanRow& p, int i, Fn fn) {
  if (!CommitsAnything(p)) return;
  if (a.block_table.data == nullptr) {
    fn(p.final_block, CheckedField::kStateIndices, i, -1);
    return;
  }
  const int32_t r = p.request_row;
  fn(p.final_block, CheckedField::kBlockTable, r, -1);
  if (IsBlock(p.boundary_block) && p.boundary_block != p.final_block) {
    fn(p.boundary_block, CheckedField::kBlockTable, r, -1);
  }
}

template <typename Fn>
SPECSTATE_HD void ForEachCommitRead(const CommitPlanRow& p, int i, Fn fn) {
  if (CommitsAnything(p)) fn(p.source, CheckedField::kStateIndices, i, -1);
}

template <typename Fn>
SPECSTATE_HD void ForEachRecordWrite(const RecordRow& row, Fn fn) {
  if (row.request_row >= 0) fn(row.request_row, CheckedField::kIdxMapping, row.batch_row, -1);
}

// Tokens the replay runs for one row of replay indices: up to the last
// column it stores (later tokens cannot change a stored state).
SPECSTATE_HD int ReplayTokens(const int32_t* replay_row, int q) {
  if (!IsBlock(replay_row[q])) return 0;
  for (int t = q - 1; t >= 0; --t) {
    if (IsBlock(replay_row[t])) return t + 1;
  }
  return 0;
}

// ---------------------------------------------------------------------------
// DEFERRED commits (kda_args.h, PendingBlocks).

// One (layer, block)'s pending tokens: `tokens` (1..16) record tokens of
// record row `record_row` in records buffer `buffer`. Packed into an int32
// that is never 0 (0: nothing pending).
struct PendingEntry {
  int32_t record_row;
  int32_t buffer;
  int32_t tokens;
};

SPECSTATE_HD int32_t PackPending(int32_t record_row, int32_t buffer, int32_t tokens) {
  return ((record_row + 1) << 6) | (buffer << 5) | tokens;
}

SPECSTATE_HD PendingEntry UnpackPending(int32_t packed) {
  return PendingEntry{(packed >> 6) - 1, (packed >> 5) & 1, packed & 31};
}

SPECSTATE_HD int32_t* PendingEntriesOf(const PendingBlocks& p, int layer) {
  return p.entries + static_cast<int64_t>(layer) * p.num_blocks;
}

// header[0]: the records buffer holding the pending tokens; header[1]: the
// number of blocks the last commit left pending; header[2 ...]: those blocks.
SPECSTATE_HD int32_t* PendingBufferWord(const PendingBlocks& p) { return p.header; }
SPECSTATE_HD int32_t* PendingListSize(const PendingBlocks& p) { return p.header + 1; }
SPECSTATE_HD int32_t* PendingList(const PendingBlocks& p) { return p.header + 2; }

// Whether a DEFERRED commit leaves row i's tokens pending on its checkpoint
// block: it commits something, its state stays in the checkpoint's block, and
// it writes no boundary state (align mode: a block handed to the prefix
// cache is always a real state, so those rows are replayed at Commit).
SPECSTATE_HD bool DefersCommit(const CommitPlanRow& p) {
  return CommitsAnything(p) && p.final_block == p.source && !IsBlock(p.boundary_block);
}

// A replay of pending tokens into `block` (a Flush, or what a commit
// materializes because no Verify took it): from `block`'s state, the entry's
// tokens, stored after the last one.
SPECSTATE_HD ReplayJob PendingJob(int layer, int32_t block, const PendingEntry& e, int q) {
  ReplayJob job;
  job.layer = layer;
  job.buffer = e.buffer;
  job.record_row = e.record_row;
  for (int c = 0; c <= kMaxSpecQueryLen; ++c) job.indices[c] = kNullBlock;
  job.indices[q] = block;
  job.indices[e.tokens - 1] = block;
  return job;
}

// The replay of row i of a commit in one layer, as EAGER runs it (its replay
// indices), from the step's records in `buffer`.
SPECSTATE_HD ReplayJob CommitJob(int layer, const CommitPlanRow& p, int i, int32_t buffer,
                                 int q) {
  ReplayJob job;
  job.layer = layer;
  job.buffer = buffer;
  job.record_row = i;
  for (int c = 0; c <= kMaxSpecQueryLen; ++c) job.indices[c] = c <= q ? ReplayIndex(p, q, c) : 0;
  return job;
}

// A block a DEFERRED commit writes (a final or boundary block other than the
// row's checkpoint, which the step's Verify calls materialized) must not
// have tokens pending in any layer: they belong to the state of another
// request (the scheduler reused the block without a Flush).
SPECSTATE_HD RowFault CheckNotPending(const PendingBlocks& p, int32_t block, CheckedField field,
                                      int32_t index, int32_t col) {
  for (int l = 0; l < p.num_layers; ++l) {
    if (PendingEntriesOf(p, l)[block] != 0) {
      return MakeFault(field, CheckProblem::kPendingBlock, index, col, block, l);
    }
  }
  return NoFault();
}

// Row i's faults of a DEFERRED commit: each block it writes, unless that is
// its checkpoint, has nothing pending.
SPECSTATE_HD RowFault CheckDeferredCommitRow(const CommitArgs& a, const CommitPlanRow& p, int i) {
  RowFault fault = NoFault();
  ForEachCommitWrite(a, p, i, [&](int32_t b, CheckedField field, int32_t index, int32_t col) {
    if (fault.problem == 0 && b != p.source) {
      fault = CheckNotPending(a.pending, b, field, index, col);
    }
  });
  return fault;
}

// DEFERRED Verify: row n verifies from `block`, which has pending tokens in
// the layer, and a lower row verifies from it too (the caller names it).
SPECSTATE_HD RowFault PendingSharedFault(int32_t block, int n) {
  return MakeFault(CheckedField::kStateIndices, CheckProblem::kPendingShared, n, -1, block, 0);
}

// Element i of a block list (a Flush's), read once into `checked`: null
// (<= 0) or below the pool's `num_blocks`.
SPECSTATE_HD RowFault CheckListedBlock(const int32_t* blocks, int32_t* checked, int i,
                                       int64_t num_blocks) {
  const int32_t block = blocks[i];
  checked[i] = block;
  return CheckBlock(CheckedField::kBlocks, block, num_blocks, i, -1);
}

// Flush: element i of the block list, read once into the checked copy.
SPECSTATE_HD RowFault CheckFlushBlock(const FlushArgs& a, int i) {
  return CheckListedBlock(a.blocks, a.checked_blocks, i, a.pending.num_blocks);
}

// ---------------------------------------------------------------------------
// FAST commits (kda_args.h, FastRings). The kernels' own memory, written only
// by them in stream order; a fault here means a scheduler's misuse (rows
// sharing a block, a block reused without a Flush) or memory something else
// wrote.

// Two int32 in one int64 of a fault (device_status.h): high, then low.
SPECSTATE_HD int64_t PackPair(int32_t high, int32_t low) {
  return static_cast<int64_t>((static_cast<uint64_t>(static_cast<uint32_t>(high)) << 32) |
                              static_cast<uint64_t>(static_cast<uint32_t>(low)));
}

// `block`'s cursor as Verify and Commit leave it: 0 <= tokens <= capacity and
// 0 <= candidates <= capacity - tokens. `layer`: the layer of a call over
// several (Commit, Flush), -1 for a Verify.
SPECSTATE_HD RowFault CheckFastCursor(const FastRings& r, int32_t block, int layer) {
  const FastCursor c = r.cursors[block];
  if (c.tokens < 0 || c.tokens > r.capacity || c.candidates < 0 ||
      c.candidates > r.capacity - c.tokens) {
    return MakeFault(CheckedField::kRingCursors, CheckProblem::kFastCursor, block, layer,
                     PackPair(c.tokens, c.candidates), r.capacity);
  }
  return NoFault();
}

// FAST Verify, row n (`tokens` tokens verified from `block`): the block's
// cursor, and room in its ring for the window's candidates.
SPECSTATE_HD RowFault CheckFastVerifyRow(const FastRings& r, int n, int32_t block, int tokens) {
  if (!IsBlock(block)) return NoFault();
  const RowFault f = CheckFastCursor(r, block, -1);
  if (f.problem != 0) return f;
  const int32_t held = r.cursors[block].tokens;
  if (held + tokens > r.capacity) {
    return MakeFault(CheckedField::kStateIndices, CheckProblem::kFastRingFull, n, -1,
                     PackPair(block, held), PackPair(tokens, r.capacity));
  }
  return NoFault();
}

// Row n uses (verifies or commits from) `block`, which a lower row uses too
// (the caller names it as the other row).
SPECSTATE_HD RowFault FastSharedFault(int32_t block, int n) {
  return MakeFault(CheckedField::kStateIndices, CheckProblem::kFastShared, n, -1, block, 0);
}

// FAST Commit, row i in layer `layer` (its rings `r`): the checkpoint's
// cursor; the candidates the block's last Verify left cover the row's
// commit_len; and every block the row writes other than its checkpoint holds
// no ring tokens (they would be another request's: the block was reused
// without a Flush).
SPECSTATE_HD RowFault CheckFastCommitRow(const CommitArgs& a, const FastRings& r, int layer,
                                         const CommitPlanRow& p, int i) {
  if (!IsBlock(p.source)) return NoFault();
  const RowFault f = CheckFastCursor(r, p.source, layer);
  if (f.problem != 0 || !CommitsAnything(p)) return f;
  const int32_t candidates = r.cursors[p.source].candidates;
  if (candidates < p.commit_len) {
    return MakeFault(CheckedField::kRingCursors, CheckProblem::kFastCandidates, p.source, layer,
                     p.commit_len, candidates);
  }
  RowFault fault = NoFault();
  ForEachCommitWrite(a, p, i, [&](int32_t b, CheckedField field, int32_t index, int32_t col) {
    if (fault.problem == 0 && b != p.source && r.cursors[b].tokens != 0) {
      fault = MakeFault(field, CheckProblem::kFastRingInUse, index, col, b, layer);
    }
  });
  return fault;
}

// Workspace layout of a commit: the owner table first (its place must not
// depend on the number of rows), then the plan, then the replay indices.
struct CommitWorkspace {
  int32_t* owner;            // [num_blocks]
  CommitPlanRow* plan;       // [rows]
  int32_t* replay_indices;   // [rows, q + 1]
};

SPECSTATE_HD size_t AlignUp(size_t bytes) { return (bytes + 255) & ~size_t{255}; }

SPECSTATE_HD size_t CommitWorkspaceSize(int rows, int q, int64_t num_blocks) {
  return AlignUp(static_cast<size_t>(num_blocks) * sizeof(int32_t)) +
         AlignUp(static_cast<size_t>(rows) * sizeof(CommitPlanRow)) +
         AlignUp(static_cast<size_t>(rows) * (q + 1) * sizeof(int32_t));
}

SPECSTATE_HD CommitWorkspace CommitWorkspaceLayout(void* base, int rows, int64_t num_blocks) {
  char* p = static_cast<char*>(base);
  CommitWorkspace w;
  w.owner = reinterpret_cast<int32_t*>(p);
  p += AlignUp(static_cast<size_t>(num_blocks) * sizeof(int32_t));
  w.plan = reinterpret_cast<CommitPlanRow*>(p);
  p += AlignUp(static_cast<size_t>(rows) * sizeof(CommitPlanRow));
  w.replay_indices = reinterpret_cast<int32_t*>(p);
  return w;
}

}  // namespace internal
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_INTERNAL_CHECKS_H_
