// Commit mode FAST's device checks (kda_args.h, FastRings), shared by the
// kernel interface's CPU and CUDA backends and kernels/fast's direct calls.
// The rings are the kernels' own memory, written only by them in stream
// order; a fault here means a scheduler's misuse (rows sharing a block, a
// block reused without a Flush) or memory something else wrote.
#ifndef SPECSTATE_KERNELS_FAST_CHECKS_H_
#define SPECSTATE_KERNELS_FAST_CHECKS_H_

#include <cstdint>

#include "kernels/checks/commit_plan.h"
#include "kernels/checks/rows.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace fast {

// `block`'s cursor as Verify and Commit leave it: 0 <= tokens <= capacity and
// 0 <= candidates <= capacity - tokens. `layer`: the layer of a call over
// several (Commit, Flush), -1 for a Verify.
SPECSTATE_HD internal::RowFault CheckFastCursor(const FastRings& r, int32_t block, int layer) {
  const FastCursor c = r.cursors[block];
  if (c.tokens < 0 || c.tokens > r.capacity || c.candidates < 0 ||
      c.candidates > r.capacity - c.tokens) {
    return internal::MakeFault(CheckedField::kRingCursors, CheckProblem::kFastCursor, block, layer,
                               internal::PackPair(c.tokens, c.candidates), r.capacity);
  }
  return internal::NoFault();
}

// FAST Verify, row n (`tokens` tokens verified from `block`): the block's
// cursor, and room in its ring for the window's candidates.
SPECSTATE_HD internal::RowFault CheckFastVerifyRow(const FastRings& r, int n, int32_t block,
                                                   int tokens) {
  if (!internal::IsBlock(block)) return internal::NoFault();
  const internal::RowFault f = CheckFastCursor(r, block, -1);
  if (f.problem != 0) return f;
  const int32_t held = r.cursors[block].tokens;
  if (held + tokens > r.capacity) {
    return internal::MakeFault(CheckedField::kStateIndices, CheckProblem::kFastRingFull, n, -1,
                               internal::PackPair(block, held),
                               internal::PackPair(tokens, r.capacity));
  }
  return internal::NoFault();
}

// Row n uses (verifies or commits from) `block`, which a lower row uses too
// (the caller names it as the other row).
SPECSTATE_HD internal::RowFault FastSharedFault(int32_t block, int n) {
  return internal::MakeFault(CheckedField::kStateIndices, CheckProblem::kFastShared, n, -1, block,
                             0);
}

// FAST Commit, row i in layer `layer` (its rings `r`): the checkpoint's
// cursor; the candidates the block's last Verify left cover the row's
// commit_len; and every block the row writes other than its checkpoint holds
// no ring tokens (they would be another request's: the block was reused
// without a Flush).
SPECSTATE_HD internal::RowFault CheckFastCommitRow(const CommitArgs& a, const FastRings& r,
                                                   int layer, const CommitPlanRow& p, int i) {
  if (!internal::IsBlock(p.source)) return internal::NoFault();
  const internal::RowFault f = CheckFastCursor(r, p.source, layer);
  if (f.problem != 0 || !internal::CommitsAnything(p)) return f;
  const int32_t candidates = r.cursors[p.source].candidates;
  if (candidates < p.commit_len) {
    return internal::MakeFault(CheckedField::kRingCursors, CheckProblem::kFastCandidates, p.source,
                               layer, p.commit_len, candidates);
  }
  internal::RowFault fault = internal::NoFault();
  internal::ForEachCommitWrite(
      a, p, i, [&](int32_t b, CheckedField field, int32_t index, int32_t col) {
        if (fault.problem == 0 && b != p.source && r.cursors[b].tokens != 0) {
          fault = internal::MakeFault(field, CheckProblem::kFastRingInUse, index, col, b, layer);
        }
      });
  return fault;
}

// FAST's own Verify checks, after the ones every Verify runs (the kernel
// interface's) or the rows' (the direct call's), on a backend's `Checker`
// (checks/cpu_checker.h, checks/block_checker.cuh): each row's block has a
// cursor a Commit leaves and room in its ring for the window of
// tokens_of(n) tokens, and no two rows verify from one block (their
// candidates would share its ring's slots). `owner`: a zeroed table of one
// int32 a block. Writes `status` when one fails.
template <typename Checker, typename BlockOf, typename TokensOf>
SPECSTATE_HD bool CheckFastVerify(const FastRings& rings, int num_rows, int32_t* owner,
                                  DeviceStatus* status, BlockOf block_of, TokensOf tokens_of) {
  if (!Checker::Rows(num_rows, status, [&](int n) {
        return CheckFastVerifyRow(rings, n, block_of(n), tokens_of(n));
      })) {
    return false;
  }
  return Checker::OneUserABlock(
      num_rows, owner, status, block_of, [](int32_t) { return true; },
      [](int32_t b, int n) { return FastSharedFault(b, n); });
}

// FAST's own Commit checks, after internal::CheckCommitPlan's (the plan in
// `ws`): every layer's cursors and candidates and each written block's ring
// empty (an item a row and layer, rings_of(l) the layer's rings), then one
// row a checkpoint block. Writes a.status when one fails.
template <typename Checker, typename RingsOf>
SPECSTATE_HD bool CheckFastCommit(const CommitArgs& a, const internal::CommitWorkspace& ws,
                                  int num_layers, RingsOf rings_of) {
  if (!Checker::Items(
          a.num_rows * num_layers, a.status,
          [&](int x) {
            const int i = x / num_layers, l = x % num_layers;
            return CheckFastCommitRow(a, rings_of(l), l, ws.plan[i], i);
          },
          [&](int x) { return x / num_layers; })) {
    return false;
  }
  return Checker::OneUserABlock(
      a.num_rows, ws.owner, a.status, [&](int i) { return ws.plan[i].source; },
      [](int32_t) { return true; }, [](int32_t b, int n) { return FastSharedFault(b, n); });
}

}  // namespace fast
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_FAST_CHECKS_H_
