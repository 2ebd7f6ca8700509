#include "client/simulator/fast_checker.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/simulator/host_bytes.h"
#include "kernels/fast/contract_errors.h"
#include "server/base/fnv1a.h"

namespace specstate {
namespace client {
namespace simulator_internal {
namespace {

using ::specstate::kernels::fast::ElementwiseError;
using ::specstate::kernels::fast::MaxError;
using ::specstate::kernels::fast::NormError;

// The quantities of the contract, in the report's arrays.
enum Quantity { kOutElem = 0, kOutNorm = 1, kStateElem = 2, kStateNorm = 3 };
constexpr const char* kQuantityNames[4] = {"output, element-wise", "output, norm-wise",
                                           "state, element-wise", "state, norm-wise"};

// `count` elements of `dtype` from host bytes, as doubles.
std::vector<double> AsDoubles(const char* p, int64_t count, DType dtype) {
  const int64_t size = DTypeSize(dtype);
  std::vector<double> out(count);
  for (int64_t i = 0; i < count; ++i) out[i] = ElementAsFloat(p + i * size, dtype);
  return out;
}

int32_t ReferenceBlock(const Dims& d, int slot, int col) { return 1 + slot * d.Q + col; }

double Bound(double exact) { return kFastContractFactor * std::max(exact, kFastContractFloor); }

ModePhases FastPhases() {
  ModePhases phases;
  phases.pending_blocks = true;
  phases.drill_keeps_pending = true;  // the rings are kept with the pools
  phases.corrupt_whole_block = true;
  return phases;
}

}  // namespace

FastChecker::FastChecker(SharedMemory& memory, const ServicePools& pools, const StockPath& stock,
                         const LayerBuffers& outputs, const Model& model, const Dims& dims,
                         SimulationReport& report, Tp1Checks* tp1)
    : ModeChecker(FastPhases(), memory, pools, stock, outputs, model, dims, report, tp1),
      params_(dims.L),
      pools64_(dims.L),
      out64_(dims.L),
      written64_(dims.L),
      pending_(dims.R, 0),
      current_(dims.R, std::vector<std::vector<char>>(dims.L)) {
  report_.fast = true;
  shape_.heads = d_.H;
  shape_.head_dim = d_.K;
  shape_.lower_bound = d_.lower_bound;
  shape_.kind = d_.gdn ? reference::Kind::kGdn : reference::Kind::kKda;
  shape_.value_heads = d_.HV;
  shape_.plain_gate = d_.plain_gate;
}

void FastChecker::LoadParams(int layer, const GateParams& params) {
  const float* a_log = reinterpret_cast<const float*>(params.a_log.data());
  const float* dt_bias = reinterpret_cast<const float*>(params.dt_bias.data());
  params_[layer].a_log.assign(a_log, a_log + d_.H);
  params_[layer].dt_bias.assign(dt_bias, dt_bias + d_.HK);
}

void FastChecker::StartRequest(int layer, int slot, const PrefillLayer& prefill) {
  pools64_[layer][ReferenceBlock(d_, slot, 0)] = AsDoubles(prefill.state(), d_.VW * d_.K, d_.state);
}

void FastChecker::RunReference(int layer, const LayerInputs& inputs,
                               const std::vector<Request>& requests,
                               const std::vector<int32_t>& qsl, int64_t num_tokens) {
  // proj = [q | k | v | beta] per token, as the service reads it.
  reference::Tokens tokens;
  tokens.count = num_tokens;
  const int64_t as = d_.as, HK = d_.HK, VW = d_.VW;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const char* row = inputs.proj.data() + t * d_.proj_stride * as;
    auto append = [&](std::vector<double>* to, int64_t from, int64_t count) {
      const std::vector<double> x = AsDoubles(row + from * as, count, d_.act);
      to->insert(to->end(), x.begin(), x.end());
    };
    append(&tokens.q, 0, HK);
    append(&tokens.k, HK, HK);
    append(&tokens.v, 2 * HK, VW);
    append(&tokens.beta, 2 * HK + VW, d_.HV);
  }
  tokens.g = AsDoubles(inputs.g.data(), num_tokens * d_.GW, d_.act);

  reference::StockCall call;
  call.query_start_loc = qsl;
  call.ssm_state_indices.assign(d_.R, std::vector<int32_t>(d_.Q, reference::kNullBlock));
  call.num_accepted_tokens.assign(d_.R, 1);
  for (int i = 0; i < d_.R; ++i) {
    if (!requests[i].live) continue;
    for (int c = 0; c < d_.Q; ++c) call.ssm_state_indices[i][c] = ReferenceBlock(d_, i, c);
    call.num_accepted_tokens[i] = requests[i].acc_prev;
  }
  reference::StockResult r =
      reference::Stock(shape_, params_[layer], tokens, call, &pools64_[layer]);
  out64_[layer] = std::move(r.out);
  written64_[layer] = std::move(r.written);
}

absl::Status FastChecker::CompareOutputs(const StepPlan& p) {
  const int64_t T = p.num_tokens, VW = d_.VW, as = d_.as;
  for (int l = 0; l < d_.L; ++l) {
    std::vector<char> service(T * VW * as), stock(T * VW * as);
    absl::Status st = memory_.CopyOut(service.data(), outputs_[l]->data(), service.size());
    if (st.ok()) st = memory_.CopyOut(stock.data(), stock_.Output(l).data(), stock.size());
    if (!st.ok()) return st;
    // The tokens of live rows: the others have no outputs.
    std::vector<double> got, exact, want;
    for (int64_t t = 0; t < T; ++t) {
      if (!written64_[l][t]) continue;
      const std::vector<double> g = AsDoubles(service.data() + t * VW * as, VW, d_.act);
      const std::vector<double> e = AsDoubles(stock.data() + t * VW * as, VW, d_.act);
      got.insert(got.end(), g.begin(), g.end());
      exact.insert(exact.end(), e.begin(), e.end());
      want.insert(want.end(), out64_[l].begin() + t * VW, out64_[l].begin() + (t + 1) * VW);
    }
    if (want.empty()) continue;
    Measure(got, exact, want, /*state=*/false,
            absl::StrFormat("step %d, layer %d: Verify's outputs", p.step, l));
  }
  return absl::OkStatus();
}

bool FastChecker::StartsPending(const StepPlan& p, int slot, const CommittedBlocks& c) {
  const bool stays = c.final_block == p.checkpoint[slot] && c.boundary_block <= 0;
  pending_[slot] = stays ? c.final_block : 0;
  if (stays) ++report_.pending_checked;
  return stays;
}

// A pending row's committed state (the stock path's, column acc - 1), kept
// for a restart drill's re-prefill of its block.
absl::Status FastChecker::CheckPending(const StepPlan& p, int slot, int layer) {
  std::vector<char>& state = current_[slot][layer];
  state.resize(d_.state_block_bytes);
  return memory_.CopyOut(state.data(), stock_.Block(layer, slot, p.accepted[slot] - 1),
                         state.size());
}

std::vector<ModeChecker::Expected> FastChecker::Expectations() const {
  std::vector<Expected> out;
  for (int i = 0; i < d_.R; ++i) {
    if (pending_[i] > 0) out.push_back(Expected{i, pending_[i], current_[i]});
  }
  return out;
}

absl::Status FastChecker::CompareStates(int step, int layer, int slot, int32_t block, int col,
                                        absl::string_view what) {
  std::vector<char> service;
  absl::Status st = pools_.ReadState(layer, block, &service);
  if (!st.ok()) return st;
  return MeasureState(step, layer, slot, block, col, service, what);
}

absl::Status FastChecker::MeasureState(int step, int layer, int slot, int32_t block, int col,
                                       const std::vector<char>& service, absl::string_view what) {
  std::vector<char> stock(d_.state_block_bytes);
  absl::Status st = memory_.CopyOut(stock.data(), stock_.Block(layer, slot, col), stock.size());
  if (!st.ok()) return st;
  const int64_t n = d_.VW * d_.K;
  ++report_.fast_states_checked;
  Measure(AsDoubles(service.data(), n, d_.state), AsDoubles(stock.data(), n, d_.state),
          pools64_[layer].at(ReferenceBlock(d_, slot, col)), /*state=*/true,
          absl::StrFormat("step %d, layer %d, row %d: the %s in block %d", step, layer, slot,
                          std::string(what), block));
  return absl::OkStatus();
}

absl::Status FastChecker::CheckFlushed(const std::vector<int32_t>& blocks, int step,
                                       absl::string_view how) {
  for (int i = 0; i < d_.R; ++i) {
    const int32_t b = pending_[i];
    if (b <= 0) continue;
    if (!blocks.empty() && std::find(blocks.begin(), blocks.end(), b) == blocks.end()) continue;
    ++report_.materialized_by_flush;
    const int col = model_.requests()[i].acc_prev - 1;
    for (int l = 0; l < d_.L; ++l) {
      absl::Status st =
          CompareStates(step, l, i, b, col, absl::StrCat("state materialized by ", how));
      if (!st.ok()) return st;
    }
    pending_[i] = 0;
  }
  return absl::OkStatus();
}

absl::Status FastChecker::CheckRead(int step, int slot, int layer,
                                    const v1::ReadStateResponse& read) {
  const int32_t block = pending_[slot];
  // The state ReadState folded into a copy, from its values (the pool keeps
  // the checkpoint; the block stays pending in every layer).
  const std::vector<char> service =
      BytesOfValues(read.recurrent().values().data(), read.recurrent().values_size(), d_.state);
  ++report_.materialized_by_read;
  tally_.Count();
  if (static_cast<int64_t>(service.size()) != d_.state_block_bytes ||
      read.recurrent().checksum() !=
          server::Fnv1a(absl::string_view(service.data(), service.size()))) {
    tally_.Mismatch(absl::StrFormat(
        "step %d, layer %d, row %d: ReadState's checksum of block %d is not that of the %d "
        "values it returned",
        step, layer, slot, block, read.recurrent().values_size()));
    return absl::OkStatus();
  }
  return MeasureState(step, layer, slot, block, model_.requests()[slot].acc_prev - 1, service,
                      "state ReadState materialized (a copy)");
}

void FastChecker::Discarded(int slot) {
  pending_[slot] = 0;
  ++report_.discarded;
}

void FastChecker::Measure(const std::vector<double>& got, const std::vector<double>& exact,
                          const std::vector<double>& want, bool state, const std::string& what) {
  tally_.Count();
  const int base = state ? kStateElem : kOutElem;
  const double fast_errors[2] = {ElementwiseError(got, want), NormError(got, want)};
  const double exact_errors[2] = {ElementwiseError(exact, want), NormError(exact, want)};
  for (int k = 0; k < 2; ++k) {
    double& f = report_.fast_error[base + k];
    double& e = report_.exact_error[base + k];
    f = MaxError(f, fast_errors[k]);  // a NaN stays and fails the verdict
    e = MaxError(e, exact_errors[k]);
    const double ratio = fast_errors[k] / std::max(exact_errors[k], kFastContractFloor);
    if (ratio > worst_ratio_[base + k] || !std::isfinite(fast_errors[k])) {
      worst_ratio_[base + k] = std::isfinite(ratio) ? ratio : INFINITY;
      worst_[base + k] =
          absl::StrFormat("%s: FAST %.3g, exact %.3g", what, fast_errors[k], exact_errors[k]);
    }
  }
}

void FastChecker::Verdict() {
  for (int q = 0; q < 4; ++q) {
    const double f = report_.fast_error[q], e = report_.exact_error[q];
    if (std::isfinite(f) && f <= Bound(e)) continue;
    tally_.Mismatch(absl::StrFormat(
        "the accuracy contract is broken (%s): FAST's largest error against the float64 "
        "reference is %.3g, more than %.0fx the exact path's %.3g (floor %.0e); the worst "
        "comparison: %s",
        kQuantityNames[q], f, kFastContractFactor, e, kFastContractFloor, worst_[q]));
  }
}

}  // namespace simulator_internal
}  // namespace client
}  // namespace specstate
