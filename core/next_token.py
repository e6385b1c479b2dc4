"""How two models' next-token distributions are compared, once for every stage that compares them: the
stage guard and the allocation's ``logits`` cost (:func:`mha2gqa.convert.engine.layers.next_token_kl`), the
evaluation's agreement (:mod:`mha2gqa.eval.perplexity`) and, through it, the uptraining's held-out
figures. Per token: KL(P || Q), a dot product of ``p`` with ``log p - log q`` (a term is 0 where
``p`` is, whatever ``q``), and whether the two top-1 tokens agree. Blockwise: at most
:data:`~mha2gqa.core.memory.LOGIT_ROWS` tokens' temporaries at a time, never a second tensor of the
logits' size."""

from __future__ import annotations

import torch

from mha2gqa.core.memory import logit_rows


def log_probs_(logits: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits [n, vocab], -1)`` in place, a block of rows at a time; returns ``logits``."""
    for rows in logit_rows(logits.shape[0]):
        logits[rows] = torch.log_softmax(logits[rows], -1)
    return logits


def token_kl(logp: torch.Tensor, logq: torch.Tensor, p: torch.Tensor | None = None) -> torch.Tensor:
    """``[n]``: each token's KL(P || Q) in nats from log-probabilities ``logp``, ``logq`` ``[n, vocab]``
    (``p``: ``logp.exp()`` where the caller has it, for several ``logq`` against one ``logp``)."""
    out = torch.empty(logp.shape[0], dtype=logp.dtype, device=logp.device)
    for rows in logit_rows(logp.shape[0]):
        pr = logp[rows].exp() if p is None else p[rows]
        gap = torch.where(pr > 0, logp[rows] - logq[rows], torch.zeros((), dtype=pr.dtype, device=pr.device))
        out[rows] = torch.linalg.vecdot(pr, gap)
    return out


def same_top(logp: torch.Tensor, logq: torch.Tensor, top: torch.Tensor | None = None) -> torch.Tensor:
    """``[n]`` bool: the tokens whose most likely next token is the same under both (``top``:
    ``logp.argmax(-1)`` where the caller has it)."""
    return (logp.argmax(-1) if top is None else top) == logq.argmax(-1)
