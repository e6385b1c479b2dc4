"""``prepare(recipe, src, dst)`` checks every stage of a :class:`~mha2gqa.pipeline.recipe.Recipe` before
any work; :meth:`Prepared.run` does them: the conversion (merge, refit, the stage guard), then, where the
recipe distils, the distillation (:mod:`~mha2gqa.pipeline.distill`, its rate backoff) and the publishing
of both as one DST.

With a distillation, the two stages run in one staged folder beside DST: the conversion goes to
``converted/`` in it, the distillation reads that and writes ``distilled/`` in DST's resume folder
(``.DST.mha2gqa-resume/``, with its checkpoints, the teacher's cache and the refit's finished layers),
whose final model (with both records and the card) becomes DST; nothing is published unless both
finish, and a stopped run continues with ``--resume``. Under a launcher with ``--sharding fsdp`` every
process takes its share of the statistics, the refit and the distillation, and rank 0 alone writes,
scores the stage guard and publishes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from mha2gqa.core.dims import max_positions
from mha2gqa.core.ranks import Ranks, under_launcher
from mha2gqa.pipeline.recipe import Recipe

Log = Callable[[str], None]


@dataclass(frozen=True)
class Outcome:
    """What a pipeline run made: the conversion's result and the distillation's (None without one);
    both None on a process other than rank 0, which writes nothing."""

    conversion: Any = None
    distillation: Any = None

    def lines(self) -> list[str]:
        """The run's summary: the conversion's line, then the distillation's (saying so where the
        stage guard did not publish it)."""
        if self.conversion is None:
            return []
        lines = [self.conversion.summary()]
        if self.distillation is not None:
            lines.append(_distilled_line(self.conversion, self.distillation))
        return lines


@dataclass(frozen=True)
class Prepared:
    """A recipe checked against its source and destination: :meth:`run` does its stages."""

    recipe: Recipe
    src: str
    conversion: Any  # mha2gqa.convert.prepare.Conversion
    log: Log | None = None

    def run(self) -> Outcome:
        """Every stage in turn; a failure leaves DST as it was."""
        from mha2gqa.convert.converter import run as run_conversion

        if not self.recipe.distilling:
            return Outcome(run_conversion(self.conversion))
        return _convert_and_distill(self)


def prepare(recipe: Recipe, src: str, dst: Path, log: Log | None = None) -> Prepared:
    """Check every stage of ``recipe`` (its settings, the source, DST and any kept work) before any work.
    ``log``: who hears the stages' lines (each refitted layer, the guard's decisions, the distillation);
    None: the terminal (the conversion's lines on stderr with progress, the distillation's on stdout)."""
    from mha2gqa.convert.prepare import prepare as prepare_conversion

    s, d = recipe.convert, recipe.distill.check(recipe.convert)  # (off: that no distill_* setting is given)
    if not recipe.distilling:
        return Prepared(recipe, src, dataclasses.replace(prepare_conversion(src, dst, s), log=log), log)
    conversion = s if s.reads_calibration else dataclasses.replace(s, calibration=None, self_text=None)  # ours
    first = prepare_conversion(src, dst, conversion, later={"distill": d.recipe(), "arithmetic": d.arithmetic(s)})
    return Prepared(recipe, src, first, log or print)


@dataclass(frozen=True)
class PreparedUptrain:
    """An uptraining stage checked before any weights load: :meth:`run` does it."""

    plan: Any  # mha2gqa.uptrain.trainer's plan

    def run(self):
        """The uptraining run; its ``UptrainResult``."""
        from mha2gqa.uptrain import run_uptrain

        return run_uptrain(self.plan)


def prepare_uptrain(student: str, settings, log: Log = print) -> PreparedUptrain:
    """The uptraining of ``student`` as ``settings`` (``UptrainSettings``) say (``mha2gqa uptrain``, a
    job's ``uptrain`` section after its conversion), every check done before any weights load."""
    from mha2gqa.uptrain import prepare_uptrain as prepare_stage

    return PreparedUptrain(prepare_stage(student, settings, log))


def _convert_and_distill(p: Prepared):
    """Convert, distil the result, publish the distilled model as DST (see the module doc). A stop keeps
    the refit's finished layers and the distillation's newest checkpoint beside DST: the same command with
    ``--resume`` converts again (reading the fitted layers back) and continues the distillation."""
    from mha2gqa.convert.calibration.own_text import with_own_text
    from mha2gqa.convert.converter import run
    from mha2gqa.convert.prepare import inputs_of
    from mha2gqa.core.output import staged_output
    from mha2gqa.core.progress import sink as progress_sink
    from mha2gqa.core.recipe_file import write_recipe
    from mha2gqa.core.resume import ResumeFolder, resumable
    from mha2gqa.pipeline.backoff import Judge
    from mha2gqa.pipeline.distill import CONVERTED, DISTILLED, Held, distil, publish

    s, d, log = p.recipe.convert, p.recipe.distill, p.log
    reads = d.reads(s, max_positions(p.conversion.ckpt.config))
    first = with_own_text(p.conversion, log, s, reads)  # (once: the conversion and the distillation read it)
    dst = first.dst
    team = _processes(s.device)
    if not team.main:
        _alongside(p, team)
        return Outcome()
    resume = ResumeFolder.open(dst, first.fingerprint, s.resume, s.remove_stale)
    staged = staged_output(dst, s.overwrite, inputs_of(first.ckpt, s), remove_stale=s.remove_stale)
    with resumable(resume), staged as stage:
        # each refitted layer and the guard's decisions: in ``log`` where the bars are off or go to a log (a job)
        heard = log if not s.progress or progress_sink() is not None else None
        staged_conversion = dataclasses.replace(first, dst=stage / CONVERTED, log=heard)
        converted = run(staged_conversion, guard_data=s.calibration, resume=resume)
        guard = converted.guard
        held = guard.before_windows if guard is not None and guard.ids is not None else None
        team.decide(lambda: (str(converted.output), held))  # what the other processes distil with rank 0
        out, targets = resume.path(DISTILLED), converted.kv_heads_per_layer
        judge = Judge(partial(guard.score_folder, targets=targets), guard.published) if held is not None else None
        distilled, tried, score = distil(converted.output, first, s, d, out, log, Held(held, judge), team)
        detail = tried.detail if tried is not None else ""
        kept = guard is None or guard.distillation(out, targets, log, detail, score)
        record = converted.record
        judged = {"guard": guard.record()} if guard is not None else {}
        facts = dataclasses.replace(record.conversion, distilled=kept, **judged)
        record = dataclasses.replace(record, conversion=facts)
        publish(stage, out if kept else None, dst, p.src, record)
        write_recipe(stage, p.recipe.name, p.recipe.sections())
    converted = dataclasses.replace(converted, output=dst, record=record)
    return Outcome(converted, dataclasses.replace(distilled, output=dst))


def _processes(device: str) -> Ranks:
    """The processes of this run: under a launcher, their group formed on ``device`` first."""
    from mha2gqa.core.models import resolve_device
    from mha2gqa.core.ranks import ranks

    if under_launcher():
        resolve_device(device)
    return ranks()


def _alongside(p: Prepared, team: Ranks) -> None:
    """A process other than rank 0: its share of the conversion (statistics, refit), then of the
    distillation of what rank 0 wrote; it writes nothing of its own."""
    from mha2gqa.convert.converter import run
    from mha2gqa.core.resume import resume_folder
    from mha2gqa.pipeline.distill import DISTILLED, Held, distil

    s, d = p.recipe.convert, p.recipe.distill
    run(p.conversion, guard_data=s.calibration)
    student, held = team.decide(lambda: None)
    distil(Path(student), p.conversion, s, d, resume_folder(p.conversion.dst) / DISTILLED, p.log, Held(held), team)


def _distilled_line(converted, distilled) -> str:
    """The distillation's summary, saying so where the stage guard did not publish it."""
    if converted.record.conversion.distilled is False:
        return f"{distilled.summary()}: undone by the stage guard, DST holds the model before it"
    return distilled.summary()
