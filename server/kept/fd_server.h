// Hands one file descriptor to every process of this user that connects to
// a Unix socket (SOCK_SEQPACKET, mode 0600; the descriptor travels with
// SCM_RIGHTS): ExportPoolsResponse.pools_fd_socket, through which clients
// import CUDA kept pools (a cuMemCreate allocation).
//
//   auto server = FdServer::Start("/run/specstate/specstate.sock.pools", fd, "pools 1073741824");
#ifndef SPECSTATE_SERVER_KEPT_FD_SERVER_H_
#define SPECSTATE_SERVER_KEPT_FD_SERVER_H_

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace specstate {
namespace server {

class FdServer {
 public:
  // Serves `fd` (not taken over: it must outlive the server) with `message`.
  static absl::StatusOr<std::unique_ptr<FdServer>> Start(const std::string& path, int fd,
                                                         std::string message);
  ~FdServer();  // stops serving and removes the socket

  const std::string& path() const { return path_; }

 private:
  FdServer(std::string path, int listener, int fd, std::string message);
  void Serve();

  std::string path_;
  int listener_;
  int fd_;
  std::string message_;
  int stop_[2] = {-1, -1};
  std::thread thread_;
};

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_KEPT_FD_SERVER_H_
