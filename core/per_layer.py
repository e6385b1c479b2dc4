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
Families with separate q/k/v projections or a ``[q; k; v]`` fused one (Phi-3), with or without key
norms sized by the KV heads (StableLM, OLMo-2), are supported.

Serving engines read another form of the same fact: NVIDIA's Nemotron-NAS (``DeciLMForCausalLM``)
config, a ``block_configs`` entry per layer whose ``attention.n_heads_in_group`` is ``H / G_l``. vLLM's
``nemotron_nas.py`` and llama.cpp's ``DeciModel`` converter build exactly a Llama block from it,
with the MLP width derived from ``ffn.ffn_mult`` (:func:`ffn_width`). :func:`nemotron_nas` writes
that form too for the Llama sources it can express, and says why not for the others.
"""

from __future__ import annotations

import inspect
import json
import os
from typing import Any

from mha2gqa.core.dims import PER_LAYER_KEY

MODELING_FILE = "modeling_mha2gqa.py"
CLASS_PREFIX = "Mha2GqaPerLayer"


def resize_kv_heads(model: Any, heads_per_layer: list[int]) -> None:
    """Give each decoder layer K/V projections for its own KV-head count (before weights load): the
    K/V rows of separate or fused (``qkv_proj``, ``[q; k; v]``) projections, and key norms sized by
    the KV heads (one LayerNorm per head, StableLM; one norm over all their rows, OLMo-2)."""
    import torch

    heads = model.config.num_attention_heads
    for layer, g in zip(model.base_model.layers, heads_per_layer, strict=True):
        attn = layer.self_attn
        d, old_kv = attn.head_dim, heads // attn.num_key_value_groups
        for name, rows in (("k_proj", g * d), ("v_proj", g * d), ("qkv_proj", (heads + 2 * g) * d)):
            old = getattr(attn, name, None)
            if old is None:
                continue
            new = torch.nn.Linear(
                old.in_features, rows, bias=old.bias is not None, device=old.weight.device, dtype=old.weight.dtype
            )
            setattr(attn, name, new)
        per_head = getattr(getattr(attn, "k_layernorm", None), "norms", None)
        if per_head is not None:  # StableLM: one LayerNorm per KV head
            attn.k_layernorm.norms = torch.nn.ModuleList(list(per_head)[:g])
            attn.k_layernorm.num_heads = g
        norm = getattr(attn, "k_norm", None)
        weight = getattr(norm, "weight", None)
        if weight is not None and old_kv > 1 and weight.numel() == old_kv * d:  # OLMo-2: over all KV heads' rows
            norm.weight = torch.nn.Parameter(torch.ones(g * d, device=weight.device, dtype=weight.dtype))
        attn.num_key_value_groups = heads // g
        if hasattr(attn, "num_key_value_heads"):
            attn.num_key_value_heads = g


class Section(dict):
    """A JSON object whose keys also read as attributes (``block_config.attention.n_heads_in_group``,
    as vLLM reads Nemotron-NAS configs); saved back as the same JSON."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def sections(value: Any) -> Any:
    """``value`` with every JSON object in it made a :class:`Section`."""
    if isinstance(value, dict):
        return Section({k: sections(v) for k, v in value.items()})
    if isinstance(value, list):
        return [sections(v) for v in value]
    return value


def save_keeping_architectures(model: Any, base: type, save_directory: Any, *args: Any, **kwargs: Any) -> None:
    """``base.save_pretrained``, with config.json's ``architectures`` kept as loaded (transformers
    writes the class name, which would drop ``DeciLMForCausalLM`` and the engines that read it)."""
    architectures = list(model.config.architectures or [])
    base.save_pretrained(model, save_directory, *args, **kwargs)
    model.config.architectures = architectures
    path = os.path.join(save_directory, "config.json")
    if architectures and kwargs.get("is_main_process", True) and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        data["architectures"] = architectures
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(data, indent=2, sort_keys=True) + "\n")


def causal_lm_class(config: Any) -> type:
    """transformers' ``*ForCausalLM`` class for a config object."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def per_layer_class(base: type) -> type:
    """``base`` (a ``*ForCausalLM`` class) whose layers get their own KV-head counts from the config."""

    def __init__(self, config) -> None:
        base.__init__(self, config)
        resize_kv_heads(self, list(getattr(config, PER_LAYER_KEY)))

    def save_pretrained(self, save_directory, *args, **kwargs) -> None:
        save_keeping_architectures(self, base, save_directory, *args, **kwargs)

    return type(CLASS_PREFIX + base.__name__, (base,), {"__init__": __init__, "save_pretrained": save_pretrained})


def modeling_source(base_name: str, config_name: str) -> str:
    """The ``modeling_mha2gqa.py`` written beside the weights: the config class (``config_name``
    reading ``block_configs`` as attributes) and the model class for ``base_name``, self-contained
    (stock transformers and torch only)."""
    model, config = CLASS_PREFIX + base_name, CLASS_PREFIX + config_name
    return (
        '"""Written by mha2gqa: this checkpoint\'s layers have different KV-head counts (config key\n'
        f'{PER_LAYER_KEY}). Load with AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)."""\n\n'
        "from __future__ import annotations\n\nimport json\nimport os\nfrom typing import Any\n\n"
        f"from transformers import {base_name}, {config_name}\n\n\n"
        + "\n\n".join(inspect.getsource(f) for f in (Section, sections, resize_kv_heads, save_keeping_architectures))
        + f"\n\nclass {config}({config_name}):\n"
        "    def __post_init__(self, **kwargs):\n"
        "        super().__post_init__(**kwargs)\n"
        "        if getattr(self, 'block_configs', None) is not None:\n"
        "            self.block_configs = sections(self.block_configs)\n"
        f"\n\nclass {model}({base_name}):\n"
        f"    config_class = {config}\n\n"
        "    def __init__(self, config):\n"
        "        super().__init__(config)\n"
        f"        resize_kv_heads(self, list(config.{PER_LAYER_KEY}))\n\n"
        "    def save_pretrained(self, save_directory, *args, **kwargs):\n"
        f"        save_keeping_architectures(self, {base_name}, save_directory, *args, **kwargs)\n"
    )


def auto_map(base_name: str, config_name: str) -> dict[str, str]:
    """The config's ``auto_map`` entries that point stock transformers at the modeling file."""
    module = MODELING_FILE.removesuffix(".py")
    return {
        "AutoConfig": f"{module}.{CLASS_PREFIX}{config_name}",
        "AutoModelForCausalLM": f"{module}.{CLASS_PREFIX}{base_name}",
    }


#: The model class Nemotron-NAS checkpoints name, which vLLM and llama.cpp serve with per-layer KV heads.
DECI_ARCHITECTURE = "DeciLMForCausalLM"
#: vLLM and llama.cpp round the MLP width derived from ``ffn_mult`` up to a multiple of this.
FFN_MULTIPLE = 256


def ffn_width(ffn_mult: float, hidden: int) -> int:
    """The MLP width vLLM and llama.cpp derive from a Nemotron-NAS ``ffn_mult``: ``int(2·m·h/3)``
    rounded up to a multiple of :data:`FFN_MULTIPLE`."""
    n = int(2 * ffn_mult * hidden / 3)
    return n if n % FFN_MULTIPLE == 0 else n + FFN_MULTIPLE - n % FFN_MULTIPLE


def nemotron_nas(config: dict[str, Any], heads_per_layer: list[int]) -> tuple[dict[str, Any] | None, str]:
    """The Nemotron-NAS fields (``architectures``, ``block_configs`` with each layer's ``n_heads_in_group``
    and ``ffn_mult``, and explicit ``intermediate_size`` and ``head_dim``) that let vLLM and llama.cpp
    serve a per-layer checkpoint of ``config``, with a line saying so; ``None`` and the reason when its
    shapes are not a block those engines build (a plain Llama block: SiLU gated MLP without biases,
    ``head_dim = hidden / heads``, an MLP width that ``ffn_mult`` reproduces)."""
    archs = config.get("architectures") or []
    hidden, heads, width = config["hidden_size"], config["num_attention_heads"], config.get("intermediate_size")
    ffn_mult = 1.5 * width / hidden if width else 0.0
    expressible = (  # (holds, why not): the first that fails is the reason
        (
            archs == ["LlamaForCausalLM"],
            f"the source is {archs[0] if archs else config.get('model_type')}, not LlamaForCausalLM",
        ),
        (not (config.get("attention_bias") or config.get("mlp_bias")), "its attention or MLP has biases"),
        (config.get("hidden_act", "silu") == "silu", f"its MLP activation is {config.get('hidden_act')}, not silu"),
        (
            (config.get("head_dim") or hidden // heads) * heads == hidden,
            f"head_dim {config.get('head_dim')} is not hidden_size / heads = {hidden // heads}",
        ),
        (
            ffn_width(ffn_mult, hidden) == width,
            f"its MLP width {width} is not what ffn_mult gives (int(2*ffn_mult*hidden/3) rounded up to a multiple of "
            f"{FFN_MULTIPLE}; here {ffn_width(ffn_mult, hidden)})",
        ),
    )
    why = next((reason for holds, reason in expressible if not holds), "")
    if why:
        return None, f"not written in the Nemotron-NAS form ({DECI_ARCHITECTURE}): {why}"
    blocks = [
        {
            "attention": {"n_heads_in_group": heads // g, "no_op": False, "replace_with_linear": False},
            "ffn": {"ffn_mult": ffn_mult, "no_op": False, "replace_with_linear": False},
        }
        for g in heads_per_layer
    ]
    # The widths explicit at the top level too, for readers that take them instead of deriving them (vLLM
    # reads intermediate_size, several need head_dim); not inside the entries, which NVIDIA's block_config.py
    # and TensorRT-LLM's DeciLayerConfig build as fixed dataclasses that refuse unknown keys.
    fields = {
        "architectures": [DECI_ARCHITECTURE],
        "block_configs": blocks,
        "intermediate_size": width,
        "head_dim": hidden // heads,
    }
    return (
        fields,
        f"also written in the Nemotron-NAS form ({DECI_ARCHITECTURE}, block_configs) that vLLM and llama.cpp read",
    )


def per_layer_checkpoint(config: dict[str, Any], heads_per_layer: list[int]) -> tuple[dict[str, Any], str, str]:
    """What a per-layer checkpoint of a source with ``config`` adds: its config fields (the counts,
    ``auto_map``, and the Nemotron-NAS form where it applies), the text of :data:`MODELING_FILE` and
    a line on the serving form."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config["model_type"]
    base = (config.get("architectures") or [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]])[0]
    config_name = CONFIG_MAPPING[model_type].__name__
    fields: dict[str, Any] = {PER_LAYER_KEY: list(heads_per_layer), "auto_map": auto_map(base, config_name)}
    deci, note = nemotron_nas(config, heads_per_layer)
    return fields | (deci or {}), modeling_source(base, config_name), note
