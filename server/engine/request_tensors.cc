#include "server/engine/request_tensors.h"

#include <algorithm>
#include <cmath>
#include <tuple>

#include "absl/strings/str_cat.h"

namespace specstate {
namespace server {

absl::StatusOr<const int32_t*> IndexInput::Pointer(Scratch& scratch) const {
  if (data != nullptr) return data;
  absl::StatusOr<void*> p = scratch.Upload(values.data(), values.size() * sizeof(int32_t));
  if (!p.ok()) return p.status();
  return static_cast<const int32_t*>(*p);
}

absl::Status PointIndices(Scratch& scratch, std::initializer_list<IndexArg> args) {
  for (const IndexArg& arg : args) {
    if (!arg.input->present) continue;
    absl::StatusOr<const int32_t*> p = arg.input->Pointer(scratch);
    if (!p.ok()) return p.status();
    *arg.pointer = *p;
  }
  return absl::OkStatus();
}

namespace {

absl::Status ResolveInlineIndex(const v1::IndexTensor& t, absl::string_view field,
                                const IndexSpec& spec, IndexInput& in) {
  std::vector<int64_t> shape(t.values().shape().begin(), t.values().shape().end());
  if (shape.empty()) shape.push_back(t.values().values_size());
  if (shape.size() > 2 || (shape.size() == 2 && !spec.allow_2d)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": inline values have rank ",
                                                   shape.size(), ", expected ",
                                                   spec.allow_2d ? "1 or 2" : "1"));
  }
  int64_t count = 1;
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat(field, ": negative dimension"));
    count *= d;
  }
  if (count != t.values().values_size()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": shape holds ", count,
                                                   " values but ", t.values().values_size(),
                                                   " are given"));
  }
  in.values.assign(t.values().values().begin(), t.values().values().end());
  in.rows = shape[0];
  in.cols = shape.size() == 2 ? shape[1] : 1;
  in.row_stride = in.cols;
  return absl::OkStatus();
}

absl::Status ResolveRegionIndex(RegionLookup& regions, const v1::IndexTensor& t,
                                absl::string_view field, const IndexSpec& spec, IndexInput& in) {
  const int rank = t.region().shape_size();
  if (rank != 1 && !(rank == 2 && spec.allow_2d)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": rank ", rank, ", expected ", spec.allow_2d ? "1 or 2" : "1"));
  }
  TensorSpec ts;
  ts.dtype = DType::kInt32;
  ts.shape.assign(rank, -1);
  ts.dense_inner = rank == 2 ? 1 : (spec.strided_1d ? 0 : 1);
  absl::StatusOr<TensorView> view = regions.ResolveTensor(t.region(), field, ts);
  if (!view.ok()) return view.status();
  in.data = static_cast<const int32_t*>(view->data);
  in.span = view->span;
  in.rows = view->shape[0];
  in.cols = rank == 2 ? view->shape[1] : 1;
  in.row_stride = view->strides[0];
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<IndexInput> ResolveIndex(RegionLookup& regions, const v1::IndexTensor& t,
                                        absl::string_view field, const IndexSpec& spec) {
  IndexInput in;
  if (t.source_case() == v1::IndexTensor::SOURCE_NOT_SET) return in;
  in.present = true;
  absl::Status st = t.has_values() ? ResolveInlineIndex(t, field, spec, in)
                                   : ResolveRegionIndex(regions, t, field, spec, in);
  if (!st.ok()) return st;
  if (spec.rows >= 0 && in.rows != spec.rows) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": has ", in.rows, " rows, expected ", spec.rows));
  }
  if (spec.cols >= 0 && in.cols != spec.cols) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": has ", in.cols, " columns, expected ", spec.cols));
  }
  if (in.rows > 0 && in.cols < 1) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": has no columns"));
  }
  return in;
}

absl::Status RequireIndex(const IndexInput& in, absl::string_view field) {
  if (in.present) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, " is required"));
}

const int32_t* HostCheckPlaceholder() {
  static const int32_t placeholder[1] = {0};
  return placeholder;
}

absl::Status CheckNoAlias(absl::string_view field, const ByteSpan& out, const NamedSpans& others) {
  for (const auto& [name, span] : others) {
    if (Overlap(out, span)) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " overlaps ", name, " (the same memory): an output must not alias the call's "
                                    "inputs, doorbells or other outputs"));
    }
  }
  return absl::OkStatus();
}

std::shared_ptr<std::vector<RegionPin>> UniquePins(std::vector<RegionPin> pins) {
  std::sort(pins.begin(), pins.end());
  pins.erase(std::unique(pins.begin(), pins.end()), pins.end());
  if (!pins.empty() && pins.front() == nullptr) pins.erase(pins.begin());
  return std::make_shared<std::vector<RegionPin>>(std::move(pins));
}

absl::Status Prefixed(absl::string_view prefix, const absl::Status& s) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(prefix, s.message()));
}

// ---------------------------------------------------------------------------
// Verify and BindVerifyInputs.

namespace {

struct ActivationViews {
  TensorView q, k, v, g, beta, o;
};

// The checks a Verify's tensors and a binding's share (ResolveVerifyInputs).
// The lookup holds their regions.
template <typename Request>
absl::StatusOr<ActivationViews> ResolveActivations(RegionLookup& lookup, const Request& req,
                                                   const kernels::KdaShape& shape) {
  ActivationViews out;
  const int hv = kernels::ValueHeads(shape);
  TensorSpec act;
  act.dtype = shape.act_dtype;
  act.shape = {-1, shape.num_heads, shape.head_dim};
  act.dense_inner = 2;
  absl::StatusOr<TensorView> view = lookup.ResolveTensor(req.q(), "q", act);
  if (!view.ok()) return view.status();
  out.q = *std::move(view);
  const int64_t T = out.q.shape[0];
  act.shape[0] = T;
  view = lookup.ResolveTensor(req.k(), "k", act);
  if (!view.ok()) return view.status();
  out.k = *std::move(view);
  TensorSpec value = act;  // v [T, HV, V], o dense
  value.shape = {T, hv, shape.head_dim};
  view = lookup.ResolveTensor(req.v(), "v", value);
  if (!view.ok()) return view.status();
  out.v = *std::move(view);
  value.dense_inner = 3;
  view = lookup.ResolveTensor(req.o(), "o", value);
  if (!view.ok()) return view.status();
  out.o = *std::move(view);
  TensorSpec gate = act;  // KDA [T, H, K], GDN [T, HV]; dense
  if (shape.kind == kernels::LayerKind::kGdn) {
    gate.shape = {T, hv};
    gate.dense_inner = 2;
  } else {
    gate.dense_inner = 3;
  }
  view = lookup.ResolveTensor(req.g(), "g", gate);
  if (!view.ok()) return view.status();
  out.g = *std::move(view);
  TensorSpec beta_spec;
  beta_spec.dtype = shape.act_dtype;
  beta_spec.shape = {T, hv};
  beta_spec.dense_inner = 1;
  view = lookup.ResolveTensor(req.beta(), "beta", beta_spec);
  if (!view.ok()) return view.status();
  out.beta = *std::move(view);
  return out;
}

kernels::Activation ActivationOf(const TensorView& view) {
  return kernels::Activation{view.data, view.strides[0]};
}

NamedSpans InputSpans(const ActivationViews& v, const IndexInput& qsl, const IndexInput& indices) {
  NamedSpans spans = {{"q", v.q.span}, {"k", v.k.span}, {"v", v.v.span}, {"g", v.g.span},
                      {"beta", v.beta.span}};
  if (qsl.data != nullptr) spans.emplace_back("query_start_loc", qsl.span);
  if (indices.data != nullptr) spans.emplace_back("state_indices", indices.span);
  return spans;
}

// query_start_loc [rows + 1] and state_indices [rows] or [rows, C], together.
absl::StatusOr<std::pair<IndexInput, IndexInput>> ResolveRowIndices(
    RegionLookup& lookup, const v1::IndexTensor& query_start_loc,
    const v1::IndexTensor& state_indices, int64_t rows) {
  absl::StatusOr<IndexInput> qsl =
      ResolveIndex(lookup, query_start_loc, "query_start_loc", {rows < 0 ? -1 : rows + 1});
  if (!qsl.ok()) return qsl.status();
  IndexSpec idx_spec;
  idx_spec.rows = rows < 0 ? (qsl->present ? qsl->rows - 1 : -1) : rows;
  idx_spec.allow_2d = true;
  idx_spec.strided_1d = true;
  absl::StatusOr<IndexInput> indices = ResolveIndex(lookup, state_indices, "state_indices", idx_spec);
  if (!indices.ok()) return indices.status();
  if (qsl->present != indices->present) {
    return absl::InvalidArgumentError(
        "give query_start_loc and state_indices together (or omit both after the step's first "
        "Verify)");
  }
  return std::make_pair(*std::move(qsl), *std::move(indices));
}

}  // namespace

absl::StatusOr<VerifyInputs> ResolveVerifyInputs(RegionLookup& lookup, const v1::VerifyRequest& req,
                                                 const kernels::KdaShape& shape, int num_rows) {
  absl::StatusOr<ActivationViews> views = ResolveActivations(lookup, req, shape);
  if (!views.ok()) return views.status();
  if (req.num_tokens() != 0 && req.num_tokens() != views->q.shape[0]) {
    return absl::InvalidArgumentError(absl::StrCat("num_tokens = ", req.num_tokens(),
                                                   " differs from q's first dimension ",
                                                   views->q.shape[0], " (or set it to 0)"));
  }
  absl::StatusOr<std::pair<IndexInput, IndexInput>> indices =
      ResolveRowIndices(lookup, req.query_start_loc(), req.state_indices(), num_rows);
  if (!indices.ok()) return indices.status();
  VerifyInputs in;
  in.q = ActivationOf(views->q);
  in.k = ActivationOf(views->k);
  in.v = ActivationOf(views->v);
  in.g = ActivationOf(views->g);
  in.beta = ActivationOf(views->beta);
  in.out = views->o.data;
  in.out_span = views->o.span;
  in.input_spans = InputSpans(*views, indices->first, indices->second);
  in.num_tokens = views->q.shape[0];
  in.query_start_loc = std::move(indices->first);
  in.state_indices = std::move(indices->second);
  in.pins = lookup.TakePins();
  return in;
}

absl::StatusOr<std::shared_ptr<BoundInputs>> ResolveBinding(
    RegionLookup& lookup, const v1::BindVerifyInputsRequest& req, const kernels::KdaShape& shape,
    int max_rows, const std::string& session) {
  for (auto [index, field] : {std::make_pair(&req.query_start_loc(), "query_start_loc"),
                              std::make_pair(&req.state_indices(), "state_indices")}) {
    if (index->has_values()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": a binding's index tensors must be in a region (inline values cannot change "
                 "between steps)"));
    }
  }
  absl::StatusOr<ActivationViews> views = ResolveActivations(lookup, req, shape);
  if (!views.ok()) return views.status();
  absl::StatusOr<std::pair<IndexInput, IndexInput>> indices =
      ResolveRowIndices(lookup, req.query_start_loc(), req.state_indices(), -1);
  if (!indices.ok()) return indices.status();
  const IndexInput& qsl = indices->first;
  NamedSpans input_spans = InputSpans(*views, qsl, indices->second);
  if (absl::Status alias = CheckNoAlias("o", views->o.span, input_spans); !alias.ok()) {
    return alias;
  }
  if (qsl.present && qsl.rows < 1) {
    return absl::InvalidArgumentError("query_start_loc: has 0 rows, expected max_rows + 1 >= 1");
  }
  auto bound = std::make_shared<BoundInputs>();
  bound->session = session;
  bound->q = ActivationOf(views->q);
  bound->k = ActivationOf(views->k);
  bound->v = ActivationOf(views->v);
  bound->g = ActivationOf(views->g);
  bound->beta = ActivationOf(views->beta);
  bound->out = views->o.data;
  bound->out_span = views->o.span;
  bound->input_spans = std::move(input_spans);
  bound->max_tokens = views->q.shape[0];
  if (qsl.present) {
    bound->max_rows = static_cast<int>(std::min<int64_t>(qsl.rows - 1, max_rows));
    bound->query_start_loc = qsl.data;
    bound->state_indices = indices->second.data;
    bound->state_indices_row_stride = indices->second.row_stride;
    bound->state_indices_cols = indices->second.cols;
  }
  for (const RegionPin& pin : lookup.TakePins()) {
    bound->regions.push_back(BoundInputs::Held{pin, pin->name()});
  }
  return bound;
}

absl::StatusOr<VerifyInputs> InputsFromBinding(const BoundInputs* bound,
                                               const v1::VerifyRequest& req,
                                               const std::string& session, int num_rows) {
  const int layer = req.layer();
  if (req.has_q() || req.has_k() || req.has_v() || req.has_g() || req.has_beta() || req.has_o() ||
      req.has_query_start_loc() || req.has_state_indices()) {
    return absl::InvalidArgumentError(
        "bound_inputs: leave q, k, v, g, beta, o, query_start_loc and state_indices unset (the "
        "layer's binding gives them)");
  }
  if (bound == nullptr || bound->session != session) {
    return absl::FailedPreconditionError(absl::StrCat(
        "bound_inputs: layer ", layer, " has no bound inputs in this session: call "
        "BindVerifyInputs first"));
  }
  if (req.num_tokens() < 0 || req.num_tokens() > bound->max_tokens) {
    return absl::OutOfRangeError(absl::StrCat("num_tokens = ", req.num_tokens(),
                                              " is out of range: layer ", layer,
                                              "'s bound inputs hold ", bound->max_tokens,
                                              " tokens"));
  }
  if (bound->max_rows >= 0 && num_rows > bound->max_rows) {
    return absl::OutOfRangeError(absl::StrCat(
        "num_rows = ", num_rows, " is out of range: layer ", layer,
        "'s bound query_start_loc and state_indices hold ", bound->max_rows, " rows"));
  }
  VerifyInputs in;
  in.pins.reserve(bound->regions.size() + 2);  // and the ordering's doorbells
  for (const BoundInputs::Held& held : bound->regions) {
    RegionPin pin = held.region.lock();
    if (pin == nullptr || !pin->registered()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "bound_inputs: layer ", layer, "'s bound inputs are in region \"", held.name,
          "\", which was unregistered after the bind: call BindVerifyInputs again"));
    }
    in.pins.push_back(std::move(pin));
  }
  in.q = bound->q;
  in.k = bound->k;
  in.v = bound->v;
  in.g = bound->g;
  in.beta = bound->beta;
  in.out = bound->out;
  in.out_span = bound->out_span;
  in.input_spans = bound->input_spans;
  in.num_tokens = req.num_tokens();
  if (bound->max_rows >= 0) {
    in.query_start_loc.present = true;
    in.query_start_loc.data = bound->query_start_loc;
    in.query_start_loc.rows = num_rows + 1;
    in.state_indices.present = true;
    in.state_indices.data = bound->state_indices;
    in.state_indices.rows = num_rows;
    in.state_indices.cols = bound->state_indices_cols;
    in.state_indices.row_stride = bound->state_indices_row_stride;
  }
  return in;
}

// ---------------------------------------------------------------------------
// Commit and RecordStateBlocks.

namespace {

// The required batch tensor: present, at most max_rows rows.
absl::StatusOr<IndexInput> ResolveBatch(RegionLookup& lookup, const v1::IndexTensor& tensor,
                                        absl::string_view field, int max_rows,
                                        absl::string_view bound_note) {
  absl::StatusOr<IndexInput> batch = ResolveIndex(lookup, tensor, field, {});
  if (!batch.ok()) return batch;
  if (absl::Status st = RequireIndex(*batch, field); !st.ok()) return st;
  if (batch->rows > max_rows) {
    return absl::OutOfRangeError(absl::StrCat(field, " has ", batch->rows,
                                              " rows; a batch has at most ", max_rows,
                                              bound_note));
  }
  return batch;
}

absl::Status AlignInputsError(bool align) {
  return absl::InvalidArgumentError(
      align ? "cache_mode ALIGN: block_table and num_computed_tokens are required"
            : "block_table and num_computed_tokens are for cache_mode ALIGN; this service runs "
              "cache_mode NONE");
}

}  // namespace

absl::StatusOr<CommitIndices> ResolveCommitIndices(RegionLookup& lookup,
                                                   const v1::CommitRequest& req,
                                                   const v1::Layout& layout) {
  const bool align = layout.cache_mode() == v1::ALIGN;
  CommitIndices out;
  absl::StatusOr<IndexInput> accepted =
      ResolveBatch(lookup, req.num_accepted(), "num_accepted", layout.max_rows(), " (max_rows)");
  if (!accepted.ok()) return accepted.status();
  out.num_accepted = *std::move(accepted);
  const int64_t batch = out.batch();
  if (align != req.has_block_table() || align != req.has_num_computed_tokens()) {
    return AlignInputsError(align);
  }
  absl::StatusOr<IndexInput> request_indices =
      ResolveIndex(lookup, req.request_indices(), "request_indices", {});
  if (!request_indices.ok()) return request_indices.status();
  out.request_indices = *std::move(request_indices);
  IndexSpec table_spec;
  table_spec.rows = batch;
  table_spec.allow_2d = true;
  absl::StatusOr<IndexInput> block_table =
      ResolveIndex(lookup, req.block_table(), "block_table", table_spec);
  if (!block_table.ok()) return block_table.status();
  out.block_table = *std::move(block_table);
  absl::StatusOr<IndexInput> computed =
      ResolveIndex(lookup, req.num_computed_tokens(), "num_computed_tokens", {batch});
  if (!computed.ok()) return computed.status();
  out.num_computed_tokens = *std::move(computed);
  if (align != out.block_table.present || align != out.num_computed_tokens.present) {
    return AlignInputsError(align);
  }
  if (align && out.block_table.rows > 0 && out.block_table.cols < 1) {
    return absl::InvalidArgumentError("block_table has no columns");
  }
  return out;
}

absl::StatusOr<RecordIndices> ResolveRecordIndices(RegionLookup& lookup,
                                                   const v1::RecordStateBlocksRequest& req,
                                                   const v1::Layout& layout) {
  const int max_rows = layout.max_rows();
  RecordIndices out;
  absl::StatusOr<IndexInput> mapping =
      ResolveBatch(lookup, req.idx_mapping(), "idx_mapping", max_rows, "");
  if (!mapping.ok()) return mapping.status();
  out.idx_mapping = *std::move(mapping);
  const int64_t batch = out.batch();
  for (auto [input, tensor, field] :
       {std::make_tuple(&out.num_sampled, &req.num_sampled(), "num_sampled"),
        std::make_tuple(&out.num_computed_tokens, &req.num_computed_tokens(),
                        "num_computed_tokens")}) {
    absl::StatusOr<IndexInput> resolved = ResolveIndex(lookup, *tensor, field, {batch});
    if (!resolved.ok()) return resolved.status();
    *input = *std::move(resolved);
  }
  absl::StatusOr<IndexInput> request_indices =
      ResolveIndex(lookup, req.request_indices(), "request_indices", {});
  if (!request_indices.ok()) return request_indices.status();
  out.request_indices = *std::move(request_indices);
  if (absl::Status st = RequireIndex(out.num_sampled, "num_sampled"); !st.ok()) return st;
  if (absl::Status st = RequireIndex(out.num_computed_tokens, "num_computed_tokens"); !st.ok()) {
    return st;
  }
  if (req.block_table_width() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_table_width = ", req.block_table_width(), " must be >= 1"));
  }
  TensorSpec out_spec;
  out_spec.dtype = DType::kInt32;
  out_spec.shape = {-1};
  out_spec.dense_inner = 1;
  absl::StatusOr<TensorView> state_idx = lookup.ResolveTensor(req.state_idx(), "state_idx", out_spec);
  if (!state_idx.ok()) return state_idx.status();
  if (state_idx->shape[0] > max_rows) {
    return absl::OutOfRangeError(absl::StrCat("state_idx has ", state_idx->shape[0],
                                              " rows; at most ", max_rows, " requests"));
  }
  out.state_idx = *std::move(state_idx);
  out_spec.shape[0] = out.state_idx.shape[0];
  absl::StatusOr<TensorView> accepted =
      lookup.ResolveTensor(req.num_accepted(), "num_accepted", out_spec);
  if (!accepted.ok()) return accepted.status();
  out.num_accepted = *std::move(accepted);
  return out;
}

absl::Status CheckRecordOutputsAlias(const RecordIndices& in, const NamedSpans& doorbells) {
  NamedSpans others = doorbells;
  for (const auto& [field, input] :
       {std::make_pair("idx_mapping", &in.idx_mapping),
        std::make_pair("num_sampled", &in.num_sampled),
        std::make_pair("num_computed_tokens", &in.num_computed_tokens),
        std::make_pair("request_indices", &in.request_indices)}) {
    if (input->data != nullptr) others.emplace_back(field, input->span);
  }
  absl::Status alias = CheckNoAlias("state_idx", in.state_idx.span, others);
  if (!alias.ok()) return alias;
  others.emplace_back("state_idx", in.state_idx.span);
  return CheckNoAlias("num_accepted", in.num_accepted.span, others);
}

absl::Status CheckBatchCoversStep(const IndexInput& request_indices, int64_t batch,
                                  absl::string_view batch_field, int step_rows) {
  if (request_indices.present && request_indices.rows != step_rows) {
    return absl::InvalidArgumentError(absl::StrCat("request_indices has ", request_indices.rows,
                                                   " rows, the step has ", step_rows));
  }
  if (!request_indices.present && batch < step_rows) {
    return absl::OutOfRangeError(absl::StrCat(batch_field, " has ", batch,
                                              " rows but the step has ", step_rows,
                                              " rows and no request_indices"));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// LoadLayerParams.

absl::StatusOr<const float*> FloatSource::Pointer(Scratch& scratch) const {
  if (region != nullptr) return region;
  absl::StatusOr<void*> up = scratch.Upload(values.data(), values.size() * sizeof(float));
  if (!up.ok()) return up.status();
  return static_cast<const float*>(*up);
}

absl::StatusOr<FloatSource> ResolveFloatParam(RegionLookup& lookup, const v1::FloatTensor& t,
                                              absl::string_view field, int64_t count) {
  FloatSource s;
  if (t.has_values()) {
    if (t.values().values_size() != count) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": ", t.values().values_size(), " values, expected ", count));
    }
    s.values.assign(t.values().values().begin(), t.values().values().end());
    for (float x : s.values) {
      if (!std::isfinite(x)) {
        return absl::InvalidArgumentError(absl::StrCat(field, ": values must be finite"));
      }
    }
    return s;
  }
  if (!t.has_region()) return absl::InvalidArgumentError(absl::StrCat(field, " is required"));
  TensorSpec spec;
  spec.dtype = DType::kFloat32;
  spec.shape = {count};
  spec.dense_inner = 1;
  absl::StatusOr<TensorView> view = lookup.ResolveTensor(t.region(), field, spec);
  if (!view.ok()) return view.status();
  s.region = static_cast<const float*>(view->data);
  return s;
}

}  // namespace server
}  // namespace specstate
