// The device-side checks of Stock, Verify and Commit, on every backend and on
// KDA and Gated DeltaNet layers: the call returns OK, its DeviceStatus names
// the field and the row, and no byte of any pool, record or output changes.
// The owner table is clear afterwards, and the next valid call runs.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/kda_args.h"
#include "kernels/testing/kernel_harness.h"

namespace specstate {
namespace kernels {
namespace testing {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

struct DeviceCheckCase {
  const char* what;
  // Breaks one field of the step's metadata; returns the message substring.
  std::function<std::string(Step&)> breaks;
  absl::StatusCode code;
};

class DeviceCheckTest : public KdaKernelsTest {
 protected:
  // `prepare` runs valid calls first (e.g. verify before commit); `call` is
  // the call under test, `workspace` and `entries` its owner table.
  void RunCases(const StepSpec& spec, const std::vector<DeviceCheckCase>& cases, const char* op,
                const std::function<void(Step&)>& prepare,
                const std::function<CallResult(Step&)>& call,
                const std::function<const Tensor&(const Step&)>& workspace) {
    // Every case on a KDA layer and on a Gated DeltaNet one (grouped heads).
    StepSpec gdn = spec;
    gdn.kind = LayerKind::kGdn;
    gdn.value_heads = 2 * spec.heads;
    for (const StepSpec& kind_spec : {spec, gdn})
    for (const DeviceCheckCase& c : cases) {
      SCOPED_TRACE(absl::StrCat(c.what, ", ", Describe(kind_spec)));
      Step s = MakeStep(kind_spec);
      prepare(s);
      if (HasFatalFailure()) return;
      const Metadata good = Metadata::Of(s);
      const std::string message = c.breaks(s);
      const Snapshot before = TakeSnapshot(s);
      const CallResult result = call(s);
      ASSERT_TRUE(result.launch.ok()) << result.launch;
      EXPECT_EQ(result.device.code(), c.code) << result.device;
      EXPECT_THAT(std::string(result.device.message()), StartsWith(absl::StrCat("In ", op, ": ")));
      EXPECT_THAT(std::string(result.device.message()), HasSubstr(message));
      ExpectSameBytes(before, TakeSnapshot(s));
      ExpectOwnerTableClear(workspace(s), s.num_blocks);
      good.RestoreTo(&s);
      EXPECT_TRUE(CallOk(call(s))) << "the valid call after the failed one";
      ExpectOwnerTableClear(workspace(s), s.num_blocks);
    }
  }
};

// Shifts every row boundary after row `row` so that the row gets `extra`
// more tokens.
void GrowRow(Step& s, int row, int extra) {
  for (size_t k = row + 1; k < s.qsl.size(); ++k) s.qsl[k] += extra;
}

TEST_P(DeviceCheckTest, Stock) {
  StepSpec spec;
  spec.q = 4;  // ssm_state_indices has Q + 1 = 5 columns
  spec.tokens = {2, 3, 1, 2};
  const std::vector<DeviceCheckCase> cases = {
      {"query_start_loc decreasing",
       [](Step& s) {
         s.qsl[2] = s.qsl[1] - 1;
         return absl::StrCat("query_start_loc[2] = ", s.qsl[2],
                             " is less than query_start_loc[1] = ", s.qsl[1], " (row 1)");
       },
       absl::StatusCode::kInvalidArgument},
      {"a row over the columns",
       [](Step& s) {
         GrowRow(s, 1, 3);
         return std::string(
             "query_start_loc gives row 1 6 tokens, more than the 5 the window allows");
       },
       absl::StatusCode::kOutOfRange},
      {"past the last token",
       [](Step& s) {
         s.qsl[4] = static_cast<int32_t>(s.num_tokens) + 1;
         return absl::StrCat("query_start_loc[4] = ", s.qsl[4], " is past the ", s.num_tokens,
                             " tokens of the activations");
       },
       absl::StatusCode::kOutOfRange},
      {"a start other than 0",
       [](Step& s) {
         s.qsl[0] = -1;
         return std::string("query_start_loc[0] = -1 must be 0");
       },
       absl::StatusCode::kInvalidArgument},
      {"a store past the pool",
       [](Step& s) {
         s.stock_indices[1][2] = static_cast<int32_t>(s.num_blocks);
         return absl::StrCat("state_indices[1, 2] = ", s.num_blocks,
                             " is out of range: must be below ", s.num_blocks, " (row 1)");
       },
       absl::StatusCode::kOutOfRange},
      {"a checkpoint past the pool",
       [](Step& s) {
         s.stock_indices[2][4] = static_cast<int32_t>(s.num_blocks) + 7;
         return absl::StrCat("state_indices[2, 4] = ", s.num_blocks + 7,
                             " is out of range: must be below ", s.num_blocks, " (row 2)");
       },
       absl::StatusCode::kOutOfRange},
      {"num_accepted_tokens 0",
       [](Step& s) {
         s.stock_accepted[1] = 0;
         return std::string("num_accepted_tokens[1] = 0 must be in [1, 5]");
       },
       absl::StatusCode::kOutOfRange},
      {"num_accepted_tokens past the columns",
       [](Step& s) {
         s.stock_accepted[3] = 6;
         return std::string("num_accepted_tokens[3] = 6 must be in [1, 5]");
       },
       absl::StatusCode::kOutOfRange},
      {"two rows write one block",
       [](Step& s) {
         s.stock_indices[2][0] = s.stock_indices[0][1];
         return absl::StrCat("state_indices[2, 0]: rows 0 and 2 both write block ",
                             s.stock_indices[0][1], " in one call");
       },
       absl::StatusCode::kInvalidArgument},
      {"a row writes the block a later row reads",
       [](Step& s) {
         s.stock_indices[1][0] = s.sources[2];
         return absl::StrCat("state_indices[2, 4]: row 2 reads block ", s.sources[2],
                             " while row 1 writes it in the same call");
       },
       absl::StatusCode::kInvalidArgument},
      {"a row writes the block an earlier row reads",
       [](Step& s) {
         s.stock_indices[3][1] = s.sources[0];
         return absl::StrCat("state_indices[0, 4]: row 0 reads block ", s.sources[0],
                             " while row 3 writes it in the same call");
       },
       absl::StatusCode::kInvalidArgument},
  };
  RunCases(
      spec, cases, "Stock", [](Step&) {}, [&](Step& s) { return RunStock(s, 0); },
      [](const Step& s) -> const Tensor& { return s.stock_workspace; });
}

TEST_P(DeviceCheckTest, Verify) {
  StepSpec spec;
  spec.q = 4;
  spec.tokens = {2, 3, 1, 2};
  const std::vector<DeviceCheckCase> cases = {
      {"a row over the window",
       [](Step& s) {
         GrowRow(s, 1, 2);
         return std::string(
             "query_start_loc gives row 1 5 tokens, more than the 4 the window allows");
       },
       absl::StatusCode::kOutOfRange},
      {"query_start_loc decreasing",
       [](Step& s) {
         s.qsl[3] = s.qsl[2] - 2;
         return absl::StrCat("query_start_loc[3] = ", s.qsl[3],
                             " is less than query_start_loc[2] = ", s.qsl[2], " (row 2)");
       },
       absl::StatusCode::kInvalidArgument},
      {"past the last token",
       [](Step& s) {
         s.num_tokens_arg = s.qsl[4] - 1;
         return absl::StrCat("query_start_loc[4] = ", s.qsl[4], " is past the ", s.qsl[4] - 1,
                             " tokens of the activations");
       },
       absl::StatusCode::kOutOfRange},
      {"a negative start",
       [](Step& s) {
         s.qsl[0] = -2;
         return std::string("query_start_loc[0] = -2 must be 0");
       },
       absl::StatusCode::kInvalidArgument},
      {"a positive start",
       [](Step& s) {
         s.qsl[0] = 1;
         return std::string("query_start_loc[0] = 1 must be 0");
       },
       absl::StatusCode::kInvalidArgument},
      {"a checkpoint past the pool",
       [](Step& s) {
         s.sources[1] = static_cast<int32_t>(s.num_blocks);
         return absl::StrCat("state_indices[1] = ", s.num_blocks,
                             " is out of range: must be below ", s.num_blocks, " (row 1)");
       },
       absl::StatusCode::kOutOfRange},
  };
  // Verify has no cross-row pass and no workspace: the stock workspace
  // stands in (untouched).
  RunCases(
      spec, cases, "Verify", [](Step&) {}, [&](Step& s) { return RunVerify(s, 0); },
      [](const Step& s) -> const Tensor& { return s.stock_workspace; });
}

// Align mode, rows mapped to batch rows {2, 0, 5, 3} of 6. Row 0 crosses a
// boundary (boundary column 0, final column 1), rows 1-3 do not.
StepSpec CommitCheckSpec() {
  StepSpec spec;
  spec.q = 4;
  spec.num_layers = 2;
  spec.tokens = {4, 3, 4, 2};
  spec.batch = 6;
  spec.request_indices = {2, 0, 5, 3};
  spec.num_accepted = {2, 1, 3, 2, 1, 4};
  spec.align = true;
  spec.block_size = 8;
  spec.width = 4;
  spec.num_computed = {0, 0, 6, 9, 0, 17};
  return spec;
}

TEST_P(DeviceCheckTest, Commit) {
  const std::vector<DeviceCheckCase> cases = {
      {"request index past the batch",
       [](Step& s) {
         s.request_indices[1] = 6;
         return std::string("request_indices[1] = 6 is out of range: must be below 6 (row 1)");
       },
       absl::StatusCode::kOutOfRange},
      {"negative request index",
       [](Step& s) {
         s.request_indices[1] = -2;
         return std::string("request_indices[1] = -2 must not be negative (row 1)");
       },
       absl::StatusCode::kOutOfRange},
      {"a checkpoint past the pool",
       [](Step& s) {
         s.sources[2] = static_cast<int32_t>(s.num_blocks);
         return absl::StrCat("state_indices[2] = ", s.num_blocks,
                             " is out of range: must be below ", s.num_blocks, " (row 2)");
       },
       absl::StatusCode::kOutOfRange},
      {"a final block past the pool",
       [](Step& s) {
         s.table[3][1] = static_cast<int32_t>(s.num_blocks) + 1;
         return absl::StrCat("block_table[3, 1] = ", s.num_blocks + 1,
                             " is out of range: must be below ", s.num_blocks, " (row 3)");
       },
       absl::StatusCode::kOutOfRange},
      {"a boundary block past the pool",
       [](Step& s) {
         s.table[2][0] = static_cast<int32_t>(s.num_blocks);
         return absl::StrCat("block_table[2, 0] = ", s.num_blocks,
                             " is out of range: must be below ", s.num_blocks, " (row 0)");
       },
       absl::StatusCode::kOutOfRange},
      {"boundary column past the width",
       [](Step& s) {
         s.num_computed[5] = 38;  // crosses 40: column 4 of a 4-wide table
         return std::string(
             "block_table[5, 4] (the block after the next boundary of row 2) is past the "
             "table's width 4");
       },
       absl::StatusCode::kOutOfRange},
      {"negative num_computed_tokens",
       [](Step& s) {
         s.num_computed[0] = -1;
         return std::string("num_computed_tokens[0] = -1 must not be negative (row 1)");
       },
       absl::StatusCode::kOutOfRange},
      {"query_start_loc over the window",
       [](Step& s) {
         GrowRow(s, 1, 2);
         return std::string(
             "query_start_loc gives row 1 5 tokens, more than the 4 the window allows");
       },
       absl::StatusCode::kOutOfRange},
      {"query_start_loc decreasing",
       [](Step& s) {
         s.qsl[2] = s.qsl[1] - 1;
         return absl::StrCat("query_start_loc[2] = ", s.qsl[2],
                             " is less than query_start_loc[1] = ", s.qsl[1], " (row 1)");
       },
       absl::StatusCode::kInvalidArgument},
      {"two rows write one block",
       [](Step& s) {
         s.table[3][1] = s.table[0][0];  // row 3's final = row 1's final
         return absl::StrCat("block_table[3]: rows 1 and 3 both write block ", s.table[0][0],
                             " in one call");
       },
       absl::StatusCode::kInvalidArgument},
      {"a row writes the block another row reads",
       [](Step& s) {
         s.table[0][0] = s.sources[2];  // row 1's final = row 2's checkpoint
         return absl::StrCat("state_indices[2]: row 2 reads block ", s.sources[2],
                             " while row 1 writes it in the same call");
       },
       absl::StatusCode::kInvalidArgument},
      {"a boundary block another row reads",
       [](Step& s) {
         s.table[2][0] = s.sources[3];  // row 0's boundary = row 3's checkpoint
         return absl::StrCat("state_indices[3]: row 3 reads block ", s.sources[3],
                             " while row 0 writes it in the same call");
       },
       absl::StatusCode::kInvalidArgument},
      // Not in docs/semantics.md's list: the final column, capped at the table's
      // width, is the boundary column (the reference would store both
      // states there, the final one last). The kernels reject it.
      {"boundary and final state in one block",
       [](Step& s) {
         s.num_computed[2] = 30;  // boundary column 3 = capped final column
         return absl::StrCat(
             "block_table[2, 3]: row 0 would write its boundary state and its "
             "final state to the same block ",
             s.table[2][3]);
       },
       absl::StatusCode::kInvalidArgument},
  };
  RunCases(
      CommitCheckSpec(), cases, "Commit", [&](Step& s) { StockAndVerifyAll(s); },
      [&](Step& s) { return RunCommit(s); },
      [](const Step& s) -> const Tensor& { return s.commit_workspace; });
}

TEST_P(DeviceCheckTest, CommitModeNone) {
  StepSpec spec;
  spec.q = 3;
  spec.tokens = {3, 2, 3};
  spec.num_accepted = {2, 1, 3};
  const std::vector<DeviceCheckCase> cases = {
      {"two rows commit to one checkpoint",
       [](Step& s) {
         s.sources[2] = s.sources[0];
         return absl::StrCat("state_indices[2]: rows 0 and 2 both write block ", s.sources[0],
                             " in one call");
       },
       absl::StatusCode::kInvalidArgument},
      {"a checkpoint past the pool",
       [](Step& s) {
         s.sources[0] = static_cast<int32_t>(s.num_blocks) + 3;
         return absl::StrCat("state_indices[0] = ", s.num_blocks + 3,
                             " is out of range: must be below ", s.num_blocks, " (row 0)");
       },
       absl::StatusCode::kOutOfRange},
  };
  RunCases(
      spec, cases, "Commit", [&](Step& s) { StockAndVerifyAll(s); },
      [&](Step& s) { return RunCommit(s); },
      [](const Step& s) -> const Tensor& { return s.commit_workspace; });
}

INSTANTIATE_TEST_SUITE_P(Backends, DeviceCheckTest,
                         ::testing::Values(Backend::kCpu, Backend::kCuda), BackendParamName);

}  // namespace
}  // namespace testing
}  // namespace kernels
}  // namespace specstate
