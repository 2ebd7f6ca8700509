// Commit mode EAGER on the CPU backend (eager_cpu.h).
#include "kernels/eager/eager_cpu.h"

#include <cstdint>
#include <vector>

#include "kernels/checks/commit_plan.h"
#include "kernels/checks/cpu_checker.h"
#include "kernels/checks/verify_rows.h"
#include "kernels/common/cpu/common_cpu.h"
#include "kernels/common/cpu/recurrence.h"
#include "kernels/internal/dispatch.h"

namespace specstate {
namespace kernels {
namespace eager {
namespace {

using internal::DispatchKda;

// After the checks: the stock kernel's math from each row's checkpoint,
// outputs and records.
void RunVerify(const VerifyArgs& a) {
  std::vector<internal::VerifyRow> rows;
  if (!common::VerifyChecksCpu(a, &rows)) return;
  DispatchKda(a.shape, [&](auto act, auto state, auto head_dim) {
    using Act = typename decltype(act)::type;
    using State = typename decltype(state)::type;
    constexpr int K = decltype(head_dim)::value;
    common::VerifyRows<Act, State, K>(
        a, rows, a.records, [](int) { return 0; },
        [](int, int, common::HeadRecurrence<K>&, State*) {});
  });
}

void RunCommit(const CommitArgs& a) {
  internal::CommitWorkspace ws;
  if (!common::PlanCommitCpu(a, &ws)) return;
  const int Q = a.spec_query_len;
  for (int i = 0; i < a.num_rows; ++i) {
    for (int col = 0; col <= Q; ++col) {
      ws.replay_indices[i * (Q + 1) + col] = internal::ReplayIndex(ws.plan[i], Q, col);
    }
  }
  if (a.journal.record != nullptr) {  // before the first write
    common::ListCommitJournalCpu(a, ws.plan);
    common::MarkCommitJournalStartedCpu(a);
  }
  common::CompactConvCpu(a, ws.plan);
  // Replay: the stock kernel over the records, Q tokens per row, reading
  // the source at column Q and storing only the planned columns. Tokens
  // after the last stored column cannot change a stored state, so they
  // are not run.
  const CommitJournal& journal = a.journal;
  DispatchKda(a.shape, [&](auto act, auto state, auto head_dim) {
    using Act = typename decltype(act)::type;
    using State = typename decltype(state)::type;
    for (int l = 0; l < a.num_layers; ++l) {
      common::RunStockLayer<Act, State, decltype(head_dim)::value>(
          common::ReplayWork(a.shape, a.layers[l], a.layers[l].records), a.num_rows,
          [&](int i, int64_t* bos, int* tokens, int32_t* source, const int32_t** idx) {
            const int32_t* row = ws.replay_indices + i * (Q + 1);
            *bos = int64_t{i} * Q;
            *source = row[Q];
            *idx = row;
            *tokens = internal::ReplayTokens(row, Q);
          });
      if (journal.test_hook != nullptr) journal.test_hook("layer");
    }
  });
}

}  // namespace

void VerifyCpu(const VerifyArgs& a) {
  RunVerify(a);
  internal::PublishStatus(*a.status, a.status_mirror);
}

void CommitCpu(const CommitArgs& a) {
  RunCommit(a);
  internal::PublishStatus(*a.status, a.status_mirror);
  if (a.journal.record != nullptr) common::FinishCommitJournalCpu(a, [] {});
}

}  // namespace eager
}  // namespace kernels
}  // namespace specstate
