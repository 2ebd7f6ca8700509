#include "server/kept/fast_parts.h"

#include <cstddef>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/base/fnv1a.h"

namespace specstate {
namespace server {
namespace kept_internal {
namespace {

uint64_t AlignUp(uint64_t x, uint64_t to) { return (x + to - 1) / to * to; }

// FAST's parts in a host copy of the bookkeeping.
struct FastView {
  kernels::PendingJournalRecord* journal;
  int32_t* journal_blocks;
  char* cursors;
  uint64_t cursors_stride;
  int num_layers;
  int capacity;
  int q;
  kernels::FastCursor& cursor(int l, int64_t b) const {
    return reinterpret_cast<kernels::FastCursor*>(cursors + l * cursors_stride)[b];
  }
};

FastView ViewOf(const char* bookkeeping, const HeaderLayout& at, const KeptFast& f) {
  char* base = const_cast<char*>(bookkeeping);
  FastView v;
  v.journal = reinterpret_cast<kernels::PendingJournalRecord*>(base + at.fold_journal);
  v.journal_blocks = reinterpret_cast<int32_t*>(base + at.fold_journal_blocks);
  v.cursors = base + at.cursors;
  v.cursors_stride = at.cursors_stride;
  v.num_layers = f.num_layers;
  v.capacity = f.capacity;
  v.q = f.spec_query_len;
  return v;
}

// Why a cursor is none a call leaves ("" when it is): a Commit leaves at
// most R - Q tokens (it folds when the next window would not fit), a Verify
// at most Q candidates after them.
std::string BadCursor(const FastView& v, const kernels::FastCursor& c) {
  if (c.tokens < 0 || c.tokens > v.capacity - v.q) {
    return absl::StrCat(c.tokens, " ring tokens (0 to R - Q = ", v.capacity - v.q, ")");
  }
  if (c.candidates < 0 || c.candidates > v.q || c.tokens + c.candidates > v.capacity) {
    return absl::StrCat(c.candidates, " candidates after ", c.tokens, " tokens (Q = ", v.q,
                        ", R = ", v.capacity, ")");
  }
  if (c.reserved != 0) return absl::StrCat("its reserved word is ", c.reserved);
  return std::string();
}

std::string FoldCallName(const kernels::PendingJournalRecord& j) {
  if (j.kind == kernels::kPendingDiscard) return "Flush (discard)";
  return j.layer >= 0 ? absl::StrCat("Flush of layer ", j.layer) : "Flush";
}

}  // namespace

uint64_t FastChecksum(const KeptFast& f) {
  return Fnv1a(absl::string_view(reinterpret_cast<const char*>(&f), offsetof(KeptFast, checksum)));
}

std::string FastProblem(const KeptFast& f) {
  if (f.present == 0) {
    return f.num_layers == 0 && f.capacity == 0 && f.ring_k_bytes == 0
               ? std::string()
               : "its FAST parts say absent but are not zero";
  }
  if (f.present != 1) return absl::StrCat("its FAST parts' marker is ", f.present, " (0 or 1)");
  if (FastChecksum(f) != f.checksum) {
    return absl::StrFormat("its FAST parts' checksum is %016x, their bytes sum to %016x",
                           f.checksum, FastChecksum(f));
  }
  if (f.num_layers < 1 || f.spec_query_len < 1 || f.spec_query_len > kernels::kMaxFastQueryLen ||
      f.capacity < f.spec_query_len || f.ring_k_bytes == 0 || f.ring_u_bytes == 0 ||
      f.ring_log_decay_bytes == 0) {
    return absl::StrCat("its FAST parts say ", f.num_layers, " layers, R = ", f.capacity,
                        ", Q = ", f.spec_query_len, ", rings of ", f.ring_k_bytes, " + ",
                        f.ring_u_bytes, " + ", f.ring_log_decay_bytes, " bytes a layer");
  }
  return std::string();
}

void LayOutFast(int64_t num_blocks, const KeptFast& f, uint64_t end, HeaderLayout* at) {
  at->fold_journal = AlignUp(end, 256);
  at->fold_journal_blocks = at->fold_journal + 256;
  at->cursors = AlignUp(at->fold_journal_blocks + sizeof(int32_t) * uint64_t(num_blocks), 256);
  at->cursors_stride = AlignUp(sizeof(kernels::FastCursor) * uint64_t(num_blocks), 256);
  at->bookkeeping_bytes = AlignUp(at->cursors + uint64_t(f.num_layers) * at->cursors_stride, 4096);
  at->rings = at->bookkeeping_bytes;
  at->rings_stride = AlignUp(f.ring_k_bytes + f.ring_u_bytes + f.ring_log_decay_bytes, 4096);
  at->bytes = at->rings + uint64_t(f.num_layers) * at->rings_stride;
}

std::string FoldJournalProblem(const char* bookkeeping, const HeaderLayout& at,
                               int64_t num_blocks) {
  const auto& j = *reinterpret_cast<const kernels::PendingJournalRecord*>(bookkeeping +
                                                                          at.fold_journal);
  if (j.state != kernels::kJournalIdle && j.state != kernels::kJournalStarted) {
    return absl::StrCat("its fold journal's state is ", j.state, " (not idle 0 or started 1)");
  }
  if (j.count < 0 || j.count > num_blocks) {
    return absl::StrCat("its fold journal lists ", j.count, " blocks, at most ", num_blocks,
                        " fit");
  }
  return std::string();
}

void AttachFast(char* bookkeeping, const HeaderLayout& at, const KeptFast& f, int64_t num_blocks,
                kernels::BlockRecord* blocks, uint32_t mark, v1::RecoverResponse* out) {
  const FastView v = ViewOf(bookkeeping, at, f);
  const auto empty = [&](int64_t b) {
    for (int l = 0; l < v.num_layers; ++l) v.cursor(l, b) = kernels::FastCursor{0, 0, 0};
  };
  if (v.journal->state == kernels::kJournalStarted) {
    // A fold may have written part of a listed block's checkpoint (some
    // layers, some heads) and not emptied its ring: lost. A discard only
    // empties rings: finish it.
    out->set_interrupted_call(FoldCallName(*v.journal));
    for (int e = 0; e < v.journal->count && e < num_blocks; ++e) {
      const int32_t b = v.journal_blocks[e];
      if (b <= kernels::kNullBlock || b >= num_blocks) continue;
      if (v.journal->kind != kernels::kPendingDiscard) blocks[b].lost = mark;
      empty(b);
    }
    v.journal->state = kernels::kJournalIdle;
  }
  int pending = 0;
  for (int64_t b = 1; b < num_blocks; ++b) {
    bool bad = false;
    for (int l = 0; l < v.num_layers && !bad; ++l) bad = !BadCursor(v, v.cursor(l, b)).empty();
    if (bad) blocks[b].lost = mark;  // its ring cannot be trusted
    // A lost block is re-prefilled: tokens in its ring would fold onto the
    // new state.
    if (blocks[b].lost != 0) {
      empty(b);
      continue;
    }
    bool any = false;
    for (int l = 0; l < v.num_layers; ++l) {
      kernels::FastCursor& c = v.cursor(l, b);
      c.candidates = 0;  // the Verify that wrote them belongs to a step now refused
      any = any || c.tokens != 0;
    }
    pending += any ? 1 : 0;
  }
  out->set_pending_blocks(pending);
}

int CountFastPending(const char* bookkeeping, const HeaderLayout& at, const KeptFast& f,
                     int64_t num_blocks) {
  const FastView v = ViewOf(bookkeeping, at, f);
  int pending = 0;
  for (int64_t b = 1; b < num_blocks; ++b) {
    for (int l = 0; l < v.num_layers; ++l) {
      if (v.cursor(l, b).tokens != 0) {
        ++pending;
        break;
      }
    }
  }
  return pending;
}

void VerifyFast(const char* bookkeeping, const HeaderLayout& at, const KeptFast& f,
                int64_t num_blocks, const kernels::BlockRecord* blocks, std::set<int32_t>* bad,
                v1::RecoverResponse* out) {
  const FastView v = ViewOf(bookkeeping, at, f);
  if (v.journal->state == kernels::kJournalStarted) {
    out->add_problems(absl::StrCat("the fold journal says a ", FoldCallName(*v.journal),
                                   " started and has not finished (nothing runs now: it was "
                                   "interrupted)"));
  }
  for (int64_t b = 0; b < num_blocks; ++b) {
    bool tokens = false;
    for (int l = 0; l < v.num_layers; ++l) {
      const kernels::FastCursor& c = v.cursor(l, b);
      tokens = tokens || c.tokens != 0;
      if (const std::string why = BadCursor(v, c); !why.empty() || (b == 0 && c.tokens != 0)) {
        bad->insert(static_cast<int32_t>(b));
        out->add_problems(absl::StrCat("block ", b, "'s ring in layer ", l,
                                       " has a cursor no call leaves: ",
                                       why.empty() ? "the null block's ring holds tokens" : why));
      }
    }
    if (b > 0 && tokens && blocks[b].lost != 0) {
      bad->insert(static_cast<int32_t>(b));
      out->add_problems(absl::StrCat("block ", b, " is marked lost and its ring still holds tokens "
                                     "(they would fold onto its re-prefilled state)"));
    }
  }
  out->set_pending_blocks(CountFastPending(bookkeeping, at, f, num_blocks));
}

}  // namespace kept_internal
}  // namespace server
}  // namespace specstate
