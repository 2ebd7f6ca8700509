// The verdict of a call's device-side checks, written where the kernels run.
//
// Values that live in device memory (indices, query_start_loc, accepted and
// computed counts) cannot be checked on the host without a synchronization.
// So every launcher starts with a check pass on the device that writes a
// DeviceStatus; every later kernel of the call reads it first and writes
// nothing when it says `failed`. The caller reads it when it chooses (after
// its stream reaches the call) and turns it into an absl::Status:
//
//   DeviceStatus st;  // copied back from the device
//   absl::Status s = DeviceStatusToStatus(st, "Commit");
//   // OUT_OF_RANGE: "In Commit: state_indices[3] = 9000 is past the pool's
//   //                4096 blocks (row 3)"
#ifndef SPECSTATE_KERNELS_DEVICE_STATUS_H_
#define SPECSTATE_KERNELS_DEVICE_STATUS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace specstate {
namespace kernels {

// The tensor a failed check looked at.
enum class CheckedField : int32_t {
  kNone = 0,
  kQueryStartLoc = 1,
  kStateIndices = 2,
  kNumAcceptedTokens = 3,
  kNumAccepted = 4,
  kRequestIndices = 5,
  kBlockTable = 6,
  kNumComputedTokens = 7,
  kIdxMapping = 8,
  kPrerequisites = 9,
  kALog = 10,
  kDtBias = 11,
  kInputs = 12,  // the call's inputs as a whole (a region they were read from)
  kBlocks = 13,  // a Flush's block list
  kRingCursors = 14,  // FAST: a layer's ring cursors (FastRings::cursors), indexed by block
};

// What was wrong with it.
enum class CheckProblem : int32_t {
  kNone = 0,
  kNonZeroStart = 1,        // query_start_loc[0] != 0
  kDecreasing = 2,          // query_start_loc[n + 1] < query_start_loc[n]
  kTooManyTokens = 3,       // a row has more tokens than the window allows
  kPastLastToken = 4,       // query_start_loc[N] > tokens in the activations
  kIndexTooLarge = 5,       // an index >= its bound
  kNegative = 6,            // a count or index < 0 where that is not allowed
  kColumnPastWidth = 7,     // a block-table column >= the table's width
  kDuplicateWrite = 8,      // two rows write the same block / request row
  kWriteOfRead = 9,         // a row writes the block another row reads
  kTwoStatesOneBlock = 10,  // one row writes two different states to one block
  kNumAcceptedRange = 11,   // num_accepted_tokens outside [1, columns]
  kMismatch = 12,           // differs from the value the step's first call used
  kPrerequisiteFailed = 13, // an earlier call this one depends on failed
  kCancelled = 14,          // the service cancelled the call's step
  kNotFinite = 15,          // a parameter is NaN or infinite
  kInputFault = 16,         // reading the inputs faulted (CPU: a region truncated by its owner)
  kPendingShared = 17,      // rows share a checkpoint block that has pending tokens (DEFERRED)
  kPendingBlock = 18,       // a commit writes a block another commit left pending (DEFERRED)
  // FAST (docs/semantics.md, "Fast mode (FAST)"). Where a fault needs two
  // numbers in `value` or `bound`, they are packed: high 32 bits, low 32 bits.
  kFastShared = 19,      // two rows verify (or commit) from one block: their candidates
                         // would share its ring's slots (other_row, row; value: the block)
  kFastCursor = 20,      // rings.cursors[index] is no cursor a Commit leaves (value: tokens,
                         // candidates; bound: the capacity; col: the layer, or -1)
  kFastRingFull = 21,    // the ring has no room for the row's window (value: block, tokens;
                         // bound: the window's tokens, the capacity)
  kFastCandidates = 22,  // a row commits more tokens than its block's last Verify left
                         // candidates (index: block, col: layer; value: commit_len; bound:
                         // candidates)
  kFastRingInUse = 23,   // a commit writes a block whose ring holds another request's tokens
                         // (value: block; bound: the layer)
};

// Written by the first kernel of every call (plain data: lives in device
// memory on the CUDA backend, host memory on the CPU backend).
struct DeviceStatus {
  int32_t failed;     // 0: every check passed and the call's kernels ran
  int32_t field;      // CheckedField
  int32_t problem;    // CheckProblem
  int32_t row;        // the row of the call (spec row) whose check failed
  int32_t index;      // the element's index in `field` (a batch row for per-request fields)
  int32_t col;        // the element's column for 2-D fields, or -1
  int32_t other_row;  // the other row of a conflict, or -1
  int64_t value;      // the offending value
  int64_t bound;      // the bound it broke (exclusive upper bound, or limit)
};

absl::string_view CheckedFieldName(CheckedField field);

// OK when `status.failed == 0`. Otherwise OUT_OF_RANGE for a value past a
// bound, INVALID_ARGUMENT for inconsistent values (decreasing offsets,
// conflicting writes), FAILED_PRECONDITION where the service's state forbids
// the call (a failed earlier call of the step; a block with tokens pending
// from a DEFERRED commit, or a FAST ring another request left or no Commit
// could have left); the message starts "In <operation>: " and names the
// field, its index, the row and the bound.
absl::Status DeviceStatusToStatus(const DeviceStatus& status, absl::string_view operation);

}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_DEVICE_STATUS_H_
