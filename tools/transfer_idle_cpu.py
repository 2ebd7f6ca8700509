#!/usr/bin/python3
"""What an idle specstated costs in CPU after one transfer (CPU backend): two
small services with host tiers, one key saved on the first and fetched by
the second (FetchSaved: UCX, whose progress thread then runs for the
service's life), then each process's CPU time over --seconds of idleness.

    bazel build //server:specstated
    UCX_TLS=posix,self tools/transfer_idle_cpu.py [--seconds=5]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "client", "python"))
import specstate  # noqa: E402
from transfer_time import start  # noqa: E402


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--specstated", default="bazel-bin/server/specstated")
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="ss", dir="/tmp")
    socks = [os.path.join(d, "a.sock"), os.path.join(d, "b.sock")]
    small = ["--layers=2", "--heads=2", "--blocks=8", "--host_tier_bytes=64MiB"]
    servers = []
    try:
        for s in socks:
            servers.append(start(args.specstated, s, small))
        a, b = specstate.Client("unix://" + socks[0]), specstate.Client("unix://" + socks[1])
        session = a.session("idle-cpu", drive=True)
        session.save_blocks({"k": 1})
        b.fetch_saved("unix://" + socks[0], ["k"])
        before = [cpu_seconds(p.pid) for p in servers]
        t0 = time.time()
        time.sleep(args.seconds)
        after = [cpu_seconds(p.pid) for p in servers]
        elapsed = time.time() - t0
        share = [100 * (y - x) / elapsed for x, y in zip(before, after)]
        print(f"UCX_TLS={os.environ.get('UCX_TLS', '(UCX default)')}: idle for {elapsed:.1f} s "
              f"after one transfer: source {share[0]:.1f}%, destination {share[1]:.1f}% of a core")
        session.close()
        a.close()
        b.close()
    finally:
        for p in servers:
            p.terminate()
            p.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
