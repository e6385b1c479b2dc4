"""Checking a checkpoint's tensor names and shapes against what its config describes.

The expected state dict comes from the transformers model class itself, built on the ``meta``
device (no memory, no weights), so the check follows transformers exactly for every family.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from mha2gqa.core.dims import PER_LAYER_KEY
from mha2gqa.core.errors import Mha2GqaError, config_errors
from mha2gqa.core.per_layer import causal_lm_class, per_layer_class

#: Buffers that old checkpoints carry and transformers ignores when loading.
_IGNORABLE = (re.compile(r"\.rotary_emb\.inv_freq$"), re.compile(r"\.attn\.(masked_)?bias$"))


@dataclass(frozen=True)
class Expected:
    """What a config's model holds: shapes by name, tied names that may be absent from a
    checkpoint, and name patterns transformers ignores when loading."""

    shapes: dict[str, tuple[int, ...]]
    tied: set[str]
    ignore: list[re.Pattern[str]]
    prefix: str = ""  # the base model's prefix, which some checkpoints leave out (GPT-2's hub files)
    renames: tuple[tuple[str, str], ...] = ()  # transformers' key renamings on load (GPT-NeoX embed_out -> lm_head)
    converted: bool = False  # transformers also merges or splits tensors on load: names are not compared
    kv_heads_per_layer: tuple[int, ...] | None = None  # the config's own per-layer KV-head counts


def expected_tensors(config: dict[str, Any]) -> Expected:
    """The :class:`Expected` tensors of the model ``config`` describes (built on ``meta``)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging

    cfg_dict = {k: v for k, v in config.items() if k not in ("_name_or_path", "transformers_version")}
    model_type = cfg_dict.pop("model_type")
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        cfg = AutoConfig.for_model(model_type, **cfg_dict)
        with torch.device("meta"):
            if PER_LAYER_KEY in cfg_dict:  # each layer its own KV heads (mha2gqa's per-layer class)
                model = per_layer_class(causal_lm_class(cfg))(cfg)
            else:
                model = AutoModelForCausalLM.from_config(cfg)
    except (*config_errors(), TypeError, KeyError, AttributeError, IndexError, ArithmeticError, RuntimeError) as e:
        # transformers' own validation of the values (a field of the wrong type, a bad combination), or a
        # value its model cannot be built with (zero heads, a negative size)
        why = " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
        if "Should contain one of" in why:  # an unknown model type: transformers then lists every one it knows
            why = why.split("Should contain one of")[0].strip() + " (not a model type this transformers knows)"
        why = why[:300]
        raise Mha2GqaError(f"config.json ({model_type}): transformers cannot build this model from it: {why}") from None
    finally:
        logging.set_verbosity(verbosity)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    ignore = [re.compile(p) for p in (model._keys_to_ignore_on_load_unexpected or [])]
    renames, converted = _load_renames(model)
    prefix = getattr(model, "base_model_prefix", "") or ""
    per_layer = _kv_heads_per_layer(cfg_dict)
    return Expected(shapes, tied, [*ignore, *_IGNORABLE], prefix, renames, converted, per_layer)


def _kv_heads_per_layer(config: dict[str, Any]) -> tuple[int, ...] | None:
    """The per-layer KV-head counts a config declares (either per-layer form), None for one count."""
    from mha2gqa.core.architecture import dims_of

    try:
        counts = dims_of(config).kv_heads_per_layer
    except Mha2GqaError:
        return None
    return tuple(counts) if counts else None


def _load_renames(model: Any) -> tuple[tuple[tuple[str, str], ...], bool]:
    """transformers' renamings of checkpoint keys for ``model`` (regex -> replacement), and whether it
    also converts tensors (merges, splits) on load; none with a transformers that has no such mapping."""
    from mha2gqa.core.stored_layout import conversion_mapping

    renamings, converters = conversion_mapping(model)
    renames, converted = [], bool(converters)
    for transform in renamings:
        if getattr(transform, "scope_prefix", None):
            converted = True
            continue
        (target,) = transform.target_patterns
        renames += [(source, target) for source in transform.source_patterns]
    return tuple(renames), converted


def _as_loaded(name: str, expected: Expected) -> str:
    """A checkpoint key as transformers loads it: its renamings applied, the base prefix added where
    the checkpoint leaves it out."""
    if name in expected.shapes:
        return name
    for source, target in expected.renames:
        renamed = re.sub(source, target, name)
        if renamed != name and renamed in expected.shapes:
            return renamed
    prefixed = f"{expected.prefix}.{name}"
    return prefixed if expected.prefix and prefixed in expected.shapes else name


#: A decoder layer's index in a tensor name, and a name of its K/V (or fused QKV) projection.
_LAYER = re.compile(r"\.(?:layers|h|blocks)\.(\d+)\.")
_KV = re.compile(r"(k_proj|v_proj|qkv_proj|query_key_value|c_attn|Wqkv)\.(weight|bias)$")


def check_tensors(present: dict[str, tuple[int, ...]], expected: Expected, what: str) -> None:
    """Raise a one-line :class:`Mha2GqaError` when ``present`` (name -> shape) does not match
    ``expected``: missing tensors, extra tensors or shape mismatches."""
    shapes, tied, ignore = expected.shapes, expected.tied, expected.ignore
    present = {_as_loaded(k, expected): v for k, v in present.items()}
    if expected.converted:  # transformers reshapes some tensors on load: compare the shapes of common names
        present = {k: v for k, v in present.items() if k in shapes}
        shapes = {k: v for k, v in shapes.items() if k in present}
    missing = sorted(k for k in shapes if k not in present and k not in tied)
    extra = sorted(k for k in present if k not in shapes and not any(p.search(k) for p in ignore))
    wrong = sorted(k for k in present if k in shapes and shapes[k] != present[k])

    def few(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    if missing:
        raise Mha2GqaError(f"{what}: {len(missing)} tensors the config needs are missing: {few(missing)}")
    if extra:
        raise Mha2GqaError(f"{what}: {len(extra)} tensors the config does not describe: {few(extra)}")
    if wrong:
        k = wrong[0]
        layers = sorted({int(m.group(1)) for n in wrong if (m := _LAYER.search(n))})
        if expected.kv_heads_per_layer and layers and all(_KV.search(n) for n in wrong):
            counts = ", ".join(f"layer {i}: {expected.kv_heads_per_layer[i]}" for i in layers[:4])
            raise Mha2GqaError(
                f"{what}: the config's per-layer KV-head counts do not match the weights ({counts} KV heads by "
                f"the config, but e.g. {k} is {list(present[k])}, not {list(shapes[k])}): fix the counts in "
                "config.json, or convert the model again"
            )
        raise Mha2GqaError(
            f"{what}: {len(wrong)} tensors have the wrong shape, e.g. {k} is {list(present[k])}, "
            f"the config says {list(shapes[k])}"
        )
