// The CUDA device's reaper: completes in-flight works a batch at a time once
// the batch's completion event has completed, and releases stream waits on
// doorbells of sessions that ended.
#include "server/base/log.h"

#include "server/device/cuda_device_internal.h"

namespace specstate {
namespace server {
namespace cuda_internal {

void CudaDevice::ReleaseCancelledWaits() {
  ScopedDevice scoped(ordinal_);
  std::vector<PendingWait> cancelled;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = pending_waits_.begin(); it != pending_waits_.end();) {
      if (it->cancellation != nullptr && it->cancellation->cancelled.load()) {
        cancelled.push_back(*it);
        it = pending_waits_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (const PendingWait& w : cancelled) {
    if (w.cancel_word != nullptr) {
      write_value32_(side_stream_, reinterpret_cast<CUdeviceptr>(w.cancel_word), w.cancel_value,
                     0);
    }
    write_value32_(side_stream_, reinterpret_cast<CUdeviceptr>(w.counter), w.value, 0);
  }
}

void CudaDevice::Reap() {
  cudaSetDevice(ordinal_);  // the reaper's own thread
  for (;;) {
    std::vector<InFlight> batch;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || batch_ends_ > 0; });
      if (in_flight_.empty()) return;  // stopping, nothing left
      while (!in_flight_.empty()) {
        batch.push_back(std::move(in_flight_.front()));
        in_flight_.pop_front();
        if (batch.back().ends_batch) {
          --batch_ends_;
          break;
        }
      }
    }
    // A stream blocked on a doorbell of an ended session is released by
    // ReleaseCancelledWaits(), which the service calls when the session ends.
    const InFlight& last = batch.back();
    {
      std::lock_guard<std::mutex> lock(mu_);
      reaping_since_ = batch.front().enqueued;
    }
    absl::Status batch_failure;
    if (last.completion != nullptr) {
      // The device failed while running this work (or earlier work): its
      // statuses were not copied back, so they must not be read as OK.
      const cudaError_t synced = cudaEventSynchronize(last.completion);
      batch_failure =
          CudaStatus(synced, "the device failed while running this call (cudaEventSynchronize)");
      // A kernel's fault poisons the context: every later call fails too.
      if (synced != cudaSuccess && cudaPeekAtLastError() != cudaSuccess) {
        std::lock_guard<std::mutex> lock(mu_);
        if (sticky_error_.ok()) sticky_error_ = batch_failure;
      }
    } else if (last.ends_batch) {
      // Its event could not be recorded: nothing tells when the batch ended.
      batch_failure = absl::InternalError(
          absl::StrCat("no completion event marks the end of this call on the stream: ",
                       last.launched.message()));
    }
    for (InFlight& item : batch) {
      if (!batch_failure.ok() && item.launched.ok()) {
        item.launched = batch_failure;
        LogError(item.launched.ToString());
      }
      if (TraceEnabled()) {
        LogInfo(absl::StrCat("trace: work ", item.work_id, " done ",
                             std::chrono::duration<double, std::micro>(
                                 std::chrono::steady_clock::now() - item.enqueued)
                                 .count(),
                             " us after it was enqueued"));
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (item.completion != nullptr) free_events_.push_back(item.completion);
        for (auto it = pending_waits_.begin(); it != pending_waits_.end();) {
          it = it->work_id == item.work_id ? pending_waits_.erase(it) : it + 1;
        }
      }
      if (item.done) item.done(item.launched);
    }
    std::lock_guard<std::mutex> lock(mu_);
    reaping_since_ = std::chrono::steady_clock::time_point::max();
  }
}

}  // namespace cuda_internal
}  // namespace server
}  // namespace specstate
