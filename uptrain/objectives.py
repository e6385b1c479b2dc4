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


def distillation_top_k(
    student: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, rest: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """:func:`distillation` against a cached teacher's top-K form at ``temperature``: its sorted
    log-probabilities ``values`` and their token ``indices`` ``[B, T, K]``, and ``rest`` ``[B, T]``,
    the log of the mass outside them. The KL is taken over the K tokens plus one bucket for the rest,
    which (log-sum inequality) is the exact KL minus ``p_rest * KL(teacher's tail || student's tail)``:
    never more than the exact KL, equal to it when K is the vocabulary (no bucket then)."""
    ls = F.log_softmax(_wide(student) / temperature, -1)
    idx = indices.long()
    loss = (values.exp() * (values - ls.gather(-1, idx))).sum(-1)
    if idx.shape[-1] < ls.shape[-1]:
        tail = ls.scatter(-1, idx, float("-inf")).logsumexp(-1)
        r = rest.clamp(min=-1e4)  # a tail that underflowed to zero mass adds nothing (and no NaN)
        loss = loss + r.exp() * (r - tail)
    return loss.mean() * temperature**2


def combined(
    objective: str,
    logits: torch.Tensor,
    targets: torch.Tensor,
    teacher: torch.Tensor | dict[str, torch.Tensor] | None,
    kd_weight: float,
    temperature: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of ``objective`` (``ce``, ``kd`` or ``mix``: ``(1 - kd_weight) * ce + kd_weight * kd``)
    and its parts as floats for the log. ``teacher``: its logits, or its cached top-K form."""
    parts: dict[str, torch.Tensor] = {}
    if objective in ("ce", "mix"):
        parts["ce"] = cross_entropy(logits, targets)
    if objective in ("kd", "mix") and isinstance(teacher, dict):
        parts["kd"] = distillation_top_k(logits, teacher["values"], teacher["indices"], teacher["rest"], temperature)
    elif objective in ("kd", "mix"):
        parts["kd"] = distillation(logits, teacher, temperature)
    if objective == "ce":
        loss = parts["ce"]
    elif objective == "kd":
        loss = parts["kd"]
    else:
        loss = (1 - kd_weight) * parts["ce"] + kd_weight * parts["kd"]
    return loss, {k: float(v.detach()) for k, v in parts.items()}
