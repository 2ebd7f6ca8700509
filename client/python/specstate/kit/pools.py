"""The service's pools as torch tensors (:class:`StatePools`), and the dtype
and memory helpers the kit shares (see :mod:`specstate.kit`)."""
from __future__ import annotations

from typing import Any, Dict, List

import grpc
import numpy as np

try:
    import torch
except ImportError as _e:  # pragma: no cover - depends on the install
    raise ImportError("specstate.kit needs torch (Debian: apt-get install python3-torch; "
                      "or pip install torch)") from _e

from specstate import dtypes
from specstate.errors import InvalidInput
from specstate.shm import MappedPools
from specstate.v1 import specstate_pb2 as pb

_TORCH_OF = {pb.FP32: torch.float32, pb.FP16: torch.float16, pb.BF16: torch.bfloat16,
             pb.INT32: torch.int32}
_NUMPY_FOR_TORCH = {torch.float32: np.float32, torch.float16: np.float16,
                    torch.bfloat16: np.int16, torch.int32: np.int32}


def torch_dtype(dtype: int) -> "torch.dtype":
    """The torch dtype of a ``specstate.v1.DType`` (BF16 -> torch.bfloat16)."""
    try:
        return _TORCH_OF[dtype]
    except KeyError:
        raise InvalidInput(grpc.StatusCode.INVALID_ARGUMENT,
                           f"dtype {dtype} is not FP32, FP16, BF16 or INT32") from None


def _from_numpy(a: np.ndarray) -> "torch.Tensor":
    """A torch tensor sharing `a`'s memory; uint16 (bf16 bits) becomes torch.bfloat16."""
    if a.dtype == np.uint16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def state_memory_bytes(layout: pb.Layout, requests: int) -> Dict[str, int]:
    """Recurrent-state bytes for `requests` requests under `layout`: the stock
    speculative path's ``(1 + num_spec)`` states per request per layer against
    SpecState's one (its checkpoint) plus its record scratch (``record_bytes``:
    the records, or FAST's rings)."""
    hv = layout.num_value_heads or layout.num_heads
    state = hv * layout.head_dim * layout.head_dim * dtypes.itemsize(layout.state_dtype)
    per_layer = requests * state
    return {"state_block_bytes": state,
            "stock": (1 + layout.num_spec) * per_layer * layout.num_layers,
            "specstate": per_layer * layout.num_layers,
            "specstate_records": int(layout.record_bytes)}


class StatePools:
    """The service's pools as torch tensors (see the module docstring).

    ``recurrent(layer)`` ``[num_blocks, HV, V, K]`` (state dtype),
    ``conv(layer)`` ``[num_blocks, D, W]`` (activation dtype), ``layout``
    (GetLayout), ``device``. Writes through these tensors land in the
    service's pools. Under DEFERRED and FAST a block may hold a checkpoint
    with tokens pending: flush it (:meth:`Runner.flush`) before reading it.
    """

    def __init__(self, client: Any) -> None:
        self.layout: pb.Layout = client.layout()
        export = client.export_pools()
        self._recurrent: List[Any] = []
        self._conv: List[Any] = []
        if export.backend == pb.CUDA:
            from specstate.cuda import CudaPools  # noqa: PLC0415
            self._mapped: Any = CudaPools(export)
            self.device = torch.device("cuda", self._mapped.device)
            for layer in range(self.layout.num_layers):
                self._recurrent.append(self._mapped.recurrent(layer))
                self._conv.append(self._mapped.conv(layer))
        else:
            self._mapped = MappedPools(export)
            self.device = torch.device("cpu")
            for layer in range(self.layout.num_layers):
                self._recurrent.append(_from_numpy(self._mapped.recurrent(layer)))
                self._conv.append(_from_numpy(self._mapped.conv(layer)))

    @property
    def num_layers(self) -> int:
        return self.layout.num_layers

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    def _layer(self, layer: int) -> int:
        if not 0 <= layer < self.layout.num_layers:
            raise InvalidInput(grpc.StatusCode.OUT_OF_RANGE,
                               f"layer {layer} is out of range: the service holds "
                               f"{self.layout.num_layers} layers")
        return layer

    def recurrent(self, layer: int) -> "torch.Tensor":
        """``[num_blocks, HV, V, K]`` recurrent states of `layer`."""
        return self._recurrent[self._layer(layer)]

    def conv(self, layer: int) -> "torch.Tensor":
        """``[num_blocks, D, W]`` conv states of `layer` (W = conv_kernel - 1 + num_spec)."""
        return self._conv[self._layer(layer)]

    def close(self) -> None:
        """Unmaps the pools (the tensors must not be used after)."""
        self._recurrent.clear()
        self._conv.clear()
        self._mapped.close()

    def __enter__(self) -> "StatePools":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
