// Commit mode DEFERRED's pending journal (kda_args.h, PendingBlocks::journal),
// shared by its CPU and CUDA kernels: a call that changes the pending table
// or materializes pending tokens lists its blocks and marks the record
// started before its first such write, and marks it idle after its last.
#ifndef SPECSTATE_KERNELS_DEFERRED_PENDING_JOURNAL_H_
#define SPECSTATE_KERNELS_DEFERRED_PENDING_JOURNAL_H_

#include <cstdint>

#include "kernels/common/journal.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace deferred {

// Listing: entry `index` is `block` (indices past the capacity are dropped;
// the host checks the capacity covers every call).
SPECSTATE_HD void PendingJournalList(const PendingBlocks& p, int index, int32_t block) {
  if (index >= 0 && index < p.journal_capacity) p.journal_blocks[index] = block;
}

// Once the call's blocks are listed (one thread), before its first write to
// the table or the pool.
SPECSTATE_HD void PendingJournalMarkStarted(const PendingBlocks& p, uint32_t kind, int count,
                                            int32_t layer, uint64_t step) {
  internal::PendingRecordMarkStarted(p.journal, kind, count, p.journal_capacity, layer, step);
}

// After the call's last write (one thread): nothing is half-done.
SPECSTATE_HD void PendingJournalMarkDone(const PendingBlocks& p) {
  internal::PendingRecordMarkIdle(p.journal);
}

}  // namespace deferred
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_DEFERRED_PENDING_JOURNAL_H_
