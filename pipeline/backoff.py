"""``convert --distill``'s rate backoff: a distillation that made the model worse runs again, slower.

``--distill-lr`` is relative to each weight's RMS, so the same model written differently takes the same
steps; but the share of its size a weight should move differs between models (SmolLM2-135M takes
1.5e-3 well; on pydocs-mha-8h 8 -> 2 the same rate made the model worse, and a third of it better; a
rate far too high wrecks a model). So where the stage guard finds the distilled model no closer to SRC
on its held-out windows than the model before it, the distillation runs again from the converted
model at a third of the rate, then a ninth (:data:`BACKOFF`); the first that lowers the KL is
published, and where none does the guard undoes the distillation.

Why the whole run and not a probe of a few steps: on SmolLM2 a race of three rates over the first
sixth of the steps chose a third of the rate (KL 0.439 against 0.466 after 4 steps), which over the
24 steps ended worse than the rate as given (guard KL 0.419 against 0.409); on a tiny model a check at
the first third backed off a rate whose KL rose before it fell (0.121 against 0.115 at the end). A
short run judges the start of a run, not its end (docs/methods.md). The backoff costs nothing where
the rate helps, and one more distillation for each rate backed off.

How many steps: a distillation can pass its best and go on (a rate a little too high for the model
at hand). So the guard scores each checkpoint but the last (:data:`~mha2gqa.pipeline.distill.DISTILL_CHECKPOINTS`
of them over the run) as it is written, keeps the best one's files (hard links) in the resume folder,
and where the final model scores worse than the best earlier checkpoint, the try ends at that
checkpoint's step instead (its weights cast to the source's dtype as the final's are, and scored
again as published). The cost: two more guard scores a try, about one training step each.

A run stopped during a later try (``--resume``) goes on with that try, read back from
:data:`BACKOFF_FILE` in the resume folder, and with the checkpoints scored so far (:data:`BEST_FILE`)."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from mha2gqa.core.conversion_record import GuardScore
from mha2gqa.core.ranks import Ranks
from mha2gqa.core.resume import ResumeDamaged, ResumeFolder

#: the rates tried in turn, as factors of --distill-lr: the next where the distillation at the one
#: before did not lower the guard's held-out KL
BACKOFF = (1.0, 1 / 3, 1 / 9)
#: the try in progress after the first (its rate, and what the tries before it measured), in the
#: resume folder: a resumed run goes on with it
BACKOFF_FILE = "distill-backoff.json"
#: the try in progress's checkpoints as the guard scored them (:class:`Checked`), in the resume folder,
#: and the best one's files beside it, in a folder named for its step
BEST_FILE, BEST_FOLDER, BEST_FOLDERS = "distill-best.json", "distill-best-step-{:07d}", "distill-best-step-*"


@dataclass(frozen=True)
class Judge:
    """Rank 0's view of the guard: ``score`` the model in a folder on its held-out windows, and the
    figure of the model before the distillation, which a distillation must lower."""

    score: Callable[[Path], GuardScore]
    before: GuardScore


@dataclass(frozen=True)
class Tried:
    """The backoff so far: the relative rate of the try in progress (or published), and what the
    tries before it measured (the guard's distill line)."""

    lr: float
    # e.g. "--distill-lr 0.0015: KL 0.43, not below KL 0.41 (step 8: KL 0.42, ...); --distill-lr 0.0005: KL 0.4,
    # kept (step 8: ...)"
    detail: str = ""
    step: int | None = None  # the step the published try ends at (None: still going)


@dataclass(frozen=True)
class Checked:
    """The checkpoints of the try in progress as the guard scored them: the last step scored, and
    the best step so far with its figures (``step`` 0: none yet)."""

    scored: int = 0
    step: int = 0
    kl: float | None = None
    top1: float = 0.0
    said: str = ""  # every scored checkpoint's KL, e.g. "step 8: KL 0.4312, step 16: KL 0.4151"

    @property
    def score(self) -> GuardScore:
        return GuardScore(self.kl, self.top1)


class StepWatch:
    """The guard's eye on a try's checkpoints (``uptrain``'s watch; every process calls it, rank 0
    scores): each checkpoint's figures said, the best one's files kept in the resume folder."""

    def __init__(self, judge: Judge | None, team: Ranks, kept: ResumeFolder, log, resumed: bool) -> None:
        self.judge, self.team, self.kept, self.log = judge, team, kept, log
        self.best = team.decide(partial(_read_best, kept) if resumed else partial(_forget, kept))

    def __call__(self, step: int, folder: Path) -> None:
        self.best = self.team.decide(partial(self._score, step, Path(folder)))

    def _score(self, step: int, folder: Path) -> Checked:
        if step <= self.best.scored:  # (a resumed run shows the checkpoint it starts from again)
            return self.best
        score = self.judge.score(folder)
        self.log(f"distill: step {step}: {score}")
        said = ", ".join(filter(None, (self.best.said, f"step {step}: {_kl(score)}")))
        if self.best.step and score.loss >= self.best.score.loss:
            best = dataclasses.replace(self.best, scored=step, said=said)
        else:
            _link_files(folder, self.kept.path(BEST_FOLDER.format(step)))
            best = Checked(step, step, score.kl, score.top1, said)
        self.kept.write_bytes(BEST_FILE, json.dumps(dataclasses.asdict(best)).encode())
        _drop_best(self.kept, but=BEST_FOLDER.format(best.step))
        return best

    def chosen(self) -> Path | None:
        """The best earlier checkpoint's files (rank 0), None when none was scored."""
        return self.kept.path(BEST_FOLDER.format(self.best.step)) if self.best.step else None


def _link_files(folder: Path, to: Path) -> None:
    """``folder``'s files hard-linked into ``to`` (copied where the disk cannot link), written beside it
    and renamed into place."""
    tmp = to.with_name(to.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    from mha2gqa.uptrain.checkpoints import link_or_copy

    for path in folder.iterdir():
        if path.is_file():
            link_or_copy(path, tmp / path.name)
    shutil.rmtree(to, ignore_errors=True)
    tmp.rename(to)


def _forget(kept: ResumeFolder) -> Checked:
    """A fresh try: no checkpoint scored (an earlier try's best dropped)."""
    kept.path(BEST_FILE).unlink(missing_ok=True)
    _drop_best(kept)
    return Checked()


def _drop_best(kept: ResumeFolder, but: str | None = None) -> None:
    """Every kept best checkpoint's files (their half-written copies too) but the folder named ``but``."""
    for old in kept.folder.glob(BEST_FOLDERS):
        if old.name != but:
            shutil.rmtree(old, ignore_errors=True)


def _read_best(kept: ResumeFolder) -> Checked:
    """The checkpoints a stopped try scored (refused in one line if damaged)."""
    if not kept.has(BEST_FILE):
        return Checked()
    held = kept.read_json(BEST_FILE)
    try:
        best = Checked(**held)
        if not _whole(best) or (best.step and not kept.path(BEST_FOLDER.format(best.step)).is_dir()):
            raise TypeError
    except TypeError:
        raise ResumeDamaged(
            f"{kept.path(BEST_FILE)}: not the distillation's checkpoint scores; pass --remove-stale to start over"
        ) from None
    return best


def _whole(best: Checked) -> bool:
    """Steps whole and in order, figures a guard could have measured."""
    steps = all(type(v) is int and v >= 0 for v in (best.scored, best.step)) and best.step <= best.scored
    kl = best.kl is None or (isinstance(best.kl, float) and math.isfinite(best.kl) and best.kl >= 0)
    return steps and kl and isinstance(best.top1, float) and 0 <= best.top1 <= 1 and isinstance(best.said, str)


def _kl(score: GuardScore) -> str:
    return f"KL {'inf' if score.kl is None else f'{score.kl:.4g}'}"


def distil_backing_off(student: Path, settings, team: Ranks, judge: Judge | None, log, backoff: bool = True):
    """The distillation ``settings`` (``UptrainSettings``) of ``student``, its step count chosen by the
    guard, run again at each rate of :data:`BACKOFF` in turn (``backoff``; else the rate given alone)
    while the guard finds it no closer to SRC; every process calls this, ``judge`` given on rank 0.
    ``(the uptraining result of the last try, its Tried, its GuardScore (rank 0))``."""
    from mha2gqa.uptrain import uptrain

    out, kept = Path(settings.output), ResumeFolder(Path(settings.output).parent)
    rates = [settings.lr * factor for factor in (BACKOFF if backoff else BACKOFF[:1])]
    held = team.decide(lambda: _read(kept, rates)) if settings.resume and kept.has(BACKOFF_FILE) else None
    tried = held or Tried(rates[0])
    start = rates.index(tried.lr)
    for i in range(start, len(rates)):
        resume = settings.resume and i == start  # a later try starts afresh in the emptied folder
        watch = StepWatch(judge, team, kept, log, resume)
        result = uptrain(str(student), dataclasses.replace(settings, lr=rates[i], resume=resume), log=log, watch=watch)
        nxt = rates[i + 1] if i + 1 < len(rates) else None
        tried, score, done = team.decide(partial(_check, out, tried, nxt, judge, kept, log, watch, result))
        if done:
            return _at(result, tried), tried, score
    raise AssertionError("the last rate always ends the backoff")


def _at(result, tried: Tried):
    """The uptraining result as published: at the step the guard chose."""
    if tried.step is None or tried.step == result.steps:
        return result
    return dataclasses.replace(result, steps=tried.step, tokens=result.tokens * tried.step // result.steps)


def _ended(out: Path, watch: StepWatch, judge: Judge, total: int, log) -> tuple[GuardScore, int, str]:
    """Rank 0: the try's model as it ends, ``(its score, its step, what the checkpoints said)``: the
    final model, or the best earlier checkpoint where that scored lower (then the final replaced by it)."""
    from mha2gqa.uptrain.checkpoints import final_from_checkpoint

    score = judge.score(out)
    best = watch.best
    said = f"{best.said}, step {total}: {_kl(score)}" if best.said else ""
    if not best.step or best.score.loss >= score.loss:
        return score, total, said
    final_from_checkpoint(watch.chosen(), out)
    published = judge.score(out)
    log(f"distill: step {best.step} of {total} scored best ({best.score}; step {total}: {score}): its model is kept")
    return published, best.step, f"{said}, so step {best.step}'s model"


def _check(out: Path, tried: Tried, nxt: float | None, judge: Judge, kept: ResumeFolder, log, watch, result):
    """Rank 0: score the distillation at ``tried.lr`` in ``out`` (at its best step); ``(Tried, its score,
    whether the backoff ends: it lowered the KL, or no rate ``nxt`` is left)``. Where it goes on, ``out``
    is emptied, then the next try written down."""
    score, step, note = _ended(out, watch, judge, result.total_steps, log)
    helped = score.beats(judge.before)  # lower on the calibration text, no --guard-data text worse
    at, steps = f"--distill-lr {tried.lr:.3g}: {score}", f" ({note})" if note else ""
    if helped or nxt is None:
        end = f"{at}, {'kept' if helped else 'not below either'}{steps}"
        detail = f"{tried.detail}; {end}" if tried.detail else note  # one try: its checkpoints' KL alone
        return Tried(tried.lr, detail, step), score, True
    line = f"{at}, not below {judge.before}{steps}"
    log(f"distill: {line}: again at a third of the rate")
    following = Tried(nxt, f"{tried.detail}; {line}" if tried.detail else line)
    _forget(kept)  # first: a stop in between reruns this try, never resumes it as the next ...
    shutil.rmtree(out, ignore_errors=True)  # ... nor with the scores of another try's checkpoints
    kept.write_bytes(BACKOFF_FILE, json.dumps(dataclasses.asdict(following)).encode())
    return following, score, False


def _read(kept: ResumeFolder, rates: list[float]) -> Tried:
    """The try in progress of the stopped run, one of ``rates`` (refused in one line if damaged)."""
    held = kept.read_json(BACKOFF_FILE)
    try:
        tried = Tried(**held)
        if tried.lr not in rates[1:] or not isinstance(tried.detail, str) or tried.step is not None:
            raise TypeError
    except TypeError:
        raise ResumeDamaged(
            f"{kept.path(BACKOFF_FILE)}: not the distillation backoff's record; pass --remove-stale to start over"
        ) from None
    return tried
