// What a call takes from the rest of its step, on every backend: the step's
// cancellation word, the CPU service's input-fault word and the statuses of
// the step's earlier calls (Prerequisites), each of which stops the call
// before it writes anything; and the snapshot of the indices, which the
// step's first Verify copies and a later one is checked against.
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/device_status.h"
#include "kernels/kda_args.h"
#include "kernels/testing/backend_memory.h"
#include "kernels/testing/kernel_harness.h"

namespace specstate {
namespace kernels {
namespace testing {
namespace {

using ::testing::HasSubstr;

// Three rows of different lengths, each from its own checkpoint: the step
// of every test here.
StepSpec ThreeRowSpec() {
  StepSpec spec;
  spec.tokens = {2, 3, 1};
  spec.sources = {1, 2, 3};
  spec.num_accepted = {2, 3, 1};
  return spec;
}

// The step's cancellation word (Prerequisites::cancelled): holding the call's
// generation, Verify and Commit fail CANCELLED and write nothing; holding
// another step's, the commit runs.
TEST_P(KdaKernelsTest, CancelledStepRunsNothing) {
  Step s = MakeStep(ThreeRowSpec());
  StockAndVerifyAll(s);
  if (HasFatalFailure()) return;
  BackendBuffer word = Must(BackendBuffer::Allocate(backend(), sizeof(uint32_t)), "word");
  const uint32_t generation = 0x9e3779b9u;
  ASSERT_TRUE(word.Upload(&generation, sizeof(generation)).ok());
  Prerequisites cancelled;
  cancelled.cancelled = word.As<uint32_t>();
  cancelled.generation = generation;
  const Snapshot before = TakeSnapshot(s);
  {
    const CallResult r = RunVerify(s, 0, cancelled);
    ASSERT_TRUE(r.launch.ok()) << r.launch;
    EXPECT_EQ(r.device.code(), absl::StatusCode::kCancelled) << r.device;
    EXPECT_THAT(std::string(r.device.message()), HasSubstr("its step was cancelled"));
  }
  {
    const CallResult r = RunCommit(s, cancelled);
    ASSERT_TRUE(r.launch.ok()) << r.launch;
    EXPECT_EQ(r.device.code(), absl::StatusCode::kCancelled) << r.device;
  }
  ExpectSameBytes(before, TakeSnapshot(s));
  Prerequisites another_step = cancelled;
  another_step.generation = generation + 1;
  ASSERT_TRUE(CallOk(RunCommit(s, another_step)));
  ExpectCommitMatchesStock(s, before);
}

// The input-fault word (Prerequisites::input_fault, set by the CPU service's
// SIGBUS handler when a region the call read was truncated under it): the
// call fails DATA_LOSS after its loads and writes nothing; a clear word
// lets the same call through.
TEST_P(KdaKernelsTest, InputFaultRunsNothing) {
  Step s = MakeStep(ThreeRowSpec());
  StockAndVerifyAll(s);
  if (HasFatalFailure()) return;
  BackendBuffer word = Must(BackendBuffer::Allocate(backend(), sizeof(uint32_t)), "word");
  const uint32_t faulted = 1;
  ASSERT_TRUE(word.Upload(&faulted, sizeof(faulted)).ok());
  Prerequisites fault;
  fault.input_fault = word.As<uint32_t>();
  const Snapshot before = TakeSnapshot(s);
  for (const CallResult& r : {RunVerify(s, 0, fault), RunCommit(s, fault)}) {
    ASSERT_TRUE(r.launch.ok()) << r.launch;
    EXPECT_EQ(r.device.code(), absl::StatusCode::kDataLoss) << r.device;
    EXPECT_THAT(std::string(r.device.message()), HasSubstr("reading its inputs faulted"));
  }
  ExpectSameBytes(before, TakeSnapshot(s));
  const uint32_t clear = 0;
  ASSERT_TRUE(word.Upload(&clear, sizeof(clear)).ok());
  ASSERT_TRUE(CallOk(RunCommit(s, fault)));
  ExpectCommitMatchesStock(s, before);
}

// Verify copies the caller's indices to its snapshot (dense, where the
// service keeps the step's), which its later checks and its kernel read
// (every other Verify test checks the outputs computed from it); a call
// with neither a snapshot nor expected values is refused.
TEST_P(KdaKernelsTest, VerifyCopiesItsIndicesToTheSnapshot) {
  Step s = MakeStep(ThreeRowSpec());
  StockAndVerifyAll(s);
  if (HasFatalFailure()) return;
  CallData cd;
  VerifyArgs a = VerifyArgsFor(s, 0, &cd);
  const size_t n = cd.tensors.size();
  VerifyArgs none = a;
  none.snapshot_query_start_loc = nullptr;
  none.snapshot_state_indices = nullptr;
  const absl::Status refused = kernels_->Verify(none, stream());
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("one of the two pairs"));
  VerifyArgs half = a;
  half.snapshot_state_indices = nullptr;
  EXPECT_EQ(kernels_->Verify(half, stream()).code(), absl::StatusCode::kInvalidArgument);
  a.status_mirror = ZeroedMirror();
  ASSERT_TRUE(CallOk(Finish(kernels_->Verify(a, stream()), "Verify", s)));
  EXPECT_EQ(FromBytes<int32_t>(cd.tensors[n - 2].Read()), s.qsl);
  EXPECT_EQ(FromBytes<int32_t>(cd.tensors[n - 1].Read()), s.sources);
}

// A later Verify of a step checks its query_start_loc and state_indices
// against the step's first call's (VerifyArgs::expected_*): an element that
// differs fails INVALID_ARGUMENT naming it and both values, and writes nothing.
TEST_P(KdaKernelsTest, VerifyChecksIndicesAgainstTheStepsFirstCall) {
  Step s = MakeStep(ThreeRowSpec());
  StockAndVerifyAll(s);
  if (HasFatalFailure()) return;
  const Snapshot before = TakeSnapshot(s);
  const int rows = static_cast<int>(s.sources.size());
  struct Case {
    int qsl_element;  // -1: none differs
    int source_row;   // -1: none differs
  };
  // The last case passes: it runs after the snapshot comparison.
  const std::vector<Case> cases = {
      {0, -1}, {rng_->Int(1, rows), -1}, {-1, rng_->Int(0, rows - 1)}, {-1, -1}};
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat("query_start_loc element ", c.qsl_element, ", state_indices row ",
                              c.source_row));
    std::vector<int32_t> first_qsl = s.qsl;
    std::vector<int32_t> first_sources = s.sources;
    std::string named;
    if (c.qsl_element >= 0) {
      first_qsl[c.qsl_element] += rng_->Int(1, 3);
      named = absl::StrCat("query_start_loc[", c.qsl_element, "] = ", s.qsl[c.qsl_element],
                           " differs from ", first_qsl[c.qsl_element]);
    }
    if (c.source_row >= 0) {
      first_sources[c.source_row] += rng_->Int(1, 3);
      named = absl::StrCat("state_indices[", c.source_row, "] = ", s.sources[c.source_row],
                           " differs from ", first_sources[c.source_row]);
    }
    CallData cd;
    VerifyArgs a = VerifyArgsFor(s, 0, &cd);
    a.snapshot_query_start_loc = nullptr;
    a.snapshot_state_indices = nullptr;
    a.expected_query_start_loc = Ints(&cd, first_qsl);
    a.expected_state_indices = Ints(&cd, first_sources);
    a.status_mirror = ZeroedMirror();
    const CallResult r = Finish(kernels_->Verify(a, stream()), "Verify", s);
    if (named.empty()) {
      ExpectSameBytes(before, TakeSnapshot(s));
      EXPECT_TRUE(CallOk(r));
      continue;
    }
    ASSERT_TRUE(r.launch.ok()) << r.launch;
    EXPECT_EQ(r.device.code(), absl::StatusCode::kInvalidArgument) << r.device;
    EXPECT_THAT(std::string(r.device.message()), HasSubstr(named));
  }
}

// An earlier call of the step that failed on the device
// (Prerequisites::statuses): Verify and Commit run nothing and name the
// lowest failed call, also when a row of their own is bad (the checks load
// the prerequisites and the rows together, and the prerequisites decide).
TEST_P(KdaKernelsTest, FailedEarlierCallStopsTheStep) {
  Step s = MakeStep(ThreeRowSpec());
  StockAndVerifyAll(s);
  if (HasFatalFailure()) return;
  constexpr int kCalls = 7;
  std::vector<DeviceStatus> statuses(kCalls, DeviceStatus{});
  const int lowest = rng_->Int(2, 4);
  statuses[lowest].failed = 1;
  statuses[kCalls - 1].failed = 1;
  BackendBuffer earlier =
      Must(BackendBuffer::Allocate(backend(), sizeof(DeviceStatus) * kCalls), "statuses");
  ASSERT_TRUE(earlier.Upload(statuses.data(), sizeof(DeviceStatus) * kCalls).ok());
  Prerequisites failed_earlier;
  failed_earlier.statuses = earlier.As<DeviceStatus>();
  failed_earlier.count = kCalls;
  const Snapshot before = TakeSnapshot(s);
  const std::string named = absl::StrCat("earlier call ", lowest, " of the same step failed");
  for (bool bad_row : {false, true}) {
    SCOPED_TRACE(bad_row ? "and a bad row" : "rows valid");
    const std::vector<int32_t> sources = s.sources;
    if (bad_row) s.sources[1] = static_cast<int32_t>(s.num_blocks);  // past the pool
    const CallResult r = RunVerify(s, 0, failed_earlier);
    s.sources = sources;
    ASSERT_TRUE(r.launch.ok()) << r.launch;
    EXPECT_EQ(r.device.code(), absl::StatusCode::kFailedPrecondition) << r.device;
    EXPECT_THAT(std::string(r.device.message()), HasSubstr(named));
  }
  const CallResult r = RunCommit(s, failed_earlier);
  ASSERT_TRUE(r.launch.ok()) << r.launch;
  EXPECT_EQ(r.device.code(), absl::StatusCode::kFailedPrecondition) << r.device;
  EXPECT_THAT(std::string(r.device.message()), HasSubstr(named));
  ExpectSameBytes(before, TakeSnapshot(s));
}

}  // namespace
}  // namespace testing
}  // namespace kernels
}  // namespace specstate
