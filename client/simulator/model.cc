#include "client/simulator/model.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/simulator/host_bytes.h"

namespace specstate {
namespace client {
namespace simulator_internal {

std::vector<int64_t> Dims::GateShape(int64_t t) const {
  return gdn ? std::vector<int64_t>{t, HV} : std::vector<int64_t>{t, H, K};
}

namespace {

// The sizes of the layout itself, and of the whole model it is a part of.
Dims LayoutDims(const v1::Layout& layout, int rank, int tp) {
  Dims d;
  d.L = layout.num_layers();
  d.H = layout.num_heads();
  d.K = layout.head_dim();
  d.Q = layout.num_spec() + 1;
  d.D = layout.conv_dim();
  d.W = layout.conv_width();
  d.hl = layout.conv_kernel() - 1;
  d.B = layout.num_blocks();
  d.max_rows = layout.max_rows();
  d.align = layout.cache_mode() == v1::ALIGN;
  d.deferred = layout.commit_mode() == v1::DEFERRED;
  d.fast = layout.commit_mode() == v1::FAST;
  d.fold_every = layout.fold_every();
  d.bs = layout.mamba_block_size();
  d.act = layout.activation_dtype() == v1::FP32   ? DType::kFloat32
          : layout.activation_dtype() == v1::FP16 ? DType::kFloat16
                                                  : DType::kBFloat16;
  d.state = layout.state_dtype() == v1::BF16 ? DType::kBFloat16 : DType::kFloat32;
  d.as = DTypeSize(d.act);
  d.ss = DTypeSize(d.state);
  d.HK = int64_t{d.H} * d.K;
  d.gdn = layout.layer_kind() == v1::GDN;
  d.plain_gate = layout.kda_gate() == v1::PLAIN_GATE;
  d.lower_bound = layout.lower_bound();
  d.HV = layout.num_value_heads() > 0 ? layout.num_value_heads() : d.H;
  d.VW = int64_t{d.HV} * d.K;
  d.GW = d.gdn ? d.HV : d.HK;
  d.state_block_bytes = d.VW * d.K * d.ss;
  // The whole model (this part itself when there is one rank).
  d.rank = rank;
  d.tp = tp;
  d.FH = d.H * tp;
  d.FHV = d.HV * tp;
  d.FD = d.D * tp;
  d.FHK = int64_t{d.FH} * d.K;
  d.FVW = int64_t{d.FHV} * d.K;
  d.FGW = d.gdn ? d.FHV : d.FHK;
  return d;
}

}  // namespace

absl::StatusOr<Dims> ReadDims(const v1::Layout& layout, const SimulationOptions& options,
                              int rank, int tp) {
  Dims d = LayoutDims(layout, rank, tp);
  const std::string mode = d.deferred ? "deferred" : d.fast ? "fast" : "eager";
  if (!options.commit_mode.empty() && options.commit_mode != mode) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the service runs commit mode ", v1::CommitMode_Name(layout.commit_mode()), ", not ",
        options.commit_mode, " (specstated --commit_mode=", options.commit_mode, ")"));
  }
  if (d.fast && tp > 1) {
    return absl::FailedPreconditionError(
        "commit mode FAST is checked by its accuracy contract against a float64 reference, with "
        "one service (tensor parallelism's checks are bit for bit against the TP=1 run)");
  }
  d.R = options.requests;
  if (d.R < 1 || d.R > d.max_rows) {
    return absl::InvalidArgumentError(absl::StrCat("requests = ", d.R, " must be in [1, ",
                                                   d.max_rows, "] (the service's max_rows)"));
  }
  // Blocks: none mode one per request; align mode one per mamba block of
  // tokens the request reaches.
  d.width = d.align ? 3 + (2 * d.bs + options.steps * d.Q) / d.bs : 1;
  const int64_t needed = d.align ? int64_t{d.R} * d.width : d.R;
  if (needed > d.B - 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the simulation may need ", needed, " blocks but the service has ", d.B - 1,
        ": start specstated with more --blocks, or simulate fewer --requests or --steps"));
  }
  d.tmax = int64_t{d.R} * d.Q;
  d.proj_stride = 2 * d.HK + d.VW + d.HV;
  d.full_proj_stride = 2 * d.FHK + d.FVW + d.FHV;
  d.batch_max = d.R + 1;
  d.meta_ints = 4 * (d.R + 1) + 6 * d.batch_max + d.batch_max * d.width + 8;
  return d;
}

MetaOffsets MetaLayout(const Dims& d) {
  MetaOffsets at;
  int off = 0;
  const auto take = [&off](int n) {
    const int start = off;
    off += n;
    return start;
  };
  at.qsl = take(d.R + 1);
  at.idx = take(d.R);
  at.req = take(d.R);
  at.acc = take(d.batch_max);
  at.nc = take(d.batch_max);
  at.map = take(d.batch_max);
  at.sampled = take(d.batch_max);
  at.out_idx = take(d.batch_max);
  at.out_acc = take(d.batch_max);
  at.table = take(d.batch_max * d.width);
  at.door = off;
  return at;
}

Model::Model(const Dims& dims, const SimulationOptions& options, SimulationReport& report)
    : d_(dims),
      report_(report),
      rng_(options.seed),
      deferred_rng_(options.seed ^ 0x5eed),
      finish_(options.finish_probability),
      at_(MetaLayout(dims)),
      requests_(dims.R) {
  for (int b = d_.B - 1; b >= 1; --b) free_blocks_.push_back(b);
}

// Drawn for the whole model; the service gets this rank's heads.
GateParams Model::DrawGateParams() {
  GateParams p;
  FillRandom(&p.model_a_log, d_.FH, DType::kFloat32, -2.0f, 0.5f, rng_);
  FillRandom(&p.model_dt_bias, d_.FHK, DType::kFloat32, -1.0f, 1.0f, rng_);
  p.a_log.assign(p.model_a_log.begin() + d_.rank * d_.H * 4,
                 p.model_a_log.begin() + (d_.rank + 1) * d_.H * 4);
  p.dt_bias.assign(p.model_dt_bias.begin() + d_.rank * d_.HK * 4,
                   p.model_dt_bias.begin() + (d_.rank + 1) * d_.HK * 4);
  return p;
}

// ---- requests and blocks ----

absl::StatusOr<int32_t> Model::TakeBlock() {
  if (free_blocks_.empty()) {
    return absl::ResourceExhaustedError("the simulation ran out of blocks: raise --blocks");
  }
  const int32_t b = free_blocks_.back();
  free_blocks_.pop_back();
  return b;
}

int Model::CheckpointColumn(const Request& r) const {
  return d_.align ? static_cast<int>((r.num_computed - 1) / d_.bs) : 0;
}

int32_t Model::CheckpointBlock(const Request& r) const { return r.table[CheckpointColumn(r)]; }

bool Model::DrawFinish(int step, int slot) {
  const Request& r = requests_[slot];
  return r.live && !r.pinned && step > 0 && finish_(rng_);
}

absl::StatusOr<bool> Model::DrawStart(int step, int slot) {
  const Request& r = requests_[slot];
  const bool start = !r.live && (step == 0 || finish_(rng_) || slot > 0);
  if (!start) return false;
  absl::Status st = Start(slot);
  if (!st.ok()) return st;
  return true;
}

// A new request in `slot`: its tokens so far and its checkpoint block.
absl::Status Model::Start(int slot) {
  Request& r = requests_[slot];
  r = Request();
  r.live = true;
  r.acc_prev = 1;
  r.num_computed = d_.align ? std::uniform_int_distribution<int>(1, 2 * d_.bs)(rng_) : 1;
  r.table.assign(d_.width, 0);
  absl::StatusOr<int32_t> block = TakeBlock();
  if (!block.ok()) return block.status();
  r.table[CheckpointColumn(r)] = *block;
  r.window.resize(d_.L);
  ++report_.requests_started;
  return absl::OkStatus();
}

// Its running state (random, as a prefill would leave it) and its conv
// history, both drawn for the whole model: this rank's value heads and
// channels.
PrefillLayer Model::DrawPrefill(int slot, int layer) {
  PrefillLayer p;
  FillRandom(&p.model_state, d_.FVW * d_.K, d_.state, -0.5f, 0.5f, rng_);
  p.state_offset = d_.rank * d_.state_block_bytes;
  std::vector<char> model_window;
  FillRandom(&model_window, int64_t{d_.FD} * d_.hl, d_.act, -1.0f, 1.0f, rng_);
  std::vector<char>& window = requests_[slot].window[layer];
  const auto mine = model_window.begin() + int64_t{d_.rank} * d_.D * d_.hl * d_.as;
  window.assign(mine, mine + int64_t{d_.D} * d_.hl * d_.as);
  p.conv.assign(int64_t{d_.D} * d_.W * d_.as, 0);
  for (int c = 0; c < d_.D; ++c) {
    std::memcpy(p.conv.data() + int64_t{c} * d_.W * d_.as,
                window.data() + int64_t{c} * d_.hl * d_.as, d_.hl * d_.as);
  }
  return p;
}

void Model::Finish(int slot) {
  Request& r = requests_[slot];
  for (int32_t b : r.table) {
    if (b > 0) free_blocks_.push_back(b);
  }
  r = Request();
  ++report_.requests_finished;
}

void Model::CountSavedStateBytes() {
  int live = 0;
  for (const Request& r : requests_) live += r.live;
  report_.state_bytes_saved = std::max<uint64_t>(
      report_.state_bytes_saved, uint64_t(live) * (d_.Q - 1) * d_.state_block_bytes * d_.L);
}

int Model::FirstLive() const {
  for (int i = 0; i < d_.R; ++i) {
    if (requests_[i].live) return i;
  }
  return -1;
}

// ---- one step ----

absl::Status Model::DrawRows(StepPlan& p) {
  p.tokens.assign(d_.R, 0);
  p.accepted.assign(d_.R, 0);
  p.qsl.assign(d_.R + 1, 0);
  p.checkpoint.assign(d_.R, 0);
  for (int i = 0; i < d_.R; ++i) {
    p.tokens[i] = std::uniform_int_distribution<int>(1, d_.Q)(rng_);
    p.accepted[i] = std::uniform_int_distribution<int>(1, p.tokens[i])(rng_);
    p.qsl[i + 1] = p.qsl[i] + p.tokens[i];
    Request& r = requests_[i];
    if (!r.live) {
      ++report_.null_rows;
      continue;
    }
    p.checkpoint[i] = CheckpointBlock(r);
    if (d_.align) {
      const int last = static_cast<int>((r.num_computed + p.tokens[i] - 1) / d_.bs);
      for (int c = CheckpointColumn(r); c <= last && c < d_.width; ++c) {
        if (r.table[c] == 0) {
          absl::StatusOr<int32_t> b = TakeBlock();
          if (!b.ok()) return b.status();
          r.table[c] = *b;
        }
      }
    }
    ++report_.rows;
    report_.tokens_verified += p.tokens[i];
  }
  p.num_tokens = p.qsl[d_.R];
  return absl::OkStatus();
}

void Model::LayOutBatch(StepPlan& p) const {
  p.remap = p.step % 2 == 1 && d_.R < d_.max_rows;
  p.batch = p.remap ? d_.R + 1 : d_.R;
  const int shift = p.remap ? 1 : 0;
  p.at = at_;
  const MetaOffsets& at = p.at;
  std::vector<int32_t>& meta = p.meta;
  meta.assign(d_.meta_ints, 0);
  for (int i = 0; i <= d_.R; ++i) meta[at.qsl + i] = p.qsl[i];
  for (int i = 0; i < d_.R; ++i) {
    const Request& r = requests_[i];
    meta[at.idx + i] = p.checkpoint[i];
    meta[at.req + i] = i + shift;
    meta[at.acc + i + shift] = p.accepted[i];
    meta[at.nc + i + shift] = r.live ? static_cast<int32_t>(r.num_computed) : 0;
    meta[at.map + i + shift] = r.live ? i : -1;
    meta[at.sampled + i + shift] = p.accepted[i];
    for (int c = 0; c < d_.width; ++c) {
      meta[at.table + (i + shift) * d_.width + c] = r.live ? r.table[c] : 0;
    }
  }
  if (p.remap) {  // the prefill row: accepts nothing, maps to no request
    meta[at.map] = -1;
  }
  for (int i = 0; i < d_.batch_max; ++i) {
    meta[at.out_idx + i] = -7;  // poison: rows with idx_mapping < 0 keep it
    meta[at.out_acc + i] = -7;
  }
}

LayerInputs Model::DrawLayerInputs() {
  LayerInputs in;
  FillRandom(&in.proj, d_.tmax * d_.full_proj_stride, d_.act, -1.0f, 1.0f, rng_);
  // beta (the last HV columns of each token): KDA's as logits in [-3, 3],
  // GDN's as write strengths in [0, 1].
  std::vector<char> beta;
  FillRandom(&beta, d_.tmax * d_.FHV, d_.act, d_.gdn ? 0.0f : -3.0f, d_.gdn ? 1.0f : 3.0f, rng_);
  CopyColumns(beta, d_.FHV, 0, &in.proj, d_.full_proj_stride, 2 * d_.FHK + d_.FVW, d_.tmax,
              d_.FHV, d_.as);
  // g: KDA's gate input, or GDN's log-decay (negative).
  FillRandom(&in.g, d_.tmax * d_.FGW, d_.act, d_.gdn ? -1.0f : -3.0f, d_.gdn ? -0.01f : 1.0f,
             rng_);
  return in;
}

LayerInputs Model::RankPart(const LayerInputs& model) const {
  LayerInputs in;
  in.proj.resize(d_.tmax * d_.proj_stride * d_.as);
  in.g.resize(d_.tmax * d_.GW * d_.as);
  const int64_t fps = d_.full_proj_stride, ps = d_.proj_stride, r = d_.rank;
  CopyColumns(model.proj, fps, r * d_.HK, &in.proj, ps, 0, d_.tmax, d_.HK, d_.as);
  CopyColumns(model.proj, fps, d_.FHK + r * d_.HK, &in.proj, ps, d_.HK, d_.tmax, d_.HK, d_.as);
  CopyColumns(model.proj, fps, 2 * d_.FHK + r * d_.VW, &in.proj, ps, 2 * d_.HK, d_.tmax, d_.VW,
              d_.as);
  CopyColumns(model.proj, fps, 2 * d_.FHK + d_.FVW + r * d_.HV, &in.proj, ps,
              2 * d_.HK + d_.VW, d_.tmax, d_.HV, d_.as);
  CopyColumns(model.g, d_.FGW, r * d_.GW, &in.g, d_.GW, 0, d_.tmax, d_.GW, d_.as);
  return in;
}

// The window the next step reads is the hl columns ending at the last
// accepted token (WindowEndingAt).
std::vector<char> Model::DrawConvUpdate(int slot, int layer, int tokens) {
  const int cols = d_.hl - 1 + tokens;
  // The whole model's new columns [D][tokens]; this rank's channels.
  std::vector<char> model_x;
  FillRandom(&model_x, int64_t{d_.FD} * tokens, d_.act, -1.0f, 1.0f, rng_);
  const auto mine = model_x.begin() + int64_t{d_.rank} * d_.D * tokens * d_.as;
  const std::vector<char> x(mine, mine + int64_t{d_.D} * tokens * d_.as);
  const std::vector<char>& window = requests_[slot].window[layer];
  std::vector<char> u(int64_t{d_.D} * cols * d_.as, 0);
  for (int c = 0; c < d_.D; ++c) {
    std::memcpy(u.data() + int64_t{c} * cols * d_.as,
                window.data() + (int64_t{c} * d_.hl + 1) * d_.as, (d_.hl - 1) * d_.as);
    std::memcpy(u.data() + (int64_t{c} * cols + d_.hl - 1) * d_.as,
                x.data() + int64_t{c} * tokens * d_.as, tokens * d_.as);
  }
  return u;
}

void Model::Advance(const StepPlan& p) {
  for (int i = 0; i < d_.R; ++i) {
    Request& r = requests_[i];
    if (!r.live) continue;
    const int acc = p.accepted[i];
    report_.tokens_accepted += acc;
    for (int l = 0; l < d_.L; ++l) r.window[l] = WindowEndingAt(p.updated[i][l], p.tokens[i], acc);
    r.acc_prev = acc;
    r.num_computed += acc;
  }
}

int Model::FinalColumn(const Request& r, int accepted) const {
  return static_cast<int>(std::min<int64_t>((r.num_computed + accepted - 1) / d_.bs, d_.width - 1));
}

CommittedBlocks Model::Committed(const StepPlan& p, int slot) const {
  const Request& r = requests_[slot];
  const int acc = p.accepted[slot];
  CommittedBlocks c;
  c.final_block = d_.align ? r.table[FinalColumn(r, acc)] : p.checkpoint[slot];
  if (d_.align) {
    const int64_t nc = r.num_computed;
    const int64_t next_boundary = (nc / d_.bs + 1) * d_.bs;
    if (nc + acc >= next_boundary) {
      c.boundary_block = r.table[next_boundary / d_.bs - 1];
      c.boundary_len = static_cast<int>(next_boundary - nc);
    }
  }
  return c;
}

std::vector<int32_t> Model::CommitWrites(const StepPlan& p) const {
  std::vector<int32_t> writes;
  for (int i = 0; i < d_.R; ++i) {
    if (!requests_[i].live) continue;
    const CommittedBlocks c = Committed(p, i);
    writes.push_back(c.final_block);
    if (c.boundary_block > 0 && c.boundary_block != c.final_block) {
      writes.push_back(c.boundary_block);
    }
  }
  return writes;
}

Materialization Model::DrawMaterialization(const std::vector<int32_t>& pending) {
  std::vector<int> slots;
  for (int i = 0; i < d_.R; ++i) {
    if (pending[i] > 0) slots.push_back(i);
  }
  Materialization m;
  if (slots.empty()) return m;
  const int what = std::uniform_int_distribution<int>(0, 9)(deferred_rng_);
  if (what == 0) {
    m.kind = Materialization::kFlushAll;
  } else if (what == 1) {
    m.kind = Materialization::kFlushSome;
    for (int i : slots) {
      if (std::bernoulli_distribution(0.5)(deferred_rng_)) m.blocks.push_back(pending[i]);
    }
    if (m.blocks.empty()) m.blocks.push_back(pending[slots[0]]);
    m.blocks.push_back(m.blocks[0]);  // twice: flushed once
    m.blocks.push_back(0);            // null: skipped
  } else if (what == 2) {
    m.kind = Materialization::kRead;
    m.slot = slots[std::uniform_int_distribution<size_t>(0, slots.size() - 1)(deferred_rng_)];
    m.layer = std::uniform_int_distribution<int>(0, d_.L - 1)(deferred_rng_);
  }
  return m;
}

std::vector<char> Model::WindowEndingAt(const std::vector<char>& updated, int tokens,
                                        int len) const {
  const int cols = d_.hl - 1 + tokens;
  std::vector<char> window(int64_t{d_.D} * d_.hl * d_.as);
  for (int c = 0; c < d_.D; ++c) {
    std::memcpy(window.data() + int64_t{c} * d_.hl * d_.as,
                updated.data() + (int64_t{c} * cols + len - 1) * d_.as, d_.hl * d_.as);
  }
  return window;
}

}  // namespace simulator_internal
}  // namespace client
}  // namespace specstate
