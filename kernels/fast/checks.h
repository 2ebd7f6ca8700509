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

}  // namespace fast
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_FAST_CHECKS_H_
