#include "kernels/device_status.h"

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace specstate {
namespace kernels {

absl::string_view CheckedFieldName(CheckedField field) {
  switch (field) {
    case CheckedField::kNone:
      return "none";
    case CheckedField::kQueryStartLoc:
      return "query_start_loc";
    case CheckedField::kStateIndices:
      return "state_indices";
    case CheckedField::kNumAcceptedTokens:
      return "num_accepted_tokens";
    case CheckedField::kNumAccepted:
      return "num_accepted";
    case CheckedField::kRequestIndices:
      return "request_indices";
    case CheckedField::kBlockTable:
      return "block_table";
    case CheckedField::kNumComputedTokens:
      return "num_computed_tokens";
    case CheckedField::kIdxMapping:
      return "idx_mapping";
    case CheckedField::kPrerequisites:
      return "prerequisites";
    case CheckedField::kALog:
      return "a_log";
    case CheckedField::kDtBias:
      return "dt_bias";
    case CheckedField::kInputs:
      return "inputs";
    case CheckedField::kBlocks:
      return "blocks";
    case CheckedField::kRingCursors:
      return "rings.cursors";
  }
  return "unknown";
}

namespace {

std::string Element(const DeviceStatus& s) {
  const std::string name(CheckedFieldName(static_cast<CheckedField>(s.field)));
  if (s.col >= 0) return absl::StrCat(name, "[", s.index, ", ", s.col, "]");
  return absl::StrCat(name, "[", s.index, "]");
}

// The two numbers packed into one int64 of a FAST fault (internal::PackPair).
int32_t High(int64_t packed) { return static_cast<int32_t>(packed >> 32); }
int32_t Low(int64_t packed) { return static_cast<int32_t>(static_cast<uint32_t>(packed)); }

// " (row 3)": the row of the call whose value failed. A Flush's block list
// has no rows: its element, already named, is all there is to say.
std::string RowOf(const DeviceStatus& s) {
  if (s.field == static_cast<int32_t>(CheckedField::kBlocks)) return std::string();
  return absl::StrCat(" (row ", s.row, ")");
}

// "layer 2: " for faults of a call over several layers (col), "" otherwise.
std::string LayerOf(const DeviceStatus& s) {
  return s.col >= 0 ? absl::StrCat("layer ", s.col, ": ") : std::string();
}

}  // namespace

absl::Status DeviceStatusToStatus(const DeviceStatus& s, absl::string_view operation) {
  if (s.failed == 0) return absl::OkStatus();
  const std::string where = absl::StrCat("In ", operation, ": ");
  const std::string element = Element(s);
  switch (static_cast<CheckProblem>(s.problem)) {
    case CheckProblem::kNonZeroStart:
      return absl::InvalidArgumentError(
          absl::StrCat(where, "query_start_loc[0] = ", s.value, " must be 0"));
    case CheckProblem::kDecreasing:
      return absl::InvalidArgumentError(absl::StrCat(
          where, "query_start_loc[", s.index, "] = ", s.value, " is less than query_start_loc[",
          s.index - 1, "] = ", s.bound, " (row ", s.row, ")"));
    case CheckProblem::kTooManyTokens:
      return absl::OutOfRangeError(absl::StrCat(where, "query_start_loc gives row ", s.row, " ",
                                                s.value, " tokens, more than the ", s.bound,
                                                " the window allows"));
    case CheckProblem::kPastLastToken:
      return absl::OutOfRangeError(absl::StrCat(where, "query_start_loc[", s.index, "] = ", s.value,
                                                " is past the ", s.bound,
                                                " tokens of the activations"));
    case CheckProblem::kIndexTooLarge:
      return absl::OutOfRangeError(absl::StrCat(where, element, " = ", s.value,
                                                " is out of range: must be below ", s.bound,
                                                RowOf(s)));
    case CheckProblem::kNegative:
      return absl::OutOfRangeError(
          absl::StrCat(where, element, " = ", s.value, " must not be negative", RowOf(s)));
    case CheckProblem::kColumnPastWidth:
      return absl::OutOfRangeError(absl::StrCat(
          where, "block_table[", s.index, ", ", s.value, "] (the block after the next boundary of row ",
          s.row, ") is past the table's width ", s.bound));
    case CheckProblem::kDuplicateWrite:
      return absl::InvalidArgumentError(
          absl::StrCat(where, element, ": rows ", s.other_row, " and ", s.row,
                       " both write ", s.field == static_cast<int32_t>(CheckedField::kIdxMapping)
                                           ? "request row "
                                           : "block ",
                       s.value, " in one call"));
    case CheckProblem::kWriteOfRead:
      return absl::InvalidArgumentError(
          absl::StrCat(where, element, ": row ", s.row, " reads block ", s.value,
                       " while row ", s.other_row, " writes it in the same call"));
    case CheckProblem::kTwoStatesOneBlock:
      return absl::InvalidArgumentError(absl::StrCat(
          where, element, ": row ", s.row, " would write its boundary state and its final state "
          "to the same block ", s.value));
    case CheckProblem::kNumAcceptedRange:
      return absl::OutOfRangeError(absl::StrCat(where, element, " = ", s.value,
                                                " must be in [1, ", s.bound,
                                                "] (the columns of ssm_state_indices)"));
    case CheckProblem::kMismatch:
      return absl::InvalidArgumentError(absl::StrCat(
          where, element, " = ", s.value, " differs from ", s.bound,
          ", the value the step's first call used (row ", s.row, ")"));
    case CheckProblem::kCancelled:
      return absl::CancelledError(absl::StrCat(
          where, "not run: its step was cancelled (the session that was to ring the doorbell it "
                 "waited for ended)"));
    case CheckProblem::kPrerequisiteFailed:
      return absl::FailedPreconditionError(absl::StrCat(
          where, "not run: earlier call ", s.index, " of the same step failed on the device"));
    case CheckProblem::kNotFinite:
      return absl::InvalidArgumentError(
          absl::StrCat(where, element, " is not finite (NaN or infinite)"));
    case CheckProblem::kInputFault:
      return absl::DataLossError(absl::StrCat(
          where, "not run: reading its inputs faulted (a region they are in was truncated by its "
                 "owner while in use)"));
    case CheckProblem::kPendingShared:
      return absl::FailedPreconditionError(absl::StrCat(
          where, element, ": rows ", s.other_row, " and ", s.row, " both verify from block ",
          s.value, ", which has tokens pending from a DEFERRED commit: the block's first Verify "
          "materializes them, so rows may share it only once it is flushed (Flush)"));
    case CheckProblem::kPendingBlock:
      return absl::FailedPreconditionError(absl::StrCat(
          where, element, " = ", s.value, " (row ", s.row, ") is to be written, but layer ",
          s.bound, " still has tokens pending on it from an earlier DEFERRED commit that no "
          "Verify took: Flush a block before giving it to another request"));
    case CheckProblem::kFastShared:
      return absl::InvalidArgumentError(absl::StrCat(
          where, "state_indices[", s.index, "]: rows ", s.other_row, " and ", s.row, " both ",
          absl::StrContains(operation, "Commit") ? "commit" : "verify", " from block ", s.value,
          ": commit mode FAST keeps each row's candidates in its checkpoint block's ring, so one "
          "row a step may use a block"));
    case CheckProblem::kFastCursor:
      return absl::FailedPreconditionError(absl::StrCat(
          where, LayerOf(s), "rings.cursors[", s.index, "] = {tokens ", High(s.value),
          ", candidates ", Low(s.value), "}", s.row >= 0 ? absl::StrCat(" (row ", s.row, ")") : "",
          " is not a cursor a Commit leaves in a ring of ", s.bound,
          " tokens: the ring's memory was written by something else"));
    case CheckProblem::kFastRingFull:
      return absl::OutOfRangeError(absl::StrCat(
          where, "state_indices[", s.index, "] = ", High(s.value), " (row ", s.row,
          "): the block's ring holds ", Low(s.value), " of ", Low(s.bound),
          " tokens: no room for the window's ", High(s.bound),
          " (a Commit folds the ring before tokens + Q exceeds its capacity)"));
    case CheckProblem::kFastCandidates:
      return absl::FailedPreconditionError(absl::StrCat(
          where, LayerOf(s), "row ", s.row, " commits ", s.value, " tokens to block ", s.index,
          " but its last Verify left ", s.bound,
          " candidates in the block's ring (every layer's Verify of the step comes before the "
          "Commit)"));
    case CheckProblem::kFastRingInUse:
      return absl::FailedPreconditionError(absl::StrCat(
          where, element, " = ", s.value, " (row ", s.row, ") is to be written, but layer ",
          s.bound, "'s ring of it still holds tokens of another request (commit mode FAST): "
          "Flush a block (discard) before giving it to another request"));
    case CheckProblem::kNone:
      break;
  }
  return absl::InternalError(absl::StrCat(where, "device check failed on ", element,
                                          " (problem ", s.problem, ")"));
}

}  // namespace kernels
}  // namespace specstate
