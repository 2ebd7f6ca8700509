#include "client/simulator/stock_path.h"

#include <utility>

namespace specstate {
namespace client {
namespace simulator_internal {

absl::StatusOr<const kernels::KdaKernels*> StockKernels(v1::Backend backend) {
  if (backend == v1::CUDA) return kernels::CudaKdaKernels();
  return &kernels::CpuKdaKernels();
}

// What one run of the stock kernel over every layer reads and writes: this
// service's part of the model (its stock path), or under tensor parallelism
// the whole model (the TP=1 run).
struct StockPath::Part {
  int heads = 0, value_heads = 0;
  int64_t proj_stride = 0, gate_width = 0;  // elements per token
  const LayerBuffers* proj;
  const LayerBuffers* g;
  const LayerBuffers* out;
  const LayerBuffers* pool;
  const LayerBuffers* params;
};

// The stock kernel's index inputs, workspace and status (in meta_).
struct StockPath::Metadata {
  const int32_t* qsl;
  const int32_t* indices;
  const int32_t* acc;
  char* workspace;
  kernels::DeviceStatus* status;
};

StockPath::StockPath(SharedMemory& memory, const kernels::KdaKernels& kernels, const Dims& dims)
    : memory_(memory), kernels_(kernels), d_(dims) {}

absl::Status StockPath::AllocateInto(LayerBuffers* list, uint64_t bytes) {
  absl::StatusOr<std::unique_ptr<SharedBuffer>> buf = memory_.Allocate(bytes);
  if (!buf.ok()) return buf.status();
  list->push_back(*std::move(buf));
  return absl::OkStatus();
}

absl::Status StockPath::Allocate() {
  blocks_ = 1 + int64_t{d_.R} * d_.Q;
  for (int l = 0; l < d_.L; ++l) {
    absl::Status st = AllocateInto(&pool_, blocks_ * d_.state_block_bytes);
    if (st.ok()) st = AllocateInto(&out_, d_.tmax * d_.VW * d_.as);
    if (!st.ok()) return st;
  }
  const uint64_t meta_bytes = 4 * (int64_t{d_.R} * d_.Q + d_.R + d_.R + 1) +
                              kernels::StockWorkspaceBytes(blocks_) +
                              sizeof(kernels::DeviceStatus) + 256;
  absl::StatusOr<std::unique_ptr<SharedBuffer>> meta = memory_.Allocate(meta_bytes);
  if (!meta.ok()) return meta.status();
  meta_ = *std::move(meta);
  // Tensor parallelism: the TP=1 run's (the whole model's; it shares the
  // stock path's metadata).
  for (int l = 0; l < d_.L && d_.tp > 1; ++l) {
    absl::Status st = AllocateInto(&full_proj_, d_.tmax * d_.full_proj_stride * d_.as);
    if (st.ok()) st = AllocateInto(&full_g_, d_.tmax * d_.FGW * d_.as);
    if (st.ok()) st = AllocateInto(&full_pool_, blocks_ * d_.FVW * d_.K * d_.ss);
    if (st.ok()) st = AllocateInto(&full_out_, d_.tmax * d_.FVW * d_.as);
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

// [a_log | dt_bias] floats in a buffer of their own.
absl::Status StockPath::AllocateParams(LayerBuffers* list, const std::vector<char>& a_log,
                                       const std::vector<char>& dt_bias) {
  absl::StatusOr<std::unique_ptr<SharedBuffer>> p = memory_.Allocate(a_log.size() + dt_bias.size());
  if (!p.ok()) return p.status();
  absl::Status st = memory_.CopyIn((*p)->data(), a_log.data(), a_log.size());
  if (st.ok()) {
    st = memory_.CopyIn(static_cast<char*>((*p)->data()) + a_log.size(), dt_bias.data(),
                        dt_bias.size());
  }
  if (!st.ok()) return st;
  list->push_back(*std::move(p));
  return absl::OkStatus();
}

absl::Status StockPath::LoadParams(const GateParams& params) {
  absl::Status st = AllocateParams(&params_, params.a_log, params.dt_bias);
  if (st.ok() && d_.tp > 1) {  // the TP=1 run's: every head's
    st = AllocateParams(&full_params_, params.model_a_log, params.model_dt_bias);
  }
  return st;
}

char* StockPath::Block(int layer, int slot, int col) const {
  return static_cast<char*>(pool_[layer]->data()) +
         (1 + int64_t{slot} * d_.Q + col) * d_.state_block_bytes;
}

char* StockPath::ModelBlock(int layer, int slot, int col) const {
  return static_cast<char*>(full_pool_[layer]->data()) +
         (1 + int64_t{slot} * d_.Q + col) * d_.FVW * d_.K * d_.ss;
}

absl::Status StockPath::StartRequest(int layer, int slot, const PrefillLayer& prefill) {
  absl::Status st = memory_.CopyIn(Block(layer, slot, 0), prefill.state(), d_.state_block_bytes);
  if (st.ok() && d_.tp > 1) {
    st = memory_.CopyIn(ModelBlock(layer, slot, 0), prefill.model_state.data(),
                        prefill.model_state.size());
  }
  return st;
}

absl::Status StockPath::PoisonOutput(int layer, const std::vector<char>& poison) {
  return memory_.CopyIn(out_[layer]->data(), poison.data(), d_.tmax * d_.VW * d_.as);
}

absl::Status StockPath::WriteModelInputs(int layer, const LayerInputs& model,
                                         const std::vector<char>& poison) {
  absl::Status st = memory_.CopyIn(full_proj_[layer]->data(), model.proj.data(), model.proj.size());
  if (st.ok()) st = memory_.CopyIn(full_g_[layer]->data(), model.g.data(), model.g.size());
  if (st.ok()) st = memory_.CopyIn(full_out_[layer]->data(), poison.data(), poison.size());
  return st;
}

absl::Status StockPath::Run(const LayerBuffers& proj, const LayerBuffers& g,
                            const std::vector<Request>& requests, const std::vector<int32_t>& qsl,
                            int64_t num_tokens) {
  absl::StatusOr<Metadata> meta = WriteMetadata(requests, qsl);
  if (!meta.ok()) return meta.status();
  absl::Status st = RunPart(
      Part{d_.H, d_.HV, d_.proj_stride, d_.GW, &proj, &g, &out_, &pool_, &params_}, *meta,
      num_tokens);
  if (st.ok() && d_.tp > 1) {  // the TP=1 run: every head of the model
    st = RunPart(Part{d_.FH, d_.FHV, d_.full_proj_stride, d_.FGW, &full_proj_, &full_g_,
                      &full_out_, &full_pool_, &full_params_},
                 *meta, num_tokens);
  }
  return st;
}

// ssm_state_indices [R, Q]: the slot's stock columns (null rows: all 0),
// num_accepted_tokens [R], query_start_loc [R + 1], in meta_.
absl::StatusOr<StockPath::Metadata> StockPath::WriteMetadata(const std::vector<Request>& requests,
                                                             const std::vector<int32_t>& qsl) {
  const int R = d_.R, Q = d_.Q;
  std::vector<int32_t> indices(int64_t{R} * Q, 0), acc(R, 1);
  for (int i = 0; i < R; ++i) {
    if (!requests[i].live) continue;
    for (int c = 0; c < Q; ++c) indices[int64_t{i} * Q + c] = static_cast<int32_t>(1 + i * Q + c);
    acc[i] = requests[i].acc_prev;
  }
  char* base = static_cast<char*>(meta_->data());
  int32_t* d_indices = reinterpret_cast<int32_t*>(base);
  int32_t* d_acc = d_indices + int64_t{R} * Q;
  int32_t* d_qsl = d_acc + R;
  char* workspace = base + ((4 * (int64_t{R} * Q + 2 * R + 1) + 255) / 256) * 256;
  auto* status = reinterpret_cast<kernels::DeviceStatus*>(
      workspace + kernels::StockWorkspaceBytes(blocks_));
  absl::Status st = memory_.CopyIn(d_indices, indices.data(), indices.size() * 4);
  if (st.ok()) st = memory_.CopyIn(d_acc, acc.data(), acc.size() * 4);
  if (st.ok()) st = memory_.CopyIn(d_qsl, qsl.data(), qsl.size() * 4);
  if (!st.ok()) return st;
  return Metadata{d_qsl, d_indices, d_acc, workspace, status};
}

kernels::StockArgs StockPath::Args(const Part& part, const Metadata& meta, int layer,
                                   int64_t num_tokens) const {
  const int64_t HK = int64_t{part.heads} * d_.K;
  const int64_t VW = int64_t{part.value_heads} * d_.K;
  const int64_t as = d_.as;
  kernels::StockArgs a;
  a.shape.num_heads = part.heads;
  a.shape.head_dim = d_.K;
  a.shape.act_dtype = d_.act;
  a.shape.state_dtype = d_.state;
  a.shape.lower_bound = d_.lower_bound;
  a.shape.kind = d_.gdn ? kernels::LayerKind::kGdn : kernels::LayerKind::kKda;
  a.shape.num_value_heads = part.value_heads;
  a.shape.gate = d_.plain_gate ? kernels::KdaGate::kPlain : kernels::KdaGate::kSafe;
  const char* proj = static_cast<const char*>((*part.proj)[layer]->data());
  const int64_t ps = part.proj_stride;
  a.q = kernels::Activation{proj, ps};
  a.k = kernels::Activation{proj + HK * as, ps};
  a.v = kernels::Activation{proj + 2 * HK * as, ps};
  a.beta = kernels::Activation{proj + (2 * HK + VW) * as, ps};
  a.g = kernels::Activation{(*part.g)[layer]->data(), part.gate_width};
  a.num_tokens = num_tokens;
  a.out = (*part.out)[layer]->data();
  a.state = kernels::StatePool{(*part.pool)[layer]->data(), blocks_, VW * d_.K};
  if (!d_.gdn) {
    const float* params = static_cast<const float*>((*part.params)[layer]->data());
    a.params = kernels::LayerParams{params, params + part.heads};
  }
  a.num_rows = d_.R;
  a.query_start_loc = meta.qsl;
  a.ssm_state_indices = kernels::IndexMatrix{meta.indices, d_.Q, d_.Q};
  a.num_accepted_tokens = meta.acc;
  a.workspace = meta.workspace;
  a.workspace_bytes = kernels::StockWorkspaceBytes(blocks_);
  a.status = meta.status;
  return a;
}

absl::Status StockPath::RunPart(const Part& part, const Metadata& meta, int64_t num_tokens) {
  for (int l = 0; l < d_.L; ++l) {
    // Alive until the kernel's status is read (which waits for the kernel).
    const kernels::StockArgs args = Args(part, meta, l, num_tokens);
    absl::Status st = kernels_.Stock(args, nullptr);
    if (!st.ok()) return st;
    kernels::DeviceStatus host;
    st = memory_.CopyOut(&host, meta.status, sizeof(host));
    if (!st.ok()) return st;
    st = kernels::DeviceStatusToStatus(host, "the simulator's stock path");
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

}  // namespace simulator_internal
}  // namespace client
}  // namespace specstate
