"""specstated: the flags that match the model, starting one of our own, and checking a
running one's layout."""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Any, List, Optional

import torch

from .decode import AlignPlan
from .model import ExampleError, Geometry


def server_flags(geo: Geometry, args: argparse.Namespace, commit_mode: str, backend: str,
                 align: Optional[AlignPlan] = None) -> List[str]:
    flags = [
        "--kind=gdn",
        f"--layers={len(geo.gdn_layers)}",
        f"--heads={geo.heads}",
        f"--value_heads={geo.value_heads}",
        f"--head_dim={geo.head_dim}",
        f"--conv_dim={geo.conv_dim}",
        f"--conv_kernel={geo.conv_kernel}",
        f"--num_spec={args.num_spec}",
        "--activation_dtype=fp32",
        "--state_dtype=fp32",
        f"--max_rows={args.prompts}",
        f"--blocks={max(64, 1 + args.prompts * (align.width if align else 1))}",
        f"--commit_mode={commit_mode}",
        f"--backend={backend}",
    ]
    if align is not None:
        flags += ["--cache_mode=align", f"--mamba_block_size={align.block_size}"]
    return flags


class StartedServer:
    """A specstated of our own on a temporary Unix socket, stopped (SIGTERM) on exit."""

    def __init__(self, binary: str, flags: List[str], timeout: float = 60.0) -> None:
        import specstate  # noqa: PLC0415
        self.dir = tempfile.mkdtemp(prefix="qwen3-next-specstate-")
        self.address = f"unix://{self.dir}/specstate.sock"
        self.log_path = os.path.join(self.dir, "specstated.log")
        self.cmd = [binary] + flags + [f"--listen={self.address}"]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                self.close()
                raise ExampleError(f"specstated exited with {self.proc.returncode}: "
                                   f"{' '.join(self.cmd)}\n{self.log()}")
            if os.path.exists(f"{self.dir}/specstate.sock"):
                try:
                    c = specstate.Client(self.address, connect_timeout=1.0)
                    serving = c.health() == "SERVING"
                    c.close()
                    if serving:
                        break
                except specstate.SpecStateError:
                    pass
            if time.time() > deadline:
                self.close()
                raise ExampleError(f"specstated did not serve within {timeout:g} s:\n{self.log()}")
            time.sleep(0.1)

    def log(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-4000:].decode(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "StartedServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def check_layout(lo: Any, geo: Geometry, args: argparse.Namespace, device: torch.device,
                 align: Optional[AlignPlan]) -> str:
    """Refuses a service whose layout does not hold this model's GDN layers; returns its
    commit mode's name."""
    from specstate import pb  # noqa: PLC0415
    hv = lo.num_value_heads or lo.num_heads
    want = [
        ("layer_kind", pb.LayerKind.Name(lo.layer_kind), "GDN", "--kind=gdn"),
        ("num_layers", lo.num_layers, len(geo.gdn_layers), f"--layers={len(geo.gdn_layers)}"),
        ("num_heads", lo.num_heads, geo.heads, f"--heads={geo.heads}"),
        ("num_value_heads", hv, geo.value_heads, f"--value_heads={geo.value_heads}"),
        ("head_dim", lo.head_dim, geo.head_dim, f"--head_dim={geo.head_dim}"),
        ("conv_dim", lo.conv_dim, geo.conv_dim, f"--conv_dim={geo.conv_dim}"),
        ("conv_kernel", lo.conv_kernel, geo.conv_kernel, f"--conv_kernel={geo.conv_kernel}"),
        ("activation_dtype", pb.DType.Name(lo.activation_dtype), "FP32", "--activation_dtype=fp32"),
        ("backend", pb.Backend.Name(lo.backend), "CUDA" if device.type == "cuda" else "CPU",
         f"--backend={'cuda' if device.type == 'cuda' else 'cpu'} (or --device to match)"),
    ]
    bad = [f"{field} is {got}, the model needs {need} ({flag})"
           for field, got, need, flag in want if got != need]
    if lo.max_rows < args.prompts:
        bad.append(f"max_rows is {lo.max_rows}, {args.prompts} requests decode together "
                   f"(--max_rows={args.prompts})")
    need = 1 + args.prompts * (align.width if align else 1)
    if lo.num_blocks < need:
        bad.append(f"num_blocks is {lo.num_blocks}: {args.prompts} requests need {need} with the "
                   f"null block (--blocks={need})")
    if align is None and pb.CacheMode.Name(lo.cache_mode) != "NONE":
        bad.append("cache_mode is ALIGN where this pass decodes one block per request (none mode)")
    if align is not None:
        if pb.CacheMode.Name(lo.cache_mode) != "ALIGN":
            bad.append("cache_mode is NONE where the align pass needs --cache_mode=align")
        elif lo.mamba_block_size != align.block_size:
            bad.append(f"mamba_block_size is {lo.mamba_block_size}, the pass plans "
                       f"{align.block_size} (--mamba_block_size={align.block_size})")
    if bad:
        raise ExampleError("specstated's layout does not match the model:\n  " + "\n  ".join(bad))
    if pb.DType.Name(lo.state_dtype) != "FP32":
        print(f"note: the service keeps {pb.DType.Name(lo.state_dtype)} states: "
              "expect more near-ties against generate's fp32 ones")
    return pb.CommitMode.Name(lo.commit_mode)
