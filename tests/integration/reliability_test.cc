// What no client can do to the service: the real specstated (CPU backend)
// over a real socket, with the client misbehaving as a buggy or hostile
// scheduler would. Each test is a regression test of a defect that an
// outside sweep found (docs/reliability.md lists the promises they hold).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/lib/client.h"
#include "client/lib/shared_memory.h"
#include "client/simulator/simulator.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/server_process.h"
#include "tests/integration/test_scheduler.h"

namespace specstate {
namespace {

using client::Client;
using client::SharedBuffer;
using testing::ExpectError;
using testing::RunProcess;
using testing::RunfilePath;
using testing::Scheduler;
using testing::ServerProcess;
using testing::ValueOrDie;
using ::testing::HasSubstr;
using ::testing::Not;

class ReliabilityTest : public ::testing::Test {
 protected:
  void Start(std::vector<std::string> flags = {}) {
    flags.push_back("--backend=cpu");
    server_ = ValueOrDie(ServerProcess::Start(std::move(flags)));
    client_ = ValueOrDie(Client::Connect(server_->address()));
  }
  void TearDown() override {
    if (HasFailure() && server_ != nullptr) {
      std::fprintf(stderr, "server log:\n%s", server_->Log().c_str());
    }
  }
  // The server still answers (it did not crash).
  void ExpectAlive() {
    ASSERT_NE(server_, nullptr);
    absl::StatusOr<std::string> health = client_->Health();
    ASSERT_TRUE(health.ok()) << "the server died: " << health.status() << "\n" << server_->Log();
  }
  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<Client> client_;
};

// The POSIX shared-memory name of a CPU buffer (as RegisterRegion gets it).
std::string ShmNameOf(const SharedBuffer& buffer) {
  v1::RegisterRegionRequest r;
  buffer.Describe(&r);
  return r.shm_name();
}

// Shrinks the shared-memory object behind `buffer` to nothing, as a buggy
// or hostile owner may. The caller must not touch the buffer afterwards.
void Truncate(const SharedBuffer& buffer) {
  const std::string name = ShmNameOf(buffer);
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0) << name;
  ASSERT_EQ(ftruncate(fd, 0), 0);
  close(fd);
}

// ---------------------------------------------------------------------------
// 1. Truncated shared memory.

// A region truncated by its owner: the call that reads it fails DATA_LOSS
// naming it, the pools do not change, the region is dropped, and the
// service serves on (before: SIGBUS killed it).
TEST_F(ReliabilityTest, TruncatedRegionFailsItsCallAndIsDropped) {
  Start();
  Scheduler s(*client_);
  ASSERT_OK(s.VerifyAll(1));
  ASSERT_OK(s.session().Commit(s.Commit(1)).status());
  const std::string pools = s.Pools();
  // A second buffer with the activations, so the first stays usable here.
  auto acts = ValueOrDie(s.memory().Allocate(1 << 20));
  std::memcpy(acts->data(), s.Act(0), 6 * 3 * 2 * 4 * 64 * 2);
  ValueOrDie(s.session().RegisterBuffer(*acts, "doomed"));
  v1::VerifyRequest v = s.Verify(2, 0);
  for (v1::RegionTensor* t : {v.mutable_q(), v.mutable_k(), v.mutable_v(), v.mutable_g()}) {
    t->set_region("doomed");
  }
  Truncate(*acts);
  const absl::Status st = s.session().Verify(v).status();
  ExpectError(st, absl::StatusCode::kDataLoss, "region \"doomed\" was truncated by its owner");
  ExpectAlive();
  EXPECT_EQ(s.Pools(), pools);
  const v1::ListRegionsResponse listed = ValueOrDie(client_->ListRegions(s.session().id()));
  for (const v1::RegionInfo& r : listed.regions()) {
    EXPECT_NE(r.name(), "doomed") << "a truncated region stays registered";
  }
  // The step failed; the next one, on intact memory, runs.
  ASSERT_OK(s.VerifyAll(3));
  ASSERT_OK(s.session().Commit(s.Commit(3)).status());
}

// A truncated region that holds a Commit's inputs: nothing of the commit is
// written (its checks read zeros and the fault, then stop).
TEST_F(ReliabilityTest, TruncatedCommitInputsWriteNothing) {
  Start();
  Scheduler s(*client_);
  ASSERT_OK(s.VerifyAll(1));
  const std::string pools = s.Pools();
  auto meta = ValueOrDie(s.memory().Allocate(4096));
  int32_t* accepted = static_cast<int32_t*>(meta->data());
  for (int i = 0; i < 3; ++i) accepted[i] = 2;
  ValueOrDie(s.session().RegisterBuffer(*meta, "meta"));
  v1::CommitRequest c = s.Commit(1);
  *c.mutable_num_accepted() = ValueOrDie(s.session().Index(accepted, {3}));
  Truncate(*meta);
  ExpectError(s.session().Commit(c).status(), absl::StatusCode::kDataLoss,
              "region \"meta\" was truncated");
  ExpectAlive();
  EXPECT_EQ(s.Pools(), pools);
}

// The pools are a sealed memfd: no client that maps them can shrink them.
TEST_F(ReliabilityTest, ThePoolsCannotBeShrunk) {
  Start();
  Scheduler s(*client_);
  const v1::ExportPoolsResponse exported = ValueOrDie(client_->ExportPools());
  ASSERT_THAT(exported.shm_path(), ::testing::StartsWith("/proc/"));
  const int fd = open(exported.shm_path().c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << exported.shm_path();
  EXPECT_NE(ftruncate(fd, 0), 0);
  EXPECT_EQ(errno, EPERM);
  EXPECT_NE(ftruncate(fd, static_cast<off_t>(exported.allocation_bytes()) * 2), 0);
  close(fd);
  ASSERT_OK(s.VerifyAll(1));
  ASSERT_OK(s.session().Commit(s.Commit(1)).status());
  ExpectAlive();
}

// ---------------------------------------------------------------------------
// 2. SubmitStep batches.

// Over 4 * num_layers Verify calls: INVALID_ARGUMENT naming the limit. At
// the limit, thousands of ASYNC calls answered at once run in a loop, not
// one stack frame each (before: 4,000 of them overflowed the stack).
TEST_F(ReliabilityTest, SubmitStepIsBoundedAndDoesNotRecurse) {
  constexpr int kLayers = 1024;
  Start({absl::StrCat("--layers=", kLayers), "--heads=1", "--head_dim=64", "--blocks=4",
         "--max_rows=4", "--conv_dim=64"});
  Scheduler s(*client_);
  v1::SubmitStepRequest batch;
  for (int i = 0; i < 4 * kLayers; ++i) {
    v1::VerifyRequest v = s.Verify(1, i % kLayers);
    v.set_ordering(v1::ASYNC);
    *batch.add_verifies() = std::move(v);
  }
  const absl::StatusOr<v1::SubmitStepResponse> r = s.session().SubmitStep(batch);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->verifies_size(), 4 * kLayers);
  *batch.add_verifies() = batch.verifies(0);
  ExpectError(s.session().SubmitStep(batch).status(), absl::StatusCode::kInvalidArgument,
              "SubmitStep carries 4097 Verify calls; at most 4096 (4 * num_layers)");
  ExpectAlive();
}

// ---------------------------------------------------------------------------
// 3. Registration racing the session's end.

// A RegisterRegion sent while its session closes either lands before the
// end (and goes with the session) or fails: no region outlives its session
// (before: 4-9 of 300 tries left one mapped forever).
TEST_F(ReliabilityTest, NoRegionOutlivesItsSession) {
  Start();
  auto memory = ValueOrDie(client::SharedMemory::Create(v1::CPU));
  auto buffer = ValueOrDie(memory->Allocate(4096));
  int landed = 0;
  for (int i = 0; i < 300; ++i) {
    auto session = ValueOrDie(client_->OpenSession("racer", /*drive=*/false));
    v1::RegisterRegionRequest r;
    r.set_session_id(session->id());
    r.set_name("late");
    buffer->Describe(&r);
    std::thread closer([&] { ASSERT_OK(session->Close()); });
    grpc::ClientContext ctx;
    v1::RegisterRegionResponse response;
    if (client_->stub().RegisterRegion(&ctx, r, &response).ok()) ++landed;
    closer.join();
  }
  for (int i = 0; i < 100 && ValueOrDie(client_->ListRegions()).regions_size() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(ValueOrDie(client_->ListRegions()).regions_size(), 0)
      << landed << " of 300 registrations landed";
}

// ---------------------------------------------------------------------------
// 4. A rejected call changes nothing.

TEST_F(ReliabilityTest, ARejectedVerifyStartsNoStep) {
  Start();
  Scheduler s(*client_);
  ASSERT_OK(s.session().Verify(s.Verify(10, 0)).status());
  v1::VerifyRequest stride0 = s.Verify(11, 0);
  for (int64_t st : {0, 64, 1}) stride0.mutable_q()->add_strides(st);
  ExpectError(s.session().Verify(stride0).status(), absl::StatusCode::kInvalidArgument,
              "q token stride 0");
  v1::VerifyRequest no_qsl = s.Verify(11, 0);
  no_qsl.clear_query_start_loc();
  no_qsl.clear_state_indices();
  ExpectError(s.session().Verify(no_qsl).status(), absl::StatusCode::kInvalidArgument,
              "required on the first Verify of step 11");
  // Step 10 is still the current step.
  for (int l = 1; l < s.layout().num_layers(); ++l) {
    ASSERT_OK(s.session().Verify(s.Verify(10, l)).status());
  }
  ASSERT_OK(s.session().Commit(s.Commit(10)).status());
  const v1::Stats stats = ValueOrDie(client_->GetStats());
  EXPECT_EQ(stats.steps_verified(), 1u);
  EXPECT_EQ(stats.rows_verified(), 3u);
  EXPECT_EQ(stats.steps_failed(), 0u);
}

// A Commit that fails on the device fails its step, and the stats count it.
TEST_F(ReliabilityTest, AFailedCommitCountsAsAFailedStep) {
  Start();
  Scheduler s(*client_);
  ASSERT_OK(s.VerifyAll(1));
  v1::CommitRequest c = s.Commit(1);
  // Request row 7 is past the batch of 3 (a device check).
  c.mutable_request_indices()->mutable_values()->add_values(0);
  c.mutable_request_indices()->mutable_values()->add_values(1);
  c.mutable_request_indices()->mutable_values()->add_values(7);
  ExpectError(s.session().Commit(c).status(), absl::StatusCode::kOutOfRange,
              "request_indices[2] = 7");
  EXPECT_EQ(ValueOrDie(client_->GetStats()).steps_failed(), 1u);
  EXPECT_EQ(ValueOrDie(client_->GetStats()).steps_committed(), 0u);
}

// ---------------------------------------------------------------------------
// 5. Indices rewritten while a call runs.

// A scheduler thread flips query_start_loc[1] between a valid offset and
// one far past the activations while Verify calls read it from its region:
// each call is checked on the one value it snapshotted, so it either runs
// on a valid value or fails; the service never reads with an unchecked one
// (before: the kernel re-read the offset after the check, and crashed).
TEST_F(ReliabilityTest, IndicesRewrittenDuringACallAreNeverUsedUnchecked) {
  Start();
  Scheduler s(*client_);
  auto meta = ValueOrDie(s.memory().Allocate(4096));
  auto* qsl = static_cast<int32_t*>(meta->data());
  auto* idx = qsl + 16;
  for (int i = 0; i <= 3; ++i) qsl[i] = 2 * i;
  for (int i = 0; i < 3; ++i) idx[i] = 1 + i;
  ValueOrDie(s.session().RegisterBuffer(*meta, "meta"));
  std::atomic<bool> stop{false};
  std::thread flipper([&] {
    auto* word = reinterpret_cast<std::atomic<int32_t>*>(&qsl[1]);
    while (!stop.load(std::memory_order_relaxed)) {
      word->store(2, std::memory_order_relaxed);
      word->store(1 << 30, std::memory_order_relaxed);
    }
    word->store(2);
  });
  int ok = 0, rejected = 0;
  for (int i = 0; i < 1500; ++i) {
    v1::VerifyRequest v = s.Verify(100 + i, 0);
    *v.mutable_query_start_loc() = ValueOrDie(s.session().Index(qsl, {4}));
    *v.mutable_state_indices() = ValueOrDie(s.session().Index(idx, {3}));
    const absl::Status st = s.session().Verify(v).status();
    if (st.ok()) {
      ++ok;
    } else {
      ASSERT_EQ(st.code(), absl::StatusCode::kOutOfRange) << st;
      ++rejected;
    }
  }
  stop = true;
  flipper.join();
  ExpectAlive();
  EXPECT_GT(ok + rejected, 0);
  std::printf("%d calls ran, %d were rejected\n", ok, rejected);
}

// ---------------------------------------------------------------------------
// 6. Parameters from a region are checked finite, on the device.

TEST_F(ReliabilityTest, NonFiniteParametersFromARegionAreRefused) {
  Start();
  Scheduler s(*client_);
  ASSERT_OK(s.VerifyAll(1));
  const int H = s.layout().num_heads();
  const int HK = H * s.layout().head_dim();
  auto params = ValueOrDie(s.memory().Allocate(4 * (H + HK) + 64));
  float* p = static_cast<float*>(params->data());
  for (int i = 0; i < H + HK; ++i) p[i] = 0.25f;
  ValueOrDie(s.session().RegisterBuffer(*params, "params"));
  std::mt19937 rng(std::random_device{}());
  const int bad = std::uniform_int_distribution<int>(0, HK - 1)(rng);
  p[H + bad] = std::nanf("");
  v1::LoadLayerParamsRequest req;
  req.set_layer(1);
  *req.mutable_a_log()->mutable_region() =
      ValueOrDie(s.session().Tensor(p, DType::kFloat32, {H}));
  *req.mutable_dt_bias()->mutable_region() =
      ValueOrDie(s.session().Tensor(p + H, DType::kFloat32, {HK}));
  ExpectError(s.session().LoadLayerParams(req), absl::StatusCode::kInvalidArgument,
              absl::StrCat("dt_bias[", bad, "] is not finite"));
  // The layer keeps its old parameters: the step commits finite states.
  ASSERT_OK(s.session().Commit(s.Commit(1)).status());
  const v1::ReadStateResponse state = ValueOrDie(client_->ReadState(1, 2, false));
  EXPECT_TRUE(std::isfinite(state.recurrent().l2_norm()));
  p[H + bad] = INFINITY;
  *req.mutable_a_log()->mutable_region() = ValueOrDie(s.session().Tensor(p, DType::kFloat32, {H}));
  ExpectError(s.session().LoadLayerParams(req), absl::StatusCode::kInvalidArgument,
              "is not finite");
  p[H + bad] = 0.5f;
  ASSERT_OK(s.session().LoadLayerParams(req));
}

// ---------------------------------------------------------------------------
// 7. Outputs that alias.

TEST_F(ReliabilityTest, VerifyOutputsMayNotAliasInputsOrDoorbells) {
  Start();
  Scheduler s(*client_);
  ASSERT_OK(s.VerifyAll(1));
  ASSERT_OK(s.session().Commit(s.Commit(1)).status());
  const std::string pools = s.Pools();
  {
    v1::VerifyRequest v = s.Verify(2, 0);
    *v.mutable_o() = v.k();
    ExpectError(s.session().Verify(v).status(), absl::StatusCode::kInvalidArgument,
                "o overlaps k (the same memory)");
  }
  {
    // The same shared-memory object registered again: other addresses in
    // the service, the same memory.
    v1::RegisterRegionRequest r;
    r.set_session_id(s.session().id());
    r.set_name("acts-again");
    s.acts().Describe(&r);
    grpc::ClientContext ctx;
    v1::RegisterRegionResponse response;
    ASSERT_OK(client::FromGrpc(client_->stub().RegisterRegion(&ctx, r, &response)));
    v1::VerifyRequest v = s.Verify(2, 0);
    const uint64_t q_offset = v.q().offset_bytes();
    v.mutable_o()->set_region("acts-again");
    v.mutable_o()->set_offset_bytes(q_offset + 64);
    ExpectError(s.session().Verify(v).status(), absl::StatusCode::kInvalidArgument,
                "o overlaps q");
  }
  {
    v1::VerifyRequest v = s.Verify(2, 0);
    v.set_ordering(v1::ASYNC);
    v.mutable_signal()->mutable_doorbell()->set_region("acts");
    v.mutable_signal()->mutable_doorbell()->set_offset_bytes(v.o().offset_bytes() + 64);
    v.mutable_signal()->mutable_doorbell()->set_value(1);
    ExpectError(s.session().Verify(v).status(), absl::StatusCode::kInvalidArgument,
                "o overlaps signal.doorbell");
  }
  {
    // A binding is checked when it is made.
    v1::VerifyRequest v = s.Verify(2, 0);
    v1::BindVerifyInputsRequest bind;
    bind.set_layer(0);
    *bind.mutable_q() = v.q();
    *bind.mutable_k() = v.k();
    *bind.mutable_v() = v.v();
    *bind.mutable_g() = v.g();
    *bind.mutable_beta() = v.beta();
    *bind.mutable_o() = v.g();
    ExpectError(s.session().BindVerifyInputs(bind).status(), absl::StatusCode::kInvalidArgument,
                "o overlaps g");
  }
  EXPECT_EQ(s.Pools(), pools);
  ASSERT_OK(s.VerifyAll(3));
  ASSERT_OK(s.session().Commit(s.Commit(3)).status());
}

// RecordStateBlocks' two outputs may not overlap each other or its inputs;
// and no region may be the pools themselves.
TEST_F(ReliabilityTest, RecordOutputsMayNotAliasAndThePoolsAreNoRegion) {
  Start({"--cache_mode=align", "--mamba_block_size=8"});
  Scheduler s(*client_);
  ASSERT_OK(s.VerifyAll(1));
  v1::CommitRequest c = s.Commit(1);
  auto* table = c.mutable_block_table()->mutable_values();
  for (int64_t d : {3, 2}) table->add_shape(d);
  for (int r = 0; r < 3; ++r) {
    table->add_values(1 + r);
    table->add_values(0);
  }
  for (int r = 0; r < 3; ++r) c.mutable_num_computed_tokens()->mutable_values()->add_values(0);
  ASSERT_OK(s.session().Commit(c).status());
  auto meta = ValueOrDie(s.memory().Allocate(4096));
  ValueOrDie(s.session().RegisterBuffer(*meta, "meta"));
  auto* ints = static_cast<int32_t*>(meta->data());
  for (int i = 0; i < 64; ++i) ints[i] = i % 3;
  v1::RecordStateBlocksRequest r;
  r.set_step(1);
  r.set_block_table_width(2);
  *r.mutable_idx_mapping() = ValueOrDie(s.session().Index(ints, {3}));
  *r.mutable_num_sampled() = ValueOrDie(s.session().Index(ints + 4, {3}));
  *r.mutable_num_computed_tokens() = ValueOrDie(s.session().Index(ints + 8, {3}));
  v1::RecordStateBlocksRequest overlapping = r;
  *overlapping.mutable_state_idx() =
      ValueOrDie(s.session().Tensor(ints + 16, DType::kInt32, {3}));
  *overlapping.mutable_num_accepted() =
      ValueOrDie(s.session().Tensor(ints + 18, DType::kInt32, {3}));
  ExpectError(s.session().RecordStateBlocks(overlapping).status(),
              absl::StatusCode::kInvalidArgument, "num_accepted overlaps state_idx");
  *overlapping.mutable_state_idx() = ValueOrDie(s.session().Tensor(ints + 6, DType::kInt32, {3}));
  ExpectError(s.session().RecordStateBlocks(overlapping).status(),
              absl::StatusCode::kInvalidArgument, "state_idx overlaps num_sampled");
  // Apart, they are fine.
  *r.mutable_state_idx() = ValueOrDie(s.session().Tensor(ints + 16, DType::kInt32, {3}));
  *r.mutable_num_accepted() = ValueOrDie(s.session().Tensor(ints + 20, DType::kInt32, {3}));
  ASSERT_OK(s.session().RecordStateBlocks(r).status());

  // The pools' memfd cannot be named as a region.
  v1::RegisterRegionRequest pools;
  pools.set_session_id(s.session().id());
  pools.set_name("pools");
  pools.set_shm_name(ValueOrDie(client_->ExportPools()).shm_path());
  pools.set_byte_size(4096);
  grpc::ClientContext ctx;
  v1::RegisterRegionResponse response;
  ExpectError(client::FromGrpc(client_->stub().RegisterRegion(&ctx, pools, &response)),
              absl::StatusCode::kInvalidArgument, "POSIX shared-memory name");
}

// ---------------------------------------------------------------------------
// 8. Session ids are capabilities.

TEST_F(ReliabilityTest, SessionIdsAreSecretAndUnguessable) {
  Start();
  Scheduler s(*client_);
  const std::string& id = s.session().id();
  const size_t dash = id.find('-');
  ASSERT_NE(dash, std::string::npos);
  const std::string label = id.substr(0, dash);
  EXPECT_EQ(id.size() - dash - 1, 32u) << id;  // 128 bits as hex
  // Another client sees labels, never ids.
  auto other = ValueOrDie(Client::Connect(server_->address()));
  const v1::ListRegionsResponse all = ValueOrDie(other->ListRegions());
  ASSERT_GT(all.regions_size(), 0);
  for (const v1::RegionInfo& r : all.regions()) {
    EXPECT_TRUE(r.session_id().empty()) << r.session_id();
    EXPECT_EQ(r.session_label(), label);
  }
  EXPECT_THAT(ValueOrDie(other->GetStats()).driver(), Not(HasSubstr(id)));
  EXPECT_THAT(ValueOrDie(other->GetStats()).driver(), HasSubstr(label));
  const absl::Status refused = other->OpenSession("second", /*drive=*/true).status();
  ExpectError(refused, absl::StatusCode::kFailedPrecondition, absl::StrCat("session ", label));
  EXPECT_THAT(std::string(refused.message()), Not(HasSubstr(id)));
  // Its owner, naming itself, sees its id.
  EXPECT_EQ(ValueOrDie(client_->ListRegions(id)).regions(0).session_id(), id);
  // Two sessions' secrets differ.
  auto another = ValueOrDie(other->OpenSession("reader", false));
  EXPECT_NE(another->id().substr(another->id().find('-')), id.substr(dash));
}

// ---------------------------------------------------------------------------
// 9. Health.

// A queue stuck on a doorbell past --stuck_stream_ms reports NOT_SERVING,
// overall and for specstate.v1.SpecState, and SERVING again once it moves.
TEST_F(ReliabilityTest, HealthReportsAStuckQueue) {
  Start({"--stuck_stream_ms=300"});
  Scheduler s(*client_);
  EXPECT_EQ(ValueOrDie(client_->Health()), "SERVING");
  auto door = ValueOrDie(s.memory().Allocate(64));
  std::memset(door->data(), 0, 64);
  ValueOrDie(s.session().RegisterBuffer(*door, "door"));
  v1::VerifyRequest v = s.Verify(1, 0);
  v.set_ordering(v1::ASYNC);
  v.mutable_wait()->mutable_doorbell()->set_region("door");
  v.mutable_wait()->mutable_doorbell()->set_value(1);
  ASSERT_OK(s.session().Verify(v).status());
  std::string overall, service;
  for (int i = 0; i < 100; ++i) {
    overall = ValueOrDie(client_->Health());
    service = ValueOrDie(client_->Health("specstate.v1.SpecState"));
    if (overall == "NOT_SERVING" && service == "NOT_SERVING") break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(overall, "NOT_SERVING");
  EXPECT_EQ(service, "NOT_SERVING");
  EXPECT_THAT(ValueOrDie(client_->GetStats()).health(),
              HasSubstr("NOT_SERVING: the device's queue has been on a doorbell"));
  // Rung: the queue moves on.
  reinterpret_cast<std::atomic<uint32_t>*>(door->data())->store(1);
  for (int i = 0; i < 100 && ValueOrDie(client_->Health()) != "SERVING"; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(ValueOrDie(client_->Health()), "SERVING");
  EXPECT_EQ(ValueOrDie(client_->GetStats()).health(), "SERVING");
}

// ---------------------------------------------------------------------------
// 10. Start-up and the rest.

TEST_F(ReliabilityTest, ASecondServerNeverTakesALiveSocket) {
  Start();
  const std::string path = server_->address().substr(std::string("unix://").size());
  const testing::ProcessResult second = ValueOrDie(RunProcess(
      {RunfilePath("server/specstated"), "--backend=cpu", "--listen=" + server_->address()}));
  EXPECT_EQ(second.exit_code, 1) << second.output;
  EXPECT_THAT(second.output, HasSubstr("another server answers on " + path));
  ExpectAlive();  // the first still serves on it
  const testing::ProcessResult missing = ValueOrDie(RunProcess(
      {RunfilePath("server/specstated"), "--backend=cpu", "--listen=unix:///nonexistent-dir/s"}));
  EXPECT_EQ(missing.exit_code, 1) << missing.output;
  EXPECT_THAT(missing.output, HasSubstr("directory /nonexistent-dir does not exist"));
}

TEST_F(ReliabilityTest, HelpListsEveryFlagWithItsRealDefault) {
  const testing::ProcessResult help =
      ValueOrDie(RunProcess({RunfilePath("server/specstated"), "--help"}));
  EXPECT_THAT(help.output, Not(HasSubstr("No flags matched")));
  for (const char* flag :
       {"--layers (layers (all of --kind)); default: 4;",
        "--heads (key heads per layer (H: q, k)); default: 4;", "--kind", "--value_heads",
        "--kda_gate",
        "--max_rows (rows a step may verify); default: 16;", "default: \"unix:///tmp/specstate.sock\"",
        "--stuck_stream_ms", "--backend", "--config", "--num_spec", "--lower_bound"}) {
    EXPECT_THAT(help.output, HasSubstr(flag));
  }
}

TEST_F(ReliabilityTest, ShapesAreReportedAsGiven) {
  Start();
  Scheduler s(*client_);
  v1::VerifyRequest v = s.Verify(1, 0);
  v.mutable_k()->set_shape(0, -6);
  ExpectError(s.session().Verify(v).status(), absl::StatusCode::kInvalidArgument,
              "k: shape [-6, 4, 64]: dimension 0 is negative");
  v = s.Verify(1, 0);
  v.mutable_query_start_loc()->mutable_values()->set_values(0, 1);
  ExpectError(s.session().Verify(v).status(), absl::StatusCode::kInvalidArgument,
              "query_start_loc[0] = 1 must be 0");
}

// simulate with as many requests as the service has rows (the batch then
// has no room for the simulator's prefill row) passes.
TEST_F(ReliabilityTest, SimulateWithMaxRowsRequestsPasses) {
  Start();
  client::SimulationOptions o;
  o.steps = 6;
  o.requests = ValueOrDie(client_->GetLayout()).max_rows();
  o.seed = std::random_device()();
  SCOPED_TRACE(absl::StrCat("seed ", o.seed));
  const client::SimulationReport r = ValueOrDie(client::RunSimulation(*client_, o));
  EXPECT_TRUE(r.passed()) << client::FormatReport(r);
}

}  // namespace
}  // namespace specstate
