#include "client/simulator/deferred_checker.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/simulator/host_bytes.h"
#include "server/base/fnv1a.h"

namespace specstate {
namespace client {
namespace simulator_internal {
namespace {

ModePhases DeferredPhases() {
  ModePhases phases;
  phases.pending_blocks = true;
  phases.drill_keeps_pending = true;
  return phases;
}

}  // namespace

DeferredChecker::DeferredChecker(SharedMemory& memory, const ServicePools& pools,
                                 const StockPath& stock, const LayerBuffers& outputs,
                                 const Model& model, const Dims& dims, SimulationReport& report,
                                 Tp1Checks* tp1)
    : ModeChecker(DeferredPhases(), memory, pools, stock, outputs, model, dims, report, tp1),
      pending_(dims.R) {
  report_.deferred = true;
}

absl::Status DeferredChecker::BeforeCommit(const StepPlan& p) {
  absl::Status st = CheckMaterializedByVerify(p);
  if (st.ok()) st = SnapshotCheckpoints(p);
  return st;
}

absl::Status DeferredChecker::CheckMaterializedByVerify(const StepPlan& p) {
  for (int i = 0; i < d_.R; ++i) {
    if (!model_.requests()[i].live || pending_[i].block <= 0) continue;
    if (pending_[i].block != p.checkpoint[i]) continue;  // (align: it moved on)
    ++report_.materialized_by_verify;
    absl::Status st = CheckMaterialized(p.step, i, "Verify");
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::Status DeferredChecker::SnapshotCheckpoints(const StepPlan& p) {
  checkpoints_.assign(d_.R, {});
  for (int i = 0; i < d_.R; ++i) {
    if (!model_.requests()[i].live) continue;
    checkpoints_[i].resize(d_.L);
    for (int l = 0; l < d_.L; ++l) {
      absl::Status st = pools_.ReadState(l, p.checkpoint[i], &checkpoints_[i][l]);
      if (!st.ok()) return st;
    }
  }
  return absl::OkStatus();
}

bool DeferredChecker::StartsPending(const StepPlan& p, int slot, const CommittedBlocks& c) {
  const bool pending =
      p.accepted[slot] > 0 && c.final_block == p.checkpoint[slot] && c.boundary_block <= 0;
  if (!pending) return false;
  Pending& pend = pending_[slot];
  pend = Pending();
  pend.block = c.final_block;
  pend.step = p.step;
  pend.state.resize(d_.L);
  pend.tp1_state.resize(d_.L);
  ++report_.pending_checked;
  return true;
}

absl::Status DeferredChecker::CheckPending(const StepPlan& p, int slot, int layer) {
  Pending& pend = pending_[slot];
  const int col = p.accepted[slot] - 1;
  const int64_t bytes = d_.state_block_bytes;
  absl::Status st = CompareBytes(p.step, layer, slot, pend.block, checkpoints_[slot][layer],
                                 "pending block (its checkpoint, after Commit)", "the checkpoint");
  pend.state[layer].resize(bytes);
  if (st.ok()) {
    st = memory_.CopyOut(pend.state[layer].data(), stock_.Block(layer, slot, col), bytes);
  }
  if (st.ok() && d_.tp > 1) {
    pend.tp1_state[layer].resize(bytes);
    st = memory_.CopyOut(pend.tp1_state[layer].data(),
                         stock_.ModelBlock(layer, slot, col) + d_.rank * bytes, bytes);
  }
  return st;
}

absl::Status DeferredChecker::CheckFlushed(const std::vector<int32_t>& blocks, int step,
                                           absl::string_view how) {
  for (int i = 0; i < d_.R; ++i) {
    const int32_t b = pending_[i].block;
    if (b <= 0) continue;
    if (!blocks.empty() && std::find(blocks.begin(), blocks.end(), b) == blocks.end()) continue;
    ++report_.materialized_by_flush;
    absl::Status st = CheckMaterialized(step, i, how);
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::Status DeferredChecker::CheckRead(int step, int slot, int layer,
                                        const v1::ReadStateResponse& read) {
  Pending& pend = pending_[slot];
  const std::vector<char>& state = pend.state[layer];
  tally_.Count();
  ++report_.materialized_by_read;
  if (read.recurrent().checksum() != server::Fnv1a(absl::string_view(state.data(), state.size()))) {
    tally_.Mismatch(absl::StrFormat(
        "step %d, layer %d, row %d: ReadState's checksum of pending block %d (committed at "
        "step %d) differs from the stock path's state",
        step, layer, slot, pend.block, pend.step));
  }
  // Its values, bit for bit; the block stays pending (a read materializes
  // into a copy), to be checked where it is materialized.
  const std::vector<char> values =
      BytesOfValues(read.recurrent().values().data(), read.recurrent().values_size(), d_.state);
  tally_.Count();
  if (values.size() != state.size() || std::memcmp(values.data(), state.data(), state.size()) != 0) {
    const int64_t e = values.size() != state.size()
                          ? 0
                          : FirstDifference(values.data(), state.data(), d_.ss);
    tally_.Mismatch(absl::StrFormat(
        "step %d, layer %d, row %d: the state ReadState materialized (a copy) of pending block "
        "%d differs from the stock path's state at element %d (%d values read)",
        step, layer, slot, pend.block, e, read.recurrent().values_size()));
  }
  return absl::OkStatus();
}

std::vector<int32_t> DeferredChecker::PendingBlocks() const {
  std::vector<int32_t> blocks;
  for (const Pending& pend : pending_) blocks.push_back(pend.block);
  return blocks;
}

std::vector<ModeChecker::Expected> DeferredChecker::Expectations() const {
  std::vector<Expected> out;
  for (int i = 0; i < d_.R; ++i) {
    if (pending_[i].block > 0) out.push_back(Expected{i, pending_[i].block, pending_[i].state});
  }
  return out;
}

void DeferredChecker::Discarded(int slot) {
  pending_[slot] = Pending();
  ++report_.discarded;
}

absl::Status DeferredChecker::CheckMaterialized(int step, int slot, absl::string_view how) {
  Pending& pend = pending_[slot];
  for (int l = 0; l < d_.L; ++l) {
    const std::string what =
        absl::StrCat("state materialized by ", how, " (committed at step ", pend.step, ")");
    absl::Status st =
        CompareBytes(step, l, slot, pend.block, pend.state[l], what, "the stock path's state");
    if (st.ok() && d_.tp > 1) {
      st = CompareBytes(step, l, slot, pend.block, pend.tp1_state[l], what, "the TP=1 run's state",
                        /*tp1=*/true);
    }
    if (!st.ok()) return st;
  }
  pend = Pending();
  return absl::OkStatus();
}

absl::Status DeferredChecker::CompareBytes(int step, int layer, int slot, int32_t block,
                                           const std::vector<char>& expected,
                                           absl::string_view what, absl::string_view against,
                                           bool tp1) {
  std::vector<char> service;
  absl::Status st = pools_.ReadState(layer, block, &service);
  if (!st.ok()) return st;
  tally_.Count(tp1);
  if (std::memcmp(service.data(), expected.data(), service.size()) == 0) return absl::OkStatus();
  const int64_t e = FirstDifference(service.data(), expected.data(), d_.ss);
  tally_.Mismatch(
      absl::StrFormat(
          "step %d, layer %d, row %d: the %s in block %d differs from %s at element %d: %.9g vs "
          "%.9g",
          step, layer, slot, std::string(what), block, std::string(against), e,
          ElementAsFloat(service.data() + e * d_.ss, d_.state),
          ElementAsFloat(expected.data() + e * d_.ss, d_.state)),
      tp1);
  return absl::OkStatus();
}

}  // namespace simulator_internal
}  // namespace client
}  // namespace specstate
