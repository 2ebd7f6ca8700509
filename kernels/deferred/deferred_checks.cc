// Commit mode DEFERRED's host checks (deferred_checks.h).
#include "kernels/deferred/deferred_checks.h"

#include <cstddef>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/checks/host.h"

namespace specstate {
namespace kernels {
namespace deferred {
namespace {

using host::CheckRecordBuffers;
using host::CheckWorkspace;
using host::Invalid;
using host::OutOfRange;

constexpr absl::string_view kTwoModes =
    "fast and pending are two commit modes: set one (FAST or DEFERRED)";

// DEFERRED's bookkeeping for `num_layers` layers of `num_blocks` blocks.
absl::Status CheckPending(absl::string_view op, const PendingBlocks& p, int num_layers,
                          int64_t num_blocks, int rows) {
  if (p.entries == nullptr || p.header == nullptr) {
    return Invalid(op, "pending: entries and header must be set");
  }
  if (p.num_layers != num_layers || p.num_blocks != num_blocks) {
    return Invalid(
        op, absl::StrCat("pending: the table is for ", p.num_layers, " layers of ", p.num_blocks,
                         " blocks, the pools have ", num_layers, " layers of ", num_blocks));
  }
  if (rows > p.capacity) {
    return OutOfRange(op,
                      absl::StrCat("pending: ", rows, " rows exceed its capacity of ", p.capacity));
  }
  if (p.journal != nullptr) {
    if (p.journal_blocks == nullptr) {
      return Invalid(op, "pending: a journal needs its block list");
    }
    const size_t need = PendingJournalCapacity(p.capacity, p.num_blocks);
    if (p.journal_capacity < 0 || static_cast<size_t>(p.journal_capacity) < need) {
      return OutOfRange(op, absl::StrCat("pending: the journal lists ", p.journal_capacity,
                                         " blocks, a call may need ", need));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckJobs(absl::string_view op, const ReplayJobs& j, size_t need) {
  if (j.jobs == nullptr || j.count == nullptr || static_cast<size_t>(j.capacity) < need) {
    return Invalid(op, absl::StrCat("jobs: room for ", j.capacity, " replays, ", need, " needed"));
  }
  return absl::OkStatus();
}

// The other records buffer of a DEFERRED layer: the same shape as the first.
absl::Status CheckAltRecords(absl::string_view op, const Records& r, const Records& alt,
                             absl::string_view layer) {
  if (alt.kv == nullptr || alt.g == nullptr || alt.beta == nullptr) {
    return Invalid(op, absl::StrCat(layer, "records_alt are null (DEFERRED double-buffers them)"));
  }
  if (alt.rows != r.rows || alt.q != r.q) {
    return Invalid(op, absl::StrCat(layer, "records_alt hold ", alt.rows, " rows of ", alt.q,
                                    " tokens, records ", r.rows, " of ", r.q));
  }
  return ValidateWindow(r.q);
}

// Every layer's two records buffers.
absl::Status CheckLayersRecords(absl::string_view op, const CommitLayer* layers, int num_layers) {
  for (int l = 0; l < num_layers; ++l) {
    const std::string name = absl::StrCat("layer ", l, ": ");
    absl::Status st = CheckRecordBuffers(op, layers[l].records, name);
    if (st.ok()) st = CheckAltRecords(op, layers[l].records, layers[l].records_alt, name);
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateWindow(int spec_query_len) {
  if (2 * spec_query_len > kMaxSpecQueryLen) {
    return absl::OutOfRangeError(absl::StrCat(
        "commit mode DEFERRED replays up to Q pending tokens and verifies Q in one pass: Q = ",
        spec_query_len, " must be at most ", kMaxSpecQueryLen / 2,
        " (num_spec <= ", kMaxSpecQueryLen / 2 - 1, ")"));
  }
  return absl::OkStatus();
}

absl::Status ValidateVerify(const VerifyArgs& a) {
  constexpr absl::string_view op = "Verify";
  if (a.fast.cursors != nullptr) return Invalid(op, kTwoModes);
  absl::Status st = CheckRecordBuffers(op, a.records, "");
  if (st.ok()) st = CheckPending(op, a.pending, a.pending.num_layers, a.state.num_blocks, 0);
  if (st.ok() && (a.layer < 0 || a.layer >= a.pending.num_layers)) {
    st = OutOfRange(op, absl::StrCat("layer ", a.layer, " is past the pending table's ",
                                     a.pending.num_layers, " layers"));
  }
  if (st.ok()) st = CheckAltRecords(op, a.records, a.records_alt, "");
  if (st.ok() && a.num_rows > 0 && a.replay_plan == nullptr)
    st = Invalid(op, "replay_plan is null");
  if (st.ok()) {
    st = CheckWorkspace(op, a.workspace, a.workspace_bytes,
                        VerifyWorkspaceBytes(a.state.num_blocks));
  }
  return st;
}

absl::Status ValidateCommit(const CommitArgs& a) {
  constexpr absl::string_view op = "Commit";
  absl::Status st = CheckLayersRecords(op, a.layers, a.num_layers);
  if (!st.ok()) return st;
  if (a.journal.record != nullptr && a.pending.journal == nullptr) {
    return Invalid(op,
                   "journal: a DEFERRED commit's journal needs the pending table's "
                   "(pending.journal): the table changes too");
  }
  if (a.pending.journal != nullptr && a.journal.record == nullptr) {
    return Invalid(op,
                   "pending.journal: a DEFERRED commit keeps both journals or neither (the "
                   "commit journal's finish closes the pending one)");
  }
  const int64_t num_blocks = a.layers[0].state.num_blocks;
  st = CheckPending(op, a.pending, a.num_layers, num_blocks, a.num_rows);
  if (!st.ok()) return st;
  return CheckJobs(op, a.jobs, CommitJobsCapacity(a.pending.capacity, a.num_layers));
}

absl::Status ValidateFlush(const FlushArgs& a) {
  constexpr absl::string_view op = "Flush";
  const int64_t num_blocks = a.layers[0].state.num_blocks;
  absl::Status st = CheckPending(op, a.pending, a.num_layers, num_blocks, 0);
  if (st.ok()) st = CheckJobs(op, a.jobs, FlushJobsCapacity(a.pending.capacity, a.num_layers));
  if (!st.ok()) return st;
  for (int l = 0; l < a.num_layers; ++l) {
    st = CheckAltRecords(op, a.layers[l].records, a.layers[l].records_alt,
                         absl::StrCat("layer ", l, ": "));
    if (!st.ok()) return st;
  }
  if (a.copy.data != nullptr) {
    // The replay into the copy reads the layer's records and parameters
    // from copy_layer, and writes its state pool: the copy.
    const CommitLayer* c = a.copy_layer;
    if (c == nullptr || a.device_copy_layer == nullptr) {
      return Invalid(op, "copy: a DEFERRED copy needs copy_layer and device_copy_layer");
    }
    const CommitLayer& layer = a.layers[a.layer];
    if (c->state.data != a.copy.data || c->state.num_blocks != a.copy.num_blocks ||
        c->state.block_stride != a.copy.block_stride) {
      return Invalid(op, "copy_layer: its state pool must be the copy");
    }
    if (c->records.kv != layer.records.kv || c->records_alt.kv != layer.records_alt.kv ||
        c->params.a_log != layer.params.a_log || c->params.dt_bias != layer.params.dt_bias) {
      return Invalid(op, absl::StrCat("copy_layer: its records and parameters must be layer ",
                                      a.layer, "'s"));
    }
  }
  return absl::OkStatus();
}

}  // namespace deferred
}  // namespace kernels
}  // namespace specstate
