// Commit mode FAST over a real socket (CPU backend): two specstated, one
// EAGER and one FAST (--fold_every=2), get the same calls with fresh random
// inputs every step. FAST is not bit-identical: its outputs and its states,
// once materialized, must be within the accuracy contract's reach of EAGER's
// (both within their budget of the float64 reference, FAST within twice the
// exact path's error: so within 3x the exact path's budget of each other).
// Its conv windows are EAGER's bit for bit (Commit compacts them in every
// mode). A block's pool bytes stay its checkpoint until its ring folds (at
// a Commit that leaves no room for the next window), a Flush or the end of
// the driving session materializes it (a ReadState shows the current state
// from a copy and changes nothing); a Flush with discard forgets the ring. Misuse the service can detect is refused
// with the field and the rows, nothing written; layouts FAST cannot serve are
// refused at start. FastSimulationTest runs `specstatectl simulate
// --commit_mode=fast`'s simulation, which judges FAST against a float64
// reference by the contract itself, over 1,000 steps.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <utility>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/lib/client.h"
#include "client/simulator/simulator.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/mode_fixture.h"
#include "tests/integration/server_process.h"
#include "tests/integration/test_scheduler.h"

namespace specstate {
namespace {

using client::Client;
using ::testing::HasSubstr;
using testing::ExpectError;
using testing::Scheduler;
using testing::ServerProcess;
using testing::ValueOrDie;

constexpr int kFoldEvery = 2;

// docs/semantics.md's budget of the kernels against float64 (fp32 arithmetic,
// 1e-5) plus one rounding of the stored dtype; FAST's contract is within 2x
// the exact path's error, so FAST and EAGER are within 3x of each other.
constexpr double kOutputTolerance = 3 * (1e-5 + 0x1p-8);   // bf16 outputs
constexpr double kStateTolerance = 3 * (1e-5 + 0x1p-24);  // fp32 states

float Bf16ToFloat(uint16_t bits) {
  const uint32_t u = uint32_t{bits} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t FloatToBf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

std::vector<double> Bf16Values(const std::string& bytes) {
  std::vector<double> v(bytes.size() / 2);
  for (size_t i = 0; i < v.size(); ++i) {
    uint16_t bits;
    std::memcpy(&bits, bytes.data() + 2 * i, 2);
    v[i] = Bf16ToFloat(bits);
  }
  return v;
}

std::vector<double> Fp32Values(const std::string& bytes) {
  std::vector<double> v(bytes.size() / 4);
  for (size_t i = 0; i < v.size(); ++i) {
    float f;
    std::memcpy(&f, bytes.data() + 4 * i, 4);
    v[i] = f;
  }
  return v;
}

// max(||got - want|| / ||want||, max|got - want| / max|want|).
double Error(const std::vector<double>& got, const std::vector<double>& want) {
  double diff = 0, norm = 0, max_diff = 0, max_want = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = got[i] - want[i];
    diff += d * d;
    norm += want[i] * want[i];
    max_diff = std::max(max_diff, std::fabs(d));
    max_want = std::max(max_want, std::fabs(want[i]));
  }
  if (std::isnan(diff)) return diff;
  return std::max(std::sqrt(diff / std::max(norm, 1e-300)), max_diff / std::max(max_want, 1e-300));
}

// The EAGER and the FAST service side by side (mode_fixture.h); fast_,
// fast_client_ and fast_server_ name the FAST one.
class FastCommitTest : public testing::ModePairTest {
 protected:
  void SetUp() override {
    seed_ = std::random_device()();
    seed_drawn_ = true;
    rng_.seed(seed_);
    StartPair({"--backend=cpu", "--commit_mode=eager"},
              {"--backend=cpu", "--commit_mode=fast", absl::StrCat("--fold_every=", kFoldEvery)},
              "FAST");
    fast_server_ = mode_server_.get();
    fast_client_ = mode_client_.get();
    fast_ = mode_.get();
    layers_ = eager_->layout().num_layers();
    q_ = eager_->layout().num_spec() + 1;
    capacity_ = kFoldEvery * q_;
    // A prefill: the same random states in blocks 1..3 of both services.
    std::string pools = eager_->Pools();
    for (int l = 0; l < layers_; ++l) {
      for (const v1::PoolView& view : views_.pools()) {
        if (view.layer() != l || view.kind() != "recurrent") continue;
        const uint64_t block_bytes = view.byte_size() / view.shape(0);
        for (int b = 1; b <= Scheduler::kRows; ++b) {
          for (uint64_t i = 0; i < block_bytes / 4; ++i) {
            const float x = std::normal_distribution<float>(0.0f, 0.1f)(rng_);
            std::memcpy(&pools[view.offset_bytes() + b * block_bytes + 4 * i], &x, 4);
          }
        }
      }
    }
    eager_->RestorePools(pools);
    fast_->RestorePools(pools);
  }

  // Fresh random activations, the same in both services' regions.
  void DrawInputs() {
    const int64_t elems = int64_t{Scheduler::kRows} * Scheduler::kTokensPerRow *
                          eager_->layout().num_heads() * eager_->layout().head_dim();
    for (int which : {0, 1, 2, 3, 5}) {  // q, k, v, g, beta (4: the outputs)
      const int64_t n = which == 5 ? elems / eager_->layout().head_dim() : elems;
      std::vector<uint16_t> bits(n);
      for (uint16_t& b : bits) b = FloatToBf16(std::normal_distribution<float>(0.0f, 1.0f)(rng_));
      std::memcpy(eager_->Act(which), bits.data(), n * 2);
      std::memcpy(fast_->Act(which), bits.data(), n * 2);
    }
  }

  // Every layer verified on both services, outputs compared row by row.
  void VerifyBoth(uint64_t step) {
    const int per_row = Scheduler::kTokensPerRow * eager_->layout().num_heads() *
                        eager_->layout().head_dim() * 2;
    for (int l = 0; l < layers_; ++l) {
      ASSERT_NO_FATAL_FAILURE(VerifyLayerOnBoth(step, l));
      const std::string eager = eager_->Outputs(), fast = fast_->Outputs();
      for (int n = 0; n < Scheduler::kRows; ++n) {
        const double err = Error(Bf16Values(fast.substr(n * per_row, per_row)),
                                 Bf16Values(eager.substr(n * per_row, per_row)));
        EXPECT_LT(err, kOutputTolerance)
            << "step " << step << ", layer " << l << ", row " << n << ": FAST's outputs";
        max_output_error_ = std::max(max_output_error_, err);
      }
    }
  }

  // A step on both services: Verify of every layer, `between` (FAST only),
  // then Commit of `accepted`; the conv windows compared bit for bit.
  // Returns the rings that folded, as the Commit's schedule says (tokens + Q
  // > R): those blocks' states are near EAGER's, every other block's bytes
  // are the checkpoint they held before the Commit.
  int Step(uint64_t step, const std::vector<int>& accepted,
           const std::function<void()>& between = nullptr) {
    DrawInputs();
    VerifyBoth(step);
    if (between) between();
    const std::string before = fast_->Pools();
    CommitOnBoth(step, accepted);
    int folded = 0;
    const std::string after = fast_->Pools(), eager = eager_->Pools();
    for (int n = 0; n < Scheduler::kRows; ++n) {
      const int block = 1 + n;
      for (int l = 0; l < layers_; ++l) {
        int& tokens = ring_tokens_[{l, block}];
        tokens += std::min(std::max(accepted[n], 0), Scheduler::kTokensPerRow);
        const bool fold = tokens + q_ > capacity_;
        if (fold) {
          tokens = 0;
          ++folded;
        }
        EXPECT_EQ(Block(after, l, block, "conv"), Block(eager, l, block, "conv"))
            << "step " << step << ", layer " << l << ", block " << block << ": conv window";
        if (fold) {
          ExpectStateNear(after, eager, l, block, absl::StrCat("step ", step, ", folded"));
        } else {
          EXPECT_EQ(Block(after, l, block), Block(before, l, block))
              << "step " << step << ", layer " << l << ", block " << block
              << ": written without a fold";
        }
      }
    }
    return folded;
  }

  void ExpectStateNear(const std::string& fast, const std::string& eager, int layer, int block,
                       const std::string& when) {
    const double err = Error(Fp32Values(Block(fast, layer, block)),
                             Fp32Values(Block(eager, layer, block)));
    EXPECT_LT(err, kStateTolerance) << when << ": layer " << layer << ", block " << block;
    max_state_error_ = std::max(max_state_error_, err);
  }

  void ExpectAllStatesNear(const std::string& when) {
    const std::string fast = fast_->Pools(), eager = eager_->Pools();
    for (int l = 0; l < layers_; ++l) {
      for (int b = 1; b <= Scheduler::kRows; ++b) ExpectStateNear(fast, eager, l, b, when);
    }
  }

  std::vector<int> RandomAccepted() {
    std::vector<int> a;
    for (int n = 0; n < Scheduler::kRows; ++n) {
      a.push_back(std::uniform_int_distribution<int>(0, Scheduler::kTokensPerRow + 1)(rng_));
    }
    return a;
  }

  ServerProcess* fast_server_ = nullptr;
  Client* fast_client_ = nullptr;
  Scheduler* fast_ = nullptr;
  std::mt19937 rng_;
  int layers_ = 0, q_ = 0, capacity_ = 0;
  // Each (layer, block)'s ring tokens, as the Commits and Flushes left them.
  std::map<std::pair<int, int>, int> ring_tokens_;
  double max_output_error_ = 0, max_state_error_ = 0;
};

TEST_F(FastCommitTest, TheLayoutSaysSo) {
  const v1::Layout eager = eager_->layout(), fast = fast_->layout();
  EXPECT_EQ(eager.commit_mode(), v1::EAGER);
  EXPECT_EQ(eager.fold_every(), 0);
  EXPECT_EQ(fast.commit_mode(), v1::FAST);
  EXPECT_EQ(fast.fold_every(), kFoldEvery);
  // record_bytes: the rings (raw k bf16, u and log-decay fp32, a cursor
  // {tokens, candidates, arrivals} of 12 bytes a block), every layer, each
  // buffer 256-byte aligned.
  const int64_t tokens = int64_t{fast.num_blocks()} * capacity_;
  const int64_t hk = int64_t{fast.num_heads()} * fast.head_dim();
  const auto align = [](int64_t b) { return (b + 255) / 256 * 256; };
  EXPECT_EQ(fast.record_bytes(), fast.num_layers() * (align(tokens * hk * 2) + align(tokens * hk * 4) +
                                                     align(tokens * hk * 4) +
                                                     align(int64_t{fast.num_blocks()} * 12)));
  const std::string layout = CtlLayout();
  EXPECT_THAT(layout,
              HasSubstr("commit mode      FAST (fold every 2 steps: rings of 8 tokens a block)"));
  EXPECT_THAT(layout, HasSubstr(absl::StrCat("rings ", fast.record_bytes())));
}

TEST_F(FastCommitTest, ManyStepsStayWithinTheContractOfEager) {
  int folds = 0;
  for (uint64_t step = 1; step <= 40; ++step) {
    folds += Step(step, RandomAccepted());
    if (HasFailure()) return;
    if (step % 10 == 0) {
      ASSERT_TRUE(fast_->session().Flush(v1::FlushRequest()).ok());
      ring_tokens_.clear();
      ExpectAllStatesNear(absl::StrCat("step ", step, ", after a Flush of every block"));
    }
  }
  EXPECT_GT(folds, 10 * layers_) << "the rings seldom folded at Commit";
  std::printf("40 steps (seed %u): %d folds; FAST against EAGER: outputs %.3g, states %.3g "
              "(bounds %.3g, %.3g)\n",
              seed_, folds, max_output_error_, max_state_error_, kOutputTolerance,
              kStateTolerance);
}

TEST_F(FastCommitTest, ReadStateFlushAndDiscard) {
  // One step accepting one token a row: nothing folds (1 + Q <= R).
  ASSERT_EQ(Step(1, {1, 1, 1}), 0);
  const std::string checkpoints = fast_->Pools();
  // ReadState shows block 2's current state in layer 1, its ring folded into
  // a copy: the pool (and the ring) keep every byte.
  const v1::ReadStateResponse read = ValueOrDie(fast_client_->ReadState(1, 2, true));
  EXPECT_EQ(fast_->Pools(), checkpoints) << "ReadState changed a pool byte";
  std::string values(read.recurrent().values_size() * 4, '\0');
  std::memcpy(&values[0], read.recurrent().values().data(), values.size());
  EXPECT_EQ(read.recurrent().checksum(), testing::Fnv1a(values));
  EXPECT_LT(Error(Fp32Values(values), Fp32Values(Block(eager_->Pools(), 1, 2))), kStateTolerance)
      << "ReadState's values are not near EAGER's state";
  // They are the bytes a Flush of the block then leaves in the pool.
  v1::FlushRequest flush_one;
  flush_one.mutable_blocks()->mutable_values()->add_values(2);
  flush_one.set_layer(1);
  ASSERT_TRUE(fast_->session().Flush(flush_one).ok());
  ring_tokens_[{1, 2}] = 0;
  EXPECT_EQ(Block(fast_->Pools(), 1, 2), values) << "ReadState's bytes are not the Flush's";
  // A ReadState between a step's Verify and its Commit changes nothing
  // either: the Commit succeeds and agrees.
  Step(2, {2, 2, 2}, [&] {
    const std::string pools = fast_->Pools();
    ValueOrDie(fast_client_->ReadState(0, 1, true));
    EXPECT_EQ(fast_->Pools(), pools) << "ReadState between Verify and Commit changed a pool byte";
  });
  if (HasFailure()) return;
  ASSERT_TRUE(fast_->session().Flush(v1::FlushRequest()).ok());
  ring_tokens_.clear();
  ExpectAllStatesNear("after a step with a ReadState between its Verify and its Commit");
  // Flush of blocks 1 and 2 (null and repeated entries skipped).
  ASSERT_EQ(Step(3, {1, 1, 1}), 0);
  const std::string before_flush = fast_->Pools();
  v1::FlushRequest flush;
  for (int b : {1, 2, 2, 0}) flush.mutable_blocks()->mutable_values()->add_values(b);
  ASSERT_TRUE(fast_->session().Flush(flush).ok());
  const std::string after_flush = fast_->Pools();
  for (int l = 0; l < layers_; ++l) {
    for (int b : {1, 2}) ExpectStateNear(after_flush, eager_->Pools(), l, b, "after its Flush");
    EXPECT_EQ(Block(after_flush, l, 3), Block(before_flush, l, 3))
        << "a Flush of blocks 1 and 2 wrote block 3";
  }
  // Discard: block 3 forgets its ring (it keeps its checkpoint), and a later
  // Flush of everything does not bring the tokens back.
  v1::FlushRequest discard;
  discard.mutable_blocks()->mutable_values()->add_values(3);
  discard.set_discard(true);
  ASSERT_TRUE(fast_->session().Flush(discard).ok());
  ASSERT_TRUE(fast_->session().Flush(v1::FlushRequest()).ok());
  const std::string after_discard = fast_->Pools();
  for (int l = 0; l < layers_; ++l) {
    EXPECT_EQ(Block(after_discard, l, 3), Block(before_flush, l, 3))
        << "block 3 got its discarded tokens";
  }
}

TEST_F(FastCommitTest, TheEndOfTheDriverMaterializesEverything) {
  for (uint64_t step = 1; step <= 3; ++step) {
    Step(step, {1, 1, 1});
    if (HasFailure()) return;
  }
  // 3 tokens a ring, no fold yet (3 + Q <= 8): every block is a checkpoint.
  EXPECT_NE(fast_->Pools(), eager_->Pools());
  ASSERT_TRUE(fast_->session().Close().ok());
  ASSERT_TRUE(fast_client_->GetStats().ok());
  bool current = false;
  for (int i = 0; i < 100 && !current; ++i) {
    const std::string fast = fast_->Pools(), eager = eager_->Pools();
    current = true;
    for (int l = 0; l < layers_ && current; ++l) {
      for (int b = 1; b <= Scheduler::kRows; ++b) {
        current = current && Error(Fp32Values(Block(fast, l, b)),
                                   Fp32Values(Block(eager, l, b))) < kStateTolerance;
      }
    }
    if (!current) absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_TRUE(current) << "the pools are not current after the driving session ended";
}

TEST_F(FastCommitTest, MisuseIsRefusedAndChangesNothing) {
  Step(1, {1, 1, 1});
  const std::string pools = fast_->Pools();
  // Two rows verifying from one block: refused under FAST (their candidates
  // would share the block's ring), while EAGER serves it.
  v1::VerifyRequest shared = fast_->Verify(2, 0);
  shared.mutable_state_indices()->mutable_values()->set_values(1, 1);
  ExpectError(fast_->session().Verify(shared).status(), absl::StatusCode::kInvalidArgument,
              "In Verify of layer 0: state_indices[1]: rows 0 and 1 both verify from block 1");
  EXPECT_EQ(fast_->Pools(), pools);
  v1::VerifyRequest eager_shared = eager_->Verify(2, 0);
  eager_shared.mutable_state_indices()->mutable_values()->set_values(1, 1);
  EXPECT_TRUE(eager_->session().Verify(eager_shared).ok());
  // A Commit before every layer's Verify.
  ASSERT_TRUE(fast_->session().Verify(fast_->Verify(3, 0)).ok());
  ExpectError(fast_->session().Commit(fast_->Commit(3)).status(),
              absl::StatusCode::kFailedPrecondition, "not verified");
  // A block list past the pool; a layer past the layout.
  v1::FlushRequest past;
  past.mutable_blocks()->mutable_values()->add_values(1);
  past.mutable_blocks()->mutable_values()->add_values(fast_->layout().num_blocks());
  ExpectError(fast_->session().Flush(past).status(), absl::StatusCode::kOutOfRange,
              absl::StrCat("In Flush: blocks[1] = ", fast_->layout().num_blocks(),
                           " is out of range"));
  v1::FlushRequest layer;
  layer.set_layer(layers_);
  ExpectError(fast_->session().Flush(layer).status(), absl::StatusCode::kOutOfRange,
              absl::StrCat("layer ", layers_, " is out of range"));
  EXPECT_EQ(fast_->Pools(), pools);
  // Flush writes the pools: only the driving session may.
  std::unique_ptr<client::Session> reader =
      ValueOrDie(fast_client_->OpenSession("reader", /*drive=*/false));
  ExpectError(reader->Flush(v1::FlushRequest()).status(), absl::StatusCode::kFailedPrecondition,
              "drive");
  EXPECT_EQ(fast_->Pools(), pools);
}

// The config file selects the mode as the flags do.
TEST(FastCommitStartTest, AConfigFileSelectsFast) {
  const std::string path = ::testing::TempDir() + "/fast.json";
  {
    std::FILE* f = std::fopen(path.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs(R"({"layout": {"backend": "CPU", "commitMode": "FAST", "foldEvery": 3}})", f);
    std::fclose(f);
  }
  const std::unique_ptr<ServerProcess> server =
      ValueOrDie(ServerProcess::Start({"--config=" + path}));
  const std::unique_ptr<Client> client = ValueOrDie(Client::Connect(server->address()));
  const v1::Layout layout = ValueOrDie(client->GetLayout());
  EXPECT_EQ(layout.commit_mode(), v1::FAST);
  EXPECT_EQ(layout.fold_every(), 3);
  EXPECT_THAT(server->Log(), HasSubstr("commit mode FAST (fold every 3)"));
}

// Layouts commit mode FAST cannot serve: refused at start, naming the bound.
TEST(FastCommitStartTest, LayoutsFastCannotServeAreRefused) {
  const auto start = [](std::vector<std::string> flags) {
    flags.insert(flags.begin(), {testing::RunfilePath("server/specstated"),
                                 "--listen=unix:///tmp/specstate-never.sock"});
    return ValueOrDie(testing::RunProcess(flags));
  };
  testing::ProcessResult r = start({"--backend=cpu", "--commit_mode=fast", "--num_spec=8"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr("FAST verifies at most 8 tokens a row (num_spec <= 7)"));
  r = start({"--backend=cpu", "--commit_mode=fast", "--fold_every=65"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr("layout.fold_every = 65 must be in [1, 64] (0: 4): the rings "
                                  "hold fold_every * Q tokens a block, at most 256 (Q = 4)"));
  r = start({"--backend=cpu", "--commit_mode=fast", "--fold_every=-1"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr("layout.fold_every = -1 must be in [1, 64]"));
  r = start({"--backend=cpu", "--fold_every=4"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr("layout.fold_every = 4 is for commit_mode FAST only"));
  // (Kept pools are no longer refused: restart_test's FAST drills.)
}

// The simulator's verdict in FAST: outputs and materialized states within the
// contract of the float64 reference, conv windows bit for bit.
class FastSimulationTest : public testing::ModeSimulationTest {
 protected:
  FastSimulationTest() : ModeSimulationTest("fast", {}) {}
};

void ExpectFastPass(const client::SimulationReport& r) {
  EXPECT_TRUE(r.passed()) << client::FormatReport(r);
  EXPECT_TRUE(r.fast);
  EXPECT_GT(r.pending_checked, 0u) << client::FormatReport(r);
  EXPECT_GT(r.materialized_by_flush, 0u) << client::FormatReport(r);
  EXPECT_GT(r.fast_states_checked, 0u) << client::FormatReport(r);
  for (int q = 0; q < 4; ++q) EXPECT_GT(r.exact_error[q], 0.0) << "quantity " << q;
}

TEST_F(FastSimulationTest, AThousandStepsWithinTheContract) {
  client::SimulationOptions o;
  o.steps = 1000;
  o.requests = 4;
  o.bound_inputs = true;
  const client::SimulationReport r =
      Simulate({"--fold_every=4", "--layers=2", "--activation_dtype=fp32", "--blocks=64"}, o);
  ExpectFastPass(r);
  EXPECT_EQ(r.fold_every, 4);
  EXPECT_GT(r.materialized_by_read, 0u) << client::FormatReport(r);
  EXPECT_GT(r.discarded, 0u) << client::FormatReport(r);
}

TEST_F(FastSimulationTest, AlignModeBf16StateAsync) {
  client::SimulationOptions o;
  o.steps = 150;
  o.requests = 4;
  o.async = true;
  o.batch = true;
  const client::SimulationReport r =
      Simulate({"--fold_every=2", "--cache_mode=align", "--mamba_block_size=4",
                "--state_dtype=bf16", "--kda_gate=plain", "--blocks=900"},
               o);
  ExpectFastPass(r);
  EXPECT_GT(r.boundary_states, 0u) << "no row crossed a block boundary";
}

TEST_F(FastSimulationTest, GatedDeltaNet) {
  client::SimulationOptions o;
  o.steps = 150;
  o.requests = 4;
  ExpectFastPass(
      Simulate({"--fold_every=16", "--kind=gdn", "--heads=2", "--value_heads=4"}, o));
}

TEST_F(FastSimulationTest, APlantedCorruptionFailsTheVerdict) {
  client::SimulationOptions o;
  o.steps = 12;
  o.requests = 3;
  o.corrupt_after_step = 4;
  const client::SimulationReport r = Simulate({"--fold_every=4"}, o);
  EXPECT_FALSE(r.passed()) << client::FormatReport(r);
  EXPECT_THAT(r.first_mismatch, HasSubstr("the accuracy contract is broken"));
}

// A NaN in the state makes FAST's outputs NaN: the verdict must fail (a
// running maximum that drops NaNs passed it).
TEST_F(FastSimulationTest, APlantedNaNFailsTheVerdict) {
  client::SimulationOptions o;
  o.steps = 12;
  o.requests = 3;
  o.corrupt_after_step = 4;
  o.corrupt_with_nan = true;
  const client::SimulationReport r = Simulate({"--fold_every=4"}, o);
  EXPECT_FALSE(r.passed()) << client::FormatReport(r);
  EXPECT_THAT(r.first_mismatch, HasSubstr("the accuracy contract is broken"));
  EXPECT_THAT(r.first_mismatch, HasSubstr("nan"));
}

TEST_F(FastSimulationTest, TheModeIsChecked) {
  ExpectTheModeIsChecked({"--commit_mode=deferred"},
                         "the service runs commit mode DEFERRED, not fast");
}

}  // namespace
}  // namespace specstate
