"""Paired tests of two models scored on the same examples: is the difference real?

Both models of a comparison answer the *same* questions, so the per-example results are paired and
the right test looks only at where they disagree. For a 0/1 metric (accuracy) that is McNemar's
exact test: of the ``n = b + c`` discordant examples (``b`` right only for the original, ``c`` only
for the converted model), under "no difference" each is equally likely to go either way, so
``p = min(1, 2 P[Binomial(n, 1/2) <= min(b, c)])``. For any other per-example metric it is a paired
bootstrap: resample examples (the same ones for both models) and read the 2.5th and 97.5th
percentiles of the mean difference. Every metric gets the bootstrap interval; 0/1 metrics are
decided by McNemar's p, others by the bootstrap's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: Resamples of the paired bootstrap, and its seed (fixed: the same inputs give the same interval).
BOOTSTRAP_ITERS = 10_000
BOOTSTRAP_SEED = 1234
#: Discordant pairs up to which McNemar's p is summed in exact integer arithmetic.
EXACT_UP_TO = 20_000
#: The level a difference is called significant at.
ALPHA = 0.05


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value of ``b`` and ``c`` discordant pairs (1 when there are none):
    ``min(1, 2 * sum_{k <= min(b, c)} C(b + c, k) / 2^(b + c))``, in exact integers up to
    :data:`EXACT_UP_TO` discordant pairs, beyond that summed in log space (relative error ~1e-12)."""
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts must be non-negative (got {b}, {c})")
    n, low = b + c, min(b, c)
    if n == 0 or b == c:
        return 1.0
    if n <= EXACT_UP_TO:
        term, total = 1, 1  # C(n, 0)
        for k in range(1, low + 1):
            term = term * (n - k + 1) // k
            total += term
        return min(1.0, 2 * total / 2**n)
    logs = [math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) for k in range(low + 1)]
    top = max(logs)
    log_total = top + math.log(math.fsum(math.exp(v - top) for v in logs)) - n * math.log(2)
    return min(1.0, 2 * math.exp(log_total))


def paired_bootstrap(
    original: torch.Tensor, converted: torch.Tensor, iters: int = BOOTSTRAP_ITERS, seed: int = BOOTSTRAP_SEED
) -> tuple[float, float, float]:
    """``(low, high, p)``: the 95% percentile interval of mean(converted - original) over ``iters``
    paired resamples of the examples, and the two-sided bootstrap p-value (twice the smaller share
    of resampled means on either side of zero, between 1/iters and 1). ``original``, ``converted``: [N]."""
    import torch

    diff = (converted.double() - original.double()).flatten()
    n = diff.numel()
    gen = torch.Generator().manual_seed(seed)
    means = []
    chunk = max(1, min(iters, 2**22 // max(n, 1)))  # bounded memory: at most 4M indices at once
    for start in range(0, iters, chunk):
        idx = torch.randint(n, (min(chunk, iters - start), n), generator=gen)
        means.append(diff[idx].mean(1))
    m = torch.cat(means)
    low, high = torch.quantile(m, torch.tensor([0.025, 0.975], dtype=m.dtype)).tolist()
    below, above = float((m <= 0).double().mean()), float((m >= 0).double().mean())
    return low, high, min(1.0, max(2 * min(below, above), 1 / iters))


@dataclass
class PairedTest:
    """One metric of one task, converted against original on the same ``n`` examples."""

    n: int
    difference: float  # mean(converted) - mean(original), in the metric's units
    drop: float  # how much worse the converted model is (negative: better), by higher_is_better
    ci_low: float  # 95% paired-bootstrap interval of the difference
    ci_high: float
    test: str  # "mcnemar-exact" or "paired-bootstrap"
    p_value: float
    significant: bool  # p_value < alpha
    alpha: float = ALPHA
    only_original: int | None = None  # McNemar's b: right only for the original
    only_converted: int | None = None  # McNemar's c: right only for the converted model

    @property
    def words(self) -> str:
        """``significant (p 0.0002)`` / ``not significant (p 0.15)``."""
        return f"{'significant' if self.significant else 'not significant'} (p {self.p_value:.2g})"


def is_binary(values: Sequence[float]) -> bool:
    return all(v in (0, 1) for v in values)


def paired_test(
    original: Sequence[float], converted: Sequence[float], higher_is_better: bool = True, alpha: float = ALPHA
) -> PairedTest:
    """The paired comparison of one metric's per-example values (same examples, same order)."""
    import torch

    if len(original) != len(converted) or not original:
        raise ValueError(f"paired values need the same, non-zero length (got {len(original)} and {len(converted)})")
    o = torch.tensor([float(v) for v in original], dtype=torch.float64)
    c = torch.tensor([float(v) for v in converted], dtype=torch.float64)
    if not (torch.isfinite(o).all() and torch.isfinite(c).all()):
        raise ValueError("per-example values must be finite")
    difference = float(c.mean() - o.mean())
    low, high, p = paired_bootstrap(o, c)
    only = {}
    if is_binary(original) and is_binary(converted):
        b, cc = int(((o == 1) & (c == 0)).sum()), int(((o == 0) & (c == 1)).sum())
        p, test, only = mcnemar_exact(b, cc), "mcnemar-exact", {"only_original": b, "only_converted": cc}
    else:
        test = "paired-bootstrap"
    drop = -difference if higher_is_better else difference
    return PairedTest(len(o), difference, drop, low, high, test, p, bool(p < alpha), alpha, **only)
