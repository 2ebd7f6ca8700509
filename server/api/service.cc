#include "server/api/service.h"

#include <atomic>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "server/base/log.h"

namespace specstate {
namespace server {

namespace {

// What the log names a session by: its label, never its secret id.
absl::string_view SessionLabel(absl::string_view id) { return id.substr(0, id.find('-')); }

}  // namespace

grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

SpecStateService::SpecStateService(Engine* engine, const v1::ServiceConfig& config)
    : engine_(engine) {
  sessions_ = std::make_unique<SessionManager>(
      absl::Milliseconds(config.default_lease_ms() == 0 ? 10000 : config.default_lease_ms()),
      absl::Milliseconds(config.max_lease_ms() == 0 ? 600000 : config.max_lease_ms()),
      [engine](const std::string& id) { engine->OpenSession(id); },
      [this, engine](const std::string& id, SessionEnd why) {
        LogInfo(absl::StrCat("session ", SessionLabel(id),
                             why == SessionEnd::kExpired ? " lease expired" : " closed",
                             ": releasing its regions"));
        engine->EndSession(id);
        if (why == SessionEnd::kExpired) OnLeaseExpired(id);
      });
}

SpecStateService::~SpecStateService() = default;

void SpecStateService::Finish(grpc::ServerUnaryReactor* reactor, const std::string& method,
                              absl::Time start, const absl::Status& status) {
  stats_.Record(method, status.code(), absl::Now() - start);
  if (TraceEnabled()) {
    LogInfo(absl::StrCat("trace: ", method, " answered after ",
                         absl::ToDoubleMicroseconds(absl::Now() - start), " us: ",
                         status.ok() ? "OK" : status.ToString()));
  }
  reactor->Finish(ToGrpc(status));
}

grpc::ServerUnaryReactor* SpecStateService::GetLayout(grpc::CallbackServerContext* ctx,
                                                      const v1::GetLayoutRequest*,
                                                      v1::Layout* response) {
  const absl::Time start = absl::Now();
  auto* reactor = ctx->DefaultReactor();
  *response = engine_->layout();
  Finish(reactor, "GetLayout", start, absl::OkStatus());
  return reactor;
}

grpc::ServerUnaryReactor* SpecStateService::ExportPools(grpc::CallbackServerContext* ctx,
                                                        const v1::ExportPoolsRequest*,
                                                        v1::ExportPoolsResponse* response) {
  const absl::Time start = absl::Now();
  auto* reactor = ctx->DefaultReactor();
  *response = engine_->ExportPools();
  if (recovery_ != nullptr) recovery_->AddExport(response);
  Finish(reactor, "ExportPools", start, absl::OkStatus());
  return reactor;
}

grpc::ServerUnaryReactor* SpecStateService::ReadState(grpc::CallbackServerContext* ctx,
                                                      const v1::ReadStateRequest* request,
                                                      v1::ReadStateResponse* response) {
  const absl::Time start = absl::Now();
  auto* reactor = ctx->DefaultReactor();
  engine_->ReadState(*request, [this, reactor, response, start](absl::Status s,
                                                                v1::ReadStateResponse r) {
    if (s.ok()) *response = std::move(r);
    Finish(reactor, "ReadState", start, s);
  });
  return reactor;
}

grpc::ServerUnaryReactor* SpecStateService::Ping(grpc::CallbackServerContext* ctx,
                                                 const v1::PingRequest* request,
                                                 v1::PingResponse* response) {
  auto* reactor = ctx->DefaultReactor();
  response->set_payload(request->payload());
  reactor->Finish(grpc::Status::OK);  // not counted in the stats: it measures the floor
  return reactor;
}

v1::Stats SpecStateService::CollectStats() const {
  v1::Stats stats;
  const EngineCounters c = engine_->counters();
  stats.set_steps_verified(c.steps_verified);
  stats.set_steps_committed(c.steps_committed);
  stats.set_steps_failed(c.steps_failed);
  stats.set_rows_verified(c.rows_verified);
  stats.set_rows_committed(c.rows_committed);
  stats.set_tokens_verified(c.tokens_verified);
  stats.set_tokens_committed(c.tokens_committed);
  stats.set_state_bytes_saved(c.state_bytes_saved);
  stats.set_device_check_failures(c.device_check_failures);
  stats.set_sessions(sessions_->Count());
  stats.set_regions(engine_->regions().Count());
  stats.set_driver(sessions_->DriverDescription());
  stats.set_uptime_s(absl::ToDoubleSeconds(absl::Now() - started_));
  const std::string problem = HealthProblem();
  stats.set_health(problem.empty() ? "SERVING" : absl::StrCat("NOT_SERVING: ", problem));
  for (std::string& warning : engine_->Warnings()) stats.add_warnings(std::move(warning));
  if (const std::optional<HostTier::Counters> tier = engine_->HostTierCounters()) {
    v1::HostTierStats* t = stats.mutable_host_tier();
    t->set_keys(tier->keys);
    t->set_capacity(tier->capacity);
    t->set_entry_bytes(tier->entry_bytes);
    t->set_saves(tier->saves);
    t->set_restores(tier->restores);
    t->set_evictions(tier->evictions);
    t->set_drops(tier->drops);
    t->set_failed_saves(tier->failed_saves);
    t->set_sent(tier->sent);
    t->set_fetched(tier->fetched);
  }
  stats_.ToProto(&stats);
  return stats;
}

std::string SpecStateService::HealthProblem() const {
  std::string problem = engine_->HealthProblem();
  if (problem.empty() && recovery_ != nullptr) problem = recovery_->HealthProblem();
  return problem;
}

grpc::ServerUnaryReactor* SpecStateService::GetStats(grpc::CallbackServerContext* ctx,
                                                     const v1::GetStatsRequest*,
                                                     v1::Stats* response) {
  const absl::Time start = absl::Now();
  auto* reactor = ctx->DefaultReactor();
  *response = CollectStats();
  Finish(reactor, "GetStats", start, absl::OkStatus());
  return reactor;
}

// ---------------------------------------------------------------------------
// Sessions: a bidirectional stream per session. The first message opens it;
// RenewLease messages extend the lease; each gets a SessionEvent back. The
// session ends when the client half-closes, the call is cancelled (the client
// died) or the lease runs out (then the stream is finished by the service).

class SpecStateService::SessionReactor final
    : public grpc::ServerBidiReactor<v1::SessionRequest, v1::SessionEvent> {
 public:
  SessionReactor(SpecStateService* service) : service_(service) { StartRead(&request_); }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client half-closed or went away
      End(grpc::Status::OK);
      return;
    }
    absl::StatusOr<SessionInfo> info;
    if (request_.has_open()) {
      if (!id_.empty()) {
        End(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                         "this stream already opened a session; send RenewLease"));
        return;
      }
      info = service_->sessions_->Open(request_.open().client_name(), request_.open().lease_ms(),
                                       request_.open().drive());
      if (info.ok()) {
        id_ = info->id;
        LogInfo(absl::StrCat("session ", info->label, " opened by \"", info->client_name, "\"",
                             info->driving ? " (driving)" : ""));
      }
    } else if (request_.has_renew()) {
      if (id_.empty()) {
        End(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                         "the first message of a Session stream must be OpenSession"));
        return;
      }
      info = service_->sessions_->Renew(id_);
    } else {
      End(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "send OpenSession or RenewLease"));
      return;
    }
    if (!info.ok()) {
      End(ToGrpc(info.status()));
      return;
    }
    if (request_.has_open()) {
      absl::MutexLock lock(&service_->reactors_mu_);
      service_->reactors_[id_] = this;
    }
    event_.set_session_id(info->id);
    event_.set_lease_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(info->lease)));
    event_.set_driving(info->driving);
    Write();
  }

  void OnWriteDone(bool ok) override {
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
    }
    if (!ok) {
      End(grpc::Status::OK);
      return;
    }
    // Only when the lease is still live: the session may have expired while
    // the write was in flight.
    if (!service_->sessions_->CheckLive(id_).ok()) {
      End(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                       absl::StrCat("the lease of session ", id_, " ran out")));
      return;
    }
    StartRead(&request_);
  }

  void OnCancel() override { CloseSession(); }

  void OnDone() override {
    CloseSession();
    {
      absl::MutexLock lock(&service_->reactors_mu_);
      auto it = service_->reactors_.find(id_);
      if (it != service_->reactors_.end() && it->second == this) service_->reactors_.erase(it);
    }
    delete this;
  }

  // The lease ran out (the session is already closed): finish the stream,
  // unless a write is in flight (OnWriteDone then sees the session gone).
  void Expire() {
    FinishUnlessWriting(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                                     absl::StrCat("the lease of session ", id_, " ran out")));
  }

  // The service is shutting down: end the stream now rather than make the
  // server's shutdown wait for the client to close it.
  void ShutDown() {
    FinishUnlessWriting(
        grpc::Status(grpc::StatusCode::UNAVAILABLE, "specstated is shutting down"));
  }

 private:
  void End(grpc::Status status) {
    CloseSession();
    if (!finished_.exchange(true)) Finish(status);
  }

  void FinishUnlessWriting(grpc::Status status) {
    absl::MutexLock lock(&mu_);
    if (!writing_ && !finished_.exchange(true)) Finish(status);
  }

  void Write() {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    writing_ = true;
    StartWrite(&event_);
  }

  void CloseSession() {
    if (!closed_.exchange(true) && !id_.empty()) service_->sessions_->Close(id_);
  }

  SpecStateService* const service_;
  v1::SessionRequest request_;
  v1::SessionEvent event_;
  std::string id_;
  std::atomic<bool> closed_{false};
  std::atomic<bool> finished_{false};
  absl::Mutex mu_;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
};

void SpecStateService::EndAllSessions() {
  absl::MutexLock lock(&reactors_mu_);
  for (auto& [id, reactor] : reactors_) reactor->ShutDown();
}

void SpecStateService::OnLeaseExpired(const std::string& id) {
  absl::MutexLock lock(&reactors_mu_);
  auto it = reactors_.find(id);
  if (it != reactors_.end()) it->second->Expire();
}

grpc::ServerBidiReactor<v1::SessionRequest, v1::SessionEvent>* SpecStateService::Session(
    grpc::CallbackServerContext*) {
  return new SessionReactor(this);
}

// ---------------------------------------------------------------------------
// Regions.

grpc::ServerUnaryReactor* SpecStateService::RegisterRegion(grpc::CallbackServerContext* ctx,
                                                           const v1::RegisterRegionRequest* request,
                                                           v1::RegisterRegionResponse*) {
  const absl::Time start = absl::Now();
  auto* reactor = ctx->DefaultReactor();
  absl::Status st = sessions_->CheckLive(request->session_id());
  if (st.ok()) st = engine_->RegisterRegion(*request);
  if (!st.ok()) LogInfo(absl::StrCat("RegisterRegion \"", request->name(), "\": ", st.ToString()));
  Finish(reactor, "RegisterRegion", start, st);
  return reactor;
}

grpc::ServerUnaryReactor* SpecStateService::UnregisterRegion(
    grpc::CallbackServerContext* ctx, const v1::UnregisterRegionRequest* request,
    v1::UnregisterRegionResponse*) {
  const absl::Time start = absl::Now();
  auto* reactor = ctx->DefaultReactor();
  absl::Status st = sessions_->CheckLive(request->session_id());
  if (st.ok()) {
    // Finishes once no enqueued work pins the region any more.
    st = engine_->regions().Unregister(request->session_id(), request->name(),
                                       [this, reactor, start] {
                                         Finish(reactor, "UnregisterRegion", start,
                                                absl::OkStatus());
                                       });
  }
  if (!st.ok()) Finish(reactor, "UnregisterRegion", start, st);
  return reactor;
}

grpc::ServerUnaryReactor* SpecStateService::ListRegions(grpc::CallbackServerContext* ctx,
                                                        const v1::ListRegionsRequest* request,
                                                        v1::ListRegionsResponse* response) {
  const absl::Time start = absl::Now();
  auto* reactor = ctx->DefaultReactor();
  // Without a session id: every session's regions, without their ids (a
  // session id is its owner's capability).
  for (v1::RegionInfo& info : engine_->regions().List(request->session_id())) {
    if (request->session_id().empty()) {
      info.set_session_label(std::string(SessionLabel(info.session_id())));
      info.clear_session_id();
    } else {
      info.set_session_label(std::string(SessionLabel(info.session_id())));
    }
    *response->add_regions() = std::move(info);
  }
  Finish(reactor, "ListRegions", start, absl::OkStatus());
  return reactor;
}

// ---------------------------------------------------------------------------
// Driving calls.

template <typename Request, typename Response>
grpc::ServerUnaryReactor* SpecStateService::Drive(grpc::CallbackServerContext* ctx,
                                                  const char* method, const Request* request,
                                                  Response* response, EngineVerb<Request, Response> verb) {
  const absl::Time start = absl::Now();
  auto* reactor = ctx->DefaultReactor();
  absl::Status st = sessions_->CheckDriver(request->session_id());
  if (!st.ok()) {
    Finish(reactor, method, start, st);
    return reactor;
  }
  (engine_->*verb)(request->session_id(), *request,
                   [this, reactor, response, method, start](absl::Status s, Response r) {
                     *response = std::move(r);
                     Finish(reactor, method, start, s);
                   });
  return reactor;
}

grpc::ServerUnaryReactor* SpecStateService::LoadLayerParams(
    grpc::CallbackServerContext* ctx, const v1::LoadLayerParamsRequest* request,
    v1::LoadLayerParamsResponse* response) {
  return Drive(ctx, "LoadLayerParams", request, response, &Engine::LoadLayerParams);
}

grpc::ServerUnaryReactor* SpecStateService::Verify(grpc::CallbackServerContext* ctx,
                                                   const v1::VerifyRequest* request,
                                                   v1::VerifyResponse* response) {
  return Drive(ctx, "Verify", request, response, &Engine::Verify);
}

grpc::ServerUnaryReactor* SpecStateService::BindVerifyInputs(
    grpc::CallbackServerContext* ctx, const v1::BindVerifyInputsRequest* request,
    v1::BindVerifyInputsResponse* response) {
  return Drive(ctx, "BindVerifyInputs", request, response, &Engine::BindVerifyInputs);
}

grpc::ServerUnaryReactor* SpecStateService::Commit(grpc::CallbackServerContext* ctx,
                                                   const v1::CommitRequest* request,
                                                   v1::CommitResponse* response) {
  return Drive(ctx, "Commit", request, response, &Engine::Commit);
}

grpc::ServerUnaryReactor* SpecStateService::RecordStateBlocks(
    grpc::CallbackServerContext* ctx, const v1::RecordStateBlocksRequest* request,
    v1::RecordStateBlocksResponse* response) {
  return Drive(ctx, "RecordStateBlocks", request, response, &Engine::RecordStateBlocks);
}

grpc::ServerUnaryReactor* SpecStateService::Flush(grpc::CallbackServerContext* ctx,
                                                  const v1::FlushRequest* request,
                                                  v1::FlushResponse* response) {
  return Drive(ctx, "Flush", request, response, &Engine::Flush);
}

grpc::ServerUnaryReactor* SpecStateService::SubmitStep(grpc::CallbackServerContext* ctx,
                                                       const v1::SubmitStepRequest* request,
                                                       v1::SubmitStepResponse* response) {
  return Drive(ctx, "SubmitStep", request, response, &Engine::SubmitStep);
}

// ---------------------------------------------------------------------------
// The host tier.

grpc::ServerUnaryReactor* SpecStateService::SaveBlocks(grpc::CallbackServerContext* ctx,
                                                       const v1::SaveBlocksRequest* request,
                                                       v1::SaveBlocksResponse* response) {
  return Drive(ctx, "SaveBlocks", request, response, &Engine::SaveBlocks);
}

grpc::ServerUnaryReactor* SpecStateService::RestoreBlocks(grpc::CallbackServerContext* ctx,
                                                          const v1::RestoreBlocksRequest* request,
                                                          v1::RestoreBlocksResponse* response) {
  return Drive(ctx, "RestoreBlocks", request, response, &Engine::RestoreBlocks);
}

grpc::ServerUnaryReactor* SpecStateService::ListSaved(grpc::CallbackServerContext* ctx,
                                                      const v1::ListSavedRequest*,
                                                      v1::ListSavedResponse* response) {
  const absl::Time start = absl::Now();
  auto* reactor = ctx->DefaultReactor();
  *response = engine_->ListSaved();
  Finish(reactor, "ListSaved", start, absl::OkStatus());
  return reactor;
}

grpc::ServerUnaryReactor* SpecStateService::DropSaved(grpc::CallbackServerContext* ctx,
                                                      const v1::DropSavedRequest* request,
                                                      v1::DropSavedResponse* response) {
  const absl::Time start = absl::Now();
  auto* reactor = ctx->DefaultReactor();
  absl::StatusOr<v1::DropSavedResponse> dropped = engine_->DropSaved(*request);
  if (dropped.ok()) *response = *std::move(dropped);
  Finish(reactor, "DropSaved", start, dropped.status());
  return reactor;
}

grpc::ServerUnaryReactor* SpecStateService::FetchSaved(grpc::CallbackServerContext* ctx,
                                                       const v1::FetchSavedRequest* request,
                                                       v1::FetchSavedResponse* response) {
  const absl::Time start = absl::Now();
  auto* reactor = ctx->DefaultReactor();
  engine_->FetchSaved(*request, [this, reactor, response, start](absl::Status s,
                                                                 v1::FetchSavedResponse r) {
    if (s.ok()) *response = std::move(r);
    Finish(reactor, "FetchSaved", start, s);
  });
  return reactor;
}

grpc::ServerUnaryReactor* SpecStateService::ExportSaved(grpc::CallbackServerContext* ctx,
                                                        const v1::ExportSavedRequest* request,
                                                        v1::ExportSavedResponse* response) {
  const absl::Time start = absl::Now();
  auto* reactor = ctx->DefaultReactor();
  absl::StatusOr<v1::ExportSavedResponse> r = engine_->ExportSaved(*request);
  if (r.ok()) *response = *std::move(r);
  Finish(reactor, "ExportSaved", start, r.status());
  return reactor;
}

grpc::ServerUnaryReactor* SpecStateService::ReleaseSaved(grpc::CallbackServerContext* ctx,
                                                         const v1::ReleaseSavedRequest* request,
                                                         v1::ReleaseSavedResponse*) {
  const absl::Time start = absl::Now();
  auto* reactor = ctx->DefaultReactor();
  Finish(reactor, "ReleaseSaved", start, engine_->ReleaseSaved(*request));
  return reactor;
}

// ---------------------------------------------------------------------------
// Restarts.

grpc::ServerUnaryReactor* SpecStateService::Recover(grpc::CallbackServerContext* ctx,
                                                    const v1::RecoverRequest* request,
                                                    v1::RecoverResponse* response) {
  const absl::Time start = absl::Now();
  auto* reactor = ctx->DefaultReactor();
  if (recovery_ == nullptr) {
    absl::Status st = absl::OkStatus();
    if (request->verify()) {
      st = absl::FailedPreconditionError(
          "these pools keep no bookkeeping: nothing holds them across a restart (start "
          "specstated with --keeper=PATH, or under systemd with FileDescriptorStoreMax=)");
    }
    response->set_kept(false);
    response->set_pool_bytes(engine_->layout().pool_bytes());
    if (!st.ok()) {
      Finish(reactor, "Recover", start, st);
      return reactor;
    }
    // DEFERRED keeps pending tokens per block with or without a keeper.
    engine_->CountPendingBlocks([this, reactor, response, start](absl::Status s, int32_t n) {
      response->set_pending_blocks(n);
      Finish(reactor, "Recover", start, s);
    });
    return reactor;
  }
  recovery_->Recover(*request, engine_->layout(),
                     [this, reactor, response, start](absl::Status s, v1::RecoverResponse r) {
                       if (s.ok()) *response = std::move(r);
                       Finish(reactor, "Recover", start, s);
                     });
  return reactor;
}

grpc::ServerUnaryReactor* SpecStateService::MarkReprefilled(
    grpc::CallbackServerContext* ctx, const v1::MarkReprefilledRequest* request,
    v1::MarkReprefilledResponse* response) {
  const absl::Time start = absl::Now();
  auto* reactor = ctx->DefaultReactor();
  absl::Status st = sessions_->CheckDriver(request->session_id());
  if (st.ok() && recovery_ == nullptr) {
    // Nothing keeps the pools, so nothing is lost: the blocks are checked.
    st = CheckReprefilledBlocks(*request, engine_->layout().num_blocks()).status();
  }
  if (!st.ok() || recovery_ == nullptr) {
    Finish(reactor, "MarkReprefilled", start, st);
    return reactor;
  }
  recovery_->MarkReprefilled(
      *request, [this, reactor, response, start](absl::Status s, v1::MarkReprefilledResponse r) {
        if (s.ok()) *response = std::move(r);
        Finish(reactor, "MarkReprefilled", start, s);
      });
  return reactor;
}

}  // namespace server
}  // namespace specstate
