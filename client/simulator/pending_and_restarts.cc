// The driver's pending blocks and restarts (driver.h): where the commit mode
// keeps pending blocks (ModePhases::pending_blocks: DEFERRED, FAST), a
// Flush or a ReadState between steps now and then, and a Flush of every
// block at the end, each checked by the mode's checker; under a restart
// drill, a step's calls and the calls between steps across the service's
// restarts (ResumeAfterRestart: what the service kept, checked; lost blocks
// re-prefilled).
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/simulator/driver.h"

namespace specstate {
namespace client {
namespace simulator_internal {

// Flush of `blocks` (empty: every pending block), SYNC, then each flushed
// pending block checked.
absl::Status Driver::FlushAndCheck(const std::vector<int32_t>& blocks, int step,
                                   absl::string_view how) {
  v1::FlushRequest flush;
  for (int32_t b : blocks) flush.mutable_blocks()->mutable_values()->add_values(b);
  absl::StatusOr<v1::FlushResponse> r =
      latencies_.Time("Flush", [&] { return session_->Flush(flush); });
  if (!r.ok()) return r.status();
  return checker_->CheckFlushed(blocks, step, how);
}

Driver::DeferredSnapshot Driver::SnapshotPending(bool between_steps) const {
  DeferredSnapshot s;
  if (!phases_.drill_keeps_pending) return s;
  s.expected = checker_->Expectations();
  for (const ModeChecker::Expected& e : s.expected) s.expect.pending.push_back(e.block);
  s.expect.listed = last_listed_;
  s.expect.between_steps = between_steps;
  return s;
}

// The scheduler's re-prefill of the blocks a restart reports lost: their
// bytes from before the step (or call); a block that had tokens pending
// gets the state they lead to (the service forgot them).
absl::Status Driver::RePrefill(const std::vector<int32_t>& lost, const std::vector<char>& before,
                               const DeferredSnapshot* snapshot) {
  for (int32_t block : lost) {
    absl::Status st = pools_->Restore(block, before);
    if (!st.ok()) return st;
    if (snapshot == nullptr) continue;
    for (const ModeChecker::Expected& e : snapshot->expected) {
      if (e.block != block) continue;
      for (int l = 0; l < d_.L; ++l) {
        st = pools_->WriteState(l, block, e.state[l].data());
        if (!st.ok()) return st;
      }
      if (checker_->PendingBlock(e.slot) == block) checker_->Forget(e.slot);
    }
  }
  return absl::OkStatus();
}

absl::Status Driver::BetweenStepsAcrossRestarts(const std::function<absl::Status()>& call) {
  std::vector<char> before;
  absl::Status st = pools_->ReadAll(&before);
  if (!st.ok()) return st;
  for (int attempt = 0;; ++attempt) {
    const DeferredSnapshot snapshot = SnapshotPending(true);
    st = call();
    if (st.code() != absl::StatusCode::kUnavailable || attempt == 4) return st;
    absl::StatusOr<ResumeOutcome> resumed = ResumeAfterRestart(
        *options_.drill, *session_, last_step_id_, {}, before,
        [this](std::vector<char>* now) { return pools_->ReadAll(now); },
        [this](int32_t block) { return pools_->Spans(block); },
        [this](const std::string& what) {
          Tally(report_).Mismatch(absl::StrCat("between steps: ", what));
        },
        &snapshot.expect);
    if (!resumed.ok()) return resumed.status();
    ++report_.restarts;
    report_.lost_blocks += resumed->lost.size();
    st = RePrefill(resumed->lost, before, &snapshot);
    if (!st.ok()) return st;
    // Pending blocks the call did not lose are still pending, or
    // materialized in some layers: the next call checks them.
    st = pools_->ReadAll(&before);
    if (!st.ok()) return st;
  }
}

absl::Status Driver::FinalFlush() { return FlushAndCheck({}, options_.steps, "the final Flush"); }

absl::Status Driver::MaterializeSome(int step) {
  if (options_.drill == nullptr) return MaterializeSomeOnce(step);
  return BetweenStepsAcrossRestarts([this, step] { return MaterializeSomeOnce(step); });
}

// Between steps, now and then, as a scheduler would: a Flush of every
// pending block, of some of them, or a ReadState of one pending block in
// one layer (its values and checksum; the block's bytes in the pool, which
// a read may not change).
absl::Status Driver::MaterializeSomeOnce(int step) {
  const std::vector<int32_t> pending = checker_->PendingBlocks();
  const Materialization m = model_->DrawMaterialization(pending);
  switch (m.kind) {
    case Materialization::kNone:
      return absl::OkStatus();
    case Materialization::kFlushAll:
      return FlushAndCheck({}, step, "a Flush of every block");
    case Materialization::kFlushSome:
      return FlushAndCheck(m.blocks, step, "a Flush of its block");
    case Materialization::kRead:
      break;
  }
  const int32_t block = pending[m.slot];
  std::vector<char> before, after;
  absl::Status st = pools_->ReadState(m.layer, block, &before);
  if (!st.ok()) return st;
  absl::StatusOr<v1::ReadStateResponse> r =
      latencies_.Time("ReadState", [&] { return client_.ReadState(m.layer, block, true); });
  if (!r.ok()) return r.status();
  st = pools_->ReadState(m.layer, block, &after);
  if (!st.ok()) return st;
  Tally tally(report_);
  tally.Count();
  if (before != after) {
    tally.Mismatch(absl::StrFormat(
        "step %d, layer %d: ReadState of block %d changed its bytes in the pool (a read "
        "materializes into a copy and changes nothing)",
        step, m.layer, block));
  }
  return checker_->CheckRead(step, m.slot, m.layer, *r);
}

// ServiceCalls under a restart drill: when the service dies during them,
// the drill starts it again; what it kept is checked (ResumeAfterRestart),
// the lost blocks re-prefilled (their bytes from before the step) and the
// step re-run under a new step id unless its Commit had finished.
absl::Status Driver::ServiceCallsAcrossRestarts(StepPlan& p) {
  options_.drill->BeforeStep(p.step);
  std::vector<char> before;
  absl::Status st = pools_->ReadAll(&before);
  if (!st.ok()) return st;
  for (int attempt = 0;; ++attempt) {
    // The pending blocks a restart keeps, as the (re-)run begins.
    const DeferredSnapshot snapshot = SnapshotPending(false);
    st = ServiceCalls(p);
    if (st.code() != absl::StatusCode::kUnavailable || attempt == 4) return st;
    absl::StatusOr<ResumeOutcome> resumed = ResumeAfterRestart(
        *options_.drill, *session_, p.step_id, model_->CommitWrites(p), before,
        [this](std::vector<char>* now) { return pools_->ReadAll(now); },
        [this](int32_t block) { return pools_->Spans(block); },
        [this, s = p.step](const std::string& what) {
          Tally(report_).Mismatch(absl::StrCat("step ", s, ": ", what));
        },
        phases_.drill_keeps_pending ? &snapshot.expect : nullptr);
    if (!resumed.ok()) return resumed.status();
    ++report_.restarts;
    report_.lost_blocks += resumed->lost.size();
    st = RePrefill(resumed->lost, before, phases_.drill_keeps_pending ? &snapshot : nullptr);
    if (!st.ok()) return st;
    if (resumed->committed) {
      // Its Commit finished; its answer (and, in align mode, its
      // RecordStateBlocks in the old session) was lost.
      return absl::OkStatus();
    }
    ++report_.steps_rerun;
    BuildVerifies(p);  // a new step id
  }
}

}  // namespace simulator_internal
}  // namespace client
}  // namespace specstate
