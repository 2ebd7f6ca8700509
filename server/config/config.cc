#include "server/config/config.h"

#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kernels/kda_kernels.h"
#include "server/modes/rules.h"
#include "server/config/presets.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/util/json_util.h"

namespace specstate {
namespace server {

v1::ServiceConfig DefaultServiceConfig() {
  v1::ServiceConfig config;
  v1::Layout* l = config.mutable_layout();
  l->set_num_layers(4);
  l->set_num_heads(4);
  l->set_head_dim(64);
  l->set_conv_dim(3 * 4 * 64);
  l->set_conv_kernel(4);
  l->set_num_spec(3);
  l->set_num_blocks(64);
  l->set_max_rows(16);
  l->set_activation_dtype(v1::BF16);
  l->set_state_dtype(v1::FP32);
  l->set_cache_mode(v1::NONE);
  l->set_commit_mode(v1::EAGER);
  l->set_mamba_block_size(0);
  l->set_lower_bound(-5.0f);
  l->set_backend(v1::AUTO);
  l->set_device(0);
  config.set_listen(kDefaultListen);
  config.set_default_lease_ms(10000);
  config.set_max_lease_ms(600000);
  config.set_submit_spin_us(200);
  config.set_stuck_stream_ms(30000);
  return config;
}

absl::StatusOr<v1::ServiceConfig> LoadServiceConfig(const std::string& path) {
  absl::StatusOr<ConfigFile> file = LoadConfigFile(path);
  if (!file.ok()) return file.status();
  return std::move(file->config);
}

namespace {

// JSON: "model" and "pool_memory" taken out (they are not ServiceConfig
// fields), the rest left for the ServiceConfig parser.
absl::Status TakeSizingFields(const std::string& path, std::string* json, ConfigFile* out) {
  google::protobuf::Struct root;
  if (!google::protobuf::util::JsonStringToMessage(*json, &root).ok()) {
    return absl::OkStatus();  // not a JSON object: the ServiceConfig parser says why
  }
  auto* fields = root.mutable_fields();
  bool taken = false;
  for (auto [name, value] : {std::make_pair("model", &out->model),
                             std::make_pair("pool_memory", &out->pool_memory)}) {
    auto it = fields->find(name);
    if (it == fields->end()) continue;
    if (it->second.kind_case() != google::protobuf::Value::kStringValue) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config file ", path, ": \"", name, "\" must be a string (e.g. \"",
          std::string(name) == "model" ? "kimi-linear-48b-a3b" : "60GiB", "\")"));
    }
    *value = it->second.string_value();
    fields->erase(it);
    taken = true;
  }
  if (!taken) return absl::OkStatus();
  std::string rest;  // MessageToJsonString appends
  if (!google::protobuf::util::MessageToJsonString(root, &rest).ok()) {
    return absl::InternalError(absl::StrCat("config file ", path, ": cannot re-encode it"));
  }
  *json = std::move(rest);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ConfigFile> LoadConfigFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read config file ", path));
  std::stringstream stream;
  stream << in.rdbuf();
  std::string text = stream.str();
  ConfigFile file;
  v1::ServiceConfig parsed;
  if (absl::EndsWith(path, ".json")) {
    if (absl::Status taken = TakeSizingFields(path, &text, &file); !taken.ok()) return taken;
    const auto status = google::protobuf::util::JsonStringToMessage(text, &parsed);
    if (!status.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config file ", path, " is not a valid ServiceConfig in JSON: ",
                       status.ToString()));
    }
  } else if (!google::protobuf::TextFormat::ParseFromString(text, &parsed)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config file ", path, " is not a valid ServiceConfig in protobuf text format"));
  }
  file.num_blocks_given = parsed.layout().num_blocks() != 0;
  v1::ServiceConfig config = DefaultServiceConfig();
  if (!file.model.empty()) {
    absl::Status preset =
        ApplyModelPreset(file.model, config.mutable_layout(), absl::StrCat(path, ": model"));
    if (!preset.ok()) return preset;
  }
  // Scalars that the file leaves at zero keep their defaults (or the preset's).
  v1::Layout defaults = config.layout();
  config.MergeFrom(parsed);
  v1::Layout* l = config.mutable_layout();
  if (parsed.layout().backend() == v1::BACKEND_UNSPECIFIED) l->set_backend(defaults.backend());
  if (parsed.layout().cache_mode() == v1::CACHE_MODE_UNSPECIFIED) {
    l->set_cache_mode(defaults.cache_mode());
  }
  if (parsed.layout().commit_mode() == v1::COMMIT_MODE_UNSPECIFIED) {
    l->set_commit_mode(defaults.commit_mode());
  }
  file.config = std::move(config);
  return file;
}

namespace {

absl::Status Bad(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("layout.", field, " ", what));
}

}  // namespace

absl::Status ValidateLayout(const v1::Layout& l) {
  if (l.num_layers() < 1 || l.num_layers() > 4096) {
    return Bad("num_layers", absl::StrCat("= ", l.num_layers(), " must be in [1, 4096]"));
  }
  if (l.num_heads() < 1 || l.num_heads() > 1024) {
    return Bad("num_heads", absl::StrCat("= ", l.num_heads(), " must be in [1, 1024]"));
  }
  if (l.head_dim() != 64 && l.head_dim() != 128 && l.head_dim() != 256) {
    return Bad("head_dim", absl::StrCat("= ", l.head_dim(), " must be 64, 128 or 256"));
  }
  if (l.conv_dim() < 1) return Bad("conv_dim", absl::StrCat("= ", l.conv_dim(), " must be >= 1"));
  if (l.conv_kernel() < 2 || l.conv_kernel() - 1 > kernels::kMaxConvHistory) {
    return Bad("conv_kernel", absl::StrCat("= ", l.conv_kernel(), " must be in [2, ",
                                           kernels::kMaxConvHistory + 1, "]"));
  }
  if (l.num_spec() < 0 || l.num_spec() + 1 > kernels::kMaxSpecQueryLen) {
    return Bad("num_spec", absl::StrCat("= ", l.num_spec(), " must be in [0, ",
                                        kernels::kMaxSpecQueryLen - 1, "]"));
  }
  if (l.num_blocks() < 2) {
    return Bad("num_blocks", absl::StrCat("= ", l.num_blocks(),
                                          " must be >= 2 (block 0 is the null block)"));
  }
  if (l.max_rows() < 1 || l.max_rows() > 65536) {
    return Bad("max_rows", absl::StrCat("= ", l.max_rows(), " must be in [1, 65536]"));
  }
  const auto act = FromProto(l.activation_dtype());
  if (!act.ok() || *act == DType::kInt32) {
    return Bad("activation_dtype", "must be BF16, FP16 or FP32");
  }
  const auto state = FromProto(l.state_dtype());
  if (!state.ok() || (*state != DType::kFloat32 && *state != DType::kBFloat16)) {
    return Bad("state_dtype", "must be FP32 or BF16");
  }
  if (l.cache_mode() != v1::NONE && l.cache_mode() != v1::ALIGN) {
    return Bad("cache_mode", "must be NONE or ALIGN");
  }
  const int q = l.num_spec() + 1;
  if (absl::Status mode = ValidateCommitMode(l.commit_mode()); !mode.ok()) return mode;
  if (absl::Status mode = CommitModeOf(l).Validate(l); !mode.ok()) return mode;
  if (l.cache_mode() == v1::ALIGN && l.mamba_block_size() < q) {
    return Bad("mamba_block_size", absl::StrCat("= ", l.mamba_block_size(),
                                                " must cover one speculative window of ", q,
                                                " tokens in ALIGN mode"));
  }
  if (l.layer_kind() != v1::KDA && l.layer_kind() != v1::GDN) {
    return Bad("layer_kind", "must be KDA or GDN");
  }
  const int hv = ValueHeadsOf(l);
  if (l.num_value_heads() < 0 || l.num_value_heads() > 4096 || hv % l.num_heads() != 0) {
    return Bad("num_value_heads", absl::StrCat("= ", l.num_value_heads(),
                                               " must be a multiple of num_heads = ",
                                               l.num_heads(), " in [0, 4096] (0: num_heads)"));
  }
  if (l.layer_kind() == v1::KDA) {
    if (hv != l.num_heads()) {
      return Bad("num_value_heads", absl::StrCat("= ", l.num_value_heads(),
                                                 ": KDA layers have as many value heads as "
                                                 "heads (", l.num_heads(), ")"));
    }
    if (l.kda_gate() != v1::SAFE_GATE && l.kda_gate() != v1::PLAIN_GATE) {
      return Bad("kda_gate", "must be SAFE_GATE or PLAIN_GATE");
    }
    if (l.kda_gate() == v1::SAFE_GATE && !(l.lower_bound() < 0.0f)) {
      return Bad("lower_bound", absl::StrCat("= ", l.lower_bound(), " must be negative"));
    }
  }
  if (l.device() < 0) return Bad("device", "must not be negative");
  return absl::OkStatus();
}

namespace {

int64_t Align256(int64_t bytes) { return (bytes + 255) / 256 * 256; }

}  // namespace

LayoutSizes ComputeLayoutSizes(const v1::Layout& l) {
  LayoutSizes s;
  s.spec_query_len = l.num_spec() + 1;
  s.conv_width = l.conv_kernel() - 1 + l.num_spec();
  const int64_t act = DTypeSize(FromProto(l.activation_dtype()).value_or(DType::kFloat32));
  const int64_t st = DTypeSize(FromProto(l.state_dtype()).value_or(DType::kFloat32));
  const kernels::KdaShape shape = ShapeOf(l);
  const int64_t vw = kernels::ValueWidth(shape);
  s.state_block_bytes = vw * l.head_dim() * st;
  s.conv_block_bytes = int64_t{l.conv_dim()} * s.conv_width * act;
  s.state_pool_bytes = Align256(s.state_block_bytes * l.num_blocks());
  s.conv_pool_bytes = Align256(s.conv_block_bytes * l.num_blocks());
  s.pool_bytes = (s.state_pool_bytes + s.conv_pool_bytes) * l.num_layers();
  // The token scratch and bookkeeping of the commit mode.
  static_cast<ModeScratchSizes&>(s) = CommitModeOf(l).ScratchSizes(l, shape);
  s.workspace_bytes =
      int64_t(kernels::CommitWorkspaceBytes(l.max_rows(), s.spec_query_len, l.num_blocks())) +
      int64_t(kernels::RecordStateBlocksWorkspaceBytes(l.max_rows()));
  return s;
}

int64_t StatePoolOffset(const LayoutSizes& s, int layer) {
  return (s.state_pool_bytes + s.conv_pool_bytes) * layer;
}

int64_t ConvPoolOffset(const LayoutSizes& s, int layer) {
  return StatePoolOffset(s, layer) + s.state_pool_bytes;
}

absl::StatusOr<DType> FromProto(v1::DType dtype) {
  switch (dtype) {
    case v1::FP32:
      return DType::kFloat32;
    case v1::FP16:
      return DType::kFloat16;
    case v1::BF16:
      return DType::kBFloat16;
    case v1::INT32:
      return DType::kInt32;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("dtype ", v1::DType_Name(dtype), " is not FP32, FP16, BF16 or INT32"));
  }
}

v1::DType ToProto(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return v1::FP32;
    case DType::kFloat16:
      return v1::FP16;
    case DType::kBFloat16:
      return v1::BF16;
    case DType::kInt32:
      return v1::INT32;
  }
  return v1::DTYPE_UNSPECIFIED;
}

kernels::KdaShape ShapeOf(const v1::Layout& l) {
  kernels::KdaShape shape;
  shape.num_heads = l.num_heads();
  shape.head_dim = l.head_dim();
  shape.act_dtype = FromProto(l.activation_dtype()).value_or(DType::kBFloat16);
  shape.state_dtype = FromProto(l.state_dtype()).value_or(DType::kFloat32);
  shape.lower_bound = l.lower_bound();
  shape.kind = l.layer_kind() == v1::GDN ? kernels::LayerKind::kGdn : kernels::LayerKind::kKda;
  shape.num_value_heads = ValueHeadsOf(l);
  shape.gate = l.kda_gate() == v1::PLAIN_GATE ? kernels::KdaGate::kPlain : kernels::KdaGate::kSafe;
  return shape;
}

int ValueHeadsOf(const v1::Layout& l) {
  return l.num_value_heads() > 0 ? l.num_value_heads() : l.num_heads();
}

void AddPoolViews(const v1::Layout& layout, const LayoutSizes& sizes,
                  v1::ExportPoolsResponse* out) {
  for (int l = 0; l < layout.num_layers(); ++l) {
    v1::PoolView* s = out->add_pools();
    s->set_layer(l);
    s->set_kind("recurrent");
    s->set_dtype(layout.state_dtype());
    const int64_t hv = int64_t{ValueHeadsOf(layout)};  // [blocks, HV, V, K]
    for (int64_t d : {int64_t{layout.num_blocks()}, hv, int64_t{layout.head_dim()},
                      int64_t{layout.head_dim()}}) {
      s->add_shape(d);
    }
    const int64_t k = layout.head_dim();
    for (int64_t d : {hv * k * k, k * k, k, int64_t{1}}) s->add_strides(d);
    s->set_offset_bytes(StatePoolOffset(sizes, l));
    s->set_byte_size(sizes.state_block_bytes * layout.num_blocks());
    v1::PoolView* c = out->add_pools();
    c->set_layer(l);
    c->set_kind("conv");
    c->set_dtype(layout.activation_dtype());
    for (int64_t d : {int64_t{layout.num_blocks()}, int64_t{layout.conv_dim()},
                      int64_t{sizes.conv_width}}) {
      c->add_shape(d);
    }
    for (int64_t d : {int64_t{layout.conv_dim()} * sizes.conv_width, int64_t{sizes.conv_width},
                      int64_t{1}}) {
      c->add_strides(d);
    }
    c->set_offset_bytes(ConvPoolOffset(sizes, l));
    c->set_byte_size(sizes.conv_block_bytes * layout.num_blocks());
  }
}

}  // namespace server
}  // namespace specstate
