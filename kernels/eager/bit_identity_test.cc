// Bit identity between the kernels, on every backend (memcmp, never a
// tolerance): verify's outputs are the stock kernel's; a committed state is
// the state the stock kernel stores for the same token, in mode none and in
// align mode; a row computes the same alone and in a batch of 256.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "kernels/kda_args.h"
#include "kernels/testing/kernel_harness.h"
#include "tests/reference/kda_reference.h"

namespace specstate {
namespace kernels {
namespace testing {
namespace {

namespace ref = ::specstate::reference;

TEST_P(KdaKernelsTest, VerifyOutputsEqualStockOutputs) {
  for (const Config& c : kConfigs) {
    StepSpec spec = SpecOf(c);
    spec.q = 5;
    for (int n = 0; n < 6; ++n) spec.tokens.push_back(rng().Int(0, spec.q));
    spec.sources = {1, 1, 0, 1, -4, 1};
    Step s = MakeStep(spec);
    SCOPED_TRACE(Describe(spec));
    // Stock as the commit's replay calls it: checkpoint at column Q.
    StockAndVerifyAll(s);
    // And as the stock spec path calls it: checkpoint at column 0, no
    // num_accepted_tokens.
    for (int n = 0; n < s.rows; ++n) std::swap(s.stock_indices[n][0], s.stock_indices[n][spec.q]);
    s.stock_accepted.clear();
    s.layers[0].stock_out.Write(s.layers[0].stock_out.host);  // poison again
    s.layers[0].stock_pool.Write(s.layers[0].stock_pool.host);
    ASSERT_TRUE(CallOk(RunStock(s, 0)));
    EXPECT_EQ(FirstDifference(s.layers[0].stock_out.Read(), s.layers[0].verify_out.Read()), -1)
        << "verify's outputs differ from the stock kernel's (checkpoint at column 0)";
  }
}

// The rows every commit test runs (mode none): full and partial acceptance,
// nothing accepted, more accepted than verified, no tokens, null
// checkpoints (0 and negative) and padding rows at the end.
struct CommitRow {
  int tokens;
  int32_t source;  // > 0: a fresh block
  int accepted;
};

std::vector<CommitRow> NoneModeRows(int Q, Random& rng) {
  return {
      {Q, 1, Q},                              // everything accepted
      {Q, 1, 1},                              // only the bonus token
      {Q, 1, 0},                              // nothing: state unchanged
      {std::max(Q - 2, 1), 1, Q + 3},         // more than verified: commit T_n
      {0, 1, 2},                              // no tokens
      {Q, 0, 2},                              // null checkpoint
      {Q - 1, -1, 2},                         // negative = null
      {Q, 1, rng.Int(1, Q)},                  // random
      {1, 1, -1},                             // negative accepted count
      {rng.Int(1, Q), 1, rng.Int(0, Q + 2)},  // random
      {0, 0, rng.Int(0, Q)},                  // cudagraph padding
      {0, 0, rng.Int(0, Q)},                  // cudagraph padding
  };
}

TEST_P(KdaKernelsTest, CommitEqualsStockState) {
  struct Trial {
    Config config;
    int q;
    int history;
    bool conv_token_major;
    bool remap;  // request_indices
    bool conv_dense = false;  // the service's conv layout
  };
  const Trial trials[] = {
      {{DType::kBFloat16, DType::kFloat32, 3, 64, true}, 4, 3, false, true},
      {{DType::kFloat16, DType::kBFloat16, 2, 64, true}, 3, 2, true, true},
      {{DType::kFloat32, DType::kFloat32, 1, 64, false}, 5, 3, false, false},
      {{DType::kFloat32, DType::kBFloat16, 2, 64, true}, 2, 3, true, true},
      {{DType::kBFloat16, DType::kBFloat16, 1, 128, true}, 4, 3, false, true},
      // The largest window (16 tokens) and conv history (16 columns).
      {{DType::kBFloat16, DType::kFloat32, 1, 64, true},
       kMaxSpecQueryLen,
       kMaxConvHistory,
       true,
       true},
      // No draft tokens: Q = 1, conv_kernel = 2.
      {{DType::kFloat16, DType::kFloat32, 2, 64, true}, 1, 1, false, true},
      // The service's conv layout (dense: CUDA's vector path): Kimi-Linear's
      // window (Q = 4, conv_kernel 4), fp32 activations, the largest window.
      {{DType::kBFloat16, DType::kFloat32, 3, 64, true}, 4, 3, false, true, true},
      {{DType::kFloat32, DType::kFloat32, 1, 64, false}, 5, 3, false, false, true},
      {{DType::kFloat16, DType::kFloat32, 1, 64, true}, kMaxSpecQueryLen, kMaxConvHistory, false,
       true, true},
  };
  for (const Trial& trial : trials) {
    StepSpec spec = SpecOf(trial.config);
    spec.q = trial.q;
    spec.num_layers = 3;  // different parameters and inputs each
    spec.history = trial.history;
    spec.conv_token_major = trial.conv_token_major;
    spec.conv_dense = trial.conv_dense;
    const std::vector<CommitRow> rows = NoneModeRows(spec.q, rng());
    const int n = static_cast<int>(rows.size());
    spec.batch = trial.remap ? n + 3 : n;
    std::vector<int32_t> batch_rows(spec.batch);
    for (int b = 0; b < spec.batch; ++b) batch_rows[b] = b;
    if (trial.remap) rng().Shuffle(&batch_rows);
    // Batch rows no spec row maps to hold counts that would break the plan.
    spec.num_accepted.assign(spec.batch, 1000);
    for (int i = 0; i < n; ++i) {
      spec.tokens.push_back(rows[i].tokens);
      spec.sources.push_back(rows[i].source);
      spec.num_accepted[batch_rows[i]] = rows[i].accepted;
      if (trial.remap) spec.request_indices.push_back(batch_rows[i]);
    }
    Step s = MakeStep(spec);
    SCOPED_TRACE(Describe(spec));

    StockAndVerifyAll(s);
    const Snapshot before = TakeSnapshot(s);
    ASSERT_TRUE(CallOk(RunCommit(s)));
    ExpectOwnerTableClear(s.commit_workspace, s.num_blocks);
    ExpectCommitMatchesStock(s, before);
  }
}

// Batch invariance: a row's outputs and committed state do not depend on the
// other rows or on N. Row 0 inside a step of 256 rows, then alone (N = 1,
// the same inputs and initial state), bit for bit.
TEST_P(KdaKernelsTest, ARowComputesTheSameAloneAndInABatchOf256) {
  StepSpec spec;
  spec.head_dim = 128;
  for (int n = 0; n < 256; ++n) {
    spec.tokens.push_back(rng().Int(1, spec.q));
    spec.sources.push_back(1);
    spec.num_accepted.push_back(rng().Int(1, spec.q));
  }
  Step s = MakeStep(spec);
  Layer& L = s.layers[0];
  const std::vector<uint8_t> initial = L.pool.Read();
  ASSERT_TRUE(CallOk(RunVerify(s, 0)));
  ASSERT_TRUE(CallOk(RunCommit(s)));
  const std::vector<uint8_t> batch_out = L.verify_out.Read();
  const std::vector<uint8_t> batch_pool = L.pool.Read();

  L.pool.Write(initial);
  L.verify_out.Write(std::vector<uint8_t>(batch_out.size(), 0x5a));
  s.rows = 1;
  s.batch = 1;
  s.qsl = {0, s.qsl[1]};
  s.sources = {s.sources[0]};
  s.num_accepted = {s.num_accepted[0]};
  ASSERT_TRUE(CallOk(RunVerify(s, 0)));
  ASSERT_TRUE(CallOk(RunCommit(s)));
  const size_t out_bytes = size_t(s.qsl[1]) * s.vw() * s.act_size();
  const std::vector<uint8_t> alone_out = L.verify_out.Read();
  EXPECT_EQ(FirstDifference(std::vector<uint8_t>(batch_out.begin(), batch_out.begin() + out_bytes),
                            std::vector<uint8_t>(alone_out.begin(), alone_out.begin() + out_bytes)),
            -1)
      << "row 0's outputs differ alone and in the batch";
  const size_t block_bytes = size_t(s.state_elems()) * s.state_size();
  const size_t at = size_t(s.sources[0]) * size_t(s.block_stride) * s.state_size();
  const std::vector<uint8_t> alone_pool = L.pool.Read();
  EXPECT_EQ(
      FirstDifference(
          std::vector<uint8_t>(batch_pool.begin() + at, batch_pool.begin() + at + block_bytes),
          std::vector<uint8_t>(alone_pool.begin() + at, alone_pool.begin() + at + block_bytes)),
      -1)
      << "row 0's committed state differs alone and in the batch";
}

// Align mode: each row's case is asserted on the reference plan first, so
// the test keeps covering what it says.
TEST_P(KdaKernelsTest, CommitAlignModeEqualsStockState) {
  constexpr int Q = 4, kBlockSize = 8, kWidth = 4;
  struct AlignRow {
    const char* what;
    int tokens;
    int32_t source;
    int accepted;
    int computed;
  };
  const AlignRow rows[] = {
      {"ends exactly on a boundary, all accepted", 4, 1, 4, 12},
      {"crosses a boundary mid-window", 4, 1, 3, 6},
      {"boundary at the last committed token", 4, 1, 3, 5},
      {"no crossing", 4, 1, 2, 16},
      {"final column capped at the table width", 4, 1, 2, 40},
      {"nothing accepted", 4, 1, 0, 6},
      {"crossing, final block = checkpoint", 4, 1, 4, 7},
      {"T < Q, crossing, more accepted than verified", 2, 1, 5, 15},
      {"null checkpoint", 4, 0, 3, 6},
      {"null final block", 4, 1, 2, 0},
      {"crossing into a null boundary block", 4, 1, 4, 6},
      {"padding", 0, 0, 2, 0},
  };
  // kConfigs[0] twice: conv padded [D, W], then dense (the service's layout).
  const std::pair<Config, bool> configs[] = {
      {kConfigs[0], false}, {kConfigs[0], true}, {kConfigs[3], false}};
  for (const auto& [c, conv_dense] : configs) {
    StepSpec spec = SpecOf(c);
    spec.q = Q;
    spec.num_layers = 2;
    spec.align = true;
    spec.block_size = kBlockSize;
    spec.width = kWidth;
    spec.conv_token_major = c.act == DType::kFloat16;
    spec.conv_dense = conv_dense;
    const int n = static_cast<int>(std::size(rows));
    spec.batch = n + 2;
    std::vector<int32_t> batch_rows(spec.batch);
    for (int b = 0; b < spec.batch; ++b) batch_rows[b] = b;
    rng().Shuffle(&batch_rows);
    spec.num_accepted.assign(spec.batch, 1000);
    spec.num_computed.assign(spec.batch, -1000);  // unused rows: never read
    for (int i = 0; i < n; ++i) {
      spec.tokens.push_back(rows[i].tokens);
      spec.sources.push_back(rows[i].source);
      spec.num_accepted[batch_rows[i]] = rows[i].accepted;
      spec.num_computed[batch_rows[i]] = rows[i].computed;
      spec.request_indices.push_back(batch_rows[i]);
    }
    Step s = MakeStep(spec);
    SCOPED_TRACE(Describe(spec));
    const auto table_row = [&](int i) -> std::vector<int32_t>& { return s.table[batch_rows[i]]; };
    table_row(6)[1] = s.sources[6];  // the final column holds the checkpoint
    table_row(9)[0] = 0;             // the final column is null
    table_row(10)[0] = 0;            // the boundary column is null

    const std::vector<ref::PlanRow> plan = ref::PlanCommit(RefCommitCall(s));
    const auto at = [&](int i, int col) { return table_row(i)[col]; };
    EXPECT_TRUE(plan[0].commit_len == 4 && plan[0].boundary_len == 4 &&
                plan[0].boundary_block == plan[0].final_block && plan[0].final_block == at(0, 1));
    EXPECT_TRUE(plan[1].boundary_len == 2 && plan[1].commit_len == 3 &&
                plan[1].boundary_block == at(1, 0) && plan[1].final_block == at(1, 1));
    EXPECT_TRUE(plan[2].boundary_len == 3 && plan[2].commit_len == 3 &&
                plan[2].final_block == at(2, 0) && plan[2].boundary_block == at(2, 0));
    EXPECT_TRUE(plan[3].boundary_block == 0 && plan[3].final_block == at(3, 2));
    EXPECT_TRUE(plan[4].boundary_block == 0 && plan[4].final_block == at(4, kWidth - 1));
    EXPECT_EQ(plan[5].commit_len, 0);
    EXPECT_TRUE(plan[6].boundary_len == 1 && plan[6].final_block == s.sources[6] &&
                plan[6].boundary_block == at(6, 0));
    EXPECT_TRUE(plan[7].commit_len == 2 && plan[7].boundary_len == 1 &&
                plan[7].boundary_block == at(7, 1) && plan[7].final_block == at(7, 2));
    EXPECT_EQ(plan[8].final_block, 0);
    EXPECT_TRUE(plan[9].commit_len == 2 && plan[9].final_block == 0);
    EXPECT_TRUE(plan[10].boundary_block == 0 && plan[10].commit_len == 4 &&
                plan[10].final_block == at(10, 1));

    StockAndVerifyAll(s);
    const Snapshot before = TakeSnapshot(s);
    ASSERT_TRUE(CallOk(RunCommit(s)));
    ExpectOwnerTableClear(s.commit_workspace, s.num_blocks);
    ExpectCommitMatchesStock(s, before);
  }
}

// Align mode with random rows, block size == Q, narrow tables.
TEST_P(KdaKernelsTest, CommitAlignModeRandomRows) {
  constexpr int Q = 3, kBlockSize = 3, kWidth = 5;
  for (int trial = 0; trial < 3; ++trial) {
    StepSpec spec = SpecOf(kConfigs[trial == 2 ? 4 : trial]);
    spec.q = Q;
    spec.history = 2;
    spec.align = true;
    spec.block_size = kBlockSize;
    spec.width = kWidth;
    const int n = 10;
    for (int i = 0; i < n; ++i) {
      const int tokens = rng().Int(0, Q);
      const int accepted = rng().Int(-1, Q + 1);
      const int commit_len = std::min({std::max(accepted, 0), tokens, Q});
      int computed;
      for (;;) {
        // Redraw what the kernels reject (a boundary past the table, or
        // boundary and final state in one block).
        computed = rng().Int(0, (kWidth + 1) * kBlockSize);
        if (commit_len == 0) break;
        const int next_boundary = (computed / kBlockSize + 1) * kBlockSize;
        if (computed + commit_len < next_boundary) break;
        const int boundary_col = next_boundary / kBlockSize - 1;
        const int final_col = std::min((computed + commit_len - 1) / kBlockSize, kWidth - 1);
        if (boundary_col < kWidth &&
            !(final_col == boundary_col && next_boundary - computed < commit_len)) {
          break;
        }
      }
      spec.tokens.push_back(tokens);
      spec.num_accepted.push_back(accepted);
      spec.num_computed.push_back(computed);
    }
    Step s = MakeStep(spec);
    SCOPED_TRACE(Describe(spec));
    StockAndVerifyAll(s);
    const Snapshot before = TakeSnapshot(s);
    ASSERT_TRUE(CallOk(RunCommit(s)));
    ExpectOwnerTableClear(s.commit_workspace, s.num_blocks);
    ExpectCommitMatchesStock(s, before);
  }
}

TEST_P(KdaKernelsTest, CommitOfNoRowsDoesNothing) {
  StepSpec spec;
  spec.tokens = {};
  Step s = MakeStep(spec);
  const Snapshot before = TakeSnapshot(s);
  EXPECT_TRUE(CallOk(RunCommit(s)));
  EXPECT_TRUE(CallOk(RunVerify(s, 0)));
  EXPECT_TRUE(CallOk(RunStock(s, 0)));
  ExpectSameBytes(before, TakeSnapshot(s));
}

}  // namespace
}  // namespace testing
}  // namespace kernels
}  // namespace specstate
