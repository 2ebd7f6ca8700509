// libFuzzer target over the service's request validation and region
// resolution: the real Engine on the CPU device, with real POSIX
// shared-memory regions, driven by Verify, Commit, RecordStateBlocks,
// BindVerifyInputs, SubmitStep, LoadLayerParams and RegisterRegion requests
// that the fuzzer derives from valid ones (every field may be perturbed), or
// parses from raw bytes.
//
// What it asserts, besides "no crash and no sanitizer report":
// - Verify, BindVerifyInputs and RegisterRegion never change a pool byte;
// - a rejected call (its status, or the device's) changes no pool byte.
//
//   tools/fuzz/run.sh --seconds=60      # builds with clang and runs over tools/fuzz/corpus.tar.xz
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <fuzzer/FuzzedDataProvider.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "server/config/config.h"
#include "server/device/device.h"
#include "server/engine/engine.h"

namespace specstate {
namespace server {
namespace {

constexpr int kLayers = 2;
constexpr int kHeads = 2;
constexpr int kHeadDim = 64;
constexpr int kRows = 4;
constexpr int kQ = 4;
constexpr int kTokens = kRows * kQ;
constexpr uint64_t kActsBytes = 1 << 17;
constexpr uint64_t kMetaBytes = 1 << 12;

// A POSIX shared-memory object of the fuzzer's own, mapped here too.
struct Shm {
  std::string name;
  char* data = nullptr;
  uint64_t bytes = 0;
};

Shm MakeShm(const std::string& name, uint64_t bytes) {
  Shm s;
  s.name = absl::StrCat("/specstate-fuzz-", getpid(), "-", name);
  shm_unlink(s.name.c_str());
  const int fd = shm_open(s.name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(bytes)) != 0) std::abort();
  s.data = static_cast<char*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  close(fd);
  if (s.data == MAP_FAILED) std::abort();
  s.bytes = bytes;
  return s;
}

struct World {
  std::unique_ptr<Engine> engine;
  const std::string session = "s1-fuzz";
  Shm acts, meta;
  const char* pools = nullptr;
  uint64_t pool_bytes = 0;
  std::vector<char> saved;  // the pools before the call
};

// Waits for a driving call's reply (SYNC calls answer after the device ran).
template <typename Request, typename Response>
absl::Status Wait(void (Engine::*method)(const std::string&, const Request&, Reply<Response>),
                  World& w, const Request& request) {
  absl::Notification done;
  absl::Status result;
  (w.engine.get()->*method)(w.session, request, [&](absl::Status s, Response) {
    result = s;
    done.Notify();
  });
  // Every call is answered: a call that is not within seconds is a bug.
  if (!done.WaitForNotificationWithTimeout(absl::Seconds(10))) {
    std::fprintf(stderr, "no answer within 10 s to:\n%s\n", request.DebugString().c_str());
    std::abort();
  }
  return result;
}

// Every call before it has finished on the device (the queue is in order).
void Drain(World& w) {
  v1::ReadStateRequest r;
  r.set_layer(0);
  r.set_block(0);
  absl::Notification done;
  w.engine->ReadState(r, [&](absl::Status, v1::ReadStateResponse) { done.Notify(); });
  done.WaitForNotification();
}

void Register(World& w, const std::string& name, const Shm& shm) {
  v1::RegisterRegionRequest r;
  r.set_session_id(w.session);
  r.set_name(name);
  r.set_shm_name(shm.name);
  r.set_byte_size(shm.bytes);
  if (!w.engine->RegisterRegion(r).ok()) std::abort();
}

World& TheWorld() {
  static World* const w = [] {
    auto* world = new World();
    v1::ServiceConfig config = DefaultServiceConfig();
    v1::Layout* l = config.mutable_layout();
    l->set_backend(v1::CPU);
    l->set_num_layers(kLayers);
    l->set_num_heads(kHeads);
    l->set_head_dim(kHeadDim);
    l->set_conv_dim(3 * kHeads * kHeadDim);
    l->set_num_blocks(16);
    l->set_max_rows(kRows);
    l->set_num_spec(kQ - 1);
    l->set_cache_mode(v1::ALIGN);
    l->set_mamba_block_size(8);
    auto device = CreateCpuDevice();
    if (!device.ok()) std::abort();
    auto engine = Engine::Create(config, *std::move(device));
    if (!engine.ok()) {
      std::fprintf(stderr, "%s\n", engine.status().ToString().c_str());
      std::abort();
    }
    world->engine = *std::move(engine);
    world->engine->OpenSession(world->session);
    world->acts = MakeShm("acts", kActsBytes);
    world->meta = MakeShm("meta", kMetaBytes);
    // Small bf16 values, never zero; int32 metadata; doorbells rung high.
    uint32_t x = 12345;
    auto* bf16 = reinterpret_cast<uint16_t*>(world->acts.data);
    for (uint64_t i = 0; i < kActsBytes / 2; ++i) {
      x = x * 1664525u + 1013904223u;
      bf16[i] = static_cast<uint16_t>(0x3c00 + (x >> 24));
    }
    auto* ints = reinterpret_cast<uint32_t*>(world->meta.data);
    for (uint64_t i = 0; i < kMetaBytes / 4; ++i) ints[i] = i < 512 ? i % 5 : 0xffffffffu;
    Register(*world, "acts", world->acts);
    Register(*world, "meta", world->meta);
    for (int layer = 0; layer < kLayers; ++layer) {
      v1::LoadLayerParamsRequest p;
      p.set_layer(layer);
      for (int h = 0; h < kHeads; ++h) p.mutable_a_log()->mutable_values()->add_values(-0.5f);
      for (int i = 0; i < kHeads * kHeadDim; ++i) {
        p.mutable_dt_bias()->mutable_values()->add_values(0.25f);
      }
      if (!Wait(&Engine::LoadLayerParams, *world, p).ok()) std::abort();
    }
    v1::ExportPoolsResponse exported = world->engine->ExportPools();
    const int fd = open(exported.shm_path().c_str(), O_RDONLY);
    if (fd < 0) std::abort();
    world->pool_bytes = exported.allocation_bytes();
    world->pools = static_cast<const char*>(
        mmap(nullptr, world->pool_bytes, PROT_READ, MAP_SHARED, fd, 0));
    close(fd);
    if (world->pools == MAP_FAILED) std::abort();
    return world;
  }();
  return *w;
}

// ---------------------------------------------------------------------------
// Requests: valid ones, then perturbed by the fuzzer's bytes. The provider
// reads zeros once the input is used up, so every choice is written such
// that zeros pick the valid value: inputs reach the later checks.

// True now and then (never once the input is used up).
bool Rare(FuzzedDataProvider& f, float p = 0.1f) { return f.ConsumeProbability<float>() > 1 - p; }

// `valid`, or now and then any value in [lo, hi].
template <typename T>
T Perhaps(FuzzedDataProvider& f, T valid, T lo, T hi) {
  return Rare(f) ? f.ConsumeIntegralInRange<T>(lo, hi) : valid;
}

v1::RegionTensor Tensor(FuzzedDataProvider& f, uint64_t offset, std::vector<int64_t> shape) {
  v1::RegionTensor t;
  t.set_region(f.ConsumeProbability<float>() < 0.95f ? "acts"
                                                     : f.PickValueInArray({"meta", "nope", ""}));
  t.set_dtype(v1::BF16);
  t.set_offset_bytes(offset);
  for (int64_t d : shape) t.add_shape(d);
  return t;
}

// Perturbs a tensor reference: offset, a dimension, a stride, the dtype.
void Mutate(FuzzedDataProvider& f, v1::RegionTensor* t) {
  switch (f.ConsumeIntegralInRange<int>(0, 7)) {
    case 0:
      t->set_offset_bytes(f.ConsumeIntegral<uint64_t>());
      break;
    case 1:
      t->set_offset_bytes(f.ConsumeIntegralInRange<uint64_t>(0, kActsBytes));
      break;
    case 2:
      if (t->shape_size() > 0) {
        t->set_shape(f.ConsumeIntegralInRange<int>(0, t->shape_size() - 1),
                     f.ConsumeIntegralInRange<int64_t>(-4, 300));
      }
      break;
    case 3:
      t->clear_strides();
      for (int i = 0; i < t->shape_size(); ++i) {
        t->add_strides(f.ConsumeIntegralInRange<int64_t>(-2, 1 << 20));
      }
      break;
    case 4:
      t->set_dtype(static_cast<v1::DType>(f.ConsumeIntegralInRange<int>(0, 5)));
      break;
    case 5:
      t->add_shape(f.ConsumeIntegralInRange<int64_t>(0, 8));
      break;
    default:
      break;  // unchanged
  }
}

// An index tensor: inline values, or int32 in the "meta" region.
v1::IndexTensor Index(FuzzedDataProvider& f, std::vector<int32_t> values) {
  v1::IndexTensor t;
  if (f.ConsumeBool()) {
    for (int32_t& v : values) {
      if (Rare(f, 0.05f)) v = f.ConsumeIntegral<int32_t>();
      t.mutable_values()->add_values(v);
    }
    if (Rare(f)) t.mutable_values()->add_shape(f.ConsumeIntegralInRange<int>(-1, 9));
    return t;
  }
  v1::RegionTensor* r = t.mutable_region();
  r->set_region("meta");
  r->set_dtype(v1::INT32);
  r->set_offset_bytes(4 * f.ConsumeIntegralInRange<uint64_t>(0, 500));
  r->add_shape(static_cast<int64_t>(values.size()));
  if (Rare(f, 0.2f)) Mutate(f, r);
  return t;
}

void Ordering(FuzzedDataProvider& f, v1::Ordering* ordering, v1::Signal* wait, v1::Signal* signal,
              bool* has_wait, bool* has_signal) {
  *has_wait = *has_signal = false;
  if (!f.ConsumeBool()) return;
  *ordering = Rare(f) ? static_cast<v1::Ordering>(f.ConsumeIntegralInRange<int>(0, 3)) : v1::ASYNC;
  for (v1::Signal* s : {wait, signal}) {
    if (!f.ConsumeBool()) continue;
    (s == wait ? *has_wait : *has_signal) = true;
    if (Rare(f)) {
      s->mutable_event()->set_handle(f.ConsumeBytesAsString(f.ConsumeIntegralInRange<int>(0, 70)));
      continue;
    }
    v1::Doorbell* d = s->mutable_doorbell();
    // Waits only on "meta" words that no output may overwrite.
    d->set_region(s == wait || f.ConsumeBool() ? "meta" : "acts");
    // Doorbells the fuzzer waits on are rung already (words >= 512 hold
    // 0xffffffff), so no wait blocks the queue for good.
    d->set_offset_bytes(s == wait ? 4 * f.ConsumeIntegralInRange<uint64_t>(512, 1023)
                                  : f.ConsumeIntegral<uint32_t>() % (kMetaBytes + 64));
    d->set_value(s == wait ? f.ConsumeIntegralInRange<uint32_t>(0, 100) : 0xffffffffu);
  }
}

v1::VerifyRequest MakeVerify(FuzzedDataProvider& f, uint64_t step) {
  v1::VerifyRequest v;
  v.set_step(step);
  v.set_layer(Perhaps(f, f.ConsumeIntegralInRange<int>(0, kLayers - 1), -1, kLayers));
  const int rows = kRows - Perhaps(f, f.ConsumeIntegralInRange<int>(0, kRows - 1), -1, kRows);
  v.set_num_rows(rows);
  std::vector<int32_t> qsl = {0}, idx;
  for (int i = 0; i < rows; ++i) {
    qsl.push_back(qsl.back() + kQ - Perhaps(f, f.ConsumeIntegralInRange<int>(0, kQ - 1), -1, kQ));
    idx.push_back(1 + i + Perhaps(f, 0, -2, 16));
  }
  if (!Rare(f)) {
    *v.mutable_query_start_loc() = Index(f, qsl);
    *v.mutable_state_indices() = Index(f, idx);
  }
  const int64_t T = kTokens;
  const uint64_t per = T * kHeads * kHeadDim * 2;
  *v.mutable_q() = Tensor(f, 0, {T, kHeads, kHeadDim});
  *v.mutable_k() = Tensor(f, per, {T, kHeads, kHeadDim});
  *v.mutable_v() = Tensor(f, 2 * per, {T, kHeads, kHeadDim});
  *v.mutable_g() = Tensor(f, 3 * per, {T, kHeads, kHeadDim});
  // Outputs only in "acts": the doorbell words in "meta" must keep their values.
  *v.mutable_o() = Tensor(f, 4 * per, {T, kHeads, kHeadDim});
  v.mutable_o()->set_region("acts");
  *v.mutable_beta() = Tensor(f, 5 * per, {T, kHeads});
  for (int n = f.ConsumeIntegralInRange<int>(0, 3); n > 0; --n) {
    v1::RegionTensor* fields[] = {v.mutable_q(), v.mutable_k(), v.mutable_v(),
                                  v.mutable_g(), v.mutable_o(), v.mutable_beta()};
    Mutate(f, fields[f.ConsumeIntegralInRange<int>(0, 5)]);
  }
  if (Rare(f, 0.2f)) v.set_bound_inputs(true);
  if (Rare(f)) v.set_num_tokens(f.ConsumeIntegralInRange<int64_t>(-2, 40));
  v1::Ordering o = v1::SYNC;
  bool has_wait, has_signal;
  Ordering(f, &o, v.mutable_wait(), v.mutable_signal(), &has_wait, &has_signal);
  v.set_ordering(o);
  if (!has_wait) v.clear_wait();
  if (!has_signal) v.clear_signal();
  return v;
}

v1::CommitRequest MakeCommit(FuzzedDataProvider& f, uint64_t step) {
  v1::CommitRequest c;
  c.set_step(step);
  const int batch = kRows - Perhaps(f, 0, -2, kRows);
  std::vector<int32_t> accepted, computed, request;
  for (int i = 0; i < batch; ++i) {
    accepted.push_back(Perhaps(f, f.ConsumeIntegralInRange<int>(0, kQ), -1, kQ + 1));
    computed.push_back(Perhaps(f, f.ConsumeIntegralInRange<int>(0, 12), -1, 40));
    request.push_back(Perhaps(f, i, -1, batch));
  }
  *c.mutable_num_accepted() = Index(f, accepted);
  if (!Rare(f)) {
    v1::IndexTensor table;
    const int width = 3 - Perhaps(f, 0, -3, 3);
    for (int i = 0; i < batch * width; ++i) {
      table.mutable_values()->add_values(Perhaps(f, 1 + (i % 16 + i / width * 3) % 15, -1, 17));
    }
    table.mutable_values()->add_shape(batch);
    table.mutable_values()->add_shape(width);
    *c.mutable_block_table() = table;
    *c.mutable_num_computed_tokens() = Index(f, computed);
  }
  if (f.ConsumeBool()) *c.mutable_request_indices() = Index(f, request);
  v1::Ordering o = v1::SYNC;
  bool has_wait, has_signal;
  Ordering(f, &o, c.mutable_wait(), c.mutable_signal(), &has_wait, &has_signal);
  c.set_ordering(o);
  if (!has_wait) c.clear_wait();
  if (!has_signal) c.clear_signal();
  return c;
}

v1::RecordStateBlocksRequest MakeRecord(FuzzedDataProvider& f, uint64_t step) {
  v1::RecordStateBlocksRequest r;
  r.set_step(step);
  const int batch = kRows - Perhaps(f, 0, -2, kRows);
  std::vector<int32_t> mapping, sampled, computed, request;
  for (int i = 0; i < batch; ++i) {
    mapping.push_back(Perhaps(f, i, -2, kRows + 1));
    sampled.push_back(Perhaps(f, f.ConsumeIntegralInRange<int>(0, kQ), -1, kQ + 1));
    computed.push_back(Perhaps(f, f.ConsumeIntegralInRange<int>(0, 12), -1, 40));
    request.push_back(Perhaps(f, i, -1, batch));
  }
  *r.mutable_idx_mapping() = Index(f, mapping);
  *r.mutable_num_sampled() = Index(f, sampled);
  *r.mutable_num_computed_tokens() = Index(f, computed);
  if (f.ConsumeBool()) *r.mutable_request_indices() = Index(f, request);
  r.set_block_table_width(3 - Perhaps(f, 0, -3, 4));
  for (v1::RegionTensor* out : {r.mutable_state_idx(), r.mutable_num_accepted()}) {
    // Below the doorbell words of "meta" (which start at word 512).
    out->set_region(f.ConsumeBool() ? "meta" : "acts");
    out->set_dtype(v1::INT32);
    out->set_offset_bytes(4 * (out == r.mutable_state_idx() ? 0 : 16) +
                          4 * Perhaps<uint64_t>(f, 0, 0, 480));
    out->add_shape(kRows - Perhaps<int64_t>(f, 0, -1, kRows));
  }
  return r;
}

void CheckPoolsUnchanged(World& w, const char* what, const absl::Status& status) {
  if (std::memcmp(w.saved.data(), w.pools, w.pool_bytes) != 0) {
    std::fprintf(stderr, "%s changed the pools (status %s)\n", what, status.ToString().c_str());
    std::abort();
  }
}

// SPECSTATE_FUZZ_STATS=1: how many calls of each kind were accepted, at
// exit (how deep the inputs reach).
void Tally(int op, const absl::Status& status) {
  static int calls[9], accepted[9];
  static const bool enabled = [] {
    const char* e = std::getenv("SPECSTATE_FUZZ_STATS");
    if (e == nullptr || std::string(e) != "1") return false;
    std::atexit([] {
      for (int i = 0; i < 9; ++i) std::fprintf(stderr, "op %d: %d of %d accepted\n", i, accepted[i], calls[i]);
    });
    return true;
  }();
  if (!enabled) return;
  ++calls[op];
  if (status.ok()) ++accepted[op];
  if (!status.ok() && calls[op] % 500 == 1) {
    std::fprintf(stderr, "op %d: %s\n", op, status.ToString().c_str());
  }
}

}  // namespace
}  // namespace server
}  // namespace specstate

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace specstate::server;
  namespace v1 = specstate::v1;
  World& w = TheWorld();
  FuzzedDataProvider f(data, size);
  static uint64_t next_step = 1;
  while (f.remaining_bytes() > 0) {
    // Mostly the current step (so that later calls reach deeper checks).
    const uint64_t step = Rare(f, 0.3f) ? ++next_step : next_step;
    w.saved.assign(w.pools, w.pools + w.pool_bytes);
    const uint64_t failed_before = w.engine->counters().steps_failed;
    // Zeros (a used-up input) pick Verify; Commit and RecordStateBlocks follow.
    const int op = f.ConsumeIntegralInRange<int>(0, 8);
    absl::Status st;
    bool may_write = false;  // an accepted call of this kind may change the pools
    const char* what = "";
    switch (op) {
      case 0:
      case 1:
        what = "Verify";
        st = Wait(&Engine::Verify, w, MakeVerify(f, step));
        break;
      case 2:
        what = "Commit";
        st = Wait(&Engine::Commit, w, MakeCommit(f, step));
        may_write = true;
        break;
      case 3:
        what = "RecordStateBlocks";
        st = Wait(&Engine::RecordStateBlocks, w, MakeRecord(f, step));
        break;
      case 4: {
        what = "BindVerifyInputs";
        const v1::VerifyRequest v = MakeVerify(f, step);
        v1::BindVerifyInputsRequest b;
        b.set_layer(v.layer());
        *b.mutable_q() = v.q();
        *b.mutable_k() = v.k();
        *b.mutable_v() = v.v();
        *b.mutable_g() = v.g();
        *b.mutable_beta() = v.beta();
        *b.mutable_o() = v.o();
        if (f.ConsumeBool()) {
          *b.mutable_query_start_loc() = v.query_start_loc();
          *b.mutable_state_indices() = v.state_indices();
        }
        st = Wait(&Engine::BindVerifyInputs, w, b);
        break;
      }
      case 5: {
        what = "SubmitStep";
        v1::SubmitStepRequest s;
        for (int n = f.ConsumeIntegralInRange<int>(0, 3 * kLayers); n > 0; --n) {
          *s.add_verifies() = MakeVerify(f, step);
        }
        if (f.ConsumeBool()) *s.mutable_commit() = MakeCommit(f, step);
        may_write = s.has_commit();
        st = Wait(&Engine::SubmitStep, w, s);
        break;
      }
      case 6: {
        what = "LoadLayerParams";
        v1::LoadLayerParamsRequest p;
        p.set_layer(Perhaps(f, f.ConsumeIntegralInRange<int>(0, kLayers - 1), -1, kLayers));
        if (f.ConsumeBool()) {
          for (int h = 0; h < kHeads; ++h) {
            p.mutable_a_log()->mutable_values()->add_values(f.ConsumeFloatingPoint<float>());
          }
        } else {
          v1::RegionTensor* t = p.mutable_a_log()->mutable_region();
          t->set_region("acts");
          t->set_dtype(v1::FP32);
          t->set_offset_bytes(4 * f.ConsumeIntegralInRange<uint64_t>(0, 1000));
          t->add_shape(kHeads);
        }
        v1::RegionTensor* d = p.mutable_dt_bias()->mutable_region();
        d->set_region("acts");
        d->set_dtype(v1::FP32);
        d->set_offset_bytes(4 * f.ConsumeIntegralInRange<uint64_t>(0, 1000));
        d->add_shape(kHeads * kHeadDim);
        st = Wait(&Engine::LoadLayerParams, w, p);
        break;
      }
      case 7: {
        what = "RegisterRegion";
        v1::RegisterRegionRequest r;
        r.set_session_id(f.ConsumeBool() ? w.session : f.ConsumeRandomLengthString(12));
        r.set_name(f.ConsumeRandomLengthString(8));
        r.set_shm_name(f.ConsumeBool() ? w.meta.name : f.ConsumeRandomLengthString(24));
        r.set_offset_bytes(f.ConsumeIntegralInRange<uint64_t>(0, 5000));
        r.set_byte_size(f.ConsumeIntegralInRange<uint64_t>(0, 9000));
        st = w.engine->RegisterRegion(r);
        if (st.ok()) {  // keep the registry small: drop it again
          w.engine->regions().Unregister(r.session_id(), r.name(), [] {}).IgnoreError();
        }
        break;
      }
      default: {
        what = "Verify (raw bytes)";
        v1::VerifyRequest v;
        const std::string bytes = f.ConsumeRandomLengthString(512);
        if (v.ParseFromString(bytes)) {
          v.set_ordering(v1::SYNC);
          v.clear_wait();
          v.clear_signal();
          st = Wait(&Engine::Verify, w, v);
        }
        break;
      }
    }
    Drain(w);  // ASYNC work has finished, and its failure is recorded
    Tally(op, st);
    // An ASYNC call's device failure shows as a failed step.
    const bool failed = !st.ok() || w.engine->counters().steps_failed != failed_before;
    if (failed || !may_write) CheckPoolsUnchanged(w, what, st);
  }
  return 0;
}
