// Turning a request's tensors into kernel arguments, on the host and before
// anything changes: index tensors (inline or in a region) with their shape
// rules, a Verify's activations by layer kind, the aliasing rule between a
// call's outputs and everything else it names, the pins that keep its
// regions mapped, and the fingerprint that recognizes a retry.
//
// Every function here only reads the request and the registry (through a
// RegionLookup, which pins what it finds); errors are INVALID_ARGUMENT or
// OUT_OF_RANGE and name the field and the bound. Nothing needs a device:
// request_tensors_test runs them against host memory.
//
//   RegionLookup lookup(regions, session);
//   absl::StatusOr<CommitIndices> indices = ResolveCommitIndices(lookup, request, layout);
//   if (!indices.ok()) return indices.status();
//   auto pins = UniquePins(lookup.TakePins());  // held by the work until it is done
#ifndef SPECSTATE_SERVER_ENGINE_REQUEST_TENSORS_H_
#define SPECSTATE_SERVER_ENGINE_REQUEST_TENSORS_H_

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/kda_args.h"
#include "server/device/device.h"
#include "server/base/fnv1a.h"
#include "server/engine/regions.h"
#include "specstate/v1/specstate.pb.h"

namespace specstate {
namespace server {

// An int32 index tensor from a region (device memory) or inline (uploaded
// in stream order when the work is enqueued).
struct IndexInput {
  bool present = false;
  const int32_t* data = nullptr;  // region
  std::vector<int32_t> values;    // inline
  int64_t rows = 0;
  int64_t cols = 1;
  int64_t row_stride = 1;
  ByteSpan span;  // region only

  // Where the kernels read it: the region's memory, or the inline values
  // uploaded to the work's scratch (only while the work is being launched).
  absl::StatusOr<const int32_t*> Pointer(Scratch& scratch) const;
  kernels::IndexMatrix Matrix(const int32_t* pointer) const {
    return kernels::IndexMatrix{pointer, row_stride, static_cast<int>(cols)};
  }
};

// Where the kernels read each present index tensor: `*pointer` is set for
// every present `input` (inline ones are uploaded to the work's scratch);
// absent ones leave theirs as they are.
struct IndexArg {
  const IndexInput* input;
  const int32_t** pointer;
};
absl::Status PointIndices(Scratch& scratch, std::initializer_list<IndexArg> args);

// Shape rules: `rows` (-1: any), and 1-D unless `allow_2d` ([rows, cols],
// column stride 1, any row stride). Dense 1-D unless `strided_1d` (a column
// slice [rows] with a row stride, like block_table[:, 0]).
struct IndexSpec {
  int64_t rows = -1;
  bool allow_2d = false;
  bool strided_1d = false;
  int64_t cols = -1;  // for 2-D: -1 any
};

// An absent tensor gives `present = false` (see RequireIndex).
absl::StatusOr<IndexInput> ResolveIndex(RegionLookup& regions, const v1::IndexTensor& tensor,
                                        absl::string_view field, const IndexSpec& spec);
// INVALID_ARGUMENT "<field> is required" when `input` is absent.
absl::Status RequireIndex(const IndexInput& input, absl::string_view field);

// Stands in for an inline tensor's device address while the host checks a
// call (never dereferenced).
const int32_t* HostCheckPlaceholder();

// A call's tensors by field, for the aliasing check.
using NamedSpans = std::vector<std::pair<std::string, ByteSpan>>;

// INVALID_ARGUMENT when output `field` shares a byte with any of `others`
// (inputs, doorbells, other outputs): the kernels would read what they
// write, or ring a doorbell by writing an output.
absl::Status CheckNoAlias(absl::string_view field, const ByteSpan& out, const NamedSpans& others);

// One pin per region per call (ListRegions' in_use counts calls), shared by
// the call's work and its completion.
std::shared_ptr<std::vector<RegionPin>> UniquePins(std::vector<RegionPin> pins);

// What identifies a Commit / RecordStateBlocks retry: every argument but the
// ordering (a retry may wait on another doorbell value).
template <typename Request>
uint64_t Fingerprint(Request request) {
  request.clear_ordering();
  request.clear_wait();
  request.clear_signal();
  std::string bytes;
  request.SerializeToString(&bytes);
  return Fnv1a(bytes);
}

// `status` with `prefix` before its message (OK stays OK).
absl::Status Prefixed(absl::string_view prefix, const absl::Status& status);

// ---------------------------------------------------------------------------
// Verify and BindVerifyInputs.

// A Verify's tensors, from its request or from its layer's binding.
struct VerifyInputs {
  kernels::Activation q, k, v, g, beta;
  void* out = nullptr;
  ByteSpan out_span;
  NamedSpans input_spans;  // q, k, v, g, beta and the index tensors in regions
  int64_t num_tokens = 0;
  IndexInput query_start_loc, state_indices;
  std::vector<RegionPin> pins;  // of every region named, each once
};

// A layer's Verify tensors at their capacity, checked when bound. The
// regions are referred to, not held: a bound Verify pins them, and fails
// once one was unregistered.
struct BoundInputs {
  std::string session;
  kernels::Activation q, k, v, g, beta;
  void* out = nullptr;
  int64_t max_tokens = 0;
  int max_rows = -1;  // -1: no query_start_loc / state_indices
  const int32_t* query_start_loc = nullptr;
  const int32_t* state_indices = nullptr;
  int64_t state_indices_row_stride = 1;
  int64_t state_indices_cols = 1;
  ByteSpan out_span;
  NamedSpans input_spans;
  struct Held {
    std::weak_ptr<Region> region;
    std::string name;
  };
  std::vector<Held> regions;  // distinct
};

// A Verify's tensors named in the request: q, k [T, H, K] and v [T, HV, V]
// with dense tokens, o [T, HV, V] and g (KDA [T, H, K], GDN [T, HV]) dense,
// beta [T, HV], T being q's first dimension; query_start_loc [num_rows + 1]
// and state_indices [num_rows] or [num_rows, C], both or neither. (The
// caller checks o against input_spans and its doorbells.)
absl::StatusOr<VerifyInputs> ResolveVerifyInputs(RegionLookup& lookup,
                                                 const v1::VerifyRequest& request,
                                                 const kernels::KdaShape& shape, int num_rows);

// A binding of the same tensors at their capacity; the index tensors, if
// given, must be in a region. At most `max_rows` rows are used.
absl::StatusOr<std::shared_ptr<BoundInputs>> ResolveBinding(
    RegionLookup& lookup, const v1::BindVerifyInputsRequest& request,
    const kernels::KdaShape& shape, int max_rows, const std::string& session);

// A bound Verify's tensors: `request` names none itself, `bound` is the
// session's binding of the layer (or null), its regions still registered
// (each pinned), num_tokens and `num_rows` within its capacity.
absl::StatusOr<VerifyInputs> InputsFromBinding(const BoundInputs* bound,
                                               const v1::VerifyRequest& request,
                                               const std::string& session, int num_rows);

// ---------------------------------------------------------------------------
// Commit and RecordStateBlocks.

struct CommitIndices {
  IndexInput num_accepted;  // [batch]
  IndexInput request_indices;
  IndexInput block_table;          // ALIGN: [batch, C]
  IndexInput num_computed_tokens;  // ALIGN: [batch]
  int64_t batch() const { return num_accepted.rows; }
};

// num_accepted (required, at most max_rows rows), request_indices, and in
// ALIGN mode (only there) block_table and num_computed_tokens.
absl::StatusOr<CommitIndices> ResolveCommitIndices(RegionLookup& lookup,
                                                   const v1::CommitRequest& request,
                                                   const v1::Layout& layout);

struct RecordIndices {
  IndexInput idx_mapping;  // [batch]
  IndexInput num_sampled, num_computed_tokens;  // [batch]
  IndexInput request_indices;
  TensorView state_idx, num_accepted;  // outputs [num_requests]
  int64_t batch() const { return idx_mapping.rows; }
};

// idx_mapping, num_sampled, num_computed_tokens (required), request_indices,
// block_table_width >= 1, and the outputs state_idx and num_accepted (at most
// max_rows requests).
absl::StatusOr<RecordIndices> ResolveRecordIndices(RegionLookup& lookup,
                                                   const v1::RecordStateBlocksRequest& request,
                                                   const v1::Layout& layout);
// The outputs alias no input, none of `doorbells` and not each other.
absl::Status CheckRecordOutputsAlias(const RecordIndices& indices, const NamedSpans& doorbells);

// A batch's rows against its step's: with request_indices, exactly one per
// step row; without, the batch (`batch_field`'s rows) covers every step row.
absl::Status CheckBatchCoversStep(const IndexInput& request_indices, int64_t batch,
                                  absl::string_view batch_field, int step_rows);

// ---------------------------------------------------------------------------
// LoadLayerParams.

// A float parameter, inline (checked finite here) or in a region (checked
// finite by the kernel that copies it).
struct FloatSource {
  std::vector<float> values;
  const float* region = nullptr;
  // Where the kernel reads it (inline values go through the scratch).
  absl::StatusOr<const float*> Pointer(Scratch& scratch) const;
};

absl::StatusOr<FloatSource> ResolveFloatParam(RegionLookup& lookup, const v1::FloatTensor& tensor,
                                              absl::string_view field, int64_t count);

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_ENGINE_REQUEST_TENSORS_H_
