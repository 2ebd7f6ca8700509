"""The headers the kernels' CUDA translation units include, by folder.

nvcc runs in a genrule that sees only the files it lists (bazel/cuda.bzl:
cu_deps_hdrs), so each cuda_library of the kernels lists the groups its .cu
files include, directly or not.
"""

# The kernels' arguments, statuses, numbers, per-token math and dispatch.
BASE_HDRS = [
    "//kernels:cuda_status.h",
    "//kernels:device_status.h",
    "//kernels:dtype.h",
    "//kernels:internal/dispatch.h",
    "//kernels:kda_args.h",
    "//kernels:kda_math.h",
    "//kernels:numeric.h",
]

# The device checks every verb shares and their single-block runner.
CHECKS_HDRS = ["//kernels/checks:" + h for h in [
    "block_checker.cuh",
    "commit_plan.h",
    "params.h",
    "prerequisites.h",
    "record_rows.h",
    "rows.h",
    "stock_rows.h",
    "verify_rows.h",
]]

# What every mode shares on CUDA: the launch helpers, the recurrent kernel
# (whose DEFERRED mode reads deferred/pending.h), Verify's checks, the commit
# journal, and the host API of kernels/common's own translation unit.
COMMON_CUDA_HDRS = ["//kernels/common:" + h for h in [
    "cuda/commit_journal.cuh",
    "cuda/common_cuda.h",
    "cuda/cp_async.cuh",
    "cuda/launch.cuh",
    "cuda/pipelined_recurrent.cuh",
    "cuda/recurrent_launch.cuh",
    "cuda/verify_checks.cuh",
    "journal.h",
]] + ["//kernels/deferred:pending.h"]
