"""The verify forward: transformers' modules over every request's packed window, with two
kernels of each GDN layer replaced (the causal conv update by the window update on the
SpecState conv pool, the recurrence by SpecState's Verify)."""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .model import ExampleError, Geometry, decoder_layers
from .runner import Pools


@dataclasses.dataclass
class Row:
    """One request's part of a packed verify forward."""

    start: int      # its tokens are [start, end) of the packed batch
    end: int
    block: int      # its SpecState state block
    past: int       # tokens in its attention KV cache before this step
    cache: Any      # its transformers cache (the full-attention layers' KV)


class _Handle:
    """Stands in for a cache tensor the GDN module reads and hands to a replaced kernel.
    transformers >= 5.1x keeps a dict of states per layer and reads `conv_states[0]`:
    state 0 is the handle itself."""

    def __init__(self, what: str, layer: int) -> None:
        self.what, self.layer = what, layer

    def __getitem__(self, i: Any) -> "_Handle":
        if isinstance(i, int) and i == 0:
            return self
        raise ExampleError(f"the GDN module indexed its {self} with {i!r}: this example hands it "
                           "the state it reads and replaces the kernels that use it, and knows "
                           "only state 0")

    def __repr__(self) -> str:
        return f"<SpecState {self.what} of GDN layer {self.layer}>"


class _AnyIndex:
    def __init__(self, make: Callable[[int], Any]) -> None:
        self._make = make

    def __getitem__(self, i: int) -> Any:
        return self._make(i)

    def __setitem__(self, i: int, value: Any) -> None:
        pass  # the module stores its new recurrent state: SpecState holds it

    def __len__(self) -> int:
        return 1 << 30


class _LinearLayerView:
    """cache.layers[i] of transformers >= 5: LinearAttentionLayer (its conv_states and
    recurrent_states a tensor each, or a dict of them by state index in 5.1x)."""

    def __init__(self, conv: _Handle, rec: _Handle) -> None:
        self.conv_states, self.recurrent_states = conv, rec
        self.has_previous_state = {0: True}  # truthy, and per state index where a dict
        self.record_past = False             # 5.1x: decode path only without past recording


class _DecodeCacheView:
    """What a Qwen3NextGatedDeltaNet reads of its cache_params while it decodes: a previous
    state exists (so it takes its decode path: causal_conv1d_update and the recurrent
    gated delta rule), the states are SpecState's (the replaced kernels use the pools),
    and the new state it stores is dropped. transformers 5.x: has_previous_state(layer_idx
    [, state_idx]), layers[i].conv_states (or .conv_states[0]), layers[i].record_past,
    update_recurrent_state(); 4.57: has_previous_state (truthy), conv_states[i],
    recurrent_states[i] = ..."""

    def __init__(self, spec_layer: int) -> None:
        conv, rec = _Handle("conv window", spec_layer), _Handle("recurrent state", spec_layer)
        self.conv_states = _AnyIndex(lambda i: conv)
        self.recurrent_states = _AnyIndex(lambda i: rec)
        self.layers = _AnyIndex(lambda i: _LinearLayerView(conv, rec))

    def has_previous_state(self, layer_idx: Optional[int] = None, state_idx: Optional[int] = None,
                           **kwargs: Any) -> bool:  # a method: truthy too (4.57 reads it as such)
        return True

    def update_recurrent_state(self, recurrent_states: Any, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        return recurrent_states

    def update_conv_state(self, conv_states: Any, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        raise ExampleError("the GDN module took its prefill path inside a verify forward")


# Where the two kernels the decode path calls live. transformers 4.57-5.1x: instance
# attributes set in Qwen3NextGatedDeltaNet.__init__ (`self.causal_conv1d_update =
# causal_conv1d_update or torch_causal_conv1d_update`, `self.recurrent_gated_delta_rule =
# fused_recurrent_gated_delta_rule or torch_recurrent_gated_delta_rule`); newer ones call
# module-level functions of modeling_qwen3_next (`causal_conv1d_update(...)`,
# `torch_recurrent_gated_delta_rule(...)`, registered with @use_kernelized_func). Every one
# of these names that exists is replaced while installed.
_CONV_ATTRS = ("causal_conv1d_update",)
_REC_ATTRS = ("recurrent_gated_delta_rule",)
_CONV_GLOBALS = ("causal_conv1d_update", "torch_causal_conv1d_update")
_REC_GLOBALS = ("recurrent_gated_delta_rule", "fused_recurrent_gated_delta_rule",
                "torch_recurrent_gated_delta_rule")


def _unwrapped(fn: Callable) -> Callable:
    """The function behind a method and its decorators: through __wrapped__, or, where a
    decorator sets none (transformers 5.x's @force_accelerate_hooks("conv1d") on the GDN
    forward), through the closure cell holding a function of the same name."""
    fn = getattr(fn, "__func__", fn)
    name = getattr(fn, "__name__", None)
    for _ in range(8):
        inner = getattr(fn, "__wrapped__", None)
        if inner is None:
            cells = []
            for cell in getattr(fn, "__closure__", None) or ():
                try:
                    cells.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    continue
            found = [c for c in cells if inspect.isfunction(c) and c.__name__ in (name, "forward")]
            if len(found) != 1:
                break
            inner = found[0]
        fn = getattr(inner, "__func__", inner)
    return fn


def _kernel_globals(module: Any) -> List[Dict[str, Any]]:
    """The globals the module's forward reads its kernels from (its modeling file's)."""
    out: List[Dict[str, Any]] = []
    real = _unwrapped(type(module).forward)
    g = getattr(real, "__globals__", None)
    if isinstance(g, dict):
        out.append(g)
    mod = sys.modules.get(type(module).__module__)
    if mod is not None and all(mod.__dict__ is not d for d in out):
        out.append(mod.__dict__)
    return out


class VerifyForward:
    """Runs one packed verify step: every request's window through the model.

    Full-attention layers: transformers' module per request, with its cache and an
    explicit causal mask over [past + window]. GDN layers: transformers' module on the
    packed tokens, seen as a batch of T one-token sequences so that it takes its
    decode path, with its causal conv update (`causal_conv1d_update`) replaced by the
    window update on the SpecState conv pool and its recurrent gated delta rule by
    SpecState's Verify, wherever this transformers keeps them (_kernel_slots).
    """

    def __init__(self, model: Any, geo: Geometry, pools: Pools) -> None:
        self.model, self.geo, self.pools = model, geo, pools
        self.layers = decoder_layers(model)
        self.spec_layer_of = {d: i for i, d in enumerate(geo.gdn_layers)}
        self.rows: List[Row] = []
        self.step: Any = None
        self._layer, self._seen = -1, set()
        self.hl = geo.conv_kernel - 1
        self.installed = False
        self._saved: List[Tuple[Any, str, Any]] = []
        for d in geo.gdn_layers:
            layer = self.layers[d]
            m = getattr(layer, "linear_attn", None)
            if m is None:
                raise ExampleError(f"decoder layer {d} (linear_attention) has no linear_attn module")
            if not hasattr(m, "conv1d"):
                raise ExampleError(f"{type(m).__name__} has no conv1d: this example reads the GDN "
                                   "conv's weight from linear_attn.conv1d")
            self._kernel_slots(m)  # raises, naming what it looked for, if a kernel is not found
        for d in geo.attn_layers:
            if getattr(self.layers[d], "self_attn", None) is None:
                raise ExampleError(f"decoder layer {d} (full_attention) has no self_attn module")

    # -- installing and removing the replacements --------------------------------

    @contextlib.contextmanager
    def installed_on_model(self) -> Iterator[None]:
        for d in self.geo.gdn_layers:
            m = self.layers[d].linear_attn
            spec_layer = self.spec_layer_of[d]
            self._swap(m, "forward", self._gdn_forward(m, m.forward, spec_layer))
            conv_slots, rec_slots = self._kernel_slots(m)
            for container, name in conv_slots:
                self._swap_slot(container, name, self._conv_update)
            for container, name in rec_slots:
                self._swap_slot(container, name, self._recurrence)
        for d in self.geo.attn_layers:
            a = self.layers[d].self_attn
            self._swap(a, "forward", self._attention_forward(a.forward))
        self.installed = True
        try:
            yield
        finally:
            for obj, name, had in reversed(self._saved):
                if isinstance(obj, dict):  # a module's globals or a kernel registry
                    obj[name] = had
                elif had is _MISSING:
                    delattr(obj, name)
                else:
                    setattr(obj, name, had)
            self._saved.clear()
            self.installed = False

    def _swap(self, obj: Any, name: str, value: Any) -> None:
        self._saved.append((obj, name, obj.__dict__.get(name, _MISSING)))
        setattr(obj, name, value)

    def _swap_slot(self, container: Any, name: str, value: Any) -> None:
        if not isinstance(container, dict):
            self._swap(container, name, value)
        elif not any(obj is container and n == name for obj, n, _ in self._saved):
            self._saved.append((container, name, container[name]))  # globals: once for all layers
            container[name] = value

    @staticmethod
    def _kernel_slots(m: Any) -> Tuple[List[Tuple[Any, str]], List[Tuple[Any, str]]]:
        """Where module m's decode path finds its conv update and recurrent kernel: instance
        attributes (transformers 4.57-5.1x), its modeling file's module-level functions
        (newer), and the @use_kernelized_func registry (m._hidden_kernels) where it has one."""
        slots: Tuple[List[Tuple[Any, str]], List[Tuple[Any, str]]] = ([], [])
        for out, attrs, names in ((slots[0], _CONV_ATTRS, _CONV_GLOBALS),
                                  (slots[1], _REC_ATTRS, _REC_GLOBALS)):
            out += [(m, a) for a in attrs if callable(getattr(m, a, None))]
            hidden = m.__dict__.get("_hidden_kernels")
            for d in _kernel_globals(m) + ([hidden] if isinstance(hidden, dict) else []):
                out += [(d, n) for n in names if callable(d.get(n))]
        for out, what in ((slots[0], "causal conv update"), (slots[1], "recurrent gated delta rule")):
            if not out:
                names = _CONV_ATTRS + _CONV_GLOBALS if out is slots[0] else _REC_ATTRS + _REC_GLOBALS
                raise ExampleError(
                    f"{type(m).__name__} ({type(m).__module__}) has no {what} this example can "
                    f"replace: looked for the instance attribute {names[0]!r} (transformers "
                    f"4.57-5.1x) and module-level functions {sorted(set(names))} in its modeling file")
        return slots

    # -- GDN ---------------------------------------------------------------------

    def _gdn_forward(self, module: Any, original: Callable, spec_layer: int) -> Callable:
        # transformers 5.x decorates the forward with @force_accelerate_hooks("conv1d"), whose
        # wrapper (self, *args, **kwargs) sets no __wrapped__: the parameters are the inner one's.
        sig = inspect.signature(_unwrapped(original))
        params = sig.parameters
        owner = self
        cache_name = next((n for n in ("cache_params", "past_key_values", "past_key_value")
                           if n in params), None)
        if cache_name is None and any(p.kind is p.VAR_KEYWORD for p in params.values()):
            cache_name = "cache_params"  # a wrapper we could not see through: the name 4.57-5.x use
        if cache_name is None:
            raise ExampleError(f"{type(module).__name__}.forward{sig} takes "
                               "no cache_params / past_key_values: this example hands the GDN "
                               "module a cache view that makes it take its decode path")

        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if hidden_states.dim() != 3 or hidden_states.shape[0] != 1:
                raise ExampleError(f"packed hidden states are [1, T, hidden], got "
                                   f"{tuple(hidden_states.shape)}")
            owner._layer = spec_layer
            owner._seen = set()
            call: Dict[str, Any] = {cache_name: _DecodeCacheView(spec_layer)}
            if "attention_mask" in params:
                call["attention_mask"] = None
            if "cache_position" in params:  # 4.57 also needs it for its decode path
                call["cache_position"] = torch.zeros(1, dtype=torch.long, device=hidden_states.device)
            # T one-token sequences: the module's decode path, every projection per token.
            out = original(hidden_states.transpose(0, 1), **call)
            if owner._seen != {"conv", "recurrence"}:
                missing = {"conv", "recurrence"} - owner._seen
                raise ExampleError(
                    f"{type(module).__name__}.forward did not call its "
                    f"{' and '.join(sorted(missing))} kernel through a replaced name (instance "
                    f"attributes {_CONV_ATTRS + _REC_ATTRS} or module-level "
                    f"{_CONV_GLOBALS + _REC_GLOBALS}) with a cache that has a previous state and "
                    "one token per sequence: transformers' GDN decode path differs from what "
                    "this example replaces")
            return out.transpose(0, 1)

        return forward

    def _conv_update(self, x: torch.Tensor, conv_state: Any, weight: torch.Tensor,
                     bias: Optional[torch.Tensor] = None, activation: Optional[str] = None,
                     *args: Any, **kwargs: Any) -> torch.Tensor:
        """The causal conv of every row's window, on its block of the SpecState conv pool.

        docs/semantics.md's contract: the block's columns [0, hl) hold the last hl inputs
        h_1..h_hl (hl = kernel - 1); the update writes [h_2..h_hl, x_0..x_{T-1}] from
        column 0, and Commit moves the window ending at the last accepted token back to
        columns [0, hl). transformers' update is the same convolution over [state, x]."""
        self._seen.add("conv")
        if args or any(v is not None for v in kwargs.values()):
            raise ExampleError(f"causal_conv1d_update called with arguments this example does not "
                               f"know: {len(args)} positional, {sorted(kwargs)}")
        if activation not in (None, "silu", "swish"):
            raise ExampleError(f"the GDN conv's activation is {activation!r}; expected silu")
        T, D = x.shape[0], x.shape[1]
        if x.dim() != 3 or x.shape[2] != 1 or D != self.geo.conv_dim or T != self.rows[-1].end:
            raise ExampleError(f"causal_conv1d_update input {tuple(x.shape)}, expected "
                               f"[{self.rows[-1].end}, {self.geo.conv_dim}, 1]")
        if weight.dim() == 3:
            weight = weight.squeeze(1)
        if tuple(weight.shape) != (D, self.geo.conv_kernel):
            raise ExampleError(f"conv weight {tuple(weight.shape)}, expected "
                               f"[{D}, {self.geo.conv_kernel}]")
        pool = self.pools.conv(self._layer)  # [blocks, D, W], in place
        hl = self.hl
        xs = x[:, :, 0]
        out = torch.empty_like(xs)
        for row in self.rows:
            n = row.end - row.start
            window = torch.cat([pool[row.block, :, :hl].to(x.dtype), xs[row.start:row.end].t()], dim=1)
            y = F.conv1d(window.unsqueeze(0), weight.unsqueeze(1), bias, groups=D)[0]  # [D, n]
            out[row.start:row.end] = (F.silu(y) if activation is not None else y).t()
            pool[row.block, :, :hl - 1 + n] = window[:, 1:]
        return out.unsqueeze(-1)

    def _recurrence(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    g: Optional[torch.Tensor] = None, beta: Optional[torch.Tensor] = None,
                    initial_state: Any = None, output_final_state: bool = False,
                    use_qk_l2norm_in_kernel: bool = False, scale: Optional[float] = None,
                    **kwargs: Any) -> Tuple[torch.Tensor, None]:
        """SpecState's Verify in place of the module's recurrent kernel.

        The module hands over q, k after the conv (q, k repeated to the value heads when HV
        > H), v, g = -exp(A_log) softplus(a + dt_bias) (the log-decay) and beta = sigmoid(b),
        asking the kernel to l2-normalize q and k (eps 1e-6) and scale q by K^-0.5: exactly
        what SpecState's GDN step does (docs/semantics.md), so everything goes as is."""
        self._seen.add("recurrence")
        extra = {k: v for k, v in kwargs.items() if v is not None}
        if extra:
            raise ExampleError(f"recurrent_gated_delta_rule called with {sorted(extra)}: unknown here")
        if not use_qk_l2norm_in_kernel:
            raise ExampleError("the GDN module asked its recurrent kernel not to l2-normalize q and "
                               "k; SpecState always does (docs/semantics.md): they would be "
                               "normalized twice")
        K = self.geo.head_dim
        if scale is not None and not math.isclose(scale, K ** -0.5, rel_tol=1e-6):
            raise ExampleError(f"the GDN module scales q by {scale}; SpecState by K^-0.5 = {K ** -0.5}")
        if g is None or beta is None:
            raise ExampleError("recurrent_gated_delta_rule called without g or beta")
        H, HV = self.geo.heads, self.geo.value_heads
        T = query.shape[0]
        if query.dim() != 4 or query.shape[1] != 1 or value.shape[2] != HV:
            raise ExampleError(f"q {tuple(query.shape)}, v {tuple(value.shape)}: expected "
                               f"[T, 1, H or HV, {K}] and [T, 1, {HV}, {K}]")
        q, k = query[:, 0], key[:, 0]
        if q.shape[1] == HV and HV != H:  # repeat_interleave'd: value head hv reads key head hv // r
            r = HV // H
            q, k = q[:, ::r], k[:, ::r]
        if q.shape[1] != H:
            raise ExampleError(f"q has {q.shape[1]} heads; expected {H} or {HV}")
        o = self.step.verify(self._layer, q.float(), k.float(), value[:, 0].float(),
                             g.reshape(T, HV).float(), beta.reshape(T, HV).float())
        return o.reshape(T, 1, HV, K).to(value.dtype).clone(), None

    # -- full attention ------------------------------------------------------------

    def _attention_forward(self, original: Callable) -> Callable:
        owner = self
        params = inspect.signature(original).parameters
        # transformers >= 4.56 names the cache past_key_values (past_key_value before).
        cache_kw = "past_key_value" if ("past_key_value" in params and
                                        "past_key_values" not in params) else "past_key_values"

        def forward(*args: Any, **kwargs: Any) -> Tuple[torch.Tensor, None]:
            hidden = kwargs.pop("hidden_states", None)
            if hidden is None:
                hidden, args = args[0], args[1:]
            pe = kwargs.pop("position_embeddings", None)
            if pe is None:
                pe, args = args[0], args[1:]
            if args:
                raise ExampleError(f"the decoder layer passed {len(args)} more positional "
                                   "arguments to self_attn than this example knows")
            kwargs.pop("attention_mask", None)
            kwargs.pop("past_key_values", None)
            kwargs.pop("past_key_value", None)
            kwargs.pop("position_ids", None)
            had_cache_position = kwargs.pop("cache_position", None) is not None
            cos, sin = pe
            outs = []
            for row in owner.rows:
                n = row.end - row.start
                mask = None
                if n > 1:  # causal over [past + window]; eager adds it, sdpa takes it as is
                    allowed = (torch.arange(row.past + n, device=hidden.device)[None, :]
                               <= row.past + torch.arange(n, device=hidden.device)[:, None])
                    mask = torch.zeros(allowed.shape, dtype=hidden.dtype, device=hidden.device)
                    mask.masked_fill_(~allowed, torch.finfo(hidden.dtype).min)
                    mask = mask[None, None]
                extra = dict(kwargs)
                if had_cache_position:
                    extra["cache_position"] = torch.arange(row.past, row.past + n, device=hidden.device)
                out = original(hidden_states=hidden[:, row.start:row.end],
                               position_embeddings=(cos[:, row.start:row.end], sin[:, row.start:row.end]),
                               attention_mask=mask, **{cache_kw: row.cache}, **extra)
                outs.append(out[0] if isinstance(out, tuple) else out)
            return torch.cat(outs, dim=1), None

        return forward

    # -- one step ------------------------------------------------------------------

    def logits(self, tokens: torch.Tensor, positions: torch.Tensor, rows: List[Row], step: Any) -> torch.Tensor:
        """logits [T, vocab] of the packed tokens [T] at positions [T]."""
        if not self.installed:
            raise ExampleError("VerifyForward.logits outside installed_on_model()")
        self.rows, self.step = rows, step
        inner = self.model.model
        hidden = inner.embed_tokens(tokens[None])
        pos = positions[None]
        pe = inner.rotary_emb(hidden, pos)
        for layer in self.layers:
            hidden = layer(hidden, position_embeddings=pe, attention_mask=None, position_ids=pos,
                           past_key_values=None)
            if isinstance(hidden, tuple):
                hidden = hidden[0]
        hidden = inner.norm(hidden)
        return self.model.lm_head(hidden)[0].float()


_MISSING = object()
