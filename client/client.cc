#include "client/client.h"

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
  stream_ = client_->stub().Session(&stream_context_);
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

absl::Status Session::Close() {
  {
    absl::MutexLock lock(&mu_);
    if (closing_) return absl::OkStatus();
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
  }
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
      Registered{static_cast<const char*>(buffer.data()), buffer.byte_size(), name});
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
  return Call<v1::LoadLayerParamsRequest, v1::LoadLayerParamsResponse>(
             client_, &v1::SpecState::Stub::LoadLayerParams, request)
      .status();
}

absl::StatusOr<v1::VerifyResponse> Session::Verify(const v1::VerifyRequest& request) {
  return CallInSession<v1::VerifyRequest, v1::VerifyResponse>(
      client_, id_, &v1::SpecState::Stub::Verify, request);
}

absl::StatusOr<v1::BindVerifyInputsResponse> Session::BindVerifyInputs(
    const v1::BindVerifyInputsRequest& request) {
  return CallInSession<v1::BindVerifyInputsRequest, v1::BindVerifyInputsResponse>(
      client_, id_, &v1::SpecState::Stub::BindVerifyInputs, request);
}

absl::StatusOr<v1::CommitResponse> Session::Commit(const v1::CommitRequest& request) {
  return CallInSession<v1::CommitRequest, v1::CommitResponse>(
      client_, id_, &v1::SpecState::Stub::Commit, request);
}

absl::StatusOr<v1::RecordStateBlocksResponse> Session::RecordStateBlocks(
    const v1::RecordStateBlocksRequest& request) {
  return CallInSession<v1::RecordStateBlocksRequest, v1::RecordStateBlocksResponse>(
      client_, id_, &v1::SpecState::Stub::RecordStateBlocks, request);
}

absl::StatusOr<v1::FlushResponse> Session::Flush(const v1::FlushRequest& request) {
  return CallInSession<v1::FlushRequest, v1::FlushResponse>(client_, id_,
                                                             &v1::SpecState::Stub::Flush, request);
}

absl::StatusOr<v1::SubmitStepResponse> Session::SubmitStep(const v1::SubmitStepRequest& request) {
  return CallInSession<v1::SubmitStepRequest, v1::SubmitStepResponse>(
      client_, id_, &v1::SpecState::Stub::SubmitStep, request);
}

}  // namespace client
}  // namespace specstate
