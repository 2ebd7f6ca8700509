// specstated: the SpecState service.
//
//   specstated                                   # CPU/CUDA auto, small default layout
//   specstated --config=layout.json --listen=unix:///run/specstate.sock
//   specstated --backend=cuda --layers=20 --heads=32 --head_dim=128 ...
//   specstated --backend=cuda --model=kimi-linear-48b-a3b --pool_memory=0.8
//
// Flags override the config file's fields; layout flags override --model's.
// SIGINT/SIGTERM shut down cleanly.
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/internal/parse.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/str_join.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/grpcpp.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpc/reflection/v1/reflection.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "grpcpp/health_check_service_interface.h"
#include "kernels/kda_kernels.h"
#include "proto/served_descriptor_set.h"
#include "server/config/config.h"
#include "server/engine/engine.h"
#include "server/base/log.h"
#include "server/api/metrics.h"
#include "server/modes/rules.h"
#include "server/config/presets.h"
#include "server/api/reflection.h"
#include "server/kept/recovery.h"
#include "server/kept/sd_notify.h"
#include "server/base/test_crash.h"
#include "server/api/service.h"
#include "server/config/sizing.h"

// Every flag's default is the default configuration's value (config.cc's
// DefaultServiceConfig(), checked at start); a flag overrides the config
// file only when it is given on the command line.
ABSL_FLAG(std::string, config, "", "ServiceConfig file (.json, or protobuf text format)");
ABSL_FLAG(std::string, listen, "unix:///tmp/specstate.sock", "unix:///PATH or HOST:PORT (TCP)");
ABSL_FLAG(std::string, backend, "auto",
          "auto (CUDA when a GPU is usable, else CPU), cpu or cuda");
ABSL_FLAG(int, device, 0, "CUDA device ordinal");
ABSL_FLAG(std::string, model, "",
          "a model preset: sets the layout's layer kind, layers, heads, value heads, head dim, "
          "conv dim and kernel, num_spec, dtypes and KDA gate to the model's (a -tpN preset: one "
          "rank's part of N, heads and conv channels divided). Layout flags given with it "
          "override the preset's fields (e.g. --model=kimi-linear-48b-a3b --num_spec=2). Known: "
          "kimi-linear-48b-a3b, kimi-linear-48b-a3b-tp2, -tp4, -tp8, qwen3-next-80b-a3b, "
          "qwen3-next-80b-a3b-tp2, -tp4, -tp8, kimi-k3-tp8 (specstatectl plan shows each one's "
          "memory)");
ABSL_FLAG(std::string, pool_memory, "",
          "size the pools from a memory budget instead of --blocks: bytes (60GiB, 512MiB, 80GB, "
          "123456789; B, KB, MB, GB, TB, KiB, MiB, GiB, TiB) or a fraction of the free memory "
          "(0.8 or 80%: of the GPU's free memory on CUDA, of the host's available memory "
          "(MemAvailable) on the CPU). --blocks becomes the most blocks for which everything the "
          "service allocates for the layout and commit mode (pools, records or rings, "
          "workspaces, bookkeeping) fits, logged at start; `specstatectl plan` computes the "
          "same count offline. The allocator's rounding (CUDA: up to 2 MiB an allocation) is "
          "not counted: leave it room (0.95 of an H200's free memory started, 1.0 did not). Not "
          "with --blocks; with kept pools (--keeper, systemd's FD store) in bytes only (a "
          "fraction of what is free changes while the kept pools hold memory)");
ABSL_FLAG(int, layers, 4, "layers (all of --kind)");
ABSL_FLAG(std::string, kind, "kda", "the layers' recurrence: kda (Kimi) or gdn (Gated DeltaNet)");
ABSL_FLAG(int, heads, 4, "key heads per layer (H: q, k)");
ABSL_FLAG(int, value_heads, 0,
          "value heads per layer (HV: v, beta, o, the state; GDN's g): a multiple of --heads; "
          "0: --heads");
ABSL_FLAG(std::string, kda_gate, "safe",
          "KDA's gate: safe (lower_bound / (1 + exp(-exp(A_log) (g + dt_bias)))) or plain "
          "(-exp(A_log) softplus(g + dt_bias))");
ABSL_FLAG(int, head_dim, 64, "head dim K = V: 64, 128 or 256");
ABSL_FLAG(int, conv_dim, 768, "conv-state channels (D)");
ABSL_FLAG(int, conv_kernel, 4, "conv kernel width");
ABSL_FLAG(int, num_spec, 3, "draft tokens per row (Q = num_spec + 1)");
ABSL_FLAG(int, blocks, 64,
          "blocks per pool, the null block 0 included (a request holds one; or --pool_memory)");
ABSL_FLAG(int, max_rows, 16, "rows a step may verify");
ABSL_FLAG(std::string, activation_dtype, "bf16", "bf16, fp16 or fp32");
ABSL_FLAG(std::string, state_dtype, "fp32", "fp32 or bf16");
ABSL_FLAG(std::string, cache_mode, "none", "none or align");
ABSL_FLAG(std::string, commit_mode, "eager",
          "eager (Commit replays the accepted tokens), deferred (the next Verify of the block "
          "replays them first: one state read and one write a step; needs num_spec <= 7) or "
          "fast (the state is written every --fold_every steps; Verify reads the checkpoint and "
          "a ring of the accepted tokens; within 2x the exact path's error, not bit-identical; "
          "needs num_spec <= 7)");
ABSL_FLAG(int, fold_every, 0,
          "commit mode fast: steps (at full acceptance) between two folds of a block's ring into "
          "its state; the ring holds fold_every * Q tokens, at most 256; 0: 4");
ABSL_FLAG(int, mamba_block_size, 0, "align mode: tokens per state block (>= Q)");
ABSL_FLAG(float, lower_bound, -5.0f, "the KDA gate's lower bound (negative)");
ABSL_FLAG(int, default_lease_ms, 10000, "session lease when a client asks for none (ms)");
ABSL_FLAG(int, stuck_stream_ms, 30000,
          "report NOT_SERVING while the device's queue is stuck on one wait or kernel this long "
          "(ms)");
ABSL_FLAG(int, submit_spin_us, 200,
          "CUDA: how long the submitting thread polls before it sleeps (us, <= 100000)");
ABSL_FLAG(std::string, keeper, "",
          "keep the pools across restarts of specstated: the socket of a specstate-keeper "
          "(specstate-keeper --socket=PATH); a restarted specstated takes the pools back from it");
ABSL_FLAG(std::string, host_tier_bytes, "",
          "host memory for saved blocks (SaveBlocks / RestoreBlocks: a block of every layer a "
          "key, least recently used keys evicted), allocated at start, pinned on CUDA: bytes "
          "(16GiB, 512MiB, 123456789); at least one block of every layer (the log and "
          "ListSaved say its bytes). Unset: no host tier");
ABSL_FLAG(bool, discard_kept_pools, false,
          "when the kept pools were made for another layout (or their header is damaged), start "
          "with fresh pools instead of refusing to start (the kept states are lost)");
// Not ServiceConfig fields: how this process is supervised, not the layout.
ABSL_FLAG(std::string, fd_store, "auto",
          "keep the pools in systemd's file-descriptor store (FDSTORE=1; the unit needs "
          "FileDescriptorStoreMax=): auto (when started by systemd: $NOTIFY_SOCKET set), yes, no");
ABSL_FLAG(std::string, pools_fd_socket, "",
          "CUDA kept pools: where clients fetch the pools' descriptor when cudaIpcGetMemHandle "
          "cannot export them (default: the --listen socket's path + \".pools\")");
ABSL_FLAG(std::string, test_crash_at, "",
          "tests only: SIGKILL this process at POINT:N (server/base/test_crash.h), e.g. "
          "commit:layer:3");
// Not a ServiceConfig field: where metrics are served is the deployment's
// choice, not the layout's.
ABSL_FLAG(std::string, metrics_listen, "",
          "serve Prometheus metrics over HTTP at http://HOST:PORT/metrics (e.g. 0.0.0.0:9464; "
          "port 0 picks a free one, logged at start); off when empty");

namespace specstate {
namespace server {
namespace {

// Whether the command line set `flag` (Abseil's public API has no such
// query in this version: the parser's own record of it).
template <typename T>
bool Given(const absl::Flag<T>& flag) {
  return absl::flags_internal::WasPresentOnCommandLine(absl::GetFlagReflectionHandle(flag).Name());
}

// The flags' defaults must be the default configuration's (the --help text
// shows them): an internal error at start, so that a test catches a drift.
absl::Status CheckFlagDefaults() {
  const v1::ServiceConfig d = DefaultServiceConfig();
  const v1::Layout& l = d.layout();
  const auto differs = [](const auto& flag, const std::string& want) {
    return absl::GetFlagReflectionHandle(flag).DefaultValue() != want;
  };
  std::vector<std::string> bad;
  const auto check = [&](bool drift, absl::string_view name) {
    if (drift) bad.emplace_back(name);
  };
  check(differs(FLAGS_listen, d.listen()), "listen");
  check(differs(FLAGS_device, absl::StrCat(l.device())), "device");
  check(differs(FLAGS_layers, absl::StrCat(l.num_layers())), "layers");
  check(differs(FLAGS_heads, absl::StrCat(l.num_heads())), "heads");
  check(differs(FLAGS_value_heads, absl::StrCat(l.num_value_heads())), "value_heads");
  check(differs(FLAGS_kind, l.layer_kind() == v1::GDN ? "gdn" : "kda"), "kind");
  check(differs(FLAGS_kda_gate, l.kda_gate() == v1::PLAIN_GATE ? "plain" : "safe"), "kda_gate");
  check(differs(FLAGS_head_dim, absl::StrCat(l.head_dim())), "head_dim");
  check(differs(FLAGS_conv_dim, absl::StrCat(l.conv_dim())), "conv_dim");
  check(differs(FLAGS_conv_kernel, absl::StrCat(l.conv_kernel())), "conv_kernel");
  check(differs(FLAGS_num_spec, absl::StrCat(l.num_spec())), "num_spec");
  check(differs(FLAGS_blocks, absl::StrCat(l.num_blocks())), "blocks");
  check(differs(FLAGS_max_rows, absl::StrCat(l.max_rows())), "max_rows");
  check(differs(FLAGS_mamba_block_size, absl::StrCat(l.mamba_block_size())), "mamba_block_size");
  check(differs(FLAGS_fold_every, absl::StrCat(l.fold_every())), "fold_every");
  check(differs(FLAGS_lower_bound, absl::StrCat(l.lower_bound())), "lower_bound");
  check(differs(FLAGS_default_lease_ms, absl::StrCat(d.default_lease_ms())), "default_lease_ms");
  check(differs(FLAGS_stuck_stream_ms, absl::StrCat(d.stuck_stream_ms())), "stuck_stream_ms");
  check(differs(FLAGS_submit_spin_us, absl::StrCat(d.submit_spin_us())), "submit_spin_us");
  if (bad.empty()) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("the defaults of --", absl::StrJoin(bad, ", --"),
                                          " differ from the default configuration's"));
}

absl::StatusOr<v1::DType> DTypeFlag(const std::string& value, absl::string_view flag) {
  absl::StatusOr<DType> d = ParseDType(value);
  if (!d.ok()) return absl::InvalidArgumentError(absl::StrCat("--", flag, ": ", d.status().message()));
  return ToProto(*d);
}

// A memory budget to size the pools from: --pool_memory's, or the config
// file's "pool_memory".
struct Budget {
  PoolMemory memory;
  std::string text;   // as given
  std::string field;  // "--pool_memory", or "config file PATH: pool_memory"
};

// The configuration: the defaults, the config file, --model's preset, then
// the flags given. `pool_memory`: --pool_memory's budget, when given (the
// blocks are sized once the device is open: SizeBlocks).
absl::StatusOr<v1::ServiceConfig> BuildConfig(std::optional<Budget>* pool_memory) {
  absl::Status defaults = CheckFlagDefaults();
  if (!defaults.ok()) return defaults;
  v1::ServiceConfig config = DefaultServiceConfig();
  std::string file_pool_memory;
  bool file_num_blocks = false;
  if (!absl::GetFlag(FLAGS_config).empty()) {
    absl::StatusOr<ConfigFile> loaded = LoadConfigFile(absl::GetFlag(FLAGS_config));
    if (!loaded.ok()) return loaded.status();
    config = std::move(loaded->config);
    file_pool_memory = loaded->pool_memory;
    file_num_blocks = loaded->num_blocks_given;
  }
  v1::Layout* l = config.mutable_layout();
  if (Given(FLAGS_model)) {
    absl::Status preset = ApplyModelPreset(absl::GetFlag(FLAGS_model), l);
    if (!preset.ok()) return preset;
  }
  pool_memory->reset();
  // The file's pool_memory sizes the pools unless a flag does (--blocks or
  // --pool_memory); with the file's own num_blocks it is refused.
  if (!file_pool_memory.empty() && !Given(FLAGS_blocks) && !Given(FLAGS_pool_memory)) {
    const std::string field = absl::StrCat("config file ", absl::GetFlag(FLAGS_config), ": pool_memory");
    if (file_num_blocks) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " \"", file_pool_memory, "\" and layout.num_blocks ", l->num_blocks(),
          " both size the pools: give one of them"));
    }
    absl::StatusOr<PoolMemory> m = ParsePoolMemory(file_pool_memory, field);
    if (!m.ok()) return m.status();
    *pool_memory = Budget{*m, file_pool_memory, field};
  }
  if (Given(FLAGS_pool_memory)) {
    if (Given(FLAGS_blocks)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--blocks=", absl::GetFlag(FLAGS_blocks), " and --pool_memory=",
          absl::GetFlag(FLAGS_pool_memory), " both size the pools: give one of them"));
    }
    absl::StatusOr<PoolMemory> m = ParsePoolMemory(absl::GetFlag(FLAGS_pool_memory), "--pool_memory");
    if (!m.ok()) return m.status();
    *pool_memory = Budget{*m, absl::GetFlag(FLAGS_pool_memory), "--pool_memory"};
  }
  if (Given(FLAGS_listen)) config.set_listen(absl::GetFlag(FLAGS_listen));
  if (Given(FLAGS_backend)) {
    const std::string backend = absl::GetFlag(FLAGS_backend);
    if (backend == "auto") {
      l->set_backend(v1::AUTO);
    } else if (backend == "cpu") {
      l->set_backend(v1::CPU);
    } else if (backend == "cuda") {
      l->set_backend(v1::CUDA);
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("--backend=", backend, ": expected auto, cpu or cuda"));
    }
  }
  if (Given(FLAGS_device)) l->set_device(absl::GetFlag(FLAGS_device));
  if (Given(FLAGS_layers)) l->set_num_layers(absl::GetFlag(FLAGS_layers));
  if (Given(FLAGS_heads)) l->set_num_heads(absl::GetFlag(FLAGS_heads));
  if (Given(FLAGS_value_heads)) l->set_num_value_heads(absl::GetFlag(FLAGS_value_heads));
  if (Given(FLAGS_kind)) {
    const std::string kind = absl::GetFlag(FLAGS_kind);
    if (kind == "kda") {
      l->set_layer_kind(v1::KDA);
    } else if (kind == "gdn") {
      l->set_layer_kind(v1::GDN);
    } else {
      return absl::InvalidArgumentError(absl::StrCat("--kind=", kind, ": expected kda or gdn"));
    }
  }
  if (Given(FLAGS_kda_gate)) {
    const std::string gate = absl::GetFlag(FLAGS_kda_gate);
    if (gate == "safe") {
      l->set_kda_gate(v1::SAFE_GATE);
    } else if (gate == "plain") {
      l->set_kda_gate(v1::PLAIN_GATE);
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("--kda_gate=", gate, ": expected safe or plain"));
    }
  }
  if (Given(FLAGS_head_dim)) l->set_head_dim(absl::GetFlag(FLAGS_head_dim));
  if (Given(FLAGS_conv_dim)) l->set_conv_dim(absl::GetFlag(FLAGS_conv_dim));
  if (Given(FLAGS_conv_kernel)) l->set_conv_kernel(absl::GetFlag(FLAGS_conv_kernel));
  if (Given(FLAGS_num_spec)) l->set_num_spec(absl::GetFlag(FLAGS_num_spec));
  if (Given(FLAGS_blocks)) l->set_num_blocks(absl::GetFlag(FLAGS_blocks));
  if (Given(FLAGS_max_rows)) l->set_max_rows(absl::GetFlag(FLAGS_max_rows));
  if (Given(FLAGS_activation_dtype)) {
    auto d = DTypeFlag(absl::GetFlag(FLAGS_activation_dtype), "activation_dtype");
    if (!d.ok()) return d.status();
    l->set_activation_dtype(*d);
  }
  if (Given(FLAGS_state_dtype)) {
    auto d = DTypeFlag(absl::GetFlag(FLAGS_state_dtype), "state_dtype");
    if (!d.ok()) return d.status();
    l->set_state_dtype(*d);
  }
  if (Given(FLAGS_cache_mode)) {
    const std::string mode = absl::GetFlag(FLAGS_cache_mode);
    if (mode == "none") {
      l->set_cache_mode(v1::NONE);
    } else if (mode == "align") {
      l->set_cache_mode(v1::ALIGN);
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("--cache_mode=", mode, ": expected none or align"));
    }
  }
  if (Given(FLAGS_commit_mode)) {
    absl::StatusOr<v1::CommitMode> mode =
        ParseCommitMode(absl::GetFlag(FLAGS_commit_mode), "--commit_mode");
    if (!mode.ok()) return mode.status();
    l->set_commit_mode(*mode);
  }
  if (Given(FLAGS_fold_every)) l->set_fold_every(absl::GetFlag(FLAGS_fold_every));
  if (Given(FLAGS_mamba_block_size)) l->set_mamba_block_size(absl::GetFlag(FLAGS_mamba_block_size));
  if (Given(FLAGS_lower_bound)) l->set_lower_bound(absl::GetFlag(FLAGS_lower_bound));
  for (auto [flag, name] : {std::make_pair(&FLAGS_submit_spin_us, "submit_spin_us"),
                            std::make_pair(&FLAGS_stuck_stream_ms, "stuck_stream_ms"),
                            std::make_pair(&FLAGS_default_lease_ms, "default_lease_ms")}) {
    if (Given(*flag) && absl::GetFlag(*flag) < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, " = ", absl::GetFlag(*flag), " must not be negative"));
    }
  }
  if (Given(FLAGS_submit_spin_us)) config.set_submit_spin_us(absl::GetFlag(FLAGS_submit_spin_us));
  if (Given(FLAGS_stuck_stream_ms)) {
    config.set_stuck_stream_ms(absl::GetFlag(FLAGS_stuck_stream_ms));
  }
  if (Given(FLAGS_default_lease_ms)) {
    config.set_default_lease_ms(absl::GetFlag(FLAGS_default_lease_ms));
  }
  if (Given(FLAGS_keeper)) config.set_keeper(absl::GetFlag(FLAGS_keeper));
  if (Given(FLAGS_discard_kept_pools)) {
    config.set_discard_kept_pools(absl::GetFlag(FLAGS_discard_kept_pools));
  }
  if (Given(FLAGS_host_tier_bytes)) {
    absl::StatusOr<PoolMemory> tier =
        ParsePoolMemory(absl::GetFlag(FLAGS_host_tier_bytes), "--host_tier_bytes");
    if (!tier.ok()) return tier.status();
    if (tier->bytes <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--host_tier_bytes=", absl::GetFlag(FLAGS_host_tier_bytes),
          " must be bytes (16GiB, 123456789), not a fraction"));
    }
    config.set_host_tier_bytes(uint64_t(tier->bytes));
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

// Makes `path` free for a new socket: its directory must exist; a socket
// that answers belongs to a live server (refused: never take over another
// service's socket); one that refuses connections is stale and removed.
absl::Status PrepareSocketPath(const std::string& path) {
  if (path.size() >= sizeof(sockaddr_un{}.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("the socket path has ", path.size(),
                                                   " bytes; Unix sockets allow at most ",
                                                   sizeof(sockaddr_un{}.sun_path) - 1));
  }
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  struct stat st;
  if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::NotFoundError(absl::StrCat("directory ", dir, " does not exist"));
  }
  if (lstat(path.c_str(), &st) != 0) return absl::OkStatus();
  if (!S_ISSOCK(st.st_mode)) {
    return absl::AlreadyExistsError(absl::StrCat(path, " exists and is not a socket"));
  }
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int connected = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  const int err = errno;
  close(fd);
  if (connected == 0) {
    return absl::AlreadyExistsError(absl::StrCat(
        "another server answers on ", path, ": stop it first, or choose another --listen"));
  }
  if (err != ECONNREFUSED) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot tell whether ", path, " is in use: ", std::strerror(err)));
  }
  if (unlink(path.c_str()) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot remove the stale socket ", path, ": ", std::strerror(errno)));
  }
  LogInfo(absl::StrCat("removed the stale socket ", path));
  return absl::OkStatus();
}

// --pool_memory: sets the layout's blocks to the most that fit the budget
// (server/config/sizing.h, as specstatectl plan computes them) and logs them.
absl::Status SizeBlocks(const Budget& budget, const Device& device, bool kept_pools,
                        v1::Layout* layout) {
  const PoolMemory& memory = budget.memory;
  if (kept_pools && memory.fraction > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        budget.field, "=", budget.text,
        " is a fraction of the free memory, which changes while kept pools (--keeper, "
        "systemd's FD store) still hold the previous instance's memory: the restarted service "
        "would size other pools than the ones it must take back. Give bytes (e.g. "
        "--pool_memory=60GiB) or --blocks"));
  }
  uint64_t free = 0;
  if (memory.fraction > 0) {
    absl::StatusOr<uint64_t> f = device.FreeBytes();
    if (!f.ok()) return f.status();
    free = *f;
  }
  absl::StatusOr<int64_t> bytes_budget = BudgetBytes(memory, free, budget.field);
  if (!bytes_budget.ok()) return bytes_budget.status();
  absl::StatusOr<int> blocks = BlocksForBudget(*layout, *bytes_budget, kept_pools, budget.field);
  if (!blocks.ok()) return blocks.status();
  layout->set_num_blocks(*blocks);
  const ServiceBytes bytes = ComputeServiceBytes(*layout, kept_pools);
  LogInfo(absl::StrCat(
      budget.field, "=", budget.text, ": a budget of ", *bytes_budget, " bytes (",
      FormatBytes(*bytes_budget), ")",
      memory.fraction > 0 ? absl::StrCat(", ", memory.fraction, " of ", free, " bytes free")
                          : std::string(),
      ": ", *blocks, " blocks (", *blocks - 1, " requests' states; block 0 is null), ",
      bytes.total, " bytes allocated (pools ", bytes.pools, ", ",
      CommitModeOf(*layout).scratch_name(), " ", bytes.records, ", the rest ",
      bytes.total - bytes.pools - bytes.records, ")"));
  return absl::OkStatus();
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
  const absl::Time process_start = absl::Now();
  std::optional<Budget> pool_memory;
  absl::StatusOr<v1::ServiceConfig> config = BuildConfig(&pool_memory);
  if (!config.ok()) {
    LogError(config.status().ToString());
    return 2;
  }
  if (Given(FLAGS_model)) {
    const ModelPreset* preset = FindModelPreset(absl::GetFlag(FLAGS_model));
    LogInfo(absl::StrCat("model ", preset->name, ": ", preset->model,
                         preset->tensor_parallel > 1
                             ? absl::StrCat(", one rank's part of ", preset->tensor_parallel)
                             : std::string()));
  }
  const std::string metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  if (!metrics_listen.empty()) {
    if (absl::Status st = Metrics::CheckListen(metrics_listen); !st.ok()) {
      LogError(st.ToString());
      return 2;
    }
  }
  if (absl::Status st = SetTestCrash(absl::GetFlag(FLAGS_test_crash_at)); !st.ok()) {
    LogError(st.ToString());
    return 2;
  }
  const std::string fd_store_flag = absl::GetFlag(FLAGS_fd_store);
  if (fd_store_flag != "auto" && fd_store_flag != "yes" && fd_store_flag != "no") {
    LogError(absl::StrCat("--fd_store=", fd_store_flag, ": expected auto, yes or no"));
    return 2;
  }
  std::string listen = config->listen().empty() ? kDefaultListen : config->listen();
  std::string socket_path;
  if (absl::StartsWith(listen, "unix://")) {
    socket_path = listen.substr(7);
  } else if (absl::StartsWith(listen, "unix:")) {
    socket_path = listen.substr(5);
  }
  absl::StatusOr<std::unique_ptr<Device>> device = OpenDevice(*config);
  if (!device.ok()) {
    LogError(absl::StrCat("cannot open the device: ", device.status().ToString()));
    return 1;
  }
  // Pools that outlive this process: taken back from their holder, or made
  // fresh and handed to it, before the engine allocates the rest.
  RecoveryOptions kept;
  kept.keeper = config->keeper();
  kept.fd_store = fd_store_flag == "yes" || (fd_store_flag == "auto" && UnderSystemd());
  kept.discard_kept_pools = config->discard_kept_pools();
  kept.pools_fd_socket = absl::GetFlag(FLAGS_pools_fd_socket);
  if (kept.pools_fd_socket.empty()) {
    kept.pools_fd_socket = socket_path.empty() ? absl::StrCat("/tmp/specstate-", getpid(), ".pools")
                                               : socket_path + ".pools";
  }
  if (pool_memory.has_value()) {
    absl::Status sized = SizeBlocks(*pool_memory, **device, !kept.keeper.empty() || kept.fd_store,
                                    config->mutable_layout());
    if (!sized.ok()) {
      LogError(sized.ToString());
      return 2;
    }
  }
  std::unique_ptr<Recovery> recovery;
  if (!kept.keeper.empty() || kept.fd_store) {
    absl::StatusOr<std::unique_ptr<Recovery>> r =
        Recovery::Start(config->layout(), **device, kept, process_start);
    if (!r.ok()) {
      LogError(absl::StrCat("cannot keep the pools: ", r.status().ToString()));
      return 1;
    }
    recovery = *std::move(r);
  }
  // DEFERRED's pending table and records, FAST's rings: kept with the pools.
  const KeptModeParts kept_parts = recovery != nullptr ? recovery->kept_parts() : KeptModeParts{};
  absl::StatusOr<std::unique_ptr<Engine>> engine =
      Engine::Create(*config, *std::move(device), &kept_parts);
  if (!engine.ok()) {
    LogError(absl::StrCat("cannot serve this layout: ", engine.status().ToString()));
    return 1;
  }
  if (recovery != nullptr) {
    kernels::CommitJournal journal = recovery->journal();
    if (TestCrashSet()) journal.test_hook = &CommitTestHook;
    (*engine)->SetCommitJournal(journal);
    // A step committed before the restart is refused after it, as within
    // one instance.
    const v1::RecoverResponse kept_report = recovery->Report();
    if (kept_report.kept() && kept_report.commits() > 0) {
      (*engine)->SetCommittedBeforeRestart(kept_report.last_committed_step());
    }
  }
  SpecStateService service(engine->get(), *config);
  service.SetRecovery(recovery.get());

  if (!socket_path.empty()) {
    absl::Status ready = PrepareSocketPath(socket_path);
    if (!ready.ok()) {
      LogError(absl::StrCat("cannot listen on ", listen, ": ", ready.message()));
      return 1;
    }
  }

  // Before the gRPC server: a port that cannot be had stops the start
  // before the socket exists. Scrapes read the service's stats; nothing is
  // recorded for them.
  std::unique_ptr<Metrics> metrics;
  if (!metrics_listen.empty()) {
    absl::StatusOr<std::unique_ptr<Metrics>> served =
        Metrics::Serve(metrics_listen, [&service] { return service.CollectStats(); });
    if (!served.ok()) {
      LogError(served.status().ToString());
      return 1;
    }
    metrics = *std::move(served);
    LogInfo(absl::StrCat("metrics: serving on ", metrics->url()));
  }

  // Server reflection from the embedded descriptor set, which keeps the
  // .proto files' comments (grpcurl describe shows them); list_services
  // names every service registered here.
  absl::StatusOr<std::unique_ptr<ReflectionService>> reflection = ReflectionService::Create(
      proto::ServedDescriptorSet(),
      {v1::SpecState::service_full_name(), grpc::health::v1::Health::service_full_name(),
       grpc::reflection::v1::ServerReflection::service_full_name(),
       grpc::reflection::v1alpha::ServerReflection::service_full_name()});
  if (!reflection.ok()) {
    LogError(absl::StrCat("cannot serve reflection: ", reflection.status().ToString()));
    return 1;
  }
  grpc::EnableDefaultHealthCheckService(true);  // grpc.health.v1.Health
  grpc::ServerBuilder builder;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials());
  builder.RegisterService(&service);
  for (grpc::Service* s : (*reflection)->services()) builder.RegisterService(s);
  builder.SetMaxReceiveMessageSize(64 << 20);
  builder.SetMaxSendMessageSize(512 << 20);  // ReadState with values of a large block
  // The socket is created owner-only: only this user's processes may drive it.
  const mode_t old_umask = umask(0077);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  umask(old_umask);
  if (server == nullptr) {
    LogError(absl::StrCat("cannot listen on ", listen,
                          socket_path.empty()
                              ? ": the port is in use, or the address is not this host's"
                              : ": gRPC could not bind the socket (see its message above)"));
    return 1;
  }
  if (!socket_path.empty()) chmod(socket_path.c_str(), 0600);
  server->GetHealthCheckService()->SetServingStatus("specstate.v1.SpecState", true);
  server->GetHealthCheckService()->SetServingStatus(true);
  if (UnderSystemd()) {
    absl::Status notified = SdNotify(absl::StrCat("READY=1\nMAINPID=", getpid()));
    if (!notified.ok()) LogError(notified.ToString());
  }
  if (recovery != nullptr) {
    const v1::RecoverResponse r = recovery->Report();
    LogInfo(absl::StrCat("serving ", absl::FormatDuration(absl::Now() - process_start),
                         " after start; pools ", r.kept() ? "kept" : "fresh", ", held by ",
                         r.holder(), r.kept() ? absl::StrCat(", last committed step ",
                                                             r.last_committed_step(), ", ",
                                                             r.lost_blocks_size(), " blocks lost")
                                              : std::string()));
  }

  const v1::Layout& l = (*engine)->layout();
  std::printf(
      "specstated: serving on %s (backend %s, %d %s layers, %d heads (%d value heads) x %d, "
      "%d blocks, %d rows, Q=%d, %s activations, %s state, cache mode %s, commit mode %s%s)\n",
      listen.c_str(), l.backend() == v1::CUDA ? "cuda" : "cpu", l.num_layers(),
      l.layer_kind() == v1::GDN ? "GDN" : "KDA", l.num_heads(), ValueHeadsOf(l), l.head_dim(), l.num_blocks(), l.max_rows(), l.num_spec() + 1,
      v1::DType_Name(l.activation_dtype()).c_str(), v1::DType_Name(l.state_dtype()).c_str(),
      v1::CacheMode_Name(l.cache_mode()).c_str(), v1::CommitMode_Name(l.commit_mode()).c_str(),
      l.fold_every() > 0 ? absl::StrCat(" (fold every ", l.fold_every(), ")").c_str() : "");
  std::fflush(stdout);
  if (const std::optional<HostTier::Counters> tier = (*engine)->HostTierCounters()) {
    LogInfo(absl::StrCat("host tier: ", tier->capacity, " blocks of ", tier->entry_bytes,
                         " bytes (", FormatBytes(uint64_t(tier->capacity) * tier->entry_bytes),
                         l.backend() == v1::CUDA ? ", pinned)" : ")"));
  }
  if (l.backend() == v1::CUDA) {
    if (l.mps_client()) {
      LogInfo(absl::StrCat("device ", l.device(), ": an MPS client (its context is shared through "
                           "the MPS server; the scheduler must be a client of the same server)"));
    }
    for (const std::string& warning : (*engine)->Warnings()) {
      LogError(absl::StrCat("WARNING: device ", l.device(), ": ", warning));
    }
  }

  // Health that means something: NOT_SERVING on a sticky device error or a
  // stuck queue (Engine::HealthProblem), polled a few times a second.
  absl::Notification stop_health;
  std::thread health([&] {
    std::string reported;
    do {
      const std::string problem = service.HealthProblem();
      if (problem != reported) {
        const bool serving = problem.empty();
        server->GetHealthCheckService()->SetServingStatus("specstate.v1.SpecState", serving);
        server->GetHealthCheckService()->SetServingStatus(serving);
        if (serving) {
          LogInfo("health: SERVING again");
        } else {
          LogError(absl::StrCat("health: NOT_SERVING: ", problem));
        }
        reported = problem;
      }
    } while (!stop_health.WaitForNotificationWithTimeout(absl::Milliseconds(100)));
  });

  // Wait for SIGINT/SIGTERM (blocked in every thread since the start).
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  int received = 0;
  sigwait(&signals, &received);
  LogInfo(absl::StrCat("signal ", received, ": shutting down"));
  if (UnderSystemd()) SdNotify("STOPPING=1").IgnoreError();
  stop_health.Notify();
  health.join();
  service.EndAllSessions();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  server->Wait();
  if (!socket_path.empty()) unlink(socket_path.c_str());
  // Stops its HTTP server (up to 2 s: civetweb's poll interval) before the
  // service goes.
  metrics.reset();
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
  // --help lists this file's flags (Abseil shows only those of a file named
  // after the program by default).
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "server/main.cc");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  absl::SetProgramUsageMessage(
      "the SpecState speculative-decoding state service.\n"
      "  specstated [--config=FILE] [--listen=unix:///PATH|HOST:PORT] [--backend=auto|cpu|cuda] "
      "[--metrics_listen=HOST:PORT] [--model=NAME] [--pool_memory=BYTES|FRACTION] "
      "[layout flags]\n"
      "  layout flags given with --model override the preset's fields; --pool_memory sizes "
      "--blocks (specstatectl plan --model=NAME --pool_memory=... shows the same sizing "
      "offline)");
  absl::ParseCommandLine(argc, argv);
  return specstate::server::Run();
}
