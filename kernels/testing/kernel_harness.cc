#include "kernels/testing/kernel_harness.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/device_status.h"
#include "kernels/dtype.h"
#include "kernels/kda_args.h"
#include "kernels/kda_kernels.h"
#include "kernels/testing/backend_memory.h"
#include "tests/reference/kda_reference.h"

namespace specstate {
namespace kernels {

void PrintTo(Backend backend, std::ostream* os) { *os << BackendName(backend); }

namespace testing {
namespace {

namespace ref = ::specstate::reference;

// The poison of each dtype: a signaling NaN (see Poisoned()).
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

// Index-matrix padding (between a row's columns and the next row): a kernel
// that reads it sees an index far past any pool and fails its checks.
constexpr int32_t kIndexPadding = 1 << 30;

// The budget for fp32 arithmetic against the float64 reference (see Tolerance()).
constexpr double kComputeTolerance = 1e-5;

// Each test's random source. SPECSTATE_TEST_SEED replays a failed run.
uint64_t TestSeed() {
  const char* env = std::getenv("SPECSTATE_TEST_SEED");
  if (env != nullptr && *env != '\0') return std::strtoull(env, nullptr, 0);
  std::random_device device;
  return (uint64_t{device()} << 32) ^ device();
}

// The order in which TakeSnapshot() lists a layer's buffers.
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

Activation ActivationOf(const Tensor& t, int64_t offset, int64_t stride, size_t es) {
  return Activation{static_cast<const char*>(t.data()) + offset * es, stride};
}

}  // namespace

void Must(const absl::Status& status, const char* what) {
  if (!status.ok()) {
    std::fprintf(stderr, "test infrastructure failed: %s: %s\n", what, status.ToString().c_str());
    std::abort();
  }
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

int64_t FirstDifference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  if (a.size() != b.size()) return static_cast<int64_t>(std::min(a.size(), b.size()));
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

double RelativeError(const std::vector<double>& got, const std::vector<double>& want) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  return norm > 0.0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

double ElementwiseError(const std::vector<double>& got, const std::vector<double>& want) {
  double worst = 0.0, scale = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = std::fabs(got[i] - want[i]);
    if (!(d <= worst)) worst = d;  // NaN sticks
    scale = std::max(scale, std::fabs(want[i]));
  }
  return scale > 0.0 ? worst / scale : worst;
}

double Tolerance(DType stored) {
  return stored == DType::kFloat32 ? kComputeTolerance
                                   : kComputeTolerance + ref::UnitRoundoff(RefDtype(stored));
}

::testing::AssertionResult CallOk(const CallResult& r) {
  if (!r.launch.ok()) return ::testing::AssertionFailure() << "the call returned " << r.launch;
  if (!r.device.ok()) return ::testing::AssertionFailure() << "the device reported " << r.device;
  return ::testing::AssertionSuccess();
}

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
      spec.num_layers, " layer(s)", spec.align ? ", align" : "",
      spec.conv_token_major ? ", conv [W, D]" : spec.conv_dense ? ", conv dense" : "");
}

bool Commits(const ref::PlanRow& p) {
  return p.source > ref::kNullBlock && p.commit_len > 0 && p.final_block > ref::kNullBlock;
}

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
// KdaKernelsTest.

void KdaKernelsTest::SetUp() {
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

Tensor KdaKernelsTest::Upload(std::vector<uint8_t> bytes) {
  Tensor t;
  t.dev = Must(BackendBuffer::Allocate(backend(), bytes.size()), "allocate");
  t.Write(bytes);
  return t;
}

const int32_t* KdaKernelsTest::Ints(CallData* cd, const std::vector<int32_t>& values) {
  cd->tensors.push_back(Upload(ToBytes(values)));
  return cd->tensors.back().As<int32_t>();
}

IndexMatrix KdaKernelsTest::Matrix(CallData* cd, const std::vector<std::vector<int32_t>>& rows,
                                   int64_t row_stride) {
  const int cols = rows.empty() ? 0 : static_cast<int>(rows[0].size());
  std::vector<int32_t> flat(std::max<size_t>(rows.size(), 1) * row_stride, kIndexPadding);
  for (size_t r = 0; r < rows.size(); ++r) {
    std::copy(rows[r].begin(), rows[r].end(), flat.begin() + r * row_stride);
  }
  return IndexMatrix{Ints(cd, flat), row_stride, cols};
}

std::vector<uint8_t> KdaKernelsTest::RandomElements(DType dtype, size_t count, float stddev) {
  std::vector<uint8_t> bytes(count * DTypeSize(dtype));
  for (size_t i = 0; i < count; ++i) {
    ref::StoreElement(RefDtype(dtype), rng().Normal(stddev), &bytes[i * DTypeSize(dtype)]);
  }
  return bytes;
}

CallResult KdaKernelsTest::Finish(const absl::Status& launch, const char* op,
                                  const DeviceStatus* device_status, bool mirrored) {
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

CallResult KdaKernelsTest::RunStock(Step& s, int l) {
  CallData cd;
  const StockArgs args = StockArgsFor(s, l, &cd);
  return Finish(kernels_->Stock(args, stream()), "Stock", s, /*mirrored=*/false);
}

CallResult KdaKernelsTest::RunVerify(Step& s, int l, const Prerequisites& prerequisites) {
  CallData cd;
  VerifyArgs args = VerifyArgsFor(s, l, &cd);
  args.prerequisites = prerequisites;
  args.status_mirror = ZeroedMirror();
  return Finish(kernels_->Verify(args, stream()), "Verify", s);
}

CallResult KdaKernelsTest::RunCommit(Step& s, const Prerequisites& prerequisites) {
  CallData cd;
  CommitArgs args = CommitArgsFor(s, &cd);
  args.prerequisites = prerequisites;
  args.status_mirror = ZeroedMirror();
  return Finish(kernels_->Commit(args, stream()), "Commit", s);
}

void KdaKernelsTest::StockAndVerifyAll(Step& s) {
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
  } else if (spec.conv_dense) {
    s.conv_token_stride = 1;
    s.conv_dim_stride = s.conv_width;
    s.conv_block_stride = int64_t{spec.conv_dim} * s.conv_width;
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
  // conv update leaves it (docs/semantics.md, Commit step 2): history h_1 .. h_hl
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
// offset c - 1 (docs/semantics.md, Commit step 2). A boundary block holds the
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

std::string BackendParamName(const ::testing::TestParamInfo<Backend>& info) {
  return std::string(BackendName(info.param));
}

INSTANTIATE_TEST_SUITE_P(Backends, KdaKernelsTest, ::testing::Values(Backend::kCpu, Backend::kCuda),
                         BackendParamName);
// A binary may link the harness only for a fixture derived from
// KdaKernelsTest, with no case of KdaKernelsTest itself.
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(KdaKernelsTest);

}  // namespace testing
}  // namespace kernels
}  // namespace specstate
