// Element types that cross the kernel boundary, and their sizes and names.
//
// Activations are bf16, fp16 or fp32; recurrent states fp32 or bf16; indices
// int32. The names are the ones the wire protocol and the config use:
//
//   DType d = DType::kBFloat16;
//   DTypeName(d)     // "bf16"
//   DTypeSize(d)     // 2
//   ParseDType("fp32")  // DType::kFloat32
#ifndef SPECSTATE_KERNELS_DTYPE_H_
#define SPECSTATE_KERNELS_DTYPE_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace specstate {

enum class DType : int32_t {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kInt32 = 3,
};

// Bytes per element.
size_t DTypeSize(DType dtype);

// "fp32", "fp16", "bf16", "int32".
absl::string_view DTypeName(DType dtype);

// Accepts the names above (and "float32", "float16", "bfloat16").
// Returns INVALID_ARGUMENT naming the accepted values otherwise.
absl::StatusOr<DType> ParseDType(absl::string_view name);

}  // namespace specstate

#endif  // SPECSTATE_KERNELS_DTYPE_H_
