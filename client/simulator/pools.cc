#include "client/simulator/pools.h"

#include <algorithm>
#include <cstring>
#include <utility>

namespace specstate {
namespace client {
namespace simulator_internal {

ServicePools::ServicePools(SharedMemory& memory, std::unique_ptr<MappedPools> pools,
                           const Dims& dims)
    : memory_(memory), pools_(std::move(pools)), d_(dims) {
  for (const v1::PoolView& p : pools_->description().pools()) {
    if (p.kind() == "conv") {
      conv_block_stride_ = p.strides(0);
      conv_dim_stride_ = p.strides(1);
      conv_token_stride_ = p.strides(2);
    }
  }
}

char* ServicePools::StateBlock(int layer, int32_t block) const {
  return pools_->Pool(layer, "recurrent").value() + int64_t{block} * d_.state_block_bytes;
}

char* ServicePools::ConvBlock(int layer, int32_t block) const {
  return pools_->Pool(layer, "conv").value() + int64_t{block} * conv_block_stride_ * d_.as;
}

absl::Status ServicePools::ReadState(int layer, int32_t block, std::vector<char>* out) const {
  out->resize(d_.state_block_bytes);
  return memory_.CopyOut(out->data(), StateBlock(layer, block), out->size());
}

absl::Status ServicePools::WriteState(int layer, int32_t block, const char* state) {
  return memory_.CopyIn(StateBlock(layer, block), state, d_.state_block_bytes);
}

absl::Status ServicePools::ReadConv(int layer, int32_t block, std::vector<char>* out) const {
  std::vector<char> raw(conv_block_stride_ * d_.as);
  absl::Status st = memory_.CopyOut(raw.data(), ConvBlock(layer, block), raw.size());
  if (!st.ok()) return st;
  out->assign(int64_t{d_.D} * d_.W * d_.as, 0);
  for (int c = 0; c < d_.D; ++c) {
    for (int t = 0; t < d_.W; ++t) {
      std::memcpy(out->data() + (int64_t{c} * d_.W + t) * d_.as,
                  raw.data() + (c * conv_dim_stride_ + t * conv_token_stride_) * d_.as, d_.as);
    }
  }
  return absl::OkStatus();
}

absl::Status ServicePools::WriteConv(int layer, int32_t block, const std::vector<char>& dw) {
  std::vector<char> raw(conv_block_stride_ * d_.as);
  absl::Status st = memory_.CopyOut(raw.data(), ConvBlock(layer, block), raw.size());
  if (!st.ok()) return st;
  for (int c = 0; c < d_.D; ++c) {
    for (int t = 0; t < d_.W; ++t) {
      std::memcpy(raw.data() + (c * conv_dim_stride_ + t * conv_token_stride_) * d_.as,
                  dw.data() + (int64_t{c} * d_.W + t) * d_.as, d_.as);
    }
  }
  return memory_.CopyIn(ConvBlock(layer, block), raw.data(), raw.size());
}

absl::Status ServicePools::UpdateConv(int layer, int32_t block, const std::vector<char>& columns,
                                      int cols) {
  std::vector<char> dw;
  absl::Status st = ReadConv(layer, block, &dw);
  if (!st.ok()) return st;
  for (int c = 0; c < d_.D; ++c) {
    std::memcpy(dw.data() + int64_t{c} * d_.W * d_.as, columns.data() + int64_t{c} * cols * d_.as,
                cols * d_.as);
  }
  return WriteConv(layer, block, dw);
}

absl::Status ServicePools::FlipStateBit(int layer, int32_t block, int64_t elements, bool nan) {
  for (int64_t i = 0; i < elements; ++i) {
    char* p = StateBlock(layer, block) + i * d_.ss;
    uint32_t word = 0;
    absl::Status st = memory_.CopyOut(&word, p, d_.ss);
    if (!st.ok()) return st;
    if (nan) {
      word = d_.ss == 4 ? 0x7fc00000u : 0x7fc0u;  // fp32 / bf16 quiet NaN
    } else {
      word ^= elements > 1 ? (d_.ss == 4 ? (1u << 23) : (1u << 7))
                           : (d_.ss == 4 ? (1u << 20) : (1u << 5));
    }
    st = memory_.CopyIn(p, &word, d_.ss);
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::Status ServicePools::ReadAll(std::vector<char>* out) const {
  const uint64_t bytes = pools_->description().allocation_bytes();
  out->resize(bytes);
  return memory_.CopyOut(out->data(), pools_->base(), bytes);
}

uint64_t ServicePools::Fingerprint() const {
  std::vector<char> all;
  uint64_t h = 1469598103934665603ull;
  if (ReadAll(&all).ok()) {
    for (char c : all) {
      h ^= static_cast<unsigned char>(c);
      h *= 1099511628211ull;
    }
  }
  return h;
}

std::vector<std::pair<uint64_t, uint64_t>> ServicePools::Spans(int32_t block) const {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  for (const v1::PoolView& v : pools_->description().pools()) {
    const uint64_t size = v.byte_size() / std::max<int64_t>(v.shape(0), 1);
    out.emplace_back(v.offset_bytes() + block * size, v.offset_bytes() + (block + 1) * size);
  }
  return out;
}

absl::Status ServicePools::Restore(int32_t block, const std::vector<char>& all) {
  for (const auto& [begin, end] : Spans(block)) {
    absl::Status st = memory_.CopyIn(pools_->base() + begin, all.data() + begin, end - begin);
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

}  // namespace simulator_internal
}  // namespace client
}  // namespace specstate
