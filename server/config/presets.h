// Model presets: the layout fields of the linear-attention layers of known
// models (and of their tensor-parallel parts), so that a deployment names its
// model instead of copying head counts and conv widths by hand.
//
//   const ModelPreset* p = FindModelPreset("qwen3-next-80b-a3b-tp2");
//   absl::Status st = ApplyModelPreset("kimi-linear-48b-a3b", &layout);
//
// One table, used by specstated --model, specstatectl plan --model and the
// benchmarks (tests/bench/kda_bench.cc). A preset sets the layer kind, the
// number of layers, key and value heads, head dim, conv channels and kernel,
// the number of draft tokens, the dtypes and the KDA gate; everything else
// (blocks, rows, commit and cache modes) is the deployment's.
#ifndef SPECSTATE_SERVER_CONFIG_PRESETS_H_
#define SPECSTATE_SERVER_CONFIG_PRESETS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "specstate/v1/specstate.pb.h"

namespace specstate {
namespace server {

struct ModelPreset {
  std::string name;     // what --model takes, e.g. "qwen3-next-80b-a3b-tp2"
  const char* model;    // the model, e.g. "Qwen3-Next-80B-A3B"
  int tensor_parallel;  // ranks the model's heads are split over (1: all of them)
  ::specstate::v1::LayerKind layer_kind;
  int num_layers;       // linear-attention layers (the full-attention ones keep no state here)
  int num_heads;        // key heads per rank (H)
  int num_value_heads;  // value heads per rank (HV)
  int head_dim;         // K = V
  int conv_dim;         // conv channels per rank (D)
  int conv_kernel;
  int num_spec;         // draft tokens a row (Q = num_spec + 1): the default, --num_spec overrides
  ::specstate::v1::DType activation_dtype;
  ::specstate::v1::DType state_dtype;
  ::specstate::v1::KdaGate kda_gate;  // KDA only
  float lower_bound;                  // KDA's safe gate only
};

// Every preset, in the order --help lists them.
const std::vector<ModelPreset>& ModelPresets();

// The preset called `name`, or nullptr.
const ModelPreset* FindModelPreset(absl::string_view name);

// "kimi-linear-48b-a3b, kimi-linear-48b-a3b-tp2, ..." (for --help and errors).
std::string ModelPresetNames();

// Sets the preset's fields of `layout` (and only those). INVALID_ARGUMENT
// naming `field` ("--model", "model") and listing the known presets when
// `name` is none of them; `layout` is then unchanged.
absl::Status ApplyModelPreset(absl::string_view name, ::specstate::v1::Layout* layout,
                              absl::string_view field = "--model");

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_CONFIG_PRESETS_H_
