// The kernel interface (kda_kernels.h): the host checks every verb and mode
// shares, and each verb's one dispatch on the commit mode (ModeDispatch),
// which forwards to the mode's own host checks (kernels/<mode>/*_checks.h)
// and the backend's launcher of the mode's kernels.
#include "kernels/kda_kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/check_shape.h"
#include "kernels/checks/host.h"
#include "kernels/checks/record_rows.h"
#include "kernels/deferred/deferred_checks.h"
#include "kernels/eager/eager_checks.h"
#include "kernels/fast/interface_checks.h"

namespace specstate {
namespace kernels {

absl::string_view BackendName(Backend backend) {
  return backend == Backend::kCuda ? "cuda" : "cpu";
}

void UseEagerCudaModuleLoading() { setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/1); }

// Each verb's one dispatch on the commit mode: the mode's host checks (after
// the checks every mode shares) and the backend's launcher of the mode's
// kernels. The only place outside kernels/<mode>/ that tells the modes apart.
struct ModeDispatch {
  template <typename Args>
  struct Verb {
    absl::Status (*validate)(const Args&);
    absl::Status (KdaKernels::*launch)(const Args&, Stream) const;
  };

  static const char* OpOf(const VerifyArgs&) { return "Verify"; }
  static const char* OpOf(const CommitArgs&) { return "Commit"; }
  static const char* OpOf(const FlushArgs&) { return "Flush"; }

  template <typename Args>
  static absl::Status UnknownMode(const Args& a) {
    return absl::InvalidArgumentError(absl::StrCat("In ", OpOf(a), ": mode ",
                                                   static_cast<int>(a.mode),
                                                   " is not a commit mode (EAGER, DEFERRED or "
                                                   "FAST)"));
  }

  static Verb<VerifyArgs> Verify(CommitMode mode) {
    switch (mode) {
      case CommitMode::kEager:
        return {eager::ValidateVerify, &KdaKernels::LaunchEagerVerify};
      case CommitMode::kDeferred:
        return {deferred::ValidateVerify, &KdaKernels::LaunchDeferredVerify};
      case CommitMode::kFast:
        return {fast::ValidateInterfaceVerify, &KdaKernels::LaunchFastVerify};
    }
    return {UnknownMode<VerifyArgs>, nullptr};
  }

  static Verb<CommitArgs> Commit(CommitMode mode) {
    switch (mode) {
      case CommitMode::kEager:
        return {eager::ValidateCommit, &KdaKernels::LaunchEagerCommit};
      case CommitMode::kDeferred:
        return {deferred::ValidateCommit, &KdaKernels::LaunchDeferredCommit};
      case CommitMode::kFast:
        return {fast::ValidateInterfaceCommit, &KdaKernels::LaunchFastCommit};
    }
    return {UnknownMode<CommitArgs>, nullptr};
  }

  // (EAGER's checks refuse every Flush: it has no launcher.)
  static Verb<FlushArgs> Flush(CommitMode mode) {
    switch (mode) {
      case CommitMode::kEager:
        return {eager::ValidateFlush, nullptr};
      case CommitMode::kDeferred:
        return {deferred::ValidateFlush, &KdaKernels::LaunchDeferredFlush};
      case CommitMode::kFast:
        return {fast::ValidateInterfaceFlush, &KdaKernels::LaunchFastFlush};
    }
    return {UnknownMode<FlushArgs>, nullptr};
  }
};

namespace {

using host::CheckActivations;
using host::CheckIndexMatrix;
using host::CheckParams;
using host::CheckPrerequisites;
using host::CheckRecordWindow;
using host::CheckRows;
using host::CheckStatePool;
using host::CheckWorkspace;
using host::Invalid;
using host::OutOfRange;

}  // namespace

absl::Status ValidateDeferredWindow(int spec_query_len) {
  return deferred::ValidateWindow(spec_query_len);
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
    st =
        CheckWorkspace(op, a.workspace, a.workspace_bytes, StockWorkspaceBytes(a.state.num_blocks));
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
  if (st.ok()) st = CheckRows(op, a.num_rows, a.query_start_loc);
  if (st.ok()) st = CheckRecordWindow(op, a.records, a.num_rows, "");
  if (st.ok()) st = CheckIndexMatrix(op, "state_indices", a.state_indices, a.num_rows, 1);
  if (st.ok()) {
    const bool snapshot =
        a.snapshot_query_start_loc != nullptr && a.snapshot_state_indices != nullptr;
    const bool expected =
        a.expected_query_start_loc != nullptr && a.expected_state_indices != nullptr;
    const bool any = a.snapshot_query_start_loc != nullptr || a.snapshot_state_indices != nullptr ||
                     a.expected_query_start_loc != nullptr || a.expected_state_indices != nullptr;
    if (snapshot == expected || (any && !snapshot && !expected)) {
      st = Invalid(op,
                   "give the snapshot (snapshot_query_start_loc and snapshot_state_indices) "
                   "or the expected values (expected_query_start_loc and "
                   "expected_state_indices): one of the two pairs");
    }
  }
  if (st.ok()) st = CheckPrerequisites(op, a.prerequisites);
  if (st.ok() && a.status == nullptr) st = Invalid(op, "status is null");
  if (!st.ok()) return st;
  return ModeDispatch::Verify(a.mode).validate(a);
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
      return Invalid(
          op, absl::StrCat(name, "conv blocks [", c.dim, ", ", c.width, "] differ from layer 0's [",
                           first.conv.dim, ", ", first.conv.width, "]"));
    }
    if (c.width - a.spec_query_len + 1 <= 0) {
      return Invalid(op,
                     absl::StrCat(name, "conv window of ", c.width, " columns is shorter than the ",
                                  a.spec_query_len, "-token speculative window"));
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
    st = CheckRecordWindow(op, layer.records, a.num_rows, name);
    if (!st.ok()) return st;
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
                                       "row: batch ",
                                       a.batch, " < ", a.num_rows, " rows"));
  }
  const bool has_table = a.block_table.data != nullptr;
  const bool has_computed = a.num_computed_tokens != nullptr;
  const bool has_size = a.mamba_block_size != 0;
  if (has_table || has_computed || has_size) {
    if (!(has_table && has_computed && has_size)) {
      return Invalid(op,
                     "align mode needs block_table, num_computed_tokens and mamba_block_size "
                     "together");
    }
    if (a.mamba_block_size < a.spec_query_len) {
      return Invalid(
          op, absl::StrCat("mamba_block_size = ", a.mamba_block_size,
                           " must cover one speculative window of ", a.spec_query_len, " tokens"));
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
  }
  return ModeDispatch::Commit(a.mode).validate(a);
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
  if (a.layer < -1 || a.layer >= a.num_layers) {
    return OutOfRange(op, absl::StrCat("layer ", a.layer,
                                       " is out of range: -1 (every layer) or "
                                       "below ",
                                       a.num_layers));
  }
  if (a.num_blocks_given < 0 || a.num_blocks_given > num_blocks) {
    return OutOfRange(
        op, absl::StrCat(a.num_blocks_given, " blocks given: at most the pool's ", num_blocks));
  }
  if (a.num_blocks_given > 0 && (a.blocks == nullptr || a.checked_blocks == nullptr)) {
    return Invalid(op, "blocks and checked_blocks must be set");
  }
  for (int l = 0; l < a.num_layers; ++l) {
    st = CheckStatePool(op, a.shape, a.layers[l].state, absl::StrCat("layer ", l, ": state pool"));
    if (!st.ok()) return st;
    st = CheckParams(op, a.shape, a.layers[l].params, absl::StrCat("layer ", l, ": "));
    if (!st.ok()) return st;
    if (a.layers[l].records.q != a.spec_query_len) {
      return Invalid(op, absl::StrCat("layer ", l, ": records hold windows of ",
                                      a.layers[l].records.q, " tokens, not ", a.spec_query_len));
    }
  }
  if (a.copy.data != nullptr) {
    if (a.layer < 0) {
      return Invalid(op, "copy: a copy is of one layer, and layer is -1 (every layer)");
    }
    if (a.blocks == nullptr || a.num_blocks_given < 1) {
      return Invalid(op, "copy: a copy needs a block list (blocks is empty)");
    }
    if (a.discard) return Invalid(op, "copy: discard changes the blocks; a copy changes nothing");
    if (a.copy.num_blocks <= a.num_blocks_given) {
      return OutOfRange(op, absl::StrCat("copy.num_blocks = ", a.copy.num_blocks,
                                         " must exceed the ", a.num_blocks_given,
                                         " blocks given (its block 0 is unused)"));
    }
    st = CheckStatePool(op, a.shape, a.copy, "copy");
    if (!st.ok()) return st;
    if (a.copy.block_stride != a.layers[a.layer].state.block_stride) {
      return Invalid(op, absl::StrCat("copy.block_stride = ", a.copy.block_stride,
                                      " must be layer ", a.layer, "'s pool's, ",
                                      a.layers[a.layer].state.block_stride));
    }
  }
  if (a.status == nullptr) return Invalid(op, "status is null");
  return ModeDispatch::Flush(a.mode).validate(a);
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
                                       "per row: batch ",
                                       a.batch, " < ", a.num_rows, " rows"));
  }
  if (a.num_rows > 0 &&
      (a.idx_mapping == nullptr || a.num_sampled == nullptr || a.num_computed_tokens == nullptr)) {
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
  if (a.a_log == nullptr || a.dt_bias == nullptr)
    return Invalid(op, "a_log and dt_bias must be set");
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
  return st.ok() ? (this->*ModeDispatch::Verify(args.mode).launch)(args, stream) : st;
}

absl::Status KdaKernels::Commit(const CommitArgs& args, Stream stream) const {
  absl::Status st = ValidateCommitArgs(args);
  return st.ok() ? (this->*ModeDispatch::Commit(args.mode).launch)(args, stream) : st;
}

absl::Status KdaKernels::RecordStateBlocks(const RecordStateBlocksArgs& args, Stream stream) const {
  absl::Status st = ValidateRecordStateBlocksArgs(args);
  return st.ok() ? LaunchRecordStateBlocks(args, stream) : st;
}

absl::Status KdaKernels::Flush(const FlushArgs& args, Stream stream) const {
  absl::Status st = ValidateFlushArgs(args);
  return st.ok() ? (this->*ModeDispatch::Flush(args.mode).launch)(args, stream) : st;
}

}  // namespace kernels
}  // namespace specstate
