"""Uptraining converted GQA checkpoints: continued pretraining or distillation from the MHA parent.

Settings in :mod:`mha2gqa.uptrain.settings`, the loop in :mod:`mha2gqa.uptrain.trainer`. Importing
this package is cheap: the trainer (and torch) load on first use of its names."""

from __future__ import annotations

from mha2gqa.core.lazy import lazy_names

_LAZY = {
    "UptrainSettings": "mha2gqa.uptrain.settings",
    "OBJECTIVES": "mha2gqa.uptrain.settings",
    "TRAINABLE": "mha2gqa.uptrain.settings",
    "UptrainResult": "mha2gqa.uptrain.trainer",
    "uptrain": "mha2gqa.uptrain.trainer",
}

__all__ = sorted(_LAZY)
__getattr__ = lazy_names(__name__, _LAZY)
