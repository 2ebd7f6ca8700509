// Correctness tests of the RecoverSSM kernels (kda_kernels.h), on every
// backend: the CPU backend always; the CUDA backend in
// //kernels:kda_kernels_gpu_test (built with SPECSTATE_TEST_CUDA) on a
// machine with a device.
//
// Three kinds of checks (SEMANTICS.md):
//  - agreement with the float64 reference in //tests/reference, within a
//    tolerance that accounts for fp32 arithmetic and the rounding of what is
//    stored (see Tolerance());
//  - bit identity between kernels (memcmp, never a tolerance): verify's
//    outputs are the stock kernel's, a committed state is the state the stock
//    kernel stores for the same token;
//  - argument checks: host-side errors come back from the call, device-side
//    ones in the call's DeviceStatus, and then nothing at all is written.
//
// Every test draws fresh random inputs. Its seed is printed with any failure;
// SPECSTATE_TEST_SEED=<seed> replays it.
#include "kernels/kda_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/device_status.h"
#include "kernels/dtype.h"
#include "kernels/kda_args.h"
#include "kernels/numeric.h"
#include "kernels/testing/backend_memory.h"
#include "tests/reference/kda_reference.h"

namespace specstate {
namespace kernels {

// Names the backend in gtest's messages (found by argument-dependent lookup).
void PrintTo(Backend backend, std::ostream* os) { *os << BackendName(backend); }

namespace {

namespace ref = ::specstate::reference;
using ::specstate::kernels::testing::BackendBuffer;
using ::specstate::kernels::testing::BackendStream;
using ::specstate::kernels::testing::StatusMirror;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// ---------------------------------------------------------------------------
// Small utilities.

// Infrastructure failures (no memory, a broken stream) are not what these
// tests are about: stop at once, loudly.
void Must(const absl::Status& status, const char* what) {
  if (!status.ok()) {
    std::fprintf(stderr, "test infrastructure failed: %s: %s\n", what, status.ToString().c_str());
    std::abort();
  }
}

template <typename T>
T Must(absl::StatusOr<T> value, const char* what) {
  Must(value.status(), what);
  return *std::move(value);
}

ref::Dtype RefDtype(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return ref::Dtype::kFloat16;
    case DType::kBFloat16:
      return ref::Dtype::kBFloat16;
    default:
      return ref::Dtype::kFloat32;
  }
}

// What the kernels must not write (outputs, records, state blocks no row
// stores to) starts as poison: a signaling NaN of the element's dtype. A
// kernel that reads it computes NaN; one that writes where it should not
// cannot write it back, since arithmetic only ever yields quiet NaNs (and
// the 16-bit conversions quiet them too): only a raw copy could.
uint32_t PoisonBits(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return 0x7c01u;
    case DType::kBFloat16:
      return 0x7f81u;
    default:
      return 0x7f800001u;
  }
}

std::vector<uint8_t> Poisoned(DType dtype, size_t count) {
  const size_t es = DTypeSize(dtype);
  const uint32_t bits = PoisonBits(dtype);
  std::vector<uint8_t> bytes(count * es);
  for (size_t i = 0; i < count; ++i) std::memcpy(&bytes[i * es], &bits, es);
  return bytes;
}

bool IsPoison(DType dtype, const uint8_t* bytes, size_t count) {
  const size_t es = DTypeSize(dtype);
  const uint32_t bits = PoisonBits(dtype);
  for (size_t i = 0; i < count; ++i) {
    uint32_t e = 0;
    std::memcpy(&e, bytes + i * es, es);
    if (e != bits) return false;
  }
  return true;
}

// Index-matrix padding (between a row's columns and the next row): a kernel
// that reads it sees an index far past any pool and fails its checks.
constexpr int32_t kIndexPadding = 1 << 30;

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
int64_t FirstDifference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  if (a.size() != b.size()) return static_cast<int64_t>(std::min(a.size(), b.size()));
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

// ||got - want|| / ||want|| (plain ||got - want|| when want is zero). NaN
// anywhere in `got` makes it NaN, which fails every bound.
double RelativeError(const std::vector<double>& got, const std::vector<double>& want) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  return norm > 0.0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

// max_i |got_i - want_i| / max_i |want_i|: element-wise beside the norm-wise
// RelativeError (one wrong element hides in a norm over thousands). Every
// element's error is at most the compute budget, relative to the tensor's
// scale, plus one rounding of itself: the same Tolerance() bounds it.
double ElementwiseError(const std::vector<double>& got, const std::vector<double>& want) {
  double worst = 0.0, scale = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = std::fabs(got[i] - want[i]);
    if (!(d <= worst)) worst = d;  // NaN sticks
    scale = std::max(scale, std::fabs(want[i]));
  }
  return scale > 0.0 ? worst / scale : worst;
}

// The bound on ||kernel - reference|| / ||reference|| for a tensor stored in
// `stored` (SEMANTICS.md: fp32 arithmetic throughout, one rounding on store).
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
constexpr double kComputeTolerance = 1e-5;

// fp32 stores are the kernels' own precision, inside the compute budget.
double Tolerance(DType stored) {
  return stored == DType::kFloat32 ? kComputeTolerance
                                   : kComputeTolerance + ref::UnitRoundoff(RefDtype(stored));
}

// Each test's random source. SPECSTATE_TEST_SEED replays a failed run.
uint64_t TestSeed() {
  const char* env = std::getenv("SPECSTATE_TEST_SEED");
  if (env != nullptr && *env != '\0') return std::strtoull(env, nullptr, 0);
  std::random_device device;
  return (uint64_t{device()} << 32) ^ device();
}

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
  ref::Tokens tokens;  // the values the kernels read, dense
  ref::LayerParams params;
  // Recurrent state: `stock_pool` for the stock kernel, `pool` for verify and
  // commit; both start identical (random checkpoints, everything else poison).
  Tensor stock_pool, pool;
  ref::StatePool initial_states;
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

::testing::AssertionResult CallOk(const CallResult& r) {
  if (!r.launch.ok()) return ::testing::AssertionFailure() << "the call returned " << r.launch;
  if (!r.device.ok()) return ::testing::AssertionFailure() << "the device reported " << r.device;
  return ::testing::AssertionSuccess();
}

// Every buffer of a step that a call may write (and its inputs), by name:
// kBuffersPerLayer per layer, in the order of the enum.
using Snapshot = std::vector<std::pair<std::string, std::vector<uint8_t>>>;
enum SnapshotBuffer : size_t {
  kProj,
  kG,
  kBeta,
  kStockPool,
  kPool,
  kConv,
  kRecordsKv,
  kRecordsG,
  kRecordsBeta,
  kStockOut,
  kVerifyOut,
  kBuffersPerLayer,
};

Snapshot TakeSnapshot(const Step& s) {
  Snapshot snap;
  for (size_t l = 0; l < s.layers.size(); ++l) {
    const Layer& L = s.layers[l];
    const std::string p = absl::StrCat("layer ", l, " ");
    // In SnapshotBuffer order.
    for (const auto& [name, t] :
         std::vector<std::pair<const char*, const Tensor*>>{{"q/k/v", &L.proj},
                                                            {"g", &L.g},
                                                            {"beta", &L.beta},
                                                            {"stock state pool", &L.stock_pool},
                                                            {"state pool", &L.pool},
                                                            {"conv pool", &L.conv},
                                                            {"records kv", &L.rec_kv},
                                                            {"records g", &L.rec_g},
                                                            {"records beta", &L.rec_beta},
                                                            {"stock outputs", &L.stock_out},
                                                            {"verify outputs", &L.verify_out}}) {
      snap.emplace_back(p + name, t->Read());
    }
  }
  return snap;
}

void ExpectSameBytes(const Snapshot& before, const Snapshot& after) {
  ASSERT_EQ(before.size(), after.size());
  for (size_t i = 0; i < before.size(); ++i) {
    const int64_t at = FirstDifference(before[i].second, after[i].second);
    EXPECT_EQ(at, -1) << before[i].first << " changed (first at byte " << at << ")";
  }
}

// The cross-row checks keep a table of owners, one int32 per block (or
// request row) at the start of the workspace: zero between calls.
void ExpectOwnerTableClear(const Tensor& workspace, int64_t entries) {
  const std::vector<int32_t> owner = FromBytes<int32_t>(workspace.Read());
  ASSERT_GE(owner.size(), static_cast<size_t>(entries));
  for (int64_t i = 0; i < entries; ++i) {
    if (owner[i] != 0) {
      ADD_FAILURE() << "workspace owner table entry " << i << " = " << owner[i]
                    << " after the call (must be 0)";
      return;
    }
  }
}

// A block's [H, V, K] state (without the padding to the next block).
std::vector<uint8_t> BlockBytes(const Step& s, const std::vector<uint8_t>& pool, int32_t block) {
  const size_t begin = static_cast<size_t>(block) * s.block_stride * s.state_size();
  return std::vector<uint8_t>(pool.begin() + begin,
                              pool.begin() + begin + s.state_elems() * s.state_size());
}

void SetBlockBytes(const Step& s, std::vector<uint8_t>* pool, int32_t block,
                   const std::vector<uint8_t>& bytes) {
  const size_t begin = static_cast<size_t>(block) * s.block_stride * s.state_size();
  std::copy(bytes.begin(), bytes.end(), pool->begin() + begin);
}

std::vector<double> BlockValues(const Step& s, const std::vector<uint8_t>& pool, int32_t block) {
  const std::vector<uint8_t> bytes = BlockBytes(s, pool, block);
  std::vector<double> values(s.state_elems());
  for (size_t i = 0; i < values.size(); ++i) {
    values[i] = ref::LoadElement(RefDtype(s.shape.state_dtype), &bytes[i * s.state_size()]);
  }
  return values;
}

// Conv element (block, d, x) of a conv pool's bytes, zero-extended.
size_t ConvOffset(const Step& s, int32_t block, int d, int x) {
  return (static_cast<size_t>(block) * s.conv_block_stride + d * s.conv_dim_stride +
          x * s.conv_token_stride) *
         s.act_size();
}

uint32_t ConvElement(const Step& s, const std::vector<uint8_t>& conv, int32_t block, int d, int x) {
  uint32_t e = 0;
  std::memcpy(&e, &conv[ConvOffset(s, block, d, x)], s.act_size());
  return e;
}

void SetConvElement(const Step& s, std::vector<uint8_t>* conv, int32_t block, int d, int x,
                    uint32_t e) {
  std::memcpy(&(*conv)[ConvOffset(s, block, d, x)], &e, s.act_size());
}

ref::ConvPool RefConv(const Step& s, const std::vector<uint8_t>& conv) {
  ref::ConvPool pool;
  pool.num_blocks = static_cast<int>(s.num_blocks);
  pool.dim = s.spec.conv_dim;
  pool.width = s.conv_width;
  pool.elements.resize(static_cast<size_t>(pool.num_blocks) * pool.dim * pool.width);
  for (int b = 0; b < pool.num_blocks; ++b) {
    for (int d = 0; d < pool.dim; ++d) {
      for (int x = 0; x < pool.width; ++x) pool.at(b, d, x) = ConvElement(s, conv, b, d, x);
    }
  }
  return pool;
}

// The reference's view of a step's calls.
ref::Shape RefShape(const Step& s) {
  ref::Shape shape{s.shape.num_heads, s.shape.head_dim, s.shape.lower_bound};
  shape.kind = s.shape.kind == LayerKind::kGdn ? ref::Kind::kGdn : ref::Kind::kKda;
  shape.value_heads = s.hv();
  shape.plain_gate = s.shape.gate == KdaGate::kPlain;
  return shape;
}

ref::StockCall RefStockCall(const Step& s) {
  return ref::StockCall{s.qsl, s.stock_indices, s.stock_accepted};
}

ref::VerifyCall RefVerifyCall(const Step& s) { return ref::VerifyCall{s.qsl, s.sources}; }

ref::CommitCall RefCommitCall(const Step& s) {
  ref::CommitCall c;
  c.spec_query_len = s.spec.q;
  c.query_start_loc = s.qsl;
  c.state_indices = s.sources;
  c.num_accepted = s.num_accepted;
  c.request_indices = s.request_indices;
  c.align = s.spec.align;
  c.block_table = s.table;
  c.num_computed_tokens = s.num_computed;
  c.mamba_block_size = s.block_size;
  return c;
}

std::string Describe(const StepSpec& spec) {
  return absl::StrCat(
      "act ", DTypeName(spec.act), ", state ", DTypeName(spec.state),
      spec.kind == LayerKind::kGdn ? ", GDN" : ", KDA",
      spec.gate == KdaGate::kPlain ? " (plain gate)" : "", ", H ", spec.heads,
      spec.value_heads > 0 ? absl::StrCat(", HV ", spec.value_heads) : "", ", K ",
      spec.head_dim, ", Q ", spec.q, spec.strided ? ", strided" : ", dense", ", ",
      spec.num_layers, " layer(s)", spec.align ? ", align" : "");
}

// Does the reference plan commit anything for this row?
bool Commits(const ref::PlanRow& p) {
  return p.source > ref::kNullBlock && p.commit_len > 0 && p.final_block > ref::kNullBlock;
}

// ---------------------------------------------------------------------------
// The fixture: one backend per instantiation, a seed per test.

class KdaKernelsTest : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    if (backend() == Backend::kCpu) {
      kernels_ = &CpuKdaKernels();
    } else {
#if defined(SPECSTATE_TEST_CUDA)
      absl::StatusOr<const KdaKernels*> cuda = CudaKdaKernels();
      if (!cuda.ok()) {
        GTEST_SKIP() << "the CUDA backend is unavailable here: " << cuda.status();
      }
      kernels_ = *cuda;
#else
      GTEST_SKIP() << "CUDA cases run in //kernels:kda_kernels_gpu_test (built with "
                      "SPECSTATE_TEST_CUDA) on a machine with a GPU";
#endif
    }
    stream_ = Must(BackendStream::Create(backend()), "stream");
    mirror_ = Must(StatusMirror::Allocate(backend()), "status mirror");
    const uint64_t seed = TestSeed();
    rng_.emplace(seed);
    trace_.emplace(__FILE__, __LINE__,
                   absl::StrCat("backend ", BackendName(backend()), ", seed ", seed,
                                " (replay with SPECSTATE_TEST_SEED=", seed, ")"));
  }

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

  Tensor Upload(std::vector<uint8_t> bytes) {
    Tensor t;
    t.dev = Must(BackendBuffer::Allocate(backend(), bytes.size()), "allocate");
    t.Write(bytes);
    return t;
  }

  // A zeroed buffer (workspaces must start zeroed).
  Tensor Zeroed(size_t bytes) { return Upload(std::vector<uint8_t>(bytes, 0)); }

  const int32_t* Ints(CallData* cd, const std::vector<int32_t>& values) {
    cd->tensors.push_back(Upload(ToBytes(values)));
    return cd->tensors.back().As<int32_t>();
  }

  // `rows` as a matrix whose rows are `row_stride` apart, padded with
  // kIndexPadding.
  IndexMatrix Matrix(CallData* cd, const std::vector<std::vector<int32_t>>& rows,
                     int64_t row_stride) {
    const int cols = rows.empty() ? 0 : static_cast<int>(rows[0].size());
    std::vector<int32_t> flat(std::max<size_t>(rows.size(), 1) * row_stride, kIndexPadding);
    for (size_t r = 0; r < rows.size(); ++r) {
      std::copy(rows[r].begin(), rows[r].end(), flat.begin() + r * row_stride);
    }
    return IndexMatrix{Ints(cd, flat), row_stride, cols};
  }

  // Random values of `dtype`, rounded as the kernels would read them.
  std::vector<uint8_t> RandomElements(DType dtype, size_t count, float stddev) {
    std::vector<uint8_t> bytes(count * DTypeSize(dtype));
    for (size_t i = 0; i < count; ++i) {
      ref::StoreElement(RefDtype(dtype), rng().Normal(stddev), &bytes[i * DTypeSize(dtype)]);
    }
    return bytes;
  }

  Step MakeStep(const StepSpec& spec);
  void MakeLayer(Step* s);

  // A copy of `s` whose buffers live in this backend's memory (same bytes).
  Step CopyStep(const Step& s) {
    const auto copy = [&](const Tensor& t) {
      Tensor c = Upload(t.Read());
      c.host = t.host;
      return c;
    };
    Step c;
    c.spec = s.spec;
    c.shape = s.shape;
    c.rows = s.rows;
    c.batch = s.batch;
    c.record_rows = s.record_rows;
    c.num_tokens = s.num_tokens;
    c.num_tokens_arg = s.num_tokens_arg;
    c.num_blocks = s.num_blocks;
    c.block_stride = s.block_stride;
    c.conv_width = s.conv_width;
    c.conv_block_stride = s.conv_block_stride;
    c.conv_dim_stride = s.conv_dim_stride;
    c.conv_token_stride = s.conv_token_stride;
    Metadata::Of(s).RestoreTo(&c);
    c.block_size = s.block_size;
    for (const Layer& L : s.layers) {
      Layer n;
      n.proj = copy(L.proj);
      n.g = copy(L.g);
      n.beta = copy(L.beta);
      n.a_log = copy(L.a_log);
      n.dt_bias = copy(L.dt_bias);
      n.q_off = L.q_off;
      n.k_off = L.k_off;
      n.v_off = L.v_off;
      n.proj_stride = L.proj_stride;
      n.v_stride = L.v_stride;
      n.beta_off = L.beta_off;
      n.beta_stride = L.beta_stride;
      n.tokens = L.tokens;
      n.params = L.params;
      n.stock_pool = copy(L.stock_pool);
      n.pool = copy(L.pool);
      n.initial_states = L.initial_states;
      n.conv = copy(L.conv);
      n.conv_sequence = L.conv_sequence;
      n.rec_kv = copy(L.rec_kv);
      n.rec_g = copy(L.rec_g);
      n.rec_beta = copy(L.rec_beta);
      n.stock_out = copy(L.stock_out);
      n.verify_out = copy(L.verify_out);
      c.layers.push_back(std::move(n));
    }
    c.stock_workspace = copy(s.stock_workspace);
    c.commit_workspace = copy(s.commit_workspace);
    c.status = copy(s.status);
    return c;
  }

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
                    bool mirrored = true) {
    CallResult r{launch, absl::OkStatus()};
    if (!launch.ok()) return r;
    const DeviceStatus status = Must(testing::Finish(backend(), stream(), device_status), "finish");
    r.device = DeviceStatusToStatus(status, op);
    if (mirrored && status.failed != 0) {
      EXPECT_EQ(std::memcmp(mirror_.get(), &status, sizeof(status)), 0)
          << op << ": the status mirror differs from the failed status";
    } else if (mirrored) {
      const DeviceStatus zero{};
      EXPECT_EQ(std::memcmp(mirror_.get(), &zero, sizeof(zero)), 0)
          << op << ": a passing call wrote the status mirror";
    }
    return r;
  }
  CallResult Finish(const absl::Status& launch, const char* op, const Step& s,
                    bool mirrored = true) {
    return Finish(launch, op, s.status.As<DeviceStatus>(), mirrored);
  }

  CallResult RunStock(Step& s, int l) {
    CallData cd;
    const StockArgs args = StockArgsFor(s, l, &cd);
    return Finish(kernels_->Stock(args, stream()), "Stock", s, /*mirrored=*/false);
  }
  CallResult RunVerify(Step& s, int l, const Prerequisites& prerequisites = {}) {
    CallData cd;
    VerifyArgs args = VerifyArgsFor(s, l, &cd);
    args.prerequisites = prerequisites;
    args.status_mirror = ZeroedMirror();
    return Finish(kernels_->Verify(args, stream()), "Verify", s);
  }
  CallResult RunCommit(Step& s, const Prerequisites& prerequisites = {}) {
    CallData cd;
    CommitArgs args = CommitArgsFor(s, &cd);
    args.prerequisites = prerequisites;
    args.status_mirror = ZeroedMirror();
    return Finish(kernels_->Commit(args, stream()), "Commit", s);
  }

  // Three rows of different lengths, each from its own checkpoint: the step
  // of the prerequisite and first-call tests.
  Step MakeThreeRowStep() {
    StepSpec spec;
    spec.tokens = {2, 3, 1};
    spec.sources = {1, 2, 3};
    spec.num_accepted = {2, 3, 1};
    return MakeStep(spec);
  }

  // Stock and verify on every layer (valid metadata), as a step does before
  // its commit; verify's outputs must equal the stock kernel's.
  void StockAndVerifyAll(Step& s) {
    for (int l = 0; l < s.spec.num_layers; ++l) {
      ASSERT_TRUE(CallOk(RunStock(s, l))) << "stock, layer " << l;
      ExpectOwnerTableClear(s.stock_workspace, s.num_blocks);
      ASSERT_TRUE(CallOk(RunVerify(s, l))) << "verify, layer " << l;
      const std::vector<uint8_t> stock = s.layers[l].stock_out.Read();
      const std::vector<uint8_t> verify = s.layers[l].verify_out.Read();
      EXPECT_EQ(FirstDifference(stock, verify), -1)
          << "layer " << l << ": verify's outputs differ from the stock kernel's";
    }
  }

  void ExpectCommitMatchesStock(const Step& s, const Snapshot& before_commit);
  void ExpectConvMatchesScheduler(const Step& s, const std::vector<ref::PlanRow>& plan, int l,
                                  const std::vector<uint8_t>& before);

  const KdaKernels* kernels_ = nullptr;
  bool on_cpu_ = false;
  BackendStream stream_;
  StatusMirror mirror_;
  std::optional<Random> rng_;
  std::optional<::testing::ScopedTrace> trace_;
};

Step KdaKernelsTest::MakeStep(const StepSpec& spec) {
  Step s;
  s.spec = spec;
  s.shape.num_heads = spec.heads;
  s.shape.head_dim = spec.head_dim;
  s.shape.kind = spec.kind;
  s.shape.num_value_heads = spec.value_heads;
  s.shape.gate = spec.gate;
  s.shape.act_dtype = spec.act;
  s.shape.state_dtype = spec.state;
  s.shape.lower_bound = rng().Uniform(-6.0f, -3.0f);
  s.rows = static_cast<int>(spec.tokens.size());
  s.batch = spec.batch > 0 ? spec.batch : s.rows;
  s.record_rows = s.rows + 1;  // a spare row: the kernels must leave it alone
  const int Q = spec.q;

  s.qsl.push_back(0);
  for (int t : spec.tokens) s.qsl.push_back(s.qsl.back() + t);
  s.num_tokens = s.qsl.back() + 2;  // tokens past the last row: never written
  s.num_tokens_arg = s.num_tokens;

  // Block ids in random order: sources, the stock kernel's per-token blocks,
  // the block table; two spares.
  s.num_blocks = 1 + s.rows + int64_t{s.rows} * Q + int64_t{s.batch} * spec.width + 2;
  std::vector<int32_t> free_blocks;
  for (int32_t b = 1; b < s.num_blocks; ++b) free_blocks.push_back(b);
  rng().Shuffle(&free_blocks);
  size_t next = 0;
  const auto take = [&] { return free_blocks.at(next++); };

  for (int i = 0; i < s.rows; ++i) {
    const bool fresh = spec.sources.empty() || spec.sources[i] > 0;
    s.sources.push_back(fresh ? take() : spec.sources[i]);
  }
  // The stock kernel reads the checkpoint at column Q (num_accepted_tokens =
  // Q + 1, as the commit's replay does) and stores token t's state to P_t.
  for (int i = 0; i < s.rows; ++i) {
    std::vector<int32_t> row;
    for (int t = 0; t < Q; ++t) row.push_back(take());
    row.push_back(s.sources[i]);
    s.stock_indices.push_back(row);
  }
  s.stock_accepted.assign(s.rows, Q + 1);
  s.num_accepted = spec.num_accepted;
  if (s.num_accepted.empty()) {
    for (int b = 0; b < s.batch; ++b) s.num_accepted.push_back(rng().Int(0, Q + 1));
  }
  s.request_indices = spec.request_indices;
  if (spec.align) {
    s.block_size = spec.block_size;
    s.num_computed = spec.num_computed;
    for (int b = 0; b < s.batch; ++b) {
      std::vector<int32_t> row;
      for (int c = 0; c < spec.width; ++c) row.push_back(take());
      s.table.push_back(row);
    }
  }

  // Pools: 32 bytes of padding between state blocks; conv blocks with
  // padding between channels (or tokens) and between blocks.
  s.block_stride = s.state_elems() + 32 / static_cast<int64_t>(s.state_size());
  s.conv_width = spec.history + Q - 1;
  if (spec.conv_token_major) {
    s.conv_token_stride = spec.conv_dim;
    s.conv_dim_stride = 1;
    s.conv_block_stride = int64_t{s.conv_width} * spec.conv_dim + 5;
  } else {
    s.conv_token_stride = 1;
    s.conv_dim_stride = s.conv_width + 1;
    s.conv_block_stride = int64_t{spec.conv_dim} * s.conv_dim_stride + 3;
  }
  for (int l = 0; l < spec.num_layers; ++l) MakeLayer(&s);

  s.stock_workspace = Zeroed(StockWorkspaceBytes(s.num_blocks));
  s.commit_workspace = Zeroed(CommitWorkspaceBytes(s.rows, Q, s.num_blocks));
  s.status = Zeroed(sizeof(DeviceStatus));
  return s;
}

void KdaKernelsTest::MakeLayer(Step* sp) {
  Step& s = *sp;
  Layer L;
  const DType act = s.shape.act_dtype;
  const size_t es = s.act_size();
  const int64_t hk = s.hk(), vw = s.vw(), gw = s.gw();
  const int64_t T = s.num_tokens;
  const int H = s.shape.num_heads;
  const int HV = s.hv();

  // q, k, v: column slices of one wide projection buffer (in an odd order,
  // at odd offsets), or three dense tensors one after the other.
  int64_t proj_elems;
  if (s.spec.strided) {
    L.k_off = 5;
    L.v_off = L.k_off + hk + 3;
    L.q_off = L.v_off + vw + 7;
    L.proj_stride = L.q_off + hk + 9;
    L.v_stride = L.proj_stride;
    proj_elems = T * L.proj_stride;
    L.beta_off = 1;
    L.beta_stride = HV + 3;
  } else {
    // Dense q [T, H, K], k, then v [T, HV, V]: q and k have stride hk, v vw.
    L.q_off = 0;
    L.k_off = T * hk;
    L.v_off = 2 * T * hk;
    L.proj_stride = hk;
    L.v_stride = vw;
    proj_elems = 2 * T * hk + T * vw;
    L.beta_off = 0;
    L.beta_stride = HV;
  }
  L.proj = Upload(RandomElements(act, proj_elems, 1.0f));
  // GDN's g is a log-decay (negative): -|x|.
  std::vector<uint8_t> g_bytes = RandomElements(act, T * gw, 1.5f);
  if (s.shape.kind == LayerKind::kGdn) {
    for (int64_t i = 0; i < T * gw; ++i) {
      ref::StoreElement(RefDtype(act), -std::fabs(rng().Normal(0.5f)), &g_bytes[i * es]);
    }
  }
  L.g = Upload(g_bytes);
  L.beta = Upload(RandomElements(act, T * L.beta_stride, 1.5f));

  const ref::Dtype rd = RefDtype(act);
  L.tokens.count = T;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < hk; ++i) {
      L.tokens.q.push_back(
          ref::LoadElement(rd, &L.proj.host[(L.q_off + t * L.proj_stride + i) * es]));
      L.tokens.k.push_back(
          ref::LoadElement(rd, &L.proj.host[(L.k_off + t * L.proj_stride + i) * es]));
    }
    for (int64_t i = 0; i < vw; ++i) {
      L.tokens.v.push_back(ref::LoadElement(rd, &L.proj.host[(L.v_off + t * L.v_stride + i) * es]));
    }
    for (int64_t i = 0; i < gw; ++i) {
      L.tokens.g.push_back(ref::LoadElement(rd, &L.g.host[(t * gw + i) * es]));
    }
    for (int h = 0; h < HV; ++h) {
      L.tokens.beta.push_back(
          ref::LoadElement(rd, &L.beta.host[(L.beta_off + t * L.beta_stride + h) * es]));
    }
  }

  // Gate parameters, different for every layer.
  std::vector<float> a_log(H), dt_bias(hk);
  for (float& x : a_log) x = rng().Uniform(-1.5f, 0.5f);
  for (float& x : dt_bias) x = rng().Normal(0.5f);
  L.a_log = Upload(ToBytes(a_log));
  L.dt_bias = Upload(ToBytes(dt_bias));
  L.params.a_log.assign(a_log.begin(), a_log.end());
  L.params.dt_bias.assign(dt_bias.begin(), dt_bias.end());

  // State pools: random checkpoints, poison everywhere else.
  std::vector<uint8_t> pool = Poisoned(s.shape.state_dtype, s.num_blocks * s.block_stride);
  for (int32_t source : s.sources) {
    if (source <= 0) continue;
    const std::vector<uint8_t> bytes = RandomElements(s.shape.state_dtype, s.state_elems(), 0.5f);
    SetBlockBytes(s, &pool, source, bytes);
    L.initial_states[source] = BlockValues(s, pool, source);
  }
  L.stock_pool = Upload(pool);
  L.pool = Upload(pool);

  // Conv pool: random everywhere; each checkpoint's block as the scheduler's
  // conv update leaves it (SEMANTICS.md, Commit step 2): history h_1 .. h_hl
  // and the step's tokens x_0 .. x_{T-1}, from column 0: h_2 .. h_hl, x_0 ...
  const int hl = s.history();
  std::vector<uint8_t> conv = RandomElements(act, s.num_blocks * s.conv_block_stride, 1.0f);
  L.conv_sequence.resize(s.rows);
  for (int i = 0; i < s.rows; ++i) {
    const int tokens = s.qsl[i + 1] - s.qsl[i];
    L.conv_sequence[i].resize(s.spec.conv_dim);
    for (int d = 0; d < s.spec.conv_dim; ++d) {
      const std::vector<uint8_t> seq_bytes = RandomElements(act, hl + tokens, 1.0f);
      std::vector<uint32_t>& seq = L.conv_sequence[i][d];
      for (int x = 0; x < hl + tokens; ++x) {
        uint32_t e = 0;
        std::memcpy(&e, &seq_bytes[x * es], es);
        seq.push_back(e);
      }
      if (s.sources[i] <= 0) continue;
      for (int x = 0; x + 1 < hl + tokens; ++x)
        SetConvElement(s, &conv, s.sources[i], d, x, seq[x + 1]);
    }
  }
  L.conv = Upload(conv);

  const size_t rec_tokens = static_cast<size_t>(s.record_rows) * s.spec.q;
  L.rec_kv = Upload(Poisoned(act, rec_tokens * (hk + vw)));
  L.rec_g = Upload(Poisoned(act, rec_tokens * gw));
  L.rec_beta = Upload(Poisoned(act, rec_tokens * HV));
  L.stock_out = Upload(Poisoned(act, T * vw));
  L.verify_out = Upload(Poisoned(act, T * vw));
  s.layers.push_back(std::move(L));
}

Activation ActivationOf(const Tensor& t, int64_t offset, int64_t stride, size_t es) {
  return Activation{static_cast<const char*>(t.data()) + offset * es, stride};
}

StockArgs KdaKernelsTest::StockArgsFor(Step& s, int l, CallData* cd) {
  const Layer& L = s.layers[l];
  const size_t es = s.act_size();
  StockArgs a;
  a.shape = s.shape;
  a.q = ActivationOf(L.proj, L.q_off, L.proj_stride, es);
  a.k = ActivationOf(L.proj, L.k_off, L.proj_stride, es);
  a.v = ActivationOf(L.proj, L.v_off, L.v_stride, es);
  a.g = ActivationOf(L.g, 0, s.gw(), es);
  a.beta = ActivationOf(L.beta, L.beta_off, L.beta_stride, es);
  a.num_tokens = s.num_tokens_arg;
  a.out = L.stock_out.data();
  a.state = StatePool{L.stock_pool.data(), s.num_blocks, s.block_stride};
  a.params = LayerParams{L.a_log.As<float>(), L.dt_bias.As<float>()};
  a.num_rows = s.rows;
  a.query_start_loc = Ints(cd, s.qsl);
  a.ssm_state_indices = Matrix(cd, s.stock_indices, s.spec.q + 3);
  a.num_accepted_tokens = s.stock_accepted.empty() ? nullptr : Ints(cd, s.stock_accepted);
  a.workspace = s.stock_workspace.data();
  a.workspace_bytes = s.stock_workspace.dev.size();
  a.status = s.status.As<DeviceStatus>();
  return a;
}

VerifyArgs KdaKernelsTest::VerifyArgsFor(Step& s, int l, CallData* cd) {
  const Layer& L = s.layers[l];
  const size_t es = s.act_size();
  VerifyArgs a;
  a.shape = s.shape;
  a.q = ActivationOf(L.proj, L.q_off, L.proj_stride, es);
  a.k = ActivationOf(L.proj, L.k_off, L.proj_stride, es);
  a.v = ActivationOf(L.proj, L.v_off, L.v_stride, es);
  a.g = ActivationOf(L.g, 0, s.gw(), es);
  a.beta = ActivationOf(L.beta, L.beta_off, L.beta_stride, es);
  a.num_tokens = s.num_tokens_arg;
  a.out = L.verify_out.data();
  a.state = StatePool{L.pool.data(), s.num_blocks, s.block_stride};
  a.params = LayerParams{L.a_log.As<float>(), L.dt_bias.As<float>()};
  a.records = Records{L.rec_kv.data(), L.rec_g.data(), L.rec_beta.data(), s.record_rows, s.spec.q};
  a.num_rows = s.rows;
  a.query_start_loc = Ints(cd, s.qsl);
  std::vector<std::vector<int32_t>> indices;
  for (int32_t b : s.sources) indices.push_back({b});
  a.state_indices = Matrix(cd, indices, 2);  // a column of a wider tensor
  // Where the checks copy the indices (the service's step snapshot).
  cd->tensors.push_back(Upload(ToBytes(std::vector<int32_t>(s.rows + 1, 0))));
  a.snapshot_query_start_loc = cd->tensors.back().As<int32_t>();
  cd->tensors.push_back(Upload(ToBytes(std::vector<int32_t>(std::max(s.rows, 1), 0))));
  a.snapshot_state_indices = cd->tensors.back().As<int32_t>();
  a.status = s.status.As<DeviceStatus>();
  return a;
}

CommitArgs KdaKernelsTest::CommitArgsFor(Step& s, CallData* cd) {
  for (const Layer& L : s.layers) {
    CommitLayer c;
    c.state = StatePool{L.pool.data(), s.num_blocks, s.block_stride};
    c.conv = ConvPool{L.conv.data(),       s.num_blocks,    s.conv_block_stride, s.conv_dim_stride,
                      s.conv_token_stride, s.spec.conv_dim, s.conv_width};
    c.params = LayerParams{L.a_log.As<float>(), L.dt_bias.As<float>()};
    c.records =
        Records{L.rec_kv.data(), L.rec_g.data(), L.rec_beta.data(), s.record_rows, s.spec.q};
    cd->layers.push_back(c);
  }
  cd->tensors.push_back(Upload(ToBytes(cd->layers)));
  CommitArgs a;
  a.shape = s.shape;
  a.spec_query_len = s.spec.q;
  a.num_layers = static_cast<int>(cd->layers.size());
  a.layers = cd->layers.data();
  a.device_layers = cd->tensors.back().As<CommitLayer>();
  a.num_rows = s.rows;
  a.query_start_loc = Ints(cd, s.qsl);
  std::vector<std::vector<int32_t>> indices;
  for (int32_t b : s.sources) indices.push_back({b});
  a.state_indices = Matrix(cd, indices, 3);
  a.batch = s.batch;
  a.num_accepted = Ints(cd, s.num_accepted);
  a.request_indices = s.request_indices.empty() ? nullptr : Ints(cd, s.request_indices);
  if (s.spec.align) {
    a.block_table = Matrix(cd, s.table, s.spec.width + 1);
    a.num_computed_tokens = Ints(cd, s.num_computed);
    a.mamba_block_size = s.block_size;
  }
  a.workspace = s.commit_workspace.data();
  a.workspace_bytes = s.commit_workspace.dev.size();
  a.status = s.status.As<DeviceStatus>();
  return a;
}

// After a commit: every state block the reference plan commits holds, bit for
// bit, the state the stock kernel stored for the same token (final: column
// commit_len - 1; boundary: column boundary_len - 1); every other byte of
// every state pool is as it was; the conv windows are the scheduler's.
void KdaKernelsTest::ExpectCommitMatchesStock(const Step& s, const Snapshot& before) {
  const std::vector<ref::PlanRow> plan = ref::PlanCommit(RefCommitCall(s));
  const Snapshot after = TakeSnapshot(s);
  for (int l = 0; l < s.spec.num_layers; ++l) {
    SCOPED_TRACE(absl::StrCat("layer ", l));
    const size_t base = static_cast<size_t>(l) * kBuffersPerLayer;
    const std::vector<uint8_t>& stock = after[base + kStockPool].second;
    const std::vector<uint8_t>& pool_before = before[base + kPool].second;
    const std::vector<uint8_t>& pool = after[base + kPool].second;
    std::vector<uint8_t> expected = pool_before;
    for (int i = 0; i < s.rows; ++i) {
      const ref::PlanRow& p = plan[i];
      if (!Commits(p)) continue;
      if (p.boundary_block > 0 && p.boundary_len < p.commit_len) {
        SetBlockBytes(s, &expected, p.boundary_block,
                      BlockBytes(s, stock, s.stock_indices[i][p.boundary_len - 1]));
      }
      SetBlockBytes(s, &expected, p.final_block,
                    BlockBytes(s, stock, s.stock_indices[i][p.commit_len - 1]));
    }
    for (int i = 0; i < s.rows; ++i) {
      const ref::PlanRow& p = plan[i];
      SCOPED_TRACE(absl::StrCat("row ", i, ": tokens ", s.qsl[i + 1] - s.qsl[i], ", source ",
                                p.source, ", commit_len ", p.commit_len, ", final ", p.final_block,
                                ", boundary ", p.boundary_block, " after ", p.boundary_len));
      for (int32_t block : {p.source, p.final_block, p.boundary_block}) {
        if (block <= 0) continue;
        EXPECT_EQ(FirstDifference(BlockBytes(s, pool, block), BlockBytes(s, expected, block)), -1)
            << "state block " << block;
      }
    }
    EXPECT_EQ(FirstDifference(pool, expected), -1) << "state pool (any block)";
    // Nothing else of the layer changed but its conv pool.
    for (size_t j = 0; j < kBuffersPerLayer; ++j) {
      if (j == kPool || j == kConv) continue;
      EXPECT_EQ(FirstDifference(before[base + j].second, after[base + j].second), -1)
          << before[base + j].first << " changed";
    }
    ExpectConvMatchesScheduler(s, plan, l, before[base + kConv].second);
  }
}

// The conv window the next step reads, element by element: after a commit
// of c tokens the final block's columns [0, hl) hold the last hl entries of
// h_1 .. h_hl, x_0 .. x_{c-1}; that is the window the stock path reads at
// offset c - 1 (SEMANTICS.md, Commit step 2). A boundary block holds the
// window after boundary_len tokens. Everything else is unchanged.
void KdaKernelsTest::ExpectConvMatchesScheduler(const Step& s,
                                                const std::vector<ref::PlanRow>& plan, int l,
                                                const std::vector<uint8_t>& before) {
  const Layer& L = s.layers[l];
  const std::vector<uint8_t> conv = L.conv.Read();
  std::vector<uint8_t> expected = before;
  const int hl = s.history();
  int mismatches = 0;
  for (int i = 0; i < s.rows; ++i) {
    const ref::PlanRow& p = plan[i];
    if (!Commits(p)) continue;
    std::vector<std::pair<int32_t, int>> windows;  // (block, tokens), in store order
    if (s.spec.align && p.boundary_block > 0)
      windows.emplace_back(p.boundary_block, p.boundary_len);
    windows.emplace_back(p.final_block, p.commit_len);
    for (const auto& [block, c] : windows) {
      for (int d = 0; d < s.spec.conv_dim; ++d) {
        const std::vector<uint32_t>& seq = L.conv_sequence[i][d];
        for (int x = 0; x < hl; ++x) {
          SetConvElement(s, &expected, block, d, x, seq[c + x]);
          const uint32_t got = ConvElement(s, conv, block, d, x);
          if (got != seq[c + x] && ++mismatches <= 8) {
            ADD_FAILURE() << "row " << i << ": conv block " << block << " [" << d << ", " << x
                          << "] = " << got << ", expected " << seq[c + x] << " (window after " << c
                          << " tokens)";
          }
        }
      }
    }
  }
  const int64_t at = FirstDifference(conv, expected);
  EXPECT_EQ(at, -1) << "conv pool differs from the expected windows at byte " << at;
  // The reference's compaction agrees element for element.
  ref::ConvPool model = RefConv(s, before);
  ref::CompactConv(RefCommitCall(s), plan, hl, &model);
  const ref::ConvPool got = RefConv(s, conv);
  EXPECT_TRUE(model.elements == got.elements) << "conv pool differs from the reference";
}

// Outputs against the reference: written tokens within Tolerance(act) as
// one tensor; tokens the reference leaves alone still poisoned.
void ExpectOutputs(const Step& s, const std::vector<uint8_t>& out, const std::vector<double>& want,
                   const std::vector<bool>& written) {
  const size_t per_token = static_cast<size_t>(s.vw());
  const size_t es = s.act_size();
  std::vector<double> got_values, want_values;
  for (int64_t t = 0; t < s.num_tokens; ++t) {
    const uint8_t* token = &out[t * per_token * es];
    if (!written[t]) {
      EXPECT_TRUE(IsPoison(s.shape.act_dtype, token, per_token))
          << "output token " << t << " was written";
      continue;
    }
    for (size_t i = 0; i < per_token; ++i) {
      got_values.push_back(ref::LoadElement(RefDtype(s.shape.act_dtype), token + i * es));
      want_values.push_back(want[t * per_token + i]);
    }
  }
  if (!want_values.empty()) {
    EXPECT_LT(RelativeError(got_values, want_values), Tolerance(s.shape.act_dtype))
        << "outputs vs the float64 reference";
    EXPECT_LT(ElementwiseError(got_values, want_values), Tolerance(s.shape.act_dtype))
        << "outputs vs the float64 reference, element-wise";
  }
}

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

const Config kConfigs[] = {
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

StepSpec SpecOf(const Config& c) {
  StepSpec spec;
  spec.act = c.act;
  spec.state = c.state;
  spec.heads = c.heads;
  spec.head_dim = c.head_dim;
  spec.strided = c.strided;
  spec.kind = c.kind;
  spec.value_heads = c.value_heads;
  spec.gate = c.gate;
  return spec;
}

// ---------------------------------------------------------------------------
// The reference.

TEST(ReferenceTest, ConversionsRoundLikeTheKernels) {
  // Every 16-bit pattern decodes alike.
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const uint16_t b = static_cast<uint16_t>(bits);
    const float want_bf16 = ToFloat(BFloat16{b});
    const float want_fp16 = ToFloat(Float16{b});
    if (std::isnan(want_bf16)) {
      EXPECT_TRUE(std::isnan(ref::BFloat16ToFloat(b))) << bits;
    } else {
      EXPECT_EQ(ref::BFloat16ToFloat(b), want_bf16) << bits;
    }
    if (std::isnan(want_fp16)) {
      EXPECT_TRUE(std::isnan(ref::Float16ToFloat(b))) << bits;
    } else {
      EXPECT_EQ(ref::Float16ToFloat(b), want_fp16) << bits;
    }
  }
  // Rounding: ties, subnormals, overflow and random floats of every scale.
  std::vector<float> values = {0.0f,        -0.0f,         1.0f,          65504.0f, 65519.0f,
                               65520.0f,    1e-8f,         6e-8f,         3e-8f,    1.00390625f,
                               1.01171875f, 1.0009765625f, 1.0029296875f, 3.4e38f,  -2.5e-41f,
                               INFINITY,    -INFINITY};
  std::mt19937 engine(12345);
  std::uniform_int_distribution<uint32_t> any_bits;
  for (int i = 0; i < 200000; ++i) {
    float f;
    const uint32_t u = any_bits(engine);
    std::memcpy(&f, &u, sizeof(f));
    if (!std::isnan(f)) values.push_back(f);
  }
  for (float f : values) {
    EXPECT_EQ(ref::BFloat16FromFloat(f), FromFloat<BFloat16>(f).bits) << f;
    EXPECT_EQ(ref::Float16FromFloat(f), FromFloat<Float16>(f).bits) << f;
  }
}

// ---------------------------------------------------------------------------
// Agreement with the float64 reference.

TEST_P(KdaKernelsTest, StockMatchesReference) {
  for (const Config& c : kConfigs) {
    StepSpec spec = SpecOf(c);
    spec.tokens = {4, 2, 0, 4, 1, 3};
    spec.sources = {1, 1, 1, 0, 1, -1};  // rows 3 and 5 read a null block
    Step s = MakeStep(spec);
    SCOPED_TRACE(Describe(spec));
    const int Q = spec.q;
    // The checkpoint sits at a random column acc - 1 (num_accepted_tokens);
    // the row stores each token's state to its column, overwriting the
    // checkpoint when acc - 1 < T. Row 0 skips one column (null: not stored).
    for (int n = 0; n < s.rows; ++n) {
      const int acc = rng().Int(1, Q + 1);
      std::swap(s.stock_indices[n][acc - 1], s.stock_indices[n][Q]);
      s.stock_accepted[n] = acc;
    }
    s.stock_indices[0][s.stock_accepted[0] == 1 ? 1 : 0] = 0;

    const Layer& L = s.layers[0];
    ASSERT_TRUE(CallOk(RunStock(s, 0)));
    ExpectOwnerTableClear(s.stock_workspace, s.num_blocks);

    ref::StatePool model = L.initial_states;
    const ref::StockResult want =
        ref::Stock(RefShape(s), L.params, L.tokens, RefStockCall(s), &model);
    ExpectOutputs(s, L.stock_out.Read(), want.out, want.written);

    const std::vector<uint8_t> pool = L.stock_pool.Read();
    std::vector<uint8_t> rest = pool;  // the pool with the written blocks put back
    for (int n = 0; n < s.rows; ++n) {
      const int tokens = s.qsl[n + 1] - s.qsl[n];
      if (tokens == 0 || s.stock_indices[n][s.stock_accepted[n] - 1] <= 0) continue;
      for (int t = 0; t < tokens; ++t) {
        const int32_t block = s.stock_indices[n][t];
        if (block <= 0) continue;
        const std::vector<double> got = BlockValues(s, pool, block);
        EXPECT_LT(RelativeError(got, model.at(block)), Tolerance(s.shape.state_dtype))
            << "row " << n << ", state after token " << t << " (block " << block << ")";
        EXPECT_LT(ElementwiseError(got, model.at(block)), Tolerance(s.shape.state_dtype))
            << "row " << n << ", state after token " << t << " (block " << block
            << "), element-wise";
        SetBlockBytes(s, &rest, block, BlockBytes(s, L.stock_pool.host, block));
      }
    }
    EXPECT_EQ(FirstDifference(rest, L.stock_pool.host), -1) << "a block no row stores changed";
  }
}

TEST_P(KdaKernelsTest, VerifyMatchesReference) {
  for (const Config& c : kConfigs) {
    StepSpec spec = SpecOf(c);
    spec.tokens = {4, 2, 0, 4, 1, 3};
    spec.sources = {1, 1, 1, 0, 1, -1};
    Step s = MakeStep(spec);
    SCOPED_TRACE(Describe(spec));
    const Layer& L = s.layers[0];
    ASSERT_TRUE(CallOk(RunVerify(s, 0)));

    ref::Records records = ref::MakeRecords(RefShape(s), s.record_rows, spec.q);
    const ref::VerifyResult want =
        ref::Verify(RefShape(s), L.params, L.tokens, RefVerifyCall(s), L.initial_states, &records);
    ExpectOutputs(s, L.verify_out.Read(), want.out, want.written);

    // Records: raw copies, bit for bit, of the tokens verified; poison
    // elsewhere (rows with a null checkpoint, tokens past T_n, the spare row).
    const std::vector<uint8_t> kv = L.rec_kv.Read();
    const std::vector<uint8_t> g = L.rec_g.Read();
    const std::vector<uint8_t> beta = L.rec_beta.Read();
    const size_t es = s.act_size();
    const size_t hk_bytes = s.hk() * es, vw_bytes = s.vw() * es, gw_bytes = s.gw() * es;
    const size_t h_bytes = s.hv() * es;
    for (size_t r = 0; r < records.source_token.size(); ++r) {
      const int64_t src = records.source_token[r];
      const uint8_t* rk = &kv[r * (hk_bytes + vw_bytes)];
      const uint8_t* rv = rk + hk_bytes;
      const uint8_t* rg = &g[r * gw_bytes];
      const uint8_t* rb = &beta[r * h_bytes];
      if (src < 0) {
        const DType act = s.shape.act_dtype;
        EXPECT_TRUE(IsPoison(act, rk, s.hk() + s.vw()) && IsPoison(act, rg, s.gw()) &&
                    IsPoison(act, rb, s.hv()))
            << "record token " << r << " was written";
        continue;
      }
      EXPECT_EQ(std::memcmp(rk, &L.proj.host[(L.k_off + src * L.proj_stride) * es], hk_bytes), 0)
          << "record token " << r << ": k";
      EXPECT_EQ(std::memcmp(rv, &L.proj.host[(L.v_off + src * L.v_stride) * es], vw_bytes), 0)
          << "record token " << r << ": v";
      EXPECT_EQ(std::memcmp(rg, &L.g.host[src * gw_bytes], gw_bytes), 0)
          << "record token " << r << ": g";
      EXPECT_EQ(std::memcmp(rb, &L.beta.host[(L.beta_off + src * L.beta_stride) * es], h_bytes), 0)
          << "record token " << r << ": beta";
    }
    EXPECT_EQ(FirstDifference(L.pool.Read(), L.pool.host), -1) << "verify wrote state";
  }
}

TEST_P(KdaKernelsTest, CommitMatchesReference) {
  const Config configs[] = {kConfigs[1], kConfigs[2], kConfigs[4], kConfigs[6]};
  for (const Config& c : configs) {
    for (bool align : {false, true}) {
      StepSpec spec = SpecOf(c);
      spec.num_layers = 2;
      spec.tokens = {4, 3, 4, 0, 4, 2};
      spec.sources = {1, 1, 1, 1, 0, 1};
      spec.num_accepted = {4, 2, 1, 3, 2, 5};
      if (align) {
        spec.align = true;
        spec.block_size = 8;
        spec.width = 4;
        spec.num_computed = {5, 6, 13, 0, 3, 23};
      }
      Step s = MakeStep(spec);
      SCOPED_TRACE(Describe(spec));
      StockAndVerifyAll(s);
      ASSERT_TRUE(CallOk(RunCommit(s)));

      std::vector<ref::Records> records;
      std::vector<ref::StatePool> states;
      std::vector<ref::ConvPool> convs;
      for (const Layer& L : s.layers) {
        records.push_back(ref::MakeRecords(RefShape(s), s.record_rows, spec.q));
        ref::Verify(RefShape(s), L.params, L.tokens, RefVerifyCall(s), L.initial_states,
                    &records.back());
        states.push_back(L.initial_states);
        convs.push_back(RefConv(s, L.conv.host));
      }
      std::vector<ref::CommitLayer> model;
      for (int l = 0; l < spec.num_layers; ++l) {
        model.push_back(ref::CommitLayer{s.layers[l].params, &records[l], &states[l], &convs[l]});
      }
      const std::vector<ref::PlanRow> plan =
          ref::Commit(RefShape(s), RefCommitCall(s), s.history(), &model);
      for (int l = 0; l < spec.num_layers; ++l) {
        const std::vector<uint8_t> pool = s.layers[l].pool.Read();
        int compared = 0;
        for (int i = 0; i < s.rows; ++i) {
          const ref::PlanRow& p = plan[i];
          if (!Commits(p)) continue;
          std::vector<int32_t> blocks = {p.final_block};
          if (p.boundary_block > 0) blocks.push_back(p.boundary_block);
          for (int32_t block : blocks) {
            const std::vector<double> got = BlockValues(s, pool, block);
            EXPECT_LT(RelativeError(got, states[l].at(block)), Tolerance(s.shape.state_dtype))
                << "layer " << l << ", row " << i << ", block " << block;
            EXPECT_LT(ElementwiseError(got, states[l].at(block)), Tolerance(s.shape.state_dtype))
                << "layer " << l << ", row " << i << ", block " << block << ", element-wise";
            ++compared;
          }
        }
        EXPECT_GE(compared, 4) << "the plan should commit most rows";
        EXPECT_TRUE(RefConv(s, s.layers[l].conv.Read()).elements == convs[l].elements)
            << "layer " << l << ": conv pool differs from the reference";
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Bit identity between the kernels.

TEST_P(KdaKernelsTest, VerifyOutputsEqualStockOutputs) {
  for (const Config& c : kConfigs) {
    StepSpec spec = SpecOf(c);
    spec.q = 5;
    for (int n = 0; n < 6; ++n) spec.tokens.push_back(rng().Int(0, spec.q));
    spec.sources = {1, 1, 0, 1, -4, 1};
    Step s = MakeStep(spec);
    SCOPED_TRACE(Describe(spec));
    // Stock as the commit's replay calls it: checkpoint at column Q.
    StockAndVerifyAll(s);
    // And as the stock spec path calls it: checkpoint at column 0, no
    // num_accepted_tokens.
    for (int n = 0; n < s.rows; ++n) std::swap(s.stock_indices[n][0], s.stock_indices[n][spec.q]);
    s.stock_accepted.clear();
    s.layers[0].stock_out.Write(s.layers[0].stock_out.host);  // poison again
    s.layers[0].stock_pool.Write(s.layers[0].stock_pool.host);
    ASSERT_TRUE(CallOk(RunStock(s, 0)));
    EXPECT_EQ(FirstDifference(s.layers[0].stock_out.Read(), s.layers[0].verify_out.Read()), -1)
        << "verify's outputs differ from the stock kernel's (checkpoint at column 0)";
  }
}

// The rows every commit test runs (mode none): full and partial acceptance,
// nothing accepted, more accepted than verified, no tokens, null
// checkpoints (0 and negative) and padding rows at the end.
struct CommitRow {
  int tokens;
  int32_t source;  // > 0: a fresh block
  int accepted;
};

std::vector<CommitRow> NoneModeRows(int Q, Random& rng) {
  return {
      {Q, 1, Q},                              // everything accepted
      {Q, 1, 1},                              // only the bonus token
      {Q, 1, 0},                              // nothing: state unchanged
      {std::max(Q - 2, 1), 1, Q + 3},         // more than verified: commit T_n
      {0, 1, 2},                              // no tokens
      {Q, 0, 2},                              // null checkpoint
      {Q - 1, -1, 2},                         // negative = null
      {Q, 1, rng.Int(1, Q)},                  // random
      {1, 1, -1},                             // negative accepted count
      {rng.Int(1, Q), 1, rng.Int(0, Q + 2)},  // random
      {0, 0, rng.Int(0, Q)},                  // cudagraph padding
      {0, 0, rng.Int(0, Q)},                  // cudagraph padding
  };
}

TEST_P(KdaKernelsTest, CommitEqualsStockState) {
  struct Trial {
    Config config;
    int q;
    int history;
    bool conv_token_major;
    bool remap;  // request_indices
  };
  const Trial trials[] = {
      {{DType::kBFloat16, DType::kFloat32, 3, 64, true}, 4, 3, false, true},
      {{DType::kFloat16, DType::kBFloat16, 2, 64, true}, 3, 2, true, true},
      {{DType::kFloat32, DType::kFloat32, 1, 64, false}, 5, 3, false, false},
      {{DType::kFloat32, DType::kBFloat16, 2, 64, true}, 2, 3, true, true},
      {{DType::kBFloat16, DType::kBFloat16, 1, 128, true}, 4, 3, false, true},
      // The largest window (16 tokens) and conv history (16 columns).
      {{DType::kBFloat16, DType::kFloat32, 1, 64, true}, kMaxSpecQueryLen, kMaxConvHistory, true,
       true},
      // No draft tokens: Q = 1, conv_kernel = 2.
      {{DType::kFloat16, DType::kFloat32, 2, 64, true}, 1, 1, false, true},
  };
  for (const Trial& trial : trials) {
    StepSpec spec = SpecOf(trial.config);
    spec.q = trial.q;
    spec.num_layers = 3;  // different parameters and inputs each
    spec.history = trial.history;
    spec.conv_token_major = trial.conv_token_major;
    const std::vector<CommitRow> rows = NoneModeRows(spec.q, rng());
    const int n = static_cast<int>(rows.size());
    spec.batch = trial.remap ? n + 3 : n;
    std::vector<int32_t> batch_rows(spec.batch);
    for (int b = 0; b < spec.batch; ++b) batch_rows[b] = b;
    if (trial.remap) rng().Shuffle(&batch_rows);
    // Batch rows no spec row maps to hold counts that would break the plan.
    spec.num_accepted.assign(spec.batch, 1000);
    for (int i = 0; i < n; ++i) {
      spec.tokens.push_back(rows[i].tokens);
      spec.sources.push_back(rows[i].source);
      spec.num_accepted[batch_rows[i]] = rows[i].accepted;
      if (trial.remap) spec.request_indices.push_back(batch_rows[i]);
    }
    Step s = MakeStep(spec);
    SCOPED_TRACE(Describe(spec));

    StockAndVerifyAll(s);
    const Snapshot before = TakeSnapshot(s);
    ASSERT_TRUE(CallOk(RunCommit(s)));
    ExpectOwnerTableClear(s.commit_workspace, s.num_blocks);
    ExpectCommitMatchesStock(s, before);
  }
}

// The step's cancellation word (Prerequisites::cancelled): holding the call's
// generation, Verify and Commit fail CANCELLED and write nothing; holding
// another step's, the commit runs.
TEST_P(KdaKernelsTest, CancelledStepRunsNothing) {
  Step s = MakeThreeRowStep();
  StockAndVerifyAll(s);
  if (HasFatalFailure()) return;
  BackendBuffer word = Must(BackendBuffer::Allocate(backend(), sizeof(uint32_t)), "word");
  const uint32_t generation = 0x9e3779b9u;
  ASSERT_TRUE(word.Upload(&generation, sizeof(generation)).ok());
  Prerequisites cancelled;
  cancelled.cancelled = word.As<uint32_t>();
  cancelled.generation = generation;
  const Snapshot before = TakeSnapshot(s);
  {
    const CallResult r = RunVerify(s, 0, cancelled);
    ASSERT_TRUE(r.launch.ok()) << r.launch;
    EXPECT_EQ(r.device.code(), absl::StatusCode::kCancelled) << r.device;
    EXPECT_THAT(std::string(r.device.message()), HasSubstr("its step was cancelled"));
  }
  {
    const CallResult r = RunCommit(s, cancelled);
    ASSERT_TRUE(r.launch.ok()) << r.launch;
    EXPECT_EQ(r.device.code(), absl::StatusCode::kCancelled) << r.device;
  }
  ExpectSameBytes(before, TakeSnapshot(s));
  Prerequisites another_step = cancelled;
  another_step.generation = generation + 1;
  ASSERT_TRUE(CallOk(RunCommit(s, another_step)));
  ExpectCommitMatchesStock(s, before);
}

// Batch invariance: a row's outputs and committed state do not depend on the
// other rows or on N. Row 0 inside a step of 256 rows, then alone (N = 1,
// the same inputs and initial state), bit for bit.
TEST_P(KdaKernelsTest, ARowComputesTheSameAloneAndInABatchOf256) {
  StepSpec spec;
  spec.head_dim = 128;
  for (int n = 0; n < 256; ++n) {
    spec.tokens.push_back(rng().Int(1, spec.q));
    spec.sources.push_back(1);
    spec.num_accepted.push_back(rng().Int(1, spec.q));
  }
  Step s = MakeStep(spec);
  Layer& L = s.layers[0];
  const std::vector<uint8_t> initial = L.pool.Read();
  ASSERT_TRUE(CallOk(RunVerify(s, 0)));
  ASSERT_TRUE(CallOk(RunCommit(s)));
  const std::vector<uint8_t> batch_out = L.verify_out.Read();
  const std::vector<uint8_t> batch_pool = L.pool.Read();

  L.pool.Write(initial);
  L.verify_out.Write(std::vector<uint8_t>(batch_out.size(), 0x5a));
  s.rows = 1;
  s.batch = 1;
  s.qsl = {0, s.qsl[1]};
  s.sources = {s.sources[0]};
  s.num_accepted = {s.num_accepted[0]};
  ASSERT_TRUE(CallOk(RunVerify(s, 0)));
  ASSERT_TRUE(CallOk(RunCommit(s)));
  const size_t out_bytes = size_t(s.qsl[1]) * s.vw() * s.act_size();
  const std::vector<uint8_t> alone_out = L.verify_out.Read();
  EXPECT_EQ(FirstDifference(std::vector<uint8_t>(batch_out.begin(), batch_out.begin() + out_bytes),
                            std::vector<uint8_t>(alone_out.begin(), alone_out.begin() + out_bytes)),
            -1)
      << "row 0's outputs differ alone and in the batch";
  const size_t block_bytes = size_t(s.state_elems()) * s.state_size();
  const size_t at = size_t(s.sources[0]) * size_t(s.block_stride) * s.state_size();
  const std::vector<uint8_t> alone_pool = L.pool.Read();
  EXPECT_EQ(FirstDifference(
                std::vector<uint8_t>(batch_pool.begin() + at, batch_pool.begin() + at + block_bytes),
                std::vector<uint8_t>(alone_pool.begin() + at, alone_pool.begin() + at + block_bytes)),
            -1)
      << "row 0's committed state differs alone and in the batch";
}

// The input-fault word (Prerequisites::input_fault, set by the CPU service's
// SIGBUS handler when a region the call read was truncated under it): the
// call fails DATA_LOSS after its loads and writes nothing; a clear word
// lets the same call through.
TEST_P(KdaKernelsTest, InputFaultRunsNothing) {
  Step s = MakeThreeRowStep();
  StockAndVerifyAll(s);
  if (HasFatalFailure()) return;
  BackendBuffer word = Must(BackendBuffer::Allocate(backend(), sizeof(uint32_t)), "word");
  const uint32_t faulted = 1;
  ASSERT_TRUE(word.Upload(&faulted, sizeof(faulted)).ok());
  Prerequisites fault;
  fault.input_fault = word.As<uint32_t>();
  const Snapshot before = TakeSnapshot(s);
  for (const CallResult& r : {RunVerify(s, 0, fault), RunCommit(s, fault)}) {
    ASSERT_TRUE(r.launch.ok()) << r.launch;
    EXPECT_EQ(r.device.code(), absl::StatusCode::kDataLoss) << r.device;
    EXPECT_THAT(std::string(r.device.message()), HasSubstr("reading its inputs faulted"));
  }
  ExpectSameBytes(before, TakeSnapshot(s));
  const uint32_t clear = 0;
  ASSERT_TRUE(word.Upload(&clear, sizeof(clear)).ok());
  ASSERT_TRUE(CallOk(RunCommit(s, fault)));
  ExpectCommitMatchesStock(s, before);
}

// Verify copies the caller's indices to its snapshot (dense, where the
// service keeps the step's), which its later checks and its kernel read
// (every other Verify test checks the outputs computed from it); a call
// with neither a snapshot nor expected values is refused.
TEST_P(KdaKernelsTest, VerifyCopiesItsIndicesToTheSnapshot) {
  Step s = MakeThreeRowStep();
  StockAndVerifyAll(s);
  if (HasFatalFailure()) return;
  CallData cd;
  VerifyArgs a = VerifyArgsFor(s, 0, &cd);
  const size_t n = cd.tensors.size();
  VerifyArgs none = a;
  none.snapshot_query_start_loc = nullptr;
  none.snapshot_state_indices = nullptr;
  const absl::Status refused = kernels_->Verify(none, stream());
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("one of the two pairs"));
  VerifyArgs half = a;
  half.snapshot_state_indices = nullptr;
  EXPECT_EQ(kernels_->Verify(half, stream()).code(), absl::StatusCode::kInvalidArgument);
  a.status_mirror = ZeroedMirror();
  ASSERT_TRUE(CallOk(Finish(kernels_->Verify(a, stream()), "Verify", s)));
  EXPECT_EQ(FromBytes<int32_t>(cd.tensors[n - 2].Read()), s.qsl);
  EXPECT_EQ(FromBytes<int32_t>(cd.tensors[n - 1].Read()), s.sources);
}

// LoadParams copies finite parameters, and refuses a NaN or an infinity in
// either tensor naming its element, leaving the destination as it was.
TEST_P(KdaKernelsTest, LoadParamsChecksFinitenessOnTheDevice) {
  const int H = rng().Int(1, 6);
  const int K = 64;
  const int count = H + H * K;
  std::vector<float> src(count), old(count);
  for (float& x : src) x = rng().Uniform(-2.0f, 2.0f);
  for (float& x : old) x = rng().Uniform(-2.0f, 2.0f);
  Tensor staging = Zeroed(count * sizeof(float));
  Tensor dst = Upload(ToBytes(old));
  BackendBuffer status = Must(BackendBuffer::Allocate(backend(), sizeof(DeviceStatus)), "status");
  const auto run = [&](const std::vector<float>& values) {
    Tensor source = Upload(ToBytes(values));
    LoadParamsArgs a;
    a.num_heads = H;
    a.head_dim = K;
    a.a_log = source.As<float>();
    a.dt_bias = source.As<float>() + H;
    a.staging = staging.As<float>();
    a.dst_a_log = dst.As<float>();
    a.dst_dt_bias = dst.As<float>() + H;
    a.status = status.As<DeviceStatus>();
    a.status_mirror = ZeroedMirror();
    return Finish(kernels_->LoadParams(a, stream()), "LoadParams", status.As<DeviceStatus>());
  };
  for (float bad : {std::nanf(""), INFINITY, -INFINITY}) {
    const int at = rng().Int(0, count - 1);
    SCOPED_TRACE(absl::StrCat(bad, " at ", at));
    std::vector<float> values = src;
    values[at] = bad;
    const CallResult r = run(values);
    ASSERT_TRUE(r.launch.ok()) << r.launch;
    EXPECT_EQ(r.device.code(), absl::StatusCode::kInvalidArgument) << r.device;
    const std::string element =
        at < H ? absl::StrCat("a_log[", at, "]") : absl::StrCat("dt_bias[", at - H, "]");
    EXPECT_THAT(std::string(r.device.message()), HasSubstr(element + " is not finite"));
    EXPECT_EQ(FromBytes<float>(dst.Read()), old);
  }
  ASSERT_TRUE(CallOk(run(src)));
  EXPECT_EQ(FromBytes<float>(dst.Read()), src);
}

// A later Verify of a step checks its query_start_loc and state_indices
// against the step's first call's (VerifyArgs::expected_*): an element that
// differs fails INVALID_ARGUMENT naming it and both values, and writes nothing.
TEST_P(KdaKernelsTest, VerifyChecksIndicesAgainstTheStepsFirstCall) {
  Step s = MakeThreeRowStep();
  StockAndVerifyAll(s);
  if (HasFatalFailure()) return;
  const Snapshot before = TakeSnapshot(s);
  const int rows = static_cast<int>(s.sources.size());
  struct Case {
    int qsl_element;  // -1: none differs
    int source_row;   // -1: none differs
  };
  // The last case passes: it runs after the snapshot comparison.
  const std::vector<Case> cases = {
      {0, -1}, {rng_->Int(1, rows), -1}, {-1, rng_->Int(0, rows - 1)}, {-1, -1}};
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat("query_start_loc element ", c.qsl_element, ", state_indices row ",
                              c.source_row));
    std::vector<int32_t> first_qsl = s.qsl;
    std::vector<int32_t> first_sources = s.sources;
    std::string named;
    if (c.qsl_element >= 0) {
      first_qsl[c.qsl_element] += rng_->Int(1, 3);
      named = absl::StrCat("query_start_loc[", c.qsl_element, "] = ", s.qsl[c.qsl_element],
                           " differs from ", first_qsl[c.qsl_element]);
    }
    if (c.source_row >= 0) {
      first_sources[c.source_row] += rng_->Int(1, 3);
      named = absl::StrCat("state_indices[", c.source_row, "] = ", s.sources[c.source_row],
                           " differs from ", first_sources[c.source_row]);
    }
    CallData cd;
    VerifyArgs a = VerifyArgsFor(s, 0, &cd);
    a.snapshot_query_start_loc = nullptr;
    a.snapshot_state_indices = nullptr;
    a.expected_query_start_loc = Ints(&cd, first_qsl);
    a.expected_state_indices = Ints(&cd, first_sources);
    a.status_mirror = ZeroedMirror();
    const CallResult r = Finish(kernels_->Verify(a, stream()), "Verify", s);
    if (named.empty()) {
      ExpectSameBytes(before, TakeSnapshot(s));
      EXPECT_TRUE(CallOk(r));
      continue;
    }
    ASSERT_TRUE(r.launch.ok()) << r.launch;
    EXPECT_EQ(r.device.code(), absl::StatusCode::kInvalidArgument) << r.device;
    EXPECT_THAT(std::string(r.device.message()), HasSubstr(named));
  }
}

// An earlier call of the step that failed on the device
// (Prerequisites::statuses): Verify and Commit run nothing and name the
// lowest failed call, also when a row of their own is bad (the checks load
// the prerequisites and the rows together, and the prerequisites decide).
TEST_P(KdaKernelsTest, FailedEarlierCallStopsTheStep) {
  Step s = MakeThreeRowStep();
  StockAndVerifyAll(s);
  if (HasFatalFailure()) return;
  constexpr int kCalls = 7;
  std::vector<DeviceStatus> statuses(kCalls, DeviceStatus{});
  const int lowest = rng_->Int(2, 4);
  statuses[lowest].failed = 1;
  statuses[kCalls - 1].failed = 1;
  BackendBuffer earlier =
      Must(BackendBuffer::Allocate(backend(), sizeof(DeviceStatus) * kCalls), "statuses");
  ASSERT_TRUE(earlier.Upload(statuses.data(), sizeof(DeviceStatus) * kCalls).ok());
  Prerequisites failed_earlier;
  failed_earlier.statuses = earlier.As<DeviceStatus>();
  failed_earlier.count = kCalls;
  const Snapshot before = TakeSnapshot(s);
  const std::string named = absl::StrCat("earlier call ", lowest, " of the same step failed");
  for (bool bad_row : {false, true}) {
    SCOPED_TRACE(bad_row ? "and a bad row" : "rows valid");
    const std::vector<int32_t> sources = s.sources;
    if (bad_row) s.sources[1] = static_cast<int32_t>(s.num_blocks);  // past the pool
    const CallResult r = RunVerify(s, 0, failed_earlier);
    s.sources = sources;
    ASSERT_TRUE(r.launch.ok()) << r.launch;
    EXPECT_EQ(r.device.code(), absl::StatusCode::kFailedPrecondition) << r.device;
    EXPECT_THAT(std::string(r.device.message()), HasSubstr(named));
  }
  const CallResult r = RunCommit(s, failed_earlier);
  ASSERT_TRUE(r.launch.ok()) << r.launch;
  EXPECT_EQ(r.device.code(), absl::StatusCode::kFailedPrecondition) << r.device;
  EXPECT_THAT(std::string(r.device.message()), HasSubstr(named));
  ExpectSameBytes(before, TakeSnapshot(s));
}

// Align mode: each row's case is asserted on the reference plan first, so
// the test keeps covering what it says.
TEST_P(KdaKernelsTest, CommitAlignModeEqualsStockState) {
  constexpr int Q = 4, kBlockSize = 8, kWidth = 4;
  struct AlignRow {
    const char* what;
    int tokens;
    int32_t source;
    int accepted;
    int computed;
  };
  const AlignRow rows[] = {
      {"ends exactly on a boundary, all accepted", 4, 1, 4, 12},
      {"crosses a boundary mid-window", 4, 1, 3, 6},
      {"boundary at the last committed token", 4, 1, 3, 5},
      {"no crossing", 4, 1, 2, 16},
      {"final column capped at the table width", 4, 1, 2, 40},
      {"nothing accepted", 4, 1, 0, 6},
      {"crossing, final block = checkpoint", 4, 1, 4, 7},
      {"T < Q, crossing, more accepted than verified", 2, 1, 5, 15},
      {"null checkpoint", 4, 0, 3, 6},
      {"null final block", 4, 1, 2, 0},
      {"crossing into a null boundary block", 4, 1, 4, 6},
      {"padding", 0, 0, 2, 0},
  };
  for (const Config& c : {kConfigs[0], kConfigs[3]}) {
    StepSpec spec = SpecOf(c);
    spec.q = Q;
    spec.num_layers = 2;
    spec.align = true;
    spec.block_size = kBlockSize;
    spec.width = kWidth;
    spec.conv_token_major = c.act == DType::kFloat16;
    const int n = static_cast<int>(std::size(rows));
    spec.batch = n + 2;
    std::vector<int32_t> batch_rows(spec.batch);
    for (int b = 0; b < spec.batch; ++b) batch_rows[b] = b;
    rng().Shuffle(&batch_rows);
    spec.num_accepted.assign(spec.batch, 1000);
    spec.num_computed.assign(spec.batch, -1000);  // unused rows: never read
    for (int i = 0; i < n; ++i) {
      spec.tokens.push_back(rows[i].tokens);
      spec.sources.push_back(rows[i].source);
      spec.num_accepted[batch_rows[i]] = rows[i].accepted;
      spec.num_computed[batch_rows[i]] = rows[i].computed;
      spec.request_indices.push_back(batch_rows[i]);
    }
    Step s = MakeStep(spec);
    SCOPED_TRACE(Describe(spec));
    const auto table_row = [&](int i) -> std::vector<int32_t>& { return s.table[batch_rows[i]]; };
    table_row(6)[1] = s.sources[6];  // the final column holds the checkpoint
    table_row(9)[0] = 0;             // the final column is null
    table_row(10)[0] = 0;            // the boundary column is null

    const std::vector<ref::PlanRow> plan = ref::PlanCommit(RefCommitCall(s));
    const auto at = [&](int i, int col) { return table_row(i)[col]; };
    EXPECT_TRUE(plan[0].commit_len == 4 && plan[0].boundary_len == 4 &&
                plan[0].boundary_block == plan[0].final_block && plan[0].final_block == at(0, 1));
    EXPECT_TRUE(plan[1].boundary_len == 2 && plan[1].commit_len == 3 &&
                plan[1].boundary_block == at(1, 0) && plan[1].final_block == at(1, 1));
    EXPECT_TRUE(plan[2].boundary_len == 3 && plan[2].commit_len == 3 &&
                plan[2].final_block == at(2, 0) && plan[2].boundary_block == at(2, 0));
    EXPECT_TRUE(plan[3].boundary_block == 0 && plan[3].final_block == at(3, 2));
    EXPECT_TRUE(plan[4].boundary_block == 0 && plan[4].final_block == at(4, kWidth - 1));
    EXPECT_EQ(plan[5].commit_len, 0);
    EXPECT_TRUE(plan[6].boundary_len == 1 && plan[6].final_block == s.sources[6] &&
                plan[6].boundary_block == at(6, 0));
    EXPECT_TRUE(plan[7].commit_len == 2 && plan[7].boundary_len == 1 &&
                plan[7].boundary_block == at(7, 1) && plan[7].final_block == at(7, 2));
    EXPECT_EQ(plan[8].final_block, 0);
    EXPECT_TRUE(plan[9].commit_len == 2 && plan[9].final_block == 0);
    EXPECT_TRUE(plan[10].boundary_block == 0 && plan[10].commit_len == 4 &&
                plan[10].final_block == at(10, 1));

    StockAndVerifyAll(s);
    const Snapshot before = TakeSnapshot(s);
    ASSERT_TRUE(CallOk(RunCommit(s)));
    ExpectOwnerTableClear(s.commit_workspace, s.num_blocks);
    ExpectCommitMatchesStock(s, before);
  }
}

// Align mode with random rows, block size == Q, narrow tables.
TEST_P(KdaKernelsTest, CommitAlignModeRandomRows) {
  constexpr int Q = 3, kBlockSize = 3, kWidth = 5;
  for (int trial = 0; trial < 3; ++trial) {
    StepSpec spec = SpecOf(kConfigs[trial == 2 ? 4 : trial]);
    spec.q = Q;
    spec.history = 2;
    spec.align = true;
    spec.block_size = kBlockSize;
    spec.width = kWidth;
    const int n = 10;
    for (int i = 0; i < n; ++i) {
      const int tokens = rng().Int(0, Q);
      const int accepted = rng().Int(-1, Q + 1);
      const int commit_len = std::min({std::max(accepted, 0), tokens, Q});
      int computed;
      for (;;) {
        // Redraw what the kernels reject (a boundary past the table, or
        // boundary and final state in one block).
        computed = rng().Int(0, (kWidth + 1) * kBlockSize);
        if (commit_len == 0) break;
        const int next_boundary = (computed / kBlockSize + 1) * kBlockSize;
        if (computed + commit_len < next_boundary) break;
        const int boundary_col = next_boundary / kBlockSize - 1;
        const int final_col = std::min((computed + commit_len - 1) / kBlockSize, kWidth - 1);
        if (boundary_col < kWidth &&
            !(final_col == boundary_col && next_boundary - computed < commit_len)) {
          break;
        }
      }
      spec.tokens.push_back(tokens);
      spec.num_accepted.push_back(accepted);
      spec.num_computed.push_back(computed);
    }
    Step s = MakeStep(spec);
    SCOPED_TRACE(Describe(spec));
    StockAndVerifyAll(s);
    const Snapshot before = TakeSnapshot(s);
    ASSERT_TRUE(CallOk(RunCommit(s)));
    ExpectOwnerTableClear(s.commit_workspace, s.num_blocks);
    ExpectCommitMatchesStock(s, before);
  }
}

// K = 256, the largest head: stock vs reference, verify vs stock, commit vs
// stock, both modes.
// The CUDA backend agrees with the CPU backend on the same inputs (not bit
// for bit: their reductions over K run in other orders, and exp differs by
// an ulp), to about 1e-6 relative, bounded here by the fp32 compute budget
// plus one rounding of what is stored.
// Instantiated for the CUDA backend only: a GPU suite skips nothing.
class CudaAgreementTest : public KdaKernelsTest {};


TEST_P(CudaAgreementTest, CudaAgreesWithCpu) {
  for (const Config& c : {kConfigs[0], kConfigs[4], kConfigs[6], kConfigs[7], kConfigs[8],
                          kConfigs[9], kConfigs[11]}) {
    StepSpec spec = SpecOf(c);
    spec.num_layers = 2;
    spec.tokens = {4, 1, 3, 2, 4};
    Step cuda = MakeStep(spec);
    SCOPED_TRACE(Describe(spec));
    Step cpu;
    OnCpu([&] { cpu = CopyStep(cuda); });
    for (int l = 0; l < spec.num_layers; ++l) {
      ASSERT_TRUE(CallOk(RunVerify(cuda, l)));
      OnCpu([&] { ASSERT_TRUE(CallOk(RunVerify(cpu, l))); });
      const std::vector<uint8_t> a = cuda.layers[l].verify_out.Read();
      const std::vector<uint8_t> b = cpu.layers[l].verify_out.Read();
      std::vector<double> va, vb;
      const size_t es = cuda.act_size();
      for (int64_t t = 0; t < cuda.qsl.back() * cuda.vw(); ++t) {
        va.push_back(ref::LoadElement(RefDtype(spec.act), &a[t * es]));
        vb.push_back(ref::LoadElement(RefDtype(spec.act), &b[t * es]));
      }
      EXPECT_LT(RelativeError(va, vb), Tolerance(spec.act)) << "verify outputs, layer " << l;
    }
    ASSERT_TRUE(CallOk(RunCommit(cuda)));
    OnCpu([&] { ASSERT_TRUE(CallOk(RunCommit(cpu))); });
    for (int l = 0; l < spec.num_layers; ++l) {
      const std::vector<uint8_t> a = cuda.layers[l].pool.Read();
      const std::vector<uint8_t> b = cpu.layers[l].pool.Read();
      for (int32_t block : cuda.sources) {
        if (block <= 0) continue;
        EXPECT_LT(RelativeError(BlockValues(cuda, a, block), BlockValues(cpu, b, block)),
                  Tolerance(spec.state))
            << "committed state, layer " << l << ", block " << block;
      }
      // Conv compaction is a copy: bit for bit.
      EXPECT_EQ(FirstDifference(cuda.layers[l].conv.Read(), cpu.layers[l].conv.Read()), -1)
          << "conv pool, layer " << l;
    }
  }
}

TEST_P(KdaKernelsTest, LargestHeadDim) {
  for (bool align : {false, true}) {
    StepSpec spec = SpecOf({DType::kBFloat16, DType::kBFloat16, 2, 256, true});
    spec.tokens = {4, 3, 4};
    spec.num_accepted = {3, 2, 4};
    if (align) {
      spec.align = true;
      spec.block_size = 4;
      spec.width = 3;
      spec.num_computed = {2, 0, 4};
    }
    Step s = MakeStep(spec);
    SCOPED_TRACE(Describe(spec));
    StockAndVerifyAll(s);
    ref::StatePool model = s.layers[0].initial_states;
    const ref::StockResult want =
        ref::Stock(RefShape(s), s.layers[0].params, s.layers[0].tokens, RefStockCall(s), &model);
    ExpectOutputs(s, s.layers[0].stock_out.Read(), want.out, want.written);
    const Snapshot before = TakeSnapshot(s);
    ASSERT_TRUE(CallOk(RunCommit(s)));
    ExpectCommitMatchesStock(s, before);
  }
}

TEST_P(KdaKernelsTest, CommitOfNoRowsDoesNothing) {
  StepSpec spec;
  spec.tokens = {};
  Step s = MakeStep(spec);
  const Snapshot before = TakeSnapshot(s);
  EXPECT_TRUE(CallOk(RunCommit(s)));
  EXPECT_TRUE(CallOk(RunVerify(s, 0)));
  EXPECT_TRUE(CallOk(RunStock(s, 0)));
  ExpectSameBytes(before, TakeSnapshot(s));
}

// ---------------------------------------------------------------------------
// Host-side errors: the call returns them (as Validate*Args does) and
// nothing runs.

template <typename Args>
struct HostErrorCase {
  const char* what;
  std::function<void(Args&, CallData&)> breaks;
  absl::StatusCode code;
  std::string message;  // a substring of the message
};

// Runs every case on a fresh copy of `args` (and `cd`'s layer table).
template <typename Args, typename Call, typename Validate>
void ExpectHostErrors(const Step& s, const Args& good, const CallData& good_cd,
                      const std::vector<HostErrorCase<Args>>& cases, const std::string& op,
                      Call call, Validate validate) {
  const Snapshot before = TakeSnapshot(s);
  for (const HostErrorCase<Args>& c : cases) {
    SCOPED_TRACE(c.what);
    Args args = good;
    CallData cd;
    cd.layers = good_cd.layers;
    if constexpr (std::is_same_v<Args, CommitArgs>) args.layers = cd.layers.data();
    c.breaks(args, cd);
    const absl::Status status = call(args);
    EXPECT_EQ(status.code(), c.code) << status;
    EXPECT_THAT(std::string(status.message()), StartsWith(absl::StrCat("In ", op, ": ")));
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.message));
    EXPECT_EQ(validate(args), status);
  }
  ExpectSameBytes(before, TakeSnapshot(s));
}

TEST_P(KdaKernelsTest, ValidateShapeRejectsUnsupportedShapes) {
  KdaShape shape;
  shape.num_heads = 2;
  shape.head_dim = 64;
  EXPECT_TRUE(ValidateShape(shape).ok());
  shape.head_dim = 96;
  EXPECT_EQ(ValidateShape(shape).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(ValidateShape(shape).message()),
              HasSubstr("head_dim = 96 is not supported"));
}

TEST_P(KdaKernelsTest, StockRejectsBadArguments) {
  StepSpec spec;
  spec.tokens = {2, 3};
  Step s = MakeStep(spec);
  CallData cd;
  const StockArgs good = StockArgsFor(s, 0, &cd);
  const int64_t hk = s.hk();
  const size_t need = StockWorkspaceBytes(s.num_blocks);
  using A = StockArgs;
  using C = CallData;
  constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
  const std::vector<HostErrorCase<A>> cases = {
      {"head dim 96", [](A& a, C&) { a.shape.head_dim = 96; }, kInvalid,
       "head_dim = 96 is not supported (a power of two: 64, 128 or 256)"},
      {"head dim 32", [](A& a, C&) { a.shape.head_dim = 32; }, kInvalid, "head_dim = 32"},
      {"no heads", [](A& a, C&) { a.shape.num_heads = 0; }, kInvalid, "num_heads = 0 must be >= 1"},
      {"int32 activations", [](A& a, C&) { a.shape.act_dtype = DType::kInt32; }, kInvalid,
       "activation dtype int32 is not supported"},
      {"fp16 state", [](A& a, C&) { a.shape.state_dtype = DType::kFloat16; }, kInvalid,
       "state dtype fp16 is not supported (fp32 or bf16)"},
      {"positive lower bound", [](A& a, C&) { a.shape.lower_bound = 0.5f; }, kInvalid,
       "lower_bound = 0.5 must be negative"},
      {"negative token count", [](A& a, C&) { a.num_tokens = -1; }, kInvalid,
       "num_tokens = -1 is negative"},
      {"q null", [](A& a, C&) { a.q.data = nullptr; }, kInvalid, "q is null"},
      {"k stride under a token", [hk](A& a, C&) { a.k.token_stride = hk - 1; }, kInvalid,
       absl::StrCat("k token stride ", hk - 1, " is less than one token's ", hk, " elements")},
      {"v stride under a token", [hk](A& a, C&) { a.v.token_stride = hk - 64; }, kInvalid,
       "v token stride"},
      {"g not dense", [hk](A& a, C&) { a.g.token_stride = hk + 1; }, kInvalid,
       absl::StrCat("g token stride ", hk + 1, " must be ", hk, " (dense)")},
      {"beta stride under a token", [](A& a, C&) { a.beta.token_stride = 1; }, kInvalid,
       "beta token stride 1 is less than one token's 2 elements"},
      {"out null", [](A& a, C&) { a.out = nullptr; }, kInvalid, "out is null"},
      {"state pool null", [](A& a, C&) { a.state.data = nullptr; }, kInvalid, "state pool is null"},
      {"state pool without blocks", [](A& a, C&) { a.state.num_blocks = 0; }, kInvalid,
       "state pool has no blocks"},
      {"state block stride under a block", [hk](A& a, C&) { a.state.block_stride = hk * 64 - 4; },
       kInvalid,
       absl::StrCat("state pool block stride ", hk * 64 - 4, " is less than one block's ", hk * 64,
                    " elements")},
      {"state pool misaligned",
       [](A& a, C&) { a.state.data = static_cast<char*>(a.state.data) + 4; }, kInvalid,
       "state pool blocks must start on 16-byte boundaries"},
      {"state block stride misaligned", [](A& a, C&) { a.state.block_stride += 1; }, kInvalid,
       "state pool blocks must start on 16-byte boundaries"},
      {"no gate parameters", [](A& a, C&) { a.params.dt_bias = nullptr; }, kInvalid,
       "A_log and dt_bias must be set"},
      {"negative rows", [](A& a, C&) { a.num_rows = -1; }, kInvalid, "num_rows = -1 is negative"},
      {"query_start_loc null", [](A& a, C&) { a.query_start_loc = nullptr; }, kInvalid,
       "query_start_loc is null"},
      {"ssm_state_indices null", [](A& a, C&) { a.ssm_state_indices.data = nullptr; }, kInvalid,
       "ssm_state_indices is null"},
      {"ssm_state_indices without columns", [](A& a, C&) { a.ssm_state_indices.cols = 0; },
       kInvalid, "ssm_state_indices has 0 columns, needs at least 1"},
      {"ssm_state_indices row stride 0", [](A& a, C&) { a.ssm_state_indices.row_stride = 0; },
       kInvalid, "ssm_state_indices row stride 0 must be >= 1"},
      {"workspace too small", [need](A& a, C&) { a.workspace_bytes = need - 1; }, kInvalid,
       absl::StrCat("workspace of ", need - 1, " bytes is smaller than the ", need,
                    " bytes this call needs")},
      {"workspace null", [](A& a, C&) { a.workspace = nullptr; }, kInvalid,
       "bytes is smaller than the"},
      {"status null", [](A& a, C&) { a.status = nullptr; }, kInvalid, "status is null"},
  };
  ExpectHostErrors(
      s, good, cd, cases, "Stock", [&](const A& a) { return kernels_->Stock(a, stream()); },
      ValidateStockArgs);
}

TEST_P(KdaKernelsTest, VerifyRejectsBadArguments) {
  StepSpec spec;
  spec.tokens = {2, 3, 1};
  Step s = MakeStep(spec);
  CallData cd;
  const VerifyArgs good = VerifyArgsFor(s, 0, &cd);
  using A = VerifyArgs;
  using C = CallData;
  constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
  constexpr auto kOutOfRange = absl::StatusCode::kOutOfRange;
  const std::vector<HostErrorCase<A>> cases = {
      {"head dim 96", [](A& a, C&) { a.shape.head_dim = 96; }, kInvalid,
       "head_dim = 96 is not supported"},
      {"generation without a cancellation word",
       [](A& a, C&) { a.prerequisites.generation = 3; }, kInvalid,
       "prerequisites: a generation without a cancellation word"},
      {"bf16 activations with fp16 state", [](A& a, C&) { a.shape.state_dtype = DType::kFloat16; },
       kInvalid, "state dtype fp16 is not supported"},
      {"batch over the record rows", [](A& a, C&) { a.records.rows = 2; }, kOutOfRange,
       "3 rows exceed the 2 record rows"},
      {"record window over 16 tokens", [](A& a, C&) { a.records.q = 17; }, kOutOfRange,
       "record window q = 17 must be in [1, 16]"},
      {"record window of 0 tokens", [](A& a, C&) { a.records.q = 0; }, kOutOfRange,
       "record window q = 0 must be in [1, 16]"},
      {"records null", [](A& a, C&) { a.records.g = nullptr; }, kInvalid, "records are null"},
      {"g not dense", [](A& a, C&) { a.g.token_stride += 8; }, kInvalid, "(dense)"},
      {"q stride under a token", [](A& a, C&) { a.q.token_stride = 3; }, kInvalid,
       "q token stride 3 is less than one token's 128 elements"},
      {"state_indices null", [](A& a, C&) { a.state_indices.data = nullptr; }, kInvalid,
       "state_indices is null"},
      {"query_start_loc null", [](A& a, C&) { a.query_start_loc = nullptr; }, kInvalid,
       "query_start_loc is null"},
      {"status null", [](A& a, C&) { a.status = nullptr; }, kInvalid, "status is null"},
  };
  ExpectHostErrors(
      s, good, cd, cases, "Verify", [&](const A& a) { return kernels_->Verify(a, stream()); },
      ValidateVerifyArgs);
}

TEST_P(KdaKernelsTest, CommitRejectsBadArguments) {
  StepSpec spec;
  spec.q = 4;
  spec.num_layers = 3;
  // Enough rows that a workspace sized for one row is too small for them.
  spec.tokens.assign(14, 1);
  spec.align = true;
  spec.block_size = 8;
  spec.width = 2;
  spec.num_computed.assign(14, 0);
  Step s = MakeStep(spec);
  CallData cd;
  const CommitArgs good = CommitArgsFor(s, &cd);
  const size_t need = CommitWorkspaceBytes(s.rows, spec.q, s.num_blocks);
  const size_t one_row = CommitWorkspaceBytes(1, spec.q, s.num_blocks);
  ASSERT_LT(one_row, need);
  using A = CommitArgs;
  using C = CallData;
  constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
  constexpr auto kOutOfRange = absl::StatusCode::kOutOfRange;
  const int W = s.conv_width;
  const std::string conv_shape = absl::StrCat("[", spec.conv_dim, ", ", W, "]");
  const std::vector<HostErrorCase<A>> cases = {
      {"head dim 96", [](A& a, C&) { a.shape.head_dim = 96; }, kInvalid,
       "head_dim = 96 is not supported"},
      {"no layers", [](A& a, C&) { a.num_layers = 0; }, kInvalid,
       "a commit needs at least one layer"},
      {"no layer table", [](A& a, C&) { a.layers = nullptr; }, kInvalid,
       "a commit needs at least one layer"},
      {"no device layer table", [](A& a, C&) { a.device_layers = nullptr; }, kInvalid,
       "a commit needs at least one layer"},
      {"window over 16 tokens", [](A& a, C&) { a.spec_query_len = 17; }, kOutOfRange,
       "spec_query_len = 17 must be in [1, 16]"},
      {"batch over the record rows",
       [](A& a, C& c) {
         for (CommitLayer& l : c.layers) l.records.rows = 13;
       },
       kOutOfRange, "layer 0: 14 rows exceed the 13 record rows"},
      {"records of another window", [](A& a, C& c) { c.layers[1].records.q = 5; }, kInvalid,
       "layer 1: records hold windows of 5 tokens, the commit expects 4"},
      {"records null", [](A& a, C& c) { c.layers[2].records.kv = nullptr; }, kInvalid,
       "layer 2: records are null"},
      {"state pools of different sizes", [](A& a, C& c) { c.layers[1].state.num_blocks -= 1; },
       kInvalid,
       absl::StrCat("layer 1: state pool has ", s.num_blocks - 1, " blocks, layer 0 has ",
                    s.num_blocks)},
      {"state pool misaligned",
       [](A& a, C& c) { c.layers[2].state.data = static_cast<char*>(c.layers[2].state.data) + 8; },
       kInvalid, "layer 2: state pool blocks must start on 16-byte boundaries"},
      {"conv pool null", [](A& a, C& c) { c.layers[1].conv.data = nullptr; }, kInvalid,
       "layer 1: conv pool is null"},
      {"conv pool of another size", [](A& a, C& c) { c.layers[0].conv.num_blocks += 1; }, kInvalid,
       absl::StrCat("layer 0: conv pool has ", s.num_blocks + 1, " blocks, the state pool has ",
                    s.num_blocks)},
      {"conv blocks of different shapes", [](A& a, C& c) { c.layers[2].conv.dim += 1; }, kInvalid,
       absl::StrCat("layer 2: conv blocks [", spec.conv_dim + 1, ", ", W,
                    "] differ from layer 0's ", conv_shape)},
      {"conv blocks of different widths", [](A& a, C& c) { c.layers[1].conv.width += 1; }, kInvalid,
       "differ from layer 0's"},
      {"conv without channels",
       [](A& a, C& c) {
         for (CommitLayer& l : c.layers) l.conv.dim = 0;
       },
       kInvalid, "layer 0: conv dim must be >= 1"},
      {"conv window shorter than Q",
       [](A& a, C& c) {
         for (CommitLayer& l : c.layers) l.conv.width = 3;
       },
       kInvalid,
       "layer 0: conv window of 3 columns is shorter than the 4-token speculative window"},
      {"conv history over 16 columns",
       [](A& a, C& c) {
         for (CommitLayer& l : c.layers) l.conv.width = 4 + 16;
       },
       kInvalid, "layer 0: conv history of 17 columns exceeds the supported 16"},
      {"conv stride 0", [](A& a, C& c) { c.layers[0].conv.dim_stride = 0; }, kInvalid,
       "layer 0: conv pool strides must be positive"},
      {"no gate parameters", [](A& a, C& c) { c.layers[2].params.a_log = nullptr; }, kInvalid,
       "layer 2: A_log and dt_bias must be set"},
      {"query_start_loc null", [](A& a, C&) { a.query_start_loc = nullptr; }, kInvalid,
       "query_start_loc is null"},
      {"state_indices null", [](A& a, C&) { a.state_indices.data = nullptr; }, kInvalid,
       "state_indices is null"},
      {"negative batch", [](A& a, C&) { a.batch = -1; }, kInvalid, "batch = -1 is negative"},
      {"num_accepted null", [](A& a, C&) { a.num_accepted = nullptr; }, kInvalid,
       "num_accepted is null"},
      {"batch under the rows without request_indices", [](A& a, C&) { a.batch = 13; }, kOutOfRange,
       "without request_indices, num_accepted needs one entry per row: batch 13 < 14 rows"},
      {"align metadata: block table only",
       [](A& a, C&) {
         a.num_computed_tokens = nullptr;
         a.mamba_block_size = 0;
       },
       kInvalid, "align mode needs block_table, num_computed_tokens and mamba_block_size together"},
      {"align metadata: no block table", [](A& a, C&) { a.block_table.data = nullptr; }, kInvalid,
       "align mode needs block_table, num_computed_tokens and mamba_block_size"},
      {"align metadata: no block size", [](A& a, C&) { a.mamba_block_size = 0; }, kInvalid,
       "align mode needs block_table, num_computed_tokens and mamba_block_size"},
      {"block size under Q", [](A& a, C&) { a.mamba_block_size = 3; }, kInvalid,
       "mamba_block_size = 3 must cover one speculative window of 4 tokens"},
      {"block table without columns", [](A& a, C&) { a.block_table.cols = 0; }, kInvalid,
       "block_table has 0 columns, needs at least 1"},
      {"workspace one byte short", [need](A& a, C&) { a.workspace_bytes = need - 1; }, kInvalid,
       absl::StrCat("workspace of ", need - 1, " bytes is smaller than the ", need,
                    " bytes this call needs")},
      {"batch over the plan capacity", [one_row](A& a, C&) { a.workspace_bytes = one_row; },
       kInvalid, absl::StrCat("workspace of ", one_row, " bytes is smaller than the ", need)},
      {"status null", [](A& a, C&) { a.status = nullptr; }, kInvalid, "status is null"},
  };
  ExpectHostErrors(
      s, good, cd, cases, "Commit", [&](const A& a) { return kernels_->Commit(a, stream()); },
      ValidateCommitArgs);
}

// ---------------------------------------------------------------------------
// RecordStateBlocks.

struct RsbStep;
int32_t UnusedRequestRow(const RsbStep& r);

struct RsbStep {
  int rows = 0;
  int batch = 0;
  int requests = 0;
  int block_size = 0;
  int width = 0;
  std::vector<int32_t> request_indices, idx_mapping, num_sampled, num_computed;
  Tensor state_idx, num_accepted, workspace, status;
};

// A request row no batch row maps to (there are more requests than batch rows).
int32_t UnusedRequestRow(const RsbStep& r) {
  for (int32_t v = 0; v < r.requests; ++v) {
    if (std::find(r.idx_mapping.begin(), r.idx_mapping.end(), v) == r.idx_mapping.end()) return v;
  }
  return -1;
}

class RecordStateBlocksTest : public KdaKernelsTest {
 protected:
  // Rows map to batch rows through request_indices (empty: identity); the
  // outputs start with a sentinel the kernel must leave where it writes
  // nothing.
  RsbStep MakeRsb(int rows, int batch, int requests, bool remap) {
    RsbStep r;
    r.rows = rows;
    r.batch = batch;
    r.requests = requests;
    r.block_size = rng().Int(4, 8);
    r.width = 5;
    std::vector<int32_t> batch_rows(batch), request_rows(requests);
    for (int b = 0; b < batch; ++b) batch_rows[b] = b;
    for (int q = 0; q < requests; ++q) request_rows[q] = q;
    if (remap) rng().Shuffle(&batch_rows);
    rng().Shuffle(&request_rows);
    if (remap) {
      // Batch row 1 (skipped, below) is always among the rows.
      const auto one = std::find(batch_rows.begin(), batch_rows.end(), 1);
      if (one - batch_rows.begin() >= rows) std::iter_swap(one, batch_rows.begin());
      r.request_indices.assign(batch_rows.begin(), batch_rows.begin() + rows);
    }
    r.idx_mapping.assign(batch, -1);
    for (int b = 0; b < batch; ++b) {
      // Every third batch row is skipped (< 0).
      r.idx_mapping[b] = b % 3 == 1 ? -1 - b % 2 : request_rows[b];
      r.num_sampled.push_back(rng().Int(0, 5));
      r.num_computed.push_back(rng().Int(0, r.block_size * (r.width + 2)));
    }
    r.state_idx = Upload(ToBytes(std::vector<int32_t>(requests, -777)));
    r.num_accepted = Upload(ToBytes(std::vector<int32_t>(requests, -888)));
    r.workspace = Zeroed(RecordStateBlocksWorkspaceBytes(std::max(rows, requests)));
    r.status = Zeroed(sizeof(DeviceStatus));
    return r;
  }

  RecordStateBlocksArgs ArgsFor(RsbStep& r, CallData* cd) {
    RecordStateBlocksArgs a;
    a.num_rows = r.rows;
    a.request_indices = r.request_indices.empty() ? nullptr : Ints(cd, r.request_indices);
    a.batch = r.batch;
    a.idx_mapping = Ints(cd, r.idx_mapping);
    a.num_sampled = Ints(cd, r.num_sampled);
    a.num_computed_tokens = Ints(cd, r.num_computed);
    a.mamba_block_size = r.block_size;
    a.block_table_width = r.width;
    a.num_requests = r.requests;
    a.state_idx = r.state_idx.As<int32_t>();
    a.num_accepted = r.num_accepted.As<int32_t>();
    a.workspace = r.workspace.data();
    a.workspace_bytes = r.workspace.dev.size();
    a.status = r.status.As<DeviceStatus>();
    return a;
  }

  CallResult Run(RsbStep& r) {
    CallData cd;
    RecordStateBlocksArgs a = ArgsFor(r, &cd);
    a.status_mirror = ZeroedMirror();
    return Finish(kernels_->RecordStateBlocks(a, stream()), "RecordStateBlocks",
                  r.status.As<DeviceStatus>());
  }

  void ExpectMatchesReference(const RsbStep& r) {
    ref::RecordStateBlocksCall call;
    call.num_rows = r.rows;
    call.request_indices = r.request_indices;
    call.idx_mapping = r.idx_mapping;
    call.num_sampled = r.num_sampled;
    call.num_computed_tokens = r.num_computed;
    call.mamba_block_size = r.block_size;
    call.block_table_width = r.width;
    std::vector<int32_t> state_idx = FromBytes<int32_t>(r.state_idx.host);
    std::vector<int32_t> num_accepted = FromBytes<int32_t>(r.num_accepted.host);
    ref::RecordStateBlocks(call, &state_idx, &num_accepted);
    EXPECT_EQ(FromBytes<int32_t>(r.state_idx.Read()), state_idx);
    EXPECT_EQ(FromBytes<int32_t>(r.num_accepted.Read()), num_accepted);
  }
};

TEST_P(RecordStateBlocksTest, MatchesReference) {
  for (bool remap : {false, true}) {
    SCOPED_TRACE(remap ? "request_indices" : "identity");
    RsbStep r = MakeRsb(/*rows=*/7, /*batch=*/remap ? 10 : 7, /*requests=*/12, remap);
    ASSERT_TRUE(CallOk(Run(r)));
    ExpectOwnerTableClear(r.workspace, r.requests);
    ExpectMatchesReference(r);
    // Some rows were skipped and some requests untouched.
    const std::vector<int32_t> state_idx = FromBytes<int32_t>(r.state_idx.Read());
    EXPECT_GT(std::count(state_idx.begin(), state_idx.end(), -777), 0);
  }
}

// The column of the block holding the last token, (n - 1) / bs with
// n = num_computed + num_sampled, capped at the table's last column.
TEST_P(RecordStateBlocksTest, RecordsTheBlockOfTheLastToken) {
  RsbStep r = MakeRsb(5, 5, 5, false);
  const int bs = r.block_size;
  r.idx_mapping = {2, 0, 1, 4, 3};
  r.num_computed = {0, 7, bs * 40, 2 * bs - 1, 2 * bs};
  r.num_sampled = {0, 1, 3, 1, 0};
  ASSERT_TRUE(CallOk(Run(r)));
  // Rows: n = 0 -> column 0; n = 8; far past the table -> width - 1;
  // n = 2 bs ends exactly on a boundary -> column 1, not 2; n = 2 bs with
  // nothing sampled -> column 1.
  EXPECT_EQ(FromBytes<int32_t>(r.state_idx.Read()),
            (std::vector<int32_t>{7 / bs, r.width - 1, 0, 1, 1}));
  EXPECT_EQ(FromBytes<int32_t>(r.num_accepted.Read()), (std::vector<int32_t>{1, 1, 1, 1, 1}));
  ExpectMatchesReference(r);
}

TEST_P(RecordStateBlocksTest, RejectsBadArguments) {
  RsbStep r = MakeRsb(5, 5, 6, false);
  CallData cd;
  const RecordStateBlocksArgs good = ArgsFor(r, &cd);
  const size_t need = RecordStateBlocksWorkspaceBytes(6);
  using A = RecordStateBlocksArgs;
  struct Case {
    const char* what;
    std::function<void(A&)> breaks;
    absl::StatusCode code;
    std::string message;
  };
  constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
  const std::vector<Case> cases = {
      {"negative rows", [](A& a) { a.num_rows = -1; }, kInvalid,
       "num_rows, batch and num_requests must not be negative"},
      {"negative requests", [](A& a) { a.num_requests = -1; }, kInvalid,
       "num_rows, batch and num_requests must not be negative"},
      {"block size 0", [](A& a) { a.mamba_block_size = 0; }, kInvalid,
       "mamba_block_size = 0 must be >= 1"},
      {"table width 0", [](A& a) { a.block_table_width = 0; }, kInvalid,
       "block_table_width = 0 must be >= 1"},
      {"batch under the rows", [](A& a) { a.batch = 4; }, absl::StatusCode::kOutOfRange,
       "without request_indices, the batch tensors need one entry per row: batch 4 < 5 rows"},
      {"idx_mapping null", [](A& a) { a.idx_mapping = nullptr; }, kInvalid,
       "idx_mapping, num_sampled and num_computed_tokens must be set"},
      {"outputs null", [](A& a) { a.num_accepted = nullptr; }, kInvalid,
       "the outputs state_idx and num_accepted must be set"},
      {"workspace too small", [need](A& a) { a.workspace_bytes = need - 1; }, kInvalid,
       absl::StrCat("workspace of ", need - 1, " bytes is smaller than the ", need, " bytes")},
      {"status null", [](A& a) { a.status = nullptr; }, kInvalid, "status is null"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    A args = good;
    c.breaks(args);
    const absl::Status status = kernels_->RecordStateBlocks(args, stream());
    EXPECT_EQ(status.code(), c.code) << status;
    EXPECT_THAT(std::string(status.message()), StartsWith("In RecordStateBlocks: "));
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.message));
    EXPECT_EQ(ValidateRecordStateBlocksArgs(args), status);
  }
  EXPECT_EQ(FirstDifference(r.state_idx.Read(), r.state_idx.host), -1);
  EXPECT_EQ(FirstDifference(r.num_accepted.Read(), r.num_accepted.host), -1);
}

TEST_P(RecordStateBlocksTest, DeviceChecksWriteNothing) {
  struct Case {
    const char* what;
    // Breaks one field; returns the message substring to expect.
    std::function<std::string(RsbStep&)> breaks;
    absl::StatusCode code;
  };
  const std::vector<Case> cases = {
      {"idx_mapping past the requests",
       [](RsbStep& r) {
         const int b = r.request_indices[2];
         r.idx_mapping[b] = r.requests;
         return absl::StrCat("idx_mapping[", b, "] = ", r.requests,
                             " is out of range: must be below ", r.requests, " (row 2)");
       },
       absl::StatusCode::kOutOfRange},
      {"two rows write one request row",
       [](RsbStep& r) {
         const int b1 = r.request_indices[1], b4 = r.request_indices[4];
         const int32_t v = UnusedRequestRow(r);
         r.idx_mapping[b1] = v;
         r.idx_mapping[b4] = v;
         return absl::StrCat("idx_mapping[", b4, "]: rows 1 and 4 both write request row ", v,
                             " in one call");
       },
       absl::StatusCode::kInvalidArgument},
      {"request index past the batch",
       [](RsbStep& r) {
         r.request_indices[3] = r.batch;
         return absl::StrCat("request_indices[3] = ", r.batch, " is out of range: must be below ",
                             r.batch, " (row 3)");
       },
       absl::StatusCode::kOutOfRange},
      {"negative request index",
       [](RsbStep& r) {
         r.request_indices[0] = -1;
         return std::string("request_indices[0] = -1 must not be negative (row 0)");
       },
       absl::StatusCode::kOutOfRange},
      {"negative num_computed_tokens",
       [](RsbStep& r) {
         const int b = r.request_indices[4];
         r.idx_mapping[b] = UnusedRequestRow(r);
         r.num_computed[b] = -3;
         return absl::StrCat("num_computed_tokens[", b, "] = -3 must not be negative (row 4)");
       },
       absl::StatusCode::kOutOfRange},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    RsbStep r = MakeRsb(6, 8, 9, /*remap=*/true);
    const std::vector<int32_t> idx_mapping = r.idx_mapping, request_indices = r.request_indices,
                               num_computed = r.num_computed;
    const std::string message = c.breaks(r);
    const CallResult result = Run(r);
    ASSERT_TRUE(result.launch.ok()) << result.launch;
    EXPECT_EQ(result.device.code(), c.code) << result.device;
    EXPECT_THAT(std::string(result.device.message()), StartsWith("In RecordStateBlocks: "));
    EXPECT_THAT(std::string(result.device.message()), HasSubstr(message));
    EXPECT_EQ(FirstDifference(r.state_idx.Read(), r.state_idx.host), -1);
    EXPECT_EQ(FirstDifference(r.num_accepted.Read(), r.num_accepted.host), -1);
    ExpectOwnerTableClear(r.workspace, r.requests);
    // The next valid call runs.
    r.idx_mapping = idx_mapping;
    r.request_indices = request_indices;
    r.num_computed = num_computed;
    ASSERT_TRUE(CallOk(Run(r)));
    ExpectOwnerTableClear(r.workspace, r.requests);
    ExpectMatchesReference(r);
  }
}

// ---------------------------------------------------------------------------
// Device-side checks: the call returns OK, its DeviceStatus names the field
// and the row, and no byte of any pool, record or output changes. The owner
// table is clear afterwards, and the next valid call runs.

struct DeviceCheckCase {
  const char* what;
  // Breaks one field of the step's metadata; returns the message substring.
  std::function<std::string(Step&)> breaks;
  absl::StatusCode code;
};

class DeviceCheckTest : public KdaKernelsTest {
 protected:
  // `prepare` runs valid calls first (e.g. verify before commit); `call` is
  // the call under test, `workspace` and `entries` its owner table.
  void RunCases(const StepSpec& spec, const std::vector<DeviceCheckCase>& cases, const char* op,
                const std::function<void(Step&)>& prepare,
                const std::function<CallResult(Step&)>& call,
                const std::function<const Tensor&(const Step&)>& workspace) {
    // Every case on a KDA layer and on a Gated DeltaNet one (grouped heads).
    StepSpec gdn = spec;
    gdn.kind = LayerKind::kGdn;
    gdn.value_heads = 2 * spec.heads;
    for (const StepSpec& kind_spec : {spec, gdn})
    for (const DeviceCheckCase& c : cases) {
      SCOPED_TRACE(absl::StrCat(c.what, ", ", Describe(kind_spec)));
      Step s = MakeStep(kind_spec);
      prepare(s);
      if (HasFatalFailure()) return;
      const Metadata good = Metadata::Of(s);
      const std::string message = c.breaks(s);
      const Snapshot before = TakeSnapshot(s);
      const CallResult result = call(s);
      ASSERT_TRUE(result.launch.ok()) << result.launch;
      EXPECT_EQ(result.device.code(), c.code) << result.device;
      EXPECT_THAT(std::string(result.device.message()), StartsWith(absl::StrCat("In ", op, ": ")));
      EXPECT_THAT(std::string(result.device.message()), HasSubstr(message));
      ExpectSameBytes(before, TakeSnapshot(s));
      ExpectOwnerTableClear(workspace(s), s.num_blocks);
      good.RestoreTo(&s);
      EXPECT_TRUE(CallOk(call(s))) << "the valid call after the failed one";
      ExpectOwnerTableClear(workspace(s), s.num_blocks);
    }
  }
};

// Shifts every row boundary after row `row` so that the row gets `extra`
// more tokens.
void GrowRow(Step& s, int row, int extra) {
  for (size_t k = row + 1; k < s.qsl.size(); ++k) s.qsl[k] += extra;
}

TEST_P(DeviceCheckTest, Stock) {
  StepSpec spec;
  spec.q = 4;  // ssm_state_indices has Q + 1 = 5 columns
  spec.tokens = {2, 3, 1, 2};
  const std::vector<DeviceCheckCase> cases = {
      {"query_start_loc decreasing",
       [](Step& s) {
         s.qsl[2] = s.qsl[1] - 1;
         return absl::StrCat("query_start_loc[2] = ", s.qsl[2],
                             " is less than query_start_loc[1] = ", s.qsl[1], " (row 1)");
       },
       absl::StatusCode::kInvalidArgument},
      {"a row over the columns",
       [](Step& s) {
         GrowRow(s, 1, 3);
         return std::string(
             "query_start_loc gives row 1 6 tokens, more than the 5 the window allows");
       },
       absl::StatusCode::kOutOfRange},
      {"past the last token",
       [](Step& s) {
         s.qsl[4] = static_cast<int32_t>(s.num_tokens) + 1;
         return absl::StrCat("query_start_loc[4] = ", s.qsl[4], " is past the ", s.num_tokens,
                             " tokens of the activations");
       },
       absl::StatusCode::kOutOfRange},
      {"a start other than 0",
       [](Step& s) {
         s.qsl[0] = -1;
         return std::string("query_start_loc[0] = -1 must be 0");
       },
       absl::StatusCode::kInvalidArgument},
      {"a store past the pool",
       [](Step& s) {
         s.stock_indices[1][2] = static_cast<int32_t>(s.num_blocks);
         return absl::StrCat("state_indices[1, 2] = ", s.num_blocks,
                             " is out of range: must be below ", s.num_blocks, " (row 1)");
       },
       absl::StatusCode::kOutOfRange},
      {"a checkpoint past the pool",
       [](Step& s) {
         s.stock_indices[2][4] = static_cast<int32_t>(s.num_blocks) + 7;
         return absl::StrCat("state_indices[2, 4] = ", s.num_blocks + 7,
                             " is out of range: must be below ", s.num_blocks, " (row 2)");
       },
       absl::StatusCode::kOutOfRange},
      {"num_accepted_tokens 0",
       [](Step& s) {
         s.stock_accepted[1] = 0;
         return std::string("num_accepted_tokens[1] = 0 must be in [1, 5]");
       },
       absl::StatusCode::kOutOfRange},
      {"num_accepted_tokens past the columns",
       [](Step& s) {
         s.stock_accepted[3] = 6;
         return std::string("num_accepted_tokens[3] = 6 must be in [1, 5]");
       },
       absl::StatusCode::kOutOfRange},
      {"two rows write one block",
       [](Step& s) {
         s.stock_indices[2][0] = s.stock_indices[0][1];
         return absl::StrCat("state_indices[2, 0]: rows 0 and 2 both write block ",
                             s.stock_indices[0][1], " in one call");
       },
       absl::StatusCode::kInvalidArgument},
      {"a row writes the block a later row reads",
       [](Step& s) {
         s.stock_indices[1][0] = s.sources[2];
         return absl::StrCat("state_indices[2, 4]: row 2 reads block ", s.sources[2],
                             " while row 1 writes it in the same call");
       },
       absl::StatusCode::kInvalidArgument},
      {"a row writes the block an earlier row reads",
       [](Step& s) {
         s.stock_indices[3][1] = s.sources[0];
         return absl::StrCat("state_indices[0, 4]: row 0 reads block ", s.sources[0],
                             " while row 3 writes it in the same call");
       },
       absl::StatusCode::kInvalidArgument},
  };
  RunCases(
      spec, cases, "Stock", [](Step&) {}, [&](Step& s) { return RunStock(s, 0); },
      [](const Step& s) -> const Tensor& { return s.stock_workspace; });
}

TEST_P(DeviceCheckTest, Verify) {
  StepSpec spec;
  spec.q = 4;
  spec.tokens = {2, 3, 1, 2};
  const std::vector<DeviceCheckCase> cases = {
      {"a row over the window",
       [](Step& s) {
         GrowRow(s, 1, 2);
         return std::string(
             "query_start_loc gives row 1 5 tokens, more than the 4 the window allows");
       },
       absl::StatusCode::kOutOfRange},
      {"query_start_loc decreasing",
       [](Step& s) {
         s.qsl[3] = s.qsl[2] - 2;
         return absl::StrCat("query_start_loc[3] = ", s.qsl[3],
                             " is less than query_start_loc[2] = ", s.qsl[2], " (row 2)");
       },
       absl::StatusCode::kInvalidArgument},
      {"past the last token",
       [](Step& s) {
         s.num_tokens_arg = s.qsl[4] - 1;
         return absl::StrCat("query_start_loc[4] = ", s.qsl[4], " is past the ", s.qsl[4] - 1,
                             " tokens of the activations");
       },
       absl::StatusCode::kOutOfRange},
      {"a negative start",
       [](Step& s) {
         s.qsl[0] = -2;
         return std::string("query_start_loc[0] = -2 must be 0");
       },
       absl::StatusCode::kInvalidArgument},
      {"a positive start",
       [](Step& s) {
         s.qsl[0] = 1;
         return std::string("query_start_loc[0] = 1 must be 0");
       },
       absl::StatusCode::kInvalidArgument},
      {"a checkpoint past the pool",
       [](Step& s) {
         s.sources[1] = static_cast<int32_t>(s.num_blocks);
         return absl::StrCat("state_indices[1] = ", s.num_blocks,
                             " is out of range: must be below ", s.num_blocks, " (row 1)");
       },
       absl::StatusCode::kOutOfRange},
  };
  // Verify has no cross-row pass and no workspace: the stock workspace
  // stands in (untouched).
  RunCases(
      spec, cases, "Verify", [](Step&) {}, [&](Step& s) { return RunVerify(s, 0); },
      [](const Step& s) -> const Tensor& { return s.stock_workspace; });
}

// Align mode, rows mapped to batch rows {2, 0, 5, 3} of 6. Row 0 crosses a
// boundary (boundary column 0, final column 1), rows 1-3 do not.
StepSpec CommitCheckSpec() {
  StepSpec spec;
  spec.q = 4;
  spec.num_layers = 2;
  spec.tokens = {4, 3, 4, 2};
  spec.batch = 6;
  spec.request_indices = {2, 0, 5, 3};
  spec.num_accepted = {2, 1, 3, 2, 1, 4};
  spec.align = true;
  spec.block_size = 8;
  spec.width = 4;
  spec.num_computed = {0, 0, 6, 9, 0, 17};
  return spec;
}

TEST_P(DeviceCheckTest, Commit) {
  const std::vector<DeviceCheckCase> cases = {
      {"request index past the batch",
       [](Step& s) {
         s.request_indices[1] = 6;
         return std::string("request_indices[1] = 6 is out of range: must be below 6 (row 1)");
       },
       absl::StatusCode::kOutOfRange},
      {"negative request index",
       [](Step& s) {
         s.request_indices[1] = -2;
         return std::string("request_indices[1] = -2 must not be negative (row 1)");
       },
       absl::StatusCode::kOutOfRange},
      {"a checkpoint past the pool",
       [](Step& s) {
         s.sources[2] = static_cast<int32_t>(s.num_blocks);
         return absl::StrCat("state_indices[2] = ", s.num_blocks,
                             " is out of range: must be below ", s.num_blocks, " (row 2)");
       },
       absl::StatusCode::kOutOfRange},
      {"a final block past the pool",
       [](Step& s) {
         s.table[3][1] = static_cast<int32_t>(s.num_blocks) + 1;
         return absl::StrCat("block_table[3, 1] = ", s.num_blocks + 1,
                             " is out of range: must be below ", s.num_blocks, " (row 3)");
       },
       absl::StatusCode::kOutOfRange},
      {"a boundary block past the pool",
       [](Step& s) {
         s.table[2][0] = static_cast<int32_t>(s.num_blocks);
         return absl::StrCat("block_table[2, 0] = ", s.num_blocks,
                             " is out of range: must be below ", s.num_blocks, " (row 0)");
       },
       absl::StatusCode::kOutOfRange},
      {"boundary column past the width",
       [](Step& s) {
         s.num_computed[5] = 38;  // crosses 40: column 4 of a 4-wide table
         return std::string(
             "block_table[5, 4] (the block after the next boundary of row 2) is past the "
             "table's width 4");
       },
       absl::StatusCode::kOutOfRange},
      {"negative num_computed_tokens",
       [](Step& s) {
         s.num_computed[0] = -1;
         return std::string("num_computed_tokens[0] = -1 must not be negative (row 1)");
       },
       absl::StatusCode::kOutOfRange},
      {"query_start_loc over the window",
       [](Step& s) {
         GrowRow(s, 1, 2);
         return std::string(
             "query_start_loc gives row 1 5 tokens, more than the 4 the window allows");
       },
       absl::StatusCode::kOutOfRange},
      {"query_start_loc decreasing",
       [](Step& s) {
         s.qsl[2] = s.qsl[1] - 1;
         return absl::StrCat("query_start_loc[2] = ", s.qsl[2],
                             " is less than query_start_loc[1] = ", s.qsl[1], " (row 1)");
       },
       absl::StatusCode::kInvalidArgument},
      {"two rows write one block",
       [](Step& s) {
         s.table[3][1] = s.table[0][0];  // row 3's final = row 1's final
         return absl::StrCat("block_table[3]: rows 1 and 3 both write block ", s.table[0][0],
                             " in one call");
       },
       absl::StatusCode::kInvalidArgument},
      {"a row writes the block another row reads",
       [](Step& s) {
         s.table[0][0] = s.sources[2];  // row 1's final = row 2's checkpoint
         return absl::StrCat("state_indices[2]: row 2 reads block ", s.sources[2],
                             " while row 1 writes it in the same call");
       },
       absl::StatusCode::kInvalidArgument},
      {"a boundary block another row reads",
       [](Step& s) {
         s.table[2][0] = s.sources[3];  // row 0's boundary = row 3's checkpoint
         return absl::StrCat("state_indices[3]: row 3 reads block ", s.sources[3],
                             " while row 0 writes it in the same call");
       },
       absl::StatusCode::kInvalidArgument},
      // Not in SEMANTICS.md's list: the final column, capped at the table's
      // width, is the boundary column (the reference would store both
      // states there, the final one last). The kernels reject it.
      {"boundary and final state in one block",
       [](Step& s) {
         s.num_computed[2] = 30;  // boundary column 3 = capped final column
         return absl::StrCat(
             "block_table[2, 3]: row 0 would write its boundary state and its "
             "final state to the same block ",
             s.table[2][3]);
       },
       absl::StatusCode::kInvalidArgument},
  };
  RunCases(
      CommitCheckSpec(), cases, "Commit", [&](Step& s) { StockAndVerifyAll(s); },
      [&](Step& s) { return RunCommit(s); },
      [](const Step& s) -> const Tensor& { return s.commit_workspace; });
}

TEST_P(DeviceCheckTest, CommitModeNone) {
  StepSpec spec;
  spec.q = 3;
  spec.tokens = {3, 2, 3};
  spec.num_accepted = {2, 1, 3};
  const std::vector<DeviceCheckCase> cases = {
      {"two rows commit to one checkpoint",
       [](Step& s) {
         s.sources[2] = s.sources[0];
         return absl::StrCat("state_indices[2]: rows 0 and 2 both write block ", s.sources[0],
                             " in one call");
       },
       absl::StatusCode::kInvalidArgument},
      {"a checkpoint past the pool",
       [](Step& s) {
         s.sources[0] = static_cast<int32_t>(s.num_blocks) + 3;
         return absl::StrCat("state_indices[0] = ", s.num_blocks + 3,
                             " is out of range: must be below ", s.num_blocks, " (row 0)");
       },
       absl::StatusCode::kOutOfRange},
  };
  RunCases(
      spec, cases, "Commit", [&](Step& s) { StockAndVerifyAll(s); },
      [&](Step& s) { return RunCommit(s); },
      [](const Step& s) -> const Tensor& { return s.commit_workspace; });
}

// ---------------------------------------------------------------------------

std::string BackendParamName(const ::testing::TestParamInfo<Backend>& info) {
  return std::string(BackendName(info.param));
}

INSTANTIATE_TEST_SUITE_P(Backends, KdaKernelsTest, ::testing::Values(Backend::kCpu, Backend::kCuda),
                         BackendParamName);
INSTANTIATE_TEST_SUITE_P(Backends, CudaAgreementTest, ::testing::Values(Backend::kCuda),
                         BackendParamName);
INSTANTIATE_TEST_SUITE_P(Backends, RecordStateBlocksTest,
                         ::testing::Values(Backend::kCpu, Backend::kCuda), BackendParamName);
INSTANTIATE_TEST_SUITE_P(Backends, DeviceCheckTest,
                         ::testing::Values(Backend::kCpu, Backend::kCuda), BackendParamName);

}  // namespace
}  // namespace kernels
}  // namespace specstate
