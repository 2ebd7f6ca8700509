#include "server/kept/fd_server.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "keeper/fd_passing.h"
#include "server/base/log.h"

namespace specstate {
namespace server {

absl::StatusOr<std::unique_ptr<FdServer>> FdServer::Start(const std::string& path, int fd,
                                                          std::string message) {
  absl::StatusOr<int> listener = keeper::ListenSeqpacket(path);
  if (!listener.ok()) return listener.status();
  return std::unique_ptr<FdServer>(new FdServer(path, *listener, fd, std::move(message)));
}

FdServer::FdServer(std::string path, int listener, int fd, std::string message)
    : path_(std::move(path)), listener_(listener), fd_(fd), message_(std::move(message)) {
  if (pipe2(stop_, O_CLOEXEC) != 0) stop_[0] = stop_[1] = -1;
  thread_ = std::thread([this] { Serve(); });
}

FdServer::~FdServer() {
  if (stop_[1] >= 0) {
    const char c = 0;
    ssize_t ignored = write(stop_[1], &c, 1);
    (void)ignored;
  }
  thread_.join();
  close(listener_);
  if (stop_[0] >= 0) close(stop_[0]);
  if (stop_[1] >= 0) close(stop_[1]);
  unlink(path_.c_str());
}

void FdServer::Serve() {
  for (;;) {
    pollfd p[2] = {{listener_, POLLIN, 0}, {stop_[0], POLLIN, 0}};
    if (poll(p, stop_[0] >= 0 ? 2 : 1, 1000) < 0 && errno != EINTR) return;
    if ((p[1].revents & POLLIN) != 0) return;
    if ((p[0].revents & POLLIN) == 0) continue;
    const int c = accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0) continue;
    absl::StatusOr<uid_t> uid = keeper::PeerUid(c);
    if (uid.ok() && (*uid == getuid() || *uid == 0)) {
      absl::Status sent = keeper::SendWithFds(c, message_, {fd_});
      if (!sent.ok()) LogError(absl::StrCat("pools descriptor on ", path_, ": ", sent.message()));
    } else {
      LogError(absl::StrCat("pools descriptor on ", path_, ": refused another user"));
    }
    close(c);
  }
}

}  // namespace server
}  // namespace specstate
