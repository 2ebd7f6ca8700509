// The layout-level rules of each commit mode (EAGER, DEFERRED, FAST): its
// bounds on a layout, the token scratch it sizes, what it keeps across a
// restart, and its names. Stateless; CommitModeOf() is the one place that
// picks a mode's rules by the layout, and everything else asks them.
//
//   const CommitModeRules& mode = CommitModeOf(layout);
//   if (absl::Status s = mode.Validate(layout); !s.ok()) return s;
//   ModeScratchSizes scratch = mode.ScratchSizes(layout, ShapeOf(layout));
//
// The engine side of a mode (its device memory and kernel arguments) is in
// mode_engine.h; the kernels of each mode in kernels/<mode>/.
#ifndef SPECSTATE_SERVER_MODES_RULES_H_
#define SPECSTATE_SERVER_MODES_RULES_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/kda_args.h"
#include "specstate/v1/specstate.pb.h"

namespace specstate {
namespace server {

// The token scratch and bookkeeping a mode keeps beside the pools, in bytes
// (each part 256-byte aligned).
struct ModeScratchSizes {
  // Every layer's token scratch: the records (EAGER), both records buffers
  // (DEFERRED), or the rings (FAST, which keeps no records).
  int64_t record_bytes = 0;
  int64_t records_per_layer_bytes = 0;  // one records buffer of one layer (0 under FAST)
  // What the mode keeps beside: DEFERRED's bookkeeping and replay lists (and
  // the layer table of its replays into a read's copy), FAST's Verify owner
  // table, and in every mode a Flush's block list and a read's copy
  // (ReadCopyBytes).
  int64_t mode_bytes = 0;
  // FAST: R = fold_every * Q ring tokens per block, and one layer's rings
  // (k, u, log-decay, cursors).
  int fast_ring_capacity = 0;
  int64_t fast_ring_k_bytes = 0;
  int64_t fast_ring_u_bytes = 0;
  int64_t fast_ring_log_decay_bytes = 0;
  int64_t fast_cursor_bytes = 0;
};

// The copy a read materializes into (ModeEngine::MaterializeCopy), in every
// mode: two blocks of a layer's state pool (block 1 the copy, block 0 unused
// as a pool's), 256-byte aligned.
int64_t ReadCopyBytes(const kernels::KdaShape& shape);

class CommitModeRules {
 public:
  virtual ~CommitModeRules() = default;

  virtual v1::CommitMode id() const = 0;
  // As the flags spell it: "eager", "deferred", "fast".
  virtual absl::string_view flag_name() const = 0;
  // What holds a step's tokens until they are applied: "records" or "rings".
  virtual absl::string_view scratch_name() const { return "records"; }
  // What a block's bookkeeping holds in this mode, in words (specstatectl plan).
  virtual std::string BookkeepingContents(const v1::Layout& layout) const = 0;

  // The mode's own bounds on `layout` (INVALID_ARGUMENT naming the field and
  // the bound), after the shared fields were checked.
  virtual absl::Status Validate(const v1::Layout& layout) const = 0;
  // FAST: steps between two folds of a block's ring (the layout's, or the
  // default where it is 0); 0 in the other modes.
  virtual int FoldEvery(const v1::Layout& layout) const { return 0; }
  virtual ModeScratchSizes ScratchSizes(const v1::Layout& layout,
                                        const kernels::KdaShape& shape) const = 0;
  // Whether a Flush or the end of a driving session has work to do (the mode
  // keeps tokens not yet applied to the pools).
  virtual bool KeepsUnappliedTokens() const = 0;

  // Kept pools (server/kept/): OK where the mode's state can outlive the
  // process with the pools, FAILED_PRECONDITION saying why otherwise.
  virtual absl::Status CheckKeepsPools() const { return absl::OkStatus(); }
  // Whether the kept allocation holds the mode's records and pending table
  // (DEFERRED), so that the engine allocates none.
  virtual bool RecordsInKeptAllocation() const { return false; }
  // Whether the kept allocation holds the mode's rings, cursors and fold
  // journal (FAST), so that the engine allocates none.
  virtual bool KeepsRings() const { return false; }
  // Whether the kept allocation holds the mode's token scratch (records or
  // rings: ModeScratchSizes::record_bytes).
  bool TokenScratchInKeptAllocation() const { return RecordsInKeptAllocation() || KeepsRings(); }
  // What LayoutIdentity adds for the mode: the fields that give its kept
  // parts their meaning ("" where it keeps none).
  virtual std::string IdentitySuffix(const v1::Layout& layout) const { return ""; }
};

// The rules of `layout`'s commit mode (EAGER for COMMIT_MODE_UNSPECIFIED).
// An unknown mode gets EAGER's: ValidateCommitMode refuses it first.
const CommitModeRules& CommitModeOf(const v1::Layout& layout);
const CommitModeRules& CommitModeOf(v1::CommitMode mode);
// INVALID_ARGUMENT for a value that names no mode.
absl::Status ValidateCommitMode(v1::CommitMode mode);
// "eager" / "deferred" / "fast" (INVALID_ARGUMENT naming `field` otherwise).
absl::StatusOr<v1::CommitMode> ParseCommitMode(absl::string_view name, absl::string_view field);

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_MODES_RULES_H_
