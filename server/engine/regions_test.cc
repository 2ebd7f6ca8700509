// RegionRegistry and RegionLookup: resolving a request's tensors against the
// regions its session registered.
#include "server/engine/regions.h"

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/testing/host_region_for_test.h"

namespace specstate {
namespace server {
namespace {

using ::testing::HasSubstr;

v1::RegionTensor Tensor(const std::string& region, uint64_t offset,
                        const std::vector<int64_t>& shape) {
  v1::RegionTensor t;
  t.set_region(region);
  t.set_dtype(v1::BF16);
  t.set_offset_bytes(offset);
  for (int64_t d : shape) t.add_shape(d);
  return t;
}

TensorSpec Bf16(Dims shape, int dense_inner) {
  TensorSpec spec;
  spec.dtype = DType::kBFloat16;
  spec.shape = std::move(shape);
  spec.dense_inner = dense_inner;
  return spec;
}

class RegionLookupTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937_64 rng(::testing::UnitTest::GetInstance()->random_seed());
    bytes_ = 4096 + 2 * (rng() % 512);
    registry_.OpenSession("s1");
    registry_.OpenSession("s2");
    ASSERT_TRUE(registry_.Register("s1", "acts", std::make_unique<HostRegion>(bytes_)).ok());
    ASSERT_TRUE(registry_.Register("s1", "meta", std::make_unique<HostRegion>(bytes_)).ok());
    // Another session's region of the same name: never visible to s1.
    ASSERT_TRUE(registry_.Register("s2", "acts", std::make_unique<HostRegion>(64)).ok());
  }

  int InUse(const std::string& name) {
    for (const v1::RegionInfo& r : registry_.List("s1")) {
      if (r.name() == name) return r.in_use();
    }
    return -1;
  }

  RegionRegistry registry_;
  uint64_t bytes_ = 0;
  const std::string session_ = "s1";
};

TEST_F(RegionLookupTest, ResolvesEachTensorAtItsOffset) {
  RegionLookup lookup(registry_, session_);
  const v1::RegionTensor q = Tensor("acts", 0, {4, 2, 8});
  const v1::RegionTensor k = Tensor("acts", 128, {4, 2, 8});
  const v1::RegionTensor beta = Tensor("meta", 64, {4, 2});
  absl::StatusOr<TensorView> qv = lookup.ResolveTensor(q, "q", Bf16({-1, 2, 8}, 2));
  absl::StatusOr<TensorView> kv = lookup.ResolveTensor(k, "k", Bf16({4, 2, 8}, 2));
  absl::StatusOr<TensorView> bv = lookup.ResolveTensor(beta, "beta", Bf16({4, 2}, 1));
  ASSERT_TRUE(qv.ok()) << qv.status();
  ASSERT_TRUE(kv.ok()) << kv.status();
  ASSERT_TRUE(bv.ok()) << bv.status();
  EXPECT_EQ(static_cast<char*>(kv->data) - static_cast<char*>(qv->data), 128);
  EXPECT_EQ(qv->shape, (Dims{4, 2, 8}));
  EXPECT_EQ(qv->strides, (Dims{16, 8, 1}));
  EXPECT_EQ(qv->region, kv->region);  // one region, one lookup
  EXPECT_NE(qv->region, bv->region);
  EXPECT_EQ(qv->region->session(), "s1");
  // Each region pinned once, however many tensors it holds.
  EXPECT_EQ(InUse("acts"), 1);
  EXPECT_EQ(InUse("meta"), 1);
  const std::vector<RegionPin> pins = lookup.TakePins();
  ASSERT_EQ(pins.size(), 2u);
  EXPECT_EQ(pins[0].get(), qv->region);
  EXPECT_EQ(pins[1].get(), bv->region);
  EXPECT_TRUE(lookup.TakePins().empty());
  EXPECT_EQ(InUse("acts"), 1);  // now held by `pins` alone
}

TEST_F(RegionLookupTest, RanksBeyondTheInlineCapacity) {
  RegionLookup lookup(registry_, session_);
  const v1::RegionTensor t = Tensor("meta", 0, {2, 2, 2, 2, 2, 2});
  absl::StatusOr<TensorView> v = lookup.ResolveTensor(t, "t", Bf16({2, 2, 2, 2, 2, -1}, 6));
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->strides, (Dims{32, 16, 8, 4, 2, 1}));
}

TEST_F(RegionLookupTest, ErrorsNameTheFieldAndTheBound) {
  RegionLookup lookup(registry_, session_);
  absl::StatusOr<TensorView> missing =
      lookup.ResolveTensor(Tensor("nope", 0, {4}), "g", Bf16({-1}, 1));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("g: no region \"nope\""));
  // Past the end by one element.
  const int64_t elements = static_cast<int64_t>(bytes_ / 2);
  absl::StatusOr<TensorView> past =
      lookup.ResolveTensor(Tensor("acts", 2, {elements}), "o", Bf16({-1}, 1));
  EXPECT_EQ(past.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(std::string(past.status().message()),
              HasSubstr(absl::StrCat("o: ", bytes_, " bytes at offset 2 are past the end of "
                                     "region \"acts\" (", bytes_, " bytes)")));
  // The other session's region of the same name is not this session's.
  const std::string other_session = "s3";
  RegionLookup other(registry_, other_session);
  EXPECT_EQ(other.ResolveTensor(Tensor("acts", 0, {4}), "q", Bf16({-1}, 1)).status().code(),
            absl::StatusCode::kNotFound);
}

// A dtype number the enum does not have (a client built against another
// .proto, or JSON with a number) is named with the number and the values the
// enum has; every dtype in these messages is spelled as the enum spells it.
TEST_F(RegionLookupTest, DTypeErrorsNameTheNumberAndTheAcceptedValues) {
  std::mt19937_64 rng(::testing::UnitTest::GetInstance()->random_seed());
  const int unknown[] = {5 + static_cast<int>(rng() % 1000), -1 - static_cast<int>(rng() % 1000)};
  const std::vector<int64_t> shape = {1 + static_cast<int64_t>(rng() % 8), 2, 8};
  for (int number : unknown) {
    SCOPED_TRACE(number);
    v1::RegionTensor t = Tensor("acts", 0, shape);
    t.set_dtype(static_cast<v1::DType>(number));
    RegionLookup lookup(registry_, session_);
    absl::StatusOr<TensorView> v = lookup.ResolveTensor(t, "q", Bf16({-1, 2, 8}, 2));
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(v.status().message(),
              absl::StrCat("q: dtype ", number, " is not a DType (the values are FP32 (1), "
                           "FP16 (2), BF16 (3), INT32 (4)); expected BF16"));
  }
  // A known dtype that is not the one wanted, and none at all: the same spelling.
  RegionLookup lookup(registry_, session_);
  v1::RegionTensor fp16 = Tensor("acts", 0, shape);
  fp16.set_dtype(v1::FP16);
  EXPECT_EQ(lookup.ResolveTensor(fp16, "k", Bf16({-1, 2, 8}, 2)).status().message(),
            "k: dtype FP16, expected BF16");
  TensorSpec index;
  index.dtype = DType::kInt32;
  index.shape = {-1};
  index.dense_inner = 1;
  v1::RegionTensor unset = Tensor("meta", 0, {shape[0]});
  unset.clear_dtype();
  absl::Status st = lookup.ResolveTensor(unset, "state_indices", index).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "state_indices: dtype is not set (expected INT32)");
}

// A tensor the request does not carry at all reads as an empty message; it is
// reported as missing, not as a region with an empty name, and pins nothing.
TEST_F(RegionLookupTest, AMissingTensorIsReportedAsMissing) {
  RegionLookup lookup(registry_, session_);
  absl::Status st = lookup.ResolveTensor(v1::RegionTensor(), "k", Bf16({-1, 2, 8}, 2)).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "k: missing (a RegionTensor with region, shape and dtype is required)");
  // Given, but without a region name.
  std::mt19937_64 rng(::testing::UnitTest::GetInstance()->random_seed());
  v1::RegionTensor nameless = Tensor("", 2 * (rng() % 64), {4, 2, 8});
  st = lookup.ResolveTensor(nameless, "v", Bf16({-1, 2, 8}, 2)).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("v: region is not set"));
  EXPECT_TRUE(lookup.TakePins().empty());
  EXPECT_EQ(InUse("acts"), 0);
}

TEST_F(RegionLookupTest, AnUnregisteredRegionStaysMappedWhilePinned) {
  bool unmapped = false;
  std::vector<RegionPin> pins;
  {
    RegionLookup lookup(registry_, session_);
    absl::StatusOr<TensorView> view = lookup.ResolveTensor(Tensor("acts", 0, {4}), "q", Bf16({-1}, 1));
    ASSERT_TRUE(view.ok()) << view.status();
    pins = lookup.TakePins();
  }
  ASSERT_TRUE(registry_.Unregister(session_, "acts", [&] { unmapped = true; }).ok());
  EXPECT_FALSE(unmapped);
  RegionLookup later(registry_, session_);
  EXPECT_EQ(later.ResolveTensor(Tensor("acts", 0, {4}), "q", Bf16({-1}, 1)).status().code(),
            absl::StatusCode::kNotFound);
  pins.clear();
  EXPECT_TRUE(unmapped);
}

}  // namespace
}  // namespace server
}  // namespace specstate
