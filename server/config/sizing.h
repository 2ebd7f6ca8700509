// Sizing: every byte specstated allocates for a layout, the most blocks a
// memory budget holds, and the comparison with the stock speculative path.
// One computation behind the engine's check of free memory at start
// (Engine::Allocate), specstated --pool_memory and specstatectl plan, so the
// three cannot disagree.
//
//   absl::StatusOr<PoolMemory> m = ParsePoolMemory("60GiB", "--pool_memory");
//   absl::StatusOr<int64_t> budget = BudgetBytes(*m, free_bytes, "--pool_memory");
//   absl::StatusOr<int> blocks = BlocksForBudget(layout, *budget, false, "--pool_memory");
//   layout.set_num_blocks(*blocks);
//   SizingPlan plan = PlanLayout(layout, *budget, false);
#ifndef SPECSTATE_SERVER_CONFIG_SIZING_H_
#define SPECSTATE_SERVER_CONFIG_SIZING_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/config/config.h"
#include "specstate/v1/specstate.pb.h"

namespace specstate {
namespace server {

// A memory budget: bytes, or a fraction of the memory free for the service
// (CUDA: the device's free memory; CPU: the host's available memory,
// MemAvailable, which is what the service checks its layout against).
struct PoolMemory {
  int64_t bytes = 0;    // > 0 when given in bytes
  double fraction = 0;  // in (0, 1] when given as a fraction
};

// "60GiB", "512MiB", "1.5TiB", "80GB", "100MB", "4096KiB", "123456789" (bytes;
// also B, KB, KiB, MB, GB, TB; a unit's case is ignored), or a fraction of
// the free memory: "0.8" (a number with a decimal point, in (0, 1]) or
// "80%". INVALID_ARGUMENT naming `field` for anything else: empty, garbage,
// zero, negative, a fraction over 1, more than 2^63 - 1 bytes.
absl::StatusOr<PoolMemory> ParsePoolMemory(absl::string_view text, absl::string_view field);

// The budget in bytes: `memory.bytes`, or its fraction of `free_bytes`.
// OUT_OF_RANGE naming `field` when the fraction of what is free is no byte.
absl::StatusOr<int64_t> BudgetBytes(const PoolMemory& memory, uint64_t free_bytes,
                                    absl::string_view field);

// Every byte specstated asks for, for one layout, in parts. The parts are the
// engine's allocations (ComputeLayoutSizes' sizes and the rest of what
// Engine::Allocate allocates) and, when the pools are kept across restarts
// (--keeper, systemd's FD store), the kept bookkeeping allocation beside them.
// Allocators round each allocation up (CUDA: up to 2 MiB for large ones);
// that rounding is not counted.
struct ServiceBytes {
  LayoutSizes sizes;
  int64_t pools = 0;        // every layer's recurrent and conv pools (ExportPools)
  int64_t records = 0;      // records (EAGER), both buffers (DEFERRED), rings (FAST)
  int64_t workspaces = 0;   // Commit's and RecordStateBlocks' workspaces
  int64_t mode = 0;         // DEFERRED's / FAST's bookkeeping (LayoutSizes::mode_bytes)
  int64_t params = 0;       // each layer's gate parameters, their staging and status
  int64_t step_slots = 0;   // the step table's slots: statuses, query_start_loc, state_indices
  int64_t layer_table = 0;  // the per-layer pointer table of Commit
  int64_t kept_header = 0;  // kept pools only: header, journal, block records (DEFERRED: and
                            // its pending table and records, which the engine then does not
                            // allocate)
  // What Engine::Allocate allocates itself with nothing kept: every part but
  // kept_header (the engine checks this against the free memory).
  int64_t engine = 0;
  // Everything: engine + kept_header, DEFERRED's kept records counted once.
  int64_t total = 0;
};
ServiceBytes ComputeServiceBytes(const v1::Layout& layout, bool kept_pools);

// The most blocks (block 0, the null block, included) for which `layout`'s
// ServiceBytes::total fits in `budget_bytes`; the layout's own num_blocks
// is ignored. OUT_OF_RANGE naming `field` and the least budget when not
// even 2 blocks (the null block and one request's) fit.
absl::StatusOr<int> BlocksForBudget(const v1::Layout& layout, int64_t budget_bytes,
                                    bool kept_pools, absl::string_view field);

// What specstatectl plan prints: SpecState against the stock speculative path
// for one layout (its num_blocks set) and budget.
//
// A request of SpecState holds one state block (every layer's recurrent
// state and conv window, and the per-block bookkeeping) and, while it is a
// row of a step, one row of the step scratch (records or rings' share,
// workspaces, slots). The stock speculative path (vLLM's) keeps per request
// and layer 1 + num_spec recurrent states (the checkpoint and one per draft
// token, each written by the verify kernel) and one conv state of the same
// window (conv_kernel - 1 + num_spec columns); its scratch is not counted.
struct SizingPlan {
  v1::Layout layout;     // as planned (num_blocks set)
  ServiceBytes bytes;    // at layout.num_blocks()
  int64_t budget_bytes = 0;  // the budget given, or bytes.total when sized by --blocks
  // SpecState, per request.
  int64_t state_bytes = 0;      // L recurrent states
  int64_t conv_bytes = 0;       // L conv windows
  double block_bytes = 0;       // everything one more block adds (state, conv, rings, bookkeeping)
  double row_bytes = 0;         // everything one more row of max_rows adds
  double request_bytes = 0;     // block_bytes + row_bytes
  // The stock speculative path, per request.
  int64_t stock_state_bytes = 0;  // L (1 + num_spec) recurrent states
  int64_t stock_conv_bytes = 0;   // L conv states
  int64_t stock_request_bytes = 0;
  double saving_per_request = 0;  // stock_request_bytes - request_bytes
  // At `at_requests` requests: everything specstated allocates with
  // at_requests + 1 blocks (max_rows as planned), against at_requests stock
  // requests.
  int at_requests = 256;
  int64_t specstate_at_bytes = 0;
  int64_t stock_at_bytes = 0;
  // Requests whose state fits in the budget.
  int64_t requests_fit = 0;        // num_blocks - 1
  int64_t stock_requests_fit = 0;  // budget_bytes / stock_request_bytes
};
SizingPlan PlanLayout(const v1::Layout& layout, int64_t budget_bytes, bool kept_pools,
                      int at_requests = 256);

// "60.00 GiB", "1.50 MiB", "512 B".
std::string FormatBytes(double bytes);

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_CONFIG_SIZING_H_
