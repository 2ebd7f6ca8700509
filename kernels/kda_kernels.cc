#include "kernels/kda_kernels.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/check_shape.h"
#include "kernels/internal/checks.h"

namespace specstate {
namespace kernels {

absl::string_view BackendName(Backend backend) {
  return backend == Backend::kCuda ? "cuda" : "cpu";
}

void UseEagerCudaModuleLoading() { setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/1); }

size_t StockWorkspaceBytes(int64_t num_blocks) {
  return internal::AlignUp(static_cast<size_t>(num_blocks) * sizeof(int32_t));
}

size_t CommitWorkspaceBytes(int max_rows, int spec_query_len, int64_t num_blocks) {
  return internal::CommitWorkspaceSize(max_rows, spec_query_len, num_blocks);
}

const CommitPlanRow* CommitPlanOf(const void* workspace, int64_t num_blocks) {
  return internal::CommitWorkspaceLayout(const_cast<void*>(workspace), 0, num_blocks).plan;
}

size_t RecordStateBlocksWorkspaceBytes(int max_rows) {
  return internal::AlignUp(256 + static_cast<size_t>(max_rows) * 16);
}

size_t VerifyWorkspaceBytes(int64_t num_blocks) {
  return internal::AlignUp(static_cast<size_t>(num_blocks) * sizeof(int32_t));
}

size_t PendingHeaderBytes(int capacity) {
  return internal::AlignUp((2 + static_cast<size_t>(capacity)) * sizeof(int32_t));
}

size_t PendingEntriesBytes(int num_layers, int64_t num_blocks) {
  return internal::AlignUp(static_cast<size_t>(num_layers) * num_blocks * sizeof(int32_t));
}

size_t PendingJournalCapacity(int capacity, int64_t num_blocks) {
  return 3 * static_cast<size_t>(capacity) + static_cast<size_t>(num_blocks);
}

// Every row of a commit replayed now (align mode), and every block the
// previous commit left pending, in every layer.
size_t CommitJobsCapacity(int max_rows, int num_layers) {
  return 2 * static_cast<size_t>(max_rows) * num_layers;
}

// Only blocks the last commit left pending (at most its rows) have entries.
size_t FlushJobsCapacity(int max_rows, int num_layers) {
  return static_cast<size_t>(max_rows) * num_layers;
}

namespace {

absl::Status Invalid(absl::string_view op, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("In ", op, ": ", what));
}

absl::Status OutOfRange(absl::string_view op, absl::string_view what) {
  return absl::OutOfRangeError(absl::StrCat("In ", op, ": ", what));
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Dense [H, D] tokens with token_stride >= H * D; `dense` demands equality.
absl::Status CheckActivation(absl::string_view op, absl::string_view name, const Activation& a,
                             int64_t per_token, int64_t num_tokens, bool dense) {
  if (num_tokens > 0 && a.data == nullptr) return Invalid(op, absl::StrCat(name, " is null"));
  if (dense && a.token_stride != per_token) {
    return Invalid(op, absl::StrCat(name, " token stride ", a.token_stride, " must be ", per_token,
                                    " (dense)"));
  }
  if (a.token_stride < per_token) {
    return Invalid(op, absl::StrCat(name, " token stride ", a.token_stride,
                                    " is less than one token's ", per_token, " elements"));
  }
  return absl::OkStatus();
}

absl::Status CheckActivations(absl::string_view op, const KdaShape& s, const Activation& q,
                              const Activation& k, const Activation& v, const Activation& g,
                              const Activation& beta, int64_t num_tokens, const void* out) {
  if (num_tokens < 0) return Invalid(op, absl::StrCat("num_tokens = ", num_tokens, " is negative"));
  const int64_t hk = KeyWidth(s);
  absl::Status st = CheckActivation(op, "q", q, hk, num_tokens, false);
  if (st.ok()) st = CheckActivation(op, "k", k, hk, num_tokens, false);
  if (st.ok()) st = CheckActivation(op, "v", v, ValueWidth(s), num_tokens, false);
  if (st.ok()) st = CheckActivation(op, "g", g, GateWidth(s), num_tokens, true);
  if (st.ok()) st = CheckActivation(op, "beta", beta, ValueHeads(s), num_tokens, false);
  if (st.ok() && num_tokens > 0 && out == nullptr) st = Invalid(op, "out is null");
  return st;
}

absl::Status CheckStatePool(absl::string_view op, const KdaShape& s, const StatePool& p,
                            absl::string_view name) {
  if (p.data == nullptr) return Invalid(op, absl::StrCat(name, " is null"));
  if (p.num_blocks < 1) return Invalid(op, absl::StrCat(name, " has no blocks"));
  const int64_t per_block = ValueWidth(s) * s.head_dim;
  if (p.block_stride < per_block) {
    return Invalid(op, absl::StrCat(name, " block stride ", p.block_stride,
                                    " is less than one block's ", per_block, " elements"));
  }
  if (!Aligned16(p.data) || (p.block_stride * int64_t(DTypeSize(s.state_dtype))) % 16 != 0) {
    return Invalid(op, absl::StrCat(name, " blocks must start on 16-byte boundaries"));
  }
  return absl::OkStatus();
}

// KDA's gates need A_log and dt_bias; GDN's inputs are gated already.
absl::Status CheckParams(absl::string_view op, const KdaShape& s, const LayerParams& p,
                         absl::string_view layer) {
  if (s.kind == LayerKind::kKda && (p.a_log == nullptr || p.dt_bias == nullptr)) {
    return Invalid(op, absl::StrCat(layer, "A_log and dt_bias must be set"));
  }
  return absl::OkStatus();
}

absl::Status CheckIndexMatrix(absl::string_view op, absl::string_view name, const IndexMatrix& m,
                              int rows, int min_cols) {
  if (rows == 0) return absl::OkStatus();
  if (m.data == nullptr) return Invalid(op, absl::StrCat(name, " is null"));
  if (m.cols < min_cols) {
    return Invalid(op, absl::StrCat(name, " has ", m.cols, " columns, needs at least ", min_cols));
  }
  if (rows > 1 && m.row_stride < 1) {
    return Invalid(op, absl::StrCat(name, " row stride ", m.row_stride, " must be >= 1"));
  }
  return absl::OkStatus();
}

// `buffers`: the call reads or writes the records (FAST uses only their
// rows and window q).
absl::Status CheckRecords(absl::string_view op, const Records& r, int num_rows,
                          absl::string_view layer, bool buffers = true) {
  if (buffers && (r.kv == nullptr || r.g == nullptr || r.beta == nullptr)) {
    return Invalid(op, absl::StrCat(layer, "records are null"));
  }
  if (r.q < 1 || r.q > kMaxSpecQueryLen) {
    return OutOfRange(op, absl::StrCat(layer, "record window q = ", r.q, " must be in [1, ",
                                       kMaxSpecQueryLen, "]"));
  }
  if (num_rows > r.rows) {
    return OutOfRange(op, absl::StrCat(layer, num_rows, " rows exceed the ", r.rows,
                                       " record rows"));
  }
  return absl::OkStatus();
}

absl::Status CheckRows(absl::string_view op, int num_rows, const int32_t* qsl) {
  if (num_rows < 0) return Invalid(op, absl::StrCat("num_rows = ", num_rows, " is negative"));
  if (num_rows > 0 && qsl == nullptr) return Invalid(op, "query_start_loc is null");
  return absl::OkStatus();
}

absl::Status CheckPrerequisites(absl::string_view op, const Prerequisites& p) {
  if (p.count < 0 || (p.count > 0 && p.statuses == nullptr)) {
    return Invalid(op, "prerequisites: a count without statuses");
  }
  if (p.generation != 0 && p.cancelled == nullptr) {
    return Invalid(op, "prerequisites: a generation without a cancellation word");
  }
  return absl::OkStatus();
}

absl::Status CheckWorkspace(absl::string_view op, const void* workspace, size_t have,
                            size_t need) {
  if (need > 0 && (workspace == nullptr || have < need)) {
    return Invalid(op, absl::StrCat("workspace of ", have, " bytes is smaller than the ", need,
                                    " bytes this call needs"));
  }
  return absl::OkStatus();
}

// DEFERRED's bookkeeping for `num_layers` layers of `num_blocks` blocks.
absl::Status CheckPending(absl::string_view op, const PendingBlocks& p, int num_layers,
                          int64_t num_blocks, int rows) {
  if (p.entries == nullptr || p.header == nullptr) {
    return Invalid(op, "pending: entries and header must be set");
  }
  if (p.num_layers != num_layers || p.num_blocks != num_blocks) {
    return Invalid(op, absl::StrCat("pending: the table is for ", p.num_layers, " layers of ",
                                    p.num_blocks, " blocks, the pools have ", num_layers,
                                    " layers of ", num_blocks));
  }
  if (rows > p.capacity) {
    return OutOfRange(op, absl::StrCat("pending: ", rows, " rows exceed its capacity of ",
                                       p.capacity));
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
    return Invalid(op, absl::StrCat("jobs: room for ", j.capacity, " replays, ", need,
                                    " needed"));
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
  return ValidateDeferredWindow(r.q);
}

// FAST: one layer's rings, for a pool of `num_blocks` blocks and windows of
// q tokens.
absl::Status CheckFastRings(absl::string_view op, const FastRings& r, int64_t num_blocks, int q,
                            absl::string_view layer) {
  if (r.k == nullptr || r.u == nullptr || r.log_decay == nullptr || r.cursors == nullptr) {
    return Invalid(op, absl::StrCat(layer, "fast: the rings' k, u, log_decay and cursors must be "
                                    "set"));
  }
  if (r.num_blocks != num_blocks) {
    return Invalid(op, absl::StrCat(layer, "fast.num_blocks = ", r.num_blocks,
                                    " differs from the pool's ", num_blocks,
                                    " (a ring per state block)"));
  }
  if (q > kMaxFastQueryLen) {
    return OutOfRange(op, absl::StrCat("commit mode FAST verifies at most ", kMaxFastQueryLen,
                                       " tokens a row: the window q = ", q, " is past it"));
  }
  if (r.capacity < q) {
    return OutOfRange(op, absl::StrCat(layer, "fast.capacity = ", r.capacity,
                                       " is below the window's ", q,
                                       " tokens (a ring holds at least one window)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateDeferredWindow(int spec_query_len) {
  if (2 * spec_query_len > kMaxSpecQueryLen) {
    return absl::OutOfRangeError(absl::StrCat(
        "commit mode DEFERRED replays up to Q pending tokens and verifies Q in one pass: Q = ",
        spec_query_len, " must be at most ", kMaxSpecQueryLen / 2, " (num_spec <= ",
        kMaxSpecQueryLen / 2 - 1, ")"));
  }
  return absl::OkStatus();
}

absl::Status ValidateShape(const KdaShape& shape) { return CheckShape("KdaShape", shape); }

absl::Status ValidateStockArgs(const StockArgs& a) {
  constexpr absl::string_view op = "Stock";
  absl::Status st = CheckShape(op, a.shape);
  if (st.ok()) st = CheckActivations(op, a.shape, a.q, a.k, a.v, a.g, a.beta, a.num_tokens, a.out);
  if (st.ok()) st = CheckStatePool(op, a.shape, a.state, "state pool");
  if (st.ok()) st = CheckParams(op, a.shape, a.params, "");
  if (st.ok()) st = CheckRows(op, a.num_rows, a.query_start_loc);
  if (st.ok()) st = CheckIndexMatrix(op, "ssm_state_indices", a.ssm_state_indices, a.num_rows, 1);
  if (st.ok()) {
    st = CheckWorkspace(op, a.workspace, a.workspace_bytes, StockWorkspaceBytes(a.state.num_blocks));
  }
  if (st.ok() && a.status == nullptr) st = Invalid(op, "status is null");
  return st;
}

absl::Status ValidateVerifyArgs(const VerifyArgs& a) {
  constexpr absl::string_view op = "Verify";
  absl::Status st = CheckShape(op, a.shape);
  if (st.ok()) st = CheckActivations(op, a.shape, a.q, a.k, a.v, a.g, a.beta, a.num_tokens, a.out);
  if (st.ok()) st = CheckStatePool(op, a.shape, a.state, "state pool");
  if (st.ok()) st = CheckParams(op, a.shape, a.params, "");
  const bool fast = a.fast.cursors != nullptr;
  if (st.ok()) st = CheckRows(op, a.num_rows, a.query_start_loc);
  if (st.ok()) st = CheckRecords(op, a.records, a.num_rows, "", /*buffers=*/!fast);
  if (st.ok()) st = CheckIndexMatrix(op, "state_indices", a.state_indices, a.num_rows, 1);
  if (st.ok()) {
    const bool snapshot =
        a.snapshot_query_start_loc != nullptr && a.snapshot_state_indices != nullptr;
    const bool expected =
        a.expected_query_start_loc != nullptr && a.expected_state_indices != nullptr;
    const bool any = a.snapshot_query_start_loc != nullptr || a.snapshot_state_indices != nullptr ||
                     a.expected_query_start_loc != nullptr || a.expected_state_indices != nullptr;
    if (snapshot == expected || (any && !snapshot && !expected)) {
      st = Invalid(op, "give the snapshot (snapshot_query_start_loc and snapshot_state_indices) "
                       "or the expected values (expected_query_start_loc and "
                       "expected_state_indices): one of the two pairs");
    }
  }
  if (st.ok()) st = CheckPrerequisites(op, a.prerequisites);
  if (st.ok() && a.status == nullptr) st = Invalid(op, "status is null");
  if (st.ok() && fast && a.pending.entries != nullptr) {
    st = Invalid(op, "fast and pending are two commit modes: set one (FAST or DEFERRED)");
  }
  if (st.ok() && a.pending.entries != nullptr) {
    st = CheckPending(op, a.pending, a.pending.num_layers, a.state.num_blocks, 0);
    if (st.ok() && (a.layer < 0 || a.layer >= a.pending.num_layers)) {
      st = OutOfRange(op, absl::StrCat("layer ", a.layer, " is past the pending table's ",
                                       a.pending.num_layers, " layers"));
    }
    if (st.ok()) st = CheckAltRecords(op, a.records, a.records_alt, "");
    if (st.ok() && a.num_rows > 0 && a.replay_plan == nullptr) st = Invalid(op, "replay_plan is null");
    if (st.ok()) {
      st = CheckWorkspace(op, a.workspace, a.workspace_bytes,
                          VerifyWorkspaceBytes(a.state.num_blocks));
    }
  }
  if (st.ok() && fast) {
    st = CheckFastRings(op, a.fast, a.state.num_blocks, a.records.q, "");
    if (st.ok()) {
      st = CheckWorkspace(op, a.workspace, a.workspace_bytes,
                          VerifyWorkspaceBytes(a.state.num_blocks));
    }
  }
  return st;
}

absl::Status ValidateCommitArgs(const CommitArgs& a) {
  constexpr absl::string_view op = "Commit";
  absl::Status st = CheckShape(op, a.shape);
  if (!st.ok()) return st;
  if (a.num_layers < 1 || a.layers == nullptr || a.device_layers == nullptr) {
    return Invalid(op, "a commit needs at least one layer");
  }
  if (a.spec_query_len < 1 || a.spec_query_len > kMaxSpecQueryLen) {
    return OutOfRange(op, absl::StrCat("spec_query_len = ", a.spec_query_len, " must be in [1, ",
                                       kMaxSpecQueryLen, "]"));
  }
  st = CheckRows(op, a.num_rows, a.query_start_loc);
  if (!st.ok()) return st;
  const CommitLayer& first = a.layers[0];
  for (int l = 0; l < a.num_layers; ++l) {
    const CommitLayer& layer = a.layers[l];
    const std::string name = absl::StrCat("layer ", l, ": ");
    st = CheckStatePool(op, a.shape, layer.state, absl::StrCat(name, "state pool"));
    if (!st.ok()) return st;
    if (layer.state.num_blocks != first.state.num_blocks) {
      return Invalid(op, absl::StrCat(name, "state pool has ", layer.state.num_blocks,
                                      " blocks, layer 0 has ", first.state.num_blocks));
    }
    const ConvPool& c = layer.conv;
    if (c.data == nullptr) return Invalid(op, absl::StrCat(name, "conv pool is null"));
    if (c.num_blocks != first.state.num_blocks) {
      return Invalid(op, absl::StrCat(name, "conv pool has ", c.num_blocks,
                                      " blocks, the state pool has ", first.state.num_blocks));
    }
    if (c.dim < 1) return Invalid(op, absl::StrCat(name, "conv dim must be >= 1"));
    if (c.dim != first.conv.dim || c.width != first.conv.width) {
      return Invalid(op, absl::StrCat(name, "conv blocks [", c.dim, ", ", c.width,
                                      "] differ from layer 0's [", first.conv.dim, ", ",
                                      first.conv.width, "]"));
    }
    if (c.width - a.spec_query_len + 1 <= 0) {
      return Invalid(op, absl::StrCat(name, "conv window of ", c.width,
                                      " columns is shorter than the ", a.spec_query_len,
                                      "-token speculative window"));
    }
    if (c.width - a.spec_query_len + 1 > kMaxConvHistory) {
      return Invalid(op, absl::StrCat(name, "conv history of ", c.width - a.spec_query_len + 1,
                                      " columns exceeds the supported ", kMaxConvHistory));
    }
    if (c.block_stride < 1 || c.dim_stride < 1 || c.token_stride < 1) {
      return Invalid(op, absl::StrCat(name, "conv pool strides must be positive"));
    }
    st = CheckParams(op, a.shape, layer.params, name);
    if (!st.ok()) return st;
    st = CheckRecords(op, layer.records, a.num_rows, name, /*buffers=*/!a.fast);
    if (!st.ok()) return st;
    if (a.fast) {
      st = CheckFastRings(op, layer.fast, first.state.num_blocks, a.spec_query_len, name);
      if (!st.ok()) return st;
    }
    if (layer.records.q != a.spec_query_len) {
      return Invalid(op, absl::StrCat(name, "records hold windows of ", layer.records.q,
                                      " tokens, the commit expects ", a.spec_query_len));
    }
  }
  st = CheckIndexMatrix(op, "state_indices", a.state_indices, a.num_rows, 1);
  if (!st.ok()) return st;
  if (a.batch < 0) return Invalid(op, absl::StrCat("batch = ", a.batch, " is negative"));
  if (a.num_rows > 0 && a.num_accepted == nullptr) return Invalid(op, "num_accepted is null");
  if (a.request_indices == nullptr && a.batch < a.num_rows) {
    return OutOfRange(op, absl::StrCat("without request_indices, num_accepted needs one entry per "
                                       "row: batch ", a.batch, " < ", a.num_rows, " rows"));
  }
  const bool has_table = a.block_table.data != nullptr;
  const bool has_computed = a.num_computed_tokens != nullptr;
  const bool has_size = a.mamba_block_size != 0;
  if (has_table || has_computed || has_size) {
    if (!(has_table && has_computed && has_size)) {
      return Invalid(op, "align mode needs block_table, num_computed_tokens and mamba_block_size "
                         "together");
    }
    if (a.mamba_block_size < a.spec_query_len) {
      return Invalid(op, absl::StrCat("mamba_block_size = ", a.mamba_block_size,
                                      " must cover one speculative window of ",
                                      a.spec_query_len, " tokens"));
    }
    st = CheckIndexMatrix(op, "block_table", a.block_table, a.batch, 1);
    if (!st.ok()) return st;
  }
  st = CheckWorkspace(op, a.workspace, a.workspace_bytes,
                      CommitWorkspaceBytes(a.num_rows, a.spec_query_len, first.state.num_blocks));
  if (!st.ok()) return st;
  st = CheckPrerequisites(op, a.prerequisites);
  if (!st.ok()) return st;
  if (a.status == nullptr) return Invalid(op, "status is null");
  if (a.journal.record != nullptr) {
    if (a.journal.entries == nullptr || a.journal.blocks == nullptr) {
      return Invalid(op, "journal: a record needs its entries and block records");
    }
    if (a.journal.capacity_rows < a.num_rows) {
      return OutOfRange(op, absl::StrCat("journal: entries for ", a.journal.capacity_rows,
                                         " rows, the commit has ", a.num_rows));
    }
    if (a.pending.entries != nullptr && a.pending.journal == nullptr) {
      return Invalid(op, "journal: a DEFERRED commit's journal needs the pending table's "
                         "(pending.journal): the table changes too");
    }
    if (a.fast) {
      return Invalid(op, "journal: FAST commits keep no journal yet (their accepted tokens "
                         "live in the rings, which do not outlive the service)");
    }
  }
  if (a.fast && a.pending.entries != nullptr) {
    return Invalid(op, "fast and pending are two commit modes: set one (FAST or DEFERRED)");
  }
  if (a.pending.journal != nullptr && a.journal.record == nullptr) {
    return Invalid(op, "pending.journal: a DEFERRED commit keeps both journals or neither (the "
                       "commit journal's finish closes the pending one)");
  }
  if (a.pending.entries != nullptr) {
    st = CheckPending(op, a.pending, a.num_layers, first.state.num_blocks, a.num_rows);
    if (!st.ok()) return st;
    st = CheckJobs(op, a.jobs, CommitJobsCapacity(a.pending.capacity, a.num_layers));
    if (!st.ok()) return st;
    for (int l = 0; l < a.num_layers; ++l) {
      st = CheckAltRecords(op, a.layers[l].records, a.layers[l].records_alt,
                           absl::StrCat("layer ", l, ": "));
      if (!st.ok()) return st;
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateFlushArgs(const FlushArgs& a) {
  constexpr absl::string_view op = "Flush";
  absl::Status st = CheckShape(op, a.shape);
  if (!st.ok()) return st;
  if (a.num_layers < 1 || a.layers == nullptr || a.device_layers == nullptr) {
    return Invalid(op, "a flush needs the layers");
  }
  if (a.spec_query_len < 1 || a.spec_query_len > kMaxSpecQueryLen) {
    return OutOfRange(op, absl::StrCat("spec_query_len = ", a.spec_query_len, " must be in [1, ",
                                       kMaxSpecQueryLen, "]"));
  }
  const int64_t num_blocks = a.layers[0].state.num_blocks;
  if (a.fast && a.pending.entries != nullptr) {
    return Invalid(op, "fast and pending are two commit modes: set one (FAST or DEFERRED)");
  }
  if (!a.fast) {
    st = CheckPending(op, a.pending, a.num_layers, num_blocks, 0);
    if (!st.ok()) return st;
    st = CheckJobs(op, a.jobs, FlushJobsCapacity(a.pending.capacity, a.num_layers));
    if (!st.ok()) return st;
  }
  if (a.layer < -1 || a.layer >= a.num_layers) {
    return OutOfRange(op, absl::StrCat("layer ", a.layer, " is out of range: -1 (every layer) or "
                                       "below ", a.num_layers));
  }
  if (a.num_blocks_given < 0 || a.num_blocks_given > num_blocks) {
    return OutOfRange(op, absl::StrCat(a.num_blocks_given, " blocks given: at most the pool's ",
                                       num_blocks));
  }
  if (a.num_blocks_given > 0 && (a.blocks == nullptr || a.checked_blocks == nullptr)) {
    return Invalid(op, "blocks and checked_blocks must be set");
  }
  for (int l = 0; l < a.num_layers; ++l) {
    st = CheckStatePool(op, a.shape, a.layers[l].state, absl::StrCat("layer ", l, ": state pool"));
    if (!st.ok()) return st;
    st = CheckParams(op, a.shape, a.layers[l].params, absl::StrCat("layer ", l, ": "));
    if (!st.ok()) return st;
    if (a.fast) {
      st = CheckFastRings(op, a.layers[l].fast, num_blocks, a.spec_query_len,
                          absl::StrCat("layer ", l, ": "));
    } else {
      st = CheckAltRecords(op, a.layers[l].records, a.layers[l].records_alt,
                           absl::StrCat("layer ", l, ": "));
    }
    if (!st.ok()) return st;
    if (a.layers[l].records.q != a.spec_query_len) {
      return Invalid(op, absl::StrCat("layer ", l, ": records hold windows of ",
                                      a.layers[l].records.q, " tokens, not ", a.spec_query_len));
    }
  }
  if (a.status == nullptr) return Invalid(op, "status is null");
  return absl::OkStatus();
}

absl::Status ValidateRecordStateBlocksArgs(const RecordStateBlocksArgs& a) {
  constexpr absl::string_view op = "RecordStateBlocks";
  if (a.num_rows < 0 || a.batch < 0 || a.num_requests < 0) {
    return Invalid(op, "num_rows, batch and num_requests must not be negative");
  }
  if (a.mamba_block_size < 1) {
    return Invalid(op, absl::StrCat("mamba_block_size = ", a.mamba_block_size, " must be >= 1"));
  }
  if (a.block_table_width < 1) {
    return Invalid(op, absl::StrCat("block_table_width = ", a.block_table_width, " must be >= 1"));
  }
  if (a.request_indices == nullptr && a.batch < a.num_rows) {
    return OutOfRange(op, absl::StrCat("without request_indices, the batch tensors need one entry "
                                       "per row: batch ", a.batch, " < ", a.num_rows, " rows"));
  }
  if (a.num_rows > 0 && (a.idx_mapping == nullptr || a.num_sampled == nullptr ||
                         a.num_computed_tokens == nullptr)) {
    return Invalid(op, "idx_mapping, num_sampled and num_computed_tokens must be set");
  }
  if (a.num_rows > 0 && (a.state_idx == nullptr || a.num_accepted == nullptr)) {
    return Invalid(op, "the outputs state_idx and num_accepted must be set");
  }
  const int rows = std::max(a.num_rows, a.num_requests);
  absl::Status st =
      CheckWorkspace(op, a.workspace, a.workspace_bytes, RecordStateBlocksWorkspaceBytes(rows));
  if (st.ok() && internal::RecordWorkspaceCapacity(a.workspace_bytes) < rows) {
    st = Invalid(op, absl::StrCat("workspace of ", a.workspace_bytes, " bytes holds ",
                                  internal::RecordWorkspaceCapacity(a.workspace_bytes),
                                  " rows, this call has ", rows));
  }
  if (st.ok()) st = CheckPrerequisites(op, a.prerequisites);
  if (st.ok() && a.status == nullptr) st = Invalid(op, "status is null");
  return st;
}

absl::Status ValidateLoadParamsArgs(const LoadParamsArgs& a) {
  constexpr absl::string_view op = "LoadParams";
  if (a.num_heads < 1 || a.head_dim < 1) {
    return Invalid(op, absl::StrCat("num_heads = ", a.num_heads, " and head_dim = ", a.head_dim,
                                    " must be >= 1"));
  }
  if (a.a_log == nullptr || a.dt_bias == nullptr) return Invalid(op, "a_log and dt_bias must be set");
  if (a.staging == nullptr) return Invalid(op, "staging is null");
  if (a.dst_a_log == nullptr || a.dst_dt_bias == nullptr) {
    return Invalid(op, "the destinations must be set");
  }
  if (a.status == nullptr) return Invalid(op, "status is null");
  return absl::OkStatus();
}

absl::Status KdaKernels::LoadParams(const LoadParamsArgs& args, Stream stream) const {
  absl::Status st = ValidateLoadParamsArgs(args);
  return st.ok() ? LaunchLoadParams(args, stream) : st;
}

absl::Status KdaKernels::Stock(const StockArgs& args, Stream stream) const {
  absl::Status st = ValidateStockArgs(args);
  return st.ok() ? LaunchStock(args, stream) : st;
}

absl::Status KdaKernels::Verify(const VerifyArgs& args, Stream stream) const {
  absl::Status st = ValidateVerifyArgs(args);
  if (st.ok()) st = LaunchVerify(args, stream);
  if (st.ok() && args.pending.entries != nullptr && args.pending.journal != nullptr) {
    st = LaunchPendingFinish(args.pending, stream);
  }
  return st;
}

absl::Status KdaKernels::Commit(const CommitArgs& args, Stream stream) const {
  absl::Status st = ValidateCommitArgs(args);
  if (st.ok()) st = LaunchCommit(args, stream);
  if (st.ok() && args.journal.record != nullptr) st = LaunchJournalFinish(args, stream);
  return st;
}

absl::Status KdaKernels::RecordStateBlocks(const RecordStateBlocksArgs& args,
                                           Stream stream) const {
  absl::Status st = ValidateRecordStateBlocksArgs(args);
  return st.ok() ? LaunchRecordStateBlocks(args, stream) : st;
}

absl::Status KdaKernels::Flush(const FlushArgs& args, Stream stream) const {
  absl::Status st = ValidateFlushArgs(args);
  if (st.ok()) st = LaunchFlush(args, stream);
  if (st.ok() && !args.fast && args.pending.journal != nullptr) {
    st = LaunchPendingFinish(args.pending, stream);
  }
  return st;
}

}  // namespace kernels
}  // namespace specstate
