// Reads have no side effects (issue 35), as one check both backends run
// (reads_test on the CPU, gpu_service_test on CUDA): two specstated started
// with the same flags get the same decode loop over a real socket (fresh
// random inputs every step, random acceptances, the same prefill); one of
// them also answers ReadState calls between steps and between a step's
// Verify and its Commit, of blocks with pending tokens (DEFERRED) or ring
// tokens (FAST) and of blocks without. Every pool byte (recurrent and conv,
// every layer) of the two must then be equal: a read may not materialize
// anything in place, since that changes what the pool shows through
// ExportPools and, under FAST, the rounding of every later step. What
// ReadState returns must still be the block's current state: after a Flush
// of every block, each block's bytes are what ReadState read just before.
//
//   ExpectReadsChangeNoPoolByte({"--backend=cpu", "--commit_mode=fast"}, v1::CPU, 24);
#ifndef SPECSTATE_TESTS_INTEGRATION_READS_LOOP_H_
#define SPECSTATE_TESTS_INTEGRATION_READS_LOOP_H_

#include <string>
#include <vector>

#include "specstate/v1/specstate.pb.h"

namespace specstate {
namespace testing {

// The check above, `steps` steps long, against two services started with
// `flags` (which name the backend and the commit mode), the test's buffers
// in `backend`'s memory. Failures are gtest failures (a fatal one ends it);
// the seed drawn is printed, and the reading service's log on a failure.
void ExpectReadsChangeNoPoolByte(const std::vector<std::string>& flags, v1::Backend backend,
                                 int steps);

}  // namespace testing
}  // namespace specstate

#endif  // SPECSTATE_TESTS_INTEGRATION_READS_LOOP_H_
