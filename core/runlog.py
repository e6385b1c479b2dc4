"""The JSON-lines run log (``uptrain_log.jsonl``): one record per line, written by the trainer and
read back by ``--resume`` and the report. Records (one frozen dataclass each, the JSON object's
``type`` names it): :class:`RunStart`, :class:`RunTrain`, :class:`RunEval`, :class:`RunResume`,
:class:`RunEnd`; :class:`RunHistory` is one run's log as read.

A run killed while writing leaves a torn last line; readers skip it with a warning, so such a run
can still be resumed and reported. Any other damage (a line that is not a record, a field of the
wrong type) is one error naming the file and the line."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from mha2gqa.core import typed
from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.output import replace_own_file
from mha2gqa.core.records import UPTRAIN_LOG

#: what a start record's ``settings`` (the run's identity, kept as a dict on purpose: every setting
#: of :class:`~mha2gqa.uptrain.settings.UptrainSettings` that shapes the run) must hold for the report
START_SETTINGS = {"objective": str, "train": str, "max_steps": int}


@dataclass(frozen=True)
class RunStart:
    """The run's opening record: what trains on what, with which settings, on which devices."""

    TYPE: ClassVar[str] = "start"
    created: str
    student: str
    teacher: str | None
    settings: dict[str, Any]
    windows: int
    tokens_per_step: int
    total_steps: int
    trainable_parameters: int
    parameters: int
    num_heads: int
    num_kv_heads: int
    processes: int
    device: str
    mixed_precision: str
    eval_seq_len: int | None = None

    def check(self, where: str) -> RunStart:
        """This record, its settings holding what the report reads (:data:`START_SETTINGS`)."""
        for name, kind in START_SETTINGS.items():
            if name not in self.settings:
                raise typed.RecordError(f"{where}.settings.{name} is missing")
            typed.value(kind, self.settings[name], f"{where}.settings.{name}")
        return self

    @property
    def objective(self) -> str:
        return self.settings["objective"]

    @property
    def train(self) -> str:
        """What trains (``all``, ``attention``, ``kv``, ``lora``...)."""
        return self.settings["train"]

    @property
    def max_steps(self) -> int:
        return self.settings["max_steps"]


@dataclass(frozen=True)
class RunTrain:
    """Averages over the steps since the previous train record (``parts``: the objective's terms,
    e.g. ``ce`` and ``kd``, written beside ``loss`` in the JSON object; ``peak_memory_mib``: each
    process's peak so far, in rank order)."""

    TYPE: ClassVar[str] = "train"
    step: int
    tokens: int
    epoch: float
    loss: float
    lr: float
    grad_norm: float | None
    tokens_per_second: float
    step_seconds: float | None = None
    peak_memory_mib: list[float] | None = None
    parts: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RunEval:
    """A held-out evaluation at ``step``: the student's perplexity, and with a teacher its perplexity,
    the ratio and the student's mean KL and top-1 agreement to it."""

    TYPE: ClassVar[str] = "eval"
    step: int
    tokens: int
    nll: float
    ppl: float
    eval_tokens: int
    seq_len: int | None = None
    teacher_ppl: float | None = None
    ppl_ratio: float | None = None
    kl_mean: float | None = None
    top1_agreement: float | None = None


@dataclass(frozen=True)
class RunResume:
    """The run went on from the checkpoint ``from_`` (``from`` in the JSON object) at ``step``."""

    TYPE: ClassVar[str] = "resume"
    step: int
    created: str
    from_: str


@dataclass(frozen=True)
class RunEnd:
    """The run finished all its steps and wrote its final model: the model of step ``published`` (the
    guard's choice: 0 is the student as given; None: the last step's), and the guard's ``guard`` line."""

    TYPE: ClassVar[str] = "end"
    step: int
    tokens: int
    created: str
    seconds: float
    published: int | None = None
    guard: str | None = None

    def check(self, where: str) -> RunEnd:
        """A step the run could have published: none after its last."""
        if self.published is not None and not 0 <= self.published <= self.step:
            raise typed.RecordError(f"{where}.published is {self.published}, not a step from 0 to {self.step}")
        return self


LogRecord = RunStart | RunTrain | RunEval | RunResume | RunEnd
#: fields that are finite numbers whenever present (a training loss that was not is refused as the run
#: happens, so a log holding one was damaged), and of those the ones that are positive too
_FINITE = {"train": ("loss",), "eval": ("nll", "ppl", "teacher_ppl", "ppl_ratio", "kl_mean")}
_POSITIVE = {"ppl", "teacher_ppl", "ppl_ratio"}
RECORD_TYPES: dict[str, type] = {cls.TYPE: cls for cls in (RunStart, RunTrain, RunEval, RunResume, RunEnd)}
#: JSON keys that are Python keywords, and back
_RENAMED = {"from": "from_"}
_JSON_KEYS = {v: k for k, v in _RENAMED.items()}
#: fields left out of a record's JSON when None (a run without the guard writes its end as before it)
_UNSET = ("published", "guard")


def to_json(record: LogRecord) -> dict[str, Any]:
    """The JSON object of ``record``: ``type`` first, a train record's parts beside its loss."""
    data = dataclasses.asdict(record)
    parts = data.pop("parts", {})
    data = {_JSON_KEYS.get(k, k): v for k, v in data.items() if not (k in _UNSET and v is None)}
    return {"type": record.TYPE, **data, **parts}


def from_json(data: Any, where: str) -> LogRecord:
    """The record of the JSON object ``data``; raises :class:`~mha2gqa.core.typed.RecordError`
    naming ``where`` and the field when it is not a record of a known type."""
    if not isinstance(data, dict):
        raise typed.RecordError(f"{where} is not an object")
    kind = data.get("type")
    cls = RECORD_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise typed.RecordError(f"{where}.type {data.get('type')!r:.40} is not one of {', '.join(RECORD_TYPES)}")
    data = {_RENAMED.get(k, k): v for k, v in data.items()}
    if cls is RunTrain:
        known = {f.name for f in dataclasses.fields(RunTrain)} | {"type"}
        data["parts"] = {k: v for k, v in data.items() if k not in known}
    where = f"{where} ({cls.TYPE})"
    record = typed.read(cls, data, where)
    if isinstance(record, (RunStart, RunEnd)):
        return record.check(where)
    for name in _FINITE.get(cls.TYPE, ()):  # a number the run could not have written: tampered or damaged
        value = getattr(record, name)
        if value is not None and not (math.isfinite(value) and (value > 0 or name not in _POSITIVE)):
            raise typed.RecordError(
                f"{where}.{name} is {value}, not a {'positive' if name in _POSITIVE else 'finite'} number"
            )
    return record


class RunLog:
    """Appends records to the log at ``path`` (only where ``enabled``: the main process).

    ``keep_until_step``: a resumed run keeps the records up to its checkpoint's step and drops the
    rest; ``None`` starts a fresh log."""

    def __init__(self, path: Path, enabled: bool = True, keep_until_step: int | None = None) -> None:
        self.path, self.enabled = Path(path), enabled
        if not enabled:
            return
        if keep_until_step is not None and self.path.is_file():
            kept = [r for r in read_log(self.path) if getattr(r, "step", 0) <= keep_until_step]
            replace_own_file(self.path, "".join(json.dumps(to_json(r)) + "\n" for r in kept))
        else:
            self.path.unlink(missing_ok=True)

    def write(self, record: LogRecord) -> None:
        if self.enabled:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(to_json(record)) + "\n")


def read_log(path: Path) -> list[LogRecord]:
    """The records of a run log (or of the one in a run folder). A torn last line (a run killed
    mid-write) is skipped with a warning; damage anywhere else is one error naming the file."""
    path = Path(path)
    if path.is_dir():
        path = path / UPTRAIN_LOG
    try:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise Mha2GqaError(f"{path}: cannot read the run log ({e})") from None
    records = []
    for i, line in enumerate(lines):
        try:
            data = json.loads(line)
        except ValueError as e:
            if i == len(lines) - 1:
                warnings.warn(f"{path}: ignoring a torn last line (a run stopped while writing it)", stacklevel=2)
                break
            raise Mha2GqaError(f"{path}: line {i + 1} is not a log record ({e}); the log is damaged") from None
        try:
            records.append(from_json(data, f"line {i + 1}"))
        except typed.RecordError as e:
            raise Mha2GqaError(f"{path}: {e}; the log is damaged") from None
    return records


@dataclass(frozen=True)
class RunHistory:
    """One uptraining run as its log tells it; ``label``: the run folder's name."""

    label: str
    records: tuple[LogRecord, ...]

    @classmethod
    def read(cls, path: Path) -> RunHistory:
        """The run whose log is ``path`` (``uptrain_log.jsonl`` or the run folder holding one)."""
        records = read_log(Path(path))
        if not records or not isinstance(records[0], RunStart):
            raise Mha2GqaError(f"{path}: not a log of `mha2gqa uptrain` (no start record)")
        folder = Path(path) if Path(path).is_dir() else Path(path).parent
        return cls(folder.resolve().name, tuple(records))

    @property
    def start(self) -> RunStart:
        return self.records[0]  # type: ignore[return-value]  # read() checks it

    @property
    def evals(self) -> list[RunEval]:
        return [r for r in self.records if isinstance(r, RunEval)]

    @property
    def end(self) -> RunEnd | None:
        """The record of the finished run (None: it has not finished)."""
        return next((r for r in self.records if isinstance(r, RunEnd)), None)

    @property
    def trains(self) -> list[RunTrain]:
        return [r for r in self.records if isinstance(r, RunTrain)]

    @property
    def steps(self) -> int:
        """The last step the log reached."""
        return max((getattr(r, "step", 0) for r in self.records), default=0)
