// A scheduler simulator: drives a running specstated the way a decode loop
// does and checks every state it commits against its own copy of the stock
// spec path.
//
// Each step, for every request: random drafts (1..Q tokens) and activations
// for every layer, the scheduler's conv update done on the exported conv
// pool (docs/semantics.md's contract), Verify on every layer, random accepted
// counts, Commit, and in align mode RecordStateBlocks; requests finish and
// new ones arrive (their initial state written into the pools, as a prefill
// would). Beside it the simulator runs the stock kernel on its own memory
// (1 + num_spec blocks per request, reading column acc - 1 as vLLM's stock
// path does) and compares, bit for bit: every Verify output with the stock
// outputs, every committed recurrent state (and align-mode boundary state)
// with the stock state at its column, every conv window the next step reads,
// and RecordStateBlocks' outputs.
//
//   SimulationOptions options;
//   options.steps = 50;
//   absl::StatusOr<SimulationReport> report = RunSimulation(*client, options);
//   std::cout << FormatReport(*report);  // report->passed()
#ifndef SPECSTATE_CLIENT_SIMULATOR_H_
#define SPECSTATE_CLIENT_SIMULATOR_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "client/client.h"

namespace specstate {
namespace client {

struct SimulationProgress {
  int step = 0;
  int steps = 0;
  uint64_t comparisons = 0;
  uint64_t mismatches = 0;
};

struct SimulationOptions {
  int steps = 20;
  int requests = 4;  // rows per step (<= max_rows)
  uint64_t seed = 1;
  // Verify and Commit ASYNC, ordered by doorbells; every Verify of a step is
  // sent before its inputs are written.
  bool async = false;
  // With `async`, order with CUDA interprocess events instead of doorbells
  // (CUDA backend): the inputs' event is recorded before the Verify calls.
  bool events = false;
  // Send each step's Verify calls in one SubmitStep call.
  bool batch = false;
  // Bind every layer's tensors once (BindVerifyInputs, even layers with the
  // step's query_start_loc and state_indices, odd layers without) and send
  // Verify calls that carry only their counts.
  bool bound_inputs = false;
  double finish_probability = 0.15;
  // After this step's checks, flip one bit of a committed state in the
  // service's pool through the exported handle (tests of the verdict).
  int corrupt_after_step = -1;
  // Crash tests: after sending the Verify calls of this step (before its
  // Commit), print "CRASH POINT pools=<FNV-1a of every pool byte>" and die by
  // SIGKILL, as a scheduler killed mid-step would.
  int crash_after_verify_step = -1;
  // Crash tests: send this step's Commit ASYNC, waiting on a doorbell that is
  // never rung, then print the CRASH POINT and die as above. The service must
  // not run that Commit when it releases the wait at the session's end.
  int abandon_commit_at_step = -1;
  std::function<void(const SimulationProgress&)> progress;
};

struct LatencySummary {
  uint64_t count = 0;
  double p50_us = 0;
  double p99_us = 0;
  double mean_us = 0;
};

struct SimulationReport {
  std::string backend;
  int steps = 0;
  int layers = 0;
  uint64_t rows = 0;
  uint64_t null_rows = 0;
  uint64_t tokens_verified = 0;
  uint64_t tokens_accepted = 0;
  uint64_t requests_started = 0;
  uint64_t requests_finished = 0;
  uint64_t boundary_states = 0;
  // (Q - 1) state blocks per request and layer that the stock path holds
  // and RecoverSSM does not, at the largest number of live requests.
  uint64_t state_bytes_saved = 0;
  uint64_t comparisons = 0;
  uint64_t mismatches = 0;
  std::string first_mismatch;
  std::map<std::string, LatencySummary> latency;  // per RPC
  bool passed() const { return mismatches == 0 && comparisons > 0; }
};

absl::StatusOr<SimulationReport> RunSimulation(Client& client, const SimulationOptions& options);

std::string FormatReport(const SimulationReport& report);

}  // namespace client
}  // namespace specstate

#endif  // SPECSTATE_CLIENT_SIMULATOR_H_
