// The driver's transfer phase (SimulationOptions::transfer_every): between
// steps, a live request's block makes a round trip through a second
// specstated (the peer), as a request moved to another instance and back:
//
//   1. this service saves the block under a key (SaveBlocks);
//   2. the peer fetches the key from this service (FetchSaved: UCX reads
//      out of this service's host tier into the peer's);
//   3. the peer restores the key into one of its own blocks (its pool, not
//      only its tier: the simulator drives a session there) and saves that
//      block under a new key; the peer's block, read through its exported
//      pools, must hold exactly what this service saved (a pending block's
//      state as a Flush leaves it, which ReadState materializes into a copy
//      here; any other block's bytes);
//   4. this service drops its key, its block is overwritten with random
//      bytes (evicted), it fetches the new key back from the peer and
//      restores it into the block, which is then checked as the host-tier
//      phase checks a restored block (host_tier_phase.cc: CheckMovedBack);
//      the run goes on from it.
//
// Every key is dropped on both sides once used, so the tiers do not fill.
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/simulator/driver.h"
#include "client/simulator/host_bytes.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/text_format.h"

namespace specstate {
namespace client {
namespace simulator_internal {
namespace {

// The first field (device and mps_client aside: the peer may run on another
// GPU, in or out of MPS) where the peer's layout differs from this
// service's: FAILED_PRECONDITION naming it.
absl::Status CheckSameLayout(const v1::Layout& ours, const v1::Layout& theirs,
                             const std::string& ours_address, const std::string& peer_address) {
  const google::protobuf::Descriptor* descriptor = v1::Layout::descriptor();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* field = descriptor->field(i);
    if (field->name() == "device" || field->name() == "mps_client") continue;
    std::string a, b;
    google::protobuf::TextFormat::PrintFieldValueToString(ours, field, -1, &a);
    google::protobuf::TextFormat::PrintFieldValueToString(theirs, field, -1, &b);
    if (a == b) continue;
    return absl::FailedPreconditionError(absl::StrCat(
        "transfer_peer ", peer_address, ": its layout's ", field->name(), " is ", b, ", the ",
        "simulated service's (", ours_address, ") is ", a,
        ": the transfer phase needs two services of the same layout (device aside)"));
  }
  return absl::OkStatus();
}

// A SaveBlocks or RestoreBlocks of one entry.
v1::SaveBlocksRequest SaveOne(int32_t block, const std::string& key) {
  v1::SaveBlocksRequest save;
  v1::SaveEntry* e = save.add_entries();
  e->set_block(block);
  e->set_key(key);
  return save;
}

v1::RestoreBlocksRequest RestoreOne(const std::string& key, int32_t block) {
  v1::RestoreBlocksRequest restore;
  v1::RestoreEntry* r = restore.add_entries();
  r->set_key(key);
  r->set_block(block);
  return restore;
}

}  // namespace

absl::Status CheckTransferOptions(const SimulationOptions& options, const std::string& address) {
  if (options.transfer_every < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "transfer_every = ", options.transfer_every, " must be >= 0 (0: no transfers)"));
  }
  if (options.transfer_every == 0) {
    if (!options.transfer_peer.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "transfer_peer is ", options.transfer_peer,
          " but transfer_every is 0: give transfer_every too (a round trip every N steps)"));
    }
    if (options.corrupt_transfer_at_step >= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "corrupt_transfer_at_step = ", options.corrupt_transfer_at_step,
          " corrupts a transfer, but transfer_every is 0: there is none"));
    }
    return absl::OkStatus();
  }
  if (options.transfer_peer.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "transfer_every = ", options.transfer_every,
        " needs transfer_peer: the address of a second specstated of the same layout, with a "
        "host tier"));
  }
  if (options.transfer_peer == address) {
    return absl::InvalidArgumentError(absl::StrCat(
        "transfer_peer is the simulated service's own address (", address,
        "): transfers move blocks between two services"));
  }
  if (options.drill != nullptr) {
    return absl::InvalidArgumentError(
        "transfer_every with a restart drill: the drill's restarts lose the host tier's copies "
        "a transfer moves");
  }
  return absl::OkStatus();
}

absl::Status Driver::ConnectTransferPeer() {
  const std::string& address = options_.transfer_peer;
  const auto peer_error = [&](const absl::Status& st) {
    return absl::Status(st.code(), absl::StrCat("transfer_peer ", address, ": ", st.message()));
  };
  absl::StatusOr<std::unique_ptr<Client>> peer = Client::Connect(address);
  if (!peer.ok()) return peer_error(peer.status());
  peer_ = *std::move(peer);
  absl::StatusOr<v1::Layout> layout = peer_->GetLayout();
  if (!layout.ok()) return peer_error(layout.status());
  absl::Status st = CheckSameLayout(layout_, *layout, client_.address(), address);
  if (!st.ok()) return st;
  for (Client* c : {&client_, peer_.get()}) {
    absl::StatusOr<v1::ListSavedResponse> list = c->ListSaved();
    if (!list.ok()) {
      return absl::Status(list.status().code(),
                          absl::StrCat(c->address(), ": ", list.status().message()));
    }
    if (list->capacity() == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          c == peer_.get() ? "transfer_peer " : "the simulated service ", c->address(),
          " has no host tier: transfers move blocks between host tiers (start both services "
          "with --host_tier_bytes)"));
    }
  }
  absl::StatusOr<std::unique_ptr<Session>> session =
      peer_->OpenSession("specstatectl simulate (transfer peer)", /*drive=*/true);
  if (!session.ok()) return peer_error(session.status());
  peer_session_ = *std::move(session);
  absl::StatusOr<v1::ExportPoolsResponse> exported = peer_->ExportPools();
  if (!exported.ok()) return peer_error(exported.status());
  absl::StatusOr<std::unique_ptr<MappedPools>> pools = memory_->MapPools(*exported);
  if (!pools.ok()) return peer_error(pools.status());
  peer_pools_ = std::make_unique<ServicePools>(*memory_, *std::move(pools), d_);
  return absl::OkStatus();
}

absl::Status Driver::TransferRoundTrip(int step) {
  std::mt19937_64 rng((options_.seed ^ 0x7472616e73666572ull) * 1000003 + step);
  absl::StatusOr<MovingBlock> moving = PickMovingBlock(rng);
  if (!moving.ok()) return moving.status();
  if (moving->block <= 0) return absl::OkStatus();
  const int32_t block = moving->block;
  const int32_t peer_block = std::uniform_int_distribution<int32_t>(1, d_.B - 1)(rng);
  const std::string& peer = options_.transfer_peer;
  const std::string key = absl::StrCat("sim-transfer-step-", step, "-block-", block);
  const std::string peer_key = absl::StrCat(key, "-via-peer-block-", peer_block);

  // What this service saves: a pending block's state as a Flush would leave
  // it (ReadState materializes it into a copy and changes nothing), any
  // other block's bytes.
  std::vector<std::vector<char>> saved_states = moving->states;
  for (int l = 0; l < d_.L && moving->pending; ++l) {
    absl::StatusOr<v1::ReadStateResponse> read =
        latencies_.Time("ReadState", [&] { return client_.ReadState(l, block, /*values=*/true); });
    if (!read.ok()) return read.status();
    saved_states[l] = BytesOfValues(read->recurrent().values().data(),
                                    read->recurrent().values_size(), d_.state);
    if (static_cast<int64_t>(saved_states[l].size()) != d_.state_block_bytes) {
      return absl::InternalError(absl::StrCat(
          "ReadState of layer ", l, ", block ", block, " answered ",
          read->recurrent().values_size(), " values, not a state block of ", d_.state_block_bytes,
          " bytes"));
    }
  }

  // 1-2: saved here, fetched by the peer.
  absl::StatusOr<v1::SaveBlocksResponse> saved = latencies_.Time(
      "SaveBlocks", [&] { return session_->SaveBlocks(SaveOne(block, key)); });
  if (!saved.ok()) return saved.status();
  absl::StatusOr<v1::FetchSavedResponse> fetched = latencies_.Time(
      "FetchSaved (on the peer)", [&] { return peer_->FetchSaved(client_.address(), {key}); });
  if (!fetched.ok()) {
    return absl::Status(fetched.status().code(),
                        absl::StrCat("transfer_peer ", peer, ": FetchSaved of ", key, " from ",
                                     client_.address(), ": ", fetched.status().message()));
  }

  // 3: through the peer's pool. Its block holds noise first, so only the
  // restore can make it right.
  absl::Status st = WriteNoise(*peer_pools_, peer_block, rng);
  if (!st.ok()) return st;
  absl::StatusOr<v1::RestoreBlocksResponse> peer_restored = latencies_.Time(
      "RestoreBlocks (on the peer)",
      [&] { return peer_session_->RestoreBlocks(RestoreOne(key, peer_block)); });
  if (!peer_restored.ok()) return peer_restored.status();
  if (step == options_.corrupt_transfer_at_step) {
    st = peer_pools_->FlipStateBit(0, peer_block,
                                   phases_.corrupt_whole_block ? d_.VW * d_.K : 1,
                                   options_.corrupt_with_nan);
    if (!st.ok()) return st;
  }
  absl::StatusOr<v1::SaveBlocksResponse> peer_saved = latencies_.Time(
      "SaveBlocks (on the peer)",
      [&] { return peer_session_->SaveBlocks(SaveOne(peer_block, peer_key)); });
  if (!peer_saved.ok()) return peer_saved.status();
  std::vector<std::vector<char>> states(d_.L), convs(d_.L);
  for (int l = 0; l < d_.L; ++l) {
    st = peer_pools_->ReadState(l, peer_block, &states[l]);
    if (st.ok()) st = peer_pools_->ReadConv(l, peer_block, &convs[l]);
    if (!st.ok()) return st;
  }
  const std::string there = "a save here and the peer's fetch, restore and save";
  const std::string whose = absl::StrCat("the transfer peer's (", peer, ") ");
  CompareBlockBytes(states, saved_states, /*states=*/true, step, peer_block, whose, there);
  CompareBlockBytes(convs, moving->convs, /*states=*/false, step, peer_block, whose, there);
  absl::StatusOr<v1::DropSavedResponse> dropped =
      latencies_.Time("DropSaved (on the peer)", [&] { return peer_->DropSaved({key}); });
  if (!dropped.ok()) return dropped.status();

  // 4: dropped and evicted here, fetched back from the peer and restored.
  dropped = latencies_.Time("DropSaved", [&] { return client_.DropSaved({key}); });
  if (!dropped.ok()) return dropped.status();
  st = WriteNoise(*pools_, block, rng);
  if (!st.ok()) return st;
  fetched = latencies_.Time("FetchSaved", [&] { return client_.FetchSaved(peer, {peer_key}); });
  if (!fetched.ok()) {
    return absl::Status(fetched.status().code(),
                        absl::StrCat("FetchSaved of ", peer_key, " from the transfer_peer ", peer,
                                     ": ", fetched.status().message()));
  }
  absl::StatusOr<v1::RestoreBlocksResponse> restored = latencies_.Time(
      "RestoreBlocks", [&] { return session_->RestoreBlocks(RestoreOne(peer_key, block)); });
  if (!restored.ok()) return restored.status();
  dropped = latencies_.Time("DropSaved", [&] { return client_.DropSaved({peer_key}); });
  if (dropped.ok()) {
    dropped = latencies_.Time("DropSaved (on the peer)",
                              [&] { return peer_->DropSaved({peer_key}); });
  }
  if (!dropped.ok()) return dropped.status();
  ++report_.transfer_round_trips;
  return CheckMovedBack(*moving, step,
                        absl::StrCat("a transfer of its block to ", peer,
                                     " and back (an eviction in between)"));
}

}  // namespace simulator_internal
}  // namespace client
}  // namespace specstate
