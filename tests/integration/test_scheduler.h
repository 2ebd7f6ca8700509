// Test helpers shared by the integration tests: status assertions and a
// driving scheduler with small, valid requests over a real socket.
//
//   Scheduler s(*client);                  // a driving session, params loaded
//   ASSERT_OK(s.VerifyAll(1));
//   ASSERT_OK(s.session().Commit(s.Commit(1)).status());
#ifndef SPECSTATE_TESTS_INTEGRATION_TEST_SCHEDULER_H_
#define SPECSTATE_TESTS_INTEGRATION_TEST_SCHEDULER_H_

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/lib/client.h"
#include "client/lib/shared_memory.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/base/fnv1a.h"

namespace specstate {
namespace testing {

using client::Client;
using client::Session;
using client::SharedMemory;

#define ASSERT_OK(expr)                                   \
  do {                                                    \
    const absl::Status assert_ok_status = (expr);         \
    ASSERT_TRUE(assert_ok_status.ok()) << assert_ok_status; \
  } while (0)

template <typename T>
T ValueOrDie(absl::StatusOr<T> v) {
  EXPECT_TRUE(v.ok()) << v.status();
  return *std::move(v);
}

inline void ExpectError(const absl::Status& s, absl::StatusCode code, const std::string& substring) {
  EXPECT_EQ(s.code(), code) << s;
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr(substring));
}

using ::specstate::server::Fnv1a;

// A driving scheduler with small, valid requests: N rows of 2 tokens from
// checkpoints 1..N, every layer's parameters loaded.
class Scheduler {
 public:
  static constexpr int kRows = 3;
  static constexpr int kTokensPerRow = 2;

  // `backend`: where its buffers live, the service's backend (v1::CUDA:
  // device memory; write and read them through WriteAct, Pools, Outputs).
  explicit Scheduler(Client& c, bool drive = true, v1::Backend backend = v1::CPU) : c_(c) {
    layout_ = ValueOrDie(c.GetLayout());
    session_ = ValueOrDie(c.OpenSession("test scheduler", drive));
    memory_ = ValueOrDie(SharedMemory::Create(backend));
    pools_ = ValueOrDie(memory_->MapPools(ValueOrDie(c.ExportPools())));
    H_ = layout_.num_heads();
    K_ = layout_.head_dim();
    T_ = kRows * kTokensPerRow;
    const int64_t per = T_ * H_ * K_ * 2;
    acts_ = ValueOrDie(memory_->Allocate(5 * per + T_ * H_ * 2 + 4096));
    std::vector<uint16_t> random(acts_->byte_size() / 2);
    uint32_t x = 12345;
    for (auto& v : random) {  // small bf16 values, never zero
      x = x * 1664525u + 1013904223u;
      v = static_cast<uint16_t>(0x3c00 + (x >> 24));
    }
    EXPECT_TRUE(memory_->CopyIn(acts_->data(), random.data(), random.size() * 2).ok());
    ValueOrDie(session_->RegisterBuffer(*acts_, "acts"));
    if (drive && layout_.layer_kind() == v1::KDA) {  // GDN layers have no parameters
      for (int l = 0; l < layout_.num_layers(); ++l) EXPECT_TRUE(LoadParams(l).ok());
    }
  }

  absl::Status LoadParams(int layer) {
    v1::LoadLayerParamsRequest p;
    p.set_layer(layer);
    for (int h = 0; h < H_; ++h) p.mutable_a_log()->mutable_values()->add_values(-0.5f);
    for (int i = 0; i < H_ * K_; ++i) p.mutable_dt_bias()->mutable_values()->add_values(0.25f);
    return session_->LoadLayerParams(p);
  }

  char* Act(int which) { return static_cast<char*>(acts_->data()) + which * T_ * H_ * K_ * 2; }

  v1::VerifyRequest Verify(uint64_t step, int layer) {
    v1::VerifyRequest v;
    v.set_step(step);
    v.set_layer(layer);
    v.set_num_rows(kRows);
    auto* qsl = v.mutable_query_start_loc()->mutable_values();
    for (int i = 0; i <= kRows; ++i) qsl->add_values(i * kTokensPerRow);
    auto* idx = v.mutable_state_indices()->mutable_values();
    for (int i = 0; i < kRows; ++i) idx->add_values(1 + i);
    const std::vector<int64_t> shape = {T_, H_, K_};
    *v.mutable_q() = ValueOrDie(session_->Tensor(Act(0), DType::kBFloat16, shape));
    *v.mutable_k() = ValueOrDie(session_->Tensor(Act(1), DType::kBFloat16, shape));
    *v.mutable_v() = ValueOrDie(session_->Tensor(Act(2), DType::kBFloat16, shape));
    *v.mutable_g() = ValueOrDie(session_->Tensor(Act(3), DType::kBFloat16, shape));
    *v.mutable_o() = ValueOrDie(session_->Tensor(Act(4), DType::kBFloat16, shape));
    *v.mutable_beta() = ValueOrDie(session_->Tensor(Act(5), DType::kBFloat16, {T_, H_}));
    return v;
  }

  absl::Status VerifyAll(uint64_t step) {
    for (int l = 0; l < layout_.num_layers(); ++l) {
      absl::StatusOr<v1::VerifyResponse> r = session_->Verify(Verify(step, l));
      if (!r.ok()) return r.status();
    }
    return absl::OkStatus();
  }

  v1::CommitRequest Commit(uint64_t step, std::vector<int> accepted = {1, 2, 2}) {
    v1::CommitRequest c;
    c.set_step(step);
    for (int a : accepted) c.mutable_num_accepted()->mutable_values()->add_values(a);
    return c;
  }

  // Activation `which` (q, k, v, g, o, beta: 0..5) from host memory.
  void WriteAct(int which, const void* host, uint64_t bytes) {
    EXPECT_TRUE(memory_->CopyIn(Act(which), host, bytes).ok());
  }
  // Every byte of every pool.
  std::string Pools() {
    std::string bytes(pools_->description().allocation_bytes(), '\0');
    EXPECT_TRUE(memory_->CopyOut(&bytes[0], pools_->base(), bytes.size()).ok());
    return bytes;
  }
  // Writes them back, as a scheduler may (prefill writes the pools).
  void RestorePools(const std::string& bytes) {
    EXPECT_TRUE(memory_->CopyIn(pools_->base(), bytes.data(), bytes.size()).ok());
  }
  std::string Outputs() {
    std::string bytes(T_ * H_ * K_ * 2, '\0');
    EXPECT_TRUE(memory_->CopyOut(&bytes[0], Act(4), bytes.size()).ok());
    return bytes;
  }

  Session& session() { return *session_; }
  SharedMemory& memory() { return *memory_; }
  const client::SharedBuffer& acts() const { return *acts_; }
  const v1::Layout& layout() const { return layout_; }
  std::unique_ptr<Session>& session_ptr() { return session_; }

 private:
  Client& c_;
  v1::Layout layout_;
  std::unique_ptr<Session> session_;
  std::unique_ptr<SharedMemory> memory_;
  std::unique_ptr<client::MappedPools> pools_;
  std::unique_ptr<client::SharedBuffer> acts_;
  int H_ = 0, K_ = 0;
  int64_t T_ = 0;
};

}  // namespace testing
}  // namespace specstate

#endif  // SPECSTATE_TESTS_INTEGRATION_TEST_SCHEDULER_H_
