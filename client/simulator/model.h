// The simulator's synthetic model and its inputs: the sizes it runs with
// (Dims), its requests and their blocks, and every random draw, made from one
// seed in a fixed order so that a seed replays the same simulation (and every
// tensor-parallel rank draws the same values): layer parameters, requests
// that arrive (their state and conv history, as a prefill would leave them)
// and finish, each step's rows (drafts, accepted counts, blocks), its batch
// (a prefill row in front and request_indices on odd steps), activations and
// conv updates; in commit mode DEFERRED, how pending blocks are materialized
// between steps (from a generator of its own, so that EAGER's draws stay the
// same). Values are drawn for the whole model; a rank keeps its part.
// Nothing here touches the service or shared memory: the driver puts what
// the model draws where it belongs.
//
//   absl::StatusOr<Dims> dims = ReadDims(layout, options, /*rank=*/0, /*tp=*/1);
//   Model model(*dims, options, report);
//   StepPlan p;
//   p.step = 0;
//   absl::Status st = model.DrawRows(p);
#ifndef SPECSTATE_CLIENT_SIMULATOR_MODEL_H_
#define SPECSTATE_CLIENT_SIMULATOR_MODEL_H_

#include <cstdint>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/lib/client.h"
#include "client/simulator/simulator.h"
#include "kernels/dtype.h"

namespace specstate {
namespace client {
namespace simulator_internal {

// The sizes the simulation runs with: the service's layout (under tensor
// parallelism one rank's part of the model), the whole model's, and the
// simulation's own.
struct Dims {
  // The service's layout: layers, heads, head dim, Q = num_spec + 1, conv
  // channels, conv window, its history (conv kernel - 1), blocks, mamba block
  // size, and the rows a step may verify.
  int L = 0, H = 0, K = 0, Q = 0, D = 0, W = 0, hl = 0, B = 0, bs = 0, max_rows = 0;
  bool align = false;
  bool deferred = false;  // commit mode DEFERRED
  bool fast = false;      // commit mode FAST, folding every fold_every steps
  int fold_every = 0;
  DType act = DType::kBFloat16, state = DType::kFloat32;
  int64_t as = 2, ss = 4;  // bytes per activation, per state element
  int64_t HK = 0, state_block_bytes = 0;
  // The layers: Gated DeltaNet (HV value heads, g a log-decay per value
  // head) or KDA (vLLM's plain gate or the safe one, its lower bound).
  bool gdn = false, plain_gate = false;
  float lower_bound = 0;
  int HV = 0;
  int64_t VW = 0, GW = 0;  // v and o, and g, per token (elements)
  // Tensor parallelism: this service is rank `rank` of `tp`; the whole
  // model's heads, value heads and conv channels are tp times its own.
  int rank = 0, tp = 1;
  int FH = 0, FHV = 0, FD = 0;
  int64_t FHK = 0, FVW = 0, FGW = 0;
  // The simulation's: rows per step, block-table width, tokens a step may
  // hold, elements per token of proj = [q | k | v | beta] (this service's and
  // the whole model's), batch rows (a prefill row may lead), and the int32
  // elements of the metadata buffer.
  int R = 0, width = 1;
  int64_t tmax = 0, proj_stride = 0, full_proj_stride = 0;
  int batch_max = 0;
  int64_t meta_ints = 0;

  // g's shape for `t` tokens: KDA [t, H, K], GDN [t, HV].
  std::vector<int64_t> GateShape(int64_t t) const;
};

// The sizes of a simulation of `options` on rank `rank` of `tp` (one
// service: 0 of 1) whose service has `layout`. FAILED_PRECONDITION when the
// service runs another commit mode than options.commit_mode asks, or has too
// few blocks for the simulation; INVALID_ARGUMENT when options.requests does
// not fit max_rows.
absl::StatusOr<Dims> ReadDims(const v1::Layout& layout, const SimulationOptions& options,
                              int rank, int tp);

struct Request {
  bool live = false;
  bool pinned = false;         // never finishes (carries a planted corruption)
  int64_t num_computed = 0;    // tokens before the step
  int acc_prev = 1;            // the stock state is in column acc_prev - 1
  std::vector<int32_t> table;  // block per column (none mode: one column)
  // Per layer: the conv window the next step reads, [D][hl] activation bytes.
  std::vector<std::vector<char>> window;
};

// Offsets (int32 elements) of a step's tensors in the shared metadata buffer.
struct MetaOffsets {
  int qsl = 0, idx = 0, req = 0;  // query_start_loc, state_indices, request_indices
  int acc = 0, nc = 0;            // num_accepted, num_computed_tokens (per batch row)
  int map = 0, sampled = 0;       // RecordStateBlocks' idx_mapping, num_sampled
  int out_idx = 0, out_acc = 0;   // RecordStateBlocks' outputs
  int table = 0;                  // block table [batch][width]
  int door = 0;                   // the doorbells (4), after everything else
};

// Where each of a step's int32 tensors lies in the shared metadata buffer;
// the doorbells follow them. The same every step.
MetaOffsets MetaLayout(const Dims& dims);

// What one step drew and built, handed from each of its phases to the next.
struct StepPlan {
  int step = 0;  // the simulation's step number
  uint64_t step_id = 0;  // the session's
  std::vector<int> tokens, accepted;  // per row
  std::vector<int32_t> qsl;           // [R + 1]
  std::vector<int32_t> checkpoint;    // per row: the block its state is read from
  int64_t num_tokens = 0;             // T
  bool remap = false;                 // a prefill row leads the batch
  int batch = 0;                      // batch rows (R, or R + 1 with remap)
  MetaOffsets at;
  std::vector<int32_t> meta;  // the metadata buffer's contents, host side
  std::vector<v1::VerifyRequest> verifies;  // per layer
  // [row][layer]: the conv columns after the update, [D][hl - 1 + tokens].
  std::vector<std::vector<std::vector<char>>> updated;
};

// A layer's gate parameters (KDA): the whole model's, and this rank's heads.
struct GateParams {
  std::vector<char> model_a_log, model_dt_bias;  // [FH], [FHK] floats
  std::vector<char> a_log, dt_bias;              // [H], [HK] floats
};

// A new request's layer, as a prefill would leave it.
struct PrefillLayer {
  std::vector<char> model_state;  // the whole model's state block (every value head)
  int64_t state_offset = 0;       // where this rank's state block starts in it (bytes)
  std::vector<char> conv;         // the conv block [D][W]: the history in its first hl columns
  const char* state() const { return model_state.data() + state_offset; }
};

// A layer's activations for tmax tokens: proj = [q | k | v | beta] per token
// and g.
struct LayerInputs {
  std::vector<char> proj, g;
};

// Where a row's Commit leaves its states: the committed state's block (at
// stock column acc - 1) and, in align mode when the accepted tokens cross a
// mamba-block boundary, the boundary state's block (0: none) and the tokens
// up to that boundary.
struct CommittedBlocks {
  int32_t final_block = 0;
  int32_t boundary_block = 0;
  int boundary_len = 0;
};

// Commit mode DEFERRED: how the scheduler materializes pending blocks between
// two steps.
struct Materialization {
  enum Kind { kNone, kFlushAll, kFlushSome, kRead };
  Kind kind = kNone;
  std::vector<int32_t> blocks;  // kFlushSome: some pending blocks, one twice, and a null block
  int slot = -1, layer = 0;     // kRead: ReadState of that slot's pending block in that layer
};

// The model: its requests and blocks, and every draw from the seed.
class Model {
 public:
  Model(const Dims& dims, const SimulationOptions& options, SimulationReport& report);

  const std::vector<Request>& requests() const { return requests_; }

  // Set-up: a KDA layer's gate parameters (the set-up's only draws).
  GateParams DrawGateParams();

  // Churn, slot by slot: whether the live request in `slot` finishes at
  // `step` (never at step 0, never a pinned one); then Finish gives its
  // blocks back.
  bool DrawFinish(int step, int slot);
  void Finish(int slot);
  // Whether a new request takes `slot` when it is empty (always at step 0
  // and in every slot but the first; sometimes the first stays empty for a
  // step: a null row), and if so starts it: its prefill follows, layer by
  // layer (DrawPrefill). RESOURCE_EXHAUSTED when the blocks run out.
  absl::StatusOr<bool> DrawStart(int step, int slot);
  // The new request's state and conv history of `layer` (it keeps its window).
  PrefillLayer DrawPrefill(int slot, int layer);
  // After the churn: the state bytes RecoverSSM saves at the live requests.
  void CountSavedStateBytes();

  // The step's rows: tokens (drafts + 1), accepted counts, checkpoints, and
  // in align mode blocks for the columns the step's tokens reach.
  absl::Status DrawRows(StepPlan& p);
  // The step's batch and metadata on the host (p.at, p.meta; the doorbells
  // are left 0). Odd steps put a prefill row in front of the batch and map
  // spec rows to batch rows with request_indices (when the batch has room
  // for it: the service's batches hold at most max_rows rows).
  void LayOutBatch(StepPlan& p) const;
  // A layer's activations for the whole model.
  LayerInputs DrawLayerInputs();
  // This rank's q, k, v and beta heads and its g of the whole model's.
  LayerInputs RankPart(const LayerInputs& model) const;
  // The scheduler's conv update of a live row's layer (docs/semantics.md):
  // the block's columns become [h_2..h_hl, x_0..x_{tokens-1}]; returns them,
  // [D][hl - 1 + tokens], with x drawn.
  std::vector<char> DrawConvUpdate(int slot, int layer, int tokens);
  // After the step's checks: each live row advances past its accepted tokens.
  void Advance(const StepPlan& p);

  // The block a request's state is read from (its checkpoint).
  int32_t CheckpointBlock(const Request& r) const;
  // The block-table column of a request's last accepted token (align mode).
  int FinalColumn(const Request& r, int accepted) const;
  // Where row `slot`'s Commit of step p leaves its states.
  CommittedBlocks Committed(const StepPlan& p, int slot) const;
  // The blocks step p's Commit writes: each live row's final block, and in
  // align mode a boundary block besides it (restart drills).
  std::vector<int32_t> CommitWrites(const StepPlan& p) const;
  // The [D][hl] conv window after the first `len` of a row's `tokens` tokens,
  // cut from its updated columns [D][hl - 1 + tokens].
  std::vector<char> WindowEndingAt(const std::vector<char>& updated, int tokens, int len) const;

  // The first live request's slot (-1: none), and pinning it (it never
  // finishes).
  int FirstLive() const;
  void Pin(int slot) { requests_[slot].pinned = true; }

  // Commit mode DEFERRED, between steps: `pending[slot]` is the slot's
  // pending block (0: none). Nothing (and no draw) when none is pending.
  Materialization DrawMaterialization(const std::vector<int32_t>& pending);

 private:
  absl::StatusOr<int32_t> TakeBlock();
  int CheckpointColumn(const Request& r) const;
  absl::Status Start(int slot);

  const Dims d_;
  SimulationReport& report_;
  std::mt19937_64 rng_;
  std::mt19937_64 deferred_rng_;  // DrawMaterialization's own
  std::bernoulli_distribution finish_;
  const MetaOffsets at_;
  std::vector<int32_t> free_blocks_;
  std::vector<Request> requests_;
};

}  // namespace simulator_internal
}  // namespace client
}  // namespace specstate

#endif  // SPECSTATE_CLIENT_SIMULATOR_MODEL_H_
