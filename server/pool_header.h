// The bookkeeping that makes re-attaching kept pools safe: a header (magic,
// format version, the fingerprint of the layout the pools were made for,
// their sizes; checksummed), the commit journal the kernels keep
// (kernels::JournalRecord and its entries: which blocks a commit is writing)
// and one kernels::BlockRecord per block (the last commit that wrote it;
// whether an unfinished commit did). It lives in an allocation of its own,
// kept beside the pools (server/recovery.h) and never exported: no pool view
// covers it and no client maps it. The kernels write the journal and the
// block records in stream order; the host reads and writes a copy of the
// whole allocation at start (Attach) and for verify-pools (Verify).
//
// Memory layout (HeaderLayoutFor):
//   [0, 4096)          KeptHeader
//   journal            kernels::JournalRecord
//   entries            int32 [2 * kJournalRows]: the blocks a commit writes
//   blocks             kernels::BlockRecord [num_blocks]
//
//   std::vector<char> bytes = FreshHeader(layout, v1::CPU, 0, pool_bytes, absl::Now());
//   ...                                  // kept by a keeper; a new instance:
//   absl::Status ok = CheckHeader(bytes, layout, v1::CPU, 0, pool_bytes);
//   v1::RecoverResponse report = AttachHeader(&bytes, absl::Now(), getpid());
#ifndef SPECSTATE_SERVER_POOL_HEADER_H_
#define SPECSTATE_SERVER_POOL_HEADER_H_

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
  char reserved[4096 - 2160];
};
static_assert(sizeof(KeptHeader) == 4096, "KeptHeader is one page");
static_assert(sizeof(kernels::JournalRecord) == 64, "JournalRecord's layout is part of the format");
static_assert(sizeof(kernels::BlockRecord) == 24, "BlockRecord's layout is part of the format");

// Where each part lies in the allocation, and its size.
struct HeaderLayout {
  uint64_t journal = 0;
  uint64_t entries = 0;
  uint64_t blocks = 0;
  uint64_t bytes = 0;
};
HeaderLayout HeaderLayoutFor(int64_t num_blocks);

// The fields of a layout that give the pools' bytes their meaning, as text
// ("layer_kind=KDA num_layers=4 ..."): what must not change across a
// restart. Not max_rows (records are not kept), nor the device or backend
// (checked on their own).
std::string LayoutIdentity(const v1::Layout& layout);
uint64_t LayoutFingerprint(const v1::Layout& layout);

// A new bookkeeping allocation for pools of `pool_bytes` of `layout`: no
// commit yet, no block written.
std::vector<char> FreshHeader(const v1::Layout& layout, v1::Backend backend, int device,
                              uint64_t pool_bytes, absl::Time now);

// Whether kept bookkeeping may be attached with `layout`:
// \returns DATA_LOSS for a damaged header (magic, checksum, sizes, a journal
//   out of range), FAILED_PRECONDITION naming what differs for another
//   format version, backend, device, pool size or layout (each changed field
//   with its old and new value).
absl::Status CheckHeader(const std::vector<char>& bytes, const v1::Layout& layout,
                         v1::Backend backend, int device, uint64_t pool_bytes);

// Takes checked bookkeeping over for a new instance: marks the blocks of an
// interrupted commit lost, closes the journal, stamps the instance; returns
// what was kept (RecoverResponse without holder, sizes and timing).
v1::RecoverResponse AttachHeader(std::vector<char>* bytes, absl::Time now, int64_t pid);

// What the bookkeeping says now (a live service's): `out`'s
// last_committed_step, commits and lost_blocks, from the journal and the
// block records. Leaves `out` alone when the header is damaged.
void ReadLiveHeader(const std::vector<char>& bytes, v1::RecoverResponse* out);

// verify-pools: re-checks the header against `layout` and every record
// against the journal; fills `out`'s verified, problems and
// inconsistent_blocks.
void VerifyHeader(const std::vector<char>& bytes, const v1::Layout& layout,
                  v1::RecoverResponse* out);

// The journal of a mapped allocation (`base`: where the service's kernels see
// it), for CommitArgs.
kernels::CommitJournal JournalAt(void* base, int64_t num_blocks);

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_POOL_HEADER_H_
