// Arguments of the RecoverSSM kernels: raw pointers, shapes, strides.
//
// Every pointer is in the backend's memory: device memory for the CUDA
// backend, host memory for the CPU backend. Strides count elements. See
// docs/semantics.md for what each kernel computes.
#ifndef SPECSTATE_KERNELS_KDA_ARGS_H_
#define SPECSTATE_KERNELS_KDA_ARGS_H_

#include <cstddef>
#include <cstdint>

#include "kernels/device_status.h"
#include "kernels/dtype.h"
#include "kernels/numeric.h"

namespace specstate {
namespace kernels {

inline constexpr int32_t kNullBlock = 0;

// What a Commit does with a row's accepted tokens (docs/semantics.md,
// "Commit modes"); a Verify, Commit and Flush name the service's mode in
// `mode`, and the kernel interface runs that mode's kernels
// (kernels/eager, kernels/deferred, kernels/fast):
//  - kEager: Commit replays the accepted tokens into the pool at once.
//  - kDeferred: Commit leaves them pending on the checkpoint's block; the
//    block's next Verify replays them first (`pending`, `records_alt`).
//  - kFast: the pool holds a checkpoint every few steps and a ring of the
//    accepted tokens beside it (`fast`).
enum class CommitMode : int32_t { kEager = 0, kDeferred = 1, kFast = 2 };

constexpr const char* CommitModeName(CommitMode mode) {
  return mode == CommitMode::kEager      ? "EAGER"
         : mode == CommitMode::kDeferred ? "DEFERRED"
         : mode == CommitMode::kFast     ? "FAST"
                                         : "unknown";
}


// A row may verify at most this many tokens (num_spec + 1).
inline constexpr int kMaxSpecQueryLen = 16;
// The conv history (conv_kernel - 1 columns) a commit moves per channel.
inline constexpr int kMaxConvHistory = 16;

// The two layer kinds: Kimi's KDA (a gate per column, g [T, H, K], and
// sigmoid(beta)) and Qwen3-Next's Gated DeltaNet (a scalar log-decay per
// value head, g [T, HV], and beta as given).
enum class LayerKind : int32_t { kKda = 0, kGdn = 1 };
// KDA's gate: `kSafe` lower_bound / (1 + exp(-exp(A_log) (g + dt_bias)))
// (Kimi-Linear), or `kPlain` -exp(A_log) softplus(g + dt_bias) (vLLM's
// plain KDA gate).
enum class KdaGate : int32_t { kSafe = 0, kPlain = 1 };

// What all layers of a layer group share.
struct KdaShape {
  int num_heads = 0;                     // H: key heads (q, k; KDA's g)
  int head_dim = 0;                      // K = V: 64, 128 or 256
  DType act_dtype = DType::kBFloat16;    // q, k, v, g, beta, o, records, conv state
  DType state_dtype = DType::kFloat32;   // the recurrent state: fp32 or bf16
  float lower_bound = -5.0f;             // KDA's safe gate: its lower bound (negative)
  LayerKind kind = LayerKind::kKda;
  int num_value_heads = 0;               // HV: v, beta, o, the state (GDN's g); 0: = H
  KdaGate gate = KdaGate::kSafe;         // KDA only
};

// The tensors' widths per token, by kind (elements):
//   q, k [T, H, K];  v, o [T, HV, V];  g: KDA [T, H, K], GDN [T, HV];
//   beta [T, HV];  state [blocks, HV, V, K];
//   records: kv [rows * Q, H * K + HV * V] (a token's raw k, then its raw v),
//   g as g, beta [rows * Q, HV].
SPECSTATE_HD int ValueHeads(const KdaShape& s) {
  return s.num_value_heads > 0 ? s.num_value_heads : s.num_heads;
}
SPECSTATE_HD int64_t KeyWidth(const KdaShape& s) { return int64_t{s.num_heads} * s.head_dim; }
SPECSTATE_HD int64_t ValueWidth(const KdaShape& s) {
  return int64_t{ValueHeads(s)} * s.head_dim;
}
SPECSTATE_HD int64_t GateWidth(const KdaShape& s) {
  return s.kind == LayerKind::kGdn ? int64_t{ValueHeads(s)} : KeyWidth(s);
}
SPECSTATE_HD int64_t RecordTokenWidth(const KdaShape& s) { return KeyWidth(s) + ValueWidth(s); }
// The key head (q, k) a value head reads: HV is a multiple of H.
SPECSTATE_HD int KeyHeadOf(const KdaShape& s, int value_head) {
  return value_head / (ValueHeads(s) / s.num_heads);
}

// A token-major activation: element (t, h, d) of a [T, H, D] tensor (or
// (t, h) of a [T, H] one) is at data + t * token_stride + h * D + d. Each
// token's [H, D] block is dense; token_stride may exceed H * D (column slices
// of a wider projection buffer).
struct Activation {
  const void* data = nullptr;
  int64_t token_stride = 0;
};

// One layer's recurrent-state pool [num_blocks, H, V, K]: block b starts at
// data + b * block_stride; inside a block the layout is dense. Block 0 is the
// null block and is never written.
struct StatePool {
  void* data = nullptr;
  int64_t num_blocks = 0;
  int64_t block_stride = 0;
};

// One layer's conv-state pool [num_blocks, dim, width] (dim-first), any strides.
struct ConvPool {
  void* data = nullptr;
  int64_t num_blocks = 0;
  int64_t block_stride = 0;
  int64_t dim_stride = 0;
  int64_t token_stride = 0;
  int dim = 0;
  int width = 0;  // (conv_kernel - 1) + num_spec
};

// One layer's gate parameters: A_log [H] and dt_bias [H * K], fp32.
struct LayerParams {
  const float* a_log = nullptr;
  const float* dt_bias = nullptr;
};

// One layer's records, dense, in the activation dtype: kv [rows * q, 2, H, K]
// (kv[t, 0] = raw k, kv[t, 1] = raw v), g [rows * q, H, K], beta [rows * q, H].
// Row n owns record tokens [n * q, n * q + q).
struct Records {
  void* kv = nullptr;
  void* g = nullptr;
  void* beta = nullptr;
  int rows = 0;
  int q = 0;
};

// DEFERRED commits (docs/semantics.md, "Deferred commit"): a commit leaves a
// row's accepted tokens pending on its checkpoint block (when the row's state
// stays in that block and it writes no boundary state) instead of replaying
// them; the block's next Verify replays them first, from the records of the
// commit's step, and writes the checkpoint once. Until then the block's
// recurrent state in the pool is the checkpoint before those tokens. The
// bookkeeping lives in the backend's memory, zeroed once when allocated, and
// only the kernels read and write it, in stream order:
//  - entries [num_layers, num_blocks]: a block's pending tokens in one layer
//    (a packed deferred::PendingEntry), 0 when the pool holds its current
//    state. Per layer, because a step's Verify calls consume them one layer
//    at a time (a step abandoned halfway leaves the other layers pending).
//  - header [2 + capacity]: [0] the records buffer (0 or 1) the entries'
//    tokens are in; the next Verify records into the other one. [1] how many
//    blocks the last commit left pending, then those blocks: every nonzero
//    entry is one of them (each commit materializes what the previous one
//    left and no Verify took).
//
// With kept pools (server/kept/pool_header.h) the table, both records buffers
// and `journal` live in memory that outlives the service. The journal then
// brackets every call that changes the table or materializes pending
// tokens into the pool (a Verify that replays, a Commit, a Flush): once its
// checks have passed and before its first such write, the call lists the
// blocks it may change (`journal_blocks`) and marks the record started;
// after its last write it marks it idle. After a crash the listed blocks of
// a started record are reported lost (their states may be half-written)
// and their entries cleared, in every layer.
inline constexpr uint32_t kPendingFlush = 1;    // Flush (ReadState: of one layer)
inline constexpr uint32_t kPendingDiscard = 2;  // Flush with discard: no state write
inline constexpr uint32_t kPendingCommit = 3;   // Commit: the old list, the rows' blocks
inline constexpr uint32_t kPendingVerify = 4;   // Verify's replay of its rows' pending blocks

struct PendingJournalRecord {
  uint32_t state = 0;  // kJournalIdle (0) or kJournalStarted (1)
  uint32_t kind = 0;   // kPending*
  int32_t count = 0;   // blocks listed in journal_blocks
  int32_t layer = -1;  // Verify's layer, a Flush's (-1: every layer); for the report only
  uint64_t step = 0;   // Commit: its step id; 0 otherwise
  uint64_t reserved[2] = {};
};

struct PendingBlocks {
  int32_t* entries = nullptr;  // null: commits are EAGER
  int32_t* header = nullptr;
  int num_layers = 0;
  int64_t num_blocks = 0;
  int capacity = 0;  // the most rows a commit may have
  // Optional (kept pools): the crash bookkeeping above.
  PendingJournalRecord* journal = nullptr;
  int32_t* journal_blocks = nullptr;  // [journal_capacity]
  int journal_capacity = 0;           // >= PendingJournalCapacity(capacity, num_blocks)
  // Tests only, CPU backend: called on the worker inside a call that
  // materializes ("verify:replayed" after a row's first head is stored,
  // "flush:taken" once a Flush took its entries), so a test can kill the
  // process there. Null in production.
  void (*test_hook)(const char* point) = nullptr;
};

// The replays of a DEFERRED commit or a Flush, one per (layer, block), as a
// list the call's first kernel writes on the device (the host cannot know
// how many there are) and its replay reads.
struct ReplayJob {
  int32_t layer;
  int32_t buffer;      // the records buffer its tokens are in
  int32_t record_row;  // record tokens [record_row * q, record_row * q + tokens)
  // As a row of replay indices (docs/semantics.md, Commit step 3): the
  // source block at column q, the blocks to store after token t at column t.
  int32_t indices[kMaxSpecQueryLen + 1];
};

struct ReplayJobs {
  ReplayJob* jobs = nullptr;  // [capacity]
  int32_t* count = nullptr;   // one word; the call's first kernel sets it
  int capacity = 0;
};

// FAST commits (docs/semantics.md, "Fast mode (FAST)"; kernels/fast/ has the
// CPU implementation, kernels/fast/fast_args.h the details): a block's state
// is written every few steps. Per (layer, state block) the service keeps,
// beside the checkpoint in the pool, a ring of the tokens accepted since the
// checkpoint; Verify computes its outputs from the checkpoint, the ring and
// the window (the chunked form) and leaves the window's tokens in the ring as
// candidates; Commit advances the ring over the accepted ones and folds the
// ring into the checkpoint when the next window might not fit; Flush (and
// ReadState) fold on demand. Zeroed once when allocated (every ring empty);
// only the kernels write them, in stream order.

// A FAST window (Q) has at most this many tokens.
inline constexpr int kMaxFastQueryLen = 8;

// The ring of one (layer, block): how many of its tokens are accepted ones,
// and how many candidates the last Verify of the block wrote after them.
struct FastCursor {
  int32_t tokens;
  int32_t candidates;
  // Unused, zero: keeps a cursor 12 bytes, the size the service plans
  // (FastCursorBytes). (It counted the heads of a fold ahead, a schedule
  // measured slower and removed: docs/benchmarks.md, "Fold ahead".)
  int32_t reserved;
};

// One layer's rings, one per state block, indexed like the state pool (block
// b's ring belongs to block b's checkpoint; block 0, the null block, is never
// used). Each is dense, token-major:
//   k          [num_blocks, R, H, K]  activation dtype (the raw k, bit for bit)
//   u          [num_blocks, R, HV, V] fp32: u = beta * (v - S k)
//   log_decay  [num_blocks, R, GateWidth] fp32 (KDA [H, K]; GDN [HV]): each
//              token's own gamma, not a cumulative sum (semantics.md says why)
//   cursors    [num_blocks]
// `cursors` null: not FAST.
struct FastRings {
  void* k = nullptr;
  float* u = nullptr;
  float* log_decay = nullptr;
  FastCursor* cursors = nullptr;
  int64_t num_blocks = 0;
  int capacity = 0;  // R tokens: fold_every * Q
};

// FAST with kept pools (server/kept/pool_header.h): the fold journal, in
// memory that outlives the service beside the rings. A Flush that folds
// rings into their checkpoints in place, or empties them (`discard`), lists
// its blocks and marks the record started (a PendingJournalRecord of kind
// kPendingFlush or kPendingDiscard) once its checks have passed and before
// its first write, and marks it idle after its last. After a crash the
// listed blocks of a started fold are reported lost (a checkpoint may be
// half folded) and those of a started discard emptied, in every layer. A
// Commit's folds are covered by the commit journal (CommitJournal: they
// write only the blocks it lists). Null `record`: none. Only the kernels
// write it, in stream order.
struct FoldJournal {
  PendingJournalRecord* record = nullptr;
  int32_t* blocks = nullptr;  // [capacity]
  int capacity = 0;           // >= the pool's blocks
  // Tests only, CPU backend: called on the worker once a fold has written
  // the first covered layer of its blocks ("flush:taken"), so a test can
  // kill the process mid-fold. Null in production.
  void (*test_hook)(const char* point) = nullptr;
};

// Statuses of earlier calls this call depends on (device memory on CUDA).
// When one of them failed, this call's checks fail with problem
// kPrerequisiteFailed and nothing of it runs: the service chains a step's
// Verify, Commit and RecordStateBlocks this way without a host round trip.
// Also the step's cancellation word: when `*cancelled == generation`
// (nonzero) the checks fail with kCancelled. The service writes it before it
// releases a doorbell wait whose ringer is gone, so a call let through that
// way runs nothing on inputs that may never have been written.
//
// `input_fault` (CPU backend, optional): a word the service's SIGBUS handler
// sets when reading a client's shared memory faulted because its owner
// truncated it. The checks read it after they have loaded the call's inputs:
// when it is set they fail with kInputFault before anything is written (the
// faulting pages read as zeros).
struct Prerequisites {
  const DeviceStatus* statuses = nullptr;
  int count = 0;
  const uint32_t* cancelled = nullptr;
  uint32_t generation = 0;
  const uint32_t* input_fault = nullptr;
};

// An int32 matrix [rows, cols] with column stride 1.
struct IndexMatrix {
  const int32_t* data = nullptr;
  int64_t row_stride = 0;
  int cols = 0;
};

// The stock spec-path kernel (vLLM's fused_recurrent_kda on the spec path):
// per row, reads the state at column num_accepted_tokens[n] - 1 (0 when
// absent), writes o for every token and the state after token t to block
// ssm_state_indices[n, t] when that is not null.
struct StockArgs {
  KdaShape shape;
  Activation q, k, v, g, beta;  // g must be dense (token_stride == H * K)
  int64_t num_tokens = 0;       // tokens in the activations and in `out`
  void* out = nullptr;          // o [num_tokens, H, V], dense, activation dtype
  StatePool state;
  LayerParams params;
  int num_rows = 0;                          // N
  const int32_t* query_start_loc = nullptr;  // [N + 1]
  IndexMatrix ssm_state_indices;             // [N, C]
  const int32_t* num_accepted_tokens = nullptr;  // [N] or null
  void* workspace = nullptr;  // StockWorkspaceBytes(); zeroed once when allocated
  size_t workspace_bytes = 0;
  DeviceStatus* status = nullptr;
};

// RecoverSSM verify: one checkpoint per row, outputs and records, no state writes.
struct VerifyArgs {
  KdaShape shape;
  Activation q, k, v, g, beta;
  int64_t num_tokens = 0;
  void* out = nullptr;
  StatePool state;
  LayerParams params;
  Records records;
  int num_rows = 0;
  const int32_t* query_start_loc = nullptr;  // [N + 1]; every row has at most records.q tokens
  IndexMatrix state_indices;                 // [N, >= 1]: column 0 is the checkpoint block
  // The checks read each element of query_start_loc and of state_indices'
  // column 0 exactly once, and then either copy them here (dense memory the
  // caller of the kernels owns)...
  int32_t* snapshot_query_start_loc = nullptr;  // [N + 1]
  int32_t* snapshot_state_indices = nullptr;    // [N]
  // ...or require them equal to these (problem kMismatch). One of the two
  // pairs is required. Every later check and kernel reads only the snapshot
  // (or the expected values), never the inputs again: a caller that rewrites
  // its indices while the call runs cannot get unchecked ones used.
  const int32_t* expected_query_start_loc = nullptr;
  const int32_t* expected_state_indices = nullptr;
  Prerequisites prerequisites;
  DeviceStatus* status = nullptr;
  // Optional: host memory the device writes (pinned, mapped), where the
  // call's final status is copied once its checks are done if they failed,
  // so the service reads it without a copy on the stream. The caller zeroes
  // it first (zero: passed); a passing call leaves it untouched, sparing
  // the kernel a write across PCIe. Nothing on the device reads it.
  DeviceStatus* status_mirror = nullptr;

  // The service's commit mode: which of the fields below the call uses.
  CommitMode mode = CommitMode::kEager;

  // DEFERRED commits (mode kDeferred). Each row whose
  // checkpoint block has pending tokens in `layer` replays them first (from
  // `records` or `records_alt`, the buffer pending.header names), writes
  // the checkpoint once, then verifies its window from that state; the
  // window's records go to the other buffer. At most 2 * records.q <=
  // kMaxSpecQueryLen tokens a row, replayed and verified together.
  PendingBlocks pending;
  int layer = 0;
  Records records_alt;
  int32_t* replay_plan = nullptr;  // [N]: each row's entry, as the checks took it
  void* workspace = nullptr;       // VerifyWorkspaceBytes(); zeroed once when allocated (DEFERRED, FAST)
  size_t workspace_bytes = 0;

  // FAST (mode kFast): the layer's rings. Each
  // row's outputs come from its checkpoint block, that block's ring and the
  // window; the window's raw k, u and log-decay go to the block's ring as
  // candidates (slots [tokens, tokens + T)); no records and no state are
  // written (records.q still bounds the window: Q <= kMaxFastQueryLen; the
  // records' buffers may be null). The checks also refuse two rows verifying
  // from one block (their candidates would share the ring's slots), a cursor
  // no Commit leaves and a window the ring has no room for.
  FastRings fast;
};

// Crash bookkeeping of commits (optional; null `record`: none). The service
// keeps it in memory that outlives its process (server/kept/pool_header.h), so
// that after a crash the blocks of a commit that started and did not finish
// are known, and nothing half-written passes for a committed state. Only the
// commit's kernels write it, in stream order: once the commit's checks have
// passed and before its first write, the plan lists the blocks the commit
// writes (row i's at entries[2 i] and entries[2 i + 1], kNullBlock where it
// writes none) and marks the record started; after the commit's last write
// its final kernel records the step in the BlockRecord of each listed block
// and marks the record committed. A commit whose checks fail leaves it
// untouched. DEFERRED commits keep it too (with PendingBlocks::journal,
// required then), and FAST commits (their folds write only listed blocks;
// FlushArgs::fold_journal covers a Flush's).
inline constexpr uint32_t kJournalIdle = 0;
inline constexpr uint32_t kJournalStarted = 1;
inline constexpr uint32_t kJournalCommitted = 2;

struct JournalRecord {
  uint32_t state = kJournalIdle;  // kJournal*
  int32_t num_rows = 0;           // rows listed in the entries (two entries a row)
  uint64_t step = 0;              // the started (or last) commit's step id
  uint64_t last_committed_step = 0;
  uint64_t commits = 0;           // commits finished since the record was made
  uint64_t reserved[4] = {};
};

struct BlockRecord {
  uint64_t step = 0;      // step id of the last commit that wrote the block (0: none)
  uint64_t sequence = 0;  // JournalRecord::commits once that commit finished (0: none)
  uint32_t lost = 0;      // nonzero: an unfinished commit wrote it (set by the service after a
                          // crash); cleared when a later commit writes the block
  uint32_t reserved = 0;
};

struct CommitJournal {
  JournalRecord* record = nullptr;  // null: no journal
  int32_t* entries = nullptr;       // [2 * capacity_rows]
  int capacity_rows = 0;            // >= the commit's rows
  BlockRecord* blocks = nullptr;    // [the pools' num_blocks]
  uint64_t step = 0;                // this commit's step id
  // Tests only, CPU backend: called on the worker between the commit's
  // phases ("started", "conv", "layer" after each layer's replay,
  // "replayed" before the record is marked committed), so a test can kill
  // the process at a known point of a commit. Null in production.
  void (*test_hook)(const char* phase) = nullptr;
};

// One layer of a commit.
struct CommitLayer {
  StatePool state;
  ConvPool conv;
  LayerParams params;
  Records records;
  Records records_alt;  // DEFERRED: the other records buffer (records[1])
  FastRings fast;       // FAST: the layer's rings (CommitArgs and FlushArgs in mode kFast)
};

// RecoverSSM commit of every layer of a group at once: plan, conv compaction,
// replay indices, replay through the stock kernel.
struct CommitArgs {
  KdaShape shape;
  int spec_query_len = 0;  // Q
  int num_layers = 0;
  const CommitLayer* layers = nullptr;         // host copy: validated on the host
  const CommitLayer* device_layers = nullptr;  // the same table where the kernels read it
  int num_rows = 0;                            // N spec rows (those of the verify)
  const int32_t* query_start_loc = nullptr;    // [N + 1], as verified
  IndexMatrix state_indices;                   // [N, >= 1], as verified
  int batch = 0;                               // rows of num_accepted (and align metadata)
  const int32_t* num_accepted = nullptr;       // [batch]
  const int32_t* request_indices = nullptr;    // [N] spec row -> batch row; null: identity
  // Align mode: all of block_table.data, num_computed_tokens and
  // mamba_block_size, or none of them (mode "none").
  IndexMatrix block_table;                       // [batch, width]
  const int32_t* num_computed_tokens = nullptr;  // [batch]
  int mamba_block_size = 0;
  void* workspace = nullptr;  // CommitWorkspaceBytes(); zeroed once when allocated
  size_t workspace_bytes = 0;
  Prerequisites prerequisites;
  DeviceStatus* status = nullptr;
  // Optional: host memory the device writes (pinned, mapped), where the
  // call's final status is copied once its checks are done if they failed,
  // so the service reads it without a copy on the stream. The caller zeroes
  // it first (zero: passed); a passing call leaves it untouched, sparing
  // the kernel a write across PCIe. Nothing on the device reads it.
  DeviceStatus* status_mirror = nullptr;

  // The service's commit mode: which of the fields below the call uses.
  CommitMode mode = CommitMode::kEager;

  // DEFERRED (mode kDeferred): rows whose state stays in their
  // checkpoint block and that write no boundary state are left pending
  // there (conv windows are still compacted); the others, and what the
  // previous commit left pending that no Verify took, are replayed as
  // `jobs` (capacity: 2 * max rows * layers).
  PendingBlocks pending;
  ReplayJobs jobs;

  // FAST (mode kFast): every layer's rings are in its CommitLayer
  // (`fast`), the table's for the kernels included. After the plan and the
  // conv compaction (as EAGER), each committing row's ring takes its first
  // commit_len candidates (a fold into the checkpoint when the next window
  // might not fit); align mode: a row that leaves its checkpoint's block or
  // crosses a boundary has its boundary and final states folded and stored
  // (those blocks' rings emptied). The records are not read (their buffers
  // may be null). The checks also refuse a row that commits more tokens than
  // its block's last Verify left candidates in some layer, a cursor no
  // Commit leaves, two rows committing from one block, and a final or
  // boundary block (other than the row's checkpoint) whose ring still holds
  // tokens (another request's, not flushed).

  // Optional: the commit's crash bookkeeping (see CommitJournal).
  CommitJournal journal;
};

// One spec row's commit plan (docs/semantics.md, Commit step 1), as the commit
// leaves it in its workspace (see CommitPlanOf()).
struct CommitPlanRow {
  int32_t source;
  int32_t commit_len;
  int32_t final_block;
  int32_t boundary_block;
  int32_t boundary_len;
  int32_t request_row;  // the batch row (request_indices[i], or i) the plan read
};

// DEFERRED (mode kDeferred): materializes pending blocks (replays their
// pending tokens into the pool) or, with `discard`, forgets them (for blocks
// being freed). FAST (mode kFast; the rings are in the layers' `fast`): folds the given blocks' rings (every non-empty ring when
// `blocks` is null) into their checkpoints and empties them; the candidates
// of a Verify whose Commit has not come yet are kept (moved to the ring's
// start), so a Flush or a ReadState between a step's Verify and its Commit
// changes no result. With `discard` the rings are emptied, candidates
// included, and nothing is folded. `pending` and `jobs` are unused.
struct FlushArgs {
  KdaShape shape;
  int spec_query_len = 0;  // Q
  int num_layers = 0;
  const CommitLayer* layers = nullptr;         // host copy
  const CommitLayer* device_layers = nullptr;  // where the kernels read it
  PendingBlocks pending;
  ReplayJobs jobs;                   // capacity: pending.capacity * layers
  const int32_t* blocks = nullptr;   // [num_blocks_given]; null: every pending block
  int num_blocks_given = 0;          // <= the pool's blocks; <= 0 entries are null (skipped)
  // [num_blocks_given]: the checks copy `blocks` here (each element read
  // once); everything after them reads only this copy.
  int32_t* checked_blocks = nullptr;
  int layer = -1;                    // only this layer; -1: every layer
  bool discard = false;
  Prerequisites prerequisites;       // input_fault only (the block list may be a region)
  DeviceStatus* status = nullptr;
  DeviceStatus* status_mirror = nullptr;  // optional, as in VerifyArgs
  CommitMode mode = CommitMode::kEager;   // kDeferred or kFast (EAGER leaves nothing to flush)
  // FAST with kept pools: the fold journal (not with `copy`: a copy writes
  // nothing that outlives the call).
  FoldJournal fold_journal;
  // Materialize into a copy (ReadState; a host tier's save): with
  // `copy.data` set, the current state of list element i's block in `layer`
  // goes to block i + 1 of `copy` (its block 0 unused, as a pool's), the
  // bytes a Flush would leave in the pool, bit for bit (the same replay or
  // fold), and nothing else changes: no pool byte, no pending entry and no
  // journal (DEFERRED), no ring and no cursor (FAST). Needs a list, one
  // layer and no discard; copy.num_blocks > num_blocks_given, its
  // block_stride the layer's pool's. A null entry (<= 0) leaves its copy
  // block as it was. The list is checked as a Flush's.
  StatePool copy;
  // DEFERRED, with `copy` (its replay reads a layer table): layer `layer`'s
  // entry with its state pool replaced by `copy`, on the host and where the
  // kernels read it (one entry each).
  const CommitLayer* copy_layer = nullptr;
  const CommitLayer* device_copy_layer = nullptr;
};

// Align mode, after the commit: point each request at the block holding its
// running state and reset its accepted count.
struct RecordStateBlocksArgs {
  int num_rows = 0;                             // N spec rows
  const int32_t* request_indices = nullptr;     // [N] or null (identity)
  int batch = 0;
  const int32_t* idx_mapping = nullptr;         // [batch]: request row, < 0 skips
  const int32_t* num_sampled = nullptr;         // [batch]
  const int32_t* num_computed_tokens = nullptr; // [batch]
  int mamba_block_size = 0;
  int block_table_width = 0;
  int num_requests = 0;
  int32_t* state_idx = nullptr;     // [num_requests], written
  int32_t* num_accepted = nullptr;  // [num_requests], written
  void* workspace = nullptr;  // RecordStateBlocksWorkspaceBytes(); zeroed once
  size_t workspace_bytes = 0;
  Prerequisites prerequisites;
  DeviceStatus* status = nullptr;
  // Optional: host memory the device writes (pinned, mapped), where the
  // call's final status is copied once its checks are done if they failed,
  // so the service reads it without a copy on the stream. The caller zeroes
  // it first (zero: passed); a passing call leaves it untouched, sparing
  // the kernel a write across PCIe. Nothing on the device reads it.
  DeviceStatus* status_mirror = nullptr;
};

// A layer's gate parameters copied into the service's memory, checked
// finite on the device first: the destination keeps its old values when any
// source value is NaN or infinite (field kALog / kDtBias, problem kNotFinite).
struct LoadParamsArgs {
  int num_heads = 0;                 // H
  int head_dim = 0;                  // K
  const float* a_log = nullptr;      // [H], the caller's
  const float* dt_bias = nullptr;    // [H * K], the caller's
  float* staging = nullptr;          // [H + H * K]: where the values are checked
  float* dst_a_log = nullptr;        // [H]
  float* dst_dt_bias = nullptr;      // [H * K]
  const uint32_t* input_fault = nullptr;  // as in Prerequisites
  DeviceStatus* status = nullptr;
  DeviceStatus* status_mirror = nullptr;  // optional, as in VerifyArgs
};

// Scratch each call needs. The checks use part of it as a table they reset
// before returning, so it must be zeroed once when allocated and then only
// handed to one call at a time.
size_t StockWorkspaceBytes(int64_t num_blocks);
size_t CommitWorkspaceBytes(int max_rows, int spec_query_len, int64_t num_blocks);
// For calls of at most `max_rows` spec rows and `max_rows` request rows.
size_t RecordStateBlocksWorkspaceBytes(int max_rows);
// DEFERRED and FAST: a Verify's owner table (one per block).
size_t VerifyWorkspaceBytes(int64_t num_blocks);
// DEFERRED: PendingBlocks::header's and ::entries' sizes.
size_t PendingHeaderBytes(int capacity);
size_t PendingEntriesBytes(int num_layers, int64_t num_blocks);
// DEFERRED with kept pools: the blocks a pending journal lists at most (a
// Commit: the old list and two blocks a row; a Flush: its block list).
size_t PendingJournalCapacity(int capacity, int64_t num_blocks);
// DEFERRED: a commit's or a Flush's replay list, for `rows` rows (a Flush's
// capacity is that of pending blocks: the rows of a commit).
size_t CommitJobsCapacity(int max_rows, int num_layers);
size_t FlushJobsCapacity(int max_rows, int num_layers);

// Where a commit leaves its plan in `workspace`: rows [0, num_rows) of the
// call, valid once it ran (for statistics: tokens committed per row).
const CommitPlanRow* CommitPlanOf(const void* workspace, int64_t num_blocks);

}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_KDA_ARGS_H_
