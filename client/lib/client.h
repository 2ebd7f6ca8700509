// The C++ client of specstated: what a scheduler links.
//
//   auto client = Client::Connect("unix:///tmp/specstate.sock").value();
//   v1::Layout layout = client->GetLayout().value();
//   auto session = client->OpenSession("my-scheduler", /*drive=*/true).value();
//
//   auto memory = SharedMemory::Create(layout.backend()).value();
//   auto acts = memory->Allocate(bytes).value();
//   session->RegisterBuffer("acts", *acts);                 // once
//   v1::RegionTensor q = session->Tensor(q_ptr, DType::kBFloat16, {T, H, K}).value();
//
//   v1::VerifyRequest verify;                               // fill q, k, v, ...
//   uint64_t step = session->NextStep();
//   verify.set_step(step);
//   absl::Status s = session->Verify(verify).status();      // SYNC by default
//
// Errors are absl::Status values with the server's code and message, or
// UNAVAILABLE (server down) / DEADLINE_EXCEEDED from the transport. A Session
// keeps its stream open and renews its lease from a background thread; when it
// is closed or destroyed the session ends and the server unregisters its regions.
//
// When specstated restarts (its pools kept by a keeper or systemd), a call
// fails UNAVAILABLE; Session::Resume() then reconnects, opens the session
// again and puts back what the session had set up, and returns what the
// service kept. The step that was in flight is refused afterwards
// (FAILED_PRECONDITION naming it): re-run it under a new step id.
//
//   absl::StatusOr<v1::CommitResponse> c = session->Commit(commit);
//   if (c.status().code() == absl::StatusCode::kUnavailable) {
//     v1::RecoverResponse kept = session->Resume().value();
//     // re-prefill kept.lost_blocks(); re-run the step unless it is
//     // kept.last_committed_step()
//   }
#ifndef SPECSTATE_CLIENT_LIB_CLIENT_H_
#define SPECSTATE_CLIENT_LIB_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/lib/shared_memory.h"
#include "grpcpp/grpcpp.h"
#include "kernels/dtype.h"
#include "specstate/v1/specstate.grpc.pb.h"

namespace specstate {
namespace client {

// For a scheduler's main(), before any thread starts: turns off Abseil's
// mutex deadlock detector in this process. Debian's Abseil is built without
// NDEBUG, so the detector runs on every lock, gRPC's included, and adds
// microseconds to each call (docs/benchmarks.md). specstated does the same.
void DisableMutexDeadlockDetection();

// The server's status as an absl::Status (same codes).
absl::Status FromGrpc(const grpc::Status& status);

class Session;

class Client {
 public:
  // Connects to `address`: unix:///PATH or HOST:PORT (the service's --listen
  // forms), waiting up to `timeout` for the channel to come up.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(
      const std::string& address, absl::Duration timeout = absl::Seconds(5));

  absl::StatusOr<v1::Layout> GetLayout();
  absl::StatusOr<v1::ExportPoolsResponse> ExportPools();
  absl::StatusOr<v1::ReadStateResponse> ReadState(int layer, int block, bool values);
  absl::StatusOr<v1::Stats> GetStats();
  absl::StatusOr<v1::ListRegionsResponse> ListRegions(const std::string& session_id = "");
  // What the service kept across its last restart (Recover); with `verify`,
  // its pools' bookkeeping re-checked too (specstatectl verify-pools).
  absl::StatusOr<v1::RecoverResponse> Recover(bool verify = false);
  // The host tier (any client): the saved keys, and forgetting some.
  absl::StatusOr<v1::ListSavedResponse> ListSaved();
  absl::StatusOr<v1::DropSavedResponse> DropSaved(const std::vector<std::string>& keys);
  // Transfers: `keys` saved on the service at `source` copied into this
  // service's host tier.
  absl::StatusOr<v1::FetchSavedResponse> FetchSaved(const std::string& source,
                                                    const std::vector<std::string>& keys);
  // grpc.health.v1 Check of `service` ("" = the server as a whole): the
  // status name, e.g. "SERVING".
  absl::StatusOr<std::string> Health(const std::string& service = "");

  // Opens a session; with `drive`, FAILED_PRECONDITION naming the holder when
  // another session drives.
  absl::StatusOr<std::unique_ptr<Session>> OpenSession(const std::string& client_name, bool drive,
                                                       uint32_t lease_ms = 0);

  v1::SpecState::Stub& stub() { return *stub_; }
  const std::string& address() const { return address_; }

  // Per-call deadline for unary calls (default 60 s).
  void set_deadline(absl::Duration d) { deadline_ = d; }
  absl::Duration deadline() const { return deadline_; }

 private:
  Client(std::string address, std::shared_ptr<grpc::Channel> channel);

  std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::SpecState::Stub> stub_;
  absl::Duration deadline_ = absl::Seconds(60);
};

// Tensor parallelism: one service per GPU, rank r's service holding heads
// [r*H/TP, (r+1)*H/TP) of every layer (and value heads and conv channels
// alike). Connects to `addresses[r]` for every rank r and checks that the
// services are the equal parts of one model (CheckRankLayouts): one Client
// per rank, in rank order.
//
//   auto ranks = ConnectRanks({"unix:///run/specstate/specstate-0.sock",
//                              "unix:///run/specstate/specstate-1.sock"}).value();
//   ranks[1]->GetLayout();  // rank 1's part: heads H/2 .. H-1
//
// \returns INVALID_ARGUMENT for no address or one given twice; UNAVAILABLE
//   (prefixed "rank r: ") for a service that does not answer; the first
//   error of CheckRankLayouts (FAILED_PRECONDITION).
absl::StatusOr<std::vector<std::unique_ptr<Client>>> ConnectRanks(
    const std::vector<std::string>& addresses, absl::Duration timeout = absl::Seconds(5));

// Checks the layouts of the ranks' services, layouts[r] read from
// addresses[r] (named in the errors; may be empty): every field equal to rank
// 0's but the device (heads, value heads and conv dim too: each rank holds an
// equal part; block ids are shared by the ranks, so the pools have the same
// number of blocks), and on CUDA every rank on its own device. Derived sizes
// follow from the compared fields; mps_client may differ.
//
// \returns FAILED_PRECONDITION naming the rank, its address and the field,
//   e.g. "rank 1 (unix:///b.sock): num_heads is 3, rank 0's (unix:///a.sock)
//   is 2: ..."; INVALID_ARGUMENT for no layout.
absl::Status CheckRankLayouts(const std::vector<v1::Layout>& layouts,
                              const std::vector<std::string>& addresses = {});

class Session {
 public:
  ~Session();  // Close()

  const std::string& id() const { return id_; }
  bool driving() const { return driving_; }

  // Registers `buffer` as region `name` (generated when empty), once; the
  // region cache then turns pointers into it into RegionTensors. Unregister a
  // buffer before freeing it: the service maps it until then.
  absl::StatusOr<std::string> RegisterBuffer(const SharedBuffer& buffer, std::string name = "");
  absl::Status Unregister(const std::string& name);

  // A reference to the tensor at `data` (inside a registered buffer):
  // NOT_FOUND when no registered buffer holds it. Empty strides: dense.
  absl::StatusOr<v1::RegionTensor> Tensor(const void* data, DType dtype,
                                          std::vector<int64_t> shape,
                                          std::vector<int64_t> strides = {}) const;
  // The same for an int32 index tensor.
  absl::StatusOr<v1::IndexTensor> Index(const int32_t* data, std::vector<int64_t> shape,
                                        std::vector<int64_t> strides = {}) const;

  // Step ids for the caller: increasing, unique within the session.
  uint64_t NextStep() { return ++last_step_; }

  // The driving calls, in this session: a request that already carries its
  // id (session_id()) is sent as it is, any other is copied and given it.
  absl::Status LoadLayerParams(v1::LoadLayerParamsRequest request);
  absl::StatusOr<v1::VerifyResponse> Verify(const v1::VerifyRequest& request);
  // Binds a layer's Verify tensors once; later Verify calls set bound_inputs
  // and num_tokens instead of sending them.
  absl::StatusOr<v1::BindVerifyInputsResponse> BindVerifyInputs(
      const v1::BindVerifyInputsRequest& request);
  absl::StatusOr<v1::CommitResponse> Commit(const v1::CommitRequest& request);
  absl::StatusOr<v1::RecordStateBlocksResponse> RecordStateBlocks(
      const v1::RecordStateBlocksRequest& request);
  // DEFERRED: materializes (or, with discard, forgets) blocks' pending tokens.
  absl::StatusOr<v1::FlushResponse> Flush(const v1::FlushRequest& request);
  // The host tier: blocks saved under keys, and saved keys written back.
  absl::StatusOr<v1::SaveBlocksResponse> SaveBlocks(const v1::SaveBlocksRequest& request);
  absl::StatusOr<v1::RestoreBlocksResponse> RestoreBlocks(const v1::RestoreBlocksRequest& request);
  // A step's Verify calls (and its Commit) in one round trip.
  absl::StatusOr<v1::SubmitStepResponse> SubmitStep(const v1::SubmitStepRequest& request);
  // After a restart: the scheduler re-prefilled `blocks` (Recover's
  // lost_blocks), so they are no longer reported lost (MarkReprefilled).
  // Returns the blocks still lost. OUT_OF_RANGE / INVALID_ARGUMENT naming the
  // entry and the bound; nothing changes then.
  absl::StatusOr<v1::MarkReprefilledResponse> MarkReprefilled(const std::vector<int32_t>& blocks);

  // Stops the renewal thread and closes the stream: the session ends on the
  // server, which unregisters its regions (each once no enqueued work uses
  // it). Idempotent.
  absl::Status Close();

  // Whether the lease is still being renewed (false once the server ended
  // the session or the stream broke).
  bool alive() const { return alive_.load(); }

  // After specstated restarted (a call failed UNAVAILABLE, or alive() went
  // false): waits for the service to answer again, retrying with backoff
  // (50 ms doubling to 1 s) for up to `timeout`; opens a new session with
  // this one's client name, drive flag and lease (id() changes); registers
  // every buffer registered here again under its name, and sends the last
  // LoadLayerParams and BindVerifyInputs of each layer again; step ids
  // continue. Returns what the service kept (Recover): the last committed
  // step, and the blocks lost to an interrupted Commit (re-prefill them).
  // Every step that had started here and whose Commit was not answered is
  // then refused (FAILED_PRECONDITION naming the step) without being sent:
  // re-run it from Verify under a new step id (NextStep()), unless Recover
  // says it was committed. The same for RecordStateBlocks of a step
  // committed before the restart (compute its state_idx yourself).
  // \returns DEADLINE_EXCEEDED when the service does not answer within
  //   `timeout`; the service's error when the session cannot be opened
  //   again or a registration fails (e.g. NOT_FOUND: the buffer is gone).
  absl::StatusOr<v1::RecoverResponse> Resume(absl::Duration timeout = absl::Seconds(60));

  // The steps Resume found in flight (refused from then on).
  std::vector<uint64_t> lost_steps() const;

 private:
  friend class Client;
  Session(Client* client) : client_(client) {}
  absl::Status Open(const std::string& client_name, bool drive, uint32_t lease_ms);
  void RenewLoop();
  // Stops the renewal thread and finishes the stream, whatever its state.
  absl::Status EndStream();
  // One attempt of Resume (up to `end`): Recover, a new session, its set-up.
  absl::Status ResumeOnce(absl::Time end, absl::StatusOr<v1::RecoverResponse>* kept);

  // A driving call's step bookkeeping for Resume: `started` once any call of
  // the step was sent, `done` once its Commit was answered (OK).
  absl::Status CheckStep(uint64_t step, bool record) const;
  void NoteStep(uint64_t step, const absl::Status& result, bool commit);

  struct Registered {
    const char* begin;
    uint64_t bytes;
    std::string name;
    v1::RegisterRegionRequest request;  // as sent, for Resume
  };

  Client* const client_;
  std::string id_;
  bool driving_ = false;
  absl::Duration lease_;
  bool drive_requested_ = false;
  std::unique_ptr<grpc::ClientContext> stream_context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionEvent>> stream_;
  std::thread renewer_;
  std::atomic<bool> alive_{false};
  absl::Mutex mu_;
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  mutable absl::Mutex regions_mu_;
  std::vector<Registered> regions_ ABSL_GUARDED_BY(regions_mu_);
  int next_region_ = 0;
  std::atomic<uint64_t> last_step_{0};
  // For Resume: how the session was opened, and what it set up.
  std::string client_name_;
  uint32_t lease_ms_ = 0;
  mutable absl::Mutex setup_mu_;
  std::map<int, v1::LoadLayerParamsRequest> params_ ABSL_GUARDED_BY(setup_mu_);
  std::map<int, v1::BindVerifyInputsRequest> bindings_ ABSL_GUARDED_BY(setup_mu_);
  // Steps sent and not yet committed (in flight), the last committed ones,
  // and those Resume found in flight (with why they are refused).
  mutable absl::Mutex steps_mu_;
  std::set<uint64_t> open_steps_ ABSL_GUARDED_BY(steps_mu_);
  std::set<uint64_t> committed_steps_ ABSL_GUARDED_BY(steps_mu_);
  std::map<uint64_t, std::string> lost_steps_ ABSL_GUARDED_BY(steps_mu_);
  std::map<uint64_t, std::string> unrecordable_steps_ ABSL_GUARDED_BY(steps_mu_);
};

}  // namespace client
}  // namespace specstate

#endif  // SPECSTATE_CLIENT_LIB_CLIENT_H_
