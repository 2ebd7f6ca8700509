// Flush checks its block list alike in every commit mode (EAGER, DEFERRED,
// FAST; CPU backend, over a real socket): a block past the pools is
// OUT_OF_RANGE naming the list's element and the bound, and the call changes
// nothing: no pool byte, no pending token, no ring. Under EAGER nothing is
// ever pending, yet the list is checked as under the others, inline or in a
// region, and in stream order (a list the caller writes after an ASYNC Flush
// returned, before it rings the doorbell the Flush waits for, is the list
// that is checked). A list that passes flushes (DEFERRED, FAST) or does
// nothing (EAGER) and succeeds.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/lib/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/server_process.h"
#include "tests/integration/test_scheduler.h"

namespace specstate {
namespace {

using client::Client;
using testing::ExpectError;
using testing::Scheduler;
using testing::ServerProcess;
using testing::ValueOrDie;

class FlushChecksTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    seed_ = std::random_device()();
    rng_.seed(seed_);
    std::vector<std::string> flags = {"--backend=cpu", "--commit_mode=" + GetParam()};
    if (GetParam() == "fast") flags.push_back("--fold_every=2");
    server_ = ValueOrDie(ServerProcess::Start(flags));
    client_ = ValueOrDie(Client::Connect(server_->address()));
    s_ = std::make_unique<Scheduler>(*client_);
    num_blocks_ = s_->layout().num_blocks();
    // Rows 0..2 commit into blocks 1..3: DEFERRED leaves tokens pending on
    // them, FAST in their rings; a Flush that ran would change the pools.
    ASSERT_TRUE(s_->VerifyAll(1).ok());
    ASSERT_TRUE(s_->session().Commit(s_->Commit(1)).ok());
    list_ = ValueOrDie(s_->memory().Allocate(4 * num_blocks_ + 64));
    ValueOrDie(s_->session().RegisterBuffer(*list_, "list"));
  }
  void TearDown() override {
    if (HasFailure()) {
      std::fprintf(stderr, "seed %u; server log:\n%s\n", seed_, server_->Log().c_str());
    }
  }

  // A list of 2..min(16, num_blocks) entries: null ones (<= 0) and blocks of
  // the pools, with blocks past them at `bad` and (when there is room) at a
  // later element too, so the lowest failing element must be the one named.
  std::vector<int32_t> BadList(int* bad) {
    const int n = 2 + static_cast<int>(rng_() % (std::min<int64_t>(16, num_blocks_) - 1));
    std::vector<int32_t> list(n);
    for (int32_t& b : list) b = static_cast<int32_t>(rng_() % (num_blocks_ + 3)) - 3;
    *bad = static_cast<int>(rng_() % n);
    list[*bad] = static_cast<int32_t>(num_blocks_ + rng_() % 1000);
    if (*bad + 1 < n) list[n - 1] = static_cast<int32_t>(num_blocks_ + rng_() % 1000);
    return list;
  }

  std::string Expected(const std::vector<int32_t>& list, int bad) const {
    return absl::StrCat("In Flush: blocks[", bad, "] = ", list[bad],
                        " is out of range: must be below ", num_blocks_);
  }

  // The list written into region "list" at byte 0.
  v1::IndexTensor InRegion(const std::vector<int32_t>& list) {
    std::memcpy(list_->data(), list.data(), list.size() * 4);
    return ValueOrDie(s_->session().Index(static_cast<const int32_t*>(list_->data()),
                                          {static_cast<int64_t>(list.size())}));
  }

  uint64_t DeviceCheckFailures() { return ValueOrDie(client_->GetStats()).device_check_failures(); }

  unsigned seed_ = 0;
  std::mt19937 rng_;
  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<Client> client_;
  std::unique_ptr<Scheduler> s_;
  std::unique_ptr<client::SharedBuffer> list_;
  int64_t num_blocks_ = 0;
};

TEST_P(FlushChecksTest, ABlockPastThePoolsIsOutOfRangeAndChangesNothing) {
  const std::string pools = s_->Pools();
  const uint64_t failures = DeviceCheckFailures();
  for (int round = 0; round < 4; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round, ", seed ", seed_));
    int bad = 0;
    const std::vector<int32_t> list = BadList(&bad);
    v1::FlushRequest inline_list;
    for (int32_t b : list) inline_list.mutable_blocks()->mutable_values()->add_values(b);
    inline_list.set_discard(round % 2 == 1);
    absl::Status st = s_->session().Flush(inline_list).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange) << st;
    EXPECT_EQ(st.message(), Expected(list, bad));
    EXPECT_EQ(s_->Pools(), pools);

    v1::FlushRequest region_list;
    *region_list.mutable_blocks() = InRegion(list);
    st = s_->session().Flush(region_list).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange) << st;
    EXPECT_EQ(st.message(), Expected(list, bad));
    EXPECT_EQ(s_->Pools(), pools);
  }
  // Each refusal came from the check of the list's values, counted as such.
  EXPECT_EQ(DeviceCheckFailures(), failures + 8);
}

TEST_P(FlushChecksTest, AnAsynchronousFlushChecksTheListTheDoorbellReleases) {
  const std::string pools = s_->Pools();
  auto door = ValueOrDie(s_->memory().Allocate(64));
  ValueOrDie(s_->session().RegisterBuffer(*door, "door"));
  uint32_t* counter = static_cast<uint32_t*>(door->data());
  // Enqueued with a valid list in place; the caller writes a bad one before
  // it rings: the Flush must check what the doorbell released.
  v1::FlushRequest flush;
  *flush.mutable_blocks() = InRegion(std::vector<int32_t>(4, 1));
  flush.set_ordering(v1::ASYNC);
  flush.mutable_wait()->mutable_doorbell()->set_region("door");
  flush.mutable_wait()->mutable_doorbell()->set_value(1);
  flush.mutable_signal()->mutable_doorbell()->set_region("door");
  flush.mutable_signal()->mutable_doorbell()->set_value(2);
  const v1::FlushResponse enqueued = ValueOrDie(s_->session().Flush(flush));
  EXPECT_TRUE(enqueued.enqueued());
  std::vector<int32_t> list(4);
  for (int32_t& b : list) b = static_cast<int32_t>(rng_() % num_blocks_);
  const int bad = static_cast<int>(rng_() % 4);
  list[bad] = static_cast<int32_t>(num_blocks_ + rng_() % 1000);
  InRegion(list);
  __atomic_store_n(counter, 1u, __ATOMIC_RELEASE);  // ring
  for (int i = 0; i < 500 && __atomic_load_n(counter, __ATOMIC_ACQUIRE) != 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(__atomic_load_n(counter, __ATOMIC_ACQUIRE), 2u) << "the Flush never signalled";
  EXPECT_EQ(s_->Pools(), pools);
  // Its error comes with the session's next driving call, which it fails.
  ExpectError(s_->session().Verify(s_->Verify(2, 0)).status(), absl::StatusCode::kOutOfRange,
              "an earlier asynchronous Flush failed: " + Expected(list, bad));
  EXPECT_EQ(s_->Pools(), pools);
}

TEST_P(FlushChecksTest, AListWithinThePoolsIsServed) {
  // Null entries, a block listed twice, and every block of the pools' range.
  v1::FlushRequest flush;
  for (int32_t b : {0, -1, 2, 2, static_cast<int32_t>(num_blocks_ - 1)}) {
    flush.mutable_blocks()->mutable_values()->add_values(b);
  }
  flush.mutable_blocks()->mutable_values()->add_values(
      static_cast<int32_t>(1 + rng_() % (num_blocks_ - 1)));
  ASSERT_TRUE(s_->session().Flush(flush).ok());
  v1::FlushRequest region;
  *region.mutable_blocks() = InRegion({1, 3, 0});
  ASSERT_TRUE(s_->session().Flush(region).ok());
  // The session goes on: the next step verifies and commits.
  ASSERT_TRUE(s_->VerifyAll(2).ok());
  ASSERT_TRUE(s_->session().Commit(s_->Commit(2)).ok());
}

INSTANTIATE_TEST_SUITE_P(EveryCommitMode, FlushChecksTest,
                         ::testing::Values("eager", "deferred", "fast"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace specstate
