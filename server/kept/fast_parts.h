// FAST's parts of the kept bookkeeping (pool_header.h: KeptFast, its fold
// journal, cursors and rings), for pool_header.cc: where they lie, and what
// attaching, counting and verifying them does on a host copy of the
// bookkeeping. Internal to server/kept.
#ifndef SPECSTATE_SERVER_KEPT_FAST_PARTS_H_
#define SPECSTATE_SERVER_KEPT_FAST_PARTS_H_

#include <cstdint>
#include <set>
#include <string>

#include "kernels/kda_args.h"
#include "server/kept/pool_header.h"
#include "specstate/v1/specstate.pb.h"

namespace specstate {
namespace server {
namespace kept_internal {

uint64_t FastChecksum(const KeptFast& f);
// Whether a header's FAST parts are well formed (present 0 with zeros, or 1
// with its checksum and sizes in range): "" or what is wrong.
std::string FastProblem(const KeptFast& f);

// FAST's parts after the block records (which end at `end`): `at`'s fast
// fields, bookkeeping_bytes and bytes.
void LayOutFast(int64_t num_blocks, const KeptFast& f, uint64_t end, HeaderLayout* at);

// What CheckIntact refuses in a FAST allocation's fold journal: "" or what
// is wrong.
std::string FoldJournalProblem(const char* bookkeeping, const HeaderLayout& at,
                               int64_t num_blocks);

// AttachHeader's FAST part (after the commit journal's lost blocks are
// marked with `mark`): an interrupted fold's blocks lost (a discard's
// emptied), rings of lost blocks and cursors no call leaves emptied, every
// candidate forgotten; `out`'s interrupted_call and pending_blocks.
void AttachFast(char* bookkeeping, const HeaderLayout& at, const KeptFast& f, int64_t num_blocks,
                kernels::BlockRecord* blocks, uint32_t mark, v1::RecoverResponse* out);

// Blocks whose ring holds accepted tokens in some layer.
int CountFastPending(const char* bookkeeping, const HeaderLayout& at, const KeptFast& f,
                     int64_t num_blocks);

// verify-pools' FAST part: the fold journal idle, every cursor one a call
// leaves, no lost block with tokens in its ring; `out`'s pending_blocks.
void VerifyFast(const char* bookkeeping, const HeaderLayout& at, const KeptFast& f,
                int64_t num_blocks, const kernels::BlockRecord* blocks, std::set<int32_t>* bad,
                v1::RecoverResponse* out);

}  // namespace kept_internal
}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_KEPT_FAST_PARTS_H_
