// specstated: the SpecState service.
//
//   specstated                                   # CPU/CUDA auto, small default layout
//   specstated --config=layout.json --listen=unix:///run/specstate.sock
//   specstated --backend=cuda --layers=20 --heads=32 --head_dim=128 ...
//
// Flags override the config file's fields. SIGINT/SIGTERM shut down cleanly.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpc/health/v1/health.pb.h"
#include "grpcpp/health_check_service_interface.h"
#include "kernels/kda_kernels.h"
#include "server/config.h"
#include "server/engine.h"
#include "server/log.h"
#include "server/service.h"

ABSL_FLAG(std::string, config, "", "ServiceConfig file (.json, or protobuf text format)");
ABSL_FLAG(std::string, listen, "",
          "unix:///PATH (default unix:///tmp/specstate.sock) or HOST:PORT for TCP");
ABSL_FLAG(std::string, backend, "", "auto (default), cpu or cuda");
ABSL_FLAG(int, device, -1, "CUDA device ordinal (default 0)");
ABSL_FLAG(int, layers, 0, "KDA layers");
ABSL_FLAG(int, heads, 0, "heads per layer (H)");
ABSL_FLAG(int, head_dim, 0, "head dim K = V: 64, 128 or 256");
ABSL_FLAG(int, conv_dim, 0, "conv-state channels (D)");
ABSL_FLAG(int, conv_kernel, 0, "conv kernel width");
ABSL_FLAG(int, num_spec, -1, "draft tokens per row (Q = num_spec + 1)");
ABSL_FLAG(int, blocks, 0, "blocks per pool, the null block 0 included");
ABSL_FLAG(int, max_rows, 0, "rows a step may verify");
ABSL_FLAG(std::string, activation_dtype, "", "bf16, fp16 or fp32");
ABSL_FLAG(std::string, state_dtype, "", "fp32 or bf16");
ABSL_FLAG(std::string, cache_mode, "", "none or align");
ABSL_FLAG(int, mamba_block_size, 0, "align mode: tokens per state block (>= Q)");
ABSL_FLAG(float, lower_bound, 0.0f, "the KDA gate's lower bound (negative)");
ABSL_FLAG(int, default_lease_ms, 0, "session lease when a client asks for none");
ABSL_FLAG(int, submit_spin_us, -1,
          "CUDA: how long the submitting thread polls before it sleeps (us, <= 100000; default 200)");

namespace specstate {
namespace server {
namespace {

absl::StatusOr<v1::DType> DTypeFlag(const std::string& value, absl::string_view flag) {
  absl::StatusOr<DType> d = ParseDType(value);
  if (!d.ok()) return absl::InvalidArgumentError(absl::StrCat("--", flag, ": ", d.status().message()));
  return ToProto(*d);
}

absl::StatusOr<v1::ServiceConfig> BuildConfig() {
  v1::ServiceConfig config = DefaultServiceConfig();
  if (!absl::GetFlag(FLAGS_config).empty()) {
    absl::StatusOr<v1::ServiceConfig> loaded = LoadServiceConfig(absl::GetFlag(FLAGS_config));
    if (!loaded.ok()) return loaded.status();
    config = *std::move(loaded);
  }
  v1::Layout* l = config.mutable_layout();
  if (!absl::GetFlag(FLAGS_listen).empty()) config.set_listen(absl::GetFlag(FLAGS_listen));
  const std::string backend = absl::GetFlag(FLAGS_backend);
  if (backend == "auto") {
    l->set_backend(v1::AUTO);
  } else if (backend == "cpu") {
    l->set_backend(v1::CPU);
  } else if (backend == "cuda") {
    l->set_backend(v1::CUDA);
  } else if (!backend.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--backend=", backend, ": expected auto, cpu or cuda"));
  }
  if (absl::GetFlag(FLAGS_device) >= 0) l->set_device(absl::GetFlag(FLAGS_device));
  if (absl::GetFlag(FLAGS_layers) > 0) l->set_num_layers(absl::GetFlag(FLAGS_layers));
  if (absl::GetFlag(FLAGS_heads) > 0) l->set_num_heads(absl::GetFlag(FLAGS_heads));
  if (absl::GetFlag(FLAGS_head_dim) > 0) l->set_head_dim(absl::GetFlag(FLAGS_head_dim));
  if (absl::GetFlag(FLAGS_conv_dim) > 0) l->set_conv_dim(absl::GetFlag(FLAGS_conv_dim));
  if (absl::GetFlag(FLAGS_conv_kernel) > 0) l->set_conv_kernel(absl::GetFlag(FLAGS_conv_kernel));
  if (absl::GetFlag(FLAGS_num_spec) >= 0) l->set_num_spec(absl::GetFlag(FLAGS_num_spec));
  if (absl::GetFlag(FLAGS_blocks) > 0) l->set_num_blocks(absl::GetFlag(FLAGS_blocks));
  if (absl::GetFlag(FLAGS_max_rows) > 0) l->set_max_rows(absl::GetFlag(FLAGS_max_rows));
  if (!absl::GetFlag(FLAGS_activation_dtype).empty()) {
    auto d = DTypeFlag(absl::GetFlag(FLAGS_activation_dtype), "activation_dtype");
    if (!d.ok()) return d.status();
    l->set_activation_dtype(*d);
  }
  if (!absl::GetFlag(FLAGS_state_dtype).empty()) {
    auto d = DTypeFlag(absl::GetFlag(FLAGS_state_dtype), "state_dtype");
    if (!d.ok()) return d.status();
    l->set_state_dtype(*d);
  }
  const std::string mode = absl::GetFlag(FLAGS_cache_mode);
  if (mode == "none") {
    l->set_cache_mode(v1::NONE);
  } else if (mode == "align") {
    l->set_cache_mode(v1::ALIGN);
  } else if (!mode.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--cache_mode=", mode, ": expected none or align"));
  }
  if (absl::GetFlag(FLAGS_mamba_block_size) > 0) {
    l->set_mamba_block_size(absl::GetFlag(FLAGS_mamba_block_size));
  }
  if (absl::GetFlag(FLAGS_lower_bound) != 0.0f) l->set_lower_bound(absl::GetFlag(FLAGS_lower_bound));
  if (absl::GetFlag(FLAGS_submit_spin_us) >= 0) {
    config.set_submit_spin_us(absl::GetFlag(FLAGS_submit_spin_us));
  }
  if (absl::GetFlag(FLAGS_default_lease_ms) > 0) {
    config.set_default_lease_ms(absl::GetFlag(FLAGS_default_lease_ms));
  }
  constexpr uint32_t kMaxSubmitSpinUs = 100000;
  if (config.submit_spin_us() > kMaxSubmitSpinUs) {
    return absl::InvalidArgumentError(absl::StrCat("submit_spin_us = ", config.submit_spin_us(),
                                                   " is over the limit of ", kMaxSubmitSpinUs));
  }
  absl::Status st = ValidateLayout(config.layout());
  if (!st.ok()) return st;
  return config;
}

absl::StatusOr<std::unique_ptr<Device>> OpenDevice(const v1::ServiceConfig& config) {
  const v1::Layout& layout = config.layout();
  const absl::Duration submit_spin =
      absl::Microseconds(config.submit_spin_us() == 0 ? 200 : config.submit_spin_us());
  switch (layout.backend()) {
    case v1::CPU:
      return CreateCpuDevice();
    case v1::CUDA:
      return CreateCudaDevice(layout.device(), submit_spin);
    default: {
      if (kernels::BuiltWithCuda()) {
        absl::StatusOr<std::unique_ptr<Device>> cuda = CreateCudaDevice(layout.device(), submit_spin);
        if (cuda.ok()) return cuda;
        LogInfo(absl::StrCat("no usable GPU (", cuda.status().message(),
                             "): serving on the CPU backend"));
      }
      return CreateCpuDevice();
    }
  }
}

int Run() {
  absl::StatusOr<v1::ServiceConfig> config = BuildConfig();
  if (!config.ok()) {
    LogError(config.status().ToString());
    return 2;
  }
  absl::StatusOr<std::unique_ptr<Device>> device = OpenDevice(*config);
  if (!device.ok()) {
    LogError(absl::StrCat("cannot open the device: ", device.status().ToString()));
    return 1;
  }
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(*config, *std::move(device));
  if (!engine.ok()) {
    LogError(absl::StrCat("cannot serve this layout: ", engine.status().ToString()));
    return 1;
  }
  SpecStateService service(engine->get(), *config);

  std::string listen = config->listen().empty() ? kDefaultListen : config->listen();
  std::string socket_path;
  if (absl::StartsWith(listen, "unix://")) {
    socket_path = listen.substr(7);
  } else if (absl::StartsWith(listen, "unix:")) {
    socket_path = listen.substr(5);
  }
  if (!socket_path.empty()) {
    struct stat st;
    if (lstat(socket_path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) unlink(socket_path.c_str());
  }

  // Referenced so the linker keeps grpc.health.v1's descriptor, which server
  // reflection hands to grpcurl.
  (void)grpc::health::v1::HealthCheckRequest::descriptor();
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials());
  builder.RegisterService(&service);
  builder.SetMaxReceiveMessageSize(64 << 20);
  builder.SetMaxSendMessageSize(512 << 20);  // ReadState with values of a large block
  // The socket is created owner-only: only this user's processes may drive it.
  const mode_t old_umask = umask(0077);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  umask(old_umask);
  if (server == nullptr) {
    LogError(absl::StrCat("cannot listen on ", listen));
    return 1;
  }
  if (!socket_path.empty()) chmod(socket_path.c_str(), 0600);
  server->GetHealthCheckService()->SetServingStatus("specstate.v1.SpecState", true);
  server->GetHealthCheckService()->SetServingStatus(true);

  const v1::Layout& l = (*engine)->layout();
  std::printf(
      "specstated: serving on %s (backend %s, %d layers, %d heads x %d, %d blocks, %d rows, "
      "Q=%d, %s activations, %s state, cache mode %s)\n",
      listen.c_str(), l.backend() == v1::CUDA ? "cuda" : "cpu", l.num_layers(), l.num_heads(),
      l.head_dim(), l.num_blocks(), l.max_rows(), l.num_spec() + 1,
      v1::DType_Name(l.activation_dtype()).c_str(), v1::DType_Name(l.state_dtype()).c_str(),
      v1::CacheMode_Name(l.cache_mode()).c_str());
  std::fflush(stdout);

  // Wait for SIGINT/SIGTERM (blocked in every thread since the start).
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  int received = 0;
  sigwait(&signals, &received);
  LogInfo(absl::StrCat("signal ", received, ": shutting down"));
  service.EndAllSessions();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  server->Wait();
  if (!socket_path.empty()) unlink(socket_path.c_str());
  return 0;
}

}  // namespace
}  // namespace server
}  // namespace specstate

int main(int argc, char** argv) {
  // Before any CUDA call: the stream waits on clients' doorbells (see there).
  specstate::kernels::UseEagerCudaModuleLoading();
  // Debian's Abseil is built without NDEBUG, so its mutex deadlock detector
  // runs on every lock this process takes, gRPC's included: it keeps a
  // global lock-order graph and records stack traces. Off while serving;
  // SPECSTATE_DEADLOCK_DETECTION=1 keeps it on (the unit tests always do).
  const char* detection = std::getenv("SPECSTATE_DEADLOCK_DETECTION");
  if (detection == nullptr || std::string(detection) != "1") {
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  }
  // Block the shutdown signals before any thread starts, so that only
  // sigwait() in Run() receives them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  absl::SetProgramUsageMessage(
      "specstated: the SpecState speculative-decoding state service.\n"
      "  specstated [--config=FILE] [--listen=unix:///PATH|HOST:PORT] [--backend=auto|cpu|cuda] "
      "[layout flags]");
  absl::ParseCommandLine(argc, argv);
  return specstate::server::Run();
}
