"""Training losses: next-token cross-entropy and distillation from the MHA parent.

Both return the *mean over scored tokens*, so gradient accumulation and data-parallel averaging
(equal-size windows) reproduce the loss of the whole batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from mha2gqa.core.memory import logit_rows


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
    never more than the exact KL, equal to it when K is the vocabulary (no bucket then). Computed
    :data:`~mha2gqa.core.memory.LOGIT_ROWS` tokens at a time, with its analytic gradient
    (:class:`_TopKDistillation`)."""
    k = indices.shape[-1]
    return _TopKDistillation.apply(
        student.flatten(0, -2),
        values.detach().reshape(-1, k),
        indices.detach().reshape(-1, k).long(),
        rest.detach().reshape(-1),
        temperature,
    )


def _rows(student: torch.Tensor, temperature: float) -> Iterator[tuple[slice, torch.Tensor]]:
    """``(rows, x)``: :data:`~mha2gqa.core.memory.LOGIT_ROWS` tokens of ``student`` ``[N, V]`` at a
    time, ``x / T`` in float32 (or wider), a copy of their own (the steps below change it in place)."""
    wide = torch.promote_types(student.dtype, torch.float32)
    for rows in logit_rows(student.shape[0]):
        x = student[rows].to(wide, copy=True)
        yield rows, x if temperature == 1.0 else x.div_(temperature)


class _TopKDistillation(torch.autograd.Function):
    """``T^2 * mean_tokens [sum_k p_k (v_k - ls_k) + R (r - tail)]``, with ``ls = log_softmax(s / T)``
    at the teacher's K tokens, ``p = exp(values)``, ``R = exp(rest)``, ``tail`` the student's log-mass
    outside them; its gradient for the student's scaled logits ``x`` is, with ``q = softmax(x)`` and
    ``S = sum_k p_k + R``: ``S q_j - p_j`` at the K tokens and ``S q_j - R exp(x_j - tail_x)`` outside
    (``tail_x = tail + logsumexp(x)``), times ``T / N``."""

    @staticmethod
    def forward(ctx, student, values, indices, rest, temperature: float) -> torch.Tensor:
        n, vocab = student.shape
        bucket = indices.shape[-1] < vocab
        like = {"dtype": torch.promote_types(student.dtype, torch.float32), "device": student.device}
        lse, picked, tail = (
            torch.empty(n, **like),
            torch.empty(values.shape, **like),
            torch.full((n,), -math.inf, **like),
        )
        values, rest = values.to(lse.dtype), rest.to(lse.dtype)
        for rows, x in _rows(student.detach(), temperature):
            lse[rows] = torch.logsumexp(x, -1)
            picked[rows] = x.gather(-1, indices[rows])
            if bucket:
                tail[rows] = torch.logsumexp(x.scatter_(-1, indices[rows], float("-inf")), -1)
        p = values.exp()
        loss = (p * (values - (picked - lse[:, None]))).sum(-1)
        r = rest.clamp(min=-1e4)  # a tail that underflowed to zero mass adds nothing (and no NaN)
        if bucket:
            loss = loss + r.exp() * (r - (tail - lse))
        ctx.save_for_backward(student, indices, p, picked, lse, tail, r)
        ctx.temperature, ctx.bucket = temperature, bucket
        return loss.mean() * temperature**2

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        student, indices, p, picked, lse, tail, r = ctx.saved_tensors
        temperature = ctx.temperature
        big_r = r.exp() if ctx.bucket else torch.zeros_like(r)
        total = p.sum(-1) + big_r  # S: the teacher's mass, 1 up to its rounding
        scale = grad.to(lse.dtype) * temperature / student.shape[0]
        out = torch.empty_like(student)
        for rows, x in _rows(student.detach(), temperature):
            s, lse_r = total[rows, None], lse[rows, None]
            if ctx.bucket:
                outside = x.scatter(-1, indices[rows], float("-inf")).sub_(tail[rows, None]).exp_()
                x.sub_(lse_r).exp_().mul_(s).sub_(outside.mul_(big_r[rows, None]))
            else:
                x.sub_(lse_r).exp_().mul_(s)
            x.scatter_(-1, indices[rows], s * (picked[rows] - lse_r).exp() - p[rows])
            out[rows] = x.mul_(scale)
        return out, None, None, None, None


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
