// Sizing end to end: specstated --model and --pool_memory against
// specstatectl plan for the same flags (the real binaries): plan must never
// disagree with what the service allocates.
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/lib/client.h"
#include "gtest/gtest.h"
#include "tests/integration/server_process.h"
#include "tests/integration/test_scheduler.h"

namespace specstate {
namespace {

using testing::ProcessResult;
using testing::RunfilePath;
using testing::RunProcess;
using testing::ServerProcess;
using testing::ValueOrDie;

// The integer after "key": in plan's JSON.
int64_t JsonInt(const std::string& json, const std::string& key) {
  const std::regex re("\"" + key + "\": (-?[0-9]+)");
  std::smatch m;
  if (!std::regex_search(json, m, re)) {
    ADD_FAILURE() << "no \"" << key << "\" in\n" << json;
    return -1;
  }
  int64_t v = 0;
  EXPECT_TRUE(absl::SimpleAtoi(m[1].str(), &v));
  return v;
}

ProcessResult Plan(std::vector<std::string> flags) {
  flags.insert(flags.begin(), {RunfilePath("client/cli/specstatectl"), "plan"});
  return ValueOrDie(RunProcess(flags));
}

// specstated with flags it must refuse: under `timeout`, so that a start
// it should have refused fails the test instead of hanging it.
ProcessResult Specstated(std::vector<std::string> flags) {
  flags.insert(flags.begin(),
               {"/usr/bin/timeout", "20", RunfilePath("server/specstated"), "--backend=cpu",
                absl::StrCat("--listen=unix:///tmp/specstate-sizing-", getpid(), ".sock")});
  return ValueOrDie(RunProcess(flags));
}

struct Case {
  std::string model;
  std::string commit_mode;
  int max_rows;
  int64_t budget_bytes;
};

// The service sized by --pool_memory allocates what plan says, block for
// block and byte for byte, in every commit mode.
TEST(SizingTest, PlanAgreesWithTheService) {
  std::mt19937_64 rng(std::random_device{}());
  const Case cases[] = {
      {"qwen3-next-80b-a3b-tp8", "eager", 1 + static_cast<int>(rng() % 16), 0},
      {"kimi-linear-48b-a3b-tp8", "deferred", 1 + static_cast<int>(rng() % 16), 0},
      {"qwen3-next-80b-a3b-tp8", "fast", 1 + static_cast<int>(rng() % 16), 0},
  };
  for (Case c : cases) {
    // 96 to 224 MiB, not a round number.
    c.budget_bytes = (int64_t{96} << 20) + static_cast<int64_t>(rng() % (int64_t{128} << 20));
    SCOPED_TRACE(absl::StrCat(c.model, " ", c.commit_mode, " max_rows ", c.max_rows, " budget ",
                              c.budget_bytes));
    const std::vector<std::string> flags = {
        "--model=" + c.model, "--commit_mode=" + c.commit_mode,
        absl::StrCat("--max_rows=", c.max_rows), absl::StrCat("--pool_memory=", c.budget_bytes)};
    std::vector<std::string> plan_flags = flags;
    plan_flags.push_back("--json");
    const ProcessResult plan = Plan(plan_flags);
    ASSERT_EQ(plan.exit_code, 0) << plan.output;
    const int64_t blocks = JsonInt(plan.output, "num_blocks");
    ASSERT_GE(blocks, 2);
    EXPECT_LE(JsonInt(plan.output, "total_bytes"), c.budget_bytes);

    std::vector<std::string> server_flags = flags;
    server_flags.push_back("--backend=cpu");
    std::unique_ptr<ServerProcess> server = ValueOrDie(ServerProcess::Start(server_flags));
    std::unique_ptr<client::Client> client = ValueOrDie(client::Client::Connect(server->address()));
    const v1::Layout layout = ValueOrDie(client->GetLayout());
    EXPECT_EQ(layout.num_blocks(), blocks);
    EXPECT_EQ(layout.pool_bytes(), JsonInt(plan.output, "pool_bytes"));
    EXPECT_EQ(layout.record_bytes(), JsonInt(plan.output, "record_bytes"));
    EXPECT_EQ(layout.state_block_bytes(), JsonInt(plan.output, "state_block_bytes"));
    EXPECT_EQ(layout.conv_block_bytes(), JsonInt(plan.output, "conv_block_bytes"));
    EXPECT_EQ(layout.num_layers(), JsonInt(plan.output, "num_layers"));
    EXPECT_EQ(layout.num_heads(), JsonInt(plan.output, "num_heads"));
    EXPECT_EQ(layout.num_value_heads(), JsonInt(plan.output, "num_value_heads"));
    EXPECT_EQ(layout.conv_dim(), JsonInt(plan.output, "conv_dim"));
    EXPECT_EQ(layout.max_rows(), c.max_rows);
    // The start-up log names the count.
    EXPECT_TRUE(absl::StrContains(server->Log(), absl::StrCat(": ", blocks, " blocks (")))
        << server->Log();
    // The text table says the same.
    std::vector<std::string> text_flags = flags;
    const ProcessResult text = Plan(text_flags);
    ASSERT_EQ(text.exit_code, 0) << text.output;
    EXPECT_TRUE(absl::StrContains(text.output, absl::StrCat("blocks        ", blocks, " ")))
        << text.output;
  }
}

// A fraction of the free memory (the CPU backend: MemAvailable): the count
// the service logs is plan's for the free bytes it logs.
TEST(SizingTest, AFractionOfTheFreeMemory) {
  std::ifstream meminfo("/proc/meminfo");
  std::string key, unit;
  int64_t kb = 0, available = 0;
  while (meminfo >> key >> kb >> unit) {
    if (key == "MemAvailable:") available = kb * 1024;
  }
  ASSERT_GT(available, int64_t{1} << 30);
  // About 150 MiB of what is available now.
  const std::string fraction = absl::StrFormat("%.6f", 150.0 * (1 << 20) / available);
  std::unique_ptr<ServerProcess> server = ValueOrDie(
      ServerProcess::Start({"--backend=cpu", "--model=qwen3-next-80b-a3b-tp8", "--max_rows=4",
                            "--pool_memory=" + fraction}));
  const std::string log = server->Log();
  const std::regex re("of ([0-9]+) bytes free: ([0-9]+) blocks");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(log, m, re)) << log;
  const std::string free = m[1].str();
  const int64_t blocks = std::stoll(m[2].str());
  std::unique_ptr<client::Client> client = ValueOrDie(client::Client::Connect(server->address()));
  EXPECT_EQ(ValueOrDie(client->GetLayout()).num_blocks(), blocks);
  const ProcessResult plan = Plan({"--model=qwen3-next-80b-a3b-tp8", "--max_rows=4",
                                   "--pool_memory=" + fraction, "--free_memory=" + free, "--json"});
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  EXPECT_EQ(JsonInt(plan.output, "num_blocks"), blocks);
}

// --blocks given: plan's bytes are the service's for that count.
TEST(SizingTest, PlanOfBlocksAgreesWithTheService) {
  const int blocks = 2 + static_cast<int>(std::random_device{}() % 30);
  const std::vector<std::string> flags = {"--model=kimi-linear-48b-a3b-tp8",
                                          absl::StrCat("--blocks=", blocks), "--max_rows=4"};
  std::vector<std::string> plan_flags = flags;
  plan_flags.push_back("--json");
  const ProcessResult plan = Plan(plan_flags);
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  std::vector<std::string> server_flags = flags;
  server_flags.push_back("--backend=cpu");
  std::unique_ptr<ServerProcess> server = ValueOrDie(ServerProcess::Start(server_flags));
  std::unique_ptr<client::Client> client = ValueOrDie(client::Client::Connect(server->address()));
  const v1::Layout layout = ValueOrDie(client->GetLayout());
  EXPECT_EQ(layout.num_blocks(), blocks);
  EXPECT_EQ(JsonInt(plan.output, "num_blocks"), blocks);
  EXPECT_EQ(layout.pool_bytes(), JsonInt(plan.output, "pool_bytes"));
  EXPECT_EQ(layout.record_bytes(), JsonInt(plan.output, "record_bytes"));
}

// The config file's "model" and "pool_memory" size the service as the flags do.
TEST(SizingTest, ConfigFileModelAndPoolMemory) {
  const int max_rows = 1 + static_cast<int>(std::random_device{}() % 8);
  const std::string budget = absl::StrCat(100 + std::random_device{}() % 100, "MiB");
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/sizing.json");
  std::ofstream(path) << absl::StrCat(R"({"model": "kimi-linear-48b-a3b-tp8", "pool_memory": ")",
                                      budget, R"(", "layout": {"max_rows": )", max_rows,
                                      R"(, "backend": "CPU"}})");
  const ProcessResult plan =
      Plan({"--model=kimi-linear-48b-a3b-tp8", "--pool_memory=" + budget,
            absl::StrCat("--max_rows=", max_rows), "--json"});
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  std::unique_ptr<ServerProcess> server = ValueOrDie(ServerProcess::Start({"--config=" + path}));
  std::unique_ptr<client::Client> client = ValueOrDie(client::Client::Connect(server->address()));
  const v1::Layout layout = ValueOrDie(client->GetLayout());
  EXPECT_EQ(layout.num_blocks(), JsonInt(plan.output, "num_blocks"));
  EXPECT_EQ(layout.pool_bytes(), JsonInt(plan.output, "pool_bytes"));
  EXPECT_EQ(layout.num_heads(), 4);
  EXPECT_EQ(layout.max_rows(), max_rows);
  EXPECT_TRUE(absl::StrContains(server->Log(), "pool_memory=" + budget + ": a budget of"))
      << server->Log();

  // num_blocks and pool_memory in one file: refused, naming both.
  const std::string both = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/both.json");
  std::ofstream(both) << R"({"pool_memory": "1GiB", "layout": {"num_blocks": 10}})";
  const ProcessResult r = Specstated({"--config=" + both});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(absl::StrContains(r.output, "pool_memory \"1GiB\" and layout.num_blocks 10 both "
                                          "size the pools"))
      << r.output;
}

// Layout flags given with --model override the preset's fields.
TEST(SizingTest, FlagsOverrideTheModel) {
  std::unique_ptr<ServerProcess> server = ValueOrDie(ServerProcess::Start(
      {"--backend=cpu", "--model=qwen3-next-80b-a3b-tp8", "--num_spec=2", "--layers=3",
       "--state_dtype=bf16", "--blocks=9", "--max_rows=2"}));
  std::unique_ptr<client::Client> client = ValueOrDie(client::Client::Connect(server->address()));
  const v1::Layout l = ValueOrDie(client->GetLayout());
  EXPECT_EQ(l.layer_kind(), v1::GDN);  // the preset's
  EXPECT_EQ(l.num_heads(), 2);
  EXPECT_EQ(l.num_value_heads(), 4);
  EXPECT_EQ(l.conv_dim(), 1024);
  EXPECT_EQ(l.head_dim(), 128);
  EXPECT_EQ(l.num_spec(), 2);  // the flags'
  EXPECT_EQ(l.num_layers(), 3);
  EXPECT_EQ(l.state_dtype(), v1::BF16);
  EXPECT_EQ(l.num_blocks(), 9);
}

// Refused at start, with the flag and the bound named (exit status 2).
TEST(SizingTest, BadSizingFlagsAreRefused) {
  const struct {
    std::vector<std::string> flags;
    std::string says;
  } cases[] = {
      {{"--model=kimi-linear"}, "--model=kimi-linear is not a known model; known models: "
                                "kimi-linear-48b-a3b, "},
      {{"--pool_memory=60GiB", "--blocks=100"}, "both size the pools"},
      {{"--pool_memory=lots"}, "--pool_memory=lots: expected bytes"},
      {{"--pool_memory=-5GiB"}, "--pool_memory=-5GiB: must be positive"},
      {{"--pool_memory=0"}, "--pool_memory=0: must be positive"},
      {{"--pool_memory=1.5"}, "--pool_memory=1.5: a fraction of the free memory must be in (0, 1]"},
      // Two blocks of 20 layers of 2 MiB states and 144 KiB conv windows: 86 MiB and more.
      {{"--model=kimi-linear-48b-a3b", "--pool_memory=64MiB"},
       "--pool_memory = 67108864 bytes (64.00 MiB) holds no request's state: this layout needs "
       "at least "},
      // The layout is checked before it is sized.
      {{"--model=kimi-linear-48b-a3b", "--head_dim=100", "--pool_memory=1GiB"},
       "layout.head_dim = 100 must be 64, 128 or 256"},
      {{"--model=kimi-linear-48b-a3b-tp8", "--pool_memory=0.5", "--fd_store=yes"},
       "is a fraction of the free memory"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.says);
    const ProcessResult r = Specstated(c.flags);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_TRUE(absl::StrContains(r.output, c.says)) << r.output;
    // plan refuses the same flags alike (it has no --fd_store).
    if (c.flags.back() == "--fd_store=yes") continue;
    const ProcessResult p = Plan(c.flags);
    EXPECT_EQ(p.exit_code, 2) << p.output;
    EXPECT_TRUE(absl::StrContains(p.output, c.says)) << p.output;
  }
}

}  // namespace
}  // namespace specstate
