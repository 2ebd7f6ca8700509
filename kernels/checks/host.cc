// The host checks every verb and mode shares (host.h).
#include "kernels/checks/host.h"

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/dtype.h"

namespace specstate {
namespace kernels {
namespace host {

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

absl::Status CheckRecordWindow(absl::string_view op, const Records& r, int num_rows,
                               absl::string_view layer) {
  if (r.q < 1 || r.q > kMaxSpecQueryLen) {
    return OutOfRange(op, absl::StrCat(layer, "record window q = ", r.q, " must be in [1, ",
                                       kMaxSpecQueryLen, "]"));
  }
  if (num_rows > r.rows) {
    return OutOfRange(op,
                      absl::StrCat(layer, num_rows, " rows exceed the ", r.rows, " record rows"));
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

absl::Status CheckRecordBuffers(absl::string_view op, const Records& r, absl::string_view layer) {
  if (r.kv == nullptr || r.g == nullptr || r.beta == nullptr) {
    return Invalid(op, absl::StrCat(layer, "records are null"));
  }
  return absl::OkStatus();
}

absl::Status CheckWorkspace(absl::string_view op, const void* workspace, size_t have, size_t need) {
  if (need > 0 && (workspace == nullptr || have < need)) {
    return Invalid(op, absl::StrCat("workspace of ", have, " bytes is smaller than the ", need,
                                    " bytes this call needs"));
  }
  return absl::OkStatus();
}

}  // namespace host
}  // namespace kernels
}  // namespace specstate
