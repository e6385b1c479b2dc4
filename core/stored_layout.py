"""A module's tensors as the model holds them, from a checkpoint that stores them otherwise.

transformers 5 keeps some families' weights in memory in another layout than their checkpoints (and
its own ``save_pretrained``) store them: Mixtral's experts one per expert on disk (``block_sparse_moe.
experts.3.w1.weight``), fused in memory (``mlp.experts.gate_up_proj`` ``[experts, 2 * inter, hidden]``);
Qwen2-MoE's likewise. It converts them on load through the model's conversion mapping; a layer loaded
on its own must do the same, with the same mapping, so that it computes what the model computes.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

import torch

from mha2gqa.core.errors import Mha2GqaError


def conversion_mapping(model: Any) -> tuple[list[Any], list[Any]]:
    """transformers' weight transforms for ``model``: its renamings and its converters (none with a
    transformers that has no such mapping)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return [], []
    mapping = list(get_model_conversion_mapping(model))
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    return [t for t in mapping if isinstance(t, WeightRenaming) and t not in converters], converters


def stored_tensors(model: Any, ckpt: Any, prefix: str, wanted: set[str]) -> dict[str, torch.Tensor]:
    """The tensors named ``wanted`` (full in-memory names, all under ``prefix``, e.g.
    ``model.layers.3.``) built from ``ckpt``'s tensors under ``prefix`` the way transformers loads
    them: renamed, and stacked or split by the model's converters. Memory: the module's tensors."""
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    renamings, converters = conversion_mapping(model)
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta = model.__dict__.setdefault("_mha2gqa_meta_state", model.state_dict())
    found: dict[str, torch.Tensor] = {}
    pending: dict[str, Any] = {}
    # in transformers' own order (experts.2 before experts.10): the converters stack in list order
    for key in sorted((k for k in ckpt.tensors if k.startswith(prefix)), key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
        if target not in wanted:
            continue
        if pattern is None:
            found[target] = ckpt.load(key)
        else:
            pending.setdefault(target, deepcopy(by_pattern[pattern])).add_tensor(target, key, pattern, ckpt.load(key))
    for target, converter in pending.items():
        made = converter.convert(target, model=model, config=model.config)
        found |= {k: v[0] if isinstance(v, list) else v for k, v in made.items() if k in wanted}
    missing = sorted(wanted - found.keys())
    if missing:
        raise Mha2GqaError(
            f"{ckpt.folder}: no tensor for {missing[0]}"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
            + " in the checkpoint, under its own name or any name transformers loads it from"
        )
    return found
