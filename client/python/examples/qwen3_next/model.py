"""The model side: a tiny Qwen3-Next built from transformers' own classes, its geometry
(what specstated's layout must say), and transformers' cache (the GDN states after
prefill, the attention KV)."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Dict, List, Sequence, Tuple

import torch


class ExampleError(RuntimeError):
    """Something this example relies on is not as it expects (named in the message)."""


# ---------------------------------------------------------------------------
# The model: a tiny Qwen3-Next built from transformers' own classes.

def _transformers():
    try:
        import transformers  # noqa: PLC0415
    except ImportError as e:
        raise ExampleError(f"this example needs transformers with Qwen3-Next: {e}") from None
    for name in ("Qwen3NextConfig", "Qwen3NextForCausalLM"):
        if not hasattr(transformers, name):
            raise ExampleError(f"transformers {transformers.__version__} has no {name} "
                               "(Qwen3-Next arrived in transformers 4.57)")
    return transformers


def layer_types_of(args: argparse.Namespace) -> List[str]:
    """Qwen3-Next's pattern: every `full_attention_interval`-th layer is full attention."""
    return ["full_attention" if (i + 1) % args.full_attention_interval == 0 else "linear_attention"
            for i in range(args.layers)]


def config_kwargs(args: argparse.Namespace) -> Dict[str, Any]:
    """The tiny model's Qwen3NextConfig fields (only fields every version has)."""
    return dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        layer_types=layer_types_of(args),
        num_attention_heads=args.attn_heads,
        num_key_value_heads=args.attn_kv_heads,
        head_dim=args.attn_head_dim,
        linear_conv_kernel_dim=args.conv_kernel,
        linear_key_head_dim=args.gdn_head_dim,
        linear_value_head_dim=args.gdn_head_dim,  # SpecState has V = K
        linear_num_key_heads=args.gdn_key_heads,
        linear_num_value_heads=args.gdn_value_heads,
        num_experts=args.experts,
        num_experts_per_tok=args.experts_per_tok,
        moe_intermediate_size=args.moe_intermediate,
        shared_expert_intermediate_size=args.moe_intermediate,
        decoder_sparse_step=1,
        mlp_only_layers=list(args.mlp_only_layers),  # these get the dense MLP
        norm_topk_prob=True,
        max_position_embeddings=args.max_positions,
        initializer_range=args.init_std,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=False,
        use_cache=True,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,  # never stop early: every request decodes --new_tokens
    )


@dataclasses.dataclass
class Geometry:
    """What specstated's layout must say, from the model's config."""

    gdn_layers: List[int]     # decoder-layer index of SpecState layer i
    attn_layers: List[int]
    heads: int                # linear_num_key_heads (H)
    value_heads: int          # linear_num_value_heads (HV)
    head_dim: int             # linear_key_head_dim == linear_value_head_dim (K = V)
    conv_dim: int             # 2 * H * K + HV * V: the GDN conv's channels
    conv_kernel: int

    @staticmethod
    def of(config: Any) -> "Geometry":
        types = list(config.layer_types)
        gdn = [i for i, t in enumerate(types) if t == "linear_attention"]
        attn = [i for i, t in enumerate(types) if t == "full_attention"]
        others = sorted(set(types) - {"linear_attention", "full_attention"})
        if others:
            raise ExampleError(f"config.layer_types has {others}: this example knows "
                               "linear_attention and full_attention")
        if config.linear_key_head_dim != config.linear_value_head_dim:
            raise ExampleError(
                f"linear_key_head_dim {config.linear_key_head_dim} != linear_value_head_dim "
                f"{config.linear_value_head_dim}: SpecState's state blocks are [HV, V, K] with V = K")
        h, hv, k = config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim
        if hv % h:
            raise ExampleError(f"linear_num_value_heads {hv} is not a multiple of "
                               f"linear_num_key_heads {h}")
        return Geometry(gdn, attn, h, hv, k, 2 * h * k + hv * k, config.linear_conv_kernel_dim)


def _accepted_config_kwargs(cls: Any, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The kwargs this version's Qwen3NextConfig knows (its dataclass fields in transformers
    >= 5; 4.x takes everything); the MoE/dense choice per layer as mlp_layer_types where a
    version names it so. Fields it lacks are left at its defaults, and said so."""
    if not dataclasses.is_dataclass(cls):
        return kwargs  # 4.x: explicit parameters and **kwargs for PretrainedConfig's own
    known = {f.name for f in dataclasses.fields(cls)}
    out = {k: v for k, v in kwargs.items() if k in known}
    if "mlp_only_layers" not in known and "mlp_layer_types" in known:
        out["mlp_layer_types"] = ["dense" if i in kwargs["mlp_only_layers"] else "sparse"
                                  for i in range(kwargs["num_hidden_layers"])]
    dropped = sorted(set(kwargs) - known - {"mlp_only_layers"} if "mlp_layer_types" in out
                     else set(kwargs) - known)
    if dropped:
        print(f"note: this transformers' {cls.__name__} has no {', '.join(dropped)}: left at "
              "its defaults")
    return out


def build_model(args: argparse.Namespace, device: torch.device) -> Any:
    tf = _transformers()
    torch.manual_seed(args.seed)
    config = tf.Qwen3NextConfig(**_accepted_config_kwargs(tf.Qwen3NextConfig, config_kwargs(args)))
    # The verify forward passes its own additive masks (one per request, see
    # _attention_forward): eager and sdpa take them; flash attention would not.
    if args.attn_implementation not in ("eager", "sdpa"):
        raise ExampleError("--attn_implementation must be eager or sdpa")
    config._attn_implementation = args.attn_implementation
    model = tf.Qwen3NextForCausalLM(config)
    model.to(device=device, dtype=torch.float32).eval()
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != args.attn_implementation:
        raise ExampleError(f"asked for attn_implementation {args.attn_implementation!r}, "
                           f"the model runs {impl!r}")
    if args.embed_scale != 1.0:
        # Scales the token embeddings: the residual stream then leans on the current token,
        # and greedy decoding falls into the cycles prompt lookup predicts (a random model's
        # context alone gives a few percent acceptance), while the layers still decide some.
        model.model.embed_tokens.weight.data.mul_(args.embed_scale)
    if args.router_scale != 1.0:
        # Sharper MoE routing: with transformers' 0.02 router weights the 2nd and 3rd experts'
        # probabilities can lie within the fp32 noise between two forwards of one token (a
        # batch of one in generate, a packed window here), and a flipped expert moves that
        # token's hidden state far past a near-tie. Scaled weights keep the choice robust.
        for layer in model.model.layers:
            gate = getattr(getattr(layer, "mlp", None), "gate", None)
            if gate is not None and hasattr(gate, "weight"):
                gate.weight.data.mul_(args.router_scale)
    if args.decay_range:
        # transformers draws A = exp(A_log) from U(0, 16): with dt_bias = 1 most heads then keep
        # exp(-A softplus(a + 1)) ~ e^-10 of their state per token and forget it at once, which
        # would hide a wrong state. A from U(lo, hi) keeps a memory of tens to hundreds of tokens.
        lo, hi = args.decay_range
        gen = torch.Generator().manual_seed(args.seed + 2)
        for d in Geometry.of(model.config).gdn_layers:
            m = model.model.layers[d].linear_attn
            a = torch.empty(m.A_log.shape, dtype=torch.float32).uniform_(lo, hi, generator=gen)
            m.A_log.data.copy_(a.log().to(m.A_log.device))
    for name, p in model.named_parameters():
        if not torch.isfinite(p).all():
            raise ExampleError(f"transformers' initialization left non-finite values in {name}")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def decoder_layers(model: Any) -> Sequence[Any]:
    inner = getattr(model, "model", None)
    for attr in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(inner, attr):
            raise ExampleError(f"Qwen3NextForCausalLM.model has no {attr!r}: the verify forward "
                               "drives model.model's embed_tokens, layers, rotary_emb and norm")
    if not hasattr(model, "lm_head"):
        raise ExampleError("Qwen3NextForCausalLM has no lm_head")
    return inner.layers


# ---------------------------------------------------------------------------
# transformers' cache: the GDN states after prefill, and the attention KV.

def _state0(x: Any) -> Any:
    """transformers >= 5.1x keeps a layer's states in a dict by state index (Qwen3-Next's GDN
    has one, index 0); earlier 5.x the tensor itself."""
    if isinstance(x, dict):
        return x.get(0)
    if isinstance(x, (list, tuple)):
        return x[0] if x else None
    return x


def cache_gdn_states(cache: Any, layer_idx: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(conv window [D, W_tf], recurrent state [HV, K, V]) of batch row 0 of decoder layer
    `layer_idx`: transformers >= 5 keeps them on cache.layers[i] (LinearAttentionLayer:
    .conv_states / .recurrent_states, tensors, or dicts {0: tensor} from 5.1x on), 4.57's
    Qwen3NextDynamicCache in cache.conv_states[i] / cache.recurrent_states[i]."""
    layers = getattr(cache, "layers", None)
    conv = rec = None
    if layers is not None and layer_idx < len(layers) and hasattr(layers[layer_idx], "recurrent_states"):
        conv, rec = _state0(layers[layer_idx].conv_states), _state0(layers[layer_idx].recurrent_states)
    elif hasattr(cache, "recurrent_states") and hasattr(cache, "conv_states"):
        conv, rec = cache.conv_states[layer_idx], cache.recurrent_states[layer_idx]
    else:
        raise ExampleError(f"{type(cache).__name__} keeps layer {layer_idx}'s GDN states neither "
                           "in .layers[i].conv_states/.recurrent_states nor in "
                           ".conv_states[i]/.recurrent_states[i]")
    if not torch.is_tensor(conv) or not torch.is_tensor(rec):
        raise ExampleError(f"layer {layer_idx}'s GDN cache holds no tensors after prefill "
                           f"(conv {type(conv).__name__}, recurrent {type(rec).__name__})")
    if conv.dim() != 3 or rec.dim() != 4:
        raise ExampleError(f"layer {layer_idx}'s GDN cache: conv state {tuple(conv.shape)}, recurrent "
                           f"state {tuple(rec.shape)}; expected [B, D, W] and [B, HV, K, V]")
    return conv[0], rec[0]


def cache_length(cache: Any) -> int:
    return int(cache.get_seq_length())


def cache_crop(cache: Any, length: int) -> None:
    """Drops the attention KV of rejected drafts (the GDN entries are not used while decoding).

    Only the full-attention layers: transformers 5.1x's Cache.crop also crops every
    LinearAttentionLayer, which raises unless past recording was switched on, and its
    positive (absolute-length) argument is deprecated (removed in 5.18); a negative one
    removes that many tokens in every 5.x. 4.57's Qwen3NextDynamicCache has no crop: its
    key_cache / value_cache lists are cut directly."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for layer in layers:
            keys = getattr(layer, "keys", None)
            if not torch.is_tensor(keys) or keys.dim() != 4 or keys.shape[-2] <= length:
                continue  # a linear-attention layer, an empty one, or nothing to drop
            crop = getattr(layer, "crop", None)
            if crop is not None:
                crop(length - keys.shape[-2])  # negative: remove that many tokens
            else:
                layer.keys, layer.values = keys[..., :length, :], layer.values[..., :length, :]
    else:
        for attr in ("key_cache", "value_cache"):
            tensors = getattr(cache, attr, None)
            if tensors is None:
                raise ExampleError(f"{type(cache).__name__} has neither .layers nor key_cache/value_cache")
            for i, t in enumerate(tensors):
                if torch.is_tensor(t) and t.dim() == 4 and t.shape[-2] > length:
                    tensors[i] = t[..., :length, :]
    if cache_length(cache) != length:
        raise ExampleError(f"{type(cache).__name__}: cropping to {length} tokens left {cache_length(cache)}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
