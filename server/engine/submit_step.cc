// Engine::SubmitStep: a step's Verify calls and its Commit in one RPC, each
// started when the one before it has answered, so that they are enqueued in
// the order given. Built only on the engine's public verbs.
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "server/engine/engine.h"

namespace specstate {
namespace server {

void Engine::SubmitStep(const std::string& session, const v1::SubmitStepRequest& request,
                        Reply<v1::SubmitStepResponse> reply) {
  const int64_t limit = MaxSubmitStepVerifies();
  if (request.verifies_size() > limit) {
    reply(absl::InvalidArgumentError(absl::StrCat(
              "SubmitStep carries ", request.verifies_size(), " Verify calls; at most ", limit,
              " (4 * num_layers) are allowed in one")),
          {});
    return;
  }
  // Each call starts when the one before it has answered (at once in ASYNC
  // mode, later from a device thread in SYNC mode), so they are enqueued in
  // the order given. A loop, not recursion: a call answered at once hands
  // the next one back to the loop instead of starting it from its reply.
  struct Chain {
    Chain(Engine* e, std::string s, const v1::SubmitStepRequest& r,
          Reply<v1::SubmitStepResponse> done)
        : engine(e), session(std::move(s)), request(r), reply(std::move(done)) {}
    Engine* const engine;
    const std::string session;
    const v1::SubmitStepRequest& request;  // owned by the RPC until it is answered
    const Reply<v1::SubmitStepResponse> reply;
    v1::SubmitStepResponse response;
    absl::Mutex mu;
    bool calling = false;           // Run() is inside a Verify call
    bool answered_inline = false;   // ... and that call has answered OK

    static void Run(const std::shared_ptr<Chain>& c, int i) {
      for (; i < c->request.verifies_size(); ++i) {
        {
          absl::MutexLock lock(&c->mu);
          c->calling = true;
          c->answered_inline = false;
        }
        // The engine takes the session from the batch, not from each call.
        c->engine->Verify(c->session, c->request.verifies(i),
                          [c, i](absl::Status s, v1::VerifyResponse r) {
          if (!s.ok()) {
            c->reply(absl::Status(s.code(), absl::StrCat("verifies[", i, "]: ", s.message())), {});
            return;
          }
          bool continue_here = false;
          {
            absl::MutexLock lock(&c->mu);
            *c->response.add_verifies() = std::move(r);
            if (c->calling) {
              c->answered_inline = true;
            } else {
              continue_here = true;
            }
          }
          if (continue_here) Run(c, i + 1);
        });
        absl::MutexLock lock(&c->mu);
        c->calling = false;
        if (!c->answered_inline) return;  // failed, or answers later and goes on from there
      }
      if (!c->request.has_commit()) {
        c->reply(absl::OkStatus(), std::move(c->response));
        return;
      }
      c->engine->Commit(c->session, c->request.commit(), [c](absl::Status s, v1::CommitResponse r) {
        if (!s.ok()) {
          c->reply(absl::Status(s.code(), absl::StrCat("commit: ", s.message())), {});
          return;
        }
        *c->response.mutable_commit() = std::move(r);
        c->reply(absl::OkStatus(), std::move(c->response));
      });
    }
  };
  auto chain = std::make_shared<Chain>(this, session, request, std::move(reply));
  Chain::Run(chain, 0);
}

}  // namespace server
}  // namespace specstate
