// Fixtures shared by the per-mode integration tests (deferred_commit_test,
// fast_commit_test; CPU backend, over a real socket):
//  - ModePairTest: a specstated in the commit mode under test beside an
//    EAGER one, each driven by a test Scheduler (test_scheduler.h: its
//    driving session, its regions, the pools mapped), both given the same
//    calls step by step;
//  - ModeSimulationTest: the simulator's verdict against a specstated in the
//    mode (a fresh service each run, a random seed traced).
//
//   class DeferredCommitTest : public testing::ModePairTest {
//    protected:
//     void SetUp() override {
//       StartPair({"--commit_mode=eager"}, {"--commit_mode=deferred"}, "DEFERRED");
//     }
//   };
//   ASSERT_NO_FATAL_FAILURE(VerifyLayerOnBoth(step, layer));
//   ASSERT_TRUE(CommitOnBoth(step, {1, 2, 0}));
//   EXPECT_EQ(Block(mode_->Pools(), layer, 1), Block(eager_->Pools(), layer, 1));
#ifndef SPECSTATE_TESTS_INTEGRATION_MODE_FIXTURE_H_
#define SPECSTATE_TESTS_INTEGRATION_MODE_FIXTURE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "client/lib/client.h"
#include "client/simulator/simulator.h"
#include "gtest/gtest.h"
#include "tests/integration/server_process.h"
#include "tests/integration/test_scheduler.h"

namespace specstate {
namespace testing {

// Bytes of one layer's block `block` of pool `kind` ("recurrent" or "conv")
// in a snapshot of the pools (Scheduler::Pools) laid out as `views` says.
std::string PoolBlock(const std::string& pools, const v1::ExportPoolsResponse& views, int layer,
                      int block, const std::string& kind = "recurrent");

class ModePairTest : public ::testing::Test {
 protected:
  // Starts the EAGER service with `eager_flags`, then the mode's with
  // `mode_flags`; a client and a Scheduler each; views_ from the mode's
  // service. `mode` names it in messages ("DEFERRED", "FAST").
  void StartPair(const std::vector<std::string>& eager_flags,
                 const std::vector<std::string>& mode_flags, const std::string& mode);
  // On a failure, the mode's service's log (after the seed, when one was
  // drawn: seed_drawn_).
  void TearDown() override;

  // Layer `layer` of step `step` verified on both services, EAGER first; a
  // fatal failure when either refuses (ASSERT_NO_FATAL_FAILURE at the call).
  void VerifyLayerOnBoth(uint64_t step, int layer);
  // Step `step` committed with `accepted` on both, EAGER first; each refusal
  // a (non-fatal) failure. Whether both succeeded.
  bool CommitOnBoth(uint64_t step, const std::vector<int>& accepted);
  // `specstatectl layout` against the mode's service: what it printed.
  std::string CtlLayout();
  // PoolBlock of a snapshot of either service's pools (they share a layout).
  std::string Block(const std::string& pools, int layer, int block,
                    const std::string& kind = "recurrent") const {
    return PoolBlock(pools, views_, layer, block, kind);
  }

  std::unique_ptr<ServerProcess> eager_server_, mode_server_;
  std::unique_ptr<client::Client> eager_client_, mode_client_;
  std::unique_ptr<Scheduler> eager_, mode_;
  v1::ExportPoolsResponse views_;
  std::string mode_name_;
  bool seed_drawn_ = false;
  uint32_t seed_ = 0;
};

class ModeSimulationTest : public ::testing::Test {
 protected:
  // `mode`: SimulationOptions::commit_mode ("deferred", "fast");
  // `mode_flags`: what the mode's service is started with besides
  // --commit_mode=`mode` and each run's own flags.
  ModeSimulationTest(std::string mode, std::vector<std::string> mode_flags);

  // A simulation of `o` in the mode (a random seed, traced) against a fresh
  // service started with `flags`, --commit_mode=`mode` and the mode's flags.
  client::SimulationReport Simulate(std::vector<std::string> flags, client::SimulationOptions o);
  // A service started with `server_flags` refuses a simulation in the mode:
  // FAILED_PRECONDITION, its message holding `message`.
  void ExpectTheModeIsChecked(const std::vector<std::string>& server_flags,
                              const std::string& message);

  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<client::Client> client_;

 private:
  const std::string mode_;
  const std::vector<std::string> mode_flags_;
};

}  // namespace testing
}  // namespace specstate

#endif  // SPECSTATE_TESTS_INTEGRATION_MODE_FIXTURE_H_
