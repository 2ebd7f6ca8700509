// The FAST mode's measured errors against the float64 reference, beside the
// exact path's (the CPU kernels' Verify + EAGER Commit) on the same inputs:
// the tables of docs/semantics.md, "Fast mode (FAST): accuracy".
//
//   bazel run //kernels/fast:fast_error_curves                  # everything (a few minutes)
//   bazel run //kernels/fast:fast_error_curves -- --section=numerics --steps=300
//
// Sections: `contract` (max errors over the run, FAST / exact, per kind,
// state dtype and F), `curves` (errors by step and by number of folds),
// `numerics` (what each storage and operand choice costs), `extreme`
// (a full ring at the lowest gate).
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "kernels/dtype.h"
#include "kernels/fast/fast_kernels.h"
#include "kernels/fast/testing/fast_loop.h"
#include "kernels/kda_args.h"

ABSL_FLAG(std::string, section, "all", "contract, curves, numerics, extreme or all");
ABSL_FLAG(int, steps, 1000, "decode steps of each loop");
ABSL_FLAG(uint64_t, seed, 23, "the loops' seed (each loop adds its index)");

namespace specstate {
namespace kernels {
namespace fast {
namespace testing {
namespace {

using Operands = FastNumerics::Operands;

struct Kind {
  const char* name;
  LayerKind kind;
  KdaGate gate;
  int value_heads;
};

constexpr Kind kKinds[] = {
    {"KDA safe", LayerKind::kKda, KdaGate::kSafe, 0},
    {"KDA plain", LayerKind::kKda, KdaGate::kPlain, 0},
    {"GDN", LayerKind::kGdn, KdaGate::kSafe, 4},
};

LoopConfig Config(const Kind& kind, DType state, int f, int q, int head_dim, uint64_t seed) {
  LoopConfig c;
  c.shape.num_heads = 2;
  c.shape.head_dim = head_dim;
  c.shape.act_dtype = DType::kFloat32;  // outputs unrounded: the algorithm's error shows
  c.shape.state_dtype = state;
  c.shape.kind = kind.kind;
  c.shape.gate = kind.gate;
  c.shape.num_value_heads = kind.value_heads;
  c.shape.lower_bound = -5.0f;
  c.q = q;
  c.fold_every = f;
  c.rows = 3;
  c.steps = absl::GetFlag(FLAGS_steps);
  c.seed = seed;
  return c;
}

Errors Max(const LoopResult& r, bool fast, size_t begin = 0, size_t end = SIZE_MAX) {
  Errors m;
  end = std::min(end, r.steps.size());
  for (size_t i = begin; i < end; ++i) {
    const Errors& e = fast ? r.steps[i].fast : r.steps[i].exact;
    m.out_elem = std::max(m.out_elem, e.out_elem);
    m.out_norm = std::max(m.out_norm, e.out_norm);
    if (r.steps[i].states) {
      m.state_elem = std::max(m.state_elem, e.state_elem);
      m.state_norm = std::max(m.state_norm, e.state_norm);
    }
  }
  return m;
}

LoopResult MustRun(const LoopConfig& c) {
  absl::StatusOr<LoopResult> r = RunLoop(c);
  if (!r.ok()) {
    std::fprintf(stderr, "%s: %s\n", Describe(c).c_str(), std::string(r.status().message()).c_str());
    std::exit(1);
  }
  return *std::move(r);
}

void Contract(uint64_t* seed) {
  std::printf("\n## Max error over %d steps (3 rows, H=2, K=64, Q=4, fp32 activations)\n\n",
              absl::GetFlag(FLAGS_steps));
  std::printf("elem: max|got - want| / max|want| per step, max over steps; norm: ||got - want|| / "
              "||want||. FAST/exact: the ratio (contract: <= 2).\n\n");
  std::printf("| kind | state | F | folds | out elem exact | out elem FAST | ratio | out norm "
              "ratio | state elem exact | state elem FAST | ratio | state norm ratio |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Kind& kind : kKinds) {
    for (DType state : {DType::kFloat32, DType::kBFloat16}) {
      for (int f : {4, 8, 16}) {
        const LoopConfig c = Config(kind, state, f, 4, 64, (*seed)++);
        const LoopResult r = MustRun(c);
        const Errors e = Max(r, false), x = Max(r, true);
        std::printf("| %s | %s | %d | %d | %.2e | %.2e | %.2f | %.2f | %.2e | %.2e | %.2f | %.2f |\n",
                    kind.name, std::string(DTypeName(state)).c_str(), f, r.folds, e.out_elem,
                    x.out_elem, x.out_elem / e.out_elem, x.out_norm / e.out_norm, e.state_elem,
                    x.state_elem, x.state_elem / e.state_elem, x.state_norm / e.state_norm);
        std::fflush(stdout);
      }
    }
  }
  // Larger heads, fewer steps.
  std::printf("\n| kind | state | K | F | Q | steps | out elem exact | out elem FAST | ratio | "
              "state elem exact | state elem FAST | ratio |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (int k : {128, 256}) {
    LoopConfig c = Config(kKinds[k == 128 ? 0 : 2], DType::kFloat32, 8, 8, k, (*seed)++);
    c.shape.num_heads = 1;
    c.shape.num_value_heads = k == 128 ? 0 : 2;
    c.rows = 2;
    c.steps = std::max(c.steps / 5, 1);
    const LoopResult r = MustRun(c);
    const Errors e = Max(r, false), x = Max(r, true);
    std::printf("| %s | fp32 | %d | 8 | 8 | %d | %.2e | %.2e | %.2f | %.2e | %.2e | %.2f |\n",
                k == 128 ? "KDA safe" : "GDN", k, c.steps, e.out_elem, x.out_elem,
                x.out_elem / e.out_elem, e.state_elem, x.state_elem, x.state_elem / e.state_elem);
  }
}

void Curves(uint64_t* seed) {
  const int steps = absl::GetFlag(FLAGS_steps);
  std::printf("\n## Error by step (max over the steps of each span; F=16, Q=4, fp32 state)\n\n");
  std::vector<std::pair<int, int>> spans;
  for (int b = 0, e = 10; b < steps; b = e, e *= 10) spans.push_back({b, std::min(e, steps)});
  std::printf("| kind | path | quantity |");
  for (auto [b, e] : spans) std::printf(" steps %d-%d |", b + 1, e);
  std::printf("\n|---|---|---|");
  for (size_t i = 0; i < spans.size(); ++i) std::printf("---|");
  std::printf("\n");
  for (const Kind& kind : kKinds) {
    const LoopResult r = MustRun(Config(kind, DType::kFloat32, 16, 4, 64, (*seed)++));
    for (bool fast : {false, true}) {
      for (int state = 0; state < 2; ++state) {
        std::printf("| %s | %s | %s elem |", kind.name, fast ? "FAST" : "exact",
                    state ? "state" : "out");
        for (auto [b, e] : spans) {
          const Errors m = Max(r, fast, b, e);
          std::printf(" %.2e |", state ? m.state_elem : m.out_elem);
        }
        std::printf("\n");
      }
    }
  }
  std::printf("\n## State error by number of folds (row-folds so far; max over each span of "
              "steps; fp32 and bf16 state, F=4, Q=4)\n\n");
  std::printf("| kind | state | folds (end of span) | exact state elem | FAST state elem | ratio |\n");
  std::printf("|---|---|---|---|---|---|\n");
  for (const Kind& kind : kKinds) {
    for (DType state : {DType::kFloat32, DType::kBFloat16}) {
      const LoopResult r = MustRun(Config(kind, state, 4, 4, 64, (*seed)++));
      const size_t n = r.steps.size();
      for (size_t q = 0; q < 4; ++q) {
        const size_t b = n * q / 4, e = n * (q + 1) / 4;
        if (e <= b) continue;
        const Errors ex = Max(r, false, b, e), fa = Max(r, true, b, e);
        std::printf("| %s | %s | %d | %.2e | %.2e | %.2f |\n", kind.name,
                    std::string(DTypeName(state)).c_str(), r.steps[e - 1].folds, ex.state_elem,
                    fa.state_elem, fa.state_elem / ex.state_elem);
      }
    }
  }
}

void Numerics(uint64_t* seed) {
  struct Variant {
    const char* name;
    FastNumerics n;
  };
  std::vector<Variant> variants;
  const auto add = [&](const char* name, auto set) {
    FastNumerics n;
    set(n);
    variants.push_back({name, n});
  };
  add("fp32 throughout (the CPU backend)", [](FastNumerics&) {});
  add("ring k stored normalized, bf16", [](FastNumerics& n) { n.ring_k_normalized_bf16 = true; });
  add("ring u stored bf16", [](FastNumerics& n) { n.ring_u_bf16 = true; });
  add("ring log-decay stored cumulative (exponent G_c - G_i)",
      [](FastNumerics& n) { n.ring_cumulative_log_decay = true; });
  add("ring keys (kw.kr) bf16", [](FastNumerics& n) { n.ring_keys = Operands::kBf16; });
  add("ring values (A u) bf16", [](FastNumerics& n) { n.ring_values = Operands::kBf16; });
  add("ring keys + values bf16", [](FastNumerics& n) {
    n.ring_keys = n.ring_values = Operands::kBf16;
  });
  add("ring keys + values 3xbf16", [](FastNumerics& n) {
    n.ring_keys = n.ring_values = Operands::kBf16Split;
  });
  add("ring keys + values tf32", [](FastNumerics& n) {
    n.ring_keys = n.ring_values = Operands::kTf32;
  });
  add("ring keys + values 3xtf32", [](FastNumerics& n) {
    n.ring_keys = n.ring_values = Operands::kTf32Split;
  });
  add("checkpoint bf16", [](FastNumerics& n) { n.checkpoint = Operands::kBf16; });
  add("checkpoint S hi/lo bf16, k bf16", [](FastNumerics& n) { n.checkpoint = Operands::kBf16SplitA; });
  add("checkpoint 3xbf16 (S and k hi/lo)", [](FastNumerics& n) { n.checkpoint = Operands::kBf16Split; });
  add("checkpoint tf32", [](FastNumerics& n) { n.checkpoint = Operands::kTf32; });
  add("checkpoint 3xtf32", [](FastNumerics& n) { n.checkpoint = Operands::kTf32Split; });
  add("fold bf16", [](FastNumerics& n) { n.fold = Operands::kBf16; });
  add("fold tf32", [](FastNumerics& n) { n.fold = Operands::kTf32; });
  add("fold 3xtf32", [](FastNumerics& n) { n.fold = Operands::kTf32Split; });
  add("all bf16 tensor cores (ring bf16, checkpoint 3xbf16, fold bf16)", [](FastNumerics& n) {
    n.ring_keys = n.ring_values = n.fold = Operands::kBf16;
    n.checkpoint = Operands::kBf16Split;
  });
  add("all 3xtf32", [](FastNumerics& n) {
    n.ring_keys = n.ring_values = n.fold = n.checkpoint = Operands::kTf32Split;
  });
  const int steps = std::max(absl::GetFlag(FLAGS_steps) / 2, 1);
  for (const Kind& kind : {kKinds[0], kKinds[2]}) {
    for (DType state : {DType::kFloat32, DType::kBFloat16}) {
      std::printf("\n## What each choice costs: %s, %s state, F=16, Q=4, %d steps (same inputs)\n\n",
                  kind.name, std::string(DTypeName(state)).c_str(), steps);
      std::printf("| variant | out elem | / exact | out norm / exact | state elem | / exact | state "
                  "norm / exact |\n|---|---|---|---|---|---|---|\n");
      const uint64_t s = (*seed)++;
      for (const Variant& v : variants) {
        LoopConfig c = Config(kind, state, 16, 4, 64, s);
        c.steps = steps;
        c.numerics = v.n;
        const LoopResult r = MustRun(c);
        const Errors e = Max(r, false), x = Max(r, true);
        std::printf("| %s | %.2e | %.2f | %.2f | %.2e | %.2f | %.2f |\n", v.name, x.out_elem,
                    x.out_elem / e.out_elem, x.out_norm / e.out_norm, x.state_elem,
                    x.state_elem / e.state_elem, x.state_norm / e.state_norm);
        std::fflush(stdout);
      }
    }
  }
}

void Extreme(uint64_t* seed) {
  std::printf("\n## A full ring at the lowest gate (every token at gamma = lower_bound = -5 for "
              "KDA safe and GDN; KDA plain: g = 40), F=16, Q=8: R=128, exp(-5 R) = 0 in fp32\n\n");
  std::printf("| kind | state | finite | out elem exact | out elem FAST | state elem exact | state "
              "elem FAST |\n|---|---|---|---|---|---|---|\n");
  for (const Kind& kind : kKinds) {
    for (DType state : {DType::kFloat32, DType::kBFloat16}) {
      LoopConfig c = Config(kind, state, 16, 8, 64, (*seed)++);
      c.gates = GateInputs::kLowest;
      c.steps = std::max(absl::GetFlag(FLAGS_steps) / 5, 1);
      const LoopResult r = MustRun(c);
      const Errors e = Max(r, false), x = Max(r, true);
      std::printf("| %s | %s | %s | %.2e | %.2e | %.2e | %.2e |\n", kind.name,
                  std::string(DTypeName(state)).c_str(), r.finite ? "yes" : "NO", e.out_elem,
                  x.out_elem, e.state_elem, x.state_elem);
    }
  }
}

}  // namespace
}  // namespace testing
}  // namespace fast
}  // namespace kernels
}  // namespace specstate

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  namespace t = specstate::kernels::fast::testing;
  const std::string section = absl::GetFlag(FLAGS_section);
  uint64_t seed = absl::GetFlag(FLAGS_seed);
  std::printf("# fast_error_curves --steps=%d --seed=%llu\n", absl::GetFlag(FLAGS_steps),
              static_cast<unsigned long long>(seed));
  if (section == "all" || section == "contract") t::Contract(&seed);
  if (section == "all" || section == "curves") t::Curves(&seed);
  if (section == "all" || section == "numerics") t::Numerics(&seed);
  if (section == "all" || section == "extreme") t::Extreme(&seed);
  return 0;
}
