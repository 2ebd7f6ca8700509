// Host memory standing in for a client's mapped shared-memory segment, so
// that the registry and the request-tensor rules can be tested without a
// device or a second process.
//
//   auto region = std::make_unique<HostRegion>(4096);
//   int32_t* words = static_cast<int32_t*>(region->data());
//   registry.Register("s1", "acts", std::move(region));
#ifndef SPECSTATE_SERVER_TESTING_HOST_REGION_FOR_TEST_H_
#define SPECSTATE_SERVER_TESTING_HOST_REGION_FOR_TEST_H_

#include <cstdint>
#include <vector>

#include "absl/strings/string_view.h"
#include "server/device/device.h"

namespace specstate {
namespace server {

class HostRegion final : public MappedRegion {
 public:
  explicit HostRegion(uint64_t bytes) : bytes_(bytes) {}
  void* data() const override { return const_cast<uint8_t*>(bytes_.data()); }
  uint64_t byte_size() const override { return bytes_.size(); }
  absl::string_view kind() const override { return "shm"; }
  MemoryObject object() const override {
    return MemoryObject{MemoryObject::kHost, reinterpret_cast<uint64_t>(bytes_.data()), 0};
  }
  uint64_t object_offset() const override { return 0; }

 private:
  std::vector<uint8_t> bytes_;
};

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_TESTING_HOST_REGION_FOR_TEST_H_
