// Commit mode FAST's host checks (interface_checks.h).
#include "kernels/fast/interface_checks.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/checks/host.h"

namespace specstate {
namespace kernels {
namespace fast {
namespace {

using host::Invalid;
using host::OutOfRange;

constexpr absl::string_view kTwoModes =
    "fast and pending are two commit modes: set one (FAST or DEFERRED)";

// FAST verifies at most kMaxFastQueryLen tokens a row.
absl::Status CheckWindow(absl::string_view op, int q) {
  if (q > kMaxFastQueryLen) {
    return OutOfRange(op, absl::StrCat("commit mode FAST verifies at most ", kMaxFastQueryLen,
                                       " tokens a row: the window q = ", q, " is past it"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckRings(absl::string_view op, const FastRings& r, int64_t num_blocks, int q,
                        absl::string_view where, absl::string_view name) {
  if (r.k == nullptr || r.u == nullptr || r.log_decay == nullptr || r.cursors == nullptr) {
    return Invalid(
        op, absl::StrCat(where, name, ": the rings' k, u, log_decay and cursors must be set"));
  }
  if (r.num_blocks != num_blocks) {
    return Invalid(
        op, absl::StrCat(where, name, ".num_blocks = ", r.num_blocks, " differs from the pool's ",
                         num_blocks, " (a ring per state block)"));
  }
  if (r.capacity < q) {
    return OutOfRange(
        op, absl::StrCat(where, name, ".capacity = ", r.capacity, " is below the window's ", q,
                         " tokens (a ring holds at least one window)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateInterfaceVerify(const VerifyArgs& a) {
  constexpr absl::string_view op = "Verify";
  if (a.pending.entries != nullptr) return Invalid(op, kTwoModes);
  absl::Status st = CheckWindow(op, a.records.q);
  if (st.ok()) st = CheckRings(op, a.fast, a.state.num_blocks, a.records.q, "", "fast");
  if (st.ok()) {
    st = host::CheckWorkspace(op, a.workspace, a.workspace_bytes,
                              VerifyWorkspaceBytes(a.state.num_blocks));
  }
  return st;
}

absl::Status ValidateInterfaceCommit(const CommitArgs& a) {
  constexpr absl::string_view op = "Commit";
  if (a.pending.entries != nullptr) return Invalid(op, kTwoModes);
  absl::Status st = CheckWindow(op, a.spec_query_len);
  for (int l = 0; st.ok() && l < a.num_layers; ++l) {
    st = CheckRings(op, a.layers[l].fast, a.layers[0].state.num_blocks, a.spec_query_len,
                    absl::StrCat("layer ", l, ": "), "fast");
  }
  return st;
}

absl::Status ValidateInterfaceFlush(const FlushArgs& a) {
  constexpr absl::string_view op = "Flush";
  if (a.pending.entries != nullptr) return Invalid(op, kTwoModes);
  absl::Status st = CheckWindow(op, a.spec_query_len);
  for (int l = 0; st.ok() && l < a.num_layers; ++l) {
    st = CheckRings(op, a.layers[l].fast, a.layers[0].state.num_blocks, a.spec_query_len,
                    absl::StrCat("layer ", l, ": "), "fast");
  }
  const FoldJournal& j = a.fold_journal;
  if (st.ok() && j.record != nullptr) {
    if (j.blocks == nullptr) return Invalid(op, "fold_journal: a record needs its blocks");
    if (j.capacity < a.layers[0].state.num_blocks) {
      return OutOfRange(op, absl::StrCat("fold_journal.capacity = ", j.capacity,
                                         " is below the pool's ", a.layers[0].state.num_blocks,
                                         " blocks (a Flush may fold every one)"));
    }
  }
  // A copy is FastMaterialize's `out`: blocks one after another.
  const int64_t block_elems = int64_t{ValueHeads(a.shape)} * a.shape.head_dim * a.shape.head_dim;
  if (st.ok() && a.copy.data != nullptr && a.copy.block_stride != block_elems) {
    return Invalid(op, absl::StrCat("copy.block_stride = ", a.copy.block_stride,
                                    ": commit mode FAST folds into a copy of dense blocks (",
                                    block_elems, " elements)"));
  }
  return st;
}

}  // namespace fast
}  // namespace kernels
}  // namespace specstate
