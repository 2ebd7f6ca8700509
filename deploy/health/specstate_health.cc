// specstate-health: asks a specstated for its grpc.health.v1 status; exits 0
// when it answers SERVING, 1 otherwise (not serving, unreachable, timeout).
//
//   specstate-health                                   # unix:///tmp/specstate.sock
//   specstate-health --addr=unix:///run/specstate/specstate.sock --service=specstate.v1.SpecState
//
// It exists for exec health checks (Kubernetes exec probes, the image's
// HEALTHCHECK, scripts) when the service listens on its Unix socket: kubelet's
// own grpc probe can only dial the pod IP over TCP, and grpcurl is not in
// Debian. The two health messages are encoded by hand, so the probe links
// nothing beyond what specstated already needs.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/types/optional.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/byte_buffer.h"

ABSL_FLAG(std::string, addr, "unix:///tmp/specstate.sock", "unix:///PATH or HOST:PORT");
ABSL_FLAG(std::string, service, "", "service to ask about; empty: the server as a whole");
ABSL_FLAG(int, timeout_ms, 2000, "deadline of the check");

namespace {

// grpc.health.v1.HealthCheckResponse.ServingStatus
const char* const kStatusNames[] = {"UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"};
constexpr uint64_t kServing = 1;

void PutVarint(uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>(value | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

bool GetVarint(const std::string& in, size_t* pos, uint64_t* value) {
  *value = 0;
  for (int shift = 0; shift < 64 && *pos < in.size(); shift += 7) {
    const uint8_t byte = static_cast<uint8_t>(in[(*pos)++]);
    *value |= uint64_t{byte & 0x7fu} << shift;
    if ((byte & 0x80) == 0) return true;
  }
  return false;
}

// HealthCheckRequest { string service = 1; }
std::string EncodeRequest(const std::string& service) {
  std::string out;
  if (!service.empty()) {
    out.push_back(0x0a);  // field 1, length-delimited
    PutVarint(service.size(), &out);
    out += service;
  }
  return out;
}

// HealthCheckResponse { ServingStatus status = 1; }: the status (0, UNKNOWN,
// when absent), or nullopt for bytes that are not such a message.
absl::optional<uint64_t> DecodeStatus(const std::string& in) {
  uint64_t status = 0;
  size_t pos = 0;
  while (pos < in.size()) {
    uint64_t key = 0, value = 0;
    if (!GetVarint(in, &pos, &key)) return absl::nullopt;
    switch (key & 7) {
      case 0:  // varint
        if (!GetVarint(in, &pos, &value)) return absl::nullopt;
        if (key >> 3 == 1) status = value;
        break;
      case 1:  // fixed64
        pos += 8;
        break;
      case 2:  // length-delimited
        if (!GetVarint(in, &pos, &value) || value > in.size() - pos) return absl::nullopt;
        pos += value;
        break;
      case 5:  // fixed32
        pos += 4;
        break;
      default:
        return absl::nullopt;
    }
  }
  if (pos != in.size()) return absl::nullopt;
  return status;
}

int Check() {
  const std::string addr = absl::GetFlag(FLAGS_addr);
  grpc::GenericStub stub(grpc::CreateChannel(addr, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::milliseconds(absl::GetFlag(FLAGS_timeout_ms)));

  const std::string request_bytes = EncodeRequest(absl::GetFlag(FLAGS_service));
  grpc::Slice slice(request_bytes);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  grpc::CompletionQueue cq;
  auto call = stub.PrepareUnaryCall(&context, "/grpc.health.v1.Health/Check", request, &cq);
  call->StartCall();
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  if (!cq.Next(&tag, &ok) || !ok) {
    std::fprintf(stderr, "specstate-health: %s: the call did not complete\n", addr.c_str());
    return 1;
  }
  if (!status.ok()) {
    std::fprintf(stderr, "specstate-health: %s: %s (code %d)\n", addr.c_str(),
                 status.error_message().c_str(), static_cast<int>(status.error_code()));
    return 1;
  }
  std::string bytes;
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) {
    std::fprintf(stderr, "specstate-health: %s: unreadable reply\n", addr.c_str());
    return 1;
  }
  for (const grpc::Slice& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  const absl::optional<uint64_t> serving = DecodeStatus(bytes);
  if (!serving.has_value()) {
    std::fprintf(stderr, "specstate-health: %s: not a HealthCheckResponse\n", addr.c_str());
    return 1;
  }
  const char* name = *serving < 4 ? kStatusNames[*serving] : "unknown status";
  std::printf("%s\n", name);
  return *serving == kServing ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "specstate-health: exits 0 when the service answers the gRPC health check with SERVING.\n"
      "  specstate-health [--addr=unix:///PATH|HOST:PORT] [--service=NAME] [--timeout_ms=N]");
  absl::ParseCommandLine(argc, argv);
  return Check();
}
