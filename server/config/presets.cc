#include "server/config/presets.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace specstate {
namespace server {

namespace v1 = ::specstate::v1;

namespace {

// A model's linear-attention layers at TP=1.
struct Model {
  const char* name;
  const char* model;
  v1::LayerKind kind;
  int layers, heads, value_heads, head_dim, conv_dim, conv_kernel, num_spec;
  float lower_bound;
  std::vector<int> tensor_parallel;  // the parts (besides TP=1) that get a preset of their own
};

// Where each field comes from.
//
// Kimi-Linear-48B-A3B (huggingface.co/moonshotai/Kimi-Linear-48B-A3B-Instruct,
// config.json; checked against a published copy of it): num_hidden_layers 27,
// of which linear_attn_config.kda_layers are 20 (1-3, 5-7, ..., 25, 26; the
// other 7, full_attn_layers 4, 8, ..., 24, 27, are MLA and keep no state
// here); linear_attn_config.num_heads 32 and head_dim 128 (KDA: as many value
// heads as key heads); short_conv_kernel_size 4 on each of q, k and v, so the
// conv state has 3 * 32 * 128 = 12288 channels. The gate: the safe gate with
// lower bound -5.0 (Kimi's gate_lower_bound; specstated's default). The same
// shape tests/bench/kda_bench.cc measured before this table existed.
//
// Qwen3-Next-80B-A3B (huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct,
// config.json; the fields below checked against it, num_hidden_layers from
// the model card): num_hidden_layers 48 with full_attention_interval 4, so 36
// Gated DeltaNet layers; linear_num_key_heads 16, linear_num_value_heads 32,
// linear_key_head_dim = linear_value_head_dim = 128, linear_conv_kernel_dim
// 4; the conv runs over q, k and v: 2 * 16 * 128 + 32 * 128 = 8192 channels.
//
// Kimi K3 at TP=8 (no public config): the shape docs/benchmarks.md and
// tests/bench/kda_bench.cc measure, 69 KDA layers of 96 heads of 128 split
// over 8 GPUs (12 heads, 3 * 12 * 128 = 4608 conv channels a GPU) and 7
// draft tokens (Q = 8).
//
// num_spec: Q = 4 (3 drafts) as the benchmarks run Kimi-Linear and
// Qwen3-Next; the deployment's --num_spec overrides it.
const std::vector<Model>& Models() {
  static const auto* models = new std::vector<Model>{
      {"kimi-linear-48b-a3b", "Kimi-Linear-48B-A3B", v1::KDA, 20, 32, 32, 128, 12288, 4, 3, -5.0f,
       {2, 4, 8}},
      {"qwen3-next-80b-a3b", "Qwen3-Next-80B-A3B", v1::GDN, 36, 16, 32, 128, 8192, 4, 3, -5.0f,
       {2, 4, 8}},
  };
  return *models;
}

std::vector<ModelPreset> BuildPresets() {
  std::vector<ModelPreset> presets;
  const auto add = [&](const std::string& name, const Model& m, int tp) {
    ModelPreset p;
    p.name = name;
    p.model = m.model;
    p.tensor_parallel = tp;
    p.layer_kind = m.kind;
    p.num_layers = m.layers;
    // Tensor parallelism splits heads and conv channels evenly (every part
    // in the table divides them exactly).
    p.num_heads = m.heads / tp;
    p.num_value_heads = m.value_heads / tp;
    p.head_dim = m.head_dim;
    p.conv_dim = m.conv_dim / tp;
    p.conv_kernel = m.conv_kernel;
    p.num_spec = m.num_spec;
    p.activation_dtype = v1::BF16;
    p.state_dtype = v1::FP32;
    p.kda_gate = v1::SAFE_GATE;
    p.lower_bound = m.lower_bound;
    presets.push_back(p);
  };
  for (const Model& m : Models()) {
    add(m.name, m, 1);
    for (int tp : m.tensor_parallel) add(absl::StrCat(m.name, "-tp", tp), m, tp);
  }
  // Kimi K3 exists here only as its TP=8 part (see above).
  static const Model k3{"kimi-k3", "Kimi-K3", v1::KDA, 69, 96, 96, 128, 36864, 4, 7, -5.0f, {}};
  add("kimi-k3-tp8", k3, 8);
  return presets;
}

}  // namespace

const std::vector<ModelPreset>& ModelPresets() {
  static const auto* presets = new std::vector<ModelPreset>(BuildPresets());
  return *presets;
}

const ModelPreset* FindModelPreset(absl::string_view name) {
  for (const ModelPreset& p : ModelPresets()) {
    if (name == p.name) return &p;
  }
  return nullptr;
}

std::string ModelPresetNames() {
  std::vector<std::string> names;
  for (const ModelPreset& p : ModelPresets()) names.emplace_back(p.name);
  return absl::StrJoin(names, ", ");
}

absl::Status ApplyModelPreset(absl::string_view name, v1::Layout* layout,
                              absl::string_view field) {
  const ModelPreset* p = FindModelPreset(name);
  if (p == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(field, "=", name,
                                                   " is not a known model; known models: ",
                                                   ModelPresetNames()));
  }
  layout->set_layer_kind(p->layer_kind);
  layout->set_num_layers(p->num_layers);
  layout->set_num_heads(p->num_heads);
  layout->set_num_value_heads(p->num_value_heads);
  layout->set_head_dim(p->head_dim);
  layout->set_conv_dim(p->conv_dim);
  layout->set_conv_kernel(p->conv_kernel);
  layout->set_num_spec(p->num_spec);
  layout->set_activation_dtype(p->activation_dtype);
  layout->set_state_dtype(p->state_dtype);
  layout->set_kda_gate(p->kda_gate);
  layout->set_lower_bound(p->lower_bound);
  return absl::OkStatus();
}

}  // namespace server
}  // namespace specstate
