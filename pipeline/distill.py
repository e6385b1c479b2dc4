"""``mha2gqa convert --distill``: the conversion, then a short distillation, published as one DST.

The layer-wise refit fits each layer with the layers after it unseen; a few steps over the whole model
then take off much of what it leaves (docs/methods.md, "A short distillation after the refit"). This
composes the two stages the way a user would run them by hand (``mha2gqa convert``, then ``mha2gqa
uptrain --objective kd --teacher SRC --train attention --teacher-top-k 64 --data CALIBRATION``), in one
staged folder beside DST: the conversion goes to ``converted/`` in it, the distillation reads that and
writes ``distilled/`` in DST's resume folder (``.DST.mha2gqa-resume/``, with its checkpoints and the
teacher's cache, and the refit's finished layers), whose final model (with both records and the card)
becomes DST; nothing is published unless both finish, and a stopped run continues with ``--resume``.
The distillation trains the attention projections of every layer to the source's cached top-64
next-token distribution on the calibration text, ``--distill-batch`` (:data:`BATCH`) windows of the
calibration window a step at a constant learning rate. It holds the whole model in memory (the
conversion holds one layer), or, under a launcher with ``--sharding fsdp``, each process a shard of it
(``uptrain --sharding fsdp``): every process then takes its share of the statistics, the refit and
the distillation, and rank 0 alone writes, scores the stage guard and publishes.
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mha2gqa.convert.settings import ConvertSettings, calibration_window
from mha2gqa.core.devices import PRECISION_HELP, PRECISIONS
from mha2gqa.core.dims import max_positions
from mha2gqa.core.errors import SettingError
from mha2gqa.core.ranks import Ranks, launched, under_launcher
from mha2gqa.core.settings import check_switched, setting, validate
from mha2gqa.pipeline.backoff import Judge, distil_backing_off
from mha2gqa.uptrain.settings import SHARDING

#: windows a distillation step reads
BATCH = 2
#: --distill's learning rate, relative to each parameter's RMS (SmolLM2-135M's attention projections, RMS
#: 0.05-0.4, took an absolute 3e-4 well; docs/methods.md, "Steps sized to the model")
DISTILL_LR = 1.5e-3
#: teacher log-probabilities kept per token (the rest as one remainder)
TOP_K = 64
#: where the two stages write: the conversion inside the staged DST, the distillation (its run folder,
#: checkpoints and teacher cache) in DST's resume folder, so that a stopped run continues
CONVERTED, DISTILLED, TEACHER = "converted", "distilled", "teacher"
#: checkpoints a distillation writes over its steps (the newest kept): where --resume continues
DISTILL_CHECKPOINTS = 3


#: DistillSettings that say how a run is laid over its processes, not what it makes (a run stopped on
#: some processes may continue on others: the distillation's checkpoints re-shard)
LAYOUT = ("sharding",)


@dataclass(frozen=True)
class DistillSettings:
    """``convert --distill``: a short distillation after the conversion."""

    distill: bool = setting(
        False,
        help="After the conversion (and --refit), distil the converted model's attention projections "
        "from SRC's next-token distribution (its top 64) on the --calibration text: a short pass over "
        "the whole model (held in memory) that takes off much of what the layer-wise fit leaves; DST "
        "is the distilled model.",
    )
    distill_steps: int = setting(
        24,
        help="Steps of --distill (--distill-batch calibration windows each), at most: with the guard on, an "
        "earlier checkpoint (every third of the run) that the guard scores closer to SRC is published instead.",
        minimum=1,
    )
    distill_batch: int = setting(
        BATCH,
        help="Calibration windows a --distill step reads, over all processes (a multiple of their count).",
        minimum=1,
    )
    distill_lr: float = setting(
        DISTILL_LR,
        help="AdamW learning rate of --distill (constant), relative to each parameter's RMS (a step moves each "
        "weight by about this share of its typical size, whatever the model's scale).",
        above=0,
        maximum=1,
    )
    distill_precision: str = setting(
        "auto",
        help="Arithmetic of --distill's steps and teacher pass (the stage guard scores in float32): " + PRECISION_HELP,
        choices=PRECISIONS,
    )
    distill_backoff: bool = setting(
        True,
        help="Where the stage guard finds the distilled model no closer to SRC on its held-out windows, "
        "distil again from the converted model at a third of --distill-lr, then a ninth (a rate right for one "
        "model can wreck another). Off, or with --guard off: --distill-lr alone.",
    )
    sharding: str = setting(
        "none",
        help="Under a launcher (torchrun, accelerate launch), how --distill holds the model: none: every "
        "process the whole model (DDP); fsdp: parameters, gradients and optimizer state sharded per "
        "decoder layer across the processes (a model no one device holds). The conversion before it "
        "holds one layer either way.",
        choices=SHARDING,
        job=False,  # a job runs in one process
    )

    def check(self, convert: ConvertSettings) -> DistillSettings:
        """Every value checked, that the conversion gives the distillation its text, and that the
        processes can share it (before any work)."""
        validate(self)
        check_switched(self, "distill", "sharding")
        if self.distill and convert.calibration is None:
            raise SettingError("distill", "{name} distils on the calibration text: give --calibration")
        if self.distill and self.sharding == "fsdp" and not under_launcher():
            raise SettingError(
                "sharding",
                "{name} fsdp shards the distillation across processes: run under torchrun or accelerate launch",
            )
        if self.distill and self.distill_batch % (n := launched()):
            raise SettingError(
                "distill_batch",
                f"{{name}} {self.distill_batch} windows cannot be shared by {n} processes: give a multiple of {n}",
            )
        return self

    def recipe(self) -> dict[str, Any]:
        """The settings that shape the model (the recipe file, the resume fingerprint): not
        :data:`LAYOUT`, how a run lays it over its processes."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in LAYOUT}

    def reads(self, convert: ConvertSettings, positions: int | None) -> int:
        """Tokens the distillation reads of the calibration text: its steps' windows (0: it is off)."""
        window = calibration_window(convert.calibration_seq_len, positions)
        return self.distill_steps * self.distill_batch * window if self.distill else 0

    def arithmetic(self, convert: ConvertSettings) -> str:
        """``--distill-precision`` as this machine runs it (``auto``: bf16 here, float32 there): the resume
        fingerprint holds it, so that no run continues another arithmetic's checkpoint."""
        from mha2gqa.core.models import arithmetic

        return arithmetic(self.distill_precision, convert.device)

    def uptrain_settings(
        self, convert: ConvertSettings, teacher: str, output: Path, positions: int | None, tokens: int | None = None,
        data: str | None = None,
    ):  # fmt: skip
        """The ``mha2gqa uptrain`` settings of the distillation stage (``tokens``: the first tokens of
        the calibration text it may read, the stage guard's windows after them; None: all; ``data``: the
        text it reads, the ``--self-text`` mix, else ``--calibration``)."""
        from mha2gqa.uptrain.settings import UptrainSettings

        return UptrainSettings(
            data=str(data or convert.calibration),
            data_tokens=tokens,
            output=str(output),
            objective="kd",
            teacher=teacher,
            train="attention",
            teacher_top_k=TOP_K,
            teacher_cache=str(output.parent / TEACHER),
            seq_len=calibration_window(convert.calibration_seq_len, positions),
            batch_size=self.distill_batch,
            sharding=self.sharding,
            max_steps=self.distill_steps,
            lr=self.distill_lr,
            lr_relative=True,
            mixed_precision=self.distill_precision,
            min_lr_ratio=1.0,
            save_every=max(1, -(-self.distill_steps // DISTILL_CHECKPOINTS)),  # what --resume continues from
            save_total_limit=1,
            guard="off",  # the conversion's stage guard judges the distillation, on its own held-out windows
            resume=convert.resume,
            seed=convert.seed,
            device=convert.device,
            progress=convert.progress,
        )


def split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(convert's, distill's)`` keyword arguments of a ``convert`` command line."""
    names = {f.name for f in dataclasses.fields(DistillSettings)}
    return {k: v for k, v in options.items() if k not in names}, {k: v for k, v in options.items() if k in names}


@dataclass(frozen=True)
class Held:
    """What the stage guard holds of a distillation: it reads the calibration text's first ``tokens``
    (None: the guard is off, and so is the backoff), and ``judge`` scores its checkpoints (rank 0)."""

    tokens: int | None
    judge: Judge | None = None


def distil(student: Path, conversion, s: ConvertSettings, d: DistillSettings, out: Path, log, held: Held, team: Ranks):
    """The distillation of ``student`` into ``out`` (every process calls this), as the guard holds it
    (``held``); ``(its result, the backoff's Tried and the guard's score of the result, or None and
    None)``."""
    from mha2gqa.uptrain import uptrain

    tokens, judge = held.tokens, held.judge
    teacher = str(conversion.ckpt.folder)  # the very files converted (a hub id's resolved snapshot)
    positions = max_positions(conversion.ckpt.config)
    settings = d.uptrain_settings(s, teacher, out, positions, tokens, conversion.text)
    if tokens is not None:
        return distil_backing_off(student, settings, team, judge, log, d.distill_backoff)
    return uptrain(str(student), settings, log=log), None, None


def publish(stage: Path, distilled: Path | None, dst: Path, src: str, conversion) -> None:
    """The published model's files into ``stage`` itself, the conversion's folder removed: the
    ``distilled`` model (its uptraining record naming the model it started from as DST's conversion,
    not the staged folder), or, where the stage guard undid the distillation (None), the converted
    model; either with ``conversion`` (the conversion record, the guard's verdict on every stage in it)."""
    from mha2gqa.core.cards import model_card
    from mha2gqa.core.checkpoint import local_name, portable_model
    from mha2gqa.core.records import CONVERSION_RECORD, UPTRAIN_LOG
    from mha2gqa.core.uptrain_guard import DISTILL_STAGE
    from mha2gqa.uptrain.checkpoints import CHECKPOINTS
    from mha2gqa.uptrain.record import UptrainRecord

    if distilled is not None:
        folder = distilled
        record = UptrainRecord.read(folder)  # (its names portable already: the run wrote it)
        # the stages' paths are gone once published; how the run went (resumed or not) is not the recipe
        settings = {**record.settings, "output": local_name(dst)}
        settings.pop("resume", None)
        record = dataclasses.replace(record, student=portable_model(src), settings=settings, stage=DISTILL_STAGE)
        files = record.files(conversion, folder)
    else:
        folder = stage / CONVERTED
        files = {CONVERSION_RECORD: conversion.to_json(), "README.md": model_card(conversion)}
    for path in sorted(folder.iterdir()):
        if path.name not in (CHECKPOINTS, UPTRAIN_LOG, *files):
            path.rename(stage / path.name)
    for name, text in files.items():
        (stage / name).write_text(text, encoding="utf-8")
    shutil.rmtree(stage / CONVERTED, ignore_errors=True)  # (the distillation's run is in the resume folder)
