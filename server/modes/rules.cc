#include "server/modes/rules.h"

#include "absl/strings/str_cat.h"
#include "kernels/fast/fast_args.h"
#include "kernels/kda_kernels.h"

namespace specstate {
namespace server {
namespace {

int64_t Align256(int64_t bytes) { return (bytes + 255) / 256 * 256; }

absl::Status Bad(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("layout.", field, " ", what));
}

// One layer's records: kv [tokens, H K + HV V], g [tokens, gate width],
// beta [tokens, HV], tokens = max_rows * Q.
int64_t RecordsPerLayerBytes(const v1::Layout& l, const kernels::KdaShape& shape) {
  const int64_t act = DTypeSize(shape.act_dtype);
  const int64_t tokens = int64_t{l.max_rows()} * (l.num_spec() + 1);
  return Align256(tokens * kernels::RecordTokenWidth(shape) * act) +
         Align256(tokens * kernels::GateWidth(shape) * act) +
         Align256(tokens * kernels::ValueHeads(shape) * act);
}

absl::Status NoFoldEvery(const v1::Layout& l) {
  if (l.fold_every() == 0) return absl::OkStatus();
  return Bad("fold_every", absl::StrCat("= ", l.fold_every(),
                                        " is for commit_mode FAST only (0 in the other modes)"));
}

// EAGER: every Commit replays its accepted tokens into the pools at once.
class EagerRules final : public CommitModeRules {
 public:
  v1::CommitMode id() const override { return v1::EAGER; }
  absl::string_view flag_name() const override { return "eager"; }
  std::string BookkeepingContents(const v1::Layout&) const override {
    return "Commit's owner word, a Flush's list";
  }
  absl::Status Validate(const v1::Layout& l) const override { return NoFoldEvery(l); }
  ModeScratchSizes ScratchSizes(const v1::Layout& l,
                                const kernels::KdaShape& shape) const override {
    ModeScratchSizes s;
    s.records_per_layer_bytes = RecordsPerLayerBytes(l, shape);
    s.record_bytes = s.records_per_layer_bytes * l.num_layers();
    // A Flush's block list, copied to be checked (modes/eager.cc), and a
    // read's copy.
    s.mode_bytes = Align256(int64_t{l.num_blocks()} * 4) + ReadCopyBytes(shape);
    return s;
  }
  bool KeepsUnappliedTokens() const override { return false; }
};

// DEFERRED: a Commit plans; a block's accepted tokens are replayed by its
// next Verify (or a Flush).
class DeferredRules final : public CommitModeRules {
 public:
  v1::CommitMode id() const override { return v1::DEFERRED; }
  absl::string_view flag_name() const override { return "deferred"; }
  std::string BookkeepingContents(const v1::Layout&) const override {
    return "pending entries, owner words, a Flush's list";
  }
  absl::Status Validate(const v1::Layout& l) const override {
    if (absl::Status window = kernels::ValidateDeferredWindow(l.num_spec() + 1); !window.ok()) {
      return Bad("commit_mode", absl::StrCat("DEFERRED with num_spec = ", l.num_spec(), ": ",
                                             window.message()));
    }
    return NoFoldEvery(l);
  }
  ModeScratchSizes ScratchSizes(const v1::Layout& l,
                                const kernels::KdaShape& shape) const override {
    ModeScratchSizes s;
    // Double-buffered: a step's records live until its blocks' next Verify.
    s.records_per_layer_bytes = RecordsPerLayerBytes(l, shape);
    s.record_bytes = s.records_per_layer_bytes * l.num_layers() * 2;
    s.mode_bytes =
        int64_t(kernels::PendingEntriesBytes(l.num_layers(), l.num_blocks())) +
        int64_t(kernels::PendingHeaderBytes(l.max_rows())) +
        int64_t(kernels::VerifyWorkspaceBytes(l.num_blocks())) +
        Align256(int64_t{l.num_layers()} * l.max_rows() * 4) +  // each layer's replay plan
        int64_t(kernels::CommitJobsCapacity(l.max_rows(), l.num_layers()) +
                kernels::FlushJobsCapacity(l.max_rows(), l.num_layers())) *
            int64_t{sizeof(kernels::ReplayJob)} +
        Align256(int64_t{l.num_blocks()} * 4) + 512 +  // a Flush's checked blocks, counts
        ReadCopyBytes(shape) +  // a read's copy and the layer table of its replay
        Align256(int64_t{l.num_layers()} * int64_t{sizeof(kernels::CommitLayer)});
    return s;
  }
  bool KeepsUnappliedTokens() const override { return true; }
  bool RecordsInKeptAllocation() const override { return true; }
  // Its records and pending tokens are kept: the mode and the records' rows
  // give them their meaning. (EAGER adds nothing, so its fingerprints stay
  // those of pools made before DEFERRED could be kept.)
  std::string IdentitySuffix(const v1::Layout& l) const override {
    return absl::StrCat(" commit_mode=DEFERRED max_rows=", l.max_rows());
  }
};

// FAST: a Verify reads the checkpoint and the block's ring; a Commit moves
// cursors; a block's ring is folded into its state every fold_every steps.
class FastRules final : public CommitModeRules {
 public:
  v1::CommitMode id() const override { return v1::FAST; }
  absl::string_view flag_name() const override { return "fast"; }
  absl::string_view scratch_name() const override { return "rings"; }
  std::string BookkeepingContents(const v1::Layout& l) const override {
    return absl::StrCat("FAST's rings (", FoldEvery(l) * (l.num_spec() + 1),
                        " tokens a layer), cursors, owner words");
  }
  absl::Status Validate(const v1::Layout& l) const override {
    const int q = l.num_spec() + 1;
    if (q > kernels::kMaxFastQueryLen) {
      return Bad("commit_mode", absl::StrCat("FAST with num_spec = ", l.num_spec(),
                                             ": FAST verifies at most ", kernels::kMaxFastQueryLen,
                                             " tokens a row (num_spec <= ",
                                             kernels::kMaxFastQueryLen - 1, ")"));
    }
    const int max_fold_every = kernels::fast::kMaxFastRingCapacity / q;
    if (l.fold_every() < 0 || l.fold_every() > max_fold_every) {
      return Bad("fold_every",
                 absl::StrCat("= ", l.fold_every(), " must be in [1, ", max_fold_every,
                              "] (0: ", kernels::fast::kDefaultFoldEvery,
                              "): the rings hold fold_every * Q tokens a block, at most ",
                              kernels::fast::kMaxFastRingCapacity, " (Q = ", q, ")"));
    }
    return absl::OkStatus();
  }
  int FoldEvery(const v1::Layout& l) const override {
    return l.fold_every() > 0 ? l.fold_every() : kernels::fast::kDefaultFoldEvery;
  }
  ModeScratchSizes ScratchSizes(const v1::Layout& l,
                                const kernels::KdaShape& shape) const override {
    namespace fast = kernels::fast;
    ModeScratchSizes s;
    s.fast_ring_capacity = fast::FastRingCapacity(FoldEvery(l), l.num_spec() + 1);
    s.fast_ring_k_bytes =
        Align256(int64_t(fast::FastRingKBytes(shape, l.num_blocks(), s.fast_ring_capacity)));
    s.fast_ring_u_bytes =
        Align256(int64_t(fast::FastRingUBytes(shape, l.num_blocks(), s.fast_ring_capacity)));
    s.fast_ring_log_decay_bytes = Align256(
        int64_t(fast::FastRingLogDecayBytes(shape, l.num_blocks(), s.fast_ring_capacity)));
    s.fast_cursor_bytes = Align256(int64_t(fast::FastCursorBytes(l.num_blocks())));
    s.record_bytes = (s.fast_ring_k_bytes + s.fast_ring_u_bytes + s.fast_ring_log_decay_bytes +
                      s.fast_cursor_bytes) *
                     l.num_layers();
    s.mode_bytes = int64_t(kernels::VerifyWorkspaceBytes(l.num_blocks())) +
                   Align256(int64_t{l.num_blocks()} * 4) + 512 +  // a Flush's checked blocks, status
                   ReadCopyBytes(shape);                          // a read's copy
    return s;
  }
  bool KeepsUnappliedTokens() const override { return true; }
  // Its rings, cursors and fold journal are kept with the pools: the mode,
  // fold_every and Q (in num_spec) give them their meaning.
  bool KeepsRings() const override { return true; }
  std::string IdentitySuffix(const v1::Layout& l) const override {
    return absl::StrCat(" commit_mode=FAST fold_every=", FoldEvery(l));
  }
};

}  // namespace

int64_t ReadCopyBytes(const kernels::KdaShape& shape) {
  return Align256(2 * kernels::ValueWidth(shape) * shape.head_dim *
                  int64_t(DTypeSize(shape.state_dtype)));
}

const CommitModeRules& CommitModeOf(v1::CommitMode mode) {
  static const EagerRules eager;
  static const DeferredRules deferred;
  static const FastRules fast;
  switch (mode) {
    case v1::DEFERRED:
      return deferred;
    case v1::FAST:
      return fast;
    default:
      return eager;
  }
}

const CommitModeRules& CommitModeOf(const v1::Layout& layout) {
  return CommitModeOf(layout.commit_mode());
}

absl::Status ValidateCommitMode(v1::CommitMode mode) {
  if (mode == v1::COMMIT_MODE_UNSPECIFIED || CommitModeOf(mode).id() == mode) {
    return absl::OkStatus();
  }
  return Bad("commit_mode", "must be EAGER, DEFERRED or FAST");
}

absl::StatusOr<v1::CommitMode> ParseCommitMode(absl::string_view name, absl::string_view field) {
  for (v1::CommitMode mode : {v1::EAGER, v1::DEFERRED, v1::FAST}) {
    if (CommitModeOf(mode).flag_name() == name) return mode;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, "=", name, ": expected eager, deferred or fast"));
}

}  // namespace server
}  // namespace specstate
