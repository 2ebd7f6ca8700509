"""Exposes Debian's gRPC, protobuf, Abseil, GoogleTest and prometheus-cpp to
Bazel, offline.

A repository rule runs `pkg-config` once at fetch time and writes one
`cc_library` per library with the link flags it reports. The targets carry no
`hdrs`: the headers live in /usr/include, which the compiler already searches
(adding `-isystem /usr/include` breaks libstdc++'s #include_next).
Re-run `bazel sync --configure` after upgrading the system packages.
"""

# name -> (pkg-config modules, extra link options)
_LIBS = {
    "absl": ([
        "absl_base",
        "absl_flags",
        "absl_flags_parse",
        "absl_flags_usage",
        "absl_hash",
        "absl_raw_hash_set",
        "absl_random_random",
        "absl_status",
        "absl_statusor",
        "absl_str_format",
        "absl_strings",
        "absl_synchronization",
        "absl_time",
        "absl_cleanup",
    ], []),
    "protobuf": (["protobuf"], []),
    "grpc": (["grpc++", "protobuf"], []),
    # No grpc_reflection (-lgrpc++_reflection): specstated serves reflection
    # itself (server/api/reflection.h), and gRPC's library would register the
    # same v1alpha messages a second time (protobuf aborts at start).
    "gtest": (["gtest", "gmock"], []),
    "gtest_main": (["gtest_main"], []),
    # prometheus-cpp (prometheus-cpp-dev): the registry types and the pull
    # exposer (an HTTP server, civetweb) that serves /metrics.
    "prometheus": (["prometheus-cpp-pull", "prometheus-cpp-core"], []),
}

_TOOLS = {
    "protoc": "/usr/bin/protoc",
    "grpc_cpp_plugin": "/usr/bin/grpc_cpp_plugin",
    "grpc_python_plugin": "/usr/bin/grpc_python_plugin",
}

def _pkg_config(ctx, args):
    result = ctx.execute(["pkg-config"] + args)
    if result.return_code != 0:
        fail("pkg-config %s failed (install the Debian -dev packages listed in README.md): %s" %
             (" ".join(args), result.stderr))
    return result.stdout.strip().split(" ") if result.stdout.strip() else []

def _quote(items):
    return "[" + ", ".join(['"%s"' % i for i in items]) + "]"

def _system_libs_impl(ctx):
    build = ['package(default_visibility = ["//visibility:public"])', ""]
    for name, (modules, extra) in _LIBS.items():
        linkopts = []
        defines = []
        if modules:
            linkopts = _pkg_config(ctx, ["--libs"] + modules)
            for flag in _pkg_config(ctx, ["--cflags"] + modules):
                if flag.startswith("-D"):
                    defines.append(flag[2:])
        linkopts = linkopts + extra + ["-lpthread"]
        build.append("cc_library(\n    name = \"%s\",\n    linkopts = %s,\n    defines = %s,\n)\n" %
                     (name, _quote(linkopts), _quote(defines)))
    for name, path in _TOOLS.items():
        if not ctx.path(path).exists:
            fail("%s not found: apt-get install protobuf-compiler protobuf-compiler-grpc" % path)
        ctx.symlink(path, name)
    build.append("exports_files(%s)" % _quote(list(_TOOLS.keys())))
    ctx.file("WORKSPACE", 'workspace(name = "%s")\n' % ctx.name)
    ctx.file("BUILD", "\n".join(build) + "\n")

system_libs = repository_rule(
    implementation = _system_libs_impl,
    configure = True,
    local = True,
)
