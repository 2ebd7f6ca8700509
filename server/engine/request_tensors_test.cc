// The request-tensor rules against host memory: index tensors inline and in
// regions, a Verify's activations by layer kind, bindings, Commit's and
// RecordStateBlocks' inputs, aliasing, pins and retry fingerprints. Sizes
// and offsets are drawn afresh from the test's random seed.
#include "server/engine/request_tensors.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/testing/host_region_for_test.h"
#include "server/engine/regions.h"

namespace specstate {
namespace server {
namespace {

using ::testing::HasSubstr;

void ExpectError(const absl::Status& status, absl::StatusCode code, const std::string& substring) {
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(substring));
}

v1::RegionTensor Tensor(const std::string& region, uint64_t offset, v1::DType dtype,
                        const std::vector<int64_t>& shape) {
  v1::RegionTensor t;
  t.set_region(region);
  t.set_dtype(dtype);
  t.set_offset_bytes(offset);
  for (int64_t d : shape) t.add_shape(d);
  return t;
}

v1::IndexTensor Inline(const std::vector<int32_t>& values, const std::vector<int64_t>& shape = {}) {
  v1::IndexTensor t;
  for (int32_t v : values) t.mutable_values()->add_values(v);
  for (int64_t d : shape) t.mutable_values()->add_shape(d);
  return t;
}

v1::IndexTensor InRegion(const std::string& region, uint64_t offset,
                         const std::vector<int64_t>& shape) {
  v1::IndexTensor t;
  *t.mutable_region() = Tensor(region, offset, v1::INT32, shape);
  return t;
}

class RequestTensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    rng_.seed(::testing::UnitTest::GetInstance()->random_seed());
    registry_.OpenSession(session_);
    ASSERT_TRUE(registry_.Register(session_, "acts", std::make_unique<HostRegion>(kBytes)).ok());
  }

  int Draw(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }

  // A Verify of `tokens` tokens over `rows` rows, every tensor packed one
  // after the other in region "acts" from a random 16-byte-aligned offset.
  v1::VerifyRequest VerifyOf(const kernels::KdaShape& shape, int tokens, int rows) {
    const int H = shape.num_heads, HV = kernels::ValueHeads(shape), K = shape.head_dim;
    uint64_t offset = 16 * Draw(0, 8);
    const auto next = [&](const std::vector<int64_t>& dims, v1::DType dtype, int size) {
      v1::RegionTensor t = Tensor("acts", offset, dtype, dims);
      int64_t count = 1;
      for (int64_t d : dims) count *= d;
      offset += (count * size + 15) / 16 * 16;
      return t;
    };
    v1::VerifyRequest req;
    *req.mutable_q() = next({tokens, H, K}, v1::BF16, 2);
    *req.mutable_k() = next({tokens, H, K}, v1::BF16, 2);
    *req.mutable_v() = next({tokens, HV, K}, v1::BF16, 2);
    *req.mutable_g() = shape.kind == kernels::LayerKind::kGdn ? next({tokens, HV}, v1::BF16, 2)
                                                              : next({tokens, H, K}, v1::BF16, 2);
    *req.mutable_beta() = next({tokens, HV}, v1::BF16, 2);
    *req.mutable_o() = next({tokens, HV, K}, v1::BF16, 2);
    *req.mutable_query_start_loc() =
        InRegion("acts", next({rows + 1}, v1::INT32, 4).offset_bytes(), {rows + 1});
    *req.mutable_state_indices() =
        InRegion("acts", next({rows}, v1::INT32, 4).offset_bytes(), {rows});
    EXPECT_LE(offset, kBytes);
    return req;
  }

  kernels::KdaShape Kda() const {
    kernels::KdaShape shape;
    shape.num_heads = 2;
    shape.head_dim = 64;
    return shape;
  }
  kernels::KdaShape Gdn() const {
    kernels::KdaShape shape = Kda();
    shape.kind = kernels::LayerKind::kGdn;
    shape.num_value_heads = 4;
    return shape;
  }

  static constexpr uint64_t kBytes = 1 << 20;
  std::mt19937_64 rng_;
  const std::string session_ = "s1";
  RegionRegistry registry_;
};

TEST_F(RequestTensorsTest, InlineIndexFollowsItsShapeRules) {
  RegionLookup lookup(registry_, session_);
  const int rows = Draw(1, 9);
  std::vector<int32_t> values(rows);
  for (int32_t& v : values) v = Draw(0, 1000);
  absl::StatusOr<IndexInput> in = ResolveIndex(lookup, Inline(values), "num_accepted", {rows});
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_TRUE(in->present);
  EXPECT_EQ(in->rows, rows);
  EXPECT_EQ(in->values, values);
  EXPECT_EQ(in->data, nullptr);  // uploaded when the work is enqueued

  ExpectError(ResolveIndex(lookup, Inline(values), "num_accepted", {rows + 1}).status(),
              absl::StatusCode::kInvalidArgument,
              absl::StrCat("num_accepted: has ", rows, " rows, expected ", rows + 1));
  ExpectError(ResolveIndex(lookup, Inline(values, {1, rows}), "num_accepted", {}).status(),
              absl::StatusCode::kInvalidArgument, "num_accepted: inline values have rank 2");
  ExpectError(ResolveIndex(lookup, Inline(values, {rows + 1}), "idx", {}).status(),
              absl::StatusCode::kInvalidArgument,
              absl::StrCat("idx: shape holds ", rows + 1, " values but ", rows, " are given"));
  IndexSpec matrix;
  matrix.allow_2d = true;
  values.resize(2 * rows);
  in = ResolveIndex(lookup, Inline(values, {rows, 2}), "block_table", matrix);
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_EQ(in->cols, 2);
  EXPECT_EQ(in->row_stride, 2);

  absl::StatusOr<IndexInput> absent = ResolveIndex(lookup, v1::IndexTensor(), "num_sampled", {});
  ASSERT_TRUE(absent.ok());
  EXPECT_FALSE(absent->present);
  ExpectError(RequireIndex(*absent, "num_sampled"), absl::StatusCode::kInvalidArgument,
              "num_sampled is required");
}

TEST_F(RequestTensorsTest, RegionIndexPointsIntoTheRegionAndPinsIt) {
  RegionLookup lookup(registry_, session_);
  // At least two rows: one row with a stride is still dense (the strided
  // column below would pass as num_accepted).
  const int rows = Draw(2, 64);
  const uint64_t offset = 4 * Draw(0, 1000);
  absl::StatusOr<IndexInput> in =
      ResolveIndex(lookup, InRegion("acts", offset, {rows}), "idx_mapping", {});
  ASSERT_TRUE(in.ok()) << in.status();
  const Region* region = *lookup.Find("acts");
  EXPECT_EQ(reinterpret_cast<const char*>(in->data), static_cast<const char*>(region->data()) + offset);
  EXPECT_EQ(in->rows, rows);
  EXPECT_EQ(in->span.end - in->span.begin, uint64_t(rows) * 4);

  // A column of a 2-D table ([rows] with a row stride) only where allowed.
  v1::IndexTensor column = InRegion("acts", offset, {rows});
  column.mutable_region()->add_strides(3);
  ExpectError(ResolveIndex(lookup, column, "num_accepted", {}).status(),
              absl::StatusCode::kInvalidArgument, "num_accepted");
  IndexSpec strided;
  strided.strided_1d = true;
  in = ResolveIndex(lookup, column, "state_indices", strided);
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_EQ(in->row_stride, 3);

  // Past the region's end: refused, naming the field.
  EXPECT_FALSE(ResolveIndex(lookup, InRegion("acts", kBytes - 4, {rows + 1}), "idx_mapping", {}).ok());
  ExpectError(ResolveIndex(lookup, InRegion("nope", 0, {rows}), "idx_mapping", {}).status(),
              absl::StatusCode::kNotFound, "nope");

  std::vector<RegionPin> pins = lookup.TakePins();
  ASSERT_EQ(pins.size(), 1u);  // one pin per region, however many tensors
  EXPECT_EQ(pins[0]->name(), "acts");
}

TEST_F(RequestTensorsTest, AliasingIsFoundAndNamed) {
  const uint64_t base = Draw(0, 1 << 16);
  const MemoryObject object{MemoryObject::kHost, 42, 0};
  const ByteSpan out{object, base, base + 64};
  NamedSpans others = {{"q", ByteSpan{object, base + 64, base + 128}},
                       {"wait.doorbell", ByteSpan{object, base - 4, base + 1}}};
  ExpectError(CheckNoAlias("o", out, others), absl::StatusCode::kInvalidArgument,
              "o overlaps wait.doorbell");
  others.pop_back();
  EXPECT_TRUE(CheckNoAlias("o", out, others).ok());  // adjacent is not overlapping
  const ByteSpan elsewhere{MemoryObject{MemoryObject::kHost, 43, 0}, base, base + 64};
  EXPECT_TRUE(CheckNoAlias("o", elsewhere, {{"q", out}}).ok());
}

TEST_F(RequestTensorsTest, UniquePinsKeepsEachRegionOnce) {
  RegionPin acts = *registry_.Find(session_, "acts");
  std::vector<RegionPin> pins(Draw(1, 5), acts);
  pins.push_back(nullptr);
  std::shared_ptr<std::vector<RegionPin>> unique = UniquePins(pins);
  ASSERT_EQ(unique->size(), 1u);
  EXPECT_EQ((*unique)[0], acts);
}

TEST_F(RequestTensorsTest, FingerprintIgnoresOnlyTheOrdering) {
  v1::CommitRequest req;
  req.set_step(Draw(1, 1000));
  *req.mutable_num_accepted() = Inline({Draw(0, 3), Draw(0, 3)});
  const uint64_t first = Fingerprint(req);
  v1::CommitRequest retry = req;
  retry.set_ordering(v1::ASYNC);
  retry.mutable_wait()->mutable_doorbell()->set_value(Draw(1, 100));
  EXPECT_EQ(Fingerprint(retry), first);
  retry.mutable_num_accepted()->mutable_values()->set_values(0, 7);
  EXPECT_NE(Fingerprint(retry), first);
  retry = req;
  retry.set_step(req.step() + 1);
  EXPECT_NE(Fingerprint(retry), first);
}

TEST_F(RequestTensorsTest, VerifyInputsFollowTheLayerKind) {
  for (const kernels::KdaShape& shape : {Kda(), Gdn()}) {
    SCOPED_TRACE(shape.kind == kernels::LayerKind::kGdn ? "GDN" : "KDA");
    const int tokens = Draw(1, 16), rows = Draw(1, 4);
    RegionLookup lookup(registry_, session_);
    v1::VerifyRequest req = VerifyOf(shape, tokens, rows);
    absl::StatusOr<VerifyInputs> in = ResolveVerifyInputs(lookup, req, shape, rows);
    ASSERT_TRUE(in.ok()) << in.status();
    EXPECT_EQ(in->num_tokens, tokens);
    EXPECT_EQ(in->q.token_stride, shape.num_heads * shape.head_dim);
    EXPECT_EQ(in->v.token_stride, kernels::ValueWidth(shape));
    EXPECT_EQ(in->g.token_stride, kernels::GateWidth(shape));
    EXPECT_EQ(in->beta.token_stride, kernels::ValueHeads(shape));
    EXPECT_EQ(in->input_spans.size(), 7u);  // q, k, v, g, beta and the two index tensors
    EXPECT_TRUE(CheckNoAlias("o", in->out_span, in->input_spans).ok());
    EXPECT_EQ(in->pins.size(), 1u);

    // The other kind's gate shape is refused, naming g.
    v1::VerifyRequest wrong_gate = req;
    *wrong_gate.mutable_g() =
        shape.kind == kernels::LayerKind::kGdn ? req.q() : req.beta();
    ExpectError(ResolveVerifyInputs(lookup, wrong_gate, shape, rows).status(),
                absl::StatusCode::kInvalidArgument, "g");
    // v per value head: a GDN v shaped like q is refused.
    if (shape.kind == kernels::LayerKind::kGdn) {
      v1::VerifyRequest wrong_v = req;
      *wrong_v.mutable_v() = req.q();
      ExpectError(ResolveVerifyInputs(lookup, wrong_v, shape, rows).status(),
                  absl::StatusCode::kInvalidArgument, "v");
    }
    v1::VerifyRequest tokens_differ = req;
    tokens_differ.set_num_tokens(tokens + 1);
    ExpectError(ResolveVerifyInputs(lookup, tokens_differ, shape, rows).status(),
                absl::StatusCode::kInvalidArgument,
                absl::StrCat("num_tokens = ", tokens + 1, " differs from q's first dimension"));
    v1::VerifyRequest half = req;
    half.clear_state_indices();
    ExpectError(ResolveVerifyInputs(lookup, half, shape, rows).status(),
                absl::StatusCode::kInvalidArgument, "give query_start_loc and state_indices together");
    ExpectError(ResolveVerifyInputs(lookup, req, shape, rows + 1).status(),
                absl::StatusCode::kInvalidArgument, "query_start_loc: has");
  }
}

TEST_F(RequestTensorsTest, BindingHoldsCapacityAndFailsOnceItsRegionGoes) {
  const kernels::KdaShape shape = Gdn();
  const int tokens = Draw(2, 16), rows = Draw(2, 8);
  v1::VerifyRequest full = VerifyOf(shape, tokens, rows);
  v1::BindVerifyInputsRequest bind;
  *bind.mutable_q() = full.q();
  *bind.mutable_k() = full.k();
  *bind.mutable_v() = full.v();
  *bind.mutable_g() = full.g();
  *bind.mutable_beta() = full.beta();
  *bind.mutable_o() = full.o();
  *bind.mutable_query_start_loc() = full.query_start_loc();
  *bind.mutable_state_indices() = full.state_indices();
  absl::StatusOr<std::shared_ptr<BoundInputs>> bound;
  {
    RegionLookup lookup(registry_, session_);
    bound = ResolveBinding(lookup, bind, shape, /*max_rows=*/rows - 1, session_);
  }
  ASSERT_TRUE(bound.ok()) << bound.status();
  EXPECT_EQ((*bound)->max_tokens, tokens);
  EXPECT_EQ((*bound)->max_rows, rows - 1);  // capped by the layout's max_rows

  v1::VerifyRequest req;
  req.set_bound_inputs(true);
  req.set_num_tokens(tokens - 1);
  absl::StatusOr<VerifyInputs> in = InputsFromBinding(bound->get(), req, session_, rows - 1);
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_EQ(in->num_tokens, tokens - 1);
  EXPECT_EQ(in->query_start_loc.rows, rows);
  EXPECT_EQ(in->pins.size(), 1u);

  ExpectError(InputsFromBinding(bound->get(), req, session_, rows).status(),
              absl::StatusCode::kOutOfRange, absl::StrCat("num_rows = ", rows));
  req.set_num_tokens(tokens + 1);
  ExpectError(InputsFromBinding(bound->get(), req, session_, 1).status(),
              absl::StatusCode::kOutOfRange, absl::StrCat("hold ", tokens, " tokens"));
  req.set_num_tokens(1);
  ExpectError(InputsFromBinding(bound->get(), req, "s2", 1).status(),
              absl::StatusCode::kFailedPrecondition, "no bound inputs in this session");
  ExpectError(InputsFromBinding(nullptr, req, session_, 1).status(),
              absl::StatusCode::kFailedPrecondition, "call BindVerifyInputs first");
  v1::VerifyRequest names_own = req;
  *names_own.mutable_q() = full.q();
  ExpectError(InputsFromBinding(bound->get(), names_own, session_, 1).status(),
              absl::StatusCode::kInvalidArgument, "leave q, k, v");

  ASSERT_TRUE(registry_.Unregister(session_, "acts", [] {}).ok());
  ExpectError(InputsFromBinding(bound->get(), req, session_, 1).status(),
              absl::StatusCode::kFailedPrecondition, "region \"acts\", which was unregistered");

  // Inline index tensors cannot be bound.
  *bind.mutable_query_start_loc() = Inline({0, 1});
  RegionLookup lookup(registry_, session_);
  ExpectError(ResolveBinding(lookup, bind, shape, rows, session_).status(),
              absl::StatusCode::kInvalidArgument, "query_start_loc: a binding's index tensors");
}

TEST_F(RequestTensorsTest, CommitIndicesFollowTheCacheMode) {
  v1::Layout layout;
  layout.set_max_rows(Draw(2, 16));
  const int batch = Draw(1, layout.max_rows());
  std::vector<int32_t> accepted(batch);
  for (int32_t& a : accepted) a = Draw(0, 3);
  v1::CommitRequest req;
  *req.mutable_num_accepted() = Inline(accepted);
  RegionLookup lookup(registry_, session_);
  absl::StatusOr<CommitIndices> in = ResolveCommitIndices(lookup, req, layout);
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_EQ(in->batch(), batch);
  EXPECT_FALSE(in->request_indices.present);

  v1::CommitRequest aligned = req;
  *aligned.mutable_block_table() = Inline(std::vector<int32_t>(2 * batch, 1), {batch, 2});
  *aligned.mutable_num_computed_tokens() = Inline(std::vector<int32_t>(batch, 5));
  ExpectError(ResolveCommitIndices(lookup, aligned, layout).status(),
              absl::StatusCode::kInvalidArgument, "this service runs cache_mode NONE");
  layout.set_cache_mode(v1::ALIGN);
  ExpectError(ResolveCommitIndices(lookup, req, layout).status(),
              absl::StatusCode::kInvalidArgument, "cache_mode ALIGN: block_table");
  in = ResolveCommitIndices(lookup, aligned, layout);
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_EQ(in->block_table.cols, 2);
  *aligned.mutable_num_computed_tokens() = Inline(std::vector<int32_t>(batch + 1, 5));
  ExpectError(ResolveCommitIndices(lookup, aligned, layout).status(),
              absl::StatusCode::kInvalidArgument, "num_computed_tokens: has");

  *req.mutable_num_accepted() = Inline(std::vector<int32_t>(layout.max_rows() + 1, 1));
  ExpectError(ResolveCommitIndices(lookup, req, layout).status(), absl::StatusCode::kOutOfRange,
              absl::StrCat("a batch has at most ", layout.max_rows(), " (max_rows)"));
  ExpectError(ResolveCommitIndices(lookup, v1::CommitRequest(), layout).status(),
              absl::StatusCode::kInvalidArgument, "num_accepted is required");
}

TEST_F(RequestTensorsTest, RecordOutputsMayAliasNothing) {
  v1::Layout layout;
  layout.set_max_rows(Draw(2, 16));
  const int batch = Draw(1, layout.max_rows());
  v1::RecordStateBlocksRequest req;
  *req.mutable_idx_mapping() = InRegion("acts", 0, {batch});
  *req.mutable_num_sampled() = Inline(std::vector<int32_t>(batch, 1));
  *req.mutable_num_computed_tokens() = Inline(std::vector<int32_t>(batch, 4));
  req.set_block_table_width(Draw(1, 8));
  const uint64_t out = 4096 + 4 * Draw(0, 100);
  *req.mutable_state_idx() = Tensor("acts", out, v1::INT32, {batch});
  *req.mutable_num_accepted() = Tensor("acts", out + 4 * batch, v1::INT32, {batch});
  RegionLookup lookup(registry_, session_);
  absl::StatusOr<RecordIndices> in = ResolveRecordIndices(lookup, req, layout);
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_TRUE(CheckRecordOutputsAlias(*in, {}).ok());
  const NamedSpans doorbell = {{"signal.doorbell", in->num_accepted.span}};
  ExpectError(CheckRecordOutputsAlias(*in, doorbell), absl::StatusCode::kInvalidArgument,
              "num_accepted overlaps signal.doorbell");

  v1::RecordStateBlocksRequest overlapping = req;
  *overlapping.mutable_num_accepted() = req.state_idx();
  in = ResolveRecordIndices(lookup, overlapping, layout);
  ASSERT_TRUE(in.ok()) << in.status();
  ExpectError(CheckRecordOutputsAlias(*in, {}), absl::StatusCode::kInvalidArgument,
              "num_accepted overlaps state_idx");
  *overlapping.mutable_state_idx() = Tensor("acts", 0, v1::INT32, {batch});
  in = ResolveRecordIndices(lookup, overlapping, layout);
  ASSERT_TRUE(in.ok()) << in.status();
  ExpectError(CheckRecordOutputsAlias(*in, {}), absl::StatusCode::kInvalidArgument,
              "state_idx overlaps idx_mapping");

  v1::RecordStateBlocksRequest no_width = req;
  no_width.set_block_table_width(0);
  ExpectError(ResolveRecordIndices(lookup, no_width, layout).status(),
              absl::StatusCode::kInvalidArgument, "block_table_width = 0 must be >= 1");
  v1::RecordStateBlocksRequest no_sampled = req;
  no_sampled.clear_num_sampled();
  ExpectError(ResolveRecordIndices(lookup, no_sampled, layout).status(),
              absl::StatusCode::kInvalidArgument, "num_sampled is required");
}

TEST_F(RequestTensorsTest, BatchCoversItsStep) {
  const int step_rows = Draw(2, 32);
  IndexInput request_indices;
  EXPECT_TRUE(CheckBatchCoversStep(request_indices, step_rows, "num_accepted", step_rows).ok());
  ExpectError(CheckBatchCoversStep(request_indices, step_rows - 1, "num_accepted", step_rows),
              absl::StatusCode::kOutOfRange,
              absl::StrCat("num_accepted has ", step_rows - 1, " rows but the step has ",
                           step_rows, " rows and no request_indices"));
  request_indices.present = true;
  request_indices.rows = step_rows + 1;
  ExpectError(CheckBatchCoversStep(request_indices, 1, "idx_mapping", step_rows),
              absl::StatusCode::kInvalidArgument,
              absl::StrCat("request_indices has ", step_rows + 1, " rows, the step has ", step_rows));
  request_indices.rows = step_rows;
  EXPECT_TRUE(CheckBatchCoversStep(request_indices, 1, "idx_mapping", step_rows).ok());
}

TEST_F(RequestTensorsTest, InlineParametersMustBeFinite) {
  RegionLookup lookup(registry_, session_);
  const int count = Draw(1, 64);
  v1::FloatTensor t;
  for (int i = 0; i < count; ++i) t.mutable_values()->add_values(-0.1f * Draw(1, 50));
  absl::StatusOr<FloatSource> source = ResolveFloatParam(lookup, t, "a_log", count);
  ASSERT_TRUE(source.ok()) << source.status();
  EXPECT_EQ(source->values.size(), size_t(count));
  ExpectError(ResolveFloatParam(lookup, t, "a_log", count + 1).status(),
              absl::StatusCode::kInvalidArgument,
              absl::StrCat("a_log: ", count, " values, expected ", count + 1));
  t.mutable_values()->set_values(Draw(0, count - 1), std::numeric_limits<float>::quiet_NaN());
  ExpectError(ResolveFloatParam(lookup, t, "a_log", count).status(),
              absl::StatusCode::kInvalidArgument, "a_log: values must be finite");
  ExpectError(ResolveFloatParam(lookup, v1::FloatTensor(), "dt_bias", count).status(),
              absl::StatusCode::kInvalidArgument, "dt_bias is required");
  v1::FloatTensor region;
  *region.mutable_region() = Tensor("acts", 16 * Draw(0, 10), v1::FP32, {count});
  source = ResolveFloatParam(lookup, region, "dt_bias", count);
  ASSERT_TRUE(source.ok()) << source.status();
  EXPECT_NE(source->region, nullptr);  // checked finite by the kernel that copies it
}

}  // namespace
}  // namespace server
}  // namespace specstate
