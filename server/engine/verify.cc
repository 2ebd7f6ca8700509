// Engine::Verify (and BindVerifyInputs, the binding a bound Verify reads):
// a layer's window from the checkpoint, outputs and records, no state
// writes. The mode adds its own arguments (ModeEngine::AddToVerify).
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/engine/drive.h"
#include "server/engine/engine.h"
#include "server/base/test_crash.h"

namespace specstate {
namespace server {

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
  args.records = host_layer_table_[layer_index].records;
  mode_->AddToVerify(layer_index, args);
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

}  // namespace server
}  // namespace specstate
