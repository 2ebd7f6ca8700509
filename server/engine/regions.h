// Client buffers registered with the service, after Triton Inference
// Server's shared-memory protocol: a session registers a buffer once under a
// name, and requests then refer to tensors in it by name + byte offset +
// dtype + shape + strides.
//
// A region stays mapped while work that uses it is in flight: a request's
// lookup pins each region it names once (a shared_ptr the work holds until
// the device has finished it). Unregistering, or the end of the owning
// session, drops the registry's reference; the mapping goes, and the
// unregister completes, when the last pin is released.
//
//   RegionRegistry regions;
//   regions.Register("s1", "acts", std::move(mapped));
//   RegionLookup lookup(regions, session);
//   absl::StatusOr<TensorView> q = lookup.ResolveTensor(request.q(), "q", spec);
//   work.pins = lookup.TakePins();  // keeps q's region mapped
#ifndef SPECSTATE_SERVER_ENGINE_REGIONS_H_
#define SPECSTATE_SERVER_ENGINE_REGIONS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <iterator>
#include <map>
#include <set>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "kernels/dtype.h"
#include "specstate/v1/specstate.pb.h"
#include "server/device/device.h"

namespace specstate {
namespace server {

// A registered region. Unmaps (and runs the unregister's completions) when
// the last reference goes.
class Region {
 public:
  Region(std::string session, std::string name, std::unique_ptr<MappedRegion> mapped)
      : session_(std::move(session)),
        name_(std::move(name)),
        mapped_(std::move(mapped)),
        object_(mapped_->object()),
        object_offset_(mapped_->object_offset()) {}
  ~Region();

  const std::string& session() const { return session_; }
  const std::string& name() const { return name_; }
  void* data() const { return mapped_->data(); }
  uint64_t byte_size() const { return mapped_->byte_size(); }
  absl::string_view kind() const { return mapped_->kind(); }
  // Bytes [offset, offset + bytes) of the region, as a span of its memory.
  ByteSpan Span(uint64_t offset, uint64_t bytes) const {
    return ByteSpan{object_, object_offset_ + offset, object_offset_ + offset + bytes};
  }

  // Runs `fn` once the region is unmapped.
  void OnUnmapped(std::function<void()> fn);

  // False once unregistered (or its session ended), though in-flight work
  // may still hold it mapped.
  bool registered() const { return registered_.load(std::memory_order_acquire); }
  void MarkUnregistered() { registered_.store(false, std::memory_order_release); }

  // Whether its owner truncated it while it was in use (MappedRegion::faulted).
  bool faulted() const { return mapped_->faulted(); }

 private:
  std::atomic<bool> registered_{true};
  std::string session_;
  std::string name_;
  std::unique_ptr<MappedRegion> mapped_;
  const MemoryObject object_;
  const uint64_t object_offset_;
  absl::Mutex mu_;
  std::vector<std::function<void()>> on_unmapped_;
};

using RegionPin = std::shared_ptr<Region>;

// Tensor dimensions: inline, so resolving a request's tensors allocates nothing.
using Dims = absl::InlinedVector<int64_t, 4>;

// What a tensor must look like: dtype, and per dimension the size required
// (-1: any, reported back). `dense_inner` dimensions at the end must be
// dense (stride = product of the later sizes).
struct TensorSpec {
  DType dtype = DType::kInt32;
  Dims shape;
  int dense_inner = 0;
};

// A resolved tensor: its address, shape and strides (in elements). Its
// region is held by the lookup that resolved it, and then by the pins taken
// from that lookup.
struct TensorView {
  void* data = nullptr;
  Dims shape;
  Dims strides;
  const Region* region = nullptr;
  ByteSpan span;  // the bytes from its first to its last element, in the region's memory
};

// A doorbell's counter: 4 bytes in a region of the session.
struct Counter {
  uint32_t* word = nullptr;
  RegionPin pin;
  ByteSpan span;
};

class RegionRegistry {
 public:
  // Sessions may register regions from OpenSession() until ReleaseSession():
  // a registration that races the end of its session either lands before
  // the end (and is released with the session) or fails.
  void OpenSession(const std::string& session);

  // ALREADY_EXISTS if the session already has a region of that name;
  // FAILED_PRECONDITION if the session is not open.
  absl::Status Register(const std::string& session, const std::string& name,
                        std::unique_ptr<MappedRegion> mapped);

  // Drops the registration; `unmapped` runs once no in-flight work pins it
  // (at once when none does). NOT_FOUND for an unknown name.
  absl::Status Unregister(const std::string& session, const std::string& name,
                          std::function<void()> unmapped);

  // Drops `region`'s registration if it is still registered (its name may
  // have been registered again since: that one stays).
  void Drop(const RegionPin& region);

  // DATA_LOSS naming the first of `pins` whose owner truncated it while a
  // call used it (server/device/truncation_guard.h); each such region is dropped.
  absl::Status DropTruncated(const std::vector<RegionPin>& pins);

  // Drops every region of `session` (its end); it registers no more.
  void ReleaseSession(const std::string& session);

  // The regions of `session`, or of all sessions when it is empty.
  std::vector<v1::RegionInfo> List(const std::string& session) const;
  int Count() const;

  absl::StatusOr<RegionPin> Find(absl::string_view session, absl::string_view name) const;

  // A 4-byte counter for a doorbell, inside a region of the session.
  absl::StatusOr<Counter> ResolveCounter(const std::string& session, const v1::Doorbell& doorbell,
                                         absl::string_view field) const;

 private:
  mutable absl::Mutex mu_;
  // Orders (session, name) keys, and finds one from string_views without
  // copying them (every request looks up its regions).
  struct KeyLess {
    using is_transparent = void;
    template <typename A, typename B>
    bool operator()(const A& a, const B& b) const {
      const int c = absl::string_view(a.first).compare(absl::string_view(b.first));
      return c != 0 ? c < 0 : absl::string_view(a.second) < absl::string_view(b.second);
    }
  };
  // (session, name) -> region
  std::map<std::pair<std::string, std::string>, RegionPin, KeyLess> regions_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> open_sessions_ ABSL_GUARDED_BY(mu_);
};

// The regions of one request, each looked up in the registry and pinned
// once: a Verify's eight tensors usually live in one or two regions, and a
// pin is an atomic count the device's threads also touch. `session` must
// outlive the lookup.
class RegionLookup {
 public:
  RegionLookup(const RegionRegistry& registry, const std::string& session)
      : registry_(registry), session_(session) {}
  RegionLookup(const RegionRegistry& registry, std::string&& session) = delete;

  absl::StatusOr<const Region*> Find(absl::string_view name);

  // The pins of every region found so far, each once: the views resolved
  // so far stay valid while they are held. The lookup starts afresh.
  std::vector<RegionPin> TakePins() {
    std::vector<RegionPin> pins(std::make_move_iterator(found_.begin()),
                                std::make_move_iterator(found_.end()));
    found_.clear();
    return pins;
  }

  // Resolves `tensor` of the session against `spec`: the region exists, the
  // dtype and shape match, the strides are non-negative, and every element
  // lies inside the region (computed without overflow). Errors name `field`.
  absl::StatusOr<TensorView> ResolveTensor(const v1::RegionTensor& tensor, absl::string_view field,
                                           const TensorSpec& spec);

 private:
  const RegionRegistry& registry_;
  const std::string& session_;
  absl::InlinedVector<RegionPin, 4> found_;  // matched by the region's own name
};

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_ENGINE_REGIONS_H_
