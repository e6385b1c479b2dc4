"""The verdict every comparison gets, gates or not: ``pass``, ``borderline`` or ``fail``, decided by
the worst of its figures against recommended thresholds (rationale and sources: docs/evaluation.md,
"What a good result looks like").

The thresholds are a yardstick users already know, weight quantization of 7-8B models as measured by
llama.cpp: a good 4-bit quantization costs a perplexity ratio of 1.01-1.03, a mean KL of a few
hundredths of a nat and keeps 90-95% of top tokens; a 2-bit one costs 1.1-1.6, KL in the tenths and
70-80% top tokens. ``pass``: no worse than a good 4-bit quantization; ``borderline``: usable as the
start of uptraining, not as a release; ``fail``: beyond. Explicit gates (:mod:`mha2gqa.eval.gates`)
still decide the exit code.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from mha2gqa.core import typed

#: The tiers, best first.
TIERS = ("pass", "borderline", "fail")
#: How a verdict whose measurement is not valid reads (and is tallied), instead of its tier.
NOT_VALID = "not valid"
#: Every verdict a reader sees, best first (not valid: worse than any measured tier).
SHOWN = (*TIERS, NOT_VALID)
#: Where the thresholds are explained.
SOURCE = "docs/evaluation.md#what-a-good-result-looks-like"


@dataclass(frozen=True)
class Threshold:
    """One figure's limits: at most (``op`` "<=") or at least (">=") ``passing`` for ``pass``,
    ``borderline`` for ``borderline``."""

    figure: str
    op: str
    passing: float
    borderline: float
    why: str

    @property
    def sign(self) -> str:
        """``op`` as printed: ``≤`` or ``≥``."""
        return "≤" if self.op == "<=" else "≥"

    def tier(self, value: float) -> str:
        within = (lambda limit: value <= limit) if self.op == "<=" else (lambda limit: value >= limit)
        return "pass" if within(self.passing) else "borderline" if within(self.borderline) else "fail"


#: The recommended thresholds (the one source: docs/evaluation.md renders them, tests read them).
THRESHOLDS = (
    Threshold(
        "ppl_ratio", "<=", 1.05, 1.20,
        "converted/original perplexity; a good 4-bit weight quantization of a 7-8B model costs 1.01-1.03, "
        "2-bit 1.1-1.6 (llama.cpp #6936)",
    ),
    Threshold(
        "kl_mean", "<=", 0.05, 0.25,
        "mean per-token KL(original || converted) in nats; 4-5-bit quantizations 0.01-0.04, 2-3-bit 0.2-0.6 "
        "(llama.cpp #5081, #6936, #19661)",
    ),
    Threshold(
        "top1_agreement", ">=", 0.90, 0.75,
        "share of tokens where both models' most likely next token is the same; 4-5-bit quantizations "
        "keep 92-96%, 2-3-bit 70-80% (llama.cpp #5081, #19661)",
    ),
)  # fmt: skip


@dataclass(frozen=True)
class Figure:
    """One figure of a comparison with the tier its value falls in."""

    name: str
    value: float
    tier: str
    limit: str  # the bound it missed (or met), e.g. "pass <= 1.05"


@dataclass(frozen=True)
class Verdict:
    """A comparison's tier, the figure that decided it, every figure judged, and the thresholds."""

    tier: str
    decided_by: str
    value: float
    figures: list[Figure]
    thresholds: dict[str, dict[str, Any]]
    yardstick: str | None = None  # where the conversion sits among weight quantizations
    source: str = SOURCE
    #: why the figures do not measure the conversion (e.g. evaluated on its calibration text); None: valid
    invalid: str | None = None

    @property
    def shown(self) -> str:
        """The tier, or :data:`NOT_VALID`: what the verdict says (and tallies as) to a reader."""
        return NOT_VALID if self.invalid else self.tier

    @property
    def passed(self) -> bool:
        """A valid pass."""
        return self.invalid is None and self.tier == "pass"

    def sentence(self) -> str:
        """``verdict: BORDERLINE (ppl_ratio[disjoint] 1.12: pass <= 1.05, borderline <= 1.2) ...``; not
        valid: ``verdict: NOT VALID (evaluated on the calibration text ...) - would be PASS (...)``."""
        decided = next(f for f in self.figures if f.name == self.decided_by)
        text = f"{self.tier.upper()} ({decided.name} {decided.value:.4g}: {decided.limit})"
        text += f"; {self.yardstick}" if self.yardstick else ""
        return f"verdict: NOT VALID ({self.invalid}) - would be {text}" if self.invalid else f"verdict: {text}"

    def judged_invalid(self, why: str | None) -> Verdict:
        """This verdict, marked not valid for ``why`` (itself when ``why`` is None or it already is)."""
        return self if why is None or self.invalid else replace(self, invalid=why)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> Verdict:
        verdict = typed.read(cls, data, where)
        if verdict.tier not in TIERS:
            raise typed.RecordError(f"{where}.tier {verdict.tier!r} is not one of {', '.join(TIERS)}")
        if not any(f.name == verdict.decided_by for f in verdict.figures):
            raise typed.RecordError(f"{where}.decided_by {verdict.decided_by!r} names no figure")
        return verdict


def thresholds_table() -> str:
    """The thresholds as the Markdown table the README and docs/evaluation.md carry (drift-tested)."""
    names = {
        "ppl_ratio": "perplexity ratio (converted / original), every protocol",
        "kl_mean": "mean per-token KL(original ‖ converted), nats",
        "top1_agreement": "top-1 agreement",
    }
    rows = ["| figure | pass | borderline | fail |", "|---|---|---|---|"]
    for t in THRESHOLDS:
        op, worse = t.sign, ">" if t.op == "<=" else "<"
        rows.append(f"| {names[t.figure]} | {op} {t.passing:g} | {op} {t.borderline:g} | {worse} {t.borderline:g} |")
    return "\n".join(rows)


def figures_of(ppl_ratios: dict[str, float], kl_mean: float | None, top1: float | None) -> dict[str, float]:
    """A comparison's judged figures: the perplexity ratio of every protocol, KL and top-1."""
    out = {f"ppl_ratio[{name}]": r for name, r in ppl_ratios.items() if r is not None}
    if kl_mean is not None:
        out["kl_mean"] = kl_mean
    if top1 is not None:
        out["top1_agreement"] = top1
    return out


def judge(values: dict[str, float], yardstick: str | None = None) -> Verdict | None:
    """The verdict over ``values`` (from :func:`figures_of`); None when there is nothing to judge.
    The worst tier decides; among figures in that tier, the one furthest past its bound."""
    by_name = {t.figure: t for t in THRESHOLDS}
    judged: list[tuple[Figure, float]] = []
    for name, value in values.items():
        t = by_name[name.split("[")[0]]
        tier = t.tier(value)
        bound = t.passing if tier == "pass" else t.borderline
        limit = f"pass {t.op} {t.passing:g}" + ("" if tier == "pass" else f", borderline {t.op} {t.borderline:g}")
        # How far past (or inside) the bound of its tier, relative: ranks figures of one tier.
        excess = (value - bound) / bound if t.op == "<=" else (bound - value) / max(bound, 1e-12)
        judged.append((Figure(name, value, tier, limit), excess))
    if not judged:
        return None
    worst = max(judged, key=lambda fe: (TIERS.index(fe[0].tier), fe[1]))[0]
    thresholds = {t.figure: {"op": t.op, "pass": t.passing, "borderline": t.borderline} for t in THRESHOLDS}
    return Verdict(worst.tier, worst.name, worst.value, [f for f, _ in judged], thresholds, yardstick)
