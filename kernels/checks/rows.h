// The device checks every verb shares, on one row (or item) at a time: the
// fault a check reports, a row's token count, a block or row index within
// its bound, an element of a block list read once, and the owner tags of
// the cross-row passes. CPU and CUDA run the same functions, so both accept,
// reject and report exactly alike (docs/semantics.md, "Checks before
// anything is written"); kernels/checks/cpu_checker.h and block_checker.cuh
// run them over a call's rows.
//
//   int tokens = 0;
//   RowFault f = CheckRowTokens(qsl, n, num_rows, q, num_tokens, &tokens);
//   if (f.problem != 0) *status = StatusFromFault(f, n, -1);
#ifndef SPECSTATE_KERNELS_CHECKS_ROWS_H_
#define SPECSTATE_KERNELS_CHECKS_ROWS_H_

#include <math.h>

#include <cstddef>
#include <cstdint>

#include "kernels/device_status.h"
#include "kernels/kda_args.h"
#include "kernels/numeric.h"

namespace specstate {
namespace kernels {
namespace internal {

struct RowFault {
  int32_t field;
  int32_t problem;  // 0: no fault
  int32_t index;
  int32_t col;
  int64_t value;
  int64_t bound;
};

SPECSTATE_HD RowFault NoFault() { return RowFault{0, 0, 0, -1, 0, 0}; }

SPECSTATE_HD RowFault MakeFault(CheckedField field, CheckProblem problem, int32_t index,
                                int32_t col, int64_t value, int64_t bound) {
  return RowFault{
      static_cast<int32_t>(field), static_cast<int32_t>(problem), index, col, value, bound};
}

SPECSTATE_HD bool IsBlock(int32_t block) { return block > kNullBlock; }

SPECSTATE_HD DeviceStatus StatusFromFault(const RowFault& f, int32_t row, int32_t other_row) {
  DeviceStatus s;
  s.failed = f.problem != 0 ? 1 : 0;
  s.field = f.field;
  s.problem = f.problem;
  s.row = row;
  s.index = f.index;
  s.col = f.col;
  s.other_row = other_row;
  s.value = f.value;
  s.bound = f.bound;
  return s;
}

SPECSTATE_HD DeviceStatus OkStatus() {
  DeviceStatus s;
  s.failed = 0;
  s.field = 0;
  s.problem = 0;
  s.row = -1;
  s.index = -1;
  s.col = -1;
  s.other_row = -1;
  s.value = 0;
  s.bound = 0;
  return s;
}

// Row n's token count from query_start_loc, checking the entries it reads:
// qsl[0] == 0 (row 0), non-decreasing, at most `max_tokens` tokens, and the
// last offset within the `num_tokens` tokens of the activations.
SPECSTATE_HD RowFault CheckRowTokens(const int32_t* qsl, int n, int num_rows, int max_tokens,
                                     int64_t num_tokens, int* tokens) {
  *tokens = 0;
  const int64_t begin = qsl[n];
  const int64_t end = qsl[n + 1];
  if (n == 0 && begin != 0) {
    return MakeFault(CheckedField::kQueryStartLoc, CheckProblem::kNonZeroStart, 0, -1, begin, 0);
  }
  if (end < begin) {
    return MakeFault(CheckedField::kQueryStartLoc, CheckProblem::kDecreasing, n + 1, -1, end,
                     begin);
  }
  if (end - begin > max_tokens) {
    return MakeFault(CheckedField::kQueryStartLoc, CheckProblem::kTooManyTokens, n + 1, -1,
                     end - begin, max_tokens);
  }
  if (n == num_rows - 1 && end > num_tokens) {
    return MakeFault(CheckedField::kQueryStartLoc, CheckProblem::kPastLastToken, n + 1, -1, end,
                     num_tokens);
  }
  *tokens = static_cast<int>(end - begin);
  return NoFault();
}

// A block index the call will use: null (<= 0) or below the pool's size.
SPECSTATE_HD RowFault CheckBlock(CheckedField field, int32_t block, int64_t num_blocks,
                                 int32_t index, int32_t col) {
  if (block >= num_blocks) {
    return MakeFault(field, CheckProblem::kIndexTooLarge, index, col, block, num_blocks);
  }
  return NoFault();
}

// An index into a tensor of `bound` rows.
SPECSTATE_HD RowFault CheckRowIndex(CheckedField field, int32_t value, int64_t bound,
                                    int32_t index) {
  if (value < 0) return MakeFault(field, CheckProblem::kNegative, index, -1, value, bound);
  if (value >= bound) {
    return MakeFault(field, CheckProblem::kIndexTooLarge, index, -1, value, bound);
  }
  return NoFault();
}

SPECSTATE_HD int64_t MinI64(int64_t a, int64_t b) { return a < b ? a : b; }
SPECSTATE_HD int64_t MaxI64(int64_t a, int64_t b) { return a > b ? a : b; }

SPECSTATE_HD size_t AlignUp(size_t bytes) { return (bytes + 255) & ~size_t{255}; }

// Element i of a block list (a Flush's), read once into `checked`: null
// (<= 0) or below the pool's `num_blocks`.
SPECSTATE_HD RowFault CheckListedBlock(const int32_t* blocks, int32_t* checked, int i,
                                       int64_t num_blocks) {
  const int32_t block = blocks[i];
  checked[i] = block;
  return CheckBlock(CheckedField::kBlocks, block, num_blocks, i, -1);
}

// Two int32 in one int64 of a fault (device_status.h): high, then low.
SPECSTATE_HD int64_t PackPair(int32_t high, int32_t low) {
  return static_cast<int64_t>((static_cast<uint64_t>(static_cast<uint32_t>(high)) << 32) |
                              static_cast<uint64_t>(static_cast<uint32_t>(low)));
}

// Cross-row passes. `owner` has one int32 per block (or request row), zero
// outside a call. Writers claim their blocks with a max of (INT32_MAX - row),
// so after the claims each block names its lowest writer whatever the order
// of the claims; every other writer, and every row reading the block, then
// reports a conflict with that lowest writer.
SPECSTATE_HD int32_t OwnerTag(int row) { return INT32_MAX - row; }
SPECSTATE_HD int32_t OwnerRow(int32_t tag) { return INT32_MAX - tag; }

}  // namespace internal
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_CHECKS_ROWS_H_
