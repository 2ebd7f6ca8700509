// The keeper's protocol, and its client (specstated's side). One message
// each way on a SOCK_SEQPACKET connection to specstate-keeper's socket:
//
//   'G'                         -> 'K' META + the descriptors held, or 'E' (none held)
//   'P' META + descriptors      -> 'O' (the keeper now holds these, and drops what it held)
//   'D'                         -> 'O' (the keeper holds nothing)
//   anything else               -> 'X' MESSAGE
//
// META is the holder's own text (specstated's: which descriptor is which and
// their sizes); the keeper returns it as it was given. One service per kept
// allocation: the connection whose 'G', 'P' or 'D' was answered holds the
// descriptors while it is open; the same requests from another process are
// answered 'X' naming the holder's pid ("the pools are held by pid 1234 ...:
// one service per kept allocation ..."), which the client returns as
// FAILED_PRECONDITION. A holder's death closes its connection, and the next
// process may take them. The connection may
// stay open: specstated keeps one open and watches it, so it sees the
// keeper's death as the connection's hangup.
//
//   auto keeper = KeeperClient::Connect("/run/specstate/keeper.sock").value();
//   absl::StatusOr<Held> held = keeper->Get();  // after a restart: the pools
//   absl::Status put = keeper->Put("...", {pools_fd, header_fd});
#ifndef SPECSTATE_KEEPER_KEEPER_CLIENT_H_
#define SPECSTATE_KEEPER_KEEPER_CLIENT_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "keeper/fd_passing.h"

namespace specstate {
namespace keeper {

inline constexpr char kGet = 'G';
inline constexpr char kPut = 'P';
inline constexpr char kDrop = 'D';
inline constexpr char kHeld = 'K';
inline constexpr char kEmpty = 'E';
inline constexpr char kOk = 'O';
inline constexpr char kError = 'X';

// What a keeper held: the holder's text and the descriptors (the caller's
// to close).
struct Held {
  std::string meta;
  std::vector<int> fds;
};

class KeeperClient {
 public:
  // UNAVAILABLE naming the path when no keeper answers there.
  static absl::StatusOr<std::unique_ptr<KeeperClient>> Connect(const std::string& path);
  ~KeeperClient();

  // What the keeper holds (an empty Held when nothing).
  absl::StatusOr<Held> Get();
  // Hands the keeper `fds` (duplicated into it) with `meta`, in place of
  // what it held.
  absl::Status Put(const std::string& meta, const std::vector<int>& fds);
  // The keeper lets go of what it held.
  absl::Status Drop();

  // Whether the keeper's end of the connection has hung up (it died).
  bool HungUp() const;
  const std::string& path() const { return path_; }

 private:
  KeeperClient(std::string path, int socket) : path_(std::move(path)), socket_(socket) {}
  absl::StatusOr<FdMessage> Call(const std::string& request, const std::vector<int>& fds);

  std::string path_;
  int socket_;
  absl::Duration timeout_ = absl::Seconds(10);
};

}  // namespace keeper
}  // namespace specstate

#endif  // SPECSTATE_KEEPER_KEEPER_CLIENT_H_
