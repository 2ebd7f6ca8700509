// Host-side validation of the FAST kernels' arguments and the ring sizes.
#include "kernels/fast/fast_kernels.h"

#include <cstdint>
#include <string>
#include <tuple>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/dtype.h"
#include "kernels/fast/fast_math.h"
#include "kernels/check_shape.h"
#include "kernels/checks/host.h"
#include "kernels/fast/interface_checks.h"

namespace specstate {
namespace kernels {
namespace fast {

size_t FastRingKBytes(const KdaShape& shape, int64_t num_blocks, int capacity) {
  return size_t(num_blocks) * capacity * RingKWidth(shape) * DTypeSize(shape.act_dtype);
}
size_t FastRingUBytes(const KdaShape& shape, int64_t num_blocks, int capacity) {
  return size_t(num_blocks) * capacity * RingUWidth(shape) * sizeof(float);
}
size_t FastRingLogDecayBytes(const KdaShape& shape, int64_t num_blocks, int capacity) {
  return size_t(num_blocks) * capacity * RingLogDecayWidth(shape) * sizeof(float);
}
size_t FastCursorBytes(int64_t num_blocks) { return size_t(num_blocks) * sizeof(FastCursor); }

namespace {

using ::specstate::fast::kMaxWindow;

using host::Invalid;
using host::OutOfRange;

absl::Status CheckQ(absl::string_view op, int q) {
  if (q < 1 || q > kMaxWindow) {
    return OutOfRange(op, absl::StrCat("spec_query_len = ", q, " must be in [1, ", kMaxWindow,
                                       "] (FAST verifies at most ", kMaxWindow,
                                       " tokens a row)"));
  }
  return absl::OkStatus();
}

// A layer's pool (as the kernel interface checks one) and its rings.
absl::Status CheckPoolAndRings(absl::string_view op, const KdaShape& shape, const StatePool& state,
                               const FastRings& rings, int q, absl::string_view where) {
  absl::Status st = host::CheckStatePool(op, shape, state, absl::StrCat(where, "state"));
  if (st.ok()) st = CheckRings(op, rings, state.num_blocks, q, where, "rings");
  return st;
}

}  // namespace

absl::Status ValidateFastVerifyArgs(const FastVerifyArgs& a) {
  constexpr absl::string_view op = "FastVerify";
  absl::Status st = CheckShape(op, a.shape);
  if (st.ok()) st = CheckQ(op, a.spec_query_len);
  if (st.ok()) st = CheckPoolAndRings(op, a.shape, a.state, a.rings, a.spec_query_len, "");
  if (st.ok()) st = host::CheckParams(op, a.shape, a.params, "");
  if (!st.ok()) return st;
  if (a.num_tokens < 0) return Invalid(op, absl::StrCat("num_tokens = ", a.num_tokens));
  for (const auto& [name, x, width] :
       {std::make_tuple("q", a.q, KeyWidth(a.shape)), std::make_tuple("k", a.k, KeyWidth(a.shape)),
        std::make_tuple("v", a.v, ValueWidth(a.shape)),
        std::make_tuple("g", a.g, GateWidth(a.shape)),
        std::make_tuple("beta", a.beta, int64_t{ValueHeads(a.shape)})}) {
    if (a.num_tokens == 0) break;  // no token is read
    st = host::CheckActivation(op, name, x, width, a.num_tokens, /*dense=*/false);
    if (!st.ok()) return st;
  }
  if (a.num_tokens > 0 && a.out == nullptr) return Invalid(op, "out is null");
  if (a.num_rows < 0) return Invalid(op, absl::StrCat("num_rows = ", a.num_rows));
  if (a.num_rows > 0 && (a.query_start_loc == nullptr || a.state_indices == nullptr)) {
    return Invalid(op, "query_start_loc and state_indices are required");
  }
  return absl::OkStatus();
}

absl::Status ValidateFastCommitArgs(const FastCommitArgs& a) {
  constexpr absl::string_view op = "FastCommit";
  absl::Status st = CheckShape(op, a.shape);
  if (st.ok()) st = CheckQ(op, a.spec_query_len);
  if (!st.ok()) return st;
  if (a.num_layers < 1 || a.layers == nullptr) {
    return Invalid(op, absl::StrCat("num_layers = ", a.num_layers, " (at least 1, with layers)"));
  }
  for (int l = 0; l < a.num_layers; ++l) {
    const std::string where = absl::StrCat("layer ", l, ": ");
    st = CheckPoolAndRings(op, a.shape, a.layers[l].state, a.layers[l].rings, a.spec_query_len,
                           where);
    if (st.ok()) st = host::CheckParams(op, a.shape, a.layers[l].params, where);
    if (st.ok() && a.layers[l].state.num_blocks != a.layers[0].state.num_blocks) {
      st = Invalid(op, absl::StrCat(where, "state.num_blocks = ", a.layers[l].state.num_blocks,
                                    " differs from layer 0's ", a.layers[0].state.num_blocks));
    }
    if (!st.ok()) return st;
  }
  if (a.num_rows < 0) return Invalid(op, absl::StrCat("num_rows = ", a.num_rows));
  if (a.num_rows == 0) return absl::OkStatus();
  if (a.query_start_loc == nullptr || a.state_indices.data == nullptr ||
      a.num_accepted == nullptr) {
    return Invalid(op, "query_start_loc, state_indices and num_accepted are required");
  }
  if (a.state_indices.row_stride < 1) {
    return Invalid(op, absl::StrCat("state_indices.row_stride = ", a.state_indices.row_stride));
  }
  if (a.batch < 1) return Invalid(op, absl::StrCat("batch = ", a.batch, " (at least 1)"));
  if (a.request_indices == nullptr && a.batch < a.num_rows) {
    return OutOfRange(op, absl::StrCat("batch = ", a.batch, " is below num_rows = ", a.num_rows,
                                       " without request_indices"));
  }
  const bool any_align = a.block_table.data != nullptr || a.num_computed_tokens != nullptr ||
                         a.mamba_block_size != 0;
  const bool align = a.block_table.data != nullptr && a.num_computed_tokens != nullptr &&
                     a.mamba_block_size > 0;
  if (any_align && !align) {
    return Invalid(op, "align mode needs block_table, num_computed_tokens and a positive "
                       "mamba_block_size (or none of them)");
  }
  if (align && (a.block_table.cols < 1 || a.block_table.row_stride < a.block_table.cols)) {
    return Invalid(op, absl::StrCat("block_table: ", a.block_table.cols, " columns, row_stride ",
                                    a.block_table.row_stride));
  }
  return absl::OkStatus();
}

absl::Status ValidateFastMaterializeArgs(const FastMaterializeArgs& a) {
  constexpr absl::string_view op = "FastMaterialize";
  absl::Status st = CheckShape(op, a.shape);
  if (!st.ok()) return st;
  if (a.num_layers < 1 || a.layers == nullptr) {
    return Invalid(op, absl::StrCat("num_layers = ", a.num_layers, " (at least 1, with layers)"));
  }
  if (a.layer < -1 || a.layer >= a.num_layers) {
    return OutOfRange(op, absl::StrCat("layer = ", a.layer, " is past the group's ",
                                       a.num_layers, " layers (-1: all)"));
  }
  for (int l = 0; l < a.num_layers; ++l) {
    if (a.layer >= 0 && l != a.layer) continue;
    const std::string where = absl::StrCat("layer ", l, ": ");
    st = CheckPoolAndRings(op, a.shape, a.layers[l].state, a.layers[l].rings, 1, where);
    if (st.ok()) st = host::CheckParams(op, a.shape, a.layers[l].params, where);
    if (!st.ok()) return st;
  }
  if (a.num_blocks_given < 0 || (a.num_blocks_given > 0 && a.blocks == nullptr)) {
    return Invalid(op, absl::StrCat("num_blocks_given = ", a.num_blocks_given, " with blocks ",
                                    a.blocks == nullptr ? "null" : "set"));
  }
  if (a.out != nullptr && a.layer < 0 && a.num_layers > 1) {
    return Invalid(op, "out holds one layer's states: name the layer");
  }
  if (a.out != nullptr && a.discard) return Invalid(op, "discard writes no states to out");
  if (a.every_block && (a.blocks != nullptr || a.num_blocks_given != 0 || a.out != nullptr)) {
    return Invalid(op, "every_block takes no block list and no out");
  }
  return absl::OkStatus();
}

}  // namespace fast
}  // namespace kernels
}  // namespace specstate
