"""Tensor parallelism: one specstated per GPU, rank r's holding its part of every layer.

Under tensor parallelism each GPU holds its own heads of every layer, so each
GPU gets its own service (``specstated --device=r``, its own socket) and the
scheduler's rank r talks to the service of GPU r. Rank r's service holds heads
``[r*H/TP, (r+1)*H/TP)`` (value heads and conv channels alike): every rank's
layout is the same but for its device.

    clients = specstate.connect_ranks(["unix:///run/specstate/specstate-0.sock",
                                       "unix:///run/specstate/specstate-1.sock"])
    client = clients[rank]          # this worker's service

:func:`check_rank_layouts` is the check alone, on layouts already read.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import grpc

from specstate.client import Client
from specstate.errors import SpecStateError
from specstate.v1 import specstate_pb2 as pb


def _value_heads(layout: pb.Layout) -> int:
    # 0 means as many as heads: compared as the number it stands for.
    return layout.num_value_heads or layout.num_heads


# What must be equal across the ranks (the C++ client's list, client.cc), each
# as its text in an error. Derived sizes follow from these; mps_client may differ.
_FIELDS: Tuple[Tuple[str, Callable[[pb.Layout], Any]], ...] = (
    ("backend", lambda l: pb.Backend.Name(l.backend)),
    ("layer_kind", lambda l: pb.LayerKind.Name(l.layer_kind)),
    ("kda_gate", lambda l: pb.KdaGate.Name(l.kda_gate)),
    ("num_layers", lambda l: l.num_layers),
    ("num_heads", lambda l: l.num_heads),
    ("num_value_heads", _value_heads),
    ("head_dim", lambda l: l.head_dim),
    ("conv_dim", lambda l: l.conv_dim),
    ("conv_kernel", lambda l: l.conv_kernel),
    ("num_spec", lambda l: l.num_spec),
    ("num_blocks", lambda l: l.num_blocks),
    ("max_rows", lambda l: l.max_rows),
    ("activation_dtype", lambda l: pb.DType.Name(l.activation_dtype)),
    ("state_dtype", lambda l: pb.DType.Name(l.state_dtype)),
    ("cache_mode", lambda l: pb.CacheMode.Name(l.cache_mode)),
    ("mamba_block_size", lambda l: l.mamba_block_size),
    ("lower_bound", lambda l: l.lower_bound),
)


def _rank_name(rank: int, addresses: Optional[Sequence[str]]) -> str:
    if addresses and rank < len(addresses) and addresses[rank]:
        return f"rank {rank} ({addresses[rank]})"
    return f"rank {rank}"


def _text(value: Any) -> str:
    # Floats as C++'s absl::StrCat writes them (-5, not -5.0), so both clients
    # word their errors alike.
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def check_rank_layouts(layouts: Sequence[pb.Layout],
                       addresses: Optional[Sequence[str]] = None) -> None:
    """Checks that ``layouts[r]`` (read from ``addresses[r]``) are the equal parts of one model.

    Every field must equal rank 0's but the device (heads, value heads and conv
    dim too: each rank holds an equal part; the ranks share block ids, so the
    pools have the same number of blocks), and on CUDA every rank must be on a
    device of its own.

    Raises:
        SpecStateError: FAILED_PRECONDITION naming the rank, its address and
            the field, e.g. ``rank 1 (unix:///b.sock): num_heads is 3, rank 0
            (unix:///a.sock)'s is 2: ...``; INVALID_ARGUMENT for no layout.
    """
    if not layouts:
        raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT,
                             "no ranks: give one layout per rank")
    first = layouts[0]
    for r, layout in enumerate(layouts[1:], start=1):
        for name, value in _FIELDS:
            got, want = _text(value(layout)), _text(value(first))
            if got != want:
                raise SpecStateError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{_rank_name(r, addresses)}: {name} is {got}, {_rank_name(0, addresses)}'s "
                    f"is {want}: under tensor parallelism every rank's service holds an equal "
                    "part of one model (H/TP heads, HV/TP value heads, D/TP conv channels; "
                    "every other field the same)")
    if first.backend != pb.CUDA:
        return
    for r in range(1, len(layouts)):
        for q in range(r):
            if layouts[r].device == layouts[q].device:
                raise SpecStateError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{_rank_name(r, addresses)} and {_rank_name(q, addresses)} are both on "
                    f"CUDA device {layouts[r].device}: under tensor parallelism each rank's "
                    "service runs on its own GPU (specstated --device=RANK)")


def connect_ranks(addresses: Sequence[str], **client_kwargs: Any) -> List[Client]:
    """One :class:`Client` per rank, ``addresses[r]`` being rank r's service.

    Connects to every service, reads its layout and checks the layouts with
    :func:`check_rank_layouts`. `client_kwargs` go to every :class:`Client`
    (``connect_timeout``, ``deadline``). On an error the clients made so far
    are closed.

    Raises:
        SpecStateError: INVALID_ARGUMENT for no address or one given twice;
            the service's error (UNAVAILABLE when it does not answer) prefixed
            with ``rank r: ``; the error of :func:`check_rank_layouts`.
    """
    addresses = list(addresses)
    if not addresses:
        raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT,
                             "no server addresses: give one per rank")
    for r, address in enumerate(addresses):
        if address in addresses[:r]:
            q = addresses.index(address)
            raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"rank {r}'s address is rank {q}'s ({address}): each rank "
                                 "talks to a service of its own")
    clients: List[Client] = []
    try:
        layouts = []
        for r, address in enumerate(addresses):
            try:
                clients.append(Client(address, **client_kwargs))
                layouts.append(clients[-1].layout())
            except SpecStateError as e:
                raise SpecStateError(e.code, f"rank {r}: {e.message}") from None
        check_rank_layouts(layouts, addresses)
    except BaseException:
        for c in clients:
            c.close()
        raise
    return clients
