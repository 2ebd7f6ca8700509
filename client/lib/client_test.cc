// The client library's checks that need no server: the tensor-parallel
// ranks' layouts (CheckRankLayouts) and ConnectRanks' argument checks.
#include "client/lib/client.h"

#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace specstate {
namespace client {
namespace {

using ::testing::HasSubstr;

// Rank r's part of a 4-head KDA model at TP=2, on the CPU backend.
v1::Layout Part(int device = 0) {
  v1::Layout l;
  l.set_backend(v1::CPU);
  l.set_device(device);
  l.set_num_layers(4);
  l.set_num_heads(2);
  l.set_head_dim(64);
  l.set_conv_dim(384);
  l.set_conv_kernel(4);
  l.set_num_spec(3);
  l.set_num_blocks(64);
  l.set_max_rows(16);
  l.set_activation_dtype(v1::BF16);
  l.set_state_dtype(v1::FP32);
  l.set_cache_mode(v1::NONE);
  l.set_lower_bound(-5);
  return l;
}

void ExpectRefused(const absl::Status& st, absl::StatusCode code,
                   const std::vector<std::string>& substrings) {
  EXPECT_EQ(st.code(), code) << st;
  for (const std::string& s : substrings) EXPECT_THAT(std::string(st.message()), HasSubstr(s));
}

TEST(CheckRankLayoutsTest, EqualPartsPass) {
  EXPECT_TRUE(CheckRankLayouts({Part()}).ok());
  EXPECT_TRUE(CheckRankLayouts({Part(), Part(), Part()}).ok());
  // The CPU backend has no devices to keep apart; mps_client may differ.
  v1::Layout other = Part();
  other.set_mps_client(true);
  EXPECT_TRUE(CheckRankLayouts({Part(), other}).ok());
}

TEST(CheckRankLayoutsTest, NoLayoutIsInvalid) {
  ExpectRefused(CheckRankLayouts({}), absl::StatusCode::kInvalidArgument, {"no ranks"});
}

// Every compared field, changed on rank 1, is named with both values and
// both addresses.
TEST(CheckRankLayoutsTest, EveryFieldThatDiffersIsNamed) {
  struct Case {
    std::string field;
    std::function<void(v1::Layout*)> change;
    std::string got, want;
  };
  const std::vector<Case> cases = {
      {"backend", [](v1::Layout* l) { l->set_backend(v1::CUDA); }, "CUDA", "CPU"},
      {"layer_kind", [](v1::Layout* l) { l->set_layer_kind(v1::GDN); }, "GDN", "KDA"},
      {"kda_gate", [](v1::Layout* l) { l->set_kda_gate(v1::PLAIN_GATE); }, "PLAIN_GATE",
       "SAFE_GATE"},
      {"num_layers", [](v1::Layout* l) { l->set_num_layers(5); }, "5", "4"},
      {"num_heads", [](v1::Layout* l) { l->set_num_heads(3); }, "3", "2"},
      {"num_value_heads", [](v1::Layout* l) { l->set_num_value_heads(4); }, "4", "2"},
      {"head_dim", [](v1::Layout* l) { l->set_head_dim(128); }, "128", "64"},
      {"conv_dim", [](v1::Layout* l) { l->set_conv_dim(768); }, "768", "384"},
      {"conv_kernel", [](v1::Layout* l) { l->set_conv_kernel(3); }, "3", "4"},
      {"num_spec", [](v1::Layout* l) { l->set_num_spec(2); }, "2", "3"},
      {"num_blocks", [](v1::Layout* l) { l->set_num_blocks(65); }, "65", "64"},
      {"max_rows", [](v1::Layout* l) { l->set_max_rows(8); }, "8", "16"},
      {"activation_dtype", [](v1::Layout* l) { l->set_activation_dtype(v1::FP16); }, "FP16",
       "BF16"},
      {"state_dtype", [](v1::Layout* l) { l->set_state_dtype(v1::BF16); }, "BF16", "FP32"},
      {"cache_mode", [](v1::Layout* l) { l->set_cache_mode(v1::ALIGN); }, "ALIGN", "NONE"},
      {"mamba_block_size", [](v1::Layout* l) { l->set_mamba_block_size(8); }, "8", "0"},
      {"lower_bound", [](v1::Layout* l) { l->set_lower_bound(-4); }, "-4", "-5"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.field);
    v1::Layout changed = Part();
    c.change(&changed);
    ExpectRefused(CheckRankLayouts({Part(), Part(), changed}, {"unix:///a", "unix:///b", "unix:///c"}),
                  absl::StatusCode::kFailedPrecondition,
                  {absl::StrCat("rank 2 (unix:///c): ", c.field, " is ", c.got,
                                ", rank 0 (unix:///a)'s is ", c.want, ": ")});
  }
}

// num_value_heads 0 stands for as many as heads: equal to the number itself.
TEST(CheckRankLayoutsTest, ValueHeadsZeroMeansAsManyAsHeads) {
  v1::Layout explicit_heads = Part();
  explicit_heads.set_num_value_heads(2);
  EXPECT_TRUE(CheckRankLayouts({Part(), explicit_heads}).ok());
}

TEST(CheckRankLayoutsTest, CudaRanksNeedTheirOwnDevices) {
  v1::Layout a = Part(0), b = Part(1), c = Part(0);
  for (v1::Layout* l : {&a, &b, &c}) l->set_backend(v1::CUDA);
  EXPECT_TRUE(CheckRankLayouts({a, b}).ok());
  ExpectRefused(CheckRankLayouts({a, b, c}, {"unix:///a", "unix:///b", "unix:///c"}),
                absl::StatusCode::kFailedPrecondition,
                {"rank 2 (unix:///c) and rank 0 (unix:///a) are both on CUDA device 0",
                 "--device=RANK"});
  // Without addresses the ranks are named by number alone.
  ExpectRefused(CheckRankLayouts({a, a}), absl::StatusCode::kFailedPrecondition,
                {"rank 1 and rank 0 are both on CUDA device 0"});
}

TEST(ConnectRanksTest, AddressesAreChecked) {
  ExpectRefused(ConnectRanks({}).status(), absl::StatusCode::kInvalidArgument,
                {"no server addresses"});
  ExpectRefused(ConnectRanks({"unix:///tmp/x.sock", "unix:///tmp/y.sock", "unix:///tmp/x.sock"})
                    .status(),
                absl::StatusCode::kInvalidArgument,
                {"rank 2's address is rank 0's (unix:///tmp/x.sock)"});
}

TEST(ConnectRanksTest, AServiceThatDoesNotAnswerIsNamedByRank) {
  ExpectRefused(ConnectRanks({"unix:///nonexistent/specstate-0.sock"}, absl::Milliseconds(200))
                    .status(),
                absl::StatusCode::kUnavailable,
                {"rank 0: cannot connect to specstated at unix:///nonexistent/specstate-0.sock"});
}

}  // namespace
}  // namespace client
}  // namespace specstate
