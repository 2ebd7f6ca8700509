// service_bench: what going through specstated costs, against a running
// service (start it first; see docs/benchmarks.md for the layout used).
//
//   service_bench --server=unix:///tmp/specstate.sock [--iters=200] [--steps=30]
//
// 1. The floor: Ping, an echo served by the same callback threads.
// 2. Round trips (p50, p99) of Verify at N=1 and N=max_rows, and Commit,
//    SYNC and ASYNC (ASYNC returns once the work is enqueued); Verify with
//    its tensors sent and with them bound once (BindVerifyInputs). The ASYNC
//    Verify at N=1 against the echo, alternately, both ways.
// 3. A simulated decode step over every layer: a GPU kernel standing in for
//    the rest of the model (--model_us_small at N=1, --model_us_large at
//    N=max_rows) then Verify, per layer, then Commit; through the service (all
//    of a step's calls sent ahead, ordered by doorbells on both streams; the
//    tensors bound, and sent) against the same loop calling the kernels in
//    this process.
// With --breakdown, each of them broken down further (see the flag). 1 and 2
// run on either backend; 3 needs the CUDA backend (GPU streams on both
// sides).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "client/lib/client.h"
#include "kernels/kda_kernels.h"
#include "kernels/numeric.h"
#include "tests/bench/cuda_check.h"
#include "tests/bench/spin_kernel.h"

ABSL_FLAG(std::string, server, "unix:///tmp/specstate.sock", "the running service");
ABSL_FLAG(int, iters, 200, "round trips per latency measurement");
ABSL_FLAG(bool, fast_mutexes, true,
          "turn off Abseil's mutex deadlock detector in this process (as a scheduler should)");
ABSL_FLAG(int, paired_iters, 2000,
          "pairs per alternating measurement against the echo (its noise is large)");
ABSL_FLAG(int, steps, 30, "decode steps per step measurement");
ABSL_FLAG(double, model_us_small, 50, "the model's GPU time per layer at N=1 (us)");
ABSL_FLAG(bool, breakdown, false,
          "also break the N=1 costs down: the ASYNC Verify against the echo by variant; "
          "the step without its Commit, with a 3x longer model kernel, and in-process on a "
          "second stream or with one of the service's additions at a time");
ABSL_FLAG(double, model_us_large, 300, "the model's GPU time per layer at N=max_rows (us)");

namespace specstate {
namespace {

using client::Client;
using client::Session;
using Clock = std::chrono::steady_clock;

template <typename T>
T Check(absl::StatusOr<T> v, const char* what) {
  if (!v.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, v.status().ToString().c_str());
    std::exit(1);
  }
  return *std::move(v);
}

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

struct Percentiles {
  double p50, p99;
};

Percentiles Of(std::vector<double> us) {
  std::sort(us.begin(), us.end());
  return {us[us.size() / 2], us[std::min(us.size() - 1, size_t(us.size() * 0.99))]};
}

template <typename Fn>
Percentiles TimeRpc(int iters, Fn fn) {
  for (int i = 0; i < 10; ++i) fn();
  std::vector<double> us;
  for (int i = 0; i < iters; ++i) {
    const auto t0 = Clock::now();
    fn();
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  return Of(us);
}

// Two calls measured alternately (a, b, a, b, ...), so that both see the
// same machine: the p50 of each and the p50 of the per-pair difference b - a.
struct Paired {
  Percentiles a, b;
  double diff_p50;
};

template <typename A, typename B>
Paired TimeInterleaved(int iters, A a, B b) {
  for (int i = 0; i < 10; ++i) {
    a();
    b();
  }
  std::vector<double> ta, tb, diff;
  for (int i = 0; i < iters; ++i) {
    auto t0 = Clock::now();
    a();
    auto t1 = Clock::now();
    b();
    auto t2 = Clock::now();
    ta.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    tb.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
    diff.push_back(tb.back() - ta.back());
  }
  std::sort(diff.begin(), diff.end());
  return {Of(ta), Of(tb), diff[diff.size() / 2]};
}

// The median of the calls of `method` the service served between two
// GetStats snapshots: its own handling time, from the handler's entry to its
// answer (linear within the histogram's bucket, so rough).
double ServedMedianUs(const v1::Stats& before, const v1::Stats& after, const std::string& method) {
  const auto find = [&](const v1::Stats& s) -> const v1::LatencyHistogram* {
    for (const v1::RpcStats& r : s.rpcs()) {
      if (r.method() == method) return &r.latency();
    }
    return nullptr;
  };
  const v1::LatencyHistogram* a = find(before);
  const v1::LatencyHistogram* b = find(after);
  if (b == nullptr) return 0;
  std::vector<uint64_t> counts(b->counts().begin(), b->counts().end());
  if (a != nullptr) {
    for (int i = 0; i < a->counts_size() && i < int(counts.size()); ++i) counts[i] -= a->counts(i);
  }
  uint64_t total = 0;
  for (uint64_t c : counts) total += c;
  if (total == 0) return 0;
  const double half = total / 2.0;
  double seen = 0, lower = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    const double upper = i < size_t(b->bounds_us_size()) ? b->bounds_us(i) : lower * 2;
    if (seen + counts[i] >= half) return lower + (upper - lower) * (half - seen) / counts[i];
    seen += counts[i];
    lower = upper;
  }
  return lower;
}

void FillBf16(client::SharedMemory& memory, void* dst, size_t count, std::mt19937& rng) {
  std::uniform_real_distribution<float> d(-1, 1);
  std::vector<uint16_t> h(count);
  for (auto& x : h) x = FromFloat<BFloat16>(d(rng)).bits;
  Check(memory.CopyIn(dst, h.data(), count * 2), "CopyIn");
}

// The scheduler's side of one layout: activations per layer, metadata,
// doorbells; registered with the service, and usable in-process too.
struct Scheduler {
  v1::Layout layout;
  int L, H, K, Q, N;
  int64_t HK, T;
  std::unique_ptr<client::SharedMemory> memory;
  std::vector<std::unique_ptr<client::SharedBuffer>> acts;  // per layer: q|k|v|g|o, beta
  std::unique_ptr<client::SharedBuffer> meta;               // qsl, checkpoints, accepted, doorbells
  std::string meta_name;
  std::vector<std::string> names;  // every region, to unregister before the memory goes
  int32_t* qsl;
  int32_t* checkpoints;
  int32_t* accepted;
  uint32_t* doors;  // [2 * L + 2]
};

void* Act(const Scheduler& s, int layer, int which) {  // 0 q, 1 k, 2 v, 3 g, 4 o, 5 beta
  return static_cast<char*>(s.acts[layer]->data()) + which * s.T * s.HK * 2;
}

Scheduler MakeScheduler(Client& c, Session& session, int N, std::mt19937& rng) {
  Scheduler s;
  s.layout = Check(c.GetLayout(), "GetLayout");
  s.L = s.layout.num_layers();
  s.H = s.layout.num_heads();
  s.K = s.layout.head_dim();
  s.Q = s.layout.num_spec() + 1;
  s.N = N;
  s.HK = int64_t{s.H} * s.K;
  s.T = int64_t{N} * s.Q;
  s.memory = Check(client::SharedMemory::Create(s.layout.backend(), s.layout.device()), "memory");
  for (int l = 0; l < s.L; ++l) {
    s.acts.push_back(Check(s.memory->Allocate(5 * s.T * s.HK * 2 + s.T * s.H * 2 + 64), "alloc"));
    FillBf16(*s.memory, s.acts.back()->data(), 5 * s.T * s.HK + s.T * s.H, rng);
    s.names.push_back(Check(session.RegisterBuffer(*s.acts.back()), "RegisterBuffer"));
  }
  const int ints = 3 * N + 1 + 2 * s.L + 2 + 64;
  s.meta = Check(s.memory->Allocate(ints * 4), "alloc");
  s.meta_name = Check(session.RegisterBuffer(*s.meta), "RegisterBuffer");
  s.names.push_back(s.meta_name);
  s.qsl = static_cast<int32_t*>(s.meta->data());
  s.checkpoints = s.qsl + N + 1;
  s.accepted = s.checkpoints + N;
  s.doors = reinterpret_cast<uint32_t*>(s.accepted + N);
  std::vector<int32_t> host(3 * N + 1, 0);
  std::uniform_int_distribution<int> acc(1, s.Q);
  for (int i = 0; i < N; ++i) {
    host[i + 1] = host[i] + s.Q;
    host[N + 1 + i] = 1 + i;
    host[2 * N + 1 + i] = acc(rng);
  }
  Check(s.memory->CopyIn(s.meta->data(), host.data(), host.size() * 4), "CopyIn");
  return s;
}

v1::VerifyRequest VerifyRequest(const Scheduler& s, Session& session, uint64_t step, int layer) {
  v1::VerifyRequest v;
  v.set_step(step);
  v.set_layer(layer);
  v.set_num_rows(s.N);
  *v.mutable_query_start_loc() = Check(session.Index(s.qsl, {s.N + 1}), "Index");
  *v.mutable_state_indices() = Check(session.Index(s.checkpoints, {s.N}), "Index");
  const std::vector<int64_t> shape = {s.T, s.H, s.K};
  *v.mutable_q() = Check(session.Tensor(Act(s, layer, 0), DType::kBFloat16, shape), "Tensor");
  *v.mutable_k() = Check(session.Tensor(Act(s, layer, 1), DType::kBFloat16, shape), "Tensor");
  *v.mutable_v() = Check(session.Tensor(Act(s, layer, 2), DType::kBFloat16, shape), "Tensor");
  *v.mutable_g() = Check(session.Tensor(Act(s, layer, 3), DType::kBFloat16, shape), "Tensor");
  *v.mutable_o() = Check(session.Tensor(Act(s, layer, 4), DType::kBFloat16, shape), "Tensor");
  *v.mutable_beta() = Check(session.Tensor(Act(s, layer, 5), DType::kBFloat16, {s.T, s.H}), "Tensor");
  return v;
}

// Binds every layer's tensors once (BindVerifyInputs), as a scheduler whose
// buffers stay put does.
void BindLayers(const Scheduler& s, Session& session) {
  for (int l = 0; l < s.L; ++l) {
    const v1::VerifyRequest v = VerifyRequest(s, session, 0, l);
    v1::BindVerifyInputsRequest b;
    b.set_layer(l);
    *b.mutable_q() = v.q();
    *b.mutable_k() = v.k();
    *b.mutable_v() = v.v();
    *b.mutable_g() = v.g();
    *b.mutable_beta() = v.beta();
    *b.mutable_o() = v.o();
    *b.mutable_query_start_loc() = v.query_start_loc();
    *b.mutable_state_indices() = v.state_indices();
    Check(session.BindVerifyInputs(b), "BindVerifyInputs");
  }
}

// A Verify of the layer's bound tensors: only the counts travel.
v1::VerifyRequest BoundVerifyRequest(const Scheduler& s, uint64_t step, int layer) {
  v1::VerifyRequest v;
  v.set_step(step);
  v.set_layer(layer);
  v.set_num_rows(s.N);
  v.set_bound_inputs(true);
  v.set_num_tokens(s.T);
  return v;
}

v1::CommitRequest CommitRequest(const Scheduler& s, Session& session, uint64_t step) {
  v1::CommitRequest c;
  c.set_step(step);
  *c.mutable_num_accepted() = Check(session.Index(s.accepted, {s.N}), "Index");
  return c;
}

v1::Doorbell Door(const Scheduler& s, int index, uint32_t value) {
  v1::Doorbell d;
  d.set_region(s.meta_name);
  d.set_offset_bytes(reinterpret_cast<const char*>(s.doors + index) -
                     static_cast<const char*>(s.meta->data()));
  d.set_value(value);
  return d;
}

// What the service adds to each call beyond the kernels, added one at a
// time to the in-process loop to see what each costs.
struct ServiceExtras {
  bool status_mirror = false;  // the check kernel's status mirror (pinned host memory)
  bool prerequisites = false;  // the check kernel reads the step's earlier statuses
  bool completion_event = false;  // an event recorded after each call
};

// The service's pools and parameters as this process's kernels see them.
struct InProcess {
  std::vector<kernels::CommitLayer> layers;
  kernels::CommitLayer* device_layers;
  void* workspace;
  size_t workspace_bytes;
  kernels::DeviceStatus* status;
  kernels::DeviceStatus* statuses;       // [L + 2], zero: the step's earlier calls passed
  kernels::DeviceStatus* mirror;         // pinned host memory
  // The step's copy of its indices, as the service keeps one per step: the
  // first layer's Verify writes it, the later ones compare against it.
  int32_t* snapshot_query_start_loc;     // [max_rows + 1]
  int32_t* snapshot_state_indices;       // [max_rows]
  cudaEvent_t completion;
};

InProcess MakeInProcess(const Scheduler& s, std::mt19937& rng) {
  InProcess p;
  const int64_t B = s.layout.num_blocks();
  const int W = s.layout.conv_width();
  for (int l = 0; l < s.L; ++l) {
    kernels::CommitLayer layer;
    void* state = nullptr;
    CHECK_CUDA(cudaMalloc(&state, B * s.HK * s.K * 4));
    CHECK_CUDA(cudaMemset(state, 0, B * s.HK * s.K * 4));
    layer.state = {state, B, s.HK * s.K};
    void* conv = nullptr;
    CHECK_CUDA(cudaMalloc(&conv, B * int64_t{s.layout.conv_dim()} * W * 2));
    layer.conv = {conv, B, int64_t{s.layout.conv_dim()} * W, W, 1, s.layout.conv_dim(), W};
    float* params = nullptr;
    CHECK_CUDA(cudaMalloc(&params, (s.H + s.HK) * 4));
    std::vector<float> h(s.H + s.HK);
    std::uniform_real_distribution<float> d(-1, 0.5);
    for (auto& x : h) x = d(rng);
    CHECK_CUDA(cudaMemcpy(params, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    layer.params = {params, params + s.H};
    void *kv, *g, *beta;
    const int64_t tokens = int64_t{s.layout.max_rows()} * s.Q;
    CHECK_CUDA(cudaMalloc(&kv, tokens * 2 * s.HK * 2));
    CHECK_CUDA(cudaMalloc(&g, tokens * s.HK * 2));
    CHECK_CUDA(cudaMalloc(&beta, tokens * s.H * 2 + 16));
    layer.records = {kv, g, beta, s.layout.max_rows(), s.Q};
    p.layers.push_back(layer);
  }
  CHECK_CUDA(cudaMalloc(&p.device_layers, s.L * sizeof(kernels::CommitLayer)));
  CHECK_CUDA(cudaMemcpy(p.device_layers, p.layers.data(), s.L * sizeof(kernels::CommitLayer),
                        cudaMemcpyHostToDevice));
  p.workspace_bytes = kernels::CommitWorkspaceBytes(s.layout.max_rows(), s.Q, B);
  CHECK_CUDA(cudaMalloc(&p.workspace, p.workspace_bytes));
  CHECK_CUDA(cudaMemset(p.workspace, 0, p.workspace_bytes));
  CHECK_CUDA(cudaMalloc(&p.status, sizeof(kernels::DeviceStatus)));
  CHECK_CUDA(cudaMalloc(&p.statuses, (s.L + 2) * sizeof(kernels::DeviceStatus)));
  CHECK_CUDA(cudaMemset(p.statuses, 0, (s.L + 2) * sizeof(kernels::DeviceStatus)));
  CHECK_CUDA(cudaHostAlloc(&p.mirror, sizeof(kernels::DeviceStatus), cudaHostAllocDefault));
  CHECK_CUDA(cudaMalloc(&p.snapshot_query_start_loc, (s.layout.max_rows() + 1) * sizeof(int32_t)));
  CHECK_CUDA(cudaMalloc(&p.snapshot_state_indices, s.layout.max_rows() * sizeof(int32_t)));
  CHECK_CUDA(cudaEventCreateWithFlags(&p.completion, cudaEventDisableTiming));
  return p;
}

kernels::KdaShape BenchShape(const Scheduler& s) {
  return {s.H, s.K, DType::kBFloat16, DType::kFloat32, s.layout.lower_bound()};
}

// Layer l's Verify of the step on this process's own pools.
kernels::VerifyArgs InProcessVerifyArgs(const Scheduler& s, const InProcess& p, int l) {
  kernels::VerifyArgs a;
  a.shape = BenchShape(s);
  a.q = {Act(s, l, 0), s.HK};
  a.k = {Act(s, l, 1), s.HK};
  a.v = {Act(s, l, 2), s.HK};
  a.g = {Act(s, l, 3), s.HK};
  a.out = Act(s, l, 4);
  a.beta = {Act(s, l, 5), s.H};
  a.num_tokens = s.T;
  a.state = p.layers[l].state;
  a.params = p.layers[l].params;
  a.records = p.layers[l].records;
  a.num_rows = s.N;
  a.query_start_loc = s.qsl;
  a.state_indices = {s.checkpoints, 1, 1};
  a.status = p.status;
  if (l == 0) {
    a.snapshot_query_start_loc = p.snapshot_query_start_loc;
    a.snapshot_state_indices = p.snapshot_state_indices;
  } else {
    a.expected_query_start_loc = p.snapshot_query_start_loc;
    a.expected_state_indices = p.snapshot_state_indices;
  }
  return a;
}

void InProcessStep(const Scheduler& s, const InProcess& p, double model_us, bool commit,
                   cudaStream_t stream, ServiceExtras extras = {}) {
  const kernels::KdaKernels& k = *kernels::CudaKdaKernels().value();
  const kernels::KdaShape shape = BenchShape(s);
  for (int l = 0; l < s.L; ++l) {
    CHECK_CUDA(bench::LaunchSpin(model_us, stream));
    kernels::VerifyArgs a = InProcessVerifyArgs(s, p, l);
    if (extras.status_mirror) a.status_mirror = p.mirror;
    if (extras.prerequisites) a.prerequisites = kernels::Prerequisites{p.statuses, s.L, nullptr, 0};
    Check(k.Verify(a, stream), "Verify");
    if (extras.completion_event) CHECK_CUDA(cudaEventRecord(p.completion, stream));
  }
  if (!commit) return;
  kernels::CommitArgs c;
  c.shape = shape;
  c.spec_query_len = s.Q;
  c.num_layers = s.L;
  c.layers = p.layers.data();
  c.device_layers = p.device_layers;
  c.num_rows = s.N;
  c.query_start_loc = s.qsl;
  c.state_indices = {s.checkpoints, 1, 1};
  c.batch = s.N;
  c.num_accepted = s.accepted;
  c.workspace = p.workspace;
  c.workspace_bytes = p.workspace_bytes;
  c.status = p.status;
  Check(k.Commit(c, stream), "Commit");
}

// The in-process Verify calls of one step on a second stream, each handed
// over and back by doorbells as through the service.
void InProcessHandoffStep(const Scheduler& s, const InProcess& p, double model_us,
                          cudaStream_t stream, cudaStream_t verifier, uint32_t* counters,
                          uint32_t& ring) {
  const kernels::KdaKernels& k = *kernels::CudaKdaKernels().value();
  for (int l = 0; l < s.L; ++l) {
    CHECK_CUDA(bench::LaunchSpin(model_us, stream));
    ++ring;
    bench::Ring(stream, counters, ring);
    bench::WaitGeq(verifier, counters, ring);
    kernels::VerifyArgs a = InProcessVerifyArgs(s, p, l);
    Check(k.Verify(a, verifier), "Verify");
    bench::Ring(verifier, counters + 1, ring);
    bench::WaitGeq(stream, counters + 1, ring);
  }
}

// The client's stream of one step through the service: per layer the model
// kernel, ring "inputs of layer l ready", wait "layer l verified"; then ring
// "accepted counts ready" and wait "committed".
void ServiceStepStream(const Scheduler& s, uint32_t step, double model_us, bool commit,
                       cudaStream_t stream) {
  for (int l = 0; l < s.L; ++l) {
    CHECK_CUDA(bench::LaunchSpin(model_us, stream));
    bench::Ring(stream, s.doors + 2 * l, step);
    bench::WaitGeq(stream, s.doors + 2 * l + 1, step);
  }
  if (!commit) return;
  bench::Ring(stream, s.doors + 2 * s.L, step);
  bench::WaitGeq(stream, s.doors + 2 * s.L + 1, step);
}

// All of a step's calls, sent before its GPU work reaches them, in one
// SubmitStep round trip.
// One step's calls in one SubmitStep: each layer's Verify (its tensors sent,
// or bound once by BindLayers) and the Commit, ordered by doorbells.
void SendStepCalls(const Scheduler& s, Session& session, uint64_t step_id, uint32_t step,
                   bool commit, bool bound) {
  v1::SubmitStepRequest batch;
  for (int l = 0; l < s.L; ++l) {
    v1::VerifyRequest v =
        bound ? BoundVerifyRequest(s, step_id, l) : VerifyRequest(s, session, step_id, l);
    v.set_ordering(v1::ASYNC);
    *v.mutable_wait()->mutable_doorbell() = Door(s, 2 * l, step);
    *v.mutable_signal()->mutable_doorbell() = Door(s, 2 * l + 1, step);
    *batch.add_verifies() = std::move(v);
  }
  if (commit) {
    v1::CommitRequest c = CommitRequest(s, session, step_id);
    c.set_ordering(v1::ASYNC);
    *c.mutable_wait()->mutable_doorbell() = Door(s, 2 * s.L, step);
    *c.mutable_signal()->mutable_doorbell() = Door(s, 2 * s.L + 1, step);
    *batch.mutable_commit() = std::move(c);
  }
  Check(session.SubmitStep(batch), "SubmitStep");
}

struct StepTiming {
  double gpu_us;        // mean GPU time per step
  Percentiles send_us;  // the host's before_step (through the service: SubmitStep)
};

StepTiming TimeSteps(cudaStream_t stream, int steps, const std::function<void(int)>& enqueue_step,
                     const std::function<void(int)>& before_step) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  std::vector<cudaEvent_t> done(steps);
  for (auto& e : done) CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  for (int i = 0; i < 3; ++i) {  // warm-up
    before_step(i);
    enqueue_step(i);
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<double> send;
  const auto send_calls = [&](int i) {
    const auto t0 = Clock::now();
    before_step(3 + i);
    send.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  };
  // The first step's calls go out before the clock starts, as a running
  // decode loop sends each step's calls while the GPU runs the step before
  // (as every later step here does): otherwise the GPU would sit idle for
  // one round trip inside the measured time.
  send_calls(0);
  CHECK_CUDA(cudaEventRecord(a, stream));
  for (int i = 0; i < steps; ++i) {
    // Stay at most two steps ahead of the GPU.
    if (i >= 2) CHECK_CUDA(cudaEventSynchronize(done[i - 2]));
    if (i > 0) send_calls(i);
    enqueue_step(3 + i);
    CHECK_CUDA(cudaEventRecord(done[i], stream));
  }
  CHECK_CUDA(cudaEventRecord(b, stream));
  CHECK_CUDA(cudaEventSynchronize(b));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
  for (auto& e : done) cudaEventDestroy(e);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return {ms * 1000.0 / steps, Of(send)};
}

double MeanStepUs(cudaStream_t stream, int steps, const std::function<void(int)>& enqueue_step,
                  const std::function<void(int)>& before_step) {
  return TimeSteps(stream, steps, enqueue_step, before_step).gpu_us;
}

int Main() {
  auto c = Check(Client::Connect(absl::GetFlag(FLAGS_server)), "Connect");
  const v1::Layout layout = Check(c->GetLayout(), "GetLayout");
  // On the CPU backend only the round trips (the step needs GPU streams).
  const bool cuda = layout.backend() == v1::CUDA;
  if (cuda) bench::LoadStreamValueOps();
  auto session = Check(c->OpenSession("service_bench", true), "OpenSession");
  const int iters = absl::GetFlag(FLAGS_iters);
  std::mt19937 rng(5);
  std::string device = "the CPU backend";
  if (cuda) {
    cudaDeviceProp prop;
    CHECK_CUDA(cudaGetDeviceProperties(&prop, layout.device()));
    device = prop.name;
  }
  std::printf("## service_bench on %s, %s, %d layers of %d x %d, Q=%d, commit mode %s\n\n",
              device.c_str(), c->address().c_str(), layout.num_layers(), layout.num_heads(),
              layout.head_dim(), layout.num_spec() + 1,
              v1::CommitMode_Name(layout.commit_mode()).c_str());

  // Parameters so Verify may run.
  for (int l = 0; l < layout.num_layers(); ++l) {
    v1::LoadLayerParamsRequest p;
    p.set_layer(l);
    for (int h = 0; h < layout.num_heads(); ++h) p.mutable_a_log()->mutable_values()->add_values(-1);
    for (int i = 0; i < layout.num_heads() * layout.head_dim(); ++i) {
      p.mutable_dt_bias()->mutable_values()->add_values(0.1f);
    }
    Check(session->LoadLayerParams(p), "LoadLayerParams");
  }

  std::printf("| call | N | p50 (us) | p99 (us) |\n|---|---:|---:|---:|\n");
  v1::PingRequest ping;
  ping.set_payload(std::string(64, 'x'));
  const auto bare_ping = [&] {
    grpc::ClientContext ctx;
    v1::PingResponse r;
    Check(client::FromGrpc(c->stub().Ping(&ctx, ping, &r)), "Ping");
  };
  const Percentiles echo = TimeRpc(iters, bare_ping);
  std::printf("| Ping (echo floor) | - | %.1f | %.1f |\n", echo.p50, echo.p99);

  uint64_t step_id = 0;
  std::vector<int> ns = {1, layout.max_rows()};
  Paired paired{};        // the tensors sent with each call
  Paired paired_bound{};  // the layer's tensors bound once
  std::string breakdown;  // --breakdown: what the ASYNC Verify's difference is made of
  double served_us = 0;   // the service's own handling of those ASYNC Verify calls
  double served_bound_us = 0;
  for (int N : ns) {
    Scheduler s = MakeScheduler(*c, *session, N, rng);
    const uint64_t step = ++step_id;
    v1::VerifyRequest v = VerifyRequest(s, *session, step, 0);
    const Percentiles sync = TimeRpc(iters, [&] { Check(session->Verify(v), "Verify"); });
    std::printf("| Verify, SYNC | %d | %.1f | %.1f |\n", N, sync.p50, sync.p99);
    v1::VerifyRequest va = v;
    va.set_ordering(v1::ASYNC);
    const Percentiles async = TimeRpc(iters, [&] { Check(session->Verify(va), "Verify"); });
    std::printf("| Verify, ASYNC (enqueue) | %d | %.1f | %.1f |\n", N, async.p50, async.p99);
    // Built once, as a scheduler that keeps one request per layer does (the
    // echo's request is built once too).
    v1::VerifyRequest prepared = va;
    prepared.set_session_id(session->id());
    BindLayers(s, *session);
    v1::VerifyRequest bound = BoundVerifyRequest(s, step, 0);
    bound.set_ordering(v1::ASYNC);
    bound.set_session_id(session->id());
    const Percentiles async_bound =
        TimeRpc(iters, [&] { Check(session->Verify(bound), "Verify"); });
    std::printf("| Verify, ASYNC (enqueue), bound inputs | %d | %.1f | %.1f |\n", N,
                async_bound.p50, async_bound.p99);
    if (N == 1) {
      // A step's ASYNC Verify calls of every layer in one SubmitStep (no
      // doorbells: each runs once enqueued): the service's cost per call
      // without a round trip each.
      for (const bool bound_inputs : {false, true}) {
        std::vector<double> us;
        for (int i = 0; i < std::min(iters, 100) + 5; ++i) {
          v1::SubmitStepRequest b;
          b.set_session_id(session->id());
          const uint64_t id = ++step_id;
          for (int l = 0; l < s.L; ++l) {
            v1::VerifyRequest one = bound_inputs ? BoundVerifyRequest(s, id, l)
                                                 : VerifyRequest(s, *session, id, l);
            one.set_ordering(v1::ASYNC);
            *b.add_verifies() = std::move(one);
          }
          const auto t0 = Clock::now();
          Check(session->SubmitStep(b), "SubmitStep");
          if (i >= 5) {
            us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
          }
          // Drained (a SYNC call of a new step returns after all before it),
          // so that no step waits for a free slot.
          Check(session->Verify(VerifyRequest(s, *session, ++step_id, 0)), "Verify");
        }
        const Percentiles batch = Of(us);
        std::printf("| SubmitStep of %d ASYNC Verify%s | %d | %.1f | %.1f |\n", s.L,
                    bound_inputs ? ", bound inputs" : "", N, batch.p50, batch.p99);
      }
    }
    if (N == 1 && absl::GetFlag(FLAGS_breakdown)) {
      // What the difference to the echo is made of: each variant against the
      // bare Ping, alternately.
      const auto with_deadline = [&](grpc::ClientContext& ctx) {
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
      };
      const auto row = [&](const char* what, auto call) {
        const Paired p = TimeInterleaved(absl::GetFlag(FLAGS_paired_iters), bare_ping, call);
        breakdown += absl::StrFormat("| %s | %.1f | %.1f | %.1f |\n", what, p.a.p50, p.b.p50,
                                     p.diff_p50);
      };
      breakdown =
          "\n| ASYNC Verify (N=1), against the bare Ping | Ping p50 (us) | call p50 (us) | "
          "per-pair difference p50 (us) |\n|---|---:|---:|---:|\n";
      row("Ping with a deadline", [&] {
        grpc::ClientContext ctx;
        with_deadline(ctx);
        v1::PingResponse r;
        Check(client::FromGrpc(c->stub().Ping(&ctx, ping, &r)), "Ping");
      });
      row("Verify, stub, no deadline", [&] {
        grpc::ClientContext ctx;
        v1::VerifyResponse r;
        Check(client::FromGrpc(c->stub().Verify(&ctx, prepared, &r)), "Verify");
      });
      row("Verify, stub, deadline", [&] {
        grpc::ClientContext ctx;
        with_deadline(ctx);
        v1::VerifyResponse r;
        Check(client::FromGrpc(c->stub().Verify(&ctx, prepared, &r)), "Verify");
      });
      row("Verify, Session::Verify, request without the session id (copied)",
          [&] { Check(session->Verify(va), "Verify"); });
      row("Verify, Session::Verify, prepared request",
          [&] { Check(session->Verify(prepared), "Verify"); });
      row("Verify, Session::Verify, bound inputs (prepared)",
          [&] { Check(session->Verify(bound), "Verify"); });
    }
    if (N == 1) {
      // The target's comparison, measured alternately with the echo: the
      // prepared request, with its tensors and bound.
      v1::Stats before = Check(c->GetStats(), "GetStats");
      paired = TimeInterleaved(absl::GetFlag(FLAGS_paired_iters), bare_ping,
                               [&] { Check(session->Verify(prepared), "Verify"); });
      served_us = ServedMedianUs(before, Check(c->GetStats(), "GetStats"), "Verify");
      before = Check(c->GetStats(), "GetStats");
      paired_bound = TimeInterleaved(absl::GetFlag(FLAGS_paired_iters), bare_ping,
                                     [&] { Check(session->Verify(bound), "Verify"); });
      served_bound_us = ServedMedianUs(before, Check(c->GetStats(), "GetStats"), "Verify");
    }
    Check(session->Verify(v), "Verify");  // drains the stream
    // Commit needs every layer verified in its step, once per step.
    std::vector<double> sync_commit, async_commit;
    for (int i = 0; i < std::min(iters, 100); ++i) {
      for (bool is_async : {false, true}) {
        const uint64_t id = ++step_id;
        for (int l = 0; l < s.L; ++l) {
          Check(session->Verify(VerifyRequest(s, *session, id, l)), "Verify");
        }
        v1::CommitRequest cr = CommitRequest(s, *session, id);
        if (is_async) cr.set_ordering(v1::ASYNC);
        const auto t0 = Clock::now();
        Check(session->Commit(cr), "Commit");
        (is_async ? async_commit : sync_commit)
            .push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      }
    }
    const Percentiles cs = Of(sync_commit), ca = Of(async_commit);
    std::printf("| Commit (%d layers), SYNC | %d | %.1f | %.1f |\n", s.L, N, cs.p50, cs.p99);
    std::printf("| Commit (%d layers), ASYNC (enqueue) | %d | %.1f | %.1f |\n", s.L, N, ca.p50,
                ca.p99);
    for (const std::string& name : s.names) Check(session->Unregister(name), "Unregister");
  }
  std::printf(
      "\nASYNC Verify (N=1) against the echo, alternating calls (target: within 10 us):\n\n"
      "| Verify | Ping p50 (p99) (us) | Verify p50 (p99) (us) | per-pair difference p50 (us) | "
      "handler median (us) |\n|---|---:|---:|---:|---:|\n");
  for (const auto& [what, p, served] :
       {std::make_tuple("tensors sent", &paired, served_us),
        std::make_tuple("bound inputs", &paired_bound, served_bound_us)}) {
    std::printf("| %s | %.1f (%.1f) | %.1f (%.1f) | %.1f | %.1f |\n", what, p->a.p50, p->a.p99,
                p->b.p50, p->b.p99, p->diff_p50, served);
  }
  std::printf("%s", breakdown.c_str());

  if (!cuda) {
    Check(session->Close(), "Close");
    return 0;
  }
  // The decode step.
  std::printf("\n| step of %d layers | N | model per layer (us) | in-process (us) | through the "
              "service (us) | ratio | SubmitStep p50 / p99 (us) |\n|---|---:|---:|---:|---:|---:|---:|\n",
              layout.num_layers());
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int steps = absl::GetFlag(FLAGS_steps);
  // One row: the step at N rows with `model_us` per layer, with or without
  // its Commit, in-process against through the service.
  const auto measure_step = [&](const Scheduler& s, const InProcess& p, double model_us,
                                bool commit, const char* what, bool bound = true) {
    const double in_process = MeanStepUs(
        stream, steps, [&](int) { InProcessStep(s, p, model_us, commit, stream); }, [](int) {});
    const uint32_t base = static_cast<uint32_t>(step_id + 1);
    const StepTiming service = TimeSteps(
        stream, steps, [&](int i) { ServiceStepStream(s, base + i, model_us, commit, stream); },
        [&](int i) { SendStepCalls(s, *session, ++step_id, base + i, commit, bound); });
    CHECK_CUDA(cudaStreamSynchronize(stream));
    std::printf("| %s | %d | %.0f | %.1f | %.1f | %.3f | %.0f / %.0f |\n", what, s.N, model_us,
                in_process, service.gpu_us, service.gpu_us / in_process, service.send_us.p50,
                service.send_us.p99);
    std::fflush(stdout);
  };
  for (int N : ns) {
    Scheduler s = MakeScheduler(*c, *session, N, rng);
    InProcess p = MakeInProcess(s, rng);
    const double model_us =
        N == 1 ? absl::GetFlag(FLAGS_model_us_small) : absl::GetFlag(FLAGS_model_us_large);
    BindLayers(s, *session);
    measure_step(s, p, model_us, true, "decode step");
    measure_step(s, p, model_us, true, "decode step, tensors sent", false);
    if (N == 1 && absl::GetFlag(FLAGS_breakdown)) {
      // Where the difference goes: without the Commit (the Verify chain
      // alone), and with a longer model kernel (a host that cannot keep up
      // would show as a difference that shrinks).
      measure_step(s, p, model_us, false, "Verify calls only");
      // What each of the service's additions costs in-process.
      const auto in_process_with = [&](ServiceExtras extras, const char* what) {
        const double plain = MeanStepUs(
            stream, steps, [&](int) { InProcessStep(s, p, model_us, false, stream); }, [](int) {});
        const double with = MeanStepUs(
            stream, steps, [&](int) { InProcessStep(s, p, model_us, false, stream, extras); },
            [](int) {});
        std::printf("| in-process Verify calls %s | %d | %.0f | %.1f | %.1f | %.3f | - |\n", what,
                    N, model_us, plain, with, with / plain);
        std::fflush(stdout);
      };
      {
        // The same kernels on a second stream of this process, handed to and
        // back by doorbells in device memory as through the service.
        cudaStream_t verifier;
        CHECK_CUDA(cudaStreamCreateWithFlags(&verifier, cudaStreamNonBlocking));
        uint32_t* counters = nullptr;
        CHECK_CUDA(cudaMalloc(&counters, 64));
        CHECK_CUDA(cudaMemset(counters, 0, 64));
        uint32_t ring = 0;
        const double plain = MeanStepUs(
            stream, steps, [&](int) { InProcessStep(s, p, model_us, false, stream); }, [](int) {});
        const double handed = MeanStepUs(
            stream, steps,
            [&](int) { InProcessHandoffStep(s, p, model_us, stream, verifier, counters, ring); },
            [](int) {});
        std::printf("| in-process Verify calls on a second stream, doorbells | %d | %.0f | %.1f | "
                    "%.1f | %.3f | - |\n", N, model_us, plain, handed, handed / plain);
        std::fflush(stdout);
      }
      in_process_with({true, false, false}, "+ status mirror");
      in_process_with({false, true, false}, "+ prerequisites");
      in_process_with({false, false, true}, "+ completion event");
      measure_step(s, p, 3 * model_us, true, "decode step, longer model");
    }
    for (const std::string& name : s.names) Check(session->Unregister(name), "Unregister");
  }
  Check(session->Close(), "Close");
  return 0;
}

}  // namespace
}  // namespace specstate

int main(int argc, char** argv) {
  // Before any CUDA call: this process's stream waits on the service's doorbells.
  specstate::kernels::UseEagerCudaModuleLoading();
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_fast_mutexes)) specstate::client::DisableMutexDeadlockDetection();
  return specstate::Main();
}
