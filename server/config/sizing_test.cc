#include "server/config/sizing.h"

#include <cstdint>
#include <random>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/config/config.h"
#include "server/kept/pool_header.h"
#include "server/config/presets.h"

namespace specstate {
namespace server {
namespace {

constexpr int64_t kKiB = 1024, kMiB = kKiB * 1024, kGiB = kMiB * 1024;

v1::Layout Preset(const std::string& name) {
  v1::Layout l = DefaultServiceConfig().layout();
  EXPECT_TRUE(ApplyModelPreset(name, &l).ok());
  return l;
}

TEST(ParsePoolMemoryTest, BytesInEveryUnit) {
  const struct {
    const char* text;
    int64_t bytes;
  } cases[] = {
      {"60GiB", 60 * kGiB},        {"60gib", 60 * kGiB},          {"512MiB", 512 * kMiB},
      {"4096KiB", 4096 * kKiB},    {"2TiB", 2048 * kGiB},         {"80GB", 80'000'000'000},
      {"100MB", 100'000'000},      {"7KB", 7000},                 {"3TB", 3'000'000'000'000},
      {"123456789", 123456789},    {"123456789B", 123456789},     {" 1.5GiB ", 3 * kGiB / 2},
      {"2 GiB", 2 * kGiB},         {"1", 1},                      {"0.5KiB", 512},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.text);
    absl::StatusOr<PoolMemory> m = ParsePoolMemory(c.text, "--pool_memory");
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(m->bytes, c.bytes);
    EXPECT_EQ(m->fraction, 0);
  }
}

TEST(ParsePoolMemoryTest, FractionsOfTheFreeMemory) {
  const struct {
    const char* text;
    double fraction;
  } cases[] = {{"0.8", 0.8}, {"1.0", 1.0}, {".25", 0.25}, {"80%", 0.8}, {"100%", 1.0},
               {"12.5%", 0.125}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.text);
    absl::StatusOr<PoolMemory> m = ParsePoolMemory(c.text, "--pool_memory");
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_DOUBLE_EQ(m->fraction, c.fraction);
    EXPECT_EQ(m->bytes, 0);
  }
}

TEST(ParsePoolMemoryTest, BadValuesNameTheFlagAndTheBound) {
  const struct {
    const char* text;
    const char* says;
  } cases[] = {
      {"", "empty"},
      {"   ", "empty"},
      {"-1", "must be positive"},
      {"-60GiB", "must be positive"},
      {"0", "must be positive"},
      {"0.0", "must be positive"},
      {"0%", "must be positive"},
      {"1.5", "must be in (0, 1]"},
      {"120%", "must be in (0%, 100%]"},
      {"lots", "expected bytes"},
      {"GiB", "expected bytes"},
      {"1.2.3", "expected bytes"},
      {"60XB", "unknown unit \"xb\""},
      {"60G", "unknown unit \"g\""},
      {"9000000TiB", "more than 2^63 - 1 bytes"},
      {"99999999999999999999", "more than 2^63 - 1 bytes"},
      {"0.1B", "at least 1 byte"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.text);
    absl::StatusOr<PoolMemory> m = ParsePoolMemory(c.text, "--pool_memory");
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(m.status().message(), absl::StrCat("--pool_memory=", c.text)))
        << m.status();
    EXPECT_TRUE(absl::StrContains(m.status().message(), c.says)) << m.status();
  }
}

TEST(BudgetBytesTest, AFractionOfWhatIsFree) {
  std::mt19937_64 rng(std::random_device{}());
  for (int i = 0; i < 100; ++i) {
    const uint64_t free = rng() % (uint64_t{200} * kGiB) + 1000;
    const double fraction = std::uniform_real_distribution<double>(0.01, 1.0)(rng);
    PoolMemory m;
    m.fraction = fraction;
    absl::StatusOr<int64_t> b = BudgetBytes(m, free, "--pool_memory");
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_LE(*b, static_cast<double>(free) * fraction);
    EXPECT_GT(*b + 1, static_cast<double>(free) * fraction);
    // Bytes are bytes, whatever is free.
    m = PoolMemory{static_cast<int64_t>(rng() % kGiB) + 1, 0};
    EXPECT_EQ(*BudgetBytes(m, free, "--pool_memory"), m.bytes);
  }
  PoolMemory half;
  half.fraction = 0.5;
  const absl::StatusOr<int64_t> none = BudgetBytes(half, 1, "--pool_memory");
  EXPECT_EQ(none.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_TRUE(absl::StrContains(none.status().message(), "--pool_memory")) << none.status();
}

// The parts against ComputeLayoutSizes and the kernels' sizes, by hand.
TEST(ComputeServiceBytesTest, PartsAddUp) {
  for (const char* name : {"kimi-linear-48b-a3b", "qwen3-next-80b-a3b-tp2", "kimi-k3-tp8"}) {
    for (v1::CommitMode mode : {v1::EAGER, v1::DEFERRED, v1::FAST}) {
      for (bool kept : {false, true}) {
        SCOPED_TRACE(absl::StrCat(name, " ", v1::CommitMode_Name(mode), kept ? " kept" : ""));
        v1::Layout l = Preset(name);
        l.set_commit_mode(mode);
        l.set_num_blocks(2 + static_cast<int>(std::random_device{}() % 500));
        l.set_max_rows(1 + static_cast<int>(std::random_device{}() % 300));
        ASSERT_TRUE(ValidateLayout(l).ok()) << ValidateLayout(l);
        const ServiceBytes b = ComputeServiceBytes(l, kept);
        const LayoutSizes s = ComputeLayoutSizes(l);
        const auto align = [](int64_t x) { return (x + 255) / 256 * 256; };
        EXPECT_EQ(b.pools, l.num_layers() * (align(s.state_block_bytes * l.num_blocks()) +
                                             align(s.conv_block_bytes * l.num_blocks())));
        EXPECT_EQ(b.pools, s.pool_bytes);
        EXPECT_EQ(b.records, s.record_bytes);
        EXPECT_EQ(b.workspaces, s.workspace_bytes);
        EXPECT_EQ(b.mode, s.mode_bytes);
        EXPECT_EQ(b.engine, b.pools + b.records + b.workspaces + b.mode + b.params +
                                b.step_slots + b.layer_table);
        if (kept) {
          const int64_t header = static_cast<int64_t>(
              HeaderLayoutFor(l.num_blocks(),
                              KeptDeferredFor(l, uint64_t(s.records_per_layer_bytes)),
                              KeptFastFor(l))
                  .bytes);
          EXPECT_EQ(b.kept_header, header);
          // DEFERRED's records and FAST's rings are in the kept allocation.
          EXPECT_EQ(b.total, b.engine + header - (mode == v1::EAGER ? 0 : b.records));
          if (mode == v1::FAST) EXPECT_GE(b.kept_header, b.records);
        } else {
          EXPECT_EQ(b.kept_header, 0);
          EXPECT_EQ(b.total, b.engine);
        }
      }
    }
  }
}

TEST(BlocksForBudgetTest, TheMostBlocksThatFit) {
  std::mt19937_64 rng(std::random_device{}());
  for (const ModelPreset& p : ModelPresets()) {
    for (v1::CommitMode mode : {v1::EAGER, v1::DEFERRED, v1::FAST}) {
      const bool kept = rng() % 2 == 0;
      SCOPED_TRACE(absl::StrCat(p.name, " ", v1::CommitMode_Name(mode), kept ? " kept" : ""));
      v1::Layout l = Preset(p.name);
      l.set_commit_mode(mode);
      l.set_max_rows(1 + static_cast<int>(rng() % 512));
      const int64_t budget = static_cast<int64_t>(rng() % (uint64_t{160} * kGiB)) + 4 * kGiB;
      absl::StatusOr<int> blocks = BlocksForBudget(l, budget, kept, "--pool_memory");
      ASSERT_TRUE(blocks.ok()) << blocks.status();
      l.set_num_blocks(*blocks);
      EXPECT_LE(ComputeServiceBytes(l, kept).total, budget);
      l.set_num_blocks(*blocks + 1);
      EXPECT_GT(ComputeServiceBytes(l, kept).total, budget);
    }
  }
}

TEST(BlocksForBudgetTest, TooSmallForOneRequestNamesTheFlagAndTheLeast) {
  v1::Layout l = Preset("kimi-linear-48b-a3b");
  l.set_max_rows(256);
  l.set_num_blocks(2);
  const int64_t least = ComputeServiceBytes(l, false).total;
  for (int64_t budget : {int64_t{1}, 64 * kMiB, least - 1}) {
    absl::StatusOr<int> blocks = BlocksForBudget(l, budget, false, "--pool_memory");
    ASSERT_FALSE(blocks.ok());
    EXPECT_EQ(blocks.status().code(), absl::StatusCode::kOutOfRange);
    EXPECT_TRUE(absl::StrContains(blocks.status().message(),
                                  absl::StrCat("--pool_memory = ", budget, " bytes")))
        << blocks.status();
    EXPECT_TRUE(absl::StrContains(blocks.status().message(),
                                  absl::StrCat("needs at least ", least, " bytes")))
        << blocks.status();
  }
  EXPECT_EQ(*BlocksForBudget(l, least, false, "--pool_memory"), 2);
}

// specstatectl plan's numbers for Kimi-Linear-48B-A3B in 60 GiB, by hand.
TEST(PlanLayoutTest, KimiLinearByHand) {
  v1::Layout l = Preset("kimi-linear-48b-a3b");
  l.set_max_rows(256);
  l.set_commit_mode(v1::EAGER);
  const int64_t budget = 60 * kGiB;
  // A layer's recurrent state: 32 heads x 128 x 128 fp32 = 2 MiB; its conv
  // window: 12288 channels x (4 - 1 + 3) bf16 = 147456 bytes.
  const int64_t state = 32 * 128 * 128 * 4, conv = 12288 * 6 * 2;
  ASSERT_EQ(state, 2097152);
  // A block: 20 layers of both, Commit's owner word and the word of a
  // Flush's block list checked (EAGER's only per-block bookkeeping):
  // 44892168 bytes.
  const int64_t block = 20 * (state + conv) + 4 + 4;
  // The records of 256 rows of Q = 4 tokens, per layer: kv 1024 x (4096 +
  // 4096) bf16 = 16 MiB, g 1024 x 4096 bf16 = 8 MiB, beta 1024 x 32 bf16 =
  // 64 KiB: 25231360 bytes, 504627200 for 20 layers. The rest: a read's
  // copy (two blocks of one layer's state, 4 MiB: ReadState materializes
  // into it) and under 1 MiB (workspaces of 256 rows, slots, parameters),
  // so 60 GiB holds floor((64424509440 - 504627200 - 4 MiB - <1 MiB) /
  // 44892168) = 1423 blocks.
  const int64_t records = 20 * int64_t{25231360};
  ASSERT_EQ(ComputeLayoutSizes(l).record_bytes, records);
  absl::StatusOr<int> blocks = BlocksForBudget(l, budget, false, "--pool_memory");
  ASSERT_TRUE(blocks.ok()) << blocks.status();
  EXPECT_EQ(*blocks, 1423);
  l.set_num_blocks(*blocks);
  const SizingPlan p = PlanLayout(l, budget, false);
  EXPECT_EQ(p.state_bytes, 20 * state);
  EXPECT_EQ(p.conv_bytes, 20 * conv);
  EXPECT_DOUBLE_EQ(p.block_bytes, static_cast<double>(block));
  // The stock path: 1 + 3 states and one conv window a layer.
  EXPECT_EQ(p.stock_state_bytes, 20 * 4 * state);
  EXPECT_EQ(p.stock_conv_bytes, 20 * conv);
  EXPECT_EQ(p.stock_request_bytes, 170721280);
  EXPECT_EQ(p.bytes.pools, 20 * (state + conv) * 1423);
  EXPECT_EQ(p.requests_fit, 1422);
  EXPECT_EQ(p.stock_requests_fit, 64424509440 / 170721280);  // 377
  EXPECT_EQ(p.stock_requests_fit, 377);
  // A row's share: its records (1971200 bytes) and its few words of
  // workspace and slots.
  EXPECT_GT(p.row_bytes, 1971200);
  EXPECT_LT(p.row_bytes, 1971200 + 512);
  EXPECT_DOUBLE_EQ(p.request_bytes, p.block_bytes + p.row_bytes);
  EXPECT_DOUBLE_EQ(p.saving_per_request, 170721280 - p.request_bytes);
  // 256 requests: 257 blocks and the rest, against 256 x 170721280 bytes.
  EXPECT_EQ(p.stock_at_bytes, int64_t{256} * 170721280);
  EXPECT_GT(p.specstate_at_bytes, 257 * block + records + 2 * state);
  EXPECT_LT(p.specstate_at_bytes, 257 * block + records + 2 * state + kMiB);
  EXPECT_EQ(p.budget_bytes, budget);
}

TEST(PlanLayoutTest, SizedByBlocksTheBudgetIsWhatTheyTake) {
  v1::Layout l = Preset("qwen3-next-80b-a3b");
  l.set_num_blocks(100 + static_cast<int>(std::random_device{}() % 1000));
  const SizingPlan p = PlanLayout(l, 0, false);
  EXPECT_EQ(p.budget_bytes, ComputeServiceBytes(l, false).total);
  EXPECT_EQ(p.requests_fit, l.num_blocks() - 1);
  // GDN: 32 value heads x 128 x 128 fp32 a state, 36 layers.
  EXPECT_EQ(p.state_bytes, int64_t{36} * 32 * 128 * 128 * 4);
  EXPECT_EQ(p.stock_state_bytes, int64_t{36} * 4 * 32 * 128 * 128 * 4);
}

TEST(FormatBytesTest, Units) {
  EXPECT_EQ(FormatBytes(512), "512 B");
  EXPECT_EQ(FormatBytes(1536), "1.50 KiB");
  EXPECT_EQ(FormatBytes(3 * kMiB), "3.00 MiB");
  EXPECT_EQ(FormatBytes(60 * kGiB), "60.00 GiB");
}

}  // namespace
}  // namespace server
}  // namespace specstate
