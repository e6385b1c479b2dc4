"""Output agreement of two models on the same scored tokens (llama.cpp's KL-divergence report), typed
(torch-free, as every reader of results files): the per-token figures' statistics (:class:`Stats`),
and :class:`Agreement`, the results file's ``agreement`` section, which the scoring pass returns
(:func:`mha2gqa.eval.metrics.agreement_stats`) and the uptraining evaluations read too."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(kw_only=True)
class Stats:
    """Percentiles of a per-token figure (KL, Δp); the llama.cpp-style report's extra statistics
    (``std_error``, ``min``, the low percentiles) are present wherever ``kl_reverse`` is."""

    mean: float
    median: float
    q90: float
    q95: float
    q99: float
    q99_9: float
    max: float
    std_error: float | None = None
    min: float | None = None
    q0_1: float | None = None
    q1: float | None = None
    q5: float | None = None
    q10: float | None = None
    count: int | None = None

    #: the statistics the llama.cpp-style report reads beside the headline ones
    REPORT: ClassVar[tuple[str, ...]] = ("std_error", "min", "q0_1", "q1", "q5", "q10")


@dataclass(kw_only=True)
class DeltaP(Stats):
    """Δp, the change in the correct token's probability, with its root mean square."""

    rms: float | None = None
    rms_error: float | None = None


@dataclass
class RestMass:
    """Against a top-k reference cache: the probability mass outside the kept tokens."""

    mean: float
    max: float


@dataclass
class Agreement:
    """Output agreement of the converted model with the original on the same scored tokens."""

    tokens: int
    kl: Stats
    top1_agreement: float
    nll_delta: float
    settings: dict[str, Any] = field(default_factory=dict)
    # llama.cpp's KL report (files written before it was recorded lack these)
    kl_reverse: Stats | None = None
    delta_p: DeltaP | None = None
    top1_error: float | None = None
    nll_delta_error: float | None = None
    nll_correlation: float | None = None
    # against a top-k reference cache: the probability mass outside the kept tokens (KLs are lower bounds)
    reference_rest_mass: RestMass | None = None


@dataclass
class GreedyProbe:
    """The results file's ``greedy`` section (:mod:`mha2gqa.eval.greedy`): ``prompts`` continuations
    of ``tokens`` tokens each (prompts of ``prompt_tokens``), the share identical to the original's, and
    the mean number of tokens before the first divergence."""

    prompts: int
    prompt_tokens: int
    tokens: int
    identical: float
    mean_agreeing_tokens: float

    def line(self) -> str:
        return (
            f"greedy: {self.identical:.1%} of {self.prompts} continuations of {self.tokens} tokens identical to "
            f"the original's; first divergence after {self.mean_agreeing_tokens:.1f} tokens on average"
        )
