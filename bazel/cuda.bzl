"""cuda_library: compiles .cu files with the local nvcc for sm_90 (plus compute_90 PTX).

Bazel 4.2.3 has no CUDA rules, so each .cu file is compiled by a genrule and
the objects are archived into a cc_library (alwayslink, so kernels registered
at static-init time survive). List every header a .cu file includes in `hdrs`
(its own) or `cu_deps_hdrs` (from other packages): the genrule sees only those.
Where the toolkit is absent (CUDA_ENABLED is False) no target is created:
callers guard their use with CUDA_ENABLED too.
"""

load("@local_cuda//:defs.bzl", "CUDA_ENABLED", "NVCC")

NVCC_FLAGS = [
    "-std=c++17",
    "-O3",
    "-Xcompiler=-fPIC",
    "-Xcompiler=-ffp-contract=off",
    # sm_90 machine code for Hopper, and compute_90 PTX that newer GPUs
    # (Blackwell) JIT at load; older ones (A100, sm_80) are refused at start.
    "-gencode arch=compute_90,code=sm_90",
    "-gencode arch=compute_90,code=compute_90",
    # The stock kernel, verify and replay share code and flags: no fast math.
    "--fmad=false",
    "-lineinfo",
    "-Wno-deprecated-gpu-targets",
]

def cuda_library(name, srcs, hdrs = [], cu_deps_hdrs = [], deps = [], nvcc_flags = [], **kwargs):
    if not CUDA_ENABLED:
        return
    objs = []
    for src in srcs:
        obj = "_%s_objs/%s.o" % (name, src.rsplit(".", 1)[0])
        native.genrule(
            name = "_%s_%s_nvcc" % (name, src.replace("/", "_").replace(".", "_")),
            srcs = [src] + hdrs + cu_deps_hdrs,
            outs = [obj],
            # A temporary directory of its own: nvcc names its files by
            # process id, which two sandboxes' PID namespaces can share.
            cmd = ("t=$$(mktemp -d) && TMPDIR=$$t %s %s %s -I. -I$(GENDIR) -c $(location %s) " +
                   "-o $@; s=$$?; rm -rf $$t; exit $$s") %
                  (NVCC, " ".join(NVCC_FLAGS), " ".join(nvcc_flags), src),
            message = "nvcc %s" % src,
        )
        objs.append(obj)
    archive = "lib%s_cuda.a" % name
    native.genrule(
        name = "_%s_archive" % name,
        srcs = objs,
        outs = [archive],
        cmd = "ar rcs $@ $(SRCS)",
    )
    native.cc_library(
        name = name,
        srcs = [archive],
        hdrs = hdrs,
        deps = deps + ["@local_cuda//:cudart"],
        alwayslink = True,
        **kwargs
    )
