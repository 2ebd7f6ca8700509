// specstatectl: the command-line client of specstated.
//
//   specstatectl --server=unix:///tmp/specstate.sock health
//   specstatectl layout
//   specstatectl regions
//   specstatectl state --layer=0 --block=1 [--values]
//   specstatectl stats
//   specstatectl recover          # what a restarted service kept: last committed step, lost blocks
//   specstatectl verify-pools     # the pools' bookkeeping re-checked (exit 4 when inconsistent)
//   specstatectl simulate --steps=50 --requests=4 [--async] [--seed=N]
//   specstatectl simulate --servers=unix:///run/specstate/specstate-0.sock,unix:///...-1.sock
//                                        # tensor parallelism: one service per rank
//   specstatectl simulate --restart_every=8 --steps=200
//                                        # its own keeper + specstated, killed and restarted
//   specstatectl simulate --transfer_every=5 --transfer_peer=unix:///tmp/specstate-decode.sock
//                                        # a block moved to a second service and back (UCX)
//   specstatectl plan --model=kimi-linear-48b-a3b --pool_memory=60GiB [--max_rows=256] [--json]
//                                        # offline: the blocks specstated would allocate, the
//                                        # bytes per request against the stock path
//
// Exit status: 0 on success; 1 on an error; 2 on bad usage; 3 when simulate's
// verdict fails (a state differs from the stock path); 4 when verify-pools
// finds the bookkeeping inconsistent.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <string>
#include <tuple>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/internal/parse.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/lib/client.h"
#include "client/simulator/restart_drill.h"
#include "client/simulator/simulator.h"
#include "google/protobuf/util/json_util.h"
#include "kernels/dtype.h"
#include "kernels/kda_kernels.h"
#include "server/config/config.h"
#include "server/modes/rules.h"
#include "server/config/presets.h"
#include "server/config/sizing.h"

ABSL_FLAG(std::string, server, "unix:///tmp/specstate.sock",
          "the service's address: unix:///PATH or HOST:PORT");
ABSL_FLAG(std::string, servers, "",
          "simulate under tensor parallelism: the services of ranks 0, 1, ..., comma-separated "
          "(each holding its equal part of the model: H/TP heads, HV/TP value heads, D/TP conv "
          "channels); replaces --server");
ABSL_FLAG(bool, json, false, "print replies as JSON (layout, regions, state, stats, plan)");
ABSL_FLAG(int, layer, 0, "state: the layer");
ABSL_FLAG(int, block, 1, "state: the block");
ABSL_FLAG(bool, values, false, "state: print every value, not only the summary");
ABSL_FLAG(int, steps, 20, "simulate: decode steps");
ABSL_FLAG(int, requests, 4, "simulate: concurrent requests (rows per step)");
ABSL_FLAG(uint64_t, seed, 1, "simulate: random seed");
ABSL_FLAG(bool, async, false,
          "simulate: ASYNC Verify/Commit ordered by doorbells, Verify sent before its inputs");
ABSL_FLAG(bool, events, false,
          "simulate: with --async, order with CUDA interprocess events instead of doorbells");
ABSL_FLAG(bool, batch, false, "simulate: send each step's Verify calls in one SubmitStep call");
ABSL_FLAG(bool, bound_inputs, false,
          "simulate: bind every layer's Verify tensors once (BindVerifyInputs) and send Verify "
          "calls that carry only their counts");
ABSL_FLAG(double, finish_probability, 0.15, "simulate: chance a request finishes each step");
ABSL_FLAG(int, crash_after_verify_step, -1,
          "simulate (crash tests): die by SIGKILL after sending this step's Verify calls");
ABSL_FLAG(int, abandon_commit_at_step, -1,
          "simulate (crash tests): send this step's Commit waiting on a doorbell never rung, then "
          "die by SIGKILL");
ABSL_FLAG(int, corrupt_after_step, -1,
          "simulate: flip one bit of a committed state after this step (tests the verdict)");
ABSL_FLAG(bool, corrupt_with_nan, false,
          "simulate with --corrupt_after_step: write NaNs into the state instead of flipping a bit");
ABSL_FLAG(std::string, commit_mode, "",
          "simulate: the commit mode the service must run (eager, deferred or fast; empty: any); "
          "the checks follow the service's mode. plan: the commit mode planned (empty: eager)");
// plan: the layout, as specstated's flags of the same names set it.
ABSL_FLAG(std::string, model, "",
          "plan: a model preset (specstated --model); the layout flags below override its fields");
ABSL_FLAG(std::string, pool_memory, "",
          "plan: the memory budget, as specstated --pool_memory takes it (60GiB, 80GB, bytes; or "
          "a fraction such as 0.8, of --free_memory); not with --blocks");
ABSL_FLAG(std::string, free_memory, "",
          "plan with a fractional --pool_memory: the free memory it is a fraction of (e.g. the "
          "GPU's, 79GiB; plan runs offline and cannot ask the device)");
ABSL_FLAG(int, blocks, 0, "plan: blocks, instead of --pool_memory (the null block 0 included)");
ABSL_FLAG(int, layers, 0, "plan: layers (0: the preset's or the default layout's)");
ABSL_FLAG(std::string, kind, "", "plan: kda or gdn");
ABSL_FLAG(int, heads, 0, "plan: key heads per layer");
ABSL_FLAG(int, value_heads, 0, "plan: value heads per layer");
ABSL_FLAG(int, head_dim, 0, "plan: head dim (64, 128, 256)");
ABSL_FLAG(int, conv_dim, 0, "plan: conv channels");
ABSL_FLAG(int, conv_kernel, 0, "plan: conv kernel width");
ABSL_FLAG(int, num_spec, -1, "plan: draft tokens per row (-1: the preset's or the default's)");
ABSL_FLAG(int, max_rows, 0, "plan: rows a step may verify (0: the default layout's)");
ABSL_FLAG(int, fold_every, 0, "plan with --commit_mode=fast: steps between folds (0: 4)");
ABSL_FLAG(std::string, activation_dtype, "", "plan: bf16, fp16 or fp32");
ABSL_FLAG(std::string, state_dtype, "", "plan: fp32 or bf16");
ABSL_FLAG(std::string, cache_mode, "", "plan: none or align");
ABSL_FLAG(int, mamba_block_size, 0, "plan with --cache_mode=align: tokens per state block");
ABSL_FLAG(bool, kept_pools, false,
          "plan: the pools are kept across restarts (specstated --keeper, or systemd's FD store): "
          "count their kept bookkeeping too");
ABSL_FLAG(int, at_requests, 256, "plan: the request count of the side-by-side total");
ABSL_FLAG(int, corrupt_rank, 0, "simulate with --servers: the rank whose state --corrupt_after_step flips");
ABSL_FLAG(int, restart_every, 0,
          "simulate: a restart drill: start a specstate-keeper and a specstated of its own (in a "
          "temporary directory; not with --server) and kill the service about every N steps, in "
          "turn between calls, inside a Verify and inside a Commit (at each of its phases); the "
          "verdict still compares every state bit for bit and checks what each restart kept");
ABSL_FLAG(int, host_tier_every, 0,
          "simulate: every N steps, between steps, save a live request's block to the service's "
          "host tier (it needs --host_tier_bytes), overwrite it and restore it; the block is "
          "checked and the run goes on from it (not with --restart_every)");
ABSL_FLAG(int, transfer_every, 0,
          "simulate: every N steps, between steps, move a live request's block to "
          "--transfer_peer and back: saved here, fetched by the peer (FetchSaved, over UCX), "
          "restored into a block of the peer's and saved there (its bytes checked), fetched back "
          "after the block here was overwritten, restored and checked; the run goes on from it "
          "(host tiers on both; one --server, not with --restart_every)");
ABSL_FLAG(std::string, transfer_peer, "",
          "simulate --transfer_every: the second specstated's address (same layout, "
          "--host_tier_bytes); the simulator drives a session there, and each service must reach "
          "the other at the address the simulator uses");
ABSL_FLAG(std::string, service_flags, "",
          "simulate --restart_every: flags of its own specstated, space-separated (default: the "
          "CPU backend's default layout)");
ABSL_FLAG(std::string, specstated, "",
          "simulate --restart_every: the specstated binary (default: beside specstatectl)");
ABSL_FLAG(std::string, keeper_binary, "",
          "simulate --restart_every: the specstate-keeper binary (default: beside specstatectl)");

namespace specstate {
namespace client {
namespace {

constexpr char kUsage[] =
    "specstatectl [--server=ADDRESS] SUBCOMMAND [flags]\n"
    "subcommands:\n"
    "  health     the grpc.health.v1 status of the service\n"
    "  layout     the layout the service runs\n"
    "  regions    registered regions of every session\n"
    "  state      one block of one layer (--layer, --block, --values)\n"
    "  stats      counters and per-RPC latency\n"
    "  saved      the host tier's saved blocks, most recently used first (--json)\n"
    "  recover    what the service kept across its last restart: the last committed step,\n"
    "             the blocks an interrupted commit lost, bytes kept (--json)\n"
    "  verify-pools  re-reads the pools' bookkeeping: header checksum, layout fingerprint,\n"
    "             commit journal, every block's record (exit 4 when inconsistent)\n"
    "  simulate   a decode loop checked bit for bit against the stock path\n"
    "             (--steps, --requests, --seed, --async; --servers=A0,A1,... for tensor\n"
    "             parallelism, checked against the TP=1 run too; --restart_every=N: its own\n"
    "             keeper and specstated, killed and restarted every N steps; --host_tier_every=N:\n"
    "             a block saved, overwritten and restored every N steps;\n"
    "             --transfer_every=N --transfer_peer=ADDRESS: a block moved to a second\n"
    "             service and back every N steps)\n"
    "  plan       offline, no server: the blocks specstated allocates for a model and a memory\n"
    "             budget, SpecState's bytes per request against the stock speculative path\n"
    "             (--model, --pool_memory or --blocks, --max_rows, --num_spec, --commit_mode,\n"
    "             --fold_every, --state_dtype, the layout flags, --kept_pools, --json)";

std::string Json(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, options);
  return out;
}

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "specstatectl: %s\n", s.ToString().c_str());
  return 1;
}

int Health(Client& c) {
  absl::StatusOr<std::string> all = c.Health("");
  if (!all.ok()) return Fail(all.status());
  absl::StatusOr<std::string> service = c.Health("specstate.v1.SpecState");
  if (!service.ok()) return Fail(service.status());
  std::printf("%s: %s (specstate.v1.SpecState: %s)\n", c.address().c_str(), all->c_str(),
              service->c_str());
  if (absl::StatusOr<v1::Stats> s = c.GetStats(); s.ok()) {
    for (const std::string& warning : s->warnings()) std::printf("WARNING: %s\n", warning.c_str());
  }
  return *all == "SERVING" ? 0 : 1;
}

int Layout(Client& c) {
  absl::StatusOr<v1::Layout> l = c.GetLayout();
  if (!l.ok()) return Fail(l.status());
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s", Json(*l).c_str());
    return 0;
  }
  absl::PrintF(
      "backend          %s (device %d)\n"
      "layers           %d %s%s\n"
      "heads x dim      %d x %d (value heads %d)\n"
      "conv             dim %d, kernel %d, window %d\n"
      "num_spec         %d (Q = %d)\n"
      "blocks           %d (block 0 is null)\n"
      "max_rows         %d\n"
      "dtypes           activations %s, state %s\n"
      "cache mode       %s%s\n"
      "commit mode      %s%s\n"
      "lower_bound      %g\n"
      "bytes            state block %d, conv block %d, pools %d, %s %d\n",
      v1::Backend_Name(l->backend()).c_str(), l->device(), l->num_layers(),
      l->layer_kind() == v1::GDN ? "GDN" : "KDA",
      l->layer_kind() == v1::KDA && l->kda_gate() == v1::PLAIN_GATE ? " (plain gate)" : "",
      l->num_heads(), l->head_dim(),
      l->num_value_heads() > 0 ? l->num_value_heads() : l->num_heads(), l->conv_dim(), l->conv_kernel(), l->conv_width(), l->num_spec(),
      l->num_spec() + 1, l->num_blocks(), l->max_rows(),
      v1::DType_Name(l->activation_dtype()).c_str(), v1::DType_Name(l->state_dtype()).c_str(),
      v1::CacheMode_Name(l->cache_mode()).c_str(),
      l->cache_mode() == v1::ALIGN ? absl::StrCat(" (block size ", l->mamba_block_size(), ")").c_str()
                                   : "",
      v1::CommitMode_Name(l->commit_mode()).c_str(),
      l->fold_every() > 0  // FAST's, as the service runs it (0 in the other modes)
          ? absl::StrCat(" (fold every ", l->fold_every(), " steps: rings of ",
                         l->fold_every() * (l->num_spec() + 1), " tokens a block)")
                .c_str()
          : "",
      l->lower_bound(), l->state_block_bytes(), l->conv_block_bytes(), l->pool_bytes(),
      std::string(server::CommitModeOf(*l).scratch_name()).c_str(), l->record_bytes());
  if (l->backend() == v1::CUDA) {
    std::printf("mps client       %s\n", l->mps_client() ? "yes" : "NO (see `stats`)");
  }
  return 0;
}

int Regions(Client& c) {
  absl::StatusOr<v1::ListRegionsResponse> r = c.ListRegions();
  if (!r.ok()) return Fail(r.status());
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s", Json(*r).c_str());
    return 0;
  }
  std::printf("%-20s %-24s %-9s %14s %7s\n", "session", "name", "kind", "bytes", "in use");
  for (const v1::RegionInfo& i : r->regions()) {
    std::printf("%-20s %-24s %-9s %14llu %7d\n", i.session_label().c_str(), i.name().c_str(),
                i.kind().c_str(), static_cast<unsigned long long>(i.byte_size()), i.in_use());
  }
  std::printf("%d regions\n", r->regions_size());
  return 0;
}

void PrintSummary(const char* name, const v1::TensorSummary& s) {
  std::string shape;
  for (int64_t d : s.shape()) shape += absl::StrCat(shape.empty() ? "" : " x ", d);
  std::printf("%-10s [%s] min %.6g max %.6g mean %.6g l2 %.6g checksum %016llx\n", name,
              shape.c_str(), s.min(), s.max(), s.mean(), s.l2_norm(),
              static_cast<unsigned long long>(s.checksum()));
  if (s.values_size() > 0) {
    for (int i = 0; i < s.values_size(); ++i) {
      std::printf("%.9g%s", s.values(i), (i + 1) % 8 == 0 ? "\n" : " ");
    }
    std::printf("\n");
  }
}

int State(Client& c) {
  absl::StatusOr<v1::ReadStateResponse> r = c.ReadState(
      absl::GetFlag(FLAGS_layer), absl::GetFlag(FLAGS_block), absl::GetFlag(FLAGS_values));
  if (!r.ok()) return Fail(r.status());
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s", Json(*r).c_str());
    return 0;
  }
  std::printf("layer %d, block %d\n", absl::GetFlag(FLAGS_layer), absl::GetFlag(FLAGS_block));
  PrintSummary("recurrent", r->recurrent());
  PrintSummary("conv", r->conv());
  return 0;
}

int Stats(Client& c) {
  absl::StatusOr<v1::Stats> s = c.GetStats();
  if (!s.ok()) return Fail(s.status());
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s", Json(*s).c_str());
    return 0;
  }
  std::printf(
      "uptime %.1f s, %d sessions, %d regions, driver: %s\n"
      "steps verified %llu, committed %llu, failed %llu\n"
      "rows verified %llu, committed %llu; tokens verified %llu, committed %llu\n"
      "state bytes the stock path would add for the latest step: %llu\n",
      s->uptime_s(), s->sessions(), s->regions(), s->driver().empty() ? "none" : s->driver().c_str(),
      static_cast<unsigned long long>(s->steps_verified()),
      static_cast<unsigned long long>(s->steps_committed()),
      static_cast<unsigned long long>(s->steps_failed()),
      static_cast<unsigned long long>(s->rows_verified()),
      static_cast<unsigned long long>(s->rows_committed()),
      static_cast<unsigned long long>(s->tokens_verified()),
      static_cast<unsigned long long>(s->tokens_committed()),
      static_cast<unsigned long long>(s->state_bytes_saved()));
  if (s->has_host_tier()) {
    const v1::HostTierStats& t = s->host_tier();
    std::printf("host tier: %lld of %lld blocks saved; since start %llu saved, %llu restored, "
                "%llu evicted, %llu dropped, %llu failed saves\n",
                static_cast<long long>(t.keys()), static_cast<long long>(t.capacity()),
                static_cast<unsigned long long>(t.saves()),
                static_cast<unsigned long long>(t.restores()),
                static_cast<unsigned long long>(t.evictions()),
                static_cast<unsigned long long>(t.drops()),
                static_cast<unsigned long long>(t.failed_saves()));
  }
  std::printf("health: %s\n", s->health().c_str());
  for (const std::string& warning : s->warnings()) std::printf("WARNING: %s\n", warning.c_str());
  std::printf("%-20s %8s %8s %10s %10s\n", "rpc", "calls", "errors", "p50 us", "p99 us");
  for (const v1::RpcStats& r : s->rpcs()) {
    uint64_t errors = 0;
    for (const auto& [code, n] : r.errors()) errors += n;
    std::printf("%-20s %8llu %8llu %10.1f %10.1f\n", r.method().c_str(),
                static_cast<unsigned long long>(r.calls()), static_cast<unsigned long long>(errors),
                r.latency().p50_us(), r.latency().p99_us());
  }
  return 0;
}

// The host tier's keys, most recently used first.
int Saved(Client& c) {
  absl::StatusOr<v1::ListSavedResponse> r = c.ListSaved();
  if (!r.ok()) return Fail(r.status());
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s", Json(*r).c_str());
    return 0;
  }
  if (r->capacity() == 0) {
    std::printf("no host tier (start specstated with --host_tier_bytes)\n");
    return 0;
  }
  std::printf("host tier: %d of %lld blocks saved, %s a block\n", r->keys_size(),
              static_cast<long long>(r->capacity()),
              server::FormatBytes(double(r->entry_bytes())).c_str());
  const double now = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
  std::printf("%-40s %12s %12s %9s\n", "key", "saved (s ago)", "used (s ago)", "restores");
  for (const v1::SavedKey& k : r->keys()) {
    std::printf("%-40s %12.1f %12.1f %9llu\n", k.key().c_str(), now - k.saved_at(),
                now - k.used_at(), static_cast<unsigned long long>(k.restores()));
  }
  return 0;
}

// recover and verify-pools.
int Recover(Client& c, bool verify) {
  absl::StatusOr<v1::RecoverResponse> r = c.Recover(verify);
  if (!r.ok()) return Fail(r.status());
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s", Json(*r).c_str());
  } else {
    std::printf("pools        %s, held by %s\n", r->kept() ? "kept from the previous instance" : "fresh",
                r->holder().empty() ? "nothing (they die with specstated)" : r->holder().c_str());
    std::printf("kept         %llu bytes (pools %llu), layout fingerprint %s\n",
                static_cast<unsigned long long>(r->kept_bytes()),
                static_cast<unsigned long long>(r->pool_bytes()), r->layout_fingerprint().c_str());
    std::printf("committed    last step %llu, %llu commits on these pools\n",
                static_cast<unsigned long long>(r->last_committed_step()),
                static_cast<unsigned long long>(r->commits()));
    if (r->interrupted()) {
      std::printf("interrupted  the commit of step %llu\n",
                  static_cast<unsigned long long>(r->interrupted_step()));
    } else if (!r->interrupted_call().empty()) {  // DEFERRED: a Verify's replay, a Flush
      std::printf("interrupted  a %s (commit mode DEFERRED)\n", r->interrupted_call().c_str());
    }
    if (r->pending_blocks() > 0) {
      std::printf("pending      %d blocks hold tokens pending (commit mode DEFERRED)\n",
                  r->pending_blocks());
    }
    std::vector<std::string> lost;
    for (int32_t b : r->lost_blocks()) lost.push_back(absl::StrCat(b));
    std::printf("lost blocks  %s\n", lost.empty() ? "none" : absl::StrJoin(lost, ",").c_str());
    std::printf("restarts     %llu; attached %.1f ms after start\n",
                static_cast<unsigned long long>(r->restarts()), r->attach_ms());
    if (verify) {
      std::vector<std::string> blocks;
      for (int32_t b : r->inconsistent_blocks()) blocks.push_back(absl::StrCat(b));
      std::printf("verify       %s\n", r->problems().empty() ? "consistent" : "INCONSISTENT");
      for (const std::string& p : r->problems()) std::printf("  %s\n", p.c_str());
      if (!blocks.empty()) std::printf("  blocks: %s\n", absl::StrJoin(blocks, ",").c_str());
    }
  }
  return verify && !r->problems().empty() ? 4 : 0;
}

int Simulate(const std::vector<Client*>& ranks, RestartDrill* drill = nullptr) {
  SimulationOptions options;
  options.drill = drill;
  options.steps = absl::GetFlag(FLAGS_steps);
  options.requests = absl::GetFlag(FLAGS_requests);
  options.seed = absl::GetFlag(FLAGS_seed);
  options.async = absl::GetFlag(FLAGS_async);
  options.events = absl::GetFlag(FLAGS_events);
  options.batch = absl::GetFlag(FLAGS_batch);
  options.bound_inputs = absl::GetFlag(FLAGS_bound_inputs);
  options.finish_probability = absl::GetFlag(FLAGS_finish_probability);
  options.corrupt_after_step = absl::GetFlag(FLAGS_corrupt_after_step);
  options.corrupt_with_nan = absl::GetFlag(FLAGS_corrupt_with_nan);
  options.crash_after_verify_step = absl::GetFlag(FLAGS_crash_after_verify_step);
  options.abandon_commit_at_step = absl::GetFlag(FLAGS_abandon_commit_at_step);
  options.corrupt_rank = absl::GetFlag(FLAGS_corrupt_rank);
  options.commit_mode = absl::GetFlag(FLAGS_commit_mode);
  options.host_tier_every = absl::GetFlag(FLAGS_host_tier_every);
  options.transfer_every = absl::GetFlag(FLAGS_transfer_every);
  options.transfer_peer = absl::GetFlag(FLAGS_transfer_peer);
  const bool tty = isatty(fileno(stderr));
  options.progress = [tty](const SimulationProgress& p) {
    if (tty) {
      std::fprintf(stderr, "\rstep %d/%d  comparisons %llu  mismatches %llu", p.step, p.steps,
                   static_cast<unsigned long long>(p.comparisons),
                   static_cast<unsigned long long>(p.mismatches));
      if (p.step == p.steps) std::fprintf(stderr, "\n");
    } else if (p.steps <= 20 || p.step % 10 == 0 || p.step == p.steps) {
      std::fprintf(stderr, "step %d/%d: %llu comparisons, %llu mismatches\n", p.step, p.steps,
                   static_cast<unsigned long long>(p.comparisons),
                   static_cast<unsigned long long>(p.mismatches));
    }
  };
  absl::StatusOr<SimulationReport> report = ranks.size() == 1
                                                 ? RunSimulation(*ranks[0], options)
                                                 : RunSimulation(ranks, options);
  if (!report.ok()) return Fail(report.status());
  std::printf("%s", FormatReport(*report).c_str());
  return report->passed() ? 0 : 3;
}

// plan: ------------------------------------------------------------------

bool Given(absl::string_view flag) { return absl::flags_internal::WasPresentOnCommandLine(flag); }

// The layout specstated would serve for the same flags: the default layout,
// --model's preset, then the layout flags given (their parsing as
// specstated's: the proto's enum names, the kernels' dtype names).
absl::StatusOr<v1::Layout> LayoutFromFlags() {
  namespace srv = ::specstate::server;
  v1::Layout l = srv::DefaultServiceConfig().layout();
  if (Given("model")) {
    absl::Status st = srv::ApplyModelPreset(absl::GetFlag(FLAGS_model), &l);
    if (!st.ok()) return st;
  }
  const auto set_int = [&](absl::string_view name, const absl::Flag<int>& flag,
                           void (v1::Layout::*set)(int32_t)) {
    if (Given(name)) (l.*set)(absl::GetFlag(flag));
  };
  set_int("layers", FLAGS_layers, &v1::Layout::set_num_layers);
  set_int("heads", FLAGS_heads, &v1::Layout::set_num_heads);
  set_int("value_heads", FLAGS_value_heads, &v1::Layout::set_num_value_heads);
  set_int("head_dim", FLAGS_head_dim, &v1::Layout::set_head_dim);
  set_int("conv_dim", FLAGS_conv_dim, &v1::Layout::set_conv_dim);
  set_int("conv_kernel", FLAGS_conv_kernel, &v1::Layout::set_conv_kernel);
  set_int("num_spec", FLAGS_num_spec, &v1::Layout::set_num_spec);
  set_int("blocks", FLAGS_blocks, &v1::Layout::set_num_blocks);
  set_int("max_rows", FLAGS_max_rows, &v1::Layout::set_max_rows);
  set_int("fold_every", FLAGS_fold_every, &v1::Layout::set_fold_every);
  set_int("mamba_block_size", FLAGS_mamba_block_size, &v1::Layout::set_mamba_block_size);
  const auto upper = [](const std::string& s) { return absl::AsciiStrToUpper(s); };
  if (Given("kind")) {
    v1::LayerKind kind;
    if (!v1::LayerKind_Parse(upper(absl::GetFlag(FLAGS_kind)), &kind)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--kind=", absl::GetFlag(FLAGS_kind), ": expected kda or gdn"));
    }
    l.set_layer_kind(kind);
  }
  const std::string mode = absl::GetFlag(FLAGS_commit_mode);
  if (!mode.empty()) {
    v1::CommitMode m;
    if (!v1::CommitMode_Parse(upper(mode), &m) || m == v1::COMMIT_MODE_UNSPECIFIED) {
      return absl::InvalidArgumentError(
          absl::StrCat("--commit_mode=", mode, ": expected eager, deferred or fast"));
    }
    l.set_commit_mode(m);
  }
  if (Given("cache_mode")) {
    v1::CacheMode m;
    if (!v1::CacheMode_Parse(upper(absl::GetFlag(FLAGS_cache_mode)), &m) ||
        m == v1::CACHE_MODE_UNSPECIFIED) {
      return absl::InvalidArgumentError(
          absl::StrCat("--cache_mode=", absl::GetFlag(FLAGS_cache_mode), ": expected none or align"));
    }
    l.set_cache_mode(m);
  }
  for (auto [name, flag, set] :
       {std::make_tuple("activation_dtype", &FLAGS_activation_dtype, &v1::Layout::set_activation_dtype),
        std::make_tuple("state_dtype", &FLAGS_state_dtype, &v1::Layout::set_state_dtype)}) {
    if (!Given(name)) continue;
    absl::StatusOr<DType> d = ParseDType(absl::GetFlag(*flag));
    if (!d.ok()) return absl::InvalidArgumentError(absl::StrCat("--", name, ": ", d.status().message()));
    (l.*set)(srv::ToProto(*d));
  }
  return l;
}

std::string JsonPlan(const server::SizingPlan& p, const std::string& model) {
  const v1::Layout& l = p.layout;
  const server::ServiceBytes& b = p.bytes;
  return absl::StrFormat(
      "{\n"
      "  \"model\": \"%s\",\n"
      "  \"layer_kind\": \"%s\", \"num_layers\": %d, \"num_heads\": %d, \"num_value_heads\": %d,\n"
      "  \"head_dim\": %d, \"conv_dim\": %d, \"conv_kernel\": %d, \"conv_width\": %d,\n"
      "  \"num_spec\": %d, \"max_rows\": %d, \"commit_mode\": \"%s\", \"cache_mode\": \"%s\",\n"
      "  \"state_dtype\": \"%s\", \"activation_dtype\": \"%s\", \"kept_pools\": %s,\n"
      "  \"budget_bytes\": %d,\n"
      "  \"num_blocks\": %d,\n"
      "  \"requests_fit\": %d,\n"
      "  \"stock_requests_fit\": %d,\n"
      "  \"allocated\": {\"pool_bytes\": %d, \"record_bytes\": %d, \"workspace_bytes\": %d, "
      "\"mode_bytes\": %d, \"params_bytes\": %d, \"step_slot_bytes\": %d, "
      "\"layer_table_bytes\": %d, \"kept_header_bytes\": %d, \"total_bytes\": %d},\n"
      "  \"state_block_bytes\": %d, \"conv_block_bytes\": %d,\n"
      "  \"per_request\": {\"state_bytes\": %d, \"conv_bytes\": %d, \"block_bytes\": %.1f, "
      "\"row_bytes\": %.1f, \"specstate_bytes\": %.1f, \"stock_state_bytes\": %d, "
      "\"stock_conv_bytes\": %d, \"stock_bytes\": %d, \"saving_bytes\": %.1f},\n"
      "  \"at_requests\": %d, \"specstate_at_bytes\": %d, \"stock_at_bytes\": %d, "
      "\"saving_at_bytes\": %d\n"
      "}\n",
      model, v1::LayerKind_Name(l.layer_kind()), l.num_layers(), l.num_heads(),
      server::ValueHeadsOf(l), l.head_dim(), l.conv_dim(), l.conv_kernel(), b.sizes.conv_width,
      l.num_spec(), l.max_rows(), v1::CommitMode_Name(l.commit_mode()),
      v1::CacheMode_Name(l.cache_mode()), v1::DType_Name(l.state_dtype()),
      v1::DType_Name(l.activation_dtype()), absl::GetFlag(FLAGS_kept_pools) ? "true" : "false",
      p.budget_bytes, l.num_blocks(), p.requests_fit, p.stock_requests_fit, b.pools, b.records,
      b.workspaces, b.mode, b.params, b.step_slots, b.layer_table, b.kept_header, b.total,
      b.sizes.state_block_bytes, b.sizes.conv_block_bytes, p.state_bytes, p.conv_bytes,
      p.block_bytes, p.row_bytes, p.request_bytes, p.stock_state_bytes, p.stock_conv_bytes,
      p.stock_request_bytes, p.saving_per_request, p.at_requests, p.specstate_at_bytes,
      p.stock_at_bytes, p.stock_at_bytes - p.specstate_at_bytes);
}

void PrintPlan(const server::SizingPlan& p, const std::string& model) {
  using server::FormatBytes;
  const v1::Layout& l = p.layout;
  const server::ServiceBytes& b = p.bytes;
  const server::ModelPreset* preset = server::FindModelPreset(model);
  const int64_t L = l.num_layers();
  const int Q = l.num_spec() + 1;
  absl::PrintF("model         %s\n",
               preset == nullptr
                   ? std::string("(none: the layout flags)")
                   : absl::StrCat(preset->name, " (", preset->model,
                                  preset->tensor_parallel > 1
                                      ? absl::StrCat(", one rank's part of ", preset->tensor_parallel)
                                      : std::string(),
                                  ")"));
  absl::PrintF(
      "layout        %d %s layers, %d heads x %d (%d value heads), conv %d channels x %d "
      "(kernel %d), num_spec %d (Q = %d)\n"
      "              %s state, %s activations, commit mode %s, cache mode %s, max_rows %d%s\n",
      L, v1::LayerKind_Name(l.layer_kind()), l.num_heads(), l.head_dim(), server::ValueHeadsOf(l),
      l.conv_dim(), b.sizes.conv_width, l.conv_kernel(), l.num_spec(), Q,
      v1::DType_Name(l.state_dtype()), v1::DType_Name(l.activation_dtype()),
      v1::CommitMode_Name(l.commit_mode()), v1::CacheMode_Name(l.cache_mode()), l.max_rows(),
      absl::GetFlag(FLAGS_kept_pools) ? ", pools kept across restarts" : "");
  absl::PrintF("\n%-34s %14s %16s\n", "per request", "SpecState", "stock spec path");
  absl::PrintF("  %-32s %14s %16s   %d layers x 1 | %d states of %s\n", "recurrent state",
               FormatBytes(p.state_bytes), FormatBytes(p.stock_state_bytes), L, Q,
               FormatBytes(b.sizes.state_block_bytes));
  absl::PrintF("  %-32s %14s %16s   %d layers x %d channels x %d %s\n", "conv window",
               FormatBytes(p.conv_bytes), FormatBytes(p.stock_conv_bytes), L, l.conv_dim(),
               b.sizes.conv_width, v1::DType_Name(l.activation_dtype()));
  const server::CommitModeRules& mode = server::CommitModeOf(l);
  std::string bookkeeping = mode.BookkeepingContents(l);
  if (b.kept_header > 0) bookkeeping += ", the kept block record";
  absl::PrintF("  %-32s %14s %16s   %s\n", "per-block bookkeeping",
               FormatBytes(p.block_bytes - p.state_bytes - p.conv_bytes), "-", bookkeeping);
  absl::PrintF("  %-32s %14s %16s   records%s, workspaces, slots of %d rows / %d\n",
               "step scratch, one row's share", FormatBytes(p.row_bytes), "-",
               b.sizes.records_per_layer_bytes == 0
                   ? absl::StrCat(" (none: ", mode.scratch_name(), ")").c_str()
                   : "",
               l.max_rows(), l.max_rows());
  absl::PrintF("  %-32s %14s %16s\n", "total", FormatBytes(p.request_bytes),
               FormatBytes(p.stock_request_bytes));
  absl::PrintF("%-34s %14s %16s   stock / SpecState = %.2fx\n", "saving per request", "",
               FormatBytes(p.saving_per_request),
               static_cast<double>(p.stock_request_bytes) / p.request_bytes);
  absl::PrintF("%-34s %14s %16s   saving %s (SpecState: everything specstated allocates with "
               "%d blocks)\n",
               absl::StrCat("at ", p.at_requests, " requests"), FormatBytes(p.specstate_at_bytes),
               FormatBytes(p.stock_at_bytes),
               FormatBytes(static_cast<double>(p.stock_at_bytes - p.specstate_at_bytes)),
               p.at_requests + 1);
  absl::PrintF("\nbudget        %d bytes (%s)%s\n", p.budget_bytes, FormatBytes(p.budget_bytes),
               Given("pool_memory") ? absl::StrCat(": --pool_memory=", absl::GetFlag(FLAGS_pool_memory))
                                    : ": what the blocks take");
  absl::PrintF("blocks        %d (--blocks for specstated; block 0 is the null block)\n",
               l.num_blocks());
  absl::PrintF(
      "allocated     %d bytes (%s): pools %s, %s %s, workspaces %s, mode %s, other %s%s\n",
      b.total, FormatBytes(b.total), FormatBytes(b.pools),
      mode.scratch_name(), FormatBytes(b.records),
      FormatBytes(b.workspaces), FormatBytes(b.mode),
      FormatBytes(b.params + b.step_slots + b.layer_table),
      b.kept_header == 0 ? ""
      : mode.TokenScratchInKeptAllocation()
          ? absl::StrCat(", kept header ", FormatBytes(b.kept_header), " (the ",
                         mode.scratch_name(), " are in it: counted once)")
          : absl::StrCat(", kept header ", FormatBytes(b.kept_header)));
  absl::PrintF("requests fit  SpecState %d, stock spec path %d (%.2fx)\n", p.requests_fit,
               p.stock_requests_fit,
               p.stock_requests_fit > 0
                   ? static_cast<double>(p.requests_fit) / p.stock_requests_fit
                   : 0.0);
  absl::PrintF(
      "\nSpecState keeps one checkpoint a layer per request (and a row's step scratch); the "
      "stock\nspeculative path keeps 1 + num_spec = %d recurrent states a layer per request "
      "and one conv\nstate of the same window (its scratch not counted). A request holds one "
      "block%s.\n",
      Q, l.cache_mode() == v1::ALIGN ? " (align mode: more, a block per mamba_block_size "
                                       "tokens of its prefix cache, on both paths)"
                                     : "");
}

int Plan() {
  namespace srv = ::specstate::server;
  const auto usage = [](const absl::Status& s) {
    std::fprintf(stderr, "specstatectl plan: %s\n", s.ToString().c_str());
    return 2;
  };
  absl::StatusOr<v1::Layout> layout = LayoutFromFlags();
  if (!layout.ok()) return usage(layout.status());
  const bool kept = absl::GetFlag(FLAGS_kept_pools);
  const int at_requests = absl::GetFlag(FLAGS_at_requests);
  if (at_requests < 1) {
    return usage(absl::InvalidArgumentError(
        absl::StrCat("--at_requests = ", at_requests, " must be >= 1")));
  }
  {
    // The layout is checked before it is sized (as specstated checks it
    // before it opens the device): with a budget, at the least block count.
    v1::Layout least = *layout;
    if (Given("pool_memory")) least.set_num_blocks(2);
    if (absl::Status st = srv::ValidateLayout(least); !st.ok()) return usage(st);
  }
  int64_t budget = 0;
  if (Given("pool_memory")) {
    if (Given("blocks")) {
      return usage(absl::InvalidArgumentError(
          "--blocks and --pool_memory both size the pools: give one of them"));
    }
    absl::StatusOr<srv::PoolMemory> m =
        srv::ParsePoolMemory(absl::GetFlag(FLAGS_pool_memory), "--pool_memory");
    if (!m.ok()) return usage(m.status());
    uint64_t free = 0;
    if (m->fraction > 0) {
      if (!Given("free_memory")) {
        return usage(absl::InvalidArgumentError(absl::StrCat(
            "--pool_memory=", absl::GetFlag(FLAGS_pool_memory),
            " is a fraction of the free memory: plan runs offline, give that memory with "
            "--free_memory (e.g. --free_memory=79GiB), or give --pool_memory in bytes")));
      }
      absl::StatusOr<srv::PoolMemory> f =
          srv::ParsePoolMemory(absl::GetFlag(FLAGS_free_memory), "--free_memory");
      if (!f.ok()) return usage(f.status());
      if (f->bytes == 0) {
        return usage(absl::InvalidArgumentError(absl::StrCat(
            "--free_memory=", absl::GetFlag(FLAGS_free_memory), ": must be bytes (e.g. 79GiB)")));
      }
      free = static_cast<uint64_t>(f->bytes);
    }
    absl::StatusOr<int64_t> b = srv::BudgetBytes(*m, free, "--pool_memory");
    if (!b.ok()) return usage(b.status());
    budget = *b;
    absl::StatusOr<int> blocks = srv::BlocksForBudget(*layout, budget, kept, "--pool_memory");
    if (!blocks.ok()) return usage(blocks.status());
    layout->set_num_blocks(*blocks);
  }
  if (absl::Status st = srv::ValidateLayout(*layout); !st.ok()) return usage(st);
  const srv::SizingPlan p = srv::PlanLayout(*layout, budget, kept, at_requests);
  const std::string model = absl::GetFlag(FLAGS_model);
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s", JsonPlan(p, model).c_str());
  } else {
    PrintPlan(p, model);
  }
  return 0;
}

}  // namespace
}  // namespace client
}  // namespace specstate

int main(int argc, char** argv) {
  using namespace specstate::client;  // NOLINT
  // Before any CUDA call (simulate's stock path runs kernels in this process).
  specstate::kernels::UseEagerCudaModuleLoading();
  absl::SetProgramUsageMessage(kUsage);
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2) {
    std::fprintf(stderr, "%s\n", kUsage);
    return 2;
  }
  const std::string command = args[1];
  // Offline: no server.
  if (command == "plan") return Plan();
  const bool known = command == "health" || command == "layout" || command == "regions" ||
                     command == "state" || command == "stats" || command == "simulate" ||
                     command == "recover" || command == "verify-pools" || command == "saved";
  if (!known) {
    std::fprintf(stderr, "specstatectl: unknown subcommand \"%s\"\n%s\n", command.c_str(), kUsage);
    return 2;
  }
  const std::string servers = absl::GetFlag(FLAGS_servers);
  if (!servers.empty()) {
    if (command != "simulate") {
      std::fprintf(stderr, "specstatectl: --servers is for simulate; %s takes one --server\n",
                   command.c_str());
      return 2;
    }
    absl::StatusOr<std::vector<std::unique_ptr<Client>>> ranks =
        ConnectRanks(absl::StrSplit(servers, ',', absl::SkipWhitespace()));
    if (!ranks.ok()) return Fail(ranks.status());
    std::vector<Client*> clients;
    for (const std::unique_ptr<Client>& r : *ranks) clients.push_back(r.get());
    return Simulate(clients);
  }
  const int restart_every = absl::GetFlag(FLAGS_restart_every);
  if (restart_every != 0) {
    if (command != "simulate" || restart_every < 0) {
      std::fprintf(stderr, "specstatectl: --restart_every=N (N >= 1) is for simulate\n");
      return 2;
    }
    if (absl::flags_internal::WasPresentOnCommandLine("server")) {
      std::fprintf(stderr,
                   "specstatectl: --restart_every kills and restarts the simulator's own service: "
                   "leave out --server (its layout: --service_flags)\n");
      return 2;
    }
    OwnServiceOptions own;
    own.specstated = absl::GetFlag(FLAGS_specstated);
    own.keeper = absl::GetFlag(FLAGS_keeper_binary);
    own.flags = absl::StrSplit(absl::GetFlag(FLAGS_service_flags), ' ', absl::SkipWhitespace());
    // --commit_mode names the mode the simulation expects: its own service
    // serves it, unless --service_flags says otherwise.
    const std::string mode = absl::GetFlag(FLAGS_commit_mode);
    if (!mode.empty() &&
        std::none_of(own.flags.begin(), own.flags.end(), [](const std::string& f) {
          return absl::StartsWith(f, "--commit_mode");
        })) {
      own.flags.push_back(absl::StrCat("--commit_mode=", mode));
    }
    absl::StatusOr<std::unique_ptr<OwnService>> service = OwnService::Start(own);
    if (!service.ok()) return Fail(service.status());
    std::fprintf(stderr, "restart drill: specstate-keeper and specstated in %s\n",
                 (*service)->directory().c_str());
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect((*service)->address());
    if (!client.ok()) return Fail(client.status());
    absl::StatusOr<v1::Layout> layout = (*client)->GetLayout();
    if (!layout.ok()) return Fail(layout.status());
    RestartDrill drill(service->get(), restart_every, absl::GetFlag(FLAGS_seed), *layout);
    return Simulate({client->get()}, &drill);
  }
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(absl::GetFlag(FLAGS_server));
  if (!client.ok()) return Fail(client.status());
  Client& c = **client;
  if (command == "health") return Health(c);
  if (command == "layout") return Layout(c);
  if (command == "regions") return Regions(c);
  if (command == "state") return State(c);
  if (command == "stats") return Stats(c);
  if (command == "saved") return Saved(c);
  if (command == "recover") return Recover(c, false);
  if (command == "verify-pools") return Recover(c, true);
  return Simulate({&c});
}
