// Commit mode FAST through the kernel interface on the CPU backend
// (interface_cpu.h).
#include "kernels/fast/cpu/interface_cpu.h"

#include <cstdint>
#include <vector>

#include "kernels/checks/commit_plan.h"
#include "kernels/checks/cpu_checker.h"
#include "kernels/checks/verify_rows.h"
#include "kernels/common/cpu/common_cpu.h"
#include "kernels/fast/checks.h"
#include "kernels/fast/cpu/fast_cpu.h"
#include "kernels/fast/fast_args.h"
#include "kernels/fast/fold_journal.h"
#include "kernels/fast/from_interface.h"

namespace specstate {
namespace kernels {
namespace fast {
namespace {

using internal::CpuChecker;
using internal::IsBlock;
using internal::RowFault;

// FAST Verify, after the checks every Verify runs: each row's block has a
// cursor a Commit leaves and room in its ring for the window, and no two
// rows verify from one block (their candidates would share its ring's
// slots). Then kernels/fast's Verify on the checked snapshot.
void RunVerify(const VerifyArgs& a) {
  std::vector<internal::VerifyRow> rows;
  if (!common::VerifyChecksCpu(a, &rows)) return;
  if (!CheckFastVerify<CpuChecker>(
          a.fast, a.num_rows, static_cast<int32_t*>(a.workspace), a.status,
          [&](int n) { return rows[n].source; }, [&](int n) { return rows[n].tokens; })) {
    return;
  }
  RunFastVerifyCpu(FastVerifyArgsOf(a), FastNumerics());
}

// The commit's plan and checks (as EAGER's), FAST's own (every layer's
// cursors and candidates, each written block's ring empty, one row a
// checkpoint block), the commit journal started (kept pools), the conv
// windows, then kernels/fast's Commit along the checked plan (rings
// advance, folds), then the journal's finish.
void RunCommit(const CommitArgs& a) {
  internal::CommitWorkspace ws;
  if (!common::PlanCommitCpu(a, &ws)) return;
  if (!CheckFastCommit<CpuChecker>(a, ws, a.num_layers, [&](int l) { return a.layers[l].fast; })) {
    return;
  }
  if (a.journal.record != nullptr) {  // before the first write
    common::ListCommitJournalCpu(a, ws.plan);
    common::MarkCommitJournalStartedCpu(a);
  }
  common::CompactConvCpu(a, ws.plan);
  const std::vector<FastLayer> layers = FastLayersOf(a.layers, a.num_layers);
  FastCommitArgs f = FastCommitArgsOf(a, layers.data());
  f.test_hook = a.journal.test_hook;
  RunFastCommitCpu(f, ws.plan, FastNumerics());
  if (a.journal.record != nullptr) common::FinishCommitJournalCpu(a, [] {});
}

// FAST Flush: the block list (into its checked copy), then every listed
// block's cursor in every layer it covers (without a list: every block
// whose ring holds tokens or candidates), then kernels/fast's Materialize
// in place, or into the copy (FlushArgs::copy: its `out`).
void RunFlush(const FlushArgs& a) {
  *a.status = internal::OkStatus();
  if (!CpuChecker::LoadedRows(a.num_blocks_given, a.prerequisites.input_fault, a.status,
                              [&](int i) {
                                return internal::CheckListedBlock(a.blocks, a.checked_blocks, i,
                                                                  a.layers[0].state.num_blocks);
                              })) {
    return;
  }
  const auto covers = [&](int l) { return a.layer < 0 || l == a.layer; };
  std::vector<int32_t> every;
  const int32_t* blocks = a.checked_blocks;
  int count = a.num_blocks_given;
  if (a.blocks == nullptr) {
    for (int32_t b = 1; b < a.layers[0].state.num_blocks; ++b) {
      for (int l = 0; l < a.num_layers; ++l) {
        const FastCursor c = a.layers[l].fast.cursors[b];
        if (covers(l) && (c.tokens != 0 || c.candidates != 0)) {
          every.push_back(b);
          break;
        }
      }
    }
    blocks = every.data();
    count = static_cast<int>(every.size());
  }
  for (int i = 0; i < count; ++i) {
    if (!IsBlock(blocks[i])) continue;
    for (int l = 0; l < a.num_layers; ++l) {
      if (!covers(l)) continue;
      const RowFault f = CheckFastCursor(a.layers[l].fast, blocks[i], l);
      if (f.problem != 0) {
        *a.status = internal::StatusFromFault(f, -1, -1);
        return;
      }
    }
  }
  const std::vector<FastLayer> layers = FastLayersOf(a.layers, a.num_layers);
  FastMaterializeArgs m;
  m.shape = a.shape;
  m.num_layers = a.num_layers;
  m.layers = layers.data();
  m.blocks = blocks;
  m.num_blocks_given = count;
  m.layer = a.layer;
  m.discard = a.discard;
  if (a.copy.data != nullptr) {  // into a copy: Materialize's `out`, from block 1
    m.out = static_cast<char*>(a.copy.data) +
            a.copy.block_stride * int64_t(DTypeSize(a.shape.state_dtype));
    RunFastMaterializeCpu(m, FastNumerics());
    return;
  }
  // In place: the fold journal (kept pools) lists the blocks first.
  const FoldJournal& j = a.fold_journal;
  if (j.record != nullptr) {
    for (int i = 0; i < count; ++i) FoldJournalList(j, i, blocks[i]);
    FoldJournalMarkStarted(j, a.discard, count, a.layer);
    m.test_hook = j.test_hook;
  }
  RunFastMaterializeCpu(m, FastNumerics());
  if (j.record != nullptr) FoldJournalMarkDone(j);
}

}  // namespace

void InterfaceVerifyCpu(const VerifyArgs& a) {
  RunVerify(a);
  internal::PublishStatus(*a.status, a.status_mirror);
}

void InterfaceCommitCpu(const CommitArgs& a) {
  RunCommit(a);
  internal::PublishStatus(*a.status, a.status_mirror);
}

void InterfaceFlushCpu(const FlushArgs& a) {
  RunFlush(a);
  internal::PublishStatus(*a.status, a.status_mirror);
}

}  // namespace fast
}  // namespace kernels
}  // namespace specstate
