// The sizes of the kernels' scratch and bookkeeping (declared in
// kda_args.h), from the layouts the checks use (kernels/checks/): in a
// library of their own, below every commit mode's, which size their own.
#include <cstddef>
#include <cstdint>

#include "kernels/checks/commit_plan.h"
#include "kernels/checks/record_rows.h"
#include "kernels/checks/rows.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {

size_t StockWorkspaceBytes(int64_t num_blocks) {
  return internal::AlignUp(static_cast<size_t>(num_blocks) * sizeof(int32_t));
}

size_t CommitWorkspaceBytes(int max_rows, int spec_query_len, int64_t num_blocks) {
  return internal::CommitWorkspaceSize(max_rows, spec_query_len, num_blocks);
}

const CommitPlanRow* CommitPlanOf(const void* workspace, int64_t num_blocks) {
  return internal::CommitWorkspaceLayout(const_cast<void*>(workspace), 0, num_blocks).plan;
}

size_t RecordStateBlocksWorkspaceBytes(int max_rows) {
  return internal::AlignUp(256 + static_cast<size_t>(max_rows) * 16);
}

size_t VerifyWorkspaceBytes(int64_t num_blocks) {
  return internal::AlignUp(static_cast<size_t>(num_blocks) * sizeof(int32_t));
}

size_t PendingHeaderBytes(int capacity) {
  return internal::AlignUp((2 + static_cast<size_t>(capacity)) * sizeof(int32_t));
}

size_t PendingEntriesBytes(int num_layers, int64_t num_blocks) {
  return internal::AlignUp(static_cast<size_t>(num_layers) * num_blocks * sizeof(int32_t));
}

size_t PendingJournalCapacity(int capacity, int64_t num_blocks) {
  return 3 * static_cast<size_t>(capacity) + static_cast<size_t>(num_blocks);
}

// Every row of a commit replayed now (align mode), and every block the
// previous commit left pending, in every layer.
size_t CommitJobsCapacity(int max_rows, int num_layers) {
  return 2 * static_cast<size_t>(max_rows) * num_layers;
}

// Only blocks the last commit left pending (at most its rows) have entries.
size_t FlushJobsCapacity(int max_rows, int num_layers) {
  return static_cast<size_t>(max_rows) * num_layers;
}

}  // namespace kernels
}  // namespace specstate
