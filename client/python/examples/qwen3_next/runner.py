"""SpecState's step I/O through specstate.kit: its Runner (one SubmitStep a step,
doorbells) behind the calls spec_decode makes, and the service's pools as torch tensors."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import torch

from .model import ExampleError


class KitRunner:
    """specstate.kit's Runner (ASYNC: one SubmitStep a step, doorbells) behind the calls
    spec_decode makes: begin_step (whose Step has verify and commit), flush, free,
    record_state_blocks, close."""

    def __init__(self, kit: Any, client: Any, name: str, *, max_tokens: int, max_rows: int,
                 device: torch.device, block_table_width: int = 0) -> None:
        self.runner = kit.Runner(client, name, max_tokens=max_tokens, max_rows=max_rows,
                                 device=device, block_table_width=block_table_width)

    def begin_step(self, query_start_loc: Sequence[int], state_indices: Sequence[int]) -> Any:
        return self.runner.begin_step(list(query_start_loc), list(state_indices))

    def flush(self, blocks: Sequence[int], discard: bool = False) -> None:
        self.runner.flush(list(blocks), discard=discard)

    def free(self, blocks: Sequence[int]) -> None:
        self.runner.free(list(blocks))

    def record_state_blocks(self, step: Any, *, idx_mapping: Sequence[int], num_sampled: Sequence[int],
                            num_computed_tokens: Sequence[int], block_table_width: int) -> List[int]:
        state_idx, _ = self.runner.record_state_blocks(
            step, idx_mapping=list(idx_mapping), num_sampled=list(num_sampled),
            num_computed_tokens=list(num_computed_tokens), block_table_width=block_table_width)
        return [int(x) for x in state_idx.tolist()]

    def close(self) -> None:
        self.runner.close()


def _kit_module() -> Any:
    try:
        from specstate import kit  # noqa: PLC0415
    except ImportError as e:
        raise ExampleError(f"this example needs specstate.kit (client/python): {e}") from None
    needed = ("Runner", "StatePools")
    missing = [n for n in needed if not hasattr(kit, n)]
    if missing:
        raise ExampleError(f"specstate.kit has no {', '.join(missing)}")
    return kit


class Pools:
    """The service's recurrent and conv pools as torch tensors ([blocks, HV, V, K], [blocks, D, W]):
    the kit Runner's StatePools."""

    def __init__(self, runner: KitRunner) -> None:
        self._kit = runner.runner.pools
        self._cache: Dict[Tuple[str, int], torch.Tensor] = {}

    def _get(self, kind: str, layer: int) -> torch.Tensor:
        key = (kind, layer)
        if key not in self._cache:
            t = getattr(self._kit, kind)(layer)
            if isinstance(t, np.ndarray):
                t = torch.from_numpy(t)
            if t.dtype != torch.float32:
                raise ExampleError(f"the {kind} pool of layer {layer} is {t.dtype}, this example "
                                   "writes fp32 (--activation_dtype=fp32 --state_dtype=fp32)")
            self._cache[key] = t
        return self._cache[key]

    def recurrent(self, layer: int) -> torch.Tensor:
        return self._get("recurrent", layer)

    def conv(self, layer: int) -> torch.Tensor:
        return self._get("conv", layer)

    def close(self) -> None:
        self._cache.clear()  # the kit's pools close with its Runner
