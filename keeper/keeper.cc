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
//
// One service per kept allocation: the process whose connection last took
// the descriptors (Get) or handed them over (Put, Drop) holds them while that
// connection is open; another process's Get, Put or Drop is refused, naming
// the holder's pid. A holder's death closes its connection (whatever killed
// it), so the next specstated takes the pools over.
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <time.h>
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

// What the keeper holds: the holder's text and its descriptors, and who
// holds them: the connection of the process that last asked for them or
// handed them over (one service per kept allocation), while it is open.
struct Store {
  std::string meta;
  std::vector<int> fds;
  int holder = -1;  // the holder's connection; -1: none
  pid_t holder_pid = 0;
  std::string holder_since;
};

std::string Now() {
  char text[32];
  const time_t t = time(nullptr);
  tm local{};
  localtime_r(&t, &local);
  strftime(text, sizeof(text), "%Y-%m-%d %H:%M:%S", &local);
  return text;
}

// Why `client` may not have the pools ("" when it may): another process's
// connection holds them and is open. A holder that died closed its
// connection (the kernel closes a dead process's sockets, SIGKILL
// included), so it holds nothing any more.
std::string HeldByAnother(int client, Store& store, pid_t client_pid) {
  if (store.holder < 0 || store.holder == client) return "";
  if (PeerHungUp(store.holder)) {
    Log("the holder's connection (pid " + std::to_string(store.holder_pid) +
        ") has hung up: its pools are free to take over");
    store.holder = -1;
    return "";
  }
  if (client_pid == store.holder_pid) return "";  // the same process, on another connection
  return "the pools are held by pid " + std::to_string(store.holder_pid) +
         " (its connection is open since " + store.holder_since +
         "): one service per kept allocation; stop that specstated first (when it dies, the "
         "next one takes the pools over), or start this one with a keeper of its own";
}

// Answers one request on `client`; false when the connection is done.
bool Serve(int client, Store& store) {
  absl::StatusOr<FdMessage> request = ReceiveWithFds(client, absl::ZeroDuration());
  if (!request.ok()) {
    if (request.status().code() == absl::StatusCode::kDeadlineExceeded) return true;  // nothing yet
    return false;  // closed, or broken
  }
  const char op = request->data[0];
  absl::StatusOr<pid_t> peer = PeerPid(client);
  const pid_t pid = peer.ok() ? *peer : 0;
  const bool holding_op = op == kGet || (op == kPut && !request->fds.empty()) || op == kDrop;
  const std::string refused = holding_op ? HeldByAnother(client, store, pid) : std::string();
  absl::Status answered;
  if (!refused.empty()) {
    Log("refused a '" + std::string(1, op) + "' from pid " + std::to_string(pid) + ": " + refused);
    answered = SendWithFds(client, std::string(1, kError) + refused);
  } else if (op == kGet) {
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
  if (refused.empty() && holding_op && answered.ok() && store.holder != client) {
    store.holder = client;
    store.holder_pid = pid;
    store.holder_since = Now();
    Log("pid " + std::to_string(pid) + " holds the pools");
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
        if (c == store.holder) {
          Log("the holder (pid " + std::to_string(store.holder_pid) + ") has gone");
          store.holder = -1;
        }
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
