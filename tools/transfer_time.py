#!/usr/bin/python3
"""Time to move one request's state between two SpecState services on this
machine (CPU backend): a Kimi-Linear block (20 layers, 2 MiB + 144 KiB each)
saved on one service, read into the other's host tier with FetchSaved (UCX),
restored there and compared byte for byte; median of --repeats.

    bazel build //server:specstated
    UCX_TLS=posix,self tools/transfer_time.py [--repeats=10]   # shared memory
    UCX_TLS=tcp tools/transfer_time.py                          # TCP
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "client", "python"))
import specstate  # noqa: E402


KIMI_LINEAR = ["--model=kimi-linear-48b-a3b", "--blocks=8", "--max_rows=4",
               "--host_tier_bytes=1GiB"]


def start(binary: str, sock: str, flags=KIMI_LINEAR) -> subprocess.Popen:
    """A CPU-backend specstated on `sock` with `flags`, once its socket exists
    (also tools/transfer_idle_cpu.py's)."""
    p = subprocess.Popen([binary, "--backend=cpu", f"--listen=unix://{sock}"] + list(flags),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        if os.path.exists(sock):
            return p
        time.sleep(0.1)
    raise SystemExit(f"specstated did not start on {sock}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--specstated", default="bazel-bin/server/specstated")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="ss", dir="/tmp")
    a_sock, b_sock = os.path.join(d, "a.sock"), os.path.join(d, "b.sock")
    servers = [start(args.specstated, a_sock), start(args.specstated, b_sock)]
    try:
        a, b = specstate.Client("unix://" + a_sock), specstate.Client("unix://" + b_sock)
        layout = a.layout()
        pools = a.map_pools()
        rng = np.random.default_rng()
        for layer in range(layout.num_layers):
            for kind in ("recurrent", "conv"):
                view = pools.view(layer, kind)[1].view(np.uint8)
                view[...] = rng.integers(0, 256, view.shape, dtype=np.uint8)
        sa, sb = a.session("prefill", drive=True), b.session("decode", drive=True)
        seconds = []
        for i in range(args.repeats):
            key = f"request-{i}"
            sa.save_blocks({key: 1})
            t0 = time.perf_counter()
            r = b.fetch_saved("unix://" + a_sock, [key])
            seconds.append(time.perf_counter() - t0)
            sb.restore_blocks({key: 2})
        mapped = b.map_pools()
        for layer in range(layout.num_layers):
            for kind in ("recurrent", "conv"):
                if pools.view(layer, kind)[1].tobytes() != mapped.view(layer, kind)[2].tobytes():
                    raise SystemExit(f"MISMATCH in layer {layer} ({kind})")
        t = statistics.median(seconds)
        print(f"UCX_TLS={os.environ.get('UCX_TLS', '(UCX default)')}: one Kimi-Linear request "
              f"({r.bytes / 2**20:.1f} MiB, {layout.num_layers} layers) moved in {t * 1e3:.2f} ms "
              f"(median of {args.repeats} FetchSaved round trips, {r.bytes / t / 1e9:.2f} GB/s); "
              f"restored bytes equal the source's")
        sa.close()
        sb.close()
        a.close()
        b.close()
    finally:
        for p in servers:
            p.terminate()
            p.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
