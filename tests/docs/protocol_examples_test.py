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
  json_format (the same proto3 JSON mapping). Where the real grpcurl is
  installed, `GRPCURL=/abs/path/to/grpcurl` runs the examples with it instead:
      GRPCURL=/abs/path/to/grpcurl bazel test //tests/docs:protocol_examples_test
  (the target inherits GRPCURL from bazel's environment: env_inherit in
  tests/docs/BUILD; --test_env=GRPCURL=... works too). A GRPCURL that is not
  an executable file's absolute path fails the test rather than fall back to
  the stand-in; unset or empty, the stand-in plays grpcurl.

A block whose first line is "# CUDA backend only." does not run (no GPU
here); its grpcurl bodies are parsed into their methods' request messages
instead, with placeholder values for the shell variables, so that their
field names and types are still checked.

Then: every reply the page shows as a `# -> {...}` comment that is JSON
equals one that its block printed, and every line it shows as a `#   ...`
comment is a line its block printed (the Sessions block's second
open_session: one session left, s2 driving, so the first one ended);
`describe` printed every field of VerifyRequest with a comment (num_rows'
from specstate.proto among them), `list` named the services, and the align
block's `od` printed the RecordStateBlocks outputs it promises.

Issue 25 added three checks of the page's shell: open_session ends the
session it opened before (the Sessions block opens a second one on the same
server, which drives only if the first has ended: with fd 3 inherited by the
new grpcurl it would get FAILED_PRECONDITION), every job put in the
background while a session is open starts with `3>&-` (else it keeps that
session's input open), and the clean-up at the end exits 0 and prints
nothing when a session's grpcurl has exited, or exits as it runs. Issue 32:
the clean-up also removes the shared-memory objects and the session's FIFO
the examples made, checked after the run.
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

import grpcurl_standin
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


def _documented_lines(block: str) -> List[str]:
    """The `#   ...` comments of a block: lines it prints, shown verbatim."""
    return [m.group(1).strip() for m in re.finditer(r"^#   (\S.*)$", block, flags=re.M)]


def _commands(block: str) -> List[str]:
    """The block's commands, one per line as bash reads them: comments (a #
    that starts a word outside quotes) dropped, lines joined across backslash
    continuations and quotes that span lines."""
    out: List[str] = []
    current: List[str] = []
    quote = ""
    i = 0
    while i < len(block):
        c = block[i]
        if quote:
            current.append(c)
            if quote == '"' and c == "\\" and i + 1 < len(block):
                current.append(block[i + 1])
                i += 1
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
            current.append(c)
        elif c == "#" and (i == 0 or block[i - 1].isspace()):
            while i < len(block) and block[i] != "\n":
                i += 1
            continue
        elif c == "\\" and block[i + 1:i + 2] == "\n":
            current.append(" ")
            i += 1
        elif c == "\n":
            out.append("".join(current).strip())
            current = []
        else:
            current.append(c)
        i += 1
    out.append("".join(current).strip())
    return [command for command in out if command]


def _clean_up(block: str) -> str:
    """The page's clean-up: the last block's lines from its last `exec 3>&-`."""
    lines = block.rstrip("\n").split("\n")
    start = max(i for i, line in enumerate(lines) if line.startswith("exec 3>&-"))
    return "\n".join(lines[start:])


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
        grpcurl = os.path.join(bin_dir, "grpcurl")
        real = os.environ.get("GRPCURL", "")
        if real:  # the real grpcurl, where one is installed
            self.assertTrue(os.path.isabs(real) and os.path.isfile(real)
                            and os.access(real, os.X_OK),
                            f"GRPCURL={real!r} is not an executable file's absolute path")
            os.symlink(real, grpcurl)
        else:
            with open(grpcurl, "w") as f:
                f.write(f'#!/bin/sh\nexec /usr/bin/python3 {_runfile("tests/docs/grpcurl_standin.py")} "$@"\n')
            os.chmod(grpcurl, 0o755)
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

    def test_background_jobs_close_the_session_input(self) -> None:
        # A job put in the background while a session is open (after an
        # open_session call, before `exec 3>&-`) inherits fd 3 and holds that
        # session's input open: its stream would not close, and the next
        # open_session would wait for the job. Each must start with 3>&-.
        session_open = False
        in_function = False
        background = opened = 0
        for block in self.blocks:
            for command in _commands(block):
                if command.startswith("open_session() {"):
                    in_function = True
                elif in_function:
                    in_function = command != "}"  # the session's own grpcurl runs in there
                elif command == "open_session":
                    session_open = True
                    opened += 1
                elif command.startswith("exec 3>&-"):
                    session_open = False
                elif re.search(r"(^|[^&])&$", command):
                    background += 1
                    if session_open:
                        self.assertIn("3>&-", command, "a job started in the background while "
                                      f"a session is open holds its input open:\n{command}")
        # The four servers (the transfer's destination among them) and the
        # CUDA block's buffer; every open_session call.
        self.assertEqual((background, opened), (5, 4))

    def _run_clean_up(self, setup: str) -> Tuple[int, str, str]:
        """Runs `setup`, then the page's clean-up (its paths this test's own), in
        bash with set -e."""
        clean_up = self._localize(
            _clean_up([b for b in self.blocks if not b.startswith(_CUDA_MARK)][-1]))
        script = "\n".join(["set -e", setup, clean_up, "echo '@@@ cleaned'",
                            'for pid in $SERVERS; do wait "$pid" || echo "@@@ $pid: $?"; done'])
        result = subprocess.run(["/bin/bash", "-c", script], cwd=self.dir, timeout=60,
                                stdin=subprocess.DEVNULL, capture_output=True,
                                start_new_session=True)
        return result.returncode, result.stdout.decode(), result.stderr.decode()

    def test_clean_up_when_a_session_has_ended(self) -> None:
        # Issue 25: `kill $(jobs -p)` after `exec 3>&-` listed the session's
        # grpcurl, which exits as its input closes: "No such process", and a
        # non-zero status when no other job was left. Here `cat` plays the
        # session's grpcurl (it exits when fd 3 closes) and `sleep` a server.
        fifo = os.path.join(self.dir, "session.in")
        session = f'rm -f {fifo}; mkfifo {fifo}; cat <{fifo} >/dev/null & exec 3>{fifo}'
        servers = "sleep 120 & SERVERS=$!; sleep 120 & SERVERS=\"$SERVERS $!\""
        cases = {
            # as at the end of the page: servers run, the grpcurl exits now
            "the session's grpcurl exits as the clean-up runs": f"{servers}; {session}",
            # it exited before: only the servers are left
            "the session's grpcurl has exited": f"{session}; exec 3>&-; wait $!; {servers}",
            # the servers too had stopped (or were never started)
            "only the exiting grpcurl is left": f"SERVERS=; {session}",
            "nothing is left": f"SERVERS=; {session}; exec 3>&-; wait $!",
        }
        for name, setup in cases.items():
            with self.subTest(name):
                rc, out, err = self._run_clean_up(setup)
                self.assertEqual((rc, err), (0, ""), f"{name}: the clean-up failed:\n{out}{err}")
                self.assertIn("@@@ cleaned", out)
                servers = 2 if "sleep 120" in setup else 0
                # each server stopped by the clean-up's SIGTERM: wait gives 128 + 15
                self.assertEqual(len(re.findall(r"^@@@ \d+: 143$", out, flags=re.M)), servers, out)

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
        # The clean-up removed what the examples made outside the servers.
        left = [path for path in (f"/dev/shm/my-acts-{self.tag}", f"/dev/shm/my-meta-{self.tag}",
                                  f"{self.dir}/specstate-session.in",
                                  f"{self.dir}/specstate-session.out")
                if os.path.exists(path)]
        self.assertEqual(left, [], "the page's clean-up left these behind")

        outputs = dict(re.findall(r"^@@@ block (\d+)\n(.*?)(?=^@@@ )", text, flags=re.S | re.M))
        lines_checked = 0
        for i, block in runnable:
            printed = _printed_objects(outputs[str(i)])
            for reply in _documented_replies(block):
                self.assertIn(reply, printed, f"block {i} documents a reply it did not print:\n"
                              f"{block}\nIt printed:\n{outputs[str(i)][-4000:]}")
            printed_lines = [line.strip() for line in outputs[str(i)].split("\n")]
            for line in _documented_lines(block):
                self.assertIn(line, printed_lines, f"block {i} documents a line it did not "
                              f"print:\n{block}\nIt printed:\n{outputs[str(i)][-4000:]}")
                lines_checked += 1
        # The Sessions block's second open_session: the first session ended.
        self.assertGreaterEqual(lines_checked, 2)
        self.assertIn('"driver": "session s2 (client \\"me\\")",', text)
        first = outputs[str(runnable[0][0])]
        for service in ("specstate.v1.SpecState", "grpc.health.v1.Health",
                        "grpc.reflection.v1.ServerReflection",
                        "grpc.reflection.v1alpha.ServerReflection"):
            self.assertIn(f"\n{service}\n", first)
        self.assertIn("specstate.v1.VerifyRequest is a message:", first)
        self.assertIn("// N rows; row n verifies tokens", first)
        self._assert_every_field_has_a_comment(first)
        self.assertRegex(text, r"\n\s+3\s+1\s+1\s+1\n")  # the align block's od

    def _assert_every_field_has_a_comment(self, output: str) -> None:
        """`describe specstate.v1.VerifyRequest` showed a comment for each field:
        a // line above it (blank lines aside), or one on its line."""
        described = output[output.index("specstate.v1.VerifyRequest is a message:"):]
        lines = described[:described.index("\n}")].split("\n")
        fields, bare = 0, []
        for n, line in enumerate(lines):
            if not re.match(r"^\s+(optional |repeated )?[\w.]+ \w+ = \d+;", line):
                continue
            fields += 1
            above = [x.strip() for x in lines[:n] if x.strip()]
            if "//" not in line and not (above and above[-1].startswith("//")):
                bare.append(line.strip())
        self.assertEqual(fields, len(pb.VerifyRequest.DESCRIPTOR.fields), described)
        self.assertEqual(bare, [], "describe shows these fields of VerifyRequest without a "
                         "comment:\n" + "\n".join(bare))

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
                # The command line as grpcurl reads it (grpcurl_standin.py
                # parses as Go's flag package does): -unix a boolean, the
                # socket's path the address.
                flags, positional = grpcurl_standin.parse_command_line(argv)
                self.assertTrue(flags["unix"] and flags["plaintext"], line)
                self.assertEqual(positional[0], "/tmp/x.sock", line)
                self.assertIsNotNone(flags["d"], line)
                body = flags["d"]
                method = positional[-1]
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
