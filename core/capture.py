"""Seeing every attention call of a model: a registered transformers attention implementation that
computes the usual SDPA output and hands each layer's post-RoPE queries and keys and its values to a
recorder. Calibration (``convert``) and attention similarity (``eval``) both read models through it,
so every family's own projections, biases, q/k norms and partial rotary are taken as the model
applies them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

IMPL = "mha2gqa_capture"
_recorder: Callable[..., None] | None = None


def _capture_forward(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if _recorder is not None:
        scaling, window = kwargs.get("scaling"), kwargs.get("sliding_window")
        _recorder(module.layer_idx, query, key, value, attention_mask, scaling, window, out[0], module)
    return out


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(IMPL, _capture_forward)
    AttentionMaskInterface.register(IMPL, sdpa_mask)


@contextlib.contextmanager
def capturing(model: Any, recorder: Callable[..., None]) -> Iterator[None]:
    """Within the block, ``recorder(layer, q, k, v, mask, scaling, sliding_window, output, module)``
    sees every attention call of ``model`` (which otherwise runs exactly as with SDPA): ``q``
    ``[B, H, T, d]``, ``k``/``v`` ``[B, G, T, d]`` post-RoPE, ``output`` the SDPA result ``[B, T, H, d]``,
    ``module`` the attention module."""
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


#: Attribute names of the decoder-layer list in transformers' base models (``layers``; ``h`` in
#: GPT-2-style classes: GPTBigCode, Falcon).
LAYER_LISTS = ("layers", "h")


def decoder_layers(model: Any) -> tuple[Any, str]:
    """The decoder layers of a causal LM and the attribute of its base model that holds them."""
    base = model.base_model
    for name in LAYER_LISTS:
        layers = getattr(base, name, None)
        if layers is not None:
            return layers, name
    raise AttributeError(f"{type(base).__name__} has none of {LAYER_LISTS}")
