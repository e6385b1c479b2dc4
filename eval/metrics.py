"""Divergences and summaries between distributions, all in float32 or wider.

Every function takes log-probabilities over the last dimension, so it works for next-token
distributions ``[..., vocab]`` and for attention rows ``[..., keys]`` alike. Masked entries
(probability 0, log-probability ``-inf``) contribute 0, by the convention ``0 * log 0 = 0``.
"""

from __future__ import annotations

import math

import torch

from mha2gqa.core.next_token import token_kl
from mha2gqa.eval.agreement import Agreement, DeltaP, Stats


def _plogp_terms(p: torch.Tensor, logp: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``p * (logp - other)`` with ``0 * anything = 0`` where ``p == 0``."""
    return torch.where(p > 0, p * (logp - other), torch.zeros((), dtype=p.dtype, device=p.device))


def kl_divergence(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) = sum p (log p - log q) over the last dim, in nats. ``[..., n] -> [...]``: the
    next-token comparison's own kernel (:func:`~mha2gqa.core.next_token.token_kl`) on any shape."""
    n = logp.shape[-1]
    return token_kl(logp.reshape(-1, n), logq.reshape(-1, n)).reshape(logp.shape[:-1])


def js_divergence(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence (nats, at most log 2) over the last dim. ``[..., n] -> [...]``."""
    p, q = logp.exp(), logq.exp()
    logm = torch.logaddexp(logp, logq) - math.log(2)  # log((p + q) / 2) without underflow
    return 0.5 * (_plogp_terms(p, logp, logm).sum(-1) + _plogp_terms(q, logq, logm).sum(-1))


def entropy(logp: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) over the last dim. ``[..., n] -> [...]``."""
    p = logp.exp()
    return -_plogp_terms(p, logp, torch.zeros((), dtype=p.dtype, device=p.device)).sum(-1)


def cosine(a: torch.Tensor, b: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Cosine similarity over the last dim. ``[..., n] -> [...]``."""
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(eps)


def row_stats(logp: torch.Tensor, logq: torch.Tensor, allowed: torch.Tensor) -> dict[str, torch.Tensor]:
    """KL(P||Q), JS, cosine of the probability rows and both entropies in one pass, with ``exp``
    taken once per distribution. ``logp``/``logq``: ``[..., n]`` log-probabilities, ``-inf`` where
    ``allowed`` (broadcastable bool) is False. Equal to :func:`kl_divergence`, :func:`js_divergence`,
    :func:`cosine` and :func:`entropy`; returns ``[...]`` tensors."""
    p, q = logp.exp(), logq.exp()
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    lp, lq = torch.where(allowed, logp, zero), torch.where(allowed, logq, zero)
    lm = torch.where(allowed, torch.logaddexp(logp, logq) - math.log(2), zero)
    return {
        "kl": (p * (lp - lq)).sum(-1),
        "js": 0.5 * ((p * (lp - lm)).sum(-1) + (q * (lq - lm)).sum(-1)),
        "cosine": cosine(p, q),
        "entropy_p": -(p * lp).sum(-1),
        "entropy_q": -(q * lq).sum(-1),
    }


#: llama.cpp's KL report's percentiles (its --kl-divergence output), median included.
QUANTILES = (0.001, 0.01, 0.05, 0.1, 0.5, 0.9, 0.95, 0.99, 0.999)


def summarize(values: torch.Tensor) -> dict[str, float]:
    """Mean with its standard error, min, max and the quantiles in :data:`QUANTILES` of a 1-D tensor
    (exact, via sorting; keys ``q0_1`` ... ``median`` ... ``q99_9``)."""
    v = values.double().flatten().sort().values
    n = v.numel()
    out = {"mean": v.mean().item(), "std_error": _std_error(v), "min": v[0].item(), "max": v[-1].item(), "count": n}
    for q in QUANTILES:
        # linear interpolation between closest ranks, as numpy's default
        pos = q * (n - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        out[f"q{q * 100:g}".replace(".", "_")] = (v[lo] + (v[hi] - v[lo]) * (pos - lo)).item()
    out["median"] = out.pop("q50")
    return out


def _std_error(v: torch.Tensor) -> float:
    """Standard error of the mean of ``v`` (sample standard deviation / sqrt(n)); 0 for one value."""
    n = v.numel()
    return (v.std(unbiased=True) / math.sqrt(n)).item() if n > 1 else 0.0


def agreement_stats(
    kl: torch.Tensor, kl_reverse: torch.Tensor, delta_p: torch.Tensor, nll: torch.Tensor, top1_same: int
) -> Agreement:
    """llama.cpp's KL-divergence report over per-token values of one pass (float64):

    KL(original || converted) and KL(converted || original) with mean +- error and percentiles; Δp,
    the change of the correct token's probability, with the same and its RMS +- error; the same-top
    rate +- error; the correlation of the two models' per-token NLLs (llama.cpp's "Cor(ln PPL(Q),
    ln PPL(base))") and their mean difference, ln(PPL(converted)/PPL(original)), +- error.
    ``nll``: ``[n, 2]`` per-token NLL of (original, converted)."""
    n = kl.numel()
    dp = delta_p.double()
    squares = dp.pow(2)
    rms = squares.mean().sqrt().item()
    nll = nll.double()
    diff = nll[:, 1] - nll[:, 0]
    top1 = top1_same / max(n, 1)
    centred = nll - nll.mean(0)
    corr = (centred[:, 0] * centred[:, 1]).sum() / (centred.pow(2).sum(0).prod().sqrt()).clamp_min(1e-300)
    return Agreement(
        tokens=n,
        kl=Stats(**summarize(kl)),
        kl_reverse=Stats(**summarize(kl_reverse)),
        delta_p=DeltaP(**summarize(dp), rms=rms, rms_error=_std_error(squares) / (2 * rms) if rms else 0.0),
        top1_agreement=top1,
        top1_error=math.sqrt(top1 * (1 - top1) / n) if n else 0.0,
        nll_delta=diff.mean().item(),
        nll_delta_error=_std_error(diff),
        nll_correlation=corr.item(),
    )
