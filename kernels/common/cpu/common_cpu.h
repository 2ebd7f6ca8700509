// What every commit mode shares on the CPU backend: the verbs that have no
// mode (the stock kernel, RecordStateBlocks, LoadParams), Verify's checks,
// and the commit's plan, conv compaction and journal. Each writes its
// call's DeviceStatus (and mirror) as the CUDA backend's kernels do; the
// arguments must have passed the host checks (kda_kernels.h, Validate*).
//
//   std::vector<internal::VerifyRow> rows;
//   if (common::VerifyChecksCpu(args, &rows)) { /* the mode's checks, then its work */ }
#ifndef SPECSTATE_KERNELS_COMMON_CPU_COMMON_CPU_H_
#define SPECSTATE_KERNELS_COMMON_CPU_COMMON_CPU_H_

#include <vector>

#include "kernels/checks/commit_plan.h"
#include "kernels/checks/verify_rows.h"
#include "kernels/common/journal.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace common {

// The verbs without a mode, whole (checks, work, status mirror).
void StockCpu(const StockArgs& args);
void RecordStateBlocksCpu(const RecordStateBlocksArgs& args);
void LoadParamsCpu(const LoadParamsArgs& args);

// Verify's checks, every mode's: the prerequisites, each row's indices read
// once into the snapshot (or against the expected values), the inputs not
// faulted, each row's window and block. `rows` gets each row's tokens and
// checkpoint block (from the snapshot). False (with args.status written)
// when one failed.
bool VerifyChecksCpu(const VerifyArgs& args, std::vector<internal::VerifyRow>* rows);

// The commit's plan into its workspace after internal::CheckCommitPlan's
// checks (`ws` gets the workspace's layout). False (with args.status
// written) when one failed.
bool PlanCommitCpu(const CommitArgs& args, internal::CommitWorkspace* ws);

// Commit step 2 for every layer and row along `plan`: the conv windows
// compacted. Then the journal's test hook "conv".
void CompactConvCpu(const CommitArgs& args, const CommitPlanRow* plan);

// The commit journal (args.journal.record set), before the commit's first
// write: each row's blocks listed (ListCommitJournalCpu), then, after what
// the mode lists besides, the record marked started and the test hook
// "started" (MarkCommitJournalStartedCpu).
void ListCommitJournalCpu(const CommitArgs& args, const CommitPlanRow* plan);
void MarkCommitJournalStartedCpu(const CommitArgs& args);

// After the commit's last write, when the record holds this commit (its
// checks passed): the test hook "replayed", before_records() (DEFERRED:
// its pending journal closed), each listed block's record, then
// "committed".
template <typename BeforeRecords>
void FinishCommitJournalCpu(const CommitArgs& a, BeforeRecords before_records) {
  const CommitJournal& j = a.journal;
  if (!internal::JournalOpenFor(j)) return;  // its checks failed
  if (j.test_hook != nullptr) j.test_hook("replayed");
  before_records();
  const uint64_t sequence = j.record->commits + 1;
  const int64_t num_blocks = a.layers[0].state.num_blocks;
  const int rows = internal::JournalRows(j);
  for (int e = 0; e < 2 * rows; ++e) {
    internal::JournalRecordEntry(j, num_blocks, e, j.step, sequence);
  }
  internal::JournalMarkCommitted(j, sequence);
}

}  // namespace common
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_COMMON_CPU_COMMON_CPU_H_
