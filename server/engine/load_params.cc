// Engine::LoadLayerParams: a KDA layer's gate parameters (A_log, dt_bias),
// inline or from a region, checked finite on the device before the layer's
// copy changes.
#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/device_status.h"
#include "server/engine/engine.h"

namespace specstate {
namespace server {

absl::StatusOr<std::shared_ptr<std::pair<FloatSource, FloatSource>>> Engine::LayerParamsOf(
    RegionLookup& lookup, const v1::LoadLayerParamsRequest& req) {
  const int L = layout_.num_layers();
  const int H = layout_.num_heads();
  if (req.layer() < 0 || req.layer() >= L) {
    return absl::OutOfRangeError(
        absl::StrCat("layer ", req.layer(), " is out of range: the layout has ", L, " layers"));
  }
  if (shape_.kind == kernels::LayerKind::kGdn) {
    return absl::FailedPreconditionError(
        "the layout's layers are GDN: they take no gate parameters (g is the log-decay the model "
        "computed, beta the write strength)");
  }
  if (req.has_lower_bound() && req.lower_bound() != layout_.lower_bound()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lower_bound = ", req.lower_bound(), " differs from the layout's ", layout_.lower_bound(),
        ": all layers share one lower_bound"));
  }
  // Each parameter inline or from a region; both copied into service memory.
  absl::StatusOr<FloatSource> a_log = ResolveFloatParam(lookup, req.a_log(), "a_log", H);
  if (!a_log.ok()) return a_log.status();
  absl::StatusOr<FloatSource> dt_bias =
      ResolveFloatParam(lookup, req.dt_bias(), "dt_bias", int64_t{H} * layout_.head_dim());
  if (!dt_bias.ok()) return dt_bias.status();
  return std::make_shared<std::pair<FloatSource, FloatSource>>(*std::move(a_log),
                                                               *std::move(dt_bias));
}

void Engine::LoadLayerParams(const std::string& session, const v1::LoadLayerParamsRequest& req,
                             Reply<v1::LoadLayerParamsResponse> reply) {
  RegionLookup lookup(regions_, session);
  absl::StatusOr<std::shared_ptr<std::pair<FloatSource, FloatSource>>> sources =
      LayerParamsOf(lookup, req);
  // A host mirror of this call's status (the device's is shared by every
  // LoadLayerParams: they run in stream order), reused across calls.
  kernels::DeviceStatus* mirror = nullptr;
  if (sources.ok()) {
    absl::MutexLock lock(&mu_);
    if (!param_mirrors_.empty()) {
      mirror = param_mirrors_.back();
      param_mirrors_.pop_back();
    }
  }
  if (sources.ok() && mirror == nullptr) {
    absl::StatusOr<void*> p = device_->AllocateHost(sizeof(kernels::DeviceStatus));
    if (!p.ok()) sources = p.status();
    mirror = static_cast<kernels::DeviceStatus*>(p.value_or(nullptr));
  }
  if (!sources.ok()) {
    reply(sources.status(), {});
    return;
  }
  std::memset(mirror, 0, sizeof(*mirror));
  const int layer_index = req.layer();
  Work work;
  // Inline values go through the scratch; region values are read by the
  // kernel, which checks them finite before the layer's copy changes.
  work.launch = [this, sources = *sources, layer_index, mirror](kernels::Stream stream,
                                                                 Scratch& scratch) -> absl::Status {
    absl::StatusOr<const float*> a = sources->first.Pointer(scratch);
    if (!a.ok()) return a.status();
    absl::StatusOr<const float*> d = sources->second.Pointer(scratch);
    if (!d.ok()) return d.status();
    const LayerState& layer = layers_[layer_index];
    kernels::LoadParamsArgs args;
    args.num_heads = layout_.num_heads();
    args.head_dim = layout_.head_dim();
    args.a_log = *a;
    args.dt_bias = *d;
    args.staging = params_staging_;
    args.dst_a_log = layer.a_log;
    args.dst_dt_bias = layer.dt_bias;
    args.input_fault = device_->input_fault_word();
    args.status = params_status_;
    args.status_mirror = mirror;
    return device_->kernels().LoadParams(args, stream);
  };
  work.done = [this, pins = UniquePins(lookup.TakePins()), reply, mirror,
               layer_index](absl::Status launched) {
    absl::Status result = launched;
    if (absl::Status lost = regions_.DropTruncated(*pins); !lost.ok()) result = lost;
    pins->clear();  // the regions may go now
    const bool check_failed = result.ok() && mirror->failed != 0;
    if (result.ok()) {
      result = kernels::DeviceStatusToStatus(
          *mirror, absl::StrCat("LoadLayerParams of layer ", layer_index));
    }
    {
      absl::MutexLock lock(&mu_);
      if (check_failed) ++counters_.device_check_failures;
      if (result.ok()) layers_[layer_index].params_loaded = true;
      param_mirrors_.push_back(mirror);
    }
    reply(result, {});
  };
  absl::Status st = device_->Submit(std::move(work));
  if (!st.ok()) {
    {
      absl::MutexLock lock(&mu_);
      param_mirrors_.push_back(mirror);
    }
    reply(st, {});
  }
}

}  // namespace server
}  // namespace specstate
