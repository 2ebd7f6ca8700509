// handoff_bench: what handing GPU work back and forth between two streams
// costs, with the service's doorbells (a 32-bit counter in device memory),
// in one process (two streams) or two processes (the counter shared by CUDA
// IPC, as between a scheduler and specstated).
//
//   handoff_bench [--processes=2] [--iters=200] [--model_us=50] [--work_us=10]
//
// Per iteration, side A (the scheduler) runs a kernel of model_us, rings
// "inputs ready" and waits for "done"; side B (the service) waits for
// "inputs ready", runs a kernel of work_us and rings "done". B's iterations
// are all enqueued ahead, as SubmitStep does. The baseline runs both kernels
// on A's stream. A wait is either a stream memory operation
// (cuStreamWaitValue32, polled by the GPU's front end) or a one-warp kernel
// that polls the counter; rings are cuStreamWriteValue32. The table gives the
// mean GPU time per iteration on A's stream and the cost above the baseline.
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "kernels/kda_kernels.h"
#include "tests/bench/cuda_check.h"
#include "tests/bench/spin_kernel.h"

ABSL_FLAG(int, processes, 2, "1: two streams of one process; 2: two processes (CUDA IPC)");
ABSL_FLAG(int, iters, 200, "iterations per measurement");
ABSL_FLAG(double, model_us, 50, "side A's kernel per iteration (us)");
ABSL_FLAG(double, work_us, 10, "side B's kernel per iteration (us)");

namespace specstate {
namespace bench {
namespace {

enum class WaitBy { kMemop, kKernel };
const char* Name(WaitBy w) { return w == WaitBy::kMemop ? "cuStreamWaitValue32" : "polling kernel"; }

void Wait(WaitBy by, cudaStream_t s, uint32_t* counter, uint32_t value) {
  if (by == WaitBy::kMemop) {
    WaitGeq(s, counter, value);
  } else {
    CHECK_CUDA(LaunchPollGeq(counter, value, s));
  }
}

// One scenario's instructions from A to B (two-process mode, over a pipe).
struct Order {
  int32_t wait_by;  // WaitBy, or -1: quit
  uint32_t first;   // the counter value of B's first iteration
  int32_t iters;
  // After each ring, record a blocking-sync event that a host thread waits
  // for, as specstated marks each call's end for its reaper.
  int32_t completion_events;
};

// B's side of one scenario: every iteration enqueued ahead.
void RunB(cudaStream_t s, uint32_t* counters, const Order& o, double work_us) {
  std::vector<cudaEvent_t> events(o.completion_events ? o.iters : 0);
  for (auto& e : events) {
    CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventBlockingSync));
  }
  std::atomic<int> recorded{0};
  std::thread reaper;
  if (o.completion_events) {
    reaper = std::thread([&] {
      for (int i = 0; i < o.iters; ++i) {
        while (recorded.load() <= i) std::this_thread::yield();
        CHECK_CUDA(cudaEventSynchronize(events[i]));
      }
    });
  }
  for (int i = 0; i < o.iters; ++i) {
    Wait(static_cast<WaitBy>(o.wait_by), s, counters, o.first + i);
    CHECK_CUDA(LaunchSpin(work_us, s));
    Ring(s, counters + 1, o.first + i);
    if (o.completion_events) {
      CHECK_CUDA(cudaEventRecord(events[i], s));
      recorded.store(i + 1);
    }
  }
  if (reaper.joinable()) reaper.join();
  for (auto& e : events) cudaEventDestroy(e);
}

// A's side: mean GPU time per iteration. A stall (a ring never seen) ends
// the run with a message rather than a silent hang.
template <typename Enqueue>
double MeanUs(cudaStream_t s, int iters, Enqueue enqueue) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  CHECK_CUDA(cudaEventRecord(a, s));
  for (int i = 0; i < iters; ++i) enqueue(i);
  CHECK_CUDA(cudaEventRecord(b, s));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  cudaError_t state;
  while ((state = cudaEventQuery(b)) == cudaErrorNotReady) {
    if (std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr, "stalled: the iterations did not finish within 20 s\n");
      std::exit(2);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  CHECK_CUDA(state);
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms * 1000.0 / iters;
}

int ChildMain(int orders_fd, int handle_fd, int done_fd) {
  cudaIpcMemHandle_t handle;
  if (read(handle_fd, &handle, sizeof(handle)) != sizeof(handle)) return 1;
  LoadStreamValueOps();
  void* p = nullptr;
  CHECK_CUDA(cudaIpcOpenMemHandle(&p, handle, cudaIpcMemLazyEnablePeerAccess));
  cudaStream_t s;
  CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const double work_us = absl::GetFlag(FLAGS_work_us);
  for (;;) {
    Order o;
    if (read(orders_fd, &o, sizeof(o)) != sizeof(o) || o.wait_by < 0) break;
    // Enqueueing may block once the stream's queue is full, until A rings.
    RunB(s, static_cast<uint32_t*>(p), o, work_us);
    CHECK_CUDA(cudaStreamSynchronize(s));
    const char finished = 1;
    if (write(done_fd, &finished, 1) != 1) return 1;
  }
  CHECK_CUDA(cudaIpcCloseMemHandle(p));
  return 0;
}

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  // A lazily loaded kernel's first launch may wait for the whole context,
  // whose other stream waits for a ring not yet enqueued.
  kernels::UseEagerCudaModuleLoading();
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const int processes = absl::GetFlag(FLAGS_processes);
  const int iters = absl::GetFlag(FLAGS_iters);
  const double model_us = absl::GetFlag(FLAGS_model_us);
  const double work_us = absl::GetFlag(FLAGS_work_us);
  int orders[2], handle[2], done[2];
  pid_t child = -1;
  if (processes == 2) {
    // Fork before any CUDA call: a CUDA context does not survive fork.
    if (pipe(orders) != 0 || pipe(handle) != 0 || pipe(done) != 0) return 1;
    child = fork();
    if (child == 0) std::exit(ChildMain(orders[0], handle[0], done[1]));
  }
  LoadStreamValueOps();
  uint32_t* counters = nullptr;
  CHECK_CUDA(cudaMalloc(&counters, 64));
  CHECK_CUDA(cudaMemset(counters, 0, 64));
  CHECK_CUDA(cudaDeviceSynchronize());
  if (processes == 2) {
    cudaIpcMemHandle_t h;
    CHECK_CUDA(cudaIpcGetMemHandle(&h, counters));
    if (write(handle[1], &h, sizeof(h)) != sizeof(h)) return 1;
  }
  cudaStream_t a, b;
  CHECK_CUDA(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  CHECK_CUDA(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("## handoff_bench on %s: %s, A's kernel %.0f us, B's kernel %.0f us, %d iterations\n\n",
              prop.name, processes == 2 ? "two processes (CUDA IPC)" : "two streams of one process",
              model_us, work_us, iters);

  const auto baseline = [&] {
    return MeanUs(a, iters, [&](int) {
      CHECK_CUDA(LaunchSpin(model_us, a));
      CHECK_CUDA(LaunchSpin(work_us, a));
    });
  };
  baseline();  // warm-up
  const double base = baseline();
  std::printf("| B waits by | A waits by | B's completion events | per iteration (us) | "
              "above one stream (us) |\n|---|---|---|---:|---:|\n| (one stream) | - | - | %.2f | 0 |\n",
              base);
  uint32_t next = 1;
  struct Scenario {
    WaitBy b_by, a_by;
    bool completion_events;
  };
  const Scenario scenarios[] = {{WaitBy::kMemop, WaitBy::kMemop, false},
                                {WaitBy::kMemop, WaitBy::kKernel, false},
                                {WaitBy::kKernel, WaitBy::kMemop, false},
                                {WaitBy::kKernel, WaitBy::kKernel, false},
                                {WaitBy::kMemop, WaitBy::kMemop, true}};
  for (const Scenario& sc : scenarios) {
    const WaitBy b_by = sc.b_by, a_by = sc.a_by;
    {
      double us = 0;
      for (int rep = 0; rep < 2; ++rep) {  // the first is a warm-up
        // B enqueues from its own thread (or process): its queue fills up
        // long before A has rung for the last iteration.
        const Order o{static_cast<int32_t>(b_by), next, iters, sc.completion_events};
        std::thread b_side;
        if (processes == 2) {
          if (write(orders[1], &o, sizeof(o)) != sizeof(o)) return 1;
        } else {
          b_side = std::thread([&, o] { RunB(b, counters, o, work_us); });
        }
        us = MeanUs(a, iters, [&](int i) {
          CHECK_CUDA(LaunchSpin(model_us, a));
          Ring(a, counters, next + i);
          Wait(a_by, a, counters + 1, next + i);
        });
        next += iters;
        if (processes == 2) {
          char finished;
          if (read(done[0], &finished, 1) != 1) return 1;
        } else {
          b_side.join();
          CHECK_CUDA(cudaStreamSynchronize(b));
        }
      }
      std::printf("| %s | %s | %s | %.2f | %.2f |\n", Name(b_by), Name(a_by),
                  sc.completion_events ? "yes" : "no", us, us - base);
      std::fflush(stdout);
    }
  }
  if (processes == 2) {
    const Order quit{-1, 0, 0, 0};
    if (write(orders[1], &quit, sizeof(quit)) != sizeof(quit)) return 1;
    int status = 0;
    waitpid(child, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::fprintf(stderr, "side B failed\n");
      return 1;
    }
  }
  return 0;
}

}  // namespace
}  // namespace bench
}  // namespace specstate

int main(int argc, char** argv) { return specstate::bench::Main(argc, argv); }
