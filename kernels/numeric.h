// 16-bit float storage types and their conversions, usable from host code and
// from CUDA device code (the same header serves both backends).
//
//   BFloat16 b = FromFloat<BFloat16>(1.5f);  // round to nearest even
//   float f = ToFloat(b);                    // exact
//
// Conversions round to nearest even, as __float2bfloat16_rn/__float2half_rn
// do, so the CPU and CUDA backends store the same bits for the same float.
#ifndef SPECSTATE_KERNELS_NUMERIC_H_
#define SPECSTATE_KERNELS_NUMERIC_H_

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define SPECSTATE_HD __host__ __device__ __forceinline__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#else
#define SPECSTATE_HD inline
#endif

namespace specstate {

struct BFloat16 {
  uint16_t bits;
};
struct Float16 {
  uint16_t bits;
};

SPECSTATE_HD uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

SPECSTATE_HD float BitsToFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

SPECSTATE_HD float ToFloat(float x) { return x; }
SPECSTATE_HD float ToFloat(BFloat16 x) { return BitsToFloat(uint32_t{x.bits} << 16); }

SPECSTATE_HD float ToFloat(Float16 x) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(x.bits));
#else
  const uint32_t sign = uint32_t{x.bits & 0x8000u} << 16;
  uint32_t exponent = (x.bits >> 10) & 0x1fu;
  uint32_t mantissa = x.bits & 0x3ffu;
  if (exponent == 0) {
    if (mantissa == 0) return BitsToFloat(sign);
    // Subnormal: normalize into a float exponent.
    exponent = 113;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    mantissa &= 0x3ffu;
    return BitsToFloat(sign | (exponent << 23) | (mantissa << 13));
  }
  if (exponent == 31) return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));
  return BitsToFloat(sign | ((exponent + 112) << 23) | (mantissa << 13));
#endif
}

template <typename T>
SPECSTATE_HD T FromFloat(float f);

template <>
SPECSTATE_HD float FromFloat<float>(float f) {
  return f;
}

template <>
SPECSTATE_HD BFloat16 FromFloat<BFloat16>(float f) {
  const uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return BFloat16{static_cast<uint16_t>((u >> 16) | 0x0040u)};  // quiet NaN
  }
  const uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return BFloat16{static_cast<uint16_t>((u + rounding_bias) >> 16)};
}

template <>
SPECSTATE_HD Float16 FromFloat<Float16>(float f) {
#if defined(__CUDA_ARCH__)
  return Float16{__half_as_ushort(__float2half_rn(f))};
#else
  const uint32_t u = FloatBits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t magnitude = u & 0x7fffffffu;
  if (magnitude >= 0x7f800000u) {  // inf or NaN
    return Float16{static_cast<uint16_t>(sign | 0x7c00u | (magnitude > 0x7f800000u ? 0x200u : 0u))};
  }
  if (magnitude >= 0x477ff000u) {  // rounds past 65504
    return Float16{static_cast<uint16_t>(sign | 0x7c00u)};
  }
  if (magnitude < 0x38800000u) {  // below 2^-14: subnormal half or zero
    if (magnitude <= 0x33000000u) return Float16{static_cast<uint16_t>(sign)};
    const uint32_t exponent = magnitude >> 23;
    const uint32_t mantissa = (magnitude & 0x007fffffu) | 0x00800000u;
    const uint32_t shift = 126 - exponent;
    uint32_t h = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (h & 1u))) ++h;
    return Float16{static_cast<uint16_t>(sign | h)};
  }
  uint32_t h = (magnitude - 0x38000000u) >> 13;
  const uint32_t rest = magnitude & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return Float16{static_cast<uint16_t>(sign | h)};
#endif
}

}  // namespace specstate

#endif  // SPECSTATE_KERNELS_NUMERIC_H_
