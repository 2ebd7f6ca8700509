#include "server/engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/kda_kernels.h"
#include "kernels/numeric.h"
#include "server/phase_profile.h"

namespace specstate {
namespace server {
namespace {

// An int32 index tensor from a region (device memory) or inline (uploaded
// in stream order when the work is enqueued).
struct IndexInput {
  bool present = false;
  const int32_t* data = nullptr;  // region
  std::vector<int32_t> values;    // inline
  int64_t rows = 0;
  int64_t cols = 1;
  int64_t row_stride = 1;
  ByteSpan span;  // region only

  absl::StatusOr<const int32_t*> Pointer(Scratch& scratch) const {
    if (data != nullptr) return data;
    absl::StatusOr<void*> p = scratch.Upload(values.data(), values.size() * sizeof(int32_t));
    if (!p.ok()) return p.status();
    return static_cast<const int32_t*>(*p);
  }
};

// Shape rules: `rows` (-1: any), and 1-D unless `allow_2d` ([rows, cols],
// column stride 1, any row stride). Dense 1-D unless `strided_1d` (a column
// slice [rows] with a row stride, like block_table[:, 0]).
struct IndexSpec {
  int64_t rows = -1;
  bool allow_2d = false;
  bool strided_1d = false;
  int64_t cols = -1;  // for 2-D: -1 any
};

absl::StatusOr<IndexInput> ResolveIndex(RegionLookup& regions, const v1::IndexTensor& t,
                                        absl::string_view field, const IndexSpec& spec) {
  IndexInput in;
  if (t.source_case() == v1::IndexTensor::SOURCE_NOT_SET) return in;
  in.present = true;
  if (t.has_values()) {
    std::vector<int64_t> shape(t.values().shape().begin(), t.values().shape().end());
    if (shape.empty()) shape.push_back(t.values().values_size());
    if (shape.size() > 2 || (shape.size() == 2 && !spec.allow_2d)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": inline values have rank ", shape.size(), ", expected ",
                       spec.allow_2d ? "1 or 2" : "1"));
    }
    int64_t count = 1;
    for (int64_t d : shape) {
      if (d < 0) return absl::InvalidArgumentError(absl::StrCat(field, ": negative dimension"));
      count *= d;
    }
    if (count != t.values().values_size()) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": shape holds ", count,
                                                     " values but ", t.values().values_size(),
                                                     " are given"));
    }
    in.values.assign(t.values().values().begin(), t.values().values().end());
    in.rows = shape[0];
    in.cols = shape.size() == 2 ? shape[1] : 1;
    in.row_stride = in.cols;
  } else {
    const int rank = t.region().shape_size();
    if (rank != 1 && !(rank == 2 && spec.allow_2d)) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": rank ", rank, ", expected ",
                                                     spec.allow_2d ? "1 or 2" : "1"));
    }
    TensorSpec ts;
    ts.dtype = DType::kInt32;
    ts.shape.assign(rank, -1);
    ts.dense_inner = rank == 2 ? 1 : (spec.strided_1d ? 0 : 1);
    absl::StatusOr<TensorView> view = regions.ResolveTensor(t.region(), field, ts);
    if (!view.ok()) return view.status();
    in.data = static_cast<const int32_t*>(view->data);
    in.span = view->span;
    in.rows = view->shape[0];
    in.cols = rank == 2 ? view->shape[1] : 1;
    in.row_stride = view->strides[0];
  }
  if (spec.rows >= 0 && in.rows != spec.rows) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": has ", in.rows, " rows, expected ", spec.rows));
  }
  if (spec.cols >= 0 && in.cols != spec.cols) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": has ", in.cols, " columns, expected ", spec.cols));
  }
  if (in.rows > 0 && in.cols < 1) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": has no columns"));
  }
  return in;
}

absl::Status Required(const IndexInput& in, absl::string_view field) {
  if (in.present) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, " is required"));
}

// Stands in for an inline tensor's device address while the host checks a
// call (never dereferenced).
const int32_t kPlaceholder[1] = {0};

uint64_t Fnv1a(const std::string& bytes) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// What identifies a Commit / RecordStateBlocks retry: every argument but the
// ordering (a retry may wait on another doorbell value).
template <typename Request>
uint64_t Fingerprint(Request request) {
  request.clear_ordering();
  request.clear_wait();
  request.clear_signal();
  std::string bytes;
  request.SerializeToString(&bytes);
  return Fnv1a(bytes);
}

std::string LayerList(const std::vector<int>& layers) {
  return absl::StrJoin(layers, ", ");
}

// One pin per region per call: ListRegions' in_use counts calls.
std::shared_ptr<std::vector<RegionPin>> UniquePins(std::vector<RegionPin> pins) {
  std::sort(pins.begin(), pins.end());
  pins.erase(std::unique(pins.begin(), pins.end()), pins.end());
  if (!pins.empty() && pins.front() == nullptr) pins.erase(pins.begin());
  return std::make_shared<std::vector<RegionPin>>(std::move(pins));
}

// A call's tensors by field, for the aliasing check.
using NamedSpans = std::vector<std::pair<std::string, ByteSpan>>;

// INVALID_ARGUMENT when output `field` shares a byte with any of `others`
// (inputs, doorbells, other outputs): the kernels would read what they
// write, or ring a doorbell by writing an output.
absl::Status CheckNoAlias(absl::string_view field, const ByteSpan& out, const NamedSpans& others) {
  for (const auto& [name, span] : others) {
    if (Overlap(out, span)) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " overlaps ", name, " (the same memory): an output must not alias the call's "
                                    "inputs, doorbells or other outputs"));
    }
  }
  return absl::OkStatus();
}

absl::Status Prefix(absl::string_view prefix, const absl::Status& s) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(prefix, s.message()));
}

}  // namespace

struct Engine::VerifyInputs {
  kernels::Activation q, k, v, g, beta;
  void* out = nullptr;
  ByteSpan out_span;
  NamedSpans input_spans;  // q, k, v, g, beta and the index tensors in regions
  int64_t num_tokens = 0;
  IndexInput query_start_loc, state_indices;
  std::vector<RegionPin> pins;  // of every region named, each once
};

// A layer's Verify tensors at their capacity, checked when bound. The
// regions are referred to, not held: a bound Verify pins them, and fails
// once one was unregistered.
struct Engine::BoundInputs {
  std::string session;
  kernels::Activation q, k, v, g, beta;
  void* out = nullptr;
  int64_t max_tokens = 0;
  int max_rows = -1;  // -1: no query_start_loc / state_indices
  const int32_t* query_start_loc = nullptr;
  const int32_t* state_indices = nullptr;
  int64_t state_indices_row_stride = 1;
  int64_t state_indices_cols = 1;
  ByteSpan out_span;
  NamedSpans input_spans;
  struct Held {
    std::weak_ptr<Region> region;
    std::string name;
  };
  std::vector<Held> regions;  // distinct
};

// ---------------------------------------------------------------------------
// Set-up.

Engine::Engine(const v1::ServiceConfig& config, std::unique_ptr<Device> device)
    : config_(config), layout_(config.layout()), device_(std::move(device)) {}

Engine::~Engine() = default;

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const v1::ServiceConfig& config,
                                                       std::unique_ptr<Device> device) {
  absl::Status st = ValidateLayout(config.layout());
  if (!st.ok()) return st;
  std::unique_ptr<Engine> engine(new Engine(config, std::move(device)));
  st = engine->Allocate();
  if (!st.ok()) return st;
  return engine;
}

absl::Status Engine::Allocate() {
  sizes_ = ComputeLayoutSizes(layout_);
  shape_ = ShapeOf(layout_);
  const int L = layout_.num_layers();
  const int H = layout_.num_heads();
  const int K = layout_.head_dim();
  const int Q = sizes_.spec_query_len;
  const int rows = layout_.max_rows();

  layout_.set_backend(device_->kind() == kernels::Backend::kCuda ? v1::CUDA : v1::CPU);
  layout_.set_device(device_->ordinal());
  layout_.set_conv_width(sizes_.conv_width);
  layout_.set_state_block_bytes(sizes_.state_block_bytes);
  layout_.set_conv_block_bytes(sizes_.conv_block_bytes);
  layout_.set_pool_bytes(sizes_.pool_bytes);
  layout_.set_record_bytes(sizes_.record_bytes);

  commit_workspace_bytes_ = kernels::CommitWorkspaceBytes(rows, Q, layout_.num_blocks());
  record_workspace_bytes_ = kernels::RecordStateBlocksWorkspaceBytes(rows);
  const uint64_t params_bytes = uint64_t(L) * (H + int64_t{H} * K) * sizeof(float);
  const uint64_t slot_bytes =
      kStepSlots * (uint64_t(L + 2) * sizeof(kernels::DeviceStatus) + uint64_t(2 * rows + 1) * 4);
  const uint64_t needed = uint64_t(sizes_.pool_bytes) + uint64_t(sizes_.record_bytes) +
                          commit_workspace_bytes_ + record_workspace_bytes_ + params_bytes +
                          slot_bytes + L * sizeof(kernels::CommitLayer);
  absl::StatusOr<uint64_t> free = device_->FreeBytes();
  if (!free.ok()) return free.status();
  if (needed > *free) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the layout needs ", needed, " bytes (pools ", sizes_.pool_bytes, ", records ",
        sizes_.record_bytes, ") but the ", kernels::BackendName(device_->kind()),
        " device has ", *free, " bytes free: lower num_blocks, max_rows or num_layers"));
  }

  absl::StatusOr<void*> pools = device_->AllocateExported(sizes_.pool_bytes);
  if (!pools.ok()) return pools.status();
  pools_ = static_cast<char*>(*pools);

  const int64_t hk = kernels::KeyWidth(shape_), vw = kernels::ValueWidth(shape_);
  const int64_t act_size = DTypeSize(shape_.act_dtype);
  const int64_t tokens = int64_t{rows} * Q;
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
    absl::StatusOr<void*> rec = device_->AllocateDevice(sizes_.records_per_layer_bytes);
    if (!rec.ok()) return rec.status();
    char* r = static_cast<char*>(*rec);
    const auto align = [](int64_t b) { return (b + 255) / 256 * 256; };
    layer.records.kv = r;
    layer.records.g = r + align(tokens * (hk + vw) * act_size);
    layer.records.beta = static_cast<char*>(layer.records.g) +
                         align(tokens * kernels::GateWidth(shape_) * act_size);
    layer.records.rows = rows;
    layer.records.q = Q;
    kernels::CommitLayer& entry = host_layer_table_[l];
    entry.state = layer.state;
    entry.conv = layer.conv;
    entry.params = kernels::LayerParams{layer.a_log, layer.dt_bias};
    entry.records = layer.records;
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
  absl::Status st = device_->CopyToDevice(device_layer_table_, host_layer_table_.data(),
                                          L * sizeof(kernels::CommitLayer));
  if (!st.ok()) return st;

  absl::StatusOr<void*> ws = device_->AllocateDevice(commit_workspace_bytes_);
  if (!ws.ok()) return ws.status();
  commit_workspace_ = *ws;
  ws = device_->AllocateDevice(record_workspace_bytes_);
  if (!ws.ok()) return ws.status();
  record_workspace_ = *ws;

  absl::MutexLock lock(&mu_);
  slots_.resize(kStepSlots);
  for (StepSlot& slot : slots_) {
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
  return absl::OkStatus();
}

v1::ExportPoolsResponse Engine::ExportPools() const {
  v1::ExportPoolsResponse out;
  out.set_backend(layout_.backend());
  out.set_shm_path(device_->ExportName());
  out.set_cuda_ipc_handle(device_->ExportHandle());
  out.set_device(device_->ordinal());
  out.set_allocation_bytes(sizes_.pool_bytes);
  for (int l = 0; l < layout_.num_layers(); ++l) {
    v1::PoolView* s = out.add_pools();
    s->set_layer(l);
    s->set_kind("recurrent");
    s->set_dtype(layout_.state_dtype());
    const int64_t hv = kernels::ValueHeads(shape_);  // [blocks, HV, V, K]
    for (int64_t d : {int64_t{layout_.num_blocks()}, hv, int64_t{layout_.head_dim()},
                      int64_t{layout_.head_dim()}}) {
      s->add_shape(d);
    }
    const int64_t k = layout_.head_dim();
    for (int64_t d : {hv * k * k, k * k, k, int64_t{1}}) s->add_strides(d);
    s->set_offset_bytes(StatePoolOffset(sizes_, l));
    s->set_byte_size(sizes_.state_block_bytes * layout_.num_blocks());
    v1::PoolView* c = out.add_pools();
    c->set_layer(l);
    c->set_kind("conv");
    c->set_dtype(layout_.activation_dtype());
    for (int64_t d : {int64_t{layout_.num_blocks()}, int64_t{layout_.conv_dim()},
                      int64_t{sizes_.conv_width}}) {
      c->add_shape(d);
    }
    for (int64_t d : {int64_t{layout_.conv_dim()} * sizes_.conv_width, int64_t{sizes_.conv_width},
                      int64_t{1}}) {
      c->add_strides(d);
    }
    c->set_offset_bytes(ConvPoolOffset(sizes_, l));
    c->set_byte_size(sizes_.conv_block_bytes * layout_.num_blocks());
  }
  return out;
}

// ---------------------------------------------------------------------------
// Debugging.

namespace {

template <typename T>
void Summarize(const T* values, int64_t count, bool keep, const std::vector<int64_t>& shape,
               v1::TensorSummary* out) {
  double mn = std::numeric_limits<double>::infinity();
  double mx = -mn, sum = 0, sq = 0;
  for (int64_t i = 0; i < count; ++i) {
    const double x = ToFloat(values[i]);
    mn = std::min(mn, x);
    mx = std::max(mx, x);
    sum += x;
    sq += x * x;
    if (keep) out->add_values(static_cast<float>(x));
  }
  for (int64_t d : shape) out->add_shape(d);
  out->set_min(count ? mn : 0);
  out->set_max(count ? mx : 0);
  out->set_mean(count ? sum / count : 0);
  out->set_l2_norm(std::sqrt(sq));
  out->set_checksum(Fnv1a(std::string(reinterpret_cast<const char*>(values), count * sizeof(T))));
}

template <typename F>
void WithDType(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      f(float{});
      break;
    case DType::kFloat16:
      f(Float16{});
      break;
    case DType::kBFloat16:
      f(BFloat16{});
      break;
    case DType::kInt32:
      break;
  }
}

}  // namespace

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
  work.launch = [](kernels::Stream, Scratch&) { return absl::OkStatus(); };
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
      WithDType(FromProto(layout.state_dtype()).value(), [&](auto tag) {
        using T = decltype(tag);
        Summarize(reinterpret_cast<const T*>(buffer), state_bytes / sizeof(T), values,
                  {ValueHeadsOf(layout), k, k}, out.mutable_recurrent());
      });
      WithDType(FromProto(layout.activation_dtype()).value(), [&](auto tag) {
        using T = decltype(tag);
        Summarize(reinterpret_cast<const T*>(buffer + state_bytes), conv_bytes / sizeof(T), values,
                  {layout.conv_dim(), layout.conv_width()}, out.mutable_conv());
      });
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
    return Prefix(absl::StrCat("region \"", request.name(), "\": "), mapped.status());
  }
  if ((*mapped)->object() == device_->ExportedObject()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "region \"", request.name(), "\" is the service's own pools: map them from ExportPools, "
        "never register them as a region (no call may write the pools through a client's tensor)"));
  }
  return regions_.Register(request.session_id(), request.name(), *std::move(mapped));
}

// ---------------------------------------------------------------------------
// Steps.

absl::Status Engine::TakeSessionError(const std::string& session) {
  auto it = session_errors_.find(session);
  if (it == session_errors_.end()) return absl::OkStatus();
  absl::Status s = it->second;
  session_errors_.erase(it);
  return s;
}

void Engine::MarkFailed(uint64_t step_id, const std::string& session, absl::Status status,
                        bool async) {
  Step* step = FindStep(session, step_id);
  if (step != nullptr && !step->failed) {
    step->failed = true;
    step->failure = status;
    ++counters_.steps_failed;
  }
  if (async && session_errors_.count(session) == 0) {
    session_errors_[session] = absl::Status(
        status.code(), absl::StrCat("an earlier asynchronous call failed (its step ", step_id,
                                    " is marked failed; nothing of it was committed): ",
                                    status.message()));
  }
}

Engine::Step* Engine::FindStep(const std::string& session, uint64_t id) {
  // Newest first: nearly every call is of the current step, and each Step
  // is a heap object of its own (a cache miss apiece on a cold core).
  for (auto it = steps_.rbegin(); it != steps_.rend(); ++it) {
    if ((*it)->id == id && (*it)->session == session) return it->get();
  }
  return nullptr;
}

absl::Status Engine::LostRegions(const std::vector<RegionPin>& pins) {
  absl::Status lost;
  for (const RegionPin& pin : pins) {
    if (pin == nullptr || !pin->faulted()) continue;
    regions_.Drop(pin);
    if (lost.ok()) {
      lost = absl::DataLossError(absl::StrCat(
          "region \"", pin->name(), "\" was truncated by its owner while this call used it: the "
          "call failed, and the region was unregistered (register the buffer again)"));
    }
  }
  return lost;
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

absl::StatusOr<Engine::Step*> Engine::FindOrPrepareStep(const std::string& session,
                                                        uint64_t id, int num_rows,
                                                        std::unique_ptr<Step>* fresh) {
  Step* step = FindStep(session, id);
  if (step != nullptr) {
    if (step != steps_.back().get()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "step ", id, " has ended: step ", steps_.back()->id, " started after it"));
    }
    if (step->failed) {
      return absl::FailedPreconditionError(
          absl::StrCat("step ", id, " failed: ", step->failure.message()));
    }
    if (step->commit.started) {
      return absl::FailedPreconditionError(
          absl::StrCat("step ", id, " is already committed: start a new step id"));
    }
    if (num_rows != step->num_rows) {
      return absl::InvalidArgumentError(absl::StrCat("num_rows = ", num_rows, " differs from the ",
                                                     step->num_rows,
                                                     " rows of step ", id, "'s first Verify"));
    }
    return step;
  }
  const int slot = next_slot_;
  if (slots_[slot].in_flight > 0) {
    return absl::UnavailableError(absl::StrCat(
        kStepSlots, " steps are still in flight on the device; retry once one has finished"));
  }
  *fresh = std::make_unique<Step>();
  Step& f = **fresh;
  f.session = session;
  f.id = id;
  f.slot = slot;
  f.num_rows = num_rows;
  f.verified.assign(layout_.num_layers(), false);
  f.generation = next_generation_ + 1 == 0 ? 1 : next_generation_ + 1;  // 0: no cancellation word
  return fresh->get();
}

Engine::Step* Engine::StartStep(std::unique_ptr<Step> fresh) {
  next_slot_ = (next_slot_ + 1) % kStepSlots;
  next_generation_ = fresh->generation;
  std::memset(slots_[fresh->slot].status_host, 0,
              (layout_.num_layers() + 2) * sizeof(kernels::DeviceStatus));
  ++counters_.steps_verified;
  counters_.rows_verified += fresh->num_rows;
  // The latest step's rows: what the stock path would hold beyond them now.
  counters_.state_bytes_saved = uint64_t(fresh->num_rows) * (sizes_.spec_query_len - 1) *
                                sizes_.state_block_bytes * layout_.num_layers();
  steps_.push_back(std::move(fresh));
  while (steps_.size() > kStepHistory) steps_.pop_front();
  return steps_.back().get();
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
  // One doorbell (a counter in a region of the session) or one event.
  const auto resolve = [&](const v1::Signal& sync,
                           absl::string_view field) -> absl::StatusOr<SyncPoint> {
    SyncPoint op;
    if (sync.has_doorbell()) {
      auto counter =
          regions_.ResolveCounter(session, sync.doorbell(), absl::StrCat(field, ".doorbell"));
      if (!counter.ok()) return counter.status();
      op.kind = SyncPoint::Kind::kDoorbell;
      op.counter = counter->word;
      op.value = sync.doorbell().value();
      out.doorbells.emplace_back(absl::StrCat(field, ".doorbell"), counter->span);
      out.pins.push_back(counter->pin);
    } else if (sync.has_event()) {
      auto event = device_->OpenIpcEvent(sync.event().handle());
      if (!event.ok()) return Prefix(absl::StrCat(field, ".event: "), event.status());
      op.kind = SyncPoint::Kind::kEvent;
      op.event = *event;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(field, ": set doorbell or event"));
    }
    return op;
  };
  if (has_wait) {
    absl::StatusOr<SyncPoint> op = resolve(wait, "wait");
    if (!op.ok()) return op.status();
    {
      // Raised when the session ends, so that nothing waits for it forever;
      // refused once it has ended (its end raised the cancellations before).
      absl::MutexLock lock(&mu_);
      if (open_sessions_.count(session) == 0) {
        return absl::FailedPreconditionError(
            "the session has ended: nothing may wait on its doorbells any more");
      }
      auto& c = session_waits_[session];
      if (c == nullptr) c = std::make_shared<WaitCancellation>();
      op->cancellation = c;
    }
    out.waits.push_back(*op);
  }
  if (has_signal) {
    absl::StatusOr<SyncPoint> op = resolve(signal, "signal");
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

// ---------------------------------------------------------------------------
// Driving calls.

void Engine::LoadLayerParams(const std::string& session, const v1::LoadLayerParamsRequest& req,
                             Reply<v1::LoadLayerParamsResponse> reply) {
  const int L = layout_.num_layers();
  const int H = layout_.num_heads();
  const int64_t hk = int64_t{H} * layout_.head_dim();
  if (req.layer() < 0 || req.layer() >= L) {
    reply(absl::OutOfRangeError(absl::StrCat("layer ", req.layer(),
                                             " is out of range: the layout has ", L, " layers")),
          {});
    return;
  }
  if (shape_.kind == kernels::LayerKind::kGdn) {
    reply(absl::FailedPreconditionError(
              "the layout's layers are GDN: they take no gate parameters (g is the log-decay "
              "the model computed, beta the write strength)"),
          {});
    return;
  }
  if (req.has_lower_bound() && req.lower_bound() != layout_.lower_bound()) {
    reply(absl::InvalidArgumentError(absl::StrCat(
              "lower_bound = ", req.lower_bound(), " differs from the layout's ",
              layout_.lower_bound(), ": all layers share one lower_bound")),
          {});
    return;
  }
  // Each parameter inline or from a region; both copied into service memory.
  RegionLookup lookup(regions_, session);
  struct Source {
    std::vector<float> values;
    const float* region = nullptr;
  };
  auto resolve = [&](const v1::FloatTensor& t, absl::string_view field,
                     int64_t count) -> absl::StatusOr<Source> {
    Source s;
    if (t.has_values()) {
      if (t.values().values_size() != count) {
        return absl::InvalidArgumentError(absl::StrCat(field, ": ", t.values().values_size(),
                                                       " values, expected ", count));
      }
      s.values.assign(t.values().values().begin(), t.values().values().end());
      for (float x : s.values) {
        if (!std::isfinite(x)) {
          return absl::InvalidArgumentError(absl::StrCat(field, ": values must be finite"));
        }
      }
      return s;
    }
    if (!t.has_region()) return absl::InvalidArgumentError(absl::StrCat(field, " is required"));
    TensorSpec spec;
    spec.dtype = DType::kFloat32;
    spec.shape = {count};
    spec.dense_inner = 1;
    absl::StatusOr<TensorView> view = lookup.ResolveTensor(t.region(), field, spec);
    if (!view.ok()) return view.status();
    s.region = static_cast<const float*>(view->data);
    return s;
  };
  absl::StatusOr<Source> a_log = resolve(req.a_log(), "a_log", H);
  if (!a_log.ok()) {
    reply(a_log.status(), {});
    return;
  }
  absl::StatusOr<Source> dt_bias = resolve(req.dt_bias(), "dt_bias", hk);
  if (!dt_bias.ok()) {
    reply(dt_bias.status(), {});
    return;
  }
  LayerState& layer = layers_[req.layer()];
  auto sources = std::make_shared<std::pair<Source, Source>>(*std::move(a_log), *std::move(dt_bias));
  // A host mirror of this call's status (the device's is shared by every
  // LoadLayerParams: they run in stream order).
  kernels::DeviceStatus* mirror = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (!param_mirrors_.empty()) {
      mirror = param_mirrors_.back();
      param_mirrors_.pop_back();
    }
  }
  if (mirror == nullptr) {
    absl::StatusOr<void*> p = device_->AllocateHost(sizeof(kernels::DeviceStatus));
    if (!p.ok()) {
      reply(p.status(), {});
      return;
    }
    mirror = static_cast<kernels::DeviceStatus*>(*p);
  }
  std::memset(mirror, 0, sizeof(*mirror));
  Work work;
  work.launch = [this, sources, &layer, H, hk, mirror](kernels::Stream stream,
                                                        Scratch& scratch) -> absl::Status {
    // Inline values go through the scratch; region values are read by the
    // kernel, which checks them finite before the layer's copy changes.
    auto pointer = [&](const Source& s, int64_t count) -> absl::StatusOr<const float*> {
      if (s.region != nullptr) return s.region;
      absl::StatusOr<void*> up = scratch.Upload(s.values.data(), count * sizeof(float));
      if (!up.ok()) return up.status();
      return static_cast<const float*>(*up);
    };
    absl::StatusOr<const float*> a = pointer(sources->first, H);
    if (!a.ok()) return a.status();
    absl::StatusOr<const float*> d = pointer(sources->second, hk);
    if (!d.ok()) return d.status();
    kernels::LoadParamsArgs args;
    args.num_heads = H;
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
  auto pins = std::make_shared<std::vector<RegionPin>>(lookup.TakePins());
  work.done = [this, sources, pins, reply, mirror, l = req.layer()](absl::Status launched) {
    absl::Status result = launched;
    if (absl::Status lost = LostRegions(*pins); !lost.ok()) result = lost;
    pins->clear();  // the regions may go now
    if (result.ok()) {
      result = kernels::DeviceStatusToStatus(*mirror, absl::StrCat("LoadLayerParams of layer ", l));
    }
    {
      absl::MutexLock lock(&mu_);
      if (result.ok()) layers_[l].params_loaded = true;
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

namespace {

// The checks a Verify's tensors and a binding's share: activations q, k, v
// q, k [T, H, K] and v [T, HV, V] with dense tokens, o [T, HV, V] and g (KDA
// [T, H, K], GDN [T, HV]) dense, beta [T, HV], T being q's first dimension.
// The lookup holds their regions.
struct ActivationViews {
  TensorView q, k, v, g, beta, o;
};

absl::StatusOr<ActivationViews> ResolveActivations(RegionLookup& lookup, const v1::RegionTensor& q,
                                                   const v1::RegionTensor& k,
                                                   const v1::RegionTensor& v,
                                                   const v1::RegionTensor& g,
                                                   const v1::RegionTensor& beta,
                                                   const v1::RegionTensor& o,
                                                   const kernels::KdaShape& shape) {
  ActivationViews out;
  const int hv = kernels::ValueHeads(shape);
  TensorSpec act;
  act.dtype = shape.act_dtype;
  act.shape = {-1, shape.num_heads, shape.head_dim};
  act.dense_inner = 2;
  absl::StatusOr<TensorView> view = lookup.ResolveTensor(q, "q", act);
  if (!view.ok()) return view.status();
  out.q = *std::move(view);
  const int64_t T = out.q.shape[0];
  act.shape[0] = T;
  view = lookup.ResolveTensor(k, "k", act);
  if (!view.ok()) return view.status();
  out.k = *std::move(view);
  TensorSpec value = act;  // v [T, HV, V], o dense
  value.shape = {T, hv, shape.head_dim};
  view = lookup.ResolveTensor(v, "v", value);
  if (!view.ok()) return view.status();
  out.v = *std::move(view);
  value.dense_inner = 3;
  view = lookup.ResolveTensor(o, "o", value);
  if (!view.ok()) return view.status();
  out.o = *std::move(view);
  // g: KDA [T, H, K], GDN [T, HV]; dense.
  TensorSpec gate = act;
  if (shape.kind == kernels::LayerKind::kGdn) {
    gate.shape = {T, hv};
    gate.dense_inner = 2;
  } else {
    gate.dense_inner = 3;
  }
  view = lookup.ResolveTensor(g, "g", gate);
  if (!view.ok()) return view.status();
  out.g = *std::move(view);
  TensorSpec beta_spec;
  beta_spec.dtype = shape.act_dtype;
  beta_spec.shape = {T, hv};
  beta_spec.dense_inner = 1;
  view = lookup.ResolveTensor(beta, "beta", beta_spec);
  if (!view.ok()) return view.status();
  out.beta = *std::move(view);
  return out;
}

kernels::Activation ActivationOf(const TensorView& view) {
  return kernels::Activation{view.data, view.strides[0]};
}

NamedSpans InputSpans(const ActivationViews& v, const IndexInput& qsl, const IndexInput& indices) {
  NamedSpans spans = {{"q", v.q.span}, {"k", v.k.span}, {"v", v.v.span}, {"g", v.g.span},
                      {"beta", v.beta.span}};
  if (qsl.data != nullptr) spans.emplace_back("query_start_loc", qsl.span);
  if (indices.data != nullptr) spans.emplace_back("state_indices", indices.span);
  return spans;
}

// query_start_loc [rows + 1] and state_indices [rows] or [rows, C], together.
absl::StatusOr<std::pair<IndexInput, IndexInput>> ResolveRowIndices(
    RegionLookup& lookup, const v1::IndexTensor& query_start_loc,
    const v1::IndexTensor& state_indices, int64_t rows) {
  absl::StatusOr<IndexInput> qsl =
      ResolveIndex(lookup, query_start_loc, "query_start_loc", {rows < 0 ? -1 : rows + 1});
  if (!qsl.ok()) return qsl.status();
  IndexSpec idx_spec;
  idx_spec.rows = rows < 0 ? (qsl->present ? qsl->rows - 1 : -1) : rows;
  idx_spec.allow_2d = true;
  idx_spec.strided_1d = true;
  absl::StatusOr<IndexInput> indices = ResolveIndex(lookup, state_indices, "state_indices", idx_spec);
  if (!indices.ok()) return indices.status();
  if (qsl->present != indices->present) {
    return absl::InvalidArgumentError(
        "give query_start_loc and state_indices together (or omit both after the step's first "
        "Verify)");
  }
  return std::make_pair(*std::move(qsl), *std::move(indices));
}

}  // namespace

absl::StatusOr<Engine::VerifyInputs> Engine::RequestInputs(const std::string& session,
                                                           const v1::VerifyRequest& req,
                                                           int num_rows) {
  RegionLookup lookup(regions_, session);
  absl::StatusOr<ActivationViews> views =
      ResolveActivations(lookup, req.q(), req.k(), req.v(), req.g(), req.beta(), req.o(), shape_);
  if (!views.ok()) return views.status();
  if (req.num_tokens() != 0 && req.num_tokens() != views->q.shape[0]) {
    return absl::InvalidArgumentError(absl::StrCat("num_tokens = ", req.num_tokens(),
                                                   " differs from q's first dimension ",
                                                   views->q.shape[0], " (or set it to 0)"));
  }
  absl::StatusOr<std::pair<IndexInput, IndexInput>> indices =
      ResolveRowIndices(lookup, req.query_start_loc(), req.state_indices(), num_rows);
  if (!indices.ok()) return indices.status();
  VerifyInputs in;
  in.q = ActivationOf(views->q);
  in.k = ActivationOf(views->k);
  in.v = ActivationOf(views->v);
  in.g = ActivationOf(views->g);
  in.beta = ActivationOf(views->beta);
  in.out = views->o.data;
  in.out_span = views->o.span;
  in.input_spans = InputSpans(*views, indices->first, indices->second);
  in.num_tokens = views->q.shape[0];
  in.query_start_loc = std::move(indices->first);
  in.state_indices = std::move(indices->second);
  in.pins = lookup.TakePins();
  return in;
}

absl::StatusOr<Engine::VerifyInputs> Engine::BoundInputsOf(const std::string& session,
                                                           const v1::VerifyRequest& req,
                                                           int num_rows) {
  const int layer = req.layer();
  if (req.has_q() || req.has_k() || req.has_v() || req.has_g() || req.has_beta() || req.has_o() ||
      req.has_query_start_loc() || req.has_state_indices()) {
    return absl::InvalidArgumentError(
        "bound_inputs: leave q, k, v, g, beta, o, query_start_loc and state_indices unset (the "
        "layer's binding gives them)");
  }
  std::shared_ptr<const BoundInputs> bound;
  {
    absl::ReaderMutexLock lock(&bound_mu_);
    bound = bound_[layer];
  }
  if (bound == nullptr || bound->session != session) {
    return absl::FailedPreconditionError(absl::StrCat(
        "bound_inputs: layer ", layer, " has no bound inputs in this session: call "
        "BindVerifyInputs first"));
  }
  if (req.num_tokens() < 0 || req.num_tokens() > bound->max_tokens) {
    return absl::OutOfRangeError(absl::StrCat("num_tokens = ", req.num_tokens(),
                                              " is out of range: layer ", layer,
                                              "'s bound inputs hold ", bound->max_tokens,
                                              " tokens"));
  }
  if (bound->max_rows >= 0 && num_rows > bound->max_rows) {
    return absl::OutOfRangeError(absl::StrCat(
        "num_rows = ", num_rows, " is out of range: layer ", layer,
        "'s bound query_start_loc and state_indices hold ", bound->max_rows, " rows"));
  }
  VerifyInputs in;
  in.pins.reserve(bound->regions.size() + 2);  // and the ordering's doorbells
  for (const BoundInputs::Held& held : bound->regions) {
    RegionPin pin = held.region.lock();
    if (pin == nullptr || !pin->registered()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "bound_inputs: layer ", layer, "'s bound inputs are in region \"", held.name,
          "\", which was unregistered after the bind: call BindVerifyInputs again"));
    }
    in.pins.push_back(std::move(pin));
  }
  in.q = bound->q;
  in.k = bound->k;
  in.v = bound->v;
  in.g = bound->g;
  in.beta = bound->beta;
  in.out = bound->out;
  in.out_span = bound->out_span;
  in.input_spans = bound->input_spans;
  in.num_tokens = req.num_tokens();
  if (bound->max_rows >= 0) {
    in.query_start_loc.present = true;
    in.query_start_loc.data = bound->query_start_loc;
    in.query_start_loc.rows = num_rows + 1;
    in.state_indices.present = true;
    in.state_indices.data = bound->state_indices;
    in.state_indices.rows = num_rows;
    in.state_indices.cols = bound->state_indices_cols;
    in.state_indices.row_stride = bound->state_indices_row_stride;
  }
  return in;
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
  for (auto [index, field] : {std::make_pair(&req.query_start_loc(), "query_start_loc"),
                              std::make_pair(&req.state_indices(), "state_indices")}) {
    if (index->has_values()) {
      reply(absl::InvalidArgumentError(absl::StrCat(
                field, ": a binding's index tensors must be in a region (inline values cannot "
                       "change between steps)")),
            {});
      return;
    }
  }
  RegionLookup lookup(regions_, session);
  absl::StatusOr<ActivationViews> views =
      ResolveActivations(lookup, req.q(), req.k(), req.v(), req.g(), req.beta(), req.o(), shape_);
  if (!views.ok()) {
    reply(views.status(), {});
    return;
  }
  absl::StatusOr<std::pair<IndexInput, IndexInput>> indices =
      ResolveRowIndices(lookup, req.query_start_loc(), req.state_indices(), -1);
  if (!indices.ok()) {
    reply(indices.status(), {});
    return;
  }
  const IndexInput& qsl = indices->first;
  NamedSpans input_spans = InputSpans(*views, qsl, indices->second);
  if (absl::Status alias = CheckNoAlias("o", views->o.span, input_spans); !alias.ok()) {
    reply(alias, {});
    return;
  }
  if (qsl.present && qsl.rows < 1) {
    reply(absl::InvalidArgumentError("query_start_loc: has 0 rows, expected max_rows + 1 >= 1"),
          {});
    return;
  }
  auto bound = std::make_shared<BoundInputs>();
  bound->session = session;
  bound->q = ActivationOf(views->q);
  bound->k = ActivationOf(views->k);
  bound->v = ActivationOf(views->v);
  bound->g = ActivationOf(views->g);
  bound->beta = ActivationOf(views->beta);
  bound->out = views->o.data;
  bound->out_span = views->o.span;
  bound->input_spans = std::move(input_spans);
  bound->max_tokens = views->q.shape[0];
  if (qsl.present) {
    bound->max_rows = static_cast<int>(std::min<int64_t>(qsl.rows - 1, layout_.max_rows()));
    bound->query_start_loc = qsl.data;
    bound->state_indices = indices->second.data;
    bound->state_indices_row_stride = indices->second.row_stride;
    bound->state_indices_cols = indices->second.cols;
  }
  for (const RegionPin& pin : lookup.TakePins()) {
    bound->regions.push_back(BoundInputs::Held{pin, pin->name()});
  }
  {
    absl::MutexLock lock(&bound_mu_);
    bound_[req.layer()] = bound;
  }
  v1::BindVerifyInputsResponse response;
  response.set_max_tokens(bound->max_tokens);
  response.set_max_rows(bound->max_rows);
  reply(absl::OkStatus(), response);
}

void Engine::Verify(const std::string& session, const v1::VerifyRequest& req,
                    Reply<v1::VerifyResponse> reply) {
  // SPECSTATE_PROFILE=1: where an ASYNC Verify's handling goes.
  static PhaseProfile profile("Verify (ASYNC)",
                              {"tensors", "ordering", "step+checks", "submit", "reply"});
  PhaseProfile::Timer timer(profile);
  const int L = layout_.num_layers();
  if (req.layer() < 0 || req.layer() >= L) {
    reply(absl::OutOfRangeError(absl::StrCat("layer ", req.layer(),
                                             " is out of range: the layout has ", L, " layers")),
          {});
    return;
  }
  if (req.num_rows() < 0 || req.num_rows() > layout_.max_rows()) {
    reply(absl::OutOfRangeError(absl::StrCat("num_rows = ", req.num_rows(),
                                             " is out of range: the records hold at most ",
                                             layout_.max_rows(), " rows (max_rows)")),
          {});
    return;
  }
  const int N = req.num_rows();
  absl::StatusOr<VerifyInputs> inputs_or =
      req.bound_inputs() ? BoundInputsOf(session, req, N) : RequestInputs(session, req, N);
  if (!inputs_or.ok()) {
    reply(inputs_or.status(), {});
    return;
  }
  VerifyInputs& in = *inputs_or;
  timer.Mark();
  absl::StatusOr<Ordering> ordering = ResolveOrdering(
      session, req.ordering(), req.wait(), req.signal(), req.has_wait(), req.has_signal());
  if (!ordering.ok()) {
    reply(ordering.status(), {});
    return;
  }
  {
    absl::Status alias = CheckNoAlias("o", in.out_span, in.input_spans);
    if (alias.ok()) alias = CheckNoAlias("o", in.out_span, ordering->doorbells);
    if (!alias.ok()) {
      reply(alias, {});
      return;
    }
  }
  timer.Mark();

  absl::ReleasableMutexLock lock(&mu_);
  absl::Status pending = TakeSessionError(session);
  if (!pending.ok()) {
    lock.Release();
    reply(pending, {});
    return;
  }
  LayerState& layer = layers_[req.layer()];
  if (!layer.params_loaded) {
    lock.Release();
    reply(absl::FailedPreconditionError(absl::StrCat(
              "layer ", req.layer(), " has no parameters yet: call LoadLayerParams first")),
          {});
    return;
  }
  // A new step starts only once this call has passed every check: a
  // rejected call changes nothing.
  std::unique_ptr<Step> fresh;
  absl::StatusOr<Step*> step_or = FindOrPrepareStep(session, req.step(), N, &fresh);
  if (!step_or.ok()) {
    lock.Release();
    reply(step_or.status(), {});
    return;
  }
  Step* step = *step_or;
  const bool first = fresh != nullptr;
  if (first && !in.query_start_loc.present) {
    lock.Release();
    reply(absl::InvalidArgumentError(absl::StrCat(
              "query_start_loc and state_indices are required on the first Verify of step ",
              req.step())),
          {});
    return;
  }
  StepSlot& slot = slots_[step->slot];
  const int layer_index = req.layer();

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
  args.num_rows = N;
  args.prerequisites = StepPrerequisites(slot, *step, L);
  args.status = slot.status_device + layer_index;
  args.status_mirror = slot.StatusMirror(layer_index);
  // The first Verify of a step snapshots its indices; later ones are checked
  // against that snapshot, and every kernel reads only it.
  if (first) {
    args.snapshot_query_start_loc = slot.query_start_loc;
    args.snapshot_state_indices = slot.state_indices;
  } else {
    args.expected_query_start_loc = slot.query_start_loc;
    args.expected_state_indices = slot.state_indices;
  }

  {
    // Everything the kernels check on the host, checked now so the caller
    // hears of it even in ASYNC mode (inline tensors get their real address
    // only when enqueued).
    kernels::VerifyArgs check = args;
    check.query_start_loc = kPlaceholder;
    check.state_indices = kernels::IndexMatrix{kPlaceholder, 1, 1};
    absl::Status valid = kernels::ValidateVerifyArgs(check);
    if (!valid.ok()) {
      lock.Release();
      reply(valid, {});
      return;
    }
  }

  Work work;
  work.waits = StepWaits(slot, *step, std::move(ordering->waits));
  work.signals = ordering->signals;
  if (first && N > 0) {
    work.readbacks.push_back(Readback{slot.query_start_loc, slot.qsl_host, uint64_t(N + 1) * 4});
  }
  auto inputs = std::make_shared<std::pair<IndexInput, IndexInput>>(
      std::move(in.query_start_loc), std::move(in.state_indices));
  work.launch = [this, args, inputs, &slot](kernels::Stream stream,
                                           Scratch& scratch) mutable -> absl::Status {
    if (inputs->first.present) {
      absl::StatusOr<const int32_t*> p = inputs->first.Pointer(scratch);
      if (!p.ok()) return p.status();
      args.query_start_loc = *p;
      absl::StatusOr<const int32_t*> i = inputs->second.Pointer(scratch);
      if (!i.ok()) return i.status();
      args.state_indices = kernels::IndexMatrix{*i, inputs->second.row_stride,
                                                static_cast<int>(inputs->second.cols)};
    } else {
      args.query_start_loc = slot.query_start_loc;
      args.state_indices = kernels::IndexMatrix{slot.state_indices, 1, 1};
    }
    return device_->kernels().Verify(args, stream);
  };
  const bool async = ordering->async;
  const uint64_t step_id = req.step();
  std::vector<RegionPin> all_pins = std::move(in.pins);
  all_pins.insert(all_pins.end(), ordering->pins.begin(), ordering->pins.end());
  auto pins = UniquePins(std::move(all_pins));
  // An ASYNC call is answered below, not when its work completes.
  work.done = [this, pins, reply = async ? Reply<v1::VerifyResponse>() : reply, async, step_id,
               session, layer_index, first, N, slot_index = step->slot](absl::Status launched) {
    absl::Status result = launched;
    if (absl::Status lost = LostRegions(*pins); !lost.ok()) result = lost;
    {
      absl::MutexLock lock(&mu_);
      StepSlot& s = slots_[slot_index];
      --s.in_flight;
      if (result.ok() && s.status_host[layer_index].failed != 0) {  // the message only then
        result = kernels::DeviceStatusToStatus(s.status_host[layer_index],
                                               absl::StrCat("Verify of layer ", layer_index));
      }
      if (!result.ok()) {
        MarkFailed(step_id, session, result, async);
      } else if (first && N > 0) {
        counters_.tokens_verified += uint64_t(s.qsl_host[N] - s.qsl_host[0]);
      }
    }
    pins->clear();  // the regions may go now
    if (!async) reply(result, {});
  };

  // Later calls of the step read its statuses as prerequisites: its first
  // call zeroes them, in a Work of its own ahead of the wait for the caller's
  // inputs, so that it runs while the caller's GPU work does.
  Work reset;
  if (first) {
    reset.launch = [this, &slot, L](kernels::Stream stream, Scratch&) {
      return device_->ZeroOnStream(slot.status_device, (L + 2) * sizeof(kernels::DeviceStatus),
                                   stream);
    };
    reset.done = [this, step_id, session, async, slot_index = step->slot](absl::Status launched) {
      absl::MutexLock lock(&mu_);
      --slots_[slot_index].in_flight;
      if (!launched.ok()) MarkFailed(step_id, session, launched, async);
    };
  }
  if (first) step = StartStep(std::move(fresh));
  step->verified[layer_index] = true;
  ++step->verified_count;
  layer.records_session = session;
  layer.records_step = step_id;
  layer.records_valid = true;
  timer.Mark();
  absl::Status st = first ? SubmitInSlot(slot, std::move(reset)) : absl::OkStatus();
  if (st.ok()) st = SubmitInSlot(slot, std::move(work));
  if (!st.ok()) {
    MarkFailed(step_id, session, st, false);
    lock.Release();
    reply(st, {});
    return;
  }
  lock.Release();
  timer.Mark();
  if (async) {
    v1::VerifyResponse response;
    response.set_enqueued(true);
    reply(absl::OkStatus(), response);
    timer.Mark();
  }
}

void Engine::Commit(const std::string& session, const v1::CommitRequest& req,
                    Reply<v1::CommitResponse> reply) {
  const int L = layout_.num_layers();
  const int max_rows = layout_.max_rows();
  const bool align = layout_.cache_mode() == v1::ALIGN;
  RegionLookup lookup(regions_, session);
  absl::StatusOr<IndexInput> accepted =
      ResolveIndex(lookup, req.num_accepted(), "num_accepted", {});
  if (accepted.ok()) {
    absl::Status st = Required(*accepted, "num_accepted");
    if (st.ok() && accepted->rows > max_rows) {
      st = absl::OutOfRangeError(absl::StrCat("num_accepted has ", accepted->rows,
                                              " rows; a batch has at most ", max_rows,
                                              " (max_rows)"));
    }
    if (!st.ok()) accepted = st;
  }
  if (!accepted.ok()) {
    reply(accepted.status(), {});
    return;
  }
  const int64_t batch = accepted->rows;
  if (align != req.has_block_table() || align != req.has_num_computed_tokens()) {
    reply(absl::InvalidArgumentError(
              align ? "cache_mode ALIGN: block_table and num_computed_tokens are required"
                    : "block_table and num_computed_tokens are for cache_mode ALIGN; this "
                      "service runs cache_mode NONE"),
          {});
    return;
  }
  absl::StatusOr<IndexInput> request_indices =
      ResolveIndex(lookup, req.request_indices(), "request_indices", {});
  if (!request_indices.ok()) {
    reply(request_indices.status(), {});
    return;
  }
  IndexSpec table_spec;
  table_spec.rows = batch;
  table_spec.allow_2d = true;
  absl::StatusOr<IndexInput> block_table =
      ResolveIndex(lookup, req.block_table(), "block_table", table_spec);
  absl::StatusOr<IndexInput> computed =
      block_table.ok() ? ResolveIndex(lookup, req.num_computed_tokens(),
                                      "num_computed_tokens", {batch})
                       : block_table;
  if (!computed.ok()) {
    reply(computed.status(), {});
    return;
  }
  if (align != block_table->present || align != computed->present) {
    reply(absl::InvalidArgumentError(
              align ? "cache_mode ALIGN: block_table and num_computed_tokens are required"
                    : "block_table and num_computed_tokens are for cache_mode ALIGN; this "
                      "service runs cache_mode NONE"),
          {});
    return;
  }
  if (align && block_table->rows > 0 && block_table->cols < 1) {
    reply(absl::InvalidArgumentError("block_table has no columns"), {});
    return;
  }
  absl::StatusOr<Ordering> ordering = ResolveOrdering(
      session, req.ordering(), req.wait(), req.signal(), req.has_wait(), req.has_signal());
  if (!ordering.ok()) {
    reply(ordering.status(), {});
    return;
  }
  const uint64_t fingerprint = Fingerprint(req);

  absl::ReleasableMutexLock lock(&mu_);
  Step* step = FindStep(session, req.step());
  if (step != nullptr && step->commit.started) {
    v1::CommitResponse cached;
    cached.set_num_rows(step->num_rows);
    cached.set_num_layers(L);
    AnswerRetry(step->commit, fingerprint, ordering->async,
                absl::StrCat("step ", req.step(), " was already committed"), std::move(cached),
                lock, reply);
    return;
  }
  absl::Status pending = TakeSessionError(session);
  if (!pending.ok()) {
    lock.Release();
    reply(pending, {});
    return;
  }
  if (step == nullptr) {
    lock.Release();
    reply(absl::FailedPreconditionError(absl::StrCat(
              "step ", req.step(), " was not verified (or ended long ago): Verify every layer "
              "before Commit")),
          {});
    return;
  }
  if (step->failed) {
    lock.Release();
    reply(absl::FailedPreconditionError(
              absl::StrCat("step ", req.step(), " failed: ", step->failure.message())),
          {});
    return;
  }
  std::vector<int> unverified, overwritten;
  for (int l = 0; l < L; ++l) {
    if (!step->verified[l]) {
      unverified.push_back(l);
    } else if (!layers_[l].records_valid || layers_[l].records_step != req.step() ||
               layers_[l].records_session != session) {
      overwritten.push_back(l);
    }
  }
  if (!unverified.empty()) {
    lock.Release();
    reply(absl::FailedPreconditionError(absl::StrCat(
              "step ", req.step(), " cannot be committed: layers ", LayerList(unverified),
              " were not verified in it")),
          {});
    return;
  }
  if (!overwritten.empty()) {
    lock.Release();
    reply(absl::FailedPreconditionError(absl::StrCat(
              "step ", req.step(), " cannot be committed: a later Verify overwrote the records "
              "of layers ", LayerList(overwritten))),
          {});
    return;
  }
  if (!request_indices->present && batch < step->num_rows) {
    lock.Release();
    reply(absl::OutOfRangeError(absl::StrCat("num_accepted has ", batch,
                                             " rows but the step has ", step->num_rows,
                                             " rows and no request_indices")),
          {});
    return;
  }
  if (request_indices->present && request_indices->rows != step->num_rows) {
    lock.Release();
    reply(absl::InvalidArgumentError(absl::StrCat("request_indices has ", request_indices->rows,
                                                  " rows, the step has ", step->num_rows)),
          {});
    return;
  }
  StepSlot& slot = slots_[step->slot];
  const int N = step->num_rows;
  kernels::CommitArgs args;
  args.shape = shape_;
  args.spec_query_len = sizes_.spec_query_len;
  args.num_layers = L;
  args.layers = host_layer_table_.data();
  args.device_layers = device_layer_table_;
  args.num_rows = N;
  args.query_start_loc = slot.query_start_loc;
  args.state_indices = kernels::IndexMatrix{slot.state_indices, 1, 1};
  args.batch = static_cast<int>(batch);
  args.mamba_block_size = align ? layout_.mamba_block_size() : 0;
  args.workspace = commit_workspace_;
  args.workspace_bytes = commit_workspace_bytes_;
  args.prerequisites = StepPrerequisites(slot, *step, L);
  args.status = slot.status_device + L;
  args.status_mirror = slot.StatusMirror(L);
  {
    kernels::CommitArgs check = args;
    check.num_accepted = kPlaceholder;
    if (request_indices->present) check.request_indices = kPlaceholder;
    if (align) {
      check.block_table = kernels::IndexMatrix{kPlaceholder, block_table->row_stride,
                                               static_cast<int>(block_table->cols)};
      check.num_computed_tokens = kPlaceholder;
    }
    absl::Status valid = kernels::ValidateCommitArgs(check);
    if (!valid.ok()) {
      lock.Release();
      reply(valid, {});
      return;
    }
  }

  Work work;
  work.waits = StepWaits(slot, *step, ordering->waits);
  work.signals = ordering->signals;
  if (N > 0) {
    work.readbacks.push_back(Readback{kernels::CommitPlanOf(commit_workspace_, layout_.num_blocks()),
                                      slot.plan_host, N * sizeof(kernels::CommitPlanRow)});
  }
  struct Inputs {
    IndexInput accepted, request_indices, block_table, computed;
  };
  auto inputs = std::make_shared<Inputs>(Inputs{*std::move(accepted), *std::move(request_indices),
                                                *std::move(block_table), *std::move(computed)});
  work.launch = [this, args, inputs](kernels::Stream stream, Scratch& scratch) mutable -> absl::Status {
    absl::StatusOr<const int32_t*> p = inputs->accepted.Pointer(scratch);
    if (!p.ok()) return p.status();
    args.num_accepted = *p;
    if (inputs->request_indices.present) {
      p = inputs->request_indices.Pointer(scratch);
      if (!p.ok()) return p.status();
      args.request_indices = *p;
    }
    if (inputs->block_table.present) {
      p = inputs->block_table.Pointer(scratch);
      if (!p.ok()) return p.status();
      args.block_table = kernels::IndexMatrix{*p, inputs->block_table.row_stride,
                                              static_cast<int>(inputs->block_table.cols)};
      p = inputs->computed.Pointer(scratch);
      if (!p.ok()) return p.status();
      args.num_computed_tokens = *p;
    }
    return device_->kernels().Commit(args, stream);
  };
  const bool async = ordering->async;
  const uint64_t step_id = req.step();
  std::vector<RegionPin> all_pins = lookup.TakePins();
  all_pins.insert(all_pins.end(), ordering->pins.begin(), ordering->pins.end());
  auto pins = UniquePins(std::move(all_pins));
  v1::CommitResponse response;
  response.set_enqueued(async);
  response.set_num_rows(N);
  response.set_num_layers(L);
  work.done = [this, pins, reply, async, step_id, session, N, L, response,
               slot_index = step->slot](absl::Status launched) {
    absl::Status result = launched;
    if (absl::Status lost = LostRegions(*pins); !lost.ok()) result = lost;
    std::vector<std::function<void(absl::Status)>> waiters;
    {
      absl::MutexLock lock(&mu_);
      StepSlot& s = slots_[slot_index];
      --s.in_flight;
      if (result.ok()) result = kernels::DeviceStatusToStatus(s.status_host[L], "Commit");
      if (!result.ok()) {
        MarkFailed(step_id, session, result, async);
      } else {
        ++counters_.steps_committed;
        for (int i = 0; i < N; ++i) {
          const kernels::CommitPlanRow& p = s.plan_host[i];
          if (p.source > 0 && p.commit_len > 0 && p.final_block > 0) {
            ++counters_.rows_committed;
            counters_.tokens_committed += p.commit_len;
          }
        }
      }
      if (Step* st = FindStep(session, step_id)) {
        st->commit.finished = true;
        st->commit.status = result;
        waiters.swap(st->commit.waiters);
      }
    }
    pins->clear();
    if (!async) reply(result, response);
    for (auto& w : waiters) w(result);
  };
  step->commit.started = true;
  step->commit.fingerprint = fingerprint;
  absl::Status st = SubmitInSlot(slot, std::move(work));
  if (!st.ok()) {
    step->commit.started = false;
    lock.Release();
    reply(st, {});
    return;
  }
  lock.Release();
  if (async) reply(absl::OkStatus(), response);
}

void Engine::RecordStateBlocks(const std::string& session,
                               const v1::RecordStateBlocksRequest& req,
                               Reply<v1::RecordStateBlocksResponse> reply) {
  const int L = layout_.num_layers();
  const int max_rows = layout_.max_rows();
  if (layout_.cache_mode() != v1::ALIGN) {
    reply(absl::FailedPreconditionError(
              "RecordStateBlocks is for cache_mode ALIGN; this service runs cache_mode NONE"),
          {});
    return;
  }
  RegionLookup lookup(regions_, session);
  absl::StatusOr<IndexInput> mapping =
      ResolveIndex(lookup, req.idx_mapping(), "idx_mapping", {});
  if (mapping.ok()) {
    absl::Status st = Required(*mapping, "idx_mapping");
    if (st.ok() && mapping->rows > max_rows) {
      st = absl::OutOfRangeError(absl::StrCat("idx_mapping has ", mapping->rows,
                                              " rows; a batch has at most ", max_rows));
    }
    if (!st.ok()) mapping = st;
  }
  if (!mapping.ok()) {
    reply(mapping.status(), {});
    return;
  }
  const int64_t batch = mapping->rows;
  absl::StatusOr<IndexInput> sampled =
      ResolveIndex(lookup, req.num_sampled(), "num_sampled", {batch});
  absl::StatusOr<IndexInput> computed =
      sampled.ok() ? ResolveIndex(lookup, req.num_computed_tokens(),
                                  "num_computed_tokens", {batch})
                   : sampled;
  absl::StatusOr<IndexInput> request_indices =
      computed.ok() ? ResolveIndex(lookup, req.request_indices(), "request_indices", {})
                    : computed;
  if (!request_indices.ok()) {
    reply(request_indices.status(), {});
    return;
  }
  absl::Status st = Required(*sampled, "num_sampled");
  if (st.ok()) st = Required(*computed, "num_computed_tokens");
  if (st.ok() && req.block_table_width() < 1) {
    st = absl::InvalidArgumentError(
        absl::StrCat("block_table_width = ", req.block_table_width(), " must be >= 1"));
  }
  TensorSpec out_spec;
  out_spec.dtype = DType::kInt32;
  out_spec.shape = {-1};
  out_spec.dense_inner = 1;
  absl::StatusOr<TensorView> state_idx =
      st.ok() ? lookup.ResolveTensor(req.state_idx(), "state_idx", out_spec)
              : absl::StatusOr<TensorView>(st);
  if (state_idx.ok() && state_idx->shape[0] > max_rows) {
    state_idx = absl::OutOfRangeError(absl::StrCat("state_idx has ", state_idx->shape[0],
                                                   " rows; at most ", max_rows, " requests"));
  }
  if (state_idx.ok()) out_spec.shape[0] = state_idx->shape[0];
  absl::StatusOr<TensorView> out_accepted =
      state_idx.ok()
          ? lookup.ResolveTensor(req.num_accepted(), "num_accepted", out_spec)
          : state_idx;
  if (!out_accepted.ok()) {
    reply(out_accepted.status(), {});
    return;
  }
  absl::StatusOr<Ordering> ordering = ResolveOrdering(
      session, req.ordering(), req.wait(), req.signal(), req.has_wait(), req.has_signal());
  if (!ordering.ok()) {
    reply(ordering.status(), {});
    return;
  }
  {
    NamedSpans others = ordering->doorbells;
    for (const auto& [field, input] :
         {std::make_pair("idx_mapping", &*mapping), std::make_pair("num_sampled", &*sampled),
          std::make_pair("num_computed_tokens", &*computed),
          std::make_pair("request_indices", &*request_indices)}) {
      if (input->data != nullptr) others.emplace_back(field, input->span);
    }
    absl::Status alias = CheckNoAlias("state_idx", state_idx->span, others);
    others.emplace_back("state_idx", state_idx->span);
    if (alias.ok()) alias = CheckNoAlias("num_accepted", out_accepted->span, others);
    if (!alias.ok()) {
      reply(alias, {});
      return;
    }
  }
  const uint64_t fingerprint = Fingerprint(req);

  absl::ReleasableMutexLock lock(&mu_);
  Step* step = FindStep(session, req.step());
  if (step != nullptr && step->record.started) {
    AnswerRetry(step->record, fingerprint, ordering->async,
                absl::StrCat("step ", req.step(), " already recorded its state blocks"),
                v1::RecordStateBlocksResponse(), lock, reply);
    return;
  }
  absl::Status pending = TakeSessionError(session);
  if (!pending.ok()) {
    lock.Release();
    reply(pending, {});
    return;
  }
  if (step == nullptr || !step->commit.started) {
    lock.Release();
    reply(absl::FailedPreconditionError(
              absl::StrCat("step ", req.step(), " was not committed: Commit before RecordStateBlocks")),
          {});
    return;
  }
  if (step->failed) {
    lock.Release();
    reply(absl::FailedPreconditionError(
              absl::StrCat("step ", req.step(), " failed: ", step->failure.message())),
          {});
    return;
  }
  if (request_indices->present && request_indices->rows != step->num_rows) {
    lock.Release();
    reply(absl::InvalidArgumentError(absl::StrCat("request_indices has ", request_indices->rows,
                                                  " rows, the step has ", step->num_rows)),
          {});
    return;
  }
  if (!request_indices->present && batch < step->num_rows) {
    lock.Release();
    reply(absl::OutOfRangeError(absl::StrCat("idx_mapping has ", batch, " rows but the step has ",
                                             step->num_rows, " rows and no request_indices")),
          {});
    return;
  }
  StepSlot& slot = slots_[step->slot];
  kernels::RecordStateBlocksArgs args;
  args.num_rows = step->num_rows;
  args.batch = static_cast<int>(batch);
  args.mamba_block_size = layout_.mamba_block_size();
  args.block_table_width = req.block_table_width();
  args.num_requests = static_cast<int>(state_idx->shape[0]);
  args.state_idx = static_cast<int32_t*>(state_idx->data);
  args.num_accepted = static_cast<int32_t*>(out_accepted->data);
  args.workspace = record_workspace_;
  args.workspace_bytes = record_workspace_bytes_;
  args.prerequisites = StepPrerequisites(slot, *step, L + 1);
  args.status = slot.status_device + L + 1;
  args.status_mirror = slot.StatusMirror(L + 1);
  {
    kernels::RecordStateBlocksArgs check = args;
    check.idx_mapping = check.num_sampled = check.num_computed_tokens = kPlaceholder;
    if (request_indices->present) check.request_indices = kPlaceholder;
    absl::Status valid = kernels::ValidateRecordStateBlocksArgs(check);
    if (!valid.ok()) {
      lock.Release();
      reply(valid, {});
      return;
    }
  }

  Work work;
  work.waits = StepWaits(slot, *step, ordering->waits);
  work.signals = ordering->signals;
  struct Inputs {
    IndexInput mapping, sampled, computed, request_indices;
  };
  auto inputs = std::make_shared<Inputs>(Inputs{*std::move(mapping), *std::move(sampled),
                                                *std::move(computed), *std::move(request_indices)});
  work.launch = [this, args, inputs](kernels::Stream stream, Scratch& scratch) mutable -> absl::Status {
    absl::StatusOr<const int32_t*> p = inputs->mapping.Pointer(scratch);
    if (!p.ok()) return p.status();
    args.idx_mapping = *p;
    p = inputs->sampled.Pointer(scratch);
    if (!p.ok()) return p.status();
    args.num_sampled = *p;
    p = inputs->computed.Pointer(scratch);
    if (!p.ok()) return p.status();
    args.num_computed_tokens = *p;
    if (inputs->request_indices.present) {
      p = inputs->request_indices.Pointer(scratch);
      if (!p.ok()) return p.status();
      args.request_indices = *p;
    }
    return device_->kernels().RecordStateBlocks(args, stream);
  };
  const bool async = ordering->async;
  const uint64_t step_id = req.step();
  std::vector<RegionPin> all_pins = lookup.TakePins();
  all_pins.insert(all_pins.end(), ordering->pins.begin(), ordering->pins.end());
  auto pins = UniquePins(std::move(all_pins));
  v1::RecordStateBlocksResponse response;
  response.set_enqueued(async);
  work.done = [this, pins, reply, async, step_id, session, L, response,
               slot_index = step->slot](absl::Status launched) {
    absl::Status result = launched;
    if (absl::Status lost = LostRegions(*pins); !lost.ok()) result = lost;
    std::vector<std::function<void(absl::Status)>> waiters;
    {
      absl::MutexLock lock(&mu_);
      StepSlot& s = slots_[slot_index];
      --s.in_flight;
      if (result.ok()) {
        result = kernels::DeviceStatusToStatus(s.status_host[L + 1], "RecordStateBlocks");
      }
      if (!result.ok()) MarkFailed(step_id, session, result, async);
      if (Step* st = FindStep(session, step_id)) {
        st->record.finished = true;
        st->record.status = result;
        waiters.swap(st->record.waiters);
      }
    }
    pins->clear();
    if (!async) reply(result, response);
    for (auto& w : waiters) w(result);
  };
  step->record.started = true;
  step->record.fingerprint = fingerprint;
  st = SubmitInSlot(slot, std::move(work));
  if (!st.ok()) {
    step->record.started = false;
    lock.Release();
    reply(st, {});
    return;
  }
  lock.Release();
  if (async) reply(absl::OkStatus(), response);
}

void Engine::SubmitStep(const std::string& session, const v1::SubmitStepRequest& request,
                        Reply<v1::SubmitStepResponse> reply) {
  const int64_t limit = MaxSubmitStepVerifies();
  if (request.verifies_size() > limit) {
    reply(absl::InvalidArgumentError(absl::StrCat(
              "SubmitStep carries ", request.verifies_size(), " Verify calls; at most ", limit,
              " (4 * num_layers) are allowed in one")),
          {});
    return;
  }
  // Each call starts when the one before it has answered (at once in ASYNC
  // mode, later from a device thread in SYNC mode), so they are enqueued in
  // the order given. A loop, not recursion: a call answered at once hands
  // the next one back to the loop instead of starting it from its reply.
  struct Chain {
    Chain(Engine* e, std::string s, const v1::SubmitStepRequest& r,
          Reply<v1::SubmitStepResponse> done)
        : engine(e), session(std::move(s)), request(r), reply(std::move(done)) {}
    Engine* const engine;
    const std::string session;
    const v1::SubmitStepRequest& request;  // owned by the RPC until it is answered
    const Reply<v1::SubmitStepResponse> reply;
    v1::SubmitStepResponse response;
    absl::Mutex mu;
    bool calling = false;           // Run() is inside a Verify call
    bool answered_inline = false;   // ... and that call has answered OK

    static void Run(const std::shared_ptr<Chain>& c, int i) {
      for (; i < c->request.verifies_size(); ++i) {
        {
          absl::MutexLock lock(&c->mu);
          c->calling = true;
          c->answered_inline = false;
        }
        // The engine takes the session from the batch, not from each call.
        c->engine->Verify(c->session, c->request.verifies(i),
                          [c, i](absl::Status s, v1::VerifyResponse r) {
          if (!s.ok()) {
            c->reply(absl::Status(s.code(), absl::StrCat("verifies[", i, "]: ", s.message())), {});
            return;
          }
          bool continue_here = false;
          {
            absl::MutexLock lock(&c->mu);
            *c->response.add_verifies() = std::move(r);
            if (c->calling) {
              c->answered_inline = true;
            } else {
              continue_here = true;
            }
          }
          if (continue_here) Run(c, i + 1);
        });
        absl::MutexLock lock(&c->mu);
        c->calling = false;
        if (!c->answered_inline) return;  // failed, or answers later and goes on from there
      }
      if (!c->request.has_commit()) {
        c->reply(absl::OkStatus(), std::move(c->response));
        return;
      }
      c->engine->Commit(c->session, c->request.commit(), [c](absl::Status s, v1::CommitResponse r) {
        if (!s.ok()) {
          c->reply(absl::Status(s.code(), absl::StrCat("commit: ", s.message())), {});
          return;
        }
        *c->response.mutable_commit() = std::move(r);
        c->reply(absl::OkStatus(), std::move(c->response));
      });
    }
  };
  auto chain = std::make_shared<Chain>(this, session, request, std::move(reply));
  Chain::Run(chain, 0);
}

void Engine::OpenSession(const std::string& session) {
  {
    absl::MutexLock lock(&mu_);
    open_sessions_.insert(session);
  }
  regions_.OpenSession(session);
}

void Engine::EndSession(const std::string& session) {
  std::shared_ptr<WaitCancellation> cancellation;
  {
    absl::MutexLock lock(&mu_);
    open_sessions_.erase(session);
    session_errors_.erase(session);
    auto it = session_waits_.find(session);
    if (it != session_waits_.end()) {
      cancellation = it->second;
      session_waits_.erase(it);
    }
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

EngineCounters Engine::counters() const {
  absl::MutexLock lock(&mu_);
  return counters_;
}

}  // namespace server
}  // namespace specstate
