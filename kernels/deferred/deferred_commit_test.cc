// DEFERRED commits against EAGER ones, on every backend, bit for bit (never a
// tolerance): two copies of the service's memory run the same decode loop of
// hundreds of steps, one committing EAGER (verify, then replay at Commit), the
// other DEFERRED (Commit leaves the accepted tokens pending; the next Verify
// of the block replays them first, a Flush or the next Commit materializes
// them otherwise). Rows join, leave, skip steps and change order; steps are
// abandoned halfway; requests end (their blocks flushed with discard and
// prefilled afresh); Flush and single-block flushes come in between, the
// latter first into a copy (ReadState's: EAGER's state, nothing changed).
// Every output of every Verify is the EAGER one; after every Commit every
// block but those it left pending holds the EAGER state, and so does
// every block a flush materialized; conv windows never differ. Then the
// misuse the kernels detect: rows sharing a pending block, a commit writing
// a block another commit left pending, a bad block list; each rejected with
// its field, nothing written. And batch invariance: a request alone and in a
// batch of 64 computes the same bits.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/device_status.h"
#include "kernels/dtype.h"
#include "kernels/kda_args.h"
#include "kernels/kda_kernels.h"
#include "kernels/testing/kernel_harness.h"
#include "tests/reference/kda_reference.h"

namespace specstate {
namespace kernels {
namespace testing {
namespace {

namespace ref = ::specstate::reference;

struct LoopSpec {
  Config config;
  int q = 4;
  int layers = 2;
  int requests = 6;
  int steps = 200;
  bool align = false;
  int block_size = 0;  // align: tokens per block
  int width = 0;       // align: block-table columns per request
  // DEFERRED keeps both journals (kept pools): the results must not change,
  // and each call leaves its pending journal idle, its kind recorded.
  bool journaled = false;
};

// One layer's buffers of one commit mode's memory.
struct LayerMemory {
  Tensor state, conv, a_log, dt_bias;
  Tensor rec_kv[2], rec_g[2], rec_beta[2];
  Tensor out;
  CommitLayer table{};
};

// What the kernels of one commit mode own: the service's memory.
struct Memory {
  bool deferred = false;
  std::vector<LayerMemory> layers;
  Tensor layer_table;
  Tensor status, snapshot_qsl, snapshot_indices, commit_workspace;
  // DEFERRED.
  Tensor entries, header, verify_workspace, replay_plans, commit_jobs, commit_job_count,
      flush_jobs, flush_job_count, checked_blocks;
  PendingBlocks pending{};
  // Journaled: the pending journal and the commit journal.
  Tensor pending_journal, pending_journal_blocks, journal_record, journal_entries, journal_blocks;
  CommitJournal journal{};
  uint64_t step = 0;
};

class DeferredCommitTest : public KdaKernelsTest {
 protected:
  // The loop's fixed shape.
  void Init(const LoopSpec& spec) {
    spec_ = spec;
    shape_.num_heads = spec.config.heads;
    shape_.head_dim = spec.config.head_dim;
    shape_.act_dtype = spec.config.act;
    shape_.state_dtype = spec.config.state;
    shape_.kind = spec.config.kind;
    shape_.num_value_heads = spec.config.value_heads;
    shape_.gate = spec.config.gate;
    shape_.lower_bound = -5.0f;
    max_rows_ = spec.requests + 2;  // room for idle rows
    // Mode none: a block per request. Align: `width` per request.
    blocks_per_request_ = spec.align ? spec.width : 1;
    num_blocks_ = 1 + int64_t{spec.requests} * blocks_per_request_ + 2;
    conv_width_ = spec.q + 2;  // conv_kernel 3
    block_elems_ = ValueWidth(shape_) * shape_.head_dim;
    conv_block_elems_ = int64_t{kConvDim} * conv_width_;
    table_.assign(spec.requests, {});
    for (int r = 0; r < spec.requests; ++r) {
      for (int c = 0; c < blocks_per_request_; ++c) {
        table_[r].push_back(1 + r * blocks_per_request_ + c);
      }
    }
    computed_.assign(spec.requests, spec.align ? rng().Int(1, spec.block_size * 2) : 1);
  }

  size_t act_size() const { return DTypeSize(shape_.act_dtype); }
  size_t state_size() const { return DTypeSize(shape_.state_dtype); }

  std::vector<uint8_t> RandomBytes(DType dtype, size_t count, float stddev, float mean = 0.0f) {
    std::vector<uint8_t> bytes(count * DTypeSize(dtype));
    for (size_t i = 0; i < count; ++i) {
      ref::StoreElement(RefDtype(dtype), mean + rng().Normal(stddev), &bytes[i * DTypeSize(dtype)]);
    }
    return bytes;
  }

  Memory MakeMemory(bool deferred, const std::vector<uint8_t>& states,
                    const std::vector<uint8_t>& convs, const std::vector<uint8_t>& params) {
    Memory m;
    m.deferred = deferred;
    const int Q = spec_.q;
    const int64_t tokens = int64_t{max_rows_} * Q;
    const size_t es = act_size();
    const int H = shape_.num_heads, K = shape_.head_dim;
    for (int l = 0; l < spec_.layers; ++l) {
      LayerMemory lm;
      const size_t state_bytes = num_blocks_ * block_elems_ * state_size();
      lm.state = Upload(std::vector<uint8_t>(states.begin() + l * state_bytes,
                                             states.begin() + (l + 1) * state_bytes));
      const size_t conv_bytes = num_blocks_ * conv_block_elems_ * es;
      lm.conv = Upload(std::vector<uint8_t>(convs.begin() + l * conv_bytes,
                                            convs.begin() + (l + 1) * conv_bytes));
      const size_t a_bytes = sizeof(float) * H, d_bytes = sizeof(float) * H * K;
      const size_t base = l * (a_bytes + d_bytes);
      lm.a_log = Upload(std::vector<uint8_t>(params.begin() + base, params.begin() + base + a_bytes));
      lm.dt_bias = Upload(std::vector<uint8_t>(params.begin() + base + a_bytes,
                                               params.begin() + base + a_bytes + d_bytes));
      for (int b = 0; b < (deferred ? 2 : 1); ++b) {
        lm.rec_kv[b] = Zeroed(tokens * RecordTokenWidth(shape_) * es);
        lm.rec_g[b] = Zeroed(tokens * GateWidth(shape_) * es);
        lm.rec_beta[b] = Zeroed(tokens * ValueHeads(shape_) * es);
      }
      lm.out = Zeroed(tokens * ValueWidth(shape_) * es);
      lm.table.state = StatePool{lm.state.data(), num_blocks_, block_elems_};
      lm.table.conv = ConvPool{lm.conv.data(), num_blocks_, conv_block_elems_, conv_width_, 1,
                               kConvDim, conv_width_};
      lm.table.params = LayerParams{lm.a_log.As<float>(), lm.dt_bias.As<float>()};
      lm.table.records = Records{lm.rec_kv[0].data(), lm.rec_g[0].data(), lm.rec_beta[0].data(),
                                 max_rows_, Q};
      lm.table.records_alt =
          deferred ? Records{lm.rec_kv[1].data(), lm.rec_g[1].data(), lm.rec_beta[1].data(),
                             max_rows_, Q}
                   : lm.table.records;
      m.layers.push_back(std::move(lm));
    }
    std::vector<CommitLayer> table;
    for (const LayerMemory& lm : m.layers) table.push_back(lm.table);
    m.layer_table = Upload(ToBytes(table));
    m.status = Zeroed(sizeof(DeviceStatus));
    m.snapshot_qsl = Zeroed((max_rows_ + 1) * 4);
    m.snapshot_indices = Zeroed(max_rows_ * 4);
    m.commit_workspace = Zeroed(CommitWorkspaceBytes(max_rows_, Q, num_blocks_));
    if (deferred) {
      m.entries = Zeroed(PendingEntriesBytes(spec_.layers, num_blocks_));
      m.header = Zeroed(PendingHeaderBytes(max_rows_));
      m.pending = PendingBlocks{m.entries.As<int32_t>(), m.header.As<int32_t>(), spec_.layers,
                                num_blocks_, max_rows_};
      m.verify_workspace = Zeroed(VerifyWorkspaceBytes(num_blocks_));
      m.replay_plans = Zeroed(size_t{4} * max_rows_);
      m.commit_jobs = Zeroed(CommitJobsCapacity(max_rows_, spec_.layers) * sizeof(ReplayJob));
      m.commit_job_count = Zeroed(4);
      m.flush_jobs = Zeroed(FlushJobsCapacity(max_rows_, spec_.layers) * sizeof(ReplayJob));
      m.flush_job_count = Zeroed(4);
      m.checked_blocks = Zeroed(num_blocks_ * 4);
      if (spec_.journaled) {
        const size_t capacity = PendingJournalCapacity(max_rows_, num_blocks_);
        m.pending_journal = Zeroed(sizeof(PendingJournalRecord));
        m.pending_journal_blocks = Zeroed(capacity * 4);
        m.pending.journal = m.pending_journal.As<PendingJournalRecord>();
        m.pending.journal_blocks = m.pending_journal_blocks.As<int32_t>();
        m.pending.journal_capacity = static_cast<int>(capacity);
        m.journal_record = Zeroed(sizeof(JournalRecord));
        m.journal_entries = Zeroed(2 * 4 * max_rows_);
        m.journal_blocks = Zeroed(sizeof(BlockRecord) * num_blocks_);
        m.journal.record = m.journal_record.As<JournalRecord>();
        m.journal.entries = m.journal_entries.As<int32_t>();
        m.journal.capacity_rows = max_rows_;
        m.journal.blocks = m.journal_blocks.As<BlockRecord>();
      }
    }
    return m;
  }

  // The step's rows: each request joins with probability 7/8, in a random
  // order, with idle rows (null checkpoints) among them.
  void DrawRows() {
    rows_.clear();
    for (int r = 0; r < spec_.requests; ++r) {
      if (rng().Int(0, 7) > 0) rows_.push_back(r);
    }
    rng().Shuffle(&rows_);
    if (rng().Int(0, 3) == 0) rows_.insert(rows_.begin() + rng().Int(0, rows_.size()), -1);
    qsl_.assign(1, 0);
    sources_.clear();
    for (int r : rows_) {
      const int tokens = rng().Int(0, 9) == 0 ? 0 : rng().Int(1, spec_.q);
      qsl_.push_back(qsl_.back() + tokens);
      sources_.push_back(r < 0 ? 0 : SourceOf(r));
    }
  }

  // Where request r's running state is.
  int32_t SourceOf(int r) const {
    if (!spec_.align) return table_[r][0];
    const int col = std::max(computed_[r] - 1, 0) / spec_.block_size;
    return table_[r][std::min(col, spec_.width - 1)];
  }

  // One layer's activations of the step, the same bytes for both memories.
  struct Inputs {
    Tensor q, k, v, g, beta;
  };
  Inputs DrawInputs(int tokens) {
    const int64_t n = std::max(tokens, 1);
    Inputs in;
    const DType a = shape_.act_dtype;
    in.q = Upload(RandomBytes(a, n * KeyWidth(shape_), 1.0f));
    in.k = Upload(RandomBytes(a, n * KeyWidth(shape_), 1.0f));
    in.v = Upload(RandomBytes(a, n * ValueWidth(shape_), 1.0f));
    const bool gdn = shape_.kind == LayerKind::kGdn;
    // GDN's g is a log-decay (negative), its beta a strength in (0, 1).
    std::vector<uint8_t> g(n * GateWidth(shape_) * act_size());
    for (int64_t i = 0; i < n * GateWidth(shape_); ++i) {
      ref::StoreElement(RefDtype(a), gdn ? -rng().Uniform(0.0f, 1.0f) : rng().Normal(1.0f),
                        &g[i * act_size()]);
    }
    in.g = Upload(g);
    std::vector<uint8_t> beta(n * ValueHeads(shape_) * act_size());
    for (int64_t i = 0; i < n * ValueHeads(shape_); ++i) {
      ref::StoreElement(RefDtype(a), gdn ? rng().Uniform(0.0f, 1.0f) : rng().Normal(1.0f),
                        &beta[i * act_size()]);
    }
    in.beta = Upload(beta);
    return in;
  }

  CallResult Verify(Memory& m, int l, const Inputs& in, bool first, CallData* cd) {
    LayerMemory& lm = m.layers[l];
    VerifyArgs a;
    a.shape = shape_;
    a.q = Activation{in.q.data(), KeyWidth(shape_)};
    a.k = Activation{in.k.data(), KeyWidth(shape_)};
    a.v = Activation{in.v.data(), ValueWidth(shape_)};
    a.g = Activation{in.g.data(), GateWidth(shape_)};
    a.beta = Activation{in.beta.data(), ValueHeads(shape_)};
    a.num_tokens = qsl_.back();
    a.out = lm.out.data();
    a.state = lm.table.state;
    a.params = lm.table.params;
    a.records = lm.table.records;
    a.num_rows = static_cast<int>(rows_.size());
    a.query_start_loc = Ints(cd, qsl_);
    a.state_indices = IndexMatrix{Ints(cd, sources_.empty() ? std::vector<int32_t>{0} : sources_),
                                  1, 1};
    if (first) {
      a.snapshot_query_start_loc = m.snapshot_qsl.As<int32_t>();
      a.snapshot_state_indices = m.snapshot_indices.As<int32_t>();
    } else {
      a.expected_query_start_loc = m.snapshot_qsl.As<int32_t>();
      a.expected_state_indices = m.snapshot_indices.As<int32_t>();
    }
    a.status = m.status.As<DeviceStatus>();
    if (m.deferred) {
      a.mode = CommitMode::kDeferred;
      a.pending = m.pending;
      a.layer = l;
      a.records_alt = lm.table.records_alt;
      a.replay_plan = m.replay_plans.As<int32_t>();
      a.workspace = m.verify_workspace.data();
      a.workspace_bytes = m.verify_workspace.dev.size();
    }
    CallResult r = Finish(kernels_->Verify(a, stream()), "Verify", a.status, /*mirrored=*/false);
    if (m.deferred) ExpectJournalIdle(m, kPendingVerify, "Verify");
    return r;
  }

  // Journaled: the pending journal is idle after the call, and names it.
  void ExpectJournalIdle(const Memory& m, uint32_t kind, const char* op) {
    if (m.pending.journal == nullptr) return;
    const PendingJournalRecord j = FromBytes<PendingJournalRecord>(m.pending_journal.Read())[0];
    EXPECT_EQ(j.state, kJournalIdle) << op << " left its pending journal started";
    EXPECT_EQ(j.kind, kind) << op;
    EXPECT_GE(j.count, 0) << op;
    EXPECT_LE(j.count, m.pending.journal_capacity) << op;
  }

  CallResult Commit(Memory& m, const std::vector<int32_t>& accepted, CallData* cd) {
    CommitArgs a;
    a.shape = shape_;
    a.spec_query_len = spec_.q;
    a.num_layers = spec_.layers;
    std::vector<CommitLayer>* table = &cd->layers;
    for (const LayerMemory& lm : m.layers) table->push_back(lm.table);
    a.layers = table->data();
    a.device_layers = m.layer_table.As<CommitLayer>();
    a.num_rows = static_cast<int>(rows_.size());
    a.query_start_loc = m.snapshot_qsl.As<int32_t>();
    a.state_indices = IndexMatrix{m.snapshot_indices.As<int32_t>(), 1, 1};
    a.batch = std::max(a.num_rows, 1);
    a.num_accepted = Ints(cd, accepted.empty() ? std::vector<int32_t>{0} : accepted);
    if (spec_.align) {
      std::vector<int32_t> flat, computed;
      for (int r : rows_) {
        for (int c = 0; c < spec_.width; ++c) flat.push_back(r < 0 ? 0 : table_[r][c]);
        computed.push_back(r < 0 ? 0 : computed_[r]);
      }
      if (flat.empty()) {
        flat.assign(spec_.width, 0);
        computed.push_back(0);
      }
      a.block_table = IndexMatrix{Ints(cd, flat), spec_.width, spec_.width};
      a.num_computed_tokens = Ints(cd, computed);
      a.mamba_block_size = spec_.block_size;
    }
    a.workspace = m.commit_workspace.data();
    a.workspace_bytes = m.commit_workspace.dev.size();
    a.status = m.status.As<DeviceStatus>();
    if (m.deferred) {
      a.mode = CommitMode::kDeferred;
      a.pending = m.pending;
      a.jobs = ReplayJobs{m.commit_jobs.As<ReplayJob>(), m.commit_job_count.As<int32_t>(),
                          static_cast<int>(CommitJobsCapacity(max_rows_, spec_.layers))};
    }
    if (m.journal.record != nullptr) {
      a.journal = m.journal;
      a.journal.step = ++m.step;
    }
    CallResult r = Finish(kernels_->Commit(a, stream()), "Commit", a.status, /*mirrored=*/false);
    if (m.journal.record != nullptr) {
      ExpectJournalIdle(m, kPendingCommit, "Commit");
      const JournalRecord j = FromBytes<JournalRecord>(m.journal_record.Read())[0];
      EXPECT_EQ(j.state, kJournalCommitted);
      EXPECT_EQ(j.last_committed_step, m.step);
      const PendingJournalRecord p = FromBytes<PendingJournalRecord>(m.pending_journal.Read())[0];
      EXPECT_EQ(p.step, m.step);
    }
    return r;
  }

  // A Flush of every pending block, of every layer (the layer tables in `cd`).
  FlushArgs FlushArgsFor(Memory& m, CallData* cd) {
    FlushArgs a;
    a.shape = shape_;
    a.spec_query_len = spec_.q;
    a.num_layers = spec_.layers;
    for (const LayerMemory& lm : m.layers) cd->layers.push_back(lm.table);
    a.layers = cd->layers.data();
    a.device_layers = m.layer_table.As<CommitLayer>();
    a.mode = CommitMode::kDeferred;
    a.pending = m.pending;
    a.jobs = ReplayJobs{m.flush_jobs.As<ReplayJob>(), m.flush_job_count.As<int32_t>(),
                        static_cast<int>(FlushJobsCapacity(max_rows_, spec_.layers))};
    a.status = m.status.As<DeviceStatus>();
    return a;
  }

  // blocks empty: every pending block.
  CallResult Flush(Memory& m, const std::vector<int32_t>& blocks, int layer, bool discard) {
    CallData cd;
    FlushArgs a = FlushArgsFor(m, &cd);
    if (!blocks.empty()) {
      a.blocks = Ints(&cd, blocks);
      a.num_blocks_given = static_cast<int>(blocks.size());
      a.checked_blocks = m.checked_blocks.As<int32_t>();
    }
    a.layer = layer;
    a.discard = discard;
    a.status = m.status.As<DeviceStatus>();
    CallResult r = Finish(kernels_->Flush(a, stream()), "Flush", a.status, /*mirrored=*/false);
    ExpectJournalIdle(m, discard ? kPendingDiscard : kPendingFlush, "Flush");
    return r;
  }

  // ReadState's materialization: `block` of `layer` flushed into a copy
  // (FlushArgs::copy), which must change nothing in `m`; the copy's bytes.
  std::vector<uint8_t> FlushIntoCopy(Memory& m, int32_t block, int layer) {
    CallData cd;
    FlushArgs a = FlushArgsFor(m, &cd);
    a.blocks = Ints(&cd, {block});
    a.num_blocks_given = 1;
    a.checked_blocks = m.checked_blocks.As<int32_t>();
    a.layer = layer;
    const size_t bytes = block_elems_ * state_size();
    Tensor copy = Zeroed(2 * bytes);
    a.copy = StatePool{copy.data(), 2, static_cast<int64_t>(block_elems_)};
    CommitLayer entry = cd.layers[layer];
    entry.state = a.copy;
    Tensor table = Upload(ToBytes(std::vector<CommitLayer>{entry}));
    a.copy_layer = &entry;
    a.device_copy_layer = table.As<CommitLayer>();
    EXPECT_TRUE(CallOk(Finish(kernels_->Flush(a, stream()), "Flush", a.status, false)));
    const std::vector<uint8_t> all = copy.Read();
    return std::vector<uint8_t>(all.begin() + bytes, all.end());
  }

  std::vector<uint8_t> BlockOf(const Memory& m, int l, int32_t block) const {
    const size_t bytes = block_elems_ * state_size();
    std::vector<uint8_t> out(bytes);
    Must(m.layers[l].state.dev.Download(out.data(), bytes, block * bytes), "download");
    return out;
  }

  // Every block of every layer but `skip` holds the same bytes in both.
  void ExpectSameStates(const Memory& eager, const Memory& deferred,
                        const std::set<int32_t>& skip, const std::string& when) {
    for (int l = 0; l < spec_.layers; ++l) {
      const std::vector<uint8_t> e = eager.layers[l].state.Read();
      const std::vector<uint8_t> d = deferred.layers[l].state.Read();
      const size_t bytes = block_elems_ * state_size();
      for (int64_t b = 1; b < num_blocks_; ++b) {
        if (skip.count(static_cast<int32_t>(b)) > 0) continue;
        ASSERT_EQ(std::memcmp(e.data() + b * bytes, d.data() + b * bytes, bytes), 0)
            << when << ": layer " << l << ", block " << b << " differs from EAGER";
      }
      ASSERT_EQ(FirstDifference(eager.layers[l].conv.Read(), deferred.layers[l].conv.Read()), -1)
          << when << ": layer " << l << "'s conv pool differs from EAGER";
    }
  }

  // The DEFERRED commit leaves row i's tokens pending (checks.h's DefersCommit).
  bool Defers(int i, int32_t accepted) const {
    const int32_t source = sources_[i];
    const int tokens = qsl_[i + 1] - qsl_[i];
    const int commit_len = std::min({std::max(accepted, 0), tokens, spec_.q});
    if (source <= 0 || commit_len <= 0) return false;
    if (!spec_.align) return true;
    const int r = rows_[i];
    const int bs = spec_.block_size;
    const int nc = computed_[r];
    const int final_col = std::min((nc + commit_len - 1) / bs, spec_.width - 1);
    const bool crosses = nc + commit_len >= (nc / bs + 1) * bs;
    return table_[r][final_col] == source && !crosses;
  }

  // Request r ends and a new one takes its blocks: in DEFERRED its pending
  // tokens are discarded (a Flush with discard); the new request's prefill
  // writes a fresh state to both memories.
  void EndRequest(int r, Memory& eager, Memory& deferred, std::set<int32_t>* pending) {
    ASSERT_TRUE(CallOk(Flush(deferred, table_[r], -1, /*discard=*/true)));
    for (int32_t b : table_[r]) {
      pending->erase(b);
      for (int l = 0; l < spec_.layers; ++l) {
        const std::vector<uint8_t> fresh = RandomBytes(shape_.state_dtype, block_elems_, 0.1f);
        const size_t offset = b * block_elems_ * state_size();
        Must(eager.layers[l].state.dev.Upload(fresh, offset), "prefill");
        Must(deferred.layers[l].state.dev.Upload(fresh, offset), "prefill");
      }
    }
    computed_[r] = spec_.align ? rng().Int(1, spec_.block_size * 2) : 1;
  }

  // The decode loop: EAGER and DEFERRED side by side.
  void RunLoop(LoopSpec spec) {
    // SPECSTATE_DEFERRED_STEPS caps the loops (compute-sanitizer's runs).
    if (const char* cap = std::getenv("SPECSTATE_DEFERRED_STEPS")) {
      spec.steps = std::min(spec.steps, std::max(std::atoi(cap), 1));
    }
    Init(spec);
    SCOPED_TRACE(absl::StrCat(DTypeName(shape_.act_dtype), " activations, ",
                              DTypeName(shape_.state_dtype), " state, ",
                              shape_.kind == LayerKind::kGdn ? "GDN" : "KDA",
                              shape_.gate == KdaGate::kPlain ? " plain gate" : "", ", Q ", spec.q,
                              spec.align ? ", align" : ", mode none"));
    const int H = shape_.num_heads, K = shape_.head_dim;
    std::vector<uint8_t> states =
        RandomBytes(shape_.state_dtype, size_t(spec.layers) * num_blocks_ * block_elems_, 0.1f);
    std::vector<uint8_t> convs =
        RandomBytes(shape_.act_dtype, size_t(spec.layers) * num_blocks_ * conv_block_elems_, 1.0f);
    std::vector<uint8_t> params;
    for (int l = 0; l < spec.layers; ++l) {
      const std::vector<uint8_t> a = RandomBytes(DType::kFloat32, H, 0.5f);
      const std::vector<uint8_t> d = RandomBytes(DType::kFloat32, size_t(H) * K, 0.5f);
      params.insert(params.end(), a.begin(), a.end());
      params.insert(params.end(), d.begin(), d.end());
    }
    Memory eager = MakeMemory(false, states, convs, params);
    Memory deferred = MakeMemory(true, states, convs, params);
    const int64_t max_tokens = int64_t{max_rows_} * spec.q;
    const std::vector<uint8_t> poison =
        Poisoned(shape_.act_dtype, max_tokens * ValueWidth(shape_));
    int deferred_rows = 0, materialized_by_verify = 0, flushes = 0, abandoned = 0, ended = 0,
        copies = 0;

    for (int step = 0; step < spec.steps; ++step) {
      const std::string when = absl::StrCat("step ", step);
      DrawRows();
      const int tokens = qsl_.back();
      // The scheduler's conv update: the same window in both memories.
      for (int l = 0; l < spec.layers; ++l) {
        for (size_t i = 0; i < rows_.size(); ++i) {
          if (sources_[i] <= 0) continue;
          const std::vector<uint8_t> window =
              RandomBytes(shape_.act_dtype, conv_block_elems_, 1.0f);
          const size_t offset = sources_[i] * conv_block_elems_ * act_size();
          Must(eager.layers[l].conv.dev.Upload(window, offset), "conv");
          Must(deferred.layers[l].conv.dev.Upload(window, offset), "conv");
        }
      }
      // A step abandoned after some of its layers (a scheduler that failed
      // mid-step): the layers it verified took their pending tokens.
      const bool abandon = rng().Int(0, 19) == 0;
      const int verified_layers = abandon ? rng().Int(0, spec.layers - 1) : spec.layers;
      for (int l = 0; l < verified_layers; ++l) {
        const Inputs in = DrawInputs(tokens);
        for (Memory* m : {&eager, &deferred}) {
          m->layers[l].out.Write(poison);
          CallData cd;
          ASSERT_TRUE(CallOk(Verify(*m, l, in, l == 0, &cd)))
              << when << ", layer " << l << (m->deferred ? " (DEFERRED)" : " (EAGER)");
        }
        ASSERT_EQ(FirstDifference(eager.layers[l].out.Read(), deferred.layers[l].out.Read()), -1)
            << when << ", layer " << l << ": DEFERRED's outputs differ from EAGER's";
        if (l == 0) {
          const std::vector<int32_t> plan = FromBytes<int32_t>(deferred.replay_plans.Read());
          for (size_t i = 0; i < rows_.size(); ++i) materialized_by_verify += plan[i] != 0;
        }
      }
      if (abandon) {
        ++abandoned;
        continue;
      }
      std::vector<int32_t> accepted;
      for (size_t i = 0; i < rows_.size(); ++i) accepted.push_back(rng().Int(-1, spec.q + 1));
      for (Memory* m : {&eager, &deferred}) {
        CallData cd;
        ASSERT_TRUE(CallOk(Commit(*m, accepted, &cd)))
            << when << (m->deferred ? " (DEFERRED)" : " (EAGER)");
      }
      std::set<int32_t> pending;
      for (size_t i = 0; i < rows_.size(); ++i) {
        if (Defers(static_cast<int>(i), accepted[i])) pending.insert(sources_[i]);
      }
      deferred_rows += pending.size();
      ExpectSameStates(eager, deferred, pending, absl::StrCat(when, ", after Commit"));
      if (HasFatalFailure()) return;
      for (size_t i = 0; i < rows_.size(); ++i) {
        const int tokens_i = qsl_[i + 1] - qsl_[i];
        if (rows_[i] >= 0) {
          computed_[rows_[i]] += std::min({std::max(accepted[i], 0), tokens_i, spec.q});
        }
      }
      // Between steps, now and then: a Flush of some blocks, a ReadState's
      // flush of one block in one layer, or the end of a request.
      const int what = rng().Int(0, 9);
      if (what == 0 && !pending.empty()) {
        std::vector<int32_t> some(pending.begin(), pending.end());
        some.resize(rng().Int(1, some.size()));
        some.push_back(some[0]);  // listed twice: materialized once
        some.push_back(0);        // null: skipped
        ASSERT_TRUE(CallOk(Flush(deferred, some, -1, false))) << when;
        for (int32_t b : some) pending.erase(b);
        ++flushes;
      } else if (what == 1 && !pending.empty()) {
        const int32_t block = *pending.begin();
        const int l = rng().Int(0, spec.layers - 1);
        // Into a copy first (ReadState's): EAGER's state, and nothing of the
        // DEFERRED memory changed (its pools, its pending table).
        const std::vector<uint8_t> entries = deferred.entries.Read();
        const std::vector<uint8_t> pool = deferred.layers[l].state.Read();
        const std::vector<uint8_t> copied = FlushIntoCopy(deferred, block, l);
        ASSERT_EQ(FirstDifference(BlockOf(eager, l, block), copied), -1)
            << when << ": block " << block << " of layer " << l << " flushed into a copy";
        ASSERT_EQ(FirstDifference(deferred.layers[l].state.Read(), pool), -1)
            << when << ": a flush into a copy changed the pool";
        ASSERT_EQ(FirstDifference(deferred.entries.Read(), entries), -1)
            << when << ": a flush into a copy changed the pending table";
        ++copies;
        ASSERT_TRUE(CallOk(Flush(deferred, {block}, l, false))) << when;
        ASSERT_EQ(FirstDifference(BlockOf(eager, l, block), BlockOf(deferred, l, block)), -1)
            << when << ": block " << block << " of layer " << l << " after its flush";
        ++flushes;
      } else if (what == 2) {
        EndRequest(rng().Int(0, spec.requests - 1), eager, deferred, &pending);
        ++ended;
      }
      // Align mode: a request whose block table is nearly full ends too.
      for (int r = 0; r < spec.requests && spec.align; ++r) {
        if (computed_[r] + 2 * spec.q >= (spec.width - 1) * spec.block_size) {
          EndRequest(r, eager, deferred, &pending);
          ++ended;
        }
      }
      if (HasFatalFailure()) return;
      ExpectSameStates(eager, deferred, pending, absl::StrCat(when, ", between steps"));
      if (HasFatalFailure()) return;
    }
    ASSERT_TRUE(CallOk(Flush(deferred, {}, -1, false)));
    ExpectSameStates(eager, deferred, {}, "after the final Flush");
    // The loop exercised what it is about.
    // (Align mode replays the rows that cross a block boundary at Commit.)
    EXPECT_GT(deferred_rows, spec.align ? spec.steps / 2 : spec.steps)
        << "too few rows were deferred";
    EXPECT_GT(materialized_by_verify, spec.align ? spec.steps / 4 : spec.steps / 2)
        << "too few Verify calls replayed";
    RecordProperty("deferred_rows", deferred_rows);
    std::printf("%d steps: %d rows deferred, %d replayed by Verify, %d flushes (%d into a copy "
                "first), %d abandoned, "
                "%d requests ended\n",
                spec.steps, deferred_rows, materialized_by_verify, flushes, copies, abandoned,
                ended);
  }

  static constexpr int kConvDim = 8;
  LoopSpec spec_;
  KdaShape shape_;
  int max_rows_ = 0;
  int blocks_per_request_ = 0;
  int64_t num_blocks_ = 0;
  int conv_width_ = 0;
  int64_t block_elems_ = 0, conv_block_elems_ = 0;
  std::vector<std::vector<int32_t>> table_;  // per request: its blocks
  std::vector<int> computed_;                // per request: num_computed_tokens
  // The step's rows (request, or -1 for an idle row), qsl, checkpoints.
  std::vector<int> rows_;
  std::vector<int32_t> qsl_, sources_;
};

TEST_P(DeferredCommitTest, EqualsEagerOverManySteps) {
  const LoopSpec loops[] = {
      // 200+ steps: fp32 and bf16 state, KDA's safe gate and GDN.
      {{DType::kBFloat16, DType::kFloat32, 2, 64, true}, 4, 2, 6, 220},
      {{DType::kBFloat16, DType::kBFloat16, 2, 64, true}, 4, 2, 6, 220},
      {{DType::kBFloat16, DType::kFloat32, 2, 64, true, LayerKind::kGdn, 4}, 4, 2, 5, 200},
      // Shorter: KDA's plain gate, other dtypes and head dims, Q = 8, Q = 1.
      {{DType::kBFloat16, DType::kFloat32, 2, 64, true, LayerKind::kKda, 0, KdaGate::kPlain},
       4, 2, 5, 60},
      {{DType::kFloat32, DType::kBFloat16, 1, 128, true, LayerKind::kGdn, 2}, 8, 2, 4, 40},
      {{DType::kFloat16, DType::kFloat32, 1, 64, true}, 1, 3, 4, 40},
  };
  for (const LoopSpec& loop : loops) {
    RunLoop(loop);
    if (HasFatalFailure()) return;
  }
}

// With kept pools both journals bracket every call: nothing else changes.
TEST_P(DeferredCommitTest, JournaledEqualsEagerOverManySteps) {
  LoopSpec loop{{DType::kBFloat16, DType::kFloat32, 2, 64, true}, 4, 2, 6, 120};
  loop.journaled = true;
  RunLoop(loop);
  if (HasFatalFailure()) return;
  LoopSpec align{{DType::kBFloat16, DType::kBFloat16, 2, 64, true, LayerKind::kGdn, 4}, 4, 2, 4,
                 80};
  align.align = true;
  align.block_size = 5;
  align.width = 14;
  align.journaled = true;
  RunLoop(align);
}

TEST_P(DeferredCommitTest, AlignModeEqualsEagerOverManySteps) {
  LoopSpec fp32{{DType::kBFloat16, DType::kFloat32, 2, 64, true}, 4, 2, 5, 200};
  fp32.align = true;
  fp32.block_size = 6;  // crossed every other step or so: those rows replay at Commit
  fp32.width = 12;
  RunLoop(fp32);
  if (HasFatalFailure()) return;
  LoopSpec bf16{{DType::kBFloat16, DType::kBFloat16, 2, 64, true, LayerKind::kGdn, 4}, 4, 2, 4,
                200};
  bf16.align = true;
  bf16.block_size = 5;
  bf16.width = 14;
  RunLoop(bf16);
}

// The misuse tests' memory: one layer, a DEFERRED commit of `requests`
// rows (every token accepted), so that each request's block has pending
// tokens. Returns the memory and the state of the pool after that commit.
class DeferredMisuseTest : public DeferredCommitTest {
 protected:
  Memory Prepared(const LoopSpec& spec, std::vector<uint8_t>* states_out = nullptr) {
    Init(spec);
    const int H = shape_.num_heads, K = shape_.head_dim;
    const std::vector<uint8_t> states =
        RandomBytes(shape_.state_dtype, size_t(spec.layers) * num_blocks_ * block_elems_, 0.1f);
    const std::vector<uint8_t> convs =
        RandomBytes(shape_.act_dtype, size_t(spec.layers) * num_blocks_ * conv_block_elems_, 1.0f);
    std::vector<uint8_t> params = RandomBytes(DType::kFloat32, size_t(spec.layers) * H * (K + 1), 0.5f);
    Memory m = MakeMemory(true, states, convs, params);
    computed_.assign(spec.requests, 1);  // align: Q tokens stay in the first block
    SetRows(std::vector<int>(spec.requests, -1), spec.q);
    for (int r = 0; r < spec.requests; ++r) rows_[r] = r, sources_[r] = SourceOf(r);
    for (int l = 0; l < spec.layers; ++l) {
      const Inputs in = DrawInputs(qsl_.back());
      CallData cd;
      EXPECT_TRUE(CallOk(Verify(m, l, in, l == 0, &cd)));
    }
    CallData cd;
    EXPECT_TRUE(CallOk(Commit(m, std::vector<int32_t>(spec.requests, spec.q), &cd)));
    for (int r = 0; r < spec.requests; ++r) computed_[r] += spec.q;
    if (states_out != nullptr) *states_out = m.layers[0].state.Read();
    return m;
  }

  // Rows of `tokens` tokens each, for the given requests (-1: idle).
  void SetRows(const std::vector<int>& rows, int tokens) {
    rows_ = rows;
    qsl_.assign(1, 0);
    sources_.clear();
    for (int r : rows_) {
      qsl_.push_back(qsl_.back() + tokens);
      sources_.push_back(r < 0 ? 0 : SourceOf(r));
    }
  }

  // Everything the service owns, as bytes, to show a rejected call wrote none.
  std::vector<std::vector<uint8_t>> Everything(const Memory& m) {
    std::vector<std::vector<uint8_t>> all = {m.entries.Read(), m.header.Read()};
    for (const LayerMemory& lm : m.layers) {
      for (const Tensor* t : {&lm.state, &lm.conv, &lm.out, &lm.rec_kv[0], &lm.rec_kv[1],
                              &lm.rec_g[0], &lm.rec_beta[1]}) {
        all.push_back(t->Read());
      }
    }
    return all;
  }
};

TEST_P(DeferredMisuseTest, RowsSharingAPendingBlockAreRejected) {
  Memory m = Prepared({{DType::kBFloat16, DType::kFloat32, 2, 64, true}, 4, 1, 3, 0});
  // Requests 0 and 2 are pending; rows 1 and 3 of the next step both verify
  // from request 2's block.
  SetRows({0, 2, 1, 2}, 3);
  const auto before = Everything(m);
  const Inputs in = DrawInputs(qsl_.back());
  CallData cd;
  const CallResult r = Verify(m, 0, in, true, &cd);
  ASSERT_TRUE(r.launch.ok()) << r.launch;
  EXPECT_EQ(r.device.code(), absl::StatusCode::kFailedPrecondition) << r.device;
  EXPECT_NE(r.device.message().find("rows 1 and 3 both verify from block " +
                                    std::to_string(table_[2][0])),
            std::string::npos)
      << r.device;
  EXPECT_NE(r.device.message().find("state_indices[3]"), std::string::npos) << r.device;
  const auto after = Everything(m);
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(FirstDifference(before[i], after[i]), -1) << "buffer " << i << " was written";
  }
  // Sharing a block with nothing pending is fine: request 1's (whose
  // pending tokens this Verify takes first, row 0 alone).
  SetRows({1, 0}, 2);
  const Inputs ok_in = DrawInputs(qsl_.back());
  CallData ok_cd;
  EXPECT_TRUE(CallOk(Verify(m, 0, ok_in, true, &ok_cd)));
  SetRows({1, 1}, 2);
  CallData shared_cd;
  EXPECT_TRUE(CallOk(Verify(m, 0, ok_in, true, &shared_cd)))
      << "rows may share a block once nothing is pending on it";
}

TEST_P(DeferredMisuseTest, ACommitWritingAnotherRequestsPendingBlockIsRejected) {
  LoopSpec spec{{DType::kBFloat16, DType::kFloat32, 2, 64, true}, 4, 2, 2, 0};
  spec.align = true;
  spec.block_size = 8;  // Q = 4 tokens from 1: every request's first block is pending
  spec.width = 4;
  Memory m = Prepared(spec);
  // Request 1 was given request 0's pending block as its next block (no
  // Flush): its commit, which crosses into that block, must not write it.
  table_[1][1] = table_[0][0];
  computed_[1] = 7;  // one more token reaches block column 1
  SetRows({1}, 2);
  for (int l = 0; l < spec.layers; ++l) {
    const Inputs in = DrawInputs(qsl_.back());
    CallData cd;
    ASSERT_TRUE(CallOk(Verify(m, l, in, l == 0, &cd)));
  }
  const auto before = Everything(m);
  CallData cd;
  const CallResult r = Commit(m, {2}, &cd);
  ASSERT_TRUE(r.launch.ok()) << r.launch;
  EXPECT_EQ(r.device.code(), absl::StatusCode::kFailedPrecondition) << r.device;
  EXPECT_NE(r.device.message().find("block_table[0] = " + std::to_string(table_[0][0])),
            std::string::npos)
      << r.device;
  EXPECT_NE(r.device.message().find("Flush a block before giving it to another request"),
            std::string::npos)
      << r.device;
  const auto after = Everything(m);
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(FirstDifference(before[i], after[i]), -1) << "buffer " << i << " was written";
  }
  // Flushed first (its tokens forgotten), the block may be written.
  ASSERT_TRUE(CallOk(Flush(m, {table_[0][0]}, -1, /*discard=*/true)));
  CallData retry;
  EXPECT_TRUE(CallOk(Commit(m, {2}, &retry)));
}

TEST_P(DeferredMisuseTest, AFlushOfABlockPastThePoolChangesNothing) {
  std::vector<uint8_t> states;
  Memory m = Prepared({{DType::kBFloat16, DType::kBFloat16, 2, 64, true}, 4, 2, 3, 0}, &states);
  const auto before = Everything(m);
  const CallResult r = Flush(m, {table_[0][0], static_cast<int32_t>(num_blocks_)}, -1, false);
  ASSERT_TRUE(r.launch.ok()) << r.launch;
  EXPECT_EQ(r.device.code(), absl::StatusCode::kOutOfRange) << r.device;
  EXPECT_NE(r.device.message().find("blocks[1] = " + std::to_string(num_blocks_)),
            std::string::npos)
      << r.device;
  const auto after = Everything(m);
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(FirstDifference(before[i], after[i]), -1) << "buffer " << i << " was written";
  }
  // On the host: more blocks than the pool has, a layer past the layout.
  CallData cd;
  FlushArgs a = FlushArgsFor(m, &cd);
  a.layer = spec_.layers;
  absl::Status st = kernels_->Flush(a, stream());
  EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange) << st;
  a.layer = -1;
  a.num_blocks_given = static_cast<int>(num_blocks_) + 1;
  st = kernels_->Flush(a, stream());
  EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange) << st;
  EXPECT_NE(st.message().find("at most the pool's"), std::string::npos) << st;
  // And a Verify of Q = 9 (the window and its pending tokens exceed 16).
  EXPECT_EQ(ValidateDeferredWindow(9).code(), absl::StatusCode::kOutOfRange);
  EXPECT_TRUE(ValidateDeferredWindow(8).ok());
  // A pending journal without its block list, or one too short for a call.
  Tensor record = Zeroed(sizeof(PendingJournalRecord));
  Tensor list = Zeroed(4 * PendingJournalCapacity(max_rows_, num_blocks_));
  a.num_blocks_given = 0;
  a.pending.journal = record.As<PendingJournalRecord>();
  st = kernels_->Flush(a, stream());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("a journal needs its block list"), std::string::npos) << st;
  a.pending.journal_blocks = list.As<int32_t>();
  a.pending.journal_capacity = static_cast<int>(PendingJournalCapacity(max_rows_, num_blocks_)) - 1;
  st = kernels_->Flush(a, stream());
  EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange) << st;
  EXPECT_NE(st.message().find("the journal lists"), std::string::npos) << st;
  // A DEFERRED Commit with the pending journal and no commit journal.
  CallData commit_cd;
  m.pending.journal = record.As<PendingJournalRecord>();
  m.pending.journal_blocks = list.As<int32_t>();
  m.pending.journal_capacity = static_cast<int>(PendingJournalCapacity(max_rows_, num_blocks_));
  const CallResult refused = Commit(m, {1}, &commit_cd);
  EXPECT_EQ(refused.launch.code(), absl::StatusCode::kInvalidArgument) << refused.launch;
  EXPECT_NE(refused.launch.message().find("keeps both journals or neither"), std::string::npos)
      << refused.launch;
  const auto unchanged = Everything(m);
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(FirstDifference(before[i], unchanged[i]), -1) << "buffer " << i << " was written";
  }
}

// Batch invariance in DEFERRED: a request's outputs and state do not depend
// on the other rows of its steps or on N, whether its pending tokens are
// replayed inside the next Verify or by a Flush. Request 0 runs 5 steps
// inside a batch of 64 requests (a new order every step) in one memory and
// alone (N = 1) in another, on the same inputs and initial states: every
// output of its tokens, and after the final Flush its block and conv window
// in every layer, bit for bit.
TEST_P(DeferredMisuseTest, ARowComputesTheSameAloneAndInABatch) {
  const Config configs[] = {
      {DType::kBFloat16, DType::kFloat32, 2, 128, true},
      {DType::kBFloat16, DType::kBFloat16, 2, 64, true, LayerKind::kGdn, 4},
  };
  for (const Config& config : configs) {
    const LoopSpec spec{config, 4, 2, 64, 5};
    Init(spec);
    const int H = shape_.num_heads, K = shape_.head_dim;
    const std::vector<uint8_t> states =
        RandomBytes(shape_.state_dtype, size_t(spec.layers) * num_blocks_ * block_elems_, 0.1f);
    const std::vector<uint8_t> convs =
        RandomBytes(shape_.act_dtype, size_t(spec.layers) * num_blocks_ * conv_block_elems_, 1.0f);
    const std::vector<uint8_t> params =
        RandomBytes(DType::kFloat32, size_t(spec.layers) * H * (K + 1), 0.5f);
    Memory batch = MakeMemory(true, states, convs, params);
    Memory alone = MakeMemory(true, states, convs, params);
    const std::vector<int32_t> block0 = {SourceOf(0)};
    int replayed_by_verify = 0;
    for (int step = 0; step < spec.steps; ++step) {
      const std::string when = absl::StrCat("step ", step);
      // The batch: every request, in a new order, 1 to Q tokens each.
      std::vector<int> order(spec.requests);
      for (int r = 0; r < spec.requests; ++r) order[r] = r;
      rng().Shuffle(&order);
      std::vector<int> tokens(spec.requests);
      for (int& t : tokens) t = rng().Int(1, spec.q);
      std::vector<int32_t> accepted;
      int first = 0, at = 0;  // request 0's first token in the batch, its row
      const auto batch_rows = [&] {
        rows_ = order;
        qsl_.assign(1, 0);
        sources_.clear();
        for (size_t i = 0; i < order.size(); ++i) {
          if (order[i] == 0) first = qsl_.back(), at = static_cast<int>(i);
          qsl_.push_back(qsl_.back() + tokens[order[i]]);
          sources_.push_back(SourceOf(order[i]));
        }
      };
      const auto alone_rows = [&] {
        rows_ = {0};
        qsl_ = {0, tokens[0]};
        sources_ = block0;
      };
      batch_rows();
      for (size_t i = 0; i < order.size(); ++i) {
        accepted.push_back(rng().Int(1, tokens[order[i]]));
      }
      const int n0 = tokens[0];
      for (int l = 0; l < spec.layers; ++l) {
        batch_rows();
        const Inputs in = DrawInputs(qsl_.back());
        // Request 0's tokens of each input, for the memory where it is alone.
        const auto slice = [&](const Tensor& t, int64_t width) {
          const size_t row = size_t(width) * act_size();
          return Upload(std::vector<uint8_t>(t.host.begin() + first * row,
                                             t.host.begin() + (first + n0) * row));
        };
        const Inputs mine{slice(in.q, KeyWidth(shape_)), slice(in.k, KeyWidth(shape_)),
                          slice(in.v, ValueWidth(shape_)), slice(in.g, GateWidth(shape_)),
                          slice(in.beta, ValueHeads(shape_))};
        CallData cd_batch, cd_alone;
        ASSERT_TRUE(CallOk(Verify(batch, l, in, l == 0, &cd_batch))) << when;
        if (l == 0) {
          replayed_by_verify += FromBytes<int32_t>(batch.replay_plans.Read())[at] != 0;
        }
        alone_rows();
        ASSERT_TRUE(CallOk(Verify(alone, l, mine, l == 0, &cd_alone))) << when;
        const size_t row = size_t(ValueWidth(shape_)) * act_size();
        const std::vector<uint8_t> b = batch.layers[l].out.Read();
        const std::vector<uint8_t> a = alone.layers[l].out.Read();
        ASSERT_EQ(FirstDifference(std::vector<uint8_t>(b.begin() + first * row,
                                                       b.begin() + (first + n0) * row),
                                  std::vector<uint8_t>(a.begin(), a.begin() + n0 * row)),
                  -1)
            << when << ", layer " << l << ": request 0's outputs differ alone and in the batch";
      }
      CallData cd_batch, cd_alone;
      batch_rows();
      ASSERT_TRUE(CallOk(Commit(batch, accepted, &cd_batch))) << when;
      alone_rows();
      ASSERT_TRUE(CallOk(Commit(alone, {accepted[at]}, &cd_alone))) << when;
    }
    EXPECT_GE(replayed_by_verify, spec.steps - 1) << "request 0's Verify replayed too rarely";
    ASSERT_TRUE(CallOk(Flush(batch, {}, -1, false)));
    ASSERT_TRUE(CallOk(Flush(alone, {}, -1, false)));
    for (int l = 0; l < spec.layers; ++l) {
      EXPECT_EQ(FirstDifference(BlockOf(batch, l, block0[0]), BlockOf(alone, l, block0[0])), -1)
          << "layer " << l << ": request 0's state differs alone and in the batch";
      const size_t conv_bytes = conv_block_elems_ * act_size();
      const size_t at_conv = block0[0] * conv_bytes;
      const std::vector<uint8_t> b = batch.layers[l].conv.Read();
      const std::vector<uint8_t> a = alone.layers[l].conv.Read();
      EXPECT_EQ(std::memcmp(b.data() + at_conv, a.data() + at_conv, conv_bytes), 0)
          << "layer " << l << ": request 0's conv window differs alone and in the batch";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, DeferredMisuseTest,
                         ::testing::Values(Backend::kCpu, Backend::kCuda), BackendParamName);

INSTANTIATE_TEST_SUITE_P(Backends, DeferredCommitTest,
                         ::testing::Values(Backend::kCpu, Backend::kCuda), BackendParamName);

}  // namespace
}  // namespace testing
}  // namespace kernels
}  // namespace specstate
