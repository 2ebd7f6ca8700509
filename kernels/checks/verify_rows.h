// Verify's row checks, every commit mode's, in two phases. The first loads
// each of the caller's index values once and copies it to the snapshot (or
// compares it with the step's first call's); the second checks the
// snapshot, which the caller cannot write. The kernels then read the
// snapshot too (VerifiedQueryStartLoc() and VerifiedStateIndices()).
#ifndef SPECSTATE_KERNELS_CHECKS_VERIFY_ROWS_H_
#define SPECSTATE_KERNELS_CHECKS_VERIFY_ROWS_H_

#include <cstdint>

#include "kernels/checks/rows.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace internal {

struct VerifyRowLoads {
  int32_t start;   // query_start_loc[0] (row 0 only)
  int32_t end;     // query_start_loc[n + 1]
  int32_t source;  // state_indices[n, 0]
};

SPECSTATE_HD VerifyRowLoads LoadVerifyRow(const VerifyArgs& a, int n) {
  VerifyRowLoads in;
  in.start = n == 0 ? a.query_start_loc[0] : 0;
  in.end = a.query_start_loc[n + 1];
  in.source = a.state_indices.data[n * a.state_indices.row_stride];
  return in;
}

SPECSTATE_HD const int32_t* VerifiedQueryStartLoc(const VerifyArgs& a) {
  return a.expected_query_start_loc != nullptr ? a.expected_query_start_loc
                                               : a.snapshot_query_start_loc;
}
SPECSTATE_HD const int32_t* VerifiedStateIndices(const VerifyArgs& a) {
  return a.expected_state_indices != nullptr ? a.expected_state_indices : a.snapshot_state_indices;
}

// Phase one for row n: its loads into the snapshot, or against the expected
// values (a mismatch is the row's fault).
SPECSTATE_HD RowFault SnapshotVerifyRow(const VerifyArgs& a, int n, const VerifyRowLoads& in) {
  const int32_t* const expected_qsl = a.expected_query_start_loc;
  if (expected_qsl == nullptr) {
    if (n == 0) a.snapshot_query_start_loc[0] = in.start;
    a.snapshot_query_start_loc[n + 1] = in.end;
    a.snapshot_state_indices[n] = in.source;
    return NoFault();
  }
  const int32_t expected_start = n == 0 ? expected_qsl[0] : 0;
  const int32_t expected_end = expected_qsl[n + 1];
  const int32_t expected_source = a.expected_state_indices[n];
  if (n == 0 && in.start != expected_start) {
    return MakeFault(CheckedField::kQueryStartLoc, CheckProblem::kMismatch, 0, -1, in.start,
                     expected_start);
  }
  if (in.end != expected_end) {
    return MakeFault(CheckedField::kQueryStartLoc, CheckProblem::kMismatch, n + 1, -1, in.end,
                     expected_end);
  }
  if (in.source != expected_source) {
    return MakeFault(CheckedField::kStateIndices, CheckProblem::kMismatch, n, -1, in.source,
                     expected_source);
  }
  return NoFault();
}

struct VerifyRow {
  int tokens;
  int32_t source;
};

// Phase two for row n, on the snapshot only.
SPECSTATE_HD RowFault CheckVerifyRow(const VerifyArgs& a, int n, VerifyRow* row) {
  row->tokens = 0;
  row->source = kNullBlock;
  const int32_t source = VerifiedStateIndices(a)[n];
  int tokens = 0;
  RowFault f =
      CheckRowTokens(VerifiedQueryStartLoc(a), n, a.num_rows, a.records.q, a.num_tokens, &tokens);
  if (f.problem != 0) return f;
  f = CheckBlock(CheckedField::kStateIndices, source, a.state.num_blocks, n, -1);
  if (f.problem != 0) return f;
  row->tokens = tokens;
  row->source = source;
  return NoFault();
}

}  // namespace internal
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_CHECKS_VERIFY_ROWS_H_
