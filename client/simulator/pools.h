// The service's pools as the simulated scheduler sees them: mapped into this
// process through their exported handle (ExportPools), read and written
// block by block. The scheduler writes a new request's state and conv
// history there (as a prefill would) and its conv updates; the checks read
// the states and conv windows the service committed; a restart drill reads
// every byte, and writes back the blocks a restart lost.
//
//   ServicePools pools(memory, *std::move(mapped), dims);
//   std::vector<char> conv;  // [D][W]
//   absl::Status st = pools.ReadConv(/*layer=*/0, /*block=*/1, &conv);
#ifndef SPECSTATE_CLIENT_SIMULATOR_POOLS_H_
#define SPECSTATE_CLIENT_SIMULATOR_POOLS_H_

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "client/lib/shared_memory.h"
#include "client/simulator/model.h"

namespace specstate {
namespace client {
namespace simulator_internal {

class ServicePools {
 public:
  // `memory` (the service's backend) must outlive this.
  ServicePools(SharedMemory& memory, std::unique_ptr<MappedPools> pools, const Dims& dims);

  // Layer `layer`'s recurrent state in `block` (in shared memory).
  char* StateBlock(int layer, int32_t block) const;
  // A copy of that state, or writing one (state_block_bytes).
  absl::Status ReadState(int layer, int32_t block, std::vector<char>* out) const;
  absl::Status WriteState(int layer, int32_t block, const char* state);

  // The conv block as [D][W] host bytes, or writing one.
  absl::Status ReadConv(int layer, int32_t block, std::vector<char>* out) const;
  absl::Status WriteConv(int layer, int32_t block, const std::vector<char>& dw);
  // The scheduler's conv update: every channel's first `cols` columns from
  // `columns` [D][cols]; the rest of the block stays.
  absl::Status UpdateConv(int layer, int32_t block, const std::vector<char>& columns, int cols);

  // Flips one bit of each of the first `elements` elements of the state in
  // `block` (the verdict's own test): one element, a mantissa bit (the
  // exact modes catch any change); several (FAST's whole block), the
  // exponent's lowest bit, each value doubled or halved (a mantissa bit's
  // 12.5% stayed within FAST's contract for 3 seeds of 400: the state's
  // share of the outputs decays). With `nan`, writes a quiet NaN instead.
  absl::Status FlipStateBit(int layer, int32_t block, int64_t elements = 1, bool nan = false);

  // Every byte of the pools' allocation.
  absl::Status ReadAll(std::vector<char>* out) const;
  // FNV-1a of every pool byte (the offset basis when they cannot be read).
  uint64_t Fingerprint() const;
  // Block `block`'s byte ranges [begin, end) in every layer's pools, as
  // offsets into the allocation.
  std::vector<std::pair<uint64_t, uint64_t>> Spans(int32_t block) const;
  // Block `block`'s bytes in every pool put back from `all` (what ReadAll
  // read): a scheduler's re-prefill of a block a restart lost.
  absl::Status Restore(int32_t block, const std::vector<char>& all);

 private:
  char* ConvBlock(int layer, int32_t block) const;

  SharedMemory& memory_;
  const std::unique_ptr<MappedPools> pools_;
  const Dims d_;
  int64_t conv_block_stride_ = 0, conv_dim_stride_ = 0, conv_token_stride_ = 0;
};

}  // namespace simulator_internal
}  // namespace client
}  // namespace specstate

#endif  // SPECSTATE_CLIENT_SIMULATOR_POOLS_H_
