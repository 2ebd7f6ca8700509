"""docs/protocol.md's examples, run as written (issue 16), so they cannot rot.

Every ```sh block of docs/protocol.md runs, in order, in one bash process, as
a reader's shell would run them pasted one after the other; `set -e`: a
command that fails fails the test. Three things differ from a reader's shell,
and only these:

- `bazel-bin/server/specstated` is this test's //server:specstated;
- the /tmp/specstate* paths (the servers' sockets, the session's FIFO) move
  into a fresh temporary directory, and the shared-memory names /my-acts and
  /my-meta get a suffix of this run's, so that runs side by side, and a
  reader's own server, do not meet;
- `grpcurl`, which Debian 12 does not package, is tests/docs/grpcurl_standin.py:
  it learns the methods through the server's reflection, as grpcurl does, and
  parses each JSON body into the method's request message with protobuf's
  json_format (the same proto3 JSON mapping).

A block whose first line is "# CUDA backend only." does not run (no GPU
here); its grpcurl bodies are parsed into their methods' request messages
instead, with placeholder values for the shell variables, so that their
field names and types are still checked.

Then: every reply the page shows as a `# -> {...}` comment that is JSON
equals one that its block printed, `describe` printed num_rows' comment from
specstate.proto, `list` named the services, and the align block's `od`
printed the RecordStateBlocks outputs it promises.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import unittest
from typing import Any, Dict, List, Tuple

import junit_runner
from google.protobuf import json_format
from specstate.v1 import specstate_pb2 as pb

_WORKSPACE = os.environ.get("TEST_WORKSPACE", "specstate")
_CUDA_MARK = "# CUDA backend only."


def _runfile(relative: str) -> str:
    for root in (os.environ.get("TEST_SRCDIR"), os.environ.get("RUNFILES_DIR")):
        if root:
            path = os.path.join(root, _WORKSPACE, relative)
            if os.path.exists(path):
                return path
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(here, "..", "..", relative)


def _blocks(markdown: str) -> List[str]:
    return re.findall(r"^```sh\n(.*?)^```$", markdown, flags=re.S | re.M)


def _logical_lines(block: str) -> List[str]:
    """Lines joined across backslash continuations and open single quotes."""
    out: List[str] = []
    current = ""
    for line in block.split("\n"):
        current = f"{current}\n{line}" if current else line
        if current.count("'") % 2 == 0 and not current.endswith("\\"):
            out.append(current)
            current = ""
    if current:
        out.append(current)
    return out


def _documented_replies(block: str) -> List[Any]:
    """The `# -> {...}` comments of a block that are JSON."""
    replies = []
    for m in re.finditer(r"^# -> (.*?)(?=^[^#]|^# -> |\Z)", block, flags=re.S | re.M):
        text = " ".join(line.lstrip("#").strip() for line in m.group(1).split("\n"))
        try:
            replies.append(json.loads(text))
        except json.JSONDecodeError:
            pass  # an abridged reply (e.g. ExportPools'), not compared
    return replies


def _printed_objects(output: str) -> List[Any]:
    """The JSON objects in `output` (the stand-in prints each reply indented)."""
    decoder = json.JSONDecoder()
    objects = []
    for m in re.finditer(r"^\{", output, flags=re.M):
        try:
            obj, _ = decoder.raw_decode(output[m.start():])
            objects.append(obj)
        except json.JSONDecodeError:
            pass
    return objects


class ProtocolExamplesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        with open(_runfile("docs/protocol.md")) as f:
            cls.doc = f.read()
        cls.blocks = _blocks(cls.doc)

    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="ssdoc", dir="/tmp")
        self.tag = os.path.basename(self.dir)
        self.addCleanup(self._remove_shm)
        self.addCleanup(shutil.rmtree, self.dir, True)

    def _remove_shm(self) -> None:
        for name in ("my-acts", "my-meta"):
            try:
                os.unlink(f"/dev/shm/{name}-{self.tag}")
            except FileNotFoundError:
                pass

    def _localize(self, text: str) -> str:
        text = text.replace("bazel-bin/server/specstated", _runfile("server/specstated"))
        text = text.replace("/tmp/specstate", f"{self.dir}/specstate")
        return re.sub(r"/my-(acts|meta)\b", lambda m: f"/my-{m.group(1)}-{self.tag}", text)

    def _environment(self) -> Dict[str, str]:
        bin_dir = os.path.join(self.dir, "bin")
        os.makedirs(bin_dir, exist_ok=True)
        standin = os.path.join(bin_dir, "grpcurl")
        with open(standin, "w") as f:
            f.write(f'#!/bin/sh\nexec /usr/bin/python3 {_runfile("tests/docs/grpcurl_standin.py")} "$@"\n')
        os.chmod(standin, 0o755)
        env = dict(os.environ)
        env["PATH"] = f"{bin_dir}:{env.get('PATH', '/usr/bin:/bin')}"
        env["SPECSTATE_DESCRIPTOR_SET"] = _runfile("proto/served_descriptor_set.binpb")
        # The examples run in a scratch directory: under --config=asan the
        # servers' LSan suppressions file must be named by its full path.
        env["LSAN_OPTIONS"] = re.sub(
            r"(^|:)suppressions=([^:/][^:]*)",
            lambda m: f"{m.group(1)}suppressions={os.path.abspath(_runfile(m.group(2)))}",
            env.get("LSAN_OPTIONS", ""))
        return env

    def test_blocks_exist(self) -> None:
        self.assertGreaterEqual(len(self.blocks), 8)
        self.assertEqual(sum(b.startswith(_CUDA_MARK) for b in self.blocks), 1)
        for b in self.blocks:  # no "..." left to fill in, comments aside
            code = re.sub(r"(^|\s)#.*$", "", b, flags=re.M)
            self.assertNotIn("...", code, f"a placeholder in:\n{b}")

    def test_examples_run_as_written(self) -> None:
        script = ["set -e"]
        runnable: List[Tuple[int, str]] = []
        for i, block in enumerate(self.blocks):
            if block.startswith(_CUDA_MARK):
                continue
            runnable.append((i, block))
            script += [f"echo '@@@ block {i}'", self._localize(block)]
        script.append("echo '@@@ done'")
        # Output to a file, not a pipe: the servers the examples start in the
        # background keep their stdout open after bash exits.
        log_path = os.path.join(self.dir, "examples.log")
        with open(log_path, "wb") as log:
            process = subprocess.Popen(["/bin/bash", "-c", "\n".join(script)], cwd=self.dir,
                                       env=self._environment(), stdin=subprocess.DEVNULL,
                                       stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
            try:
                process.wait(timeout=180)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:
                    os.killpg(process.pid, signal.SIGKILL)  # what the examples left running
                except ProcessLookupError:
                    pass
                process.wait()
        with open(log_path, "rb") as f:
            output = f.read()
        text = output.decode(errors="replace")
        outputs_dir = os.environ.get("TEST_UNDECLARED_OUTPUTS_DIR")
        if outputs_dir:  # bazel-testlogs/tests/docs/protocol_examples_test/test.outputs/
            with open(os.path.join(outputs_dir, "examples_output.txt"), "w") as f:
                f.write(text)
        self.assertFalse(timed_out, "the examples did not finish in 180 s; the output's end:\n"
                         + text[-6000:])
        self.assertEqual(process.returncode, 0, "a command failed; the output's end:\n"
                         + text[-6000:])
        self.assertIn("@@@ done", text)

        outputs = dict(re.findall(r"^@@@ block (\d+)\n(.*?)(?=^@@@ )", text, flags=re.S | re.M))
        for i, block in runnable:
            printed = _printed_objects(outputs[str(i)])
            for reply in _documented_replies(block):
                self.assertIn(reply, printed, f"block {i} documents a reply it did not print:\n"
                              f"{block}\nIt printed:\n{outputs[str(i)][-4000:]}")
        first = outputs[str(runnable[0][0])]
        for service in ("specstate.v1.SpecState", "grpc.health.v1.Health",
                        "grpc.reflection.v1.ServerReflection",
                        "grpc.reflection.v1alpha.ServerReflection"):
            self.assertIn(f"\n{service}\n", first)
        self.assertIn("specstate.v1.VerifyRequest is a message:", first)
        self.assertIn("// N rows; row n verifies tokens", first)
        self.assertRegex(text, r"\n\s+3\s+1\s+1\s+1\n")  # the align block's od

    def test_cuda_example_bodies_parse(self) -> None:
        cuda = [b for b in self.blocks if b.startswith(_CUDA_MARK)]
        bodies = 0
        placeholders = {"SID": "s1-00000000000000000000000000000000",
                        "HANDLE": "A" * 86 + "==", "S": "-plaintext -unix /tmp/x.sock"}
        for block in cuda:
            for line in _logical_lines(block):
                if not line.lstrip().startswith("grpcurl "):
                    continue
                argv = subprocess.run(
                    ["/bin/bash", "-c", 'eval "set -- ${CMD#grpcurl }"; printf "%s\\0" "$@"'],
                    env={**placeholders, "CMD": line.strip(), "PATH": "/usr/bin:/bin"},
                    check=True, capture_output=True).stdout.decode().split("\0")[:-1]
                self.assertIn("-d", argv, line)
                body = argv[argv.index("-d") + 1]
                method = argv[-1]
                service, name = method.split("/")
                self.assertEqual(service, "specstate.v1.SpecState")
                request = pb.DESCRIPTOR.services_by_name["SpecState"].methods_by_name[name].input_type
                message = getattr(pb, request.name)()
                json_format.Parse(body, message)
                self.assertEqual(len(message.cuda_ipc_handle), 64)
                bodies += 1
        self.assertEqual(bodies, 1)


if __name__ == "__main__":
    junit_runner.main()
