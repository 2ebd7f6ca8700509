// The gRPC face of the service: specstate.v1.SpecState on the callback API.
// Handlers check the caller's session, hand the request to the Engine and
// finish their reactor when the Engine replies (at once, or after the device
// finished, from a service thread): no handler blocks.
//
//   auto engine = Engine::Create(config, std::move(device)).value();
//   SpecStateService service(engine.get(), config);
//   grpc::ServerBuilder builder;
//   builder.RegisterService(&service);
#ifndef SPECSTATE_SERVER_API_SERVICE_H_
#define SPECSTATE_SERVER_API_SERVICE_H_

#include <map>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "specstate/v1/specstate.grpc.pb.h"
#include "server/engine/engine.h"
#include "server/kept/recovery.h"
#include "server/engine/sessions.h"
#include "server/api/stats.h"

namespace specstate {
namespace server {

class SpecStateService final : public v1::SpecState::CallbackService {
 public:
  SpecStateService(Engine* engine, const v1::ServiceConfig& config);
  ~SpecStateService() override;

  SessionManager& sessions() { return *sessions_; }

  // What GetStats answers: the engine's counters, sessions, regions, health
  // and the per-RPC stats, each read under its own lock. Safe from any
  // thread (the metrics exposer calls it on each scrape).
  v1::Stats CollectStats() const;

  // Finishes every session stream (UNAVAILABLE), before the server shuts down.
  void EndAllSessions();

  // Pools kept across restarts (null: none): Recover answers from it, its
  // health problem joins the engine's, ExportPools names its descriptor
  // socket. Before serving.
  void SetRecovery(Recovery* recovery) { recovery_ = recovery; }
  // Why health is NOT_SERVING ("" when serving): the engine's problem, else
  // the recovery's.
  std::string HealthProblem() const;

  grpc::ServerUnaryReactor* GetLayout(grpc::CallbackServerContext* ctx,
                                      const v1::GetLayoutRequest* request,
                                      v1::Layout* response) override;
  grpc::ServerUnaryReactor* ExportPools(grpc::CallbackServerContext* ctx,
                                        const v1::ExportPoolsRequest* request,
                                        v1::ExportPoolsResponse* response) override;
  grpc::ServerUnaryReactor* ReadState(grpc::CallbackServerContext* ctx,
                                      const v1::ReadStateRequest* request,
                                      v1::ReadStateResponse* response) override;
  grpc::ServerUnaryReactor* Ping(grpc::CallbackServerContext* ctx, const v1::PingRequest* request,
                                 v1::PingResponse* response) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* ctx,
                                     const v1::GetStatsRequest* request,
                                     v1::Stats* response) override;
  grpc::ServerBidiReactor<v1::SessionRequest, v1::SessionEvent>* Session(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* RegisterRegion(grpc::CallbackServerContext* ctx,
                                           const v1::RegisterRegionRequest* request,
                                           v1::RegisterRegionResponse* response) override;
  grpc::ServerUnaryReactor* UnregisterRegion(grpc::CallbackServerContext* ctx,
                                             const v1::UnregisterRegionRequest* request,
                                             v1::UnregisterRegionResponse* response) override;
  grpc::ServerUnaryReactor* ListRegions(grpc::CallbackServerContext* ctx,
                                        const v1::ListRegionsRequest* request,
                                        v1::ListRegionsResponse* response) override;
  grpc::ServerUnaryReactor* LoadLayerParams(grpc::CallbackServerContext* ctx,
                                            const v1::LoadLayerParamsRequest* request,
                                            v1::LoadLayerParamsResponse* response) override;
  grpc::ServerUnaryReactor* Verify(grpc::CallbackServerContext* ctx,
                                   const v1::VerifyRequest* request,
                                   v1::VerifyResponse* response) override;
  grpc::ServerUnaryReactor* BindVerifyInputs(grpc::CallbackServerContext* ctx,
                                             const v1::BindVerifyInputsRequest* request,
                                             v1::BindVerifyInputsResponse* response) override;
  grpc::ServerUnaryReactor* Commit(grpc::CallbackServerContext* ctx,
                                   const v1::CommitRequest* request,
                                   v1::CommitResponse* response) override;
  grpc::ServerUnaryReactor* RecordStateBlocks(grpc::CallbackServerContext* ctx,
                                              const v1::RecordStateBlocksRequest* request,
                                              v1::RecordStateBlocksResponse* response) override;
  grpc::ServerUnaryReactor* Flush(grpc::CallbackServerContext* ctx,
                                  const v1::FlushRequest* request,
                                  v1::FlushResponse* response) override;
  grpc::ServerUnaryReactor* SubmitStep(grpc::CallbackServerContext* ctx,
                                       const v1::SubmitStepRequest* request,
                                       v1::SubmitStepResponse* response) override;
  grpc::ServerUnaryReactor* SaveBlocks(grpc::CallbackServerContext* ctx,
                                       const v1::SaveBlocksRequest* request,
                                       v1::SaveBlocksResponse* response) override;
  grpc::ServerUnaryReactor* RestoreBlocks(grpc::CallbackServerContext* ctx,
                                          const v1::RestoreBlocksRequest* request,
                                          v1::RestoreBlocksResponse* response) override;
  grpc::ServerUnaryReactor* ListSaved(grpc::CallbackServerContext* ctx,
                                      const v1::ListSavedRequest* request,
                                      v1::ListSavedResponse* response) override;
  grpc::ServerUnaryReactor* DropSaved(grpc::CallbackServerContext* ctx,
                                      const v1::DropSavedRequest* request,
                                      v1::DropSavedResponse* response) override;
  grpc::ServerUnaryReactor* FetchSaved(grpc::CallbackServerContext* ctx,
                                       const v1::FetchSavedRequest* request,
                                       v1::FetchSavedResponse* response) override;
  grpc::ServerUnaryReactor* ExportSaved(grpc::CallbackServerContext* ctx,
                                        const v1::ExportSavedRequest* request,
                                        v1::ExportSavedResponse* response) override;
  grpc::ServerUnaryReactor* ReleaseSaved(grpc::CallbackServerContext* ctx,
                                         const v1::ReleaseSavedRequest* request,
                                         v1::ReleaseSavedResponse* response) override;
  grpc::ServerUnaryReactor* Recover(grpc::CallbackServerContext* ctx,
                                    const v1::RecoverRequest* request,
                                    v1::RecoverResponse* response) override;
  grpc::ServerUnaryReactor* MarkReprefilled(grpc::CallbackServerContext* ctx,
                                            const v1::MarkReprefilledRequest* request,
                                            v1::MarkReprefilledResponse* response) override;

 private:
  class SessionReactor;

  template <typename Request, typename Response>
  using EngineVerb = void (Engine::*)(const std::string&, const Request&, Reply<Response>);
  // The unary driving RPCs, one path: the caller must be the session's
  // driver; the engine's verb answers (Finish), exactly once.
  template <typename Request, typename Response>
  grpc::ServerUnaryReactor* Drive(grpc::CallbackServerContext* ctx, const char* method,
                                  const Request* request, Response* response,
                                  EngineVerb<Request, Response> verb);

  // Finishes `reactor` with `status` and records the call's latency.
  void Finish(grpc::ServerUnaryReactor* reactor, const std::string& method, absl::Time start,
              const absl::Status& status);

  // Finishes the stream of a session whose lease ran out.
  void OnLeaseExpired(const std::string& id);

  Engine* const engine_;
  Recovery* recovery_ = nullptr;
  RpcStatsRegistry stats_;
  absl::Mutex reactors_mu_;
  std::map<std::string, SessionReactor*> reactors_ ABSL_GUARDED_BY(reactors_mu_);
  const absl::Time started_ = absl::Now();
  std::unique_ptr<SessionManager> sessions_;
};

// absl::Status and grpc::Status share their codes.
grpc::Status ToGrpc(const absl::Status& status);

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_API_SERVICE_H_
