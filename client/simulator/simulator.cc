// The driver's set-up and Run, and RunSimulation: one service, or one driver
// per rank on worker threads (driver.h: the driver's phases, file by file).
#include "client/simulator/simulator.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/simulator/driver.h"

namespace specstate {
namespace client {
namespace simulator_internal {
namespace {

// Under tensor parallelism, the rank whose worker runs on this thread (for
// the trace).
thread_local int trace_rank = -1;

}  // namespace

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

absl::StatusOr<SimulationReport> Driver::Run() {
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
  if (st.ok() && peer_session_ != nullptr) st = peer_session_->Close();
  if (!st.ok()) return st;
  return report_;
}

// ---- set-up ----

// The layout, the pools, the session, the shared buffers, the stock path's
// memory and the layer parameters, in this order (the parameters are the
// set-up's only random draws); the checks, by the commit mode, come before
// the parameters and the first prefill (FAST's reference keeps copies).
absl::Status Driver::Setup() {
  absl::Status st = ReadLayout();
  if (st.ok()) st = OpenMemoryAndPools();
  if (st.ok() && options_.transfer_every > 0) st = ConnectTransferPeer();
  if (!st.ok()) return st;
  absl::StatusOr<std::unique_ptr<Session>> session =
      client_.OpenSession("specstatectl simulate", /*drive=*/true);
  if (!session.ok()) return session.status();
  session_ = *std::move(session);
  if (tp_ > 1) tp1_ = std::make_unique<Tp1Checks>(*memory_, *pools_, *stock_, o_, d_, report_);
  checker_ = MakeModeChecker(*memory_, *pools_, *stock_, o_, *model_, d_, report_, tp1_.get());
  phases_ = checker_->phases();
  st = AllocateSharedBuffers();
  if (st.ok()) st = stock_->Allocate();
  if (st.ok()) st = LoadLayerParams();
  if (st.ok() && options_.bound_inputs) st = BindInputs();
  if (st.ok() && options_.async && options_.events) st = CreateEvents();
  return st;
}

// The service's layout, the sizes derived from it, and the model.
absl::Status Driver::ReadLayout() {
  absl::StatusOr<v1::Layout> layout = client_.GetLayout();
  if (!layout.ok()) return layout.status();
  layout_ = *layout;
  report_.backend = layout_.backend() == v1::CUDA ? "cuda" : "cpu";
  report_.layers = layout_.num_layers();
  absl::StatusOr<Dims> dims = ReadDims(layout_, options_, rank_, tp_);
  if (!dims.ok()) return dims.status();
  d_ = *dims;
  report_.fold_every = d_.fold_every;
  at_ = MetaLayout(d_);
  model_ = std::make_unique<Model>(d_, options_, report_);
  return absl::OkStatus();
}

// The stock kernels and shared memory of the service's backend, and the
// service's pools mapped through their exported handle.
absl::Status Driver::OpenMemoryAndPools() {
  absl::StatusOr<const kernels::KdaKernels*> kernels = StockKernels(layout_.backend());
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

absl::Status Driver::AllocateSharedBuffers() {
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
absl::Status Driver::LoadLayerParams() {
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
absl::Status Driver::BindInputs() {
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
absl::Status Driver::CreateEvents() {
  absl::StatusOr<std::unique_ptr<IpcEvent>> e = memory_->CreateIpcEvent();
  if (!e.ok()) return e.status();
  inputs_ready_ = *std::move(e);
  e = memory_->CreateIpcEvent();
  if (!e.ok()) return e.status();
  work_done_ = *std::move(e);
  return absl::OkStatus();
}

}  // namespace simulator_internal

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
  absl::Status st = simulator_internal::CheckTransferOptions(options, client.address());
  if (!st.ok()) return st;
  simulator_internal::Driver driver(client, options);
  return driver.Run();
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
  std::vector<std::unique_ptr<simulator_internal::Driver>> sims;
  std::vector<absl::StatusOr<SimulationReport>> reports(tp, absl::UnknownError("not run"));
  std::vector<std::thread> workers;
  for (int r = 0; r < tp; ++r) {
    SimulationOptions rank_options = options;
    rank_options.progress = progress.ForRank(r);
    sims.push_back(std::make_unique<simulator_internal::Driver>(*ranks[r], rank_options, r, tp));
  }
  for (int r = 0; r < tp; ++r) {
    workers.emplace_back([r, &sims, &reports] {
      simulator_internal::trace_rank = r;
      reports[r] = sims[r]->Run();
    });
  }
  for (std::thread& w : workers) w.join();
  std::vector<const simulator_internal::Latencies*> latencies;
  for (const std::unique_ptr<simulator_internal::Driver>& sim : sims) {
    latencies.push_back(&sim->latencies());
  }
  return simulator_internal::MergeRankReports(reports, latencies, *group);
}

}  // namespace client
}  // namespace specstate
