// What FAST's CUDA kernel families (verify.cuh, fold.cuh) share: the block
// sizes and ring chunks, the gate's rule, a ring token's place, loads and
// stores of state columns, warp sums; and which numerics the kernels run.
#ifndef SPECSTATE_KERNELS_FAST_CUDA_DEVICE_MATH_CUH_
#define SPECSTATE_KERNELS_FAST_CUDA_DEVICE_MATH_CUH_

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/checks/commit_plan.h"
#include "kernels/checks/rows.h"
#include "kernels/cuda_status.h"
#include "kernels/fast/checks.h"
#include "kernels/fast/fast_args.h"
#include "kernels/fast/fast_kernels.h"
#include "kernels/fast/fast_math.h"
#include "kernels/fast/verify_plan.h"
#include "kernels/internal/dispatch.h"
#include "kernels/kda_math.h"
#include "kernels/numeric.h"

namespace specstate {
namespace kernels {
namespace fast {
namespace {

using ::specstate::fast::kMaxWindow;
using ::specstate::fast::SolveWindowRow;
using internal::DispatchKda;
using internal::IsBlock;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
static_assert(kWarps == kVerifyWarps, "verify_plan.h sizes Verify's shared memory for these warps");
// Ring tokens whose log-decays or values a thread loads together (Verify's
// ring loops: a memory round trip a batch instead of a token).
constexpr int kLoadBatch = 8;
// Materialize's fold grid over every block of a pool: blocks per (value
// head, tile) striding over the blocks (Commit's: FoldLaunchPlan).
constexpr int kMaterializeFoldGridX = 16;

// The kernel interface's checks failed (fast_args.h, `gate`): do nothing.
__device__ __forceinline__ bool GateFailed(const DeviceStatus* gate) {
  return gate != nullptr && gate->failed != 0;
}

__device__ __forceinline__ float WarpSum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ __forceinline__ kda::GateRule RuleOf(const KdaShape& s, const LayerParams& p, int h) {
  const bool kda_kind = s.kind == LayerKind::kKda;
  return kda::GateRule{s.kind, s.gate, kda_kind ? expf(p.a_log[h]) : 0.0f, s.lower_bound};
}

// Element index of ring token `slot` of `block`, in a buffer of `width`
// elements per token.
__device__ __forceinline__ int64_t RingAt(const FastRings& r, int32_t block, int slot,
                                          int64_t width) {
  return (int64_t{block} * r.capacity + slot) * width;
}

// Column j's log-decays of ring tokens i, i - 1, ..., i - kLoadBatch + 1
// of `block` (those >= lo; 0 for the rest), loaded together: the ring
// loops' exponent sums take a memory round trip a batch, not a token.
// KDA: key head h's column j; GDN: value head hv's one value.
__device__ __forceinline__ void LoadLogDecays(const FastRings& r, int32_t block, int i, int lo,
                                              bool gdn, int64_t g_width, int64_t column,
                                              float (&out)[kLoadBatch]) {
#pragma unroll
  for (int e = 0; e < kLoadBatch; ++e) {
    const float* g = r.log_decay + RingAt(r, block, max(i - e, lo), g_width);
    out[e] = i - e >= lo ? g[column] : 0.0f;
  }
}

// Normalizes one head of raw values (K of them) into `out` with a warp:
// x / sqrt(sum x^2 + eps) * scale.
template <typename Act, int K>
__device__ void WarpNormalize(const Act* raw, float scale, float* out, int lane) {
  float sum = 0.0f;
  for (int j = lane; j < K; j += 32) {
    const float x = ToFloat(raw[j]);
    out[j] = x;
    sum = kda::MulAdd(x, x, sum);
  }
  const float norm = kda::L2Norm(WarpSum(sum));
  __syncwarp();
  for (int j = lane; j < K; j += 32) out[j] = kda::Normalize(out[j], norm, scale);
}

// WarpNormalize's norm alone, summed in its order (a lane's columns lane,
// lane + 32, ..., then the warp), for raw values already in shared memory.
template <typename Act, int K>
__device__ __forceinline__ float WarpNormOf(const Act* raw, int lane) {
  float sum = 0.0f;
  for (int j = lane; j < K; j += 32) {
    const float x = ToFloat(raw[j]);
    sum = kda::MulAdd(x, x, sum);
  }
  return kda::L2Norm(WarpSum(sum));
}

// Four state elements of a row as floats (16 bytes of fp32, 8 of bf16).
__device__ __forceinline__ float4 Load4(const float* p) {
  return __ldcs(reinterpret_cast<const float4*>(p));
}
__device__ __forceinline__ float4 Load4(const BFloat16* p) {
  const uint2 raw = __ldcs(reinterpret_cast<const uint2*>(p));
  return make_float4(BitsToFloat(raw.x << 16), BitsToFloat(raw.x & 0xffff0000u),
                     BitsToFloat(raw.y << 16), BitsToFloat(raw.y & 0xffff0000u));
}

// C consecutive state elements (C = 2, 4, 8) as floats, vectorized loads.
template <int C>
__device__ __forceinline__ void LoadCols(const float* p, float (&out)[C]) {
  if constexpr (C == 2) {
    const float2 x = __ldcs(reinterpret_cast<const float2*>(p));
    out[0] = x.x;
    out[1] = x.y;
  } else {
#pragma unroll
    for (int q = 0; q < C / 4; ++q) {
      const float4 x = Load4(p + 4 * q);
      out[4 * q] = x.x;
      out[4 * q + 1] = x.y;
      out[4 * q + 2] = x.z;
      out[4 * q + 3] = x.w;
    }
  }
}
template <int C>
__device__ __forceinline__ void LoadCols(const BFloat16* p, float (&out)[C]) {
  if constexpr (C == 2) {
    const unsigned int raw = __ldcs(reinterpret_cast<const unsigned int*>(p));
    out[0] = BitsToFloat(raw << 16);
    out[1] = BitsToFloat(raw & 0xffff0000u);
  } else {
#pragma unroll
    for (int q = 0; q < C / 4; ++q) {
      const float4 x = Load4(p + 4 * q);
      out[4 * q] = x.x;
      out[4 * q + 1] = x.y;
      out[4 * q + 2] = x.z;
      out[4 * q + 3] = x.w;
    }
  }
}

// Brings the 128-byte line at p into L2.
__device__ __forceinline__ void PrefetchL2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// C consecutive floats of shared memory (C = 1, 2, 4, 8; aligned to C).
template <int C>
__device__ __forceinline__ void SmemCols(const float* p, float (&out)[C]) {
  if constexpr (C == 1) {
    out[0] = p[0];
  } else if constexpr (C == 2) {
    const float2 x = *reinterpret_cast<const float2*>(p);
    out[0] = x.x;
    out[1] = x.y;
  } else {
#pragma unroll
    for (int q = 0; q < C / 4; ++q) {
      const float4 x = reinterpret_cast<const float4*>(p)[q];
      out[4 * q] = x.x;
      out[4 * q + 1] = x.y;
      out[4 * q + 2] = x.z;
      out[4 * q + 3] = x.w;
    }
  }
}

// C consecutive state elements of shared memory as floats (C = 4 or a
// multiple of 8; 16-byte loads, or one 8-byte load of four bf16, aligned),
// converted as LoadCols.
template <int C>
__device__ __forceinline__ void SharedStateCols(const float* p, float (&out)[C]) {
  SmemCols<C>(p, out);
}
template <int C>
__device__ __forceinline__ void SharedStateCols(const BFloat16* p, float (&out)[C]) {
  static_assert(C == 4 || C % 8 == 0, "one 8-byte load, or whole 16-byte loads");
  if constexpr (C == 4) {
    const uint2 w = *reinterpret_cast<const uint2*>(p);
    out[0] = BitsToFloat(w.x << 16);
    out[1] = BitsToFloat(w.x & 0xffff0000u);
    out[2] = BitsToFloat(w.y << 16);
    out[3] = BitsToFloat(w.y & 0xffff0000u);
  } else {
#pragma unroll
    for (int q = 0; q < C / 8; ++q) {
      const uint4 w = reinterpret_cast<const uint4*>(p)[q];
      const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        out[8 * q + 2 * e] = BitsToFloat(words[e] << 16);
        out[8 * q + 2 * e + 1] = BitsToFloat(words[e] & 0xffff0000u);
      }
    }
  }
}

// Stores C consecutive state elements (16-byte stores; four bf16 in one
// 8-byte store), rounded as FromFloat.
template <int C>
__device__ __forceinline__ void StoreCols(const float (&x)[C], float* p) {
  static_assert(C % 4 == 0, "whole float4s");
#pragma unroll
  for (int q = 0; q < C / 4; ++q) {
    reinterpret_cast<float4*>(p)[q] = make_float4(x[4 * q], x[4 * q + 1], x[4 * q + 2], x[4 * q + 3]);
  }
}
template <int C>
__device__ __forceinline__ void StoreCols(const float (&x)[C], BFloat16* p) {
  static_assert(C == 4 || C % 8 == 0, "one 8-byte store, or whole 16-byte stores");
  if constexpr (C == 4) {
    *reinterpret_cast<uint2*>(p) =
        make_uint2(uint32_t{FromFloat<BFloat16>(x[0]).bits} |
                       (uint32_t{FromFloat<BFloat16>(x[1]).bits} << 16),
                   uint32_t{FromFloat<BFloat16>(x[2]).bits} |
                       (uint32_t{FromFloat<BFloat16>(x[3]).bits} << 16));
  } else {
#pragma unroll
    for (int q = 0; q < C / 8; ++q) {
      uint32_t w[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        w[e] = uint32_t{FromFloat<BFloat16>(x[8 * q + 2 * e]).bits} |
               (uint32_t{FromFloat<BFloat16>(x[8 * q + 2 * e + 1]).bits} << 16);
      }
      reinterpret_cast<uint4*>(p)[q] = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

// Reduces M values per lane (M a power of two <= 32) over the warp with
// 2 M - 2 + log2(32 / M) shuffles (a reduce-scatter: each step keeps half of
// the values and ships the other half), instead of 5 M. Returns, in every
// lane, the warp's sum of x[lane >> (5 - log2 M)]. Each sum is formed in the
// same pairing as WarpSum (xor 16, 8, 4, 2, 1), so the results are those of
// WarpSum bit for bit.
template <int M>
__device__ __forceinline__ float TransposeWarpSum(float (&x)[M], int lane) {
  static_assert(M >= 1 && M <= 32 && (M & (M - 1)) == 0, "M a power of two <= 32");
  int o = 16;
#pragma unroll
  for (int half = M / 2; half >= 1; half /= 2, o /= 2) {
    const bool hi = (lane & o) != 0;
#pragma unroll
    for (int m = 0; m < half; ++m) {
      const float send = hi ? x[m] : x[m + half];
      const float keep = hi ? x[m + half] : x[m];
      x[m] = keep + __shfl_xor_sync(0xffffffffu, send, o);
    }
  }
#pragma unroll
  for (; o > 0; o /= 2) x[0] += __shfl_xor_sync(0xffffffffu, x[0], o);
  return x[0];
}

// ---------------------------------------------------------------------------
// The host's side: the device's limits, and which numerics the CUDA kernels run.

// The current device's SM count and the shared memory its largest block
// may take, queried once a device (Verify and the folds launch every layer
// of every step; the recurrent kernel's launcher caches its occupancy alike).
inline cudaError_t CurrentDeviceLimits(int* sms, int* smem_optin) {
  static std::atomic<int> cached_sms[16] = {}, cached_optin[16] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const bool cacheable = device >= 0 && device < 16;
  if (cacheable) {
    *sms = cached_sms[device].load(std::memory_order_relaxed);
    *smem_optin = cached_optin[device].load(std::memory_order_relaxed);
    if (*sms > 0 && *smem_optin > 0) return cudaSuccess;
  }
  err = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  }
  if (err != cudaSuccess) {
    cudaGetLastError();  // not the next launch's error
    return err;
  }
  if (cacheable) {
    cached_sms[device].store(*sms, std::memory_order_relaxed);
    cached_optin[device].store(*smem_optin, std::memory_order_relaxed);
  }
  return cudaSuccess;
}

inline bool DefaultNumerics(const FastNumerics& n) {
  using O = FastNumerics::Operands;
  return !n.ring_k_normalized_bf16 && !n.ring_u_bf16 && !n.ring_cumulative_log_decay &&
         n.ring_keys == O::kFp32 && n.ring_values == O::kFp32 && n.checkpoint == O::kFp32 &&
         n.fold == O::kFp32;
}

inline absl::Status NumericsUnimplemented(const char* op) {
  return absl::UnimplementedError(absl::StrCat(
      "In ", op,
      ": the CUDA kernels run fp32 throughout (FastNumerics' default), Verify also with "
      "`checkpoint` kTf32 or kTf32Split (tensor cores), nothing else"));
}

}  // namespace
}  // namespace fast
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_FAST_CUDA_DEVICE_MATH_CUH_
