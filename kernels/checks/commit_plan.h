// The commit plan (docs/semantics.md, Commit step 1) and the checks every
// commit mode runs before its own, in one order for both backends
// (CheckCommitPlan): the prerequisites, each row's plan (each of the
// caller's values read once), the inputs not faulted, the lowest failing
// row, the cross-row pass. A mode's own checks follow (kernels/deferred,
// kernels/fast).
#ifndef SPECSTATE_KERNELS_CHECKS_COMMIT_PLAN_H_
#define SPECSTATE_KERNELS_CHECKS_COMMIT_PLAN_H_

#include <cstddef>
#include <cstdint>

#include "kernels/checks/prerequisites.h"
#include "kernels/checks/rows.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace internal {

// Whether the row changes anything: conv compaction and replay both need a
// real source, a token to commit and a real final block.
SPECSTATE_HD bool CommitsAnything(const CommitPlanRow& p) {
  return IsBlock(p.source) && p.commit_len > 0 && IsBlock(p.final_block);
}

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
  const int32_t commit_len = static_cast<int32_t>(MinI64(MinI64(MaxI64(accepted, 0), tokens), q));
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

// The blocks each row of a commit writes and reads, for the cross-row pass:
// fn(block, field, index, col) for every block, naming where it came from.
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

// Tokens the replay runs for one row of replay indices: up to the last
// column it stores (later tokens cannot change a stored state).
SPECSTATE_HD int ReplayTokens(const int32_t* replay_row, int q) {
  if (!IsBlock(replay_row[q])) return 0;
  for (int t = q - 1; t >= 0; --t) {
    if (IsBlock(replay_row[t])) return t + 1;
  }
  return 0;
}

// Workspace layout of a commit: the owner table first (its place must not
// depend on the number of rows), then the plan, then the replay indices.
struct CommitWorkspace {
  int32_t* owner;           // [num_blocks]
  CommitPlanRow* plan;      // [rows]
  int32_t* replay_indices;  // [rows, q + 1]
};

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

// The checks every commit runs first, whatever its mode, in this order on
// any backend: the prerequisites; each row's plan into `ws.plan` (each of
// the caller's values read once) and, on the CPU, whether reading them
// faulted; the lowest failing row; the cross-row pass (no block written by
// two rows, none written by one and read by another). `Checker` runs them
// on its backend (checks/cpu_checker.h, checks/block_checker.cuh: one
// thread, or every thread of one block). Writes a.status (OK first);
// returns whether all passed. A mode's own checks follow.
template <typename Checker>
SPECSTATE_HD bool CheckCommitPlan(const CommitArgs& a, const CommitWorkspace& ws,
                                  int64_t num_blocks) {
  Checker::Start(a.status);
  if (!Checker::Prerequisites(a.prerequisites, a.status)) return false;
  if (!Checker::LoadedRows(a.num_rows, a.prerequisites.input_fault, a.status,
                           [&](int i) { return PlanCommitRow(a, num_blocks, i, &ws.plan[i]); })) {
    return false;
  }
  return Checker::CrossRow(
      a.num_rows, ws.owner, a.status,
      [&](int i, auto fn) { ForEachCommitWrite(a, ws.plan[i], i, fn); },
      [&](int i, auto fn) { ForEachCommitRead(ws.plan[i], i, fn); });
}

}  // namespace internal
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_CHECKS_COMMIT_PLAN_H_
