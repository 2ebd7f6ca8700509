// Integration tests: the real specstated (CPU backend) over a real Unix
// socket, driven by the C++ client and the scheduler simulator, whose stock
// path is its own stock-kernel run on its own memory.
#include <dirent.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <random>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
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
using client::Session;
using client::SharedMemory;
using ::testing::HasSubstr;
using testing::ServerProcess;

using testing::ExpectError;
using testing::Fnv1a;
using testing::Scheduler;
using testing::ValueOrDie;

class ServiceTest : public ::testing::Test {
 protected:
  void Start(std::vector<std::string> flags = {}) {
    server_ = ValueOrDie(ServerProcess::Start(std::move(flags)));
    client_ = ValueOrDie(Client::Connect(server_->address()));
  }
  void TearDown() override {
    if (HasFailure() && server_ != nullptr) std::fprintf(stderr, "server log:\n%s", server_->Log().c_str());
  }
  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<Client> client_;
};

// ---------------------------------------------------------------------------
// Decode loops checked bit for bit against the simulator's own stock path.

TEST_F(ServiceTest, SimulationNoneModeSync) {
  Start();
  client::SimulationOptions o;
  o.steps = 12;
  o.requests = 5;
  // Requests must finish within the run under any seed (at 0.15 some seeds
  // finish none in 12 steps: seed 741078789 did).
  o.finish_probability = 0.3;
  o.seed = std::random_device()();
  SCOPED_TRACE(absl::StrCat("seed ", o.seed));
  const client::SimulationReport r = ValueOrDie(client::RunSimulation(*client_, o));
  EXPECT_TRUE(r.passed()) << client::FormatReport(r);
  EXPECT_GT(r.comparisons, 100u);
  EXPECT_GT(r.requests_finished, 0u);
}

TEST_F(ServiceTest, SimulationNoneModeAsyncDoorbells) {
  Start({"--activation_dtype=fp32", "--head_dim=128", "--heads=2"});
  client::SimulationOptions o;
  o.steps = 10;
  o.requests = 4;
  o.async = true;
  o.seed = std::random_device()();
  SCOPED_TRACE(absl::StrCat("seed ", o.seed));
  const client::SimulationReport r = ValueOrDie(client::RunSimulation(*client_, o));
  EXPECT_TRUE(r.passed()) << client::FormatReport(r);
  EXPECT_EQ(r.latency.count("Verify (async)"), 1u);
}

TEST_F(ServiceTest, SimulationWithSubmitStep) {
  Start({"--cache_mode=align", "--mamba_block_size=4", "--blocks=300"});
  for (bool async : {false, true}) {
    client::SimulationOptions o;
    o.steps = 8;
    o.requests = 4;
    o.batch = true;
    o.async = async;
    o.seed = std::random_device()();
    SCOPED_TRACE(absl::StrCat("async ", async, ", seed ", o.seed));
    const client::SimulationReport r = ValueOrDie(client::RunSimulation(*client_, o));
    EXPECT_TRUE(r.passed()) << client::FormatReport(r);
    EXPECT_EQ(r.latency.count(async ? "SubmitStep (Verify (async))" : "SubmitStep (Verify)"), 1u);
  }
}

// Gated DeltaNet layers (grouped value heads), through the whole service:
// sync and async Verify, SubmitStep, align mode; bit for bit against the
// simulator's stock path, which runs the GDN stock kernel.
TEST_F(ServiceTest, SimulationGatedDeltaNet) {
  Start({"--kind=gdn", "--heads=4", "--value_heads=8", "--cache_mode=align",
         "--mamba_block_size=4", "--blocks=300"});
  const v1::Layout layout = ValueOrDie(client_->GetLayout());
  EXPECT_EQ(layout.layer_kind(), v1::GDN);
  EXPECT_EQ(layout.num_value_heads(), 8);
  EXPECT_EQ(layout.state_block_bytes(), int64_t{8} * 64 * 64 * 4);  // [HV, V, K] fp32
  for (bool async : {false, true}) {
    for (bool batch : {false, true}) {
      client::SimulationOptions o;
      o.steps = 8;
      o.requests = 4;
      o.async = async;
      o.batch = batch;
      o.seed = std::random_device()();
      SCOPED_TRACE(absl::StrCat("async ", async, ", batch ", batch, ", seed ", o.seed));
      const client::SimulationReport r = ValueOrDie(client::RunSimulation(*client_, o));
      EXPECT_TRUE(r.passed()) << client::FormatReport(r);
      EXPECT_GT(r.comparisons, 100u);
    }
  }
}

TEST_F(ServiceTest, GatedDeltaNetLayout) {
  Start({"--kind=gdn", "--heads=2", "--value_heads=6", "--head_dim=128"});
  // The recurrent pools are [blocks, HV, V, K].
  const v1::ExportPoolsResponse pools = ValueOrDie(client_->ExportPools());
  ASSERT_GT(pools.pools_size(), 0);
  EXPECT_EQ(pools.pools(0).kind(), "recurrent");
  EXPECT_THAT(std::vector<int64_t>(pools.pools(0).shape().begin(), pools.pools(0).shape().end()),
              ::testing::ElementsAre(64, 6, 128, 128));
  // GDN layers take no gate parameters.
  Scheduler s(*client_);
  ExpectError(s.LoadParams(0), absl::StatusCode::kFailedPrecondition,
              "GDN: they take no gate parameters");
  // Value heads that do not group the key heads, and KDA with grouped heads,
  // are refused at start, naming the field.
  for (const std::vector<std::string>& bad :
       {std::vector<std::string>{"--kind=gdn", "--heads=4", "--value_heads=6"},
        std::vector<std::string>{"--kind=kda", "--heads=2", "--value_heads=4"},
        std::vector<std::string>{"--kind=mamba"}}) {
    std::vector<std::string> argv = {testing::RunfilePath("server/specstated"),
                                     "--backend=cpu", "--listen=unix:///tmp/specstate-unused.sock"};
    argv.insert(argv.end(), bad.begin(), bad.end());
    const testing::ProcessResult r = ValueOrDie(testing::RunProcess(argv));
    SCOPED_TRACE(absl::StrJoin(bad, " "));
    EXPECT_NE(r.exit_code, 0);
    EXPECT_THAT(r.output, ::testing::AnyOf(HasSubstr("layout.num_value_heads"),
                                           HasSubstr("--kind=mamba: expected kda or gdn")));
  }
}

TEST_F(ServiceTest, SubmitStepStopsAtTheFirstError) {
  Start();
  Scheduler s(*client_);
  v1::SubmitStepRequest step;
  for (int l = 0; l < 4; ++l) *step.add_verifies() = s.Verify(1, l);
  step.mutable_verifies(2)->set_layer(7);
  *step.mutable_commit() = s.Commit(1);
  const std::string before = s.Pools();
  ExpectError(s.session().SubmitStep(step).status(), absl::StatusCode::kOutOfRange,
              "verifies[2]: layer 7 is out of range");
  EXPECT_TRUE(s.Pools() == before);
  // The whole step in one call.
  step.mutable_verifies(2)->set_layer(2);
  for (int l = 0; l < 4; ++l) step.mutable_verifies(l)->set_step(2);
  step.mutable_commit()->set_step(2);
  const v1::SubmitStepResponse r = ValueOrDie(s.session().SubmitStep(step));
  EXPECT_EQ(r.verifies_size(), 4);
  EXPECT_EQ(r.commit().num_layers(), 4);
  EXPECT_FALSE(s.Pools() == before);
}

TEST_F(ServiceTest, SimulationAlignModeAcrossBlockBoundaries) {
  Start({"--cache_mode=align", "--mamba_block_size=4", "--blocks=400", "--state_dtype=bf16",
         "--activation_dtype=fp16"});
  client::SimulationOptions o;
  o.steps = 16;
  o.requests = 5;
  o.seed = std::random_device()();
  SCOPED_TRACE(absl::StrCat("seed ", o.seed));
  const client::SimulationReport r = ValueOrDie(client::RunSimulation(*client_, o));
  EXPECT_TRUE(r.passed()) << client::FormatReport(r);
  EXPECT_GT(r.boundary_states, 0u) << "no step crossed a block boundary";
}

TEST_F(ServiceTest, SimulationAlignModeAsync) {
  Start({"--cache_mode=align", "--mamba_block_size=8", "--blocks=300"});
  client::SimulationOptions o;
  o.steps = 10;
  o.requests = 4;
  o.async = true;
  o.seed = std::random_device()();
  SCOPED_TRACE(absl::StrCat("seed ", o.seed));
  const client::SimulationReport r = ValueOrDie(client::RunSimulation(*client_, o));
  EXPECT_TRUE(r.passed()) << client::FormatReport(r);
}

TEST_F(ServiceTest, PlantedCorruptionFailsTheVerdict) {
  Start();
  client::SimulationOptions o;
  o.steps = 6;
  o.requests = 3;
  o.corrupt_after_step = 2;
  const client::SimulationReport r = ValueOrDie(client::RunSimulation(*client_, o));
  EXPECT_FALSE(r.passed());
  EXPECT_GT(r.mismatches, 0u);
  EXPECT_THAT(r.first_mismatch, HasSubstr("step 3"));
}

// ---------------------------------------------------------------------------
// Bad input: the right code, a message naming the field, and no byte of any
// pool changed.

struct BadCase {
  std::string name;
  std::function<absl::Status(Scheduler&)> call;
  absl::StatusCode code;
  std::string message;
};

TEST_F(ServiceTest, BadInputIsRejectedAndChangesNothing) {
  Start();
  Scheduler s(*client_);
  // A committed step first, so the pools hold non-zero states.
  ASSERT_OK(s.VerifyAll(1));
  ASSERT_OK(s.session().Commit(s.Commit(1)).status());
  uint64_t step = 100;
  const std::vector<BadCase> cases = {
      {"layer out of range",
       [&](Scheduler& s) { return s.session().Verify(s.Verify(++step, 9)).status(); },
       absl::StatusCode::kOutOfRange, "layer 9 is out of range"},
      {"rows over capacity",
       [&](Scheduler& s) {
         v1::VerifyRequest v = s.Verify(++step, 0);
         v.set_num_rows(17);
         return s.session().Verify(v).status();
       },
       absl::StatusCode::kOutOfRange, "max_rows"},
      {"wrong dtype",
       [&](Scheduler& s) {
         v1::VerifyRequest v = s.Verify(++step, 0);
         v.mutable_q()->set_dtype(v1::FP32);
         return s.session().Verify(v).status();
       },
       absl::StatusCode::kInvalidArgument, "q: dtype FP32, expected BF16"},
      {"a dtype number the enum does not have",
       [&](Scheduler& s) {
         v1::VerifyRequest v = s.Verify(++step, 0);
         v.mutable_v()->set_dtype(static_cast<v1::DType>(5 + step % 50));
         return s.session().Verify(v).status();
       },
       absl::StatusCode::kInvalidArgument,
       "is not a DType (the values are FP32 (1), FP16 (2), BF16 (3), INT32 (4)); expected BF16"},
      {"no k",
       [&](Scheduler& s) {
         v1::VerifyRequest v = s.Verify(++step, 0);
         v.clear_k();
         return s.session().Verify(v).status();
       },
       absl::StatusCode::kInvalidArgument,
       "k: missing (a RegionTensor with region, shape and dtype is required)"},
      {"wrong shape",
       [&](Scheduler& s) {
         v1::VerifyRequest v = s.Verify(++step, 0);
         v.mutable_k()->set_shape(1, 3);
         return s.session().Verify(v).status();
       },
       absl::StatusCode::kInvalidArgument, "k: shape"},
      {"g not dense",
       [&](Scheduler& s) {
         v1::VerifyRequest v = s.Verify(++step, 0);
         for (int64_t st : {4096, 128, 2}) v.mutable_g()->add_strides(st);
         return s.session().Verify(v).status();
       },
       absl::StatusCode::kInvalidArgument, "g: stride of dimension"},
      {"unknown region",
       [&](Scheduler& s) {
         v1::VerifyRequest v = s.Verify(++step, 0);
         v.mutable_v()->set_region("nope");
         return s.session().Verify(v).status();
       },
       absl::StatusCode::kNotFound, "v: no region \"nope\""},
      {"offset past the region",
       [&](Scheduler& s) {
         v1::VerifyRequest v = s.Verify(++step, 0);
         v.mutable_o()->set_offset_bytes(1 << 30);
         return s.session().Verify(v).status();
       },
       absl::StatusCode::kOutOfRange, "o: "},
      {"state index past the pool (device check)",
       [&](Scheduler& s) {
         v1::VerifyRequest v = s.Verify(++step, 0);
         v.mutable_state_indices()->mutable_values()->set_values(1, 9999);
         return s.session().Verify(v).status();
       },
       absl::StatusCode::kOutOfRange, "state_indices[1] = 9999"},
      {"row longer than Q (device check)",
       [&](Scheduler& s) {
         v1::VerifyRequest v = s.Verify(++step, 0);
         auto* q = v.mutable_query_start_loc()->mutable_values();
         q->set_values(1, 5);
         q->set_values(2, 5);
         q->set_values(3, 6);
         return s.session().Verify(v).status();
       },
       absl::StatusCode::kOutOfRange, "row 0 5 tokens, more than the 4"},
      {"decreasing query_start_loc (device check)",
       [&](Scheduler& s) {
         v1::VerifyRequest v = s.Verify(++step, 0);
         v.mutable_query_start_loc()->mutable_values()->set_values(2, 1);
         return s.session().Verify(v).status();
       },
       absl::StatusCode::kInvalidArgument, "query_start_loc[2] = 1 is less than"},
      {"commit without verify",
       [&](Scheduler& s) { return s.session().Commit(s.Commit(++step)).status(); },
       absl::StatusCode::kFailedPrecondition, "was not verified"},
      {"commit with layers not verified",
       [&](Scheduler& s) {
         const uint64_t id = ++step;
         absl::Status st = s.session().Verify(s.Verify(id, 0)).status();
         if (!st.ok()) return st;
         return s.session().Commit(s.Commit(id)).status();
       },
       absl::StatusCode::kFailedPrecondition, "layers 1, 2, 3 were not verified"},
      {"request index past the batch (device check)",
       [&](Scheduler& s) {
         const uint64_t id = ++step;
         absl::Status st = s.VerifyAll(id);
         if (!st.ok()) return st;
         v1::CommitRequest c = s.Commit(id);
         for (int r : {0, 7, 2}) c.mutable_request_indices()->mutable_values()->add_values(r);
         return s.session().Commit(c).status();
       },
       absl::StatusCode::kOutOfRange, "request_indices[1] = 7"},
      {"block table in mode none",
       [&](Scheduler& s) {
         const uint64_t id = ++step;
         absl::Status st = s.VerifyAll(id);
         if (!st.ok()) return st;
         v1::CommitRequest c = s.Commit(id);
         c.mutable_block_table()->mutable_values()->add_values(1);
         c.mutable_num_computed_tokens()->mutable_values()->add_values(1);
         return s.session().Commit(c).status();
       },
       absl::StatusCode::kInvalidArgument, "cache_mode NONE"},
      {"two rows writing one block (device check)",
       [&](Scheduler& s) {
         const uint64_t id = ++step;
         for (int l = 0; l < s.layout().num_layers(); ++l) {
           v1::VerifyRequest v = s.Verify(id, l);
           v.mutable_state_indices()->mutable_values()->set_values(2, 1);
           absl::Status st = s.session().Verify(v).status();
           if (!st.ok()) return st;
         }
         return s.session().Commit(s.Commit(id)).status();
       },
       absl::StatusCode::kInvalidArgument, "rows 0 and 2 both write block 1"},
      {"RecordStateBlocks in mode none",
       [&](Scheduler& s) {
         v1::RecordStateBlocksRequest r;
         r.set_step(1);
         return s.session().RecordStateBlocks(r).status();
       },
       absl::StatusCode::kFailedPrecondition, "cache_mode ALIGN"},
      {"parameters of the wrong size",
       [&](Scheduler& s) {
         v1::LoadLayerParamsRequest p;
         p.set_layer(0);
         p.mutable_a_log()->mutable_values()->add_values(1);
         p.mutable_dt_bias()->mutable_values()->add_values(1);
         return s.session().LoadLayerParams(p);
       },
       absl::StatusCode::kInvalidArgument, "a_log: 1 values, expected 4"},
      {"a second lower_bound",
       [&](Scheduler& s) {
         v1::LoadLayerParamsRequest p;
         p.set_layer(0);
         p.set_lower_bound(-3);
         return s.session().LoadLayerParams(p);
       },
       absl::StatusCode::kInvalidArgument, "all layers share one lower_bound"},
  };
  for (const BadCase& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string before = s.Pools();
    ExpectError(c.call(s), c.code, c.message);
    EXPECT_TRUE(s.Pools() == before) << "a rejected call changed the pools";
  }
  // The service still works after all of that.
  ASSERT_OK(s.VerifyAll(1000));
  ASSERT_OK(s.session().Commit(s.Commit(1000)).status());
}

// ---------------------------------------------------------------------------
// Bound inputs: a layer's tensors bound once, Verify calls with counts only.

TEST_F(ServiceTest, SimulationWithBoundInputs) {
  Start({"--cache_mode=align", "--mamba_block_size=4", "--blocks=300"});
  for (auto [async, batch] : {std::pair{false, false}, {true, false}, {true, true}}) {
    client::SimulationOptions o;
    o.steps = 8;
    o.requests = 4;
    o.async = async;
    o.batch = batch;
    o.bound_inputs = true;
    o.seed = std::random_device()();
    SCOPED_TRACE(absl::StrCat("async ", async, ", batch ", batch, ", seed ", o.seed));
    const client::SimulationReport r = ValueOrDie(client::RunSimulation(*client_, o));
    EXPECT_TRUE(r.passed()) << client::FormatReport(r);
    EXPECT_GT(r.boundary_states, 0u);
    EXPECT_EQ(r.latency.count("BindVerifyInputs"), 1u);
  }
}

TEST_F(ServiceTest, BoundInputsAreCheckedAndFollowTheirRegions) {
  Start();
  auto s = std::make_unique<Scheduler>(*client_);
  ASSERT_OK(s->VerifyAll(1));
  ASSERT_OK(s->session().Commit(s->Commit(1)).status());
  const int L = s->layout().num_layers();
  // The rows of Scheduler::Verify, in a region: query_start_loc [4], state_indices [3].
  auto rows = ValueOrDie(s->memory().Allocate(64));
  int32_t* r = static_cast<int32_t*>(rows->data());
  const int32_t values[] = {0, 2, 4, 6, 1, 2, 3};
  std::memcpy(r, values, sizeof(values));
  ValueOrDie(s->session().RegisterBuffer(*rows, "rows"));
  const auto binding = [&](int layer) {
    const v1::VerifyRequest v = s->Verify(0, layer);
    v1::BindVerifyInputsRequest b;
    b.set_layer(layer);
    *b.mutable_q() = v.q();
    *b.mutable_k() = v.k();
    *b.mutable_v() = v.v();
    *b.mutable_g() = v.g();
    *b.mutable_beta() = v.beta();
    *b.mutable_o() = v.o();
    *b.mutable_query_start_loc() = ValueOrDie(s->session().Index(r, {4}));
    *b.mutable_state_indices() = ValueOrDie(s->session().Index(r + 4, {3}));
    return b;
  };
  const auto bind_all = [&]() -> absl::Status {
    for (int l = 0; l < L; ++l) {
      absl::StatusOr<v1::BindVerifyInputsResponse> b = s->session().BindVerifyInputs(binding(l));
      if (!b.ok()) return b.status();
      EXPECT_EQ(b->max_tokens(), 6);
      EXPECT_EQ(b->max_rows(), 3);
    }
    return absl::OkStatus();
  };
  const auto bound = [](uint64_t step, int layer) {
    v1::VerifyRequest v;
    v.set_step(step);
    v.set_layer(layer);
    v.set_num_rows(3);
    v.set_bound_inputs(true);
    v.set_num_tokens(6);
    return v;
  };
  uint64_t step = 100;
  const auto run_cases = [&](const std::vector<BadCase>& cases) {
    for (const BadCase& c : cases) {
      SCOPED_TRACE(c.name);
      const std::string before = s->Pools();
      ExpectError(c.call(*s), c.code, c.message);
      EXPECT_TRUE(s->Pools() == before) << "a rejected call changed the pools";
    }
  };
  run_cases({
      {"bound Verify without a binding",
       [&](Scheduler& s) { return s.session().Verify(bound(++step, 0)).status(); },
       absl::StatusCode::kFailedPrecondition, "layer 0 has no bound inputs in this session"},
      {"binding with inline rows",
       [&](Scheduler& s) {
         v1::BindVerifyInputsRequest b = binding(0);
         b.mutable_query_start_loc()->mutable_values()->add_values(0);
         return s.session().BindVerifyInputs(b).status();
       },
       absl::StatusCode::kInvalidArgument, "query_start_loc: a binding's index tensors must be in a region"},
      {"binding of the wrong dtype",
       [&](Scheduler& s) {
         v1::BindVerifyInputsRequest b = binding(0);
         b.mutable_q()->set_dtype(v1::FP32);
         return s.session().BindVerifyInputs(b).status();
       },
       absl::StatusCode::kInvalidArgument, "q: dtype FP32, expected BF16"},
      {"binding past its region",
       [&](Scheduler& s) {
         v1::BindVerifyInputsRequest b = binding(0);
         b.mutable_o()->set_offset_bytes(1 << 30);
         return s.session().BindVerifyInputs(b).status();
       },
       absl::StatusCode::kOutOfRange, "o: "},
      {"binding with state_indices alone",
       [&](Scheduler& s) {
         v1::BindVerifyInputsRequest b = binding(0);
         b.clear_query_start_loc();
         return s.session().BindVerifyInputs(b).status();
       },
       absl::StatusCode::kInvalidArgument, "together"},
      {"binding of a layer out of range",
       [&](Scheduler& s) {
         v1::BindVerifyInputsRequest b = binding(0);
         b.set_layer(9);
         return s.session().BindVerifyInputs(b).status();
       },
       absl::StatusCode::kOutOfRange, "layer 9 is out of range"},
  });
  ASSERT_OK(bind_all());
  // The binding does not hold its regions.
  const v1::ListRegionsResponse listed = ValueOrDie(client_->ListRegions(s->session().id()));
  for (const v1::RegionInfo& info : listed.regions()) EXPECT_EQ(info.in_use(), 0) << info.name();
  run_cases({
      {"bound Verify with tensors too",
       [&](Scheduler& s) {
         v1::VerifyRequest v = bound(++step, 0);
         *v.mutable_q() = s.Verify(0, 0).q();
         return s.session().Verify(v).status();
       },
       absl::StatusCode::kInvalidArgument, "bound_inputs: leave q, k, v"},
      {"more tokens than bound",
       [&](Scheduler& s) {
         v1::VerifyRequest v = bound(++step, 0);
         v.set_num_tokens(7);
         return s.session().Verify(v).status();
       },
       absl::StatusCode::kOutOfRange, "num_tokens = 7 is out of range: layer 0's bound inputs hold 6 tokens"},
      {"more rows than bound",
       [&](Scheduler& s) {
         v1::VerifyRequest v = bound(++step, 0);
         v.set_num_rows(4);
         return s.session().Verify(v).status();
       },
       absl::StatusCode::kOutOfRange, "num_rows = 4 is out of range: layer 0's bound query_start_loc and state_indices hold 3 rows"},
      {"tensors with another num_tokens",
       [&](Scheduler& s) {
         v1::VerifyRequest v = s.Verify(++step, 0);
         v.set_num_tokens(5);
         return s.session().Verify(v).status();
       },
       absl::StatusCode::kInvalidArgument, "num_tokens = 5 differs from q's first dimension 6"},
      {"bound state index past the pool (device check)",
       [&](Scheduler& s) {
         r[5] = 9999;
         absl::Status st = s.session().Verify(bound(++step, 0)).status();
         r[5] = 2;
         return st;
       },
       absl::StatusCode::kOutOfRange, "state_indices[1] = 9999"},
      {"bound row longer than Q (device check)",
       [&](Scheduler& s) {
         r[1] = 5;
         r[2] = 5;
         absl::Status st = s.session().Verify(bound(++step, 0)).status();
         r[1] = 2;
         r[2] = 4;
         return st;
       },
       absl::StatusCode::kOutOfRange, "row 0 5 tokens, more than the 4"},
  });

  // A bound step computes what the same step with its tensors sent does.
  const std::string start = s->Pools();
  for (int l = 0; l < L; ++l) ASSERT_OK(s->session().Verify(bound(200, l)).status());
  ASSERT_OK(s->session().Commit(s->Commit(200)).status());
  const std::string bound_pools = s->Pools(), bound_outputs = s->Outputs();
  s->RestorePools(start);
  ASSERT_OK(s->VerifyAll(201));
  ASSERT_OK(s->session().Commit(s->Commit(201)).status());
  EXPECT_FALSE(bound_pools == start);
  EXPECT_TRUE(s->Pools() == bound_pools) << "the bound step's states differ";
  EXPECT_TRUE(s->Outputs() == bound_outputs) << "the bound step's outputs differ";

  // Unregistering a bound region neither waits for the binding nor leaves it
  // usable, even under the same name again; binding again does.
  ASSERT_OK(s->session().Unregister("rows"));
  run_cases({{"bound Verify after its region went",
              [&](Scheduler& s) { return s.session().Verify(bound(++step, 0)).status(); },
              absl::StatusCode::kFailedPrecondition,
              "region \"rows\", which was unregistered after the bind"}});
  ValueOrDie(s->session().RegisterBuffer(*rows, "rows"));
  run_cases({{"bound Verify after its region was registered again",
              [&](Scheduler& s) { return s.session().Verify(bound(++step, 0)).status(); },
              absl::StatusCode::kFailedPrecondition, "unregistered after the bind"}});
  ASSERT_OK(bind_all());
  for (int l = 0; l < L; ++l) ASSERT_OK(s->session().Verify(bound(300, l)).status());
  ASSERT_OK(s->session().Commit(s->Commit(300)).status());

  // A session's bindings end with it.
  s.reset();
  Scheduler next(*client_);
  ExpectError(next.session().Verify(bound(1, 0)).status(), absl::StatusCode::kFailedPrecondition,
              "layer 0 has no bound inputs in this session");
}

TEST_F(ServiceTest, AlignModeDeviceChecksNameTheField) {
  Start({"--cache_mode=align", "--mamba_block_size=4", "--blocks=64"});
  Scheduler s(*client_);
  const auto commit = [&](uint64_t id, std::vector<int32_t> table, int width,
                          std::vector<int32_t> computed) {
    absl::Status st = s.VerifyAll(id);
    if (!st.ok()) return st;
    v1::CommitRequest c = s.Commit(id, {2, 2, 2});
    for (int32_t b : table) c.mutable_block_table()->mutable_values()->add_values(b);
    c.mutable_block_table()->mutable_values()->add_shape(3);
    c.mutable_block_table()->mutable_values()->add_shape(width);
    for (int32_t n : computed) c.mutable_num_computed_tokens()->mutable_values()->add_values(n);
    return s.session().Commit(c).status();
  };
  std::string before = s.Pools();
  ExpectError(commit(1, {1, 10, 2, 11, 3, 999}, 2, {1, 1, 3}), absl::StatusCode::kOutOfRange,
              "block_table[2, 1] = 999");
  EXPECT_TRUE(s.Pools() == before);
  ExpectError(commit(2, {1, 10, 2, 11, 3, 12}, 2, {1, -4, 1}), absl::StatusCode::kOutOfRange,
              "num_computed_tokens[1] = -4 must not be negative");
  EXPECT_TRUE(s.Pools() == before);
  // Row 2 crosses the boundary at token 8, whose block column 1 is past the width 1.
  ExpectError(commit(3, {1, 2, 3}, 1, {1, 1, 7}), absl::StatusCode::kOutOfRange,
              "past the table's width 1");
  EXPECT_TRUE(s.Pools() == before);
  ASSERT_OK(commit(4, {1, 10, 2, 11, 3, 12}, 2, {1, 1, 3}));
  EXPECT_FALSE(s.Pools() == before);
}

TEST_F(ServiceTest, AsyncErrorIsReportedByTheNextCall) {
  Start();
  Scheduler s(*client_);
  v1::VerifyRequest bad = s.Verify(1, 0);
  bad.set_ordering(v1::ASYNC);
  bad.mutable_state_indices()->mutable_values()->set_values(0, 5000);
  const std::string before = s.Pools();
  // Enqueued: the error lives on the device until the next call.
  ASSERT_OK(s.session().Verify(bad).status());
  absl::Status next;
  for (int i = 0; i < 100; ++i) {
    next = s.session().Verify(s.Verify(1, 1)).status();
    // A call that reaches the device before the failed one has finished
    // fails on its own check (its prerequisite, layer 0, failed) and says
    // so; the asynchronous error is then reported by the call after it.
    if (absl::IsFailedPrecondition(next) &&
        absl::StrContains(next.message(), "earlier call 0 of the same step failed")) {
      continue;
    }
    if (!next.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ExpectError(next, absl::StatusCode::kOutOfRange, "an earlier asynchronous call failed");
  EXPECT_THAT(std::string(next.message()), HasSubstr("state_indices[0] = 5000"));
  // The step is failed: nothing of it is committed.
  ExpectError(s.session().Commit(s.Commit(1)).status(), absl::StatusCode::kFailedPrecondition,
              "step 1 failed");
  EXPECT_TRUE(s.Pools() == before);
  // A new step works.
  ASSERT_OK(s.VerifyAll(2));
  ASSERT_OK(s.session().Commit(s.Commit(2)).status());
}

// ---------------------------------------------------------------------------
// Steps.

TEST_F(ServiceTest, CommitAppliesOncePerStep) {
  Start();
  Scheduler s(*client_);
  ASSERT_OK(s.VerifyAll(1));
  const v1::CommitResponse first = ValueOrDie(s.session().Commit(s.Commit(1)));
  EXPECT_FALSE(first.replayed_from_cache());
  const std::string after_first = s.Pools();
  const v1::CommitResponse retry = ValueOrDie(s.session().Commit(s.Commit(1)));
  EXPECT_TRUE(retry.replayed_from_cache());
  EXPECT_TRUE(s.Pools() == after_first) << "a retried Commit replayed again";
  ExpectError(s.session().Commit(s.Commit(1, {2, 2, 2})).status(),
              absl::StatusCode::kFailedPrecondition, "already committed with different arguments");
  ExpectError(s.session().Verify(s.Verify(1, 0)).status(), absl::StatusCode::kFailedPrecondition,
              "step 1 is already committed");
}

TEST_F(ServiceTest, CommitOfAStepWhoseRecordsWereOverwritten) {
  Start();
  Scheduler s(*client_);
  ASSERT_OK(s.VerifyAll(1));
  ASSERT_OK(s.session().Verify(s.Verify(2, 0)).status());  // overwrites layer 0's records
  ExpectError(s.session().Commit(s.Commit(1)).status(), absl::StatusCode::kFailedPrecondition,
              "a later Verify overwrote the records of layers 0");
}

TEST_F(ServiceTest, ASecondDriverIsRefusedAndReadOnlyCallsStayOpen) {
  Start();
  Scheduler driver(*client_);
  absl::StatusOr<std::unique_ptr<Session>> second = client_->OpenSession("other", true);
  ExpectError(second.status(), absl::StatusCode::kFailedPrecondition, "test scheduler");
  Scheduler reader(*client_, /*drive=*/false);
  ExpectError(reader.session().Verify(reader.Verify(1, 0)).status(),
              absl::StatusCode::kFailedPrecondition, "does not drive");
  // A Session sends its calls under its own id, whatever the request says.
  v1::VerifyRequest borrowed = reader.Verify(1, 0);
  borrowed.set_session_id(driver.session().id());
  ExpectError(reader.session().Verify(borrowed).status(), absl::StatusCode::kFailedPrecondition,
              "does not drive");
  EXPECT_TRUE(client_->GetLayout().ok());
  EXPECT_TRUE(client_->GetStats().ok());
  EXPECT_TRUE(client_->ReadState(0, 1, false).ok());
  EXPECT_EQ(ValueOrDie(client_->Health("specstate.v1.SpecState")), "SERVING");
}

// A scheduler process runs `simulate` with `crash_flags` and is killed
// (SIGKILL) mid-step, after printing the pools' checksum; its session ends
// with its connection, a new scheduler takes over and finds the pools as the
// killed one left them, and runs correctly on them.
void ExpectTakeoverAfterKill(const std::string& address, client::Client& client,
                             const std::vector<std::string>& crash_flags) {
  std::vector<std::string> argv = {testing::RunfilePath("client/cli/specstatectl"),
                                   absl::StrCat("--server=", address), "simulate", "--steps=6",
                                   "--requests=3"};
  argv.insert(argv.end(), crash_flags.begin(), crash_flags.end());
  const testing::ProcessResult crashed = ValueOrDie(testing::RunProcess(argv));
  EXPECT_EQ(crashed.signal, SIGKILL);
  // A killed process cannot unlink its shared memory; the test does.
  const std::string prefix = absl::StrCat("specstate-client-", crashed.pid, "-");
  if (DIR* dir = opendir("/dev/shm")) {
    while (dirent* e = readdir(dir)) {
      if (absl::StartsWith(e->d_name, prefix)) shm_unlink(absl::StrCat("/", e->d_name).c_str());
    }
    closedir(dir);
  }
  const size_t at = crashed.output.find("CRASH POINT pools=");
  ASSERT_NE(at, std::string::npos) << crashed.output;
  const std::string checksum_at_crash = crashed.output.substr(at + 18, 16);

  // Its session ends with its connection; a new scheduler may drive at once.
  std::unique_ptr<Session> next;
  for (int i = 0; i < 100 && next == nullptr; ++i) {
    absl::StatusOr<std::unique_ptr<Session>> s = client.OpenSession("restarted", true);
    if (s.ok()) next = *std::move(s);
    else std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_NE(next, nullptr);
  EXPECT_EQ(ValueOrDie(client.ListRegions()).regions_size(), 0) << "the dead session's regions";
  // A read is queued after whatever the dead session left on the device.
  ASSERT_OK(client.ReadState(0, 1, false).status());
  // Exactly as the killed scheduler left them.
  auto memory = ValueOrDie(SharedMemory::Create(v1::CPU));
  auto pools = ValueOrDie(memory->MapPools(ValueOrDie(client.ExportPools())));
  const std::string now(pools->base(), pools->description().allocation_bytes());
  EXPECT_EQ(absl::StrFormat("%016x", Fnv1a(now)), checksum_at_crash);
  // Its half-done step is not the new driver's to commit.
  v1::CommitRequest c;
  c.set_step(4);
  c.mutable_num_accepted()->mutable_values()->add_values(1);
  ExpectError(next->Commit(c).status(), absl::StatusCode::kFailedPrecondition, "was not verified");
  ASSERT_OK(next->Close());
  // And the next scheduler runs correctly on the same pools.
  client::SimulationOptions o;
  o.steps = 5;
  o.requests = 3;
  const client::SimulationReport r = ValueOrDie(client::RunSimulation(client, o));
  EXPECT_TRUE(r.passed()) << client::FormatReport(r);
}

// Killed after sending step 3's Verify calls, before its Commit.
TEST_F(ServiceTest, KilledSchedulerLeavesThePoolsForTheNextOne) {
  Start();
  ExpectTakeoverAfterKill(server_->address(), *client_, {"--crash_after_verify_step=3"});
}

// Killed after sending step 3's Commit, which waits on a doorbell the dead
// scheduler never rings: releasing the wait must not run the Commit.
TEST_F(ServiceTest, KilledSchedulersWaitingCommitNeverRuns) {
  Start();
  ExpectTakeoverAfterKill(server_->address(), *client_,
                          {"--async", "--abandon_commit_at_step=3"});
}

// ---------------------------------------------------------------------------
// Regions and sessions.

TEST_F(ServiceTest, RegionRegistration) {
  Start();
  Scheduler s(*client_);
  auto buffer = ValueOrDie(s.memory().Allocate(4096));
  ExpectError(s.session().RegisterBuffer(*buffer, "acts").status(),
              absl::StatusCode::kAlreadyExists, "already registered");
  ExpectError(s.session().Unregister("missing"), absl::StatusCode::kNotFound, "no region");

  auto raw = [&](std::function<void(v1::RegisterRegionRequest*)> edit) {
    v1::RegisterRegionRequest r;
    r.set_session_id(s.session().id());
    r.set_name("raw");
    buffer->Describe(&r);
    edit(&r);
    grpc::ClientContext ctx;
    v1::RegisterRegionResponse response;
    return client::FromGrpc(client_->stub().RegisterRegion(&ctx, r, &response));
  };
  ExpectError(raw([](v1::RegisterRegionRequest* r) { r->set_shm_name("/specstate-no-such"); }),
              absl::StatusCode::kNotFound, "shm_open(/specstate-no-such)");
  ExpectError(raw([](v1::RegisterRegionRequest* r) { r->set_byte_size(1 << 20); }),
              absl::StatusCode::kOutOfRange, "does not fit");
  ExpectError(raw([](v1::RegisterRegionRequest* r) { r->set_offset_bytes(~uint64_t{0} - 15); }),
              absl::StatusCode::kOutOfRange, "does not fit");
  // Every element of a region at an odd offset would be misaligned.
  ExpectError(raw([](v1::RegisterRegionRequest* r) { r->set_offset_bytes(1); }),
              absl::StatusCode::kInvalidArgument, "offset_bytes = 1 must be a multiple of 16");
  ExpectError(raw([](v1::RegisterRegionRequest* r) { r->set_cuda_ipc_handle(std::string(64, 'x')); }),
              absl::StatusCode::kInvalidArgument, "CPU backend");
  ExpectError(raw([](v1::RegisterRegionRequest* r) { r->set_shm_name("no-slash"); }),
              absl::StatusCode::kInvalidArgument, "POSIX shared-memory name");
  ExpectError(raw([](v1::RegisterRegionRequest* r) { r->set_session_id("s99-nobody"); }),
              absl::StatusCode::kFailedPrecondition, "does not exist");
  ASSERT_OK(raw([](v1::RegisterRegionRequest*) {}));
  EXPECT_EQ(ValueOrDie(client_->ListRegions(s.session().id())).regions_size(), 2);
}

TEST_F(ServiceTest, UnregisterWaitsForWorkThatUsesTheRegion) {
  Start();
  Scheduler s(*client_);
  auto door = ValueOrDie(s.memory().Allocate(64));
  ValueOrDie(s.session().RegisterBuffer(*door, "door"));
  // An ASYNC Verify that waits for a doorbell pins "acts" and "door".
  v1::VerifyRequest v = s.Verify(1, 0);
  v.set_ordering(v1::ASYNC);
  v.mutable_wait()->mutable_doorbell()->set_region("door");
  v.mutable_wait()->mutable_doorbell()->set_value(1);
  ASSERT_OK(s.session().Verify(v).status());
  const v1::ListRegionsResponse listed = ValueOrDie(client_->ListRegions(s.session().id()));
  for (const v1::RegionInfo& r : listed.regions()) EXPECT_EQ(r.in_use(), 1) << r.name();

  std::future<absl::Status> unregister =
      std::async(std::launch::async, [&] { return s.session().Unregister("acts"); });
  EXPECT_EQ(unregister.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout)
      << "Unregister returned while enqueued work still uses the region";
  __atomic_store_n(static_cast<uint32_t*>(door->data()), 1u, __ATOMIC_RELEASE);  // ring
  ASSERT_EQ(unregister.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  ASSERT_OK(unregister.get());
}

TEST_F(ServiceTest, SessionEndReleasesItsRegionsAndItsWaits) {
  Start();
  {
    Scheduler s(*client_);
    auto door = ValueOrDie(s.memory().Allocate(64));
    ValueOrDie(s.session().RegisterBuffer(*door, "door"));
    // A wait that will never be rung: the session's end must release it.
    v1::VerifyRequest v = s.Verify(1, 0);
    v.set_ordering(v1::ASYNC);
    v.mutable_wait()->mutable_doorbell()->set_region("door");
    v.mutable_wait()->mutable_doorbell()->set_value(7);
    ASSERT_OK(s.session().Verify(v).status());
    EXPECT_EQ(ValueOrDie(client_->ListRegions()).regions_size(), 2);
  }  // the session closes here
  for (int i = 0; i < 100 && ValueOrDie(client_->ListRegions()).regions_size() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(ValueOrDie(client_->ListRegions()).regions_size(), 0);
  // The service's queue moved on: a new driver's work runs.
  Scheduler next(*client_);
  ASSERT_OK(next.VerifyAll(1));
  ASSERT_OK(next.session().Commit(next.Commit(1)).status());
}

TEST_F(ServiceTest, LeaseExpiryEndsASilentSession) {
  Start();
  // A raw session stream that never renews its 300 ms lease.
  grpc::ClientContext ctx;
  auto stream = client_->stub().Session(&ctx);
  v1::SessionRequest open;
  open.mutable_open()->set_client_name("silent");
  open.mutable_open()->set_drive(true);
  open.mutable_open()->set_lease_ms(300);
  ASSERT_TRUE(stream->Write(open));
  v1::SessionEvent event;
  ASSERT_TRUE(stream->Read(&event));
  auto memory = ValueOrDie(SharedMemory::Create(v1::CPU));
  auto buffer = ValueOrDie(memory->Allocate(4096));
  v1::RegisterRegionRequest r;
  r.set_session_id(event.session_id());
  r.set_name("b");
  buffer->Describe(&r);
  grpc::ClientContext rctx;
  v1::RegisterRegionResponse rr;
  ASSERT_TRUE(client_->stub().RegisterRegion(&rctx, r, &rr).ok());
  EXPECT_EQ(ValueOrDie(client_->ListRegions()).regions_size(), 1);
  // The server ends the stream when the lease runs out.
  EXPECT_FALSE(stream->Read(&event));
  const grpc::Status end = stream->Finish();
  EXPECT_EQ(end.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << end.error_message();
  EXPECT_EQ(ValueOrDie(client_->ListRegions()).regions_size(), 0);
  EXPECT_TRUE(client_->OpenSession("next", true).ok()) << "the expired driver still drives";
}

TEST_F(ServiceTest, ServerDownIsUnavailable) {
  absl::StatusOr<std::unique_ptr<Client>> c =
      Client::Connect("unix:///tmp/specstate-nobody-listens.sock", absl::Milliseconds(300));
  ExpectError(c.status(), absl::StatusCode::kUnavailable, "cannot connect");
}

TEST_F(ServiceTest, ServerRestartedMidSession) {
  char dir[] = "/tmp/ssrXXXXXX";  // outlives both servers
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string address = absl::StrCat("unix://", dir, "/s.sock");
  server_ = ValueOrDie(ServerProcess::Start({}, address));
  client_ = ValueOrDie(Client::Connect(address));
  auto session = ValueOrDie(client_->OpenSession("before", true));
  server_.reset();  // SIGTERM: the server goes away under the session
  v1::VerifyRequest v;
  v.set_step(1);
  ExpectError(session->Verify(v).status(), absl::StatusCode::kUnavailable, "");
  // A new server on the same socket knows nothing of the old session...
  server_ = ValueOrDie(ServerProcess::Start({}, address));
  absl::Status st;
  for (int i = 0; i < 50; ++i) {  // the channel reconnects on its own
    st = session->Verify(v).status();
    if (st.code() != absl::StatusCode::kUnavailable) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ExpectError(st, absl::StatusCode::kFailedPrecondition, "does not exist or has ended");
  // ...and the same client opens a new one.
  {
    Scheduler s(*client_);
    ASSERT_OK(s.VerifyAll(1));
    ASSERT_OK(s.session().Commit(s.Commit(1)).status());
  }
  server_.reset();
  rmdir(dir);
}

TEST_F(ServiceTest, SpecstatectlSubcommands) {
  Start();
  Scheduler s(*client_);
  ASSERT_OK(s.VerifyAll(1));
  ASSERT_OK(s.session().Commit(s.Commit(1)).status());
  const auto ctl = [&](std::vector<std::string> args) {
    std::vector<std::string> argv = {testing::RunfilePath("client/cli/specstatectl"),
                                     absl::StrCat("--server=", server_->address())};
    argv.insert(argv.end(), args.begin(), args.end());
    return ValueOrDie(testing::RunProcess(argv));
  };
  testing::ProcessResult r = ctl({"health"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("SERVING (specstate.v1.SpecState: SERVING)"));
  r = ctl({"layout"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("heads x dim      4 x 64"));
  r = ctl({"--json", "layout"});
  EXPECT_THAT(r.output, HasSubstr("\"num_layers\": 4"));
  r = ctl({"regions"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("acts"));
  EXPECT_THAT(r.output, HasSubstr("1 regions"));
  r = ctl({"state", "--layer=1", "--block=2"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("layer 1, block 2"));
  EXPECT_THAT(r.output, HasSubstr("recurrent  [4 x 64 x 64]"));
  r = ctl({"state", "--layer=9"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.output, HasSubstr("OUT_OF_RANGE: layer 9 is out of range"));
  r = ctl({"stats"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("steps verified 1, committed 1"));
  EXPECT_THAT(r.output, HasSubstr("driver: session"));
  r = ctl({"frobnicate"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr("unknown subcommand"));
  // simulate needs the driving seat, which the test's scheduler holds.
  r = ctl({"simulate", "--steps=1"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.output, HasSubstr("another session drives this service"));
}

TEST_F(ServiceTest, StatsCountTheSteps) {
  Start();
  Scheduler s(*client_);
  ASSERT_OK(s.VerifyAll(1));
  ASSERT_OK(s.session().Commit(s.Commit(1, {1, 2, 0})).status());
  const v1::Stats stats = ValueOrDie(client_->GetStats());
  EXPECT_EQ(stats.steps_verified(), 1u);
  EXPECT_EQ(stats.steps_committed(), 1u);
  EXPECT_EQ(stats.rows_verified(), 3u);
  EXPECT_EQ(stats.rows_committed(), 2u);  // row 2 accepted nothing
  EXPECT_EQ(stats.tokens_verified(), 6u);
  EXPECT_EQ(stats.tokens_committed(), 3u);
  EXPECT_THAT(stats.driver(), HasSubstr("test scheduler"));
  EXPECT_EQ(stats.health(), "SERVING");
  EXPECT_EQ(stats.warnings_size(), 0);  // MPS is the CUDA backend's concern
  EXPECT_FALSE(ValueOrDie(client_->GetLayout()).mps_client());
  bool saw_verify = false;
  for (const v1::RpcStats& r : stats.rpcs()) {
    if (r.method() == "Verify") {
      saw_verify = true;
      EXPECT_EQ(r.calls(), 4u);
      EXPECT_GT(r.latency().p50_us(), 0);
    }
  }
  EXPECT_TRUE(saw_verify);
}

TEST_F(ServiceTest, RefusesALayoutThatDoesNotFit) {
  const testing::ProcessResult r = ValueOrDie(testing::RunProcess(
      {testing::RunfilePath("server/specstated"), "--listen=unix:///tmp/specstate-never.sock",
       "--layers=4096", "--heads=64", "--head_dim=256", "--blocks=100000", "--backend=cpu"}));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.output, HasSubstr("RESOURCE_EXHAUSTED: the layout needs"));
  EXPECT_THAT(r.output, HasSubstr("lower num_blocks, max_rows or num_layers"));
}

TEST_F(ServiceTest, RefusesASubmitSpinOverItsLimit) {
  const testing::ProcessResult r = ValueOrDie(testing::RunProcess(
      {testing::RunfilePath("server/specstated"), "--listen=unix:///tmp/specstate-never.sock",
       "--submit_spin_us=100001", "--backend=cpu"}));
  EXPECT_EQ(r.exit_code, 2);  // a bad configuration, as a bad flag
  EXPECT_THAT(r.output, HasSubstr("submit_spin_us = 100001 is over the limit of 100000"));
}

}  // namespace
}  // namespace specstate
