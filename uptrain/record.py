"""``mha2gqa_uptrain.json``: what an uptraining run did, written into the final model and every
checkpoint, and the model card rendered from it (the conversion's card follows, from its record)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mha2gqa.core import typed
from mha2gqa.core.cards import front_matter, model_card
from mha2gqa.core.checkpoint import hub_id, local_name, portable_model
from mha2gqa.core.conversion_record import ConversionRecord
from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.records import UPTRAIN_RECORD, now, version
from mha2gqa.core.runlog import RunEval
from mha2gqa.core.text_ref import TextRef, portable_name
from mha2gqa.core.uptrain_guard import UptrainGuard, checked, checked_stage

UPTRAIN_SCHEMA = "mha2gqa.uptrain/1"
#: settings that name a text or a model: a published record names them portably (:meth:`UptrainRecord.portable`)
_TEXTS, _MODELS = ("data", "eval_data"), ("teacher",)


def portable_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """An uptraining's settings as a published model carries them (its record, its run log): the texts by
    file name, the teacher by name (``./NAME`` or a hub id), the output as ``./NAME``, the teacher's cache
    (a folder of this machine) dropped."""
    s = dict(settings)
    for key in _TEXTS:
        if isinstance(s.get(key), str):
            s[key] = portable_name(s[key])
    for key in _MODELS:
        if isinstance(s.get(key), str):
            s[key] = portable_model(s[key])
    if isinstance(s.get("output"), str):
        s["output"] = local_name(s["output"])
    s["teacher_cache"] = None
    return s


@dataclass(frozen=True)
class UptrainRecord:
    """One uptraining run up to ``steps``: the student, the run's settings (the ``--resume`` identity),
    what was trained, and the first and last held-out evaluations (log records). In a published model,
    ``steps`` is the step of the model ``guard`` chose (0: the student as given), not the run's last."""

    student: str
    settings: dict[str, Any]
    steps: int
    tokens: int
    warmup_steps: int
    trainable_parameters: int
    processes: int
    mixed_precision: str
    first_eval: RunEval | None = None
    last_eval: RunEval | None = None
    guard: UptrainGuard | None = None  # --guard's decision that published this model (None: off, unmeasured)
    #: the training text (``--data``) by file name, sha256 and line sketch (None: a record before it)
    text: TextRef | None = None
    #: :data:`~mha2gqa.core.uptrain_guard.DISTILL_STAGE` where the run was ``convert --distill``'s own
    stage: str | None = None
    mha2gqa_version: str = dataclasses.field(default_factory=version)
    created: str = dataclasses.field(default_factory=now)
    schema: str = UPTRAIN_SCHEMA

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        head = {k: data.pop(k) for k in ("schema", "mha2gqa_version", "created")}
        return {"schema": head["schema"], "uptrain": data, **{k: head[k] for k in ("mha2gqa_version", "created")}}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: Any, where: str) -> UptrainRecord:
        """Read a record; a damaged or foreign one raises one error naming ``where`` and the field."""
        if not isinstance(data, dict) or not isinstance(data.get("uptrain"), dict):
            raise Mha2GqaError(f"{where}: not an uptraining record (no 'uptrain' object)")
        if data.get("schema", UPTRAIN_SCHEMA) != UPTRAIN_SCHEMA:
            raise Mha2GqaError(f"{where}: schema {data.get('schema')!r} is not {UPTRAIN_SCHEMA}")
        flat = {**data["uptrain"], **{k: data[k] for k in ("mha2gqa_version", "created", "schema") if k in data}}
        try:
            record = typed.read(cls, flat, "uptrain")
        except typed.RecordError as e:
            raise Mha2GqaError(f"{where}: damaged uptraining record ({e})") from None
        checked(record.guard, where)
        checked_stage(record.stage, where)
        return record

    def portable(self, text_field: str = "text") -> UptrainRecord:
        """This record as a published model carries it: the student, the teacher and the output by name
        (``./NAME`` for a local folder, a hub id as given), the texts by file name, the teacher's cache (a
        folder of this machine) dropped, and the training text's sha256 and line sketch (so ``eval`` can
        still tell it trained on the text it scores, on any machine)."""
        data = self.settings.get("data")
        text = self.text or (training_text_ref(data, text_field) if isinstance(data, str) else None)
        s = portable_settings(self.settings)
        return dataclasses.replace(self, student=portable_model(self.student), settings=s, text=text)

    @classmethod
    def read(cls, folder: Path) -> UptrainRecord:
        path = Path(folder) / UPTRAIN_RECORD
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise Mha2GqaError(f"{path}: not readable JSON ({e})") from None
        return cls.from_dict(data, str(path))

    def files(self, conversion: ConversionRecord | None, student_folder: Path) -> dict[str, str]:
        """What travels with the uptrained model (and each checkpoint): this record, the model card,
        the conversion record, and a per-layer student's modeling file."""
        from mha2gqa.core.per_layer import MODELING_FILE
        from mha2gqa.core.records import CONVERSION_RECORD

        files = {UPTRAIN_RECORD: self.to_json(), "README.md": self.card(conversion)}
        if conversion:
            files[CONVERSION_RECORD] = conversion.to_json()
        modeling = Path(student_folder) / MODELING_FILE
        if modeling.is_file():  # a per-layer student: its class travels with the weights
            files[MODELING_FILE] = modeling.read_text(encoding="utf-8")
        return files

    def card(self, conversion: ConversionRecord | None) -> str:
        """The model card (README.md) of the uptrained model: the uptraining, then the conversion."""
        base, s = Path(self.student).name, self.settings
        origin = conversion.source.repo_id if conversion else None  # the MHA model it comes from
        student = None if Path(self.student).expanduser().exists() else hub_id(self.student)  # ./NAME: none
        teacher = f" (teacher `{Path(s['teacher']).name}`)" if s.get("teacher") else ""
        rows = [
            ("student", f"`{base}`"),
            ("objective", s["objective"] + teacher),
            ("trained", f"{s['train']} ({self.trainable_parameters:,} parameters)"),
            ("steps", f"{self.steps:,} × batch {s['batch_size']} × {s['seq_len']} tokens = {self.tokens:,} tokens"),
            (
                "optimizer",
                f"AdamW lr {s['lr']:g}{' × each parameter’s RMS' if s.get('lr_relative') else ''}, "
                f"warm-up {self.warmup_steps}, cosine to {s['min_lr_ratio']:g}× lr",
            ),
            ("data", f"`{portable_name(s['data'])}`"),
        ]
        if ev := self.last_eval:
            held = f"the last tokens of `{portable_name(s['data'])}` (held out)"
            text = f"`{portable_name(s['eval_data'])}`" if s.get("eval_data") else held
            line = f"perplexity {ev.ppl:.4f} on {text} ({ev.eval_tokens:,} tokens)"
            if ev.ppl_ratio is not None:
                line += f", ×{ev.ppl_ratio:.3f} the teacher, KL {ev.kl_mean:.4f}"
            rows.append(("held-out", line))
        if self.guard is not None:
            rows.append(("guard", self.guard.line()))
        table = "\n".join(f"| {k} | {v} |" for k, v in rows)
        distilled = ("converted and distilled", "`mha2gqa convert --distill`")
        done, how = distilled if self.stage else ("uptrained", "`mha2gqa uptrain`")
        text = (
            front_matter(origin or student, ["distilled" if self.stage else "uptrained"])
            + f"# {base}, {done}\n\nA grouped-query-attention model {done} with {how}.\n\n"
            f"| setting | value |\n|---|---|\n{table}\n\nExact settings and evaluations: `{UPTRAIN_RECORD}`.\n"
        )
        if conversion:
            body = model_card(conversion).split("---\n", 2)[2]
            text += "\n## Conversion\n" + body.replace("\n# ", "\n### ", 1)
        return text


def training_text_ref(data: str, text_field: str = "text") -> TextRef | None:
    """The training text's reference (None where it cannot be read any more: the record still names it)."""
    from mha2gqa.core.text_ref import text_ref

    try:
        return text_ref(data, text_field)
    except (Mha2GqaError, OSError):
        return None
