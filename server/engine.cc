// The engine: set-up and pools, debugging reads, and the driving calls. The
// per-request tensor rules are in request_tensors.cc, the step bookkeeping
// in step_table.cc; what is here is each verb's own checks and kernel
// arguments, and Drive(), the one place that runs the step protocol.
#include "server/engine.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/internal/checks.h"
#include "kernels/kda_kernels.h"
#include "server/log.h"
#include "server/sizing.h"
#include "server/tensor_summary.h"
#include "server/test_crash.h"

namespace specstate {
namespace server {

// ---------------------------------------------------------------------------
// Set-up.

Engine::Engine(const v1::ServiceConfig& config, std::unique_ptr<Device> device)
    : config_(config), layout_(config.layout()), device_(std::move(device)) {}

Engine::~Engine() = default;

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const v1::ServiceConfig& config,
                                                       std::unique_ptr<Device> device,
                                                       const DeferredParts* kept) {
  absl::Status st = ValidateLayout(config.layout());
  if (!st.ok()) return st;
  std::unique_ptr<Engine> engine(new Engine(config, std::move(device)));
  if (kept != nullptr && kept->pending.entries != nullptr) {
    if (!IsDeferred(config.layout()) ||
        static_cast<int>(kept->records.size()) != 2 * config.layout().num_layers() ||
        kept->pending.num_layers != config.layout().num_layers() ||
        kept->pending.num_blocks != config.layout().num_blocks() ||
        kept->pending.capacity != config.layout().max_rows()) {
      return absl::InternalError(
          "the kept DEFERRED parts were not made for this layout (Recovery checks that first)");
    }
    engine->kept_deferred_ = *kept;
  }
  st = engine->Allocate();
  if (!st.ok()) return st;
  return engine;
}

absl::Status Engine::Allocate() {
  sizes_ = ComputeLayoutSizes(layout_);
  shape_ = ShapeOf(layout_);
  const int L = layout_.num_layers();
  const int Q = sizes_.spec_query_len;
  const int rows = layout_.max_rows();

  layout_.set_backend(device_->kind() == kernels::Backend::kCuda ? v1::CUDA : v1::CPU);
  if (layout_.commit_mode() == v1::COMMIT_MODE_UNSPECIFIED) layout_.set_commit_mode(v1::EAGER);
  layout_.set_fold_every(FoldEveryOf(layout_));
  layout_.set_device(device_->ordinal());
  layout_.set_mps_client(device_->mps_client());
  layout_.set_conv_width(sizes_.conv_width);
  layout_.set_state_block_bytes(sizes_.state_block_bytes);
  layout_.set_conv_block_bytes(sizes_.conv_block_bytes);
  layout_.set_pool_bytes(sizes_.pool_bytes);
  layout_.set_record_bytes(sizes_.record_bytes);

  commit_workspace_bytes_ = kernels::CommitWorkspaceBytes(rows, Q, layout_.num_blocks());
  record_workspace_bytes_ = kernels::RecordStateBlocksWorkspaceBytes(rows);
  // What specstated --pool_memory and specstatectl plan size with (server/sizing.h).
  // Kept DEFERRED records are in the kept allocation already (not counted twice).
  const ServiceBytes service = ComputeServiceBytes(layout_, /*kept_pools=*/false);
  const uint64_t needed = uint64_t(service.engine) -
                          (kept_deferred_.pending.entries != nullptr ? uint64_t(service.records) : 0);
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
  if (IsDeferred(layout_)) {
    st = AllocatePending();
    if (!st.ok()) return st;
  }
  if (IsFast(layout_)) {
    st = AllocateFast();
    if (!st.ok()) return st;
  }
  if (!IsDeferred(layout_) && !IsFast(layout_)) {
    // EAGER: where a Flush's block list is copied to be checked (Flush).
    absl::StatusOr<void*> p = device_->AllocateDevice(uint64_t(layout_.num_blocks()) * 4);
    if (!p.ok()) return p.status();
    flush_checked_blocks_ = static_cast<int32_t*>(*p);
  }
  absl::StatusOr<std::vector<StepSlot>> slots = AllocateSlots();
  if (!slots.ok()) return slots.status();
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
    if (IsFast(layout_)) {
      // FAST keeps its windows in the rings: records of no buffers, whose
      // rows and window still bound a step.
      layer.records.rows = layout_.max_rows();
      layer.records.q = sizes_.spec_query_len;
      layer.records_alt = layer.records;
      if (absl::Status st = AllocateRings(&layer.fast); !st.ok()) return st;
    } else {
      const bool kept = kept_deferred_.pending.entries != nullptr;
      absl::StatusOr<kernels::Records> records =
          AllocateRecords(kept ? kept_deferred_.records[2 * l] : nullptr);
      if (!records.ok()) return records.status();
      layer.records = *records;
      // DEFERRED double-buffers them; EAGER's second buffer is the first.
      if (IsDeferred(layout_)) {
        records = AllocateRecords(kept ? kept_deferred_.records[2 * l + 1] : nullptr);
        if (!records.ok()) return records.status();
      }
      layer.records_alt = *records;
    }
    kernels::CommitLayer& entry = host_layer_table_[l];
    entry.state = layer.state;
    entry.conv = layer.conv;
    entry.params = kernels::LayerParams{layer.a_log, layer.dt_bias};
    entry.records = layer.records;
    entry.records_alt = layer.records_alt;
    entry.fast = layer.fast;
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

// One layer's records: kv [rows * Q, H K + HV V], g, beta, each 256-byte
// aligned; at `at` (kept memory) or allocated.
absl::StatusOr<kernels::Records> Engine::AllocateRecords(char* at) {
  const int Q = sizes_.spec_query_len;
  const int64_t hk = kernels::KeyWidth(shape_), vw = kernels::ValueWidth(shape_);
  const int64_t act_size = DTypeSize(shape_.act_dtype);
  const int64_t tokens = int64_t{layout_.max_rows()} * Q;
  kernels::Records records;
  absl::StatusOr<void*> rec =
      at != nullptr ? absl::StatusOr<void*>(at)
                    : device_->AllocateDevice(sizes_.records_per_layer_bytes);
  if (!rec.ok()) return rec.status();
  char* r = static_cast<char*>(*rec);
  const auto align = [](int64_t b) { return (b + 255) / 256 * 256; };
  records.kv = r;
  records.g = r + align(tokens * (hk + vw) * act_size);
  records.beta =
      static_cast<char*>(records.g) + align(tokens * kernels::GateWidth(shape_) * act_size);
  records.rows = layout_.max_rows();
  records.q = Q;
  return records;
}

void Engine::SetCommitJournal(const kernels::CommitJournal& journal) {
  journal_ = journal;
  if (journal.test_hook != nullptr && pending_.journal != nullptr) {
    pending_.test_hook = &PendingTestHook;
  }
}

// DEFERRED's bookkeeping (zeroed: nothing pending), each layer's replay plan,
// the replay lists of Commit and Flush, a Flush's checked blocks and status.
absl::Status Engine::AllocatePending() {
  const int L = layout_.num_layers();
  const int rows = layout_.max_rows();
  const int64_t blocks = layout_.num_blocks();
  const auto allocate = [this](uint64_t bytes, auto** out) -> absl::Status {
    absl::StatusOr<void*> p = device_->AllocateDevice(bytes);
    if (!p.ok()) return p.status();
    *out = static_cast<std::remove_reference_t<decltype(**out)>*>(*p);
    return absl::OkStatus();
  };
  pending_.num_layers = L;
  pending_.num_blocks = blocks;
  pending_.capacity = rows;
  absl::Status st;
  if (kept_deferred_.pending.entries != nullptr) {
    // Kept: the table (and its journal) as the last instance left it.
    pending_ = kept_deferred_.pending;
  } else {
    st = allocate(kernels::PendingEntriesBytes(L, blocks), &pending_.entries);
    if (st.ok()) st = allocate(kernels::PendingHeaderBytes(rows), &pending_.header);
  }
  if (st.ok()) st = allocate(uint64_t(L) * rows * 4, &replay_plans_);
  verify_workspace_bytes_ = kernels::VerifyWorkspaceBytes(blocks);
  if (st.ok()) st = allocate(verify_workspace_bytes_, reinterpret_cast<char**>(&verify_workspace_));
  commit_jobs_.capacity = static_cast<int>(kernels::CommitJobsCapacity(rows, L));
  flush_jobs_.capacity = static_cast<int>(kernels::FlushJobsCapacity(rows, L));
  if (st.ok()) st = allocate(commit_jobs_.capacity * sizeof(kernels::ReplayJob), &commit_jobs_.jobs);
  if (st.ok()) st = allocate(sizeof(int32_t), &commit_jobs_.count);
  if (st.ok()) st = allocate(flush_jobs_.capacity * sizeof(kernels::ReplayJob), &flush_jobs_.jobs);
  if (st.ok()) st = allocate(sizeof(int32_t), &flush_jobs_.count);
  if (st.ok()) st = allocate(uint64_t(blocks) * 4, &flush_checked_blocks_);
  if (st.ok()) st = allocate(sizeof(kernels::DeviceStatus), &flush_status_);
  return st;
}

// One layer's FAST rings, zeroed (every ring empty).
absl::Status Engine::AllocateRings(kernels::FastRings* rings) {
  const auto allocate = [this](int64_t bytes) -> absl::StatusOr<char*> {
    absl::StatusOr<void*> p = device_->AllocateDevice(uint64_t(bytes));
    if (!p.ok()) return p.status();
    return static_cast<char*>(*p);
  };
  absl::StatusOr<char*> k = allocate(sizes_.fast_ring_k_bytes);
  if (!k.ok()) return k.status();
  absl::StatusOr<char*> u = allocate(sizes_.fast_ring_u_bytes);
  if (!u.ok()) return u.status();
  absl::StatusOr<char*> log_decay = allocate(sizes_.fast_ring_log_decay_bytes);
  if (!log_decay.ok()) return log_decay.status();
  absl::StatusOr<char*> cursors = allocate(sizes_.fast_cursor_bytes);
  if (!cursors.ok()) return cursors.status();
  rings->k = *k;
  rings->u = reinterpret_cast<float*>(*u);
  rings->log_decay = reinterpret_cast<float*>(*log_decay);
  rings->cursors = reinterpret_cast<kernels::FastCursor*>(*cursors);
  rings->num_blocks = layout_.num_blocks();
  rings->capacity = sizes_.fast_ring_capacity;
  return absl::OkStatus();
}

// FAST's Verify owner table and a Flush's checked blocks and status (the
// rings are the layers').
absl::Status Engine::AllocateFast() {
  verify_workspace_bytes_ = kernels::VerifyWorkspaceBytes(layout_.num_blocks());
  absl::StatusOr<void*> p = device_->AllocateDevice(verify_workspace_bytes_);
  if (!p.ok()) return p.status();
  verify_workspace_ = *p;
  p = device_->AllocateDevice(uint64_t(layout_.num_blocks()) * 4);
  if (!p.ok()) return p.status();
  flush_checked_blocks_ = static_cast<int32_t*>(*p);
  p = device_->AllocateDevice(sizeof(kernels::DeviceStatus));
  if (!p.ok()) return p.status();
  flush_status_ = static_cast<kernels::DeviceStatus*>(*p);
  return absl::OkStatus();
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
// Debugging.

void Engine::ReadState(const v1::ReadStateRequest& request, Reply<v1::ReadStateResponse> reply) {
  if (request.layer() < 0 || request.layer() >= layout_.num_layers()) {
    reply(absl::OutOfRangeError(absl::StrCat("layer ", request.layer(),
                                             " is out of range: the layout has ",
                                             layout_.num_layers(), " layers")),
          {});
    return;
  }
  if (request.block() < 0 || request.block() >= layout_.num_blocks()) {
    reply(absl::OutOfRangeError(absl::StrCat("block ", request.block(),
                                             " is out of range: the pools have ",
                                             layout_.num_blocks(), " blocks")),
          {});
    return;
  }
  const LayerState& layer = layers_[request.layer()];
  // Host memory the device copies into (pinned on CUDA, so the copies stay
  // asynchronous); reused across calls.
  char* buffer = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (!read_buffers_.empty()) {
      buffer = read_buffers_.back();
      read_buffers_.pop_back();
    }
  }
  if (buffer == nullptr) {
    absl::StatusOr<void*> p =
        device_->AllocateHost(sizes_.state_block_bytes + sizes_.conv_block_bytes);
    if (!p.ok()) {
      reply(p.status(), {});
      return;
    }
    buffer = static_cast<char*>(*p);
  }
  const int64_t state_bytes = sizes_.state_block_bytes;
  const int64_t conv_bytes = sizes_.conv_block_bytes;
  Work work;
  // DEFERRED: the block's pending tokens in this layer are replayed first;
  // FAST: its ring in this layer is folded into it (the candidates of a step
  // in flight kept). So the summary is of its current state.
  auto block = std::make_shared<IndexInput>();
  block->present = true;
  block->values = {request.block()};
  block->rows = 1;
  work.launch = FlushLaunch(std::move(block), request.layer(), false, nullptr);
  work.readbacks.push_back(Readback{
      static_cast<const char*>(layer.state.data) + request.block() * state_bytes, buffer,
      uint64_t(state_bytes)});
  work.readbacks.push_back(Readback{
      static_cast<const char*>(layer.conv.data) + request.block() * conv_bytes,
      buffer + state_bytes, uint64_t(conv_bytes)});
  const v1::Layout layout = layout_;
  const bool values = request.values();
  work.done = [this, buffer, state_bytes, conv_bytes, layout, values,
               reply](absl::Status launched) {
    v1::ReadStateResponse out;
    if (launched.ok()) {
      const int64_t k = layout.head_dim();
      SummarizeTensor(buffer, state_bytes, FromProto(layout.state_dtype()).value(), values,
                      {ValueHeadsOf(layout), k, k}, out.mutable_recurrent());
      SummarizeTensor(buffer + state_bytes, conv_bytes,
                      FromProto(layout.activation_dtype()).value(), values,
                      {layout.conv_dim(), layout.conv_width()}, out.mutable_conv());
    }
    {
      absl::MutexLock lock(&mu_);
      read_buffers_.push_back(buffer);
    }
    reply(launched, std::move(out));
  };
  absl::Status st = device_->Submit(std::move(work));
  if (!st.ok()) {
    {
      absl::MutexLock lock(&mu_);
      read_buffers_.push_back(buffer);
    }
    reply(st, {});
  }
}

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

// ---------------------------------------------------------------------------
// The step protocol.

void Engine::MarkFailed(uint64_t step_id, const std::string& session, absl::Status status,
                        bool async) {
  if (steps_->MarkFailed(step_id, session, status, async)) ++counters_.steps_failed;
}

Step* Engine::StartStep(std::unique_ptr<Step> fresh) {
  ++counters_.steps_verified;
  counters_.rows_verified += fresh->num_rows;
  // The latest step's rows: what the stock path would hold beyond them now.
  counters_.state_bytes_saved = uint64_t(fresh->num_rows) * (sizes_.spec_query_len - 1) *
                                sizes_.state_block_bytes * layout_.num_layers();
  return steps_->Start(std::move(fresh));
}

absl::Status Engine::SubmitInSlot(StepSlot& slot, Work work) {
  ++slot.in_flight;
  absl::Status st = device_->Submit(std::move(work));
  if (!st.ok()) --slot.in_flight;
  return st;
}

kernels::Prerequisites Engine::StepPrerequisites(const StepSlot& slot, const Step& step,
                                                int count) const {
  return kernels::Prerequisites{slot.status_device, count, slot.cancelled, step.generation,
                                device_->input_fault_word()};
}

std::vector<WaitOp> Engine::StepWaits(const StepSlot& slot, const Step& step,
                                      std::vector<WaitOp> waits) {
  for (WaitOp& w : waits) {
    w.cancel_word = slot.cancelled;
    w.cancel_value = step.generation;
  }
  return waits;
}

absl::StatusOr<SyncPoint> Engine::ResolveSyncPoint(const std::string& session,
                                                   const v1::Signal& sync,
                                                   absl::string_view field, Ordering& out) {
  SyncPoint op;
  if (sync.has_doorbell()) {
    const std::string name = absl::StrCat(field, ".doorbell");
    absl::StatusOr<Counter> counter = regions_.ResolveCounter(session, sync.doorbell(), name);
    if (!counter.ok()) return counter.status();
    op.kind = SyncPoint::Kind::kDoorbell;
    op.counter = counter->word;
    op.value = sync.doorbell().value();
    out.doorbells.emplace_back(name, counter->span);
    out.pins.push_back(counter->pin);
  } else if (sync.has_event()) {
    absl::StatusOr<void*> event = device_->OpenIpcEvent(sync.event().handle());
    if (!event.ok()) return Prefixed(absl::StrCat(field, ".event: "), event.status());
    op.kind = SyncPoint::Kind::kEvent;
    op.event = *event;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(field, ": set doorbell or event"));
  }
  return op;
}

absl::StatusOr<Engine::Ordering> Engine::ResolveOrdering(const std::string& session,
                                                         v1::Ordering ordering,
                                                         const v1::Signal& wait,
                                                         const v1::Signal& signal, bool has_wait,
                                                         bool has_signal) {
  Ordering out;
  out.async = ordering == v1::ASYNC;
  if (!out.async && (has_wait || has_signal)) {
    return absl::InvalidArgumentError("wait and signal need ordering ASYNC");
  }
  // One doorbell (a counter in a region of the session) or one event each.
  if (has_wait) {
    absl::StatusOr<SyncPoint> op = ResolveSyncPoint(session, wait, "wait", out);
    if (!op.ok()) return op.status();
    {
      // Raised when the session ends, so that nothing waits for it forever.
      absl::MutexLock lock(&mu_);
      absl::StatusOr<std::shared_ptr<WaitCancellation>> c = steps_->WaitCancellationOf(session);
      if (!c.ok()) return c.status();
      op->cancellation = *std::move(c);
    }
    out.waits.push_back(*op);
  }
  if (has_signal) {
    absl::StatusOr<SyncPoint> op = ResolveSyncPoint(session, signal, "signal", out);
    if (!op.ok()) return op.status();
    out.signals.push_back(*op);
  }
  return out;
}

template <typename Response>
void Engine::AnswerRetry(Step::Once& once, uint64_t fingerprint, bool async,
                         const std::string& first_call, Response cached,
                         absl::ReleasableMutexLock& lock, const Reply<Response>& reply) {
  if (once.fingerprint != fingerprint) {
    lock.Release();
    reply(absl::FailedPreconditionError(absl::StrCat(first_call, " with different arguments")), {});
    return;
  }
  cached.set_replayed_from_cache(true);
  cached.set_enqueued(async);
  if (once.finished || async) {
    const absl::Status s = once.finished ? once.status : absl::OkStatus();
    lock.Release();
    reply(s, cached);
    return;
  }
  once.waiters.push_back([reply, cached](absl::Status s) { reply(s, cached); });
}

// Whether a call's response can say it was answered from the cache (the
// calls that apply at most once per step).
template <typename Response, typename = void>
constexpr bool kAnswersRetries = false;
template <typename Response>
constexpr bool kAnswersRetries<
    Response, std::void_t<decltype(std::declval<Response&>().set_replayed_from_cache(true))>> =
    true;

// What a verb states; Drive() does the rest. `find_step`, `prepare` and
// `respond` run inside Drive, under the lock (they may capture the verb's
// locals by reference); `succeeded` runs later, when the work is done, also
// under the lock (it must capture by value).
template <typename Response>
struct Engine::StepCall {
  StepCall(const std::string& session, uint64_t step_id, Ordering ordering,
           std::vector<RegionPin> pins)
      : session(session), step_id(step_id), ordering(std::move(ordering)), pins(std::move(pins)) {}

  const std::string session;
  const uint64_t step_id;
  Ordering ordering;
  std::vector<RegionPin> pins;  // of the request's regions (the ordering's are added)
  // The slot's status the call's kernels write: a layer's (its Verify),
  // num_layers (Commit) or num_layers + 1 (RecordStateBlocks).
  int status_index = 0;
  int verifies_layer = -1;  // Verify: the layer it marks verified in the step
  // Commit / RecordStateBlocks apply at most once per step: a retry with
  // the same fingerprint is answered from the first call.
  Step::Once Step::*once = nullptr;
  uint64_t fingerprint = 0;
  std::string retry_first_call;  // "step 7 was already committed"

  // The call's step, checked for this verb. A Verify of a new step prepares
  // it in `fresh` (started only once every check passed).
  std::function<absl::StatusOr<Step*>(std::unique_ptr<Step>* fresh)> find_step;
  // The kernel arguments, checked on the host, as the work's launch and
  // readbacks. Changes nothing. `first`: the call starts the step.
  std::function<absl::StatusOr<Work>(const Step& step, const StepSlot& slot, bool first)> prepare;
  // What the response says of the step (also when answered from the cache).
  std::function<Response(const Step& step)> respond = [](const Step&) { return Response(); };
  // The work succeeded: counters. `first` and `num_rows` as of the call.
  std::function<void(const StepSlot& slot, bool first, int num_rows)> succeeded;
};

template <typename Response>
void Engine::Drive(StepCall<Response>& call, const Reply<Response>& reply,
                   PhaseProfile::Timer* timer) {
  const bool async = call.ordering.async;
  absl::ReleasableMutexLock lock(&mu_);
  if constexpr (kAnswersRetries<Response>) {
    Step* earlier = call.once == nullptr ? nullptr : steps_->Find(call.session, call.step_id);
    if (earlier != nullptr && (earlier->*call.once).started) {
      AnswerRetry(earlier->*call.once, call.fingerprint, async, call.retry_first_call,
                  call.respond(*earlier), lock, reply);
      return;
    }
  }
  drivers_.insert(call.session);
  absl::Status pending = steps_->TakeSessionError(call.session);
  std::unique_ptr<Step> fresh;
  absl::StatusOr<Step*> found = pending.ok() ? call.find_step(&fresh) : pending;
  const bool first = fresh != nullptr;
  absl::StatusOr<Work> work =
      found.ok() ? call.prepare(**found, steps_->slot((*found)->slot), first) : found.status();
  if (!work.ok()) {
    lock.Release();
    reply(work.status(), {});
    return;
  }

  // Every check passed: from here on the call changes state.
  const int slot_index = (*found)->slot;
  StepSlot& slot = steps_->slot(slot_index);
  const int num_rows = (*found)->num_rows;
  Response response = call.respond(**found);
  response.set_enqueued(async);
  work->waits = StepWaits(slot, **found, std::move(call.ordering.waits));
  work->signals = std::move(call.ordering.signals);
  std::vector<RegionPin> all_pins = std::move(call.pins);
  all_pins.insert(all_pins.end(), call.ordering.pins.begin(), call.ordering.pins.end());
  work->done = Completion(call, async ? Reply<Response>() : reply, response,
                          UniquePins(std::move(all_pins)), first, num_rows, slot_index);
  Work reset = first ? StatusReset(**found, async) : Work();
  Step* step = first ? StartStep(std::move(fresh)) : *found;
  if (call.verifies_layer >= 0) steps_->MarkVerified(*step, call.verifies_layer);
  if (call.once != nullptr) {
    (step->*call.once).started = true;
    (step->*call.once).fingerprint = call.fingerprint;
  }
  if (timer != nullptr) timer->Mark();
  absl::Status st = first ? SubmitInSlot(slot, std::move(reset)) : absl::OkStatus();
  if (st.ok()) st = SubmitInSlot(slot, *std::move(work));
  if (!st.ok()) {
    // An at-most-once call may be retried; a Verify's step cannot go on.
    if (call.once != nullptr) {
      (step->*call.once).started = false;
    } else {
      MarkFailed(call.step_id, call.session, st, false);
    }
    lock.Release();
    reply(st, {});
    return;
  }
  lock.Release();
  if (timer != nullptr) timer->Mark();
  if (async) {
    reply(absl::OkStatus(), std::move(response));
    if (timer != nullptr) timer->Mark();
  }
}

template <typename Response>
std::function<void(absl::Status)> Engine::Completion(
    StepCall<Response>& call, Reply<Response> reply, Response response,
    std::shared_ptr<std::vector<RegionPin>> pins, bool first, int num_rows, int slot_index) {
  return [this, pins = std::move(pins), reply = std::move(reply),
          response = std::move(response), async = call.ordering.async, first, num_rows,
          slot_index, session = call.session, step_id = call.step_id,
          status_index = call.status_index, once = call.once,
          succeeded = std::move(call.succeeded)](absl::Status launched) {
    absl::Status result = launched;
    if (absl::Status lost = regions_.DropTruncated(*pins); !lost.ok()) result = lost;
    std::vector<std::function<void(absl::Status)>> waiters;
    {
      absl::MutexLock lock(&mu_);
      StepSlot& s = steps_->slot(slot_index);
      --s.in_flight;
      const kernels::DeviceStatus& status = s.status_host[status_index];
      if (result.ok() && status.failed != 0) {  // the message only then
        ++counters_.device_check_failures;
        const int L = layout_.num_layers();
        result = kernels::DeviceStatusToStatus(
            status, status_index < L    ? absl::StrCat("Verify of layer ", status_index)
                    : status_index == L ? std::string("Commit")
                                        : std::string("RecordStateBlocks"));
      }
      if (!result.ok()) {
        MarkFailed(step_id, session, result, async);
      } else if (succeeded) {
        succeeded(s, first, num_rows);
      }
      if (once != nullptr) {
        if (Step* st = steps_->Find(session, step_id)) {
          (st->*once).finished = true;
          (st->*once).status = result;
          waiters.swap((st->*once).waiters);
        }
      }
    }
    pins->clear();  // the regions may go now
    if (reply) reply(result, response);
    for (auto& w : waiters) w(result);
  };
}

Work Engine::StatusReset(const Step& step, bool async) {
  Work reset;
  const int L = layout_.num_layers();
  const StepSlot& slot = steps_->slot(step.slot);
  reset.launch = [this, status = slot.status_device, L](kernels::Stream stream, Scratch&) {
    return device_->ZeroOnStream(status, (L + 2) * sizeof(kernels::DeviceStatus), stream);
  };
  reset.done = [this, step_id = step.id, session = step.session, async,
                slot_index = step.slot](absl::Status launched) {
    absl::MutexLock lock(&mu_);
    --steps_->slot(slot_index).in_flight;
    if (!launched.ok()) MarkFailed(step_id, session, launched, async);
  };
  return reset;
}

// ---------------------------------------------------------------------------
// Driving calls.

absl::StatusOr<std::shared_ptr<std::pair<FloatSource, FloatSource>>> Engine::LayerParamsOf(
    RegionLookup& lookup, const v1::LoadLayerParamsRequest& req) {
  const int L = layout_.num_layers();
  const int H = layout_.num_heads();
  if (req.layer() < 0 || req.layer() >= L) {
    return absl::OutOfRangeError(
        absl::StrCat("layer ", req.layer(), " is out of range: the layout has ", L, " layers"));
  }
  if (shape_.kind == kernels::LayerKind::kGdn) {
    return absl::FailedPreconditionError(
        "the layout's layers are GDN: they take no gate parameters (g is the log-decay the model "
        "computed, beta the write strength)");
  }
  if (req.has_lower_bound() && req.lower_bound() != layout_.lower_bound()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lower_bound = ", req.lower_bound(), " differs from the layout's ", layout_.lower_bound(),
        ": all layers share one lower_bound"));
  }
  // Each parameter inline or from a region; both copied into service memory.
  absl::StatusOr<FloatSource> a_log = ResolveFloatParam(lookup, req.a_log(), "a_log", H);
  if (!a_log.ok()) return a_log.status();
  absl::StatusOr<FloatSource> dt_bias =
      ResolveFloatParam(lookup, req.dt_bias(), "dt_bias", int64_t{H} * layout_.head_dim());
  if (!dt_bias.ok()) return dt_bias.status();
  return std::make_shared<std::pair<FloatSource, FloatSource>>(*std::move(a_log),
                                                               *std::move(dt_bias));
}

void Engine::LoadLayerParams(const std::string& session, const v1::LoadLayerParamsRequest& req,
                             Reply<v1::LoadLayerParamsResponse> reply) {
  RegionLookup lookup(regions_, session);
  absl::StatusOr<std::shared_ptr<std::pair<FloatSource, FloatSource>>> sources =
      LayerParamsOf(lookup, req);
  // A host mirror of this call's status (the device's is shared by every
  // LoadLayerParams: they run in stream order), reused across calls.
  kernels::DeviceStatus* mirror = nullptr;
  if (sources.ok()) {
    absl::MutexLock lock(&mu_);
    if (!param_mirrors_.empty()) {
      mirror = param_mirrors_.back();
      param_mirrors_.pop_back();
    }
  }
  if (sources.ok() && mirror == nullptr) {
    absl::StatusOr<void*> p = device_->AllocateHost(sizeof(kernels::DeviceStatus));
    if (!p.ok()) sources = p.status();
    mirror = static_cast<kernels::DeviceStatus*>(p.value_or(nullptr));
  }
  if (!sources.ok()) {
    reply(sources.status(), {});
    return;
  }
  std::memset(mirror, 0, sizeof(*mirror));
  const int layer_index = req.layer();
  Work work;
  // Inline values go through the scratch; region values are read by the
  // kernel, which checks them finite before the layer's copy changes.
  work.launch = [this, sources = *sources, layer_index, mirror](kernels::Stream stream,
                                                                 Scratch& scratch) -> absl::Status {
    absl::StatusOr<const float*> a = sources->first.Pointer(scratch);
    if (!a.ok()) return a.status();
    absl::StatusOr<const float*> d = sources->second.Pointer(scratch);
    if (!d.ok()) return d.status();
    const LayerState& layer = layers_[layer_index];
    kernels::LoadParamsArgs args;
    args.num_heads = layout_.num_heads();
    args.head_dim = layout_.head_dim();
    args.a_log = *a;
    args.dt_bias = *d;
    args.staging = params_staging_;
    args.dst_a_log = layer.a_log;
    args.dst_dt_bias = layer.dt_bias;
    args.input_fault = device_->input_fault_word();
    args.status = params_status_;
    args.status_mirror = mirror;
    return device_->kernels().LoadParams(args, stream);
  };
  work.done = [this, pins = UniquePins(lookup.TakePins()), reply, mirror,
               layer_index](absl::Status launched) {
    absl::Status result = launched;
    if (absl::Status lost = regions_.DropTruncated(*pins); !lost.ok()) result = lost;
    pins->clear();  // the regions may go now
    const bool check_failed = result.ok() && mirror->failed != 0;
    if (result.ok()) {
      result = kernels::DeviceStatusToStatus(
          *mirror, absl::StrCat("LoadLayerParams of layer ", layer_index));
    }
    {
      absl::MutexLock lock(&mu_);
      if (check_failed) ++counters_.device_check_failures;
      if (result.ok()) layers_[layer_index].params_loaded = true;
      param_mirrors_.push_back(mirror);
    }
    reply(result, {});
  };
  absl::Status st = device_->Submit(std::move(work));
  if (!st.ok()) {
    {
      absl::MutexLock lock(&mu_);
      param_mirrors_.push_back(mirror);
    }
    reply(st, {});
  }
}

void Engine::BindVerifyInputs(const std::string& session, const v1::BindVerifyInputsRequest& req,
                              Reply<v1::BindVerifyInputsResponse> reply) {
  const int L = layout_.num_layers();
  if (req.layer() < 0 || req.layer() >= L) {
    reply(absl::OutOfRangeError(absl::StrCat("layer ", req.layer(),
                                             " is out of range: the layout has ", L, " layers")),
          {});
    return;
  }
  RegionLookup lookup(regions_, session);
  absl::StatusOr<std::shared_ptr<BoundInputs>> bound =
      ResolveBinding(lookup, req, shape_, layout_.max_rows(), session);
  if (!bound.ok()) {
    reply(bound.status(), {});
    return;
  }
  {
    absl::MutexLock lock(&bound_mu_);
    bound_[req.layer()] = *bound;
  }
  v1::BindVerifyInputsResponse response;
  response.set_max_tokens((*bound)->max_tokens);
  response.set_max_rows((*bound)->max_rows);
  reply(absl::OkStatus(), response);
}

absl::StatusOr<VerifyInputs> Engine::VerifyInputsOf(const std::string& session,
                                                    const v1::VerifyRequest& req) {
  const int L = layout_.num_layers();
  if (req.layer() < 0 || req.layer() >= L) {
    return absl::OutOfRangeError(
        absl::StrCat("layer ", req.layer(), " is out of range: the layout has ", L, " layers"));
  }
  if (req.num_rows() < 0 || req.num_rows() > layout_.max_rows()) {
    return absl::OutOfRangeError(absl::StrCat("num_rows = ", req.num_rows(),
                                              " is out of range: the records hold at most ",
                                              layout_.max_rows(), " rows (max_rows)"));
  }
  if (!req.bound_inputs()) {
    RegionLookup lookup(regions_, session);
    return ResolveVerifyInputs(lookup, req, shape_, req.num_rows());
  }
  std::shared_ptr<const BoundInputs> bound;
  {
    absl::ReaderMutexLock lock(&bound_mu_);
    bound = bound_[req.layer()];
  }
  return InputsFromBinding(bound.get(), req, session, req.num_rows());
}

absl::StatusOr<kernels::VerifyArgs> Engine::VerifyArgsFor(const VerifyInputs& in, int layer_index,
                                                        const Step& step, const StepSlot& slot,
                                                        bool first) const {
  const LayerState& layer = layers_[layer_index];
  kernels::VerifyArgs args;
  args.shape = shape_;
  args.q = in.q;
  args.k = in.k;
  args.v = in.v;
  args.g = in.g;
  args.beta = in.beta;
  args.num_tokens = in.num_tokens;
  args.out = in.out;
  args.state = layer.state;
  args.params = kernels::LayerParams{layer.a_log, layer.dt_bias};
  args.records = layer.records;
  args.mode = kernels::CommitModeOf(IsDeferred(layout_), IsFast(layout_));
  if (IsDeferred(layout_)) {
    args.pending = pending_;
    args.layer = layer_index;
    args.records_alt = layer.records_alt;
    args.replay_plan = replay_plans_ + int64_t{layer_index} * layout_.max_rows();
    args.workspace = verify_workspace_;
    args.workspace_bytes = verify_workspace_bytes_;
  }
  if (IsFast(layout_)) {
    args.fast = layer.fast;
    args.workspace = verify_workspace_;
    args.workspace_bytes = verify_workspace_bytes_;
  }
  args.num_rows = step.num_rows;
  args.prerequisites = StepPrerequisites(slot, step, layout_.num_layers());
  args.status = slot.status_device + layer_index;
  args.status_mirror = slot.StatusMirror(layer_index);
  // The first Verify of a step snapshots its indices; later ones are
  // checked against that snapshot, and every kernel reads only it.
  if (first) {
    args.snapshot_query_start_loc = slot.query_start_loc;
    args.snapshot_state_indices = slot.state_indices;
  } else {
    args.expected_query_start_loc = slot.query_start_loc;
    args.expected_state_indices = slot.state_indices;
  }
  // Checked now so the caller hears of it even in ASYNC mode (inline
  // tensors get their real address only when enqueued).
  kernels::VerifyArgs check = args;
  check.query_start_loc = HostCheckPlaceholder();
  check.state_indices = kernels::IndexMatrix{HostCheckPlaceholder(), 1, 1};
  if (absl::Status valid = kernels::ValidateVerifyArgs(check); !valid.ok()) return valid;
  return args;
}

void Engine::Verify(const std::string& session, const v1::VerifyRequest& req,
                    Reply<v1::VerifyResponse> reply) {
  // SPECSTATE_PROFILE=1: where an ASYNC Verify's handling goes.
  static PhaseProfile profile("Verify (ASYNC)",
                              {"tensors", "ordering", "step+checks", "submit", "reply"});
  PhaseProfile::Timer timer(profile);
  absl::StatusOr<VerifyInputs> in = VerifyInputsOf(session, req);
  timer.Mark();
  absl::StatusOr<Ordering> ordering = in.ok() ? ResolveOrdering(session, req) : in.status();
  absl::Status checked = ordering.ok() ? CheckNoAlias("o", in->out_span, in->input_spans)
                                       : ordering.status();
  if (checked.ok()) checked = CheckNoAlias("o", in->out_span, ordering->doorbells);
  if (!checked.ok()) {
    reply(checked, {});
    return;
  }
  timer.Mark();
  const int N = req.num_rows();
  const int layer_index = req.layer();
  LayerState& layer = layers_[layer_index];
  StepCall<v1::VerifyResponse> call(session, req.step(), *std::move(ordering),
                                    std::move(in->pins));
  call.status_index = layer_index;
  call.verifies_layer = layer_index;
  call.find_step = [&](std::unique_ptr<Step>* fresh) -> absl::StatusOr<Step*> {
    if (!layer.params_loaded) {
      return absl::FailedPreconditionError(absl::StrCat(
          "layer ", layer_index, " has no parameters yet: call LoadLayerParams first"));
    }
    absl::StatusOr<Step*> step = steps_->FindOrPrepare(session, req.step(), N, fresh);
    if (step.ok() && *fresh != nullptr && !in->query_start_loc.present) {
      return absl::InvalidArgumentError(absl::StrCat(
          "query_start_loc and state_indices are required on the first Verify of step ",
          req.step()));
    }
    return step;
  };
  call.prepare = [&](const Step& step, const StepSlot& slot,
                     bool first) -> absl::StatusOr<Work> {
    absl::StatusOr<kernels::VerifyArgs> args = VerifyArgsFor(*in, layer_index, step, slot, first);
    if (!args.ok()) return args.status();
    Work work;
    if (first && N > 0) {
      work.readbacks.push_back(Readback{slot.query_start_loc, slot.qsl_host, uint64_t(N + 1) * 4});
    }
    work.launch = [this, args = *args, qsl = std::move(in->query_start_loc),
                   indices = std::move(in->state_indices), snapshot = slot.query_start_loc,
                   snapshot_indices = slot.state_indices](kernels::Stream stream,
                                                          Scratch& scratch) mutable {
      // The step's snapshot unless this call gives the indices.
      const int32_t* qsl_data = snapshot;
      const int32_t* indices_data = snapshot_indices;
      absl::Status st = PointIndices(scratch, {{&qsl, &qsl_data}, {&indices, &indices_data}});
      if (!st.ok()) return st;
      args.query_start_loc = qsl_data;
      args.state_indices = qsl.present ? indices.Matrix(indices_data)
                                       : kernels::IndexMatrix{snapshot_indices, 1, 1};
      TestCrashPoint("verify");
      return device_->kernels().Verify(args, stream);
    };
    return work;
  };
  call.succeeded = [this](const StepSlot& s, bool first, int rows) {
    if (first && rows > 0) counters_.tokens_verified += uint64_t(s.qsl_host[rows] - s.qsl_host[0]);
  };
  Drive(call, reply, &timer);
}

absl::StatusOr<kernels::CommitArgs> Engine::CommitArgsFor(const CommitIndices& indices,
                                                          const Step& step,
                                                          const StepSlot& slot) const {
  const int L = layout_.num_layers();
  const bool align = layout_.cache_mode() == v1::ALIGN;
  kernels::CommitArgs args;
  args.shape = shape_;
  args.spec_query_len = sizes_.spec_query_len;
  args.num_layers = L;
  args.layers = host_layer_table_.data();
  args.device_layers = device_layer_table_;
  args.num_rows = step.num_rows;
  args.query_start_loc = slot.query_start_loc;
  args.state_indices = kernels::IndexMatrix{slot.state_indices, 1, 1};
  args.batch = static_cast<int>(indices.batch());
  args.mamba_block_size = align ? layout_.mamba_block_size() : 0;
  args.workspace = commit_workspace_;
  args.workspace_bytes = commit_workspace_bytes_;
  args.prerequisites = StepPrerequisites(slot, step, L);
  args.status = slot.status_device + L;
  args.status_mirror = slot.StatusMirror(L);
  if (IsDeferred(layout_)) {
    args.pending = pending_;
    args.jobs = commit_jobs_;
  }
  args.mode = kernels::CommitModeOf(IsDeferred(layout_), IsFast(layout_));  // FAST: rings in table
  if (journal_.record != nullptr) {
    args.journal = journal_;
    args.journal.step = step.id;
  }
  kernels::CommitArgs check = args;
  check.num_accepted = HostCheckPlaceholder();
  if (indices.request_indices.present) check.request_indices = HostCheckPlaceholder();
  if (align) {
    check.block_table = indices.block_table.Matrix(HostCheckPlaceholder());
    check.num_computed_tokens = HostCheckPlaceholder();
  }
  if (absl::Status valid = kernels::ValidateCommitArgs(check); !valid.ok()) return valid;
  return args;
}

void Engine::Commit(const std::string& session, const v1::CommitRequest& req,
                    Reply<v1::CommitResponse> reply) {
  RegionLookup lookup(regions_, session);
  absl::StatusOr<CommitIndices> indices = ResolveCommitIndices(lookup, req, layout_);
  absl::StatusOr<Ordering> ordering =
      indices.ok() ? ResolveOrdering(session, req) : indices.status();
  if (!ordering.ok()) {
    reply(ordering.status(), {});
    return;
  }
  const int L = layout_.num_layers();
  StepCall<v1::CommitResponse> call(session, req.step(), *std::move(ordering), lookup.TakePins());
  call.status_index = L;
  call.once = &Step::commit;
  call.fingerprint = Fingerprint(req);
  call.retry_first_call = absl::StrCat("step ", req.step(), " was already committed");
  call.respond = [L](const Step& step) {
    v1::CommitResponse response;
    response.set_num_rows(step.num_rows);
    response.set_num_layers(L);
    return response;
  };
  call.find_step = [&](std::unique_ptr<Step>*) -> absl::StatusOr<Step*> {
    absl::StatusOr<Step*> step = steps_->FindCommittable(session, req.step());
    if (!step.ok()) return step;
    absl::Status covered = CheckBatchCoversStep(indices->request_indices, indices->batch(),
                                                "num_accepted", (*step)->num_rows);
    if (!covered.ok()) return covered;
    return step;
  };
  call.prepare = [&](const Step& step, const StepSlot& slot, bool) -> absl::StatusOr<Work> {
    absl::StatusOr<kernels::CommitArgs> args = CommitArgsFor(*indices, step, slot);
    if (!args.ok()) return args.status();
    Work work;
    if (step.num_rows > 0) {
      work.readbacks.push_back(Readback{kernels::CommitPlanOf(commit_workspace_, layout_.num_blocks()),
                                        slot.plan_host, step.num_rows * sizeof(kernels::CommitPlanRow)});
    }
    work.launch = [this, args = *args, in = *std::move(indices)](kernels::Stream stream,
                                                                 Scratch& scratch) mutable {
      const int32_t* table = nullptr;
      absl::Status st = PointIndices(scratch, {{&in.num_accepted, &args.num_accepted},
                                               {&in.request_indices, &args.request_indices},
                                               {&in.block_table, &table},
                                               {&in.num_computed_tokens, &args.num_computed_tokens}});
      if (!st.ok()) return st;
      if (in.block_table.present) args.block_table = in.block_table.Matrix(table);
      const absl::Status launched = device_->kernels().Commit(args, stream);
      TestCrashPoint("commit:enqueued");
      return launched;
    };
    return work;
  };
  call.succeeded = [this](const StepSlot& s, bool, int rows) {
    ++counters_.steps_committed;
    for (int i = 0; i < rows; ++i) {
      const kernels::CommitPlanRow& p = s.plan_host[i];
      if (p.source > 0 && p.commit_len > 0 && p.final_block > 0) {
        ++counters_.rows_committed;
        counters_.tokens_committed += p.commit_len;
      }
    }
  };
  Drive(call, reply);
}

absl::StatusOr<kernels::RecordStateBlocksArgs> Engine::RecordArgsFor(
    const RecordIndices& indices, const v1::RecordStateBlocksRequest& req, const Step& step,
    const StepSlot& slot) const {
  const int L = layout_.num_layers();
  kernels::RecordStateBlocksArgs args;
  args.num_rows = step.num_rows;
  args.batch = static_cast<int>(indices.batch());
  args.mamba_block_size = layout_.mamba_block_size();
  args.block_table_width = req.block_table_width();
  args.num_requests = static_cast<int>(indices.state_idx.shape[0]);
  args.state_idx = static_cast<int32_t*>(indices.state_idx.data);
  args.num_accepted = static_cast<int32_t*>(indices.num_accepted.data);
  args.workspace = record_workspace_;
  args.workspace_bytes = record_workspace_bytes_;
  args.prerequisites = StepPrerequisites(slot, step, L + 1);
  args.status = slot.status_device + L + 1;
  args.status_mirror = slot.StatusMirror(L + 1);
  kernels::RecordStateBlocksArgs check = args;
  check.idx_mapping = check.num_sampled = check.num_computed_tokens = HostCheckPlaceholder();
  if (indices.request_indices.present) check.request_indices = HostCheckPlaceholder();
  if (absl::Status valid = kernels::ValidateRecordStateBlocksArgs(check); !valid.ok()) {
    return valid;
  }
  return args;
}

void Engine::RecordStateBlocks(const std::string& session,
                               const v1::RecordStateBlocksRequest& req,
                               Reply<v1::RecordStateBlocksResponse> reply) {
  if (layout_.cache_mode() != v1::ALIGN) {
    reply(absl::FailedPreconditionError(
              "RecordStateBlocks is for cache_mode ALIGN; this service runs cache_mode NONE"),
          {});
    return;
  }
  RegionLookup lookup(regions_, session);
  absl::StatusOr<RecordIndices> indices = ResolveRecordIndices(lookup, req, layout_);
  absl::StatusOr<Ordering> ordering =
      indices.ok() ? ResolveOrdering(session, req) : indices.status();
  absl::Status checked = ordering.ok() ? CheckRecordOutputsAlias(*indices, ordering->doorbells)
                                       : ordering.status();
  if (!checked.ok()) {
    reply(checked, {});
    return;
  }
  const int L = layout_.num_layers();
  StepCall<v1::RecordStateBlocksResponse> call(session, req.step(), *std::move(ordering),
                                               lookup.TakePins());
  call.status_index = L + 1;
  call.once = &Step::record;
  call.fingerprint = Fingerprint(req);
  call.retry_first_call = absl::StrCat("step ", req.step(), " already recorded its state blocks");
  call.find_step = [&](std::unique_ptr<Step>*) -> absl::StatusOr<Step*> {
    absl::StatusOr<Step*> step = steps_->FindRecordable(session, req.step());
    if (!step.ok()) return step;
    absl::Status covered = CheckBatchCoversStep(indices->request_indices, indices->batch(),
                                                "idx_mapping", (*step)->num_rows);
    if (!covered.ok()) return covered;
    return step;
  };
  call.prepare = [&](const Step& step, const StepSlot& slot, bool) -> absl::StatusOr<Work> {
    absl::StatusOr<kernels::RecordStateBlocksArgs> args = RecordArgsFor(*indices, req, step, slot);
    if (!args.ok()) return args.status();
    Work work;
    work.launch = [this, args = *args, in = *std::move(indices)](kernels::Stream stream,
                                                                 Scratch& scratch) mutable {
      absl::Status st = PointIndices(scratch, {{&in.idx_mapping, &args.idx_mapping},
                                               {&in.num_sampled, &args.num_sampled},
                                               {&in.num_computed_tokens, &args.num_computed_tokens},
                                               {&in.request_indices, &args.request_indices}});
      if (!st.ok()) return st;
      return device_->kernels().RecordStateBlocks(args, stream);
    };
    return work;
  };
  Drive(call, reply);
}

std::function<absl::Status(kernels::Stream, Scratch&)> Engine::FlushLaunch(
    std::shared_ptr<const IndexInput> blocks, int layer, bool discard,
    kernels::DeviceStatus* mirror) const {
  if (!IsDeferred(layout_) && !IsFast(layout_)) {
    return [](kernels::Stream, Scratch&) { return absl::OkStatus(); };
  }
  kernels::FlushArgs args;
  args.shape = shape_;
  args.spec_query_len = sizes_.spec_query_len;
  args.num_layers = layout_.num_layers();
  args.layers = host_layer_table_.data();
  args.device_layers = device_layer_table_;
  if (IsDeferred(layout_)) {
    args.pending = pending_;
    args.jobs = flush_jobs_;
  }
  args.mode = kernels::CommitModeOf(IsDeferred(layout_), IsFast(layout_));
  args.layer = layer;
  args.discard = discard;
  args.prerequisites.input_fault = device_->input_fault_word();
  args.status = flush_status_;
  args.status_mirror = mirror;
  return [this, args, blocks = std::move(blocks)](kernels::Stream stream,
                                                  Scratch& scratch) mutable -> absl::Status {
    if (blocks != nullptr && blocks->present && blocks->rows > 0) {
      absl::StatusOr<const int32_t*> data = blocks->Pointer(scratch);
      if (!data.ok()) return data.status();
      args.blocks = *data;
      args.num_blocks_given = static_cast<int>(blocks->rows);
      args.checked_blocks = flush_checked_blocks_;
    }
    return device_->kernels().Flush(args, stream);
  };
}

namespace {

// A Flush's host memory: its status mirror and, under EAGER, after it the
// copy of its block list that the service checks (Engine::Flush).
uint64_t FlushMirrorBytes(const v1::Layout& layout) {
  static_assert(sizeof(kernels::DeviceStatus) % alignof(int32_t) == 0, "the list follows it");
  const bool eager = !IsDeferred(layout) && !IsFast(layout);
  return sizeof(kernels::DeviceStatus) + (eager ? uint64_t(layout.num_blocks()) * 4 : 0);
}

int32_t* ListCopyOf(kernels::DeviceStatus* mirror) {
  return reinterpret_cast<int32_t*>(mirror + 1);
}

// EAGER: the check that the DEFERRED and FAST kernels run on a Flush's block
// list (kernels/internal/checks.h, CheckListedBlock: <= 0 is skipped, every
// other block below the pool's), on the list's copy after `mirror`; the
// lowest failing element's fault goes to `mirror`, as theirs goes to theirs.
void CheckListCopy(kernels::DeviceStatus* mirror, int64_t rows, int64_t num_blocks) {
  const int32_t* list = ListCopyOf(mirror);
  std::vector<int32_t> checked(rows);
  for (int64_t i = 0; i < rows; ++i) {
    const kernels::internal::RowFault f = kernels::internal::CheckListedBlock(
        list, checked.data(), static_cast<int>(i), num_blocks);
    if (f.problem != 0) {
      *mirror = kernels::internal::StatusFromFault(f, static_cast<int32_t>(i), -1);
      return;
    }
  }
}

}  // namespace

void Engine::Flush(const std::string& session, const v1::FlushRequest& req,
                   Reply<v1::FlushResponse> reply) {
  const int L = layout_.num_layers();
  if (req.has_layer() && (req.layer() < 0 || req.layer() >= L)) {
    reply(absl::OutOfRangeError(absl::StrCat("layer ", req.layer(),
                                             " is out of range: the layout has ", L, " layers")),
          {});
    return;
  }
  RegionLookup lookup(regions_, session);
  absl::StatusOr<IndexInput> blocks =
      ResolveIndex(lookup, req.blocks(), "blocks", IndexSpec{});
  if (blocks.ok() && blocks->rows > layout_.num_blocks()) {
    blocks = absl::OutOfRangeError(absl::StrCat("blocks has ", blocks->rows,
                                                " entries: at most the pool's ",
                                                layout_.num_blocks(), " blocks"));
  }
  absl::StatusOr<Ordering> ordering = blocks.ok() ? ResolveOrdering(session, req) : blocks.status();
  if (!ordering.ok()) {
    reply(ordering.status(), {});
    return;
  }
  // A host mirror of this call's status, reused across calls.
  kernels::DeviceStatus* mirror = nullptr;
  {
    absl::MutexLock lock(&mu_);
    drivers_.insert(session);
    if (!flush_mirrors_.empty()) {
      mirror = flush_mirrors_.back();
      flush_mirrors_.pop_back();
    }
  }
  if (mirror == nullptr) {
    absl::StatusOr<void*> p = device_->AllocateHost(FlushMirrorBytes(layout_));
    if (!p.ok()) {
      reply(p.status(), {});
      return;
    }
    mirror = static_cast<kernels::DeviceStatus*>(*p);
  }
  std::memset(mirror, 0, sizeof(*mirror));
  const bool async = ordering->async;
  Work work;
  work.waits = std::move(ordering->waits);
  work.signals = std::move(ordering->signals);
  auto list = std::make_shared<const IndexInput>(*std::move(blocks));
  // EAGER has nothing pending, and FlushLaunch nothing to run; the block list
  // is checked all the same, as the other modes' kernels check it and in
  // stream order (a list in a region may be written by the caller's stream
  // before a wait): copied on the stream before the signals, read back, and
  // checked once the device got there. A list that fails is the call's error
  // (OUT_OF_RANGE naming the element and the bound); one that passes, as
  // under the other modes, changes nothing.
  const bool check_copy =
      !IsDeferred(layout_) && !IsFast(layout_) && list->present && list->rows > 0;
  const int64_t list_rows = check_copy ? list->rows : 0;
  if (check_copy) {
    const uint64_t bytes = uint64_t(list->rows) * sizeof(int32_t);
    work.launch = [this, list, bytes](kernels::Stream stream, Scratch& scratch) -> absl::Status {
      absl::StatusOr<const int32_t*> data = list->Pointer(scratch);
      if (!data.ok()) return data.status();
      return device_->CopyOnStream(flush_checked_blocks_, *data, bytes, stream);
    };
    work.readbacks.push_back(Readback{flush_checked_blocks_, ListCopyOf(mirror), bytes});
  } else {
    work.launch = FlushLaunch(std::move(list), req.has_layer() ? req.layer() : -1, req.discard(),
                              mirror);
  }
  std::vector<RegionPin> pins = lookup.TakePins();
  pins.insert(pins.end(), ordering->pins.begin(), ordering->pins.end());
  work.done = [this, pins = UniquePins(std::move(pins)), reply, mirror, async, session,
               list_rows](absl::Status launched) {
    absl::Status result = launched;
    if (absl::Status lost = regions_.DropTruncated(*pins); !lost.ok()) result = lost;
    pins->clear();  // the regions may go now
    if (result.ok() && list_rows > 0) CheckListCopy(mirror, list_rows, layout_.num_blocks());
    const bool check_failed = result.ok() && mirror->failed != 0;
    if (check_failed) result = kernels::DeviceStatusToStatus(*mirror, "Flush");
    {
      absl::MutexLock lock(&mu_);
      if (check_failed) ++counters_.device_check_failures;
      flush_mirrors_.push_back(mirror);
      if (async && !result.ok()) {
        steps_->KeepSessionError(session, absl::Status(result.code(),
                                                       absl::StrCat("an earlier asynchronous "
                                                                    "Flush failed: ",
                                                                    result.message())));
      }
    }
    if (!async) reply(result, {});
  };
  absl::Status st = device_->Submit(std::move(work));
  if (!st.ok()) {
    {
      absl::MutexLock lock(&mu_);
      flush_mirrors_.push_back(mirror);
    }
    reply(st, {});
    return;
  }
  if (async) {
    v1::FlushResponse response;
    response.set_enqueued(true);
    reply(absl::OkStatus(), response);
  }
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
  if (drove && (IsDeferred(layout_) || IsFast(layout_))) {
    // The pools outlive the driver: whoever maps or drives them next finds
    // every block's current state.
    Work flush;
    flush.launch = FlushLaunch(nullptr, -1, false, nullptr);
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
