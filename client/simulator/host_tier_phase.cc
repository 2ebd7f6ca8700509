// The driver's host-tier phase (SimulationOptions::host_tier_every): between
// steps, a live request's block is saved to the service's host tier, its
// bytes in every layer overwritten with random ones (as when a prefix cache
// evicts the GPU copy and the block is reused), and the saved key restored
// into it. A block the mode holds pending (DEFERRED's tokens, FAST's ring)
// must then hold its materialized state, checked as after a Flush of it;
// any other block must hold exactly its bytes from before the save. The run
// then goes on from the restored block, every later state compared as usual.
#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/simulator/driver.h"

namespace specstate {
namespace client {
namespace simulator_internal {

absl::Status Driver::EvictAndRestore(int step) {
  std::vector<int> live;
  for (int i = 0; i < static_cast<int>(model_->requests().size()); ++i) {
    if (model_->requests()[i].live) live.push_back(i);
  }
  if (live.empty()) return absl::OkStatus();
  std::mt19937_64 rng(options_.seed * 1000003 + step);
  const int slot = live[std::uniform_int_distribution<size_t>(0, live.size() - 1)(rng)];
  const int32_t block = model_->CheckpointBlock(model_->requests()[slot]);
  if (block <= 0) return absl::OkStatus();
  const std::vector<int32_t> pending = checker_->PendingBlocks();
  const bool is_pending = std::find(pending.begin(), pending.end(), block) != pending.end();

  // Its bytes now (every layer's state and conv window).
  std::vector<std::vector<char>> states(d_.L), convs(d_.L);
  for (int l = 0; l < d_.L; ++l) {
    absl::Status st = pools_->ReadState(l, block, &states[l]);
    if (st.ok()) st = pools_->ReadConv(l, block, &convs[l]);
    if (!st.ok()) return st;
  }
  const std::string key = absl::StrCat("sim-step-", step, "-block-", block);
  v1::SaveBlocksRequest save;
  v1::SaveEntry* e = save.add_entries();
  e->set_block(block);
  e->set_key(key);
  absl::StatusOr<v1::SaveBlocksResponse> saved =
      latencies_.Time("SaveBlocks", [&] { return session_->SaveBlocks(save); });
  if (!saved.ok()) return saved.status();

  // Evicted: the block reused by someone else.
  for (int l = 0; l < d_.L; ++l) {
    std::vector<char> noise(states[l].size());
    for (char& c : noise) c = static_cast<char>(rng());
    std::vector<char> conv_noise(convs[l].size());
    for (char& c : conv_noise) c = static_cast<char>(rng());
    absl::Status st = pools_->WriteState(l, block, noise.data());
    if (st.ok()) st = pools_->WriteConv(l, block, conv_noise);
    if (!st.ok()) return st;
  }

  v1::RestoreBlocksRequest restore;
  v1::RestoreEntry* r = restore.add_entries();
  r->set_key(key);
  r->set_block(block);
  absl::StatusOr<v1::RestoreBlocksResponse> restored =
      latencies_.Time("RestoreBlocks", [&] { return session_->RestoreBlocks(restore); });
  if (!restored.ok()) return restored.status();
  ++report_.host_tier_round_trips;

  const std::string how = "a save, an eviction and a restore of its block";
  for (int l = 0; l < d_.L; ++l) {
    std::vector<char> state, conv;
    absl::Status st = pools_->ReadState(l, block, &state);
    if (st.ok()) st = pools_->ReadConv(l, block, &conv);
    if (!st.ok()) return st;
    Tally(report_).Count();
    if (conv != convs[l]) {
      Tally(report_).Mismatch(absl::StrCat("step ", step, ", layer ", l, ", block ", block,
                                           ": the conv window after ", how,
                                           " differs from the one saved"));
    }
    if (is_pending) continue;  // checked below, as after a Flush
    Tally(report_).Count();
    if (state != states[l]) {
      Tally(report_).Mismatch(absl::StrCat("step ", step, ", layer ", l, ", block ", block,
                                           ": the state after ", how,
                                           " differs from the one saved"));
    }
  }
  if (is_pending) return checker_->CheckFlushed({block}, step, how);
  return absl::OkStatus();
}

}  // namespace simulator_internal
}  // namespace client
}  // namespace specstate
