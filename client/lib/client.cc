#include "client/lib/client.h"

#include <algorithm>
#include <chrono>
#include <functional>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace specstate {
namespace client {

void DisableMutexDeadlockDetection() {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
}

absl::Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

namespace {

void SetDeadline(grpc::ClientContext* ctx, absl::Duration d) {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::microseconds(absl::ToInt64Microseconds(d)));
}

template <typename Request, typename Response, typename Method>
absl::StatusOr<Response> Call(Client* client, Method method, const Request& request) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx, client->deadline());
  Response response;
  grpc::Status st = (client->stub().*method)(&ctx, request, &response);
  if (!st.ok()) return FromGrpc(st);
  return response;
}

// A driving call in session `id`: the caller's request itself when it
// already names the session (a scheduler that keeps one request per layer
// and changes only its step copies nothing), else a copy that does.
template <typename Request, typename Response, typename Method>
absl::StatusOr<Response> CallInSession(Client* client, const std::string& id, Method method,
                                       const Request& request) {
  if (request.session_id() == id) return Call<Request, Response>(client, method, request);
  Request named = request;
  named.set_session_id(id);
  return Call<Request, Response>(client, method, named);
}

}  // namespace

Client::Client(std::string address, std::shared_ptr<grpc::Channel> channel)
    : address_(std::move(address)),
      channel_(std::move(channel)),
      stub_(v1::SpecState::NewStub(channel_)) {}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& address,
                                                        absl::Duration timeout) {
  if (address.empty()) return absl::InvalidArgumentError("server address is empty");
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(512 << 20);
  // A restarted specstated is found again within a second (gRPC's default
  // reconnect backoff starts at 1 s and grows to 120 s).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  // A connection of its own: a channel that shared another's (gRPC's global
  // subchannel pool) would inherit a connection to a specstated that has
  // died and been restarted, and fail its first call.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  auto channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  const auto deadline = std::chrono::system_clock::now() +
                        std::chrono::microseconds(absl::ToInt64Microseconds(timeout));
  if (!channel->WaitForConnected(deadline)) {
    return absl::UnavailableError(absl::StrCat("cannot connect to specstated at ", address,
                                               " within ", absl::FormatDuration(timeout),
                                               " (is it running? see specstated --listen)"));
  }
  return std::unique_ptr<Client>(new Client(address, std::move(channel)));
}

absl::StatusOr<v1::Layout> Client::GetLayout() {
  return Call<v1::GetLayoutRequest, v1::Layout>(this, &v1::SpecState::Stub::GetLayout, {});
}

absl::StatusOr<v1::ExportPoolsResponse> Client::ExportPools() {
  return Call<v1::ExportPoolsRequest, v1::ExportPoolsResponse>(
      this, &v1::SpecState::Stub::ExportPools, {});
}

absl::StatusOr<v1::ReadStateResponse> Client::ReadState(int layer, int block, bool values) {
  v1::ReadStateRequest r;
  r.set_layer(layer);
  r.set_block(block);
  r.set_values(values);
  return Call<v1::ReadStateRequest, v1::ReadStateResponse>(this, &v1::SpecState::Stub::ReadState,
                                                           r);
}

absl::StatusOr<v1::Stats> Client::GetStats() {
  return Call<v1::GetStatsRequest, v1::Stats>(this, &v1::SpecState::Stub::GetStats, {});
}

absl::StatusOr<v1::ListRegionsResponse> Client::ListRegions(const std::string& session_id) {
  v1::ListRegionsRequest r;
  r.set_session_id(session_id);
  return Call<v1::ListRegionsRequest, v1::ListRegionsResponse>(
      this, &v1::SpecState::Stub::ListRegions, r);
}

absl::StatusOr<v1::RecoverResponse> Client::Recover(bool verify) {
  v1::RecoverRequest r;
  r.set_verify(verify);
  return Call<v1::RecoverRequest, v1::RecoverResponse>(this, &v1::SpecState::Stub::Recover, r);
}

absl::StatusOr<v1::ListSavedResponse> Client::ListSaved() {
  return Call<v1::ListSavedRequest, v1::ListSavedResponse>(this, &v1::SpecState::Stub::ListSaved,
                                                           {});
}

absl::StatusOr<v1::DropSavedResponse> Client::DropSaved(const std::vector<std::string>& keys) {
  v1::DropSavedRequest r;
  for (const std::string& key : keys) r.add_keys(key);
  return Call<v1::DropSavedRequest, v1::DropSavedResponse>(this, &v1::SpecState::Stub::DropSaved,
                                                           r);
}

absl::StatusOr<v1::FetchSavedResponse> Client::FetchSaved(const std::string& source,
                                                          const std::vector<std::string>& keys) {
  v1::FetchSavedRequest r;
  r.set_source(source);
  for (const std::string& key : keys) r.add_keys(key);
  return Call<v1::FetchSavedRequest, v1::FetchSavedResponse>(this, &v1::SpecState::Stub::FetchSaved,
                                                             r);
}

absl::StatusOr<std::string> Client::Health(const std::string& service) {
  auto health = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext ctx;
  SetDeadline(&ctx, deadline_);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status st = health->Check(&ctx, request, &response);
  if (!st.ok()) return FromGrpc(st);
  return grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status());
}

absl::StatusOr<std::unique_ptr<Session>> Client::OpenSession(const std::string& client_name,
                                                             bool drive, uint32_t lease_ms) {
  std::unique_ptr<Session> session(new Session(this));
  absl::Status st = session->Open(client_name, drive, lease_ms);
  if (!st.ok()) return st;
  return session;
}


// ---------------------------------------------------------------------------
// Tensor parallelism.

namespace {

// What must be equal across the ranks, each as its text in an error.
struct RankField {
  const char* name;
  std::function<std::string(const v1::Layout&)> value;
};

const std::vector<RankField>& RankFields() {
  static const auto* const fields = new std::vector<RankField>{
      {"backend", [](const v1::Layout& l) { return v1::Backend_Name(l.backend()); }},
      {"layer_kind", [](const v1::Layout& l) { return v1::LayerKind_Name(l.layer_kind()); }},
      {"kda_gate", [](const v1::Layout& l) { return v1::KdaGate_Name(l.kda_gate()); }},
      {"num_layers", [](const v1::Layout& l) { return absl::StrCat(l.num_layers()); }},
      {"num_heads", [](const v1::Layout& l) { return absl::StrCat(l.num_heads()); }},
      // 0 means as many as heads: compared as the number it stands for.
      {"num_value_heads",
       [](const v1::Layout& l) {
         return absl::StrCat(l.num_value_heads() > 0 ? l.num_value_heads() : l.num_heads());
       }},
      {"head_dim", [](const v1::Layout& l) { return absl::StrCat(l.head_dim()); }},
      {"conv_dim", [](const v1::Layout& l) { return absl::StrCat(l.conv_dim()); }},
      {"conv_kernel", [](const v1::Layout& l) { return absl::StrCat(l.conv_kernel()); }},
      {"num_spec", [](const v1::Layout& l) { return absl::StrCat(l.num_spec()); }},
      {"num_blocks", [](const v1::Layout& l) { return absl::StrCat(l.num_blocks()); }},
      {"max_rows", [](const v1::Layout& l) { return absl::StrCat(l.max_rows()); }},
      {"activation_dtype", [](const v1::Layout& l) { return v1::DType_Name(l.activation_dtype()); }},
      {"state_dtype", [](const v1::Layout& l) { return v1::DType_Name(l.state_dtype()); }},
      {"cache_mode", [](const v1::Layout& l) { return v1::CacheMode_Name(l.cache_mode()); }},
      {"commit_mode", [](const v1::Layout& l) { return v1::CommitMode_Name(l.commit_mode()); }},
      {"mamba_block_size", [](const v1::Layout& l) { return absl::StrCat(l.mamba_block_size()); }},
      {"lower_bound", [](const v1::Layout& l) { return absl::StrCat(l.lower_bound()); }},
  };
  return *fields;
}

std::string RankName(int rank, const std::vector<std::string>& addresses) {
  if (rank < static_cast<int>(addresses.size()) && !addresses[rank].empty()) {
    return absl::StrCat("rank ", rank, " (", addresses[rank], ")");
  }
  return absl::StrCat("rank ", rank);
}

}  // namespace

absl::Status CheckRankLayouts(const std::vector<v1::Layout>& layouts,
                              const std::vector<std::string>& addresses) {
  if (layouts.empty()) return absl::InvalidArgumentError("no ranks: give one layout per rank");
  const v1::Layout& first = layouts[0];
  for (int r = 1; r < static_cast<int>(layouts.size()); ++r) {
    for (const RankField& field : RankFields()) {
      const std::string got = field.value(layouts[r]);
      const std::string want = field.value(first);
      if (got != want) {
        return absl::FailedPreconditionError(absl::StrCat(
            RankName(r, addresses), ": ", field.name, " is ", got, ", ", RankName(0, addresses),
            "'s is ", want,
            ": under tensor parallelism every rank's service holds an equal part of one model "
            "(H/TP heads, HV/TP value heads, D/TP conv channels; every other field the same)"));
      }
    }
  }
  if (first.backend() != v1::CUDA) return absl::OkStatus();
  for (int r = 1; r < static_cast<int>(layouts.size()); ++r) {
    for (int q = 0; q < r; ++q) {
      if (layouts[r].device() == layouts[q].device()) {
        return absl::FailedPreconditionError(absl::StrCat(
            RankName(r, addresses), " and ", RankName(q, addresses), " are both on CUDA device ",
            layouts[r].device(),
            ": under tensor parallelism each rank's service runs on its own GPU (specstated "
            "--device=RANK)"));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::unique_ptr<Client>>> ConnectRanks(
    const std::vector<std::string>& addresses, absl::Duration timeout) {
  if (addresses.empty()) {
    return absl::InvalidArgumentError("no server addresses: give one per rank");
  }
  for (int r = 1; r < static_cast<int>(addresses.size()); ++r) {
    for (int q = 0; q < r; ++q) {
      if (addresses[r] == addresses[q]) {
        return absl::InvalidArgumentError(
            absl::StrCat("rank ", r, "'s address is rank ", q, "'s (", addresses[r],
                         "): each rank talks to a service of its own"));
      }
    }
  }
  std::vector<std::unique_ptr<Client>> clients;
  std::vector<v1::Layout> layouts;
  for (int r = 0; r < static_cast<int>(addresses.size()); ++r) {
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(addresses[r], timeout);
    absl::StatusOr<v1::Layout> layout =
        c.ok() ? (*c)->GetLayout() : absl::StatusOr<v1::Layout>(c.status());
    if (!layout.ok()) {
      return absl::Status(layout.status().code(),
                          absl::StrCat("rank ", r, ": ", layout.status().message()));
    }
    layouts.push_back(*std::move(layout));
    clients.push_back(*std::move(c));
  }
  absl::Status st = CheckRankLayouts(layouts, addresses);
  if (!st.ok()) return st;
  return clients;
}

// ---------------------------------------------------------------------------

absl::Status Session::Open(const std::string& client_name, bool drive, uint32_t lease_ms) {
  client_name_ = client_name;
  drive_requested_ = drive;
  lease_ms_ = lease_ms;
  stream_context_ = std::make_unique<grpc::ClientContext>();
  stream_ = client_->stub().Session(stream_context_.get());
  v1::SessionRequest open;
  open.mutable_open()->set_client_name(client_name);
  open.mutable_open()->set_drive(drive);
  open.mutable_open()->set_lease_ms(lease_ms);
  v1::SessionEvent event;
  if (!stream_->Write(open) || !stream_->Read(&event)) {
    stream_->WritesDone();
    const absl::Status refused = FromGrpc(stream_->Finish());
    stream_.reset();  // finished: Close() must not finish it again
    return refused.ok() ? absl::UnavailableError("the session stream closed at once") : refused;
  }
  id_ = event.session_id();
  driving_ = event.driving();
  lease_ = absl::Milliseconds(event.lease_ms());
  alive_ = true;
  renewer_ = std::thread([this] { RenewLoop(); });
  return absl::OkStatus();
}

void Session::RenewLoop() {
  // Renew at a third of the lease: two renewals may be late before it runs out.
  const absl::Duration period = lease_ / 3;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      auto closing = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return closing_; };
      mu_.AwaitWithTimeout(absl::Condition(&closing), period);
      if (closing_) return;
    }
    v1::SessionRequest renew;
    renew.mutable_renew();
    v1::SessionEvent event;
    if (!stream_->Write(renew) || !stream_->Read(&event)) {
      alive_ = false;
      return;
    }
  }
}

absl::Status Session::EndStream() {
  {
    absl::MutexLock lock(&mu_);
    closing_ = true;
  }
  if (renewer_.joinable()) renewer_.join();
  // Ending the session unregisters its regions on the server (each once no
  // enqueued work uses it): no call per region, and none can block here.
  absl::Status result = absl::OkStatus();
  if (stream_ != nullptr) {
    stream_->WritesDone();
    grpc::Status st = stream_->Finish();
    // DEADLINE_EXCEEDED: the lease already ran out, which ended the session too.
    if (!st.ok() && st.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) result = FromGrpc(st);
    stream_.reset();
  }
  return result;
}

absl::Status Session::Close() {
  {
    absl::MutexLock lock(&mu_);
    if (closing_) return absl::OkStatus();
  }
  absl::Status result = EndStream();
  {
    absl::MutexLock lock(&regions_mu_);
    regions_.clear();
  }
  alive_ = false;
  return result;
}

Session::~Session() { Close().IgnoreError(); }

absl::StatusOr<std::string> Session::RegisterBuffer(const SharedBuffer& buffer, std::string name) {
  if (name.empty()) name = absl::StrCat("buffer-", next_region_++);
  v1::RegisterRegionRequest request;
  request.set_session_id(id_);
  request.set_name(name);
  buffer.Describe(&request);
  grpc::ClientContext ctx;
  SetDeadline(&ctx, client_->deadline());
  v1::RegisterRegionResponse response;
  grpc::Status st = client_->stub().RegisterRegion(&ctx, request, &response);
  if (!st.ok()) return FromGrpc(st);
  absl::MutexLock lock(&regions_mu_);
  regions_.push_back(
      Registered{static_cast<const char*>(buffer.data()), buffer.byte_size(), name, request});
  return name;
}

absl::Status Session::Unregister(const std::string& name) {
  v1::UnregisterRegionRequest request;
  request.set_session_id(id_);
  request.set_name(name);
  grpc::ClientContext ctx;
  SetDeadline(&ctx, client_->deadline());
  v1::UnregisterRegionResponse response;
  grpc::Status st = client_->stub().UnregisterRegion(&ctx, request, &response);
  absl::MutexLock lock(&regions_mu_);
  for (auto it = regions_.begin(); it != regions_.end(); ++it) {
    if (it->name == name) {
      regions_.erase(it);
      break;
    }
  }
  return FromGrpc(st);
}

absl::StatusOr<v1::RegionTensor> Session::Tensor(const void* data, DType dtype,
                                                 std::vector<int64_t> shape,
                                                 std::vector<int64_t> strides) const {
  const char* p = static_cast<const char*>(data);
  absl::MutexLock lock(&regions_mu_);
  // Newest first: a buffer freed and reallocated at the same address is
  // registered again, and the new registration is the one that holds it.
  for (auto it = regions_.rbegin(); it != regions_.rend(); ++it) {
    const Registered& r = *it;
    if (p >= r.begin && p < r.begin + r.bytes) {
      v1::RegionTensor t;
      t.set_region(r.name);
      t.set_offset_bytes(static_cast<uint64_t>(p - r.begin));
      switch (dtype) {
        case DType::kFloat32:
          t.set_dtype(v1::FP32);
          break;
        case DType::kFloat16:
          t.set_dtype(v1::FP16);
          break;
        case DType::kBFloat16:
          t.set_dtype(v1::BF16);
          break;
        case DType::kInt32:
          t.set_dtype(v1::INT32);
          break;
      }
      for (int64_t d : shape) t.add_shape(d);
      for (int64_t s : strides) t.add_strides(s);
      return t;
    }
  }
  return absl::NotFoundError("no registered buffer holds this tensor: RegisterBuffer it first");
}

absl::StatusOr<v1::IndexTensor> Session::Index(const int32_t* data, std::vector<int64_t> shape,
                                               std::vector<int64_t> strides) const {
  absl::StatusOr<v1::RegionTensor> t = Tensor(data, DType::kInt32, std::move(shape),
                                              std::move(strides));
  if (!t.ok()) return t.status();
  v1::IndexTensor index;
  *index.mutable_region() = *std::move(t);
  return index;
}

absl::Status Session::LoadLayerParams(v1::LoadLayerParamsRequest request) {
  request.set_session_id(id_);
  absl::Status st = Call<v1::LoadLayerParamsRequest, v1::LoadLayerParamsResponse>(
                        client_, &v1::SpecState::Stub::LoadLayerParams, request)
                        .status();
  if (st.ok()) {
    absl::MutexLock lock(&setup_mu_);
    params_[request.layer()] = std::move(request);
  }
  return st;
}

absl::Status Session::CheckStep(uint64_t step, bool record) const {
  absl::MutexLock lock(&steps_mu_);
  auto lost = lost_steps_.find(step);
  if (lost != lost_steps_.end()) return absl::FailedPreconditionError(lost->second);
  if (record) {
    auto unrecordable = unrecordable_steps_.find(step);
    if (unrecordable != unrecordable_steps_.end()) {
      return absl::FailedPreconditionError(unrecordable->second);
    }
  }
  return absl::OkStatus();
}

void Session::NoteStep(uint64_t step, const absl::Status& result, bool commit) {
  constexpr size_t kRemembered = 64;  // steps; a scheduler has one or two in flight
  absl::MutexLock lock(&steps_mu_);
  if (commit && result.ok()) {
    open_steps_.erase(step);
    committed_steps_.insert(step);
    while (committed_steps_.size() > kRemembered) committed_steps_.erase(committed_steps_.begin());
    return;
  }
  if (committed_steps_.count(step) != 0) return;
  open_steps_.insert(step);
  while (open_steps_.size() > kRemembered) open_steps_.erase(open_steps_.begin());
}

absl::StatusOr<v1::VerifyResponse> Session::Verify(const v1::VerifyRequest& request) {
  if (absl::Status st = CheckStep(request.step(), false); !st.ok()) return st;
  absl::StatusOr<v1::VerifyResponse> r = CallInSession<v1::VerifyRequest, v1::VerifyResponse>(
      client_, id_, &v1::SpecState::Stub::Verify, request);
  NoteStep(request.step(), r.status(), false);
  return r;
}

absl::StatusOr<v1::BindVerifyInputsResponse> Session::BindVerifyInputs(
    const v1::BindVerifyInputsRequest& request) {
  absl::StatusOr<v1::BindVerifyInputsResponse> r =
      CallInSession<v1::BindVerifyInputsRequest, v1::BindVerifyInputsResponse>(
          client_, id_, &v1::SpecState::Stub::BindVerifyInputs, request);
  if (r.ok()) {
    absl::MutexLock lock(&setup_mu_);
    bindings_[request.layer()] = request;
  }
  return r;
}

absl::StatusOr<v1::CommitResponse> Session::Commit(const v1::CommitRequest& request) {
  if (absl::Status st = CheckStep(request.step(), false); !st.ok()) return st;
  absl::StatusOr<v1::CommitResponse> r = CallInSession<v1::CommitRequest, v1::CommitResponse>(
      client_, id_, &v1::SpecState::Stub::Commit, request);
  NoteStep(request.step(), r.status(), true);
  return r;
}

absl::StatusOr<v1::RecordStateBlocksResponse> Session::RecordStateBlocks(
    const v1::RecordStateBlocksRequest& request) {
  if (absl::Status st = CheckStep(request.step(), true); !st.ok()) return st;
  return CallInSession<v1::RecordStateBlocksRequest, v1::RecordStateBlocksResponse>(
      client_, id_, &v1::SpecState::Stub::RecordStateBlocks, request);
}

absl::StatusOr<v1::FlushResponse> Session::Flush(const v1::FlushRequest& request) {
  return CallInSession<v1::FlushRequest, v1::FlushResponse>(client_, id_,
                                                             &v1::SpecState::Stub::Flush, request);
}

absl::StatusOr<v1::SaveBlocksResponse> Session::SaveBlocks(const v1::SaveBlocksRequest& request) {
  return CallInSession<v1::SaveBlocksRequest, v1::SaveBlocksResponse>(
      client_, id_, &v1::SpecState::Stub::SaveBlocks, request);
}

absl::StatusOr<v1::RestoreBlocksResponse> Session::RestoreBlocks(
    const v1::RestoreBlocksRequest& request) {
  return CallInSession<v1::RestoreBlocksRequest, v1::RestoreBlocksResponse>(
      client_, id_, &v1::SpecState::Stub::RestoreBlocks, request);
}

absl::StatusOr<v1::MarkReprefilledResponse> Session::MarkReprefilled(
    const std::vector<int32_t>& blocks) {
  v1::MarkReprefilledRequest request;
  request.set_session_id(id_);
  request.mutable_blocks()->Add(blocks.begin(), blocks.end());
  return CallInSession<v1::MarkReprefilledRequest, v1::MarkReprefilledResponse>(
      client_, id_, &v1::SpecState::Stub::MarkReprefilled, request);
}

absl::StatusOr<v1::SubmitStepResponse> Session::SubmitStep(const v1::SubmitStepRequest& request) {
  const bool has_step = request.verifies_size() > 0 || request.has_commit();
  const uint64_t step =
      request.verifies_size() > 0 ? request.verifies(0).step() : request.commit().step();
  if (has_step) {
    if (absl::Status st = CheckStep(step, false); !st.ok()) return st;
  }
  absl::StatusOr<v1::SubmitStepResponse> r =
      CallInSession<v1::SubmitStepRequest, v1::SubmitStepResponse>(
          client_, id_, &v1::SpecState::Stub::SubmitStep, request);
  if (has_step) NoteStep(step, r.status(), request.has_commit());
  return r;
}

std::vector<uint64_t> Session::lost_steps() const {
  absl::MutexLock lock(&steps_mu_);
  std::vector<uint64_t> out;
  for (const auto& [step, why] : lost_steps_) out.push_back(step);
  return out;
}

absl::Status Session::ResumeOnce(absl::Time end, absl::StatusOr<v1::RecoverResponse>* kept) {
  EndStream().IgnoreError();  // the old stream broke with the old service
  {
    grpc::ClientContext ctx;
    ctx.set_wait_for_ready(true);
    SetDeadline(&ctx, std::max(absl::Milliseconds(1),
                               std::min(absl::Seconds(1), end - absl::Now())));
    v1::RecoverResponse response;
    grpc::Status st = client_->stub().Recover(&ctx, v1::RecoverRequest(), &response);
    if (!st.ok()) return FromGrpc(st);
    *kept = std::move(response);
  }
  {
    absl::MutexLock lock(&mu_);
    closing_ = false;
  }
  absl::Status st = Open(client_name_, drive_requested_, lease_ms_);
  if (!st.ok()) return st;
  std::vector<Registered> regions;
  {
    absl::MutexLock lock(&regions_mu_);
    regions = regions_;
  }
  for (Registered& r : regions) {
    r.request.set_session_id(id_);
    grpc::ClientContext ctx;
    SetDeadline(&ctx, client_->deadline());
    v1::RegisterRegionResponse response;
    grpc::Status registered = client_->stub().RegisterRegion(&ctx, r.request, &response);
    if (!registered.ok()) {
      const absl::Status failed = FromGrpc(registered);
      return absl::Status(failed.code(), absl::StrCat("registering region \"", r.name,
                                                      "\" again: ", failed.message()));
    }
  }
  std::map<int, v1::LoadLayerParamsRequest> params;
  std::map<int, v1::BindVerifyInputsRequest> bindings;
  {
    absl::MutexLock lock(&setup_mu_);
    params = params_;
    bindings = bindings_;
  }
  for (auto& [layer, request] : params) {
    st = LoadLayerParams(request);
    if (!st.ok()) {
      return absl::Status(st.code(), absl::StrCat("LoadLayerParams of layer ", layer,
                                                  " again: ", st.message()));
    }
  }
  for (auto& [layer, request] : bindings) {
    absl::StatusOr<v1::BindVerifyInputsResponse> bound = BindVerifyInputs(request);
    if (!bound.ok()) {
      return absl::Status(bound.status().code(),
                          absl::StrCat("BindVerifyInputs of layer ", layer, " again: ",
                                       bound.status().message()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::RecoverResponse> Session::Resume(absl::Duration timeout) {
  // Every attempt: what the service kept, a new session, its set-up again.
  // A connection that died with the old service fails a call once
  // (UNAVAILABLE); the attempt is then made again, with backoff.
  const absl::Time end = absl::Now() + timeout;
  absl::Duration pause = absl::Milliseconds(50);
  absl::StatusOr<v1::RecoverResponse> kept;
  for (;;) {
    absl::Status attempt = ResumeOnce(end, &kept);
    if (attempt.ok()) break;
    if (attempt.code() != absl::StatusCode::kUnavailable &&
        attempt.code() != absl::StatusCode::kDeadlineExceeded) {
      return attempt;
    }
    if (absl::Now() + pause >= end) {
      return absl::DeadlineExceededError(
          absl::StrCat("specstated at ", client_->address(), " did not answer again within ",
                       absl::FormatDuration(timeout), " (last: ", attempt.message(), ")"));
    }
    absl::SleepFor(pause);
    pause = std::min(pause * 2, absl::Seconds(1));
  }
  absl::MutexLock lock(&steps_mu_);
  for (uint64_t step : open_steps_) {
    std::string why;
    if (!kept->kept()) {
      why = absl::StrCat("step ", step, " was in flight when specstated restarted without its "
                         "pools (nothing kept them): every state is gone; re-prefill every "
                         "request");
    } else if (kept->interrupted() && kept->interrupted_step() == step) {
      why = absl::StrCat("step ", step, "'s Commit was interrupted when specstated restarted: ",
                         kept->lost_blocks_size(), " blocks are lost (Recover's lost_blocks: "
                         "re-prefill them), nothing else of it was committed; re-run it from "
                         "Verify under a new step id");
    } else if (kept->last_committed_step() == step && step != 0) {
      why = absl::StrCat("step ", step, " was committed before specstated restarted (Recover: "
                         "last committed step ", step, ") but the answer was lost; its records "
                         "did not survive: go on with the next step");
    } else {
      why = absl::StrCat("step ", step, " was in flight when specstated restarted (the last "
                         "committed step is ", kept->last_committed_step(), "): nothing of it "
                         "was committed and its Verify records did not survive; re-run it from "
                         "Verify under a new step id");
    }
    lost_steps_[step] = why;
  }
  for (uint64_t step : committed_steps_) {
    unrecordable_steps_[step] = absl::StrCat(
        "step ", step, " was committed before specstated restarted; its RecordStateBlocks "
        "cannot run in the new session (the step's records are gone): compute state_idx from "
        "the block table");
  }
  open_steps_.clear();
  committed_steps_.clear();
  return kept;
}

}  // namespace client
}  // namespace specstate
