// A decode loop that runs FAST, the exact path (the CPU kernels' EAGER
// Verify + Commit) and the float64 reference side by side on the same inputs,
// and measures both paths' errors against the reference at every step.
// Shared by fast_accuracy_test (the accuracy contract) and fast_error_curves
// (the tables of docs/semantics.md).
//
//   LoopConfig c;
//   c.shape = ...; c.q = 4; c.fold_every = 8; c.steps = 1000; c.seed = 7;
//   LoopResult r = RunLoop(c);
//   // r.steps[i].fast.out_elem, r.steps[i].exact.state_norm, r.folds, ...
#ifndef SPECSTATE_KERNELS_FAST_TESTING_FAST_LOOP_H_
#define SPECSTATE_KERNELS_FAST_TESTING_FAST_LOOP_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/fast/contract_errors.h"
#include "kernels/fast/fast_kernels.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace fast {
namespace testing {

// The gate inputs a loop draws.
enum class GateInputs {
  kRandom,  // KDA: g ~ N(0, 1); GDN: g ~ -U(0, 1)
  kLowest,  // every token at the strongest decay: KDA's safe gate at its lower
            // bound (gamma = lower_bound), GDN's g = lower_bound
};

struct LoopConfig {
  KdaShape shape;  // dtypes, kind, gate, H, K, HV
  int q = 4;       // Q: window tokens at most
  int fold_every = 8;
  int rows = 3;
  int steps = 1000;
  uint64_t seed = 1;
  GateInputs gates = GateInputs::kRandom;
  FastNumerics numerics;   // FAST's operand precisions (the default: fp32)
  bool run_exact = true;   // also run the exact path (costs as much as FAST)
  bool check_states_every_step = true;  // else only at folds and at the end
};

// One path's errors against the reference: max|got - want| / max|want| and
// ||got - want|| / ||want|| of the step's outputs (every row's tokens) and
// states (every row's block after the Commit).
struct Errors {
  double out_elem = 0.0, out_norm = 0.0, state_elem = 0.0, state_norm = 0.0;
};

struct StepResult {
  Errors fast, exact;
  int folds = 0;          // folds so far, all rows
  bool states = false;    // whether the state errors were measured this step
  int ring_tokens = 0;    // row 0's ring after the Commit
};

struct LoopResult {
  std::vector<StepResult> steps;
  int folds = 0;
  int committed_tokens = 0;
  int rejected_tokens = 0;
  bool finite = true;  // no NaN or Inf in any FAST output or state
};

// Errors of `got` against `want` (contract_errors.h).
using ::specstate::kernels::fast::ElementwiseError;
using ::specstate::kernels::fast::NormError;

// Runs the loop; an error status when a kernel refused a call (a bug).
absl::StatusOr<LoopResult> RunLoop(const LoopConfig& config);

// A short description ("KDA safe, fp32 state, F=8, Q=4, H=2 K=64").
std::string Describe(const LoopConfig& config);

}  // namespace testing
}  // namespace fast
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_FAST_TESTING_FAST_LOOP_H_
