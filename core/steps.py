"""Steps that follow the model's scale: Adam (and AdamW) move every entry by about the learning
rate a step, whatever the gradient's size, so an absolute rate is a different share of each
model's weights (3e-3 is ~5% of SmolLM2-135M's ``o_proj`` RMS and ~22% of a Qwen2 model's). A rate
*relative* to each tensor's own size (its RMS at the start) gives the same relative step on every
model, and the same fit, rescaled, on a model rescaled without changing its function (``v x t`` with
``o / t``; ``q x s`` with ``k / s``; a norm's weight ``x c`` with the projections it feeds ``/ c``).
The refit (:mod:`mha2gqa.convert.refit`) and ``uptrain --lr-relative`` (``convert --distill``) size
their steps here."""

from __future__ import annotations

import torch


def rms(t: torch.Tensor) -> float:
    """Root mean square of ``t``'s entries (a sharded tensor's over all its shards)."""
    t = t.detach()
    if hasattr(t, "full_tensor"):  # a DTensor (FSDP): every rank gathers the same whole tensor
        t = t.full_tensor()
    return float(t.double().pow(2).mean().sqrt()) if t.numel() else 0.0


def step_size(value: torch.Tensor, weight: torch.Tensor | None = None) -> float:
    """What a relative learning rate is multiplied by for ``value``: its RMS; a bias's (``weight``:
    the weight it is added to) the larger of its own and its weight's, so that a zero bias still
    moves, at its layer's scale. 1 for an all-zero tensor with no weight beside it."""
    size = rms(value)
    if weight is not None:
        size = max(size, rms(weight))
    return size if size > 0 else 1.0
