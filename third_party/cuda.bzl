"""Detects the local CUDA toolkit and describes it to Bazel.

Writes @local_cuda with:
  - defs.bzl: CUDA_ENABLED (bool) and NVCC (path), read by //bazel:cuda.bzl;
  - //:cudart: the CUDA runtime (headers + static libcudart) when the toolkit exists.
The toolkit is looked up at $CUDA_PATH or /usr/local/cuda. SPECSTATE_CUDA=0
forces a CPU-only build even where nvcc exists; SPECSTATE_CUDA=1 makes a
missing toolkit an error instead of a silent CPU-only build.
"""

def _cuda_configure_impl(ctx):
    mode = ctx.os.environ.get("SPECSTATE_CUDA", "auto")
    root = ctx.os.environ.get("CUDA_PATH", "/usr/local/cuda")
    nvcc = root + "/bin/nvcc"
    found = ctx.path(nvcc).exists and ctx.path(root + "/include/cuda_runtime.h").exists
    if mode == "1" and not found:
        fail("SPECSTATE_CUDA=1 but no CUDA toolkit at %s (set CUDA_PATH)" % root)
    enabled = found and mode != "0"

    ctx.file("WORKSPACE", 'workspace(name = "%s")\n' % ctx.name)
    ctx.file("defs.bzl", "CUDA_ENABLED = %s\nNVCC = %r\nCUDA_ROOT = %r\n" %
                         (enabled, nvcc, root))
    if not enabled:
        ctx.file("BUILD", 'package(default_visibility = ["//visibility:public"])\n' +
                          'exports_files(["defs.bzl"])\n')
        return
    ctx.symlink(root + "/include", "include")
    ctx.file("BUILD", """package(default_visibility = ["//visibility:public"])

exports_files(["defs.bzl"])

# Static runtime: the binaries then need no libcudart.so beside them, and
# still start (and fall back to the CPU backend) where no driver exists. The
# driver API is reached through cudaGetDriverEntryPoint, never -lcuda.
cc_library(
    name = "cudart",
    hdrs = glob(["include/**/*.h", "include/**/*.hpp"]),
    includes = ["include"],
    linkopts = [
        "-L{root}/lib64",
        "-lcudart_static",
        "-ldl",
        "-lrt",
        "-lpthread",
    ],
)

# CUPTI, for the GPU timeline tracer only (tools/gpu/trace): never linked into
# the service.
cc_library(
    name = "cupti",
    linkopts = ["-L{root}/lib64", "-lcupti"],
    deps = [":cudart"],
)
""".format(root = root))

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["SPECSTATE_CUDA", "CUDA_PATH"],
    configure = True,
    local = True,
)
