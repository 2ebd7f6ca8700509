// What ReadState says of a tensor in a pool block: min, max, mean, L2 norm
// and an FNV-1a checksum of its bytes (which a client can recompute over
// the bytes it expects), and the values themselves on request.
//
//   SummarizeTensor(buffer, bytes, DType::kFloat32, /*keep_values=*/false,
//                   {heads, k, k}, response.mutable_recurrent());
#ifndef SPECSTATE_SERVER_ENGINE_TENSOR_SUMMARY_H_
#define SPECSTATE_SERVER_ENGINE_TENSOR_SUMMARY_H_

#include <cstdint>
#include <vector>

#include "kernels/dtype.h"
#include "specstate/v1/specstate.pb.h"

namespace specstate {
namespace server {

// `bytes` of `dtype` elements (float types; INT32 leaves `out` empty).
void SummarizeTensor(const void* data, int64_t bytes, DType dtype, bool keep_values,
                     const std::vector<int64_t>& shape, v1::TensorSummary* out);

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_ENGINE_TENSOR_SUMMARY_H_
