"""Checkpoints whose layers have different KV-head counts: the model class that loads them.

transformers' decoders take one ``num_key_value_heads`` for every layer, but nothing in their
attention depends on it being shared: each layer's K/V projections give its heads (the forward
reshapes by ``head_dim``), ``num_key_value_groups`` tells SDPA how many query heads share one,
and the dynamic KV cache stores whatever each layer hands it. So a model built as usual (with the
largest count) and then given, layer by layer, K/V projections of that layer's size loads the
weights and caches exactly ``G_l`` heads in layer ``l``.

mha2gqa's loader does that in process (:func:`per_layer_class`); a converted checkpoint also carries
``modeling_mha2gqa.py`` (written from this module's own source) and an ``auto_map`` entry, so stock
``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`` builds the same model.
Families with separate q/k/v projections and no per-KV-head norm module are supported.
"""

from __future__ import annotations

import inspect
from typing import Any

from mha2gqa.core.dims import PER_LAYER_KEY

MODELING_FILE = "modeling_mha2gqa.py"
CLASS_PREFIX = "Mha2GqaPerLayer"


def resize_kv_heads(model: Any, heads_per_layer: list[int]) -> None:
    """Give each decoder layer K/V projections for its own KV-head count (before weights load)."""
    import torch

    heads = model.config.num_attention_heads
    for layer, g in zip(model.base_model.layers, heads_per_layer, strict=True):
        attn = layer.self_attn
        for name in ("k_proj", "v_proj"):
            old = getattr(attn, name)
            new = torch.nn.Linear(old.in_features, g * attn.head_dim, bias=old.bias is not None,
                                  device=old.weight.device, dtype=old.weight.dtype)  # fmt: skip
            setattr(attn, name, new)
        attn.num_key_value_groups = heads // g
        if hasattr(attn, "num_key_value_heads"):
            attn.num_key_value_heads = g


def causal_lm_class(config: Any) -> type:
    """transformers' ``*ForCausalLM`` class for a config object."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def per_layer_class(base: type) -> type:
    """``base`` (a ``*ForCausalLM`` class) whose layers get their own KV-head counts from the config."""

    def __init__(self, config) -> None:
        base.__init__(self, config)
        resize_kv_heads(self, list(getattr(config, PER_LAYER_KEY)))

    return type(CLASS_PREFIX + base.__name__, (base,), {"__init__": __init__})


def modeling_source(base_name: str) -> str:
    """The ``modeling_mha2gqa.py`` written beside the weights: :func:`resize_kv_heads` and the class
    for ``base_name``, self-contained (stock transformers and torch only)."""
    return (
        '"""Written by mha2gqa: this checkpoint\'s layers have different KV-head counts (config key\n'
        f'{PER_LAYER_KEY}). Load with AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)."""\n\n'
        "from __future__ import annotations\n\nfrom typing import Any\n\n"
        f"from transformers import {base_name}\n\n\n"
        + inspect.getsource(resize_kv_heads)
        + f"\n\nclass {CLASS_PREFIX}{base_name}({base_name}):\n"
        "    def __init__(self, config):\n"
        "        super().__init__(config)\n"
        f"        resize_kv_heads(self, list(config.{PER_LAYER_KEY}))\n"
    )


def auto_map(base_name: str) -> dict[str, str]:
    """The config's ``auto_map`` entry that points stock transformers at the modeling file."""
    return {"AutoModelForCausalLM": f"{MODELING_FILE.removesuffix('.py')}.{CLASS_PREFIX}{base_name}"}
