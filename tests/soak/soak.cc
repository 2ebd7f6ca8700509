// The soak test's client processes (tools/soak.sh runs them against one
// specstated, kills and restarts some of them, then replays):
//
//   soak --server=ADDR --role=driver   --log=FILE --lock=FILE --stop=FILE --seed=N
//   soak --server=ADDR --role=contender --stop=FILE
//   soak --server=ADDR --role=reader    --stop=FILE --seed=N
//   soak --server=ADDR --role=hostile   --stop=FILE --seed=N
//   soak --server=ADDR --role=replay    --log=FILE
//   soak --server=ADDR --role=hash
//
// Drivers take turns (a file lock orders their runs as the log does): each
// turn is one simulation (client/simulator/simulator.h: a decode loop checked
// bit for bit) in a driving session of its own, appended to the log once it passed;
// now and then a driver then dies abruptly (its session ends when its
// stream breaks). A contender keeps trying to drive, and drops the session
// at once when it gets one. Readers read everything and check it (a
// block's every value against the service's summary of it, the committed
// steps never going back, their own regions listed) and register and drop
// regions; hostile clients send what no scheduler should and truncate their
// own shared memory. Every process of every role does at least one round
// (even one started as the stop file appeared) and ends printing
// "ROLE: N rounds (...)"; tools/soak.sh fails when a participant did none. The final pools are a function of the logged runs
// alone, so `replay` on a fresh server must produce them byte for byte
// (`hash` prints the FNV-1a of every pool byte).
//
// Exits 0 when every call got what its role expects (the service's answer,
// never a transport failure), 1 otherwise, naming the call.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/lib/client.h"
#include "client/lib/shared_memory.h"
#include "client/simulator/simulator.h"

ABSL_FLAG(std::string, server, "", "specstated's address");
ABSL_FLAG(std::string, role, "", "driver, contender, reader, hostile, replay or hash");
ABSL_FLAG(std::string, log, "", "the drivers' log of passed runs");
ABSL_FLAG(std::string, lock, "", "drivers: the lock file that orders their turns");
ABSL_FLAG(std::string, stop, "", "the role stops (cleanly) once this file exists");
ABSL_FLAG(uint64_t, seed, 1, "random seed");

namespace specstate {
namespace {

using client::Client;

bool Stopped() {
  const std::string stop = absl::GetFlag(FLAGS_stop);
  return !stop.empty() && access(stop.c_str(), F_OK) == 0;
}

[[noreturn]] void Fail(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "soak %s: %s: %s\n", absl::GetFlag(FLAGS_role).c_str(), what.c_str(),
               s.ToString().c_str());
  std::exit(1);
}

// A transport failure (the service died or hung) is never acceptable.
bool Transport(const absl::Status& s) {
  return s.code() == absl::StatusCode::kUnavailable ||
         s.code() == absl::StatusCode::kDeadlineExceeded || s.code() == absl::StatusCode::kUnknown;
}

// One logged run: what RunSimulation needs to do it again.
struct Run {
  uint64_t seed;
  int steps, requests;
  bool async, batch, bound;

  std::string Line() const {
    return absl::StrFormat("%d %d %d %d %d %d\n", seed, steps, requests, async, batch, bound);
  }
  client::SimulationOptions Options() const {
    client::SimulationOptions o;
    o.seed = seed;
    o.steps = steps;
    o.requests = requests;
    o.async = async;
    o.batch = batch;
    o.bound_inputs = bound;
    return o;
  }
};

int Driver(Client& c) {
  const v1::Layout layout = c.GetLayout().value();
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  const int lock = open(absl::GetFlag(FLAGS_lock).c_str(), O_RDWR | O_CREAT, 0600);
  if (lock < 0) Fail("opening the lock", absl::InternalError(std::strerror(errno)));
  int turns = 0;
  do {
    Run r;
    r.seed = rng();
    r.steps = 2 + rng() % 5;
    r.requests = 1 + rng() % layout.max_rows();
    r.async = rng() % 2;
    r.batch = rng() % 3 == 0;
    r.bound = !r.batch && rng() % 3 == 0;
    flock(lock, LOCK_EX);
    absl::StatusOr<client::SimulationReport> report;
    for (;;) {  // a contender (or a dying driver's session) may hold the drive briefly
      report = client::RunSimulation(c, r.Options());
      if (report.ok() || !absl::StrContains(report.status().message(), "another session drives")) {
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    if (!report.ok()) Fail("simulation", report.status());
    if (!report->passed()) Fail("simulation", absl::InternalError(client::FormatReport(*report)));
    std::ofstream(absl::GetFlag(FLAGS_log), std::ios::app) << r.Line();
    ++turns;
    // Now and then die as a crashed scheduler would: no goodbye. The turn
    // is logged and its session ends when the stream breaks.
    if (rng() % 8 == 0) {
      std::printf("driver: %d rounds (runs passed; then died on purpose)\n", turns);
      std::fflush(stdout);
      _exit(0);
    }
    flock(lock, LOCK_UN);
  } while (!Stopped());
  std::printf("driver: %d rounds (runs passed)\n", turns);
  return 0;
}

int Contender(Client& c) {
  int got = 0, refused = 0;
  do {
    absl::StatusOr<std::unique_ptr<client::Session>> s = c.OpenSession("contender", true);
    if (s.ok()) {
      ++got;
      if (!(*s)->Close().ok()) Fail("closing", absl::InternalError("close failed"));
    } else if (s.status().code() == absl::StatusCode::kFailedPrecondition) {
      ++refused;
    } else {
      Fail("OpenSession(drive)", s.status());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(3));
  } while (!Stopped());
  std::printf("contender: %d rounds (drove %d times, refused %d)\n", got + refused, got, refused);
  return 0;
}

// A reader's round: a block's state with every value, checked against the
// summary the service computed over the same bytes; the stats (the
// committed steps never go back); the pools' export (their size); health;
// and every fourth round a session of its own whose registered region must
// be listed under it. Every round does all of it (a round is never empty),
// and a process does at least one round, even if the stop file appeared
// while it started.
int Reader(Client& c) {
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  const v1::Layout layout = c.GetLayout().value();
  auto memory = client::SharedMemory::Create(v1::CPU).value();
  int calls = 0;
  uint64_t values_checked = 0;
  uint64_t committed = 0;
  do {
    const int layer = rng() % layout.num_layers();
    const int block = rng() % layout.num_blocks();
    absl::StatusOr<v1::ReadStateResponse> read = c.ReadState(layer, block, true);
    if (!read.ok()) Fail("ReadState", read.status());
    for (const v1::TensorSummary* t : {&read->recurrent(), &read->conv()}) {
      int64_t elements = 1;
      for (int64_t d : t->shape()) elements *= d;
      if (t->shape().empty() || elements != t->values_size()) {
        Fail("ReadState", absl::DataLossError(absl::StrCat(
                              "layer ", layer, " block ", block, ": ", t->values_size(),
                              " values for a shape of ", elements, " elements")));
      }
      double lo = t->values_size() > 0 ? t->values(0) : 0, hi = lo, sum2 = 0;
      for (float v : t->values()) {
        lo = std::min<double>(lo, v);
        hi = std::max<double>(hi, v);
        sum2 += double{v} * v;
      }
      // The summary is of the same bytes: its extremes are values, and its
      // norm is theirs (up to the float rounding of the values sent).
      if (lo != t->min() || hi != t->max() ||
          std::abs(std::sqrt(sum2) - t->l2_norm()) > 1e-4 * (1 + t->l2_norm())) {
        Fail("ReadState", absl::DataLossError(absl::StrFormat(
                              "layer %d block %d: values span [%g, %g] norm %g, the summary "
                              "says [%g, %g] norm %g",
                              layer, block, lo, hi, std::sqrt(sum2), t->min(), t->max(),
                              t->l2_norm())));
      }
      values_checked += t->values_size();
    }
    absl::StatusOr<v1::Stats> stats = c.GetStats();
    if (!stats.ok()) Fail("GetStats", stats.status());
    if (stats->steps_committed() < committed) {
      Fail("GetStats", absl::DataLossError(absl::StrCat("steps_committed went back from ",
                                                        committed, " to ",
                                                        stats->steps_committed())));
    }
    committed = stats->steps_committed();
    absl::StatusOr<v1::ExportPoolsResponse> pools = c.ExportPools();
    if (!pools.ok()) Fail("ExportPools", pools.status());
    if (pools->allocation_bytes() < layout.pool_bytes()) {
      Fail("ExportPools", absl::DataLossError(absl::StrCat(
                              "allocation_bytes ", pools->allocation_bytes(),
                              " < the layout's pool_bytes ", layout.pool_bytes())));
    }
    absl::Status s = c.ListRegions().status();
    if (s.ok()) s = c.Health().status();
    if (!s.ok()) Fail("reading", s);
    if (rng() % 4 == 0) {
      auto session = c.OpenSession("reader", false);
      if (!session.ok()) Fail("OpenSession", session.status());
      auto buffer = memory->Allocate(4096 * (1 + rng() % 4));
      if (!buffer.ok()) Fail("Allocate", buffer.status());
      absl::StatusOr<std::string> name = (*session)->RegisterBuffer(**buffer);
      if (!name.ok()) Fail("RegisterBuffer", name.status());
      absl::StatusOr<v1::ListRegionsResponse> mine = c.ListRegions((*session)->id());
      if (!mine.ok()) Fail("ListRegions", mine.status());
      if (mine->regions_size() != 1 || mine->regions(0).name() != *name) {
        Fail("ListRegions", absl::DataLossError(absl::StrCat(
                                "session ", (*session)->id(), " registered ", *name, " but ",
                                mine->regions_size(), " regions are listed under it")));
      }
      if (rng() % 2 == 0) {
        absl::Status u = (*session)->Unregister(*name);
        if (!u.ok()) Fail("Unregister", u);
      }
      // Closing drops the rest.
    }
    ++calls;
  } while (!Stopped());
  std::printf("reader: %d rounds (%llu state values checked)\n", calls,
              static_cast<unsigned long long>(values_checked));
  return 0;
}

// What no scheduler should do; the service must answer each with an error
// (never die), and change nothing (the replay proves it).
int Hostile(Client& c) {
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  const v1::Layout layout = c.GetLayout().value();
  auto memory = client::SharedMemory::Create(v1::CPU).value();
  int calls = 0;
  do {
    auto session = c.OpenSession("hostile", false);
    if (!session.ok()) Fail("OpenSession", session.status());
    client::Session& s = **session;
    auto buffer = memory->Allocate(1 << 16).value();
    std::string name = s.RegisterBuffer(*buffer).value();
    const auto expect_error = [&](const absl::Status& st, const char* what) {
      if (st.ok() || Transport(st)) Fail(what, st.ok() ? absl::InternalError("accepted") : st);
    };
    // Driving calls from a session that does not drive.
    v1::VerifyRequest v;
    v.set_session_id(s.id());
    v.set_layer(rng() % (layout.num_layers() + 2));
    v.set_num_rows(rng() % 40);
    expect_error(s.Verify(v).status(), "Verify");
    v1::CommitRequest commit;
    commit.set_step(rng());
    commit.mutable_num_accepted()->mutable_values()->add_values(1);
    expect_error(s.Commit(commit).status(), "Commit");
    v1::SubmitStepRequest batch;
    for (int i = 0; i < 50; ++i) *batch.add_verifies() = v;
    expect_error(s.SubmitStep(batch).status(), "SubmitStep");
    // Guessed session ids.
    v1::CommitRequest guessed = commit;
    guessed.set_session_id(absl::StrCat("s", rng() % 50, "-", absl::Hex(rng())));
    {
      grpc::ClientContext ctx;
      v1::CommitResponse response;
      expect_error(client::FromGrpc(c.stub().Commit(&ctx, guessed, &response)), "guessed Commit");
    }
    // Malformed registrations.
    v1::RegisterRegionRequest r;
    r.set_session_id(s.id());
    r.set_name(absl::StrCat("bad", calls));
    buffer->Describe(&r);
    r.set_offset_bytes(rng() % 3 == 0 ? 1 : (uint64_t{1} << 40));
    {
      grpc::ClientContext ctx;
      v1::RegisterRegionResponse response;
      expect_error(client::FromGrpc(c.stub().RegisterRegion(&ctx, r, &response)), "RegisterRegion");
    }
    // Shrink our own registered memory under the service.
    if (rng() % 2 == 0) {
      v1::RegisterRegionRequest d;
      buffer->Describe(&d);
      const int fd = shm_open(d.shm_name().c_str(), O_RDWR, 0);
      if (fd >= 0) {
        if (ftruncate(fd, 0) != 0) Fail("ftruncate", absl::InternalError(std::strerror(errno)));
        close(fd);
      }
    }
    absl::Status closed = s.Close();
    if (!closed.ok()) Fail("Close", closed);
    buffer.reset();
    ++calls;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  } while (!Stopped());
  std::printf("hostile: %d rounds\n", calls);
  return 0;
}

int Replay(Client& c) {
  std::ifstream in(absl::GetFlag(FLAGS_log));
  std::string line;
  int runs = 0;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    Run r;
    int async, batch, bound;
    if (!(fields >> r.seed >> r.steps >> r.requests >> async >> batch >> bound)) {
      Fail("reading the log", absl::DataLossError(line));
    }
    r.async = async;
    r.batch = batch;
    r.bound = bound;
    absl::StatusOr<client::SimulationReport> report = client::RunSimulation(c, r.Options());
    if (!report.ok()) Fail(absl::StrCat("replay of run ", runs), report.status());
    if (!report->passed()) {
      Fail(absl::StrCat("replay of run ", runs), absl::InternalError(client::FormatReport(*report)));
    }
    ++runs;
  }
  std::printf("replayed %d runs\n", runs);
  return 0;
}

int Hash(Client& c) {
  const v1::ExportPoolsResponse exported = c.ExportPools().value();
  const int fd = open(exported.shm_path().c_str(), O_RDONLY);
  if (fd < 0) Fail("open the pools", absl::InternalError(std::strerror(errno)));
  const auto* p = static_cast<const unsigned char*>(
      mmap(nullptr, exported.allocation_bytes(), PROT_READ, MAP_SHARED, fd, 0));
  close(fd);
  if (p == MAP_FAILED) Fail("mmap the pools", absl::InternalError(std::strerror(errno)));
  uint64_t h = 1469598103934665603ull;
  for (uint64_t i = 0; i < exported.allocation_bytes(); ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  std::printf("pools %016llx (%llu bytes)\n", static_cast<unsigned long long>(h),
              static_cast<unsigned long long>(exported.allocation_bytes()));
  return 0;
}

}  // namespace
}  // namespace specstate

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  using namespace specstate;
  absl::StatusOr<std::unique_ptr<client::Client>> c =
      client::Client::Connect(absl::GetFlag(FLAGS_server));
  if (!c.ok()) Fail("Connect", c.status());
  (*c)->set_deadline(absl::Seconds(30));
  const std::string role = absl::GetFlag(FLAGS_role);
  if (role == "driver") return Driver(**c);
  if (role == "contender") return Contender(**c);
  if (role == "reader") return Reader(**c);
  if (role == "hostile") return Hostile(**c);
  if (role == "replay") return Replay(**c);
  if (role == "hash") return Hash(**c);
  std::fprintf(stderr, "unknown --role=%s\n", role.c_str());
  return 2;
}
