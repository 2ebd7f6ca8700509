// Commit mode DEFERRED on the CPU backend (deferred_cpu.h).
#include "kernels/deferred/deferred_cpu.h"

#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/checks/commit_plan.h"
#include "kernels/checks/cpu_checker.h"
#include "kernels/checks/verify_rows.h"
#include "kernels/common/cpu/common_cpu.h"
#include "kernels/common/cpu/recurrence.h"
#include "kernels/deferred/pending.h"
#include "kernels/deferred/pending_journal.h"
#include "kernels/internal/dispatch.h"

namespace specstate {
namespace kernels {
namespace deferred {
namespace {

using internal::CpuChecker;
using internal::DispatchKda;
using internal::IsBlock;
using internal::RowFault;

// Runs a replay list (ReplayJob: one layer's replay of one row), each as
// the stock kernel over the records, like the commit's replay.
void RunReplayJobs(const KdaShape& shape, const CommitLayer* layers, int q,
                   const std::vector<ReplayJob>& jobs) {
  DispatchKda(shape, [&](auto act, auto state, auto head_dim) {
    using Act = typename decltype(act)::type;
    using State = typename decltype(state)::type;
    for (const ReplayJob& job : jobs) {
      const CommitLayer& layer = layers[job.layer];
      common::RunStockLayer<Act, State, decltype(head_dim)::value>(
          common::ReplayWork(shape, layer, common::RecordsOf(layer, job.buffer)), 1,
          [&](int, int64_t* bos, int* tokens, int32_t* source, const int32_t** idx) {
            *bos = int64_t{job.record_row} * q;
            *source = job.indices[q];
            *idx = job.indices;
            *tokens = internal::ReplayTokens(job.indices, q);
          });
    }
  });
}

// The list also goes to the call's ReplayJobs, as the CUDA backend leaves it.
void PublishJobs(const std::vector<ReplayJob>& jobs, const ReplayJobs& out) {
  if (out.count == nullptr) return;
  *out.count = static_cast<int32_t>(jobs.size());
  if (!jobs.empty()) std::memcpy(out.jobs, jobs.data(), jobs.size() * sizeof(ReplayJob));
}

// DEFERRED Commit, after its checks: what the previous commit left pending
// that no Verify took is materialized (replay jobs), rows that are not
// deferred are replayed now (jobs), and the deferred rows' tokens become
// the pending entries, in the records buffer this step's Verify calls wrote.
std::vector<ReplayJob> DeferCommit(const CommitArgs& a, const CommitPlanRow* plan) {
  const PendingBlocks& p = a.pending;
  const int q = a.spec_query_len;
  const int32_t buffer = *PendingBufferWord(p);  // the previous commit's records
  std::vector<ReplayJob> jobs;
  const int32_t* list = PendingList(p);
  for (int j = 0; j < *PendingListSize(p); ++j) {
    for (int l = 0; l < p.num_layers; ++l) {
      int32_t& entry = PendingEntriesOf(p, l)[list[j]];
      if (entry == 0) continue;
      jobs.push_back(PendingJob(l, list[j], UnpackPending(entry), q));
      entry = 0;
    }
  }
  for (int i = 0; i < a.num_rows; ++i) {
    if (!internal::CommitsAnything(plan[i]) || DefersCommit(plan[i])) continue;
    for (int l = 0; l < a.num_layers; ++l) {
      jobs.push_back(CommitJob(l, plan[i], i, 1 - buffer, q));
    }
  }
  int32_t listed = 0;
  for (int i = 0; i < a.num_rows; ++i) {
    if (!DefersCommit(plan[i])) continue;
    const int32_t entry = PackPending(i, 1 - buffer, plan[i].commit_len);
    for (int l = 0; l < p.num_layers; ++l) {
      PendingEntriesOf(p, l)[plan[i].source] = entry;
    }
    PendingList(p)[listed++] = plan[i].source;
  }
  *PendingListSize(p) = listed;
  *PendingBufferWord(p) = 1 - buffer;
  PublishJobs(jobs, a.jobs);
  return jobs;
}

// Verify, after the checks every Verify runs: no two rows may verify from a
// block that has pending tokens in this layer (the first to run would
// materialize it under the other). Then each row takes its block's entry
// (replay_plan) and the table forgets it: the kernels replay it now.
bool TakePendingTokens(const VerifyArgs& a, const std::vector<internal::VerifyRow>& rows) {
  int32_t* const entries = PendingEntriesOf(a.pending, a.layer);
  if (!CpuChecker::OneUserABlock(
          a.num_rows, static_cast<int32_t*>(a.workspace), a.status,
          [&](int n) { return rows[n].source; }, [&](int32_t b) { return entries[b] != 0; },
          [](int32_t b, int n) { return PendingSharedFault(b, n); })) {
    return false;
  }
  if (a.pending.journal != nullptr) {  // before the table or a checkpoint changes
    int listed = 0;
    for (int n = 0; n < a.num_rows; ++n) {
      const int32_t b = rows[n].source;
      if (IsBlock(b) && entries[b] != 0) PendingJournalList(a.pending, listed++, b);
    }
    PendingJournalMarkStarted(a.pending, kPendingVerify, listed, a.layer, 0);
  }
  for (int n = 0; n < a.num_rows; ++n) {
    const int32_t b = rows[n].source;
    a.replay_plan[n] = IsBlock(b) ? entries[b] : 0;
    if (IsBlock(b)) entries[b] = 0;
  }
  return true;
}

// After the checks: each row's pending tokens (from the records buffer the
// header names) replayed from its checkpoint, exactly as the commit's
// replay would have run them, the checkpoint stored once, then the window
// verified from that state; the window's records go to the other buffer.
void RunVerify(const VerifyArgs& a) {
  std::vector<internal::VerifyRow> rows;
  if (!common::VerifyChecksCpu(a, &rows) || !TakePendingTokens(a, rows)) return;
  const int32_t pending_buffer = *PendingBufferWord(a.pending);
  const Records& records = pending_buffer == 1 ? a.records : a.records_alt;
  const Records& pending_records = pending_buffer == 1 ? a.records_alt : a.records;
  DispatchKda(a.shape, [&](auto act, auto state, auto head_dim) {
    using Act = typename decltype(act)::type;
    using State = typename decltype(state)::type;
    constexpr int K = decltype(head_dim)::value;
    // The pending tokens as the commit's replay reads them.
    const CommitLayer layer{a.state, {}, a.params, pending_records, {}};
    const common::StockLayerWork replay = common::ReplayWork(a.shape, layer, pending_records);
    common::PreparedHead pending_prep;
    common::VerifyRows<Act, State, K>(
        a, rows, records, [&](int n) { return UnpackPending(a.replay_plan[n]).tokens; },
        [&](int n, int h, common::HeadRecurrence<K>& head, State* checkpoint) {
          const PendingEntry pending = UnpackPending(a.replay_plan[n]);
          if (pending.tokens == 0) return;
          // The commit's replay, then the checkpoint stored once (and read
          // back as a later Verify would read it).
          common::PrepareHead<Act, K>(a.shape, replay.q, replay.k, replay.v, replay.g, replay.beta,
                                      a.params, h, int64_t{pending.record_row} * a.records.q,
                                      pending.tokens, &pending_prep);
          head.template Run<State>(
              pending_prep, pending.tokens, false, [](int, int, float) {},
              [](int) -> State* { return nullptr; });
          head.Store(checkpoint);
          head.template RoundTo<State>();
          if (h == 0 && a.pending.test_hook != nullptr) a.pending.test_hook("verify:replayed");
        });
  });
}

// DEFERRED with kept pools, before the commit's first write: the pending
// journal lists what the previous commit left pending (materialized now
// or by this step's Verify calls) and every block a row writes (some
// become pending), and is marked started.
void ListDeferredCommit(const CommitArgs& a, const CommitPlanRow* plan) {
  const PendingBlocks& p = a.pending;
  int listed = 0;
  const int32_t* list = PendingList(p);
  for (int j = 0; j < *PendingListSize(p); ++j) {
    PendingJournalList(p, listed++, list[j]);
  }
  for (int i = 0; i < a.num_rows; ++i) {
    internal::ForEachCommitWrite(a, plan[i], i, [&](int32_t b, CheckedField, int32_t, int32_t) {
      PendingJournalList(p, listed++, b);
    });
  }
  PendingJournalMarkStarted(p, kPendingCommit, listed, -1, a.journal.step);
}

void RunCommit(const CommitArgs& a) {
  internal::CommitWorkspace ws;
  if (!common::PlanCommitCpu(a, &ws)) return;
  // DEFERRED's own checks: a commit whose checks fail leaves the journals alone.
  if (!CpuChecker::Rows(a.num_rows, a.status,
                        [&](int i) { return CheckDeferredCommitRow(a, ws.plan[i], i); })) {
    return;
  }
  if (a.journal.record != nullptr) {  // before the first write
    common::ListCommitJournalCpu(a, ws.plan);
    if (a.pending.journal != nullptr) ListDeferredCommit(a, ws.plan);
    common::MarkCommitJournalStartedCpu(a);
  }
  common::CompactConvCpu(a, ws.plan);
  const std::vector<ReplayJob> jobs = DeferCommit(a, ws.plan);
  if (a.journal.test_hook != nullptr) a.journal.test_hook("deferred");
  RunReplayJobs(a.shape, a.layers, a.spec_query_len, jobs);
}

// A Flush into a copy (FlushArgs::copy): each listed block's bytes in the
// layer copied to its copy block, then its pending tokens replayed there as
// a Flush replays them in the pool (the same jobs, on copy_layer); the
// table, the journal and the pool are left as they are.
void FlushIntoCopy(const FlushArgs& a) {
  const int64_t elem = DTypeSize(a.shape.state_dtype);
  const int64_t block_bytes = ValueWidth(a.shape) * a.shape.head_dim * elem;
  const int64_t stride_bytes = a.copy.block_stride * elem;
  const char* pool = static_cast<const char*>(a.layers[a.layer].state.data);
  char* copy = static_cast<char*>(a.copy.data);
  const int32_t* entries = PendingEntriesOf(a.pending, a.layer);
  std::vector<ReplayJob> jobs;
  for (int i = 0; i < a.num_blocks_given; ++i) {
    const int32_t b = a.checked_blocks[i];
    if (!IsBlock(b)) continue;
    std::memcpy(copy + (i + 1) * stride_bytes, pool + b * stride_bytes, block_bytes);
    if (entries[b] != 0) {
      jobs.push_back(PendingJob(0, i + 1, UnpackPending(entries[b]), a.spec_query_len));
    }
  }
  PublishJobs(jobs, a.jobs);
  RunReplayJobs(a.shape, a.copy_layer, a.spec_query_len, jobs);
}

void RunFlush(const FlushArgs& a) {
  *a.status = internal::OkStatus();
  if (!CpuChecker::LoadedRows(a.num_blocks_given, a.prerequisites.input_fault, a.status,
                              [&](int i) { return CheckFlushBlock(a, i); })) {
    return;
  }
  if (a.copy.data != nullptr) {
    FlushIntoCopy(a);
    return;
  }
  const bool listed = a.blocks == nullptr;
  const int count = listed ? *PendingListSize(a.pending) : a.num_blocks_given;
  const int32_t* blocks = listed ? PendingList(a.pending) : a.checked_blocks;
  if (a.pending.journal != nullptr) {  // before the table or a state changes
    int journaled = 0;
    for (int i = 0; i < count; ++i) {
      if (!IsBlock(blocks[i])) continue;
      for (int l = 0; l < a.num_layers; ++l) {
        if ((a.layer < 0 || l == a.layer) && PendingEntriesOf(a.pending, l)[blocks[i]] != 0) {
          PendingJournalList(a.pending, journaled++, blocks[i]);
          break;
        }
      }
    }
    PendingJournalMarkStarted(a.pending, a.discard ? kPendingDiscard : kPendingFlush, journaled,
                              a.layer, 0);
  }
  std::vector<ReplayJob> jobs;
  for (int i = 0; i < count; ++i) {
    if (!IsBlock(blocks[i])) continue;
    for (int l = 0; l < a.num_layers; ++l) {
      if (a.layer >= 0 && l != a.layer) continue;
      int32_t& entry = PendingEntriesOf(a.pending, l)[blocks[i]];
      if (entry == 0) continue;
      if (!a.discard) {
        jobs.push_back(PendingJob(l, blocks[i], UnpackPending(entry), a.spec_query_len));
      }
      entry = 0;
    }
  }
  PublishJobs(jobs, a.jobs);
  if (a.pending.test_hook != nullptr && !a.discard) a.pending.test_hook("flush:taken");
  RunReplayJobs(a.shape, a.layers, a.spec_query_len, jobs);
}

}  // namespace

void VerifyCpu(const VerifyArgs& a) {
  RunVerify(a);
  internal::PublishStatus(*a.status, a.status_mirror);
  if (a.pending.journal != nullptr) PendingJournalMarkDone(a.pending);
}

void CommitCpu(const CommitArgs& a) {
  RunCommit(a);
  internal::PublishStatus(*a.status, a.status_mirror);
  if (a.journal.record != nullptr) {
    common::FinishCommitJournalCpu(a, [&] {
      if (a.pending.journal != nullptr) PendingJournalMarkDone(a.pending);
    });
  }
}

void FlushCpu(const FlushArgs& a) {
  RunFlush(a);
  internal::PublishStatus(*a.status, a.status_mirror);
  // (A copy journals nothing: it changes neither the table nor a pool.)
  if (a.pending.journal != nullptr && a.copy.data == nullptr) PendingJournalMarkDone(a.pending);
}

}  // namespace deferred
}  // namespace kernels
}  // namespace specstate
