#include "kernels/device_status.h"

#include <string>

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
  }
  return "unknown";
}

namespace {

std::string Element(const DeviceStatus& s) {
  const std::string name(CheckedFieldName(static_cast<CheckedField>(s.field)));
  if (s.col >= 0) return absl::StrCat(name, "[", s.index, ", ", s.col, "]");
  return absl::StrCat(name, "[", s.index, "]");
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
                                                " (row ", s.row, ")"));
    case CheckProblem::kNegative:
      return absl::OutOfRangeError(
          absl::StrCat(where, element, " = ", s.value, " must not be negative (row ", s.row, ")"));
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
    case CheckProblem::kNone:
      break;
  }
  return absl::InternalError(absl::StrCat(where, "device check failed on ", element,
                                          " (problem ", s.problem, ")"));
}

}  // namespace kernels
}  // namespace specstate
