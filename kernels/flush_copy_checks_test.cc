// The host checks of a Flush into a copy (FlushArgs::copy, ReadState's
// materialization): a copy is of one layer and of a list, never a discard,
// with room for the list, its blocks laid out as the layer's pool's, and under
// DEFERRED with a layer table whose state pool is the copy and whose records
// and parameters are the layer's. Each refusal names the field and the bound,
// and nothing is written (the copy included).
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/device_status.h"
#include "kernels/dtype.h"
#include "kernels/kda_args.h"
#include "kernels/kda_kernels.h"

namespace specstate {
namespace kernels {
namespace {

using ::testing::HasSubstr;

constexpr int kLayers = 2, kBlocks = 4, kQ = 4;

// Two layers of a small KDA layout in host memory, and a Flush of block 2 of
// layer 1 into a copy of two blocks: every check passes up to the mode's.
class FlushCopyChecksTest : public ::testing::Test {
 protected:
  void SetUp() override {
    shape_.num_heads = 2;
    shape_.head_dim = 64;
    elems_ = ValueWidth(shape_) * shape_.head_dim;
    pool_.assign(kLayers * kBlocks * elems_, 0.5f);
    copy_.assign(2 * elems_, 7.0f);
    params_.assign(shape_.num_heads + KeyWidth(shape_), 0.25f);
    records_.assign(4096, 0);  // (never read: nothing is pending)
    for (int l = 0; l < kLayers; ++l) {
      CommitLayer c;
      c.state = StatePool{pool_.data() + l * kBlocks * elems_, kBlocks, elems_};
      c.params = LayerParams{params_.data(), params_.data() + shape_.num_heads};
      c.records = Records{records_.data(), records_.data(), records_.data(), 1, kQ};
      c.records_alt = c.records;
      layers_.push_back(c);
    }
    entries_.assign(kLayers * kBlocks, 0);  // nothing pending
    header_.assign(PendingHeaderBytes(1) / 4 + 1, 0);
    jobs_.resize(FlushJobsCapacity(1, kLayers));
    a_.pending = PendingBlocks{entries_.data(), header_.data(), kLayers, kBlocks, 1};
    a_.jobs = ReplayJobs{jobs_.data(), &job_count_, static_cast<int>(jobs_.size())};
    copy_layer_ = layers_[1];
    copy_layer_.state = StatePool{copy_.data(), 2, elems_};
    a_.shape = shape_;
    a_.spec_query_len = kQ;
    a_.num_layers = kLayers;
    a_.layers = layers_.data();
    a_.device_layers = layers_.data();
    a_.blocks = blocks_;
    a_.num_blocks_given = 1;
    a_.checked_blocks = checked_;
    a_.layer = 1;
    a_.status = &status_;
    a_.mode = CommitMode::kDeferred;
    a_.copy = copy_layer_.state;
    a_.copy_layer = &copy_layer_;
    a_.device_copy_layer = &copy_layer_;
  }

  // `breaks` applied to the good arguments is refused with `code` and
  // `text`; nothing written.
  void ExpectRefused(const std::function<void(FlushArgs&)>& breaks, absl::StatusCode code,
                     const std::string& text) {
    SCOPED_TRACE(text);
    FlushArgs a = a_;
    breaks(a);
    const std::vector<float> pool = pool_, copy = copy_;
    const absl::Status st = ValidateFlushArgs(a);
    EXPECT_EQ(st.code(), code) << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr(text));
    EXPECT_THAT(std::string(st.message()), HasSubstr("In Flush"));
    const absl::Status launched = CpuKdaKernels().Flush(a, nullptr);
    EXPECT_EQ(launched, st);
    EXPECT_EQ(pool_, pool);
    EXPECT_EQ(copy_, copy);
  }

  KdaShape shape_;
  int64_t elems_ = 0;
  std::vector<float> pool_, copy_, params_, records_;
  std::vector<int32_t> entries_, header_;
  std::vector<ReplayJob> jobs_;
  int32_t job_count_ = 0;
  std::vector<CommitLayer> layers_;
  CommitLayer copy_layer_;
  int32_t blocks_[3] = {2, 3, 0};
  int32_t checked_[3] = {};
  DeviceStatus status_{};
  FlushArgs a_;
};

TEST_F(FlushCopyChecksTest, ACopyIsOfOneLayerAndAListAndNeverADiscard) {
  ExpectRefused([](FlushArgs& a) { a.layer = -1; }, absl::StatusCode::kInvalidArgument,
                "copy: a copy is of one layer, and layer is -1");
  ExpectRefused(
      [](FlushArgs& a) {
        a.blocks = nullptr;
        a.num_blocks_given = 0;
      },
      absl::StatusCode::kInvalidArgument, "copy: a copy needs a block list");
  ExpectRefused([](FlushArgs& a) { a.discard = true; }, absl::StatusCode::kInvalidArgument,
                "copy: discard changes the blocks; a copy changes nothing");
}

TEST_F(FlushCopyChecksTest, TheCopyHoldsTheListAsThePoolHoldsBlocks) {
  ExpectRefused([](FlushArgs& a) { a.num_blocks_given = 2; }, absl::StatusCode::kOutOfRange,
                "copy.num_blocks = 2 must exceed the 2 blocks given (its block 0 is unused)");
  const int64_t e = elems_;
  ExpectRefused([e](FlushArgs& a) { a.copy.block_stride = 2 * e; },
                absl::StatusCode::kInvalidArgument,
                absl::StrCat("copy.block_stride = ", 2 * e, " must be layer 1's pool's, ", e));
  ExpectRefused([e](FlushArgs& a) { a.copy.block_stride = e - 1; },
                absl::StatusCode::kInvalidArgument, "copy block stride");
}

TEST_F(FlushCopyChecksTest, DeferredReplaysThroughTheCopysLayerTable) {
  ExpectRefused([](FlushArgs& a) { a.copy_layer = nullptr; }, absl::StatusCode::kInvalidArgument,
                "copy: a DEFERRED copy needs copy_layer and device_copy_layer");
  CommitLayer other = layers_[1];  // the pool's state, not the copy
  ExpectRefused([&other](FlushArgs& a) { a.copy_layer = &other; },
                absl::StatusCode::kInvalidArgument, "copy_layer: its state pool must be the copy");
  CommitLayer layer0 = copy_layer_;
  std::vector<float> elsewhere(params_.size());
  layer0.params.a_log = elsewhere.data();
  ExpectRefused([&layer0](FlushArgs& a) { a.copy_layer = &layer0; },
                absl::StatusCode::kInvalidArgument,
                "copy_layer: its records and parameters must be layer 1's");
}

// The good arguments pass, and the copy is all they write: block 2 of layer
// 1, nothing pending there, is the pool's bytes.
TEST_F(FlushCopyChecksTest, AGoodCopyWritesOnlyTheCopy) {
  for (int64_t e = 0; e < elems_; ++e) pool_[(kBlocks + 2) * elems_ + e] = float(e % 97) - 48;
  const std::vector<float> pool = pool_;
  ASSERT_TRUE(ValidateFlushArgs(a_).ok()) << ValidateFlushArgs(a_);
  ASSERT_TRUE(CpuKdaKernels().Flush(a_, nullptr).ok());
  ASSERT_EQ(status_.failed, 0);
  EXPECT_EQ(pool_, pool);
  EXPECT_EQ(std::vector<float>(copy_.begin() + elems_, copy_.end()),
            std::vector<float>(pool_.begin() + (kBlocks + 2) * elems_,
                               pool_.begin() + (kBlocks + 3) * elems_));
  EXPECT_EQ(std::vector<float>(copy_.begin(), copy_.begin() + elems_),
            std::vector<float>(elems_, 7.0f))
      << "the copy's block 0 is not written";
  EXPECT_EQ(entries_, std::vector<int32_t>(kLayers * kBlocks, 0));
}

}  // namespace
}  // namespace kernels
}  // namespace specstate
