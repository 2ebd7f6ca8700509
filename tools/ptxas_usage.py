#!/usr/bin/env python3
"""Registers, spills and code bytes of each kernel in a .cu file, as ptxas
reports them for sm_90 with the build's nvcc flags (read from
bazel/cuda.bzl), one row a kernel whose demangled name matches REGEX; code
bytes are the size of the kernel's .text section in the cubin (16 bytes a
SASS instruction). Runs here, no GPU needed (a few minutes for
kernels/fast/cuda/fast_cuda.cu).

    tools/ptxas_usage.py kernels/fast/cuda/fast_cuda.cu 'FastVerifyKernel<.*128, 3, false, false'
"""
import ast
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_flags():
    """NVCC_FLAGS of bazel/cuda.bzl, each split as the genrule's shell would."""
    text = open(os.path.join(ROOT, "bazel", "cuda.bzl")).read()
    literal = re.search(r"NVCC_FLAGS = (\[.*?\])", text, re.S).group(1)
    literal = re.sub(r"#[^\n]*", "", literal)
    return [part for flag in ast.literal_eval(literal) for part in flag.split()]


def text_sizes(keep_dir):
    """{mangled kernel name: bytes of its .text section} over the cubins
    nvcc kept in keep_dir (readelf's section table)."""
    sizes = {}
    for name in os.listdir(keep_dir):
        if not name.endswith(".cubin"):
            continue
        table = subprocess.run(["readelf", "-S", "-W", os.path.join(keep_dir, name)],
                               capture_output=True, text=True).stdout
        for line in table.splitlines():
            m = re.search(r"\]\s+\.text\.(\S+)\s+\S+\s+\S+\s+\S+\s+([0-9a-f]+)\s", line)
            if m:
                sizes[m.group(1)] = int(m.group(2), 16)
    return sizes


def main(argv):
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    src, pattern = argv[1], re.compile(argv[2] if len(argv) == 3 else ".")
    nvcc = os.environ.get("NVCC", "/usr/local/cuda/bin/nvcc")
    gendir = os.path.join(ROOT, "bazel-bin")
    with tempfile.TemporaryDirectory() as tmp:
        run = subprocess.run([nvcc] + build_flags() + ["-Xptxas", "-v", "-I" + ROOT, "-I" + gendir,
                              "--keep", "--keep-dir", tmp, "-c", src, "-o",
                              os.path.join(tmp, "out.o")],
                             cwd=ROOT, capture_output=True, text=True)
        code_bytes = text_sizes(tmp)
    if run.returncode != 0:
        print(run.stderr, file=sys.stderr)
        return run.returncode
    kernel, spills, rows = None, "", []
    for line in run.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            kernel = m.group(1)
            continue
        if kernel and "spill stores" in line:
            spills = line.strip()
        m = re.search(r"Used (\d+) registers", line)
        if kernel and m:
            name = subprocess.run(["c++filt", kernel], capture_output=True, text=True).stdout.strip()
            name = name.replace("(anonymous namespace)::", "")
            name = re.sub(r"\b[A-Za-z_]\w*::", "", name)
            name = re.sub(r"\((PipeCopy|CheckpointPassKind|FoldMode|Staging)\)", "", name)  # enum casts
            name = re.sub(r"^void ", "", name.split("(")[0])
            if pattern.search(name):
                stores = re.search(r"(\d+) bytes spill stores", spills).group(1)
                loads = re.search(r"(\d+) bytes spill loads", spills).group(1)
                rows.append((name, m.group(1), stores, loads, str(code_bytes.get(kernel, "?"))))
            kernel = None
    print("| kernel | registers | spill stores (bytes) | spill loads (bytes) | code (bytes) |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
