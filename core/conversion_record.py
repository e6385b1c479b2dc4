"""The conversion record (``mha2gqa_conversion.json``), typed: what ``convert`` wrote into a converted
model, read back by the model card, ``eval`` (which model it came from, how its heads were grouped)
and ``uptrain`` (which carries it along). The one place that knows the record's keys.

Schema ``mha2gqa.conversion/1``; records written before the tag existed read as that version.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from mha2gqa.core import typed
from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.records import CONVERSION_RECORD, read_record_json
from mha2gqa.core.text_ref import TextRef

CONVERSION_SCHEMA = "mha2gqa.conversion/1"


#: Per-layer counts a recipe name lists one by one (more: their average).
RECIPE_LAYERS = 8


@dataclass(frozen=True)
class OwnText:
    """``--self-text``: the text the source model wrote itself (seeded sampling), mixed into the user's
    calibration text for every stage: the share asked and the share the mix has (by characters), the
    written tokens and documents, the sampling, and the sha256 of the written text and of the mix."""

    share: float
    mixed_share: float
    tokens: int
    documents: int
    seed: int
    temperature: float
    top_p: float
    sha256: str
    mix_sha256: str

    def line(self) -> str:
        """In words: how much of the calibration text the model wrote, and how."""
        return (
            f"{self.mixed_share:.0%} of it written by the model itself ({self.tokens:,} tokens in "
            f"{self.documents:,} documents; seed {self.seed}, temperature {self.temperature:g}, top-p "
            f"{self.top_p:g}; sha256 {self.sha256[:16]})"
        )


@dataclass(frozen=True)
class Calibration:
    """What a calibrated method read (``data`` None: from the weights alone): the text by its
    portable name (a file's name, never its path), with its sha256 and line sketch in ``text``; with
    ``--self-text``, what the model wrote into it (``own``): the stages then read the mix."""

    data: str | None
    tokens: int
    rotary_dim: int | None = None
    weights_only: bool = False
    text: TextRef | None = None
    own: OwnText | None = None


@dataclass(frozen=True)
class Retargeted:
    """The class a classic MHA source was re-expressed in (exact at the same head count)."""

    source_class: str
    target_class: str
    definition: str
    description: str


@dataclass(frozen=True)
class Allocation:
    """``--per-layer auto``: the budget, every layer's cost of every count, the choice."""

    budget_kv_heads: int
    average_kv_heads: float
    chosen: list[int]
    cost: float
    uniform_cost: dict[str, float]
    cost_measure: str
    costs: dict[str, dict[str, float]]


#: :attr:`Refit.error` of records written before loud dimensions were scaled (their default)
ABSOLUTE_ERROR = "mean squared error"
#: :attr:`Refit.error` of records written from 2026-11-26 to 2026-11-28: squared error over max(the
#: dimension's mean square, the average one)
LOUD_SCALED_ERROR = "mean squared error, each hidden dimension louder than average relative to its size"
#: :attr:`Refit.error` now: the squared error of each token's stream over its root mean square, as a
#: norm reads it (:mod:`mha2gqa.convert.refit.objective`)
NORMALIZED_ERROR = "mean squared error of each token's stream over its root mean square"
#: :attr:`Refit.target` of records written before the target could be the residual stream after attention
LAYER_TARGET = "layer output"
#: :attr:`Refit.target` where the layer reads its input only through the stream after attention
ATTENTION_TARGET = "residual stream after attention"
#: how a log or card says a layer's output projection was solved in closed form (:attr:`RefitLayer.o_ridge`)
O_SOLVED = "o_proj solved in closed form"


@dataclass(frozen=True)
class RefitLayer:
    """One layer's refit: held-out error of its output against the original layer's (as
    :attr:`Refit.error` says), at the start (the merge) and at the end; ``kept``: the refit did not
    lower it, so the layer kept its starting weights."""

    layer: int
    loss_before: float
    loss_after: float
    kept: bool
    steps: int
    seconds: float
    #: the ridge of the closed-form output projection that replaced the Adam fit's (None: not replaced)
    o_ridge: float | None = None
    #: the learning rate (relative to each projection's RMS) the fit went on with, of those it probed
    lr: float | None = None


#: what a layer becomes (:attr:`LayerPlan.how`): a byte copy (its count kept); its K/V heads pooled by the
#: method's reducer; its K/V heads drawn anew; its q/k/v/o rewritten together (a layer method, or heads regrouped)
COPY, POOL, FRESH, REWRITE = "copy", "pool", "fresh", "rewrite"


@dataclass(frozen=True)
class LayerPlan:
    """What one decoder layer becomes, decided after calibration and before any tensor is written
    (:func:`mha2gqa.convert.plan.layer_plans`); the stages read it, none decides it again."""

    layer: int
    kv_heads_before: int
    kv_heads_after: int
    how: Literal["copy", "pool", "fresh", "rewrite"]  # COPY, POOL, FRESH or REWRITE
    #: the source KV heads in the grouping's order (each run of ``before // after`` is one new KV
    #: head's group); None: in their own order
    permutation: tuple[int, ...] | None = None
    #: the projections ``--refit`` fits in this layer (empty: none)
    refit: tuple[str, ...] = ()
    #: what the fit reproduces, as asked (``attention``: the stream after attention, where the layer
    #: reads its input only through it; else its output); None: no refit
    refit_target: str | None = None
    #: the output projection gets its closed-form solve after the fit
    solve_output: bool = False

    def record_problem(self) -> str | None:
        """What a read-back plan says that no conversion could have planned (None: nothing)."""
        before, after = self.kv_heads_before, self.kv_heads_after
        if self.layer < 0 or after < 1 or before < after or before % after:
            return f"has {before} -> {after} KV heads at layer {self.layer}: not a layer's merge"
        if self.permutation is not None and sorted(self.permutation) != list(range(before)):
            return f"has permutation {list(self.permutation)!r:.60}: not an order of the layer's {before} KV heads"
        return None

    @property
    def changed(self) -> bool:
        """The layer's KV-head count changes (else it is a byte copy)."""
        return self.kv_heads_after != self.kv_heads_before

    @property
    def regrouped(self) -> bool:
        """Its heads are taken in another order than their own (q and o move with them)."""
        return self.permutation is not None and list(self.permutation) != sorted(self.permutation)


@dataclass(frozen=True)
class Refit:
    """``--refit``: every changed layer's projections fitted to reproduce the original layer's output
    on the converted model's own hidden states (:mod:`mha2gqa.convert.refit`)."""

    data: str
    tokens: int
    windows: int
    heldout_windows: int
    steps: int
    lr: float
    batch: int
    params: list[str]
    seed: int
    layers: list[RefitLayer]
    error: str = ABSOLUTE_ERROR
    #: what the error is measured on: :data:`LAYER_TARGET` or :data:`ATTENTION_TARGET`
    target: str = LAYER_TARGET
    #: the arithmetic of its calibration pass and Adam steps: ``bf16`` (autocast) or ``no`` (float32;
    #: records before the choice; before 2026-11-28's evening ``bf16`` was the steps only)
    precision: str = "no"
    #: the text ``data`` names (sha256, line sketch); None in records before portable names
    text: TextRef | None = None


@dataclass(frozen=True)
class SourceScore:
    """A model's next-token agreement with the original on the windows of one further held-out text
    (``convert --guard-data``)."""

    name: str  # the text, named portably (a file's name)
    kl: float | None
    top1: float

    @property
    def loss(self) -> float:
        return math.inf if self.kl is None else self.kl


#: how much a stage may raise the KL of a further held-out text (``--guard-data``), as a share of that
#: text's KL before the stage, and still be kept: a stage that lowers the calibration text's KL and
#: raises another's by less is taken as making no text worse. Not zero, because a held-out sample of
#: :data:`~mha2gqa.convert.settings.GUARD_WINDOWS` windows moves by about that much between stages that
#: do nothing to its kind of text (and a zero tolerance would undo a refit that takes the calibration
#: text's KL from x2 to x1.1 for a 0.1% rise elsewhere); not more, so that a stage that trades the
#: served text for the calibration text is undone.
SOURCE_TOLERANCE = 0.01


@dataclass(frozen=True)
class GuardScore:
    """A model's next-token agreement with the original on the guard's held-out windows: the
    calibration text's (``kl``, ``top1``) and each further held-out text's (``sources``, None without
    ``--guard-data``)."""

    kl: float | None  # mean per-token KL(original || model), nats; None: not finite (the model overflowed)
    top1: float  # share of tokens whose most likely next token is the original's
    sources: list[SourceScore] | None = None

    @property
    def loss(self) -> float:
        """The KL, infinite where it was not finite: what the guard compares."""
        return math.inf if self.kl is None else self.kl

    def worse_on(self, before: GuardScore) -> list[str]:
        """The further held-out texts on which this model's KL is above ``before``'s by more than
        :data:`SOURCE_TOLERANCE` of it (a text ``before`` did not score is not compared)."""
        theirs = {s.name: s for s in before.sources or []}
        return [
            s.name
            for s in self.sources or []
            if s.name in theirs and s.loss > theirs[s.name].loss * (1 + SOURCE_TOLERANCE)
        ]

    def beats(self, before: GuardScore) -> bool:
        """Whether a stage that leads from ``before`` to this model is kept: a lower KL on the
        calibration text's windows, and no further held-out text made worse (:meth:`worse_on`)."""
        return self.loss < before.loss and not self.worse_on(before)

    def __str__(self) -> str:
        return f"KL {'inf' if self.kl is None else f'{self.kl:.4g}'}, top-1 {self.top1:.1%}"


class GuardMode(StrEnum):
    """What a model-level guard does with a stage that does not make the model better (``convert
    --guard``, ``uptrain --guard``): undo it (publish the model before it), fail, or not measure."""

    UNDO = "undo"
    FAIL = "fail"
    OFF = "off"


#: the guard's modes as the settings offer them (their choices)
GUARD_MODES = tuple(mode.value for mode in GuardMode)
#: :attr:`GuardStage.outcome`: the stage's weights are published
KEPT = "kept"
#: :attr:`GuardStage.outcome`: the stage made the model worse, so the model before it is published
UNDONE = "undone"
#: :attr:`GuardStage.outcome`: a first part of the stage is published (the refit's best prefix of layers)
KEPT_IN_PART = "kept in part"
#: :attr:`GuardStage.outcome`: nothing to compare with (the merge: the original is MHA)
MEASURED = "measured"


@dataclass(frozen=True)
class GuardStage:
    """One stage as the guard saw it: the model before it, after it as it ran, and what is published."""

    stage: str  # merge, refit, distill
    outcome: str  # KEPT, UNDONE, KEPT_IN_PART or MEASURED
    after: GuardScore  # the stage as it ran (all of it)
    published: GuardScore  # what the output holds after the guard's decision
    before: GuardScore | None = None  # the model the stage started from
    detail: str = ""  # e.g. which layers' refit is published

    def line(self) -> str:
        """``refit: undone - held-out KL 0.41 -> 0.97, top-1 ...`` (terminal, card, report)."""
        if self.before is None:
            text = f"{self.stage}: {self.outcome} - held-out {self.after}"
        else:
            text = f"{self.stage}: {self.outcome} - held-out {self.before} -> {self.after}"
        if self.outcome == KEPT_IN_PART:
            text += f"; published {self.published}"
        return text + self._sources() + (f" ({self.detail})" if self.detail else "")

    def _sources(self) -> str:
        """``; chat.txt KL 0.31 -> 0.29, code.py KL 0.5 (worse)``: each further held-out text's KL."""
        before = {s.name: s for s in self.before.sources or []} if self.before is not None else {}
        worse = set(self.after.worse_on(self.before)) if self.before is not None else set()
        parts = []
        for s in self.after.sources or []:
            was = f"{_kl(before[s.name].kl)} -> " if s.name in before else ""
            parts.append(f"{s.name} KL {was}{_kl(s.kl)}" + (" (worse)" if s.name in worse else ""))
        return "; " + ", ".join(parts) if parts else ""


def _kl(kl: float | None) -> str:
    return "inf" if kl is None else f"{kl:.4g}"


@dataclass(frozen=True)
class StageGuard:
    """The model-level guard of a conversion (:mod:`mha2gqa.convert.guard`): where it measured,
    what it does with a stage that hurts (``mode``), and each stage's figures and outcome."""

    mode: str  # undo, fail
    windows: int
    tokens: int
    where: str  # which tokens of the calibration text, or why nothing was measured
    stages: list[GuardStage] = field(default_factory=list)
    #: the further held-out texts (``--guard-data``) and which of their tokens (None: none given)
    sources: list[str] | None = None

    def stage(self, name: str) -> GuardStage | None:
        return next((s for s in self.stages if s.stage == name), None)


@dataclass(frozen=True)
class WindowedCache:
    """The KV cache of a model whose layers keep different spans of the sequence (sliding windows,
    shared caches), at ``tokens`` tokens, before and after: bytes per token alone would overstate it."""

    tokens: int
    bytes_before: int
    bytes_after: int
    note: str  # which layers keep what, in words

    def line(self) -> str:
        mib = 2**20
        return (
            f"at {self.tokens:,} tokens: {self.bytes_before / mib:,.2f} -> {self.bytes_after / mib:,.2f} MiB "
            f"a sequence ({self.note})"
        )


@dataclass(frozen=True)
class Facts:
    """What the conversion did: method, grouping, shapes before and after, KV bytes."""

    method: str
    num_layers: int
    num_heads: int
    num_kv_heads_before: int
    num_kv_heads_after: int
    head_dim: int
    query_heads_per_kv_head: list[list[int]]
    kv_cache_dtype: str
    kv_cache_bytes_per_token_before: int
    kv_cache_bytes_per_token_after: int
    method_summary: str = ""
    calibration: Calibration | None = None
    grouping: str = "contiguous"
    grouping_summary: str = ""
    source_kv_heads_per_kv_head_by_layer: dict[str, list[list[int]] | None] | None = None
    seed: int | None = None
    num_kv_heads_per_layer: list[int] | None = None
    source_kv_heads_per_kv_head: list[list[int]] = field(default_factory=list)
    rewrites: list[str] = field(default_factory=list)
    rewritten: list[str] = field(default_factory=list)
    retarget: Retargeted | None = None
    runs_in: str | None = None
    per_layer_allocation: Allocation | None = None
    serving_form: str | None = None
    refit: Refit | None = None
    guard: StageGuard | None = None
    windowed_cache: WindowedCache | None = None
    #: what each decoder layer became (None: a record before the field)
    layer_plans: list[LayerPlan] | None = None
    #: ``convert --distill`` ran: True where the published model is the distilled one, False where the stage
    #: guard undid it (None: no distillation, or a record before the field)
    distilled: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def changed(self) -> bool:
        """Some layer's KV-head count changed (otherwise every tensor is a copy)."""
        return self.num_kv_heads_after != self.num_kv_heads_before or bool(self.num_kv_heads_per_layer)

    @property
    def recipe(self) -> str:
        """The conversion named in full, the one name every table, report, card and summary shows:
        the method, ``/similarity`` grouping, ``/per-layer(...)`` counts (``auto``: allocated from
        calibration; more than :data:`RECIPE_LAYERS` layers: their average), ``+refit``; e.g.
        ``svd+refit``, ``svd/per-layer(4,1,2)+refit``, ``svd/per-layer(auto, avg 2)``; ``+refit(undone)``
        where the stage guard undid it, ``+refit(in part)`` where it kept the first layers' refit;
        ``+distill`` where ``--distill``'s model is published and ``+distill(undone)`` where the guard undid it."""
        name = self.method + ("" if self.grouping == "contiguous" else f"/{self.grouping}")
        counts = self.num_kv_heads_per_layer
        if counts:
            shown = (
                ",".join(map(str, counts)) if len(counts) <= RECIPE_LAYERS else f"avg {sum(counts) / len(counts):.3g}"
            )
            name += f"/per-layer({'auto, ' if self.per_layer_allocation else ''}{shown})"
        elif (allocated := self.guard.stage("allocation") if self.guard else None) and allocated.outcome == UNDONE:
            name += "/per-layer(auto, undone)"  # allocated, then undone by the stage guard: uniform counts
        distill = self.guard.stage("distill") if self.guard else None
        if distill is not None:  # judged by the guard
            distilled = stage_name("distill", distill.outcome)
        elif self.distilled is None:  # no distillation (or a record before the fact)
            distilled = ""
        else:
            distilled = stage_name("distill", None if self.distilled else UNDONE)
        return name + self._stage_name("refit", self.refit is not None) + distilled

    def _stage_name(self, stage: str, ran: bool) -> str:
        """``+refit``, ``+refit(undone)`` or ``+refit(in part)``: a stage that ran, as the guard published it."""
        if not ran:
            return ""
        seen = self.guard.stage(stage) if self.guard else None
        return stage_name(stage, seen.outcome if seen else None)

    @property
    def kv_heads_after(self) -> str:
        """``4`` or ``8, 4, 2, 1 per layer``."""
        per_layer = self.num_kv_heads_per_layer
        return f"{', '.join(map(str, per_layer))} per layer" if per_layer else str(self.num_kv_heads_after)

    def groups_by_layer(self) -> dict[int, list[list[int]]]:
        """Similarity grouping: each layer's source KV heads per new KV head (empty when heads kept
        their places)."""
        found = self.source_kv_heads_per_kv_head_by_layer or {}
        return {int(layer): groups for layer, groups in found.items() if groups}


def stage_name(stage: str, outcome: str | None) -> str:
    """The recipe's name for a stage that ran: ``+refit`` (kept, or not judged: ``outcome`` None),
    ``+refit(undone)`` (the guard published the model before it) or ``+refit(in part)``."""
    if outcome in (None, KEPT):
        return f"+{stage}"
    return f"+{stage}({'undone' if outcome == UNDONE else 'in part'})"


@dataclass(frozen=True)
class Source:
    """The checkpoint that was converted (hashes of its config and safetensors headers); ``path``: its hub
    id, or ``./NAME`` for a local folder (a record before it: the folder's path)."""

    path: str
    config_sha256: str
    format: str
    repo_id: str | None = None
    revision: str | None = None
    files: list[dict[str, Any]] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The hub id, else the folder's name."""
        return self.repo_id or Path(self.path).name


@dataclass(frozen=True)
class Output:
    files: list[str]
    total_size: int


@dataclass(frozen=True)
class ConversionRecord:
    """One ``mha2gqa_conversion.json``."""

    mha2gqa_version: str
    created: str
    family: str
    source: Source
    settings: dict[str, Any]
    conversion: Facts
    output: Output | None = None
    schema: str = CONVERSION_SCHEMA

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        return {"schema": data.pop("schema"), **data}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: Any, where: str) -> ConversionRecord:
        """Read a record; a damaged or foreign one raises one error naming ``where`` and the field."""
        if isinstance(data, dict) and data.get("schema", CONVERSION_SCHEMA) != CONVERSION_SCHEMA:
            raise Mha2GqaError(
                f"{where}: schema {data.get('schema')!r} is not {CONVERSION_SCHEMA}: written by another mha2gqa "
                "version; convert again with this one"
            )
        try:
            return typed.read(cls, data, "record")
        except typed.RecordError as e:
            raise Mha2GqaError(f"{where}: damaged conversion record ({e}); convert the model again") from None


def read_conversion_record(folder: Path) -> ConversionRecord | None:
    """The record of a converted model folder; None when it has none (not converted by mha2gqa)."""
    path = Path(folder) / CONVERSION_RECORD
    data = read_record_json(path, "convert the model again")
    return None if data is None else ConversionRecord.from_dict(data, str(path))
