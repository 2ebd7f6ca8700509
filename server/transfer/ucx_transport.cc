#include "server/transfer/ucx_transport.h"

#include <dlfcn.h>
#include <ucp/api/ucp.h>

#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace specstate {
namespace server {

// libucp's entry points, loaded once.
struct UcxTransport::Api {
  decltype(&ucp_config_read) config_read;
  decltype(&ucp_config_release) config_release;
  decltype(&ucp_init_version) init_version;
  decltype(&ucp_cleanup) cleanup;
  decltype(&ucp_worker_create) worker_create;
  decltype(&ucp_worker_destroy) worker_destroy;
  decltype(&ucp_worker_get_address) worker_get_address;
  decltype(&ucp_worker_release_address) worker_release_address;
  decltype(&ucp_worker_progress) worker_progress;
  decltype(&ucp_mem_map) mem_map;
  decltype(&ucp_mem_unmap) mem_unmap;
  decltype(&ucp_rkey_pack) rkey_pack;
  decltype(&ucp_rkey_buffer_release) rkey_buffer_release;
  decltype(&ucp_ep_create) ep_create;
  decltype(&ucp_ep_close_nbx) ep_close_nbx;
  decltype(&ucp_ep_rkey_unpack) ep_rkey_unpack;
  decltype(&ucp_rkey_destroy) rkey_destroy;
  decltype(&ucp_get_nbx) get_nbx;
  decltype(&ucp_request_check_status) request_check_status;
  decltype(&ucp_request_free) request_free;
  decltype(&ucs_status_string) status_string;
};

namespace {

template <typename F>
bool Bind(void* library, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(library, name));
  return *out != nullptr;
}

absl::StatusOr<const UcxTransport::Api*> LoadApi() {
  static std::once_flag once;
  static absl::StatusOr<const UcxTransport::Api*>* loaded = nullptr;
  std::call_once(once, [] {
    void* library = dlopen("libucp.so.0", RTLD_NOW | RTLD_GLOBAL);
    if (library == nullptr) {
      loaded = new absl::StatusOr<const UcxTransport::Api*>(absl::UnavailableError(absl::StrCat(
          "transfers need UCX: libucp.so.0 could not be loaded (", dlerror(),
          "); install Debian's libucx0")));
      return;
    }
    auto* api = new UcxTransport::Api();
    const bool ok =
        Bind(library, "ucp_config_read", &api->config_read) &&
        Bind(library, "ucp_config_release", &api->config_release) &&
        Bind(library, "ucp_init_version", &api->init_version) &&
        Bind(library, "ucp_cleanup", &api->cleanup) &&
        Bind(library, "ucp_worker_create", &api->worker_create) &&
        Bind(library, "ucp_worker_destroy", &api->worker_destroy) &&
        Bind(library, "ucp_worker_get_address", &api->worker_get_address) &&
        Bind(library, "ucp_worker_release_address", &api->worker_release_address) &&
        Bind(library, "ucp_worker_progress", &api->worker_progress) &&
        Bind(library, "ucp_mem_map", &api->mem_map) &&
        Bind(library, "ucp_mem_unmap", &api->mem_unmap) &&
        Bind(library, "ucp_rkey_pack", &api->rkey_pack) &&
        Bind(library, "ucp_rkey_buffer_release", &api->rkey_buffer_release) &&
        Bind(library, "ucp_ep_create", &api->ep_create) &&
        Bind(library, "ucp_ep_close_nbx", &api->ep_close_nbx) &&
        Bind(library, "ucp_ep_rkey_unpack", &api->ep_rkey_unpack) &&
        Bind(library, "ucp_rkey_destroy", &api->rkey_destroy) &&
        Bind(library, "ucp_get_nbx", &api->get_nbx) &&
        Bind(library, "ucp_request_check_status", &api->request_check_status) &&
        Bind(library, "ucp_request_free", &api->request_free) &&
        Bind(library, "ucs_status_string", &api->status_string);
    if (!ok) {
      loaded = new absl::StatusOr<const UcxTransport::Api*>(absl::UnavailableError(
          absl::StrCat("transfers need UCX: libucp.so.0 lacks a symbol (", dlerror(), ")")));
      return;
    }
    loaded = new absl::StatusOr<const UcxTransport::Api*>(api);
  });
  return *loaded;
}

absl::Status UcxError(const UcxTransport::Api& api, ucs_status_t status, absl::string_view what) {
  return absl::UnavailableError(absl::StrCat("UCX: ", what, ": ", api.status_string(status)));
}

// Waits until `request` completes or `deadline` passes, moving `worker`
// itself (the progress thread may be asleep); frees it either way once done.
absl::Status Await(const UcxTransport::Api& api, void* worker, void* request,
                   absl::Time deadline, absl::string_view what) {
  if (request == nullptr) return absl::OkStatus();  // completed at once
  if (UCS_PTR_IS_ERR(request)) return UcxError(api, UCS_PTR_STATUS(request), what);
  for (;;) {
    const ucs_status_t s = api.request_check_status(request);
    if (s != UCS_INPROGRESS) {
      api.request_free(request);
      return s == UCS_OK ? absl::OkStatus() : UcxError(api, s, what);
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat("UCX: ", what, " did not finish in time"));
    }
    if (api.worker_progress(static_cast<ucp_worker_h>(worker)) == 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(5));
    }
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<UcxTransport>> UcxTransport::Create(void* arena, uint64_t bytes) {
  absl::StatusOr<const Api*> api = LoadApi();
  if (!api.ok()) return api.status();
  const Api& a = **api;
  std::unique_ptr<UcxTransport> t(new UcxTransport());
  t->api_ = *api;
  t->arena_ = arena;

  // UCX's malloc hooks are for its registration cache, which mapping one
  // arena for the transport's life does not need; off, they cannot clash
  // with the process's allocator (or a sanitizer's). A user's setting wins.
  setenv("UCX_MEM_MALLOC_HOOKS", "no", /*overwrite=*/0);
  setenv("UCX_MEM_EVENTS", "no", /*overwrite=*/0);
  ucp_config_t* config = nullptr;
  ucs_status_t s = a.config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return UcxError(a, s, "reading its configuration");
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_RMA;
  params.mt_workers_shared = 1;
  ucp_context_h context = nullptr;
  s = a.init_version(UCP_API_MAJOR, UCP_API_MINOR, &params, config, &context);
  a.config_release(config);
  if (s != UCS_OK) return UcxError(a, s, "ucp_init");
  t->context_ = context;

  ucp_worker_params_t worker_params{};
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker_params.thread_mode = UCS_THREAD_MODE_MULTI;
  ucp_worker_h worker = nullptr;
  s = a.worker_create(context, &worker_params, &worker);
  if (s != UCS_OK) return UcxError(a, s, "ucp_worker_create");
  t->worker_ = worker;

  ucp_mem_map_params_t map{};
  map.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  map.address = arena;
  map.length = bytes;
  ucp_mem_h memory = nullptr;
  s = a.mem_map(context, &map, &memory);
  if (s != UCS_OK) return UcxError(a, s, "mapping the host tier");
  t->memory_ = memory;

  void* key = nullptr;
  size_t key_bytes = 0;
  s = a.rkey_pack(context, memory, &key, &key_bytes);
  if (s != UCS_OK) return UcxError(a, s, "packing the host tier's remote key");
  t->remote_key_.assign(static_cast<const char*>(key), key_bytes);
  a.rkey_buffer_release(key);

  ucp_address_t* address = nullptr;
  size_t address_bytes = 0;
  s = a.worker_get_address(worker, &address, &address_bytes);
  if (s != UCS_OK) return UcxError(a, s, "the worker's address");
  t->worker_address_.assign(reinterpret_cast<const char*>(address), address_bytes);
  a.worker_release_address(worker, address);

  t->progress_ = std::thread([raw = t.get()] { raw->Progress(); });
  return t;
}

UcxTransport::~UcxTransport() {
  stop_ = true;
  if (progress_.joinable()) progress_.join();
  if (api_ == nullptr) return;
  auto context = static_cast<ucp_context_h>(context_);
  if (memory_ != nullptr) api_->mem_unmap(context, static_cast<ucp_mem_h>(memory_));
  if (worker_ != nullptr) api_->worker_destroy(static_cast<ucp_worker_h>(worker_));
  if (context_ != nullptr) api_->cleanup(context);
}

// The worker moves (peers' reads of this arena over transports that need
// the target's help, such as TCP). While an export is held it polls every
// 20 us; otherwise, idle, it backs off to 2 ms between polls, so a service
// that once transferred does not keep a core busy (a 20 us poll cost about
// a fifth of one: tools/transfer_idle_cpu.py); any event brings it back to
// 20 us.
void UcxTransport::Progress() {
  auto worker = static_cast<ucp_worker_h>(worker_);
  constexpr int kBusyPollUs = 20, kIdlePollUs = 2000;
  int poll_us = kBusyPollUs;
  while (!stop_.load(std::memory_order_relaxed)) {
    if (api_->worker_progress(worker) != 0) {
      poll_us = kBusyPollUs;
      continue;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(poll_us));
    poll_us = serving_.load(std::memory_order_relaxed) ? kBusyPollUs
                                                       : std::min(2 * poll_us, kIdlePollUs);
  }
}

absl::Status UcxTransport::Get(const std::string& peer_worker_address,
                               const std::string& peer_remote_key,
                               const std::vector<Read>& reads, absl::Duration timeout) {
  const Api& a = *api_;
  const absl::Time deadline = absl::Now() + timeout;
  ucp_ep_params_t ep_params{};
  ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
  ep_params.address = reinterpret_cast<const ucp_address_t*>(peer_worker_address.data());
  ucp_ep_h ep = nullptr;
  ucs_status_t s = a.ep_create(static_cast<ucp_worker_h>(worker_), &ep_params, &ep);
  if (s != UCS_OK) return UcxError(a, s, "connecting to the source");
  ucp_rkey_h rkey = nullptr;
  s = a.ep_rkey_unpack(ep, peer_remote_key.data(), &rkey);
  absl::Status result = s == UCS_OK ? absl::OkStatus() : UcxError(a, s, "the source's remote key");
  std::vector<void*> requests;
  ucp_request_param_t param{};
  for (size_t i = 0; result.ok() && i < reads.size(); ++i) {
    void* r = a.get_nbx(ep, reads[i].local, reads[i].bytes, reads[i].remote_address, rkey, &param);
    if (UCS_PTR_IS_ERR(r)) {
      result = UcxError(a, UCS_PTR_STATUS(r), "reading a saved block");
    } else if (r != nullptr) {
      requests.push_back(r);
    }
  }
  for (void* r : requests) {
    absl::Status st = result.ok()
                          ? Await(a, worker_, r, deadline, "reading a saved block")
                          : Await(a, worker_, r, absl::Now() + absl::Seconds(5), "a read");
    if (result.ok()) result = st;
  }
  if (rkey != nullptr) a.rkey_destroy(rkey);
  // Flushed unless something went wrong: then closed at once.
  ucp_request_param_t close{};
  close.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  close.flags = result.ok() ? 0 : UCP_EP_CLOSE_FLAG_FORCE;
  // (A close that fails after every read finished loses nothing.)
  Await(a, worker_, a.ep_close_nbx(ep, &close), absl::Now() + absl::Seconds(5),
        "closing the connection")
      .IgnoreError();
  return result;
}

}  // namespace server
}  // namespace specstate
