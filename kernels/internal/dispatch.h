// Turns the runtime dtypes and head dim of a KdaShape into template arguments.
//
//   DispatchKda(shape, [&](auto act, auto state, auto head_dim) {
//     using Act = typename decltype(act)::type;      // float, Float16, BFloat16
//     using State = typename decltype(state)::type;  // float, BFloat16
//     constexpr int K = decltype(head_dim)::value;   // 64, 128, 256
//     ...
//   });
//
// Shapes must have passed ValidateShape(); anything else is a programming
// error and returns false without calling `f`.
#ifndef SPECSTATE_KERNELS_INTERNAL_DISPATCH_H_
#define SPECSTATE_KERNELS_INTERNAL_DISPATCH_H_

#include <type_traits>

#include "kernels/kda_args.h"
#include "kernels/numeric.h"

namespace specstate {
namespace kernels {
namespace internal {

template <typename T>
struct TypeTag {
  using type = T;
};

template <int N>
using IntTag = std::integral_constant<int, N>;

template <typename Act, typename State, typename F>
bool DispatchHeadDim(int head_dim, F&& f) {
  switch (head_dim) {
    case 64:
      f(TypeTag<Act>{}, TypeTag<State>{}, IntTag<64>{});
      return true;
    case 128:
      f(TypeTag<Act>{}, TypeTag<State>{}, IntTag<128>{});
      return true;
    case 256:
      f(TypeTag<Act>{}, TypeTag<State>{}, IntTag<256>{});
      return true;
    default:
      return false;
  }
}

template <typename Act, typename F>
bool DispatchState(const KdaShape& s, F&& f) {
  switch (s.state_dtype) {
    case DType::kFloat32:
      return DispatchHeadDim<Act, float>(s.head_dim, f);
    case DType::kBFloat16:
      return DispatchHeadDim<Act, BFloat16>(s.head_dim, f);
    default:
      return false;
  }
}

template <typename F>
bool DispatchKda(const KdaShape& s, F&& f) {
  switch (s.act_dtype) {
    case DType::kFloat32:
      return DispatchState<float>(s, f);
    case DType::kFloat16:
      return DispatchState<Float16>(s, f);
    case DType::kBFloat16:
      return DispatchState<BFloat16>(s, f);
    default:
      return false;
  }
}

// Activation dtype alone (conv compaction, record copies).
template <typename F>
bool DispatchAct(DType act, F&& f) {
  switch (act) {
    case DType::kFloat32:
      f(TypeTag<float>{});
      return true;
    case DType::kFloat16:
      f(TypeTag<Float16>{});
      return true;
    case DType::kBFloat16:
      f(TypeTag<BFloat16>{});
      return true;
    default:
      return false;
  }
}

}  // namespace internal
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_INTERNAL_DISPATCH_H_
