// The kernel interface's arguments (kernels/kda_args.h) as kernels/fast's:
// what both backends of KdaKernels (cpu/interface_cpu.cc,
// cuda/interface_*.cuh) hand to their FAST work once their device checks are
// enqueued. Host code only.
#ifndef SPECSTATE_KERNELS_FAST_FROM_INTERFACE_H_
#define SPECSTATE_KERNELS_FAST_FROM_INTERFACE_H_

#include <vector>

#include "kernels/checks/verify_rows.h"
#include "kernels/fast/fast_args.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace fast {

// Each layer of a commit or flush as kernels/fast takes it.
inline std::vector<FastLayer> FastLayersOf(const CommitLayer* layers, int num_layers) {
  std::vector<FastLayer> out(num_layers);
  for (int l = 0; l < num_layers; ++l) {
    out[l] = FastLayer{layers[l].state, layers[l].fast, layers[l].params};
  }
  return out;
}

// A Verify's FAST arguments: its rows from the snapshot the checks validated
// (never the caller's indices again).
inline FastVerifyArgs FastVerifyArgsOf(const VerifyArgs& a) {
  FastVerifyArgs f;
  f.shape = a.shape;
  f.q = a.q;
  f.k = a.k;
  f.v = a.v;
  f.g = a.g;
  f.beta = a.beta;
  f.num_tokens = a.num_tokens;
  f.out = a.out;
  f.state = a.state;
  f.rings = a.fast;
  f.params = a.params;
  f.spec_query_len = a.records.q;
  f.num_rows = a.num_rows;
  f.query_start_loc = internal::VerifiedQueryStartLoc(a);
  f.state_indices = internal::VerifiedStateIndices(a);
  f.rows_before_checks =
      a.expected_query_start_loc != nullptr && a.expected_state_indices != nullptr;
  return f;
}

// A Commit's FAST arguments over `layers` (FastLayersOf(a.layers, ...)).
inline FastCommitArgs FastCommitArgsOf(const CommitArgs& a, const FastLayer* layers) {
  FastCommitArgs f;
  f.shape = a.shape;
  f.spec_query_len = a.spec_query_len;
  f.num_layers = a.num_layers;
  f.layers = layers;
  f.num_rows = a.num_rows;
  f.query_start_loc = a.query_start_loc;
  f.state_indices = a.state_indices;
  f.batch = a.batch;
  f.num_accepted = a.num_accepted;
  f.request_indices = a.request_indices;
  f.block_table = a.block_table;
  f.num_computed_tokens = a.num_computed_tokens;
  f.mamba_block_size = a.mamba_block_size;
  return f;
}

}  // namespace fast
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_FAST_FROM_INTERFACE_H_
