#include "client/simulator/restart_drill.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/lib/client.h"
#include "server/modes/rules.h"

namespace specstate {
namespace client {
namespace {

bool Executable(const std::string& path) { return access(path.c_str(), X_OK) == 0; }

// `name` of `package`: beside this program, in Bazel's bazel-bin layout (the
// program one or two folders deep: bazel-bin/client/cli/specstatectl), or in
// a test's runfiles.
std::string FindBinary(const std::string& package, const std::string& name) {
  std::vector<std::string> candidates;
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n > 0) {
    self[n] = '\0';
    std::string dir(self);
    dir = dir.substr(0, dir.rfind('/'));
    candidates.push_back(absl::StrCat(dir, "/", name));
    candidates.push_back(absl::StrCat(dir, "/../", package, "/", name));
    candidates.push_back(absl::StrCat(dir, "/../../", package, "/", name));
  }
  if (const char* runfiles = std::getenv("TEST_SRCDIR")) {
    candidates.push_back(absl::StrCat(runfiles, "/specstate/", package, "/", name));
  }
  for (const std::string& c : candidates) {
    if (Executable(c)) return c;
  }
  return name;  // from PATH
}

pid_t Spawn(const std::vector<std::string>& argv, const std::string& log) {
  const int out = open(log.c_str(), O_CREAT | O_WRONLY | O_APPEND | O_CLOEXEC, 0600);
  const pid_t pid = fork();
  if (pid == 0) {
    if (out >= 0) {
      dup2(out, 1);
      dup2(out, 2);
    }
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execvp(args[0], args.data());
    _exit(127);
  }
  if (out >= 0) close(out);
  return pid;
}

bool Answers(const std::string& socket_path, int type) {
  const int fd = socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, socket_path.c_str(), sizeof(addr.sun_path) - 1);
  const bool ok = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}

void Reap(pid_t* pid, int signal) {
  if (*pid <= 0) return;
  kill(*pid, signal);
  waitpid(*pid, nullptr, 0);
  *pid = -1;
}

}  // namespace

absl::StatusOr<std::unique_ptr<OwnService>> OwnService::Start(OwnServiceOptions options) {
  std::unique_ptr<OwnService> s(new OwnService());
  if (options.specstated.empty()) options.specstated = FindBinary("server", "specstated");
  if (options.keeper.empty()) options.keeper = FindBinary("keeper", "specstate-keeper");
  bool backend = false;
  for (const std::string& f : options.flags) backend |= absl::StartsWith(f, "--backend");
  if (!backend) options.flags.push_back("--backend=cpu");
  s->options_ = std::move(options);
  char tmpl[] = "/tmp/specstate-drill-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return absl::InternalError("mkdtemp failed");
  s->dir_ = tmpl;
  s->socket_ = s->dir_ + "/specstate.sock";
  s->address_ = "unix://" + s->socket_;
  s->keeper_socket_ = s->dir_ + "/keeper.sock";
  s->log_ = s->dir_ + "/specstated.log";
  absl::Status st = s->LaunchKeeper();
  if (st.ok()) st = s->Launch();
  if (!st.ok()) return st;
  return s;
}

OwnService::~OwnService() {
  Reap(&pid_, SIGTERM);
  Reap(&keeper_pid_, SIGTERM);
  for (const std::string& f : {socket_, socket_ + ".pools", keeper_socket_, log_,
                               dir_ + "/keeper.log"}) {
    unlink(f.c_str());
  }
  rmdir(dir_.c_str());
}

absl::Status OwnService::LaunchKeeper() {
  keeper_pid_ = Spawn({options_.keeper, "--socket=" + keeper_socket_}, dir_ + "/keeper.log");
  for (int i = 0; i < 500; ++i) {
    if (Answers(keeper_socket_, SOCK_SEQPACKET)) return absl::OkStatus();
    if (waitpid(keeper_pid_, nullptr, WNOHANG) == keeper_pid_) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  keeper_pid_ = -1;
  return absl::UnavailableError(absl::StrCat("specstate-keeper (", options_.keeper,
                                             ") did not come up on ", keeper_socket_));
}

void OwnService::KillKeeper() { Reap(&keeper_pid_, SIGKILL); }

void OwnService::Kill() { Reap(&pid_, SIGKILL); }

bool OwnService::Running() {
  if (pid_ <= 0) return false;
  if (waitpid(pid_, nullptr, WNOHANG) == pid_) {
    pid_ = -1;
    return false;
  }
  return true;
}

absl::Status OwnService::Launch(const std::vector<std::string>& extra_flags,
                                absl::Duration timeout) {
  if (Running()) return absl::FailedPreconditionError("specstated is running: Kill it first");
  std::vector<std::string> argv = {options_.specstated, "--listen=" + address_,
                                   "--keeper=" + keeper_socket_};
  argv.insert(argv.end(), options_.flags.begin(), options_.flags.end());
  argv.insert(argv.end(), extra_flags.begin(), extra_flags.end());
  const absl::Time start = absl::Now();
  pid_ = Spawn(argv, log_);
  while (absl::Now() - start < timeout) {
    if (Answers(socket_, SOCK_STREAM)) {
      last_launch_ = absl::Now() - start;
      return absl::OkStatus();
    }
    if (!Running()) {
      return absl::UnavailableError(
          absl::StrCat("specstated exited at start (", absl::StrJoin(argv, " "), "):\n", Log()));
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  Kill();
  return absl::DeadlineExceededError(
      absl::StrCat("specstated did not serve within ", absl::FormatDuration(timeout), ":\n", Log()));
}

std::string OwnService::Log() const {
  std::ifstream in(log_);
  std::stringstream s;
  s << in.rdbuf();
  const std::string all = s.str();
  return all.size() > 4000 ? all.substr(all.size() - 4000) : all;
}

const char* KillPointName(KillPoint point) {
  switch (point) {
    case KillPoint::kBetweenCalls:
      return "between calls";
    case KillPoint::kVerify:
      return "inside Verify";
    case KillPoint::kCommitStarted:
      return "Commit started";
    case KillPoint::kCommitConv:
      return "Commit, conv compacted";
    case KillPoint::kCommitLayer:
      return "Commit, layers half replayed";
    case KillPoint::kCommitReplayed:
      return "Commit replayed, not marked";
    case KillPoint::kCommitEnqueued:
      return "Commit done, unanswered";
    case KillPoint::kVerifyReplayed:
      return "inside Verify's replay";
    case KillPoint::kCommitDeferred:
      return "Commit, table updated";
    case KillPoint::kFlushTaken:
      return "inside Flush";
  }
  return "?";
}

namespace {

// The kill points of a layout's commit mode, by what it keeps beside the
// pools.
std::vector<KillPoint> PointsFor(const v1::Layout& layout) {
  const server::CommitModeRules& mode = server::CommitModeOf(layout);
  if (mode.RecordsInKeptAllocation()) {  // a pending table: its Verify replay, its Flush
    return {KillPoint::kBetweenCalls,   KillPoint::kVerify,         KillPoint::kVerifyReplayed,
            KillPoint::kCommitStarted,  KillPoint::kCommitConv,     KillPoint::kCommitDeferred,
            KillPoint::kCommitReplayed, KillPoint::kCommitEnqueued, KillPoint::kFlushTaken};
  }
  std::vector<KillPoint> points = {
      KillPoint::kBetweenCalls, KillPoint::kVerify,         KillPoint::kCommitStarted,
      KillPoint::kCommitConv,   KillPoint::kCommitLayer,    KillPoint::kCommitReplayed,
      KillPoint::kCommitEnqueued};
  if (mode.KeepsRings()) points.push_back(KillPoint::kFlushTaken);  // a Flush's fold
  return points;
}

}  // namespace

RestartDrill::RestartDrill(OwnService* service, int every, uint64_t seed, const v1::Layout& layout)
    : service_(service),
      every_(every < 1 ? 1 : every),
      layers_(layout.num_layers() < 1 ? 1 : layout.num_layers()),
      rng_(seed),
      cuda_(layout.backend() == v1::CUDA),
      points_(PointsFor(layout)) {
  next_point_ = static_cast<int>(rng_() % kinds());
  // The service runs unarmed: its first death is a kill between calls.
  armed_ = KillPoint::kBetweenCalls;
  kill_at_step_ = every_;
}

void RestartDrill::BeforeStep(int s) {
  step_ = s;
  if (armed_ == KillPoint::kBetweenCalls && s == kill_at_step_ && service_->Running()) {
    service_->Kill();
  }
}

std::vector<std::string> RestartDrill::ArmNext(int from_step) {
  armed_ = points_[next_point_];
  next_point_ = (next_point_ + 1) % kinds();
  if (cuda_) {  // no hooks inside the CUDA kernels: a commit dies while they run
    const bool hooked = armed_ == KillPoint::kCommitStarted || armed_ == KillPoint::kCommitConv ||
                        armed_ == KillPoint::kCommitLayer || armed_ == KillPoint::kCommitReplayed ||
                        armed_ == KillPoint::kCommitDeferred;
    if (hooked) armed_ = KillPoint::kCommitEnqueued;
    // Nor inside a Verify's replay or a Flush: those die at a Verify's start.
    if (armed_ == KillPoint::kVerifyReplayed || armed_ == KillPoint::kFlushTaken) {
      armed_ = KillPoint::kVerify;
    }
  }
  kill_at_step_ = -1;
  const int verifies = (every_ - 1) * layers_ + 1 + static_cast<int>(rng_() % layers_);
  const int layer_replays =
      (every_ - 1) * layers_ + 1 + static_cast<int>(rng_() % std::max(1, layers_ - 1));
  switch (armed_) {
    case KillPoint::kBetweenCalls:
      kill_at_step_ = from_step + every_;
      return {};
    case KillPoint::kVerify:
      return {absl::StrCat("--test_crash_at=verify:", verifies)};
    case KillPoint::kCommitStarted:
      return {absl::StrCat("--test_crash_at=commit:started:", every_)};
    case KillPoint::kCommitConv:
      return {absl::StrCat("--test_crash_at=commit:conv:", every_)};
    case KillPoint::kCommitLayer:
      return {absl::StrCat("--test_crash_at=commit:layer:", layer_replays)};
    case KillPoint::kCommitReplayed:
      return {absl::StrCat("--test_crash_at=commit:replayed:", every_)};
    case KillPoint::kCommitEnqueued:
      return {absl::StrCat("--test_crash_at=commit:enqueued:", every_)};
    case KillPoint::kVerifyReplayed:  // once per row whose block is pending, per Verify
      return {absl::StrCat("--test_crash_at=verify:replayed:", every_)};
    case KillPoint::kCommitDeferred:
      return {absl::StrCat("--test_crash_at=commit:deferred:", every_)};
    case KillPoint::kFlushTaken:  // the simulator's Flush and ReadState calls are a draw
      return {"--test_crash_at=flush:taken:1"};
  }
  return {};
}

absl::Status RestartDrill::Restart() {
  killed_at_ = absl::Now();
  last_point_ = armed_;
  service_->Kill();  // reaped (it may have died by its armed crash already)
  ++kills_[KillPointName(last_point_)];
  ++restarts_;
  absl::Status st = service_->Launch(ArmNext(step_));
  if (st.ok()) max_restart_ = std::max(max_restart_, service_->last_launch());
  return st;
}

void RestartDrill::NoteResume(absl::Duration resume, uint64_t kept_bytes,
                              const std::string& outcome) {
  max_resume_ = std::max(max_resume_, resume);
  total_kill_to_resumed_ += absl::Now() - killed_at_;
  kept_bytes_ = kept_bytes;
  if (!outcome.empty()) ++enqueued_outcomes_[outcome];
}

std::string RestartDrill::Summary() const {
  std::vector<std::string> parts;
  for (const auto& [name, n] : kills_) parts.push_back(absl::StrCat(name, " ", n));
  std::string out = absl::StrCat(
      restarts_, " restarts (", absl::StrJoin(parts, ", "), "); specstated's start to serving at "
      "most ", absl::ToInt64Milliseconds(max_restart_), " ms; from the failed call to the session resumed: mean ",
      restarts_ > 0 ? absl::ToInt64Milliseconds(total_kill_to_resumed_ / restarts_) : 0,
      " ms, Resume at most ", absl::ToInt64Milliseconds(max_resume_), " ms; ", kept_bytes_,
      " bytes kept");
  if (!enqueued_outcomes_.empty()) {
    std::vector<std::string> o;
    for (const auto& [name, n] : enqueued_outcomes_) o.push_back(absl::StrCat(name, " ", n));
    absl::StrAppend(&out, "; kills right after a Commit was enqueued found it ",
                    absl::StrJoin(o, ", "));
  }
  return out;
}

absl::StatusOr<ResumeOutcome> ResumeAfterRestart(
    RestartDrill& drill, Session& session, uint64_t step_id, const std::vector<int32_t>& writes,
    const std::vector<char>& before, const ReadPools& read_now,
    const std::function<std::vector<std::pair<uint64_t, uint64_t>>(int32_t)>& spans,
    const std::function<void(const std::string&)>& mismatch, const DeferredExpect* deferred) {
  absl::Status st = drill.Restart();
  if (!st.ok()) return st;
  ResumeOutcome out;
  out.point = drill.last_point();
  const absl::Time resume_start = absl::Now();
  absl::StatusOr<v1::RecoverResponse> kept = session.Resume(absl::Seconds(30));
  if (!kept.ok()) return kept.status();
  const absl::Duration resumed_in = absl::Now() - resume_start;
  const std::string where = absl::StrCat("after a kill (", KillPointName(out.point),
                                         ") in step ", step_id, ": ");
  if (!kept->kept()) mismatch(where + "the service did not keep its pools");
  out.lost.assign(kept->lost_blocks().begin(), kept->lost_blocks().end());
  std::vector<int32_t> want_lost;
  const bool between_steps = deferred != nullptr && deferred->between_steps;
  out.committed = !between_steps && kept->last_committed_step() == step_id;
  if (out.committed) {
    if (kept->interrupted()) mismatch(where + "a finished Commit is reported interrupted");
  } else if (kept->interrupted()) {
    if (kept->interrupted_step() != step_id) {
      mismatch(absl::StrCat(where, "the interrupted Commit is step ", kept->interrupted_step()));
    }
    want_lost = writes;
  }
  // Where the drill killed it says which of the three it must be (on CUDA
  // a kill right after the Commit was enqueued may find any of them).
  const bool in_commit = out.point == KillPoint::kCommitStarted ||
                         out.point == KillPoint::kCommitConv ||
                         out.point == KillPoint::kCommitLayer ||
                         out.point == KillPoint::kCommitDeferred ||
                         out.point == KillPoint::kCommitReplayed;
  const bool enqueued = out.point == KillPoint::kCommitEnqueued;
  if (between_steps && out.point != KillPoint::kBetweenCalls && out.point != KillPoint::kFlushTaken) {
    mismatch(absl::StrCat(where, "the service died outside a step"));
  }
  if (!(enqueued && drill.cuda()) && !between_steps) {
    if (in_commit != kept->interrupted()) {
      mismatch(absl::StrCat(where, "Recover says interrupted=", kept->interrupted()));
    }
    if (enqueued != out.committed) {
      mismatch(absl::StrCat(where, "Recover's last committed step is ",
                            kept->last_committed_step()));
    }
  }
  drill.NoteResume(resumed_in, kept->kept_bytes(),
                   !enqueued ? ""
                   : out.committed ? "finished"
                   : kept->interrupted() ? "interrupted"
                                         : "not started");
  std::sort(want_lost.begin(), want_lost.end());
  want_lost.erase(std::unique(want_lost.begin(), want_lost.end()), want_lost.end());
  if (deferred == nullptr) {
    if (out.lost != want_lost) {
      mismatch(absl::StrCat(where, "lost blocks [", absl::StrJoin(out.lost, ","),
                            "], the step's Commit writes [", absl::StrJoin(want_lost, ","), "]"));
    }
  } else {
    // DEFERRED: the lost blocks are those the interrupted call journaled:
    // at least what an interrupted Commit writes, and otherwise only blocks
    // that had tokens pending (or that the pending list may name).
    std::vector<int32_t> may = want_lost;
    may.insert(may.end(), deferred->pending.begin(), deferred->pending.end());
    if (kept->interrupted()) may.insert(may.end(), deferred->listed.begin(), deferred->listed.end());
    const auto in = [](const std::vector<int32_t>& v, int32_t b) {
      return std::find(v.begin(), v.end(), b) != v.end();
    };
    for (int32_t b : want_lost) {
      if (!in(out.lost, b)) mismatch(absl::StrCat(where, "block ", b, " the Commit writes is not lost"));
    }
    for (int32_t b : out.lost) {
      if (!in(may, b)) {
        mismatch(absl::StrCat(where, "block ", b, " is lost: the interrupted call (",
                              kept->interrupted_call(), ") could not have written it"));
      }
    }
    const bool replaying = out.point == KillPoint::kVerifyReplayed;
    const bool flushing = out.point == KillPoint::kFlushTaken;
    if (replaying && (out.lost.empty() || !absl::StartsWith(kept->interrupted_call(), "Verify"))) {
      mismatch(absl::StrCat(where, "a Verify killed in its replay is reported as \"",
                            kept->interrupted_call(), "\" losing ", out.lost.size(), " blocks"));
    }
    if (flushing && !absl::StartsWith(kept->interrupted_call(), "Flush")) {
      mismatch(absl::StrCat(where, "a Flush killed inside is reported as \"",
                            kept->interrupted_call(), "\""));
    }
    // On CUDA the kernels enqueued before the death run on while the
    // process dies, or not: a Commit or a Verify's replay may be found
    // interrupted after any kill.
    const bool may_lose = replaying || flushing || in_commit || kept->interrupted() ||
                          (drill.cuda() && !kept->interrupted_call().empty());
    if (!may_lose && !out.lost.empty()) {
      mismatch(absl::StrCat(where, "lost blocks [", absl::StrJoin(out.lost, ","),
                            "] though no call was writing"));
    }
  }
  // Every other byte of the pools is as before the step (or as its finished
  // Commit left it, in the blocks it wrote).
  std::vector<char> now;
  st = read_now(&now);
  if (!st.ok()) return st;
  if (now.size() != before.size()) return absl::InternalError("the pools changed size");
  std::vector<char> a = before, b = now;
  std::vector<int32_t> skip = out.lost;
  if (out.committed) skip.insert(skip.end(), writes.begin(), writes.end());
  if (deferred != nullptr) {  // materialized in some layers, or not: checked when materialized
    skip.insert(skip.end(), deferred->pending.begin(), deferred->pending.end());
  }
  for (int32_t block : skip) {
    for (const auto& [begin, end] : spans(block)) {
      std::fill(a.begin() + begin, a.begin() + end, 0);
      std::fill(b.begin() + begin, b.begin() + end, 0);
    }
  }
  if (a != b) {
    size_t i = 0;
    while (a[i] == b[i]) ++i;
    mismatch(absl::StrCat(where, "pool byte ", i,
                          " changed outside the lost and committed blocks"));
  }
  if (between_steps) return out;  // no step in flight
  // The step in flight is refused, naming it.
  v1::CommitRequest again;
  again.set_step(step_id);
  absl::StatusOr<v1::CommitResponse> refused = session.Commit(again);
  if (refused.status().code() != absl::StatusCode::kFailedPrecondition ||
      !absl::StrContains(refused.status().message(), absl::StrCat("step ", step_id))) {
    mismatch(absl::StrCat(where, "a Commit of the step in flight after Resume got ",
                          refused.status().ToString()));
  }
  return out;
}

}  // namespace client
}  // namespace specstate
