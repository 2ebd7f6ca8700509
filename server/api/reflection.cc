#include "server/api/reflection.h"

#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/descriptor.pb.h"
#include "grpc/reflection/v1/reflection.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"

namespace specstate {
namespace server {
namespace {

namespace pb = google::protobuf;

// Collects protobuf's complaints about a file that does not build.
class CollectErrors final : public pb::DescriptorPool::ErrorCollector {
 public:
  void AddError(const std::string& filename, const std::string& element_name,
                const pb::Message* /*descriptor*/, ErrorLocation /*location*/,
                const std::string& message) override {
    errors_.push_back(absl::StrCat(element_name.empty() ? filename : element_name, ": ", message));
  }
  std::string Joined() const { return absl::StrJoin(errors_, "; "); }

 private:
  std::vector<std::string> errors_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DescriptorIndex>> DescriptorIndex::Create(
    std::string_view descriptor_set) {
  pb::FileDescriptorSet set;
  if (!set.ParseFromArray(descriptor_set.data(), static_cast<int>(descriptor_set.size()))) {
    return absl::InvalidArgumentError(absl::StrCat("the descriptor set (", descriptor_set.size(),
                                                   " bytes) is not a FileDescriptorSet"));
  }
  std::unique_ptr<DescriptorIndex> index(new DescriptorIndex());
  for (const pb::FileDescriptorProto& file : set.file()) {
    CollectErrors errors;
    if (index->pool_.BuildFileCollectingErrors(file, &errors) == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("In the descriptor set: file ", file.name(),
                                                     " does not build: ", errors.Joined()));
    }
    index->serialized_[file.name()] = file.SerializeAsString();
  }
  return index;
}

std::vector<std::string> DescriptorIndex::WithImports(const pb::FileDescriptor* file) const {
  std::vector<std::string> out;
  std::set<std::string> seen;
  std::vector<const pb::FileDescriptor*> todo = {file};
  while (!todo.empty()) {
    const pb::FileDescriptor* f = todo.back();
    todo.pop_back();
    if (!seen.insert(f->name()).second) continue;
    out.push_back(serialized_.at(f->name()));
    for (int i = f->dependency_count() - 1; i >= 0; --i) todo.push_back(f->dependency(i));
  }
  return out;
}

absl::StatusOr<std::vector<std::string>> DescriptorIndex::FileByName(
    const std::string& file_name) const {
  const pb::FileDescriptor* file = pool_.FindFileByName(file_name);
  if (file == nullptr) return absl::NotFoundError(absl::StrCat("no file ", file_name));
  return WithImports(file);
}

absl::StatusOr<std::vector<std::string>> DescriptorIndex::FileContainingSymbol(
    const std::string& symbol) const {
  const pb::FileDescriptor* file = pool_.FindFileContainingSymbol(symbol);
  if (file == nullptr) return absl::NotFoundError(absl::StrCat("no symbol ", symbol));
  return WithImports(file);
}

absl::StatusOr<std::vector<std::string>> DescriptorIndex::FileContainingExtension(
    const std::string& type, int number) const {
  const pb::Descriptor* message = pool_.FindMessageTypeByName(type);
  if (message == nullptr) return absl::NotFoundError(absl::StrCat("no message type ", type));
  const pb::FieldDescriptor* extension = pool_.FindExtensionByNumber(message, number);
  if (extension == nullptr) {
    return absl::NotFoundError(absl::StrCat("no extension ", number, " of ", type));
  }
  return WithImports(extension->file());
}

absl::StatusOr<std::vector<int>> DescriptorIndex::ExtensionNumbersOf(const std::string& type) const {
  const pb::Descriptor* message = pool_.FindMessageTypeByName(type);
  if (message == nullptr) return absl::NotFoundError(absl::StrCat("no message type ", type));
  std::vector<const pb::FieldDescriptor*> extensions;
  pool_.FindAllExtensions(message, &extensions);
  std::vector<int> numbers;
  for (const pb::FieldDescriptor* e : extensions) numbers.push_back(e->number());
  return numbers;
}

bool DescriptorIndex::HasService(const std::string& full_name) const {
  return pool_.FindServiceByName(full_name) != nullptr;
}

namespace {

// One answer; Request and Response are either version's messages (the two
// versions' messages are the same but for the package).
template <typename Request, typename Response>
void Answer(const DescriptorIndex& index, const std::vector<std::string>& services,
            const Request& request, Response* response) {
  response->set_valid_host(request.host());
  *response->mutable_original_request() = request;
  absl::StatusOr<std::vector<std::string>> files = std::vector<std::string>();
  absl::Status status;
  switch (request.message_request_case()) {
    case Request::kFileByFilename:
      files = index.FileByName(request.file_by_filename());
      break;
    case Request::kFileContainingSymbol:
      files = index.FileContainingSymbol(request.file_containing_symbol());
      break;
    case Request::kFileContainingExtension:
      files = index.FileContainingExtension(request.file_containing_extension().containing_type(),
                                            request.file_containing_extension().extension_number());
      break;
    case Request::kAllExtensionNumbersOfType: {
      absl::StatusOr<std::vector<int>> numbers =
          index.ExtensionNumbersOf(request.all_extension_numbers_of_type());
      if (numbers.ok()) {
        auto* out = response->mutable_all_extension_numbers_response();
        out->set_base_type_name(request.all_extension_numbers_of_type());
        for (int n : *numbers) out->add_extension_number(n);
      }
      status = numbers.status();
      break;
    }
    case Request::kListServices: {
      auto* out = response->mutable_list_services_response();
      for (const std::string& name : services) out->add_service()->set_name(name);
      break;
    }
    default:
      status = absl::UnimplementedError("the request sets none of the requests this service knows");
  }
  if (!files.ok()) {
    status = files.status();
  } else if (!files->empty()) {
    auto* out = response->mutable_file_descriptor_response();
    for (std::string& file : *files) out->add_file_descriptor_proto(std::move(file));
  }
  if (!status.ok()) {
    // absl's codes are gRPC's, number for number.
    response->mutable_error_response()->set_error_code(static_cast<int>(status.code()));
    response->mutable_error_response()->set_error_message(std::string(status.message()));
  }
}

// One ServerReflectionInfo stream: read a request, write its answer, until
// the client ends the stream. The answers are computed in memory, at once.
template <typename Request, typename Response>
class InfoReactor final : public grpc::ServerBidiReactor<Request, Response> {
 public:
  InfoReactor(const DescriptorIndex* index, const std::vector<std::string>* services)
      : index_(index), services_(services) {
    this->StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client ended the stream (or went away)
      this->Finish(grpc::Status::OK);
      return;
    }
    response_.Clear();
    Answer(*index_, *services_, request_, &response_);
    this->StartWrite(&response_);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      this->Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the stream broke"));
      return;
    }
    this->StartRead(&request_);
  }

  void OnDone() override { delete this; }

 private:
  const DescriptorIndex* const index_;
  const std::vector<std::string>* const services_;
  Request request_;
  Response response_;
};

}  // namespace

class ReflectionService::V1 final
    : public grpc::reflection::v1::ServerReflection::CallbackService {
 public:
  V1(const DescriptorIndex* index, const std::vector<std::string>* services)
      : index_(index), services_(services) {}
  grpc::ServerBidiReactor<grpc::reflection::v1::ServerReflectionRequest,
                          grpc::reflection::v1::ServerReflectionResponse>*
  ServerReflectionInfo(grpc::CallbackServerContext* /*ctx*/) override {
    return new InfoReactor<grpc::reflection::v1::ServerReflectionRequest,
                           grpc::reflection::v1::ServerReflectionResponse>(index_, services_);
  }

 private:
  const DescriptorIndex* const index_;
  const std::vector<std::string>* const services_;
};

class ReflectionService::V1Alpha final
    : public grpc::reflection::v1alpha::ServerReflection::CallbackService {
 public:
  V1Alpha(const DescriptorIndex* index, const std::vector<std::string>* services)
      : index_(index), services_(services) {}
  grpc::ServerBidiReactor<grpc::reflection::v1alpha::ServerReflectionRequest,
                          grpc::reflection::v1alpha::ServerReflectionResponse>*
  ServerReflectionInfo(grpc::CallbackServerContext* /*ctx*/) override {
    return new InfoReactor<grpc::reflection::v1alpha::ServerReflectionRequest,
                           grpc::reflection::v1alpha::ServerReflectionResponse>(index_,
                                                                                services_);
  }

 private:
  const DescriptorIndex* const index_;
  const std::vector<std::string>* const services_;
};

absl::StatusOr<std::unique_ptr<ReflectionService>> ReflectionService::Create(
    std::string_view descriptor_set, std::vector<std::string> services) {
  absl::StatusOr<std::unique_ptr<DescriptorIndex>> index = DescriptorIndex::Create(descriptor_set);
  if (!index.ok()) return index.status();
  std::vector<std::string> missing;
  for (const std::string& name : services) {
    if (!(*index)->HasService(name)) missing.push_back(name);
  }
  if (!missing.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the descriptor set does not define ", absl::StrJoin(missing, ", "),
                     ": reflection could not describe it"));
  }
  std::unique_ptr<ReflectionService> service(new ReflectionService());
  service->index_ = *std::move(index);
  service->service_names_ = std::move(services);
  service->v1_ = std::make_unique<V1>(service->index_.get(), &service->service_names_);
  service->v1alpha_ = std::make_unique<V1Alpha>(service->index_.get(), &service->service_names_);
  return service;
}

ReflectionService::~ReflectionService() = default;

std::vector<grpc::Service*> ReflectionService::services() const {
  return {v1_.get(), v1alpha_.get()};
}

}  // namespace server
}  // namespace specstate
