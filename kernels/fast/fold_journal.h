// FAST's fold journal (kda_args.h, FoldJournal), shared by its CPU and CUDA
// Flush: the blocks listed and the record marked started before the first
// write to a checkpoint or a ring, idle after the last.
#ifndef SPECSTATE_KERNELS_FAST_FOLD_JOURNAL_H_
#define SPECSTATE_KERNELS_FAST_FOLD_JOURNAL_H_

#include <cstdint>

#include "kernels/common/journal.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace fast {

// Listing: entry `index` is `block` (indices past the capacity are dropped;
// the host checks the capacity covers the pool's blocks).
SPECSTATE_HD void FoldJournalList(const FoldJournal& j, int index, int32_t block) {
  if (index >= 0 && index < j.capacity) j.blocks[index] = block;
}

// Once the blocks are listed (one thread), before the first write.
SPECSTATE_HD void FoldJournalMarkStarted(const FoldJournal& j, bool discard, int count,
                                         int32_t layer) {
  internal::PendingRecordMarkStarted(j.record, discard ? kPendingDiscard : kPendingFlush, count,
                                     j.capacity, layer, /*step=*/0);
}

// After the last write (one thread): nothing is half-folded.
SPECSTATE_HD void FoldJournalMarkDone(const FoldJournal& j) {
  internal::PendingRecordMarkIdle(j.record);
}

}  // namespace fast
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_FAST_FOLD_JOURNAL_H_
