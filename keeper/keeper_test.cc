#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "keeper/fd_passing.h"
#include "keeper/keeper_client.h"

namespace specstate {
namespace keeper {
namespace {

std::string KeeperBinary() {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  return srcdir != nullptr ? absl::StrCat(srcdir, "/specstate/keeper/specstate-keeper")
                           : "keeper/specstate-keeper";
}

// A specstate-keeper process on a socket in a fresh directory.
class KeeperProcess {
 public:
  explicit KeeperProcess(const std::string& dir) : path_(dir + "/keeper.sock") { Start(); }
  ~KeeperProcess() { Stop(SIGTERM); }

  void Start() {
    pid_ = fork();
    if (pid_ == 0) {
      execl(KeeperBinary().c_str(), "specstate-keeper", ("--socket=" + path_).c_str(), nullptr);
      _exit(127);
    }
    for (int i = 0; i < 200; ++i) {
      absl::StatusOr<int> s = ConnectSeqpacket(path_);
      if (s.ok()) {
        close(*s);
        return;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    ADD_FAILURE() << "the keeper did not come up on " << path_;
  }
  // Returns the exit status (waitpid's).
  int Stop(int signal) {
    if (pid_ <= 0) return -1;
    kill(pid_, signal);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return status;
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  pid_t pid_ = -1;
};

std::string TempDir() {
  char tmpl[] = "/tmp/skXXXXXX";
  EXPECT_NE(mkdtemp(tmpl), nullptr);
  return tmpl;
}

// A sealed memfd of `bytes` holding `fill`.
int Memfd(size_t bytes, char fill) {
  const int fd = memfd_create("keeper-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(ftruncate(fd, bytes), 0);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  std::memset(p, fill, bytes);
  munmap(p, bytes);
  EXPECT_EQ(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  return fd;
}

std::string Contents(int fd) {
  struct stat st;
  EXPECT_EQ(fstat(fd, &st), 0);
  std::string out(st.st_size, '\0');
  EXPECT_EQ(pread(fd, out.data(), out.size(), 0), static_cast<ssize_t>(out.size()));
  return out;
}

TEST(KeeperTest, HoldsDescriptorsAfterTheirHolderLetGoAndHandsThemBack) {
  const std::string dir = TempDir();
  KeeperProcess keeper(dir);
  {
    auto client = KeeperClient::Connect(keeper.path());
    ASSERT_TRUE(client.ok()) << client.status();
    absl::StatusOr<Held> empty = (*client)->Get();
    ASSERT_TRUE(empty.ok()) << empty.status();
    EXPECT_TRUE(empty->fds.empty());
    const int a = Memfd(8192, 'a'), b = Memfd(4096, 'b');
    ASSERT_TRUE((*client)->Put("pools=8192 header=4096", {a, b}).ok());
    close(a);
    close(b);  // only the keeper holds them now
  }
  auto client = KeeperClient::Connect(keeper.path());
  ASSERT_TRUE(client.ok());
  absl::StatusOr<Held> held = (*client)->Get();
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(held->meta, "pools=8192 header=4096");
  ASSERT_EQ(held->fds.size(), 2u);
  EXPECT_EQ(Contents(held->fds[0]), std::string(8192, 'a'));
  EXPECT_EQ(Contents(held->fds[1]), std::string(4096, 'b'));
  // A Put replaces what was held; a Drop lets go of it.
  const int c = Memfd(4096, 'c');
  ASSERT_TRUE((*client)->Put("one", {c}).ok());
  close(c);
  held = (*client)->Get();
  ASSERT_TRUE(held.ok());
  EXPECT_EQ(held->meta, "one");
  ASSERT_EQ(held->fds.size(), 1u);
  EXPECT_EQ(Contents(held->fds[0]), std::string(4096, 'c'));
  CloseAll(&held->fds);
  ASSERT_TRUE((*client)->Drop().ok());
  held = (*client)->Get();
  ASSERT_TRUE(held.ok());
  EXPECT_TRUE(held->fds.empty());
  rmdir(dir.c_str());
}

// One holder at a time: a process that took the descriptors holds them while
// its connection is open; another process's Get, Put and Drop are refused
// naming it, and change nothing. Its death (SIGKILL) frees them.
TEST(KeeperTest, AnotherProcessIsRefusedWhileTheHolderLivesAndServedOnceItDies) {
  const std::string dir = TempDir();
  KeeperProcess keeper(dir);
  const std::string fill(1, static_cast<char>('a' + absl::ToUnixNanos(absl::Now()) % 26));
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t holder = fork();
  if (holder == 0) {  // takes the (empty) keeper, hands it a memfd, and stays
    auto client = KeeperClient::Connect(keeper.path());
    const int fd = Memfd(4096, fill[0]);
    const bool ok = client.ok() && (*client)->Get().ok() && (*client)->Put("held", {fd}).ok();
    if (write(ready[1], ok ? "y" : "n", 1) != 1) _exit(2);
    pause();
    _exit(0);
  }
  close(ready[1]);
  char answer = 0;
  ASSERT_EQ(read(ready[0], &answer, 1), 1);
  close(ready[0]);
  ASSERT_EQ(answer, 'y');
  auto client = KeeperClient::Connect(keeper.path());
  ASSERT_TRUE(client.ok());
  const std::string named = absl::StrCat("held by pid ", holder);
  absl::StatusOr<Held> refused = (*client)->Get();
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), ::testing::HasSubstr(named));
  EXPECT_THAT(std::string(refused.status().message()),
              ::testing::HasSubstr("one service per kept allocation"));
  const int other = Memfd(4096, 'z');
  absl::Status put = (*client)->Put("mine", {other});
  close(other);
  EXPECT_EQ(put.code(), absl::StatusCode::kFailedPrecondition) << put;
  EXPECT_THAT(std::string(put.message()), ::testing::HasSubstr(named));
  EXPECT_EQ((*client)->Drop().code(), absl::StatusCode::kFailedPrecondition);
  // The holder dies without a goodbye: its descriptors are the next one's.
  kill(holder, SIGKILL);
  waitpid(holder, nullptr, 0);
  absl::StatusOr<Held> held = (*client)->Get();
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(held->meta, "held");
  ASSERT_EQ(held->fds.size(), 1u);
  EXPECT_EQ(Contents(held->fds[0]), std::string(4096, fill[0]));
  CloseAll(&held->fds);
  rmdir(dir.c_str());
}

TEST(KeeperTest, RefusesMalformedRequestsAndKeepsServing) {
  const std::string dir = TempDir();
  KeeperProcess keeper(dir);
  absl::StatusOr<int> s = ConnectSeqpacket(keeper.path());
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE(SendWithFds(*s, "Zzz").ok());
  absl::StatusOr<FdMessage> reply = ReceiveWithFds(*s, absl::Seconds(5));
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->data[0], kError);
  EXPECT_THAT(reply->data, ::testing::HasSubstr("unknown request"));
  // A Put without descriptors is refused too (it would drop what is held).
  ASSERT_TRUE(SendWithFds(*s, "Pnothing").ok());
  reply = ReceiveWithFds(*s, absl::Seconds(5));
  ASSERT_TRUE(reply.ok());
  EXPECT_EQ(reply->data[0], kError);
  close(*s);
  auto client = KeeperClient::Connect(keeper.path());
  ASSERT_TRUE(client.ok());
  EXPECT_TRUE((*client)->Get().ok());
  rmdir(dir.c_str());
}

TEST(KeeperTest, ASecondKeeperNeverTakesALiveSocketAndAStaleOneIsReplaced) {
  const std::string dir = TempDir();
  auto keeper = std::make_unique<KeeperProcess>(dir);
  absl::StatusOr<int> second = ListenSeqpacket(keeper->path());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kAlreadyExists) << second.status();
  // SIGKILL leaves the socket file behind: stale, replaced by the next keeper.
  keeper->Stop(SIGKILL);
  struct stat st;
  ASSERT_EQ(lstat((dir + "/keeper.sock").c_str(), &st), 0);
  KeeperProcess next(dir);
  EXPECT_TRUE(KeeperClient::Connect(next.path()).ok());
  rmdir(dir.c_str());
}

TEST(KeeperTest, ItsDeathIsSeenAsAHangup) {
  const std::string dir = TempDir();
  KeeperProcess keeper(dir);
  auto client = KeeperClient::Connect(keeper.path());
  ASSERT_TRUE(client.ok());
  EXPECT_FALSE((*client)->HungUp());
  EXPECT_EQ(WTERMSIG(keeper.Stop(SIGKILL)), SIGKILL);
  EXPECT_TRUE((*client)->HungUp());
  absl::StatusOr<Held> held = (*client)->Get();
  EXPECT_EQ(held.status().code(), absl::StatusCode::kUnavailable) << held.status();
  unlink((dir + "/keeper.sock").c_str());
  rmdir(dir.c_str());
}

TEST(KeeperTest, StopsCleanlyOnSigterm) {
  const std::string dir = TempDir();
  KeeperProcess keeper(dir);
  const int status = keeper.Stop(SIGTERM);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  struct stat st;
  EXPECT_NE(lstat((dir + "/keeper.sock").c_str(), &st), 0) << "the socket is removed";
  rmdir(dir.c_str());
}

TEST(FdPassingTest, RefusesTooManyDescriptorsAndEmptyMessages) {
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair), 0);
  std::vector<int> many(kMaxFds + 1, pair[0]);
  EXPECT_EQ(SendWithFds(pair[0], "x", many).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SendWithFds(pair[0], "").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ReceiveWithFds(pair[1], absl::Milliseconds(10)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  close(pair[0]);
  EXPECT_EQ(ReceiveWithFds(pair[1], absl::Seconds(1)).status().code(),
            absl::StatusCode::kUnavailable);
  close(pair[1]);
}

}  // namespace
}  // namespace keeper
}  // namespace specstate
