#include "server/config/config.h"

#include <cstdlib>
#include <fstream>
#include <random>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/config/presets.h"

namespace specstate {
namespace server {
namespace {

// A config file in the test's temporary directory.
std::string WriteFile(const std::string& name, const std::string& text) {
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string path = absl::StrCat(dir != nullptr ? dir : "/tmp", "/", name);
  std::ofstream(path) << text;
  return path;
}

TEST(LoadConfigFileTest, AModelUnderTheFilesOwnFields) {
  const int blocks = 2 + static_cast<int>(std::random_device{}() % 1000);
  const std::string path = WriteFile(
      "model.json", absl::StrCat(R"({"model": "qwen3-next-80b-a3b-tp2",
          "layout": {"num_spec": 2, "max_rows": 48, "num_blocks": )",
                                 blocks, R"(, "commit_mode": "DEFERRED"},
          "listen": "unix:///tmp/x.sock"})"));
  absl::StatusOr<ConfigFile> file = LoadConfigFile(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const v1::Layout& l = file->config.layout();
  EXPECT_EQ(file->model, "qwen3-next-80b-a3b-tp2");
  EXPECT_TRUE(file->pool_memory.empty());
  EXPECT_TRUE(file->num_blocks_given);
  // The preset's fields ...
  EXPECT_EQ(l.layer_kind(), v1::GDN);
  EXPECT_EQ(l.num_layers(), 36);
  EXPECT_EQ(l.num_heads(), 8);
  EXPECT_EQ(l.num_value_heads(), 16);
  EXPECT_EQ(l.conv_dim(), 4096);
  // ... under the file's.
  EXPECT_EQ(l.num_spec(), 2);
  EXPECT_EQ(l.max_rows(), 48);
  EXPECT_EQ(l.num_blocks(), blocks);
  EXPECT_EQ(l.commit_mode(), v1::DEFERRED);
  EXPECT_EQ(file->config.listen(), "unix:///tmp/x.sock");
  // The defaults where neither says.
  EXPECT_EQ(l.cache_mode(), v1::NONE);
  EXPECT_EQ(l.backend(), v1::AUTO);
  // LoadServiceConfig reads the same.
  absl::StatusOr<v1::ServiceConfig> config = LoadServiceConfig(path);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->SerializeAsString(), file->config.SerializeAsString());
}

TEST(LoadConfigFileTest, PoolMemoryIsAString) {
  absl::StatusOr<ConfigFile> file = LoadConfigFile(
      WriteFile("budget.json", R"({"model": "kimi-linear-48b-a3b", "pool_memory": "60GiB"})"));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->pool_memory, "60GiB");
  EXPECT_FALSE(file->num_blocks_given);
  EXPECT_EQ(file->config.layout().num_layers(), 20);

  const std::string number = WriteFile("number.json", R"({"pool_memory": 0.8})");
  absl::StatusOr<ConfigFile> bad = LoadConfigFile(number);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad.status().message(),
                                absl::StrCat("config file ", number, ": \"pool_memory\" must be a string")))
      << bad.status();
}

TEST(LoadConfigFileTest, AnUnknownModelNamesTheFileAndTheKnownOnes) {
  const std::string path = WriteFile("unknown.json", R"({"model": "kimi-linear"})");
  absl::StatusOr<ConfigFile> file = LoadConfigFile(path);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(file.status().message(),
                                absl::StrCat(path, ": model=kimi-linear is not a known model")))
      << file.status();
  EXPECT_TRUE(absl::StrContains(file.status().message(), ModelPresetNames())) << file.status();
}

// A file without the new fields reads as before, errors included.
TEST(LoadConfigFileTest, PlainFilesAreUnchanged) {
  absl::StatusOr<ConfigFile> file =
      LoadConfigFile(WriteFile("plain.json", R"({"layout": {"num_layers": 7}})"));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE(file->model.empty());
  EXPECT_FALSE(file->num_blocks_given);
  EXPECT_EQ(file->config.layout().num_layers(), 7);
  EXPECT_EQ(file->config.layout().num_heads(), DefaultServiceConfig().layout().num_heads());
  absl::StatusOr<ConfigFile> bad =
      LoadConfigFile(WriteFile("typo.json", R"({"layout": {"num_layer": 7}})"));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "is not a valid ServiceConfig in JSON"))
      << bad.status();
  EXPECT_EQ(LoadConfigFile("/nonexistent/x.json").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace server
}  // namespace specstate
