"""Generates C++ (protobuf + gRPC) and Python code from .proto files with
Debian's protoc and plugins, symlinked into @system_libs."""

def cc_grpc_library(name, srcs, deps = [], **kwargs):
    """A cc_library of the messages and gRPC stubs of `srcs` (paths in this package).

    The package directory is the import root: proto/specstate/v1/x.proto is
    "specstate/v1/x.proto" to protoc and "specstate/v1/x.pb.h" to C++.
    """
    pkg = native.package_name()
    hdrs = []
    ccs = []
    for src in srcs:
        base = src[:-len(".proto")]
        hdrs += [base + ".pb.h", base + ".grpc.pb.h"]
        ccs += [base + ".pb.cc", base + ".grpc.pb.cc"]
    native.genrule(
        name = name + "_codegen",
        srcs = srcs,
        outs = hdrs + ccs,
        tools = ["@system_libs//:protoc", "@system_libs//:grpc_cpp_plugin"],
        cmd = ("$(location @system_libs//:protoc) -I%s --cpp_out=$(GENDIR)/%s --grpc_out=$(GENDIR)/%s " %
               (pkg, pkg, pkg) +
               "--plugin=protoc-gen-grpc=$(location @system_libs//:grpc_cpp_plugin) " +
               " ".join(["%s/%s" % (pkg, s) for s in srcs])),
        message = "protoc (C++) %s" % name,
    )
    native.cc_library(
        name = name,
        srcs = ccs,
        hdrs = hdrs,
        includes = ["."],
        deps = deps + ["@system_libs//:grpc"],
        **kwargs
    )

def py_grpc_library(name, srcs, **kwargs):
    """A py_library of the messages and gRPC stubs of `srcs` (paths in this package),
    with the package directory as import root (module specstate.v1.specstate_pb2)."""
    pkg = native.package_name()
    outs = []
    for src in srcs:
        base = src[:-len(".proto")]
        outs += [base + "_pb2.py", base + "_pb2_grpc.py"]
    native.genrule(
        name = name + "_codegen",
        srcs = srcs,
        outs = outs,
        tools = ["@system_libs//:protoc", "@system_libs//:grpc_python_plugin"],
        cmd = ("$(location @system_libs//:protoc) -I%s --python_out=$(GENDIR)/%s --grpc_out=$(GENDIR)/%s " %
               (pkg, pkg, pkg) +
               "--plugin=protoc-gen-grpc=$(location @system_libs//:grpc_python_plugin) " +
               " ".join(["%s/%s" % (pkg, s) for s in srcs])),
        message = "protoc (Python) %s" % name,
    )
    native.py_library(
        name = name,
        srcs = outs,
        imports = ["."],
        **kwargs
    )
