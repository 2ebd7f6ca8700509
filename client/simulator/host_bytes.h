// Host copies of tensors as raw bytes, in any of the service's element types:
// random values, a rank's columns of the model's tensor, one element read as
// a float, and the first element where two copies differ. The simulator's
// draws and its bit-for-bit comparisons work on these.
//
//   std::vector<char> x;
//   FillRandom(&x, 16, DType::kBFloat16, -1.0f, 1.0f, rng);
//   float first = ElementAsFloat(x.data(), DType::kBFloat16);
#ifndef SPECSTATE_CLIENT_SIMULATOR_HOST_BYTES_H_
#define SPECSTATE_CLIENT_SIMULATOR_HOST_BYTES_H_

#include <cstdint>
#include <random>
#include <vector>

#include "kernels/dtype.h"

namespace specstate {
namespace client {
namespace simulator_internal {

// `count` elements of `dtype`, uniform in [lo, hi), as host bytes in `out`.
void FillRandom(std::vector<char>* out, int64_t count, DType dtype, float lo, float hi,
                std::mt19937_64& rng);

// Copies `width` elements of `rows` rows: row t's elements [from, from +
// width) of `src` (rows of `src_stride` elements) to elements [to, to +
// width) of row t of `dst` (rows of `dst_stride`). Tensor parallelism: a
// rank's columns (heads, channels) of the model's tensor.
void CopyColumns(const std::vector<char>& src, int64_t src_stride, int64_t from,
                 std::vector<char>* dst, int64_t dst_stride, int64_t to, int64_t rows,
                 int64_t width, int64_t element_bytes);

// The element of `dtype` at `p`, as a float (0 for kInt32).
float ElementAsFloat(const char* p, DType dtype);

// `count` values read as floats (ReadState's `values`) back as elements of
// `dtype`: exact for values read from fp32 or bf16 elements (the state
// dtypes); empty for other dtypes.
std::vector<char> BytesOfValues(const float* values, int64_t count, DType dtype);

// The index of the first element (of `element_bytes` bytes) where `a` and
// `b` differ. They must differ somewhere.
int64_t FirstDifference(const char* a, const char* b, int64_t element_bytes);

}  // namespace simulator_internal
}  // namespace client
}  // namespace specstate

#endif  // SPECSTATE_CLIENT_SIMULATOR_HOST_BYTES_H_
