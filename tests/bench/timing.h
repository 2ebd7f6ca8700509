// What kda_bench and fast_bench share: device buffers filled with random
// values, the timing loop (CUDA events around launched runs and around
// replays of a CUDA graph of one run, the median of `iters`), a cold L2
// (a buffer larger than L2 written before a run, outside the timed
// window), and the device-to-device copy bandwidth the tables compare with.
//
//   const double copy_bps = bench::CopyBandwidth(stream, iters);
//   const bench::Timing t = bench::Time(stream, iters, [&] { launch(); }, /*cold=*/true);
//   std::printf("%.1f us (graph %.1f us)\n", t.launched_us, t.graph_us);
//
// Every CUDA error ends the run (CHECK_CUDA).
#ifndef SPECSTATE_TESTS_BENCH_TIMING_H_
#define SPECSTATE_TESTS_BENCH_TIMING_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <functional>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "tests/bench/cuda_check.h"

namespace specstate {
namespace bench {

// Ends the run with `what` and the status when it is not OK.
void CheckOk(const absl::Status& s, const char* what);

// cudaMalloc that ends the run on failure.
void* DeviceAlloc(size_t bytes);

// A device copy of `host` (16 bytes of slack after it, for vector loads).
template <typename T>
T* Upload(const std::vector<T>& host) {
  T* p = static_cast<T*>(DeviceAlloc(host.size() * sizeof(T) + 16));
  CHECK_CUDA(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

// `count` values uniform in [lo, hi), as bf16 or fp32: up to 8 MiB generated
// on the host, larger buffers tiled with device copies of that (gigabytes
// of pools would take minutes to generate).
void FillRandom(void* dst, size_t count, bool bf16, float lo, float hi, std::mt19937& rng);

// A buffer larger than the H200's 60 MiB L2: a cold-L2 run writes it first.
void* L2Flush();

// Median microseconds of `iters` runs of `fn` on `stream`, launched and
// replayed from a CUDA graph of one run.
struct Timing {
  double launched_us = 0;
  double graph_us = 0;
  double best() const { return launched_us < graph_us ? launched_us : graph_us; }
};

// `before` (optional) runs on the stream before every run, outside the
// timed window (what a run consumes is put back; a cold L2 is made there).
// `warmups` untimed runs come first.
double TimeLaunched(cudaStream_t stream, int iters, const std::function<void()>& fn,
                    const std::function<void()>& before, int warmups);
double TimeGraph(cudaStream_t stream, int iters, const std::function<void()>& fn,
                 const std::function<void()>& before, int warmups);

// Both, three warmups each; `cold`: L2 flushed before each run, after
// `prepare` (optional, as `before` above).
Timing Time(cudaStream_t stream, int iters, const std::function<void()>& fn, bool cold = false,
            const std::function<void()>& prepare = nullptr);

// Graph replays only, two warmups (fast_bench's tables).
double TimeGraphOnly(cudaStream_t stream, int iters, const std::function<void()>& fn, bool cold,
                     const std::function<void()>& prepare = nullptr);

// Device-to-device copy bandwidth (bytes read + written per second) of a
// launched 2 GiB copy: a graph's copy node was timed far slower on the H200
// (2773 GB/s against about 4.2 TB/s, docs/results/fast_cuda_h200.md).
double CopyBandwidth(cudaStream_t stream, int iters);

}  // namespace bench
}  // namespace specstate

#endif  // SPECSTATE_TESTS_BENCH_TIMING_H_
