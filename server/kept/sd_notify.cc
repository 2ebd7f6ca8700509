#include "server/kept/sd_notify.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace specstate {
namespace server {

bool UnderSystemd() {
  const char* path = std::getenv("NOTIFY_SOCKET");
  return path != nullptr && path[0] != '\0';
}

absl::Status SdNotify(absl::string_view state, const std::vector<int>& fds) {
  const char* path = std::getenv("NOTIFY_SOCKET");
  if (path == nullptr || path[0] == '\0') {
    return absl::FailedPreconditionError("NOTIFY_SOCKET is not set: not started by systemd");
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const size_t len = std::strlen(path);
  if (len >= sizeof(addr.sun_path) || (path[0] != '/' && path[0] != '@')) {
    return absl::InvalidArgumentError(absl::StrCat("NOTIFY_SOCKET=", path, " is not a socket path"));
  }
  std::memcpy(addr.sun_path, path, len);
  if (path[0] == '@') addr.sun_path[0] = '\0';  // an abstract socket
  const socklen_t addr_len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + len);
  const int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  iovec iov{const_cast<char*>(state.data()), state.size()};
  msghdr msg{};
  msg.msg_name = &addr;
  msg.msg_namelen = addr_len;
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control;
  if (!fds.empty()) {
    control.assign(CMSG_SPACE(sizeof(int) * fds.size()), 0);
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  const ssize_t sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
  const int err = errno;
  close(fd);
  if (sent < 0) {
    return absl::UnavailableError(absl::StrCat("notifying systemd at ", path, ": ", std::strerror(err)));
  }
  return absl::OkStatus();
}

std::map<std::string, int> SdListenFds() {
  std::map<std::string, int> out;
  const char* pid = std::getenv("LISTEN_PID");
  const char* count = std::getenv("LISTEN_FDS");
  const char* names = std::getenv("LISTEN_FDNAMES");
  int64_t listen_pid = 0, n = 0;
  const bool mine = pid != nullptr && count != nullptr && absl::SimpleAtoi(pid, &listen_pid) &&
                    listen_pid == getpid() && absl::SimpleAtoi(count, &n) && n > 0 && n < 4096;
  if (mine) {
    std::vector<std::string> name_list;
    if (names != nullptr) name_list = absl::StrSplit(names, ':');
    for (int64_t i = 0; i < n; ++i) {
      const int fd = 3 + static_cast<int>(i);
      fcntl(fd, F_SETFD, FD_CLOEXEC);
      std::string name = i < static_cast<int64_t>(name_list.size()) ? name_list[i] : "unknown";
      if (out.count(name) != 0) {
        close(fd);  // a second one of a name: the first stands
        continue;
      }
      out[name] = fd;
    }
  }
  unsetenv("LISTEN_PID");
  unsetenv("LISTEN_FDS");
  unsetenv("LISTEN_FDNAMES");
  return out;
}

}  // namespace server
}  // namespace specstate
