#include "client/simulator/simulator.h"

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/strings/str_format.h"
#include "client/restart_drill.h"
#include "kernels/kda_kernels.h"
#include "kernels/numeric.h"
#include "server/fnv1a.h"

namespace specstate {
namespace client {
namespace {

using Clock = std::chrono::steady_clock;

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

// Per-RPC latencies, for the report.
class Latencies {
 public:
  void Add(const std::string& rpc, Clock::duration d) {
    samples_[rpc].push_back(std::chrono::duration<double, std::micro>(d).count());
  }
  void Add(const Latencies& other) {
    for (const auto& [rpc, v] : other.samples_) {
      samples_[rpc].insert(samples_[rpc].end(), v.begin(), v.end());
    }
  }
  std::map<std::string, LatencySummary> Summaries() const {
    std::map<std::string, LatencySummary> out;
    for (auto [rpc, v] : samples_) {
      std::sort(v.begin(), v.end());
      LatencySummary s;
      s.count = v.size();
      s.p50_us = v[v.size() / 2];
      s.p99_us = v[std::min(v.size() - 1, static_cast<size_t>(v.size() * 0.99))];
      double sum = 0;
      for (double x : v) sum += x;
      s.mean_us = sum / v.size();
      out[rpc] = s;
    }
    return out;
  }

 private:
  std::map<std::string, std::vector<double>> samples_;
};

// Host bytes of `count` elements of `dtype`, uniform in [lo, hi).
template <typename Rng>
void FillRandom(std::vector<char>* out, int64_t count, DType dtype, float lo, float hi, Rng& rng) {
  std::uniform_real_distribution<float> dist(lo, hi);
  out->resize(count * DTypeSize(dtype));
  for (int64_t i = 0; i < count; ++i) {
    const float x = dist(rng);
    switch (dtype) {
      case DType::kFloat32:
        std::memcpy(out->data() + 4 * i, &x, 4);
        break;
      case DType::kFloat16: {
        const Float16 h = FromFloat<Float16>(x);
        std::memcpy(out->data() + 2 * i, &h.bits, 2);
        break;
      }
      case DType::kBFloat16: {
        const BFloat16 b = FromFloat<BFloat16>(x);
        std::memcpy(out->data() + 2 * i, &b.bits, 2);
        break;
      }
      case DType::kInt32:
        break;
    }
  }
}

// Copies `width` elements of `rows` rows: row t's elements [from, from +
// width) of `src` (rows of `src_stride` elements) to elements [to, to +
// width) of row t of `dst` (rows of `dst_stride`). Tensor parallelism: a
// rank's columns (heads, channels) of the model's tensor.
void CopyColumns(const std::vector<char>& src, int64_t src_stride, int64_t from,
                 std::vector<char>* dst, int64_t dst_stride, int64_t to, int64_t rows,
                 int64_t width, int64_t element_bytes) {
  for (int64_t t = 0; t < rows; ++t) {
    std::memcpy(dst->data() + (t * dst_stride + to) * element_bytes,
                src.data() + (t * src_stride + from) * element_bytes, width * element_bytes);
  }
}

float ElementAsFloat(const char* p, DType dtype) {
  switch (dtype) {
    case DType::kFloat32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kFloat16: {
      Float16 h;
      std::memcpy(&h.bits, p, 2);
      return ToFloat(h);
    }
    case DType::kBFloat16: {
      BFloat16 b;
      std::memcpy(&b.bits, p, 2);
      return ToFloat(b);
    }
    case DType::kInt32:
      break;
  }
  return 0;
}

struct Request {
  bool live = false;
  bool pinned = false;         // never finishes (carries a planted corruption)
  int64_t num_computed = 0;    // tokens before the step
  int acc_prev = 1;            // the stock state is in column acc_prev - 1
  std::vector<int32_t> table;  // block per column (none mode: one column)
  // Per layer: the conv window the next step reads, [D][hl] activation bytes.
  std::vector<std::vector<char>> window;
};

// Offsets (int32 elements) of a step's tensors in the shared metadata buffer.
struct MetaOffsets {
  int qsl = 0, idx = 0, req = 0;  // query_start_loc, state_indices, request_indices
  int acc = 0, nc = 0;            // num_accepted, num_computed_tokens (per batch row)
  int map = 0, sampled = 0;       // RecordStateBlocks' idx_mapping, num_sampled
  int out_idx = 0, out_acc = 0;   // RecordStateBlocks' outputs
  int table = 0;                  // block table [batch][width]
  int door = 0;                   // the doorbells (4), after everything else
};

// What one step drew and built, handed from each of its phases to the next.
struct StepPlan {
  int step = 0;  // the simulation's step number
  uint64_t step_id = 0;  // the session's
  std::vector<int> tokens, accepted;  // per row
  std::vector<int32_t> qsl;           // [R + 1]
  std::vector<int32_t> checkpoint;    // per row: the block its state is read from
  int64_t num_tokens = 0;             // T
  bool remap = false;                 // a prefill row leads the batch
  int batch = 0;                      // batch rows (R, or R + 1 with remap)
  MetaOffsets at;
  std::vector<int32_t> meta;  // the metadata buffer's contents, host side
  std::vector<v1::VerifyRequest> verifies;  // per layer
  // [row][layer]: the conv columns after the update, [D][hl - 1 + tokens].
  std::vector<std::vector<std::vector<char>>> updated;
};

// The simulator of one service: the whole model's, or under tensor
// parallelism rank `rank`'s part of it (of `ranks`). Every rank's simulator
// draws the whole model's values from the same seed in the same order (so
// all ranks run the same steps), keeps its part for its service and its
// stock path, and with more than one rank also runs the stock kernel over the
// whole model (the TP=1 run) to compare its service's heads with.
class Simulator {
 public:
  Simulator(Client& client, const SimulationOptions& options, int rank = 0, int ranks = 1)
      : client_(client), options_(options), rng_(options.seed), rank_(rank), tp_(ranks) {}

  const Latencies& latencies() const { return latencies_; }
  const v1::Layout& layout() const { return layout_; }

  absl::StatusOr<SimulationReport> Run() {
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
    if (deferred_) {  // what is still pending, materialized and checked
      st = FlushAndCheck({}, options_.steps, "the final Flush");
      if (!st.ok()) return st;
    }
    report_.latency = latencies_.Summaries();
    if (options_.drill != nullptr) report_.restart_summary = options_.drill->Summary();
    st = session_->Close();
    if (!st.ok()) return st;
    return report_;
  }

 private:
  // ---- set-up ----

  // The layout, the pools, the session, the shared buffers, the stock path's
  // memory and the layer parameters, in this order (the parameters are the
  // set-up's only random draws).
  absl::Status Setup() {
    absl::Status st = ReadLayout();
    if (st.ok()) st = OpenMemoryAndPools();
    if (!st.ok()) return st;
    absl::StatusOr<std::unique_ptr<Session>> session =
        client_.OpenSession("specstatectl simulate", /*drive=*/true);
    if (!session.ok()) return session.status();
    session_ = *std::move(session);
    st = AllocateSharedBuffers();
    if (st.ok()) st = AllocateStockMemory();
    if (st.ok()) st = LoadLayerParams();
    if (st.ok() && options_.bound_inputs) st = BindInputs();
    if (!st.ok()) return st;
    if (options_.async && options_.events) {
      absl::StatusOr<std::unique_ptr<IpcEvent>> e = memory_->CreateIpcEvent();
      if (!e.ok()) return e.status();
      inputs_ready_ = *std::move(e);
      e = memory_->CreateIpcEvent();
      if (!e.ok()) return e.status();
      work_done_ = *std::move(e);
    }
    requests_.resize(R_);
    pending_.resize(R_);
    return absl::OkStatus();
  }

  // The service's layout, the sizes derived from it, and the blocks the
  // simulation may take.
  absl::Status ReadLayout() {
    absl::StatusOr<v1::Layout> layout = client_.GetLayout();
    if (!layout.ok()) return layout.status();
    layout_ = *layout;
    L_ = layout_.num_layers();
    H_ = layout_.num_heads();
    K_ = layout_.head_dim();
    Q_ = layout_.num_spec() + 1;
    D_ = layout_.conv_dim();
    W_ = layout_.conv_width();
    hl_ = layout_.conv_kernel() - 1;
    B_ = layout_.num_blocks();
    align_ = layout_.cache_mode() == v1::ALIGN;
    deferred_ = layout_.commit_mode() == v1::DEFERRED;
    report_.deferred = deferred_;
    const std::string mode = deferred_ ? "deferred" : "eager";
    if (!options_.commit_mode.empty() && options_.commit_mode != mode) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the service runs commit mode ", v1::CommitMode_Name(layout_.commit_mode()),
          ", not ", options_.commit_mode, " (specstated --commit_mode=", options_.commit_mode, ")"));
    }
    deferred_rng_.seed(options_.seed ^ 0x5eed);
    bs_ = layout_.mamba_block_size();
    R_ = options_.requests;
    act_ = layout_.activation_dtype() == v1::FP32   ? DType::kFloat32
           : layout_.activation_dtype() == v1::FP16 ? DType::kFloat16
                                                    : DType::kBFloat16;
    state_ = layout_.state_dtype() == v1::BF16 ? DType::kBFloat16 : DType::kFloat32;
    as_ = DTypeSize(act_);
    ss_ = DTypeSize(state_);
    HK_ = int64_t{H_} * K_;
    gdn_ = layout_.layer_kind() == v1::GDN;
    HV_ = layout_.num_value_heads() > 0 ? layout_.num_value_heads() : H_;
    VW_ = int64_t{HV_} * K_;
    GW_ = gdn_ ? HV_ : HK_;
    state_block_bytes_ = VW_ * K_ * ss_;
    // The whole model (this part itself when there is one rank).
    FH_ = H_ * tp_;
    FHV_ = HV_ * tp_;
    FD_ = D_ * tp_;
    FHK_ = int64_t{FH_} * K_;
    FVW_ = int64_t{FHV_} * K_;
    FGW_ = gdn_ ? FHV_ : FHK_;
    report_.backend = layout_.backend() == v1::CUDA ? "cuda" : "cpu";
    report_.layers = L_;
    if (R_ < 1 || R_ > layout_.max_rows()) {
      return absl::InvalidArgumentError(absl::StrCat("requests = ", R_, " must be in [1, ",
                                                     layout_.max_rows(), "] (the service's max_rows)"));
    }
    // Blocks: none mode one per request; align mode one per mamba block of
    // tokens the request reaches.
    width_ = align_ ? 3 + (2 * bs_ + options_.steps * Q_) / bs_ : 1;
    const int64_t needed = align_ ? int64_t{R_} * width_ : R_;
    if (needed > B_ - 1) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the simulation may need ", needed, " blocks but the service has ", B_ - 1,
          ": start specstated with more --blocks, or simulate fewer --requests or --steps"));
    }
    for (int b = B_ - 1; b >= 1; --b) free_blocks_.push_back(b);
    return absl::OkStatus();
  }

  // The stock kernels and shared memory of the service's backend, and the
  // service's pools mapped through their exported handle.
  absl::Status OpenMemoryAndPools() {
    if (layout_.backend() == v1::CUDA) {
      absl::StatusOr<const kernels::KdaKernels*> k = kernels::CudaKdaKernels();
      if (!k.ok()) return k.status();
      stock_ = *k;
    } else {
      stock_ = &kernels::CpuKdaKernels();
    }
    absl::StatusOr<std::unique_ptr<SharedMemory>> memory =
        SharedMemory::Create(layout_.backend(), layout_.device());
    if (!memory.ok()) return memory.status();
    memory_ = *std::move(memory);
    absl::StatusOr<v1::ExportPoolsResponse> exported = client_.ExportPools();
    if (!exported.ok()) return exported.status();
    absl::StatusOr<std::unique_ptr<MappedPools>> pools = memory_->MapPools(*exported);
    if (!pools.ok()) return pools.status();
    pools_ = *std::move(pools);
    for (const v1::PoolView& p : exported->pools()) {
      if (p.kind() == "conv") {
        conv_block_stride_ = p.strides(0);
        conv_dim_stride_ = p.strides(1);
        conv_token_stride_ = p.strides(2);
      }
    }
    return absl::OkStatus();
  }

  // Shared buffers, registered with the session: per layer proj = [q | k | v
  // | beta] per token (so q, k, v and beta are column slices with a token
  // stride larger than a token), g and o; and one int32 buffer for the step's
  // metadata and doorbells.
  absl::Status AllocateSharedBuffers() {
    tmax_ = int64_t{R_} * Q_;
    proj_stride_ = 2 * HK_ + VW_ + HV_;
    full_proj_stride_ = 2 * FHK_ + FVW_ + FHV_;
    for (int l = 0; l < L_; ++l) {
      for (auto* list : {&proj_, &g_, &o_}) {
        const int64_t per_token = list == &proj_ ? proj_stride_ : list == &g_ ? GW_ : VW_;
        absl::StatusOr<std::unique_ptr<SharedBuffer>> buf =
            memory_->Allocate(tmax_ * per_token * as_);
        if (!buf.ok()) return buf.status();
        absl::StatusOr<std::string> name = session_->RegisterBuffer(**buf);
        if (!name.ok()) return name.status();
        list->push_back(*std::move(buf));
      }
    }
    batch_max_ = R_ + 1;
    meta_ints_ = 4 * (R_ + 1) + 6 * batch_max_ + batch_max_ * width_ + 8;
    absl::StatusOr<std::unique_ptr<SharedBuffer>> meta = memory_->Allocate(meta_ints_ * 4);
    if (!meta.ok()) return meta.status();
    meta_ = *std::move(meta);
    absl::StatusOr<std::string> name = session_->RegisterBuffer(*meta_, "meta");
    return name.status();
  }

  // The stock path's own memory: Q blocks per request slot and layer, its
  // outputs, and its metadata, workspace and status.
  absl::Status AllocateStockMemory() {
    stock_blocks_ = 1 + int64_t{R_} * Q_;
    for (int l = 0; l < L_; ++l) {
      for (auto* list : {&stock_pool_, &stock_out_}) {
        const uint64_t bytes = list == &stock_pool_ ? stock_blocks_ * state_block_bytes_
                                                    : tmax_ * VW_ * as_;
        absl::StatusOr<std::unique_ptr<SharedBuffer>> buf = memory_->Allocate(bytes);
        if (!buf.ok()) return buf.status();
        list->push_back(*std::move(buf));
      }
    }
    const uint64_t stock_meta_bytes =
        4 * (int64_t{R_} * Q_ + R_ + R_ + 1) + kernels::StockWorkspaceBytes(stock_blocks_) +
        sizeof(kernels::DeviceStatus) + 256;
    absl::StatusOr<std::unique_ptr<SharedBuffer>> sm = memory_->Allocate(stock_meta_bytes);
    if (!sm.ok()) return sm.status();
    stock_meta_ = *std::move(sm);
    // Tensor parallelism: the TP=1 run's inputs, state blocks and outputs
    // (the whole model's; it shares the stock path's metadata).
    for (int l = 0; l < L_ && tp_ > 1; ++l) {
      for (auto* list : {&full_proj_, &full_g_, &full_pool_, &full_out_}) {
        const uint64_t bytes = list == &full_proj_  ? tmax_ * full_proj_stride_ * as_
                               : list == &full_g_   ? tmax_ * FGW_ * as_
                               : list == &full_pool_ ? stock_blocks_ * FVW_ * K_ * ss_
                                                     : tmax_ * FVW_ * as_;
        absl::StatusOr<std::unique_ptr<SharedBuffer>> buf = memory_->Allocate(bytes);
        if (!buf.ok()) return buf.status();
        list->push_back(*std::move(buf));
      }
    }
    return absl::OkStatus();
  }

  // Layer parameters (KDA): random, loaded into the service and kept for the
  // stock path. GDN layers have none (g arrives as the log-decay). Drawn for
  // the whole model; the service gets this rank's heads.
  absl::Status LoadLayerParams() {
    for (int l = 0; l < L_ && !gdn_; ++l) {
      std::vector<char> model_a_log, model_dt_bias;
      FillRandom(&model_a_log, FH_, DType::kFloat32, -2.0f, 0.5f, rng_);
      FillRandom(&model_dt_bias, FHK_, DType::kFloat32, -1.0f, 1.0f, rng_);
      const std::vector<char> a_log(model_a_log.begin() + rank_ * H_ * 4,
                                    model_a_log.begin() + (rank_ + 1) * H_ * 4);
      const std::vector<char> dt_bias(model_dt_bias.begin() + rank_ * HK_ * 4,
                                      model_dt_bias.begin() + (rank_ + 1) * HK_ * 4);
      v1::LoadLayerParamsRequest req;
      req.set_layer(l);
      for (int i = 0; i < H_; ++i) {
        req.mutable_a_log()->mutable_values()->add_values(
            reinterpret_cast<const float*>(a_log.data())[i]);
      }
      for (int64_t i = 0; i < HK_; ++i) {
        req.mutable_dt_bias()->mutable_values()->add_values(
            reinterpret_cast<const float*>(dt_bias.data())[i]);
      }
      const auto t0 = Clock::now();
      absl::Status st = session_->LoadLayerParams(req);
      latencies_.Add("LoadLayerParams", Clock::now() - t0);
      if (!st.ok()) return st;
      absl::StatusOr<std::unique_ptr<SharedBuffer>> p = memory_->Allocate((H_ + HK_) * 4);
      if (!p.ok()) return p.status();
      absl::Status copied = memory_->CopyIn((*p)->data(), a_log.data(), H_ * 4);
      if (copied.ok()) {
        copied = memory_->CopyIn(static_cast<char*>((*p)->data()) + H_ * 4, dt_bias.data(), HK_ * 4);
      }
      if (!copied.ok()) return copied;
      stock_params_.push_back(*std::move(p));
      if (tp_ > 1) {  // the TP=1 run's: every head's
        p = memory_->Allocate((FH_ + FHK_) * 4);
        if (!p.ok()) return p.status();
        copied = memory_->CopyIn((*p)->data(), model_a_log.data(), FH_ * 4);
        if (copied.ok()) {
          copied = memory_->CopyIn(static_cast<char*>((*p)->data()) + FH_ * 4,
                                   model_dt_bias.data(), FHK_ * 4);
        }
        if (!copied.ok()) return copied;
        full_params_.push_back(*std::move(p));
      }
    }
    return absl::OkStatus();
  }

  // `bound_inputs`: every layer's tensors bound once, the buffers at their
  // capacity; each step uses the first T tokens (and the R_ rows at the front
  // of the metadata, where every step puts them). Even layers bind the step's
  // query_start_loc and state_indices too, odd layers do not.
  absl::Status BindInputs() {
    for (int l = 0; l < L_; ++l) {
      v1::BindVerifyInputsRequest bind;
      bind.set_layer(l);
      const char* proj = static_cast<const char*>(proj_[l]->data());
      const std::vector<int64_t> strides = {proj_stride_, K_, 1};
      *bind.mutable_q() = session_->Tensor(proj, act_, {tmax_, H_, K_}, strides).value();
      *bind.mutable_k() =
          session_->Tensor(proj + HK_ * as_, act_, {tmax_, H_, K_}, strides).value();
      *bind.mutable_v() =
          session_->Tensor(proj + 2 * HK_ * as_, act_, {tmax_, HV_, K_}, strides).value();
      *bind.mutable_beta() =
          session_->Tensor(proj + (2 * HK_ + VW_) * as_, act_, {tmax_, HV_}, {proj_stride_, 1}).value();
      *bind.mutable_g() = session_->Tensor(g_[l]->data(), act_, GateShape(tmax_)).value();
      *bind.mutable_o() = session_->Tensor(o_[l]->data(), act_, {tmax_, HV_, K_}).value();
      if (l % 2 == 0) {
        *bind.mutable_query_start_loc() = session_->Index(Meta(0), {R_ + 1}).value();
        *bind.mutable_state_indices() = session_->Index(Meta(R_ + 1), {R_}).value();
      }
      const auto t0 = Clock::now();
      absl::StatusOr<v1::BindVerifyInputsResponse> bound = session_->BindVerifyInputs(bind);
      latencies_.Add("BindVerifyInputs", Clock::now() - t0);
      if (!bound.ok()) return bound.status();
    }
    return absl::OkStatus();
  }

  // ---- pools ----

  char* StateBlock(int layer, int32_t block) {
    return pools_->Pool(layer, "recurrent").value() + int64_t{block} * state_block_bytes_;
  }
  char* ConvBlock(int layer, int32_t block) {
    return pools_->Pool(layer, "conv").value() + int64_t{block} * conv_block_stride_ * as_;
  }
  char* StockBlock(int layer, int slot, int col) {
    return static_cast<char*>(stock_pool_[layer]->data()) +
           (1 + int64_t{slot} * Q_ + col) * state_block_bytes_;
  }
  // Tensor parallelism: the TP=1 run's state block (every value head).
  char* FullStockBlock(int layer, int slot, int col) {
    return static_cast<char*>(full_pool_[layer]->data()) +
           (1 + int64_t{slot} * Q_ + col) * FVW_ * K_ * ss_;
  }

  // The conv block as [D][W] host bytes.
  absl::Status ReadConv(int layer, int32_t block, std::vector<char>* out) {
    std::vector<char> raw(conv_block_stride_ * as_);
    absl::Status st = memory_->CopyOut(raw.data(), ConvBlock(layer, block), raw.size());
    if (!st.ok()) return st;
    out->assign(int64_t{D_} * W_ * as_, 0);
    for (int d = 0; d < D_; ++d) {
      for (int t = 0; t < W_; ++t) {
        std::memcpy(out->data() + (int64_t{d} * W_ + t) * as_,
                    raw.data() + (d * conv_dim_stride_ + t * conv_token_stride_) * as_, as_);
      }
    }
    return absl::OkStatus();
  }

  absl::Status WriteConv(int layer, int32_t block, const std::vector<char>& dw) {
    std::vector<char> raw(conv_block_stride_ * as_);
    absl::Status st = memory_->CopyOut(raw.data(), ConvBlock(layer, block), raw.size());
    if (!st.ok()) return st;
    for (int d = 0; d < D_; ++d) {
      for (int t = 0; t < W_; ++t) {
        std::memcpy(raw.data() + (d * conv_dim_stride_ + t * conv_token_stride_) * as_,
                    dw.data() + (int64_t{d} * W_ + t) * as_, as_);
      }
    }
    return memory_->CopyIn(ConvBlock(layer, block), raw.data(), raw.size());
  }

  // ---- checks ----

  void Mismatch(const std::string& what) {
    ++report_.mismatches;
    if (report_.first_mismatch.empty()) report_.first_mismatch = what;
  }

  absl::Status CompareState(int step, int layer, int slot, int32_t block, int col,
                            absl::string_view what) {
    std::vector<char> service(state_block_bytes_), stock(state_block_bytes_);
    absl::Status st = memory_->CopyOut(service.data(), StateBlock(layer, block), service.size());
    if (st.ok()) st = memory_->CopyOut(stock.data(), StockBlock(layer, slot, col), stock.size());
    if (!st.ok()) return st;
    ++report_.comparisons;
    if (std::memcmp(service.data(), stock.data(), service.size()) == 0) return absl::OkStatus();
    int64_t i = 0;
    while (std::memcmp(service.data() + i * ss_, stock.data() + i * ss_, ss_) == 0) ++i;
    Mismatch(absl::StrFormat(
        "step %d, layer %d, row %d: the %s in block %d differs from the stock path's state "
        "(column %d) at element %d (head %d, row %d, col %d): %.9g vs %.9g",
        step, layer, slot, std::string(what), block, col, i, i / (int64_t{K_} * K_), (i / K_) % K_,
        i % K_, ElementAsFloat(service.data() + i * ss_, state_),
        ElementAsFloat(stock.data() + i * ss_, state_)));
    return absl::OkStatus();
  }

  absl::Status CompareWindow(int step, int layer, int slot, int32_t block,
                             const std::vector<char>& expected, absl::string_view what) {
    std::vector<char> dw;
    absl::Status st = ReadConv(layer, block, &dw);
    if (!st.ok()) return st;
    ++report_.comparisons;
    for (int d = 0; d < D_; ++d) {
      for (int h = 0; h < hl_; ++h) {
        const char* got = dw.data() + (int64_t{d} * W_ + h) * as_;
        const char* want = expected.data() + (int64_t{d} * hl_ + h) * as_;
        if (std::memcmp(got, want, as_) != 0) {
          Mismatch(absl::StrFormat(
              "step %d, layer %d, row %d: the %s in block %d differs from the window the stock "
              "path reads next at channel %d, column %d: %.9g vs %.9g",
              step, layer, slot, std::string(what), block, d, h, ElementAsFloat(got, act_),
              ElementAsFloat(want, act_)));
          return absl::OkStatus();
        }
      }
    }
    return absl::OkStatus();
  }

  // Tensor parallelism: the service's state in `block` against the TP=1
  // run's state at stock column `col`, on this rank's value heads.
  absl::Status CompareStateWithTp1(int step, int layer, int slot, int32_t block, int col,
                                   absl::string_view what) {
    std::vector<char> service(state_block_bytes_), tp1(state_block_bytes_);
    absl::Status st = memory_->CopyOut(service.data(), StateBlock(layer, block), service.size());
    if (st.ok()) {
      st = memory_->CopyOut(tp1.data(), FullStockBlock(layer, slot, col) + rank_ * state_block_bytes_,
                            tp1.size());
    }
    if (!st.ok()) return st;
    ++report_.comparisons;
    ++report_.tp1_comparisons;
    if (std::memcmp(service.data(), tp1.data(), service.size()) == 0) return absl::OkStatus();
    int64_t i = 0;
    while (std::memcmp(service.data() + i * ss_, tp1.data() + i * ss_, ss_) == 0) ++i;
    const int64_t head = i / (int64_t{K_} * K_);
    ++report_.tp1_mismatches;
    Mismatch(absl::StrFormat(
        "step %d, layer %d, row %d: the %s in block %d differs from the TP=1 run's state "
        "(all %d value heads, column %d) at value head %d of the model (this rank's head %d), "
        "row %d, col %d: %.9g vs %.9g",
        step, layer, slot, std::string(what), block, FHV_, col, rank_ * HV_ + head, head,
        (i / K_) % K_, i % K_, ElementAsFloat(service.data() + i * ss_, state_),
        ElementAsFloat(tp1.data() + i * ss_, state_)));
    return absl::OkStatus();
  }

  // Tensor parallelism: every layer's Verify output against the TP=1 run's
  // outputs of this rank's value heads.
  absl::Status CompareOutputsWithTp1(const StepPlan& p) {
    const int64_t T = p.num_tokens;
    for (int l = 0; l < L_; ++l) {
      std::vector<char> service(T * VW_ * as_), model(T * FVW_ * as_), tp1(T * VW_ * as_);
      absl::Status st = memory_->CopyOut(service.data(), o_[l]->data(), service.size());
      if (st.ok()) st = memory_->CopyOut(model.data(), full_out_[l]->data(), model.size());
      if (!st.ok()) return st;
      CopyColumns(model, FVW_, rank_ * VW_, &tp1, VW_, 0, T, VW_, as_);
      ++report_.comparisons;
      ++report_.tp1_comparisons;
      if (std::memcmp(service.data(), tp1.data(), service.size()) != 0) {
        int64_t e = 0;
        while (std::memcmp(service.data() + e * as_, tp1.data() + e * as_, as_) == 0) ++e;
        ++report_.tp1_mismatches;
        Mismatch(absl::StrFormat(
            "step %d, layer %d: Verify's output differs from the TP=1 run's (all %d value heads) "
            "at token %d, value head %d of the model (this rank's head %d), column %d: %.9g vs "
            "%.9g",
            p.step, l, FHV_, e / VW_, rank_ * HV_ + (e / K_) % HV_, (e / K_) % HV_, e % K_,
            ElementAsFloat(service.data() + e * as_, act_),
            ElementAsFloat(tp1.data() + e * as_, act_)));
      }
    }
    return absl::OkStatus();
  }

  // ---- requests ----

  absl::StatusOr<int32_t> TakeBlock() {
    if (free_blocks_.empty()) {
      return absl::ResourceExhaustedError("the simulation ran out of blocks: raise --blocks");
    }
    const int32_t b = free_blocks_.back();
    free_blocks_.pop_back();
    return b;
  }

  int CheckpointColumn(const Request& r) const {
    return align_ ? static_cast<int>((r.num_computed - 1) / bs_) : 0;
  }

  // A new request: its running state (random, as a prefill would leave it) in
  // its checkpoint block and in its stock column 0, and its conv history.
  // Both drawn for the whole model: this rank's value heads and channels.
  absl::Status StartRequest(int slot) {
    Request& r = requests_[slot];
    r = Request();
    r.live = true;
    r.acc_prev = 1;
    r.num_computed = align_ ? std::uniform_int_distribution<int>(1, 2 * bs_)(rng_) : 1;
    r.table.assign(width_, 0);
    absl::StatusOr<int32_t> block = TakeBlock();
    if (!block.ok()) return block.status();
    r.table[CheckpointColumn(r)] = *block;
    r.window.resize(L_);
    for (int l = 0; l < L_; ++l) {
      std::vector<char> model_state;
      FillRandom(&model_state, FVW_ * K_, state_, -0.5f, 0.5f, rng_);
      const char* state = model_state.data() + rank_ * state_block_bytes_;
      absl::Status st = memory_->CopyIn(StateBlock(l, *block), state, state_block_bytes_);
      if (st.ok()) st = memory_->CopyIn(StockBlock(l, slot, 0), state, state_block_bytes_);
      if (st.ok() && tp_ > 1) {
        st = memory_->CopyIn(FullStockBlock(l, slot, 0), model_state.data(), model_state.size());
      }
      if (!st.ok()) return st;
      std::vector<char> model_window;
      FillRandom(&model_window, int64_t{FD_} * hl_, act_, -1.0f, 1.0f, rng_);
      const auto mine = model_window.begin() + int64_t{rank_} * D_ * hl_ * as_;
      r.window[l].assign(mine, mine + int64_t{D_} * hl_ * as_);
      std::vector<char> dw(int64_t{D_} * W_ * as_, 0);
      for (int d = 0; d < D_; ++d) {
        std::memcpy(dw.data() + int64_t{d} * W_ * as_, r.window[l].data() + int64_t{d} * hl_ * as_,
                    hl_ * as_);
      }
      st = WriteConv(l, *block, dw);
      if (!st.ok()) return st;
    }
    ++report_.requests_started;
    return absl::OkStatus();
  }

  absl::Status FinishRequest(int slot) {
    Request& r = requests_[slot];
    if (deferred_ && pending_[slot].block > 0) {
      // Its blocks go back to the pool: their pending tokens must not land
      // on the next request's state.
      v1::FlushRequest discard;
      discard.mutable_blocks()->mutable_values()->add_values(pending_[slot].block);
      discard.set_discard(true);
      const auto t0 = Clock::now();
      absl::StatusOr<v1::FlushResponse> flushed = session_->Flush(discard);
      latencies_.Add("Flush (discard)", Clock::now() - t0);
      if (!flushed.ok()) return flushed.status();
      pending_[slot] = Pending();
      ++report_.discarded;
    }
    for (int32_t b : r.table) {
      if (b > 0) free_blocks_.push_back(b);
    }
    r = Request();
    ++report_.requests_finished;
    return absl::OkStatus();
  }

  // ---- one step ----

  int32_t* Meta(int offset) { return reinterpret_cast<int32_t*>(meta_->data()) + offset; }

  absl::Status WaitDoorbell(int index, uint32_t value) {
    const auto deadline = Clock::now() + std::chrono::seconds(20);
    for (;;) {
      uint32_t v = 0;
      absl::Status st = memory_->CopyOut(&v, Meta(door_ + index), 4);
      if (!st.ok()) return st;
      if (v >= value) return absl::OkStatus();
      if (Clock::now() > deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("the service did not signal doorbell ", index, " within 20 s"));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  v1::Doorbell Door(int index, uint32_t value) {
    v1::Doorbell d;
    d.set_region("meta");
    d.set_offset_bytes((door_ + index) * 4);
    d.set_value(value);
    return d;
  }

  // One decode step, as a scheduler runs it. The order of the phases is the
  // protocol's (ASYNC Verify calls go out before their inputs exist; with
  // events they go out after the inputs' event is recorded), and the order
  // of the random draws is fixed by it: a seed replays the same simulation.
  absl::Status Step(int s) {
    StepPlan p;
    p.step = s;
    absl::Status st = ChurnRequests(s);
    if (st.ok()) st = DrawRows(p);
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

    // The stock path, on the simulator's own memory: row i's state blocks are
    // its Q stock columns, and it reads the state at column acc_prev - 1.
    TracePhase(s, "inputs and conv update written");
    st = RunStockPath(p.qsl, p.num_tokens);
    if (!st.ok()) return st;
    TracePhase(s, "stock path done");

    st = options_.drill != nullptr ? ServiceCallsAcrossRestarts(p) : ServiceCalls(p);
    if (st.ok()) st = CompareCommitted(p);
    if (st.ok() && deferred_) st = MaterializeSome(p.step);
    if (st.ok() && s == options_.corrupt_after_step) {
      st = CorruptARunningState(/*flip=*/rank_ == options_.corrupt_rank);
    }
    return st;
  }

  // The step's calls to the service, from Verify (SYNC, or with the inputs'
  // doorbell rung) to RecordStateBlocks, and the checks of their outputs.
  absl::Status ServiceCalls(const StepPlan& p) {
    const int s = p.step;
    absl::Status st = RunVerifies(p);
    if (!st.ok()) return st;
    TracePhase(s, "Verify done");
    if (s == options_.crash_after_verify_step) Crash();
    st = CompareOutputs(p);
    if (st.ok() && tp_ > 1) st = CompareOutputsWithTp1(p);
    if (st.ok() && deferred_) st = CheckMaterializedByVerify(p);
    if (st.ok() && deferred_) st = SnapshotCheckpoints(p);
    if (st.ok()) st = CommitStep(p);
    if (st.ok() && align_) st = RecordStateBlocks(p);
    return st;
  }

  // ServiceCalls under a restart drill: when the service dies during them,
  // the drill starts it again; what it kept is checked (ResumeAfterRestart),
  // the lost blocks re-prefilled (their bytes from before the step) and the
  // step re-run under a new step id unless its Commit had finished.
  absl::Status ServiceCallsAcrossRestarts(StepPlan& p) {
    options_.drill->BeforeStep(p.step);
    const uint64_t bytes = pools_->description().allocation_bytes();
    std::vector<char> before(bytes);
    absl::Status st = memory_->CopyOut(before.data(), pools_->base(), bytes);
    if (!st.ok()) return st;
    for (int attempt = 0;; ++attempt) {
      st = ServiceCalls(p);
      if (st.code() != absl::StatusCode::kUnavailable || attempt == 4) return st;
      // The blocks this step's Commit writes (ForEachCommitWrite's: each live
      // row's final block, and in align mode a boundary block besides it).
      std::vector<int32_t> writes;
      for (int i = 0; i < R_; ++i) {
        if (!requests_[i].live) continue;
        const Request& r = requests_[i];
        const int64_t fnc = r.num_computed + p.accepted[i];
        const int32_t final_block =
            align_ ? r.table[std::min<int64_t>((fnc - 1) / bs_, width_ - 1)] : p.checkpoint[i];
        writes.push_back(final_block);
        const int64_t next_boundary = (r.num_computed / std::max(bs_, 1) + 1) * bs_;
        if (align_ && fnc >= next_boundary) {
          const int32_t b = r.table[next_boundary / bs_ - 1];
          if (b > 0 && b != final_block) writes.push_back(b);
        }
      }
      const auto spans = [this](int32_t block) {
        std::vector<std::pair<uint64_t, uint64_t>> out;
        for (const v1::PoolView& v : pools_->description().pools()) {
          const uint64_t size = v.byte_size() / std::max<int64_t>(v.shape(0), 1);
          out.emplace_back(v.offset_bytes() + block * size, v.offset_bytes() + (block + 1) * size);
        }
        return out;
      };
      const auto read_now = [this, bytes](std::vector<char>* now) {
        now->resize(bytes);
        return memory_->CopyOut(now->data(), pools_->base(), bytes);
      };
      absl::StatusOr<ResumeOutcome> resumed = ResumeAfterRestart(
          *options_.drill, *session_, p.step_id, writes, before, read_now, spans,
          [this, s = p.step](const std::string& what) { Mismatch(absl::StrCat("step ", s, ": ", what)); });
      if (!resumed.ok()) return resumed.status();
      ++report_.restarts;
      report_.lost_blocks += resumed->lost.size();
      for (int32_t block : resumed->lost) {  // the scheduler's re-prefill
        for (const auto& [begin, end] : spans(block)) {
          st = memory_->CopyIn(pools_->base() + begin, before.data() + begin, end - begin);
          if (!st.ok()) return st;
        }
      }
      if (resumed->committed) {
        // Its Commit finished; its answer (and, in align mode, its
        // RecordStateBlocks in the old session) was lost.
        return absl::OkStatus();
      }
      ++report_.steps_rerun;
      BuildVerifies(p);  // a new step id
    }
  }

  // Churn: finished requests leave, new ones arrive; sometimes a slot stays
  // empty for a step (a null row).
  absl::Status ChurnRequests(int s) {
    std::bernoulli_distribution finish(options_.finish_probability);
    for (int i = 0; i < R_; ++i) {
      Request& r = requests_[i];
      if (r.live && !r.pinned && s > 0 && finish(rng_)) {
        absl::Status st = FinishRequest(i);
        if (!st.ok()) return st;
      }
      if (!r.live && (s == 0 || finish(rng_) || i > 0)) {
        absl::Status st = StartRequest(i);
        if (!st.ok()) return st;
      }
    }
    TracePhase(s, "requests finished and started");
    int live = 0;
    for (const Request& r : requests_) live += r.live;
    report_.state_bytes_saved = std::max<uint64_t>(
        report_.state_bytes_saved, uint64_t(live) * (Q_ - 1) * state_block_bytes_ * L_);
    return absl::OkStatus();
  }

  // The step's rows: tokens (drafts + 1), accepted counts, checkpoints, and in
  // align mode blocks for the columns the step's tokens reach.
  absl::Status DrawRows(StepPlan& p) {
    p.tokens.assign(R_, 0);
    p.accepted.assign(R_, 0);
    p.qsl.assign(R_ + 1, 0);
    p.checkpoint.assign(R_, 0);
    for (int i = 0; i < R_; ++i) {
      p.tokens[i] = std::uniform_int_distribution<int>(1, Q_)(rng_);
      p.accepted[i] = std::uniform_int_distribution<int>(1, p.tokens[i])(rng_);
      p.qsl[i + 1] = p.qsl[i] + p.tokens[i];
      Request& r = requests_[i];
      if (!r.live) {
        ++report_.null_rows;
        continue;
      }
      p.checkpoint[i] = r.table[CheckpointColumn(r)];
      if (align_) {
        const int last = static_cast<int>((r.num_computed + p.tokens[i] - 1) / bs_);
        for (int c = CheckpointColumn(r); c <= last && c < width_; ++c) {
          if (r.table[c] == 0) {
            absl::StatusOr<int32_t> b = TakeBlock();
            if (!b.ok()) return b.status();
            r.table[c] = *b;
          }
        }
      }
      ++report_.rows;
      report_.tokens_verified += p.tokens[i];
    }
    p.num_tokens = p.qsl[R_];
    return absl::OkStatus();
  }

  // Where each of the step's int32 tensors lies in the shared metadata
  // buffer (in elements); the doorbells follow them.
  MetaOffsets MetaLayout() const {
    MetaOffsets at;
    int off = 0;
    const auto take = [&off](int n) {
      const int start = off;
      off += n;
      return start;
    };
    at.qsl = take(R_ + 1);
    at.idx = take(R_);
    at.req = take(R_);
    at.acc = take(batch_max_);
    at.nc = take(batch_max_);
    at.map = take(batch_max_);
    at.sampled = take(batch_max_);
    at.out_idx = take(batch_max_);
    at.out_acc = take(batch_max_);
    at.table = take(batch_max_ * width_);
    at.door = off;
    return at;
  }

  // The step's metadata, on the host: odd steps put a prefill row in front of
  // the batch and map spec rows to batch rows with request_indices (when the
  // batch has room for it: the service's batches hold at most max_rows rows).
  absl::Status LayOutMetadata(StepPlan& p) {
    p.remap = p.step % 2 == 1 && R_ < layout_.max_rows();
    p.batch = p.remap ? R_ + 1 : R_;
    const int shift = p.remap ? 1 : 0;
    p.at = MetaLayout();
    const MetaOffsets& at = p.at;
    door_ = at.door;
    std::vector<int32_t>& meta = p.meta;
    meta.assign(meta_ints_, 0);
    for (int i = 0; i <= R_; ++i) meta[at.qsl + i] = p.qsl[i];
    for (int i = 0; i < R_; ++i) {
      const Request& r = requests_[i];
      meta[at.idx + i] = p.checkpoint[i];
      meta[at.req + i] = i + shift;
      meta[at.acc + i + shift] = p.accepted[i];
      meta[at.nc + i + shift] = r.live ? static_cast<int32_t>(r.num_computed) : 0;
      meta[at.map + i + shift] = r.live ? i : -1;
      meta[at.sampled + i + shift] = p.accepted[i];
      for (int c = 0; c < width_; ++c) {
        meta[at.table + (i + shift) * width_ + c] = r.live ? r.table[c] : 0;
      }
    }
    if (p.remap) {  // the prefill row: accepts nothing, maps to no request
      meta[at.map] = -1;
    }
    for (int i = 0; i < batch_max_; ++i) {
      meta[at.out_idx + i] = -7;  // poison: rows with idx_mapping < 0 keep it
      meta[at.out_acc + i] = -7;
    }
    // Doorbells keep their values across steps.
    return memory_->CopyOut(meta.data() + door_, Meta(door_), 4 * 4);
  }

  // Every layer's Verify request (ASYNC: built, and maybe sent, before any
  // input exists).
  void BuildVerifies(StepPlan& p) {
    p.verifies.assign(L_, v1::VerifyRequest());
    p.step_id = session_->NextStep();
    for (int l = 0; l < L_; ++l) {
      v1::VerifyRequest& v = p.verifies[l];
      v.set_step(p.step_id);
      v.set_layer(l);
      v.set_num_rows(R_);
      if (options_.bound_inputs) {
        v.set_bound_inputs(true);
        v.set_num_tokens(p.num_tokens);
      } else {
        SetVerifyTensors(p, l, &v);
      }
      if (options_.async && options_.events) {
        v.set_ordering(v1::ASYNC);
        v.mutable_wait()->mutable_event()->set_handle(inputs_ready_->handle());
        if (l == L_ - 1) v.mutable_signal()->mutable_event()->set_handle(work_done_->handle());
      } else if (options_.async) {
        v.set_ordering(v1::ASYNC);
        *v.mutable_wait()->mutable_doorbell() = Door(0, p.step + 1);
        if (l == L_ - 1) *v.mutable_signal()->mutable_doorbell() = Door(1, p.step + 1);
      }
    }
  }

  // Layer `l`'s tensors in its request: q, k, v and beta as column slices of
  // proj, g and o; the metadata on layer 0 and every third step (later layers
  // may rely on the step's copy).
  void SetVerifyTensors(const StepPlan& p, int l, v1::VerifyRequest* v) {
    const int64_t T = p.num_tokens;
    if (l == 0 || p.step % 3 == 0) {
      *v->mutable_query_start_loc() = session_->Index(Meta(p.at.qsl), {R_ + 1}).value();
      *v->mutable_state_indices() = session_->Index(Meta(p.at.idx), {R_}).value();
    }
    const char* proj = static_cast<const char*>(proj_[l]->data());
    const std::vector<int64_t> strides = {proj_stride_, K_, 1};
    *v->mutable_q() = session_->Tensor(proj, act_, {T, H_, K_}, strides).value();
    *v->mutable_k() = session_->Tensor(proj + HK_ * as_, act_, {T, H_, K_}, strides).value();
    *v->mutable_v() = session_->Tensor(proj + 2 * HK_ * as_, act_, {T, HV_, K_}, strides).value();
    *v->mutable_beta() =
        session_->Tensor(proj + (2 * HK_ + VW_) * as_, act_, {T, HV_}, {proj_stride_, 1}).value();
    *v->mutable_g() = session_->Tensor(g_[l]->data(), act_, GateShape(T)).value();
    *v->mutable_o() = session_->Tensor(o_[l]->data(), act_, {T, HV_, K_}).value();
  }

  // Sends every layer's Verify: one call each, or one SubmitStep.
  absl::Status SendVerifies(const StepPlan& p, const std::string& name) {
    if (options_.batch) {
      v1::SubmitStepRequest batch;
      for (const v1::VerifyRequest& v : p.verifies) *batch.add_verifies() = v;
      const auto t0 = Clock::now();
      absl::StatusOr<v1::SubmitStepResponse> r = session_->SubmitStep(batch);
      latencies_.Add("SubmitStep (" + name + ")", Clock::now() - t0);
      return r.status();
    }
    for (int l = 0; l < L_; ++l) {
      const auto t0 = Clock::now();
      absl::StatusOr<v1::VerifyResponse> r = session_->Verify(p.verifies[l]);
      latencies_.Add(name, Clock::now() - t0);
      if (!r.ok()) return r.status();
    }
    return absl::OkStatus();
  }

  // The inputs in the shared buffers: metadata, every layer's activations
  // (at capacity), and poisoned outputs, the service's and the stock path's.
  // The activations are drawn for the whole model (under tensor parallelism
  // the TP=1 run reads them all); this rank's service gets its heads.
  absl::Status WriteInputs(const StepPlan& p) {
    absl::Status st = memory_->CopyIn(meta_->data(), p.meta.data(), door_ * 4);
    if (!st.ok()) return st;
    std::vector<char> poison(tmax_ * FVW_ * as_, static_cast<char>(0xff));
    for (int l = 0; l < L_; ++l) {
      std::vector<char> model_proj, model_g;
      FillRandom(&model_proj, tmax_ * full_proj_stride_, act_, -1.0f, 1.0f, rng_);
      // beta (the last HV columns of each token): KDA's as logits in [-3, 3],
      // GDN's as write strengths in [0, 1].
      std::vector<char> beta;
      FillRandom(&beta, tmax_ * FHV_, act_, gdn_ ? 0.0f : -3.0f, gdn_ ? 1.0f : 3.0f, rng_);
      CopyColumns(beta, FHV_, 0, &model_proj, full_proj_stride_, 2 * FHK_ + FVW_, tmax_, FHV_,
                  as_);
      // g: KDA's gate input, or GDN's log-decay (negative).
      FillRandom(&model_g, tmax_ * FGW_, act_, gdn_ ? -1.0f : -3.0f, gdn_ ? -0.01f : 1.0f, rng_);
      if (tp_ == 1) {
        st = WriteLayerInputs(l, model_proj, model_g, poison);
      } else {
        // This rank's q, k, v and beta heads, and its g.
        std::vector<char> proj(tmax_ * proj_stride_ * as_), g(tmax_ * GW_ * as_);
        const int64_t fps = full_proj_stride_;
        CopyColumns(model_proj, fps, rank_ * HK_, &proj, proj_stride_, 0, tmax_, HK_, as_);
        CopyColumns(model_proj, fps, FHK_ + rank_ * HK_, &proj, proj_stride_, HK_, tmax_, HK_,
                    as_);
        CopyColumns(model_proj, fps, 2 * FHK_ + rank_ * VW_, &proj, proj_stride_, 2 * HK_, tmax_,
                    VW_, as_);
        CopyColumns(model_proj, fps, 2 * FHK_ + FVW_ + rank_ * HV_, &proj, proj_stride_,
                    2 * HK_ + VW_, tmax_, HV_, as_);
        CopyColumns(model_g, FGW_, rank_ * GW_, &g, GW_, 0, tmax_, GW_, as_);
        st = WriteLayerInputs(l, proj, g, poison);
        if (st.ok()) st = memory_->CopyIn(full_proj_[l]->data(), model_proj.data(), model_proj.size());
        if (st.ok()) st = memory_->CopyIn(full_g_[l]->data(), model_g.data(), model_g.size());
        if (st.ok()) st = memory_->CopyIn(full_out_[l]->data(), poison.data(), poison.size());
      }
      if (!st.ok()) return st;
    }
    return absl::OkStatus();
  }

  // Layer `l`'s activations of this service in its buffers, and its outputs
  // and the stock path's poisoned.
  absl::Status WriteLayerInputs(int l, const std::vector<char>& proj, const std::vector<char>& g,
                                const std::vector<char>& poison) {
    const uint64_t out_bytes = tmax_ * VW_ * as_;
    absl::Status st = memory_->CopyIn(proj_[l]->data(), proj.data(), proj.size());
    if (st.ok()) st = memory_->CopyIn(g_[l]->data(), g.data(), g.size());
    if (st.ok()) st = memory_->CopyIn(o_[l]->data(), poison.data(), out_bytes);
    if (st.ok()) st = memory_->CopyIn(stock_out_[l]->data(), poison.data(), out_bytes);
    return st;
  }

  // The scheduler's conv update (docs/semantics.md): the block's columns become
  // [h_2..h_hl, x_0..x_{T-1}]; the window the next step reads is the hl
  // columns ending at the last accepted token. Keeps each row's updated
  // columns in `p.updated` for the window checks after Commit.
  absl::Status UpdateConvWindows(StepPlan& p) {
    p.updated.assign(R_, {});
    for (int i = 0; i < R_; ++i) {
      Request& r = requests_[i];
      if (!r.live) continue;
      p.updated[i].resize(L_);
      const int tokens = p.tokens[i];
      const int cols = hl_ - 1 + tokens;
      for (int l = 0; l < L_; ++l) {
        // The whole model's new columns [D][tokens]; this rank's channels.
        std::vector<char> model_x;
        FillRandom(&model_x, int64_t{FD_} * tokens, act_, -1.0f, 1.0f, rng_);
        const auto mine = model_x.begin() + int64_t{rank_} * D_ * tokens * as_;
        const std::vector<char> x(mine, mine + int64_t{D_} * tokens * as_);
        std::vector<char>& u = p.updated[i][l];
        u.assign(int64_t{D_} * cols * as_, 0);
        for (int d = 0; d < D_; ++d) {
          std::memcpy(u.data() + int64_t{d} * cols * as_,
                      r.window[l].data() + (int64_t{d} * hl_ + 1) * as_, (hl_ - 1) * as_);
          std::memcpy(u.data() + (int64_t{d} * cols + hl_ - 1) * as_,
                      x.data() + int64_t{d} * tokens * as_, tokens * as_);
        }
        std::vector<char> dw;
        absl::Status st = ReadConv(l, p.checkpoint[i], &dw);
        if (!st.ok()) return st;
        for (int d = 0; d < D_; ++d) {
          std::memcpy(dw.data() + int64_t{d} * W_ * as_, u.data() + int64_t{d} * cols * as_,
                      cols * as_);
        }
        st = WriteConv(l, p.checkpoint[i], dw);
        if (!st.ok()) return st;
      }
    }
    return absl::OkStatus();
  }

  // Verify, once the inputs are written: ASYNC by events (record, send, wait
  // for the last layer's), ASYNC by doorbells (already sent: ring, wait), or
  // SYNC (send).
  absl::Status RunVerifies(const StepPlan& p) {
    absl::Status st;
    if (options_.async && options_.events) {
      // An event wait applies to the record made before the call: record the
      // inputs' event, then send the Verify calls, then wait for the last one.
      st = inputs_ready_->Record();
      if (st.ok()) st = SendVerifies(p, "Verify (async, events)");
      if (st.ok()) st = work_done_->Synchronize();
    } else if (options_.async) {
      uint32_t ring = p.step + 1;
      st = memory_->CopyIn(Meta(door_ + 0), &ring, 4);
      if (st.ok()) st = WaitDoorbell(1, p.step + 1);
    } else {
      st = SendVerifies(p, "Verify");
    }
    return st;
  }

  // Every layer's Verify output against the stock kernel's, bit for bit.
  absl::Status CompareOutputs(const StepPlan& p) {
    const int64_t T = p.num_tokens;
    for (int l = 0; l < L_; ++l) {
      std::vector<char> service(T * VW_ * as_), stock(T * VW_ * as_);
      absl::Status st = memory_->CopyOut(service.data(), o_[l]->data(), service.size());
      if (st.ok()) st = memory_->CopyOut(stock.data(), stock_out_[l]->data(), stock.size());
      if (!st.ok()) return st;
      ++report_.comparisons;
      if (std::memcmp(service.data(), stock.data(), service.size()) != 0) {
        int64_t e = 0;
        while (std::memcmp(service.data() + e * as_, stock.data() + e * as_, as_) == 0) ++e;
        Mismatch(absl::StrFormat(
            "step %d, layer %d: Verify's output differs from the stock kernel's at token %d, "
            "head %d, column %d: %.9g vs %.9g",
            p.step, l, e / VW_, (e / K_) % HV_, e % K_,
            ElementAsFloat(service.data() + e * as_, act_),
            ElementAsFloat(stock.data() + e * as_, act_)));
      }
    }
    return absl::OkStatus();
  }

  // Commit (ASYNC: signals doorbell 2, which this waits for). The crash test
  // `abandon_commit_at_step` makes it wait on doorbell 3, never rung, and dies.
  absl::Status CommitStep(const StepPlan& p) {
    const int s = p.step;
    v1::CommitRequest commit;
    commit.set_step(p.step_id);
    *commit.mutable_num_accepted() = session_->Index(Meta(p.at.acc), {p.batch}).value();
    if (p.remap) *commit.mutable_request_indices() = session_->Index(Meta(p.at.req), {R_}).value();
    if (align_) {
      *commit.mutable_block_table() =
          session_->Index(Meta(p.at.table), {p.batch, width_}).value();
      *commit.mutable_num_computed_tokens() = session_->Index(Meta(p.at.nc), {p.batch}).value();
    }
    if (options_.async) {
      commit.set_ordering(v1::ASYNC);
      *commit.mutable_signal()->mutable_doorbell() = Door(2, s + 1);
    }
    const bool abandon = s == options_.abandon_commit_at_step;
    if (abandon) {  // doorbell 3 is never rung
      commit.set_ordering(v1::ASYNC);
      *commit.mutable_wait()->mutable_doorbell() = Door(3, s + 1);
    }
    TracePhase(s, "outputs compared; Commit");
    const auto t0 = Clock::now();
    absl::StatusOr<v1::CommitResponse> r = session_->Commit(commit);
    latencies_.Add(options_.async ? "Commit (async)" : "Commit", Clock::now() - t0);
    if (!r.ok()) return r.status();
    if (abandon) Crash();
    if (options_.async) {
      absl::Status st = WaitDoorbell(2, s + 1);
      if (!st.ok()) return st;
    }
    TracePhase(s, "Commit done");
    return absl::OkStatus();
  }

  // Align mode: RecordStateBlocks into the metadata's poisoned output rows,
  // then its outputs against what the step's rows imply.
  absl::Status RecordStateBlocks(const StepPlan& p) {
    v1::RecordStateBlocksRequest record;
    record.set_step(p.step_id);
    *record.mutable_idx_mapping() = session_->Index(Meta(p.at.map), {p.batch}).value();
    *record.mutable_num_sampled() = session_->Index(Meta(p.at.sampled), {p.batch}).value();
    *record.mutable_num_computed_tokens() = session_->Index(Meta(p.at.nc), {p.batch}).value();
    if (p.remap) *record.mutable_request_indices() = session_->Index(Meta(p.at.req), {R_}).value();
    record.set_block_table_width(width_);
    *record.mutable_state_idx() =
        session_->Tensor(Meta(p.at.out_idx), DType::kInt32, {R_}).value();
    *record.mutable_num_accepted() =
        session_->Tensor(Meta(p.at.out_acc), DType::kInt32, {R_}).value();
    const auto t0 = Clock::now();
    absl::StatusOr<v1::RecordStateBlocksResponse> r = session_->RecordStateBlocks(record);
    latencies_.Add("RecordStateBlocks", Clock::now() - t0);
    if (!r.ok()) return r.status();
    TracePhase(p.step, "RecordStateBlocks done");
    return CheckRecordedBlocks(p);
  }

  // RecordStateBlocks' outputs: a live row's state_idx is the column of its
  // last accepted token and its num_accepted 1; a null row keeps the poison.
  absl::Status CheckRecordedBlocks(const StepPlan& p) {
    std::vector<int32_t> out(2 * batch_max_);
    absl::Status st = memory_->CopyOut(out.data(), Meta(p.at.out_idx), out.size() * 4);
    if (!st.ok()) return st;
    for (int i = 0; i < R_; ++i) {
      const Request& r = requests_[i];
      const int32_t want_idx =
          r.live ? static_cast<int32_t>(std::min<int64_t>(
                       (r.num_computed + p.accepted[i] - 1) / bs_, width_ - 1))
                 : -7;
      const int32_t want_acc = r.live ? 1 : -7;
      ++report_.comparisons;
      if (out[i] != want_idx || out[batch_max_ + i] != want_acc) {
        Mismatch(absl::StrFormat(
            "step %d, row %d: RecordStateBlocks wrote state_idx %d, num_accepted %d; expected "
            "%d, %d",
            p.step, i, out[i], out[batch_max_ + i], want_idx, want_acc));
      }
    }
    return absl::OkStatus();
  }

  // The committed states and conv windows against the stock path's, row by
  // row; then each live row advances past its accepted tokens.
  absl::Status CompareCommitted(const StepPlan& p) {
    for (int i = 0; i < R_; ++i) {
      if (!requests_[i].live) continue;
      absl::Status st = CompareCommittedRow(p, i);
      if (!st.ok()) return st;
    }
    return absl::OkStatus();
  }

  // Row i: per layer, the committed state (column acc - 1) and the conv
  // window ending at the last accepted token; in align mode also the state
  // and window at a mamba-block boundary the accepted tokens crossed.
  absl::Status CompareCommittedRow(const StepPlan& p, int i) {
    Request& r = requests_[i];
    const int acc = p.accepted[i];
    report_.tokens_accepted += acc;
    const int64_t nc = r.num_computed;
    const int64_t fnc = nc + acc;
    const int32_t final_block =
        align_ ? r.table[std::min<int64_t>((fnc - 1) / bs_, width_ - 1)] : p.checkpoint[i];
    int32_t boundary_block = 0;
    int boundary_len = 0;
    if (align_) {
      const int64_t next_boundary = (nc / bs_ + 1) * bs_;
      if (fnc >= next_boundary) {
        boundary_block = r.table[next_boundary / bs_ - 1];
        boundary_len = static_cast<int>(next_boundary - nc);
      }
    }
    const int s = p.step;
    // DEFERRED: the row's tokens are pending on its checkpoint block, which
    // still holds the checkpoint; the stock state it must become is kept.
    const bool pending = deferred_ && acc > 0 && final_block == p.checkpoint[i] &&
                         boundary_block <= 0;
    if (pending) {
      Pending& pend = pending_[i];
      pend = Pending();
      pend.block = final_block;
      pend.step = s;
      pend.state.resize(L_);
      pend.tp1_state.resize(L_);
      pend.materialized.assign(L_, false);
      ++report_.pending_checked;
    }
    for (int l = 0; l < L_; ++l) {
      const std::vector<char>& updated = p.updated[i][l];
      absl::Status st;
      if (pending) {
        Pending& pend = pending_[i];
        st = CompareBytes(s, l, i, final_block, checkpoints_[i][l],
                          "pending block (its checkpoint, after Commit)", "the checkpoint");
        pend.state[l].resize(state_block_bytes_);
        if (st.ok()) {
          st = memory_->CopyOut(pend.state[l].data(), StockBlock(l, i, acc - 1),
                                state_block_bytes_);
        }
        if (st.ok() && tp_ > 1) {
          pend.tp1_state[l].resize(state_block_bytes_);
          st = memory_->CopyOut(pend.tp1_state[l].data(),
                                FullStockBlock(l, i, acc - 1) + rank_ * state_block_bytes_,
                                state_block_bytes_);
        }
      } else {
        st = CompareState(s, l, i, final_block, acc - 1, "committed state");
        if (st.ok() && tp_ > 1) {
          st = CompareStateWithTp1(s, l, i, final_block, acc - 1, "committed state");
        }
      }
      if (!st.ok()) return st;
      std::vector<char> window = WindowEndingAt(updated, p.tokens[i], acc);
      st = CompareWindow(s, l, i, final_block, window, "conv window");
      if (!st.ok()) return st;
      if (boundary_block > 0 && boundary_len < acc) {
        st = CompareState(s, l, i, boundary_block, boundary_len - 1, "boundary state");
        if (st.ok() && tp_ > 1) {
          st = CompareStateWithTp1(s, l, i, boundary_block, boundary_len - 1, "boundary state");
        }
        if (!st.ok()) return st;
        st = CompareWindow(s, l, i, boundary_block,
                           WindowEndingAt(updated, p.tokens[i], boundary_len),
                           "boundary conv window");
        if (!st.ok()) return st;
        if (l == 0) ++report_.boundary_states;
      }
      r.window[l] = std::move(window);
    }
    r.acc_prev = acc;
    r.num_computed = fnc;
    return absl::OkStatus();
  }

  // ---- commit mode DEFERRED ----

  // The service's block `block` of `layer` against `expected`, bit for bit.
  absl::Status CompareBytes(int step, int layer, int slot, int32_t block,
                            const std::vector<char>& expected, absl::string_view what,
                            absl::string_view against) {
    std::vector<char> service(state_block_bytes_);
    absl::Status st = memory_->CopyOut(service.data(), StateBlock(layer, block), service.size());
    if (!st.ok()) return st;
    ++report_.comparisons;
    if (std::memcmp(service.data(), expected.data(), service.size()) == 0) return absl::OkStatus();
    int64_t e = 0;
    while (std::memcmp(service.data() + e * ss_, expected.data() + e * ss_, ss_) == 0) ++e;
    Mismatch(absl::StrFormat(
        "step %d, layer %d, row %d: the %s in block %d differs from %s at element %d: %.9g vs "
        "%.9g",
        step, layer, slot, std::string(what), block, std::string(against), e,
        ElementAsFloat(service.data() + e * ss_, state_),
        ElementAsFloat(expected.data() + e * ss_, state_)));
    return absl::OkStatus();
  }

  // A pending block, once materialized: every layer not yet checked against
  // the stock state kept for it (and the TP=1 run's).
  absl::Status CheckMaterialized(int step, int slot, absl::string_view how) {
    Pending& pend = pending_[slot];
    for (int l = 0; l < L_; ++l) {
      if (pend.materialized[l]) continue;
      const std::string what = absl::StrCat("state materialized by ", how, " (committed at step ",
                                            pend.step, ")");
      absl::Status st = CompareBytes(step, l, slot, pend.block, pend.state[l], what,
                                     "the stock path's state");
      if (st.ok() && tp_ > 1) {
        ++report_.tp1_comparisons;
        const uint64_t before = report_.mismatches;
        st = CompareBytes(step, l, slot, pend.block, pend.tp1_state[l], what,
                          "the TP=1 run's state");
        report_.tp1_mismatches += report_.mismatches - before;
      }
      if (!st.ok()) return st;
    }
    pend = Pending();
    return absl::OkStatus();
  }

  // After a step's Verify calls: every row's pending block is materialized.
  absl::Status CheckMaterializedByVerify(const StepPlan& p) {
    for (int i = 0; i < R_; ++i) {
      if (!requests_[i].live || pending_[i].block <= 0) continue;
      if (pending_[i].block != p.checkpoint[i]) continue;  // (align: it moved on)
      ++report_.materialized_by_verify;
      absl::Status st = CheckMaterialized(p.step, i, "Verify");
      if (!st.ok()) return st;
    }
    return absl::OkStatus();
  }

  // Before Commit: the live rows' checkpoints, which a deferred row's block
  // must still hold after it.
  absl::Status SnapshotCheckpoints(const StepPlan& p) {
    checkpoints_.assign(R_, {});
    for (int i = 0; i < R_; ++i) {
      if (!requests_[i].live) continue;
      checkpoints_[i].resize(L_);
      for (int l = 0; l < L_; ++l) {
        checkpoints_[i][l].resize(state_block_bytes_);
        absl::Status st = memory_->CopyOut(checkpoints_[i][l].data(),
                                           StateBlock(l, p.checkpoint[i]), state_block_bytes_);
        if (!st.ok()) return st;
      }
    }
    return absl::OkStatus();
  }

  // Flush of `blocks` (empty: every pending block), SYNC, then each flushed
  // pending block checked.
  absl::Status FlushAndCheck(const std::vector<int32_t>& blocks, int step,
                             absl::string_view how) {
    v1::FlushRequest flush;
    for (int32_t b : blocks) flush.mutable_blocks()->mutable_values()->add_values(b);
    const auto t0 = Clock::now();
    absl::StatusOr<v1::FlushResponse> r = session_->Flush(flush);
    latencies_.Add("Flush", Clock::now() - t0);
    if (!r.ok()) return r.status();
    for (int i = 0; i < R_; ++i) {
      const int32_t b = pending_[i].block;
      if (b <= 0) continue;
      if (!blocks.empty() && std::find(blocks.begin(), blocks.end(), b) == blocks.end()) continue;
      ++report_.materialized_by_flush;
      absl::Status st = CheckMaterialized(step, i, how);
      if (!st.ok()) return st;
    }
    return absl::OkStatus();
  }

  // Between steps, now and then, as a scheduler would: a Flush of every
  // pending block, of some of them, or a ReadState of one pending block in
  // one layer (its checksum, and the block's bytes in that layer).
  absl::Status MaterializeSome(int step) {
    std::vector<int> slots;
    for (int i = 0; i < R_; ++i) {
      if (pending_[i].block > 0) slots.push_back(i);
    }
    if (slots.empty()) return absl::OkStatus();
    const int what = std::uniform_int_distribution<int>(0, 9)(deferred_rng_);
    if (what == 0) return FlushAndCheck({}, step, "a Flush of every block");
    if (what == 1) {
      std::vector<int32_t> some;
      for (int i : slots) {
        if (std::bernoulli_distribution(0.5)(deferred_rng_)) some.push_back(pending_[i].block);
      }
      if (some.empty()) some.push_back(pending_[slots[0]].block);
      some.push_back(some[0]);  // twice: flushed once
      some.push_back(0);        // null: skipped
      return FlushAndCheck(some, step, "a Flush of its block");
    }
    if (what == 2) {
      const int slot = slots[std::uniform_int_distribution<size_t>(0, slots.size() - 1)(
          deferred_rng_)];
      const int l = std::uniform_int_distribution<int>(0, L_ - 1)(deferred_rng_);
      Pending& pend = pending_[slot];
      const auto t0 = Clock::now();
      absl::StatusOr<v1::ReadStateResponse> r = client_.ReadState(l, pend.block, false);
      latencies_.Add("ReadState", Clock::now() - t0);
      if (!r.ok()) return r.status();
      ++report_.comparisons;
      ++report_.materialized_by_read;
      if (r->recurrent().checksum() !=
          server::Fnv1a(absl::string_view(pend.state[l].data(), pend.state[l].size()))) {
        Mismatch(absl::StrFormat(
            "step %d, layer %d, row %d: ReadState's checksum of pending block %d (committed at "
            "step %d) differs from the stock path's state",
            step, l, slot, pend.block, pend.step));
      }
      absl::Status st = CompareBytes(step, l, slot, pend.block, pend.state[l],
                                     "state materialized by ReadState", "the stock path's state");
      if (!st.ok()) return st;
      pend.materialized[l] = true;
    }
    return absl::OkStatus();
  }

  // The [D][hl] conv window after the first `len` of a row's `tokens` tokens,
  // cut from its updated columns [D][hl - 1 + tokens].
  std::vector<char> WindowEndingAt(const std::vector<char>& updated, int tokens, int len) const {
    const int cols = hl_ - 1 + tokens;
    std::vector<char> window(int64_t{D_} * hl_ * as_);
    for (int d = 0; d < D_; ++d) {
      std::memcpy(window.data() + int64_t{d} * hl_ * as_,
                  updated.data() + (int64_t{d} * cols + len - 1) * as_, hl_ * as_);
    }
    return window;
  }

  // The verdict's own test (`corrupt_after_step`): flips one mantissa bit of
  // the first element of the first live request's running state, in the
  // service's pool, through the exported handle; the request never finishes.
  // Under tensor parallelism only `corrupt_rank` flips the bit, but every
  // rank pins the request (which changes the random draws that follow).
  absl::Status CorruptARunningState(bool flip) {
    for (int i = 0; i < R_; ++i) {
      Request& r = requests_[i];
      if (!r.live) continue;
      if (!flip) {
        r.pinned = true;
        break;
      }
      char* p = StateBlock(0, r.table[CheckpointColumn(r)]);
      uint32_t word = 0;
      absl::Status st = memory_->CopyOut(&word, p, ss_);
      if (!st.ok()) return st;
      word ^= ss_ == 4 ? (1u << 20) : (1u << 5);
      st = memory_->CopyIn(p, &word, ss_);
      if (!st.ok()) return st;
      r.pinned = true;
      break;
    }
    return absl::OkStatus();
  }

  [[noreturn]] void Crash() {
    const uint64_t bytes = pools_->description().allocation_bytes();
    std::vector<char> all(bytes);
    uint64_t h = 1469598103934665603ull;
    if (memory_->CopyOut(all.data(), pools_->base(), bytes).ok()) {
      for (char c : all) {
        h ^= static_cast<unsigned char>(c);
        h *= 1099511628211ull;
      }
    }
    std::printf("CRASH POINT pools=%016llx\n", static_cast<unsigned long long>(h));
    std::fflush(stdout);
    raise(SIGKILL);
    std::abort();
  }

  absl::Status RunStockPath(const std::vector<int32_t>& qsl, int64_t T) {
    // ssm_state_indices [R, Q]: the slot's stock columns (null rows: all 0),
    // num_accepted_tokens [R], query_start_loc [R + 1].
    std::vector<int32_t> indices(int64_t{R_} * Q_, 0), acc(R_, 1);
    for (int i = 0; i < R_; ++i) {
      if (!requests_[i].live) continue;
      for (int c = 0; c < Q_; ++c) indices[int64_t{i} * Q_ + c] = static_cast<int32_t>(1 + i * Q_ + c);
      acc[i] = requests_[i].acc_prev;
    }
    char* base = static_cast<char*>(stock_meta_->data());
    int32_t* d_indices = reinterpret_cast<int32_t*>(base);
    int32_t* d_acc = d_indices + int64_t{R_} * Q_;
    int32_t* d_qsl = d_acc + R_;
    char* workspace = base + ((4 * (int64_t{R_} * Q_ + 2 * R_ + 1) + 255) / 256) * 256;
    auto* status = reinterpret_cast<kernels::DeviceStatus*>(
        workspace + kernels::StockWorkspaceBytes(stock_blocks_));
    absl::Status st = memory_->CopyIn(d_indices, indices.data(), indices.size() * 4);
    if (st.ok()) st = memory_->CopyIn(d_acc, acc.data(), acc.size() * 4);
    if (st.ok()) st = memory_->CopyIn(d_qsl, qsl.data(), qsl.size() * 4);
    if (!st.ok()) return st;
    const StockMetadata meta{d_qsl, d_indices, d_acc, workspace, status};
    st = RunStockKernels(
        StockPart{H_, HV_, proj_stride_, GW_, &proj_, &g_, &stock_out_, &stock_pool_, &stock_params_},
        meta, T);
    if (st.ok() && tp_ > 1) {  // the TP=1 run: every head of the model
      st = RunStockKernels(StockPart{FH_, FHV_, full_proj_stride_, FGW_, &full_proj_, &full_g_,
                                     &full_out_, &full_pool_, &full_params_},
                           meta, T);
    }
    return st;
  }

  // What one run of the stock kernel over every layer reads and writes: this
  // service's part of the model (its stock path), or under tensor
  // parallelism the whole model (the TP=1 run).
  struct StockPart {
    int heads = 0, value_heads = 0;
    int64_t proj_stride = 0, gate_width = 0;  // elements per token
    const std::vector<std::unique_ptr<SharedBuffer>>* proj;
    const std::vector<std::unique_ptr<SharedBuffer>>* g;
    const std::vector<std::unique_ptr<SharedBuffer>>* out;
    const std::vector<std::unique_ptr<SharedBuffer>>* pool;
    const std::vector<std::unique_ptr<SharedBuffer>>* params;
  };
  // The stock kernel's index inputs, workspace and status (in stock_meta_).
  struct StockMetadata {
    const int32_t* qsl;
    const int32_t* indices;
    const int32_t* acc;
    char* workspace;
    kernels::DeviceStatus* status;
  };

  absl::Status RunStockKernels(const StockPart& part, const StockMetadata& meta, int64_t T) {
    const int64_t HK = int64_t{part.heads} * K_;
    const int64_t VW = int64_t{part.value_heads} * K_;
    for (int l = 0; l < L_; ++l) {
      kernels::StockArgs a;
      a.shape.num_heads = part.heads;
      a.shape.head_dim = K_;
      a.shape.act_dtype = act_;
      a.shape.state_dtype = state_;
      a.shape.lower_bound = layout_.lower_bound();
      a.shape.kind = gdn_ ? kernels::LayerKind::kGdn : kernels::LayerKind::kKda;
      a.shape.num_value_heads = part.value_heads;
      a.shape.gate = layout_.kda_gate() == v1::PLAIN_GATE ? kernels::KdaGate::kPlain
                                                           : kernels::KdaGate::kSafe;
      const char* proj = static_cast<const char*>((*part.proj)[l]->data());
      const int64_t ps = part.proj_stride;
      a.q = kernels::Activation{proj, ps};
      a.k = kernels::Activation{proj + HK * as_, ps};
      a.v = kernels::Activation{proj + 2 * HK * as_, ps};
      a.beta = kernels::Activation{proj + (2 * HK + VW) * as_, ps};
      a.g = kernels::Activation{(*part.g)[l]->data(), part.gate_width};
      a.num_tokens = T;
      a.out = (*part.out)[l]->data();
      a.state = kernels::StatePool{(*part.pool)[l]->data(), stock_blocks_, VW * K_};
      if (!gdn_) {
        const float* params = static_cast<const float*>((*part.params)[l]->data());
        a.params = kernels::LayerParams{params, params + part.heads};
      }
      a.num_rows = R_;
      a.query_start_loc = meta.qsl;
      a.ssm_state_indices = kernels::IndexMatrix{meta.indices, Q_, Q_};
      a.num_accepted_tokens = meta.acc;
      a.workspace = meta.workspace;
      a.workspace_bytes = kernels::StockWorkspaceBytes(stock_blocks_);
      a.status = meta.status;
      absl::Status st = stock_->Stock(a, nullptr);
      if (!st.ok()) return st;
      kernels::DeviceStatus host;
      st = memory_->CopyOut(&host, meta.status, sizeof(host));
      if (!st.ok()) return st;
      st = kernels::DeviceStatusToStatus(host, "the simulator's stock path");
      if (!st.ok()) return st;
    }
    return absl::OkStatus();
  }

  Client& client_;
  const SimulationOptions options_;
  std::mt19937_64 rng_;
  const int rank_;  // tensor parallelism: this service's rank, of tp_
  const int tp_;
  SimulationReport report_;
  Latencies latencies_;

  v1::Layout layout_;
  int L_ = 0, H_ = 0, K_ = 0, Q_ = 0, D_ = 0, W_ = 0, hl_ = 0, B_ = 0, R_ = 0, bs_ = 0;
  bool align_ = false;
  bool deferred_ = false;  // the service's commit mode is DEFERRED
  // DEFERRED: per request slot, its block whose tokens are pending, and per
  // layer the stock state (this rank's part; under TP also the TP=1 run's)
  // it must hold once materialized; whether each layer already is (ReadState).
  struct Pending {
    int32_t block = 0;  // 0: nothing pending
    int step = 0;
    std::vector<std::vector<char>> state, tp1_state;
    std::vector<bool> materialized;
  };
  std::vector<Pending> pending_;
  std::vector<std::vector<std::vector<char>>> checkpoints_;  // [slot][layer], before Commit
  std::mt19937_64 deferred_rng_;  // its own draws: EAGER's simulation stays the same
  DType act_ = DType::kBFloat16, state_ = DType::kFloat32;
  int64_t as_ = 2, ss_ = 4, HK_ = 0, state_block_bytes_ = 0;
  // Gated DeltaNet: HV value heads, g a log-decay per value head.
  bool gdn_ = false;
  int HV_ = 0;
  int64_t VW_ = 0, GW_ = 0;  // v and o, and g, per token (elements)
  // The whole model's: tp_ times this service's heads, value heads and conv
  // channels (the same as this service's with one rank).
  int FH_ = 0, FHV_ = 0, FD_ = 0;
  int64_t FHK_ = 0, FVW_ = 0, FGW_ = 0, full_proj_stride_ = 0;
  // g's shape for T tokens: KDA [T, H, K], GDN [T, HV].
  std::vector<int64_t> GateShape(int64_t t) const {
    return gdn_ ? std::vector<int64_t>{t, HV_} : std::vector<int64_t>{t, H_, K_};
  }
  int64_t conv_block_stride_ = 0, conv_dim_stride_ = 0, conv_token_stride_ = 0;
  int width_ = 1;
  int64_t tmax_ = 0, proj_stride_ = 0;
  int batch_max_ = 0;
  int64_t meta_ints_ = 0;
  int door_ = 0;
  int64_t stock_blocks_ = 0;

  const kernels::KdaKernels* stock_ = nullptr;
  std::unique_ptr<SharedMemory> memory_;
  std::unique_ptr<MappedPools> pools_;
  std::unique_ptr<Session> session_;
  std::vector<std::unique_ptr<SharedBuffer>> proj_, g_, o_, stock_pool_, stock_out_, stock_params_;
  // Tensor parallelism: the TP=1 run's inputs, outputs, state blocks and
  // parameters, per layer (none with one rank).
  std::vector<std::unique_ptr<SharedBuffer>> full_proj_, full_g_, full_out_, full_pool_,
      full_params_;
  std::unique_ptr<SharedBuffer> meta_, stock_meta_;
  std::vector<int32_t> free_blocks_;
  std::vector<Request> requests_;
  std::unique_ptr<IpcEvent> inputs_ready_, work_done_;
};

// Tensor parallelism: the ranks' progress, passed on once every rank has
// done a step.
class MergedProgress {
 public:
  MergedProgress(int ranks, std::function<void(const SimulationProgress&)> progress)
      : latest_(ranks), progress_(std::move(progress)) {}

  std::function<void(const SimulationProgress&)> ForRank(int rank) {
    if (!progress_) return nullptr;
    return [this, rank](const SimulationProgress& p) {
      absl::MutexLock lock(&mu_);
      latest_[rank] = p;
      SimulationProgress all = p;
      all.comparisons = all.mismatches = 0;
      for (const SimulationProgress& q : latest_) {
        all.step = std::min(all.step, q.step);
        all.comparisons += q.comparisons;
        all.mismatches += q.mismatches;
      }
      if (all.step <= reported_) return;
      reported_ = all.step;
      progress_(all);
    };
  }

 private:
  absl::Mutex mu_;
  std::vector<SimulationProgress> latest_ ABSL_GUARDED_BY(mu_);
  int reported_ ABSL_GUARDED_BY(mu_) = 0;
  const std::function<void(const SimulationProgress&)> progress_;
};

// What rank r of `layout`'s model holds, for the report.
std::string RankPart(int r, int ranks, const v1::Layout& layout, const std::string& address) {
  const int h = layout.num_heads();
  const int hv = layout.num_value_heads() > 0 ? layout.num_value_heads() : h;
  const int d = layout.conv_dim();
  const std::string where = layout.backend() == v1::CUDA
                                ? absl::StrCat("CUDA device ", layout.device())
                                : std::string("CPU");
  return absl::StrFormat(
      "rank %d at %s (%s): heads %d-%d of %d, value heads %d-%d of %d, conv channels %d-%d of %d",
      r, address, where, r * h,
      (r + 1) * h - 1, ranks * h, r * hv, (r + 1) * hv - 1, ranks * hv, r * d, (r + 1) * d - 1,
      ranks * d);
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
  if (options.steps < 1) return absl::InvalidArgumentError("steps must be >= 1");
  if (options.crash_after_verify_step >= 0 || options.abandon_commit_at_step >= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the crash tests (crash_after_verify_step, abandon_commit_at_step) drive one service, "
        "not ", tp, " ranks"));
  }
  if (options.drill != nullptr) {
    return absl::InvalidArgumentError("a restart drill drives one service, not ranks");
  }
  if (options.corrupt_rank < 0 || options.corrupt_rank >= tp) {
    return absl::InvalidArgumentError(absl::StrCat("corrupt_rank = ", options.corrupt_rank,
                                                   " is not a rank: there are ", tp));
  }
  std::vector<v1::Layout> layouts;
  std::vector<std::string> addresses;
  for (int r = 0; r < tp; ++r) {
    absl::StatusOr<v1::Layout> layout = ranks[r]->GetLayout();
    if (!layout.ok()) {
      return absl::Status(layout.status().code(), absl::StrCat("rank ", r, " (", ranks[r]->address(),
                                                               "): ", layout.status().message()));
    }
    layouts.push_back(*std::move(layout));
    addresses.push_back(ranks[r]->address());
  }
  absl::Status st = CheckRankLayouts(layouts, addresses);
  if (!st.ok()) return st;

  // One worker per rank, as a tensor-parallel scheduler runs one per GPU
  // (on CUDA each thread's current device is its rank's: SharedMemory).
  MergedProgress progress(tp, options.progress);
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
  for (int r = 0; r < tp; ++r) {
    if (!reports[r].ok()) {
      return absl::Status(reports[r].status().code(),
                          absl::StrCat("rank ", r, " (", addresses[r], "): ",
                                       reports[r].status().message()));
    }
  }

  // One report: the steps every rank ran (the same), the ranks' sums.
  SimulationReport merged = *reports[0];
  merged.tensor_parallel = tp;
  merged.state_bytes_saved = merged.comparisons = merged.mismatches = 0;
  merged.tp1_comparisons = merged.tp1_mismatches = 0;
  merged.first_mismatch.clear();
  Latencies latencies;
  for (int r = 0; r < tp; ++r) {
    const SimulationReport& rr = *reports[r];
    const SimulationReport& r0 = *reports[0];
    if (rr.rows != r0.rows || rr.null_rows != r0.null_rows ||
        rr.tokens_verified != r0.tokens_verified || rr.tokens_accepted != r0.tokens_accepted ||
        rr.requests_started != r0.requests_started ||
        rr.requests_finished != r0.requests_finished || rr.boundary_states != r0.boundary_states) {
      return absl::InternalError(absl::StrCat(
          "rank ", r, " ran other steps than rank 0 (its rows, tokens or requests differ): the "
          "ranks' draws diverged, a bug of the simulator"));
    }
    merged.state_bytes_saved += rr.state_bytes_saved;
    merged.comparisons += rr.comparisons;
    merged.mismatches += rr.mismatches;
    merged.tp1_comparisons += rr.tp1_comparisons;
    merged.tp1_mismatches += rr.tp1_mismatches;
    if (merged.first_mismatch.empty() && !rr.first_mismatch.empty()) {
      merged.first_mismatch = absl::StrCat("rank ", r, ": ", rr.first_mismatch);
    }
    latencies.Add(sims[r]->latencies());
    merged.ranks.push_back(RankPart(r, tp, layouts[r], addresses[r]));
  }
  merged.latency = latencies.Summaries();
  return merged;
}

std::string FormatReport(const SimulationReport& r) {
  std::string out = absl::StrFormat(
      "steps %d on the %s backend, %d layers: %d rows (%d null), %d tokens verified, %d accepted\n"
      "requests: %d started, %d finished; %d boundary states (align mode)\n"
      "memory saved against the stock path: %d bytes of recurrent state\n",
      r.steps, r.backend, r.layers, r.rows, r.null_rows, r.tokens_verified, r.tokens_accepted,
      r.requests_started, r.requests_finished, r.boundary_states, r.state_bytes_saved);
  if (r.deferred) {
    out += absl::StrFormat(
        "commit mode DEFERRED: %d blocks held their checkpoint after Commit; materialized by "
        "Verify %d, by Flush %d, by ReadState %d (layer, block); %d discarded at a request's end\n",
        r.pending_checked, r.materialized_by_verify, r.materialized_by_flush,
        r.materialized_by_read, r.discarded);
  }
  if (r.tensor_parallel > 1) {
    out += absl::StrFormat("tensor parallelism: TP=%d, one service per rank\n", r.tensor_parallel);
    for (const std::string& rank : r.ranks) out += absl::StrCat("  ", rank, "\n");
  }
  if (!r.restart_summary.empty()) {
    out += absl::StrFormat(
        "restart drill: %s; %d steps re-run, %d blocks reported lost (and re-prefilled)\n",
        r.restart_summary, r.steps_rerun, r.lost_blocks);
  }
  out += "latency per RPC (us):           calls      p50      p99     mean\n";
  for (const auto& [rpc, s] : r.latency) {
    out += absl::StrFormat("  %-28s %7d %8.1f %8.1f %8.1f\n", rpc, s.count, s.p50_us, s.p99_us,
                           s.mean_us);
  }
  if (r.passed() && r.tensor_parallel > 1) {
    out += absl::StrFormat(
        "verdict: PASS: %d comparisons, every output, state and conv window of the %d ranks "
        "bit-identical to the stock path, and every head's committed state and output to the "
        "TP=1 run's (%d of the comparisons)\n",
        r.comparisons, r.tensor_parallel, r.tp1_comparisons);
  } else if (r.passed()) {
    out += absl::StrFormat(
        "verdict: PASS: %d comparisons, every output, state and conv window bit-identical to "
        "the stock path%s\n",
        r.comparisons,
        r.restarts > 0 ? absl::StrFormat(", across %d restarts of the service", r.restarts) : "");
  } else if (r.comparisons == 0) {
    out += "verdict: FAIL: nothing was compared\n";
  } else if (r.mismatches == 0) {  // tensor parallelism, no TP=1 comparison
    out += "verdict: FAIL: nothing was compared with the TP=1 run\n";
  } else {
    const std::string tp1 =
        r.tensor_parallel > 1
            ? absl::StrFormat(" (%d of %d against the TP=1 run)", r.tp1_mismatches,
                              r.tp1_comparisons)
            : "";
    out += absl::StrFormat("verdict: FAIL: %d of %d comparisons differ%s; first: %s\n",
                           r.mismatches, r.comparisons, tp1, r.first_mismatch);
  }
  return out;
}

}  // namespace client
}  // namespace specstate
