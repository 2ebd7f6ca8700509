#include "server/config/presets.h"

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/config/config.h"

namespace specstate {
namespace server {
namespace {

struct Expected {
  std::string name;
  v1::LayerKind kind;
  int layers, heads, value_heads, head_dim, conv_dim, conv_kernel, num_spec, tp;
};

// Every preset's fields, written out by hand from the model configs (see
// presets.cc for where each comes from): a change to the table must change
// this list too.
const Expected kExpected[] = {
    {"kimi-linear-48b-a3b", v1::KDA, 20, 32, 32, 128, 12288, 4, 3, 1},
    {"kimi-linear-48b-a3b-tp2", v1::KDA, 20, 16, 16, 128, 6144, 4, 3, 2},
    {"kimi-linear-48b-a3b-tp4", v1::KDA, 20, 8, 8, 128, 3072, 4, 3, 4},
    {"kimi-linear-48b-a3b-tp8", v1::KDA, 20, 4, 4, 128, 1536, 4, 3, 8},
    {"qwen3-next-80b-a3b", v1::GDN, 36, 16, 32, 128, 8192, 4, 3, 1},
    {"qwen3-next-80b-a3b-tp2", v1::GDN, 36, 8, 16, 128, 4096, 4, 3, 2},
    {"qwen3-next-80b-a3b-tp4", v1::GDN, 36, 4, 8, 128, 2048, 4, 3, 4},
    {"qwen3-next-80b-a3b-tp8", v1::GDN, 36, 2, 4, 128, 1024, 4, 3, 8},
    {"kimi-k3-tp8", v1::KDA, 69, 12, 12, 128, 4608, 4, 7, 8},
};

TEST(PresetsTest, EveryPresetHasTheModelsFields) {
  ASSERT_EQ(ModelPresets().size(), std::size(kExpected));
  for (const Expected& e : kExpected) {
    SCOPED_TRACE(e.name);
    const ModelPreset* p = FindModelPreset(e.name);
    ASSERT_NE(p, nullptr);
    v1::Layout layout = DefaultServiceConfig().layout();
    ASSERT_TRUE(ApplyModelPreset(e.name, &layout).ok());
    EXPECT_EQ(layout.layer_kind(), e.kind);
    EXPECT_EQ(layout.num_layers(), e.layers);
    EXPECT_EQ(layout.num_heads(), e.heads);
    EXPECT_EQ(ValueHeadsOf(layout), e.value_heads);
    EXPECT_EQ(layout.head_dim(), e.head_dim);
    EXPECT_EQ(layout.conv_dim(), e.conv_dim);
    EXPECT_EQ(layout.conv_kernel(), e.conv_kernel);
    EXPECT_EQ(layout.num_spec(), e.num_spec);
    EXPECT_EQ(layout.activation_dtype(), v1::BF16);
    EXPECT_EQ(layout.state_dtype(), v1::FP32);
    EXPECT_EQ(p->tensor_parallel, e.tp);
    if (e.kind == v1::KDA) {
      EXPECT_EQ(layout.kda_gate(), v1::SAFE_GATE);
      EXPECT_EQ(layout.lower_bound(), -5.0f);
    }
    // The conv state covers q, k and v: H K + H K + HV V channels.
    EXPECT_EQ(layout.conv_dim(), (2 * e.heads + e.value_heads) * e.head_dim);
    // A preset is a layout the service accepts as it is.
    EXPECT_TRUE(ValidateLayout(layout).ok()) << ValidateLayout(layout);
  }
}

TEST(PresetsTest, TensorParallelPartsAreEqualShares) {
  for (const ModelPreset& p : ModelPresets()) {
    if (p.tensor_parallel == 1) continue;
    const std::string base = p.name.substr(0, p.name.rfind("-tp"));
    const ModelPreset* whole = FindModelPreset(base);
    if (whole == nullptr) continue;  // kimi-k3 exists only as its TP=8 part
    SCOPED_TRACE(p.name);
    EXPECT_EQ(p.num_heads * p.tensor_parallel, whole->num_heads);
    EXPECT_EQ(p.num_value_heads * p.tensor_parallel, whole->num_value_heads);
    EXPECT_EQ(p.conv_dim * p.tensor_parallel, whole->conv_dim);
    EXPECT_EQ(p.num_layers, whole->num_layers);
    EXPECT_EQ(p.name, absl::StrCat(base, "-tp", p.tensor_parallel));
  }
}

TEST(PresetsTest, SetsOnlyItsFields) {
  v1::Layout layout = DefaultServiceConfig().layout();
  layout.set_num_blocks(777);
  layout.set_max_rows(33);
  layout.set_commit_mode(v1::DEFERRED);
  layout.set_cache_mode(v1::ALIGN);
  layout.set_mamba_block_size(64);
  layout.set_device(3);
  ASSERT_TRUE(ApplyModelPreset("qwen3-next-80b-a3b", &layout).ok());
  EXPECT_EQ(layout.num_blocks(), 777);
  EXPECT_EQ(layout.max_rows(), 33);
  EXPECT_EQ(layout.commit_mode(), v1::DEFERRED);
  EXPECT_EQ(layout.cache_mode(), v1::ALIGN);
  EXPECT_EQ(layout.mamba_block_size(), 64);
  EXPECT_EQ(layout.device(), 3);
}

TEST(PresetsTest, UnknownNameListsTheKnownOnesAndChangesNothing) {
  v1::Layout layout = DefaultServiceConfig().layout();
  const std::string before = layout.SerializeAsString();
  for (const std::string name : {"kimi-linear", "", "KIMI-LINEAR-48B-A3B", "qwen3-next-80b-a3b-tp3"}) {
    SCOPED_TRACE(name);
    const absl::Status st = ApplyModelPreset(name, &layout);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(st.message(), absl::StrCat("--model=", name, " is not a known")))
        << st;
    for (const ModelPreset& p : ModelPresets()) {
      EXPECT_TRUE(absl::StrContains(st.message(), p.name)) << st;
    }
    EXPECT_EQ(layout.SerializeAsString(), before);
  }
  EXPECT_TRUE(absl::StrContains(ApplyModelPreset("x", &layout, "model").message(), "model=x"));
}

}  // namespace
}  // namespace server
}  // namespace specstate
