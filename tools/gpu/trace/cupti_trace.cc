// A GPU timeline of any CUDA process, for finding where time goes between
// the scheduler's and the service's streams (no Nsight on the GPU machine).
// Loaded by the CUDA driver through its injection hook:
//
//   CUDA_INJECTION64_PATH=libcupti_trace.so SPECSTATE_CUPTI_OUT=/tmp/x.csv cmd
//
// It records every kernel, memcpy and memset with its GPU start and end (ns,
// the GPU's global timer, comparable across processes) and writes a CSV:
// kind,pid,stream,start_ns,end_ns,name. Records are flushed every 100 ms and
// at exit. tools/gpu/trace/timeline.py summarises such files.
#include <cupti.h>
#include <cxxabi.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace {

constexpr size_t kBufferBytes = 8 << 20;
std::FILE* out = nullptr;
std::mutex out_mu;

void CUPTIAPI BufferRequested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

void CUPTIAPI BufferCompleted(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  const int pid = getpid();
  std::lock_guard<std::mutex> lock(out_mu);
  CUpti_Activity* record = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    switch (record->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
      case CUPTI_ACTIVITY_KIND_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
        int demangled = -1;
        char* name = abi::__cxa_demangle(k->name, nullptr, nullptr, &demangled);
        std::fprintf(out, "kernel,%d,%u,%llu,%llu,%s\n", pid, k->streamId,
                     static_cast<unsigned long long>(k->start),
                     static_cast<unsigned long long>(k->end),
                     demangled == 0 ? name : k->name);
        std::free(name);
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
        std::fprintf(out, "memcpy,%d,%u,%llu,%llu,%llu bytes kind %d\n", pid, m->streamId,
                     static_cast<unsigned long long>(m->start),
                     static_cast<unsigned long long>(m->end),
                     static_cast<unsigned long long>(m->bytes), m->copyKind);
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
        std::fprintf(out, "memset,%d,%u,%llu,%llu,%llu bytes\n", pid, m->streamId,
                     static_cast<unsigned long long>(m->start),
                     static_cast<unsigned long long>(m->end),
                     static_cast<unsigned long long>(m->bytes));
        break;
      }
      default:
        break;
    }
  }
  std::fflush(out);
  std::free(buffer);
}

void FlushAtExit() { cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED); }

}  // namespace

extern "C" int InitializeInjection(void) {
  const char* path = std::getenv("SPECSTATE_CUPTI_OUT");
  char name[256];
  if (path == nullptr) {
    std::snprintf(name, sizeof(name), "/tmp/cupti_trace.%d.csv", getpid());
    path = name;
  }
  out = std::fopen(path, "w");
  if (out == nullptr) return 0;
  if (cuptiActivityRegisterCallbacks(BufferRequested, BufferCompleted) != CUPTI_SUCCESS ||
      cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS ||
      cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY) != CUPTI_SUCCESS ||
      cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET) != CUPTI_SUCCESS) {
    std::fprintf(stderr, "cupti_trace: cannot enable activity tracing\n");
    return 0;
  }
  cuptiActivityFlushPeriod(100);
  std::atexit(FlushAtExit);
  return 1;
}
