"""Seeing every attention call of a model: a registered transformers attention implementation that
computes the usual SDPA output and hands each layer's post-RoPE queries and keys and its values to a
recorder. Calibration (``convert``) and attention similarity (``eval``) both read models through it,
so every family's own projections, biases, q/k norms and partial rotary are taken as the model
applies them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

IMPL = "mha2gqa_capture"
_recorder: Callable[..., None] | None = None


def softcap_of(module: Any) -> float | None:
    """The attention-logit soft cap of an attention module (Gemma 2: ``cap * tanh(scores / cap)``), or None."""
    return getattr(module, "attn_logit_softcapping", None)


def soft_capped(scores: Any, cap: float | None) -> Any:
    """``cap * tanh(scores / cap)``, the scores as a soft-capping family sees them; ``scores`` when None."""
    import torch

    return scores if cap is None else torch.tanh(scores / cap) * cap


@dataclass(frozen=True)
class AttentionCall:
    """One attention call as the recorder sees it: ``q`` ``[B, H, T, d]``, ``k``/``v`` ``[B, G, T, d]``
    post-RoPE, the ``mask``, ``scaling`` and ``window`` (sliding) it ran with, ``output`` the SDPA result
    ``[B, T, H, d]``, ``module`` the attention module of decoder layer ``layer``."""

    layer: int
    q: Any
    k: Any
    v: Any
    mask: Any
    scaling: float | None
    window: int | None
    output: Any
    module: Any


def _capture_forward(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kwargs.get("softcap") is not None:  # SDPA has no soft cap: the eager computation, as the model's own
        out = _softcapped_attention(query, key, value, attention_mask, kwargs.get("scaling"), kwargs["softcap"])
    else:
        out = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if _recorder is not None:
        scaling, window = kwargs.get("scaling"), kwargs.get("sliding_window")
        _recorder(AttentionCall(module.layer_idx, query, key, value, attention_mask, scaling, window, out[0], module))
    return out


def _softcapped_attention(query, key, value, mask, scaling: float | None, softcap: float):
    """Eager attention with soft-capped scores: ``[B, H, T, d]`` queries, ``[B, G, S, d]`` keys and
    values, a boolean (True: attend) or additive mask, or None (causal) -> ``([B, T, H, d], probs)``."""
    import torch

    n = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(n, 1), value.repeat_interleave(n, 1)
    scores = soft_capped(torch.matmul(query, key.transpose(2, 3)) * (scaling or query.shape[-1] ** -0.5), softcap)
    if mask is None:
        t, s = query.shape[2], key.shape[2]
        mask = torch.ones(t, s, dtype=torch.bool, device=query.device).tril(s - t)
    mask = mask[..., : key.shape[2]]
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(IMPL, _capture_forward)
    AttentionMaskInterface.register(IMPL, sdpa_mask)


@contextlib.contextmanager
def capturing(model: Any, recorder: Callable[..., None]) -> Iterator[None]:
    """Within the block, ``recorder(call)`` sees every attention call of ``model`` (which otherwise
    runs exactly as with SDPA) as an :class:`AttentionCall`."""
    global _recorder
    _register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(IMPL)
    _recorder = recorder
    try:
        yield
    finally:
        _recorder = None
        model.set_attn_implementation(previous)


#: Where transformers' base models hold their decoder-layer list (``layers``; ``h`` in GPT-2-style
#: classes: GPTBigCode, Falcon; ``decoder.layers`` in OPT's).
LAYER_LISTS = ("layers", "h", "decoder.layers")


def decoder_layers(model: Any) -> tuple[Any, Any, str]:
    """``(the decoder layers of a causal LM, the module that holds them, its attribute naming them)``:
    ``setattr(holder, name, other)`` swaps them."""
    base = model.base_model
    for path in LAYER_LISTS:
        *outer, name = path.split(".")
        holder = base
        for part in outer:
            holder = getattr(holder, part, None)
        layers = getattr(holder, name, None) if holder is not None else None
        if layers is not None:
            return layers, holder, name
    raise AttributeError(f"{type(base).__name__} has none of {LAYER_LISTS}")
