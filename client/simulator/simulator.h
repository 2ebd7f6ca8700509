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
// Against a service in commit mode DEFERRED (docs/semantics.md, "Commit
// modes") the committed state of a deferred row is checked where it is
// materialized: right after Commit its block must still hold its checkpoint
// bit for bit; then by the next step's Verify (before its Commit), by a Flush
// of some blocks or of all, or by ReadState (its checksum and the block's
// bytes), which the simulator mixes in at random, each against the stock
// state it kept for the block. A finished request's blocks are flushed with
// `discard` before they are reused, as a scheduler must.
//
// Against a service in commit mode FAST (docs/semantics.md, "Fast mode
// (FAST)") outputs and states are checked by FAST's accuracy contract
// instead (fast_checker.h): the simulator also runs a float64 reference, and
// FAST's errors against it must stay within 2x its stock path's over the
// run; the conv windows stay bit for bit. One service (no tensor
// parallelism). Under a restart drill a block whose ring a restart lost is
// re-prefilled with the stock path's state of its request.
//
//   SimulationOptions options;
//   options.steps = 50;
//   absl::StatusOr<SimulationReport> report = RunSimulation(*client, options);
//   std::cout << FormatReport(*report);  // report->passed()
//
// Tensor parallelism (TP ranks, one service each, every service with the
// layout of one rank's part: H/TP heads, HV/TP value heads, D/TP conv
// channels): RunSimulation(ranks, options) simulates the model of H heads.
// Every rank's worker (a thread) draws the whole model's inputs from the same
// seed, so every rank sees the same requests, rows and accepted counts and the
// same values, as if the scheduler had broadcast them; it sends its service
// heads [r*H/TP, (r+1)*H/TP) (and conv channels [r*D/TP, (r+1)*D/TP)), checks
// that service bit for bit against its own stock path as above, and also runs
// the stock kernel over all H heads (the TP=1 run) and compares every
// committed state (boundary states too) and every Verify output of its
// service, head by head, with the TP=1 run's heads of the rank.
#ifndef SPECSTATE_CLIENT_SIMULATOR_SIMULATOR_H_
#define SPECSTATE_CLIENT_SIMULATOR_SIMULATOR_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/lib/client.h"
#include "client/simulator/simulation_report.h"

namespace specstate {
namespace client {

class RestartDrill;  // client/simulator/restart_drill.h

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
  // service's pool through the exported handle (tests of the verdict; FAST:
  // the block flushed first, the bit flipped in each of its elements).
  int corrupt_after_step = -1;
  // With corrupt_after_step: write NaNs instead of flipping a bit (the
  // verdicts must fail on a state that is not a number, too).
  bool corrupt_with_nan = false;
  // Crash tests: after sending the Verify calls of this step (before its
  // Commit), print "CRASH POINT pools=<FNV-1a of every pool byte>" and die by
  // SIGKILL, as a scheduler killed mid-step would.
  int crash_after_verify_step = -1;
  // Crash tests: send this step's Commit ASYNC, waiting on a doorbell that is
  // never rung, then print the CRASH POINT and die as above. The service must
  // not run that Commit when it releases the wait at the session's end.
  int abandon_commit_at_step = -1;
  // Tensor parallelism: the rank whose service `corrupt_after_step` corrupts.
  int corrupt_rank = 0;
  // The commit mode the service must run: "" (any), "eager", "deferred" or
  // "fast" (FAILED_PRECONDITION otherwise). The checks follow the service's
  // mode.
  std::string commit_mode;
  // Restart drills (client/simulator/restart_drill.h; specstatectl simulate
  // --restart_every): the drill kills the service now and then (between
  // calls, inside a Verify, inside a Commit) and starts it again; the
  // simulator then resumes its session (Session::Resume), checks what the
  // service kept (a finished Commit kept, an interrupted one's blocks and
  // only those reported lost, every other pool byte unchanged, the step in
  // flight refused), re-prefills the lost blocks and re-runs the step, and
  // goes on comparing every state bit for bit. One service, SYNC ordering.
  RestartDrill* drill = nullptr;
  // The host tier (specstated --host_tier_bytes): every this many steps
  // (0: never), between steps, one live request's block is saved
  // (SaveBlocks), overwritten with random bytes as if the GPU copy had been
  // evicted and the block reused, and restored (RestoreBlocks); the block is
  // then checked as after a Flush of it, and the run goes on from it. Not
  // with a restart drill (the saved copies die with the service).
  int host_tier_every = 0;
  // Transfers between instances (docs/protocol.md, "The host tier", its
  // Transfers): every this many steps (0: never), between steps, one live
  // request's block makes a round trip through `transfer_peer`, a second
  // specstated of the same layout (device aside), with a host tier on both:
  // this service saves it (SaveBlocks); the peer fetches the key
  // (FetchSaved, over UCX), restores it into one of its own blocks (with a
  // driving session the simulator opens there) and saves that block under a
  // new key, its bytes checked through the peer's exported pools against
  // what this service saved; this service then drops its key, its block is
  // overwritten with random bytes (evicted), and it fetches the new key back
  // from the peer and restores it into the block, which is checked as after
  // the host-tier phase's restore (a pending block holds its materialized
  // state, any other exactly its bytes); the run goes on from it. Each
  // service must reach the other at the address the simulator uses for it.
  // One service (no tensor parallelism), no restart drill (INVALID_ARGUMENT
  // naming the field).
  int transfer_every = 0;
  std::string transfer_peer;
  // Tests of the verdict (with transfer_every): at the transfer after this
  // step, flip a bit of the peer's block between its restore and its save
  // (FAST: of every element of layer 0's state), so that the bytes moved
  // back differ from the ones saved; with corrupt_with_nan, write NaNs.
  int corrupt_transfer_at_step = -1;
  // Called after every step (under tensor parallelism, once every rank has
  // done it, with the ranks' sums).
  std::function<void(const SimulationProgress&)> progress;
};

absl::StatusOr<SimulationReport> RunSimulation(Client& client, const SimulationOptions& options);

// Tensor parallelism: ranks[r] is rank r's service (one rank: the call
// above). The layouts must be the equal parts of one model (CheckRankLayouts,
// FAILED_PRECONDITION otherwise); the crash tests (crash_after_verify_step,
// abandon_commit_at_step) take one service (INVALID_ARGUMENT). An error of
// one rank is returned prefixed with "rank r (ADDRESS): ".
absl::StatusOr<SimulationReport> RunSimulation(const std::vector<Client*>& ranks,
                                               const SimulationOptions& options);


}  // namespace client
}  // namespace specstate

#endif  // SPECSTATE_CLIENT_SIMULATOR_SIMULATOR_H_
