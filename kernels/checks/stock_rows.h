// The stock kernel's row checks and the blocks each row writes and reads
// (for the cross-row pass).
#ifndef SPECSTATE_KERNELS_CHECKS_STOCK_ROWS_H_
#define SPECSTATE_KERNELS_CHECKS_STOCK_ROWS_H_

#include <cstdint>

#include "kernels/checks/rows.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace internal {

struct StockRow {
  int tokens;
  int first_col;   // column holding the initial state
  int32_t source;  // initial block; the row is idle unless IsBlock(source)
};

// A stock row runs at most one token per column of ssm_state_indices, and at
// most kMaxSpecQueryLen (the kernels stage a row's tokens in shared memory).
SPECSTATE_HD int StockMaxTokens(int cols) {
  return cols < kMaxSpecQueryLen ? cols : kMaxSpecQueryLen;
}

SPECSTATE_HD RowFault CheckStockRow(const StockArgs& a, int n, StockRow* row) {
  row->tokens = 0;
  row->first_col = 0;
  row->source = kNullBlock;
  const int cols = a.ssm_state_indices.cols;
  int tokens = 0;
  RowFault f =
      CheckRowTokens(a.query_start_loc, n, a.num_rows, StockMaxTokens(cols), a.num_tokens, &tokens);
  if (f.problem != 0 || tokens == 0) return f;
  int first_col = 0;
  if (a.num_accepted_tokens != nullptr) {
    const int32_t accepted = a.num_accepted_tokens[n];
    if (accepted < 1 || accepted > cols) {
      return MakeFault(CheckedField::kNumAcceptedTokens, CheckProblem::kNumAcceptedRange, n, -1,
                       accepted, cols);
    }
    first_col = accepted - 1;
  }
  const int32_t* idx = a.ssm_state_indices.data + n * a.ssm_state_indices.row_stride;
  const int32_t source = idx[first_col];
  f = CheckBlock(CheckedField::kStateIndices, source, a.state.num_blocks, n, first_col);
  if (f.problem != 0 || !IsBlock(source)) return f;
  for (int t = 0; t < tokens; ++t) {
    f = CheckBlock(CheckedField::kStateIndices, idx[t], a.state.num_blocks, n, t);
    if (f.problem != 0) return f;
  }
  row->tokens = tokens;
  row->first_col = first_col;
  row->source = source;
  return NoFault();
}

// The blocks each row writes and reads, for the cross-row pass:
// fn(block, field, index, col) for every block, naming where it came from.
template <typename Fn>
SPECSTATE_HD void ForEachStockWrite(const StockArgs& a, const StockRow& row, int n, Fn fn) {
  if (!IsBlock(row.source)) return;
  const int32_t* idx = a.ssm_state_indices.data + n * a.ssm_state_indices.row_stride;
  for (int t = 0; t < row.tokens; ++t) {
    if (IsBlock(idx[t])) fn(idx[t], CheckedField::kStateIndices, n, t);
  }
}

template <typename Fn>
SPECSTATE_HD void ForEachStockRead(const StockRow& row, int n, Fn fn) {
  if (IsBlock(row.source)) fn(row.source, CheckedField::kStateIndices, n, row.first_col);
}

}  // namespace internal
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_CHECKS_STOCK_ROWS_H_
