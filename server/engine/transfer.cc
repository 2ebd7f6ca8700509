// Transfers between instances: FetchSaved (the destination) reads saved
// keys out of another service's host tier into its own with UCX
// (server/transfer/ucx_transport.h), after that service's ExportSaved has
// held them and said where they are; ReleaseSaved tells it the reads are
// done. Bit for bit: a saved block's bytes are read as they are.
#include <grpcpp/grpcpp.h>

#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/base/log.h"
#include "server/engine/engine.h"
#include "specstate/v1/specstate.grpc.pb.h"

namespace specstate {
namespace server {
namespace {

// An export not released is released after this (a reader that died).
constexpr absl::Duration kExportLease = absl::Seconds(60);
// How long a fetch's reads may take.
constexpr absl::Duration kReadTimeout = absl::Seconds(60);

absl::Status FromGrpc(const grpc::Status& s, absl::string_view what) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(what, ": ", s.error_message()));
}

absl::Status CheckKeys(const std::vector<std::string>& keys, int capacity) {
  if (keys.empty() || static_cast<int64_t>(keys.size()) > capacity) {
    return absl::InvalidArgumentError(absl::StrCat("keys has ", keys.size(),
                                                   " entries: 1 to the host tier's capacity, ",
                                                   capacity));
  }
  return HostTier::ValidateKeys(keys, "keys", "");
}

}  // namespace

absl::StatusOr<UcxTransport*> Engine::Transport() {
  if (transport_ == nullptr) {
    absl::StatusOr<std::unique_ptr<UcxTransport>> t =
        UcxTransport::Create(host_tier_->SlotData(0), host_tier_->arena_bytes());
    if (!t.ok()) return t.status();
    transport_ = *std::move(t);
  }
  return transport_.get();
}

void Engine::ExpireExports() {
  const absl::Time now = absl::Now();
  for (auto it = exports_.begin(); it != exports_.end();) {
    if (it->second.expires > now) {
      ++it;
      continue;
    }
    LogInfo(absl::StrCat("export ", it->first, " was not released in ",
                         absl::FormatDuration(kExportLease), ": its blocks are free again"));
    host_tier_->EndRestore(it->second.ticket, /*copied=*/false, /*send=*/true);
    it = exports_.erase(it);
  }
  if (transport_ != nullptr) transport_->SetServing(!exports_.empty());
}

absl::StatusOr<v1::ExportSavedResponse> Engine::ExportSaved(const v1::ExportSavedRequest& req) {
  if (host_tier_ == nullptr) return NoHostTier();
  const std::vector<std::string> keys(req.keys().begin(), req.keys().end());
  if (absl::Status st = CheckKeys(keys, host_tier_->capacity()); !st.ok()) return st;
  absl::MutexLock lock(&transfer_mu_);
  ExpireExports();
  absl::StatusOr<UcxTransport*> transport = Transport();
  if (!transport.ok()) return transport.status();
  absl::StatusOr<HostTier::Ticket> ticket = host_tier_->BeginRestore(keys, /*send=*/true);
  if (!ticket.ok()) return ticket.status();
  const uint64_t id = next_export_++;
  exports_[id] = Export{*ticket, absl::Now() + kExportLease};
  (*transport)->SetServing(true);
  v1::ExportSavedResponse out;
  out.set_export_id(id);
  out.set_worker_address((*transport)->worker_address());
  out.set_remote_key((*transport)->remote_key());
  for (size_t i = 0; i < keys.size(); ++i) {
    v1::ExportedBlock* b = out.add_blocks();
    b->set_key(keys[i]);
    b->set_address(reinterpret_cast<uint64_t>(host_tier_->SlotData(ticket->slots[i])));
  }
  *out.mutable_layout() = layout_;
  return out;
}

absl::Status Engine::ReleaseSaved(const v1::ReleaseSavedRequest& req) {
  if (host_tier_ == nullptr) return NoHostTier();
  absl::MutexLock lock(&transfer_mu_);
  auto it = exports_.find(req.export_id());
  if (it == exports_.end()) {
    return absl::NotFoundError(absl::StrCat("export_id ", req.export_id(),
                                            " is not held: released already, or after ",
                                            absl::FormatDuration(kExportLease)));
  }
  host_tier_->EndRestore(it->second.ticket, req.completed(), /*send=*/true);
  exports_.erase(it);
  if (transport_ != nullptr) transport_->SetServing(!exports_.empty());
  return absl::OkStatus();
}

void Engine::FetchSaved(const v1::FetchSavedRequest& req, Reply<v1::FetchSavedResponse> reply) {
  if (host_tier_ == nullptr) return reply(NoHostTier(), {});
  if (req.source().empty()) {
    return reply(absl::InvalidArgumentError("source is empty: the source service's address"), {});
  }
  const std::vector<std::string> keys(req.keys().begin(), req.keys().end());
  if (absl::Status st = CheckKeys(keys, host_tier_->capacity()); !st.ok()) return reply(st, {});
  // The reads take a while: on a thread of their own, not the RPC's. (The
  // server's shutdown waits for this call's answer.)
  std::thread([this, req, reply] {
    absl::StatusOr<v1::FetchSavedResponse> r = FetchSavedNow(req);
    reply(r.status(), r.ok() ? *std::move(r) : v1::FetchSavedResponse());
  }).detach();
}

absl::StatusOr<v1::FetchSavedResponse> Engine::FetchSavedNow(const v1::FetchSavedRequest& req) {
  const absl::Time start = absl::Now();
  const std::vector<std::string> keys(req.keys().begin(), req.keys().end());
  const std::string where = absl::StrCat("the source ", req.source());
  std::unique_ptr<v1::SpecState::Stub> source =
      v1::SpecState::NewStub(grpc::CreateChannel(req.source(), grpc::InsecureChannelCredentials()));
  v1::ExportSavedRequest ask;
  for (const std::string& key : keys) ask.add_keys(key);
  v1::ExportSavedResponse exported;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    absl::Status st = FromGrpc(source->ExportSaved(&ctx, ask, &exported), where);
    if (!st.ok()) return st;
  }
  // Whatever happens here, the source is told (it holds the blocks).
  const auto release = [&](bool completed) {
    v1::ReleaseSavedRequest r;
    r.set_export_id(exported.export_id());
    r.set_completed(completed);
    v1::ReleaseSavedResponse ignored;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    absl::Status st = FromGrpc(source->ReleaseSaved(&ctx, r, &ignored), where);
    if (!st.ok()) LogError(absl::StrCat("releasing export ", exported.export_id(), ": ", st.message()));
  };
  const v1::Layout& theirs = exported.layout();
  if (theirs.num_layers() != layout_.num_layers() ||
      theirs.state_block_bytes() != layout_.state_block_bytes() ||
      theirs.conv_block_bytes() != layout_.conv_block_bytes() ||
      theirs.state_dtype() != layout_.state_dtype() ||
      theirs.activation_dtype() != layout_.activation_dtype()) {
    release(false);
    return absl::FailedPreconditionError(absl::StrCat(
        where, " holds blocks of ", theirs.num_layers(), " layers x (", theirs.state_block_bytes(),
        " + ", theirs.conv_block_bytes(), ") bytes, this service ", layout_.num_layers(),
        " layers x (", layout_.state_block_bytes(), " + ", layout_.conv_block_bytes(),
        "): transfers need the same layout"));
  }
  if (exported.blocks_size() != static_cast<int>(keys.size())) {
    release(false);
    return absl::InternalError(absl::StrCat(where, " exported ", exported.blocks_size(),
                                            " blocks for ", keys.size(), " keys"));
  }
  std::vector<std::string> evicted;
  absl::StatusOr<HostTier::Ticket> ticket = host_tier_->BeginSave(keys, &evicted);
  if (!ticket.ok()) {
    release(false);
    return ticket.status();
  }
  absl::StatusOr<UcxTransport*> transport;
  {
    absl::MutexLock lock(&transfer_mu_);
    transport = Transport();
  }
  absl::Status st = transport.status();
  if (st.ok()) {
    std::vector<UcxTransport::Read> reads;
    for (size_t i = 0; i < keys.size(); ++i) {
      reads.push_back(UcxTransport::Read{exported.blocks(i).address(),
                                         host_tier_->SlotData(ticket->slots[i]),
                                         host_tier_->entry_bytes()});
    }
    st = (*transport)->Get(exported.worker_address(), exported.remote_key(), reads, kReadTimeout);
  }
  host_tier_->EndSave(*ticket, keys, st.ok(), /*fetched=*/true);
  release(st.ok());
  if (!st.ok()) return st;
  v1::FetchSavedResponse out;
  out.set_bytes(keys.size() * host_tier_->entry_bytes());
  for (const std::string& key : evicted) out.add_evicted(key);
  out.set_seconds(absl::ToDoubleSeconds(absl::Now() - start));
  return out;
}

}  // namespace server
}  // namespace specstate
