#include "kernels/check_shape.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/dtype.h"

namespace specstate {
namespace kernels {
namespace {

absl::Status Invalid(absl::string_view op, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("In ", op, ": ", what));
}

}  // namespace

absl::Status CheckShape(absl::string_view op, const KdaShape& s) {
  if (s.num_heads < 1) return Invalid(op, absl::StrCat("num_heads = ", s.num_heads, " must be >= 1"));
  if (s.head_dim != 64 && s.head_dim != 128 && s.head_dim != 256) {
    return Invalid(op, absl::StrCat("head_dim = ", s.head_dim,
                                    " is not supported (a power of two: 64, 128 or 256)"));
  }
  if (s.act_dtype != DType::kBFloat16 && s.act_dtype != DType::kFloat16 &&
      s.act_dtype != DType::kFloat32) {
    return Invalid(op, absl::StrCat("activation dtype ", DTypeName(s.act_dtype),
                                    " is not supported (bf16, fp16 or fp32)"));
  }
  if (s.state_dtype != DType::kFloat32 && s.state_dtype != DType::kBFloat16) {
    return Invalid(op, absl::StrCat("state dtype ", DTypeName(s.state_dtype),
                                    " is not supported (fp32 or bf16)"));
  }
  if (s.kind != LayerKind::kKda && s.kind != LayerKind::kGdn) {
    return Invalid(op, absl::StrCat("layer kind ", static_cast<int>(s.kind), " is not KDA or GDN"));
  }
  const int hv = ValueHeads(s);
  if (s.num_value_heads < 0 || hv % s.num_heads != 0) {
    return Invalid(op, absl::StrCat("num_value_heads = ", s.num_value_heads,
                                    " must be a multiple of num_heads = ", s.num_heads));
  }
  if (s.kind == LayerKind::kKda) {
    if (hv != s.num_heads) {
      return Invalid(op, absl::StrCat("KDA layers have as many value heads as heads: ",
                                      "num_value_heads = ", hv, ", num_heads = ", s.num_heads));
    }
    if (s.gate != KdaGate::kSafe && s.gate != KdaGate::kPlain) {
      return Invalid(op, absl::StrCat("KDA gate ", static_cast<int>(s.gate), " is not safe or plain"));
    }
    if (s.gate == KdaGate::kSafe && (!std::isfinite(s.lower_bound) || s.lower_bound >= 0.0f)) {
      return Invalid(op, absl::StrCat("lower_bound = ", s.lower_bound, " must be negative"));
    }
  }
  return absl::OkStatus();
}

}  // namespace kernels
}  // namespace specstate
