// gRPC server reflection (grpc.reflection.v1 and grpc.reflection.v1alpha)
// answered from a FileDescriptorSet built with source info, so that
// `grpcurl describe` shows the .proto's comments.
//
// gRPC's own reflection plugin (libgrpc++_reflection) serves
// DescriptorPool::generated_pool(), which cannot be replaced, and whose
// files carry no comments: protoc strips source info from the descriptors
// it compiles into C++. specstated embeds the set instead
// (//proto:served_descriptor_set) and serves it with this service; it must
// not link libgrpc++_reflection, which defines the v1alpha messages too.
//
//   auto reflection = ReflectionService::Create(proto::ServedDescriptorSet(),
//                                               {"specstate.v1.SpecState", ...}).value();
//   for (grpc::Service* s : reflection->services()) builder.RegisterService(s);
#ifndef SPECSTATE_SERVER_API_REFLECTION_H_
#define SPECSTATE_SERVER_API_REFLECTION_H_

#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/grpcpp.h"

namespace specstate {
namespace server {

// The files of a FileDescriptorSet, looked up as reflection asks: by name,
// by a symbol they define, by extension. Answers are serialized
// FileDescriptorProtos exactly as the set holds them (source info
// included): the file asked for first, then every file it imports,
// transitively, each once. Thread-safe (immutable after Create).
class DescriptorIndex {
 public:
  // Parses `descriptor_set` (a serialized google.protobuf.FileDescriptorSet
  // whose files come after the files they import, as protoc's
  // --include_imports writes them) and builds its files.
  // \returns INVALID_ARGUMENT if it does not parse or a file does not build
  //   (the message names the file and protobuf's complaint).
  static absl::StatusOr<std::unique_ptr<DescriptorIndex>> Create(std::string_view descriptor_set);

  // \returns NOT_FOUND for a file the set does not hold.
  absl::StatusOr<std::vector<std::string>> FileByName(const std::string& file_name) const;
  // `symbol` is fully qualified: a message, enum, service, method, field,
  // enum value or extension ("specstate.v1.VerifyRequest",
  // "specstate.v1.SpecState.Verify").
  // \returns NOT_FOUND for a symbol no file of the set defines.
  absl::StatusOr<std::vector<std::string>> FileContainingSymbol(const std::string& symbol) const;
  // \returns NOT_FOUND for an unknown message type or extension number.
  absl::StatusOr<std::vector<std::string>> FileContainingExtension(const std::string& type,
                                                                   int number) const;
  // The numbers of every extension of message `type` the set defines.
  // \returns NOT_FOUND for an unknown message type.
  absl::StatusOr<std::vector<int>> ExtensionNumbersOf(const std::string& type) const;

  // Whether the set defines the service `full_name`.
  bool HasService(const std::string& full_name) const;

 private:
  DescriptorIndex() = default;
  std::vector<std::string> WithImports(const google::protobuf::FileDescriptor* file) const;

  google::protobuf::DescriptorPool pool_;
  std::map<std::string, std::string> serialized_;  // file name -> FileDescriptorProto
};

// The reflection services, both versions, over one DescriptorIndex.
// ServerReflectionInfo streams answer each request in order; errors are
// ErrorResponses with gRPC's status codes, as the protocol has it (the
// stream itself ends OK when the client ends it).
class ReflectionService {
 public:
  // `services`: the full names list_services reports, which should be every
  // service the server registers, these two included
  // ("grpc.reflection.v1.ServerReflection",
  // "grpc.reflection.v1alpha.ServerReflection").
  // \returns INVALID_ARGUMENT if the set does not parse or build, or does
  //   not define one of `services` (reflection could not describe it).
  static absl::StatusOr<std::unique_ptr<ReflectionService>> Create(
      std::string_view descriptor_set, std::vector<std::string> services);
  ~ReflectionService();

  // The two services to register with the ServerBuilder; they live as long
  // as this object.
  std::vector<grpc::Service*> services() const;

  class V1;
  class V1Alpha;

 private:
  ReflectionService() = default;
  std::unique_ptr<DescriptorIndex> index_;
  std::vector<std::string> service_names_;
  std::unique_ptr<V1> v1_;
  std::unique_ptr<V1Alpha> v1alpha_;
};

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_API_REFLECTION_H_
