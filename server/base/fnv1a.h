// FNV-1a, 64 bits: the fingerprint of a retried call's arguments
// (request_tensors.h) and ReadState's checksums, which clients and tests
// recompute over the bytes they expect.
//
//   EXPECT_EQ(Fnv1a(expected_bytes), read_state.recurrent().checksum());
#ifndef SPECSTATE_SERVER_BASE_FNV1A_H_
#define SPECSTATE_SERVER_BASE_FNV1A_H_

#include <cstdint>

#include "absl/strings/string_view.h"

namespace specstate {
namespace server {

inline uint64_t Fnv1a(absl::string_view bytes) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_BASE_FNV1A_H_
