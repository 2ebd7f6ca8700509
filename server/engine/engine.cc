// The engine's set-up (the pools, each layer's parameters, the layer table,
// the step slots; the commit mode's own memory through its ModeEngine),
// regions, sessions and health. Each verb is in a file of its own (verify.cc,
// commit.cc, record_state_blocks.cc, flush.cc, read_state.cc,
// load_params.cc, submit_step.cc); the step protocol in drive.h and
// step_protocol.cc; the per-request tensor rules in request_tensors.cc.
#include "server/engine/engine.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/kda_kernels.h"
#include "server/base/log.h"
#include "server/modes/rules.h"
#include "server/config/sizing.h"

namespace specstate {
namespace server {

// ---------------------------------------------------------------------------
// Set-up.

Engine::Engine(const v1::ServiceConfig& config, std::unique_ptr<Device> device)
    : config_(config), layout_(config.layout()), device_(std::move(device)) {}

Engine::~Engine() = default;

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const v1::ServiceConfig& config,
                                                       std::unique_ptr<Device> device,
                                                       const KeptModeParts* kept) {
  absl::Status st = ValidateLayout(config.layout());
  if (!st.ok()) return st;
  std::unique_ptr<Engine> engine(new Engine(config, std::move(device)));
  st = engine->Allocate(kept);
  if (!st.ok()) return st;
  return engine;
}

absl::Status Engine::Allocate(const KeptModeParts* kept) {
  sizes_ = ComputeLayoutSizes(layout_);
  shape_ = ShapeOf(layout_);
  const int L = layout_.num_layers();
  const int Q = sizes_.spec_query_len;
  const int rows = layout_.max_rows();

  layout_.set_backend(device_->kind() == kernels::Backend::kCuda ? v1::CUDA : v1::CPU);
  if (layout_.commit_mode() == v1::COMMIT_MODE_UNSPECIFIED) layout_.set_commit_mode(v1::EAGER);
  layout_.set_fold_every(CommitModeOf(layout_).FoldEvery(layout_));
  layout_.set_device(device_->ordinal());
  layout_.set_mps_client(device_->mps_client());
  layout_.set_conv_width(sizes_.conv_width);
  layout_.set_state_block_bytes(sizes_.state_block_bytes);
  layout_.set_conv_block_bytes(sizes_.conv_block_bytes);
  layout_.set_pool_bytes(sizes_.pool_bytes);
  layout_.set_record_bytes(sizes_.record_bytes);

  commit_workspace_bytes_ = kernels::CommitWorkspaceBytes(rows, Q, layout_.num_blocks());
  record_workspace_bytes_ = kernels::RecordStateBlocksWorkspaceBytes(rows);
  ModeEnvironment env;
  env.layout = &layout_;
  env.sizes = &sizes_;
  env.shape = shape_;
  env.device = device_.get();
  if (kept != nullptr) env.kept = *kept;
  absl::StatusOr<std::unique_ptr<ModeEngine>> mode = ModeEngine::Create(env);
  if (!mode.ok()) return mode.status();
  mode_ = *std::move(mode);
  // What specstated --pool_memory and specstatectl plan size with (server/config/sizing.h),
  // less what the kept allocation holds already (not counted twice).
  const ServiceBytes service = ComputeServiceBytes(layout_, /*kept_pools=*/false);
  const uint64_t needed = uint64_t(service.engine) - mode_->BytesAlreadyKept();
  absl::StatusOr<uint64_t> free = device_->FreeBytes();
  if (!free.ok()) return free.status();
  if (needed > *free) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the layout needs ", needed, " bytes (pools ", sizes_.pool_bytes, ", records ",
        sizes_.record_bytes, ") but the ", kernels::BackendName(device_->kind()),
        " device has ", *free,
        " bytes free: lower num_blocks, max_rows or num_layers, or let --pool_memory size "
        "num_blocks (specstatectl plan shows the sizes offline)"));
  }
  absl::Status st = AllocateLayers();
  if (!st.ok()) return st;
  absl::StatusOr<void*> ws = device_->AllocateDevice(commit_workspace_bytes_);
  if (!ws.ok()) return ws.status();
  commit_workspace_ = *ws;
  ws = device_->AllocateDevice(record_workspace_bytes_);
  if (!ws.ok()) return ws.status();
  record_workspace_ = *ws;
  st = mode_->AllocateShared(LayerTables{host_layer_table_.data(), device_layer_table_});
  if (!st.ok()) return st;
  // ReadState's status and one block; the mode's pending count (sized once
  // its shared parts are: DEFERRED's table).
  read_buffers_ = std::make_unique<HostBufferPool>(
      *device_, sizeof(kernels::DeviceStatus) + sizes_.state_block_bytes + sizes_.conv_block_bytes);
  pending_buffers_ =
      std::make_unique<HostBufferPool>(*device_, mode_->PendingCountBytes() + sizeof(int32_t));
  absl::StatusOr<std::vector<StepSlot>> slots = AllocateSlots();
  if (!slots.ok()) return slots.status();
  if (config_.host_tier_bytes() > 0) {
    // One saved block: every layer's recurrent and conv block.
    const uint64_t entry = uint64_t(L) * (sizes_.state_block_bytes + sizes_.conv_block_bytes);
    absl::StatusOr<std::unique_ptr<HostTier>> tier = HostTier::Create(
        config_.host_tier_bytes(), entry,
        [this](uint64_t bytes) { return device_->AllocateHost(bytes); });
    if (!tier.ok()) return tier.status();
    host_tier_ = *std::move(tier);
  }
  absl::MutexLock lock(&mu_);
  steps_ = std::make_unique<StepTable>(L, *std::move(slots));
  return absl::OkStatus();
}

// The pools, each layer's parameters and records, the commit layer table
// and LoadLayerParams' staging.
absl::Status Engine::AllocateLayers() {
  const int L = layout_.num_layers();
  const int H = layout_.num_heads();
  const int K = layout_.head_dim();
  absl::StatusOr<void*> pools = device_->AllocateExported(sizes_.pool_bytes);
  if (!pools.ok()) return pools.status();
  pools_ = static_cast<char*>(*pools);

  const int64_t hk = kernels::KeyWidth(shape_), vw = kernels::ValueWidth(shape_);
  layers_.resize(L);
  {
    absl::MutexLock lock(&bound_mu_);
    bound_.assign(L, nullptr);
  }
  host_layer_table_.resize(L);
  for (int l = 0; l < L; ++l) {
    LayerState& layer = layers_[l];
    layer.state.data = pools_ + StatePoolOffset(sizes_, l);
    layer.state.num_blocks = layout_.num_blocks();
    layer.state.block_stride = vw * K;
    layer.conv.data = pools_ + ConvPoolOffset(sizes_, l);
    layer.conv.num_blocks = layout_.num_blocks();
    layer.conv.dim = layout_.conv_dim();
    layer.conv.width = sizes_.conv_width;
    layer.conv.block_stride = int64_t{layout_.conv_dim()} * sizes_.conv_width;
    layer.conv.dim_stride = sizes_.conv_width;
    layer.conv.token_stride = 1;
    absl::StatusOr<void*> a_log = device_->AllocateDevice(H * sizeof(float));
    if (!a_log.ok()) return a_log.status();
    absl::StatusOr<void*> dt_bias = device_->AllocateDevice(hk * sizeof(float));
    if (!dt_bias.ok()) return dt_bias.status();
    layer.a_log = static_cast<float*>(*a_log);
    layer.dt_bias = static_cast<float*>(*dt_bias);
    // GDN's gate arrives computed (g is the log-decay): nothing to load.
    layer.params_loaded = shape_.kind == kernels::LayerKind::kGdn;
    kernels::CommitLayer& entry = host_layer_table_[l];
    entry.state = layer.state;
    entry.conv = layer.conv;
    entry.params = kernels::LayerParams{layer.a_log, layer.dt_bias};
    if (absl::Status st = mode_->AllocateLayer(l, entry); !st.ok()) return st;
  }
  absl::StatusOr<void*> staging = device_->AllocateDevice((H + hk) * sizeof(float));
  if (!staging.ok()) return staging.status();
  params_staging_ = static_cast<float*>(*staging);
  absl::StatusOr<void*> params_status = device_->AllocateDevice(sizeof(kernels::DeviceStatus));
  if (!params_status.ok()) return params_status.status();
  params_status_ = static_cast<kernels::DeviceStatus*>(*params_status);
  absl::StatusOr<void*> table = device_->AllocateDevice(L * sizeof(kernels::CommitLayer));
  if (!table.ok()) return table.status();
  device_layer_table_ = static_cast<kernels::CommitLayer*>(*table);
  return device_->CopyToDevice(device_layer_table_, host_layer_table_.data(),
                               L * sizeof(kernels::CommitLayer));
}

void Engine::SetCommitJournal(const kernels::CommitJournal& journal) {
  journal_ = journal;
  mode_->SetCommitJournal(journal);
}

void Engine::SetCommittedBeforeRestart(uint64_t step) {
  absl::MutexLock lock(&mu_);
  steps_->SetCommittedBeforeRestart(step);
}

absl::StatusOr<std::vector<StepSlot>> Engine::AllocateSlots() {
  const int L = layout_.num_layers();
  const int rows = layout_.max_rows();
  std::vector<StepSlot> slots(StepTable::kSlots);
  for (StepSlot& slot : slots) {
    absl::StatusOr<void*> p = device_->AllocateDevice((L + 2) * sizeof(kernels::DeviceStatus));
    if (!p.ok()) return p.status();
    slot.status_device = static_cast<kernels::DeviceStatus*>(*p);
    p = device_->kind() == kernels::Backend::kCpu
            ? absl::StatusOr<void*>(static_cast<void*>(slot.status_device))
            : device_->AllocateHost((L + 2) * sizeof(kernels::DeviceStatus));
    if (!p.ok()) return p.status();
    slot.status_host = static_cast<kernels::DeviceStatus*>(*p);
    p = device_->AllocateDevice(sizeof(uint32_t));
    if (!p.ok()) return p.status();
    slot.cancelled = static_cast<uint32_t*>(*p);
    p = device_->AllocateDevice((rows + 1) * sizeof(int32_t));
    if (!p.ok()) return p.status();
    slot.query_start_loc = static_cast<int32_t*>(*p);
    p = device_->AllocateDevice(rows * sizeof(int32_t));
    if (!p.ok()) return p.status();
    slot.state_indices = static_cast<int32_t*>(*p);
    p = device_->AllocateHost((rows + 1) * sizeof(int32_t));
    if (!p.ok()) return p.status();
    slot.qsl_host = static_cast<int32_t*>(*p);
    p = device_->AllocateHost(rows * sizeof(kernels::CommitPlanRow));
    if (!p.ok()) return p.status();
    slot.plan_host = static_cast<kernels::CommitPlanRow*>(*p);
  }
  return slots;
}

v1::ExportPoolsResponse Engine::ExportPools() const {
  v1::ExportPoolsResponse out;
  out.set_backend(layout_.backend());
  out.set_shm_path(device_->ExportName());
  out.set_cuda_ipc_handle(device_->ExportHandle());
  out.set_device(device_->ordinal());
  out.set_allocation_bytes(sizes_.pool_bytes);
  AddPoolViews(layout_, sizes_, &out);
  return out;
}

// ---------------------------------------------------------------------------
// Regions, sessions, health.

absl::Status Engine::RegisterRegion(const v1::RegisterRegionRequest& request) {
  if (request.name().empty()) return absl::InvalidArgumentError("name is empty");
  if (request.byte_size() == 0) return absl::InvalidArgumentError("byte_size is 0");
  // Every allocation starts aligned; a region that does not leaves every
  // element of every tensor in it misaligned.
  constexpr uint64_t kRegionAlignment = 16;
  if (request.offset_bytes() % kRegionAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat("offset_bytes = ", request.offset_bytes(),
                                                   " must be a multiple of ", kRegionAlignment));
  }
  absl::StatusOr<std::unique_ptr<MappedRegion>> mapped;
  switch (request.kind_case()) {
    case v1::RegisterRegionRequest::kShmName:
      mapped = device_->MapShm(request.shm_name(), request.offset_bytes(), request.byte_size());
      break;
    case v1::RegisterRegionRequest::kCudaIpcHandle:
      mapped = device_->MapCudaIpc(request.cuda_ipc_handle(), request.device(),
                                   request.offset_bytes(), request.byte_size());
      break;
    default:
      return absl::InvalidArgumentError("set shm_name (CPU backend) or cuda_ipc_handle (CUDA)");
  }
  if (!mapped.ok()) {
    return Prefixed(absl::StrCat("region \"", request.name(), "\": "), mapped.status());
  }
  if ((*mapped)->object() == device_->ExportedObject()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "region \"", request.name(), "\" is the service's own pools: map them from ExportPools, "
        "never register them as a region (no call may write the pools through a client's tensor)"));
  }
  return regions_.Register(request.session_id(), request.name(), *std::move(mapped));
}

void Engine::OpenSession(const std::string& session) {
  {
    absl::MutexLock lock(&mu_);
    steps_->OpenSession(session);
  }
  regions_.OpenSession(session);
}

void Engine::EndSession(const std::string& session) {
  std::shared_ptr<WaitCancellation> cancellation;
  bool drove = false;
  {
    absl::MutexLock lock(&mu_);
    cancellation = steps_->EndSession(session);
    drove = drivers_.erase(session) > 0;
  }
  if (cancellation != nullptr) {
    cancellation->cancelled.store(true);
    device_->ReleaseCancelledWaits();
  }
  {
    absl::MutexLock lock(&bound_mu_);
    for (auto& bound : bound_) {
      if (bound != nullptr && bound->session == session) bound = nullptr;
    }
  }
  regions_.ReleaseSession(session);
  if (drove && CommitModeOf(layout_).KeepsUnappliedTokens()) {
    // The pools outlive the driver: whoever maps or drives them next finds
    // every block's current state.
    Work flush;
    flush.launch = mode_->Materialize(nullptr, -1, false, nullptr);
    flush.done = [](absl::Status launched) {
      if (!launched.ok()) {
        LogError(absl::StrCat("flushing the pending blocks of an ended session: ",
                              launched.ToString()));
      }
    };
    if (absl::Status st = device_->Submit(std::move(flush)); !st.ok()) {
      LogError(absl::StrCat("flushing the pending blocks of an ended session: ", st.ToString()));
    }
  }
}

std::string Engine::HealthProblem() const {
  const Device::Health h = device_->CheckHealth();
  if (!h.sticky_error.ok()) {
    return absl::StrCat("the device failed and cannot recover: ", h.sticky_error.ToString());
  }
  const absl::Duration limit =
      absl::Milliseconds(config_.stuck_stream_ms() == 0 ? 30000 : config_.stuck_stream_ms());
  if (h.stalled > limit) {
    return absl::StrCat("the device's queue has been on ", h.stalled_on, " for ",
                        absl::FormatDuration(h.stalled), ", over the limit of ",
                        absl::FormatDuration(limit), " (stuck_stream_ms)");
  }
  return "";
}

std::vector<std::string> Engine::Warnings() const {
  std::vector<std::string> warnings;
  if (device_->kind() == kernels::Backend::kCuda && !device_->mps_client()) {
    warnings.push_back(
        "not an MPS client: the GPU time-slices this service's and the scheduler's contexts "
        "(5.3x the in-process step time at N=1); run both under one MPS server "
        "(nvidia-cuda-mps-control -d, the same CUDA_MPS_PIPE_DIRECTORY in both)");
  }
  return warnings;
}

EngineCounters Engine::counters() const {
  absl::MutexLock lock(&mu_);
  return counters_;
}

}  // namespace server
}  // namespace specstate
