#include "server/config/sizing.h"

#include <cctype>
#include <cmath>
#include <limits>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/device_status.h"
#include "kernels/kda_args.h"
#include "kernels/kda_kernels.h"
#include "server/kept/pool_header.h"
#include "server/modes/rules.h"
#include "server/engine/step_table.h"

namespace specstate {
namespace server {

namespace {

constexpr char kExpected[] =
    "expected bytes (e.g. 60GiB, 512MiB, 80GB, 123456789) or a fraction of the free memory "
    "(e.g. 0.8 or 80%)";

// Bytes per unit, or 0 for an unknown unit (`unit` in lower case).
int64_t UnitBytes(absl::string_view unit) {
  if (unit.empty() || unit == "b") return 1;
  if (unit == "kb") return 1000;
  if (unit == "mb") return 1000 * 1000;
  if (unit == "gb") return int64_t{1000} * 1000 * 1000;
  if (unit == "tb") return int64_t{1000} * 1000 * 1000 * 1000;
  if (unit == "kib") return int64_t{1} << 10;
  if (unit == "mib") return int64_t{1} << 20;
  if (unit == "gib") return int64_t{1} << 30;
  if (unit == "tib") return int64_t{1} << 40;
  return 0;
}

}  // namespace

absl::StatusOr<PoolMemory> ParsePoolMemory(absl::string_view text, absl::string_view field) {
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(field, "=", text, ": ", why));
  };
  const absl::string_view s = absl::StripAsciiWhitespace(text);
  if (s.empty()) return bad(absl::StrCat("empty; ", kExpected));
  size_t split = 0;
  while (split < s.size() && (std::isdigit(static_cast<unsigned char>(s[split])) ||
                              s[split] == '.' || s[split] == '-' || s[split] == '+')) {
    ++split;
  }
  const absl::string_view number = s.substr(0, split);
  const std::string unit = absl::AsciiStrToLower(absl::StripAsciiWhitespace(s.substr(split)));
  double value = 0;
  if (number.empty() || !absl::SimpleAtod(number, &value) || !std::isfinite(value)) {
    return bad(kExpected);
  }
  if (!(value > 0)) return bad("must be positive");
  PoolMemory memory;
  if (unit == "%") {
    if (value > 100) return bad("a share of the free memory must be in (0%, 100%]");
    memory.fraction = value / 100;
    return memory;
  }
  const bool decimal = number.find('.') != absl::string_view::npos;
  if (unit.empty() && decimal) {
    if (value > 1) {
      return bad(
          "a fraction of the free memory must be in (0, 1]; give bytes with a unit (e.g. "
          "60GiB) for more");
    }
    memory.fraction = value;
    return memory;
  }
  const int64_t per_unit = UnitBytes(unit);
  if (per_unit == 0) {
    return bad(absl::StrCat("unknown unit \"", unit,
                            "\"; units: B, KB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, TiB "
                            "(powers of 1024)"));
  }
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  int64_t whole = 0;
  if (!decimal && absl::SimpleAtoi(number, &whole)) {
    // Exact for integers: no rounding through a double.
    if (whole > kMax / per_unit) return bad("is more than 2^63 - 1 bytes");
    memory.bytes = whole * per_unit;
  } else {
    const double bytes = std::floor(value * static_cast<double>(per_unit));
    if (bytes >= 9.2e18) return bad("is more than 2^63 - 1 bytes");
    memory.bytes = static_cast<int64_t>(bytes);
  }
  if (memory.bytes < 1) return bad("must be at least 1 byte");
  return memory;
}

absl::StatusOr<int64_t> BudgetBytes(const PoolMemory& memory, uint64_t free_bytes,
                                    absl::string_view field) {
  if (memory.bytes > 0) return memory.bytes;
  const double bytes = std::floor(memory.fraction * static_cast<double>(free_bytes));
  if (!(bytes >= 1)) {
    return absl::OutOfRangeError(absl::StrCat(field, " = ", memory.fraction, " of ", free_bytes,
                                              " bytes free is no byte"));
  }
  return bytes >= 9.2e18 ? std::numeric_limits<int64_t>::max() : static_cast<int64_t>(bytes);
}

ServiceBytes ComputeServiceBytes(const v1::Layout& layout, bool kept_pools) {
  ServiceBytes b;
  b.sizes = ComputeLayoutSizes(layout);
  const LayoutSizes& s = b.sizes;
  const int64_t L = layout.num_layers();
  const int64_t rows = layout.max_rows();
  const kernels::KdaShape shape = ShapeOf(layout);
  const int64_t H = layout.num_heads();
  const int64_t hk = kernels::KeyWidth(shape);
  b.pools = s.pool_bytes;
  b.records = s.record_bytes;
  b.workspaces = s.workspace_bytes;
  b.mode = s.mode_bytes;
  // Engine::AllocateLayers: each layer's A_log [H] and dt_bias [H K] (fp32),
  // LoadLayerParams' staging of one layer's, and its status.
  b.params = L * (H + hk) * int64_t{sizeof(float)} + (H + hk) * int64_t{sizeof(float)} +
             int64_t{sizeof(kernels::DeviceStatus)};
  // Engine::AllocateSlots: per slot, a status per layer's Verify, Commit's and
  // RecordStateBlocks', the cancellation word, query_start_loc [rows + 1] and
  // state_indices [rows].
  b.step_slots = StepTable::kSlots * ((L + 2) * int64_t{sizeof(kernels::DeviceStatus)} +
                                      int64_t{sizeof(uint32_t)} + (2 * rows + 1) * 4);
  b.layer_table = L * int64_t{sizeof(kernels::CommitLayer)};
  b.engine = b.pools + b.records + b.workspaces + b.mode + b.params + b.step_slots +
             b.layer_table;
  b.total = b.engine;
  if (kept_pools) {
    const KeptDeferred deferred =
        KeptDeferredFor(layout, static_cast<uint64_t>(s.records_per_layer_bytes));
    b.kept_header = static_cast<int64_t>(
        HeaderLayoutFor(layout.num_blocks(), deferred, KeptFastFor(layout)).bytes);
    // DEFERRED's records and FAST's rings live in the kept allocation; the
    // engine allocates none.
    b.total += b.kept_header -
               (CommitModeOf(layout).TokenScratchInKeptAllocation() ? b.records : 0);
  }
  return b;
}

absl::StatusOr<int> BlocksForBudget(const v1::Layout& layout, int64_t budget_bytes,
                                    bool kept_pools, absl::string_view field) {
  v1::Layout l = layout;
  const auto total = [&](int64_t blocks) {
    l.set_num_blocks(static_cast<int32_t>(blocks));
    return ComputeServiceBytes(l, kept_pools).total;
  };
  const int64_t least = total(2);
  if (least > budget_bytes) {
    return absl::OutOfRangeError(absl::StrCat(
        field, " = ", budget_bytes, " bytes (", FormatBytes(budget_bytes),
        ") holds no request's state: this layout needs at least ", least, " bytes (",
        FormatBytes(least), ") for 2 blocks (the null block and one request's) with max_rows = ",
        layout.max_rows(), "; raise ", field, " or lower max_rows"));
  }
  // Every part grows with the blocks: the largest count that fits, by bisection.
  int64_t lo = 2, hi = std::numeric_limits<int32_t>::max();
  if (total(hi) <= budget_bytes) return static_cast<int>(hi);
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (total(mid) <= budget_bytes) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return static_cast<int>(lo);
}

SizingPlan PlanLayout(const v1::Layout& layout, int64_t budget_bytes, bool kept_pools,
                      int at_requests) {
  SizingPlan p;
  p.layout = layout;
  p.bytes = ComputeServiceBytes(layout, kept_pools);
  p.budget_bytes = budget_bytes > 0 ? budget_bytes : p.bytes.total;
  const int64_t L = layout.num_layers();
  const LayoutSizes& s = p.bytes.sizes;
  p.state_bytes = L * s.state_block_bytes;
  p.conv_bytes = L * s.conv_block_bytes;
  // What one more block, and one more row, add to everything specstated
  // allocates (averaged over many: the pools are 256-byte aligned).
  constexpr int kMoreBlocks = 1024, kMoreRows = 64;
  v1::Layout more = layout;
  more.set_num_blocks(layout.num_blocks() + kMoreBlocks);
  p.block_bytes =
      static_cast<double>(ComputeServiceBytes(more, kept_pools).total - p.bytes.total) /
      kMoreBlocks;
  more = layout;
  more.set_max_rows(layout.max_rows() + kMoreRows);
  p.row_bytes = static_cast<double>(ComputeServiceBytes(more, kept_pools).total - p.bytes.total) /
                kMoreRows;
  p.request_bytes = p.block_bytes + p.row_bytes;
  p.stock_state_bytes = L * (1 + int64_t{layout.num_spec()}) * s.state_block_bytes;
  p.stock_conv_bytes = L * s.conv_block_bytes;
  p.stock_request_bytes = p.stock_state_bytes + p.stock_conv_bytes;
  p.saving_per_request = static_cast<double>(p.stock_request_bytes) - p.request_bytes;
  p.at_requests = at_requests;
  v1::Layout at = layout;
  at.set_num_blocks(at_requests + 1);
  p.specstate_at_bytes = ComputeServiceBytes(at, kept_pools).total;
  p.stock_at_bytes = int64_t{at_requests} * p.stock_request_bytes;
  p.requests_fit = layout.num_blocks() - 1;
  p.stock_requests_fit = p.stock_request_bytes > 0 ? p.budget_bytes / p.stock_request_bytes : 0;
  return p;
}

std::string FormatBytes(double bytes) {
  const double a = std::fabs(bytes);
  if (a >= double(int64_t{1} << 30)) return absl::StrFormat("%.2f GiB", bytes / (1 << 30));
  if (a >= double(1 << 20)) return absl::StrFormat("%.2f MiB", bytes / (1 << 20));
  if (a >= double(1 << 10)) return absl::StrFormat("%.2f KiB", bytes / (1 << 10));
  return absl::StrFormat("%.0f B", bytes);
}

}  // namespace server
}  // namespace specstate
