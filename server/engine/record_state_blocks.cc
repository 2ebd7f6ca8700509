// Engine::RecordStateBlocks (cache_mode ALIGN): each request's state block
// recorded and its accepted count reset, after the step's Commit.
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/engine/drive.h"
#include "server/engine/engine.h"

namespace specstate {
namespace server {

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

}  // namespace server
}  // namespace specstate
