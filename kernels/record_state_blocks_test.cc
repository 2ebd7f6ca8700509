// RecordStateBlocks on every backend: per request, the block that holds its
// last token, against the reference; its host-side checks and its
// device-side checks, after which nothing is written.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/device_status.h"
#include "kernels/kda_args.h"
#include "kernels/kda_kernels.h"
#include "kernels/testing/kernel_harness.h"
#include "tests/reference/kda_reference.h"

namespace specstate {
namespace kernels {
namespace testing {
namespace {

namespace ref = ::specstate::reference;
using ::testing::HasSubstr;
using ::testing::StartsWith;

struct RsbStep;
int32_t UnusedRequestRow(const RsbStep& r);

struct RsbStep {
  int rows = 0;
  int batch = 0;
  int requests = 0;
  int block_size = 0;
  int width = 0;
  std::vector<int32_t> request_indices, idx_mapping, num_sampled, num_computed;
  Tensor state_idx, num_accepted, workspace, status;
};

// A request row no batch row maps to (there are more requests than batch rows).
int32_t UnusedRequestRow(const RsbStep& r) {
  for (int32_t v = 0; v < r.requests; ++v) {
    if (std::find(r.idx_mapping.begin(), r.idx_mapping.end(), v) == r.idx_mapping.end()) return v;
  }
  return -1;
}

class RecordStateBlocksTest : public KdaKernelsTest {
 protected:
  // Rows map to batch rows through request_indices (empty: identity); the
  // outputs start with a sentinel the kernel must leave where it writes
  // nothing.
  RsbStep MakeRsb(int rows, int batch, int requests, bool remap) {
    RsbStep r;
    r.rows = rows;
    r.batch = batch;
    r.requests = requests;
    r.block_size = rng().Int(4, 8);
    r.width = 5;
    std::vector<int32_t> batch_rows(batch), request_rows(requests);
    for (int b = 0; b < batch; ++b) batch_rows[b] = b;
    for (int q = 0; q < requests; ++q) request_rows[q] = q;
    if (remap) rng().Shuffle(&batch_rows);
    rng().Shuffle(&request_rows);
    if (remap) {
      // Batch row 1 (skipped, below) is always among the rows.
      const auto one = std::find(batch_rows.begin(), batch_rows.end(), 1);
      if (one - batch_rows.begin() >= rows) std::iter_swap(one, batch_rows.begin());
      r.request_indices.assign(batch_rows.begin(), batch_rows.begin() + rows);
    }
    r.idx_mapping.assign(batch, -1);
    for (int b = 0; b < batch; ++b) {
      // Every third batch row is skipped (< 0).
      r.idx_mapping[b] = b % 3 == 1 ? -1 - b % 2 : request_rows[b];
      r.num_sampled.push_back(rng().Int(0, 5));
      r.num_computed.push_back(rng().Int(0, r.block_size * (r.width + 2)));
    }
    r.state_idx = Upload(ToBytes(std::vector<int32_t>(requests, -777)));
    r.num_accepted = Upload(ToBytes(std::vector<int32_t>(requests, -888)));
    r.workspace = Zeroed(RecordStateBlocksWorkspaceBytes(std::max(rows, requests)));
    r.status = Zeroed(sizeof(DeviceStatus));
    return r;
  }

  RecordStateBlocksArgs ArgsFor(RsbStep& r, CallData* cd) {
    RecordStateBlocksArgs a;
    a.num_rows = r.rows;
    a.request_indices = r.request_indices.empty() ? nullptr : Ints(cd, r.request_indices);
    a.batch = r.batch;
    a.idx_mapping = Ints(cd, r.idx_mapping);
    a.num_sampled = Ints(cd, r.num_sampled);
    a.num_computed_tokens = Ints(cd, r.num_computed);
    a.mamba_block_size = r.block_size;
    a.block_table_width = r.width;
    a.num_requests = r.requests;
    a.state_idx = r.state_idx.As<int32_t>();
    a.num_accepted = r.num_accepted.As<int32_t>();
    a.workspace = r.workspace.data();
    a.workspace_bytes = r.workspace.dev.size();
    a.status = r.status.As<DeviceStatus>();
    return a;
  }

  CallResult Run(RsbStep& r) {
    CallData cd;
    RecordStateBlocksArgs a = ArgsFor(r, &cd);
    a.status_mirror = ZeroedMirror();
    return Finish(kernels_->RecordStateBlocks(a, stream()), "RecordStateBlocks",
                  r.status.As<DeviceStatus>());
  }

  void ExpectMatchesReference(const RsbStep& r) {
    ref::RecordStateBlocksCall call;
    call.num_rows = r.rows;
    call.request_indices = r.request_indices;
    call.idx_mapping = r.idx_mapping;
    call.num_sampled = r.num_sampled;
    call.num_computed_tokens = r.num_computed;
    call.mamba_block_size = r.block_size;
    call.block_table_width = r.width;
    std::vector<int32_t> state_idx = FromBytes<int32_t>(r.state_idx.host);
    std::vector<int32_t> num_accepted = FromBytes<int32_t>(r.num_accepted.host);
    ref::RecordStateBlocks(call, &state_idx, &num_accepted);
    EXPECT_EQ(FromBytes<int32_t>(r.state_idx.Read()), state_idx);
    EXPECT_EQ(FromBytes<int32_t>(r.num_accepted.Read()), num_accepted);
  }
};

TEST_P(RecordStateBlocksTest, MatchesReference) {
  for (bool remap : {false, true}) {
    SCOPED_TRACE(remap ? "request_indices" : "identity");
    RsbStep r = MakeRsb(/*rows=*/7, /*batch=*/remap ? 10 : 7, /*requests=*/12, remap);
    ASSERT_TRUE(CallOk(Run(r)));
    ExpectOwnerTableClear(r.workspace, r.requests);
    ExpectMatchesReference(r);
    // Some rows were skipped and some requests untouched.
    const std::vector<int32_t> state_idx = FromBytes<int32_t>(r.state_idx.Read());
    EXPECT_GT(std::count(state_idx.begin(), state_idx.end(), -777), 0);
  }
}

// The column of the block holding the last token, (n - 1) / bs with
// n = num_computed + num_sampled, capped at the table's last column.
TEST_P(RecordStateBlocksTest, RecordsTheBlockOfTheLastToken) {
  RsbStep r = MakeRsb(5, 5, 5, false);
  const int bs = r.block_size;
  r.idx_mapping = {2, 0, 1, 4, 3};
  r.num_computed = {0, 7, bs * 40, 2 * bs - 1, 2 * bs};
  r.num_sampled = {0, 1, 3, 1, 0};
  ASSERT_TRUE(CallOk(Run(r)));
  // Rows: n = 0 -> column 0; n = 8; far past the table -> width - 1;
  // n = 2 bs ends exactly on a boundary -> column 1, not 2; n = 2 bs with
  // nothing sampled -> column 1.
  EXPECT_EQ(FromBytes<int32_t>(r.state_idx.Read()),
            (std::vector<int32_t>{7 / bs, r.width - 1, 0, 1, 1}));
  EXPECT_EQ(FromBytes<int32_t>(r.num_accepted.Read()), (std::vector<int32_t>{1, 1, 1, 1, 1}));
  ExpectMatchesReference(r);
}

TEST_P(RecordStateBlocksTest, RejectsBadArguments) {
  RsbStep r = MakeRsb(5, 5, 6, false);
  CallData cd;
  const RecordStateBlocksArgs good = ArgsFor(r, &cd);
  const size_t need = RecordStateBlocksWorkspaceBytes(6);
  using A = RecordStateBlocksArgs;
  struct Case {
    const char* what;
    std::function<void(A&)> breaks;
    absl::StatusCode code;
    std::string message;
  };
  constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
  const std::vector<Case> cases = {
      {"negative rows", [](A& a) { a.num_rows = -1; }, kInvalid,
       "num_rows, batch and num_requests must not be negative"},
      {"negative requests", [](A& a) { a.num_requests = -1; }, kInvalid,
       "num_rows, batch and num_requests must not be negative"},
      {"block size 0", [](A& a) { a.mamba_block_size = 0; }, kInvalid,
       "mamba_block_size = 0 must be >= 1"},
      {"table width 0", [](A& a) { a.block_table_width = 0; }, kInvalid,
       "block_table_width = 0 must be >= 1"},
      {"batch under the rows", [](A& a) { a.batch = 4; }, absl::StatusCode::kOutOfRange,
       "without request_indices, the batch tensors need one entry per row: batch 4 < 5 rows"},
      {"idx_mapping null", [](A& a) { a.idx_mapping = nullptr; }, kInvalid,
       "idx_mapping, num_sampled and num_computed_tokens must be set"},
      {"outputs null", [](A& a) { a.num_accepted = nullptr; }, kInvalid,
       "the outputs state_idx and num_accepted must be set"},
      {"workspace too small", [need](A& a) { a.workspace_bytes = need - 1; }, kInvalid,
       absl::StrCat("workspace of ", need - 1, " bytes is smaller than the ", need, " bytes")},
      {"status null", [](A& a) { a.status = nullptr; }, kInvalid, "status is null"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    A args = good;
    c.breaks(args);
    const absl::Status status = kernels_->RecordStateBlocks(args, stream());
    EXPECT_EQ(status.code(), c.code) << status;
    EXPECT_THAT(std::string(status.message()), StartsWith("In RecordStateBlocks: "));
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.message));
    EXPECT_EQ(ValidateRecordStateBlocksArgs(args), status);
  }
  EXPECT_EQ(FirstDifference(r.state_idx.Read(), r.state_idx.host), -1);
  EXPECT_EQ(FirstDifference(r.num_accepted.Read(), r.num_accepted.host), -1);
}

TEST_P(RecordStateBlocksTest, DeviceChecksWriteNothing) {
  struct Case {
    const char* what;
    // Breaks one field; returns the message substring to expect.
    std::function<std::string(RsbStep&)> breaks;
    absl::StatusCode code;
  };
  const std::vector<Case> cases = {
      {"idx_mapping past the requests",
       [](RsbStep& r) {
         const int b = r.request_indices[2];
         r.idx_mapping[b] = r.requests;
         return absl::StrCat("idx_mapping[", b, "] = ", r.requests,
                             " is out of range: must be below ", r.requests, " (row 2)");
       },
       absl::StatusCode::kOutOfRange},
      {"two rows write one request row",
       [](RsbStep& r) {
         const int b1 = r.request_indices[1], b4 = r.request_indices[4];
         const int32_t v = UnusedRequestRow(r);
         r.idx_mapping[b1] = v;
         r.idx_mapping[b4] = v;
         return absl::StrCat("idx_mapping[", b4, "]: rows 1 and 4 both write request row ", v,
                             " in one call");
       },
       absl::StatusCode::kInvalidArgument},
      {"request index past the batch",
       [](RsbStep& r) {
         r.request_indices[3] = r.batch;
         return absl::StrCat("request_indices[3] = ", r.batch, " is out of range: must be below ",
                             r.batch, " (row 3)");
       },
       absl::StatusCode::kOutOfRange},
      {"negative request index",
       [](RsbStep& r) {
         r.request_indices[0] = -1;
         return std::string("request_indices[0] = -1 must not be negative (row 0)");
       },
       absl::StatusCode::kOutOfRange},
      {"negative num_computed_tokens",
       [](RsbStep& r) {
         const int b = r.request_indices[4];
         r.idx_mapping[b] = UnusedRequestRow(r);
         r.num_computed[b] = -3;
         return absl::StrCat("num_computed_tokens[", b, "] = -3 must not be negative (row 4)");
       },
       absl::StatusCode::kOutOfRange},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    RsbStep r = MakeRsb(6, 8, 9, /*remap=*/true);
    const std::vector<int32_t> idx_mapping = r.idx_mapping, request_indices = r.request_indices,
                               num_computed = r.num_computed;
    const std::string message = c.breaks(r);
    const CallResult result = Run(r);
    ASSERT_TRUE(result.launch.ok()) << result.launch;
    EXPECT_EQ(result.device.code(), c.code) << result.device;
    EXPECT_THAT(std::string(result.device.message()), StartsWith("In RecordStateBlocks: "));
    EXPECT_THAT(std::string(result.device.message()), HasSubstr(message));
    EXPECT_EQ(FirstDifference(r.state_idx.Read(), r.state_idx.host), -1);
    EXPECT_EQ(FirstDifference(r.num_accepted.Read(), r.num_accepted.host), -1);
    ExpectOwnerTableClear(r.workspace, r.requests);
    // The next valid call runs.
    r.idx_mapping = idx_mapping;
    r.request_indices = request_indices;
    r.num_computed = num_computed;
    ASSERT_TRUE(CallOk(Run(r)));
    ExpectOwnerTableClear(r.workspace, r.requests);
    ExpectMatchesReference(r);
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, RecordStateBlocksTest,
                         ::testing::Values(Backend::kCpu, Backend::kCuda), BackendParamName);

}  // namespace
}  // namespace testing
}  // namespace kernels
}  // namespace specstate
