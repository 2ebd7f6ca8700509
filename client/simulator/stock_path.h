// The simulator's own run of the stock spec path, the reference it checks the
// service against: the stock recurrent kernel of the service's backend on the
// simulator's memory, as vLLM's stock path keeps it (1 + num_spec state blocks
// per request, reading column acc - 1 of the previous step and writing one
// state per token), on the same activations as the service. Under tensor
// parallelism it also runs the stock kernel over every head of the model
// (the TP=1 run), on the whole model's activations.
//
//   StockPath stock(*memory, *kernels, dims);
//   absl::Status st = stock.Allocate();
//   ...  // LoadParams per layer, StartRequest per new request and layer
//   st = stock.Run(proj, g, model.requests(), plan.qsl, plan.num_tokens);
//   const char* state = stock.Block(layer, slot, accepted - 1);
#ifndef SPECSTATE_CLIENT_SIMULATOR_STOCK_PATH_H_
#define SPECSTATE_CLIENT_SIMULATOR_STOCK_PATH_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/lib/shared_memory.h"
#include "client/simulator/model.h"
#include "kernels/kda_kernels.h"

namespace specstate {
namespace client {
namespace simulator_internal {

// One shared buffer per layer.
using LayerBuffers = std::vector<std::unique_ptr<SharedBuffer>>;

// The stock kernels of the service's backend. UNAVAILABLE for CUDA in a build
// without it.
absl::StatusOr<const kernels::KdaKernels*> StockKernels(v1::Backend backend);

class StockPath {
 public:
  // `memory` and `kernels` (the service's backend) must outlive this.
  StockPath(SharedMemory& memory, const kernels::KdaKernels& kernels, const Dims& dims);

  // Its memory: Q state blocks per request slot and layer, its outputs, and
  // its metadata, workspace and status; under tensor parallelism the TP=1
  // run's inputs, state blocks and outputs too.
  absl::Status Allocate();
  // The next layer's gate parameters (KDA): this rank's heads, and every
  // head for the TP=1 run.
  absl::Status LoadParams(const GateParams& params);
  // A new request's state of `layer` in its stock column 0 (and the TP=1
  // run's).
  absl::Status StartRequest(int layer, int slot, const PrefillLayer& prefill);
  // `layer`'s outputs overwritten with `poison` (as many bytes as they hold).
  absl::Status PoisonOutput(int layer, const std::vector<char>& poison);
  // Tensor parallelism: the TP=1 run's inputs of `layer` (the whole
  // model's), and its outputs poisoned.
  absl::Status WriteModelInputs(int layer, const LayerInputs& model,
                                const std::vector<char>& poison);

  // One step over every layer: row i's state blocks are its Q stock
  // columns, and it reads the state at column acc_prev - 1. `proj` and `g`
  // are the service's inputs (this rank's part). Errors of the kernels'
  // checks are returned as "the simulator's stock path: ...".
  absl::Status Run(const LayerBuffers& proj, const LayerBuffers& g,
                   const std::vector<Request>& requests, const std::vector<int32_t>& qsl,
                   int64_t num_tokens);

  // The state of `layer` in stock column `col` of request slot `slot`:
  // this rank's heads, or (tensor parallelism) the TP=1 run's every head.
  char* Block(int layer, int slot, int col) const;
  char* ModelBlock(int layer, int slot, int col) const;
  // `layer`'s outputs: this rank's [tmax, HV, K], or the TP=1 run's
  // [tmax, FHV, K].
  const SharedBuffer& Output(int layer) const { return *out_[layer]; }
  const SharedBuffer& ModelOutput(int layer) const { return *full_out_[layer]; }

 private:
  struct Part;
  struct Metadata;
  absl::StatusOr<Metadata> WriteMetadata(const std::vector<Request>& requests,
                                         const std::vector<int32_t>& qsl);
  // The stock kernel's arguments for `layer` of `part`.
  kernels::StockArgs Args(const Part& part, const Metadata& meta, int layer,
                          int64_t num_tokens) const;
  absl::Status RunPart(const Part& part, const Metadata& meta, int64_t num_tokens);
  absl::Status AllocateInto(LayerBuffers* list, uint64_t bytes);
  absl::Status AllocateParams(LayerBuffers* list, const std::vector<char>& a_log,
                              const std::vector<char>& dt_bias);

  SharedMemory& memory_;
  const kernels::KdaKernels& kernels_;
  const Dims d_;
  int64_t blocks_ = 0;  // 1 + R * Q: block 0 is the null block
  LayerBuffers pool_, out_, params_;
  // Tensor parallelism: the TP=1 run's inputs, outputs, state blocks and
  // parameters, per layer (none with one rank).
  LayerBuffers full_proj_, full_g_, full_out_, full_pool_, full_params_;
  std::unique_ptr<SharedBuffer> meta_;
};

}  // namespace simulator_internal
}  // namespace client
}  // namespace specstate

#endif  // SPECSTATE_CLIENT_SIMULATOR_STOCK_PATH_H_
