"""``convert --distill``'s learning-rate probe: the rate the distillation goes on with, chosen on the model.

``--distill-lr`` is relative to each weight's RMS, so the same model written differently takes the same
steps; but the share of its size a weight should move differs between models (SmolLM2-135M took
1.5e-3 well; a rate that is too high for a model wrecks it within a few steps, and one too low wastes
the run). So the first sixth of the steps (:data:`PROBE_SHARE`) runs once at ``--distill-lr`` times each
factor of :data:`PROBE`, each from the converted model on the same windows, and the stage guard scores
each short run's model on its held-out windows (the converted model's next-token KL to the original);
the run with the lowest KL goes on to the end (its steps are kept: a probe run stops at a checkpoint
and the distillation resumes from it), the others are dropped. Extra cost: the other rates' probe
steps (a third of the run at the defaults) and three scorings.

A run stopped after the probe (``--resume``) goes on at the rate chosen, read back from
:data:`PROBE_FILE` in the resume folder; one stopped during it probes again."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mha2gqa.core.conversion_record import GuardScore
from mha2gqa.core.ranks import Ranks
from mha2gqa.core.resume import ResumeDamaged, ResumeFolder

#: the factors of --distill-lr the probe tries (its middle one the rate as given)
PROBE = (1 / 3, 1.0, 3.0)
#: the probe runs the first 1/PROBE_SHARE of the steps at each rate
PROBE_SHARE = 6
#: the probe's outcome, in the resume folder: a resumed run goes on at the rate it chose
PROBE_FILE = "distill-probe.json"

#: scores the models in the folders given on the guard's held-out windows (rank 0)
Scorer = Callable[[Sequence[Path]], list[GuardScore]]


@dataclass(frozen=True)
class Probed:
    """The probe's choice: the relative rate the distillation goes on with, and what it measured."""

    lr: float
    detail: str  # e.g. "--distill-lr 0.0015 chosen of 0.0005: KL 0.41, ..." (the guard's distill line)


def probe_steps(max_steps: int) -> int:
    """Steps each probed rate runs (0: the run is too short to probe and still go on)."""
    steps = max(1, max_steps // PROBE_SHARE)
    return steps if steps < max_steps else 0


def probe_rate(student: Path, settings, team: Ranks, score: Scorer | None, log) -> Probed | None:
    """Run the probe of the distillation ``settings`` (``UptrainSettings``; its output the distillation's
    folder, which ends up holding the chosen run at its last probe step) on ``student``; every process
    calls this, ``score`` given on rank 0. None: the run is too short to probe."""
    from mha2gqa.uptrain import uptrain
    from mha2gqa.uptrain.checkpoints import checkpoint_dirs

    out = Path(settings.output)
    steps = probe_steps(settings.max_steps)
    if not steps:
        return None
    kept = ResumeFolder(out.parent)
    if settings.resume and out.is_dir() and checkpoint_dirs(out):  # stopped after the probe
        return team.decide(lambda: _read(kept))
    rates = [settings.lr * factor for factor in PROBE]
    folders = [out.with_name(f"{out.name}-probe-{i}") for i in range(len(rates))]
    team.decide(lambda: _clear([out, *folders]))
    for rate, folder in zip(rates, folders, strict=True):
        log(f"distill probe: --distill-lr {rate:.3g} for {steps} of {settings.max_steps} steps")
        run = dataclasses.replace(settings, output=str(folder), lr=rate, stop_after=steps, resume=False)
        uptrain(str(student), run, log=log)
    return team.decide(lambda: _choose(out, folders, rates, steps, score, kept, log))


def _choose(out: Path, folders: list[Path], rates: list[float], steps: int, score: Scorer, kept, log) -> Probed:
    """Rank 0: score each probe run's model, keep the best as the distillation's folder ``out``."""
    from mha2gqa.uptrain.checkpoints import checkpoint_dirs

    scores = score([checkpoint_dirs(folder)[-1][1] for folder in folders])
    best = min(range(len(rates)), key=lambda i: (scores[i].loss, abs(PROBE[i] - 1.0)))
    figures = "; ".join(f"{rate:.3g}: {s}" for rate, s in zip(rates, scores, strict=True))
    probed = Probed(rates[best], f"--distill-lr {rates[best]:.3g} chosen after {steps} steps at each rate: {figures}")
    kept.write_bytes(PROBE_FILE, json.dumps(dataclasses.asdict(probed)).encode())
    folders[best].rename(out)
    _clear(folders)
    log(f"distill probe: {probed.detail}")
    return probed


def _read(kept: ResumeFolder) -> Probed:
    """The probe's choice of the stopped run (refused in one line if damaged)."""
    held = kept.read_json(PROBE_FILE) if kept.has(PROBE_FILE) else None
    try:
        probed = Probed(**held)
        if not (isinstance(probed.lr, float) and 0 < probed.lr < math.inf and isinstance(probed.detail, str)):
            raise TypeError
    except TypeError:
        raise ResumeDamaged(
            f"{kept.path(PROBE_FILE)}: not the distillation probe's choice; pass --remove-stale to start over"
        ) from None
    return probed


def _clear(folders: Sequence[Path]) -> None:
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
