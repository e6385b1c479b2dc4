"""Divergences and summaries between distributions, all in float32 or wider.

Every function takes log-probabilities over the last dimension, so it works for next-token
distributions ``[..., vocab]`` and for attention rows ``[..., keys]`` alike. Masked entries
(probability 0, log-probability ``-inf``) contribute 0, by the convention ``0 * log 0 = 0``.
"""

from __future__ import annotations

import math

import torch


def _plogp_terms(p: torch.Tensor, logp: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``p * (logp - other)`` with ``0 * anything = 0`` where ``p == 0``."""
    return torch.where(p > 0, p * (logp - other), torch.zeros((), dtype=p.dtype, device=p.device))


def kl_divergence(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) = sum p (log p - log q) over the last dim, in nats. ``[..., n] -> [...]``."""
    return _plogp_terms(logp.exp(), logp, logq).sum(-1)


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


QUANTILES = (0.5, 0.9, 0.95, 0.99, 0.999)


def summarize(values: torch.Tensor) -> dict[str, float]:
    """Mean, max and the quantiles in :data:`QUANTILES` of a 1-D tensor (exact, via sorting)."""
    v = values.double().flatten().sort().values
    n = v.numel()
    out = {"mean": v.mean().item(), "max": v[-1].item(), "count": n}
    for q in QUANTILES:
        # linear interpolation between closest ranks, as numpy's default
        pos = q * (n - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        out[f"q{q * 100:g}".replace(".", "_")] = (v[lo] + (v[hi] - v[lo]) * (pos - lo)).item()
    out["median"] = out.pop("q50")
    return out
