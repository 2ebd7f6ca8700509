// Engine::Commit: every layer of a step at once, after sampling; the mode
// adds its own arguments (ModeEngine::AddToCommit).
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/engine/drive.h"
#include "server/engine/engine.h"
#include "server/base/test_crash.h"

namespace specstate {
namespace server {

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
  mode_->AddToCommit(args);
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

}  // namespace server
}  // namespace specstate
