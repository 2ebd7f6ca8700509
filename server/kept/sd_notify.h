// systemd's notification protocol, without libsystemd: sd_pid_notify_with_fds
// (a datagram to $NOTIFY_SOCKET, descriptors attached with SCM_RIGHTS) and
// sd_listen_fds_with_names ($LISTEN_FDS descriptors from fd 3, named by
// $LISTEN_FDNAMES). specstated uses it for Type=notify (READY=1) and the
// file-descriptor store (FDSTORE=1 with FileDescriptorStoreMax=): the
// service manager keeps the pools' descriptors while specstated restarts and
// passes them back to the next instance. (libsystemd-dev would do the same
// in a library the container image would then have to carry; the protocol
// is a few lines and documented in sd_notify(3) and sd_listen_fds(3).)
//
//   if (UnderSystemd()) SdNotify("READY=1");
//   std::map<std::string, int> fds = SdListenFds();   // {"specstate-pools": 3, ...}
#ifndef SPECSTATE_SERVER_KEPT_SD_NOTIFY_H_
#define SPECSTATE_SERVER_KEPT_SD_NOTIFY_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace specstate {
namespace server {

// Whether the process was started by systemd with a notification socket
// ($NOTIFY_SOCKET set).
bool UnderSystemd();

// Sends `state` ("READY=1", "FDSTORE=1\nFDNAME=x", ...) with `fds` to the
// service manager. FAILED_PRECONDITION when $NOTIFY_SOCKET is unset.
absl::Status SdNotify(absl::string_view state, const std::vector<int>& fds = {});

// The descriptors the service manager passed to this process, by name
// (unnamed ones as "unknown"), marked close-on-exec; the variables are
// removed from the environment. Empty when none were passed to this process
// ($LISTEN_PID is another's).
std::map<std::string, int> SdListenFds();

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_KEPT_SD_NOTIFY_H_
