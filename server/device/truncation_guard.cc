#include "server/device/truncation_guard.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>

#include "absl/strings/str_cat.h"

namespace specstate {
namespace server {
namespace {

// Read by the signal handler without a lock: a slot is published by its
// `begin` (stored last, with release) and retired by clearing `begin` first.
struct Slot {
  std::atomic<uintptr_t> begin{0};
  std::atomic<uintptr_t> end{0};
  std::atomic<bool> faulted{false};
};

Slot g_slots[TruncationGuard::kMaxWatched];
std::atomic<uint32_t> g_fault_word{0};
uintptr_t g_page_size = 4096;
struct sigaction g_previous;
std::mutex g_mu;  // Watch / Unwatch / Install
bool g_installed = false;

static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t) &&
                  std::atomic<uint32_t>::is_always_lock_free,
              "the fault word is read as a plain uint32_t");

void OnSigbus(int signal, siginfo_t* info, void* context) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(info->si_addr);
  for (Slot& slot : g_slots) {
    const uintptr_t begin = slot.begin.load(std::memory_order_acquire);
    if (begin == 0 || address < begin) continue;
    const uintptr_t end = slot.end.load(std::memory_order_relaxed);
    if (address >= end) continue;
    // Zero pages over the rest of the mapping: the access, retried on
    // return, reads (or writes) them. mmap is a plain system call here, as
    // in libwayland-server's handler for the same purpose.
    const uintptr_t page = address & ~(g_page_size - 1);
    void* mapped = mmap(reinterpret_cast<void*>(page), end - page, PROT_READ | PROT_WRITE,
                        MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapped == MAP_FAILED) break;
    if (!slot.faulted.exchange(true)) g_fault_word.fetch_add(1);
    return;
  }
  // Not a watched mapping: what would have happened without the guard.
  sigaction(SIGBUS, &g_previous, nullptr);
  (void)signal;
  (void)context;
}

}  // namespace

absl::Status TruncationGuard::Install() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_installed) return absl::OkStatus();
  const long page = sysconf(_SC_PAGESIZE);
  if (page > 0) g_page_size = static_cast<uintptr_t>(page);
  struct sigaction action;
  std::memset(&action, 0, sizeof(action));
  action.sa_sigaction = OnSigbus;
  action.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&action.sa_mask);
  if (sigaction(SIGBUS, &action, &g_previous) != 0) {
    return absl::InternalError(absl::StrCat("sigaction(SIGBUS): ", std::strerror(errno)));
  }
  g_installed = true;
  return absl::OkStatus();
}

absl::StatusOr<int> TruncationGuard::Watch(void* base, uint64_t bytes) {
  if (base == nullptr || bytes == 0) return absl::InvalidArgumentError("an empty mapping");
  std::lock_guard<std::mutex> lock(g_mu);
  for (int i = 0; i < kMaxWatched; ++i) {
    Slot& slot = g_slots[i];
    if (slot.begin.load(std::memory_order_relaxed) != 0) continue;
    slot.faulted.store(false, std::memory_order_relaxed);
    slot.end.store(reinterpret_cast<uintptr_t>(base) + bytes, std::memory_order_relaxed);
    slot.begin.store(reinterpret_cast<uintptr_t>(base), std::memory_order_release);
    return i;
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("the service maps ", kMaxWatched, " shared-memory regions already"));
}

void TruncationGuard::Unwatch(int slot_index) {
  if (slot_index < 0 || slot_index >= kMaxWatched) return;
  std::lock_guard<std::mutex> lock(g_mu);
  Slot& slot = g_slots[slot_index];
  slot.begin.store(0, std::memory_order_release);
  if (slot.faulted.exchange(false)) g_fault_word.fetch_sub(1);
}

bool TruncationGuard::Faulted(int slot_index) {
  if (slot_index < 0 || slot_index >= kMaxWatched) return false;
  return g_slots[slot_index].faulted.load(std::memory_order_acquire);
}

const uint32_t* TruncationGuard::FaultWord() {
  return reinterpret_cast<const uint32_t*>(&g_fault_word);
}

}  // namespace server
}  // namespace specstate
