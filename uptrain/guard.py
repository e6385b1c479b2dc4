"""``uptrain --guard``: the run's published model is the one its held-out evaluations scored best.

Uptraining can make a model worse where the user will use it (a learning rate right for one model
wrecks another; a few steps on one text can move a model away from its teacher on another: in the
demo job, 30 steps made a refitted model's held-out KL 0.011 -> 0.022). So, like ``convert``'s stage
guard (:mod:`mha2gqa.convert.guard`), a run proves at the model level that it helped: every
evaluation on ``--eval-data`` (or ``--heldout-tokens``, the last tokens of ``--data``) scores the model
of its step by the run's own objective (:class:`Figure`: the perplexity for ``ce``, the KL to
``--teacher`` for ``kd``), and the model published is the best of the student as given (step 0), the
last step's, and every evaluated step whose checkpoint the run kept (the checkpoint pruning spares
it). A run whose best is step 0 is *undone*: the student is published as it was, and the record, the
model card and the terminal say so (``--guard fail`` fails instead; ``--guard off`` publishes the
last step's model). Without ``--eval-data`` nothing is measured and the last step's model is published.

Where the figure is a strict improvement: a model no better than the one before it is not kept, as in
the conversion's guard. The choice reads the text it scores, so a figure on ``--eval-data`` is that
of the best of a few candidates (the run's evaluations): hold out another text for an unbiased one."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from mha2gqa.core.conversion_record import KEPT, KEPT_IN_PART, UNDONE
from mha2gqa.core.runlog import RunEval
from mha2gqa.core.uptrain_guard import UptrainGuard


@dataclass(frozen=True)
class Figure:
    """What the guard compares, the run's objective on held-out text: ``ce`` the perplexity, ``kd`` the
    KL to the teacher, ``mix`` ``(1 - kd_weight) x NLL + kd_weight x KL``; the perplexity where the
    evaluations measure no KL (a ``--teacher-top-k`` run scores the held-out text without the teacher)."""

    objective: str
    kd_weight: float = 0.5

    def measured(self, evals: Sequence[RunEval]) -> Figure:
        """This figure as ``evals`` can give it: the perplexity where the first has no KL."""
        return self if self.objective == "ce" or (evals and evals[0].kl_mean is not None) else Figure("ce")

    @property
    def name(self) -> str:
        return {"ce": "perplexity", "kd": "KL"}.get(
            self.objective, f"{1 - self.kd_weight:g} NLL + {self.kd_weight:g} KL"
        )

    def of(self, ev: RunEval) -> float:
        """One evaluation's value (one that is not finite, or a KL not measured, counts as infinite)."""
        if self.objective == "ce":
            x = ev.ppl
        elif ev.kl_mean is None:
            x = math.inf
        else:
            x = ev.kl_mean if self.objective == "kd" else (1 - self.kd_weight) * ev.nll + self.kd_weight * ev.kl_mean
        return x if math.isfinite(x) else math.inf


def choose(evals: Sequence[RunEval], last: int, kept: Collection[int], figure: Figure) -> UptrainGuard | None:
    """The guard's decision on a run that ended at step ``last``, from its evaluations ``evals``
    (step 0's among them) and ``kept``, the earlier steps whose checkpoint holds a whole model; None
    where step 0 or ``last`` was not evaluated (no ``--eval-data``). Ties go to the earlier model."""
    by_step = {ev.step: ev for ev in evals}
    if 0 not in by_step or last not in by_step:
        return None
    figure = figure.measured(evals)
    value = {step: figure.of(ev) for step, ev in by_step.items()}
    candidates = [0, *sorted(s for s in kept if 0 < s < last and s in by_step), last]
    best = min(candidates, key=lambda s: (value[s], s))
    outcome = UNDONE if best == 0 else KEPT if best == last else KEPT_IN_PART
    return UptrainGuard(outcome, figure.name, value[0], value[last], best, value[best], last)


def best_so_far(evals: Sequence[RunEval], figure: Figure) -> int | None:
    """The step after 0 whose evaluation scored best so far (None: none yet): the checkpoint the
    pruning spares."""
    later, figure = [ev for ev in evals if ev.step > 0], figure.measured(evals)
    return min(later, key=lambda ev: (figure.of(ev), ev.step)).step if later else None
