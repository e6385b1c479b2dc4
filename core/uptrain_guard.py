"""What ``uptrain --guard`` decided about a published model (:class:`UptrainGuard`, part of the
uptraining record ``mha2gqa_uptrain.json``), and reading that decision back from a model folder, as
the results name the model (``+uptrain(undone)``: :attr:`~mha2gqa.core.model_info.ModelInfo.recipe`).
The decision itself is made in :mod:`mha2gqa.uptrain.guard`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mha2gqa.core.conversion_record import KEPT, KEPT_IN_PART, UNDONE
from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.text_ref import TextRef


@dataclass(frozen=True)
class UptrainGuard:
    """The guard's decision on a finished run: the figure it compared (``KL`` or ``perplexity`` on
    ``--eval-data``), the student's (step 0), the last step's, and the step whose model is published
    (0: the student as given) with its figure."""

    outcome: str  # KEPT (the last step's), KEPT_IN_PART (an earlier step's) or UNDONE (the student)
    figure: str
    before: float
    last: float
    step: int
    published: float
    steps: int  # the run's last step

    def problem(self) -> str | None:
        """What makes this decision one no run could have made (a tampered record), or None."""
        if self.outcome not in (KEPT, KEPT_IN_PART, UNDONE):
            return f"outcome {self.outcome!r} is not one of {KEPT}, {KEPT_IN_PART}, {UNDONE}"
        step = {KEPT: self.steps, UNDONE: 0}.get(self.outcome)
        if not 0 <= self.step <= self.steps or (step is not None and self.step != step):
            return f"step {self.step} cannot be published as {self.outcome} by a run of {self.steps} steps"
        if any(math.isnan(x) or x < 0 for x in (self.before, self.last, self.published)):
            return "a figure is not a non-negative number"
        return None

    @property
    def moved(self) -> str:
        """``held-out KL 0.011 -> 0.022``: the figure at the start and at the run's last step."""
        return f"held-out {self.figure} {_f(self.before)} -> {_f(self.last)}"

    def line(self) -> str:
        """``undone - held-out KL 0.011 -> 0.022: the student is published as given`` (terminal, card)."""
        moved = self.moved
        if self.outcome == KEPT:
            return f"kept - {moved}"
        if self.outcome == UNDONE:
            return f"undone - {moved}: the student is published as given"
        return f"step {self.step} of {self.steps} kept - {moved}; step {self.step}: {_f(self.published)}"


def _f(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.4g}"


def checked(guard: UptrainGuard | None, where: str) -> UptrainGuard | None:
    """``guard`` as read from the record ``where``; one no run could have made: one error naming it."""
    if guard is not None and (problem := guard.problem()):
        raise Mha2GqaError(f"{where}: damaged uptraining record (uptrain.guard: {problem})")
    return guard


#: an uptraining record's ``stage`` where the run was ``convert --distill``'s own (None: ``mha2gqa uptrain``)
DISTILL_STAGE = "distill"


@dataclass(frozen=True)
class PublishedRun:
    """The part of an uptraining record that core reads (the rest is the uptrain layer's): the guard's
    decision, which stage wrote it, and its training text."""

    guard: UptrainGuard | None = None
    stage: str | None = None
    settings: dict[str, Any] | None = None
    text: TextRef | None = None

    @property
    def outcome(self) -> str | None:
        """The guard's outcome (KEPT, KEPT_IN_PART or UNDONE); None where the run was not guarded
        (``--guard off``, no held-out text, ``convert --distill``'s own run, judged by the conversion's guard)."""
        return None if self.guard is None else self.guard.outcome

    @property
    def training_text(self) -> tuple[str, TextRef | None] | None:
        """The training text (``--data``): its name and reference (file name, sha256, line sketch; None in
        a record before them, which names the file by its path); None where it names no text."""
        data = (self.settings or {}).get("data")
        return (data, self.text) if isinstance(data, str) and data else None


@dataclass(frozen=True)
class _Published:
    uptrain: PublishedRun


def checked_stage(stage: str | None, where: str) -> str | None:
    """An uptraining record's ``stage`` as read from ``where``: None or :data:`DISTILL_STAGE`, else one
    error naming it."""
    if stage not in (None, DISTILL_STAGE):
        raise Mha2GqaError(f"{where}: damaged uptraining record (uptrain.stage {stage!r} is not {DISTILL_STAGE!r})")
    return stage


def published_run(folder: Path) -> PublishedRun | None:
    """The uptraining record of the model in ``folder`` as core reads it (None: it has none); a damaged
    record: one error naming it."""
    from mha2gqa.core import typed
    from mha2gqa.core.records import UPTRAIN_RECORD, read_record_json

    path = Path(folder) / UPTRAIN_RECORD
    data = read_record_json(path, "uptrain the model again")
    if data is None:
        return None
    try:
        run = typed.read(_Published, data, "record").uptrain
    except typed.RecordError as e:
        raise Mha2GqaError(f"{path}: damaged uptraining record ({e})") from None
    checked_stage(run.stage, str(path))
    checked(run.guard, str(path))
    return run


def published_outcome(folder: Path) -> str | None:
    """The guard's outcome on the uptrained model in ``folder`` (:attr:`PublishedRun.outcome`; None
    without a record)."""
    run = published_run(folder)
    return None if run is None else run.outcome
