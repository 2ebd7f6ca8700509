#include "tests/reference/kda_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace specstate {
namespace reference {
namespace {

// The reference takes valid inputs only: anything else is a bug in the test.
#define REF_CHECK(cond)                                                                      \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      std::fprintf(stderr, "%s:%d: reference precondition failed: %s\n", __FILE__, __LINE__, \
                   #cond);                                                                   \
      std::abort();                                                                          \
    }                                                                                        \
  } while (false)

// `x` rounded to `precision` significant bits with exponents down to `emin`
// (below that the spacing stays 2^(emin - precision + 1): subnormals), to
// nearest with ties to even (the default rounding mode of nearbyint).
// Plain arithmetic on doubles, exact for every float input.
double RoundToPrecision(double x, int precision, int emin) {
  if (x == 0.0 || !std::isfinite(x)) return x;
  const int e = std::max(std::ilogb(x), emin);
  const double spacing = std::ldexp(1.0, e - precision + 1);
  return std::nearbyint(x / spacing) * spacing;
}

constexpr double kFloat16Max = 65504.0;

double RoundFloat16(float x) {
  if (std::isnan(x)) return x;
  const double r = RoundToPrecision(x, 11, -14);
  if (std::fabs(r) > kFloat16Max) return std::copysign(INFINITY, r);
  return r;
}

double RoundBFloat16(float x) {
  if (std::isnan(x)) return x;
  // Past the largest bf16 the rounded value is 2^128, which is inf as a float.
  return static_cast<float>(RoundToPrecision(x, 8, -126));
}

uint32_t FloatBits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

float FloatFromBits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

}  // namespace

uint16_t BFloat16FromFloat(float x) {
  if (std::isnan(x)) return static_cast<uint16_t>((FloatBits(x) >> 16) | 0x0040u);
  // The rounded value is a float whose low 16 bits are zero.
  return static_cast<uint16_t>(FloatBits(static_cast<float>(RoundBFloat16(x))) >> 16);
}

float BFloat16ToFloat(uint16_t bits) { return FloatFromBits(uint32_t{bits} << 16); }

uint16_t Float16FromFloat(float x) {
  const uint16_t sign = std::signbit(x) ? 0x8000u : 0u;
  if (std::isnan(x)) return sign | 0x7e00u;
  const double r = std::fabs(RoundFloat16(x));
  if (std::isinf(r)) return sign | 0x7c00u;
  if (r < std::ldexp(1.0, -14)) {  // subnormal (or zero): units of 2^-24
    return sign | static_cast<uint16_t>(r * std::ldexp(1.0, 24));
  }
  const int e = std::ilogb(r);
  const uint16_t mantissa = static_cast<uint16_t>((std::ldexp(r, -e) - 1.0) * 1024.0);
  return sign | static_cast<uint16_t>((e + 15) << 10) | mantissa;
}

float Float16ToFloat(uint16_t bits) {
  const double sign = (bits & 0x8000u) ? -1.0 : 1.0;
  const int exponent = (bits >> 10) & 0x1f;
  const int mantissa = bits & 0x3ff;
  if (exponent == 31) return static_cast<float>(mantissa == 0 ? sign * INFINITY : NAN);
  if (exponent == 0) return static_cast<float>(sign * std::ldexp(mantissa, -24));
  return static_cast<float>(sign * std::ldexp(1.0 + mantissa / 1024.0, exponent - 15));
}

size_t SizeOf(Dtype dtype) { return dtype == Dtype::kFloat32 ? 4 : 2; }

float RoundTo(Dtype dtype, float x) {
  switch (dtype) {
    case Dtype::kFloat32:
      return x;
    case Dtype::kFloat16:
      return static_cast<float>(RoundFloat16(x));
    case Dtype::kBFloat16:
      return static_cast<float>(RoundBFloat16(x));
  }
  return x;
}

void StoreElement(Dtype dtype, float x, void* dst) {
  switch (dtype) {
    case Dtype::kFloat32:
      std::memcpy(dst, &x, 4);
      return;
    case Dtype::kFloat16: {
      const uint16_t bits = Float16FromFloat(x);
      std::memcpy(dst, &bits, 2);
      return;
    }
    case Dtype::kBFloat16: {
      const uint16_t bits = BFloat16FromFloat(x);
      std::memcpy(dst, &bits, 2);
      return;
    }
  }
}

double LoadElement(Dtype dtype, const void* src) {
  switch (dtype) {
    case Dtype::kFloat32: {
      float x;
      std::memcpy(&x, src, 4);
      return x;
    }
    case Dtype::kFloat16: {
      uint16_t bits;
      std::memcpy(&bits, src, 2);
      return Float16ToFloat(bits);
    }
    case Dtype::kBFloat16: {
      uint16_t bits;
      std::memcpy(&bits, src, 2);
      return BFloat16ToFloat(bits);
    }
  }
  return NAN;
}

double UnitRoundoff(Dtype dtype) {
  switch (dtype) {
    case Dtype::kFloat32:
      return std::ldexp(1.0, -24);
    case Dtype::kFloat16:
      return std::ldexp(1.0, -11);
    case Dtype::kBFloat16:
      return std::ldexp(1.0, -8);
  }
  return 0.0;
}

// ---------------------------------------------------------------------------
// The recurrence.

namespace {

// One token of value head `hv` (key head h = hv / (HV / H)): the per-token
// step of docs/semantics.md on `s` ([V, K]), writing o[v] to `o`. `g` is the
// token's gate input (KDA: K columns of key head h; GDN: one value).
void TokenStep(const Shape& shape, const LayerParams& params, int hv, const double* q_raw,
               const double* k_raw, const double* v, const double* g, double beta, double* s,
               double* o) {
  const int K = shape.head_dim;
  const int h = hv / (shape.hv() / shape.heads);
  double q_sum = 0.0, k_sum = 0.0;
  for (int j = 0; j < K; ++j) {
    q_sum += q_raw[j] * q_raw[j];
    k_sum += k_raw[j] * k_raw[j];
  }
  const double q_norm = std::sqrt(q_sum + 1e-6);
  const double k_norm = std::sqrt(k_sum + 1e-6);
  const double scale = 1.0 / std::sqrt(static_cast<double>(K));
  std::vector<double> q(K), k(K), decay(K);
  for (int j = 0; j < K; ++j) {
    q[j] = q_raw[j] / q_norm * scale;
    k[j] = k_raw[j] / k_norm;
    if (shape.kind == Kind::kGdn) {
      decay[j] = std::exp(g[0]);
      continue;
    }
    const double a = std::exp(params.a_log[h]);
    const double x = g[j] + params.dt_bias[h * K + j];
    if (shape.plain_gate) {
      const double softplus = x > 20.0 ? x : std::log1p(std::exp(x));
      decay[j] = std::exp(-a * softplus);
    } else {
      decay[j] = std::exp(shape.lower_bound / (1.0 + std::exp(-(a * x))));
    }
  }
  const double strength = shape.kind == Kind::kGdn ? beta : 1.0 / (1.0 + std::exp(-beta));
  for (int row = 0; row < K; ++row) {  // V = K state rows
    double* sv = s + static_cast<size_t>(row) * K;
    double kdot = 0.0;
    for (int j = 0; j < K; ++j) {
      sv[j] *= decay[j];
      kdot += sv[j] * k[j];
    }
    const double u = (v[row] - kdot) * strength;
    double out = 0.0;
    for (int j = 0; j < K; ++j) {
      sv[j] += u * k[j];
      out += sv[j] * q[j];
    }
    o[row] = out;
  }
}

// Runs `tokens` tokens of a row from `initial` (all value heads), starting
// at activation token `bos`. after(t, state, o) sees the state and the
// outputs ([HV, V]) after each token.
template <typename After>
void RunRow(const Shape& shape, const LayerParams& params, const Tokens& x, int64_t bos, int tokens,
            const State& initial, After after) {
  const int H = shape.heads;
  const int HV = shape.hv();
  const int K = shape.head_dim;
  REF_CHECK(H > 0 && HV % H == 0);
  const size_t head = static_cast<size_t>(K) * K;
  REF_CHECK(initial.size() == head * HV);
  REF_CHECK(bos >= 0 && bos + tokens <= x.count);
  State s = initial;
  std::vector<double> o(shape.value_width());
  const bool gdn = shape.kind == Kind::kGdn;
  for (int t = 0; t < tokens; ++t) {
    const size_t tok = static_cast<size_t>(bos + t);
    for (int hv = 0; hv < HV; ++hv) {
      const size_t key = (tok * H + hv / (HV / H)) * K;
      const size_t value = (tok * HV + hv) * K;
      const double* g = gdn ? &x.g[tok * HV + hv] : &x.g[key];
      TokenStep(shape, params, hv, &x.q[key], &x.k[key], &x.v[value], g, x.beta[tok * HV + hv],
                &s[head * hv], &o[static_cast<size_t>(hv) * K]);
    }
    after(t, s, o);
  }
}

const State& Lookup(const StatePool& pool, int32_t block) {
  const auto it = pool.find(block);
  REF_CHECK(it != pool.end());
  return it->second;
}

void WriteOutputs(const Shape& shape, int64_t tok, const std::vector<double>& o,
                  std::vector<double>* out, std::vector<bool>* written) {
  const size_t per_token = shape.value_width();
  std::copy(o.begin(), o.end(), out->begin() + tok * per_token);
  (*written)[tok] = true;
}

}  // namespace

StockResult Stock(const Shape& shape, const LayerParams& params, const Tokens& tokens,
                  const StockCall& call, StatePool* pool) {
  const int num_rows = static_cast<int>(call.query_start_loc.size()) - 1;
  REF_CHECK(num_rows >= 0 && static_cast<int>(call.ssm_state_indices.size()) >= num_rows);
  StockResult result;
  result.out.assign(static_cast<size_t>(tokens.count) * shape.value_width(), 0.0);
  result.written.assign(tokens.count, false);
  result.states.resize(num_rows);
  for (int n = 0; n < num_rows; ++n) {
    const int64_t bos = call.query_start_loc[n];
    const int count = static_cast<int>(call.query_start_loc[n + 1] - bos);
    if (count == 0) continue;
    const std::vector<int32_t>& idx = call.ssm_state_indices[n];
    REF_CHECK(count <= static_cast<int>(idx.size()));
    const int first_col = call.num_accepted_tokens.empty() ? 0 : call.num_accepted_tokens[n] - 1;
    REF_CHECK(first_col >= 0 && first_col < static_cast<int>(idx.size()));
    const int32_t slot = idx[first_col];
    if (slot <= kNullBlock) continue;  // no outputs, no states
    const State initial = Lookup(*pool, slot);
    RunRow(shape, params, tokens, bos, count, initial,
           [&](int t, const State& s, const std::vector<double>& o) {
             WriteOutputs(shape, bos + t, o, &result.out, &result.written);
             result.states[n].push_back(s);
             if (idx[t] > kNullBlock) (*pool)[idx[t]] = s;
           });
  }
  return result;
}

Records MakeRecords(const Shape& shape, int rows, int q) {
  Records r;
  r.rows = rows;
  r.q = q;
  const size_t tokens = static_cast<size_t>(rows) * q;
  r.k.assign(tokens * shape.key_width(), 0.0);
  r.v.assign(tokens * shape.value_width(), 0.0);
  r.g.assign(tokens * shape.gate_width(), 0.0);
  r.beta.assign(tokens * shape.hv(), 0.0);
  r.source_token.assign(tokens, -1);
  return r;
}

VerifyResult Verify(const Shape& shape, const LayerParams& params, const Tokens& tokens,
                    const VerifyCall& call, const StatePool& pool, Records* records) {
  const int num_rows = static_cast<int>(call.query_start_loc.size()) - 1;
  REF_CHECK(num_rows >= 0 && num_rows <= records->rows);
  REF_CHECK(static_cast<int>(call.state_indices.size()) >= num_rows);
  const size_t hk = shape.key_width(), vw = shape.value_width(), gw = shape.gate_width();
  const size_t hv = shape.hv();
  VerifyResult result;
  result.out.assign(static_cast<size_t>(tokens.count) * vw, 0.0);
  result.written.assign(tokens.count, false);
  std::fill(records->source_token.begin(), records->source_token.end(), -1);
  for (int n = 0; n < num_rows; ++n) {
    const int64_t bos = call.query_start_loc[n];
    const int count = static_cast<int>(call.query_start_loc[n + 1] - bos);
    REF_CHECK(count >= 0 && count <= records->q);
    const int32_t slot = call.state_indices[n];
    if (count == 0 || slot <= kNullBlock) continue;
    RunRow(shape, params, tokens, bos, count, Lookup(pool, slot),
           [&](int t, const State&, const std::vector<double>& o) {
             WriteOutputs(shape, bos + t, o, &result.out, &result.written);
           });
    for (int t = 0; t < count; ++t) {
      const size_t rec = static_cast<size_t>(n) * records->q + t;
      const size_t tok = static_cast<size_t>(bos + t);
      std::copy_n(&tokens.k[tok * hk], hk, &records->k[rec * hk]);
      std::copy_n(&tokens.v[tok * vw], vw, &records->v[rec * vw]);
      std::copy_n(&tokens.g[tok * gw], gw, &records->g[rec * gw]);
      std::copy_n(&tokens.beta[tok * hv], hv, &records->beta[rec * hv]);
      records->source_token[rec] = bos + t;
    }
  }
  return result;
}

std::vector<PlanRow> PlanCommit(const CommitCall& call) {
  const int num_rows = static_cast<int>(call.query_start_loc.size()) - 1;
  REF_CHECK(num_rows >= 0 && static_cast<int>(call.state_indices.size()) >= num_rows);
  const int q = call.spec_query_len;
  std::vector<PlanRow> plan(num_rows);
  for (int i = 0; i < num_rows; ++i) {
    PlanRow& p = plan[i];
    const int32_t source = call.state_indices[i];
    const int r = call.request_indices.empty() ? i : call.request_indices[i];
    REF_CHECK(r >= 0 && r < static_cast<int>(call.num_accepted.size()));
    const int64_t acc = call.num_accepted[r];
    const int64_t tokens = call.query_start_loc[i + 1] - call.query_start_loc[i];
    int64_t commit_len = std::min(std::min(std::max<int64_t>(acc, 0), tokens), int64_t{q});
    int64_t final_block = source;
    int64_t boundary = kNullBlock;
    int64_t boundary_len = 0;
    if (call.align && source > kNullBlock && commit_len > 0) {
      // The reference computes these for every row; rows that commit nothing
      // discard them below, so they are only evaluated where they matter
      // (an idle row may carry no valid metadata).
      const int64_t nc = call.num_computed_tokens[r];
      const int64_t bs = call.mamba_block_size;
      const std::vector<int32_t>& table = call.block_table[r];
      const int64_t width = static_cast<int64_t>(table.size());
      const int64_t fnc = nc + commit_len;
      final_block = table[std::min(std::max<int64_t>(fnc - 1, 0) / bs, width - 1)];
      const int64_t next_boundary = (nc / bs + 1) * bs;
      boundary_len = next_boundary - nc;
      if (fnc >= next_boundary) {
        const int64_t col = next_boundary / bs - 1;
        REF_CHECK(col < width);  // the kernels reject this (device check)
        boundary = table[col];
      }
    }
    if (!(source > kNullBlock && commit_len > 0)) {
      commit_len = 0;
      final_block = kNullBlock;
      boundary = kNullBlock;
      boundary_len = 0;
    }
    p.source = source;
    p.commit_len = static_cast<int32_t>(commit_len);
    p.final_block = static_cast<int32_t>(final_block);
    p.boundary_block = static_cast<int32_t>(boundary);
    p.boundary_len = static_cast<int32_t>(boundary_len);
  }
  return plan;
}

IndexRows ReplayIndices(const std::vector<PlanRow>& plan, int q) {
  IndexRows rows(plan.size(), std::vector<int32_t>(q + 1, kNullBlock));
  for (size_t i = 0; i < plan.size(); ++i) {
    const PlanRow& p = plan[i];
    if (!(p.source > kNullBlock && p.commit_len > 0 && p.final_block > kNullBlock)) continue;
    std::vector<int32_t>& row = rows[i];
    row[p.commit_len - 1] = p.final_block;
    if (p.boundary_block > kNullBlock && p.boundary_len < p.commit_len) {
      row[p.boundary_len - 1] = p.boundary_block;
    }
    row[q] = p.source;
  }
  return rows;
}

void CompactConv(const CommitCall& call, const std::vector<PlanRow>& plan, int history_len,
                 ConvPool* conv) {
  for (const PlanRow& p : plan) {
    if (p.source <= kNullBlock || p.commit_len == 0 || p.final_block <= kNullBlock) continue;
    const bool boundary = call.align && p.boundary_block > kNullBlock;
    // Read the whole row's windows before writing any (final or boundary may
    // be the source).
    std::vector<uint32_t> final_window, boundary_window;
    for (int d = 0; d < conv->dim; ++d) {
      for (int x = 0; x < history_len; ++x) {
        final_window.push_back(conv->at(p.source, d, p.commit_len - 1 + x));
        if (boundary) boundary_window.push_back(conv->at(p.source, d, p.boundary_len - 1 + x));
      }
    }
    // The reference stores the boundary window first, then the final one.
    size_t i = 0;
    for (int d = 0; d < conv->dim; ++d) {
      for (int x = 0; x < history_len; ++x, ++i) {
        if (boundary) conv->at(p.boundary_block, d, x) = boundary_window[i];
      }
    }
    i = 0;
    for (int d = 0; d < conv->dim; ++d) {
      for (int x = 0; x < history_len; ++x, ++i) conv->at(p.final_block, d, x) = final_window[i];
    }
  }
}

std::vector<PlanRow> Commit(const Shape& shape, const CommitCall& call, int history_len,
                            std::vector<CommitLayer>* layers) {
  REF_CHECK(!layers->empty());
  const int q = call.spec_query_len;
  const std::vector<PlanRow> plan = PlanCommit(call);
  const int num_rows = static_cast<int>(plan.size());
  for (CommitLayer& layer : *layers) CompactConv(call, plan, history_len, layer.conv);

  StockCall replay;
  replay.ssm_state_indices = ReplayIndices(plan, q);
  for (int i = 0; i <= num_rows; ++i) replay.query_start_loc.push_back(i * q);
  replay.num_accepted_tokens.assign(num_rows, q + 1);
  for (CommitLayer& layer : *layers) {
    const Records& rec = *layer.records;
    REF_CHECK(rec.q == q && rec.rows >= num_rows);
    // The stock kernel over the records: q = k = recorded k.
    Tokens x;
    x.count = static_cast<int64_t>(num_rows) * q;
    x.k.assign(rec.k.begin(), rec.k.begin() + x.count * shape.key_width());
    x.q = x.k;
    x.v.assign(rec.v.begin(), rec.v.begin() + x.count * shape.value_width());
    x.g.assign(rec.g.begin(), rec.g.begin() + x.count * shape.gate_width());
    x.beta.assign(rec.beta.begin(), rec.beta.begin() + x.count * shape.hv());
    Stock(shape, layer.params, x, replay, layer.states);  // outputs discarded
  }
  return plan;
}

void RecordStateBlocks(const RecordStateBlocksCall& call, std::vector<int32_t>* state_idx,
                       std::vector<int32_t>* num_accepted) {
  for (int i = 0; i < call.num_rows; ++i) {
    const int b = call.request_indices.empty() ? i : call.request_indices[i];
    const int r = call.idx_mapping[b];
    if (r < 0) continue;
    REF_CHECK(r < static_cast<int>(state_idx->size()));
    const int64_t last =
        std::max<int64_t>(int64_t{call.num_computed_tokens[b]} + call.num_sampled[b] - 1, 0);
    (*state_idx)[r] = static_cast<int32_t>(
        std::min<int64_t>(last / call.mamba_block_size, call.block_table_width - 1));
    (*num_accepted)[r] = 1;
  }
}

}  // namespace reference
}  // namespace specstate
