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
from mha2gqa.core.errors import Mha2GqaError
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
    finally:
        logging.set_verbosity(verbosity)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    ignore = [re.compile(p) for p in (model._keys_to_ignore_on_load_unexpected or [])]
    return Expected(shapes, tied, [*ignore, *_IGNORABLE])


def check_tensors(present: dict[str, tuple[int, ...]], expected: Expected, what: str) -> None:
    """Raise a one-line :class:`Mha2GqaError` when ``present`` (name -> shape) does not match
    ``expected``: missing tensors, extra tensors or shape mismatches."""
    shapes, tied, ignore = expected.shapes, expected.tied, expected.ignore
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
        raise Mha2GqaError(
            f"{what}: {len(wrong)} tensors have the wrong shape, e.g. {k} is {list(present[k])}, "
            f"the config says {list(shapes[k])}"
        )
