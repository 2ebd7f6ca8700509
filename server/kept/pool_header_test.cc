#include "server/kept/pool_header.h"

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/kda_args.h"
#include "server/config/config.h"

namespace specstate {
namespace server {
namespace {

using ::testing::HasSubstr;

v1::Layout TestLayout() { return DefaultServiceConfig().layout(); }

uint64_t PoolBytes(const v1::Layout& l) { return ComputeLayoutSizes(l).pool_bytes; }

std::vector<char> Fresh(const v1::Layout& l) {
  return FreshHeader(l, v1::CPU, 0, PoolBytes(l), absl::Now());
}

kernels::JournalRecord& Journal(std::vector<char>& bytes, int64_t num_blocks) {
  return *reinterpret_cast<kernels::JournalRecord*>(bytes.data() +
                                                    HeaderLayoutFor(num_blocks).journal);
}
int32_t* Entries(std::vector<char>& bytes, int64_t num_blocks) {
  return reinterpret_cast<int32_t*>(bytes.data() + HeaderLayoutFor(num_blocks).entries);
}
kernels::BlockRecord* Blocks(std::vector<char>& bytes, int64_t num_blocks) {
  return reinterpret_cast<kernels::BlockRecord*>(bytes.data() + HeaderLayoutFor(num_blocks).blocks);
}

TEST(PoolHeaderTest, AFreshHeaderPassesItsChecks) {
  const v1::Layout l = TestLayout();
  std::vector<char> bytes = Fresh(l);
  EXPECT_EQ(bytes.size(), HeaderLayoutFor(l.num_blocks()).bytes);
  EXPECT_TRUE(CheckHeader(bytes, l, v1::CPU, 0, PoolBytes(l)).ok());
  v1::RecoverResponse verified;
  VerifyHeader(bytes, l, &verified);
  EXPECT_TRUE(verified.verified());
  EXPECT_THAT(verified.problems(), ::testing::IsEmpty());
  const v1::RecoverResponse r = AttachHeader(&bytes, absl::Now(), 42);
  EXPECT_TRUE(r.kept());
  EXPECT_FALSE(r.interrupted());
  EXPECT_EQ(r.lost_blocks_size(), 0);
  EXPECT_EQ(r.restarts(), 1u);
  EXPECT_EQ(r.layout_fingerprint().size(), 16u);
}

TEST(PoolHeaderTest, TheFingerprintCoversWhatGivesThePoolsTheirMeaning) {
  const v1::Layout l = TestLayout();
  v1::Layout rows = l;
  rows.set_max_rows(l.max_rows() * 2);  // records are not kept: may change
  rows.set_device(3);
  EXPECT_EQ(LayoutFingerprint(rows), LayoutFingerprint(l));
  v1::Layout value_heads = l;
  value_heads.set_num_value_heads(l.num_heads());  // 0 means as many as heads
  EXPECT_EQ(LayoutFingerprint(value_heads), LayoutFingerprint(l));
  for (auto change : std::vector<void (*)(v1::Layout*)>{
           [](v1::Layout* x) { x->set_num_blocks(x->num_blocks() + 1); },
           [](v1::Layout* x) { x->set_head_dim(128); },
           [](v1::Layout* x) { x->set_num_spec(x->num_spec() + 1); },
           [](v1::Layout* x) { x->set_state_dtype(v1::BF16); },
           [](v1::Layout* x) { x->set_conv_dim(x->conv_dim() + 8); },
           [](v1::Layout* x) { x->set_lower_bound(-4.0f); },
           [](v1::Layout* x) { x->set_kda_gate(v1::PLAIN_GATE); },
           [](v1::Layout* x) { x->set_layer_kind(v1::GDN); },
       }) {
    v1::Layout changed = l;
    change(&changed);
    EXPECT_NE(LayoutFingerprint(changed), LayoutFingerprint(l)) << LayoutIdentity(changed);
  }
}

TEST(PoolHeaderTest, AnotherLayoutIsRefusedNamingWhatChanged) {
  const v1::Layout l = TestLayout();
  const std::vector<char> bytes = Fresh(l);
  v1::Layout other = l;
  other.set_head_dim(128);
  other.set_num_layers(6);
  const absl::Status st = CheckHeader(bytes, other, v1::CPU, 0, PoolBytes(other));
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("head_dim 64 -> 128"));
  EXPECT_THAT(std::string(st.message()), HasSubstr("num_layers 4 -> 6"));
  EXPECT_THAT(std::string(st.message()), HasSubstr("--discard_kept_pools"));
  // The backend, the device and the pools' size are checked on their own.
  EXPECT_THAT(std::string(CheckHeader(bytes, l, v1::CUDA, 0, PoolBytes(l)).message()),
              HasSubstr("they are CPU memory, this specstated runs the CUDA backend"));
  std::vector<char> cuda = FreshHeader(l, v1::CUDA, 1, PoolBytes(l), absl::Now());
  EXPECT_THAT(std::string(CheckHeader(cuda, l, v1::CUDA, 0, PoolBytes(l)).message()),
              HasSubstr("on CUDA device 1, this specstated runs on 0"));
  EXPECT_THAT(std::string(CheckHeader(bytes, l, v1::CPU, 0, PoolBytes(l) + 256).message()),
              HasSubstr("bytes of pools"));
}

TEST(PoolHeaderTest, ADamagedHeaderIsDataLoss) {
  const v1::Layout l = TestLayout();
  const std::vector<char> good = Fresh(l);
  struct Case {
    const char* what;
    size_t offset;
    const char* message;
  };
  const Case cases[] = {
      {"magic", offsetof(KeptHeader, magic), "magic"},
      {"layout text", offsetof(KeptHeader, identity) + 3, "checksum"},
      {"pool size", offsetof(KeptHeader, pool_bytes), "checksum"},
      {"checksum", offsetof(KeptHeader, checksum), "checksum"},
  };
  for (const Case& c : cases) {
    std::vector<char> bytes = good;
    bytes[c.offset] ^= 0x10;
    const absl::Status st = CheckHeader(bytes, l, v1::CPU, 0, PoolBytes(l));
    EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << c.what << ": " << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr(c.message)) << c.what;
    v1::RecoverResponse verified;
    VerifyHeader(bytes, l, &verified);
    EXPECT_THAT(verified.problems(), ::testing::Not(::testing::IsEmpty())) << c.what;
  }
  std::vector<char> short_bytes(good.begin(), good.begin() + 100);
  EXPECT_EQ(CheckHeader(short_bytes, l, v1::CPU, 0, PoolBytes(l)).code(),
            absl::StatusCode::kDataLoss);
  std::vector<char> bad_state = good;
  Journal(bad_state, l.num_blocks()).state = 7;
  const absl::Status st = CheckHeader(bad_state, l, v1::CPU, 0, PoolBytes(l));
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(st.message()), HasSubstr("journal's state is 7"));
}

// An interrupted commit: its blocks are lost from now on (and after further
// restarts) until a commit writes them; the journal is closed.
TEST(PoolHeaderTest, AnInterruptedCommitsBlocksAreReportedLost) {
  const v1::Layout l = TestLayout();
  const int64_t B = l.num_blocks();
  std::vector<char> bytes = Fresh(l);
  kernels::JournalRecord& j = Journal(bytes, B);
  j.state = kernels::kJournalStarted;
  j.step = 18;
  j.last_committed_step = 17;
  j.commits = 9;
  j.num_rows = 3;
  const int32_t entries[] = {5, 0, 9, 12, 0, 0};
  std::memcpy(Entries(bytes, B), entries, sizeof(entries));
  ASSERT_TRUE(CheckHeader(bytes, l, v1::CPU, 0, PoolBytes(l)).ok());
  v1::RecoverResponse r = AttachHeader(&bytes, absl::Now(), 7);
  EXPECT_TRUE(r.interrupted());
  EXPECT_EQ(r.interrupted_step(), 18u);
  EXPECT_EQ(r.last_committed_step(), 17u);
  EXPECT_EQ(r.commits(), 9u);
  EXPECT_THAT(r.lost_blocks(), ::testing::ElementsAre(5, 9, 12));
  EXPECT_EQ(Journal(bytes, B).state, kernels::kJournalIdle);
  // verify-pools lists them.
  v1::RecoverResponse verified;
  VerifyHeader(bytes, l, &verified);
  EXPECT_THAT(verified.inconsistent_blocks(), ::testing::ElementsAre(5, 9, 12));
  // Another restart before any commit: still lost, no longer interrupted.
  r = AttachHeader(&bytes, absl::Now(), 8);
  EXPECT_FALSE(r.interrupted());
  EXPECT_THAT(r.lost_blocks(), ::testing::ElementsAre(5, 9, 12));
  EXPECT_EQ(r.restarts(), 2u);
  // A finished commit that wrote block 9 (as the kernels record it) clears it.
  kernels::BlockRecord& b9 = Blocks(bytes, B)[9];
  b9.lost = 0;
  b9.step = 19;
  b9.sequence = 10;
  Journal(bytes, B).commits = 10;
  r = AttachHeader(&bytes, absl::Now(), 9);
  EXPECT_THAT(r.lost_blocks(), ::testing::ElementsAre(5, 12));
}

TEST(PoolHeaderTest, VerifyFindsRecordsNewerThanTheJournal) {
  const v1::Layout l = TestLayout();
  const int64_t B = l.num_blocks();
  std::vector<char> bytes = Fresh(l);
  kernels::JournalRecord& j = Journal(bytes, B);
  j.state = kernels::kJournalCommitted;
  j.step = j.last_committed_step = 30;
  j.commits = 4;
  j.num_rows = 1;
  Entries(bytes, B)[0] = 7;
  Blocks(bytes, B)[7] = kernels::BlockRecord{30, 4, 0, 0};
  v1::RecoverResponse ok;
  VerifyHeader(bytes, l, &ok);
  EXPECT_THAT(ok.problems(), ::testing::IsEmpty());
  Blocks(bytes, B)[11] = kernels::BlockRecord{31, 5, 0, 0};  // a commit the journal never saw
  Blocks(bytes, B)[7].sequence = 3;                           // the last commit's block, stale
  Blocks(bytes, B)[0].step = 1;                               // the null block
  v1::RecoverResponse bad;
  VerifyHeader(bytes, l, &bad);
  EXPECT_THAT(bad.inconsistent_blocks(), ::testing::ElementsAre(7, 11));
  EXPECT_EQ(bad.problems_size(), 3);
  // And a fingerprint that is not the served layout's.
  v1::Layout other = l;
  other.set_num_spec(2);
  v1::RecoverResponse mismatch;
  VerifyHeader(Fresh(l), other, &mismatch);
  ASSERT_EQ(mismatch.problems_size(), 1);
  EXPECT_THAT(mismatch.problems(0), HasSubstr("num_spec 3 -> 2"));
}

TEST(PoolHeaderTest, TheJournalPointsIntoTheAllocation) {
  std::vector<char> bytes = Fresh(TestLayout());
  const kernels::CommitJournal j = JournalAt(bytes.data(), 64);
  EXPECT_EQ(reinterpret_cast<char*>(j.record), bytes.data() + HeaderLayoutFor(64).journal);
  EXPECT_EQ(j.capacity_rows, kJournalRows);
  EXPECT_LE(reinterpret_cast<char*>(j.blocks + 64), bytes.data() + bytes.size());
  EXPECT_GE(reinterpret_cast<char*>(j.blocks), reinterpret_cast<char*>(j.entries + 2 * kJournalRows));
}

// ---- commit_mode DEFERRED: the pending table and its journal ----

v1::Layout DeferredLayout() {
  v1::Layout l = TestLayout();
  l.set_commit_mode(v1::DEFERRED);
  return l;
}

KeptDeferred DeferredOf(const v1::Layout& l) {
  return KeptDeferredFor(l, ComputeLayoutSizes(l).records_per_layer_bytes);
}

// A host copy's DEFERRED parts, where the kernels would see them.
struct Table {
  kernels::PendingBlocks p;
  int32_t& word() { return p.header[0]; }
  int32_t& listed() { return p.header[1]; }
  int32_t* list() { return p.header + 2; }
  int32_t& entry(int layer, int32_t block) { return p.entries[layer * p.num_blocks + block]; }
};
Table TableOf(std::vector<char>& bytes, const v1::Layout& l) {
  return Table{DeferredPartsAt(bytes.data(), l.num_blocks(), DeferredOf(l)).pending};
}

int32_t Pending(int32_t record_row, int32_t buffer, int32_t tokens) {
  return ((record_row + 1) << 6) | (buffer << 5) | tokens;
}

TEST(PoolHeaderTest, DeferredPartsFollowTheBookkeepingAndAreChecked) {
  const v1::Layout l = DeferredLayout();
  const KeptDeferred d = DeferredOf(l);
  ASSERT_EQ(d.present, 1u);
  const HeaderLayout at = HeaderLayoutFor(l.num_blocks(), d);
  const uint64_t records = ComputeLayoutSizes(l).records_per_layer_bytes;
  EXPECT_EQ(at.bookkeeping_bytes, at.records);
  EXPECT_GE(at.bytes - at.records, 2 * l.num_layers() * records);
  EXPECT_GT(at.pending_journal, HeaderLayoutFor(l.num_blocks()).blocks);
  // EAGER's layout and fingerprint are those of pools made before.
  EXPECT_EQ(HeaderLayoutFor(l.num_blocks()).bytes, HeaderLayoutFor(l.num_blocks(), {}).bytes);
  EXPECT_NE(LayoutFingerprint(l), LayoutFingerprint(TestLayout()));
  v1::Layout rows = l;
  rows.set_max_rows(l.max_rows() * 2);  // DEFERRED keeps its records: they may not change
  EXPECT_NE(LayoutFingerprint(rows), LayoutFingerprint(l));

  std::vector<char> bytes = FreshHeader(l, v1::CPU, 0, PoolBytes(l), absl::Now(), d);
  EXPECT_EQ(bytes.size(), at.bookkeeping_bytes);  // the host never copies the records
  EXPECT_TRUE(CheckHeader(bytes, l, v1::CPU, 0, PoolBytes(l), d).ok());
  // Parts that differ from the layout's though the fingerprint matches.
  absl::Status st = CheckHeader(bytes, l, v1::CPU, 0, PoolBytes(l), KeptDeferred{});
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("DEFERRED parts"));
  // Damage.
  std::vector<char> damaged = bytes;
  reinterpret_cast<KeptHeader*>(damaged.data())->deferred.capacity += 1;
  st = CheckHeader(damaged, l, v1::CPU, 0, PoolBytes(l), d);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("DEFERRED parts' checksum"));
  damaged = bytes;
  TableOf(damaged, l).word() = 2;
  st = CheckHeader(damaged, l, v1::CPU, 0, PoolBytes(l), d);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("records parity word is 2"));
  damaged = bytes;
  TableOf(damaged, l).listed() = l.max_rows() + 1;
  st = CheckHeader(damaged, l, v1::CPU, 0, PoolBytes(l), d);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("pending list has"));
  damaged = bytes;
  TableOf(damaged, l).p.journal->state = 5;
  st = CheckHeader(damaged, l, v1::CPU, 0, PoolBytes(l), d);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("pending journal's state is 5"));
  // A bookkeeping copy shorter than its own layout says.
  std::vector<char> cut(bytes.begin(), bytes.begin() + at.pending_entries);
  EXPECT_EQ(CheckHeader(cut, l, v1::CPU, 0, PoolBytes(l), d).code(), absl::StatusCode::kDataLoss);
}

// A Commit killed with the table half updated: every block it journaled
// (the old list, its rows' blocks) is lost, their entries are gone in every
// layer, and the list is rebuilt from what is left.
TEST(PoolHeaderTest, AnInterruptedDeferredCommitLosesWhatItListedAndLeavesTheTableConsistent) {
  const v1::Layout l = DeferredLayout();
  const int64_t B = l.num_blocks();
  std::vector<char> bytes = FreshHeader(l, v1::CPU, 0, PoolBytes(l), absl::Now(), DeferredOf(l));
  Table t = TableOf(bytes, l);
  // The previous commit left 3 and 4 pending (buffer 1); a Verify took 4's
  // layer 0 entry. Block 9 is pending too and untouched by the commit.
  t.word() = 1;
  t.listed() = 3;
  t.list()[0] = 3;
  t.list()[1] = 4;
  t.list()[2] = 9;
  for (int layer = 0; layer < l.num_layers(); ++layer) {
    t.entry(layer, 3) = Pending(0, 1, 2);
    t.entry(layer, 4) = layer == 0 ? 0 : Pending(1, 1, 3);
    t.entry(layer, 9) = Pending(2, 1, 1);
  }
  // The commit of step 12 (rows writing 3 and 6) had materialized 3 and
  // started leaving 6 pending, in buffer 0, when it died.
  t.p.journal->kind = kernels::kPendingCommit;
  t.p.journal->step = 12;
  t.p.journal->count = 4;
  t.p.journal_blocks[0] = 3;
  t.p.journal_blocks[1] = 4;
  t.p.journal_blocks[2] = 3;
  t.p.journal_blocks[3] = 6;
  t.p.journal->state = kernels::kJournalStarted;
  t.entry(0, 3) = 0;
  t.entry(0, 6) = Pending(1, 0, 2);
  kernels::JournalRecord& j = Journal(bytes, B);
  j.state = kernels::kJournalStarted;
  j.step = 12;
  j.num_rows = 2;
  Entries(bytes, B)[0] = 3;
  Entries(bytes, B)[1] = kernels::kNullBlock;
  Entries(bytes, B)[2] = 6;
  Entries(bytes, B)[3] = kernels::kNullBlock;

  const v1::RecoverResponse r = AttachHeader(&bytes, absl::Now(), 7);
  EXPECT_TRUE(r.interrupted());
  EXPECT_EQ(r.interrupted_step(), 12u);
  EXPECT_EQ(r.interrupted_call(), "Commit of step 12");
  EXPECT_THAT(r.lost_blocks(), ::testing::ElementsAre(3, 4, 6));
  EXPECT_EQ(r.pending_blocks(), 1);
  t = TableOf(bytes, l);
  EXPECT_EQ(t.p.journal->state, kernels::kJournalIdle);
  for (int layer = 0; layer < l.num_layers(); ++layer) {
    EXPECT_EQ(t.entry(layer, 3), 0);
    EXPECT_EQ(t.entry(layer, 4), 0);
    EXPECT_EQ(t.entry(layer, 6), 0);
    EXPECT_EQ(t.entry(layer, 9), Pending(2, 1, 1)) << "untouched pending tokens survive";
  }
  EXPECT_EQ(t.listed(), 1);
  EXPECT_EQ(t.list()[0], 9);
  EXPECT_EQ(t.word(), 1);
  v1::RecoverResponse verified;
  VerifyHeader(bytes, l, &verified);
  EXPECT_EQ(verified.pending_blocks(), 1);
  EXPECT_THAT(verified.inconsistent_blocks(), ::testing::ElementsAre(3, 4, 6));  // lost only
  for (const std::string& problem : verified.problems()) {
    EXPECT_THAT(problem, ::testing::Not(HasSubstr("pending"))) << problem;
  }
}

TEST(PoolHeaderTest, AnInterruptedDiscardLosesNothingAndForgetsItsBlocks) {
  const v1::Layout l = DeferredLayout();
  std::vector<char> bytes = FreshHeader(l, v1::CPU, 0, PoolBytes(l), absl::Now(), DeferredOf(l));
  Table t = TableOf(bytes, l);
  t.listed() = 1;
  t.list()[0] = 5;
  t.entry(1, 5) = Pending(0, 0, 4);  // layer 0's was discarded already
  t.p.journal->kind = kernels::kPendingDiscard;
  t.p.journal->count = 1;
  t.p.journal_blocks[0] = 5;
  t.p.journal->state = kernels::kJournalStarted;
  const v1::RecoverResponse r = AttachHeader(&bytes, absl::Now(), 7);
  EXPECT_FALSE(r.interrupted());
  EXPECT_EQ(r.interrupted_call(), "Flush (discard)");
  EXPECT_THAT(r.lost_blocks(), ::testing::IsEmpty());
  EXPECT_EQ(r.pending_blocks(), 0);
  t = TableOf(bytes, l);
  EXPECT_EQ(t.entry(1, 5), 0);
  EXPECT_EQ(t.listed(), 0);
}

TEST(PoolHeaderTest, VerifyFindsAnInconsistentPendingTable) {
  const v1::Layout l = DeferredLayout();
  std::vector<char> bytes = FreshHeader(l, v1::CPU, 0, PoolBytes(l), absl::Now(), DeferredOf(l));
  v1::RecoverResponse ok;
  VerifyHeader(bytes, l, &ok);
  EXPECT_THAT(ok.problems(), ::testing::IsEmpty());
  Table t = TableOf(bytes, l);
  t.listed() = 2;
  t.list()[0] = 5;
  t.list()[1] = 6;
  t.entry(0, 5) = Pending(0, 0, 2);                 // fine
  t.entry(0, 6) = Pending(l.max_rows() + 3, 0, 2);  // a record row past the records
  t.entry(1, 8) = Pending(1, 0, 1);                 // pending, not listed
  t.entry(0, 10) = Pending(2, 1, 1);                // the other buffer than the word's
  v1::RecoverResponse bad;
  VerifyHeader(bytes, l, &bad);
  EXPECT_EQ(bad.pending_blocks(), 4);
  EXPECT_THAT(bad.inconsistent_blocks(), ::testing::ElementsAre(6, 8, 10));
  const std::string all = absl::StrJoin(bad.problems(), "\n");
  EXPECT_THAT(all, HasSubstr("block 6 has tokens pending in layer 0 that no commit could have "
                             "left: record row"));
  EXPECT_THAT(all, HasSubstr("block 8 has tokens pending but is not in the pending list"));
  EXPECT_THAT(all, HasSubstr("block 10 has tokens pending in layer 0 that no commit could have "
                             "left: records buffer 1 (the parity word says 0)"));
  // At the next start: the impossible entries lose their blocks, the
  // unlisted one is listed, and verify-pools finds only the lost blocks.
  const v1::RecoverResponse r = AttachHeader(&bytes, absl::Now(), 7);
  EXPECT_THAT(r.lost_blocks(), ::testing::ElementsAre(6, 10));
  EXPECT_EQ(r.pending_blocks(), 2);
  v1::RecoverResponse after;
  VerifyHeader(bytes, l, &after);
  EXPECT_THAT(after.inconsistent_blocks(), ::testing::ElementsAre(6, 10));
  EXPECT_EQ(after.problems_size(), 1) << absl::StrJoin(after.problems(), "\n");
}

// FAST: its parts follow the block records, are checked like DEFERRED's,
// and verify-pools finds what no call leaves; the next start fixes it.
TEST(PoolHeaderTest, FastPartsAreCheckedAndVerified) {
  v1::Layout l = TestLayout();
  l.set_commit_mode(v1::FAST);
  const KeptFast f = KeptFastFor(l);
  ASSERT_EQ(f.present, 1u);
  EXPECT_EQ(KeptFastFor(TestLayout()).present, 0u);
  const HeaderLayout at = HeaderLayoutFor(l.num_blocks(), {}, f);
  EXPECT_GT(at.fold_journal, HeaderLayoutFor(l.num_blocks()).blocks);
  EXPECT_EQ(at.bookkeeping_bytes, at.rings);
  EXPECT_GE(at.bytes - at.rings,
            uint64_t(l.num_layers()) * (f.ring_k_bytes + f.ring_u_bytes + f.ring_log_decay_bytes));
  std::vector<char> bytes = FreshHeader(l, v1::CPU, 0, PoolBytes(l), absl::Now(), {}, f);
  EXPECT_EQ(bytes.size(), at.bookkeeping_bytes);
  EXPECT_TRUE(CheckHeader(bytes, l, v1::CPU, 0, PoolBytes(l), {}, f).ok());
  absl::Status st = CheckHeader(bytes, l, v1::CPU, 0, PoolBytes(l), {}, KeptFast{});
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("FAST parts"));
  std::vector<char> damaged = bytes;
  reinterpret_cast<KeptHeader*>(damaged.data())->fast.capacity += 1;
  st = CheckHeader(damaged, l, v1::CPU, 0, PoolBytes(l), {}, f);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("FAST parts' checksum"));
  damaged = bytes;
  auto* journal = reinterpret_cast<kernels::PendingJournalRecord*>(damaged.data() + at.fold_journal);
  journal->state = 4;
  st = CheckHeader(damaged, l, v1::CPU, 0, PoolBytes(l), {}, f);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("fold journal's state is 4"));

  v1::RecoverResponse ok;
  VerifyHeader(bytes, l, &ok);
  EXPECT_THAT(ok.problems(), ::testing::IsEmpty());
  const auto cursor = [&](int layer, int64_t block) -> kernels::FastCursor& {
    return reinterpret_cast<kernels::FastCursor*>(bytes.data() + at.cursors +
                                                  layer * at.cursors_stride)[block];
  };
  cursor(0, 4) = kernels::FastCursor{2, 0, 0};          // fine: pending
  cursor(1, 6) = kernels::FastCursor{f.capacity, 0, 0};  // more tokens than a Commit leaves
  cursor(0, 9) = kernels::FastCursor{1, 0, 0};          // pending on a lost block
  Blocks(bytes, l.num_blocks())[9].lost = 1;
  v1::RecoverResponse bad;
  VerifyHeader(bytes, l, &bad);
  EXPECT_EQ(bad.pending_blocks(), 3);
  EXPECT_THAT(bad.inconsistent_blocks(), ::testing::ElementsAre(6, 9));
  const std::string all = absl::StrJoin(bad.problems(), "\n");
  EXPECT_THAT(all, HasSubstr("block 6's ring in layer 1 has a cursor no call leaves"));
  EXPECT_THAT(all, HasSubstr("block 9 is marked lost and its ring still holds tokens"));
  // The next start: block 6 lost too, both rings emptied, block 4 kept.
  const v1::RecoverResponse r = AttachHeader(&bytes, absl::Now(), 7);
  EXPECT_THAT(r.lost_blocks(), ::testing::ElementsAre(6, 9));
  EXPECT_EQ(r.pending_blocks(), 1);
  EXPECT_EQ(cursor(0, 4).tokens, 2);
  EXPECT_EQ(cursor(1, 6).tokens, 0);
  EXPECT_EQ(cursor(0, 9).tokens, 0);
}

}  // namespace
}  // namespace server
}  // namespace specstate
