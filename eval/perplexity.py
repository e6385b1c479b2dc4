"""Perplexity under a pinned protocol.

``disjoint``: the token stream (tokenized once, one BOS at the start when the tokenizer adds one)
is cut into consecutive non-overlapping windows of ``seq_len`` tokens; every token except the first
of each window is predicted from the tokens before it *in its window*; PPL = exp(mean NLL). This is
the convention of the quantization literature (Llama-2-7B fp16 on WikiText-2 test at 2048: 5.47).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F


@dataclass
class Perplexity:
    """Summed next-token NLL (nats) over ``tokens`` predicted tokens."""

    protocol: str
    seq_len: int
    nll_sum: float
    tokens: int
    windows: int

    @property
    def nll(self) -> float:
        return self.nll_sum / self.tokens

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    def as_dict(self) -> dict:
        return {**asdict(self), "nll": self.nll, "ppl": self.ppl}


def disjoint_windows(ids: torch.Tensor, seq_len: int) -> list[torch.Tensor]:
    """Consecutive ``[seq_len]`` slices of the 1-D ``ids``; a last shorter slice is kept if it has
    at least 2 tokens (one prediction)."""
    return [ids[s : s + seq_len] for s in range(0, ids.numel(), seq_len) if ids[s : s + seq_len].numel() >= 2]


def window_nll(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Per-token NLL ``[B, T-1]`` (float32) of ``batch`` ``[B, T]`` under ``model``."""
    logits = model(batch).logits[:, :-1].float()
    return F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none")


@torch.no_grad()
def perplexity_disjoint(model: torch.nn.Module, ids: torch.Tensor, seq_len: int, batch_size: int = 1) -> Perplexity:
    """Perplexity of ``model`` on the 1-D token tensor ``ids`` with disjoint windows."""
    device = next(model.parameters()).device
    windows = disjoint_windows(ids, seq_len)
    if not windows:
        raise ValueError(f"need at least 2 tokens, got {ids.numel()}")
    nll = 0.0
    tokens = 0
    full = [w for w in windows if w.numel() == seq_len]
    rest = [w for w in windows if w.numel() != seq_len]
    for i in range(0, len(full), batch_size):
        batch = torch.stack(full[i : i + batch_size]).to(device)
        losses = window_nll(model, batch)
        nll += losses.double().sum().item()
        tokens += losses.numel()
    for w in rest:
        losses = window_nll(model, w[None].to(device))
        nll += losses.double().sum().item()
        tokens += losses.numel()
    return Perplexity("disjoint", seq_len, nll, tokens, len(windows))
