// What every commit mode shares on the CPU backend (common_cpu.h).
#include "kernels/common/cpu/common_cpu.h"

#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/checks/cpu_checker.h"
#include "kernels/checks/params.h"
#include "kernels/checks/record_rows.h"
#include "kernels/checks/stock_rows.h"
#include "kernels/common/cpu/recurrence.h"
#include "kernels/internal/dispatch.h"

namespace specstate {
namespace kernels {
namespace common {
namespace {

using internal::CpuChecker;
using internal::DispatchAct;
using internal::DispatchKda;
using internal::RowFault;

// docs/semantics.md, Commit step 2, for one row of one layer.
template <typename Act>
void CompactConvRow(const ConvPool& c, int history_len, const CommitPlanRow& p, bool align,
                    std::vector<Act>* scratch) {
  if (!internal::CommitsAnything(p)) return;
  Act* base = static_cast<Act*>(c.data);
  const Act* src = base + int64_t{p.source} * c.block_stride;
  const bool boundary = align && IsBlock(p.boundary_block);
  // Read the row's windows before writing: final or boundary may be the source.
  scratch->resize(size_t(c.dim) * history_len * 2);
  Act* final_window = scratch->data();
  Act* boundary_window = final_window + size_t(c.dim) * history_len;
  for (int d = 0; d < c.dim; ++d) {
    for (int x = 0; x < history_len; ++x) {
      final_window[size_t(d) * history_len + x] =
          src[d * c.dim_stride + int64_t(p.commit_len - 1 + x) * c.token_stride];
      if (boundary) {
        boundary_window[size_t(d) * history_len + x] =
            src[d * c.dim_stride + int64_t(p.boundary_len - 1 + x) * c.token_stride];
      }
    }
  }
  Act* dst = base + int64_t{p.final_block} * c.block_stride;
  Act* bdst = base + int64_t{p.boundary_block} * c.block_stride;
  for (int d = 0; d < c.dim; ++d) {
    for (int x = 0; x < history_len; ++x) {
      if (boundary) {
        bdst[d * c.dim_stride + x * c.token_stride] = boundary_window[size_t(d) * history_len + x];
      }
      dst[d * c.dim_stride + x * c.token_stride] = final_window[size_t(d) * history_len + x];
    }
  }
}

}  // namespace

void StockCpu(const StockArgs& a) {
  *a.status = internal::OkStatus();
  std::vector<internal::StockRow> rows(a.num_rows);
  if (!CpuChecker::Rows(a.num_rows, a.status,
                        [&](int n) { return internal::CheckStockRow(a, n, &rows[n]); })) {
    return;
  }
  if (!CpuChecker::CrossRow(
          a.num_rows, static_cast<int32_t*>(a.workspace), a.status,
          [&](int n, auto fn) { internal::ForEachStockWrite(a, rows[n], n, fn); },
          [&](int n, auto fn) { internal::ForEachStockRead(rows[n], n, fn); })) {
    return;
  }
  StockLayerWork w{a.shape, a.q, a.k, a.v, a.g, a.beta, a.out, a.state, a.params};
  DispatchKda(a.shape, [&](auto act, auto state, auto head_dim) {
    using Act = typename decltype(act)::type;
    using State = typename decltype(state)::type;
    RunStockLayer<Act, State, decltype(head_dim)::value>(
        w, a.num_rows, [&](int n, int64_t* bos, int* tokens, int32_t* source, const int32_t** idx) {
          *bos = a.query_start_loc[n];
          *tokens = rows[n].tokens;
          *source = rows[n].source;
          *idx = a.ssm_state_indices.data + n * a.ssm_state_indices.row_stride;
        });
  });
}

void RecordStateBlocksCpu(const RecordStateBlocksArgs& a) {
  [&] {
    *a.status = internal::OkStatus();
    if (!CpuChecker::Prerequisites(a.prerequisites, a.status)) return;
    const internal::RecordWorkspace ws =
        internal::RecordWorkspaceLayout(a.workspace, a.workspace_bytes);
    internal::RecordRow* const rows = ws.rows;
    if (!CpuChecker::LoadedRows(a.num_rows, a.prerequisites.input_fault, a.status,
                                [&](int i) { return internal::CheckRecordRow(a, i, &rows[i]); })) {
      return;
    }
    const auto no_reads = [](int, auto) {};
    if (!CpuChecker::CrossRow(
            a.num_rows, ws.owner, a.status,
            [&](int i, auto fn) { internal::ForEachRecordWrite(rows[i], fn); }, no_reads)) {
      return;
    }
    for (int i = 0; i < a.num_rows; ++i) {
      if (rows[i].request_row < 0) continue;
      a.state_idx[rows[i].request_row] = rows[i].state_column;
      a.num_accepted[rows[i].request_row] = 1;
    }
  }();
  internal::PublishStatus(*a.status, a.status_mirror);
}

void LoadParamsCpu(const LoadParamsArgs& a) {
  *a.status = internal::OkStatus();
  const int count = a.num_heads + a.num_heads * a.head_dim;
  for (int i = 0; i < count; ++i) {
    a.staging[i] = i < a.num_heads ? a.a_log[i] : a.dt_bias[i - a.num_heads];
  }
  if (CpuChecker::InputsIntact(a.input_fault, a.status)) {
    for (int i = 0; i < count; ++i) {
      const RowFault f = internal::CheckParamValue(a.staging[i], i, a.num_heads);
      if (f.problem != 0) {
        *a.status = internal::StatusFromFault(f, -1, -1);
        break;
      }
    }
  }
  if (a.status->failed == 0) {
    std::memcpy(a.dst_a_log, a.staging, sizeof(float) * a.num_heads);
    std::memcpy(a.dst_dt_bias, a.staging + a.num_heads, sizeof(float) * a.num_heads * a.head_dim);
  }
  internal::PublishStatus(*a.status, a.status_mirror);
}

bool VerifyChecksCpu(const VerifyArgs& a, std::vector<internal::VerifyRow>* rows) {
  *a.status = internal::OkStatus();
  if (!CpuChecker::Prerequisites(a.prerequisites, a.status)) return false;
  rows->assign(a.num_rows, internal::VerifyRow{});
  std::vector<RowFault> mismatch(a.num_rows);
  for (int n = 0; n < a.num_rows; ++n) {
    mismatch[n] = internal::SnapshotVerifyRow(a, n, internal::LoadVerifyRow(a, n));
  }
  if (!CpuChecker::InputsIntact(a.prerequisites.input_fault, a.status)) return false;
  return CpuChecker::Rows(a.num_rows, a.status, [&](int n) {
    return mismatch[n].problem != 0 ? mismatch[n] : internal::CheckVerifyRow(a, n, &(*rows)[n]);
  });
}

bool PlanCommitCpu(const CommitArgs& a, internal::CommitWorkspace* ws) {
  const int64_t num_blocks = a.layers[0].state.num_blocks;
  *ws = internal::CommitWorkspaceLayout(a.workspace, a.num_rows, num_blocks);
  return internal::CheckCommitPlan<CpuChecker>(a, *ws, num_blocks);
}

void CompactConvCpu(const CommitArgs& a, const CommitPlanRow* plan) {
  const bool align = a.block_table.data != nullptr;
  const int history_len = a.layers[0].conv.width - a.spec_query_len + 1;
  DispatchAct(a.shape.act_dtype, [&](auto act) {
    using Act = typename decltype(act)::type;
    std::vector<Act> scratch;
    for (int l = 0; l < a.num_layers; ++l) {
      for (int i = 0; i < a.num_rows; ++i) {
        CompactConvRow<Act>(a.layers[l].conv, history_len, plan[i], align, &scratch);
      }
    }
  });
  if (a.journal.test_hook != nullptr) a.journal.test_hook("conv");
}

void ListCommitJournalCpu(const CommitArgs& a, const CommitPlanRow* plan) {
  for (int i = 0; i < a.num_rows; ++i) internal::JournalListRow(a, plan[i], i);
}

void MarkCommitJournalStartedCpu(const CommitArgs& a) {
  internal::JournalMarkStarted(a.journal, a.num_rows);
  if (a.journal.test_hook != nullptr) a.journal.test_hook("started");
}

}  // namespace common
}  // namespace kernels
}  // namespace specstate
