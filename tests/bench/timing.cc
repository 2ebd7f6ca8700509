#include "tests/bench/timing.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "kernels/numeric.h"

namespace specstate {
namespace bench {

void CheckOk(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

void* DeviceAlloc(size_t bytes) {
  void* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, bytes));
  return p;
}

void FillRandom(void* dst, size_t count, bool bf16, float lo, float hi, std::mt19937& rng) {
  const size_t elem = bf16 ? 2 : 4;
  std::uniform_real_distribution<float> dist(lo, hi);
  const size_t chunk = std::min(count, (size_t{8} << 20) / elem);
  std::vector<char> host(chunk * elem);
  for (size_t i = 0; i < chunk; ++i) {
    const float x = dist(rng);
    if (bf16) {
      const uint16_t bits = FromFloat<BFloat16>(x).bits;
      std::memcpy(host.data() + i * 2, &bits, 2);
    } else {
      std::memcpy(host.data() + i * 4, &x, 4);
    }
  }
  CHECK_CUDA(cudaMemcpy(dst, host.data(), host.size(), cudaMemcpyHostToDevice));
  for (size_t done = chunk; done < count; done += chunk) {
    const size_t n = std::min(chunk, count - done);
    CHECK_CUDA(
        cudaMemcpy(static_cast<char*>(dst) + done * elem, dst, n * elem, cudaMemcpyDeviceToDevice));
  }
}

void* L2Flush() {
  static void* const buffer = DeviceAlloc(size_t{256} << 20);
  return buffer;
}

namespace {

// The median of `iters` runs of `run`, each between two events on `stream`.
double MedianUs(cudaStream_t stream, int iters, const std::function<void()>& run,
                const std::function<void()>& before) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    if (before) before();
    CHECK_CUDA(cudaEventRecord(a, stream));
    run();
    CHECK_CUDA(cudaEventRecord(b, stream));
    CHECK_CUDA(cudaEventSynchronize(b));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CHECK_CUDA(cudaEventDestroy(a));
  CHECK_CUDA(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2] * 1000.0;
}

}  // namespace

double TimeLaunched(cudaStream_t stream, int iters, const std::function<void()>& fn,
                    const std::function<void()>& before, int warmups) {
  for (int i = 0; i < warmups; ++i) {
    if (before) before();
    fn();
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  return MedianUs(stream, iters, fn, before);
}

double TimeGraph(cudaStream_t stream, int iters, const std::function<void()>& fn,
                 const std::function<void()>& before, int warmups) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  if (before) before();
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  fn();
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  const auto replay = [&] { CHECK_CUDA(cudaGraphLaunch(exec, stream)); };
  for (int i = 0; i < warmups; ++i) {
    if (before) before();
    replay();
  }
  const double us = MedianUs(stream, iters, replay, before);
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  return us;
}

namespace {

std::function<void()> BeforeRun(cudaStream_t stream, bool cold,
                                const std::function<void()>& prepare) {
  return [stream, cold, prepare] {
    if (prepare) prepare();
    if (cold) CHECK_CUDA(cudaMemsetAsync(L2Flush(), 0x3f, size_t{256} << 20, stream));
  };
}

}  // namespace

Timing Time(cudaStream_t stream, int iters, const std::function<void()>& fn, bool cold,
            const std::function<void()>& prepare) {
  const std::function<void()> before = BeforeRun(stream, cold, prepare);
  Timing t;
  t.launched_us = TimeLaunched(stream, iters, fn, before, 3);
  t.graph_us = TimeGraph(stream, iters, fn, before, 3);
  return t;
}

double TimeGraphOnly(cudaStream_t stream, int iters, const std::function<void()>& fn, bool cold,
                     const std::function<void()>& prepare) {
  return TimeGraph(stream, iters, fn, BeforeRun(stream, cold, prepare), 2);
}

double CopyBandwidth(cudaStream_t stream, int iters) {
  const size_t bytes = size_t{2} << 30;
  void* a = DeviceAlloc(bytes);
  void* b = DeviceAlloc(bytes);
  CHECK_CUDA(cudaMemset(a, 1, bytes));
  const double us = TimeLaunched(
      stream, iters,
      [&] { CHECK_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream)); }, nullptr,
      2);
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaFree(b));
  return 2.0 * bytes / (us * 1e-6);
}

}  // namespace bench
}  // namespace specstate
