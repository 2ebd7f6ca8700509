#include "server/kept/pool_header.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "kernels/kda_kernels.h"
#include "server/base/fnv1a.h"
#include "server/config/config.h"
#include "server/kept/fast_parts.h"
#include "server/modes/rules.h"

namespace specstate {
namespace server {
namespace {

using kept_internal::FastProblem;

uint64_t AlignUp(uint64_t x, uint64_t to) { return (x + to - 1) / to * to; }

const KeptHeader& HeaderOf(const std::vector<char>& bytes) {
  return *reinterpret_cast<const KeptHeader*>(bytes.data());
}
KeptHeader& HeaderOf(std::vector<char>* bytes) {
  return *reinterpret_cast<KeptHeader*>(bytes->data());
}

uint64_t HeaderChecksum(const KeptHeader& h) {
  return Fnv1a(absl::string_view(reinterpret_cast<const char*>(&h), offsetof(KeptHeader, checksum)));
}

std::string IdentityOf(const KeptHeader& h) {
  const size_t n = std::min<size_t>(h.identity_bytes, sizeof(h.identity));
  return std::string(h.identity, n);
}

// "key=value" pairs of an identity.
std::map<std::string, std::string> Fields(const std::string& identity) {
  std::map<std::string, std::string> fields;
  for (absl::string_view pair : absl::StrSplit(identity, ' ', absl::SkipEmpty())) {
    const size_t eq = pair.find('=');
    if (eq == absl::string_view::npos) continue;
    fields[std::string(pair.substr(0, eq))] = std::string(pair.substr(eq + 1));
  }
  return fields;
}

// "num_blocks 64 -> 128, head_dim 64 -> 128".
std::string Differences(const std::string& kept, const std::string& now) {
  const std::map<std::string, std::string> a = Fields(kept), b = Fields(now);
  std::vector<std::string> out;
  std::set<std::string> keys;
  for (const auto& [k, v] : a) keys.insert(k);
  for (const auto& [k, v] : b) keys.insert(k);
  for (const std::string& k : keys) {
    auto x = a.find(k), y = b.find(k);
    // Identities without a commit mode are EAGER's (it keeps no max_rows).
    const std::string absent = k == "commit_mode" ? "EAGER" : k == "max_rows" ? "(not kept)" : "(none)";
    const std::string old_value = x == a.end() ? absent : x->second;
    const std::string new_value = y == b.end() ? absent : y->second;
    if (old_value != new_value) out.push_back(absl::StrCat(k, " ", old_value, " -> ", new_value));
  }
  return out.empty() ? "the layouts' texts differ" : absl::StrJoin(out, ", ");
}

uint64_t DeferredChecksum(const KeptDeferred& d) {
  return Fnv1a(absl::string_view(reinterpret_cast<const char*>(&d), offsetof(KeptDeferred, checksum)));
}

// Whether a header's DEFERRED parts are well formed (present 0, or 1 with
// its checksum and sizes in range): "" or what is wrong.
std::string DeferredProblem(const KeptDeferred& d) {
  if (d.present == 0) {
    return d.num_layers == 0 && d.capacity == 0 && d.records_per_layer_bytes == 0
               ? std::string()
               : "its DEFERRED parts say absent but are not zero";
  }
  if (d.present != 1) return absl::StrCat("its DEFERRED parts' marker is ", d.present, " (0 or 1)");
  if (DeferredChecksum(d) != d.checksum) {
    return absl::StrFormat("its DEFERRED parts' checksum is %016x, their bytes sum to %016x",
                           d.checksum, DeferredChecksum(d));
  }
  if (d.num_layers < 1 || d.capacity < 1 || d.capacity > kJournalRows || d.spec_query_len < 1 ||
      d.spec_query_len > kernels::kMaxSpecQueryLen || d.records_per_layer_bytes == 0) {
    return absl::StrCat("its DEFERRED parts say ", d.num_layers, " layers, ", d.capacity,
                        " rows, Q = ", d.spec_query_len, ", ", d.records_per_layer_bytes,
                        " bytes of records a layer");
  }
  return std::string();
}

// The DEFERRED table in a host copy of the bookkeeping.
struct PendingView {
  kernels::PendingJournalRecord* journal;
  int32_t* journal_blocks;
  int32_t* header;  // [0] parity word, [1] list size, [2...] the list
  int32_t* entries;
  int num_layers;
  int capacity;
  int q;
  int journal_capacity;
  int32_t& word() const { return header[0]; }
  int32_t& listed() const { return header[1]; }
  int32_t* list() const { return header + 2; }
  int32_t* layer(int l, int64_t num_blocks) const { return entries + int64_t{l} * num_blocks; }
};

PendingView PendingOf(char* base, const HeaderLayout& at, const KeptDeferred& d,
                      int64_t num_blocks) {
  PendingView v;
  v.journal = reinterpret_cast<kernels::PendingJournalRecord*>(base + at.pending_journal);
  v.journal_blocks = reinterpret_cast<int32_t*>(base + at.pending_journal_blocks);
  v.header = reinterpret_cast<int32_t*>(base + at.pending_header);
  v.entries = reinterpret_cast<int32_t*>(base + at.pending_entries);
  v.num_layers = d.num_layers;
  v.capacity = d.capacity;
  v.q = d.spec_query_len;
  v.journal_capacity = static_cast<int>(kernels::PendingJournalCapacity(d.capacity, num_blocks));
  return v;
}

// Why a nonzero entry cannot be one the kernels wrote ("" when it can): a
// record row past the capacity, another buffer than the parity word's, no
// tokens or more than Q.
// An entry as the kernels pack it (kernels/internal/checks.h, PackPending:
// ((record_row + 1) << 6) | (buffer << 5) | tokens); kept, so part of the
// format.
struct Entry {
  int32_t record_row, buffer, tokens;
};
Entry Unpack(int32_t packed) { return Entry{(packed >> 6) - 1, (packed >> 5) & 1, packed & 31}; }

std::string BadEntry(const PendingView& v, int32_t packed) {
  const Entry e = Unpack(packed);
  if (packed < 0 || e.record_row < 0 || e.record_row >= v.capacity) {
    return absl::StrCat("record row ", e.record_row, " (the records have ", v.capacity, " rows)");
  }
  if (e.buffer != v.word()) {
    return absl::StrCat("records buffer ", e.buffer, " (the parity word says ", v.word(), ")");
  }
  if (e.tokens < 1 || e.tokens > v.q) {
    return absl::StrCat(e.tokens, " tokens (1 to Q = ", v.q, ")");
  }
  return std::string();
}

std::string CallName(const kernels::PendingJournalRecord& j) {
  switch (j.kind) {
    case kernels::kPendingVerify:
      return absl::StrCat("Verify of layer ", j.layer);
    case kernels::kPendingFlush:
      return j.layer >= 0 ? absl::StrCat("Flush of layer ", j.layer) : "Flush";
    case kernels::kPendingDiscard:
      return "Flush (discard)";
    case kernels::kPendingCommit:
      return absl::StrCat("Commit of step ", j.step);
    default:
      return absl::StrCat("a call of kind ", j.kind);
  }
}

const kernels::JournalRecord& JournalOf(const std::vector<char>& bytes, const HeaderLayout& at) {
  return *reinterpret_cast<const kernels::JournalRecord*>(bytes.data() + at.journal);
}

const int32_t* EntriesOf(const std::vector<char>& bytes, const HeaderLayout& at) {
  return reinterpret_cast<const int32_t*>(bytes.data() + at.entries);
}

const kernels::BlockRecord* BlocksOf(const std::vector<char>& bytes, const HeaderLayout& at) {
  return reinterpret_cast<const kernels::BlockRecord*>(bytes.data() + at.blocks);
}

// The parts of a header that must hold whatever the layout: magic, checksum,
// sizes, and a journal in range. DATA_LOSS naming the first that does not.
absl::Status CheckIntact(const std::vector<char>& bytes) {
  const auto damaged = [](absl::string_view what) {
    return absl::DataLossError(absl::StrCat("the kept pools' header is damaged: ", what));
  };
  if (bytes.size() < sizeof(KeptHeader)) {
    return damaged(absl::StrCat("it has ", bytes.size(), " bytes, a header needs ",
                                sizeof(KeptHeader)));
  }
  const KeptHeader& h = HeaderOf(bytes);
  if (std::memcmp(h.magic, kKeptMagic, sizeof(kKeptMagic)) != 0) {
    return damaged("its magic is not SPSTKEPT (not specstated's, or overwritten)");
  }
  if (HeaderChecksum(h) != h.checksum) {
    return damaged(absl::StrFormat("its checksum is %016x, its bytes sum to %016x", h.checksum,
                                   HeaderChecksum(h)));
  }
  if (h.num_blocks < 2 || h.journal_rows != kJournalRows) {
    return damaged(absl::StrCat("num_blocks ", h.num_blocks, ", journal rows ", h.journal_rows));
  }
  if (const std::string why = DeferredProblem(h.deferred); !why.empty()) return damaged(why);
  if (const std::string why = FastProblem(h.fast); !why.empty()) return damaged(why);
  if (h.deferred.present != 0 && h.fast.present != 0) {
    return damaged("it says it has both DEFERRED's and FAST's parts");
  }
  const HeaderLayout at = HeaderLayoutFor(h.num_blocks, h.deferred, h.fast);
  if (h.bytes != at.bytes || bytes.size() < at.bookkeeping_bytes) {
    return damaged(absl::StrCat("it says ", h.bytes, " bytes, has ", bytes.size(), ", its layout needs ",
                                at.bytes, " (", at.bookkeeping_bytes, " of bookkeeping)"));
  }
  const kernels::JournalRecord& j = JournalOf(bytes, at);
  if (j.state != kernels::kJournalIdle && j.state != kernels::kJournalStarted &&
      j.state != kernels::kJournalCommitted) {
    return damaged(absl::StrCat("its journal's state is ", j.state,
                                " (not idle 0, started 1 or committed 2)"));
  }
  if (j.num_rows < 0 || j.num_rows > kJournalRows) {
    return damaged(absl::StrCat("its journal lists ", j.num_rows, " rows, at most ", kJournalRows,
                                " fit"));
  }
  if (h.deferred.present != 0) {
    const PendingView v =
        PendingOf(const_cast<char*>(bytes.data()), at, h.deferred, h.num_blocks);
    if (v.journal->state != kernels::kJournalIdle && v.journal->state != kernels::kJournalStarted) {
      return damaged(absl::StrCat("its pending journal's state is ", v.journal->state,
                                  " (not idle 0 or started 1)"));
    }
    if (v.journal->count < 0 || v.journal->count > v.journal_capacity) {
      return damaged(absl::StrCat("its pending journal lists ", v.journal->count,
                                  " blocks, at most ", v.journal_capacity, " fit"));
    }
    if (v.word() != 0 && v.word() != 1) {
      return damaged(absl::StrCat("its records parity word is ", v.word(), " (0 or 1)"));
    }
    if (v.listed() < 0 || v.listed() > v.capacity) {
      return damaged(absl::StrCat("its pending list has ", v.listed(), " blocks, at most ",
                                  v.capacity, " fit"));
    }
  }
  if (h.fast.present != 0) {
    if (const std::string why = kept_internal::FoldJournalProblem(bytes.data(), at, h.num_blocks);
        !why.empty()) {
      return damaged(why);
    }
  }
  return absl::OkStatus();
}

double UnixSeconds(absl::Time t) { return absl::ToDoubleSeconds(t - absl::UnixEpoch()); }

}  // namespace

HeaderLayout HeaderLayoutFor(int64_t num_blocks, const KeptDeferred& d, const KeptFast& f) {
  HeaderLayout at;
  at.journal = sizeof(KeptHeader);
  at.entries = at.journal + 256;
  at.blocks = AlignUp(at.entries + 2 * sizeof(int32_t) * uint64_t{kJournalRows}, 256);
  const uint64_t end = at.blocks + sizeof(kernels::BlockRecord) * uint64_t(num_blocks);
  if (f.present != 0) {
    kept_internal::LayOutFast(num_blocks, f, end, &at);
    return at;
  }
  if (d.present == 0) {
    at.bookkeeping_bytes = at.bytes = AlignUp(end, 4096);
    return at;
  }
  at.pending_journal = AlignUp(end, 256);
  at.pending_journal_blocks = at.pending_journal + 256;
  at.pending_header =
      AlignUp(at.pending_journal_blocks +
                  sizeof(int32_t) * kernels::PendingJournalCapacity(d.capacity, num_blocks),
              256);
  at.pending_entries = AlignUp(at.pending_header + kernels::PendingHeaderBytes(d.capacity), 256);
  at.bookkeeping_bytes = AlignUp(
      at.pending_entries + kernels::PendingEntriesBytes(d.num_layers, num_blocks), 4096);
  at.records = at.bookkeeping_bytes;
  at.records_stride = AlignUp(d.records_per_layer_bytes, 4096);
  at.bytes = at.records + 2 * uint64_t(d.num_layers) * at.records_stride;
  return at;
}

KeptDeferred KeptDeferredFor(const v1::Layout& layout, uint64_t records_per_layer_bytes) {
  KeptDeferred d;
  if (!CommitModeOf(layout).RecordsInKeptAllocation()) return d;
  d.present = 1;
  d.num_layers = layout.num_layers();
  d.capacity = layout.max_rows();
  d.spec_query_len = layout.num_spec() + 1;
  d.records_per_layer_bytes = records_per_layer_bytes;
  d.checksum = DeferredChecksum(d);
  return d;
}

KeptFast KeptFastFor(const v1::Layout& layout) {
  KeptFast f;
  if (!CommitModeOf(layout).KeepsRings()) return f;
  const LayoutSizes sizes = ComputeLayoutSizes(layout);
  f.present = 1;
  f.num_layers = layout.num_layers();
  f.capacity = sizes.fast_ring_capacity;
  f.spec_query_len = sizes.spec_query_len;
  f.ring_k_bytes = static_cast<uint64_t>(sizes.fast_ring_k_bytes);
  f.ring_u_bytes = static_cast<uint64_t>(sizes.fast_ring_u_bytes);
  f.ring_log_decay_bytes = static_cast<uint64_t>(sizes.fast_ring_log_decay_bytes);
  f.checksum = kept_internal::FastChecksum(f);
  return f;
}

FastParts FastPartsAt(void* base, int64_t num_blocks, const KeptFast& f) {
  FastParts parts;
  if (f.present == 0) return parts;
  const HeaderLayout at = HeaderLayoutFor(num_blocks, {}, f);
  char* p = static_cast<char*>(base);
  for (int l = 0; l < f.num_layers; ++l) {
    kernels::FastRings r;
    char* rings = p + at.rings + l * at.rings_stride;
    r.k = rings;
    r.u = reinterpret_cast<float*>(rings + f.ring_k_bytes);
    r.log_decay = reinterpret_cast<float*>(rings + f.ring_k_bytes + f.ring_u_bytes);
    r.cursors = reinterpret_cast<kernels::FastCursor*>(p + at.cursors + l * at.cursors_stride);
    r.num_blocks = num_blocks;
    r.capacity = f.capacity;
    parts.rings.push_back(r);
  }
  parts.journal.record = reinterpret_cast<kernels::PendingJournalRecord*>(p + at.fold_journal);
  parts.journal.blocks = reinterpret_cast<int32_t*>(p + at.fold_journal_blocks);
  parts.journal.capacity = static_cast<int>(num_blocks);
  return parts;
}

DeferredParts DeferredPartsAt(void* base, int64_t num_blocks, const KeptDeferred& d) {
  DeferredParts parts;
  if (d.present == 0) return parts;
  const HeaderLayout at = HeaderLayoutFor(num_blocks, d);
  char* p = static_cast<char*>(base);
  kernels::PendingBlocks& pending = parts.pending;
  pending.entries = reinterpret_cast<int32_t*>(p + at.pending_entries);
  pending.header = reinterpret_cast<int32_t*>(p + at.pending_header);
  pending.num_layers = d.num_layers;
  pending.num_blocks = num_blocks;
  pending.capacity = d.capacity;
  pending.journal = reinterpret_cast<kernels::PendingJournalRecord*>(p + at.pending_journal);
  pending.journal_blocks = reinterpret_cast<int32_t*>(p + at.pending_journal_blocks);
  pending.journal_capacity = static_cast<int>(kernels::PendingJournalCapacity(d.capacity, num_blocks));
  for (int i = 0; i < 2 * d.num_layers; ++i) parts.records.push_back(p + at.records + i * at.records_stride);
  return parts;
}

HeaderLayout HeaderLayoutOf(const std::vector<char>& bytes) {
  if (bytes.size() < sizeof(KeptHeader)) return HeaderLayoutFor(2);
  const KeptHeader& h = HeaderOf(bytes);
  const int64_t num_blocks = std::max<int64_t>(h.num_blocks, 2);
  if (!DeferredProblem(h.deferred).empty() || !FastProblem(h.fast).empty() ||
      (h.deferred.present != 0 && h.fast.present != 0)) {
    return HeaderLayoutFor(num_blocks);
  }
  return HeaderLayoutFor(num_blocks, h.deferred, h.fast);
}

std::string LayoutIdentity(const v1::Layout& l) {
  const int value_heads = l.num_value_heads() > 0 ? l.num_value_heads() : l.num_heads();
  std::string s = absl::StrCat(
      "layer_kind=", v1::LayerKind_Name(l.layer_kind()), " num_layers=", l.num_layers(),
      " num_heads=", l.num_heads(), " num_value_heads=", value_heads, " head_dim=", l.head_dim(),
      " conv_dim=", l.conv_dim(), " conv_kernel=", l.conv_kernel(), " num_spec=", l.num_spec(),
      " num_blocks=", l.num_blocks(), " activation_dtype=", v1::DType_Name(l.activation_dtype()),
      " state_dtype=", v1::DType_Name(l.state_dtype()), " cache_mode=",
      v1::CacheMode_Name(l.cache_mode()));
  if (l.cache_mode() == v1::ALIGN) absl::StrAppend(&s, " mamba_block_size=", l.mamba_block_size());
  if (l.layer_kind() == v1::KDA) {
    absl::StrAppend(&s, " kda_gate=", v1::KdaGate_Name(l.kda_gate()),
                    " lower_bound=", absl::StrFormat("%.9g", l.lower_bound()));
  }
  // The commit mode's kept parts (DEFERRED's records and pending tokens) need
  // the fields that give them their meaning.
  absl::StrAppend(&s, CommitModeOf(l).IdentitySuffix(l));
  return s;
}

uint64_t LayoutFingerprint(const v1::Layout& layout) { return Fnv1a(LayoutIdentity(layout)); }

std::vector<char> FreshHeader(const v1::Layout& layout, v1::Backend backend, int device,
                              uint64_t pool_bytes, absl::Time now, const KeptDeferred& deferred,
                              const KeptFast& fast) {
  const HeaderLayout at = HeaderLayoutFor(layout.num_blocks(), deferred, fast);
  std::vector<char> bytes(at.bookkeeping_bytes, 0);
  KeptHeader& h = HeaderOf(&bytes);
  std::memcpy(h.magic, kKeptMagic, sizeof(kKeptMagic));
  h.version = kKeptFormatVersion;
  h.backend = static_cast<uint32_t>(backend);
  h.device = device;
  h.journal_rows = kJournalRows;
  h.bytes = at.bytes;
  h.pool_bytes = pool_bytes;
  h.num_blocks = layout.num_blocks();
  const std::string identity = LayoutIdentity(layout);
  h.identity_bytes = static_cast<uint32_t>(std::min(identity.size(), sizeof(h.identity)));
  std::memcpy(h.identity, identity.data(), h.identity_bytes);
  h.fingerprint = Fnv1a(identity);
  h.created_unix_s = UnixSeconds(now);
  h.checksum = HeaderChecksum(h);
  h.started_unix_s = UnixSeconds(now);
  h.deferred = deferred;
  h.fast = fast;
  return bytes;
}

absl::Status CheckHeader(const std::vector<char>& bytes, const v1::Layout& layout,
                         v1::Backend backend, int device, uint64_t pool_bytes,
                         const KeptDeferred& deferred, const KeptFast& fast) {
  absl::Status intact = CheckIntact(bytes);
  if (!intact.ok()) return intact;
  const KeptHeader& h = HeaderOf(bytes);
  const auto refuse = [](absl::string_view what) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the kept pools cannot be used: ", what,
        "; start specstated as before, or with --discard_kept_pools to start with fresh pools "
        "(the kept states are then lost)"));
  };
  if (h.version != kKeptFormatVersion) {
    return refuse(absl::StrCat("their format version is ", h.version, ", this specstated reads ",
                               kKeptFormatVersion));
  }
  if (h.backend != static_cast<uint32_t>(backend)) {
    return refuse(absl::StrCat("they are ", v1::Backend_Name(static_cast<v1::Backend>(h.backend)),
                               " memory, this specstated runs the ", v1::Backend_Name(backend),
                               " backend"));
  }
  if (backend == v1::CUDA && h.device != device) {
    return refuse(absl::StrCat("they are on CUDA device ", h.device, ", this specstated runs on ",
                               device));
  }
  const std::string identity = LayoutIdentity(layout);
  if (h.fingerprint != Fnv1a(identity) || IdentityOf(h) != identity) {
    return refuse(absl::StrCat("they were made for another layout (fingerprint ",
                               absl::StrFormat("%016x", h.fingerprint), ", this one's ",
                               absl::StrFormat("%016x", Fnv1a(identity)),
                               "): ", Differences(IdentityOf(h), identity)));
  }
  if (h.pool_bytes != pool_bytes) {
    return refuse(absl::StrCat("they hold ", h.pool_bytes, " bytes of pools, this layout needs ",
                               pool_bytes));
  }
  if (std::memcmp(&h.deferred, &deferred, sizeof(KeptDeferred)) != 0) {
    // The fingerprint says the same layout: the header's own record of it is wrong.
    return absl::DataLossError(absl::StrCat(
        "the kept pools' header is damaged: its DEFERRED parts (", h.deferred.num_layers,
        " layers, ", h.deferred.capacity, " rows, ", h.deferred.records_per_layer_bytes,
        " bytes of records a layer) are not those of the layout it names (", deferred.num_layers,
        " layers, ", deferred.capacity, " rows, ", deferred.records_per_layer_bytes, " bytes)"));
  }
  if (std::memcmp(&h.fast, &fast, sizeof(KeptFast)) != 0) {
    return absl::DataLossError(absl::StrCat(
        "the kept pools' header is damaged: its FAST parts (", h.fast.num_layers, " layers, R = ",
        h.fast.capacity, ", Q = ", h.fast.spec_query_len, ") are not those of the layout it names (",
        fast.num_layers, " layers, R = ", fast.capacity, ", Q = ", fast.spec_query_len, ")"));
  }
  return absl::OkStatus();
}

namespace {

// AttachHeader's DEFERRED part (after the commit journal's lost blocks are
// marked): the interrupted call's blocks, the lost blocks' entries, entries
// no kernel could have written, the list rebuilt.
void AttachPending(std::vector<char>* bytes, v1::RecoverResponse* out) {
  KeptHeader& h = HeaderOf(bytes);
  const HeaderLayout at = HeaderLayoutFor(h.num_blocks, h.deferred);
  const PendingView v = PendingOf(bytes->data(), at, h.deferred, h.num_blocks);
  auto* blocks = reinterpret_cast<kernels::BlockRecord*>(bytes->data() + at.blocks);
  const uint32_t mark = static_cast<uint32_t>(std::max<uint64_t>(h.restarts, 1));
  const auto clear = [&](int64_t b) {
    for (int l = 0; l < v.num_layers; ++l) v.layer(l, h.num_blocks)[b] = 0;
  };
  if (v.journal->state == kernels::kJournalStarted) {
    // The call had started taking entries or writing checkpoints: each
    // listed block may be half-materialized in some layer, or half-pending.
    out->set_interrupted_call(CallName(*v.journal));
    for (int e = 0; e < v.journal->count; ++e) {
      const int32_t b = v.journal_blocks[e];
      if (b <= kernels::kNullBlock || b >= h.num_blocks) continue;
      if (v.journal->kind != kernels::kPendingDiscard) blocks[b].lost = mark;
      clear(b);  // a discard forgets them anyway
    }
    v.journal->state = kernels::kJournalIdle;
  }
  std::vector<char> pending(h.num_blocks, 0);
  for (int64_t b = 1; b < h.num_blocks; ++b) {
    // A lost block is re-prefilled: tokens pending on it would replay onto
    // the new state.
    if (blocks[b].lost != 0) clear(b);
    for (int l = 0; l < v.num_layers; ++l) {
      const int32_t entry = v.layer(l, h.num_blocks)[b];
      if (entry == 0) continue;
      if (!BadEntry(v, entry).empty()) {
        blocks[b].lost = mark;
        clear(b);
        pending[b] = 0;
        break;
      }
      pending[b] = 1;
    }
  }
  // Every block with an entry is listed, once: the old list's order, then
  // any other (none after any call the kernels finished or the journal
  // covers).
  std::vector<int32_t> list;
  for (int i = 0; i < v.listed(); ++i) {
    const int32_t b = v.list()[i];
    if (b > kernels::kNullBlock && b < h.num_blocks && pending[b] == 1) {
      list.push_back(b);
      pending[b] = 2;
    }
  }
  for (int64_t b = 1; b < h.num_blocks; ++b) {
    if (pending[b] != 1) continue;
    if (static_cast<int>(list.size()) < v.capacity) {
      list.push_back(static_cast<int32_t>(b));
    } else {
      blocks[b].lost = mark;  // cannot be listed: cannot be materialized
      clear(b);
    }
  }
  std::copy(list.begin(), list.end(), v.list());
  v.listed() = static_cast<int32_t>(list.size());
  out->set_pending_blocks(static_cast<int32_t>(list.size()));
}

// Blocks with an entry in some layer.
int CountPending(const PendingView& v, int64_t num_blocks) {
  int n = 0;
  for (int64_t b = 1; b < num_blocks; ++b) {
    for (int l = 0; l < v.num_layers; ++l) {
      if (v.layer(l, num_blocks)[b] != 0) {
        ++n;
        break;
      }
    }
  }
  return n;
}

}  // namespace

v1::RecoverResponse AttachHeader(std::vector<char>* bytes, absl::Time now, int64_t pid) {
  KeptHeader& h = HeaderOf(bytes);
  const HeaderLayout at = HeaderLayoutFor(h.num_blocks);
  auto& j = *reinterpret_cast<kernels::JournalRecord*>(bytes->data() + at.journal);
  const int32_t* entries = reinterpret_cast<const int32_t*>(bytes->data() + at.entries);
  auto* blocks = reinterpret_cast<kernels::BlockRecord*>(bytes->data() + at.blocks);
  v1::RecoverResponse out;
  out.set_kept(true);
  h.restarts += 1;
  if (j.state == kernels::kJournalStarted) {
    // A commit had started writing these blocks and never finished: their
    // states may be half-written, in any layer.
    out.set_interrupted(true);
    out.set_interrupted_step(j.step);
    for (int e = 0; e < 2 * j.num_rows; ++e) {
      const int32_t b = entries[e];
      if (b > kernels::kNullBlock && b < h.num_blocks) {
        blocks[b].lost = static_cast<uint32_t>(std::max<uint64_t>(h.restarts, 1));
      }
    }
    j.state = kernels::kJournalIdle;
  }
  if (h.deferred.present != 0) AttachPending(bytes, &out);
  if (h.fast.present != 0) {
    kept_internal::AttachFast(bytes->data(), HeaderLayoutFor(h.num_blocks, {}, h.fast), h.fast,
                              h.num_blocks, blocks,
                              static_cast<uint32_t>(std::max<uint64_t>(h.restarts, 1)), &out);
  }
  for (int64_t b = 1; b < h.num_blocks; ++b) {
    if (blocks[b].lost != 0) out.add_lost_blocks(static_cast<int32_t>(b));
  }
  out.set_last_committed_step(j.last_committed_step);
  out.set_commits(j.commits);
  out.set_previous_started_unix_s(h.started_unix_s);
  out.set_restarts(h.restarts);
  out.set_layout_fingerprint(absl::StrFormat("%016x", h.fingerprint));
  h.previous_started_unix_s = h.started_unix_s;
  h.started_unix_s = UnixSeconds(now);
  out.set_started_unix_s(h.started_unix_s);
  h.pid = pid;
  return out;
}

void ReadLiveHeader(const std::vector<char>& bytes, v1::RecoverResponse* out) {
  if (!CheckIntact(bytes).ok()) return;
  const KeptHeader& h = HeaderOf(bytes);
  const HeaderLayout at = HeaderLayoutFor(h.num_blocks, h.deferred, h.fast);
  const kernels::JournalRecord& j = JournalOf(bytes, at);
  const kernels::BlockRecord* blocks = BlocksOf(bytes, at);
  out->set_last_committed_step(j.last_committed_step);
  out->set_commits(j.commits);
  out->clear_lost_blocks();
  for (int64_t b = 1; b < h.num_blocks; ++b) {
    if (blocks[b].lost != 0) out->add_lost_blocks(static_cast<int32_t>(b));
  }
  if (h.deferred.present != 0) {
    out->set_pending_blocks(CountPending(
        PendingOf(const_cast<char*>(bytes.data()), at, h.deferred, h.num_blocks), h.num_blocks));
  }
  if (h.fast.present != 0) {
    out->set_pending_blocks(
        kept_internal::CountFastPending(bytes.data(), at, h.fast, h.num_blocks));
  }
}

namespace {

// verify-pools' DEFERRED part: the pending journal idle, the parity word,
// the list in range, every entry one the kernels could have written and its
// block listed, no lost block pending.
void VerifyPending(const std::vector<char>& bytes, const HeaderLayout& at, std::set<int32_t>* bad,
                   v1::RecoverResponse* out) {
  const KeptHeader& h = HeaderOf(bytes);
  const PendingView v = PendingOf(const_cast<char*>(bytes.data()), at, h.deferred, h.num_blocks);
  const kernels::BlockRecord* blocks = BlocksOf(bytes, at);
  if (v.journal->state == kernels::kJournalStarted) {
    out->add_problems(absl::StrCat("the pending journal says a ", CallName(*v.journal),
                                   " started and has not finished (nothing runs now: it was "
                                   "interrupted)"));
  }
  std::vector<char> listed(h.num_blocks, 0);
  for (int i = 0; i < v.listed(); ++i) {
    const int32_t b = v.list()[i];
    if (b <= kernels::kNullBlock || b >= h.num_blocks) {
      out->add_problems(absl::StrCat("the pending list's entry ", i, " names block ", b,
                                     ", outside [1, ", h.num_blocks, ")"));
    } else {
      listed[b] = 1;
    }
  }
  int pending = 0;
  for (int64_t b = 1; b < h.num_blocks; ++b) {
    bool any = false;
    for (int l = 0; l < v.num_layers; ++l) {
      const int32_t entry = v.layer(l, h.num_blocks)[b];
      if (entry == 0) continue;
      any = true;
      if (const std::string why = BadEntry(v, entry); !why.empty()) {
        bad->insert(static_cast<int32_t>(b));
        out->add_problems(absl::StrCat("block ", b, " has tokens pending in layer ", l,
                                       " that no commit could have left: ", why));
      }
    }
    if (!any) continue;
    ++pending;
    if (!listed[b]) {
      bad->insert(static_cast<int32_t>(b));
      out->add_problems(absl::StrCat("block ", b, " has tokens pending but is not in the pending "
                                     "list (no Commit or Flush would materialize it)"));
    }
    if (blocks[b].lost != 0) {
      bad->insert(static_cast<int32_t>(b));
      out->add_problems(absl::StrCat("block ", b, " is marked lost and still has tokens pending "
                                     "(they would replay onto its re-prefilled state)"));
    }
  }
  out->set_pending_blocks(pending);
}

}  // namespace

void VerifyHeader(const std::vector<char>& bytes, const v1::Layout& layout,
                  v1::RecoverResponse* out) {
  out->set_verified(true);
  absl::Status intact = CheckIntact(bytes);
  if (!intact.ok()) {
    out->add_problems(std::string(intact.message()));
    return;
  }
  const KeptHeader& h = HeaderOf(bytes);
  const std::string identity = LayoutIdentity(layout);
  if (h.fingerprint != Fnv1a(identity) || IdentityOf(h) != identity) {
    out->add_problems(absl::StrCat(
        "the header's layout fingerprint ", absl::StrFormat("%016x", h.fingerprint),
        " is not the served layout's ", absl::StrFormat("%016x", Fnv1a(identity)), ": ",
        Differences(IdentityOf(h), identity)));
  }
  const HeaderLayout at = HeaderLayoutFor(h.num_blocks, h.deferred, h.fast);
  const kernels::JournalRecord& j = JournalOf(bytes, at);
  const int32_t* entries = EntriesOf(bytes, at);
  const kernels::BlockRecord* blocks = BlocksOf(bytes, at);
  if (j.state == kernels::kJournalStarted) {
    out->add_problems(absl::StrCat("the journal says a commit of step ", j.step,
                                   " started and has not finished (nothing runs now: it was "
                                   "interrupted)"));
  }
  std::set<int32_t> bad;
  if (j.state == kernels::kJournalCommitted) {
    for (int e = 0; e < 2 * j.num_rows; ++e) {
      const int32_t b = entries[e];
      if (b < kernels::kNullBlock || b >= h.num_blocks) {
        out->add_problems(absl::StrCat("the journal's entry ", e, " names block ", b,
                                       ", outside the pools' ", h.num_blocks, " blocks"));
      } else if (b > kernels::kNullBlock && blocks[b].sequence != j.commits) {
        bad.insert(b);
        out->add_problems(absl::StrCat("block ", b, " was written by the last commit (#", j.commits,
                                       ", step ", j.step, ") but its record says commit #",
                                       blocks[b].sequence));
      }
    }
  }
  if (blocks[0].step != 0 || blocks[0].sequence != 0 || blocks[0].lost != 0) {
    out->add_problems("the null block 0 has a commit record: no commit writes it");
  }
  int lost = 0;
  for (int64_t b = 1; b < h.num_blocks; ++b) {
    const kernels::BlockRecord& r = blocks[b];
    if (r.sequence > j.commits) {
      bad.insert(static_cast<int32_t>(b));
      out->add_problems(absl::StrCat("block ", b, " records commit #", r.sequence, " (step ", r.step,
                                     "), after the journal's last, #", j.commits));
    }
    if (r.lost != 0) {
      bad.insert(static_cast<int32_t>(b));
      ++lost;
    }
  }
  if (lost > 0) {
    out->add_problems(absl::StrCat(lost, " blocks are marked lost (an unfinished commit wrote "
                                   "them; no commit has written them since)"));
  }
  if (h.deferred.present != 0) VerifyPending(bytes, at, &bad, out);
  if (h.fast.present != 0) {
    kept_internal::VerifyFast(bytes.data(), at, h.fast, h.num_blocks, blocks, &bad, out);
  }
  for (int32_t b : bad) out->add_inconsistent_blocks(b);
}

kernels::CommitJournal JournalAt(void* base, int64_t num_blocks) {
  const HeaderLayout at = HeaderLayoutFor(num_blocks);
  char* p = static_cast<char*>(base);
  kernels::CommitJournal j;
  j.record = reinterpret_cast<kernels::JournalRecord*>(p + at.journal);
  j.entries = reinterpret_cast<int32_t*>(p + at.entries);
  j.capacity_rows = kJournalRows;
  j.blocks = reinterpret_cast<kernels::BlockRecord*>(p + at.blocks);
  return j;
}

}  // namespace server
}  // namespace specstate
