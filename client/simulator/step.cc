// The driver's steps (driver.h): one decode step, as a scheduler runs it,
// from the requests' churn to RecordStateBlocks, with the checks after each
// phase, the crash and corruption tests, and the metadata's doorbells.
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/simulator/driver.h"

namespace specstate {
namespace client {
namespace simulator_internal {

// One decode step, as a scheduler runs it. The order of the phases is the
// protocol's (ASYNC Verify calls go out before their inputs exist; with
// events they go out after the inputs' event is recorded), and the order
// of the random draws is fixed by it: a seed replays the same simulation.
absl::Status Driver::Step(int s) {
  StepPlan p;
  p.step = s;
  absl::Status st = ChurnRequests(s);
  if (st.ok()) st = model_->DrawRows(p);
  if (st.ok()) st = LayOutMetadata(p);
  if (!st.ok()) return st;
  BuildVerifies(p);
  if (options_.async && !options_.events) {
    st = SendVerifies(p, "Verify (async)");
    if (!st.ok()) return st;
    TracePhase(s, "Verify calls sent ahead of their inputs");
  }
  st = WriteInputs(p);
  if (st.ok()) st = UpdateConvWindows(p);
  if (!st.ok()) return st;

  // The stock path, on the simulator's own memory.
  TracePhase(s, "inputs and conv update written");
  st = stock_->Run(proj_, g_, model_->requests(), p.qsl, p.num_tokens);
  if (!st.ok()) return st;
  TracePhase(s, "stock path done");

  st = options_.drill != nullptr ? ServiceCallsAcrossRestarts(p) : ServiceCalls(p);
  if (st.ok()) st = checker_->CompareCommitted(p);
  if (!st.ok()) return st;
  model_->Advance(p);
  last_listed_.clear();
  for (int32_t b : checker_->PendingBlocks()) {
    if (b > 0) last_listed_.push_back(b);
  }
  last_step_id_ = p.step_id;
  if (phases_.pending_blocks) st = MaterializeSome(p.step);
  if (st.ok() && options_.host_tier_every > 0 && options_.drill == nullptr &&
      (p.step + 1) % options_.host_tier_every == 0) {
    st = EvictAndRestore(p.step);
  }
  if (st.ok() && options_.transfer_every > 0 && (p.step + 1) % options_.transfer_every == 0) {
    st = TransferRoundTrip(p.step);
  }
  if (st.ok() && s == options_.corrupt_after_step) {
    st = CorruptARunningState(/*flip=*/rank_ == options_.corrupt_rank, s);
  }
  return st;
}

// The step's calls to the service, from Verify (SYNC, or with the inputs'
// doorbell rung) to RecordStateBlocks, and the checks of their outputs.
absl::Status Driver::ServiceCalls(const StepPlan& p) {
  const int s = p.step;
  absl::Status st = RunVerifies(p);
  if (!st.ok()) return st;
  TracePhase(s, "Verify done");
  if (s == options_.crash_after_verify_step) Crash();
  st = checker_->CompareOutputs(p);
  if (st.ok()) st = checker_->BeforeCommit(p);
  if (st.ok()) st = CommitStep(p);
  if (st.ok() && d_.align) st = RecordStateBlocks(p);
  return st;
}

// Churn: finished requests leave, new ones arrive (each put into the pools
// and the stock path, as a prefill would).
absl::Status Driver::ChurnRequests(int s) {
  for (int i = 0; i < d_.R; ++i) {
    if (model_->DrawFinish(s, i)) {
      absl::Status st = FinishRequest(i);
      if (!st.ok()) return st;
    }
    absl::StatusOr<bool> started = model_->DrawStart(s, i);
    if (!started.ok()) return started.status();
    if (!*started) continue;
    absl::Status st = Prefill(i);
    if (!st.ok()) return st;
  }
  TracePhase(s, "requests finished and started");
  model_->CountSavedStateBytes();
  return absl::OkStatus();
}

// A finished request's blocks go back to the pool, so their pending tokens
// (DEFERRED, FAST) must not land on the next request's state: Flush with
// `discard` first.
absl::Status Driver::FinishRequest(int slot) {
  const int32_t pending = checker_->PendingBlock(slot);
  if (pending > 0) {
    v1::FlushRequest discard;
    discard.mutable_blocks()->mutable_values()->add_values(pending);
    discard.set_discard(true);
    absl::StatusOr<v1::FlushResponse> flushed =
        latencies_.Time("Flush (discard)", [&] { return session_->Flush(discard); });
    if (!flushed.ok()) return flushed.status();
    checker_->Discarded(slot);
  }
  model_->Finish(slot);
  return absl::OkStatus();
}

// The new request in `slot`: its running state in its checkpoint block and
// in its stock column 0, and its conv history, layer by layer.
absl::Status Driver::Prefill(int slot) {
  const int32_t block = model_->CheckpointBlock(model_->requests()[slot]);
  for (int l = 0; l < d_.L; ++l) {
    const PrefillLayer prefill = model_->DrawPrefill(slot, l);
    absl::Status st = pools_->WriteState(l, block, prefill.state());
    if (st.ok()) st = stock_->StartRequest(l, slot, prefill);
    if (st.ok()) checker_->StartRequest(l, slot, prefill);
    if (st.ok()) st = pools_->WriteConv(l, block, prefill.conv);
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

// The step's metadata on the host; the doorbells keep their values across
// steps.
absl::Status Driver::LayOutMetadata(StepPlan& p) {
  model_->LayOutBatch(p);
  return memory_->CopyOut(p.meta.data() + at_.door, Meta(at_.door), 4 * 4);
}

// Every layer's Verify request (ASYNC: built, and maybe sent, before any
// input exists). Without bound inputs each carries its tensors, and the
// metadata on layer 0 and every third step (later layers may rely on the
// step's copy).
void Driver::BuildVerifies(StepPlan& p) {
  p.verifies.assign(d_.L, v1::VerifyRequest());
  p.step_id = session_->NextStep();
  for (int l = 0; l < d_.L; ++l) {
    v1::VerifyRequest& v = p.verifies[l];
    v.set_step(p.step_id);
    v.set_layer(l);
    v.set_num_rows(d_.R);
    if (options_.bound_inputs) {
      v.set_bound_inputs(true);
      v.set_num_tokens(p.num_tokens);
    } else {
      if (l == 0 || p.step % 3 == 0) {
        *v.mutable_query_start_loc() = session_->Index(Meta(p.at.qsl), {d_.R + 1}).value();
        *v.mutable_state_indices() = session_->Index(Meta(p.at.idx), {d_.R}).value();
      }
      SetLayerTensors(l, p.num_tokens, &v);
    }
    if (options_.async && options_.events) {
      v.set_ordering(v1::ASYNC);
      v.mutable_wait()->mutable_event()->set_handle(inputs_ready_->handle());
      if (l == d_.L - 1) v.mutable_signal()->mutable_event()->set_handle(work_done_->handle());
    } else if (options_.async) {
      v.set_ordering(v1::ASYNC);
      *v.mutable_wait()->mutable_doorbell() = Door(0, p.step + 1);
      if (l == d_.L - 1) *v.mutable_signal()->mutable_doorbell() = Door(1, p.step + 1);
    }
  }
}

// Sends every layer's Verify: one call each, or one SubmitStep.
absl::Status Driver::SendVerifies(const StepPlan& p, const std::string& name) {
  if (options_.batch) {
    v1::SubmitStepRequest batch;
    for (const v1::VerifyRequest& v : p.verifies) *batch.add_verifies() = v;
    return latencies_
        .Time("SubmitStep (" + name + ")", [&] { return session_->SubmitStep(batch); })
        .status();
  }
  for (int l = 0; l < d_.L; ++l) {
    absl::StatusOr<v1::VerifyResponse> r =
        latencies_.Time(name, [&] { return session_->Verify(p.verifies[l]); });
    if (!r.ok()) return r.status();
  }
  return absl::OkStatus();
}

// The inputs in the shared buffers: metadata, every layer's activations
// (at capacity), and poisoned outputs, the service's and the stock path's.
// The activations are drawn for the whole model (under tensor parallelism
// the TP=1 run reads them all); this rank's service gets its heads.
absl::Status Driver::WriteInputs(const StepPlan& p) {
  absl::Status st = memory_->CopyIn(meta_->data(), p.meta.data(), at_.door * 4);
  if (!st.ok()) return st;
  std::vector<char> poison(d_.tmax * d_.FVW * d_.as, static_cast<char>(0xff));
  for (int l = 0; l < d_.L; ++l) {
    const LayerInputs model = model_->DrawLayerInputs();
    if (tp_ == 1) {
      st = WriteLayerInputs(l, model, poison);
      checker_->RunReference(l, model, model_->requests(), p.qsl, p.num_tokens);
    } else {
      st = WriteLayerInputs(l, model_->RankPart(model), poison);
      if (st.ok()) st = stock_->WriteModelInputs(l, model, poison);
    }
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

// Layer `l`'s activations of this service in its buffers, and its outputs
// and the stock path's poisoned.
absl::Status Driver::WriteLayerInputs(int l, const LayerInputs& in,
                                      const std::vector<char>& poison) {
  absl::Status st = memory_->CopyIn(proj_[l]->data(), in.proj.data(), in.proj.size());
  if (st.ok()) st = memory_->CopyIn(g_[l]->data(), in.g.data(), in.g.size());
  if (st.ok()) st = memory_->CopyIn(o_[l]->data(), poison.data(), d_.tmax * d_.VW * d_.as);
  if (st.ok()) st = stock_->PoisonOutput(l, poison);
  return st;
}

// The scheduler's conv update on every live row's checkpoint block; keeps
// each row's updated columns in `p.updated` for the window checks after
// Commit.
absl::Status Driver::UpdateConvWindows(StepPlan& p) {
  p.updated.assign(d_.R, {});
  for (int i = 0; i < d_.R; ++i) {
    if (!model_->requests()[i].live) continue;
    p.updated[i].resize(d_.L);
    const int tokens = p.tokens[i];
    for (int l = 0; l < d_.L; ++l) {
      p.updated[i][l] = model_->DrawConvUpdate(i, l, tokens);
      absl::Status st =
          pools_->UpdateConv(l, p.checkpoint[i], p.updated[i][l], d_.hl - 1 + tokens);
      if (!st.ok()) return st;
    }
  }
  return absl::OkStatus();
}

// Verify, once the inputs are written: ASYNC by events (record, send, wait
// for the last layer's), ASYNC by doorbells (already sent: ring, wait), or
// SYNC (send).
absl::Status Driver::RunVerifies(const StepPlan& p) {
  absl::Status st;
  if (options_.async && options_.events) {
    // An event wait applies to the record made before the call: record the
    // inputs' event, then send the Verify calls, then wait for the last one.
    st = inputs_ready_->Record();
    if (st.ok()) st = SendVerifies(p, "Verify (async, events)");
    if (st.ok()) st = work_done_->Synchronize();
  } else if (options_.async) {
    uint32_t ring = p.step + 1;
    st = memory_->CopyIn(Meta(at_.door + 0), &ring, 4);
    if (st.ok()) st = WaitDoorbell(1, p.step + 1);
  } else {
    st = SendVerifies(p, "Verify");
  }
  return st;
}

// The step's Commit request (ASYNC: it signals doorbell 2). The crash test
// `abandon_commit_at_step` makes it wait on doorbell 3, never rung.
v1::CommitRequest Driver::BuildCommit(const StepPlan& p) {
  const int s = p.step;
  v1::CommitRequest commit;
  commit.set_step(p.step_id);
  *commit.mutable_num_accepted() = session_->Index(Meta(p.at.acc), {p.batch}).value();
  if (p.remap) {
    *commit.mutable_request_indices() = session_->Index(Meta(p.at.req), {d_.R}).value();
  }
  if (d_.align) {
    *commit.mutable_block_table() =
        session_->Index(Meta(p.at.table), {p.batch, d_.width}).value();
    *commit.mutable_num_computed_tokens() = session_->Index(Meta(p.at.nc), {p.batch}).value();
  }
  if (options_.async) {
    commit.set_ordering(v1::ASYNC);
    *commit.mutable_signal()->mutable_doorbell() = Door(2, s + 1);
  }
  if (s == options_.abandon_commit_at_step) {  // doorbell 3 is never rung
    commit.set_ordering(v1::ASYNC);
    *commit.mutable_wait()->mutable_doorbell() = Door(3, s + 1);
  }
  return commit;
}

// Commit, and (ASYNC) the wait for its doorbell; `abandon_commit_at_step`
// dies once it is sent.
absl::Status Driver::CommitStep(const StepPlan& p) {
  const int s = p.step;
  const v1::CommitRequest commit = BuildCommit(p);
  TracePhase(s, "outputs compared; Commit");
  absl::StatusOr<v1::CommitResponse> r = latencies_.Time(
      options_.async ? "Commit (async)" : "Commit", [&] { return session_->Commit(commit); });
  if (!r.ok()) return r.status();
  if (s == options_.abandon_commit_at_step) Crash();
  if (options_.async) {
    absl::Status st = WaitDoorbell(2, s + 1);
    if (!st.ok()) return st;
  }
  TracePhase(s, "Commit done");
  return absl::OkStatus();
}

// Align mode: RecordStateBlocks into the metadata's poisoned output rows,
// then its outputs checked.
absl::Status Driver::RecordStateBlocks(const StepPlan& p) {
  v1::RecordStateBlocksRequest record;
  record.set_step(p.step_id);
  *record.mutable_idx_mapping() = session_->Index(Meta(p.at.map), {p.batch}).value();
  *record.mutable_num_sampled() = session_->Index(Meta(p.at.sampled), {p.batch}).value();
  *record.mutable_num_computed_tokens() = session_->Index(Meta(p.at.nc), {p.batch}).value();
  if (p.remap) {
    *record.mutable_request_indices() = session_->Index(Meta(p.at.req), {d_.R}).value();
  }
  record.set_block_table_width(d_.width);
  *record.mutable_state_idx() =
      session_->Tensor(Meta(p.at.out_idx), DType::kInt32, {d_.R}).value();
  *record.mutable_num_accepted() =
      session_->Tensor(Meta(p.at.out_acc), DType::kInt32, {d_.R}).value();
  absl::StatusOr<v1::RecordStateBlocksResponse> r = latencies_.Time(
      "RecordStateBlocks", [&] { return session_->RecordStateBlocks(record); });
  if (!r.ok()) return r.status();
  TracePhase(p.step, "RecordStateBlocks done");
  return checker_->CheckRecordedBlocks(p, Meta(p.at.out_idx));
}

// The verdict's own test (`corrupt_after_step`): flips one mantissa bit of
// the first element of the first live request's running state, in the
// service's pool, through the exported handle; the request never finishes.
// Under tensor parallelism only `corrupt_rank` flips the bit, but every
// rank pins the request (which changes the random draws that follow).
// FAST (ModePhases::corrupt_whole_block): the block is flushed first and
// every element of the block doubled or halved (ServicePools::FlipStateBit).
absl::Status Driver::CorruptARunningState(bool flip, int step) {
  const int slot = model_->FirstLive();
  if (slot < 0) return absl::OkStatus();
  const int32_t block = model_->CheckpointBlock(model_->requests()[slot]);
  if (phases_.corrupt_whole_block && checker_->PendingBlock(slot) > 0) {
    absl::Status st = FlushAndCheck({block}, step, "a Flush before the planted corruption");
    if (!st.ok()) return st;
  }
  if (flip) {
    absl::Status st = pools_->FlipStateBit(0, block, phases_.corrupt_whole_block ? d_.VW * d_.K : 1,
                                           options_.corrupt_with_nan);
    if (!st.ok()) return st;
  }
  model_->Pin(slot);
  return absl::OkStatus();
}

// The crash tests: the pools' fingerprint, then death by SIGKILL, as a
// scheduler killed mid-step.
void Driver::Crash() {
  std::printf("CRASH POINT pools=%016llx\n",
              static_cast<unsigned long long>(pools_->Fingerprint()));
  std::fflush(stdout);
  raise(SIGKILL);
  std::abort();
}

// The metadata buffer's doorbells.

absl::Status Driver::WaitDoorbell(int index, uint32_t value) {
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  for (;;) {
    uint32_t v = 0;
    absl::Status st = memory_->CopyOut(&v, Meta(at_.door + index), 4);
    if (!st.ok()) return st;
    if (v >= value) return absl::OkStatus();
    if (Clock::now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("the service did not signal doorbell ", index, " within 20 s"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

v1::Doorbell Driver::Door(int index, uint32_t value) {
  v1::Doorbell d;
  d.set_region("meta");
  d.set_offset_bytes((at_.door + index) * 4);
  d.set_value(value);
  return d;
}

}  // namespace simulator_internal
}  // namespace client
}  // namespace specstate
