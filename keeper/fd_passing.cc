#include "keeper/fd_passing.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"

namespace specstate {
namespace keeper {
namespace {

absl::Status Errno(absl::string_view what, int err) {
  return absl::Status(err == ECONNREFUSED || err == ENOENT || err == EPIPE || err == ECONNRESET
                          ? absl::StatusCode::kUnavailable
                          : absl::StatusCode::kInternal,
                      absl::StrCat(what, ": ", std::strerror(err)));
}

absl::StatusOr<sockaddr_un> AddressOf(const std::string& path) {
  sockaddr_un addr{};
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("socket path \"", path, "\" has ", path.size(),
                                                   " bytes; Unix sockets allow 1 to ",
                                                   sizeof(addr.sun_path) - 1));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  return addr;
}

}  // namespace

absl::Status SendWithFds(int socket, absl::string_view data, const std::vector<int>& fds) {
  if (fds.size() > kMaxFds) {
    return absl::InvalidArgumentError(
        absl::StrCat(fds.size(), " descriptors in one message; at most ", kMaxFds));
  }
  if (data.size() > kMaxMessageBytes || data.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("a message of ", data.size(),
                                                   " bytes; 1 to ", kMaxMessageBytes));
  }
  iovec iov{const_cast<char*>(data.data()), data.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)];
  if (!fds.empty()) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  for (;;) {
    const ssize_t n = sendmsg(socket, &msg, MSG_NOSIGNAL);
    if (n >= 0) return absl::OkStatus();
    if (errno != EINTR) return Errno("sendmsg", errno);
  }
}

absl::StatusOr<FdMessage> ReceiveWithFds(int socket, absl::Duration timeout) {
  pollfd p{socket, POLLIN, 0};
  const int ms = timeout == absl::InfiniteDuration()
                     ? -1
                     : static_cast<int>(absl::ToInt64Milliseconds(timeout));
  int ready;
  do {
    ready = poll(&p, 1, ms);
  } while (ready < 0 && errno == EINTR);
  if (ready < 0) return Errno("poll", errno);
  if (ready == 0) {
    return absl::DeadlineExceededError(
        absl::StrCat("no message within ", absl::FormatDuration(timeout)));
  }
  std::string data(kMaxMessageBytes, '\0');
  iovec iov{data.data(), data.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)];
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n;
  do {
    n = recvmsg(socket, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return Errno("recvmsg", errno);
  FdMessage out;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      out.fds.push_back(fd);
    }
  }
  if ((msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) {
    CloseAll(&out.fds);
    return absl::DataLossError("a message or its descriptors were cut short");
  }
  if (n == 0 && out.fds.empty()) {
    return absl::UnavailableError("the other end closed the connection");
  }
  data.resize(static_cast<size_t>(n));
  out.data = std::move(data);
  return out;
}

absl::StatusOr<int> ConnectSeqpacket(const std::string& path) {
  absl::StatusOr<sockaddr_un> addr = AddressOf(path);
  if (!addr.ok()) return addr.status();
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno("socket", errno);
  if (connect(fd, reinterpret_cast<const sockaddr*>(&*addr), sizeof(*addr)) != 0) {
    const int err = errno;
    close(fd);
    return absl::UnavailableError(
        absl::StrCat("nothing answers on ", path, ": ", std::strerror(err)));
  }
  return fd;
}

absl::StatusOr<int> ListenSeqpacket(const std::string& path) {
  absl::StatusOr<sockaddr_un> addr = AddressOf(path);
  if (!addr.ok()) return addr.status();
  const size_t slash = path.rfind('/');
  const std::string dir =
      slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  struct stat st;
  if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::NotFoundError(absl::StrCat("directory ", dir, " does not exist"));
  }
  if (lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::AlreadyExistsError(absl::StrCat(path, " exists and is not a socket"));
    }
    absl::StatusOr<int> live = ConnectSeqpacket(path);
    if (live.ok()) {
      close(*live);
      return absl::AlreadyExistsError(
          absl::StrCat("another process answers on ", path, ": stop it first"));
    }
    if (unlink(path.c_str()) != 0) return Errno(absl::StrCat("removing stale ", path), errno);
  }
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno("socket", errno);
  const mode_t old_umask = umask(0077);
  const int bound = bind(fd, reinterpret_cast<const sockaddr*>(&*addr), sizeof(*addr));
  const int err = errno;
  umask(old_umask);
  if (bound != 0 || listen(fd, 16) != 0) {
    const int e = bound != 0 ? err : errno;
    close(fd);
    return Errno(absl::StrCat("listening on ", path), e);
  }
  chmod(path.c_str(), 0600);
  return fd;
}

absl::StatusOr<uid_t> PeerUid(int socket) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(socket, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return Errno("SO_PEERCRED", errno);
  }
  return cred.uid;
}

absl::StatusOr<pid_t> PeerPid(int socket) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(socket, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return Errno("SO_PEERCRED", errno);
  }
  return cred.pid;
}

bool PeerHungUp(int socket) {
  pollfd p{socket, POLLRDHUP, 0};
  if (poll(&p, 1, 0) <= 0) return false;
  return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

void CloseAll(std::vector<int>* fds) {
  for (int fd : *fds) close(fd);
  fds->clear();
}

}  // namespace keeper
}  // namespace specstate
