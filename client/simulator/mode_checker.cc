#include "client/simulator/mode_checker.h"

#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/str_format.h"
#include "client/simulator/deferred_checker.h"
#include "client/simulator/fast_checker.h"
#include "client/simulator/host_bytes.h"

namespace specstate {
namespace client {
namespace simulator_internal {
namespace {

// EAGER: ModeChecker's checks as they stand, and none of the phases.
class EagerChecker final : public ModeChecker {
 public:
  EagerChecker(SharedMemory& memory, const ServicePools& pools, const StockPath& stock,
               const LayerBuffers& outputs, const Model& model, const Dims& dims,
               SimulationReport& report, Tp1Checks* tp1)
      : ModeChecker(ModePhases(), memory, pools, stock, outputs, model, dims, report, tp1) {}
};

}  // namespace

std::unique_ptr<ModeChecker> MakeModeChecker(SharedMemory& memory, const ServicePools& pools,
                                             const StockPath& stock, const LayerBuffers& outputs,
                                             const Model& model, const Dims& dims,
                                             SimulationReport& report, Tp1Checks* tp1) {
  if (dims.deferred) {
    return std::make_unique<DeferredChecker>(memory, pools, stock, outputs, model, dims, report,
                                             tp1);
  }
  if (dims.fast) {
    return std::make_unique<FastChecker>(memory, pools, stock, outputs, model, dims, report, tp1);
  }
  return std::make_unique<EagerChecker>(memory, pools, stock, outputs, model, dims, report, tp1);
}

ModeChecker::ModeChecker(const ModePhases& phases, SharedMemory& memory, const ServicePools& pools,
                         const StockPath& stock, const LayerBuffers& outputs, const Model& model,
                         const Dims& dims, SimulationReport& report, Tp1Checks* tp1)
    : memory_(memory),
      pools_(pools),
      stock_(stock),
      outputs_(outputs),
      model_(model),
      d_(dims),
      report_(report),
      tally_(report),
      tp1_(tp1),
      phases_(phases) {}

absl::Status ModeChecker::CompareOutputs(const StepPlan& p) {
  const int64_t T = p.num_tokens;
  const int64_t as = d_.as, VW = d_.VW, K = d_.K;
  for (int l = 0; l < d_.L; ++l) {
    std::vector<char> service(T * VW * as), stock(T * VW * as);
    absl::Status st = memory_.CopyOut(service.data(), outputs_[l]->data(), service.size());
    if (st.ok()) st = memory_.CopyOut(stock.data(), stock_.Output(l).data(), stock.size());
    if (!st.ok()) return st;
    tally_.Count();
    if (std::memcmp(service.data(), stock.data(), service.size()) == 0) continue;
    const int64_t e = FirstDifference(service.data(), stock.data(), as);
    tally_.Mismatch(absl::StrFormat(
        "step %d, layer %d: Verify's output differs from the stock kernel's at token %d, "
        "head %d, column %d: %.9g vs %.9g",
        p.step, l, e / VW, (e / K) % d_.HV, e % K, ElementAsFloat(service.data() + e * as, d_.act),
        ElementAsFloat(stock.data() + e * as, d_.act)));
  }
  return tp1_ != nullptr ? tp1_->CompareOutputs(p) : absl::OkStatus();
}

absl::Status ModeChecker::CheckRecordedBlocks(const StepPlan& p, const int32_t* recorded) {
  std::vector<int32_t> out(2 * d_.batch_max);
  absl::Status st = memory_.CopyOut(out.data(), recorded, out.size() * 4);
  if (!st.ok()) return st;
  for (int i = 0; i < d_.R; ++i) {
    const Request& r = model_.requests()[i];
    const int32_t want_idx = r.live ? model_.FinalColumn(r, p.accepted[i]) : -7;
    const int32_t want_acc = r.live ? 1 : -7;
    tally_.Count();
    if (out[i] != want_idx || out[d_.batch_max + i] != want_acc) {
      tally_.Mismatch(absl::StrFormat(
          "step %d, row %d: RecordStateBlocks wrote state_idx %d, num_accepted %d; expected "
          "%d, %d",
          p.step, i, out[i], out[d_.batch_max + i], want_idx, want_acc));
    }
  }
  return absl::OkStatus();
}

absl::Status ModeChecker::CompareCommitted(const StepPlan& p) {
  for (int i = 0; i < d_.R; ++i) {
    if (!model_.requests()[i].live) continue;
    absl::Status st = CompareCommittedRow(p, i);
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

// Per layer, the committed state (column acc - 1; a pending row: what
// CheckPending checks) and the conv window ending at the last accepted
// token; in align mode also the state and window at a mamba-block boundary
// the accepted tokens crossed.
absl::Status ModeChecker::CompareCommittedRow(const StepPlan& p, int slot) {
  const int acc = p.accepted[slot];
  const int tokens = p.tokens[slot];
  const CommittedBlocks c = model_.Committed(p, slot);
  const bool boundary = c.boundary_block > 0 && c.boundary_len < acc;
  const int s = p.step;
  const bool pending = StartsPending(p, slot, c);
  for (int l = 0; l < d_.L; ++l) {
    const std::vector<char>& updated = p.updated[slot][l];
    absl::Status st = pending
                          ? CheckPending(p, slot, l)
                          : CompareStates(s, l, slot, c.final_block, acc - 1, "committed state");
    if (st.ok()) {
      st = CompareWindow(s, l, slot, c.final_block, model_.WindowEndingAt(updated, tokens, acc),
                         "conv window");
    }
    if (st.ok() && boundary) {
      st = CompareStates(s, l, slot, c.boundary_block, c.boundary_len - 1, "boundary state");
      if (st.ok()) {
        st = CompareWindow(s, l, slot, c.boundary_block,
                           model_.WindowEndingAt(updated, tokens, c.boundary_len),
                           "boundary conv window");
      }
      if (st.ok() && l == 0) ++report_.boundary_states;
    }
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::Status ModeChecker::CompareStates(int step, int layer, int slot, int32_t block, int col,
                                        absl::string_view what) {
  absl::Status st = CompareState(step, layer, slot, block, col, what);
  if (st.ok() && tp1_ != nullptr) st = tp1_->CompareState(step, layer, slot, block, col, what);
  return st;
}

absl::Status ModeChecker::CompareState(int step, int layer, int slot, int32_t block, int col,
                                       absl::string_view what) {
  std::vector<char> service, stock(d_.state_block_bytes);
  absl::Status st = pools_.ReadState(layer, block, &service);
  if (st.ok()) st = memory_.CopyOut(stock.data(), stock_.Block(layer, slot, col), stock.size());
  if (!st.ok()) return st;
  tally_.Count();
  if (std::memcmp(service.data(), stock.data(), service.size()) == 0) return absl::OkStatus();
  const int64_t i = FirstDifference(service.data(), stock.data(), d_.ss);
  const int64_t K = d_.K;
  tally_.Mismatch(absl::StrFormat(
      "step %d, layer %d, row %d: the %s in block %d differs from the stock path's state "
      "(column %d) at element %d (head %d, row %d, col %d): %.9g vs %.9g",
      step, layer, slot, std::string(what), block, col, i, i / (K * K), (i / K) % K, i % K,
      ElementAsFloat(service.data() + i * d_.ss, d_.state),
      ElementAsFloat(stock.data() + i * d_.ss, d_.state)));
  return absl::OkStatus();
}

absl::Status ModeChecker::CompareWindow(int step, int layer, int slot, int32_t block,
                                        const std::vector<char>& expected, absl::string_view what) {
  std::vector<char> dw;
  absl::Status st = pools_.ReadConv(layer, block, &dw);
  if (!st.ok()) return st;
  tally_.Count();
  const int64_t as = d_.as;
  for (int c = 0; c < d_.D; ++c) {
    for (int h = 0; h < d_.hl; ++h) {
      const char* got = dw.data() + (int64_t{c} * d_.W + h) * as;
      const char* want = expected.data() + (int64_t{c} * d_.hl + h) * as;
      if (std::memcmp(got, want, as) != 0) {
        tally_.Mismatch(absl::StrFormat(
            "step %d, layer %d, row %d: the %s in block %d differs from the window the stock "
            "path reads next at channel %d, column %d: %.9g vs %.9g",
            step, layer, slot, std::string(what), block, c, h, ElementAsFloat(got, d_.act),
            ElementAsFloat(want, d_.act)));
        return absl::OkStatus();
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace simulator_internal
}  // namespace client
}  // namespace specstate
