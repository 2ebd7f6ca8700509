// Moving the host tier's saved blocks between SpecState instances with UCX
// (Debian's libucx0): RDMA where the network has it, TCP or shared memory
// otherwise (UCX picks; UCX_TLS narrows it). A service exposes its host tier
// arena for remote reads (Expose: the arena mapped, its remote key packed,
// its worker's address); another reads saved blocks out of it into its own
// arena (Get), one-sided: the exposing side only keeps its worker
// progressing (a thread of this class), so a get over TCP completes too.
//
// libucp is loaded when the first transport is made (dlopen), so specstated
// runs without UCX installed until a transfer is asked for (then
// UNAVAILABLE, saying so).
#ifndef SPECSTATE_SERVER_TRANSFER_UCX_TRANSPORT_H_
#define SPECSTATE_SERVER_TRANSFER_UCX_TRANSPORT_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace specstate {
namespace server {

class UcxTransport {
 public:
  // A transport over `bytes` of host memory at `arena` (the host tier's):
  // UCX initialized with remote memory access, the arena mapped, a worker
  // and its progress thread. UNAVAILABLE when libucp cannot be loaded or UCX
  // finds no transport.
  static absl::StatusOr<std::unique_ptr<UcxTransport>> Create(void* arena, uint64_t bytes);
  ~UcxTransport();

  // What a peer needs to read the arena: this worker's address and the
  // arena's packed remote key (opaque bytes), and where the arena is.
  const std::string& worker_address() const { return worker_address_; }
  const std::string& remote_key() const { return remote_key_; }
  uint64_t arena_address() const { return reinterpret_cast<uint64_t>(arena_); }

  // One read: `bytes` at the peer's `remote_address` into `local`.
  struct Read {
    uint64_t remote_address = 0;
    char* local = nullptr;
    uint64_t bytes = 0;
  };
  // Reads out of a peer's exposed arena (its worker_address and
  // remote_key), all issued at once, and waits until every one is done.
  // UNAVAILABLE when the peer cannot be reached or a read fails;
  // DEADLINE_EXCEEDED after `timeout`.
  absl::Status Get(const std::string& peer_worker_address, const std::string& peer_remote_key,
                   const std::vector<Read>& reads, absl::Duration timeout);

  // While a peer may be reading the arena (an export held), the progress
  // thread polls every 20 us; otherwise it backs off to 2 ms when idle.
  void SetServing(bool serving) { serving_.store(serving, std::memory_order_relaxed); }

  // libucp's entry points (ucx_transport.cc).
  struct Api;

 private:
  UcxTransport() = default;
  void Progress();

  const Api* api_ = nullptr;
  void* arena_ = nullptr;
  void* context_ = nullptr;  // ucp_context_h
  void* worker_ = nullptr;   // ucp_worker_h
  void* memory_ = nullptr;   // ucp_mem_h
  std::string worker_address_;
  std::string remote_key_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> serving_{false};
  std::thread progress_;
};

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_TRANSFER_UCX_TRANSPORT_H_
