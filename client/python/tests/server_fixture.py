"""Starts and stops a real specstated for the tests.

The binary: $SPECSTATED, else Bazel's runfiles (//server:specstated as a data
dependency), else bazel-bin/server/specstated of the checkout holding this file.
The Unix socket lives in a short tempfile.mkdtemp(dir="/tmp") directory
(socket paths are limited to 107 bytes).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Any, Optional

import specstate


def _find_binary(env: str, package: str, name: str) -> str:
    candidates = [os.environ.get(env)]
    for root in (os.environ.get("TEST_SRCDIR"), os.environ.get("RUNFILES_DIR")):
        if root:
            candidates.append(os.path.join(root, os.environ.get("TEST_WORKSPACE", "specstate"),
                                           package, name))
    here = os.path.dirname(os.path.abspath(__file__))
    candidates.append(os.path.join(here, "..", "..", "..", "bazel-bin", package, name))
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return os.path.abspath(c)
    raise FileNotFoundError(f"{name} not found: build //{package}:{name} or set {env}")


def find_specstated() -> str:
    return _find_binary("SPECSTATED", "server", "specstated")


class Keeper:
    """A specstate-keeper process (it holds specstated's pools across restarts)
    on a socket in `directory`; ``Server(keeper=keeper.socket)`` uses it."""

    def __init__(self, directory: str) -> None:
        self.socket = os.path.join(directory, "keeper.sock")
        self.process = subprocess.Popen(
            [_find_binary("SPECSTATE_KEEPER", "keeper", "specstate-keeper"),
             f"--socket={self.socket}"], stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not os.path.exists(self.socket):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("specstate-keeper did not come up")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


class Server:
    """A specstated process on a fresh Unix socket; flags as keyword arguments
    (``Server(layers=2, cache_mode="align")`` -> ``--layers=2 --cache_mode=align``)."""

    def __init__(self, **flags: Any) -> None:
        self.flags = {"backend": "cpu", **flags}
        self.dir = tempfile.mkdtemp(prefix="ss", dir="/tmp")
        self.socket = os.path.join(self.dir, "s.sock")
        self.address = "unix://" + self.socket
        self.log_path = os.path.join(self.dir, "specstated.log")
        self.process: Optional[subprocess.Popen] = None

    def start(self, timeout: float = 30.0) -> "Server":
        args = [find_specstated(), f"--listen={self.address}"]
        args += [f"--{k}={v}" for k, v in self.flags.items()]
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"specstated exited with {self.process.returncode}:\n"
                                   + self.log())
            if os.path.exists(self.socket):
                try:
                    with specstate.Client(self.address, connect_timeout=1.0) as client:
                        client.layout()
                    return self
                except specstate.SpecStateError:
                    pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("specstated did not come up:\n" + self.log())
            time.sleep(0.05)

    def client(self, **kwargs: Any) -> specstate.Client:
        return specstate.Client(self.address, **kwargs)

    def log(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")[-4000:]
        except OSError:
            return ""

    def kill(self, hard: bool = False) -> None:
        """Stops the process (SIGTERM, then SIGKILL; `hard`: SIGKILL at once, like a
        crash), keeping the directory."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL if hard else signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def stop(self) -> None:
        self.kill()  # the pools (a memfd) go with the process
        if getattr(self, "_log", None) is not None:
            self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
