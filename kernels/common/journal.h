// The commit journal's writes (kda_args.h, CommitJournal), shared by the CPU
// and CUDA backends and by every commit mode, so all keep the same
// bookkeeping: the plan lists each row's blocks and marks the record
// started, the commit's last step records the listed blocks and marks it
// committed. And the start and end of a PendingJournalRecord, which
// DEFERRED's pending journal and FAST's fold journal share.
#ifndef SPECSTATE_KERNELS_COMMON_JOURNAL_H_
#define SPECSTATE_KERNELS_COMMON_JOURNAL_H_

#include <cstdint>

#include "kernels/checks/commit_plan.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace internal {

// Orders the journal's writes: everything before it lands before anything
// after it (for another thread, and for whoever reads the memory after this
// process died).
SPECSTATE_HD void JournalFence() {
#ifdef __CUDA_ARCH__
  __threadfence();
#else
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

SPECSTATE_HD void JournalStoreState(JournalRecord* r, uint32_t state) {
  *reinterpret_cast<volatile uint32_t*>(&r->state) = state;
}

SPECSTATE_HD uint32_t JournalLoadState(const JournalRecord* r) {
  return *reinterpret_cast<const volatile uint32_t*>(&r->state);
}

// A PendingJournalRecord (DEFERRED's pending journal, FAST's fold journal),
// once its call listed `count` blocks (at most `capacity` kept), before the
// call's first write (one thread): what the call is, then "started".
SPECSTATE_HD void PendingRecordMarkStarted(PendingJournalRecord* r, uint32_t kind, int count,
                                           int capacity, int32_t layer, uint64_t step) {
  r->kind = kind;
  r->count = count < capacity ? count : capacity;
  r->layer = layer;
  r->step = step;
  JournalFence();
  *reinterpret_cast<volatile uint32_t*>(&r->state) = kJournalStarted;
  JournalFence();
}

// After the call's last write (one thread): nothing is half-done.
SPECSTATE_HD void PendingRecordMarkIdle(PendingJournalRecord* r) {
  JournalFence();
  *reinterpret_cast<volatile uint32_t*>(&r->state) = kJournalIdle;
  JournalFence();
}

// Row i's entries: the blocks its commit writes (ForEachCommitWrite: the
// final block, and in align mode a boundary block that differs from it).
SPECSTATE_HD void JournalListRow(const CommitArgs& a, const CommitPlanRow& p, int i) {
  int32_t* e = a.journal.entries + 2 * int64_t{i};
  e[0] = kNullBlock;
  e[1] = kNullBlock;
  int k = 0;
  ForEachCommitWrite(a, p, i, [&](int32_t block, CheckedField, int32_t, int32_t) {
    if (k < 2) e[k++] = block;
  });
}

// Once every row is listed (one thread): the step, then "started".
SPECSTATE_HD void JournalMarkStarted(const CommitJournal& j, int num_rows) {
  j.record->num_rows = num_rows;
  j.record->step = j.step;
  JournalFence();
  JournalStoreState(j.record, kJournalStarted);
  JournalFence();
}

// Whether the record holds this commit, started and not yet committed.
SPECSTATE_HD bool JournalOpenFor(const CommitJournal& j) {
  return JournalLoadState(j.record) == kJournalStarted && j.record->step == j.step;
}

// The rows the record lists, within the entries' capacity.
SPECSTATE_HD int JournalRows(const CommitJournal& j) {
  const int32_t rows = j.record->num_rows;
  return rows < 0 ? 0 : (rows > j.capacity_rows ? j.capacity_rows : rows);
}

// After the commit's last write: entry `e`'s block now holds step `step`
// (commit number `sequence`), and is no longer lost.
SPECSTATE_HD void JournalRecordEntry(const CommitJournal& j, int64_t num_blocks, int e,
                                     uint64_t step, uint64_t sequence) {
  const int32_t block = j.entries[e];
  if (block <= kNullBlock || block >= num_blocks) return;
  BlockRecord& b = j.blocks[block];
  b.step = step;
  b.sequence = sequence;
  b.lost = 0;
}

// Then (one thread): the record says committed.
SPECSTATE_HD void JournalMarkCommitted(const CommitJournal& j, uint64_t sequence) {
  JournalFence();
  j.record->last_committed_step = j.record->step;
  j.record->commits = sequence;
  JournalFence();
  JournalStoreState(j.record, kJournalCommitted);
  JournalFence();
}

}  // namespace internal
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_COMMON_JOURNAL_H_
