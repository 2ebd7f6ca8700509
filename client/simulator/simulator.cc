// The driver of the simulation: sets up one service (its layout, pools,
// session, shared buffers, the stock path's memory and the layer parameters)
// and runs the decode steps on it, as a scheduler does, calling on the model
// (model.h) for the draws, the stock path (stock_path.h) for the reference
// and the checker of the service's commit mode (mode_checker.h) after each
// phase; where the mode keeps pending blocks (DEFERRED, FAST) it also
// flushes and reads them between steps; under a restart drill it resumes its
// session across the service's restarts; under tensor parallelism one driver
// per rank, on worker threads (ranks.h for the group).
#include "client/simulator/simulator.h"

#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/simulator/mode_checker.h"
#include "client/simulator/model.h"
#include "client/simulator/pools.h"
#include "client/simulator/ranks.h"
#include "client/simulator/report.h"
#include "client/simulator/restart_drill.h"
#include "client/simulator/stock_path.h"

namespace specstate {
namespace client {
namespace {

using simulator_internal::Clock;
using simulator_internal::Dims;
using simulator_internal::GateParams;
using simulator_internal::LayerBuffers;
using simulator_internal::LayerInputs;
using simulator_internal::Latencies;
using simulator_internal::Materialization;
using simulator_internal::MetaOffsets;
using simulator_internal::ModeChecker;
using simulator_internal::ModePhases;
using simulator_internal::Model;
using simulator_internal::PrefillLayer;
using simulator_internal::ServicePools;
using simulator_internal::StepPlan;
using simulator_internal::StockPath;
using simulator_internal::Tally;
using simulator_internal::Tp1Checks;

// Under tensor parallelism, the rank whose worker runs on this thread (for
// the trace).
thread_local int trace_rank = -1;

// SPECSTATE_TRACE=1: each phase of each step on stderr, so a stall shows
// where it is (used while bringing up a backend).
void TracePhase(int step, const char* phase) {
  static const bool enabled = [] {
    const char* v = std::getenv("SPECSTATE_TRACE");
    return v != nullptr && v[0] != '\0' && v[0] != '0';
  }();
  if (!enabled) return;
  static const Clock::time_point start = Clock::now();
  const std::string rank = trace_rank < 0 ? "" : absl::StrCat(" rank ", trace_rank);
  std::fprintf(stderr, "[simulate%s %.3f ms] step %d: %s\n", rank.c_str(),
               std::chrono::duration<double, std::milli>(Clock::now() - start).count(), step,
               phase);
}

// The simulator of one service: the whole model's, or under tensor
// parallelism rank `rank`'s part of it (of `ranks`).
class Simulator {
 public:
  Simulator(Client& client, const SimulationOptions& options, int rank = 0, int ranks = 1)
      : client_(client), options_(options), rank_(rank), tp_(ranks) {}

  const Latencies& latencies() const { return latencies_; }

  absl::StatusOr<SimulationReport> Run();

 private:
  // ---- set-up ----
  absl::Status Setup();
  absl::Status ReadLayout();
  absl::Status OpenMemoryAndPools();
  absl::Status AllocateSharedBuffers();
  absl::Status LoadLayerParams();
  absl::Status BindInputs();
  absl::Status CreateEvents();
  // Layer `l`'s q, k, v and beta (column slices of proj), g and o, for
  // `tokens` tokens, in a Verify or BindVerifyInputs request.
  template <typename Message>
  void SetLayerTensors(int l, int64_t tokens, Message* r);

  // ---- one step ----
  absl::Status Step(int s);
  absl::Status ServiceCalls(const StepPlan& p);
  absl::Status ServiceCallsAcrossRestarts(StepPlan& p);
  absl::Status ChurnRequests(int s);
  absl::Status FinishRequest(int slot);
  absl::Status Prefill(int slot);
  absl::Status LayOutMetadata(StepPlan& p);
  void BuildVerifies(StepPlan& p);
  absl::Status SendVerifies(const StepPlan& p, const std::string& name);
  absl::Status WriteInputs(const StepPlan& p);
  absl::Status WriteLayerInputs(int l, const LayerInputs& in, const std::vector<char>& poison);
  absl::Status UpdateConvWindows(StepPlan& p);
  absl::Status RunVerifies(const StepPlan& p);
  v1::CommitRequest BuildCommit(const StepPlan& p);
  absl::Status CommitStep(const StepPlan& p);
  absl::Status RecordStateBlocks(const StepPlan& p);
  absl::Status CorruptARunningState(bool flip, int step);
  [[noreturn]] void Crash();

  // ---- pending blocks (ModePhases::pending_blocks: DEFERRED, FAST) ----
  absl::Status FlushAndCheck(const std::vector<int32_t>& blocks, int step, absl::string_view how);
  absl::Status MaterializeSome(int step);
  absl::Status MaterializeSomeOnce(int step);
  absl::Status FinalFlush();
  // Restart drills, DEFERRED: what a death may have touched (DeferredExpect)
  // and the states pending blocks must become; after the restart, lost
  // blocks re-prefilled (a pending one with its materialized state).
  struct DeferredSnapshot {
    DeferredExpect expect;
    std::vector<ModeChecker::Expected> expected;
  };
  DeferredSnapshot SnapshotPending(bool between_steps) const;
  absl::Status RePrefill(const std::vector<int32_t>& lost, const std::vector<char>& before,
                         const DeferredSnapshot* snapshot);
  // Runs `call` (a Flush or ReadState between steps) across the drill's
  // restarts.
  absl::Status BetweenStepsAcrossRestarts(const std::function<absl::Status()>& call);
  std::vector<int32_t> last_listed_;  // what the last Commit left pending
  uint64_t last_step_id_ = 0;

  // ---- the metadata buffer and its doorbells ----
  int32_t* Meta(int offset) { return reinterpret_cast<int32_t*>(meta_->data()) + offset; }
  absl::Status WaitDoorbell(int index, uint32_t value);
  v1::Doorbell Door(int index, uint32_t value);

  Client& client_;
  const SimulationOptions options_;
  const int rank_;  // tensor parallelism: this service's rank, of tp_
  const int tp_;
  SimulationReport report_;
  Latencies latencies_;

  v1::Layout layout_;
  Dims d_;
  MetaOffsets at_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<SharedMemory> memory_;
  std::unique_ptr<ServicePools> pools_;
  std::unique_ptr<StockPath> stock_;
  std::unique_ptr<Session> session_;
  // The scheduler's shared buffers, registered with the session: per layer
  // proj = [q | k | v | beta] per token (so q, k, v and beta are column
  // slices with a token stride larger than a token), g and o; and one int32
  // buffer for the step's metadata and doorbells.
  LayerBuffers proj_, g_, o_;
  std::unique_ptr<SharedBuffer> meta_;
  std::unique_ptr<IpcEvent> inputs_ready_, work_done_;
  std::unique_ptr<Tp1Checks> tp1_;  // tensor parallelism only
  // The checks of the service's commit mode, and the phases it has: both
  // chosen once, at set-up.
  std::unique_ptr<ModeChecker> checker_;
  ModePhases phases_;
};

absl::StatusOr<SimulationReport> Simulator::Run() {
  absl::Status st = Setup();
  if (!st.ok()) return st;
  for (int s = 0; s < options_.steps; ++s) {
    TracePhase(s, "begins");
    st = Step(s);
    if (!st.ok()) return absl::Status(st.code(), absl::StrCat("step ", s, ": ", st.message()));
    report_.steps = s + 1;
    if (options_.progress) {
      options_.progress(SimulationProgress{s + 1, options_.steps, report_.comparisons,
                                           report_.mismatches});
    }
  }
  if (phases_.pending_blocks) {  // what is still pending, materialized and checked
    st = options_.drill != nullptr ? BetweenStepsAcrossRestarts([this] { return FinalFlush(); })
                                   : FinalFlush();
    if (!st.ok()) return st;
  }
  checker_->Verdict();
  report_.latency = latencies_.Summaries();
  if (options_.drill != nullptr) report_.restart_summary = options_.drill->Summary();
  st = session_->Close();
  if (!st.ok()) return st;
  return report_;
}

// ---- set-up ----

// The layout, the pools, the session, the shared buffers, the stock path's
// memory and the layer parameters, in this order (the parameters are the
// set-up's only random draws); the checks, by the commit mode, come before
// the parameters and the first prefill (FAST's reference keeps copies).
absl::Status Simulator::Setup() {
  absl::Status st = ReadLayout();
  if (st.ok()) st = OpenMemoryAndPools();
  if (!st.ok()) return st;
  absl::StatusOr<std::unique_ptr<Session>> session =
      client_.OpenSession("specstatectl simulate", /*drive=*/true);
  if (!session.ok()) return session.status();
  session_ = *std::move(session);
  if (tp_ > 1) tp1_ = std::make_unique<Tp1Checks>(*memory_, *pools_, *stock_, o_, d_, report_);
  checker_ = simulator_internal::MakeModeChecker(*memory_, *pools_, *stock_, o_, *model_, d_,
                                                 report_, tp1_.get());
  phases_ = checker_->phases();
  st = AllocateSharedBuffers();
  if (st.ok()) st = stock_->Allocate();
  if (st.ok()) st = LoadLayerParams();
  if (st.ok() && options_.bound_inputs) st = BindInputs();
  if (st.ok() && options_.async && options_.events) st = CreateEvents();
  return st;
}

// The service's layout, the sizes derived from it, and the model.
absl::Status Simulator::ReadLayout() {
  absl::StatusOr<v1::Layout> layout = client_.GetLayout();
  if (!layout.ok()) return layout.status();
  layout_ = *layout;
  report_.backend = layout_.backend() == v1::CUDA ? "cuda" : "cpu";
  report_.layers = layout_.num_layers();
  absl::StatusOr<Dims> dims = simulator_internal::ReadDims(layout_, options_, rank_, tp_);
  if (!dims.ok()) return dims.status();
  d_ = *dims;
  report_.fold_every = d_.fold_every;
  at_ = simulator_internal::MetaLayout(d_);
  model_ = std::make_unique<Model>(d_, options_, report_);
  return absl::OkStatus();
}

// The stock kernels and shared memory of the service's backend, and the
// service's pools mapped through their exported handle.
absl::Status Simulator::OpenMemoryAndPools() {
  absl::StatusOr<const kernels::KdaKernels*> kernels =
      simulator_internal::StockKernels(layout_.backend());
  if (!kernels.ok()) return kernels.status();
  absl::StatusOr<std::unique_ptr<SharedMemory>> memory =
      SharedMemory::Create(layout_.backend(), layout_.device());
  if (!memory.ok()) return memory.status();
  memory_ = *std::move(memory);
  absl::StatusOr<v1::ExportPoolsResponse> exported = client_.ExportPools();
  if (!exported.ok()) return exported.status();
  absl::StatusOr<std::unique_ptr<MappedPools>> pools = memory_->MapPools(*exported);
  if (!pools.ok()) return pools.status();
  pools_ = std::make_unique<ServicePools>(*memory_, *std::move(pools), d_);
  stock_ = std::make_unique<StockPath>(*memory_, **kernels, d_);
  return absl::OkStatus();
}

absl::Status Simulator::AllocateSharedBuffers() {
  for (int l = 0; l < d_.L; ++l) {
    for (auto* list : {&proj_, &g_, &o_}) {
      const int64_t per_token = list == &proj_ ? d_.proj_stride : list == &g_ ? d_.GW : d_.VW;
      absl::StatusOr<std::unique_ptr<SharedBuffer>> buf =
          memory_->Allocate(d_.tmax * per_token * d_.as);
      if (!buf.ok()) return buf.status();
      absl::StatusOr<std::string> name = session_->RegisterBuffer(**buf);
      if (!name.ok()) return name.status();
      list->push_back(*std::move(buf));
    }
  }
  absl::StatusOr<std::unique_ptr<SharedBuffer>> meta = memory_->Allocate(d_.meta_ints * 4);
  if (!meta.ok()) return meta.status();
  meta_ = *std::move(meta);
  absl::StatusOr<std::string> name = session_->RegisterBuffer(*meta_, "meta");
  return name.status();
}

// Layer parameters (KDA): random, loaded into the service (this rank's
// heads) and kept for the stock path. GDN layers have none (g arrives as the
// log-decay).
absl::Status Simulator::LoadLayerParams() {
  for (int l = 0; l < d_.L && !d_.gdn; ++l) {
    const GateParams params = model_->DrawGateParams();
    v1::LoadLayerParamsRequest req;
    req.set_layer(l);
    for (int i = 0; i < d_.H; ++i) {
      req.mutable_a_log()->mutable_values()->add_values(
          reinterpret_cast<const float*>(params.a_log.data())[i]);
    }
    for (int64_t i = 0; i < d_.HK; ++i) {
      req.mutable_dt_bias()->mutable_values()->add_values(
          reinterpret_cast<const float*>(params.dt_bias.data())[i]);
    }
    absl::Status st =
        latencies_.Time("LoadLayerParams", [&] { return session_->LoadLayerParams(req); });
    if (st.ok()) st = stock_->LoadParams(params);
    if (st.ok()) checker_->LoadParams(l, params);
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

// `bound_inputs`: every layer's tensors bound once, the buffers at their
// capacity; each step uses the first T tokens (and the R rows at the front
// of the metadata, where every step puts them). Even layers bind the step's
// query_start_loc and state_indices too, odd layers do not.
absl::Status Simulator::BindInputs() {
  for (int l = 0; l < d_.L; ++l) {
    v1::BindVerifyInputsRequest bind;
    bind.set_layer(l);
    SetLayerTensors(l, d_.tmax, &bind);
    if (l % 2 == 0) {
      *bind.mutable_query_start_loc() = session_->Index(Meta(at_.qsl), {d_.R + 1}).value();
      *bind.mutable_state_indices() = session_->Index(Meta(at_.idx), {d_.R}).value();
    }
    absl::StatusOr<v1::BindVerifyInputsResponse> bound =
        latencies_.Time("BindVerifyInputs", [&] { return session_->BindVerifyInputs(bind); });
    if (!bound.ok()) return bound.status();
  }
  return absl::OkStatus();
}

// `events`: the inputs' event (recorded before the Verify calls) and the
// last Verify's.
absl::Status Simulator::CreateEvents() {
  absl::StatusOr<std::unique_ptr<IpcEvent>> e = memory_->CreateIpcEvent();
  if (!e.ok()) return e.status();
  inputs_ready_ = *std::move(e);
  e = memory_->CreateIpcEvent();
  if (!e.ok()) return e.status();
  work_done_ = *std::move(e);
  return absl::OkStatus();
}

template <typename Message>
void Simulator::SetLayerTensors(int l, int64_t tokens, Message* r) {
  const int64_t HK = d_.HK, as = d_.as;
  const char* proj = static_cast<const char*>(proj_[l]->data());
  const std::vector<int64_t> strides = {d_.proj_stride, d_.K, 1};
  *r->mutable_q() = session_->Tensor(proj, d_.act, {tokens, d_.H, d_.K}, strides).value();
  *r->mutable_k() = session_->Tensor(proj + HK * as, d_.act, {tokens, d_.H, d_.K}, strides).value();
  *r->mutable_v() =
      session_->Tensor(proj + 2 * HK * as, d_.act, {tokens, d_.HV, d_.K}, strides).value();
  *r->mutable_beta() = session_->Tensor(proj + (2 * HK + d_.VW) * as, d_.act, {tokens, d_.HV},
                                        {d_.proj_stride, 1})
                           .value();
  *r->mutable_g() = session_->Tensor(g_[l]->data(), d_.act, d_.GateShape(tokens)).value();
  *r->mutable_o() = session_->Tensor(o_[l]->data(), d_.act, {tokens, d_.HV, d_.K}).value();
}

// ---- one step ----

// One decode step, as a scheduler runs it. The order of the phases is the
// protocol's (ASYNC Verify calls go out before their inputs exist; with
// events they go out after the inputs' event is recorded), and the order
// of the random draws is fixed by it: a seed replays the same simulation.
absl::Status Simulator::Step(int s) {
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
  if (st.ok() && s == options_.corrupt_after_step) {
    st = CorruptARunningState(/*flip=*/rank_ == options_.corrupt_rank, s);
  }
  return st;
}

// The step's calls to the service, from Verify (SYNC, or with the inputs'
// doorbell rung) to RecordStateBlocks, and the checks of their outputs.
absl::Status Simulator::ServiceCalls(const StepPlan& p) {
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

// ServiceCalls under a restart drill: when the service dies during them,
// the drill starts it again; what it kept is checked (ResumeAfterRestart),
// the lost blocks re-prefilled (their bytes from before the step) and the
// step re-run under a new step id unless its Commit had finished.
absl::Status Simulator::ServiceCallsAcrossRestarts(StepPlan& p) {
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

// Churn: finished requests leave, new ones arrive (each put into the pools
// and the stock path, as a prefill would).
absl::Status Simulator::ChurnRequests(int s) {
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
absl::Status Simulator::FinishRequest(int slot) {
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
absl::Status Simulator::Prefill(int slot) {
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
absl::Status Simulator::LayOutMetadata(StepPlan& p) {
  model_->LayOutBatch(p);
  return memory_->CopyOut(p.meta.data() + at_.door, Meta(at_.door), 4 * 4);
}

// Every layer's Verify request (ASYNC: built, and maybe sent, before any
// input exists). Without bound inputs each carries its tensors, and the
// metadata on layer 0 and every third step (later layers may rely on the
// step's copy).
void Simulator::BuildVerifies(StepPlan& p) {
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
absl::Status Simulator::SendVerifies(const StepPlan& p, const std::string& name) {
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
absl::Status Simulator::WriteInputs(const StepPlan& p) {
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
absl::Status Simulator::WriteLayerInputs(int l, const LayerInputs& in,
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
absl::Status Simulator::UpdateConvWindows(StepPlan& p) {
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
absl::Status Simulator::RunVerifies(const StepPlan& p) {
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
v1::CommitRequest Simulator::BuildCommit(const StepPlan& p) {
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
absl::Status Simulator::CommitStep(const StepPlan& p) {
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
absl::Status Simulator::RecordStateBlocks(const StepPlan& p) {
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
// the bit flipped in every element of the block.
absl::Status Simulator::CorruptARunningState(bool flip, int step) {
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
void Simulator::Crash() {
  std::printf("CRASH POINT pools=%016llx\n",
              static_cast<unsigned long long>(pools_->Fingerprint()));
  std::fflush(stdout);
  raise(SIGKILL);
  std::abort();
}

// ---- pending blocks (ModePhases::pending_blocks: DEFERRED, FAST) ----

// Flush of `blocks` (empty: every pending block), SYNC, then each flushed
// pending block checked.
absl::Status Simulator::FlushAndCheck(const std::vector<int32_t>& blocks, int step,
                                      absl::string_view how) {
  v1::FlushRequest flush;
  for (int32_t b : blocks) flush.mutable_blocks()->mutable_values()->add_values(b);
  absl::StatusOr<v1::FlushResponse> r =
      latencies_.Time("Flush", [&] { return session_->Flush(flush); });
  if (!r.ok()) return r.status();
  return checker_->CheckFlushed(blocks, step, how);
}

Simulator::DeferredSnapshot Simulator::SnapshotPending(bool between_steps) const {
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
absl::Status Simulator::RePrefill(const std::vector<int32_t>& lost,
                                  const std::vector<char>& before,
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

absl::Status Simulator::BetweenStepsAcrossRestarts(const std::function<absl::Status()>& call) {
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

absl::Status Simulator::FinalFlush() { return FlushAndCheck({}, options_.steps, "the final Flush"); }

absl::Status Simulator::MaterializeSome(int step) {
  if (options_.drill == nullptr) return MaterializeSomeOnce(step);
  return BetweenStepsAcrossRestarts([this, step] { return MaterializeSomeOnce(step); });
}

// Between steps, now and then, as a scheduler would: a Flush of every
// pending block, of some of them, or a ReadState of one pending block in
// one layer (its checksum, and the block's bytes in that layer).
absl::Status Simulator::MaterializeSomeOnce(int step) {
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
  absl::StatusOr<v1::ReadStateResponse> r =
      latencies_.Time("ReadState", [&] { return client_.ReadState(m.layer, block, false); });
  if (!r.ok()) return r.status();
  return checker_->CheckRead(step, m.slot, m.layer, *r);
}

// ---- the metadata buffer and its doorbells ----

absl::Status Simulator::WaitDoorbell(int index, uint32_t value) {
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

v1::Doorbell Simulator::Door(int index, uint32_t value) {
  v1::Doorbell d;
  d.set_region("meta");
  d.set_offset_bytes((at_.door + index) * 4);
  d.set_value(value);
  return d;
}

}  // namespace

absl::StatusOr<SimulationReport> RunSimulation(Client& client, const SimulationOptions& options) {
  if (options.steps < 1) return absl::InvalidArgumentError("steps must be >= 1");
  if (options.corrupt_rank != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("corrupt_rank = ", options.corrupt_rank, " is not a rank of 1 service"));
  }
  if (options.drill != nullptr && options.async) {
    return absl::InvalidArgumentError(
        "a restart drill runs SYNC steps: ASYNC calls sent ahead would have to be re-sent in "
        "order after a restart");
  }
  Simulator sim(client, options);
  return sim.Run();
}

absl::StatusOr<SimulationReport> RunSimulation(const std::vector<Client*>& ranks,
                                               const SimulationOptions& options) {
  if (ranks.empty()) return absl::InvalidArgumentError("no ranks: give one service per rank");
  if (ranks.size() == 1) return RunSimulation(*ranks[0], options);
  const int tp = static_cast<int>(ranks.size());
  absl::Status st = simulator_internal::CheckRankOptions(tp, options);
  if (!st.ok()) return st;
  absl::StatusOr<simulator_internal::RankGroup> group = simulator_internal::ReadRankLayouts(ranks);
  if (!group.ok()) return group.status();

  // One worker per rank, as a tensor-parallel scheduler runs one per GPU
  // (on CUDA each thread's current device is its rank's: SharedMemory).
  simulator_internal::MergedProgress progress(tp, options.progress);
  std::vector<std::unique_ptr<Simulator>> sims;
  std::vector<absl::StatusOr<SimulationReport>> reports(tp, absl::UnknownError("not run"));
  std::vector<std::thread> workers;
  for (int r = 0; r < tp; ++r) {
    SimulationOptions rank_options = options;
    rank_options.progress = progress.ForRank(r);
    sims.push_back(std::make_unique<Simulator>(*ranks[r], rank_options, r, tp));
  }
  for (int r = 0; r < tp; ++r) {
    workers.emplace_back([r, &sims, &reports] {
      trace_rank = r;
      reports[r] = sims[r]->Run();
    });
  }
  for (std::thread& w : workers) w.join();
  std::vector<const Latencies*> latencies;
  for (const std::unique_ptr<Simulator>& sim : sims) latencies.push_back(&sim->latencies());
  return simulator_internal::MergeRankReports(reports, latencies, *group);
}

}  // namespace client
}  // namespace specstate
