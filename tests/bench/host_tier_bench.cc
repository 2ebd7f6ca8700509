// host_tier_bench: the host tier's SaveBlocks and RestoreBlocks against a
// running CUDA specstated started with --host_tier_bytes, beside the PCIe
// copy ceilings measured in this run (pinned host memory, the copy engine),
// as a markdown table; then a check that every restored block equals its
// source in every layer (ReadState's checksums).
//
//   specstated --backend=cuda --model=kimi-linear-48b-a3b --blocks=72 \
//     --max_rows=16 --host_tier_bytes=3GiB --listen=unix:///tmp/s.sock &
//   host_tier_bench --server=unix:///tmp/s.sock [--counts=1,8,32] [--iters=10]
//
// The pools are filled with random bytes first (mapped through ExportPools,
// as a prefill would write them). A call's time is its round trip, SYNC:
// from the request to the answer once the copies are done.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/lib/client.h"
#include "client/lib/shared_memory.h"
#include "tests/bench/cuda_check.h"

ABSL_FLAG(std::string, server, "unix:///tmp/specstate.sock", "the running service");
ABSL_FLAG(std::string, counts, "1,8,32", "blocks per call");
ABSL_FLAG(int, iters, 10, "calls per measurement (the median is reported)");

namespace specstate {
namespace {

using Clock = std::chrono::steady_clock;

template <typename T>
T OrDie(absl::StatusOr<T> v, const char* what) {
  if (!v.ok()) {
    std::fprintf(stderr, "host_tier_bench: %s: %s\n", what, v.status().ToString().c_str());
    std::exit(1);
  }
  return *std::move(v);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The copy engine between pinned host memory and the device, GB/s (bytes
// moved one way), median of 5 copies of `bytes`.
double CopyBandwidth(bool to_device, size_t bytes) {
  void* host = nullptr;
  void* device = nullptr;
  CHECK_CUDA(cudaHostAlloc(&host, bytes, cudaHostAllocDefault));
  CHECK_CUDA(cudaMalloc(&device, bytes));
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  std::vector<double> gbps;
  for (int i = 0; i < 6; ++i) {
    CHECK_CUDA(cudaEventRecord(a));
    CHECK_CUDA(to_device ? cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice)
                         : cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaEventRecord(b));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    if (i > 0) gbps.push_back(bytes / (ms * 1e-3) / 1e9);
  }
  CHECK_CUDA(cudaFreeHost(host));
  CHECK_CUDA(cudaFree(device));
  return Median(gbps);
}

int Main() {
  auto c = OrDie(client::Client::Connect(absl::GetFlag(FLAGS_server)), "connect");
  const v1::Layout layout = OrDie(c->GetLayout(), "GetLayout");
  const v1::ListSavedResponse tier = OrDie(c->ListSaved(), "ListSaved");
  if (tier.capacity() == 0) {
    std::fprintf(stderr, "host_tier_bench: the service has no host tier (--host_tier_bytes)\n");
    return 2;
  }
  std::vector<int> counts;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_counts), ',')) {
    int n = 0;
    if (!absl::SimpleAtoi(s, &n) || n < 1 || n > tier.capacity() ||
        2 * n + 1 > layout.num_blocks()) {
      std::fprintf(stderr, "host_tier_bench: --counts: %s: 1 to %lld, and 2n + 1 <= %d blocks\n",
                   std::string(s).c_str(), static_cast<long long>(tier.capacity()),
                   layout.num_blocks());
      return 2;
    }
    counts.push_back(n);
  }
  const bool cuda = layout.backend() == v1::CUDA;

  // Random pools, as a prefill would leave them.
  auto memory = OrDie(client::SharedMemory::Create(layout.backend(), layout.device()), "memory");
  auto pools = OrDie(memory->MapPools(OrDie(c->ExportPools(), "ExportPools")), "MapPools");
  const uint64_t pool_bytes = pools->description().allocation_bytes();
  {
    std::vector<char> chunk(64 << 20);
    std::mt19937_64 rng(std::random_device{}());
    for (size_t i = 0; i < chunk.size(); i += 8) {
      const uint64_t x = rng();
      std::memcpy(&chunk[i], &x, 8);
    }
    for (uint64_t at = 0; at < pool_bytes; at += chunk.size()) {
      const uint64_t n = std::min<uint64_t>(chunk.size(), pool_bytes - at);
      if (n <= 8) break;
      // Shifted each chunk: no two blocks hold the same bytes.
      if (cuda) {
        CHECK_CUDA(cudaMemcpy(pools->base() + at, chunk.data() + (at / chunk.size()) % 8, n - 8,
                              cudaMemcpyHostToDevice));
      } else {
        std::memcpy(pools->base() + at, chunk.data() + (at / chunk.size()) % 8, n - 8);
      }
    }
  }

  auto session = OrDie(c->OpenSession("host_tier_bench", /*drive=*/true), "OpenSession");
  const uint64_t entry = tier.entry_bytes();
  std::printf("## host_tier_bench: %s backend, %d layers, a block %.2f MiB (every layer's "
              "recurrent %lld B and conv %lld B), SYNC round trips, median of %d\n\n",
              cuda ? "CUDA" : "CPU", layout.num_layers(), entry / 1048576.0,
              static_cast<long long>(layout.state_block_bytes()),
              static_cast<long long>(layout.conv_block_bytes()), absl::GetFlag(FLAGS_iters));
  double d2h = 0, h2d = 0;
  if (cuda) {
    d2h = CopyBandwidth(false, 256 << 20);
    h2d = CopyBandwidth(true, 256 << 20);
    std::printf("Copy engine, pinned host memory, 256 MiB, this run: device to host %.1f GB/s, "
                "host to device %.1f GB/s\n\n",
                d2h, h2d);
  }
  std::printf("| call | blocks | MiB | time (ms) | GB/s | of the copy engine |\n"
              "|---|---:|---:|---:|---:|---:|\n");
  const int iters = absl::GetFlag(FLAGS_iters);
  for (int n : counts) {
    v1::SaveBlocksRequest save;
    v1::RestoreBlocksRequest restore;
    for (int i = 0; i < n; ++i) {
      v1::SaveEntry* s = save.add_entries();
      s->set_block(1 + i);
      s->set_key(absl::StrCat("bench-", n, "-", i));
      v1::RestoreEntry* r = restore.add_entries();
      r->set_key(s->key());
      r->set_block(1 + n + i);
    }
    for (bool is_save : {true, false}) {
      std::vector<double> ms;
      for (int it = 0; it < iters; ++it) {
        const Clock::time_point t0 = Clock::now();
        const absl::Status st = is_save ? session->SaveBlocks(save).status()
                                        : session->RestoreBlocks(restore).status();
        const double elapsed =
            std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
        if (!st.ok()) {
          std::fprintf(stderr, "host_tier_bench: %s: %s\n", is_save ? "SaveBlocks" : "RestoreBlocks",
                       st.ToString().c_str());
          return 1;
        }
        ms.push_back(elapsed);
      }
      const double t = Median(ms);
      const double gbps = double(n) * entry / (t * 1e-3) / 1e9;
      const double ceiling = is_save ? d2h : h2d;
      std::printf("| %s | %d | %.1f | %.3f | %.1f | %s |\n",
                  is_save ? "SaveBlocks" : "RestoreBlocks", n, n * entry / 1048576.0, t, gbps,
                  ceiling > 0 ? absl::StrCat(static_cast<int>(100 * gbps / ceiling + 0.5), "%").c_str()
                              : "-");
    }
    // Every restored block equals its source, every layer, both pools.
    for (int i = 0; i < n; ++i) {
      for (int l = 0; l < layout.num_layers(); ++l) {
        const v1::ReadStateResponse a = OrDie(c->ReadState(l, 1 + i, false), "ReadState");
        const v1::ReadStateResponse b = OrDie(c->ReadState(l, 1 + n + i, false), "ReadState");
        if (a.recurrent().checksum() != b.recurrent().checksum() ||
            a.conv().checksum() != b.conv().checksum()) {
          std::printf("\nMISMATCH: block %d restored into block %d differs in layer %d\n", 1 + i,
                      1 + n + i, l);
          return 1;
        }
      }
    }
  }
  std::printf("\nEvery restored block equals its source in every layer (ReadState checksums).\n");
  return 0;
}

}  // namespace
}  // namespace specstate

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return specstate::Main();
}
