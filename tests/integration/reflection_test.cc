// Server reflection of the real specstated over a real Unix socket, as
// grpcurl uses it: list the services, fetch the file that defines a symbol
// and read the .proto's comments from it (issue 16: describe showed none).
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"
#include "grpc/reflection/v1/reflection.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/integration/server_process.h"
#include "tests/integration/test_scheduler.h"

namespace specstate {
namespace {

namespace pb = google::protobuf;
namespace rv1 = grpc::reflection::v1;
using ::testing::HasSubstr;
using ::testing::IsSupersetOf;
using testing::ServerProcess;
using testing::ValueOrDie;

class ReflectionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = ValueOrDie(ServerProcess::Start({}));
    channel_ = grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials());
  }
  void TearDown() override {
    if (HasFailure()) std::fprintf(stderr, "server log:\n%s", server_->Log().c_str());
  }

  // Sends `requests` on one ServerReflectionInfo stream (version v1 or
  // v1alpha, whose messages are the same) and returns the answers.
  template <typename Stub, typename Request, typename Response>
  std::vector<Response> Ask(const std::vector<Request>& requests) {
    auto stub = Stub::NewStub(channel_);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    auto stream = stub->ServerReflectionInfo(&ctx);
    std::vector<Response> answers;
    for (const Request& request : requests) {
      EXPECT_TRUE(stream->Write(request));
      Response response;
      EXPECT_TRUE(stream->Read(&response));
      answers.push_back(response);
    }
    stream->WritesDone();
    const grpc::Status status = stream->Finish();
    EXPECT_TRUE(status.ok()) << status.error_code() << ": " << status.error_message();
    return answers;
  }
  std::vector<rv1::ServerReflectionResponse> AskV1(
      const std::vector<rv1::ServerReflectionRequest>& requests) {
    return Ask<rv1::ServerReflection, rv1::ServerReflectionRequest, rv1::ServerReflectionResponse>(
        requests);
  }

  std::unique_ptr<ServerProcess> server_;
  std::shared_ptr<grpc::Channel> channel_;
};

rv1::ServerReflectionRequest ListServices() {
  rv1::ServerReflectionRequest r;
  r.set_list_services("");
  return r;
}
rv1::ServerReflectionRequest Symbol(const std::string& symbol) {
  rv1::ServerReflectionRequest r;
  r.set_file_containing_symbol(symbol);
  return r;
}

template <typename Response>
std::vector<std::string> ServiceNames(const Response& response) {
  std::vector<std::string> names;
  for (const auto& s : response.list_services_response().service()) names.push_back(s.name());
  return names;
}

// Builds the answer's files (the file asked for first, its imports after)
// into `pool`; returns the first.
const pb::FileDescriptor* BuildAnswer(const rv1::ServerReflectionResponse& response,
                                      pb::DescriptorPool* pool) {
  const auto& files = response.file_descriptor_response().file_descriptor_proto();
  const pb::FileDescriptor* first = nullptr;
  for (int i = files.size() - 1; i >= 0; --i) {
    pb::FileDescriptorProto proto;
    if (!proto.ParseFromString(files[i])) {
      ADD_FAILURE() << "file " << i << " of the answer is not a FileDescriptorProto";
      return nullptr;
    }
    first = pool->BuildFile(proto);
    if (first == nullptr) {
      ADD_FAILURE() << proto.name() << " does not build";
      return nullptr;
    }
  }
  return first;
}

TEST_F(ReflectionTest, ListsEveryServiceInBothVersions) {
  const std::vector<std::string> expected = {
      "specstate.v1.SpecState", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
      "grpc.reflection.v1alpha.ServerReflection"};
  const std::vector<rv1::ServerReflectionResponse> v1 = AskV1({ListServices()});
  ASSERT_EQ(v1.size(), 1u);
  EXPECT_THAT(ServiceNames(v1[0]), IsSupersetOf(expected));
  EXPECT_FALSE(v1[0].has_error_response()) << v1[0].error_response().error_message();

  namespace ra = grpc::reflection::v1alpha;
  ra::ServerReflectionRequest list;
  list.set_list_services("*");
  const std::vector<ra::ServerReflectionResponse> v1alpha =
      Ask<ra::ServerReflection, ra::ServerReflectionRequest, ra::ServerReflectionResponse>({list});
  ASSERT_EQ(v1alpha.size(), 1u);
  EXPECT_THAT(ServiceNames(v1alpha[0]), IsSupersetOf(expected));
  EXPECT_EQ(v1alpha[0].original_request().list_services(), "*");
}

TEST_F(ReflectionTest, DescribedMessagesCarryTheProtosComments) {
  const std::vector<rv1::ServerReflectionResponse> answers =
      AskV1({Symbol("specstate.v1.VerifyRequest"), Symbol("specstate.v1.SpecState.Verify")});
  ASSERT_EQ(answers.size(), 2u);
  for (const rv1::ServerReflectionResponse& answer : answers) {
    ASSERT_FALSE(answer.has_error_response()) << answer.error_response().error_message();
    ASSERT_EQ(answer.file_descriptor_response().file_descriptor_proto_size(), 1);
    pb::FileDescriptorProto proto;
    ASSERT_TRUE(proto.ParseFromString(answer.file_descriptor_response().file_descriptor_proto(0)));
    EXPECT_EQ(proto.name(), "specstate/v1/specstate.proto");
    EXPECT_GT(proto.source_code_info().location_size(), 100);
  }
  EXPECT_EQ(answers[0].original_request().file_containing_symbol(), "specstate.v1.VerifyRequest");

  pb::DescriptorPool pool;
  ASSERT_NE(BuildAnswer(answers[0], &pool), nullptr);
  const pb::FieldDescriptor* num_rows = pool.FindFieldByName("specstate.v1.VerifyRequest.num_rows");
  ASSERT_NE(num_rows, nullptr);
  pb::SourceLocation where;
  ASSERT_TRUE(num_rows->GetSourceLocation(&where));
  // specstate.proto: "N rows; row n verifies tokens [query_start_loc[n], ..."
  EXPECT_THAT(where.leading_comments, HasSubstr("N rows; row n verifies tokens"));
  const pb::FieldDescriptor* step = pool.FindFieldByName("specstate.v1.VerifyRequest.step");
  ASSERT_NE(step, nullptr);
  ASSERT_TRUE(step->GetSourceLocation(&where));
  EXPECT_THAT(where.leading_comments, HasSubstr("every call of a step carries the same id"));
}

TEST_F(ReflectionTest, UnknownSymbolsAreNotFoundAndTheStreamGoesOn) {
  rv1::ServerReflectionRequest file;
  file.set_file_by_filename("specstate/v1/nothing.proto");
  rv1::ServerReflectionRequest extension;
  extension.mutable_file_containing_extension()->set_containing_type("specstate.v1.VerifyRequest");
  extension.mutable_file_containing_extension()->set_extension_number(1000);
  rv1::ServerReflectionRequest numbers;
  numbers.set_all_extension_numbers_of_type("specstate.v1.VerifyRequest");
  const std::vector<rv1::ServerReflectionResponse> answers =
      AskV1({Symbol("specstate.v1.NoSuchRequest"), Symbol("specstate.v1.VerifyRequest.no_field"),
             file, extension, numbers, Symbol("grpc.health.v1.Health")});
  ASSERT_EQ(answers.size(), 6u);
  for (int i = 0; i < 4; ++i) {
    SCOPED_TRACE(answers[i].original_request().DebugString());
    ASSERT_TRUE(answers[i].has_error_response());
    EXPECT_EQ(answers[i].error_response().error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_EQ(answers[i].file_descriptor_response().file_descriptor_proto_size(), 0);
  }
  EXPECT_THAT(answers[0].error_response().error_message(),
              HasSubstr("specstate.v1.NoSuchRequest"));
  // Known type, no extensions: an empty list, not an error.
  EXPECT_FALSE(answers[4].has_error_response());
  EXPECT_EQ(answers[4].all_extension_numbers_response().base_type_name(),
            "specstate.v1.VerifyRequest");
  EXPECT_EQ(answers[4].all_extension_numbers_response().extension_number_size(), 0);
  // The health service is described too (from the same embedded set).
  ASSERT_FALSE(answers[5].has_error_response()) << answers[5].error_response().error_message();
  pb::DescriptorPool pool;
  const pb::FileDescriptor* health = BuildAnswer(answers[5], &pool);
  ASSERT_NE(health, nullptr);
  EXPECT_EQ(health->name(), "grpc/health/v1/health.proto");
  EXPECT_NE(pool.FindMethodByName("grpc.health.v1.Health.Check"), nullptr);
}

}  // namespace
}  // namespace specstate
