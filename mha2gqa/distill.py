"""``mha2gqa convert --distill``: the conversion, then a short distillation, published as one DST.

The layer-wise refit fits each layer with the layers after it unseen; a few steps over the whole model
then take off much of what it leaves (docs/methods.md, "A short distillation after the refit"). This
composes the two stages the way a user would run them by hand (``mha2gqa convert``, then ``mha2gqa
uptrain --objective kd --teacher SRC --train attention --teacher-top-k 64 --data CALIBRATION``), in one
staged folder beside DST: the conversion goes to ``converted/`` in it, the distillation reads that and
writes ``distilled/``, whose final model (with both records and the card) becomes DST; nothing is
published unless both finish. The distillation trains the attention projections of every layer to the
source's cached top-64 next-token distribution on the calibration text, :data:`BATCH` windows of the
calibration window a step at a constant learning rate. It holds the whole model in memory (the
conversion holds one layer).
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mha2gqa.convert.settings import ConvertSettings, calibration_window
from mha2gqa.core.errors import SettingError
from mha2gqa.core.settings import check_switched, setting, validate

#: windows a distillation step reads
BATCH = 2
#: teacher log-probabilities kept per token (the rest as one remainder)
TOP_K = 64
#: where the two stages write inside the staged DST
CONVERTED, DISTILLED = "converted", "distilled"


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
    distill_steps: int = setting(24, help=f"Steps of --distill ({BATCH} calibration windows each).", minimum=1)
    distill_lr: float = setting(3e-4, help="AdamW learning rate of --distill (constant).", above=0, maximum=1)

    def check(self, convert: ConvertSettings) -> DistillSettings:
        """Every value checked, and that the conversion gives the distillation its text."""
        validate(self)
        check_switched(self, "distill")
        if self.distill and convert.calibration is None:
            raise SettingError("distill", "{name} distils on the calibration text: give --calibration")
        return self

    def uptrain_settings(self, convert: ConvertSettings, teacher: str, output: Path, positions: int | None):
        """The ``mha2gqa uptrain`` settings of the distillation stage."""
        from mha2gqa.uptrain.settings import UptrainSettings

        return UptrainSettings(
            data=str(convert.calibration),
            output=str(output),
            objective="kd",
            teacher=teacher,
            train="attention",
            teacher_top_k=TOP_K,
            teacher_cache=str(output.parent / "teacher"),
            seq_len=calibration_window(convert.calibration_seq_len, positions),
            batch_size=BATCH,
            max_steps=self.distill_steps,
            lr=self.distill_lr,
            min_lr_ratio=1.0,
            save_every=self.distill_steps + 1,  # no checkpoints: the run is short, and staged
            seed=convert.seed,
            device=convert.device,
            progress=convert.progress,
        )


def split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(convert's, distill's)`` keyword arguments of a ``convert`` command line."""
    names = {f.name for f in dataclasses.fields(DistillSettings)}
    return {k: v for k, v in options.items() if k not in names}, {k: v for k, v in options.items() if k in names}


def convert_and_distill(src: str, dst: Path, s: ConvertSettings, d: DistillSettings, log: Callable[[str], None]):
    """Convert ``src`` as ``s`` says, distil the result as ``d`` says, and publish the distilled model
    as ``dst``; returns ``(conversion result, uptraining result)``. Settings and destination are
    checked before any work; a failure or a stop leaves ``dst`` as it was."""
    from mha2gqa.convert.converter import run
    from mha2gqa.convert.prepare import inputs_of, prepare
    from mha2gqa.core.output import staged_output
    from mha2gqa.core.signals import Terminated

    d = d.check(s)
    conversion = s if s.reads_calibration else dataclasses.replace(s, calibration=None)  # the text is ours
    first = prepare(src, dst, conversion)  # every check of the settings, the source and DST, before any work
    with staged_output(Path(dst), s.overwrite, inputs_of(first.ckpt, s), remove_stale=s.remove_stale) as stage:
        converted = run(dataclasses.replace(first, dst=stage / CONVERTED))
        try:
            distilled = _distil(converted.output, first, s, d, stage / DISTILLED, log)
        except Terminated as e:  # the staged run goes with the stage: nothing to --resume
            e.kept = None
            raise
        _publish(stage, Path(dst), src)
    return dataclasses.replace(converted, output=Path(dst)), dataclasses.replace(distilled, output=Path(dst))


def _distil(student: Path, conversion, s: ConvertSettings, d: DistillSettings, out: Path, log):
    from mha2gqa.uptrain import uptrain

    teacher = str(conversion.ckpt.folder)  # the very files converted (a hub id's resolved snapshot)
    positions = conversion.ckpt.config.get("max_position_embeddings")
    return uptrain(str(student), d.uptrain_settings(s, teacher, out, positions), log=log)


def _publish(stage: Path, dst: Path, src: str) -> None:
    """The distilled model's files into ``stage`` itself (its uptraining record naming the model it
    started from as DST's conversion, not the staged folder), the stages' folders removed."""
    from mha2gqa.core.conversion_record import read_conversion_record
    from mha2gqa.core.records import UPTRAIN_LOG
    from mha2gqa.uptrain.checkpoints import CHECKPOINTS
    from mha2gqa.uptrain.record import UptrainRecord

    distilled = stage / DISTILLED
    record = UptrainRecord.read(distilled)
    staged = {"output": str(dst), "teacher_cache": None}  # the staged paths are gone once published
    record = dataclasses.replace(
        record, student=f"{src} converted (this model before --distill)", settings={**record.settings, **staged}
    )
    files = record.files(read_conversion_record(distilled), distilled)
    for path in sorted(distilled.iterdir()):
        if path.name not in (CHECKPOINTS, UPTRAIN_LOG, *files):
            path.rename(stage / path.name)
    for name, text in files.items():
        (stage / name).write_text(text, encoding="utf-8")
    for name in (CONVERTED, DISTILLED, "teacher"):
        shutil.rmtree(stage / name, ignore_errors=True)
