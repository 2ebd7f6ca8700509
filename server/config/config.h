// The service's layout and start-up configuration: parsing, defaults,
// validation and the sizes derived from a layout.
//
//   absl::StatusOr<v1::ServiceConfig> config = LoadServiceConfig("layout.json");
//   absl::Status valid = ValidateLayout(config->layout());
//   LayoutSizes sizes = ComputeLayoutSizes(config->layout());
#ifndef SPECSTATE_SERVER_CONFIG_CONFIG_H_
#define SPECSTATE_SERVER_CONFIG_CONFIG_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/dtype.h"
#include "kernels/kda_args.h"
#include "server/modes/rules.h"
#include "specstate/v1/specstate.pb.h"

namespace specstate {
namespace server {

namespace v1 = ::specstate::v1;

inline constexpr char kDefaultListen[] = "unix:///tmp/specstate.sock";

// A small layout that starts anywhere (the README's quick start): 4 layers of
// 4 heads of 64, 64 blocks, 16 rows, 3 drafts, bf16 activations, fp32 state.
v1::ServiceConfig DefaultServiceConfig();

// Reads a ServiceConfig from `path`: JSON when it ends in .json, protobuf
// text format otherwise. Fields it does not set keep DefaultServiceConfig()'s
// values. NOT_FOUND / INVALID_ARGUMENT naming the file and the problem.
absl::StatusOr<v1::ServiceConfig> LoadServiceConfig(const std::string& path);

// A config file, with what a JSON file may say besides the ServiceConfig
// message:
//   "model": "kimi-linear-48b-a3b"   a preset (server/config/presets.h), applied to
//                                    the defaults before the file's own layout
//                                    fields, which override it;
//   "pool_memory": "60GiB"           as specstated --pool_memory (a string).
// `config` is LoadServiceConfig's, the preset applied; `pool_memory` is
// empty when the file gives none. INVALID_ARGUMENT naming the file and the
// field for an unknown model or a pool_memory that is not a string.
struct ConfigFile {
  v1::ServiceConfig config;
  std::string model;
  std::string pool_memory;
  bool num_blocks_given = false;  // the file sets layout.num_blocks
};
absl::StatusOr<ConfigFile> LoadConfigFile(const std::string& path);

// Every field in range (INVALID_ARGUMENT naming the field and the bound);
// FAILED_PRECONDITION for commit_mode FAST on the CUDA backend (no kernels
// yet).
absl::Status ValidateLayout(const v1::Layout& layout);

// Sizes in bytes; every pool starts 256-byte aligned.
// The commit mode's part (records or rings, its bookkeeping) is its rules'
// ModeScratchSizes (server/modes/rules.h).
struct LayoutSizes : ModeScratchSizes {
  int spec_query_len = 0;     // Q = num_spec + 1
  int conv_width = 0;         // W = conv_kernel - 1 + num_spec
  int64_t state_block_bytes = 0;
  int64_t conv_block_bytes = 0;
  int64_t state_pool_bytes = 0;  // per layer
  int64_t conv_pool_bytes = 0;   // per layer
  int64_t pool_bytes = 0;        // every layer's pools, in one exported allocation
  int64_t workspace_bytes = 0;   // commit + record-state-blocks workspaces
};

LayoutSizes ComputeLayoutSizes(const v1::Layout& layout);

// Offsets of layer `layer`'s pools inside the pool allocation.
int64_t StatePoolOffset(const LayoutSizes& sizes, int layer);
int64_t ConvPoolOffset(const LayoutSizes& sizes, int layer);

// Each layer's recurrent pool [blocks, HV, V, K] and conv pool [blocks, D, W]
// as views into the pool allocation (ExportPools).
void AddPoolViews(const v1::Layout& layout, const LayoutSizes& sizes,
                  v1::ExportPoolsResponse* out);

// Conversions between the wire enum and the kernels' dtype.
absl::StatusOr<DType> FromProto(v1::DType dtype);
v1::DType ToProto(DType dtype);

// The shape every kernel call of this layout uses.
kernels::KdaShape ShapeOf(const v1::Layout& layout);
// HV: num_value_heads, or num_heads where it is 0.
int ValueHeadsOf(const v1::Layout& layout);
// What differs by commit mode: server/modes/rules.h (CommitModeOf).

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_CONFIG_CONFIG_H_
