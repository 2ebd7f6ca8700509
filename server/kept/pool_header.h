// The bookkeeping that makes re-attaching kept pools safe: a header (magic,
// format version, the fingerprint of the layout the pools were made for,
// their sizes; checksummed), the commit journal the kernels keep
// (kernels::JournalRecord and its entries: which blocks a commit is writing)
// and one kernels::BlockRecord per block (the last commit that wrote it;
// whether an unfinished commit did). It lives in an allocation of its own,
// kept beside the pools (server/kept/recovery.h) and never exported: no pool view
// covers it and no client maps it. The kernels write the journal and the
// block records in stream order; the host reads and writes a copy of the
// whole allocation at start (Attach) and for verify-pools (Verify).
//
// Memory layout (HeaderLayoutFor):
//   [0, 4096)          KeptHeader
//   journal            kernels::JournalRecord
//   entries            int32 [2 * kJournalRows]: the blocks a commit writes
//   blocks             kernels::BlockRecord [num_blocks]
// and with commit_mode DEFERRED (KeptHeader::deferred says so) its state
// that must outlive the process too, so that pending tokens survive:
//   pending_journal    kernels::PendingJournalRecord
//   pending_journal_blocks int32 [PendingJournalCapacity]
//   pending_header     PendingBlocks::header (the records' parity word, the list)
//   pending_entries    PendingBlocks::entries [num_layers, num_blocks]
//   records            2 * num_layers records buffers (layer l's buffer b at 2 l + b)
// or with commit_mode FAST (KeptHeader::fast says so) its rings, so that
// accepted tokens not yet folded survive:
//   fold_journal       kernels::PendingJournalRecord (kernels::FoldJournal's)
//   fold_journal_blocks int32 [num_blocks]
//   cursors            kernels::FastCursor [num_layers, num_blocks] (a layer's
//                      at cursors + l * cursors_stride)
//   rings              per layer k, u and log-decay (layer l's at
//                      rings + l * rings_stride)
// Everything before `records` (`rings`) is the bookkeeping Attach and
// Recover read; the records and rings are read only by the kernels.
//
//   std::vector<char> bytes = FreshHeader(layout, v1::CPU, 0, pool_bytes, absl::Now());
//   ...                                  // kept by a keeper; a new instance:
//   absl::Status ok = CheckHeader(bytes, layout, v1::CPU, 0, pool_bytes);
//   v1::RecoverResponse report = AttachHeader(&bytes, absl::Now(), getpid());
#ifndef SPECSTATE_SERVER_KEPT_POOL_HEADER_H_
#define SPECSTATE_SERVER_KEPT_POOL_HEADER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kernels/kda_args.h"
#include "specstate/v1/specstate.pb.h"

namespace specstate {
namespace server {

namespace v1 = ::specstate::v1;

inline constexpr char kKeptMagic[8] = {'S', 'P', 'S', 'T', 'K', 'E', 'P', 'T'};
inline constexpr uint32_t kKeptFormatVersion = 1;
// Rows the journal's entries hold: ValidateLayout's bound on max_rows, so the
// allocation does not depend on max_rows (which may change across restarts).
inline constexpr int kJournalRows = 65536;

// DEFERRED's kept parts, as the header records them (zero: none, EAGER).
// Written once, when the pools are made; its own checksum (it lies after the
// header's, where version 1 headers have zeros).
struct KeptDeferred {
  uint32_t present = 0;       // 1: the allocation has DEFERRED's parts
  int32_t num_layers = 0;
  int32_t capacity = 0;       // max_rows: the rows of a commit, of the records
  int32_t spec_query_len = 0;  // Q
  uint64_t records_per_layer_bytes = 0;  // one records buffer of one layer
  uint64_t checksum = 0;      // FNV-1a of the fields before it
};
static_assert(sizeof(KeptDeferred) == 32, "KeptDeferred's layout is part of the format");

// FAST's kept parts, as the header records them (zero: none). Written once,
// when the pools are made; its own checksum (after DEFERRED's, where older
// headers have zeros).
struct KeptFast {
  uint32_t present = 0;        // 1: the allocation has FAST's parts
  int32_t num_layers = 0;
  int32_t capacity = 0;        // R: ring tokens a block (fold_every * Q)
  int32_t spec_query_len = 0;  // Q
  uint64_t ring_k_bytes = 0;   // one layer's rings, as ModeScratchSizes sizes them
  uint64_t ring_u_bytes = 0;
  uint64_t ring_log_decay_bytes = 0;
  uint64_t checksum = 0;       // FNV-1a of the fields before it
};
static_assert(sizeof(KeptFast) == 48, "KeptFast's layout is part of the format");

// The start of the bookkeeping allocation. Everything up to `checksum` is
// written once, when the pools are made; the rest at every attach.
struct KeptHeader {
  char magic[8];
  uint32_t version;
  uint32_t backend;  // v1::Backend of the memory: CPU (memfds) or CUDA
  int32_t device;    // CUDA: the device the pools are on
  int32_t journal_rows;
  uint64_t bytes;       // the whole bookkeeping allocation, as laid out
  uint64_t pool_bytes;  // the pools' allocation (ExportPools' allocation_bytes)
  int64_t num_blocks;
  uint64_t fingerprint;  // LayoutFingerprint() of `identity`
  double created_unix_s;
  uint32_t identity_bytes;
  uint32_t reserved0;
  char identity[2048];  // LayoutIdentity(), NUL-padded
  uint64_t checksum;    // FNV-1a of every byte before it
  // Per instance.
  double started_unix_s;
  double previous_started_unix_s;
  int64_t pid;
  uint64_t restarts;
  KeptDeferred deferred;  // written once, with the part above
  KeptFast fast;          // written once, with the part above
  char reserved[4096 - 2160 - sizeof(KeptDeferred) - sizeof(KeptFast)];
};
static_assert(sizeof(KeptHeader) == 4096, "KeptHeader is one page");
static_assert(sizeof(kernels::JournalRecord) == 64, "JournalRecord's layout is part of the format");
static_assert(sizeof(kernels::BlockRecord) == 24, "BlockRecord's layout is part of the format");

// Where each part lies in the allocation, and its size.
struct HeaderLayout {
  uint64_t journal = 0;
  uint64_t entries = 0;
  uint64_t blocks = 0;
  // DEFERRED (all 0 without it).
  uint64_t pending_journal = 0;
  uint64_t pending_journal_blocks = 0;
  uint64_t pending_header = 0;
  uint64_t pending_entries = 0;
  uint64_t records = 0;
  uint64_t records_stride = 0;  // between two records buffers
  // FAST (all 0 without it).
  uint64_t fold_journal = 0;
  uint64_t fold_journal_blocks = 0;
  uint64_t cursors = 0;
  uint64_t cursors_stride = 0;  // between two layers' cursors
  uint64_t rings = 0;
  uint64_t rings_stride = 0;    // between two layers' rings (k, u, log-decay)
  uint64_t bookkeeping_bytes = 0;  // [0, bookkeeping_bytes): what the host reads
  uint64_t bytes = 0;
};
HeaderLayout HeaderLayoutFor(int64_t num_blocks, const KeptDeferred& deferred = {},
                             const KeptFast& fast = {});

// `layout`'s DEFERRED parts (present = 0 for other commit modes), given one
// records buffer's size (LayoutSizes::records_per_layer_bytes).
KeptDeferred KeptDeferredFor(const v1::Layout& layout, uint64_t records_per_layer_bytes);
// `layout`'s FAST parts (present = 0 for other commit modes).
KeptFast KeptFastFor(const v1::Layout& layout);

// Where DEFERRED's kept parts lie in a mapped allocation (`base`: where the
// kernels see it): the pending table with its journal, and the records
// buffers (kernels::Records' kv at each; the engine lays out g and beta as
// for its own).
struct DeferredParts {
  kernels::PendingBlocks pending;
  std::vector<char*> records;  // [2 * num_layers]: layer l's buffer b at 2 l + b
};
DeferredParts DeferredPartsAt(void* base, int64_t num_blocks, const KeptDeferred& deferred);

// Where FAST's kept parts lie in a mapped allocation: every layer's rings
// and cursors (FastRings, as the kernels take them) and the fold journal.
struct FastParts {
  std::vector<kernels::FastRings> rings;  // [num_layers]
  kernels::FoldJournal journal;
};
FastParts FastPartsAt(void* base, int64_t num_blocks, const KeptFast& fast);

// What the kept allocation holds for the layout's commit mode (both empty
// for EAGER), for the Engine (Recovery::kept_parts()).
struct KeptModeParts {
  DeferredParts deferred;  // pending.entries null: none
  FastParts fast;          // rings empty: none
};

// The fields of a layout that give the pools' bytes their meaning, as text
// ("layer_kind=KDA num_layers=4 ..."): what must not change across a
// restart. Not max_rows (EAGER keeps no records), nor the device or backend
// (checked on their own); with commit_mode DEFERRED, the mode and max_rows
// too (its records and pending tokens are kept; an EAGER service would
// ignore pending tokens).
std::string LayoutIdentity(const v1::Layout& layout);
uint64_t LayoutFingerprint(const v1::Layout& layout);

// A new bookkeeping allocation for pools of `pool_bytes` of `layout`: no
// commit yet, no block written.
// The host copy holds the bookkeeping (HeaderLayout::bookkeeping_bytes);
// the records that follow it in the allocation start zeroed.
std::vector<char> FreshHeader(const v1::Layout& layout, v1::Backend backend, int device,
                              uint64_t pool_bytes, absl::Time now,
                              const KeptDeferred& deferred = {}, const KeptFast& fast = {});

// The layout a header's own fields give (its num_blocks and DEFERRED parts);
// the EAGER layout when the header is too damaged to say.
HeaderLayout HeaderLayoutOf(const std::vector<char>& bytes);

// Whether kept bookkeeping may be attached with `layout`:
// \returns DATA_LOSS for a damaged header (magic, checksum, sizes, a journal
//   out of range), FAILED_PRECONDITION naming what differs for another
//   format version, backend, device, pool size or layout (each changed field
//   with its old and new value).
//   `bytes` is the bookkeeping (at least HeaderLayout::bookkeeping_bytes);
//   `deferred`, `fast`: the parts `layout` needs (DATA_LOSS when the
//   header's differ though the fingerprint matches).
absl::Status CheckHeader(const std::vector<char>& bytes, const v1::Layout& layout,
                         v1::Backend backend, int device, uint64_t pool_bytes,
                         const KeptDeferred& deferred = {}, const KeptFast& fast = {});

// Takes checked bookkeeping over for a new instance: marks the blocks of an
// interrupted commit lost, closes the journal, stamps the instance; returns
// what was kept (RecoverResponse without holder, sizes and timing).
// DEFERRED: the blocks an interrupted call listed in the pending journal are
// lost too (unless it only discarded), every lost block's pending entries
// are cleared in every layer, an entry the kernels could not have written
// (a record row past the capacity, another records buffer than the parity
// word's, no tokens or more than Q) loses its block, and the list of
// pending blocks is rebuilt from the entries, so the table is consistent
// whatever call the crash interrupted.
// FAST: the blocks an interrupted fold listed are lost too (an interrupted
// discard's are emptied), every lost block's ring is emptied in every
// layer, a cursor no call could have left loses its block, and every
// Verify's candidates are forgotten (the step in flight is refused and
// re-run), so the rings hold only accepted tokens of finished Commits.
v1::RecoverResponse AttachHeader(std::vector<char>* bytes, absl::Time now, int64_t pid);

// What the bookkeeping says now (a live service's): `out`'s
// last_committed_step, commits and lost_blocks, from the journal and the
// block records. Leaves `out` alone when the header is damaged.
void ReadLiveHeader(const std::vector<char>& bytes, v1::RecoverResponse* out);

// verify-pools: re-checks the header against `layout` and every record
// against the journal (DEFERRED: the pending table too: the parity word,
// every entry's record row, buffer and tokens, every pending block listed,
// no lost block pending, the pending journal idle; FAST: the fold journal
// idle, every cursor one a call leaves, no lost block with ring tokens);
// fills `out`'s verified,
// problems and inconsistent_blocks.
void VerifyHeader(const std::vector<char>& bytes, const v1::Layout& layout,
                  v1::RecoverResponse* out);

// The journal of a mapped allocation (`base`: where the service's kernels see
// it), for CommitArgs.
kernels::CommitJournal JournalAt(void* base, int64_t num_blocks);

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_KEPT_POOL_HEADER_H_
