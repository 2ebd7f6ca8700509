#include "server/api/reflection.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "google/protobuf/descriptor.pb.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "proto/served_descriptor_set.h"
#include "specstate/v1/specstate.pb.h"

namespace specstate {
namespace server {
namespace {

namespace pb = google::protobuf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

std::unique_ptr<DescriptorIndex> Served() {
  absl::StatusOr<std::unique_ptr<DescriptorIndex>> index =
      DescriptorIndex::Create(proto::ServedDescriptorSet());
  EXPECT_TRUE(index.ok()) << index.status();
  return index.ok() ? *std::move(index) : nullptr;
}

std::vector<std::string> Names(const std::vector<std::string>& files) {
  std::vector<std::string> names;
  for (const std::string& f : files) {
    pb::FileDescriptorProto proto;
    EXPECT_TRUE(proto.ParseFromString(f));
    names.push_back(proto.name());
  }
  return names;
}

TEST(DescriptorIndexTest, ServesSpecStateProtoWithItsComments) {
  std::unique_ptr<DescriptorIndex> index = Served();
  ASSERT_NE(index, nullptr);
  absl::StatusOr<std::vector<std::string>> files =
      index->FileContainingSymbol("specstate.v1.VerifyRequest");
  ASSERT_TRUE(files.ok()) << files.status();
  ASSERT_THAT(Names(*files), ElementsAre("specstate/v1/specstate.proto"));

  pb::FileDescriptorProto proto;
  ASSERT_TRUE(proto.ParseFromString(files->front()));
  ASSERT_GT(proto.source_code_info().location_size(), 0);
  pb::DescriptorPool pool;
  const pb::FileDescriptor* file = pool.BuildFile(proto);
  ASSERT_NE(file, nullptr);
  const pb::FieldDescriptor* num_rows =
      pool.FindFieldByName("specstate.v1.VerifyRequest.num_rows");
  ASSERT_NE(num_rows, nullptr);
  pb::SourceLocation where;
  ASSERT_TRUE(num_rows->GetSourceLocation(&where));
  EXPECT_THAT(where.leading_comments, HasSubstr("N rows; row n verifies tokens"));
}

// The embedded set is the same contract as the generated code, comments
// and JSON names aside: no drift between what is described and what runs.
TEST(DescriptorIndexTest, EmbeddedFileEqualsTheGeneratedDescriptor) {
  std::unique_ptr<DescriptorIndex> index = Served();
  ASSERT_NE(index, nullptr);
  absl::StatusOr<std::vector<std::string>> files =
      index->FileByName("specstate/v1/specstate.proto");
  ASSERT_TRUE(files.ok()) << files.status();
  pb::FileDescriptorProto embedded;
  ASSERT_TRUE(embedded.ParseFromString(files->front()));
  embedded.clear_source_code_info();
  pb::FileDescriptorProto generated;
  v1::VerifyRequest::descriptor()->file()->CopyTo(&generated);
  v1::VerifyRequest::descriptor()->file()->CopyJsonNameTo(&generated);
  EXPECT_EQ(embedded.SerializeAsString(), generated.SerializeAsString());
}

TEST(DescriptorIndexTest, FindsMethodsFieldsAndEveryServedService) {
  std::unique_ptr<DescriptorIndex> index = Served();
  ASSERT_NE(index, nullptr);
  for (const char* symbol : {"specstate.v1.SpecState", "specstate.v1.SpecState.Verify",
                             "specstate.v1.VerifyRequest.num_rows", "specstate.v1.BF16"}) {
    EXPECT_TRUE(index->FileContainingSymbol(symbol).ok()) << symbol;
  }
  for (const char* service : {"specstate.v1.SpecState", "grpc.health.v1.Health",
                              "grpc.reflection.v1.ServerReflection",
                              "grpc.reflection.v1alpha.ServerReflection"}) {
    EXPECT_TRUE(index->HasService(service)) << service;
  }
  absl::StatusOr<std::vector<std::string>> health =
      index->FileContainingSymbol("grpc.health.v1.HealthCheckRequest");
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_THAT(Names(*health), ElementsAre("grpc/health/v1/health.proto"));
}

TEST(DescriptorIndexTest, UnknownNamesAreNotFound) {
  std::unique_ptr<DescriptorIndex> index = Served();
  ASSERT_NE(index, nullptr);
  for (const char* symbol : {"specstate.v1.NoSuchRequest", "specstate.v1.VerifyRequest.no_field",
                             "specstate.v2", ""}) {
    absl::StatusOr<std::vector<std::string>> files = index->FileContainingSymbol(symbol);
    EXPECT_EQ(files.status().code(), absl::StatusCode::kNotFound) << symbol;
  }
  EXPECT_EQ(index->FileByName("specstate/v1/nothing.proto").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(index->FileContainingExtension("specstate.v1.VerifyRequest", 1000).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(index->FileContainingExtension("specstate.v1.Nothing", 1000).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(index->ExtensionNumbersOf("specstate.v1.Nothing").status().code(),
            absl::StatusCode::kNotFound);
  absl::StatusOr<std::vector<int>> none = index->ExtensionNumbersOf("specstate.v1.VerifyRequest");
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_THAT(*none, IsEmpty());
}

// A set of three files: c imports b, b imports a; b extends a's message.
std::string ChainedSet(bool imports_first) {
  pb::FileDescriptorSet set;
  const char* a = R"pb(name: "a.proto" package: "t" syntax: "proto2"
                       message_type {
                         name: "A"
                         extension_range { start: 100 end: 200 }
                       })pb";
  const char* b = R"pb(name: "b.proto" package: "t" syntax: "proto2" dependency: "a.proto"
                       message_type { name: "B" }
                       extension {
                         name: "ext" number: 150 label: LABEL_OPTIONAL type: TYPE_INT32
                         extendee: ".t.A"
                       })pb";
  const char* c = R"pb(name: "c.proto" package: "t" syntax: "proto2" dependency: "b.proto"
                       dependency: "a.proto"
                       message_type { name: "C" })pb";
  std::vector<const char*> order = {a, b, c};
  if (!imports_first) order = {c, b, a};
  for (const char* text : order) {
    EXPECT_TRUE(pb::TextFormat::ParseFromString(text, set.add_file()));
  }
  return set.SerializeAsString();
}

TEST(DescriptorIndexTest, AnswersCarryEveryImportOnceTheFileFirst) {
  absl::StatusOr<std::unique_ptr<DescriptorIndex>> index =
      DescriptorIndex::Create(ChainedSet(/*imports_first=*/true));
  ASSERT_TRUE(index.ok()) << index.status();
  absl::StatusOr<std::vector<std::string>> files = (*index)->FileContainingSymbol("t.C");
  ASSERT_TRUE(files.ok()) << files.status();
  EXPECT_THAT(Names(*files), ElementsAre("c.proto", "b.proto", "a.proto"));

  absl::StatusOr<std::vector<std::string>> ext = (*index)->FileContainingExtension("t.A", 150);
  ASSERT_TRUE(ext.ok()) << ext.status();
  EXPECT_THAT(Names(*ext), ElementsAre("b.proto", "a.proto"));
  absl::StatusOr<std::vector<int>> numbers = (*index)->ExtensionNumbersOf("t.A");
  ASSERT_TRUE(numbers.ok()) << numbers.status();
  EXPECT_THAT(*numbers, ElementsAre(150));
}

TEST(DescriptorIndexTest, BadSetsAreInvalidArguments) {
  absl::StatusOr<std::unique_ptr<DescriptorIndex>> unordered =
      DescriptorIndex::Create(ChainedSet(/*imports_first=*/false));
  EXPECT_EQ(unordered.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(unordered.status().message(), HasSubstr("file c.proto does not build"));

  absl::StatusOr<std::unique_ptr<DescriptorIndex>> garbage = DescriptorIndex::Create("\xff\xff");
  EXPECT_EQ(garbage.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ReflectionServiceTest, RefusesToListAServiceItCannotDescribe) {
  absl::StatusOr<std::unique_ptr<ReflectionService>> service = ReflectionService::Create(
      proto::ServedDescriptorSet(), {"specstate.v1.SpecState", "other.v1.Nothing"});
  EXPECT_EQ(service.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(service.status().message(), HasSubstr("does not define other.v1.Nothing"));

  absl::StatusOr<std::unique_ptr<ReflectionService>> ok =
      ReflectionService::Create(proto::ServedDescriptorSet(), {"specstate.v1.SpecState"});
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ((*ok)->services().size(), 2u);
}

}  // namespace
}  // namespace server
}  // namespace specstate
