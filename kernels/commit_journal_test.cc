// The commit journal (kda_args.h, CommitJournal) on every backend: a commit
// lists the blocks it writes and marks its record started before its first
// write, and after its last write records its step in those blocks' records
// (clearing their lost marks) and marks the record committed; a commit whose
// checks fail changes no byte of it; the launcher refuses a journal it
// cannot fill. On the CPU the test hook sees the phases in order, with the
// record started while the states are being written.
#include <cstdint>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/device_status.h"
#include "kernels/kda_args.h"
#include "kernels/kda_kernels.h"
#include "kernels/testing/kernel_harness.h"
#include "tests/reference/kda_reference.h"

namespace specstate {
namespace kernels {
namespace testing {
namespace {

namespace ref = ::specstate::reference;

// The journal's three buffers, in the backend's memory.
struct JournalMemory {
  Tensor record, entries, blocks;
  int capacity_rows = 0;

  CommitJournal Journal(uint64_t step) const {
    CommitJournal j;
    j.record = record.As<JournalRecord>();
    j.entries = entries.As<int32_t>();
    j.capacity_rows = capacity_rows;
    j.blocks = blocks.As<BlockRecord>();
    j.step = step;
    return j;
  }
  JournalRecord Record() const { return FromBytes<JournalRecord>(record.Read())[0]; }
  std::vector<int32_t> Entries() const { return FromBytes<int32_t>(entries.Read()); }
  std::vector<BlockRecord> Blocks() const { return FromBytes<BlockRecord>(blocks.Read()); }
};

// An align-mode step of rows that cross boundaries, stay, accept nothing,
// have null blocks: every kind of entry.
StepSpec AlignSpec(const Config& c, std::vector<int32_t>* batch_rows, Random& rng) {
  struct Row {
    int tokens;
    int32_t source;
    int accepted;
    int computed;
  };
  const Row rows[] = {{4, 1, 4, 12}, {4, 1, 3, 6}, {4, 1, 2, 16},
                      {4, 1, 0, 6},  {4, 0, 3, 6}, {2, 1, 5, 15}};
  StepSpec spec = SpecOf(c);
  spec.q = 4;
  spec.num_layers = 2;
  spec.align = true;
  spec.block_size = 8;
  spec.width = 4;
  const int n = static_cast<int>(std::size(rows));
  spec.batch = n + 1;
  batch_rows->resize(spec.batch);
  for (int b = 0; b < spec.batch; ++b) (*batch_rows)[b] = b;
  rng.Shuffle(batch_rows);
  spec.num_accepted.assign(spec.batch, 1000);
  spec.num_computed.assign(spec.batch, -1000);
  for (int i = 0; i < n; ++i) {
    spec.tokens.push_back(rows[i].tokens);
    spec.sources.push_back(rows[i].source);
    spec.num_accepted[(*batch_rows)[i]] = rows[i].accepted;
    spec.num_computed[(*batch_rows)[i]] = rows[i].computed;
    spec.request_indices.push_back((*batch_rows)[i]);
  }
  return spec;
}

class CommitJournalTest : public KdaKernelsTest {
 protected:
  JournalMemory MakeJournal(const Step& s, int capacity_rows) {
    JournalMemory m;
    m.capacity_rows = capacity_rows;
    m.record = Zeroed(sizeof(JournalRecord));
    m.entries = Zeroed(2 * sizeof(int32_t) * capacity_rows);
    m.blocks = Zeroed(sizeof(BlockRecord) * s.num_blocks);
    return m;
  }

  // Commits `s` with `journal`, as RunCommit does.
  CallResult RunJournaledCommit(Step& s, const CommitJournal& journal) {
    CallData cd;
    CommitArgs args = CommitArgsFor(s, &cd);
    args.journal = journal;
    args.status_mirror = ZeroedMirror();
    return Finish(kernels_->Commit(args, stream()), "Commit", s);
  }
};

TEST_P(CommitJournalTest, ACommitListsItsBlocksAndRecordsThemOnceDone) {
  std::vector<int32_t> batch_rows;
  StepSpec spec = AlignSpec(kConfigs[0], &batch_rows, rng());
  Step s = MakeStep(spec);
  SCOPED_TRACE(Describe(spec));
  const std::vector<ref::PlanRow> plan = ref::PlanCommit(RefCommitCall(s));
  JournalMemory m = MakeJournal(s, s.rows + 2);
  // As a previous commit left it, with two blocks marked lost: one this
  // commit writes (the mark goes), one it does not (the mark stays).
  JournalRecord before;
  before.state = kJournalCommitted;
  before.step = before.last_committed_step = 41;
  before.commits = 6;
  m.record.Write(ToBytes(std::vector<JournalRecord>{before}));
  std::vector<BlockRecord> blocks(s.num_blocks);
  int32_t written = 0;
  for (const ref::PlanRow& p : plan) {
    if (Commits(p)) written = p.final_block;
  }
  ASSERT_GT(written, 0);
  int32_t untouched = 1;
  const auto writes = [&](int32_t b) {
    for (const ref::PlanRow& p : plan) {
      if (Commits(p) && (p.final_block == b || p.boundary_block == b)) return true;
    }
    return false;
  };
  while (writes(untouched) || untouched == written) ++untouched;
  ASSERT_LT(untouched, s.num_blocks);
  blocks[written].lost = 2;
  blocks[untouched].lost = 1;
  blocks[untouched].step = 9;
  m.blocks.Write(ToBytes(blocks));

  StockAndVerifyAll(s);
  const Snapshot before_commit = TakeSnapshot(s);
  ASSERT_TRUE(CallOk(RunJournaledCommit(s, m.Journal(42))));
  ExpectCommitMatchesStock(s, before_commit);

  const JournalRecord r = m.Record();
  EXPECT_EQ(r.state, kJournalCommitted);
  EXPECT_EQ(r.step, 42u);
  EXPECT_EQ(r.last_committed_step, 42u);
  EXPECT_EQ(r.commits, 7u);
  EXPECT_EQ(r.num_rows, s.rows);
  const std::vector<int32_t> entries = m.Entries();
  std::vector<BlockRecord> want = blocks;
  for (int i = 0; i < s.rows; ++i) {
    const ref::PlanRow& p = plan[i];
    int32_t first = kNullBlock, second = kNullBlock;
    if (Commits(p)) {
      first = p.final_block;
      if (p.boundary_block > kNullBlock && p.boundary_block != p.final_block) {
        second = p.boundary_block;
      }
    }
    EXPECT_EQ(entries[2 * i], first) << "row " << i;
    EXPECT_EQ(entries[2 * i + 1], second) << "row " << i;
    for (int32_t b : {first, second}) {
      if (b <= kNullBlock) continue;
      want[b].step = 42;
      want[b].sequence = 7;
      want[b].lost = 0;
    }
  }
  const std::vector<BlockRecord> got = m.Blocks();
  for (int64_t b = 0; b < s.num_blocks; ++b) {
    EXPECT_EQ(got[b].step, want[b].step) << "block " << b;
    EXPECT_EQ(got[b].sequence, want[b].sequence) << "block " << b;
    EXPECT_EQ(got[b].lost, want[b].lost) << "block " << b;
  }
  EXPECT_EQ(got[untouched].lost, 1u);
  EXPECT_EQ(got[written].lost, 0u);
}

TEST_P(CommitJournalTest, ACommitThatFailsItsChecksLeavesTheJournalAlone) {
  std::vector<int32_t> batch_rows;
  StepSpec spec = AlignSpec(kConfigs[3], &batch_rows, rng());
  Step s = MakeStep(spec);
  JournalMemory m = MakeJournal(s, s.rows);
  JournalRecord before;
  before.state = kJournalCommitted;
  before.step = before.last_committed_step = 5;
  before.commits = 3;
  m.record.Write(ToBytes(std::vector<JournalRecord>{before}));
  const std::vector<uint8_t> record = m.record.Read(), entries = m.entries.Read(),
                             blocks = m.blocks.Read();
  StockAndVerifyAll(s);
  // The commit's own check fails: a block-table entry past the pool.
  s.table[batch_rows[0]][1] = static_cast<int32_t>(s.num_blocks);
  const CallResult r = RunJournaledCommit(s, m.Journal(6));
  EXPECT_TRUE(r.launch.ok()) << r.launch;
  EXPECT_FALSE(r.device.ok());
  EXPECT_EQ(FirstDifference(m.record.Read(), record), -1);
  EXPECT_EQ(FirstDifference(m.entries.Read(), entries), -1);
  EXPECT_EQ(FirstDifference(m.blocks.Read(), blocks), -1);
}

TEST_P(CommitJournalTest, TheLauncherRefusesAJournalItCannotFill) {
  std::vector<int32_t> batch_rows;
  Step s = MakeStep(AlignSpec(kConfigs[0], &batch_rows, rng()));
  JournalMemory m = MakeJournal(s, s.rows - 1);
  CommitJournal small = m.Journal(1);
  absl::Status st = RunJournaledCommit(s, small).launch;
  EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange) << st;
  EXPECT_NE(std::string(st.message()).find("journal: entries for"), std::string::npos) << st;
  CommitJournal no_entries = m.Journal(1);
  no_entries.capacity_rows = s.rows;
  no_entries.entries = nullptr;
  st = RunJournaledCommit(s, no_entries).launch;
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
}

// The CPU worker's phases, and what the record says at each.
std::vector<std::string>* g_phases = nullptr;
const JournalRecord* g_record = nullptr;

void RecordPhase(const char* phase) {
  g_phases->push_back(absl::StrCat(phase, ":", g_record->state, ":", g_record->step));
}

TEST_P(CommitJournalTest, TheTestHookSeesThePhasesInOrderOnTheCpu) {
  OnCpu([&] {
    std::vector<int32_t> batch_rows;
    Step s = MakeStep(AlignSpec(kConfigs[0], &batch_rows, rng()));
    JournalMemory m = MakeJournal(s, s.rows);
    std::vector<std::string> phases;
    g_phases = &phases;
    g_record = m.record.As<JournalRecord>();
    CommitJournal j = m.Journal(77);
    j.test_hook = &RecordPhase;
    StockAndVerifyAll(s);
    ASSERT_TRUE(CallOk(RunJournaledCommit(s, j)));
    const std::string started = absl::StrCat(":", kJournalStarted, ":77");
    EXPECT_EQ(phases, (std::vector<std::string>{"started" + started, "conv" + started,
                                                "layer" + started, "layer" + started,
                                                "replayed" + started}));
    EXPECT_EQ(m.Record().state, kJournalCommitted);
    g_phases = nullptr;
    g_record = nullptr;
  });
}

INSTANTIATE_TEST_SUITE_P(Backends, CommitJournalTest,
                         ::testing::Values(Backend::kCpu, Backend::kCuda), BackendParamName);

}  // namespace
}  // namespace testing
}  // namespace kernels
}  // namespace specstate
