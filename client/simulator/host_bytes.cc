#include "client/simulator/host_bytes.h"

#include <cstring>

#include "kernels/numeric.h"

namespace specstate {
namespace client {
namespace simulator_internal {

void FillRandom(std::vector<char>* out, int64_t count, DType dtype, float lo, float hi,
                std::mt19937_64& rng) {
  std::uniform_real_distribution<float> dist(lo, hi);
  out->resize(count * DTypeSize(dtype));
  for (int64_t i = 0; i < count; ++i) {
    const float x = dist(rng);
    switch (dtype) {
      case DType::kFloat32:
        std::memcpy(out->data() + 4 * i, &x, 4);
        break;
      case DType::kFloat16: {
        const Float16 h = FromFloat<Float16>(x);
        std::memcpy(out->data() + 2 * i, &h.bits, 2);
        break;
      }
      case DType::kBFloat16: {
        const BFloat16 b = FromFloat<BFloat16>(x);
        std::memcpy(out->data() + 2 * i, &b.bits, 2);
        break;
      }
      case DType::kInt32:
        break;
    }
  }
}

void CopyColumns(const std::vector<char>& src, int64_t src_stride, int64_t from,
                 std::vector<char>* dst, int64_t dst_stride, int64_t to, int64_t rows,
                 int64_t width, int64_t element_bytes) {
  for (int64_t t = 0; t < rows; ++t) {
    std::memcpy(dst->data() + (t * dst_stride + to) * element_bytes,
                src.data() + (t * src_stride + from) * element_bytes, width * element_bytes);
  }
}

std::vector<char> BytesOfValues(const float* values, int64_t count, DType dtype) {
  std::vector<char> out;
  if (dtype == DType::kFloat32) {
    out.resize(count * 4);
    std::memcpy(out.data(), values, out.size());
  } else if (dtype == DType::kBFloat16) {
    out.resize(count * 2);
    for (int64_t i = 0; i < count; ++i) {
      uint32_t bits;
      std::memcpy(&bits, &values[i], 4);
      const uint16_t high = static_cast<uint16_t>(bits >> 16);  // exact: the value was a bf16
      std::memcpy(&out[i * 2], &high, 2);
    }
  }
  return out;
}

float ElementAsFloat(const char* p, DType dtype) {
  switch (dtype) {
    case DType::kFloat32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kFloat16: {
      Float16 h;
      std::memcpy(&h.bits, p, 2);
      return ToFloat(h);
    }
    case DType::kBFloat16: {
      BFloat16 b;
      std::memcpy(&b.bits, p, 2);
      return ToFloat(b);
    }
    case DType::kInt32:
      break;
  }
  return 0;
}

int64_t FirstDifference(const char* a, const char* b, int64_t element_bytes) {
  int64_t i = 0;
  while (std::memcmp(a + i * element_bytes, b + i * element_bytes, element_bytes) == 0) ++i;
  return i;
}

}  // namespace simulator_internal
}  // namespace client
}  // namespace specstate
