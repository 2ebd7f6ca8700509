// Commit mode EAGER's host checks (eager_checks.h).
#include "kernels/eager/eager_checks.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/checks/host.h"

namespace specstate {
namespace kernels {
namespace eager {
namespace {

// Another mode's bookkeeping in an EAGER call: the caller meant that mode.
absl::Status CheckNoOtherMode(absl::string_view op, const PendingBlocks& pending, bool fast) {
  if (pending.entries != nullptr) {
    return host::Invalid(op,
                         "pending is set but mode is EAGER: set mode to DEFERRED (the "
                         "pending table is commit mode DEFERRED's)");
  }
  if (fast) {
    return host::Invalid(op,
                         "fast is set but mode is EAGER: set mode to FAST (the rings are "
                         "commit mode FAST's)");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateVerify(const VerifyArgs& a) {
  constexpr absl::string_view op = "Verify";
  absl::Status st = CheckNoOtherMode(op, a.pending, a.fast.cursors != nullptr);
  if (st.ok()) st = host::CheckRecordBuffers(op, a.records, "");
  return st;
}

absl::Status ValidateCommit(const CommitArgs& a) {
  constexpr absl::string_view op = "Commit";
  absl::Status st = CheckNoOtherMode(op, a.pending, /*fast=*/false);
  for (int l = 0; st.ok() && l < a.num_layers; ++l) {
    st = host::CheckRecordBuffers(op, a.layers[l].records, absl::StrCat("layer ", l, ": "));
  }
  return st;
}

absl::Status ValidateFlush(const FlushArgs&) {
  return host::Invalid("Flush",
                       "commit mode EAGER leaves nothing pending to flush (mode is "
                       "DEFERRED or FAST)");
}

}  // namespace eager
}  // namespace kernels
}  // namespace specstate
