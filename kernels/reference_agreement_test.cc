// The kernels against the float64 reference in //tests/reference, on every
// backend, within Tolerance(): fp32 arithmetic, and one rounding of what is
// stored (docs/semantics.md). Stock, verify and commit on every layout of
// kConfigs, the reference's own 16-bit conversions against the kernels', and
// the CUDA backend against the CPU backend on the same inputs.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "kernels/kda_args.h"
#include "kernels/numeric.h"
#include "kernels/testing/kernel_harness.h"
#include "tests/reference/kda_reference.h"

namespace specstate {
namespace kernels {
namespace testing {
namespace {

namespace ref = ::specstate::reference;

// ---------------------------------------------------------------------------
// The reference.

TEST(ReferenceTest, ConversionsRoundLikeTheKernels) {
  // Every 16-bit pattern decodes alike.
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const uint16_t b = static_cast<uint16_t>(bits);
    const float want_bf16 = ToFloat(BFloat16{b});
    const float want_fp16 = ToFloat(Float16{b});
    if (std::isnan(want_bf16)) {
      EXPECT_TRUE(std::isnan(ref::BFloat16ToFloat(b))) << bits;
    } else {
      EXPECT_EQ(ref::BFloat16ToFloat(b), want_bf16) << bits;
    }
    if (std::isnan(want_fp16)) {
      EXPECT_TRUE(std::isnan(ref::Float16ToFloat(b))) << bits;
    } else {
      EXPECT_EQ(ref::Float16ToFloat(b), want_fp16) << bits;
    }
  }
  // Rounding: ties, subnormals, overflow and random floats of every scale.
  std::vector<float> values = {0.0f,        -0.0f,         1.0f,          65504.0f, 65519.0f,
                               65520.0f,    1e-8f,         6e-8f,         3e-8f,    1.00390625f,
                               1.01171875f, 1.0009765625f, 1.0029296875f, 3.4e38f,  -2.5e-41f,
                               INFINITY,    -INFINITY};
  std::mt19937 engine(12345);
  std::uniform_int_distribution<uint32_t> any_bits;
  for (int i = 0; i < 200000; ++i) {
    float f;
    const uint32_t u = any_bits(engine);
    std::memcpy(&f, &u, sizeof(f));
    if (!std::isnan(f)) values.push_back(f);
  }
  for (float f : values) {
    EXPECT_EQ(ref::BFloat16FromFloat(f), FromFloat<BFloat16>(f).bits) << f;
    EXPECT_EQ(ref::Float16FromFloat(f), FromFloat<Float16>(f).bits) << f;
  }
}

// ---------------------------------------------------------------------------
// Agreement with the float64 reference.

// Outputs against the reference: written tokens within Tolerance(act) as
// one tensor; tokens the reference leaves alone still poisoned.
void ExpectOutputs(const Step& s, const std::vector<uint8_t>& out, const std::vector<double>& want,
                   const std::vector<bool>& written) {
  const size_t per_token = static_cast<size_t>(s.vw());
  const size_t es = s.act_size();
  std::vector<double> got_values, want_values;
  for (int64_t t = 0; t < s.num_tokens; ++t) {
    const uint8_t* token = &out[t * per_token * es];
    if (!written[t]) {
      EXPECT_TRUE(IsPoison(s.shape.act_dtype, token, per_token))
          << "output token " << t << " was written";
      continue;
    }
    for (size_t i = 0; i < per_token; ++i) {
      got_values.push_back(ref::LoadElement(RefDtype(s.shape.act_dtype), token + i * es));
      want_values.push_back(want[t * per_token + i]);
    }
  }
  if (!want_values.empty()) {
    EXPECT_LT(RelativeError(got_values, want_values), Tolerance(s.shape.act_dtype))
        << "outputs vs the float64 reference";
    EXPECT_LT(ElementwiseError(got_values, want_values), Tolerance(s.shape.act_dtype))
        << "outputs vs the float64 reference, element-wise";
  }
}

TEST_P(KdaKernelsTest, StockMatchesReference) {
  for (const Config& c : kConfigs) {
    StepSpec spec = SpecOf(c);
    spec.tokens = {4, 2, 0, 4, 1, 3};
    spec.sources = {1, 1, 1, 0, 1, -1};  // rows 3 and 5 read a null block
    Step s = MakeStep(spec);
    SCOPED_TRACE(Describe(spec));
    const int Q = spec.q;
    // The checkpoint sits at a random column acc - 1 (num_accepted_tokens);
    // the row stores each token's state to its column, overwriting the
    // checkpoint when acc - 1 < T. Row 0 skips one column (null: not stored).
    for (int n = 0; n < s.rows; ++n) {
      const int acc = rng().Int(1, Q + 1);
      std::swap(s.stock_indices[n][acc - 1], s.stock_indices[n][Q]);
      s.stock_accepted[n] = acc;
    }
    s.stock_indices[0][s.stock_accepted[0] == 1 ? 1 : 0] = 0;

    const Layer& L = s.layers[0];
    ASSERT_TRUE(CallOk(RunStock(s, 0)));
    ExpectOwnerTableClear(s.stock_workspace, s.num_blocks);

    ref::StatePool model = L.initial_states;
    const ref::StockResult want =
        ref::Stock(RefShape(s), L.params, L.tokens, RefStockCall(s), &model);
    ExpectOutputs(s, L.stock_out.Read(), want.out, want.written);

    const std::vector<uint8_t> pool = L.stock_pool.Read();
    std::vector<uint8_t> rest = pool;  // the pool with the written blocks put back
    for (int n = 0; n < s.rows; ++n) {
      const int tokens = s.qsl[n + 1] - s.qsl[n];
      if (tokens == 0 || s.stock_indices[n][s.stock_accepted[n] - 1] <= 0) continue;
      for (int t = 0; t < tokens; ++t) {
        const int32_t block = s.stock_indices[n][t];
        if (block <= 0) continue;
        const std::vector<double> got = BlockValues(s, pool, block);
        EXPECT_LT(RelativeError(got, model.at(block)), Tolerance(s.shape.state_dtype))
            << "row " << n << ", state after token " << t << " (block " << block << ")";
        EXPECT_LT(ElementwiseError(got, model.at(block)), Tolerance(s.shape.state_dtype))
            << "row " << n << ", state after token " << t << " (block " << block
            << "), element-wise";
        SetBlockBytes(s, &rest, block, BlockBytes(s, L.stock_pool.host, block));
      }
    }
    EXPECT_EQ(FirstDifference(rest, L.stock_pool.host), -1) << "a block no row stores changed";
  }
}

TEST_P(KdaKernelsTest, VerifyMatchesReference) {
  for (const Config& c : kConfigs) {
    StepSpec spec = SpecOf(c);
    spec.tokens = {4, 2, 0, 4, 1, 3};
    spec.sources = {1, 1, 1, 0, 1, -1};
    Step s = MakeStep(spec);
    SCOPED_TRACE(Describe(spec));
    const Layer& L = s.layers[0];
    ASSERT_TRUE(CallOk(RunVerify(s, 0)));

    ref::Records records = ref::MakeRecords(RefShape(s), s.record_rows, spec.q);
    const ref::VerifyResult want =
        ref::Verify(RefShape(s), L.params, L.tokens, RefVerifyCall(s), L.initial_states, &records);
    ExpectOutputs(s, L.verify_out.Read(), want.out, want.written);

    // Records: raw copies, bit for bit, of the tokens verified; poison
    // elsewhere (rows with a null checkpoint, tokens past T_n, the spare row).
    const std::vector<uint8_t> kv = L.rec_kv.Read();
    const std::vector<uint8_t> g = L.rec_g.Read();
    const std::vector<uint8_t> beta = L.rec_beta.Read();
    const size_t es = s.act_size();
    const size_t hk_bytes = s.hk() * es, vw_bytes = s.vw() * es, gw_bytes = s.gw() * es;
    const size_t h_bytes = s.hv() * es;
    for (size_t r = 0; r < records.source_token.size(); ++r) {
      const int64_t src = records.source_token[r];
      const uint8_t* rk = &kv[r * (hk_bytes + vw_bytes)];
      const uint8_t* rv = rk + hk_bytes;
      const uint8_t* rg = &g[r * gw_bytes];
      const uint8_t* rb = &beta[r * h_bytes];
      if (src < 0) {
        const DType act = s.shape.act_dtype;
        EXPECT_TRUE(IsPoison(act, rk, s.hk() + s.vw()) && IsPoison(act, rg, s.gw()) &&
                    IsPoison(act, rb, s.hv()))
            << "record token " << r << " was written";
        continue;
      }
      EXPECT_EQ(std::memcmp(rk, &L.proj.host[(L.k_off + src * L.proj_stride) * es], hk_bytes), 0)
          << "record token " << r << ": k";
      EXPECT_EQ(std::memcmp(rv, &L.proj.host[(L.v_off + src * L.v_stride) * es], vw_bytes), 0)
          << "record token " << r << ": v";
      EXPECT_EQ(std::memcmp(rg, &L.g.host[src * gw_bytes], gw_bytes), 0)
          << "record token " << r << ": g";
      EXPECT_EQ(std::memcmp(rb, &L.beta.host[(L.beta_off + src * L.beta_stride) * es], h_bytes), 0)
          << "record token " << r << ": beta";
    }
    EXPECT_EQ(FirstDifference(L.pool.Read(), L.pool.host), -1) << "verify wrote state";
  }
}

TEST_P(KdaKernelsTest, CommitMatchesReference) {
  const Config configs[] = {kConfigs[1], kConfigs[2], kConfigs[4], kConfigs[6]};
  for (const Config& c : configs) {
    for (bool align : {false, true}) {
      StepSpec spec = SpecOf(c);
      spec.num_layers = 2;
      spec.tokens = {4, 3, 4, 0, 4, 2};
      spec.sources = {1, 1, 1, 1, 0, 1};
      spec.num_accepted = {4, 2, 1, 3, 2, 5};
      if (align) {
        spec.align = true;
        spec.block_size = 8;
        spec.width = 4;
        spec.num_computed = {5, 6, 13, 0, 3, 23};
      }
      Step s = MakeStep(spec);
      SCOPED_TRACE(Describe(spec));
      StockAndVerifyAll(s);
      ASSERT_TRUE(CallOk(RunCommit(s)));

      std::vector<ref::Records> records;
      std::vector<ref::StatePool> states;
      std::vector<ref::ConvPool> convs;
      for (const Layer& L : s.layers) {
        records.push_back(ref::MakeRecords(RefShape(s), s.record_rows, spec.q));
        ref::Verify(RefShape(s), L.params, L.tokens, RefVerifyCall(s), L.initial_states,
                    &records.back());
        states.push_back(L.initial_states);
        convs.push_back(RefConv(s, L.conv.host));
      }
      std::vector<ref::CommitLayer> model;
      for (int l = 0; l < spec.num_layers; ++l) {
        model.push_back(ref::CommitLayer{s.layers[l].params, &records[l], &states[l], &convs[l]});
      }
      const std::vector<ref::PlanRow> plan =
          ref::Commit(RefShape(s), RefCommitCall(s), s.history(), &model);
      for (int l = 0; l < spec.num_layers; ++l) {
        const std::vector<uint8_t> pool = s.layers[l].pool.Read();
        int compared = 0;
        for (int i = 0; i < s.rows; ++i) {
          const ref::PlanRow& p = plan[i];
          if (!Commits(p)) continue;
          std::vector<int32_t> blocks = {p.final_block};
          if (p.boundary_block > 0) blocks.push_back(p.boundary_block);
          for (int32_t block : blocks) {
            const std::vector<double> got = BlockValues(s, pool, block);
            EXPECT_LT(RelativeError(got, states[l].at(block)), Tolerance(s.shape.state_dtype))
                << "layer " << l << ", row " << i << ", block " << block;
            EXPECT_LT(ElementwiseError(got, states[l].at(block)), Tolerance(s.shape.state_dtype))
                << "layer " << l << ", row " << i << ", block " << block << ", element-wise";
            ++compared;
          }
        }
        EXPECT_GE(compared, 4) << "the plan should commit most rows";
        EXPECT_TRUE(RefConv(s, s.layers[l].conv.Read()).elements == convs[l].elements)
            << "layer " << l << ": conv pool differs from the reference";
      }
    }
  }
}

// K = 256, the largest head: stock vs reference, verify vs stock, commit vs
// stock, both modes.
TEST_P(KdaKernelsTest, LargestHeadDim) {
  for (bool align : {false, true}) {
    StepSpec spec = SpecOf({DType::kBFloat16, DType::kBFloat16, 2, 256, true});
    spec.tokens = {4, 3, 4};
    spec.num_accepted = {3, 2, 4};
    if (align) {
      spec.align = true;
      spec.block_size = 4;
      spec.width = 3;
      spec.num_computed = {2, 0, 4};
    }
    Step s = MakeStep(spec);
    SCOPED_TRACE(Describe(spec));
    StockAndVerifyAll(s);
    ref::StatePool model = s.layers[0].initial_states;
    const ref::StockResult want =
        ref::Stock(RefShape(s), s.layers[0].params, s.layers[0].tokens, RefStockCall(s), &model);
    ExpectOutputs(s, s.layers[0].stock_out.Read(), want.out, want.written);
    const Snapshot before = TakeSnapshot(s);
    ASSERT_TRUE(CallOk(RunCommit(s)));
    ExpectCommitMatchesStock(s, before);
  }
}

// ---------------------------------------------------------------------------
// The CUDA backend against the CPU backend.

// The CUDA backend agrees with the CPU backend on the same inputs (not bit
// for bit: their reductions over K run in other orders, and exp differs by
// an ulp), to about 1e-6 relative, bounded here by the fp32 compute budget
// plus one rounding of what is stored.
// Instantiated for the CUDA backend only: a GPU suite skips nothing.
class CudaAgreementTest : public KdaKernelsTest {
 protected:
  // A copy of `s` whose buffers live in this backend's memory (same bytes).
  Step CopyStep(const Step& s) {
    const auto copy = [&](const Tensor& t) {
      Tensor c = Upload(t.Read());
      c.host = t.host;
      return c;
    };
    Step c;
    c.spec = s.spec;
    c.shape = s.shape;
    c.rows = s.rows;
    c.batch = s.batch;
    c.record_rows = s.record_rows;
    c.num_tokens = s.num_tokens;
    c.num_tokens_arg = s.num_tokens_arg;
    c.num_blocks = s.num_blocks;
    c.block_stride = s.block_stride;
    c.conv_width = s.conv_width;
    c.conv_block_stride = s.conv_block_stride;
    c.conv_dim_stride = s.conv_dim_stride;
    c.conv_token_stride = s.conv_token_stride;
    Metadata::Of(s).RestoreTo(&c);
    c.block_size = s.block_size;
    for (const Layer& L : s.layers) {
      Layer n;
      n.proj = copy(L.proj);
      n.g = copy(L.g);
      n.beta = copy(L.beta);
      n.a_log = copy(L.a_log);
      n.dt_bias = copy(L.dt_bias);
      n.q_off = L.q_off;
      n.k_off = L.k_off;
      n.v_off = L.v_off;
      n.proj_stride = L.proj_stride;
      n.v_stride = L.v_stride;
      n.beta_off = L.beta_off;
      n.beta_stride = L.beta_stride;
      n.tokens = L.tokens;
      n.params = L.params;
      n.stock_pool = copy(L.stock_pool);
      n.pool = copy(L.pool);
      n.initial_states = L.initial_states;
      n.conv = copy(L.conv);
      n.conv_sequence = L.conv_sequence;
      n.rec_kv = copy(L.rec_kv);
      n.rec_g = copy(L.rec_g);
      n.rec_beta = copy(L.rec_beta);
      n.stock_out = copy(L.stock_out);
      n.verify_out = copy(L.verify_out);
      c.layers.push_back(std::move(n));
    }
    c.stock_workspace = copy(s.stock_workspace);
    c.commit_workspace = copy(s.commit_workspace);
    c.status = copy(s.status);
    return c;
  }

  StockArgs StockArgsFor(Step& s, int l, CallData* cd);
  VerifyArgs VerifyArgsFor(Step& s, int l, CallData* cd);
  CommitArgs CommitArgsFor(Step& s, CallData* cd);
};

TEST_P(CudaAgreementTest, CudaAgreesWithCpu) {
  for (const Config& c : {kConfigs[0], kConfigs[4], kConfigs[6], kConfigs[7], kConfigs[8],
                          kConfigs[9], kConfigs[11]}) {
    StepSpec spec = SpecOf(c);
    spec.num_layers = 2;
    spec.tokens = {4, 1, 3, 2, 4};
    Step cuda = MakeStep(spec);
    SCOPED_TRACE(Describe(spec));
    Step cpu;
    OnCpu([&] { cpu = CopyStep(cuda); });
    for (int l = 0; l < spec.num_layers; ++l) {
      ASSERT_TRUE(CallOk(RunVerify(cuda, l)));
      OnCpu([&] { ASSERT_TRUE(CallOk(RunVerify(cpu, l))); });
      const std::vector<uint8_t> a = cuda.layers[l].verify_out.Read();
      const std::vector<uint8_t> b = cpu.layers[l].verify_out.Read();
      std::vector<double> va, vb;
      const size_t es = cuda.act_size();
      for (int64_t t = 0; t < cuda.qsl.back() * cuda.vw(); ++t) {
        va.push_back(ref::LoadElement(RefDtype(spec.act), &a[t * es]));
        vb.push_back(ref::LoadElement(RefDtype(spec.act), &b[t * es]));
      }
      EXPECT_LT(RelativeError(va, vb), Tolerance(spec.act)) << "verify outputs, layer " << l;
    }
    ASSERT_TRUE(CallOk(RunCommit(cuda)));
    OnCpu([&] { ASSERT_TRUE(CallOk(RunCommit(cpu))); });
    for (int l = 0; l < spec.num_layers; ++l) {
      const std::vector<uint8_t> a = cuda.layers[l].pool.Read();
      const std::vector<uint8_t> b = cpu.layers[l].pool.Read();
      for (int32_t block : cuda.sources) {
        if (block <= 0) continue;
        EXPECT_LT(RelativeError(BlockValues(cuda, a, block), BlockValues(cpu, b, block)),
                  Tolerance(spec.state))
            << "committed state, layer " << l << ", block " << block;
      }
      // Conv compaction is a copy: bit for bit.
      EXPECT_EQ(FirstDifference(cuda.layers[l].conv.Read(), cpu.layers[l].conv.Read()), -1)
          << "conv pool, layer " << l;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, CudaAgreementTest, ::testing::Values(Backend::kCuda),
                         BackendParamName);

}  // namespace
}  // namespace testing
}  // namespace kernels
}  // namespace specstate
