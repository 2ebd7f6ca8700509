#include "keeper/keeper_client.h"

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "keeper/fd_passing.h"

namespace specstate {
namespace keeper {

absl::StatusOr<std::unique_ptr<KeeperClient>> KeeperClient::Connect(const std::string& path) {
  absl::StatusOr<int> socket = ConnectSeqpacket(path);
  if (!socket.ok()) {
    return absl::UnavailableError(absl::StrCat("no specstate-keeper answers on ", path, " (",
                                               socket.status().message(), ")"));
  }
  return std::unique_ptr<KeeperClient>(new KeeperClient(path, *socket));
}

KeeperClient::~KeeperClient() { close(socket_); }

absl::StatusOr<FdMessage> KeeperClient::Call(const std::string& request,
                                             const std::vector<int>& fds) {
  absl::Status sent = SendWithFds(socket_, request, fds);
  absl::StatusOr<FdMessage> reply =
      sent.ok() ? ReceiveWithFds(socket_, timeout_) : absl::StatusOr<FdMessage>(sent);
  if (!reply.ok()) {
    return absl::Status(reply.status().code(), absl::StrCat("the keeper on ", path_, ": ",
                                                            reply.status().message()));
  }
  if (reply->data.empty() || reply->data[0] == kError) {
    CloseAll(&reply->fds);
    return absl::FailedPreconditionError(absl::StrCat(
        "the keeper on ", path_, " refused: ",
        reply->data.empty() ? std::string("(no reason)") : reply->data.substr(1)));
  }
  return reply;
}

absl::StatusOr<Held> KeeperClient::Get() {
  absl::StatusOr<FdMessage> reply = Call(std::string(1, kGet), {});
  if (!reply.ok()) return reply.status();
  Held held;
  if (reply->data[0] == kEmpty) {
    CloseAll(&reply->fds);
    return held;
  }
  if (reply->data[0] != kHeld) {
    CloseAll(&reply->fds);
    return absl::DataLossError(absl::StrCat("the keeper on ", path_, " answered '",
                                            reply->data.substr(0, 1), "' to a Get"));
  }
  held.meta = reply->data.substr(1);
  held.fds = std::move(reply->fds);
  return held;
}

absl::Status KeeperClient::Put(const std::string& meta, const std::vector<int>& fds) {
  absl::StatusOr<FdMessage> reply = Call(std::string(1, kPut) + meta, fds);
  if (!reply.ok()) return reply.status();
  CloseAll(&reply->fds);
  return absl::OkStatus();
}

absl::Status KeeperClient::Drop() {
  absl::StatusOr<FdMessage> reply = Call(std::string(1, kDrop), {});
  if (!reply.ok()) return reply.status();
  CloseAll(&reply->fds);
  return absl::OkStatus();
}

bool KeeperClient::HungUp() const { return PeerHungUp(socket_); }

}  // namespace keeper
}  // namespace specstate
