// The CUDA device's submitter: Submit() queues a checked Work; one thread
// issues each on the stream (its waits, launch, signals, readbacks) and
// records the completion event that ends a batch.
#include "server/base/log.h"
#include "server/engine/phase_profile.h"

#include "server/device/cuda_device_internal.h"

namespace specstate {
namespace server {
namespace cuda_internal {
namespace {

// cudaMallocAsync'd copies of inline tensors, freed in stream order after
// the work that reads them.
class StreamScratch final : public Scratch {
 public:
  explicit StreamScratch(cudaStream_t stream) : stream_(stream) {}
  ~StreamScratch() override {
    for (void* p : buffers_) cudaFreeAsync(p, stream_);
  }
  absl::StatusOr<void*> Upload(const void* host, uint64_t bytes) override {
    void* p = nullptr;
    SPECSTATE_CUDA_RETURN(cudaMallocAsync(&p, bytes == 0 ? 4 : bytes, stream_),
                          "cudaMallocAsync for an inline tensor");
    buffers_.push_back(p);
    SPECSTATE_CUDA_RETURN(cudaMemcpyAsync(p, host, bytes, cudaMemcpyHostToDevice, stream_),
                          "cudaMemcpyAsync of an inline tensor");
    return p;
  }

 private:
  cudaStream_t stream_;
  std::vector<void*> buffers_;
};

}  // namespace

absl::Status CudaDevice::Submit(Work work) {
  bool uses_events = false;
  for (const WaitOp& w : work.waits) uses_events |= w.kind == WaitOp::Kind::kEvent;
  for (const SignalOp& s : work.signals) uses_events |= s.kind == SignalOp::Kind::kEvent;
  auto enqueued = uses_events ? std::make_shared<absl::Notification>() : nullptr;
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    if (submit_stopping_) return absl::UnavailableError("the service is shutting down");
    submit_queue_.push_back(Queued{std::move(work), std::chrono::steady_clock::now(), enqueued});
    queued_.fetch_add(1, std::memory_order_release);
    wake = submitter_sleeping_;
  }
  // A spinning submitter sees the queue itself: no futex call on the RPC path.
  if (wake) queue_cv_.notify_one();
  if (enqueued != nullptr) enqueued->WaitForNotification();
  return absl::OkStatus();
}

void CudaDevice::SubmitLoop() {
  cudaSetDevice(ordinal_);  // the submitter's own thread
  for (;;) {
    Queued item;
    const auto spin_until = std::chrono::steady_clock::now() + submit_spin_;
    while (queued_.load(std::memory_order_acquire) == 0 &&
           std::chrono::steady_clock::now() < spin_until) {
      std::this_thread::yield();
    }
    {
      std::unique_lock<std::mutex> lock(queue_mu_);
      submitter_sleeping_ = true;
      queue_cv_.wait(lock, [&] { return submit_stopping_ || !submit_queue_.empty(); });
      submitter_sleeping_ = false;
      if (submit_queue_.empty()) return;  // stopping, nothing left
      item = std::move(submit_queue_.front());
      submit_queue_.pop_front();
      queued_.fetch_sub(1, std::memory_order_relaxed);
    }
    Enqueue(std::move(item.work), item.queued);
    if (item.enqueued != nullptr) item.enqueued->Notify();
  }
}

void CudaDevice::Enqueue(Work work, std::chrono::steady_clock::time_point queued) {
  // SPECSTATE_PROFILE=1: where the submitter's time per work goes.
  static PhaseProfile profile("CUDA submit", {"waits", "launch", "signals+readbacks",
                                              "completion+bookkeeping"});
  PhaseProfile::Timer timer(profile);
  const auto t1 = std::chrono::steady_clock::now();
  absl::Status launched = absl::OkStatus();
  for (const WaitOp& wait : work.waits) {
    if (wait.cancellation != nullptr && wait.cancellation->cancelled.load()) {
      // Its session ended before the wait reached the stream: never block
      // on it, and run nothing of this call.
      launched = absl::CancelledError("a wait of this call was cancelled before its doorbell rang");
      // In stream order: the step's later calls, already queued, run nothing.
      if (wait.cancel_word != nullptr) {
        write_value32_(stream_, reinterpret_cast<CUdeviceptr>(wait.cancel_word),
                       wait.cancel_value, 0);
      }
      break;
    }
    if (wait.kind == WaitOp::Kind::kDoorbell) {
      if (wait_value32_(stream_, reinterpret_cast<CUdeviceptr>(wait.counter), wait.value,
                        CU_STREAM_WAIT_VALUE_GEQ) != CUDA_SUCCESS) {
        launched = absl::InternalError("cuStreamWaitValue32 failed");
        break;
      }
      PendingWait pending;
      pending.work_id = next_work_id_;
      pending.counter = wait.counter;
      pending.value = wait.value;
      pending.cancellation = wait.cancellation;
      pending.cancel_word = wait.cancel_word;
      pending.cancel_value = wait.cancel_value;
      {
        std::lock_guard<std::mutex> lock(mu_);
        pending_waits_.push_back(pending);
      }
      // The session may have ended between the check above and now, after
      // its release scanned pending_waits_: release this wait then.
      if (wait.cancellation != nullptr && wait.cancellation->cancelled.load()) {
        ReleaseCancelledWaits();
      }
    } else {
      launched = CudaStatus(
          cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(wait.event), 0),
          "cudaStreamWaitEvent");
      if (!launched.ok()) break;
    }
  }
  timer.Mark();
  if (launched.ok()) {
    StreamScratch scratch(stream_);
    launched = work.launch(stream_, scratch);
  }
  timer.Mark();
  const auto t2 = std::chrono::steady_clock::now();
  // Signal even after a failure: the caller's stream must not wait forever;
  // the failure reaches it through the session's next call.
  for (const SignalOp& signal : work.signals) {
    if (signal.kind == SignalOp::Kind::kDoorbell) {
      write_value32_(stream_, reinterpret_cast<CUdeviceptr>(signal.counter), signal.value, 0);
    } else {
      cudaEventRecord(static_cast<cudaEvent_t>(signal.event), stream_);
    }
  }
  // After the signals: the readbacks copy service memory (snapshots, plans)
  // for `done` only, so the caller's stream need not wait for them. By a
  // kernel: a copy-engine copy here would delay the release of the next
  // work's doorbell wait (about 8 us, H200 timeline).
  for (const Readback& r : work.readbacks) {
    const absl::Status copied = kernels::CopyToHostOnStream(r.host, r.device, r.bytes, stream_);
    if (!copied.ok() && launched.ok()) launched = copied;
  }
  timer.Mark();
  // A completion event only on the last work queued so far: the works
  // before it in a burst (a step's calls) end earlier in stream order, and
  // its event tells the reaper that all of them are done. Each
  // blocking-sync event costs the stream an interrupt and about 1.8 us
  // before the next handoff (handoff_bench, H200). At least one every
  // kMaxBatchWorks, so that a queue that never empties still has its
  // calls answered and their regions released.
  const bool ends_batch = queued_.load(std::memory_order_acquire) == 0 ||
                          ++works_since_event_ >= kMaxBatchWorks;
  if (ends_batch) works_since_event_ = 0;
  cudaEvent_t completion = nullptr;
  if (ends_batch) {
    completion = TakeEvent();
    const cudaError_t record =
        completion == nullptr ? cudaErrorMemoryAllocation : cudaEventRecord(completion, stream_);
    if (record != cudaSuccess) {
      // Nothing marks the batch's end on the stream: the reaper fails its
      // works in order, without an event (never here: Submit may be
      // waiting for this thread with the engine's lock held).
      if (completion != nullptr) ReturnEvent(completion);
      completion = nullptr;
      launched = CudaStatus(record, "recording a completion event");
      LogError(launched.ToString());
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_.push_back(InFlight{next_work_id_, completion, ends_batch,
                                  std::move(work.done), launched,
                                  std::chrono::steady_clock::now()});
    if (ends_batch) ++batch_ends_;
  }
  ++next_work_id_;
  timer.Mark();
  if (TraceEnabled()) {
    const auto us = [](auto a, auto b) {
      return std::chrono::duration<double, std::micro>(b - a).count();
    };
    const auto t3 = std::chrono::steady_clock::now();
    LogInfo(absl::StrCat("trace: submit ", next_work_id_ - 1, ": queued ", us(queued, t1),
                         " us, waits+launch ", us(t1, t2), " us, signals+readbacks+record ",
                         us(t2, t3), " us"));
  }
  cv_.notify_all();
}

void CudaDevice::ReturnEvent(cudaEvent_t e) {
  std::lock_guard<std::mutex> lock(mu_);
  free_events_.push_back(e);
}

cudaEvent_t CudaDevice::TakeEvent() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!free_events_.empty()) {
      cudaEvent_t e = free_events_.back();
      free_events_.pop_back();
      return e;
    }
  }
  cudaEvent_t e = nullptr;
  // Blocking sync: the reaper sleeps in cudaEventSynchronize instead of spinning.
  if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventBlockingSync) !=
      cudaSuccess) {
    return nullptr;
  }
  return e;
}

}  // namespace cuda_internal
}  // namespace server
}  // namespace specstate
