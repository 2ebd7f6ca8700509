// The harness of the kernels' tests (the *_test targets of //kernels): a
// step's data in a backend's memory, the fixture that calls the kernels on
// it, and the comparisons of what they wrote.
//
// KdaKernelsTest::MakeStep() draws a step from a StepSpec: random activations
// and gate parameters, random checkpoints in state pools whose other bytes are
// poison (a signaling NaN no arithmetic writes back), conv windows as the
// scheduler leaves them, and the metadata of the step's Stock, Verify and
// Commit calls. The metadata stays on the host and is uploaded afresh for
// every call: a test breaks one field and puts it back with Metadata.
// Run*() make a call and return what it returned and what its DeviceStatus
// says. What the kernels wrote is compared with the float64 reference in
// //tests/reference within Tolerance(), or between kernels byte for byte
// (FirstDifference()).
//
// Every case of KdaKernelsTest runs on each backend, as
// Backends/KdaKernelsTest.<Case>/cpu and .../cuda: the suite is instantiated
// here, so its cases may be in any file. A fixture derived from it is
// instantiated next to its cases. The CUDA cases skip unless the binary
// links :kernel_harness_cuda (which brings SPECSTATE_TEST_CUDA) and finds a
// device. The tests sit in an unnamed namespace inside
// specstate::kernels::testing, where the harness's names need no
// qualification:
//
//   TEST_P(KdaKernelsTest, VerifyWritesNoState) {
//     StepSpec spec;
//     spec.tokens = {4, 2};  // two rows, of 4 tokens and 2
//     Step s = MakeStep(spec);
//     ASSERT_TRUE(CallOk(RunVerify(s, /*l=*/0)));
//     EXPECT_EQ(FirstDifference(s.layers[0].pool.Read(), s.layers[0].pool.host), -1);
//   }
//
// Every test draws fresh random inputs. Its seed is printed with any failure;
// SPECSTATE_TEST_SEED=<seed> replays it.
#ifndef SPECSTATE_KERNELS_TESTING_KERNEL_HARNESS_H_
#define SPECSTATE_KERNELS_TESTING_KERNEL_HARNESS_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kernels/device_status.h"
#include "kernels/dtype.h"
#include "kernels/kda_args.h"
#include "kernels/kda_kernels.h"
#include "kernels/testing/backend_memory.h"
#include "tests/reference/kda_reference.h"

namespace specstate {
namespace kernels {

// Names the backend in gtest's messages (found by argument-dependent lookup).
void PrintTo(Backend backend, std::ostream* os);

namespace testing {

// ---------------------------------------------------------------------------
// Small utilities.

// Infrastructure failures (no memory, a broken stream) are not what these
// tests are about: stop at once, loudly.
void Must(const absl::Status& status, const char* what);

template <typename T>
T Must(absl::StatusOr<T> value, const char* what) {
  Must(value.status(), what);
  return *std::move(value);
}

// The reference's name for a kernel dtype (fp32 for anything but the 16-bit
// floats).
reference::Dtype RefDtype(DType dtype);

// What the kernels must not write (outputs, records, state blocks no row
// stores to) starts as poison: a signaling NaN of the element's dtype. A
// kernel that reads it computes NaN; one that writes where it should not
// cannot write it back, since arithmetic only ever yields quiet NaNs (and
// the 16-bit conversions quiet them too): only a raw copy could.
std::vector<uint8_t> Poisoned(DType dtype, size_t count);
bool IsPoison(DType dtype, const uint8_t* bytes, size_t count);

template <typename T>
std::vector<uint8_t> ToBytes(const std::vector<T>& values) {
  std::vector<uint8_t> bytes(values.size() * sizeof(T));
  if (!bytes.empty()) std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

template <typename T>
std::vector<T> FromBytes(const std::vector<uint8_t>& bytes) {
  std::vector<T> values(bytes.size() / sizeof(T));
  if (!values.empty()) std::memcpy(values.data(), bytes.data(), values.size() * sizeof(T));
  return values;
}

// The offset of the first byte where `a` and `b` differ, or -1.
int64_t FirstDifference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b);

// ||got - want|| / ||want|| (plain ||got - want|| when want is zero). NaN
// anywhere in `got` makes it NaN, which fails every bound.
double RelativeError(const std::vector<double>& got, const std::vector<double>& want);

// max_i |got_i - want_i| / max_i |want_i|: element-wise beside the norm-wise
// RelativeError (one wrong element hides in a norm over thousands). Every
// element's error is at most the compute budget, relative to the tensor's
// scale, plus one rounding of itself: the same Tolerance() bounds it.
double ElementwiseError(const std::vector<double>& got, const std::vector<double>& want);

// The bound on ||kernel - reference|| / ||reference|| for a tensor stored in
// `stored` (docs/semantics.md: fp32 arithmetic throughout, one rounding on store).
//  - The kernels compute in fp32, the reference in float64 from the same
//    (already rounded) inputs: sums over K <= 256 terms, a few transcendental
//    functions and Q tokens of recurrence stay within a few fp32 ulps
//    (relative ~1e-6; the recurrence is contractive: decay < 1, normalized k,
//    sigmoid(beta) < 1). 1e-5 is the budget for that.
//  - Storing rounds every element once, to nearest: |round(x) - x| <= u |x|
//    with u the unit roundoff of the stored dtype (2^-24 fp32, 2^-11 fp16,
//    2^-8 bf16), so norm-wise at most u. Outputs are stored in the
//    activation dtype, states in the state dtype; inputs need no allowance
//    because the reference reads the very values the kernels read.
// fp32 stores are the kernels' own precision, inside the compute budget.
double Tolerance(DType stored);

// Each test's random source.
class Random {
 public:
  explicit Random(uint64_t seed) : engine_(seed) {}

  float Normal(float stddev) { return std::normal_distribution<float>(0.0f, stddev)(engine_); }
  float Uniform(float lo, float hi) {
    return std::uniform_real_distribution<float>(lo, hi)(engine_);
  }
  // In [lo, hi].
  int Int(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(engine_); }
  template <typename T>
  void Shuffle(std::vector<T>* v) {
    std::shuffle(v->begin(), v->end(), engine_);
  }

 private:
  std::mt19937_64 engine_;
};

// ---------------------------------------------------------------------------
// A step's data: host copies and the backend buffers the kernels see.

// Bytes in the backend's memory and the host copy they were made from.
struct Tensor {
  std::vector<uint8_t> host;
  BackendBuffer dev;

  void* data() const { return dev.data(); }
  template <typename T>
  T* As() const {
    return dev.As<T>();
  }
  std::vector<uint8_t> Read() const { return Must(dev.ToHost(), "download"); }
  void Write(const std::vector<uint8_t>& bytes) {
    host = bytes;
    Must(dev.Upload(bytes), "upload");
  }
};

// What one step of the tests looks like. Rows, tokens and blocks are drawn by
// MakeStep(); tests adjust the metadata vectors of the Step afterwards (they
// are uploaded afresh for every call).
struct StepSpec {
  DType act = DType::kBFloat16;
  DType state = DType::kFloat32;
  int heads = 2;
  int head_dim = 64;
  LayerKind kind = LayerKind::kKda;
  int value_heads = 0;  // HV; 0: = heads
  KdaGate gate = KdaGate::kSafe;
  int q = 4;        // Q = num_spec + 1
  int history = 3;  // conv history_len = conv_kernel - 1
  int conv_dim = 20;
  bool conv_token_major = false;  // conv blocks [W, D] (dim stride 1) instead of [D, W]
  // Conv blocks [D, W] with no padding between channels or blocks (the
  // service's layout; the CUDA compaction's vector path where 16-byte aligned).
  bool conv_dense = false;
  int num_layers = 1;
  bool strided = true;           // q, k, v, beta: column slices of wider buffers
  std::vector<int> tokens;       // T_n of each spec row
  std::vector<int32_t> sources;  // per row: > 0 a fresh checkpoint block, <= 0 this null index
  int batch = 0;                 // rows of num_accepted (and align metadata); 0: one per row
  std::vector<int32_t> request_indices;  // empty: identity
  std::vector<int32_t> num_accepted;     // [batch]; empty: drawn in [0, Q + 1]
  bool align = false;
  int block_size = 0;
  int width = 0;
  std::vector<int32_t> num_computed;  // [batch]
};

struct Layer {
  // Activations: q, k, v at element offsets of one buffer, then g, beta.
  Tensor proj, g, beta, a_log, dt_bias;
  int64_t q_off = 0, k_off = 0, v_off = 0, proj_stride = 0, v_stride = 0;
  int64_t beta_off = 0, beta_stride = 0;
  reference::Tokens tokens;  // the values the kernels read, dense
  reference::LayerParams params;
  // Recurrent state: `stock_pool` for the stock kernel, `pool` for verify and
  // commit; both start identical (random checkpoints, everything else poison).
  Tensor stock_pool, pool;
  reference::StatePool initial_states;
  // The conv pool, and for each row the sequence its checkpoint's conv window
  // stands for: per channel, h_1 .. h_hl, x_0 .. x_{T-1} (element bits).
  Tensor conv;
  std::vector<std::vector<std::vector<uint32_t>>> conv_sequence;  // [row][d]
  Tensor rec_kv, rec_g, rec_beta;
  Tensor stock_out, verify_out;
};

struct Step {
  StepSpec spec;
  KdaShape shape;
  int rows = 0;
  int batch = 0;
  int record_rows = 0;
  int64_t num_tokens = 0;      // tokens in the activations and outputs
  int64_t num_tokens_arg = 0;  // what the calls say (tests lower it)
  int64_t num_blocks = 0;
  int64_t block_stride = 0;  // state pool, elements
  int conv_width = 0;
  int64_t conv_block_stride = 0, conv_dim_stride = 0, conv_token_stride = 0;

  // Metadata, uploaded for every call.
  std::vector<int32_t> qsl;
  std::vector<int32_t> sources;                     // verify/commit state_indices
  std::vector<std::vector<int32_t>> stock_indices;  // [rows][Q + 1]: P_0 .. P_{Q-1}, source
  std::vector<int32_t> stock_accepted;              // [rows]; empty: none (column 0)
  std::vector<int32_t> num_accepted;                // [batch]
  std::vector<int32_t> request_indices;             // [rows] or empty
  std::vector<std::vector<int32_t>> table;          // [batch][width]
  std::vector<int32_t> num_computed;                // [batch]
  int block_size = 0;

  std::vector<Layer> layers;
  Tensor stock_workspace, commit_workspace, status;

  size_t act_size() const { return DTypeSize(shape.act_dtype); }
  size_t state_size() const { return DTypeSize(shape.state_dtype); }
  int hv() const { return ValueHeads(shape); }
  int64_t hk() const { return KeyWidth(shape); }    // q, k per token
  int64_t vw() const { return ValueWidth(shape); }  // v, o per token
  int64_t gw() const { return GateWidth(shape); }   // g per token
  int64_t state_elems() const { return vw() * shape.head_dim; }  // one block's [HV, V, K]
  int history() const { return spec.history; }
};

// The metadata of a step, to restore after a test broke one field.
struct Metadata {
  std::vector<int32_t> qsl, sources, stock_accepted, num_accepted, request_indices, num_computed;
  std::vector<std::vector<int32_t>> stock_indices, table;
  int64_t num_tokens_arg = 0;

  static Metadata Of(const Step& s) {
    return Metadata{s.qsl,           s.sources,         s.stock_accepted,
                    s.num_accepted,  s.request_indices, s.num_computed,
                    s.stock_indices, s.table,           s.num_tokens_arg};
  }
  void RestoreTo(Step* s) const {
    s->qsl = qsl;
    s->sources = sources;
    s->stock_accepted = stock_accepted;
    s->num_accepted = num_accepted;
    s->request_indices = request_indices;
    s->num_computed = num_computed;
    s->stock_indices = stock_indices;
    s->table = table;
    s->num_tokens_arg = num_tokens_arg;
  }
};

// What a call's pointers point at; alive until the call has finished.
struct CallData {
  std::vector<Tensor> tensors;
  std::vector<CommitLayer> layers;
};

struct CallResult {
  absl::Status launch;  // what the call returned
  absl::Status device;  // its DeviceStatus, converted
};

// Success when the call returned OK and its DeviceStatus says it passed.
::testing::AssertionResult CallOk(const CallResult& r);

// Every buffer of a step that a call may write (and its inputs), by name, in
// the order of the layers.
using Snapshot = std::vector<std::pair<std::string, std::vector<uint8_t>>>;

Snapshot TakeSnapshot(const Step& s);

// Every buffer of `after` holds the bytes it held in `before`.
void ExpectSameBytes(const Snapshot& before, const Snapshot& after);

// The cross-row checks keep a table of owners, one int32 per block (or
// request row) at the start of the workspace: zero between calls.
void ExpectOwnerTableClear(const Tensor& workspace, int64_t entries);

// A block's [H, V, K] state (without the padding to the next block).
std::vector<uint8_t> BlockBytes(const Step& s, const std::vector<uint8_t>& pool, int32_t block);
void SetBlockBytes(const Step& s, std::vector<uint8_t>* pool, int32_t block,
                   const std::vector<uint8_t>& bytes);
// The same state's elements as the reference reads them.
std::vector<double> BlockValues(const Step& s, const std::vector<uint8_t>& pool, int32_t block);

// A conv pool's bytes as the reference's pool (element bits, zero-extended).
reference::ConvPool RefConv(const Step& s, const std::vector<uint8_t>& conv);

// The reference's view of a step's calls.
reference::Shape RefShape(const Step& s);
reference::StockCall RefStockCall(const Step& s);
reference::VerifyCall RefVerifyCall(const Step& s);
reference::CommitCall RefCommitCall(const Step& s);

// Does the reference plan commit anything for this row?
bool Commits(const reference::PlanRow& p);

// The dtypes, kind and shape of a step, for SCOPED_TRACE.
std::string Describe(const StepSpec& spec);

// The shapes and dtypes the reference comparisons cover.
struct Config {
  DType act;
  DType state;
  int heads;
  int head_dim;
  bool strided;
  LayerKind kind = LayerKind::kKda;
  int value_heads = 0;
  KdaGate gate = KdaGate::kSafe;
};

inline constexpr Config kConfigs[] = {
    {DType::kBFloat16, DType::kFloat32, 2, 64, true},
    {DType::kBFloat16, DType::kBFloat16, 3, 64, true},
    {DType::kFloat16, DType::kFloat32, 3, 64, true},
    {DType::kFloat16, DType::kBFloat16, 2, 64, false},
    {DType::kFloat32, DType::kFloat32, 4, 64, true},
    {DType::kFloat32, DType::kBFloat16, 1, 64, false},
    {DType::kBFloat16, DType::kFloat32, 3, 128, true},
    {DType::kFloat32, DType::kFloat32, 2, 256, true},
    // KDA with vLLM's plain gate; Gated DeltaNet with grouped value heads.
    {DType::kBFloat16, DType::kFloat32, 2, 64, true, LayerKind::kKda, 0, KdaGate::kPlain},
    {DType::kBFloat16, DType::kFloat32, 2, 64, true, LayerKind::kGdn, 4},
    {DType::kFloat32, DType::kBFloat16, 1, 64, false, LayerKind::kGdn, 3},
    {DType::kFloat16, DType::kFloat32, 2, 128, true, LayerKind::kGdn, 2},
    {DType::kBFloat16, DType::kFloat32, 1, 256, false, LayerKind::kGdn, 1},
};

// A StepSpec of `c`'s dtypes and shape, the rest as StepSpec's defaults.
StepSpec SpecOf(const Config& c);

// ---------------------------------------------------------------------------
// The fixture: one backend per instantiation, a seed per test.

class KdaKernelsTest : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override;

  Backend backend() const { return on_cpu_ ? Backend::kCpu : GetParam(); }
  Stream stream() const { return on_cpu_ ? nullptr : stream_.get(); }

  // Runs `fn` with the CPU backend (its memory and kernels) in place of this
  // test's backend: the CPU-vs-CUDA agreement test builds the same step twice.
  template <typename Fn>
  void OnCpu(Fn fn) {
    const KdaKernels* saved = kernels_;
    kernels_ = &CpuKdaKernels();
    on_cpu_ = true;
    fn();
    on_cpu_ = false;
    kernels_ = saved;
  }
  Random& rng() { return *rng_; }

  // `bytes` in a new buffer of this backend's memory.
  Tensor Upload(std::vector<uint8_t> bytes);

  // A zeroed buffer (workspaces must start zeroed).
  Tensor Zeroed(size_t bytes) { return Upload(std::vector<uint8_t>(bytes, 0)); }

  // `values` in this backend's memory, alive as long as `cd`.
  const int32_t* Ints(CallData* cd, const std::vector<int32_t>& values);

  // A step of `spec` in this backend's memory, drawn from rng().
  Step MakeStep(const StepSpec& spec);

  // The arguments of a call on `s` (layer `l`) as the service makes them;
  // `cd` keeps the uploaded metadata.
  StockArgs StockArgsFor(Step& s, int l, CallData* cd);
  VerifyArgs VerifyArgsFor(Step& s, int l, CallData* cd);
  CommitArgs CommitArgsFor(Step& s, CallData* cd);

  // A zeroed host mirror for the call's status (status_mirror), as the
  // service hands it over.
  DeviceStatus* ZeroedMirror() {
    std::memset(mirror_.get(), 0, sizeof(DeviceStatus));
    return mirror_.get();
  }

  // The call's status; its host mirror (when given) must hold the same bytes
  // if the call failed, and still be zero if it passed.
  CallResult Finish(const absl::Status& launch, const char* op, const DeviceStatus* device_status,
                    bool mirrored = true);
  CallResult Finish(const absl::Status& launch, const char* op, const Step& s,
                    bool mirrored = true) {
    return Finish(launch, op, s.status.As<DeviceStatus>(), mirrored);
  }

  CallResult RunStock(Step& s, int l);
  CallResult RunVerify(Step& s, int l, const Prerequisites& prerequisites = {});
  CallResult RunCommit(Step& s, const Prerequisites& prerequisites = {});

  // Stock and verify on every layer (valid metadata), as a step does before
  // its commit; verify's outputs must equal the stock kernel's.
  void StockAndVerifyAll(Step& s);

  // After a commit: every state block the reference plan commits holds, bit
  // for bit, the state the stock kernel stored for the same token (final:
  // column commit_len - 1; boundary: column boundary_len - 1); every other
  // byte of every state pool is as it was; the conv windows are the
  // scheduler's.
  void ExpectCommitMatchesStock(const Step& s, const Snapshot& before_commit);

  const KdaKernels* kernels_ = nullptr;
  std::optional<Random> rng_;

 private:
  void MakeLayer(Step* s);

  // Random values of `dtype`, rounded as the kernels would read them.
  std::vector<uint8_t> RandomElements(DType dtype, size_t count, float stddev);

  // `rows` as a matrix whose rows are `row_stride` apart, padded with
  // kIndexPadding.
  IndexMatrix Matrix(CallData* cd, const std::vector<std::vector<int32_t>>& rows,
                     int64_t row_stride);

  void ExpectConvMatchesScheduler(const Step& s, const std::vector<reference::PlanRow>& plan, int l,
                                  const std::vector<uint8_t>& before);

  bool on_cpu_ = false;
  BackendStream stream_;
  StatusMirror mirror_;
  std::optional<::testing::ScopedTrace> trace_;
};

// The backend's name as a test name's suffix: .../cpu, .../cuda.
std::string BackendParamName(const ::testing::TestParamInfo<Backend>& info);

}  // namespace testing
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_TESTING_KERNEL_HARNESS_H_
