// Restart drills: a specstated that is killed and started again while a
// decode loop runs (specstatectl simulate --restart_every=K, and the
// integration test tests/integration/restart_test.cc).
//
// OwnService runs a specstate-keeper and a specstated (CPU backend unless
// flags say otherwise) in a fresh temporary directory, the pools held by
// the keeper, so the whole drill is one command. RestartDrill decides where
// the service dies: about every K steps, in turn between two calls (a
// SIGKILL from outside before a step), inside a Verify, and inside a Commit
// at each of its phases (specstated --test_crash_at: the journal started,
// conv windows compacted, a layer replayed, every state written, the
// commit enqueued and unanswered). The simulator calls BeforeStep() before
// each step's calls to the service and Restart() when a call failed
// UNAVAILABLE; it then resumes its session and checks what the service
// kept (simulator.h, SimulationOptions::drill).
//
//   auto service = OwnService::Start({}).value();
//   auto client = Client::Connect(service->address()).value();
//   RestartDrill drill(service.get(), /*every=*/8, /*seed=*/1);
//   options.drill = &drill;
//   RunSimulation(*client, options);
#ifndef SPECSTATE_CLIENT_SIMULATOR_RESTART_DRILL_H_
#define SPECSTATE_CLIENT_SIMULATOR_RESTART_DRILL_H_

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <utility>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "specstate/v1/specstate.pb.h"

namespace specstate {
namespace client {

struct OwnServiceOptions {
  // The binaries; empty: found beside this program (the same directory, or
  // Bazel's bazel-bin layout: from bazel-bin/client/cli/specstatectl,
  // ../../server/specstated and ../../keeper/specstate-keeper).
  std::string specstated;
  std::string keeper;
  // specstated's flags besides --listen and --keeper (e.g. --backend=cpu,
  // --layers=2). Without a --backend, --backend=cpu.
  std::vector<std::string> flags;
};

// A keeper and a specstated of this process's own, in a temporary
// directory that goes with it.
class OwnService {
 public:
  static absl::StatusOr<std::unique_ptr<OwnService>> Start(OwnServiceOptions options);
  ~OwnService();  // SIGTERM to both, the directory removed

  const std::string& address() const { return address_; }
  const std::string& keeper_socket() const { return keeper_socket_; }
  const std::string& directory() const { return dir_; }

  // specstated's state: Kill sends SIGKILL (a crash) and reaps it; Launch
  // starts it (with `extra_flags` this time only) and waits until it serves.
  void Kill();
  bool Running();
  absl::Status Launch(const std::vector<std::string>& extra_flags = {},
                      absl::Duration timeout = absl::Seconds(30));
  // How long the last Launch took from fork to serving, and specstated's log.
  absl::Duration last_launch() const { return last_launch_; }
  std::string Log() const;
  pid_t pid() const { return pid_; }

  // The keeper's: SIGKILL, and a new one on the same socket.
  void KillKeeper();
  absl::Status LaunchKeeper();

 private:
  OwnService() = default;
  OwnServiceOptions options_;
  std::string dir_;
  std::string address_;
  std::string socket_;
  std::string keeper_socket_;
  std::string log_;
  pid_t pid_ = -1;
  pid_t keeper_pid_ = -1;
  absl::Duration last_launch_;
};

// Where a drill kills the service.
enum class KillPoint {
  kBetweenCalls,    // SIGKILL from outside before a step's first call
  kVerify,          // inside a Verify (--test_crash_at=verify)
  kCommitStarted,   // the commit's journal says started, nothing written yet
  kCommitConv,      // conv windows compacted, no state replayed
  kCommitLayer,     // some layers' states replayed, not all
  kCommitReplayed,  // every state written, the journal not yet committed
  kCommitEnqueued,  // the commit done (CPU) and its answer never sent
  // commit_mode DEFERRED (CPU hooks):
  kVerifyReplayed,  // a Verify stored part of a pending block's materialized checkpoint
  kCommitDeferred,  // the pending table updated, no replay run
  kFlushTaken,      // a Flush (or ReadState) took its blocks' entries, replayed none
};
const char* KillPointName(KillPoint point);

class RestartDrill {
 public:
  // `every`: steps between kills (>= 1); `layout`: the service's (its
  // layers place crashes inside a later step's calls). Points taken in
  // turn, starting at a seeded place; which points, by what the layout's
  // commit mode keeps beside the pools: a pending table (DEFERRED: inside a
  // Verify's replay, the Commit with its table updated, inside a Flush, and
  // no "layers half replayed": a DEFERRED Commit replays through one list),
  // rings (FAST: a Commit's folds layer by layer, inside a Flush's fold), or
  // nothing (EAGER). The CUDA backend's Commit phases have no test hook: the
  // points are between calls, inside Verify, and right after the Commit's
  // kernels were enqueued (the process dies while they run, so the Commit
  // may be found not started, interrupted or finished).
  RestartDrill(OwnService* service, int every, uint64_t seed, const v1::Layout& layout);

  // Before step `s`'s calls: kills the service when a kill between calls
  // is due.
  void BeforeStep(int s);
  // A call failed UNAVAILABLE: the service died (by a kill of this drill,
  // or its armed crash). Starts it again, arming the next crash.
  absl::Status Restart();
  // What the last death was (for the simulator's expectations).
  KillPoint last_point() const { return last_point_; }

  bool cuda() const { return cuda_; }
  // How many kinds of kill the drill takes in turn.
  int kinds() const { return static_cast<int>(points_.size()); }
  // ResumeAfterRestart's measurements: how long the session took to resume
  // (from the restarted service's start), the bytes it kept, and what a
  // kill at kCommitEnqueued found ("not started", "interrupted", "finished").
  void NoteResume(absl::Duration resume, uint64_t kept_bytes, const std::string& outcome);

  int restarts() const { return restarts_; }
  const std::map<std::string, int>& kills() const { return kills_; }
  absl::Duration max_restart() const { return max_restart_; }
  // "12 restarts (between calls 2, verify 2, ...), restart to serving at most 41 ms".
  std::string Summary() const;

 private:
  // Picks the next point; for a crash point, the flag that arms it.
  std::vector<std::string> ArmNext(int from_step);

  OwnService* service_;
  int every_;
  int layers_;
  std::mt19937_64 rng_;
  int next_point_ = 0;
  KillPoint armed_ = KillPoint::kBetweenCalls;
  int kill_at_step_ = -1;  // kBetweenCalls: the step before which it kills
  int step_ = 0;           // the last step BeforeStep saw
  KillPoint last_point_ = KillPoint::kBetweenCalls;
  int restarts_ = 0;
  std::map<std::string, int> kills_;
  absl::Duration max_restart_;
  bool cuda_ = false;
  std::vector<KillPoint> points_;
  absl::Duration max_resume_;
  absl::Duration total_kill_to_resumed_;
  uint64_t kept_bytes_ = 0;
  std::map<std::string, int> enqueued_outcomes_;
  absl::Time killed_at_;
};

// The simulator's side of a restart, generic over what it simulates: after a
// call of the step `step_id` failed UNAVAILABLE, the service is started again
// (drill.Restart()), `session` resumed, and what the service kept checked
// against what the simulator knows:
//  - when Recover's last committed step is `step_id`, the step's Commit
//    finished before the death (its answer was lost): nothing is lost;
//  - when a Commit was interrupted, it is this step's, and the lost blocks
//    are exactly the blocks it writes (`writes`);
//  - otherwise nothing is lost;
//  - every pool byte outside the lost blocks (and the written ones, when the
//    Commit finished) is what it was before the step's calls (`before`,
//    compared with what `read_now` reads once the old instance is gone;
//    `spans(b)` gives block
//    b's byte ranges in every layer's pools);
//  - the resumed session refuses the step (FAILED_PRECONDITION naming it).
// Each failed check calls `mismatch` (the verdict's). The caller then puts
// `before`'s bytes back in the lost blocks (a re-prefill) and re-runs the
// step under a new id unless `committed`.
// commit_mode DEFERRED: what else a death may have touched. Blocks pending
// when the step (or the call) began may hold their materialized state, in
// some layers, rather than the checkpoint: their bytes are not compared
// (the simulator checks them when they are materialized). A death inside a
// Verify's replay loses some of them; an interrupted Commit loses the blocks
// it writes and may lose those the service's pending list names (what the
// previous Commit left pending); a death inside a Flush loses some of its
// pending blocks. Outside a step (`between_steps`: a Flush or ReadState after
// the step's Commit) no step is in flight.
struct DeferredExpect {
  std::vector<int32_t> pending;
  std::vector<int32_t> listed;
  bool between_steps = false;
};

struct ResumeOutcome {
  bool committed = false;
  std::vector<int32_t> lost;
  KillPoint point = KillPoint::kBetweenCalls;
};
class Session;
// Reads every byte of the pools' allocation.
using ReadPools = std::function<absl::Status(std::vector<char>*)>;
absl::StatusOr<ResumeOutcome> ResumeAfterRestart(
    RestartDrill& drill, Session& session, uint64_t step_id, const std::vector<int32_t>& writes,
    const std::vector<char>& before, const ReadPools& read_now,
    const std::function<std::vector<std::pair<uint64_t, uint64_t>>(int32_t)>& spans,
    const std::function<void(const std::string&)>& mismatch,
    const DeferredExpect* deferred = nullptr);

}  // namespace client
}  // namespace specstate

#endif  // SPECSTATE_CLIENT_SIMULATOR_RESTART_DRILL_H_
