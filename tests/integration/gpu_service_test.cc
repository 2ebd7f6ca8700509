// GPU integration tests (tag "gpu"): specstated on the CUDA backend, driven by
// specstatectl simulate in a separate process that shares its buffers and
// maps the pools by CUDA IPC handle, checking every state bit for bit against
// its own CUDA stock path (ReadsChangeNoPoolByte drives two services itself,
// tests/integration/reads_loop.h). Needs an NVIDIA GPU.
#include <cuda_runtime.h>

#include <csignal>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/lib/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/reads_loop.h"
#include "tests/integration/server_process.h"

namespace specstate {
namespace {

using ::testing::HasSubstr;
using testing::RunfilePath;
using testing::ServerProcess;

bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

class GpuServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  }
  void Start(std::vector<std::string> flags) {
    flags.push_back("--backend=cuda");
    auto s = ServerProcess::Start(flags);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
  }
  testing::ProcessResult Simulate(std::vector<std::string> flags) {
    std::vector<std::string> argv = {RunfilePath("client/cli/specstatectl"),
                                     absl::StrCat("--server=", server_->address()), "simulate"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    auto r = testing::RunProcess(argv);
    EXPECT_TRUE(r.ok()) << r.status();
    return *r;
  }
  void TearDown() override {
    if (HasFailure() && server_ != nullptr) std::fprintf(stderr, "server log:\n%s", server_->Log().c_str());
  }
  std::unique_ptr<ServerProcess> server_;
};

TEST_F(GpuServiceTest, SimulationSyncAsyncDoorbellsEventsAndBoundInputs) {
  Start({"--heads=8", "--head_dim=128", "--conv_dim=3072", "--blocks=128", "--max_rows=32"});
  for (const std::vector<std::string>& mode :
       {std::vector<std::string>{}, std::vector<std::string>{"--async"},
        std::vector<std::string>{"--async", "--events"},
        std::vector<std::string>{"--async", "--batch"},
        std::vector<std::string>{"--async", "--bound_inputs"},
        std::vector<std::string>{"--async", "--events", "--bound_inputs"}}) {
    std::vector<std::string> flags = {"--steps=25", "--requests=12", "--seed=3"};
    flags.insert(flags.end(), mode.begin(), mode.end());
    const testing::ProcessResult r = Simulate(flags);
    SCOPED_TRACE(absl::StrCat("simulate ", absl::StrJoin(mode, " "), "\n", r.output));
    EXPECT_EQ(r.exit_code, 0);
    EXPECT_THAT(r.output, HasSubstr("on the cuda backend"));
    EXPECT_THAT(r.output, HasSubstr("verdict: PASS"));
  }
}

TEST_F(GpuServiceTest, SimulationAlignModeBf16State) {
  Start({"--heads=4", "--head_dim=64", "--cache_mode=align", "--mamba_block_size=8",
         "--blocks=600", "--state_dtype=bf16", "--activation_dtype=fp16"});
  const testing::ProcessResult r = Simulate({"--steps=30", "--requests=8", "--async"});
  SCOPED_TRACE(r.output);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_THAT(r.output, HasSubstr("verdict: PASS"));
}

// Commit mode DEFERRED on the CUDA backend: 500 steps (the bar),
// ASYNC with doorbells, every state checked where it is materialized; then
// align mode with bf16 state and GDN, shorter.
TEST_F(GpuServiceTest, SimulationDeferredCommitMode) {
  Start({"--commit_mode=deferred", "--heads=8", "--head_dim=128", "--conv_dim=3072",
         "--blocks=128", "--max_rows=32"});
  for (const std::vector<std::string>& mode :
       {std::vector<std::string>{"--steps=500", "--requests=12", "--async"},
        std::vector<std::string>{"--steps=40", "--requests=12", "--async", "--bound_inputs",
                                 "--events"}}) {
    std::vector<std::string> flags = {"--commit_mode=deferred", "--seed=5"};
    flags.insert(flags.end(), mode.begin(), mode.end());
    const testing::ProcessResult r = Simulate(flags);
    SCOPED_TRACE(absl::StrCat("simulate ", absl::StrJoin(flags, " "), "\n", r.output));
    EXPECT_EQ(r.exit_code, 0);
    EXPECT_THAT(r.output, HasSubstr("commit mode DEFERRED"));
    EXPECT_THAT(r.output, HasSubstr("verdict: PASS"));
    std::printf("%s", r.output.c_str());
  }
  server_.reset();
  for (const std::vector<std::string>& layout :
       {std::vector<std::string>{"--heads=4", "--head_dim=64", "--cache_mode=align",
                                 "--mamba_block_size=8", "--blocks=600", "--state_dtype=bf16"},
        std::vector<std::string>{"--kind=gdn", "--heads=4", "--value_heads=8", "--head_dim=128",
                                 "--conv_dim=2048", "--blocks=128"}}) {
    std::vector<std::string> flags = layout;
    flags.push_back("--commit_mode=deferred");
    Start(flags);
    const testing::ProcessResult r =
        Simulate({"--commit_mode=deferred", "--steps=40", "--requests=8", "--async"});
    SCOPED_TRACE(absl::StrCat(absl::StrJoin(layout, " "), "\n", r.output));
    EXPECT_EQ(r.exit_code, 0);
    EXPECT_THAT(r.output, HasSubstr("verdict: PASS"));
    server_.reset();
  }
}

// Commit mode FAST on the CUDA backend, judged by the simulator against its
// float64 reference by the accuracy contract: the three 1,000-step layouts
// of docs/results/simulate_fast_cpu_1000.md (KDA fp32 activations; KDA
// plain gate, bf16 state, align mode; GDN), the same flags and seed as
// `tools/simulate_matrix.sh fast-1000` on the CPU; then Kimi-Linear's head
// dim with ASYNC, SubmitStep and bound inputs; then a planted corruption,
// which must FAIL.
TEST_F(GpuServiceTest, SimulationFastCommitMode) {
  struct Run {
    std::vector<std::string> layout, simulate;
  };
  const std::vector<Run> runs = {
      {{"--fold_every=4", "--activation_dtype=fp32"}, {"--steps=1000", "--requests=4"}},
      {{"--fold_every=8", "--state_dtype=bf16", "--kda_gate=plain", "--cache_mode=align",
        "--mamba_block_size=16", "--blocks=1200"},
       {"--steps=1000", "--requests=4"}},
      {{"--fold_every=16", "--activation_dtype=fp32", "--kind=gdn", "--heads=2",
        "--value_heads=4"},
       {"--steps=1000", "--requests=4"}},
      {{"--fold_every=4", "--heads=8", "--head_dim=128", "--conv_dim=3072", "--blocks=128",
        "--max_rows=32"},
       {"--steps=200", "--requests=12", "--async", "--batch", "--bound_inputs"}},
  };
  for (const Run& run : runs) {
    std::vector<std::string> layout = run.layout;
    layout.push_back("--commit_mode=fast");
    Start(layout);
    std::vector<std::string> flags = run.simulate;
    flags.insert(flags.end(), {"--commit_mode=fast", "--seed=23"});
    const testing::ProcessResult r = Simulate(flags);
    SCOPED_TRACE(absl::StrCat(absl::StrJoin(layout, " "), ": simulate ", absl::StrJoin(flags, " "),
                              "\n", r.output));
    EXPECT_EQ(r.exit_code, 0);
    EXPECT_THAT(r.output, HasSubstr("on the cuda backend"));
    EXPECT_THAT(r.output, HasSubstr("commit mode FAST"));
    EXPECT_THAT(r.output, HasSubstr("verdict: PASS"));
    std::printf("== specstated %s | simulate %s\n%s", absl::StrJoin(layout, " ").c_str(),
                absl::StrJoin(flags, " ").c_str(), r.output.c_str());
    server_.reset();
  }
  Start({"--commit_mode=fast", "--fold_every=4"});
  const testing::ProcessResult r =
      Simulate({"--commit_mode=fast", "--steps=20", "--requests=4", "--corrupt_after_step=5"});
  SCOPED_TRACE(r.output);
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_THAT(r.output, HasSubstr("verdict: FAIL"));
  EXPECT_THAT(r.output, HasSubstr("the accuracy contract is broken"));
}

// Gated DeltaNet on the CUDA backend, the Qwen3-Next head grouping at TP4
// (4 key heads, 8 value heads, K = 128), align mode; and KDA's plain gate.
TEST_F(GpuServiceTest, SimulationGatedDeltaNetAndPlainGate) {
  for (const std::vector<std::string>& layout :
       {std::vector<std::string>{"--kind=gdn", "--heads=4", "--value_heads=8", "--head_dim=128",
                                 "--conv_dim=2048", "--cache_mode=align", "--mamba_block_size=8",
                                 "--blocks=600"},
        std::vector<std::string>{"--kda_gate=plain", "--heads=4", "--head_dim=128"}}) {
    Start(layout);
    for (const std::vector<std::string>& mode :
         {std::vector<std::string>{}, std::vector<std::string>{"--async", "--batch"}}) {
      std::vector<std::string> flags = {"--steps=20", "--requests=8"};
      flags.insert(flags.end(), mode.begin(), mode.end());
      const testing::ProcessResult r = Simulate(flags);
      SCOPED_TRACE(absl::StrCat(absl::StrJoin(layout, " "), ": simulate ",
                                absl::StrJoin(mode, " "), "\n", r.output));
      EXPECT_EQ(r.exit_code, 0);
      EXPECT_THAT(r.output, HasSubstr("on the cuda backend"));
      EXPECT_THAT(r.output, HasSubstr("verdict: PASS"));
    }
  }
}

TEST_F(GpuServiceTest, PlantedCorruptionFailsTheVerdict) {
  Start({});
  const testing::ProcessResult r = Simulate({"--steps=6", "--corrupt_after_step=2"});
  SCOPED_TRACE(r.output);
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_THAT(r.output, HasSubstr("verdict: FAIL"));
}

// A scheduler killed after sending a Commit that waits on a doorbell it never
// rings: its session's end releases the wait (the stream would block forever
// otherwise), and the Commit must then run nothing. The pools stay as the
// scheduler left them, and the service keeps serving.
TEST_F(GpuServiceTest, KilledSchedulersWaitingCommitNeverRuns) {
  Start({});
  const testing::ProcessResult crashed =
      Simulate({"--steps=6", "--requests=3", "--async", "--abandon_commit_at_step=3"});
  EXPECT_EQ(crashed.signal, SIGKILL) << crashed.output;
  const size_t at = crashed.output.find("CRASH POINT pools=");
  ASSERT_NE(at, std::string::npos) << crashed.output;
  const std::string checksum_at_crash = crashed.output.substr(at + 18, 16);

  auto c = client::Client::Connect(server_->address()).value();
  std::unique_ptr<client::Session> next;
  for (int i = 0; i < 100 && next == nullptr; ++i) {
    absl::StatusOr<std::unique_ptr<client::Session>> s = c->OpenSession("restarted", true);
    if (s.ok()) next = *std::move(s);
    else std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_NE(next, nullptr);
  // A read is queued after whatever the dead session left on the stream.
  ASSERT_TRUE(c->ReadState(0, 1, false).ok());
  auto memory = client::SharedMemory::Create(v1::CUDA).value();
  auto pools = memory->MapPools(c->ExportPools().value()).value();
  std::vector<char> bytes(pools->description().allocation_bytes());
  ASSERT_TRUE(memory->CopyOut(bytes.data(), pools->base(), bytes.size()).ok());
  uint64_t h = 1469598103934665603ull;  // FNV-1a, as the simulator's CRASH POINT
  for (char b : bytes) {
    h ^= static_cast<unsigned char>(b);
    h *= 1099511628211ull;
  }
  EXPECT_EQ(absl::StrFormat("%016x", h), checksum_at_crash);
  pools.reset();
  ASSERT_TRUE(next->Close().ok());
  const testing::ProcessResult after = Simulate({"--steps=4", "--requests=3", "--seed=9"});
  EXPECT_EQ(after.exit_code, 0) << after.output;
  EXPECT_THAT(after.output, HasSubstr("verdict: PASS"));
}

// Reads have no side effects on CUDA (reads_loop.h; reads_test runs it on
// the CPU): a decode loop on two CUDA services, ReadState calls interleaved
// on one, in every commit mode; every pool byte equal at the end, and what
// ReadState returned is what a Flush then leaves. (The CUDA kernels are
// deterministic run to run: no float atomics.)
TEST_F(GpuServiceTest, ReadsChangeNoPoolByte) {
  for (const char* mode : {"eager", "deferred", "fast"}) {
    SCOPED_TRACE(mode);
    std::vector<std::string> flags = {"--backend=cuda", absl::StrCat("--commit_mode=", mode)};
    if (std::string(mode) == "fast") flags.push_back("--fold_every=3");
    testing::ExpectReadsChangeNoPoolByte(flags, v1::CUDA, 24);
    if (HasFatalFailure()) return;
  }
}

// Whether the service is an MPS client is in the layout, in the log at start
// and, when it is not, as a warning in GetStats. (run_suite.sh runs this
// without MPS, tools/gpu/diagnose.sh ... mps under it.)
TEST_F(GpuServiceTest, MpsClientIsReportedAndItsAbsenceWarnedAbout) {
  Start({});
  auto c = client::Client::Connect(server_->address()).value();
  const v1::Layout layout = c->GetLayout().value();
  const v1::Stats stats = c->GetStats().value();
  EXPECT_EQ(stats.health(), "SERVING");  // slow is not broken
  const bool under_mps = std::getenv("CUDA_MPS_PIPE_DIRECTORY") != nullptr &&
                         std::getenv("SPECSTATE_EXPECT_MPS") != nullptr;
  if (under_mps) EXPECT_TRUE(layout.mps_client());
  if (layout.mps_client()) {
    EXPECT_EQ(stats.warnings_size(), 0);
    EXPECT_THAT(server_->Log(), HasSubstr("an MPS client"));
  } else {
    ASSERT_EQ(stats.warnings_size(), 1);
    EXPECT_THAT(stats.warnings(0), HasSubstr("not an MPS client"));
    EXPECT_THAT(server_->Log(), HasSubstr("WARNING: device 0: not an MPS client"));
  }
  std::printf("mps_client: %s\n", layout.mps_client() ? "yes" : "no");
}

// Health on the CUDA backend: a stream stuck on a doorbell for longer than
// --stuck_stream_ms reports NOT_SERVING (overall and for the service), and
// SERVING again once the doorbell rings.
TEST_F(GpuServiceTest, HealthReportsAStuckStream) {
  Start({"--stuck_stream_ms=300"});
  auto c = client::Client::Connect(server_->address()).value();
  ASSERT_EQ(c->Health().value(), "SERVING");
  const v1::Layout layout = c->GetLayout().value();
  auto session = c->OpenSession("gpu health", true).value();
  const int H = layout.num_heads(), K = layout.head_dim();
  v1::LoadLayerParamsRequest params;
  params.set_layer(0);
  for (int h = 0; h < H; ++h) params.mutable_a_log()->mutable_values()->add_values(-0.5f);
  for (int i = 0; i < H * K; ++i) params.mutable_dt_bias()->mutable_values()->add_values(0.25f);
  ASSERT_TRUE(session->LoadLayerParams(params).ok());
  auto memory = client::SharedMemory::Create(v1::CUDA).value();
  auto buffer = memory->Allocate(1 << 20).value();
  std::vector<char> zeros(1 << 20, 0);
  ASSERT_TRUE(memory->CopyIn(buffer->data(), zeros.data(), zeros.size()).ok());
  ASSERT_TRUE(session->RegisterBuffer(*buffer, "acts").ok());
  char* base = static_cast<char*>(buffer->data());
  const int64_t T = 2;
  const int64_t per = T * H * K * 2;
  v1::VerifyRequest v;
  v.set_step(1);
  v.set_layer(0);
  v.set_num_rows(1);
  v.mutable_query_start_loc()->mutable_values()->add_values(0);
  v.mutable_query_start_loc()->mutable_values()->add_values(2);
  v.mutable_state_indices()->mutable_values()->add_values(1);
  int which = 1;
  for (v1::RegionTensor* t : {v.mutable_q(), v.mutable_k(), v.mutable_v(), v.mutable_g(),
                              v.mutable_o()}) {
    *t = session->Tensor(base + 4096 * which++, DType::kBFloat16, {T, H, K}).value();
    ASSERT_LE(4096 * which + per, 1 << 20);
  }
  *v.mutable_beta() = session->Tensor(base + 4096 * 8 + 2 * per, DType::kBFloat16, {T, H}).value();
  v.set_ordering(v1::ASYNC);
  v.mutable_wait()->mutable_doorbell()->set_region("acts");
  v.mutable_wait()->mutable_doorbell()->set_value(1);
  ASSERT_TRUE(session->Verify(v).ok());
  std::string overall, service;
  for (int i = 0; i < 100; ++i) {
    overall = c->Health().value();
    service = c->Health("specstate.v1.SpecState").value();
    if (overall == "NOT_SERVING" && service == "NOT_SERVING") break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(overall, "NOT_SERVING");
  EXPECT_EQ(service, "NOT_SERVING");
  EXPECT_THAT(c->GetStats().value().health(), HasSubstr("NOT_SERVING: the device's queue"));
  const uint32_t one = 1;
  ASSERT_TRUE(memory->CopyIn(base, &one, sizeof(one)).ok());
  for (int i = 0; i < 100 && c->Health().value() != "SERVING"; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(c->Health().value(), "SERVING");
  ASSERT_TRUE(session->Close().ok());
}

TEST_F(GpuServiceTest, CudaRegionHandlesAreChecked) {
  Start({});
  auto c = client::Client::Connect(server_->address()).value();
  auto session = c->OpenSession("gpu test", true).value();
  auto memory = client::SharedMemory::Create(v1::CUDA).value();
  auto buffer = memory->Allocate(1 << 20).value();
  auto raw = [&](std::function<void(v1::RegisterRegionRequest*)> edit) {
    v1::RegisterRegionRequest r;
    r.set_session_id(session->id());
    r.set_name("raw");
    buffer->Describe(&r);
    edit(&r);
    grpc::ClientContext ctx;
    v1::RegisterRegionResponse response;
    return client::FromGrpc(c->stub().RegisterRegion(&ctx, r, &response));
  };
  absl::Status st = raw([](v1::RegisterRegionRequest* r) { r->set_cuda_ipc_handle("short"); });
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("cuda_ipc_handle has 5 bytes"));
  // torch's expandable-segments handles are 30 bytes.
  st = raw([](v1::RegisterRegionRequest* r) { r->set_cuda_ipc_handle(std::string(30, 'e')); });
  EXPECT_THAT(std::string(st.message()), HasSubstr("expandable segments"));
  // Bigger than the allocation the handle names (cuMemGetAddressRange).
  st = raw([](v1::RegisterRegionRequest* r) { r->set_byte_size(2 << 20); });
  EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange) << st;
  st = raw([](v1::RegisterRegionRequest* r) { r->set_shm_name("/x"); });
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  // The service's own pools are no region.
  const std::string pools = c->ExportPools().value().cuda_ipc_handle();
  st = raw([&](v1::RegisterRegionRequest* r) { r->set_cuda_ipc_handle(pools); });
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("the service's own pools"));
  EXPECT_TRUE(raw([](v1::RegisterRegionRequest*) {}).ok());
  // Events of the wrong size, to wait on and to record: refused before
  // anything is enqueued.
  for (const auto& [field, bytes] : {std::make_pair("wait", 10), std::make_pair("signal", 65)}) {
    v1::CommitRequest commit;
    commit.set_session_id(session->id());
    commit.set_step(1);
    commit.mutable_num_accepted()->mutable_values()->add_values(1);
    commit.set_ordering(v1::ASYNC);
    v1::Signal* sync = std::string(field) == "wait" ? commit.mutable_wait() : commit.mutable_signal();
    sync->mutable_event()->set_handle(std::string(bytes, 'x'));
    st = session->Commit(commit).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_THAT(std::string(st.message()),
                HasSubstr(absl::StrCat(field, ".event: event handle has ", bytes,
                                       " bytes; a cudaIpcEventHandle_t has 64")));
  }
  // The service maps the buffer until the session ends: end it before the
  // memory is freed.
  ASSERT_TRUE(session->Close().ok());
}

}  // namespace
}  // namespace specstate
