#include "server/engine/regions.h"

#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/descriptor.h"
#include "server/config/config.h"

namespace specstate {
namespace server {

Region::~Region() {
  mapped_.reset();
  std::vector<std::function<void()>> callbacks;
  {
    absl::MutexLock lock(&mu_);
    callbacks.swap(on_unmapped_);
  }
  for (auto& fn : callbacks) fn();
}

void Region::OnUnmapped(std::function<void()> fn) {
  absl::MutexLock lock(&mu_);
  on_unmapped_.push_back(std::move(fn));
}

void RegionRegistry::OpenSession(const std::string& session) {
  absl::MutexLock lock(&mu_);
  open_sessions_.insert(session);
}

absl::Status RegionRegistry::Register(const std::string& session, const std::string& name,
                                      std::unique_ptr<MappedRegion> mapped) {
  if (name.empty()) return absl::InvalidArgumentError("region name is empty");
  absl::MutexLock lock(&mu_);
  if (open_sessions_.count(session) == 0) {
    return absl::FailedPreconditionError(
        "the session has ended: its regions were released, and it registers no more");
  }
  auto key = std::make_pair(session, name);
  if (regions_.count(key) != 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("region \"", name, "\" is already registered by this session"));
  }
  regions_.emplace(key, std::make_shared<Region>(session, name, std::move(mapped)));
  return absl::OkStatus();
}

absl::Status RegionRegistry::Unregister(const std::string& session, const std::string& name,
                                        std::function<void()> unmapped) {
  RegionPin region;
  {
    absl::MutexLock lock(&mu_);
    auto it = regions_.find(std::make_pair(session, name));
    if (it == regions_.end()) {
      return absl::NotFoundError(absl::StrCat("no region \"", name, "\" in this session"));
    }
    region = std::move(it->second);
    regions_.erase(it);
  }
  region->MarkUnregistered();
  region->OnUnmapped(std::move(unmapped));
  region.reset();  // the last reference unless in-flight work pins it
  return absl::OkStatus();
}

void RegionRegistry::Drop(const RegionPin& region) {
  RegionPin dropped;  // released after the lock
  {
    absl::MutexLock lock(&mu_);
    auto it = regions_.find(std::make_pair(region->session(), region->name()));
    if (it == regions_.end() || it->second != region) return;
    dropped = std::move(it->second);
    regions_.erase(it);
  }
  dropped->MarkUnregistered();
}

void RegionRegistry::ReleaseSession(const std::string& session) {
  std::vector<RegionPin> dropped;
  {
    absl::MutexLock lock(&mu_);
    open_sessions_.erase(session);
    for (auto it = regions_.begin(); it != regions_.end();) {
      if (it->first.first == session) {
        it->second->MarkUnregistered();
        dropped.push_back(std::move(it->second));
        it = regions_.erase(it);
      } else {
        ++it;
      }
    }
  }
  // Unmapped here, or by the last in-flight work that pins them.
}

std::vector<v1::RegionInfo> RegionRegistry::List(const std::string& session) const {
  std::vector<v1::RegionInfo> out;
  absl::MutexLock lock(&mu_);
  for (const auto& [key, region] : regions_) {
    if (!session.empty() && key.first != session) continue;
    v1::RegionInfo info;
    info.set_session_id(key.first);
    info.set_name(key.second);
    info.set_kind(std::string(region->kind()));
    info.set_byte_size(region->byte_size());
    info.set_in_use(static_cast<int32_t>(region.use_count() - 1));
    out.push_back(std::move(info));
  }
  return out;
}

int RegionRegistry::Count() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(regions_.size());
}

absl::StatusOr<RegionPin> RegionRegistry::Find(absl::string_view session,
                                               absl::string_view name) const {
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(std::make_pair(session, name));
  if (it == regions_.end()) {
    return absl::NotFoundError(absl::StrCat("no region \"", name, "\" in this session"));
  }
  return it->second;
}

namespace {

// A wanted shape: "*" for a dimension of any size.
std::string ShapeString(const Dims& shape) {
  std::vector<std::string> dims;
  for (int64_t d : shape) dims.push_back(d < 0 ? "*" : absl::StrCat(d));
  return absl::StrCat("[", absl::StrJoin(dims, ", "), "]");
}

// A given shape, as given.
std::string GivenShapeString(const Dims& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// The wire's name of a kernel dtype (the proto enum's: "BF16"), the one
// spelling of dtypes in the service's messages.
std::string WireDTypeName(DType dtype) { return v1::DType_Name(ToProto(dtype)); }

// The DType values a tensor may carry, with their numbers: "FP32 (1), FP16
// (2), BF16 (3), INT32 (4)".
std::string AcceptedDTypes() {
  const google::protobuf::EnumDescriptor* e = v1::DType_descriptor();
  std::vector<std::string> names;
  for (int i = 0; i < e->value_count(); ++i) {
    const google::protobuf::EnumValueDescriptor* v = e->value(i);
    if (v->number() == v1::DTYPE_UNSPECIFIED) continue;
    names.push_back(absl::StrCat(v->name(), " (", v->number(), ")"));
  }
  return absl::StrJoin(names, ", ");
}

}  // namespace

absl::StatusOr<const Region*> RegionLookup::Find(absl::string_view name) {
  for (const RegionPin& pin : found_) {
    if (pin->name() == name) return pin.get();
  }
  absl::StatusOr<RegionPin> pin = registry_.Find(session_, name);
  if (!pin.ok()) return pin.status();
  found_.push_back(*std::move(pin));
  return found_.back().get();
}

absl::StatusOr<TensorView> RegionLookup::ResolveTensor(const v1::RegionTensor& t,
                                                       absl::string_view field,
                                                       const TensorSpec& spec) {
  if (t.region().empty()) {
    // An absent message reads as an empty one: every field at its default.
    if (t.ByteSizeLong() == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": missing (a RegionTensor with region, shape and dtype is required)"));
    }
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": region is not set (the name a RegisterRegion of this session gave)"));
  }
  absl::StatusOr<const Region*> region = Find(t.region());
  if (!region.ok()) return absl::NotFoundError(absl::StrCat(field, ": ", region.status().message()));
  if (t.dtype() == v1::DTYPE_UNSPECIFIED) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": dtype is not set (expected ",
                                                   WireDTypeName(spec.dtype), ")"));
  }
  if (!v1::DType_IsValid(t.dtype())) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": dtype ", static_cast<int>(t.dtype()), " is not a DType (the values are ",
        AcceptedDTypes(), "); expected ", WireDTypeName(spec.dtype)));
  }
  const int rank = static_cast<int>(spec.shape.size());
  Dims shape(t.shape().begin(), t.shape().end());
  if (static_cast<int>(shape.size()) != rank) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": shape ", GivenShapeString(shape),
                                                   " has rank ", shape.size(), ", expected ",
                                                   ShapeString(spec.shape)));
  }
  const DType want = spec.dtype;
  const bool dtype_ok = (t.dtype() == v1::FP32 && want == DType::kFloat32) ||
                        (t.dtype() == v1::FP16 && want == DType::kFloat16) ||
                        (t.dtype() == v1::BF16 && want == DType::kBFloat16) ||
                        (t.dtype() == v1::INT32 && want == DType::kInt32);
  if (!dtype_ok) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": dtype ", v1::DType_Name(t.dtype()),
                                                   ", expected ", WireDTypeName(want)));
  }
  for (int d = 0; d < rank; ++d) {
    if (shape[d] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": shape ", GivenShapeString(shape),
                                                     ": dimension ", d, " is negative"));
    }
    if (spec.shape[d] >= 0 && shape[d] != spec.shape[d]) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": shape ", GivenShapeString(shape),
                                                     ", expected ", ShapeString(spec.shape)));
    }
  }
  Dims strides(t.strides().begin(), t.strides().end());
  if (strides.empty()) {
    strides.assign(rank, 1);
    for (int d = rank - 2; d >= 0; --d) strides[d] = strides[d + 1] * std::max<int64_t>(shape[d + 1], 1);
  } else if (static_cast<int>(strides.size()) != rank) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", strides.size(),
                                                   " strides for a tensor of rank ", rank));
  }
  int64_t dense = 1;
  for (int d = rank - 1; d >= 0; --d) {
    if (strides[d] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": stride ", d, " is negative"));
    }
    if (d >= rank - spec.dense_inner && shape[d] > 1 && strides[d] != dense) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": stride of dimension ", d, " is ",
                                                     strides[d], ", must be ", dense,
                                                     " (these dimensions must be dense)"));
    }
    dense *= shape[d];
  }
  // Last element offset, with overflow checks: every product and sum stays
  // below the region size, which is far below INT64_MAX.
  const uint64_t elem = DTypeSize(want);
  const uint64_t size = (*region)->byte_size();
  if (t.offset_bytes() % elem != 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": offset_bytes ", t.offset_bytes(),
                                                   " is not a multiple of the element size ",
                                                   elem));
  }
  bool empty = false;
  uint64_t last = 0;  // elements
  for (int d = 0; d < rank; ++d) {
    if (shape[d] == 0) empty = true;
    if (shape[d] <= 1) continue;
    const uint64_t extent = static_cast<uint64_t>(shape[d] - 1);
    const uint64_t stride = static_cast<uint64_t>(strides[d]);
    if (stride != 0 && extent > (size / elem) / stride) {
      return absl::OutOfRangeError(absl::StrCat(field, ": shape ", GivenShapeString(shape),
                                                " with these strides reaches past region \"",
                                                t.region(), "\" (", size, " bytes)"));
    }
    last += extent * stride;
    if (last > size / elem) {
      return absl::OutOfRangeError(absl::StrCat(field, ": shape ", GivenShapeString(shape),
                                                " with these strides reaches past region \"",
                                                t.region(), "\" (", size, " bytes)"));
    }
  }
  const uint64_t needed = empty ? 0 : (last + 1) * elem;
  if (t.offset_bytes() > size || needed > size - t.offset_bytes()) {
    return absl::OutOfRangeError(absl::StrCat(field, ": ", needed, " bytes at offset ",
                                              t.offset_bytes(), " are past the end of region \"",
                                              t.region(), "\" (", size, " bytes)"));
  }
  TensorView view;
  view.data = static_cast<char*>((*region)->data()) + t.offset_bytes();
  view.shape = std::move(shape);
  view.strides = std::move(strides);
  view.region = *region;
  view.span = (*region)->Span(t.offset_bytes(), needed);
  return view;
}

absl::StatusOr<Counter> RegionRegistry::ResolveCounter(
    const std::string& session, const v1::Doorbell& doorbell, absl::string_view field) const {
  absl::StatusOr<RegionPin> region = Find(session, doorbell.region());
  if (!region.ok()) return absl::NotFoundError(absl::StrCat(field, ": ", region.status().message()));
  if (doorbell.offset_bytes() % 4 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": offset_bytes ", doorbell.offset_bytes(), " is not 4-byte aligned"));
  }
  const uint64_t size = (*region)->byte_size();
  if (doorbell.offset_bytes() > size || size - doorbell.offset_bytes() < 4) {
    return absl::OutOfRangeError(absl::StrCat(field, ": offset_bytes ", doorbell.offset_bytes(),
                                              " is past the end of region \"", doorbell.region(),
                                              "\" (", size, " bytes)"));
  }
  Counter counter;
  counter.word = reinterpret_cast<uint32_t*>(static_cast<char*>((*region)->data()) +
                                             doorbell.offset_bytes());
  counter.span = (*region)->Span(doorbell.offset_bytes(), 4);
  counter.pin = *std::move(region);
  return counter;
}

absl::Status RegionRegistry::DropTruncated(const std::vector<RegionPin>& pins) {
  absl::Status lost;
  for (const RegionPin& pin : pins) {
    if (pin == nullptr || !pin->faulted()) continue;
    Drop(pin);
    if (lost.ok()) {
      lost = absl::DataLossError(absl::StrCat(
          "region \"", pin->name(), "\" was truncated by its owner while this call used it: the "
          "call failed, and the region was unregistered (register the buffer again)"));
    }
  }
  return lost;
}

}  // namespace server
}  // namespace specstate
