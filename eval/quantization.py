"""Round-to-nearest weight quantization of the original, as a yardstick users already know:
``eval --compare-quantization int8,int4`` scores quantized copies of the original against it, so the
verdict can say where a conversion sits ("costs less than 4-bit weight quantization").

Every linear layer's weight (``nn.Linear`` and GPT-2's ``Conv1D``) except the output head is replaced
by its quantized-then-dequantized values in its own dtype (fake quantization: the numbers a quantized
runtime computes with, not its speed). Embeddings and the output head stay as they are, as in GPTQ's
and AWQ's round-to-nearest baselines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads with the evaluation, not with the settings that name the schemes
    import torch

GROUP = 128


@dataclass(frozen=True)
class Scheme:
    """A weight quantization: ``bits``, symmetric absmax per output channel (``group`` None) or
    asymmetric min-max over groups of ``group`` input columns."""

    name: str
    bits: int
    group: int | None
    description: str


SCHEMES = {
    s.name: s
    for s in (
        Scheme("int8", 8, None, "int8 weights, symmetric per output channel (absmax), round to nearest"),
        Scheme("int4", 4, GROUP, f"int4 weights, asymmetric per group of {GROUP} inputs (min-max), round to nearest"),
    )
}


def fake_quantize(weight: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """``weight`` ``[out, in]`` quantized with ``scheme`` and dequantized, in its own dtype."""
    import torch

    w = weight.detach().float()
    if scheme.group is None:
        top = 2 ** (scheme.bits - 1) - 1
        scale = (w.abs().amax(1, keepdim=True) / top).clamp(min=1e-12)
        return ((w / scale).round().clamp(-top, top) * scale).to(weight.dtype)
    out_features, in_features = w.shape
    pad = -in_features % scheme.group
    valid = torch.ones_like(w, dtype=torch.bool)
    groups = torch.nn.functional.pad(w, (0, pad)).reshape(out_features, -1, scheme.group)
    mask = torch.nn.functional.pad(valid, (0, pad)).reshape(groups.shape)
    low = torch.where(mask, groups, torch.inf).amin(-1, keepdim=True)
    high = torch.where(mask, groups, -torch.inf).amax(-1, keepdim=True)
    levels = 2**scheme.bits - 1
    scale = ((high - low) / levels).clamp(min=1e-12)
    zero = (-low / scale).round()
    q = ((groups / scale).round() + zero).clamp(0, levels)
    deq = ((q - zero) * scale).reshape(out_features, -1)[:, :in_features]
    return deq.to(weight.dtype)


def quantize_model(model: torch.nn.Module, scheme: Scheme) -> int:
    """Quantize every linear weight of ``model`` but its output head, in place; returns how many
    weights were quantized."""
    import torch
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings()
    count = 0
    for module in model.modules():
        if module is head:
            continue
        with torch.no_grad():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(fake_quantize(module.weight, scheme))
            elif isinstance(module, Conv1D):  # weight [in, out]
                module.weight.copy_(fake_quantize(module.weight.T, scheme).T)
            else:
                continue
        count += 1
    return count
