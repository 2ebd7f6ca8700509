// The device the service computes on: its memory, the regions it maps from
// clients, and an in-order queue of work (a CUDA stream, or a CPU worker
// thread that plays the same role). The rest of the service is the same for
// both backends.
//
//   std::unique_ptr<Device> device = CreateCpuDevice().value();
//   Work work;
//   work.launch = [&](kernels::Stream stream, Scratch& scratch) {
//     return device->kernels().Verify(args, stream);
//   };
//   work.done = [](absl::Status launched) { ... };  // after the device finished
//   absl::Status enqueued = device->Submit(std::move(work));
#ifndef SPECSTATE_SERVER_DEVICE_DEVICE_H_
#define SPECSTATE_SERVER_DEVICE_DEVICE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "kernels/device_status.h"
#include "kernels/kda_kernels.h"

namespace specstate {
namespace server {

// Which memory a mapping is of, whatever address it is mapped at: two
// registrations of one shared-memory object (mapped twice) or of one CUDA
// allocation are the same object, so the service can tell that a call's
// output overlaps its inputs or its own pools.
struct MemoryObject {
  enum Kind : uint32_t { kNone = 0, kShm = 1, kCudaAllocation = 2, kHost = 3 };
  uint32_t kind = kNone;
  uint64_t a = 0;  // shm: st_dev; CUDA: the allocation's base in the service; host: its address
  uint64_t b = 0;  // shm: st_ino
  bool operator==(const MemoryObject& o) const { return kind == o.kind && a == o.a && b == o.b; }
};

// Bytes [begin, end) of an object.
struct ByteSpan {
  MemoryObject object;
  uint64_t begin = 0;
  uint64_t end = 0;
};

// Whether two spans share a byte (empty spans share none).
inline bool Overlap(const ByteSpan& x, const ByteSpan& y) {
  return x.object.kind != MemoryObject::kNone && x.object == y.object && x.begin < x.end &&
         y.begin < y.end && x.begin < y.end && y.begin < x.end;
}

// A client's buffer mapped into the service. Unmapped on destruction.
class MappedRegion {
 public:
  virtual ~MappedRegion() = default;
  // Where the region starts (after the registration's offset_bytes).
  virtual void* data() const = 0;
  virtual uint64_t byte_size() const = 0;
  virtual absl::string_view kind() const = 0;  // "shm" or "cuda_ipc"
  // The memory it maps, and where data() lies in it.
  virtual MemoryObject object() const = 0;
  virtual uint64_t object_offset() const = 0;
  // Whether an access to it faulted because its owner truncated it (CPU:
  // server/device/truncation_guard.h); the calls that used it must fail.
  virtual bool faulted() const { return false; }
};

// Raised by the service to end waits that can no longer be satisfied (the
// session that was to ring the doorbell has ended).
struct WaitCancellation {
  std::atomic<bool> cancelled{false};
};

// A doorbell or an interprocess event that the queue waits for before a
// piece of work (wait: until *counter >= value) or signals after it (signal:
// *counter = value; an event is recorded).
struct SyncPoint {
  enum class Kind { kDoorbell, kEvent };
  Kind kind = Kind::kDoorbell;
  uint32_t* counter = nullptr;
  uint32_t value = 0;
  void* event = nullptr;  // an opened interprocess event
  std::shared_ptr<WaitCancellation> cancellation;  // waits only
  // Waits only: the step's cancellation word (kernels::Prerequisites), set to
  // `cancel_value` before a cancelled wait is let through or skipped, so no
  // call of that step runs after it.
  uint32_t* cancel_word = nullptr;
  uint32_t cancel_value = 0;
};
using WaitOp = SyncPoint;
using SignalOp = SyncPoint;

// Device bytes to copy to host memory after the work (statistics).
struct Readback {
  const void* device = nullptr;
  void* host = nullptr;  // from AllocateHost: the CUDA device writes it with a kernel
  uint64_t bytes = 0;
};

// Stream-ordered scratch for one piece of work: released after it.
class Scratch {
 public:
  virtual ~Scratch() = default;
  // Device memory holding a copy of `bytes` bytes of host memory.
  virtual absl::StatusOr<void*> Upload(const void* host, uint64_t bytes) = 0;
};

struct Work {
  std::vector<WaitOp> waits;
  // Enqueues the kernels (CUDA) or runs them (CPU) on `stream`.
  std::function<absl::Status(kernels::Stream stream, Scratch& scratch)> launch;
  std::vector<Readback> readbacks;
  std::vector<SignalOp> signals;
  // Runs once the device has finished the work (on a service thread, never
  // on the RPC's), with the launch's own status; the kernels' status mirrors
  // and the readbacks are filled by then. Also runs when a wait was
  // cancelled (status CANCELLED) or timed out.
  std::function<void(absl::Status launched)> done;
};

class Device {
 public:
  virtual ~Device() = default;

  virtual kernels::Backend kind() const = 0;
  // Whether the device's contexts are shared through MPS (CUDA; false on the CPU).
  virtual bool mps_client() const { return false; }
  virtual int ordinal() const = 0;
  virtual const kernels::KdaKernels& kernels() const = 0;

  // Memory still free for the pools, the records and the workspaces.
  virtual absl::StatusOr<uint64_t> FreeBytes() const = 0;

  // The pools: one zeroed allocation other processes can map. Once. When
  // kept pools were allocated or attached first (AllocateKept / AttachKept
  // with `pools`), returns those, as they are.
  virtual absl::StatusOr<void*> AllocateExported(uint64_t bytes) = 0;

  // Memory that can outlive this process (server/kept/recovery.h): a file
  // descriptor names it, which a keeper process or systemd's
  // file-descriptor store holds while specstated restarts. CPU: a sealed
  // memfd; CUDA: a cuMemCreate allocation exported as a POSIX file
  // descriptor. `data` is where the kernels see it (device memory on CUDA);
  // `fd` stays the device's (dup it, or pass it by SCM_RIGHTS, to hand it on).
  struct KeptMemory {
    void* data = nullptr;
    uint64_t bytes = 0;  // mapped (CUDA: rounded up to the allocation granularity)
    int fd = -1;
  };
  // At least `bytes` of zeroed kept memory. `pools`: it is the pools, which
  // AllocateExported then returns and ExportPools names (once).
  virtual absl::StatusOr<KeptMemory> AllocateKept(uint64_t bytes, bool pools) {
    return absl::UnimplementedError("this device keeps no memory across restarts");
  }
  // Maps the kept memory `fd` names (taking `fd` over, closed on failure),
  // its contents as they are: FAILED_PRECONDITION when it is smaller than
  // `bytes` or is not kept memory of this backend.
  virtual absl::StatusOr<KeptMemory> AttachKept(int fd, uint64_t bytes, bool pools) {
    return absl::UnimplementedError("this device keeps no memory across restarts");
  }
  // CUDA kept pools: the descriptor a client imports
  // (ExportPoolsResponse.pools_fd_socket hands it out; ExportHandle may be
  // set too, where cudaIpcGetMemHandle covers cuMemCreate memory), and the
  // allocation's size; -1 when clients use ExportName/ExportHandle only.
  virtual int ExportFd() const { return -1; }
  virtual uint64_t ExportFdBytes() const { return 0; }
  // How a client maps it: a path to open (CPU) or cuda_ipc_handle (CUDA).
  virtual std::string ExportName() const = 0;
  virtual std::string ExportHandle() const = 0;
  // The pools' memory: a region of it is refused (no call may write the
  // pools through a client's tensor).
  virtual MemoryObject ExportedObject() const = 0;

  // Zeroed memory only the service uses (records, workspaces, tables).
  virtual absl::StatusOr<void*> AllocateDevice(uint64_t bytes) = 0;
  // Host memory the device can write into (pinned on CUDA).
  virtual absl::StatusOr<void*> AllocateHost(uint64_t bytes) = 0;

  // Synchronous copies, ordered after all submitted work. For set-up and
  // debugging, never on the hot path.
  virtual absl::Status CopyToDevice(void* device, const void* host, uint64_t bytes) = 0;
  virtual absl::Status CopyFromDevice(void* host, const void* device, uint64_t bytes) = 0;

  // Stream-ordered copy / zeroing of device memory, for use inside a Work's
  // launch (the CPU device runs them at once: its launch runs on the worker).
  virtual absl::Status CopyOnStream(void* dst, const void* src, uint64_t bytes,
                                    kernels::Stream stream) = 0;
  virtual absl::Status ZeroOnStream(void* dst, uint64_t bytes, kernels::Stream stream) = 0;

  // Maps a client's buffer: a POSIX shared-memory object (CPU) or a CUDA IPC
  // memory handle (CUDA), checked against the real size of what it names.
  virtual absl::StatusOr<std::unique_ptr<MappedRegion>> MapShm(absl::string_view shm_name,
                                                               uint64_t offset_bytes,
                                                               uint64_t byte_size) = 0;
  virtual absl::StatusOr<std::unique_ptr<MappedRegion>> MapCudaIpc(absl::string_view handle,
                                                                   int device,
                                                                   uint64_t offset_bytes,
                                                                   uint64_t byte_size) = 0;
  // Opens (once; cached) a CUDA interprocess event.
  virtual absl::StatusOr<void*> OpenIpcEvent(absl::string_view handle) = 0;

  // Enqueues `work` after everything submitted before. Returns an error when
  // nothing was enqueued (then `done` never runs).
  virtual absl::Status Submit(Work work) = 0;

  // Whether doorbell counters must live in device memory (CUDA) or host
  // memory (CPU), for validation.
  virtual bool DoorbellsInDeviceMemory() const = 0;

  // What the health service reports: a device error that no later work can
  // clear, and how long the queue has been on one piece of work (a wait, or
  // a kernel) without finishing it.
  struct Health {
    absl::Status sticky_error;
    absl::Duration stalled = absl::ZeroDuration();
    std::string stalled_on;  // what it waits for, when stalled
  };
  virtual Health CheckHealth() const = 0;

  // A word that reads nonzero while the call running on the queue has
  // faulted reading a client's memory (kernels::Prerequisites::input_fault),
  // or null where that cannot happen (CUDA).
  virtual const uint32_t* input_fault_word() const { return nullptr; }

  // Unblocks the queue from waits whose WaitCancellation was raised (called
  // when the session that was to ring them has ended). The CPU device's
  // worker watches the flags itself.
  virtual void ReleaseCancelledWaits() {}

 protected:
  // Submits a Work running `launch` after everything submitted before, and
  // waits until the device has finished it. Set-up and debugging copies
  // only: never on the hot path, nor on a device thread.
  absl::Status SubmitAndWait(std::function<absl::Status(kernels::Stream)> launch) {
    absl::Notification finished;
    absl::Status result;
    Work work;
    work.launch = [&](kernels::Stream stream, Scratch&) { return launch(stream); };
    work.done = [&](absl::Status status) {
      result = status;
      finished.Notify();
    };
    absl::Status st = Submit(std::move(work));
    if (!st.ok()) return st;
    finished.WaitForNotification();
    return result;
  }
};

absl::StatusOr<std::unique_ptr<Device>> CreateCpuDevice();
// UNAVAILABLE without a CUDA build or device. `submit_spin`: how long the
// submitting thread polls an empty queue before it sleeps.
absl::StatusOr<std::unique_ptr<Device>> CreateCudaDevice(int ordinal,
                                                         absl::Duration submit_spin);

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_DEVICE_DEVICE_H_
