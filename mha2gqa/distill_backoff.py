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

A run stopped during a later try (``--resume``) goes on with that try, read back from
:data:`BACKOFF_FILE` in the resume folder."""

from __future__ import annotations

import dataclasses
import json
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
    detail: str = ""  # e.g. "--distill-lr 0.0015: KL 0.43, not below KL 0.41; --distill-lr 0.0005: KL 0.4, kept"


def distil_backing_off(student: Path, settings, team: Ranks, judge: Judge | None, log):
    """The distillation ``settings`` (``UptrainSettings``) of ``student``, run again at each rate of
    :data:`BACKOFF` in turn while the guard finds it no closer to SRC; every process calls this,
    ``judge`` given on rank 0. ``(the uptraining result of the last try, its Tried, its GuardScore
    (rank 0))``."""
    from mha2gqa.uptrain import uptrain

    out, kept = Path(settings.output), ResumeFolder(Path(settings.output).parent)
    rates = [settings.lr * factor for factor in BACKOFF]
    held = team.decide(lambda: _read(kept, rates)) if settings.resume and kept.has(BACKOFF_FILE) else None
    tried = held or Tried(rates[0])
    start = rates.index(tried.lr)
    for i in range(start, len(rates)):
        resume = settings.resume and i == start  # a later try starts afresh in the emptied folder
        result = uptrain(str(student), dataclasses.replace(settings, lr=rates[i], resume=resume), log=log)
        nxt = rates[i + 1] if i + 1 < len(rates) else None
        tried, score, done = team.decide(partial(_check, out, tried, nxt, judge, kept, log))
        if done:
            return result, tried, score
    raise AssertionError("the last rate always ends the backoff")


def _check(out: Path, tried: Tried, nxt: float | None, judge: Judge, kept: ResumeFolder, log):
    """Rank 0: score the distillation at ``tried.lr`` in ``out``; ``(Tried, its score, whether the
    backoff ends: it lowered the KL, or no rate ``nxt`` is left)``. Where it goes on, ``out`` is emptied,
    then the next try written down."""
    score = judge.score(out)
    helped = score.loss < judge.before.loss
    if helped or nxt is None:
        end = f"--distill-lr {tried.lr:.3g}: {score}, " + ("kept" if helped else "not below either")
        return Tried(tried.lr, f"{tried.detail}; {end}" if tried.detail else ""), score, True
    line = f"--distill-lr {tried.lr:.3g}: {score}, not below {judge.before}"
    log(f"distill: {line}: again at a third of the rate")
    following = Tried(nxt, f"{tried.detail}; {line}" if tried.detail else line)
    shutil.rmtree(out, ignore_errors=True)  # first: a stop in between reruns this try, never resumes it as the next
    kept.write_bytes(BACKOFF_FILE, json.dumps(dataclasses.asdict(following)).encode())
    return following, score, False


def _read(kept: ResumeFolder, rates: list[float]) -> Tried:
    """The try in progress of the stopped run, one of ``rates`` (refused in one line if damaged)."""
    held = kept.read_json(BACKOFF_FILE)
    try:
        tried = Tried(**held)
        if tried.lr not in rates[1:] or not isinstance(tried.detail, str):
            raise TypeError
    except TypeError:
        raise ResumeDamaged(
            f"{kept.path(BACKOFF_FILE)}: not the distillation backoff's record; pass --remove-stale to start over"
        ) from None
    return tried
