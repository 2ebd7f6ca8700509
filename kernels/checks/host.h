// The host checks of the kernels' arguments that every verb and commit mode
// shares: each returns INVALID_ARGUMENT or OUT_OF_RANGE "In <op>: ..."
// naming the field and the bound, or OK. The kernel interface's Validate*
// (kda_kernels.cc) and each mode's own (kernels/<mode>/*_checks.h) are
// written with them, so a field is refused alike whichever check sees it.
//
//   absl::Status st = host::CheckStatePool("Verify", shape, args.state, "state pool");
//   // "In Verify: state pool block stride 64 is less than one block's 4096 elements"
#ifndef SPECSTATE_KERNELS_CHECKS_HOST_H_
#define SPECSTATE_KERNELS_CHECKS_HOST_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace host {

// "In <op>: <what>" as INVALID_ARGUMENT or OUT_OF_RANGE.
absl::Status Invalid(absl::string_view op, absl::string_view what);
absl::Status OutOfRange(absl::string_view op, absl::string_view what);

bool Aligned16(const void* p);

// A token-major activation of `per_token` elements a token: set when there
// are tokens, token_stride >= per_token (`dense`: equal).
absl::Status CheckActivation(absl::string_view op, absl::string_view name, const Activation& a,
                             int64_t per_token, int64_t num_tokens, bool dense);
// q, k, v, g (dense), beta of `num_tokens` tokens of shape `s`, and `out`.
absl::Status CheckActivations(absl::string_view op, const KdaShape& s, const Activation& q,
                              const Activation& k, const Activation& v, const Activation& g,
                              const Activation& beta, int64_t num_tokens, const void* out);
// A state pool of shape `s`: set, blocks, stride, 16-byte aligned blocks.
absl::Status CheckStatePool(absl::string_view op, const KdaShape& s, const StatePool& p,
                            absl::string_view name);
// KDA's gates need A_log and dt_bias; GDN's inputs are gated already.
absl::Status CheckParams(absl::string_view op, const KdaShape& s, const LayerParams& p,
                         absl::string_view layer);
absl::Status CheckIndexMatrix(absl::string_view op, absl::string_view name, const IndexMatrix& m,
                              int rows, int min_cols);
// The records' window q (1 to kMaxSpecQueryLen) and rows (at least
// num_rows); CheckRecordBuffers: their buffers set (the modes that read or
// write them).
absl::Status CheckRecordWindow(absl::string_view op, const Records& r, int num_rows,
                               absl::string_view layer);
absl::Status CheckRecordBuffers(absl::string_view op, const Records& r, absl::string_view layer);
absl::Status CheckRows(absl::string_view op, int num_rows, const int32_t* qsl);
absl::Status CheckPrerequisites(absl::string_view op, const Prerequisites& p);
// `have` bytes at `workspace`, at least `need`.
absl::Status CheckWorkspace(absl::string_view op, const void* workspace, size_t have, size_t need);

}  // namespace host
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_CHECKS_HOST_H_
