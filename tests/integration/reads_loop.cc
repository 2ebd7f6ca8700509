// tests/integration/reads_loop.h: two services, one decode loop, reads on one.
#include "tests/integration/reads_loop.h"

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/lib/client.h"
#include "gtest/gtest.h"
#include "tests/integration/mode_fixture.h"
#include "tests/integration/server_process.h"
#include "tests/integration/test_scheduler.h"

namespace specstate {
namespace testing {
namespace {

using client::Client;

uint16_t FloatToBf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

class ReadsLoop {
 public:
  ReadsLoop(std::vector<std::string> flags, v1::Backend backend)
      : flags_(std::move(flags)), backend_(backend) {}

  ~ReadsLoop() {
    if (!::testing::Test::HasFailure() || servers_[1] == nullptr) return;
    std::fprintf(stderr, "%s: seed %u; the reading service's log:\n%s", Name().c_str(), seed_,
                 servers_[1]->Log().c_str());
  }

  std::string Name() const { return absl::StrJoin(flags_, " "); }

  void SetUp() {
    seed_ = std::random_device()();
    rng_.seed(seed_);
    std::printf("%s: seed %u\n", Name().c_str(), seed_);
    for (int i = 0; i < 2; ++i) {
      servers_[i] = ValueOrDie(ServerProcess::Start(flags_));
      ASSERT_NE(servers_[i], nullptr);
      clients_[i] = ValueOrDie(Client::Connect(servers_[i]->address()));
      ASSERT_NE(clients_[i], nullptr);
      schedulers_[i] = std::make_unique<Scheduler>(*clients_[i], true, backend_);
    }
    views_ = ValueOrDie(clients_[0]->ExportPools());
    layers_ = schedulers_[0]->layout().num_layers();
    // A prefill: the same random states in blocks 1..kRows of both.
    std::string pools = schedulers_[0]->Pools();
    for (const v1::PoolView& view : views_.pools()) {
      if (view.kind() != "recurrent") continue;
      ASSERT_EQ(view.dtype(), v1::FP32);
      const uint64_t block_bytes = view.byte_size() / view.shape(0);
      for (int b = 1; b <= Scheduler::kRows; ++b) {
        for (uint64_t i = 0; i < block_bytes / 4; ++i) {
          const float x = std::normal_distribution<float>(0.0f, 0.1f)(rng_);
          std::memcpy(&pools[view.offset_bytes() + b * block_bytes + 4 * i], &x, 4);
        }
      }
    }
    for (auto& s : schedulers_) s->RestorePools(pools);
  }

  Scheduler& plain() { return *schedulers_[0]; }
  Scheduler& reader() { return *schedulers_[1]; }
  Client& reader_client() { return *clients_[1]; }

  // Fresh random activations, the same in both services' regions.
  void DrawInputs() {
    const v1::Layout& l = plain().layout();
    const int64_t elems =
        int64_t{Scheduler::kRows} * Scheduler::kTokensPerRow * l.num_heads() * l.head_dim();
    for (int which : {0, 1, 2, 3, 5}) {  // q, k, v, g, beta (4: the outputs)
      const int64_t n = which == 5 ? elems / l.head_dim() : elems;
      std::vector<uint16_t> bits(n);
      for (uint16_t& b : bits) b = FloatToBf16(std::normal_distribution<float>(0.0f, 1.0f)(rng_));
      for (auto& s : schedulers_) s->WriteAct(which, bits.data(), n * 2);
    }
  }

  // Reads of a random layer of some blocks, among them the step's rows'
  // (pending or ring tokens) and one no row uses (block kRows + 1), each
  // with or without its values.
  void ReadSome(const std::string& when) {
    for (int b = 0; b <= Scheduler::kRows + 1; ++b) {
      if (rng_() % 3 == 0) continue;
      const int layer = static_cast<int>(rng_() % layers_);
      const absl::StatusOr<v1::ReadStateResponse> r =
          reader_client().ReadState(layer, b, rng_() % 2 == 0);
      ASSERT_TRUE(r.ok()) << when << ": ReadState(layer " << layer << ", block " << b
                          << "): " << r.status();
      ++reads_;
    }
  }

  // A step on both: every layer's Verify (reads between them and the
  // Commit now and then, on the reader only), the Commit of random
  // acceptances, then reads.
  void Step(uint64_t step) {
    DrawInputs();
    for (int l = 0; l < layers_; ++l) {
      for (auto& s : schedulers_) {
        const absl::StatusOr<v1::VerifyResponse> v = s->session().Verify(s->Verify(step, l));
        ASSERT_TRUE(v.ok()) << "step " << step << ", layer " << l << ": " << v.status();
      }
      ASSERT_EQ(plain().Outputs(), reader().Outputs())
          << "step " << step << ", layer " << l << ": the reads changed Verify's outputs";
    }
    if (step % 3 == 0) {
      ASSERT_NO_FATAL_FAILURE(ReadSome(absl::StrCat("step ", step, ", before its Commit")));
    }
    std::vector<int> accepted;
    for (int n = 0; n < Scheduler::kRows; ++n) {
      accepted.push_back(std::uniform_int_distribution<int>(0, Scheduler::kTokensPerRow)(rng_));
    }
    for (auto& s : schedulers_) {
      const absl::StatusOr<v1::CommitResponse> c = s->session().Commit(s->Commit(step, accepted));
      ASSERT_TRUE(c.ok()) << "step " << step << ": " << c.status();
    }
    ASSERT_NO_FATAL_FAILURE(ReadSome(absl::StrCat("after step ", step)));
  }

  // The first (layer, kind, block) whose bytes differ, or "".
  std::string FirstDifference(const std::string& a, const std::string& b) const {
    if (a.size() != b.size()) return "the pools' sizes";
    for (const v1::PoolView& view : views_.pools()) {
      for (int blk = 0; blk < view.shape(0); ++blk) {
        if (testing::PoolBlock(a, views_, view.layer(), blk, view.kind()) !=
            testing::PoolBlock(b, views_, view.layer(), blk, view.kind())) {
          return absl::StrCat("layer ", view.layer(), ", ", view.kind(), ", block ", blk);
        }
      }
    }
    return a == b ? "" : "bytes outside the pools' views";
  }

  void Run(int steps);

 private:
  const std::vector<std::string> flags_;
  const v1::Backend backend_;
  uint32_t seed_ = 0;
  std::mt19937 rng_;
  std::unique_ptr<ServerProcess> servers_[2];
  std::unique_ptr<Client> clients_[2];
  std::unique_ptr<Scheduler> schedulers_[2];
  v1::ExportPoolsResponse views_;
  int layers_ = 0;
  int reads_ = 0;
};

void ReadsLoop::Run(int steps) {
  for (uint64_t step = 1; step <= uint64_t(steps); ++step) {
    ASSERT_NO_FATAL_FAILURE(Step(step));
    if (step % 8 == 0) {
      ASSERT_EQ(FirstDifference(plain().Pools(), reader().Pools()), "")
          << "after step " << step << " and " << reads_ << " reads";
    }
  }
  EXPECT_GT(reads_, 40);
  // Every pool byte, with blocks still pending (DEFERRED) or holding ring
  // tokens (FAST): what the reads left must be what no reads left.
  ASSERT_EQ(FirstDifference(plain().Pools(), reader().Pools()), "")
      << "after " << steps << " steps and " << reads_ << " reads";
  // What ReadState returns is the block's current state: the bytes a Flush
  // leaves in the pool.
  std::map<std::pair<int, int>, uint64_t> read;
  for (int l = 0; l < layers_; ++l) {
    for (int b = 0; b <= Scheduler::kRows + 1; ++b) {
      read[{l, b}] = ValueOrDie(reader_client().ReadState(l, b, false)).recurrent().checksum();
    }
  }
  ASSERT_EQ(FirstDifference(plain().Pools(), reader().Pools()), "") << "after the last reads";
  for (auto& s : schedulers_) ASSERT_TRUE(s->session().Flush(v1::FlushRequest()).ok());
  const std::string flushed = reader().Pools();
  EXPECT_EQ(FirstDifference(plain().Pools(), flushed), "") << "after a Flush of every block";
  for (const auto& [at, checksum] : read) {
    EXPECT_EQ(checksum, testing::Fnv1a(testing::PoolBlock(flushed, views_, at.first, at.second)))
        << "layer " << at.first << ", block " << at.second
        << ": ReadState's checksum is not that of the state a Flush leaves";
  }
}

}  // namespace

void ExpectReadsChangeNoPoolByte(const std::vector<std::string>& flags, v1::Backend backend,
                                 int steps) {
  ReadsLoop loop(flags, backend);
  loop.SetUp();
  if (::testing::Test::HasFatalFailure()) return;
  loop.Run(steps);
}

}  // namespace testing
}  // namespace specstate
