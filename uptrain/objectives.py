"""Training losses: next-token cross-entropy and distillation from the MHA parent.

Both return the *mean over scored tokens*, so gradient accumulation and data-parallel averaging
(equal-size windows) reproduce the loss of the whole batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL. ``logits [B, T, V]``, ``targets [B, T]`` (already shifted)."""
    return F.cross_entropy(_wide(logits).flatten(0, 1), targets.flatten())


def _wide(x: torch.Tensor) -> torch.Tensor:
    """Half-precision logits in float32 (wider ones as they are)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class _Distillation(torch.autograd.Function):
    """``T^2 * mean_tokens KL(softmax(t/T) || softmax(s/T))`` with its analytic gradient
    ``T * (softmax(s/T) - softmax(t/T)) / N`` for the student (none for the teacher): exactly zero,
    not rounding noise, when both give the same distributions."""

    @staticmethod
    def forward(ctx, student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
        s = F.log_softmax(_wide(student) / temperature, -1)
        t = F.log_softmax(_wide(teacher) / temperature, -1)
        ctx.save_for_backward(s, t)
        ctx.temperature, ctx.dtype = temperature, student.dtype
        return (t.exp() * (t - s)).sum(-1).mean() * temperature**2

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        s, t = ctx.saved_tensors
        scale = grad * ctx.temperature / s.shape[0]
        return ((s.exp() - t.exp()) * scale).to(ctx.dtype), None, None


def distillation(student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Mean per-token ``KL(teacher || student)`` of the temperature-softened distributions, times
    ``temperature**2`` (Hinton et al., so gradients keep their scale across temperatures).

    ``student``, ``teacher``: ``[B, T, V]`` logits over the same vocabulary. Zero, with a zero
    gradient, exactly when the two give the same distributions.
    """
    return _Distillation.apply(student.flatten(0, -2), teacher.detach().flatten(0, -2), temperature)


def combined(
    objective: str,
    logits: torch.Tensor,
    targets: torch.Tensor,
    teacher_logits: torch.Tensor | None,
    kd_weight: float,
    temperature: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of ``objective`` (``ce``, ``kd`` or ``mix``: ``(1 - kd_weight) * ce + kd_weight * kd``)
    and its parts as floats for the log."""
    parts: dict[str, torch.Tensor] = {}
    if objective in ("ce", "mix"):
        parts["ce"] = cross_entropy(logits, targets)
    if objective in ("kd", "mix"):
        parts["kd"] = distillation(logits, teacher_logits, temperature)
    if objective == "ce":
        loss = parts["ce"]
    elif objective == "kd":
        loss = parts["kd"]
    else:
        loss = (1 - kd_weight) * parts["ce"] + kd_weight * parts["kd"]
    return loss, {k: float(v.detach()) for k, v in parts.items()}
