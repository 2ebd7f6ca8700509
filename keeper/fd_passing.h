// Unix-socket plumbing shared by specstate-keeper, specstated and the
// clients: SOCK_SEQPACKET sockets (one message per send, never merged), and
// messages that carry file descriptors (SCM_RIGHTS). A descriptor sent this
// way is duplicated into the receiver; the sender keeps its own.
//
//   absl::StatusOr<int> s = ConnectSeqpacket("/run/specstate/keeper.sock");
//   absl::Status sent = SendWithFds(*s, "P...", {pools_fd, header_fd});
//   absl::StatusOr<FdMessage> reply = ReceiveWithFds(*s, absl::Seconds(5));
#ifndef SPECSTATE_KEEPER_FD_PASSING_H_
#define SPECSTATE_KEEPER_FD_PASSING_H_

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace specstate {
namespace keeper {

// The most descriptors one message carries.
inline constexpr int kMaxFds = 16;
// The longest message (bytes besides the descriptors).
inline constexpr size_t kMaxMessageBytes = 4096;

struct FdMessage {
  std::string data;
  std::vector<int> fds;  // the receiver's, O_CLOEXEC; the caller closes them
};

// Sends `data` and `fds` as one message. UNAVAILABLE when the peer is gone,
// INVALID_ARGUMENT for too many descriptors or bytes.
absl::Status SendWithFds(int socket, absl::string_view data, const std::vector<int>& fds = {});

// Receives one message, waiting at most `timeout`. UNAVAILABLE when the peer
// closed the connection, DEADLINE_EXCEEDED when nothing came, DATA_LOSS when
// the message or its descriptors were cut short (what did arrive is closed).
absl::StatusOr<FdMessage> ReceiveWithFds(int socket, absl::Duration timeout);

// A SOCK_SEQPACKET connection to the socket at `path` (O_CLOEXEC).
// UNAVAILABLE naming the path when nobody listens there.
absl::StatusOr<int> ConnectSeqpacket(const std::string& path);

// A listening SOCK_SEQPACKET socket at `path`, mode 0600. A socket file that
// nobody answers on is stale and replaced; one that answers belongs to a live
// process: ALREADY_EXISTS. NOT_FOUND for a missing directory.
absl::StatusOr<int> ListenSeqpacket(const std::string& path);

// The user id of the process at the other end of a connected Unix socket.
absl::StatusOr<uid_t> PeerUid(int socket);
// The process id of the process that connected the other end (SO_PEERCRED:
// as of connect(), in the caller's pid namespace).
absl::StatusOr<pid_t> PeerPid(int socket);

// Whether the other end of a connected socket has hung up (without waiting).
bool PeerHungUp(int socket);

// Closes every descriptor of `fds` and clears it.
void CloseAll(std::vector<int>* fds);

}  // namespace keeper
}  // namespace specstate

#endif  // SPECSTATE_KEEPER_FD_PASSING_H_
