// Commit mode DEFERRED's bookkeeping (kda_args.h, PendingBlocks) and its
// device checks, shared by its CPU and CUDA kernels: a pending entry packed
// in an int32, the table's header, which rows a commit defers, the replays
// a commit or Flush lists, and the faults of its misuse (a block reused with
// tokens pending, rows sharing a pending block).
#ifndef SPECSTATE_KERNELS_DEFERRED_PENDING_H_
#define SPECSTATE_KERNELS_DEFERRED_PENDING_H_

#include <cstdint>

#include "kernels/checks/commit_plan.h"
#include "kernels/checks/rows.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace deferred {

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
  return internal::CommitsAnything(p) && p.final_block == p.source &&
         !internal::IsBlock(p.boundary_block);
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
SPECSTATE_HD ReplayJob CommitJob(int layer, const CommitPlanRow& p, int i, int32_t buffer, int q) {
  ReplayJob job;
  job.layer = layer;
  job.buffer = buffer;
  job.record_row = i;
  for (int c = 0; c <= kMaxSpecQueryLen; ++c)
    job.indices[c] = c <= q ? internal::ReplayIndex(p, q, c) : 0;
  return job;
}

// A block a DEFERRED commit writes (a final or boundary block other than the
// row's checkpoint, which the step's Verify calls materialized) must not
// have tokens pending in any layer: they belong to the state of another
// request (the scheduler reused the block without a Flush).
SPECSTATE_HD internal::RowFault CheckNotPending(const PendingBlocks& p, int32_t block,
                                                CheckedField field, int32_t index, int32_t col) {
  for (int l = 0; l < p.num_layers; ++l) {
    if (PendingEntriesOf(p, l)[block] != 0) {
      return internal::MakeFault(field, CheckProblem::kPendingBlock, index, col, block, l);
    }
  }
  return internal::NoFault();
}

// Row i's faults of a DEFERRED commit: each block it writes, unless that is
// its checkpoint, has nothing pending.
SPECSTATE_HD internal::RowFault CheckDeferredCommitRow(const CommitArgs& a, const CommitPlanRow& p,
                                                       int i) {
  internal::RowFault fault = internal::NoFault();
  internal::ForEachCommitWrite(a, p, i,
                               [&](int32_t b, CheckedField field, int32_t index, int32_t col) {
                                 if (fault.problem == 0 && b != p.source) {
                                   fault = CheckNotPending(a.pending, b, field, index, col);
                                 }
                               });
  return fault;
}

// DEFERRED Verify: row n verifies from `block`, which has pending tokens in
// the layer, and a lower row verifies from it too (the caller names it).
SPECSTATE_HD internal::RowFault PendingSharedFault(int32_t block, int n) {
  return internal::MakeFault(CheckedField::kStateIndices, CheckProblem::kPendingShared, n, -1,
                             block, 0);
}

// Flush: element i of the block list, read once into the checked copy.
SPECSTATE_HD internal::RowFault CheckFlushBlock(const FlushArgs& a, int i) {
  return internal::CheckListedBlock(a.blocks, a.checked_blocks, i, a.pending.num_blocks);
}

}  // namespace deferred
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_DEFERRED_PENDING_H_
