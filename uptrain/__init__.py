"""Uptraining converted GQA checkpoints: continued pretraining or distillation from the MHA parent.

Settings in :mod:`mha2gqa.uptrain.settings`, the loop in :mod:`mha2gqa.uptrain.trainer`. Importing
this package is cheap: the trainer (and torch) load on first use of its names."""

from __future__ import annotations

from mha2gqa.core.lazy import lazy_names

_LAZY = {
    "mha2gqa.uptrain.settings": ("OBJECTIVES", "TRAINABLE", "UptrainSettings"),
    "mha2gqa.uptrain.trainer": ("UptrainPlan", "UptrainResult", "prepare_uptrain", "run_uptrain", "uptrain"),
}

__all__ = sorted(name for names in _LAZY.values() for name in names)
__getattr__ = lazy_names(__name__, _LAZY)
