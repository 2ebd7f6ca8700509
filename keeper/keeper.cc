// specstate-keeper: holds specstated's pools while specstated restarts.
//
//   specstate-keeper --socket=/run/specstate/keeper.sock
//
// It holds memory only: file descriptors (the pools' sealed memfd, or a
// CUDA allocation's POSIX descriptor, and their bookkeeping) that
// specstated hands it over a Unix socket (SCM_RIGHTS), and hands them back
// to the specstated that asks (keeper_client.h has the protocol). No gRPC,
// no kernels, no CUDA: while a descriptor is open the memory it names stays
// allocated, whatever happens to the process that made it. Run one keeper
// per specstated, as the same user (it refuses other users' connections),
// and keep it running: when it stops, the memory goes with the last
// process that holds it. SIGTERM or SIGINT ends it.
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "keeper/fd_passing.h"
#include "keeper/keeper_client.h"

namespace specstate {
namespace keeper {
namespace {

volatile sig_atomic_t g_stop = 0;
void OnSignal(int) { g_stop = 1; }

void Log(const std::string& line) {
  std::fprintf(stderr, "specstate-keeper: %s\n", line.c_str());
  std::fflush(stderr);
}

// What the keeper holds: the holder's text and its descriptors.
struct Store {
  std::string meta;
  std::vector<int> fds;
};

// Answers one request on `client`; false when the connection is done.
bool Serve(int client, Store& store) {
  absl::StatusOr<FdMessage> request = ReceiveWithFds(client, absl::ZeroDuration());
  if (!request.ok()) {
    if (request.status().code() == absl::StatusCode::kDeadlineExceeded) return true;  // nothing yet
    return false;  // closed, or broken
  }
  const char op = request->data[0];
  absl::Status answered;
  if (op == kGet) {
    if (store.fds.empty()) {
      answered = SendWithFds(client, std::string(1, kEmpty));
    } else {
      answered = SendWithFds(client, std::string(1, kHeld) + store.meta, store.fds);
      if (answered.ok()) Log("handed back " + std::to_string(store.fds.size()) + " descriptors");
    }
  } else if (op == kPut && !request->fds.empty()) {
    CloseAll(&store.fds);
    store.fds = std::move(request->fds);
    store.meta = request->data.substr(1);
    Log("holding " + std::to_string(store.fds.size()) + " descriptors: " + store.meta);
    answered = SendWithFds(client, std::string(1, kOk));
  } else if (op == kDrop) {
    if (!store.fds.empty()) Log("dropped " + std::to_string(store.fds.size()) + " descriptors");
    CloseAll(&store.fds);
    store.meta.clear();
    answered = SendWithFds(client, std::string(1, kOk));
  } else {
    CloseAll(&request->fds);
    answered = SendWithFds(client, std::string(1, kError) +
                                       "unknown request (G, P with descriptors, or D)");
  }
  CloseAll(&request->fds);
  return answered.ok();
}

int Run(const std::string& path) {
  absl::StatusOr<int> listener = ListenSeqpacket(path);
  if (!listener.ok()) {
    Log("cannot listen on " + path + ": " + std::string(listener.status().message()));
    return 1;
  }
  Log("listening on " + path);
  Store store;
  std::vector<int> clients;
  while (!g_stop) {
    std::vector<pollfd> polled{{*listener, POLLIN, 0}};
    for (int c : clients) polled.push_back({c, POLLIN, 0});
    if (poll(polled.data(), polled.size(), 1000) < 0 && errno != EINTR) {
      Log(std::string("poll: ") + std::strerror(errno));
      break;
    }
    std::vector<int> kept;
    for (size_t i = 1; i < polled.size(); ++i) {
      const int c = clients[i - 1];
      const bool done = (polled[i].revents & (POLLIN | POLLHUP | POLLERR)) != 0 && !Serve(c, store);
      if (done) {
        close(c);
      } else {
        kept.push_back(c);
      }
    }
    clients.swap(kept);
    if ((polled[0].revents & POLLIN) != 0) {
      const int c = accept4(*listener, nullptr, nullptr, SOCK_CLOEXEC);
      absl::StatusOr<uid_t> uid = c >= 0 ? PeerUid(c) : absl::StatusOr<uid_t>(absl::InternalError("accept"));
      if (c >= 0 && uid.ok() && (*uid == getuid() || *uid == 0)) {
        clients.push_back(c);
      } else if (c >= 0) {
        Log("refused a connection from another user");
        close(c);
      }
    }
  }
  for (int c : clients) close(c);
  close(*listener);
  unlink(path.c_str());
  if (!store.fds.empty()) Log("stopping: letting go of " + std::to_string(store.fds.size()) + " descriptors");
  CloseAll(&store.fds);
  return 0;
}

}  // namespace
}  // namespace keeper
}  // namespace specstate

int main(int argc, char** argv) {
  std::string socket_path;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--socket=", 0) == 0) {
      socket_path = arg.substr(9);
    } else {
      std::fprintf(stderr, "usage: specstate-keeper --socket=PATH\n");
      return 2;
    }
  }
  if (socket_path.empty()) {
    std::fprintf(stderr, "usage: specstate-keeper --socket=PATH\n");
    return 2;
  }
  struct sigaction action {};
  action.sa_handler = specstate::keeper::OnSignal;
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
  signal(SIGPIPE, SIG_IGN);
  return specstate::keeper::Run(socket_path);
}
