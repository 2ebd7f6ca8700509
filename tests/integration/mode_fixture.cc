#include "tests/integration/mode_fixture.h"

#include <cstdio>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"

namespace specstate {
namespace testing {

std::string PoolBlock(const std::string& pools, const v1::ExportPoolsResponse& views, int layer,
                      int block, const std::string& kind) {
  for (const v1::PoolView& view : views.pools()) {
    if (view.layer() != layer || view.kind() != kind) continue;
    const uint64_t block_bytes = view.byte_size() / view.shape(0);
    return pools.substr(view.offset_bytes() + block * block_bytes, block_bytes);
  }
  return "";
}

void ModePairTest::StartPair(const std::vector<std::string>& eager_flags,
                             const std::vector<std::string>& mode_flags, const std::string& mode) {
  mode_name_ = mode;
  eager_server_ = ValueOrDie(ServerProcess::Start(eager_flags));
  mode_server_ = ValueOrDie(ServerProcess::Start(mode_flags));
  eager_client_ = ValueOrDie(client::Client::Connect(eager_server_->address()));
  mode_client_ = ValueOrDie(client::Client::Connect(mode_server_->address()));
  eager_ = std::make_unique<Scheduler>(*eager_client_);
  mode_ = std::make_unique<Scheduler>(*mode_client_);
  views_ = ValueOrDie(mode_client_->ExportPools());
}

void ModePairTest::TearDown() {
  if (!HasFailure()) return;
  const std::string seed = seed_drawn_ ? absl::StrCat("seed ", seed_, "; ") : "";
  std::fprintf(stderr, "%s%s server log:\n%s", seed.c_str(), mode_name_.c_str(),
               mode_server_->Log().c_str());
}

void ModePairTest::VerifyLayerOnBoth(uint64_t step, int layer) {
  const absl::StatusOr<v1::VerifyResponse> eager =
      eager_->session().Verify(eager_->Verify(step, layer));
  ASSERT_TRUE(eager.ok()) << "EAGER: " << eager.status();
  const absl::StatusOr<v1::VerifyResponse> mode =
      mode_->session().Verify(mode_->Verify(step, layer));
  ASSERT_TRUE(mode.ok()) << mode_name_ << ": " << mode.status();
}

bool ModePairTest::CommitOnBoth(uint64_t step, const std::vector<int>& accepted) {
  const absl::StatusOr<v1::CommitResponse> eager =
      eager_->session().Commit(eager_->Commit(step, accepted));
  EXPECT_TRUE(eager.ok()) << "EAGER: " << eager.status();
  const absl::StatusOr<v1::CommitResponse> mode =
      mode_->session().Commit(mode_->Commit(step, accepted));
  EXPECT_TRUE(mode.ok()) << mode_name_ << ": " << mode.status();
  return eager.ok() && mode.ok();
}

std::string ModePairTest::CtlLayout() {
  return ValueOrDie(RunProcess({RunfilePath("client/cli/specstatectl"),
                                "--server=" + mode_server_->address(), "layout"}))
      .output;
}

ModeSimulationTest::ModeSimulationTest(std::string mode, std::vector<std::string> mode_flags)
    : mode_(std::move(mode)), mode_flags_(std::move(mode_flags)) {}

client::SimulationReport ModeSimulationTest::Simulate(std::vector<std::string> flags,
                                                      client::SimulationOptions o) {
  flags.push_back("--commit_mode=" + mode_);
  flags.insert(flags.end(), mode_flags_.begin(), mode_flags_.end());
  server_ = ValueOrDie(ServerProcess::Start(flags));
  client_ = ValueOrDie(client::Client::Connect(server_->address()));
  o.commit_mode = mode_;
  o.seed = std::random_device()();
  SCOPED_TRACE(absl::StrCat("seed ", o.seed));
  return ValueOrDie(client::RunSimulation(*client_, o));
}

void ModeSimulationTest::ExpectTheModeIsChecked(const std::vector<std::string>& server_flags,
                                                const std::string& message) {
  server_ = ValueOrDie(ServerProcess::Start(server_flags));
  client_ = ValueOrDie(client::Client::Connect(server_->address()));
  client::SimulationOptions o;
  o.commit_mode = mode_;
  const absl::StatusOr<client::SimulationReport> r = client::RunSimulation(*client_, o);
  ExpectError(r.status(), absl::StatusCode::kFailedPrecondition, message);
}

}  // namespace testing
}  // namespace specstate
