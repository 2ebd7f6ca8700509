// The RecoverSSM kernels, on the CPU and on CUDA, behind one interface.
//
// Each entry point validates everything it can see on the host (shapes,
// dtypes, strides, capacities) and returns an error naming the field and the
// bound before anything runs. Then it enqueues the call on `stream`
// (cudaStream_t on CUDA; the CPU backend runs on the calling thread) and
// returns without synchronizing. The first thing each call does on the device
// is check every value that lives in device memory (docs/semantics.md,
// "Checks before anything is written"); if one fails, no kernel of the call writes anything and
// `args.status` says which field and row failed. Read it after the stream
// reaches the call and convert it with DeviceStatusToStatus().
//
//   const KdaKernels& kernels = CpuKdaKernels();
//   VerifyArgs args = ...;                 // pointers into host memory
//   absl::Status s = kernels.Verify(args, /*stream=*/nullptr);
//   if (s.ok()) s = DeviceStatusToStatus(*args.status, "Verify");
#ifndef SPECSTATE_KERNELS_KDA_KERNELS_H_
#define SPECSTATE_KERNELS_KDA_KERNELS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {

enum class Backend { kCpu, kCuda };

absl::string_view BackendName(Backend backend);  // "cpu", "cuda"

using Stream = void*;

class KdaKernels {
 public:
  virtual ~KdaKernels() = default;

  virtual Backend backend() const = 0;

  // The stock spec-path recurrent kernel (one layer).
  // \returns INVALID_ARGUMENT / OUT_OF_RANGE for bad host-visible arguments.
  absl::Status Stock(const StockArgs& args, Stream stream) const;

  // RecoverSSM verify (one layer): outputs and records, no state writes.
  // DEFERRED (args.mode) replays a row's pending tokens first; FAST
  // computes the outputs from the checkpoint and the block's ring and leaves
  // the window in the ring as candidates (kda_args.h).
  absl::Status Verify(const VerifyArgs& args, Stream stream) const;

  // RecoverSSM commit of every layer of a group, with a number of kernel
  // launches that does not depend on the number of layers. FAST: the rings
  // advance and fold instead of a replay.
  absl::Status Commit(const CommitArgs& args, Stream stream) const;

  // Align mode: record each request's state block and reset its accepted count.
  absl::Status RecordStateBlocks(const RecordStateBlocksArgs& args, Stream stream) const;

  // DEFERRED commits: materializes (or, with `discard`, forgets) the pending
  // tokens of the given blocks, or of every pending block. FAST: folds (or
  // empties) the blocks' rings. (EAGER: INVALID_ARGUMENT, nothing to flush.)
  absl::Status Flush(const FlushArgs& args, Stream stream) const;

  // Copies a layer's gate parameters after checking them finite on the
  // device (the destination is unchanged when they are not).
  absl::Status LoadParams(const LoadParamsArgs& args, Stream stream) const;

 protected:
  // Called with validated arguments. Each enqueues the call's kernels
  // (checks first) on `stream`, writes its DeviceStatus (and mirror) in
  // stream order, and keeps the crash bookkeeping its mode keeps (the
  // commit journal: EAGER and DEFERRED; the pending journal: DEFERRED).
  virtual absl::Status LaunchStock(const StockArgs& args, Stream stream) const = 0;
  virtual absl::Status LaunchRecordStateBlocks(const RecordStateBlocksArgs& args,
                                               Stream stream) const = 0;
  virtual absl::Status LaunchLoadParams(const LoadParamsArgs& args, Stream stream) const = 0;
  // Each commit mode's verbs: a backend forwards each to its mode's kernels
  // (kernels/eager, kernels/deferred, kernels/fast).
  virtual absl::Status LaunchEagerVerify(const VerifyArgs& args, Stream stream) const = 0;
  virtual absl::Status LaunchEagerCommit(const CommitArgs& args, Stream stream) const = 0;
  virtual absl::Status LaunchDeferredVerify(const VerifyArgs& args, Stream stream) const = 0;
  virtual absl::Status LaunchDeferredCommit(const CommitArgs& args, Stream stream) const = 0;
  virtual absl::Status LaunchDeferredFlush(const FlushArgs& args, Stream stream) const = 0;
  virtual absl::Status LaunchFastVerify(const VerifyArgs& args, Stream stream) const = 0;
  virtual absl::Status LaunchFastCommit(const CommitArgs& args, Stream stream) const = 0;
  virtual absl::Status LaunchFastFlush(const FlushArgs& args, Stream stream) const = 0;

 private:
  // kda_kernels.cc: each verb's one dispatch on args.mode, to the mode's
  // host checks and the launcher above.
  friend struct ModeDispatch;
};

// The CPU backend: host memory, runs on the calling thread.
const KdaKernels& CpuKdaKernels();

// The CUDA backend (sm_90). UNAVAILABLE when this build has no CUDA.
absl::StatusOr<const KdaKernels*> CudaKdaKernels();

// Whether this build includes the CUDA backend.
bool BuiltWithCuda();

// Copies `bytes` from device memory to pinned host memory (device-visible
// under unified addressing) on `stream`, with a kernel rather than the copy
// engine: a copy-engine operation right ahead of a stream wait delayed the
// wait's release by about 8 us on the H200 (docs/benchmarks.md, GPU timeline).
// Never synchronizes. UNAVAILABLE when this build has no CUDA.
absl::Status CopyToHostOnStream(void* host, const void* device, uint64_t bytes, Stream stream);

// Sets CUDA_MODULE_LOADING=EAGER for this process. Call it first in main(),
// before any CUDA call, in every process whose streams wait on doorbells or
// events of another process. Under lazy loading (CUDA's default since 12.2)
// the first launch of a kernel loads its module, which may synchronize the
// whole context: with a stream parked on a doorbell that the other process
// rings only after this launch returns, that is a deadlock. (Seen on the
// H200: the first ASYNC Verify of a shape never returned.)
void UseEagerCudaModuleLoading();

// Host-side validation, exposed for the service (which checks a request
// before it enqueues anything) and for tests: the checks every commit mode
// shares, then args.mode's own (kernels/<mode>/*_checks.h).
absl::Status ValidateShape(const KdaShape& shape);
absl::Status ValidateStockArgs(const StockArgs& args);
absl::Status ValidateVerifyArgs(const VerifyArgs& args);
absl::Status ValidateCommitArgs(const CommitArgs& args);
absl::Status ValidateRecordStateBlocksArgs(const RecordStateBlocksArgs& args);
absl::Status ValidateFlushArgs(const FlushArgs& args);
// DEFERRED replays a row's pending tokens and verifies its window in one
// pass: at most kMaxSpecQueryLen tokens, so Q <= kMaxSpecQueryLen / 2.
absl::Status ValidateDeferredWindow(int spec_query_len);
absl::Status ValidateLoadParamsArgs(const LoadParamsArgs& args);

}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_KDA_KERNELS_H_
