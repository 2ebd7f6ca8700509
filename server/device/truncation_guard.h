// Survives a client truncating shared memory that the service has mapped.
//
// A POSIX shared-memory object that its owner shrinks (ftruncate) after the
// service mapped it makes every access past the new end raise SIGBUS, which
// kills the process. The guard, after Wayland's wl_shm, installs a SIGBUS
// handler that, for a fault inside a watched mapping, maps anonymous zero
// pages over the rest of that mapping and flags it; the faulting access then
// proceeds on the zeros. The CPU device watches every client region it
// maps; the engine fails each call that used a flagged region (DATA_LOSS,
// naming it) and drops the region. While a flagged mapping is still mapped,
// FaultWord() reads nonzero: the kernels' checks read it after loading a
// call's inputs (kernels::Prerequisites::input_fault) and write nothing.
// The pools cannot be truncated at all (a sealed memfd, cpu_device.cc).
//
// A SIGBUS outside every watched mapping goes to the handler installed
// before (or the default action: the process dies, as it would without the
// guard).
//
//   absl::Status installed = TruncationGuard::Install();
//   absl::StatusOr<int> watch = TruncationGuard::Watch(base, bytes);
//   ...                                 // a truncation no longer kills us
//   bool lost = TruncationGuard::Faulted(*watch);
//   TruncationGuard::Unwatch(*watch);   // before munmap(base, bytes)
#ifndef SPECSTATE_SERVER_DEVICE_TRUNCATION_GUARD_H_
#define SPECSTATE_SERVER_DEVICE_TRUNCATION_GUARD_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace specstate {
namespace server {

class TruncationGuard {
 public:
  // The most mappings watched at once (RESOURCE_EXHAUSTED beyond).
  static constexpr int kMaxWatched = 4096;

  // Installs the handler; idempotent.
  static absl::Status Install();

  // Watches the mapping [base, base + bytes). Returns its slot.
  static absl::StatusOr<int> Watch(void* base, uint64_t bytes);
  // Stops watching (before the mapping is unmapped).
  static void Unwatch(int slot);
  // Whether an access to the slot's mapping faulted since Watch().
  static bool Faulted(int slot);

  // Nonzero while any mapping that faulted is still watched.
  static const uint32_t* FaultWord();
};

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_DEVICE_TRUNCATION_GUARD_H_
