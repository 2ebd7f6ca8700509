// Commit mode FAST through the kernel interface (KdaKernels, the CPU
// backend), as the service calls it: mode kFast, VerifyArgs::fast and the
// layers' rings. Three copies of the service's memory run the same decode
// loop with fresh random inputs every step:
//  - FAST through KdaKernels (its host validation and device checks first);
//  - FAST through kernels/fast's direct calls (FastVerifyCpu, FastCommitCpu,
//    FastMaterializeCpu);
//  - EAGER through KdaKernels.
// The first two agree bit for bit after every call (outputs, state pools,
// rings, cursors): the interface runs kernels/fast's work, nothing of its
// own. The conv pools of the first equal EAGER's bit for bit (Commit compacts
// the windows as in every mode); with fp32 state its outputs and current
// states are within the contract's reach of EAGER's. Rows join, skip steps
// and change order; requests end (their blocks flushed with discard and
// prefilled afresh); Flush and single-block folds (first into a copy, as
// ReadState's: nothing changes, and the copy is the fold's) come in
// between, one of them between a step's Verify and its Commit. Then the
// device checks: each refusal names its field, bound and row, with nothing
// written. Every test draws fresh random inputs; its seed is printed
// (SPECSTATE_TEST_SEED=<seed> replays it).
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/device_status.h"
#include "kernels/dtype.h"
#include "kernels/fast/fast_args.h"
#include "kernels/fast/fast_kernels.h"
#include "kernels/fast/testing/fast_loop.h"
#include "kernels/kda_args.h"
#include "kernels/kda_kernels.h"
#include "tests/reference/kda_reference.h"

namespace specstate {
namespace kernels {
namespace fast {
namespace testing {
namespace {

namespace ref = ::specstate::reference;

uint64_t TestSeed() {
  const char* env = std::getenv("SPECSTATE_TEST_SEED");
  if (env != nullptr && *env != '\0') return std::strtoull(env, nullptr, 0);
  std::random_device device;
  return (uint64_t{device()} << 32) ^ device();
}

ref::Dtype RefDtype(DType d) {
  return d == DType::kBFloat16  ? ref::Dtype::kBFloat16
         : d == DType::kFloat16 ? ref::Dtype::kFloat16
                                : ref::Dtype::kFloat32;
}

// docs/semantics.md's budget for fp32 arithmetic against float64, plus one
// rounding to the stored dtype.
double Tolerance(DType stored) { return 1e-5 + ref::UnitRoundoff(RefDtype(stored)); }

template <typename T>
std::vector<uint8_t> Bytes(const std::vector<T>& v) {
  const uint8_t* p = reinterpret_cast<const uint8_t*>(v.data());
  return std::vector<uint8_t>(p, p + v.size() * sizeof(T));
}

enum class Path { kFastInterface, kFastDirect, kEager };

struct LoopSpec {
  KdaShape shape;
  bool align = false;
  int q = 4;
  int fold_every = 2;
  int layers = 2;
  int requests = 3;
  int steps = 24;
};

KdaShape Shape(LayerKind kind, KdaGate gate, int heads, int value_heads, DType act, DType state) {
  KdaShape s;
  s.num_heads = heads;
  s.num_value_heads = value_heads;
  s.head_dim = 64;
  s.act_dtype = act;
  s.state_dtype = state;
  s.kind = kind;
  s.gate = gate;
  s.lower_bound = -5.0f;
  return s;
}

constexpr int kConvDim = 8;
constexpr int kHistory = 3;  // conv_kernel - 1

// One layer's buffers in one copy of the service's memory.
struct LayerMemory {
  std::vector<uint8_t> state, conv, ring_k, out;
  std::vector<float> ring_u, ring_g;
  std::vector<FastCursor> cursors;
  std::vector<uint8_t> rec_kv, rec_g, rec_beta;  // EAGER
};

// One copy: what the kernels of one path own.
struct Memory {
  Path path;
  std::vector<LayerMemory> layers;
  std::vector<CommitLayer> table;
  DeviceStatus status{};
  std::vector<int32_t> snapshot_qsl, snapshot_indices, checked_blocks;
  std::vector<uint64_t> commit_workspace, verify_workspace;
};

class FastInterfaceTest : public ::testing::Test {
 protected:
  void Init(const LoopSpec& spec, uint64_t seed) {
    spec_ = spec;
    shape_ = spec.shape;
    rng_.seed(seed);
    a_log_.clear();
    dt_bias_.clear();
    table_.clear();
    computed_.clear();
    capacity_ = FastRingCapacity(spec.fold_every, spec.q);
    max_rows_ = spec.requests + 1;
    block_size_ = 6;
    width_ = spec.align ? 2 + spec.steps * spec.q / block_size_ : 1;
    num_blocks_ = 1 + int64_t{spec.requests} * width_;
    block_elems_ = ValueWidth(shape_) * shape_.head_dim;
    conv_width_ = kHistory + spec.q;
    for (int l = 0; l < spec.layers; ++l) {
      a_log_.emplace_back();
      dt_bias_.emplace_back();
      for (int h = 0; h < shape_.num_heads; ++h) a_log_[l].push_back(Normal(0.5f));
      for (int64_t i = 0; i < KeyWidth(shape_); ++i) dt_bias_[l].push_back(Normal(0.5f));
    }
    // The initial pools: a random state and conv window in every block.
    initial_state_.resize(spec.layers);
    initial_conv_.resize(spec.layers);
    for (int l = 0; l < spec.layers; ++l) {
      initial_state_[l] = RandomElements(shape_.state_dtype, num_blocks_ * block_elems_, 0.1f);
      initial_conv_[l] =
          RandomElements(shape_.act_dtype, num_blocks_ * kConvDim * conv_width_, 1.0f);
    }
    for (int r = 0; r < spec.requests; ++r) {
      table_.emplace_back();
      for (int c = 0; c < width_; ++c) table_[r].push_back(1 + r * width_ + c);
      computed_.push_back(spec.align ? 1 + static_cast<int>(rng_() % block_size_) : 1);
    }
  }

  float Normal(float stddev) { return std::normal_distribution<float>(0.0f, stddev)(rng_); }
  float Uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng_); }
  int Int(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }

  std::vector<uint8_t> RandomElements(DType dtype, int64_t count, float stddev) {
    std::vector<uint8_t> bytes(count * DTypeSize(dtype));
    for (int64_t i = 0; i < count; ++i) {
      ref::StoreElement(RefDtype(dtype), Normal(stddev), &bytes[i * DTypeSize(dtype)]);
    }
    return bytes;
  }

  size_t es() const { return DTypeSize(shape_.act_dtype); }
  size_t ss() const { return DTypeSize(shape_.state_dtype); }

  Memory MakeMemory(Path path) {
    Memory m;
    m.path = path;
    const int64_t tokens = int64_t{max_rows_} * spec_.q;
    for (int l = 0; l < spec_.layers; ++l) {
      LayerMemory lm;
      lm.state = initial_state_[l];
      lm.conv = initial_conv_[l];
      lm.out.assign(tokens * ValueWidth(shape_) * es(), 0xff);
      if (path == Path::kEager) {
        lm.rec_kv.assign(tokens * RecordTokenWidth(shape_) * es(), 0);
        lm.rec_g.assign(tokens * GateWidth(shape_) * es(), 0);
        lm.rec_beta.assign(tokens * ValueHeads(shape_) * es(), 0);
      } else {
        lm.ring_k.assign(FastRingKBytes(shape_, num_blocks_, capacity_), 0);
        lm.ring_u.assign(FastRingUBytes(shape_, num_blocks_, capacity_) / 4, 0.0f);
        lm.ring_g.assign(FastRingLogDecayBytes(shape_, num_blocks_, capacity_) / 4, 0.0f);
        lm.cursors.assign(num_blocks_, FastCursor{0, 0});
      }
      m.layers.push_back(std::move(lm));
    }
    for (int l = 0; l < spec_.layers; ++l) {
      LayerMemory& lm = m.layers[l];
      CommitLayer c{};
      c.state = StatePool{lm.state.data(), num_blocks_, block_elems_};
      c.conv = ConvPool{lm.conv.data(), num_blocks_, int64_t{kConvDim} * conv_width_,
                        conv_width_,        1,           kConvDim,
                        conv_width_};
      c.params = LayerParams{a_log_[l].data(), dt_bias_[l].data()};
      c.records = Records{lm.rec_kv.empty() ? nullptr : lm.rec_kv.data(),
                          lm.rec_g.empty() ? nullptr : lm.rec_g.data(),
                          lm.rec_beta.empty() ? nullptr : lm.rec_beta.data(), max_rows_, spec_.q};
      c.records_alt = c.records;
      if (path != Path::kEager) c.fast = RingsOf(lm);
      m.table.push_back(c);
    }
    m.snapshot_qsl.assign(max_rows_ + 1, 0);
    m.snapshot_indices.assign(max_rows_, 0);
    m.checked_blocks.assign(num_blocks_, 0);
    m.commit_workspace.assign(CommitWorkspaceBytes(max_rows_, spec_.q, num_blocks_) / 8 + 1, 0);
    m.verify_workspace.assign(VerifyWorkspaceBytes(num_blocks_) / 8 + 1, 0);
    return m;
  }

  FastRings RingsOf(LayerMemory& lm) const {
    return FastRings{lm.ring_k.data(), lm.ring_u.data(), lm.ring_g.data(), lm.cursors.data(),
                     num_blocks_, capacity_};
  }

  // A step's inputs: random activations of every layer.
  struct Window {
    std::vector<int32_t> qsl, sources, accepted, computed;
    std::vector<int32_t> table;  // align: [rows, width]
    std::vector<int> request;    // per row: the request, or -1 (a null row)
    std::vector<std::vector<uint8_t>> q, k, v, g, beta;  // per layer
    int64_t tokens() const { return qsl.back(); }
    int rows() const { return static_cast<int>(sources.size()); }
  };

  void DrawActivations(Window* w) {
    const bool gdn = shape_.kind == LayerKind::kGdn;
    const int64_t T = w->tokens();
    const auto draw = [&](int64_t n, auto value) {
      std::vector<uint8_t> bytes(n * es());
      for (int64_t i = 0; i < n; ++i) {
        ref::StoreElement(RefDtype(shape_.act_dtype), value(), &bytes[i * es()]);
      }
      return bytes;
    };
    for (int l = 0; l < spec_.layers; ++l) {
      w->q.push_back(draw(T * KeyWidth(shape_), [&] { return Normal(1.0f); }));
      w->k.push_back(draw(T * KeyWidth(shape_), [&] { return Normal(1.0f); }));
      w->v.push_back(draw(T * ValueWidth(shape_), [&] { return Normal(1.0f); }));
      w->g.push_back(
          draw(T * GateWidth(shape_), [&] { return gdn ? -Uniform(0.0f, 1.0f) : Normal(1.0f); }));
      w->beta.push_back(draw(T * ValueHeads(shape_),
                             [&] { return gdn ? Uniform(0.0f, 1.0f) : Normal(1.0f); }));
    }
  }

  // Rows in a random order; a request sometimes skips the step (a null row).
  Window Draw() {
    Window w;
    std::vector<int> order(spec_.requests);
    for (int r = 0; r < spec_.requests; ++r) order[r] = r;
    std::shuffle(order.begin(), order.end(), rng_);
    w.qsl.push_back(0);
    for (int r : order) {
      const bool skip = Int(0, 6) == 0;
      const int tokens = Int(1, spec_.q);
      w.request.push_back(skip ? -1 : r);
      w.sources.push_back(skip ? 0 : SourceOf(r));
      w.qsl.push_back(w.qsl.back() + tokens);
      w.accepted.push_back(Int(0, tokens + 1));
      w.computed.push_back(computed_[r]);
      for (int c = 0; c < width_; ++c) w.table.push_back(skip ? 0 : table_[r][c]);
    }
    DrawActivations(&w);
    return w;
  }

  int32_t SourceOf(int r) const {
    return spec_.align ? table_[r][(computed_[r] - 1) / block_size_] : table_[r][0];
  }

  VerifyArgs InterfaceVerifyArgs(Memory& m, const Window& w, int l) {
    LayerMemory& lm = m.layers[l];
    VerifyArgs a;
    a.shape = shape_;
    a.q = Activation{w.q[l].data(), KeyWidth(shape_)};
    a.k = Activation{w.k[l].data(), KeyWidth(shape_)};
    a.v = Activation{w.v[l].data(), ValueWidth(shape_)};
    a.g = Activation{w.g[l].data(), GateWidth(shape_)};
    a.beta = Activation{w.beta[l].data(), ValueHeads(shape_)};
    a.num_tokens = w.tokens();
    a.out = lm.out.data();
    a.state = m.table[l].state;
    a.params = m.table[l].params;
    a.records = m.table[l].records;
    a.num_rows = w.rows();
    a.query_start_loc = w.qsl.data();
    a.state_indices = IndexMatrix{w.sources.data(), 1, 1};
    if (l == 0) {
      a.snapshot_query_start_loc = m.snapshot_qsl.data();
      a.snapshot_state_indices = m.snapshot_indices.data();
    } else {
      a.expected_query_start_loc = m.snapshot_qsl.data();
      a.expected_state_indices = m.snapshot_indices.data();
    }
    a.status = &m.status;
    if (m.path == Path::kFastInterface) {
      a.mode = CommitMode::kFast;
      a.fast = m.table[l].fast;
      a.workspace = m.verify_workspace.data();
      a.workspace_bytes = m.verify_workspace.size() * 8;
    }
    return a;
  }

  FastVerifyArgs DirectVerifyArgs(Memory& m, const Window& w, int l) {
    const VerifyArgs v = InterfaceVerifyArgs(m, w, l);
    FastVerifyArgs a;
    a.shape = shape_;
    a.q = v.q;
    a.k = v.k;
    a.v = v.v;
    a.g = v.g;
    a.beta = v.beta;
    a.num_tokens = v.num_tokens;
    a.out = v.out;
    a.state = v.state;
    a.rings = m.table[l].fast;
    a.params = v.params;
    a.spec_query_len = spec_.q;
    a.num_rows = w.rows();
    a.query_start_loc = w.qsl.data();
    a.state_indices = w.sources.data();
    return a;
  }

  CommitArgs InterfaceCommitArgs(Memory& m, const Window& w) {
    CommitArgs a;
    a.shape = shape_;
    a.spec_query_len = spec_.q;
    a.num_layers = spec_.layers;
    a.layers = m.table.data();
    a.device_layers = m.table.data();
    a.num_rows = w.rows();
    a.query_start_loc = m.snapshot_qsl.data();
    a.state_indices = IndexMatrix{m.snapshot_indices.data(), 1, 1};
    a.batch = w.rows();
    a.num_accepted = w.accepted.data();
    if (spec_.align) {
      a.block_table = IndexMatrix{w.table.data(), width_, width_};
      a.num_computed_tokens = w.computed.data();
      a.mamba_block_size = block_size_;
    }
    a.workspace = m.commit_workspace.data();
    a.workspace_bytes = m.commit_workspace.size() * 8;
    a.status = &m.status;
    if (m.path == Path::kFastInterface) a.mode = CommitMode::kFast;
    return a;
  }

  std::vector<FastLayer> FastLayersOf(Memory& m) {
    std::vector<FastLayer> layers;
    for (const CommitLayer& c : m.table) layers.push_back(FastLayer{c.state, c.fast, c.params});
    return layers;
  }

  FlushArgs InterfaceFlushArgs(Memory& m, const std::vector<int32_t>* blocks, int layer,
                               bool discard) {
    FlushArgs a;
    a.shape = shape_;
    a.spec_query_len = spec_.q;
    a.num_layers = spec_.layers;
    a.layers = m.table.data();
    a.device_layers = m.table.data();
    if (blocks != nullptr) {
      a.blocks = blocks->data();
      a.num_blocks_given = static_cast<int>(blocks->size());
      a.checked_blocks = m.checked_blocks.data();
    }
    a.layer = layer;
    a.discard = discard;
    a.status = &m.status;
    a.mode = CommitMode::kFast;
    return a;
  }

  // Both FAST copies' device status after an interface call.
  absl::Status DeviceResult(const absl::Status& launch, const Memory& m, const char* op) {
    if (!launch.ok()) return launch;
    return DeviceStatusToStatus(m.status, op);
  }

  void VerifyAll(Memory& via, Memory& direct, Memory& eager, const Window& w) {
    const KdaKernels& k = CpuKdaKernels();
    for (int l = 0; l < spec_.layers; ++l) {
      const absl::Status a = DeviceResult(k.Verify(InterfaceVerifyArgs(via, w, l), nullptr), via,
                                          "Verify");
      ASSERT_TRUE(a.ok()) << a;
      const absl::Status b = FastVerifyCpu(DirectVerifyArgs(direct, w, l));
      ASSERT_TRUE(b.ok()) << b;
      const absl::Status c = DeviceResult(k.Verify(InterfaceVerifyArgs(eager, w, l), nullptr),
                                          eager, "Verify");
      ASSERT_TRUE(c.ok()) << c;
      ASSERT_EQ(via.layers[l].out, direct.layers[l].out) << "layer " << l << ": outputs";
      ExpectOutputsNear(via, eager, w, l);
    }
  }

  void CommitAll(Memory& via, Memory& direct, Memory& eager, const Window& w) {
    const KdaKernels& k = CpuKdaKernels();
    const absl::Status a =
        DeviceResult(k.Commit(InterfaceCommitArgs(via, w), nullptr), via, "Commit");
    ASSERT_TRUE(a.ok()) << a;
    const std::vector<FastLayer> layers = FastLayersOf(direct);
    FastCommitArgs f;
    const CommitArgs c = InterfaceCommitArgs(direct, w);
    f.shape = shape_;
    f.spec_query_len = spec_.q;
    f.num_layers = spec_.layers;
    f.layers = layers.data();
    f.num_rows = c.num_rows;
    f.query_start_loc = w.qsl.data();
    f.state_indices = IndexMatrix{w.sources.data(), 1, 1};
    f.batch = c.batch;
    f.num_accepted = c.num_accepted;
    f.block_table = c.block_table;
    f.num_computed_tokens = c.num_computed_tokens;
    f.mamba_block_size = c.mamba_block_size;
    const absl::Status b = FastCommitCpu(f);
    ASSERT_TRUE(b.ok()) << b;
    const absl::Status e =
        DeviceResult(k.Commit(InterfaceCommitArgs(eager, w), nullptr), eager, "Commit");
    ASSERT_TRUE(e.ok()) << e;
    for (int l = 0; l < spec_.layers; ++l) {
      ASSERT_EQ(via.layers[l].conv, eager.layers[l].conv)
          << "layer " << l << ": FAST's conv windows differ from EAGER's";
    }
  }

  // ReadState's: `block` of `layer` folded into a copy through the interface
  // (FlushArgs::copy, Materialize's `out`); the copy's bytes.
  std::vector<uint8_t> FlushIntoCopy(Memory& m, int32_t block, int layer) {
    const std::vector<int32_t> one = {block};
    FlushArgs a = InterfaceFlushArgs(m, &one, layer, false);
    const int64_t elems = ValueWidth(shape_) * shape_.head_dim;
    const size_t bytes = elems * DTypeSize(shape_.state_dtype);
    std::vector<uint64_t> copy((2 * bytes + 7) / 8, 0);  // 16-byte aligned (malloc's)
    a.copy = StatePool{copy.data(), 2, elems};
    const absl::Status st = DeviceResult(CpuKdaKernels().Flush(a, nullptr), m, "Flush");
    EXPECT_TRUE(st.ok()) << st;
    const uint8_t* p = reinterpret_cast<const uint8_t*>(copy.data()) + bytes;
    return std::vector<uint8_t>(p, p + bytes);
  }

  // Flush through the interface and Materialize directly, alike.
  void FlushBoth(Memory& via, Memory& direct, const std::vector<int32_t>* blocks, int layer,
                 bool discard) {
    const absl::Status a = DeviceResult(
        CpuKdaKernels().Flush(InterfaceFlushArgs(via, blocks, layer, discard), nullptr), via,
        "Flush");
    ASSERT_TRUE(a.ok()) << a;
    // Without a list: every block (a ring never used folds to itself).
    std::vector<int32_t> every;
    for (int32_t b = 1; b < num_blocks_; ++b) every.push_back(b);
    const std::vector<FastLayer> layers = FastLayersOf(direct);
    FastMaterializeArgs m;
    m.shape = shape_;
    m.num_layers = spec_.layers;
    m.layers = layers.data();
    m.blocks = blocks != nullptr ? blocks->data() : every.data();
    m.num_blocks_given = static_cast<int>(blocks != nullptr ? blocks->size() : every.size());
    m.layer = layer;
    m.discard = discard;
    const absl::Status b = FastMaterializeCpu(m);
    ASSERT_TRUE(b.ok()) << b;
  }

  // Everything both FAST copies own, equal byte for byte.
  void ExpectSameFastMemory(const Memory& via, const Memory& direct, const std::string& when) {
    for (int l = 0; l < spec_.layers; ++l) {
      const LayerMemory &a = via.layers[l], &b = direct.layers[l];
      EXPECT_EQ(a.state, b.state) << when << ", layer " << l << ": state pool";
      EXPECT_EQ(a.ring_k, b.ring_k) << when << ", layer " << l << ": ring k";
      EXPECT_EQ(Bytes(a.ring_u), Bytes(b.ring_u)) << when << ", layer " << l << ": ring u";
      EXPECT_EQ(Bytes(a.ring_g), Bytes(b.ring_g)) << when << ", layer " << l << ": ring gamma";
      EXPECT_EQ(Bytes(a.cursors), Bytes(b.cursors)) << when << ", layer " << l << ": cursors";
    }
  }

  std::vector<double> Values(const std::vector<uint8_t>& bytes, DType dtype, int64_t begin,
                             int64_t count) const {
    std::vector<double> v(count);
    for (int64_t i = 0; i < count; ++i) {
      v[i] = ref::LoadElement(RefDtype(dtype), &bytes[(begin + i) * DTypeSize(dtype)]);
    }
    return v;
  }

  // FAST's outputs against EAGER's, live rows only: both within the
  // contract of the float64 reference (FAST within 2x the exact path's
  // error), so within 3x the exact path's budget of each other. With bf16
  // state that budget includes the state's roundings (EAGER rounds it at
  // every Commit, FAST at every fold; docs/semantics.md measures both paths'
  // errors at 1-2 bf16 units over 1,000 steps): 2 units.
  void ExpectOutputsNear(const Memory& fast, const Memory& eager, const Window& w, int l) {
    const double budget =
        Tolerance(shape_.act_dtype) +
        (shape_.state_dtype == DType::kBFloat16 ? 2 * ref::UnitRoundoff(ref::Dtype::kBFloat16)
                                                : 0.0);
    for (int n = 0; n < w.rows(); ++n) {
      if (w.request[n] < 0) continue;
      const int64_t begin = w.qsl[n] * ValueWidth(shape_);
      const int64_t count = (w.qsl[n + 1] - w.qsl[n]) * ValueWidth(shape_);
      const std::vector<double> got = Values(fast.layers[l].out, shape_.act_dtype, begin, count);
      const std::vector<double> want =
          Values(eager.layers[l].out, shape_.act_dtype, begin, count);
      EXPECT_LT(NormError(got, want), 3 * budget)
          << "layer " << l << ", row " << n << ": FAST's outputs against EAGER's";
    }
  }

  // Block b's current state in a FAST copy (Materialize into `out`).
  std::vector<double> Current(Memory& m, int l, int32_t block) {
    std::vector<uint8_t> out(block_elems_ * ss());
    const std::vector<FastLayer> layers = FastLayersOf(m);
    FastMaterializeArgs a;
    a.shape = shape_;
    a.num_layers = spec_.layers;
    a.layers = layers.data();
    a.blocks = &block;
    a.num_blocks_given = 1;
    a.layer = l;
    a.out = out.data();
    const absl::Status st = FastMaterializeCpu(a);
    EXPECT_TRUE(st.ok()) << st;
    return Values(out, shape_.state_dtype, 0, block_elems_);
  }

  // With fp32 state: each request's current state against EAGER's pool
  // (within 3x the exact path's budget, as the outputs).
  void ExpectStatesNear(Memory& fast, const Memory& eager, const std::string& when) {
    if (shape_.state_dtype != DType::kFloat32) return;
    for (int l = 0; l < spec_.layers; ++l) {
      for (int r = 0; r < spec_.requests; ++r) {
        const int32_t b = SourceOf(r);
        const std::vector<double> want =
            Values(eager.layers[l].state, shape_.state_dtype, b * block_elems_, block_elems_);
        EXPECT_LT(NormError(Current(fast, l, b), want), 3 * Tolerance(DType::kFloat32))
            << when << ", layer " << l << ", block " << b;
      }
    }
  }

  // After Commit: each live request's computed tokens move on.
  void Advance(const Window& w) {
    for (int n = 0; n < w.rows(); ++n) {
      if (w.request[n] < 0) continue;
      const int tokens = w.qsl[n + 1] - w.qsl[n];
      computed_[w.request[n]] += std::min(std::max(w.accepted[n], 0), tokens);
    }
  }

  // Request r ends: its blocks are flushed with discard (FAST copies) and a
  // new request starts in them (a prefill writes a fresh state into each
  // copy's pools).
  void Restart(int r, Memory& via, Memory& direct, Memory& eager) {
    const std::vector<int32_t> blocks = table_[r];
    FlushBoth(via, direct, &blocks, -1, /*discard=*/true);
    computed_[r] = spec_.align ? 1 + Int(0, block_size_ - 1) : 1;
    for (int l = 0; l < spec_.layers; ++l) {
      const std::vector<uint8_t> fresh = RandomElements(shape_.state_dtype, block_elems_, 0.1f);
      for (Memory* m : {&via, &direct, &eager}) {
        std::memcpy(m->layers[l].state.data() + SourceOf(r) * block_elems_ * ss(), fresh.data(),
                    fresh.size());
      }
    }
  }

  LoopSpec spec_;
  KdaShape shape_;
  std::mt19937_64 rng_;
  int capacity_ = 0, max_rows_ = 0, block_size_ = 0, width_ = 0, conv_width_ = 0;
  int64_t num_blocks_ = 0, block_elems_ = 0;
  std::vector<std::vector<float>> a_log_, dt_bias_;
  std::vector<std::vector<uint8_t>> initial_state_, initial_conv_;
  std::vector<std::vector<int32_t>> table_;
  std::vector<int> computed_;
};

TEST_F(FastInterfaceTest, AgreesWithTheDirectCallsBitForBit) {
  const LoopSpec loops[] = {
      {Shape(LayerKind::kKda, KdaGate::kSafe, 2, 0, DType::kBFloat16, DType::kFloat32), false},
      {Shape(LayerKind::kKda, KdaGate::kPlain, 2, 0, DType::kFloat16, DType::kFloat32), true},
      {Shape(LayerKind::kGdn, KdaGate::kSafe, 1, 2, DType::kFloat32, DType::kBFloat16), true},
      {Shape(LayerKind::kGdn, KdaGate::kSafe, 2, 4, DType::kBFloat16, DType::kFloat32), false},
  };
  for (const LoopSpec& spec : loops) {
    const uint64_t seed = TestSeed();
    SCOPED_TRACE(absl::StrCat(spec.shape.kind == LayerKind::kGdn ? "GDN" : "KDA",
                              spec.align ? " align" : " none", ", ",
                              DTypeName(spec.shape.act_dtype), " activations, ",
                              DTypeName(spec.shape.state_dtype), " state (replay with "
                              "SPECSTATE_TEST_SEED=", seed, ")"));
    Init(spec, seed);
    Memory via = MakeMemory(Path::kFastInterface), direct = MakeMemory(Path::kFastDirect),
           eager = MakeMemory(Path::kEager);
    int folds = 0, mid_step_folds = 0, boundaries = 0;
    for (int step = 0; step < spec.steps; ++step) {
      const std::string when = absl::StrCat("step ", step);
      SCOPED_TRACE(when);
      const Window w = Draw();
      VerifyAll(via, direct, eager, w);
      if (HasFatalFailure()) return;
      ExpectSameFastMemory(via, direct, when + ", after Verify");
      if (step % 4 == 1) {
        // ReadState's fold of one block in one layer, between the step's
        // Verify and its Commit: the step's candidates survive it.
        for (int n = 0; n < w.rows(); ++n) {
          if (w.request[n] < 0) continue;
          const std::vector<int32_t> one = {w.sources[n]};
          const int l = step % spec.layers;
          // Into a copy first: nothing changes (the pools, the rings, the
          // candidates), and the copy is what the fold in place then leaves.
          const std::vector<uint8_t> copied = FlushIntoCopy(via, w.sources[n], l);
          ExpectSameFastMemory(via, direct, when + ", after a fold into a copy");
          FlushBoth(via, direct, &one, l, false);
          const size_t bytes = copied.size();
          const std::vector<uint8_t> pool(via.layers[l].state.begin() + w.sources[n] * bytes,
                                          via.layers[l].state.begin() + (w.sources[n] + 1) * bytes);
          EXPECT_EQ(copied, pool) << when << ": the fold into a copy differs from the fold in place";
          ++mid_step_folds;
          break;
        }
      }
      std::vector<int> held;  // layer 0's ring tokens of each row's block
      for (int n = 0; n < w.rows(); ++n) {
        held.push_back(w.sources[n] > 0 ? via.layers[0].cursors[w.sources[n]].tokens : 0);
      }
      CommitAll(via, direct, eager, w);
      if (HasFatalFailure()) return;
      for (int n = 0; n < w.rows(); ++n) {  // a ring that had tokens and now has none
        folds += w.sources[n] > 0 && held[n] + w.accepted[n] > 0 &&
                 via.layers[0].cursors[w.sources[n]].tokens == 0;
      }
      for (int n = 0; n < w.rows(); ++n) {
        if (w.request[n] < 0 || !spec.align) continue;
        const int tokens = w.qsl[n + 1] - w.qsl[n];
        const int len = std::min(std::max(w.accepted[n], 0), tokens);
        boundaries += len > 0 && (w.computed[n] / block_size_ + 1) * block_size_ <= w.computed[n] + len;
      }
      Advance(w);
      ExpectSameFastMemory(via, direct, when + ", after Commit");
      ExpectStatesNear(via, eager, when + ", after Commit");
      if (step % 5 == 4) {
        std::vector<int32_t> some = {0};
        for (int r = 0; r < spec.requests; r += 2) some.push_back(SourceOf(r));
        some.push_back(some.back());  // listed twice: folded once
        FlushBoth(via, direct, &some, -1, false);
        ExpectSameFastMemory(via, direct, when + ", after a Flush of some blocks");
      }
      if (step % 7 == 6) {
        FlushBoth(via, direct, nullptr, -1, false);
        ExpectSameFastMemory(via, direct, when + ", after a Flush of every block");
        ExpectStatesNear(via, eager, when + ", after a Flush of every block");
      }
      if (step % 9 == 8) {
        Restart(Int(0, spec.requests - 1), via, direct, eager);
        ExpectSameFastMemory(via, direct, when + ", after a request's end");
      }
    }
    EXPECT_GT(folds, 0) << "no Commit folded a ring";
    EXPECT_GT(mid_step_folds, 0);
    if (spec.align) {
      EXPECT_GT(boundaries, 0) << "no row crossed a block boundary";
    }
  }
}

// ---------------------------------------------------------------------------
// The device checks: each refusal with its code, field and bound, nothing
// written.

class FastInterfaceChecksTest : public FastInterfaceTest {
 protected:
  void SetUp() override {
    seed_ = TestSeed();
    LoopSpec spec{Shape(LayerKind::kKda, KdaGate::kSafe, 2, 0, DType::kBFloat16, DType::kFloat32),
                  true};
    spec.requests = 2;
    Init(spec, seed_);
    via_ = MakeMemory(Path::kFastInterface);
  }

  // Every byte the FAST kernels may write.
  std::vector<std::vector<uint8_t>> Everything() const {
    std::vector<std::vector<uint8_t>> all;
    for (const LayerMemory& lm : via_.layers) {
      for (const std::vector<uint8_t>& b :
           {lm.state, lm.conv, lm.ring_k, lm.out, Bytes(lm.ring_u), Bytes(lm.ring_g),
            Bytes(lm.cursors)}) {
        all.push_back(b);
      }
    }
    return all;
  }

  // Rows 0 and 1 of requests 0 and 1, Q tokens each, every layer verified.
  Window TwoRows() {
    Window w;
    w.qsl = {0, spec_.q, 2 * spec_.q};
    for (int r = 0; r < 2; ++r) {
      w.request.push_back(r);
      w.sources.push_back(SourceOf(r));
      w.accepted.push_back(spec_.q);
      w.computed.push_back(computed_[r]);
      for (int c = 0; c < width_; ++c) w.table.push_back(table_[r][c]);
    }
    DrawActivations(&w);
    return w;
  }

  absl::Status Verify(const Window& w, int l, const Prerequisites& p = {}) {
    VerifyArgs a = InterfaceVerifyArgs(via_, w, l);
    a.prerequisites = p;
    return DeviceResult(CpuKdaKernels().Verify(a, nullptr), via_, "Verify of layer 0");
  }
  absl::Status Commit(const Window& w, const Prerequisites& p = {}) {
    CommitArgs a = InterfaceCommitArgs(via_, w);
    a.prerequisites = p;
    return DeviceResult(CpuKdaKernels().Commit(a, nullptr), via_, "Commit");
  }

  void ExpectRefused(const absl::Status& st, absl::StatusCode code, const std::string& text,
                     const std::vector<std::vector<uint8_t>>& before) {
    EXPECT_EQ(st.code(), code) << st;
    EXPECT_NE(st.message().find(text), std::string::npos) << st;
    EXPECT_TRUE(Everything() == before) << "a refused call wrote: " << st;
  }

  uint64_t seed_ = 0;
  Memory via_;
};

TEST_F(FastInterfaceChecksTest, VerifyRefusesWithNothingWritten) {
  SCOPED_TRACE(absl::StrCat("replay with SPECSTATE_TEST_SEED=", seed_));
  Window w = TwoRows();
  {
    // Two rows verifying from one block: their candidates would share slots.
    Window shared = w;
    shared.sources[1] = shared.sources[0];
    const auto before = Everything();
    ExpectRefused(Verify(shared, 0), absl::StatusCode::kInvalidArgument,
                  absl::StrCat("state_indices[1]: rows 0 and 1 both verify from block ",
                               shared.sources[0]),
                  before);
  }
  {
    // A cursor no Commit leaves.
    via_.layers[0].cursors[w.sources[1]] = FastCursor{capacity_ + 3, 0};
    const auto before = Everything();
    ExpectRefused(Verify(w, 0), absl::StatusCode::kFailedPrecondition,
                  absl::StrCat("rings.cursors[", w.sources[1], "] = {tokens ", capacity_ + 3,
                               ", candidates 0} (row 1) is not a cursor a Commit leaves in a "
                               "ring of ",
                               capacity_, " tokens"),
                  before);
    // A ring with no room for the window.
    via_.layers[0].cursors[w.sources[1]] = FastCursor{capacity_ - 1, 0};
    const auto full = Everything();
    ExpectRefused(Verify(w, 0), absl::StatusCode::kOutOfRange,
                  absl::StrCat("state_indices[1] = ", w.sources[1], " (row 1): the block's ring "
                               "holds ", capacity_ - 1, " of ", capacity_,
                               " tokens: no room for the window's ", spec_.q),
                  full);
    via_.layers[0].cursors[w.sources[1]] = FastCursor{0, 0};
  }
  {
    // A failed earlier call of the step, a cancelled step, a faulted input.
    DeviceStatus failed{};
    failed.failed = 1;
    const auto before = Everything();
    ExpectRefused(Verify(w, 0, Prerequisites{&failed, 1}), absl::StatusCode::kFailedPrecondition,
                  "earlier call 0 of the same step failed", before);
    const uint32_t cancelled = 7;
    ExpectRefused(Verify(w, 0, Prerequisites{nullptr, 0, &cancelled, 7}),
                  absl::StatusCode::kCancelled, "its step was cancelled", before);
    const uint32_t fault = 1;
    ExpectRefused(Verify(w, 0, Prerequisites{nullptr, 0, nullptr, 0, &fault}),
                  absl::StatusCode::kDataLoss, "reading its inputs faulted", before);
  }
  {
    // A later layer's indices differ from the step's snapshot.
    ASSERT_TRUE(Verify(w, 0).ok());
    Window other = w;
    std::swap(other.sources[0], other.sources[1]);
    const auto before = Everything();
    ExpectRefused(Verify(other, 1), absl::StatusCode::kInvalidArgument,
                  "differs from", before);
  }
  {
    // Host checks: a window past FAST's, rings of another pool, FAST and
    // DEFERRED at once.
    VerifyArgs a = InterfaceVerifyArgs(via_, w, 0);
    a.records.q = kMaxFastQueryLen + 1;
    absl::Status st = CpuKdaKernels().Verify(a, nullptr);
    EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange) << st;
    EXPECT_NE(st.message().find("at most 8 tokens a row"), std::string::npos) << st;
    a = InterfaceVerifyArgs(via_, w, 0);
    a.fast.num_blocks = num_blocks_ - 1;
    st = CpuKdaKernels().Verify(a, nullptr);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("fast.num_blocks"), std::string::npos) << st;
    a = InterfaceVerifyArgs(via_, w, 0);
    int32_t entries[1] = {}, header[4] = {};
    a.pending = PendingBlocks{entries, header, 1, num_blocks_, 4};
    st = CpuKdaKernels().Verify(a, nullptr);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("two commit modes"), std::string::npos) << st;
  }
}

TEST_F(FastInterfaceChecksTest, CommitAndFlushRefuseWithNothingWritten) {
  SCOPED_TRACE(absl::StrCat("replay with SPECSTATE_TEST_SEED=", seed_));
  Window w = TwoRows();
  ASSERT_TRUE(Verify(w, 0).ok());
  {
    // Layer 1 not verified: no candidates in its rings.
    const auto before = Everything();
    ExpectRefused(Commit(w), absl::StatusCode::kFailedPrecondition,
                  absl::StrCat("layer 1: row 0 commits ", spec_.q, " tokens to block ",
                               w.sources[0], " but its last Verify left 0 candidates"),
                  before);
  }
  ASSERT_TRUE(Verify(w, 1).ok());
  {
    DeviceStatus failed{};
    failed.failed = 1;
    const auto before = Everything();
    ExpectRefused(Commit(w, Prerequisites{&failed, 1}), absl::StatusCode::kFailedPrecondition,
                  "earlier call 0 of the same step failed", before);
  }
  {
    // Align mode: row 0's window crosses into a block whose ring holds
    // another request's tokens (it was not flushed before its reuse).
    Window reuse = w;
    const int32_t next = reuse.table[(computed_[0] - 1) / block_size_ + 1];
    via_.layers[1].cursors[next] = FastCursor{2, 0};
    reuse.computed[0] = ((computed_[0] - 1) / block_size_ + 1) * block_size_;  // at a boundary
    via_.snapshot_indices[0] = reuse.table[(reuse.computed[0] - 1) / block_size_];
    reuse.sources[0] = via_.snapshot_indices[0];
    via_.layers[0].cursors[reuse.sources[0]].candidates = spec_.q;
    via_.layers[1].cursors[reuse.sources[0]].candidates = spec_.q;
    const auto before = Everything();
    ExpectRefused(Commit(reuse), absl::StatusCode::kFailedPrecondition,
                  absl::StrCat("block_table[0] = ", next, " (row 0) is to be written, but layer 1's "
                               "ring of it still holds tokens of another request"),
                  before);
    via_.layers[1].cursors[next] = FastCursor{0, 0};
    via_.snapshot_indices[0] = w.sources[0];
  }
  {
    // Flush: a block past the pool; a cursor no Commit leaves.
    const std::vector<int32_t> past = {1, static_cast<int32_t>(num_blocks_)};
    const auto before = Everything();
    ExpectRefused(DeviceResult(CpuKdaKernels().Flush(InterfaceFlushArgs(via_, &past, -1, false),
                                                     nullptr),
                               via_, "Flush"),
                  absl::StatusCode::kOutOfRange,
                  absl::StrCat("In Flush: blocks[1] = ", num_blocks_, " is out of range"), before);
    via_.layers[1].cursors[3] = FastCursor{-1, 0};
    const std::vector<int32_t> three = {3};
    const auto corrupt = Everything();
    ExpectRefused(DeviceResult(CpuKdaKernels().Flush(InterfaceFlushArgs(via_, &three, -1, false),
                                                     nullptr),
                               via_, "Flush"),
                  absl::StatusCode::kFailedPrecondition,
                  "In Flush: layer 1: rings.cursors[3] = {tokens -1, candidates 0} is not a cursor",
                  corrupt);
    via_.layers[1].cursors[3] = FastCursor{0, 0};
  }
  {
    // Host checks: a fold journal too small for the pool.
    const std::vector<int32_t> three = {3};
    FlushArgs a = InterfaceFlushArgs(via_, &three, -1, false);
    PendingJournalRecord record;
    std::vector<int32_t> listed(num_blocks_);
    a.fold_journal = FoldJournal{&record, listed.data(), static_cast<int>(num_blocks_) - 1};
    const absl::Status st = CpuKdaKernels().Flush(a, nullptr);
    EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange) << st;
    EXPECT_NE(st.message().find("fold_journal.capacity"), std::string::npos) << st;
  }
  // The step's Commit itself still passes, journaled (kept pools): nothing
  // above changed a byte; its rows' blocks are listed and recorded.
  CommitArgs a = InterfaceCommitArgs(via_, w);
  JournalRecord record;
  std::vector<int32_t> entries(2 * a.num_rows);
  std::vector<BlockRecord> blocks(num_blocks_);
  a.journal = CommitJournal{&record, entries.data(), a.num_rows, blocks.data(), 41};
  const absl::Status st = DeviceResult(CpuKdaKernels().Commit(a, nullptr), via_, "Commit");
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(record.state, kJournalCommitted);
  EXPECT_EQ(record.last_committed_step, 41u);
  EXPECT_EQ(record.num_rows, a.num_rows);
  int recorded = 0;
  for (int32_t b : entries) {
    if (b <= kNullBlock) continue;
    EXPECT_EQ(blocks[b].step, 41u) << "block " << b;
    EXPECT_EQ(blocks[b].sequence, 1u) << "block " << b;
    ++recorded;
  }
  EXPECT_GE(recorded, a.num_rows) << "each row's final block at least";
}

// A Flush with a fold journal (kept pools) lists the blocks it folds and
// leaves the journal idle; a copy (ReadState) does not touch it.
TEST_F(FastInterfaceChecksTest, AFlushJournalsTheBlocksItFolds) {
  SCOPED_TRACE(absl::StrCat("replay with SPECSTATE_TEST_SEED=", seed_));
  Window w = TwoRows();
  ASSERT_TRUE(Verify(w, 0).ok());
  ASSERT_TRUE(Verify(w, 1).ok());
  ASSERT_TRUE(Commit(w).ok());
  // The next step's Verify: candidates in the rings (tokens too where a row
  // stayed in its block).
  ASSERT_TRUE(Verify(w, 0).ok());
  ASSERT_TRUE(Verify(w, 1).ok());
  std::vector<int32_t> holding;  // blocks whose ring holds tokens or candidates
  for (int32_t b = 1; b < num_blocks_; ++b) {
    for (int l = 0; l < 2; ++l) {
      const FastCursor c = via_.layers[l].cursors[b];
      if (c.tokens != 0 || c.candidates != 0) {
        holding.push_back(b);
        break;
      }
    }
  }
  ASSERT_FALSE(holding.empty());
  PendingJournalRecord record;
  std::vector<int32_t> listed(num_blocks_, -7);
  FlushArgs a = InterfaceFlushArgs(via_, nullptr, -1, false);
  a.fold_journal = FoldJournal{&record, listed.data(), static_cast<int>(num_blocks_)};
  ASSERT_TRUE(DeviceResult(CpuKdaKernels().Flush(a, nullptr), via_, "Flush").ok());
  EXPECT_EQ(record.state, kJournalIdle);
  EXPECT_EQ(record.kind, kPendingFlush);
  EXPECT_EQ(record.layer, -1);
  std::vector<int32_t> folded(listed.begin(), listed.begin() + record.count);
  std::sort(folded.begin(), folded.end());
  EXPECT_EQ(folded, holding) << "every block whose ring held tokens or candidates, once";
  for (int l = 0; l < 2; ++l) {
    for (int32_t b : holding) EXPECT_EQ(via_.layers[l].cursors[b].tokens, 0);
  }
}

}  // namespace
}  // namespace testing
}  // namespace fast
}  // namespace kernels
}  // namespace specstate
