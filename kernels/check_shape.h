// The host check of a KdaShape, shared by the kernel interface
// (kda_kernels.h: every Validate*Args, ValidateShape) and the FAST kernels
// (kernels/fast), which the CPU backend of the interface calls and which
// therefore cannot depend on it.
//
//   absl::Status st = CheckShape("Verify", shape);
//   // INVALID_ARGUMENT: "In Verify: head_dim = 96 is not supported (...)"
#ifndef SPECSTATE_KERNELS_CHECK_SHAPE_H_
#define SPECSTATE_KERNELS_CHECK_SHAPE_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {

// OK when the kernels support `shape`: H >= 1, K in {64, 128, 256},
// activations bf16/fp16/fp32, state fp32/bf16, KDA (HV = H, a known gate, a
// negative lower bound for the safe gate) or GDN (HV a multiple of H).
// \returns INVALID_ARGUMENT "In <op>: ..." naming the field otherwise.
absl::Status CheckShape(absl::string_view op, const KdaShape& shape);

}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_CHECK_SHAPE_H_
