// RecordStateBlocks' row checks, its workspace and the request rows each
// row writes (for the cross-row pass).
#ifndef SPECSTATE_KERNELS_CHECKS_RECORD_ROWS_H_
#define SPECSTATE_KERNELS_CHECKS_RECORD_ROWS_H_

#include <cstddef>
#include <cstdint>

#include "kernels/checks/rows.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace internal {

// What the checks read of spec row i, kept (service memory) for the
// cross-row pass and the writes, which read nothing of the caller's again.
struct RecordRow {
  int32_t batch_row;
  int32_t request_row;   // < 0: skipped
  int32_t state_column;  // what state_idx[request_row] gets
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

template <typename Fn>
SPECSTATE_HD void ForEachRecordWrite(const RecordRow& row, Fn fn) {
  if (row.request_row >= 0) fn(row.request_row, CheckedField::kIdxMapping, row.batch_row, -1);
}

}  // namespace internal
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_CHECKS_RECORD_ROWS_H_
