// vmm_probe: what the CUDA driver does with a cuMemCreate allocation whose
// POSIX file descriptor outlives the process that made it: the questions
// specstated's kept pools rest on (issue 24), measured on a GPU machine.
//
//   vmm_probe [--bytes=268435456] [--hold_ms=2000] [--device=0]
//
// 1. ipc: can cudaIpcGetMemHandle export a cuMemCreate allocation (as it
//    does cudaMalloc memory), or must clients import its descriptor?
// 2. For each way the creator ends (it exits cleanly after cuMemRelease; it
//    is SIGKILLed): the creator (a child process) makes an allocation,
//    writes a pattern, hands its descriptor to this process (SCM_RIGHTS) and
//    ends. This process, which never initializes CUDA, holds the descriptor
//    for hold_ms, then an importer (another child) imports it, maps it and
//    reads it back: does a held, never-imported descriptor keep the
//    allocation and its bytes alive? Also: a holder that imports it without
//    mapping it (another child, alive while the creator ends).
// 3. Timing: import + map + access of `bytes`, and reading it back.
//
// Prints one line per question ("probe: ... : yes/no (...)") and exits 0
// when every question was answered (whatever the answers), 1 when the
// machine could not run the probe.
#include <cuda.h>
#include <cuda_runtime.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

// The driver's VMM functions, through the runtime (no -lcuda at link time).
struct Vmm {
  CUresult (*create)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                     unsigned long long) = nullptr;
  CUresult (*release)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long) = nullptr;
  CUresult (*free)(CUdeviceptr, size_t) = nullptr;
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                  unsigned long long) = nullptr;
  CUresult (*unmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  CUresult (*granularity)(size_t*, const CUmemAllocationProp*,
                          CUmemAllocationGranularity_flags) = nullptr;
  CUresult (*export_fd)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                        unsigned long long) = nullptr;
  CUresult (*import_fd)(CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType) = nullptr;

  bool Load() {
    return Get("cuMemCreate", &create) && Get("cuMemRelease", &release) &&
           Get("cuMemAddressReserve", &reserve) && Get("cuMemAddressFree", &free) &&
           Get("cuMemMap", &map) && Get("cuMemUnmap", &unmap) && Get("cuMemSetAccess", &access) &&
           Get("cuMemGetAllocationGranularity", &granularity) &&
           Get("cuMemExportToShareableHandle", &export_fd) &&
           Get("cuMemImportFromShareableHandle", &import_fd);
  }
  template <typename F>
  bool Get(const char* name, F* f) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult r;
    if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &r) != cudaSuccess ||
        r != cudaDriverEntryPointSuccess || p == nullptr) {
      std::fprintf(stderr, "vmm_probe: the driver has no %s\n", name);
      return false;
    }
    *f = reinterpret_cast<F>(p);
    return true;
  }
};

int g_device = 0;

CUmemAllocationProp Prop() {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = g_device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

size_t Rounded(Vmm& v, size_t bytes) {
  size_t g = 0;
  const CUmemAllocationProp prop = Prop();
  if (v.granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS || g == 0) {
    g = 2 << 20;
  }
  return (bytes + g - 1) / g * g;
}

bool MapHere(Vmm& v, CUmemGenericAllocationHandle h, size_t bytes, CUdeviceptr* out) {
  if (v.reserve(out, bytes, 0, 0, 0) != CUDA_SUCCESS) return false;
  if (v.map(*out, bytes, 0, h, 0) != CUDA_SUCCESS) return false;
  CUmemAccessDesc a{};
  a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  a.location.id = g_device;
  a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return v.access(*out, bytes, &a, 1) == CUDA_SUCCESS;
}

uint32_t Pattern(size_t i) { return static_cast<uint32_t>(i * 2654435761u + 12345u); }

void SendFd(int socket, int fd, const std::string& text) {
  iovec iov{const_cast<char*>(text.data()), text.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  if (fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  sendmsg(socket, &msg, MSG_NOSIGNAL);
}

int ReceiveFd(int socket, std::string* text) {
  char buf[512];
  iovec iov{buf, sizeof(buf)};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t n = recvmsg(socket, &msg, 0);
  if (n <= 0) return -1;
  text->assign(buf, n);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  if (c == nullptr || c->cmsg_type != SCM_RIGHTS) return -1;
  int fd = -1;
  std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
  return fd;
}

double Ms(std::chrono::steady_clock::time_point a) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count();
}

// --role=create: makes the allocation, writes the pattern, reports whether
// cudaIpcGetMemHandle covers it, hands the descriptor over fd 3, then ends
// as told (clean: unmap, release, exit; kill: SIGKILL itself).
int Create(size_t bytes, bool kill_self) {
  Vmm v;
  if (cudaSetDevice(g_device) != cudaSuccess || cudaFree(nullptr) != cudaSuccess || !v.Load()) {
    SendFd(3, -1, "error: no CUDA");
    return 1;
  }
  bytes = Rounded(v, bytes);
  const CUmemAllocationProp prop = Prop();
  CUmemGenericAllocationHandle h = 0;
  CUdeviceptr p = 0;
  if (v.create(&h, bytes, &prop, 0) != CUDA_SUCCESS || !MapHere(v, h, bytes, &p)) {
    SendFd(3, -1, "error: cuMemCreate or mapping failed");
    return 1;
  }
  std::vector<uint32_t> host(bytes / 4);
  for (size_t i = 0; i < host.size(); ++i) host[i] = Pattern(i);
  cudaMemcpy(reinterpret_cast<void*>(p), host.data(), bytes, cudaMemcpyHostToDevice);
  cudaDeviceSynchronize();
  cudaIpcMemHandle_t ipc;
  const cudaError_t ipc_err = cudaIpcGetMemHandle(&ipc, reinterpret_cast<void*>(p));
  cudaGetLastError();
  int fd = -1;
  const CUresult exported = v.export_fd(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  const std::string text = std::string("ipc=") +
                           (ipc_err == cudaSuccess ? "ok" : cudaGetErrorName(ipc_err)) +
                           " export=" + std::to_string(static_cast<int>(exported)) +
                           " bytes=" + std::to_string(bytes);
  SendFd(3, exported == CUDA_SUCCESS ? fd : -1, text);
  if (kill_self) raise(SIGKILL);
  v.unmap(p, bytes);
  v.free(p, bytes);
  v.release(h);
  close(fd);
  return 0;
}

// --role=import: imports the descriptor on fd 4 (bytes of it), maps it,
// reads it back; reports on fd 3.
int Import(size_t bytes) {
  Vmm v;
  if (cudaSetDevice(g_device) != cudaSuccess || cudaFree(nullptr) != cudaSuccess || !v.Load()) {
    SendFd(3, -1, "import=error(no CUDA)");
    return 1;
  }
  const auto t0 = std::chrono::steady_clock::now();
  CUmemGenericAllocationHandle h = 0;
  const CUresult imported = v.import_fd(&h, reinterpret_cast<void*>(static_cast<uintptr_t>(4)),
                                        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (imported != CUDA_SUCCESS) {
    SendFd(3, -1, "import=failed(" + std::to_string(static_cast<int>(imported)) + ")");
    return 0;
  }
  CUdeviceptr p = 0;
  if (!MapHere(v, h, bytes, &p)) {
    SendFd(3, -1, "import=ok map=failed");
    return 0;
  }
  const double map_ms = Ms(t0);
  std::vector<uint32_t> host(bytes / 4);
  const auto t1 = std::chrono::steady_clock::now();
  const cudaError_t copied =
      cudaMemcpy(host.data(), reinterpret_cast<void*>(p), bytes, cudaMemcpyDeviceToHost);
  const double read_ms = Ms(t1);
  size_t bad = 0;
  for (size_t i = 0; i < host.size(); ++i) bad += host[i] != Pattern(i);
  char text[256];
  std::snprintf(text, sizeof(text),
                "import=ok map=ok read=%s intact=%s mismatched_words=%zu import_map_ms=%.2f "
                "read_ms=%.2f",
                copied == cudaSuccess ? "ok" : cudaGetErrorName(copied), bad == 0 ? "yes" : "no",
                bad, map_ms, read_ms);
  SendFd(3, -1, text);
  v.unmap(p, bytes);
  v.free(p, bytes);
  v.release(h);
  return 0;
}

// --role=hold: imports the descriptor on fd 4 without mapping it, says so on
// fd 3 and closes fd 4; on a request (any message on fd 3) exports the
// imported handle to a new descriptor and sends it; then waits until killed.
int Hold() {
  Vmm v;
  if (cudaSetDevice(g_device) != cudaSuccess || cudaFree(nullptr) != cudaSuccess || !v.Load()) {
    SendFd(3, -1, "hold=error");
    return 1;
  }
  CUmemGenericAllocationHandle h = 0;
  const CUresult r = v.import_fd(&h, reinterpret_cast<void*>(static_cast<uintptr_t>(4)),
                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  close(4);
  SendFd(3, -1, r == CUDA_SUCCESS ? "hold=imported" : "hold=failed");
  char c;
  if (read(3, &c, 1) <= 0) return 0;
  int fd = -1;
  const CUresult e = v.export_fd(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  SendFd(3, e == CUDA_SUCCESS ? fd : -1, "reexport=" + std::to_string(static_cast<int>(e)));
  pause();
  return 0;
}

std::string g_self;

// Runs this program as `role` with `fd` (if >= 0) at 4 and a socket at 3;
// returns the child's pid and, in *parent, this side of the socket.
pid_t Spawn(const std::string& role, size_t bytes, int fd, int* parent) {
  int pair[2];
  socketpair(AF_UNIX, SOCK_SEQPACKET, 0, pair);
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(pair[1], 3);
    if (fd >= 0) dup2(fd, 4);
    execl(g_self.c_str(), "vmm_probe", ("--role=" + role).c_str(),
          ("--bytes=" + std::to_string(bytes)).c_str(),
          ("--device=" + std::to_string(g_device)).c_str(), nullptr);
    _exit(127);
  }
  close(pair[1]);
  *parent = pair[0];
  return pid;
}

std::string Field(const std::string& text, const std::string& key) {
  const size_t at = text.find(key + "=");
  if (at == std::string::npos) return "";
  const size_t end = text.find(' ', at);
  return text.substr(at + key.size() + 1, end == std::string::npos ? end : end - at - key.size() - 1);
}

// One scenario: a creator that ends as told (`kill_self`); then either this
// process (never a CUDA context) holds the descriptor for hold_ms, or
// (`holder`) a process that imported it without mapping it holds the
// allocation alone for hold_ms and exports a new descriptor afterwards; then
// an importer maps the descriptor and reads it back. Returns its report.
std::string Scenario(size_t bytes, bool kill_self, bool holder, int hold_ms,
                     std::string* created) {
  int socket = -1;
  const pid_t creator = Spawn(kill_self ? "create_kill" : "create", bytes, -1, &socket);
  int fd = ReceiveFd(socket, created);
  close(socket);
  if (fd < 0) {
    waitpid(creator, nullptr, 0);
    return "creator failed: " + *created;
  }
  const size_t real = std::stoull(Field(*created, "bytes"));
  pid_t holder_pid = -1;
  int holder_socket = -1;
  if (holder) {
    holder_pid = Spawn("hold", real, fd, &holder_socket);
    std::string said;
    ReceiveFd(holder_socket, &said);
    *created += " " + said;
    close(fd);  // from here only the holder's imported handle keeps it
    fd = -1;
  }
  waitpid(creator, nullptr, 0);
  usleep(hold_ms * 1000);
  if (holder) {
    std::string said;
    if (write(holder_socket, "x", 1) == 1) fd = ReceiveFd(holder_socket, &said);
    *created += " " + said;
    if (fd < 0) {
      kill(holder_pid, SIGKILL);
      waitpid(holder_pid, nullptr, 0);
      return "the holder could not export it again: " + said;
    }
  }
  int report_socket = -1;
  const pid_t importer = Spawn("import", real, fd, &report_socket);
  std::string report;
  ReceiveFd(report_socket, &report);
  close(report_socket);
  waitpid(importer, nullptr, 0);
  if (holder_pid > 0) {
    kill(holder_pid, SIGKILL);
    waitpid(holder_pid, nullptr, 0);
    close(holder_socket);
  }
  close(fd);
  return report;
}

}  // namespace

int main(int argc, char** argv) {
  size_t bytes = 256u << 20;
  int hold_ms = 2000;
  std::string role;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--bytes=", 0) == 0) bytes = std::stoull(a.substr(8));
    if (a.rfind("--hold_ms=", 0) == 0) hold_ms = std::stoi(a.substr(10));
    if (a.rfind("--device=", 0) == 0) g_device = std::stoi(a.substr(9));
    if (a.rfind("--role=", 0) == 0) role = a.substr(7);
  }
  if (role == "create") return Create(bytes, false);
  if (role == "create_kill") return Create(bytes, true);
  if (role == "import") return Import(bytes);
  if (role == "hold") return Hold();
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return 1;
  g_self.assign(self, n);
  // This process never touches CUDA: a descriptor it holds is held by no
  // CUDA context.
  std::printf("vmm_probe: device %d, %zu bytes, descriptor held %d ms before the import\n",
              g_device, bytes, hold_ms);
  struct Case {
    const char* what;
    bool kill_self;
    bool holder;
  };
  const Case cases[] = {
      {"the creator exited cleanly (cuMemRelease, context destroyed); only a never-imported "
       "descriptor held",
       false, false},
      {"the creator was SIGKILLed; only a never-imported descriptor held", true, false},
      {"the creator was SIGKILLed; a process that imported the descriptor (not mapped) held it",
       true, true},
  };
  bool answered = true;
  std::string ipc;
  for (const Case& c : cases) {
    std::string created;
    const std::string report = Scenario(bytes, c.kill_self, c.holder, hold_ms, &created);
    if (ipc.empty()) ipc = Field(created, "ipc");
    const std::string intact = Field(report, "intact");
    answered = answered && !report.empty() && report.rfind("creator failed", 0) != 0;
    std::printf("probe: %s: the allocation survived and its bytes are intact: %s\n  (creator: %s)\n"
                "  (importer: %s)\n",
                c.what,
                intact == "yes" ? "yes" : (Field(report, "import").empty() ? "unknown" : "no"),
                created.c_str(), report.c_str());
  }
  std::printf("probe: cudaIpcGetMemHandle on a cuMemCreate allocation: %s\n",
              ipc == "ok" ? "works (schedulers may keep CUDA IPC handles)"
                          : ("fails with " + ipc +
                             " (schedulers import the descriptor: ExportPools' pools_fd_socket)")
                                .c_str());
  std::fflush(stdout);
  return answered ? 0 : 1;
}
