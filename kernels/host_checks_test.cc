// The host-side argument checks of Stock, Verify and Commit, on every
// backend: a bad argument comes back from the call as the error
// Validate*Args gives for it, naming the call, and nothing runs.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "kernels/kda_args.h"
#include "kernels/kda_kernels.h"
#include "kernels/testing/kernel_harness.h"

namespace specstate {
namespace kernels {
namespace testing {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

template <typename Args>
struct HostErrorCase {
  const char* what;
  std::function<void(Args&, CallData&)> breaks;
  absl::StatusCode code;
  std::string message;  // a substring of the message
};

// Runs every case on a fresh copy of `args` (and `cd`'s layer table).
template <typename Args, typename Call, typename Validate>
void ExpectHostErrors(const Step& s, const Args& good, const CallData& good_cd,
                      const std::vector<HostErrorCase<Args>>& cases, const std::string& op,
                      Call call, Validate validate) {
  const Snapshot before = TakeSnapshot(s);
  for (const HostErrorCase<Args>& c : cases) {
    SCOPED_TRACE(c.what);
    Args args = good;
    CallData cd;
    cd.layers = good_cd.layers;
    if constexpr (std::is_same_v<Args, CommitArgs>) args.layers = cd.layers.data();
    c.breaks(args, cd);
    const absl::Status status = call(args);
    EXPECT_EQ(status.code(), c.code) << status;
    EXPECT_THAT(std::string(status.message()), StartsWith(absl::StrCat("In ", op, ": ")));
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.message));
    EXPECT_EQ(validate(args), status);
  }
  ExpectSameBytes(before, TakeSnapshot(s));
}

TEST_P(KdaKernelsTest, ValidateShapeRejectsUnsupportedShapes) {
  KdaShape shape;
  shape.num_heads = 2;
  shape.head_dim = 64;
  EXPECT_TRUE(ValidateShape(shape).ok());
  shape.head_dim = 96;
  EXPECT_EQ(ValidateShape(shape).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(ValidateShape(shape).message()),
              HasSubstr("head_dim = 96 is not supported"));
}

TEST_P(KdaKernelsTest, StockRejectsBadArguments) {
  StepSpec spec;
  spec.tokens = {2, 3};
  Step s = MakeStep(spec);
  CallData cd;
  const StockArgs good = StockArgsFor(s, 0, &cd);
  const int64_t hk = s.hk();
  const size_t need = StockWorkspaceBytes(s.num_blocks);
  using A = StockArgs;
  using C = CallData;
  constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
  const std::vector<HostErrorCase<A>> cases = {
      {"head dim 96", [](A& a, C&) { a.shape.head_dim = 96; }, kInvalid,
       "head_dim = 96 is not supported (a power of two: 64, 128 or 256)"},
      {"head dim 32", [](A& a, C&) { a.shape.head_dim = 32; }, kInvalid, "head_dim = 32"},
      {"no heads", [](A& a, C&) { a.shape.num_heads = 0; }, kInvalid, "num_heads = 0 must be >= 1"},
      {"int32 activations", [](A& a, C&) { a.shape.act_dtype = DType::kInt32; }, kInvalid,
       "activation dtype int32 is not supported"},
      {"fp16 state", [](A& a, C&) { a.shape.state_dtype = DType::kFloat16; }, kInvalid,
       "state dtype fp16 is not supported (fp32 or bf16)"},
      {"positive lower bound", [](A& a, C&) { a.shape.lower_bound = 0.5f; }, kInvalid,
       "lower_bound = 0.5 must be negative"},
      {"negative token count", [](A& a, C&) { a.num_tokens = -1; }, kInvalid,
       "num_tokens = -1 is negative"},
      {"q null", [](A& a, C&) { a.q.data = nullptr; }, kInvalid, "q is null"},
      {"k stride under a token", [hk](A& a, C&) { a.k.token_stride = hk - 1; }, kInvalid,
       absl::StrCat("k token stride ", hk - 1, " is less than one token's ", hk, " elements")},
      {"v stride under a token", [hk](A& a, C&) { a.v.token_stride = hk - 64; }, kInvalid,
       "v token stride"},
      {"g not dense", [hk](A& a, C&) { a.g.token_stride = hk + 1; }, kInvalid,
       absl::StrCat("g token stride ", hk + 1, " must be ", hk, " (dense)")},
      {"beta stride under a token", [](A& a, C&) { a.beta.token_stride = 1; }, kInvalid,
       "beta token stride 1 is less than one token's 2 elements"},
      {"out null", [](A& a, C&) { a.out = nullptr; }, kInvalid, "out is null"},
      {"state pool null", [](A& a, C&) { a.state.data = nullptr; }, kInvalid, "state pool is null"},
      {"state pool without blocks", [](A& a, C&) { a.state.num_blocks = 0; }, kInvalid,
       "state pool has no blocks"},
      {"state block stride under a block", [hk](A& a, C&) { a.state.block_stride = hk * 64 - 4; },
       kInvalid,
       absl::StrCat("state pool block stride ", hk * 64 - 4, " is less than one block's ", hk * 64,
                    " elements")},
      {"state pool misaligned",
       [](A& a, C&) { a.state.data = static_cast<char*>(a.state.data) + 4; }, kInvalid,
       "state pool blocks must start on 16-byte boundaries"},
      {"state block stride misaligned", [](A& a, C&) { a.state.block_stride += 1; }, kInvalid,
       "state pool blocks must start on 16-byte boundaries"},
      {"no gate parameters", [](A& a, C&) { a.params.dt_bias = nullptr; }, kInvalid,
       "A_log and dt_bias must be set"},
      {"negative rows", [](A& a, C&) { a.num_rows = -1; }, kInvalid, "num_rows = -1 is negative"},
      {"query_start_loc null", [](A& a, C&) { a.query_start_loc = nullptr; }, kInvalid,
       "query_start_loc is null"},
      {"ssm_state_indices null", [](A& a, C&) { a.ssm_state_indices.data = nullptr; }, kInvalid,
       "ssm_state_indices is null"},
      {"ssm_state_indices without columns", [](A& a, C&) { a.ssm_state_indices.cols = 0; },
       kInvalid, "ssm_state_indices has 0 columns, needs at least 1"},
      {"ssm_state_indices row stride 0", [](A& a, C&) { a.ssm_state_indices.row_stride = 0; },
       kInvalid, "ssm_state_indices row stride 0 must be >= 1"},
      {"workspace too small", [need](A& a, C&) { a.workspace_bytes = need - 1; }, kInvalid,
       absl::StrCat("workspace of ", need - 1, " bytes is smaller than the ", need,
                    " bytes this call needs")},
      {"workspace null", [](A& a, C&) { a.workspace = nullptr; }, kInvalid,
       "bytes is smaller than the"},
      {"status null", [](A& a, C&) { a.status = nullptr; }, kInvalid, "status is null"},
  };
  ExpectHostErrors(
      s, good, cd, cases, "Stock", [&](const A& a) { return kernels_->Stock(a, stream()); },
      ValidateStockArgs);
}

TEST_P(KdaKernelsTest, VerifyRejectsBadArguments) {
  StepSpec spec;
  spec.tokens = {2, 3, 1};
  Step s = MakeStep(spec);
  CallData cd;
  const VerifyArgs good = VerifyArgsFor(s, 0, &cd);
  using A = VerifyArgs;
  using C = CallData;
  constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
  constexpr auto kOutOfRange = absl::StatusCode::kOutOfRange;
  const std::vector<HostErrorCase<A>> cases = {
      {"head dim 96", [](A& a, C&) { a.shape.head_dim = 96; }, kInvalid,
       "head_dim = 96 is not supported"},
      {"generation without a cancellation word",
       [](A& a, C&) { a.prerequisites.generation = 3; }, kInvalid,
       "prerequisites: a generation without a cancellation word"},
      {"bf16 activations with fp16 state", [](A& a, C&) { a.shape.state_dtype = DType::kFloat16; },
       kInvalid, "state dtype fp16 is not supported"},
      {"batch over the record rows", [](A& a, C&) { a.records.rows = 2; }, kOutOfRange,
       "3 rows exceed the 2 record rows"},
      {"record window over 16 tokens", [](A& a, C&) { a.records.q = 17; }, kOutOfRange,
       "record window q = 17 must be in [1, 16]"},
      {"record window of 0 tokens", [](A& a, C&) { a.records.q = 0; }, kOutOfRange,
       "record window q = 0 must be in [1, 16]"},
      {"records null", [](A& a, C&) { a.records.g = nullptr; }, kInvalid, "records are null"},
      {"g not dense", [](A& a, C&) { a.g.token_stride += 8; }, kInvalid, "(dense)"},
      {"q stride under a token", [](A& a, C&) { a.q.token_stride = 3; }, kInvalid,
       "q token stride 3 is less than one token's 128 elements"},
      {"state_indices null", [](A& a, C&) { a.state_indices.data = nullptr; }, kInvalid,
       "state_indices is null"},
      {"query_start_loc null", [](A& a, C&) { a.query_start_loc = nullptr; }, kInvalid,
       "query_start_loc is null"},
      {"status null", [](A& a, C&) { a.status = nullptr; }, kInvalid, "status is null"},
  };
  ExpectHostErrors(
      s, good, cd, cases, "Verify", [&](const A& a) { return kernels_->Verify(a, stream()); },
      ValidateVerifyArgs);
}

TEST_P(KdaKernelsTest, CommitRejectsBadArguments) {
  StepSpec spec;
  spec.q = 4;
  spec.num_layers = 3;
  // Enough rows that a workspace sized for one row is too small for them.
  spec.tokens.assign(14, 1);
  spec.align = true;
  spec.block_size = 8;
  spec.width = 2;
  spec.num_computed.assign(14, 0);
  Step s = MakeStep(spec);
  CallData cd;
  const CommitArgs good = CommitArgsFor(s, &cd);
  const size_t need = CommitWorkspaceBytes(s.rows, spec.q, s.num_blocks);
  const size_t one_row = CommitWorkspaceBytes(1, spec.q, s.num_blocks);
  ASSERT_LT(one_row, need);
  using A = CommitArgs;
  using C = CallData;
  constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
  constexpr auto kOutOfRange = absl::StatusCode::kOutOfRange;
  const int W = s.conv_width;
  const std::string conv_shape = absl::StrCat("[", spec.conv_dim, ", ", W, "]");
  const std::vector<HostErrorCase<A>> cases = {
      {"head dim 96", [](A& a, C&) { a.shape.head_dim = 96; }, kInvalid,
       "head_dim = 96 is not supported"},
      {"no layers", [](A& a, C&) { a.num_layers = 0; }, kInvalid,
       "a commit needs at least one layer"},
      {"no layer table", [](A& a, C&) { a.layers = nullptr; }, kInvalid,
       "a commit needs at least one layer"},
      {"no device layer table", [](A& a, C&) { a.device_layers = nullptr; }, kInvalid,
       "a commit needs at least one layer"},
      {"window over 16 tokens", [](A& a, C&) { a.spec_query_len = 17; }, kOutOfRange,
       "spec_query_len = 17 must be in [1, 16]"},
      {"batch over the record rows",
       [](A& a, C& c) {
         for (CommitLayer& l : c.layers) l.records.rows = 13;
       },
       kOutOfRange, "layer 0: 14 rows exceed the 13 record rows"},
      {"records of another window", [](A& a, C& c) { c.layers[1].records.q = 5; }, kInvalid,
       "layer 1: records hold windows of 5 tokens, the commit expects 4"},
      {"records null", [](A& a, C& c) { c.layers[2].records.kv = nullptr; }, kInvalid,
       "layer 2: records are null"},
      {"state pools of different sizes", [](A& a, C& c) { c.layers[1].state.num_blocks -= 1; },
       kInvalid,
       absl::StrCat("layer 1: state pool has ", s.num_blocks - 1, " blocks, layer 0 has ",
                    s.num_blocks)},
      {"state pool misaligned",
       [](A& a, C& c) { c.layers[2].state.data = static_cast<char*>(c.layers[2].state.data) + 8; },
       kInvalid, "layer 2: state pool blocks must start on 16-byte boundaries"},
      {"conv pool null", [](A& a, C& c) { c.layers[1].conv.data = nullptr; }, kInvalid,
       "layer 1: conv pool is null"},
      {"conv pool of another size", [](A& a, C& c) { c.layers[0].conv.num_blocks += 1; }, kInvalid,
       absl::StrCat("layer 0: conv pool has ", s.num_blocks + 1, " blocks, the state pool has ",
                    s.num_blocks)},
      {"conv blocks of different shapes", [](A& a, C& c) { c.layers[2].conv.dim += 1; }, kInvalid,
       absl::StrCat("layer 2: conv blocks [", spec.conv_dim + 1, ", ", W,
                    "] differ from layer 0's ", conv_shape)},
      {"conv blocks of different widths", [](A& a, C& c) { c.layers[1].conv.width += 1; }, kInvalid,
       "differ from layer 0's"},
      {"conv without channels",
       [](A& a, C& c) {
         for (CommitLayer& l : c.layers) l.conv.dim = 0;
       },
       kInvalid, "layer 0: conv dim must be >= 1"},
      {"conv window shorter than Q",
       [](A& a, C& c) {
         for (CommitLayer& l : c.layers) l.conv.width = 3;
       },
       kInvalid,
       "layer 0: conv window of 3 columns is shorter than the 4-token speculative window"},
      {"conv history over 16 columns",
       [](A& a, C& c) {
         for (CommitLayer& l : c.layers) l.conv.width = 4 + 16;
       },
       kInvalid, "layer 0: conv history of 17 columns exceeds the supported 16"},
      {"conv stride 0", [](A& a, C& c) { c.layers[0].conv.dim_stride = 0; }, kInvalid,
       "layer 0: conv pool strides must be positive"},
      {"no gate parameters", [](A& a, C& c) { c.layers[2].params.a_log = nullptr; }, kInvalid,
       "layer 2: A_log and dt_bias must be set"},
      {"query_start_loc null", [](A& a, C&) { a.query_start_loc = nullptr; }, kInvalid,
       "query_start_loc is null"},
      {"state_indices null", [](A& a, C&) { a.state_indices.data = nullptr; }, kInvalid,
       "state_indices is null"},
      {"negative batch", [](A& a, C&) { a.batch = -1; }, kInvalid, "batch = -1 is negative"},
      {"num_accepted null", [](A& a, C&) { a.num_accepted = nullptr; }, kInvalid,
       "num_accepted is null"},
      {"batch under the rows without request_indices", [](A& a, C&) { a.batch = 13; }, kOutOfRange,
       "without request_indices, num_accepted needs one entry per row: batch 13 < 14 rows"},
      {"align metadata: block table only",
       [](A& a, C&) {
         a.num_computed_tokens = nullptr;
         a.mamba_block_size = 0;
       },
       kInvalid, "align mode needs block_table, num_computed_tokens and mamba_block_size together"},
      {"align metadata: no block table", [](A& a, C&) { a.block_table.data = nullptr; }, kInvalid,
       "align mode needs block_table, num_computed_tokens and mamba_block_size"},
      {"align metadata: no block size", [](A& a, C&) { a.mamba_block_size = 0; }, kInvalid,
       "align mode needs block_table, num_computed_tokens and mamba_block_size"},
      {"block size under Q", [](A& a, C&) { a.mamba_block_size = 3; }, kInvalid,
       "mamba_block_size = 3 must cover one speculative window of 4 tokens"},
      {"block table without columns", [](A& a, C&) { a.block_table.cols = 0; }, kInvalid,
       "block_table has 0 columns, needs at least 1"},
      {"workspace one byte short", [need](A& a, C&) { a.workspace_bytes = need - 1; }, kInvalid,
       absl::StrCat("workspace of ", need - 1, " bytes is smaller than the ", need,
                    " bytes this call needs")},
      {"batch over the plan capacity", [one_row](A& a, C&) { a.workspace_bytes = one_row; },
       kInvalid, absl::StrCat("workspace of ", one_row, " bytes is smaller than the ", need)},
      {"status null", [](A& a, C&) { a.status = nullptr; }, kInvalid, "status is null"},
  };
  ExpectHostErrors(
      s, good, cd, cases, "Commit", [&](const A& a) { return kernels_->Commit(a, stream()); },
      ValidateCommitArgs);
}

}  // namespace
}  // namespace testing
}  // namespace kernels
}  // namespace specstate
