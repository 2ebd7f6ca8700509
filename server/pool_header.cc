#include "server/pool_header.h"

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
#include "server/fnv1a.h"

namespace specstate {
namespace server {
namespace {

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
    const std::string old_value = x == a.end() ? "(none)" : x->second;
    const std::string new_value = y == b.end() ? "(none)" : y->second;
    if (old_value != new_value) out.push_back(absl::StrCat(k, " ", old_value, " -> ", new_value));
  }
  return out.empty() ? "the layouts' texts differ" : absl::StrJoin(out, ", ");
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
  const HeaderLayout at = HeaderLayoutFor(h.num_blocks);
  if (h.bytes != at.bytes || bytes.size() < at.bytes) {
    return damaged(absl::StrCat("it says ", h.bytes, " bytes, has ", bytes.size(), ", its layout needs ",
                                at.bytes));
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
  return absl::OkStatus();
}

double UnixSeconds(absl::Time t) { return absl::ToDoubleSeconds(t - absl::UnixEpoch()); }

}  // namespace

HeaderLayout HeaderLayoutFor(int64_t num_blocks) {
  HeaderLayout at;
  at.journal = sizeof(KeptHeader);
  at.entries = at.journal + 256;
  at.blocks = AlignUp(at.entries + 2 * sizeof(int32_t) * uint64_t{kJournalRows}, 256);
  at.bytes = AlignUp(at.blocks + sizeof(kernels::BlockRecord) * uint64_t(num_blocks), 4096);
  return at;
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
  return s;
}

uint64_t LayoutFingerprint(const v1::Layout& layout) { return Fnv1a(LayoutIdentity(layout)); }

std::vector<char> FreshHeader(const v1::Layout& layout, v1::Backend backend, int device,
                              uint64_t pool_bytes, absl::Time now) {
  const HeaderLayout at = HeaderLayoutFor(layout.num_blocks());
  std::vector<char> bytes(at.bytes, 0);
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
  return bytes;
}

absl::Status CheckHeader(const std::vector<char>& bytes, const v1::Layout& layout,
                         v1::Backend backend, int device, uint64_t pool_bytes) {
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
  return absl::OkStatus();
}

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
  const HeaderLayout at = HeaderLayoutFor(h.num_blocks);
  const kernels::JournalRecord& j = JournalOf(bytes, at);
  const kernels::BlockRecord* blocks = BlocksOf(bytes, at);
  out->set_last_committed_step(j.last_committed_step);
  out->set_commits(j.commits);
  out->clear_lost_blocks();
  for (int64_t b = 1; b < h.num_blocks; ++b) {
    if (blocks[b].lost != 0) out->add_lost_blocks(static_cast<int32_t>(b));
  }
}

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
  const HeaderLayout at = HeaderLayoutFor(h.num_blocks);
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
