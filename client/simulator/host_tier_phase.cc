// The driver's host-tier phase (SimulationOptions::host_tier_every): between
// steps, a live request's block is saved to the service's host tier, its
// bytes in every layer overwritten with random ones (as when a prefix cache
// evicts the GPU copy and the block is reused), and the saved key restored
// into it. A block the mode holds pending (DEFERRED's tokens, FAST's ring)
// must then hold its materialized state, checked as after a Flush of it;
// any other block must hold exactly its bytes from before the save. The run
// then goes on from the restored block, every later state compared as usual.
//
// Also the helpers of every phase that moves a block out of the pools and
// back (the transfer phase, transfer_phase.cc, too): picking the block and
// its bytes, the eviction's noise, and the checks once it is back.
#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/simulator/driver.h"
#include "client/simulator/host_bytes.h"

namespace specstate {
namespace client {
namespace simulator_internal {

absl::StatusOr<Driver::MovingBlock> Driver::PickMovingBlock(std::mt19937_64& rng) {
  MovingBlock moving;
  std::vector<int> live;
  for (int i = 0; i < static_cast<int>(model_->requests().size()); ++i) {
    if (model_->requests()[i].live) live.push_back(i);
  }
  if (live.empty()) return moving;
  const int slot = live[std::uniform_int_distribution<size_t>(0, live.size() - 1)(rng)];
  const int32_t block = model_->CheckpointBlock(model_->requests()[slot]);
  if (block <= 0) return moving;
  const std::vector<int32_t> pending = checker_->PendingBlocks();
  moving.block = block;
  moving.pending = std::find(pending.begin(), pending.end(), block) != pending.end();
  moving.states.resize(d_.L);
  moving.convs.resize(d_.L);
  for (int l = 0; l < d_.L; ++l) {
    absl::Status st = pools_->ReadState(l, block, &moving.states[l]);
    if (st.ok()) st = pools_->ReadConv(l, block, &moving.convs[l]);
    if (!st.ok()) return st;
  }
  return moving;
}

absl::Status Driver::WriteNoise(ServicePools& pools, int32_t block, std::mt19937_64& rng) {
  std::vector<char> noise(d_.state_block_bytes);
  std::vector<char> conv_noise(int64_t{d_.D} * d_.W * d_.as);
  for (int l = 0; l < d_.L; ++l) {
    for (char& c : noise) c = static_cast<char>(rng());
    for (char& c : conv_noise) c = static_cast<char>(rng());
    absl::Status st = pools.WriteState(l, block, noise.data());
    if (st.ok()) st = pools.WriteConv(l, block, conv_noise);
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

void Driver::CompareBlockBytes(const std::vector<std::vector<char>>& got,
                               const std::vector<std::vector<char>>& want, bool states, int step,
                               int32_t block, absl::string_view whose, absl::string_view how) {
  for (int l = 0; l < d_.L; ++l) {
    Tally(report_).Count();
    if (got[l] == want[l]) continue;
    const int64_t element = got[l].size() != want[l].size()
                                ? 0
                                : FirstDifference(got[l].data(), want[l].data(),
                                                  states ? d_.ss : d_.as);
    Tally(report_).Mismatch(absl::StrCat("step ", step, ", layer ", l, ", ", whose, "block ",
                                         block, ": the ", states ? "state" : "conv window",
                                         " after ", how, " differs from the one saved at element ",
                                         element));
  }
}

absl::Status Driver::CheckMovedBack(const MovingBlock& moving, int step, absl::string_view how) {
  std::vector<std::vector<char>> states(d_.L), convs(d_.L);
  for (int l = 0; l < d_.L; ++l) {
    absl::Status st = pools_->ReadState(l, moving.block, &states[l]);
    if (st.ok()) st = pools_->ReadConv(l, moving.block, &convs[l]);
    if (!st.ok()) return st;
  }
  CompareBlockBytes(convs, moving.convs, /*states=*/false, step, moving.block, "", how);
  // A pending block's state is not the bytes it held (its checkpoint): it
  // must be the state a Flush leaves, which the mode's checker knows.
  if (moving.pending) return checker_->CheckFlushed({moving.block}, step, how);
  CompareBlockBytes(states, moving.states, /*states=*/true, step, moving.block, "", how);
  return absl::OkStatus();
}

absl::Status Driver::EvictAndRestore(int step) {
  std::mt19937_64 rng(options_.seed * 1000003 + step);
  absl::StatusOr<MovingBlock> moving = PickMovingBlock(rng);
  if (!moving.ok()) return moving.status();
  if (moving->block <= 0) return absl::OkStatus();
  const int32_t block = moving->block;

  const std::string key = absl::StrCat("sim-step-", step, "-block-", block);
  v1::SaveBlocksRequest save;
  v1::SaveEntry* e = save.add_entries();
  e->set_block(block);
  e->set_key(key);
  absl::StatusOr<v1::SaveBlocksResponse> saved =
      latencies_.Time("SaveBlocks", [&] { return session_->SaveBlocks(save); });
  if (!saved.ok()) return saved.status();

  absl::Status st = WriteNoise(*pools_, block, rng);  // evicted: the block reused
  if (!st.ok()) return st;

  v1::RestoreBlocksRequest restore;
  v1::RestoreEntry* r = restore.add_entries();
  r->set_key(key);
  r->set_block(block);
  absl::StatusOr<v1::RestoreBlocksResponse> restored =
      latencies_.Time("RestoreBlocks", [&] { return session_->RestoreBlocks(restore); });
  if (!restored.ok()) return restored.status();
  ++report_.host_tier_round_trips;
  return CheckMovedBack(*moving, step, "a save, an eviction and a restore of its block");
}

}  // namespace simulator_internal
}  // namespace client
}  // namespace specstate
