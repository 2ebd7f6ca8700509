// A float64 reference for the RecoverSSM kernels, straight from docs/semantics.md.
//
// Independent of //kernels on purpose: its own structs, its own 16-bit float
// conversions, plain loops in double precision. It models the results, not
// the kernels' arithmetic: outputs and states are exact-as-double values of
// the math, so tests compare them with a tolerance (bit identity is a
// property between the kernels, tested by comparing kernels to kernels).
//
// The reference takes valid inputs only (it does not model the kernels'
// device checks); a precondition it relies on aborts with a message.
//
//   reference::Shape shape{/*heads=*/2, /*head_dim=*/64, /*lower_bound=*/-5.0};
//   reference::StatePool pool;            // block -> [H, V, K] state
//   pool[3] = initial_state;
//   reference::StockResult r = reference::Stock(shape, params, tokens, call, &pool);
//   // r.out[(t * H + h) * K + v], and pool[idx[n][t]] now holds the state after token t.
#ifndef SPECSTATE_TESTS_REFERENCE_KDA_REFERENCE_H_
#define SPECSTATE_TESTS_REFERENCE_KDA_REFERENCE_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

namespace specstate {
namespace reference {

inline constexpr int32_t kNullBlock = 0;

// ---------------------------------------------------------------------------
// Element types and their rounding (round to nearest even, as the kernels).

enum class Dtype { kFloat32, kFloat16, kBFloat16 };

uint16_t BFloat16FromFloat(float x);
float BFloat16ToFloat(uint16_t bits);
uint16_t Float16FromFloat(float x);
float Float16ToFloat(uint16_t bits);

size_t SizeOf(Dtype dtype);

// `x` rounded to `dtype`, as a float (exact).
float RoundTo(Dtype dtype, float x);

// Writes `x`, rounded to `dtype`, to the element at `dst`; reads one back.
void StoreElement(Dtype dtype, float x, void* dst);
double LoadElement(Dtype dtype, const void* src);

// The unit roundoff of `dtype` (2^-24, 2^-11, 2^-8): rounding to it changes a
// value by at most this fraction of its magnitude (normal range).
double UnitRoundoff(Dtype dtype);

// ---------------------------------------------------------------------------
// Data.

// KDA (a gate per column) or Gated DeltaNet (a scalar log-decay per value
// head, beta as given).
enum class Kind { kKda, kGdn };

struct Shape {
  int heads = 0;     // H: key heads (q, k; KDA's g)
  int head_dim = 0;  // K = V
  double lower_bound = -5.0;
  Kind kind = Kind::kKda;
  int value_heads = 0;      // HV (v, beta, o, the state; GDN's g); 0: = heads
  bool plain_gate = false;  // KDA: exp(-exp(A_log) softplus(g + dt_bias))

  int hv() const { return value_heads > 0 ? value_heads : heads; }
  // Per token: q, k; v and o; g; beta.
  size_t key_width() const { return static_cast<size_t>(heads) * head_dim; }
  size_t value_width() const { return static_cast<size_t>(hv()) * head_dim; }
  size_t gate_width() const { return kind == Kind::kGdn ? hv() : key_width(); }
};

// One head-block of recurrent state per value head: [HV, V, K], K innermost.
using State = std::vector<double>;

// The recurrent-state blocks the reference knows about, by block index.
// Reading a block that is not there aborts (the test did not set it up).
using StatePool = std::map<int32_t, State>;

// KDA's gate parameters (GDN's g arrives as the model computed it).
struct LayerParams {
  std::vector<double> a_log;    // [H]
  std::vector<double> dt_bias;  // [H * K]
};

// Token-major activations, dense: q, k [T, H, K]; v [T, HV, K]; g KDA
// [T, H, K], GDN [T, HV]; beta [T, HV].
struct Tokens {
  int64_t count = 0;
  std::vector<double> q, k, v, g, beta;
};

using IndexRows = std::vector<std::vector<int32_t>>;

// ---------------------------------------------------------------------------
// The stock spec-path kernel.

struct StockCall {
  std::vector<int32_t> query_start_loc;      // [N + 1]
  IndexRows ssm_state_indices;               // N rows of C columns
  std::vector<int32_t> num_accepted_tokens;  // [N]; empty: column 0
};

struct StockResult {
  std::vector<double> out;    // [T, HV, V]
  std::vector<bool> written;  // [T]: whether o[t] was written
  // states[n][t]: row n's state after its token t (empty for idle rows),
  // whether or not a block receives it.
  std::vector<std::vector<State>> states;
};

// Runs every row and stores the per-token states into `pool`.
StockResult Stock(const Shape& shape, const LayerParams& params, const Tokens& tokens,
                  const StockCall& call, StatePool* pool);

// ---------------------------------------------------------------------------
// Verify.

// Record tokens [rows * q]: the raw k, v, g, beta each verified token left.
struct Records {
  int rows = 0;
  int q = 0;
  std::vector<double> k, v, g;  // [rows * q] of k, v, g as in Tokens
  std::vector<double> beta;     // [rows * q, HV]
  // The activation token each record token was copied from in the last
  // Verify, or -1 where Verify left it alone.
  std::vector<int64_t> source_token;
};

Records MakeRecords(const Shape& shape, int rows, int q);

struct VerifyCall {
  std::vector<int32_t> query_start_loc;  // [N + 1]
  std::vector<int32_t> state_indices;    // [N]: the checkpoint block of each row
};

struct VerifyResult {
  std::vector<double> out;
  std::vector<bool> written;
};

// Outputs as the stock kernel would write them from each row's checkpoint,
// and the records. Reads `pool`, writes no state.
VerifyResult Verify(const Shape& shape, const LayerParams& params, const Tokens& tokens,
                    const VerifyCall& call, const StatePool& pool, Records* records);

// ---------------------------------------------------------------------------
// Commit.

struct CommitCall {
  int spec_query_len = 0;                // Q
  std::vector<int32_t> query_start_loc;  // [N + 1]
  std::vector<int32_t> state_indices;    // [N]
  std::vector<int32_t> num_accepted;     // [batch]
  std::vector<int32_t> request_indices;  // [N]; empty: identity
  bool align = false;
  IndexRows block_table;                     // [batch, width]
  std::vector<int32_t> num_computed_tokens;  // [batch]
  int mamba_block_size = 0;
};

struct PlanRow {
  int32_t source = kNullBlock;
  int32_t commit_len = 0;
  int32_t final_block = kNullBlock;
  int32_t boundary_block = kNullBlock;
  int32_t boundary_len = 0;
};

// Commit step 1.
std::vector<PlanRow> PlanCommit(const CommitCall& call);

// Commit step 3: N rows of Q + 1 columns.
IndexRows ReplayIndices(const std::vector<PlanRow>& plan, int q);

// A conv-state pool [blocks, dim, width] of raw elements (bit patterns of the
// activation dtype, zero-extended): compaction copies them, never computes.
struct ConvPool {
  int num_blocks = 0;
  int dim = 0;
  int width = 0;
  std::vector<uint32_t> elements;

  uint32_t& at(int32_t block, int d, int x) {
    return elements[(static_cast<size_t>(block) * dim + d) * width + x];
  }
};

// Commit step 2 for one layer.
void CompactConv(const CommitCall& call, const std::vector<PlanRow>& plan, int history_len,
                 ConvPool* conv);

struct CommitLayer {
  LayerParams params;
  const Records* records = nullptr;
  StatePool* states = nullptr;
  ConvPool* conv = nullptr;
};

// All four steps for every layer. `history_len` = conv width - Q + 1.
std::vector<PlanRow> Commit(const Shape& shape, const CommitCall& call, int history_len,
                            std::vector<CommitLayer>* layers);

// ---------------------------------------------------------------------------
// RecordStateBlocks.

struct RecordStateBlocksCall {
  int num_rows = 0;
  std::vector<int32_t> request_indices;      // [N]; empty: identity
  std::vector<int32_t> idx_mapping;          // [batch]
  std::vector<int32_t> num_sampled;          // [batch]
  std::vector<int32_t> num_computed_tokens;  // [batch]
  int mamba_block_size = 0;
  int block_table_width = 0;
};

// Writes the entries it sets; leaves the others as they are.
void RecordStateBlocks(const RecordStateBlocksCall& call, std::vector<int32_t>* state_idx,
                       std::vector<int32_t>* num_accepted);

}  // namespace reference
}  // namespace specstate

#endif  // SPECSTATE_TESTS_REFERENCE_KDA_REFERENCE_H_
