"""The results schema of ``mha2gqa eval`` (``mha2gqa.eval/1``), typed.

The harness writes the JSON; everything that reads it (the terminal summary, gates, the report, job
and demo tables) reads it through :meth:`Results.from_dict`, which checks the fields it needs and
names a missing one. Files written before a field existed stay readable: such fields are optional
here and derived where the numbers allow (e.g. a model's KV bytes per token from its dimensions).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mha2gqa.core import typed
from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.model_info import ModelInfo
from mha2gqa.core.records import EVAL_SCHEMA
from mha2gqa.eval.paired import mcnemar_exact
from mha2gqa.eval.tasks import TasksSection
from mha2gqa.eval.verdict import Verdict, figures_of, judge


class _Missing(Mha2GqaError):
    pass


@dataclass
class Score:
    """Perplexity of one model under one protocol."""

    nll_sum: float
    tokens: int
    nll: float
    ppl: float
    word_perplexity: float | None = None
    byte_perplexity: float | None = None
    bits_per_byte: float | None = None


@dataclass
class Protocol:
    name: str
    settings: dict[str, Any]
    original: Score
    converted: Score | None = None
    ppl_ratio: float | None = None
    windows: int = 0
    seconds: float = 0.0
    tokens_per_second: float = 0.0


@dataclass
class Agreement:
    """Output agreement of the converted model with the original on the same scored tokens."""

    tokens: int
    kl: dict[str, float]
    top1_agreement: float
    nll_delta: float
    settings: dict[str, Any] = field(default_factory=dict)
    # llama.cpp's KL report (files written before it was recorded lack these)
    kl_reverse: dict[str, float] | None = None
    delta_p: dict[str, float] | None = None
    top1_error: float | None = None
    nll_delta_error: float | None = None
    nll_correlation: float | None = None
    # against a top-k reference cache: the probability mass outside the kept tokens (KLs are lower bounds)
    reference_rest_mass: dict[str, float] | None = None


@dataclass
class Quantized:
    """The original quantized (``--compare-quantization``) and scored against itself: the yardstick."""

    description: str
    bits: int
    group: int | None
    weights: int
    ppl_ratio: dict[str, float]
    agreement: Agreement
    seconds: float = 0.0


@dataclass
class Results:
    """One results file."""

    schema: str
    created: str
    settings: dict[str, Any]
    models: dict[str, ModelInfo]
    data: dict[str, Any]
    protocols: dict[str, Protocol]
    device: dict[str, Any]
    versions: dict[str, str] = field(default_factory=dict)
    tokenizer: dict[str, Any] = field(default_factory=dict)
    agreement: Agreement | None = None
    attention: dict[str, Any] | None = None
    gates: dict[str, Any] | None = None
    verdict: Verdict | None = None
    quantization: dict[str, Quantized] = field(default_factory=dict)
    samples: list[dict[str, str]] = field(default_factory=list)
    tasks: TasksSection | None = None  # lm-evaluation-harness tasks (--tasks)
    git_revision: str | None = None
    seconds: float = 0.0
    path: str | None = None

    @classmethod
    def from_dict(cls, d: Any, path: str | None = None) -> Results:
        """Read a results dict, every field the readers use checked for presence and type (nested
        sections included); raises :class:`Mha2GqaError` naming the file and the field."""
        where = path or "results"
        try:
            _check_schema(d)
            models = d.get("models")
            if not isinstance(models, dict) or "original" not in models:
                raise _Missing("models.original is missing")
            parsed = {n: typed.read(ModelInfo, m, f"models.{n}") for n, m in models.items()}
            protocols = d.get("protocols")
            if not isinstance(protocols, dict) or not protocols:
                raise _Missing("protocols is missing or empty")
            plain = {**d, "models": {}, "protocols": {}, "agreement": None, "verdict": None, "path": None}
            out = typed.read(cls, plain, "results")
            out.models = parsed
            out.protocols = {n: _protocol(n, p) for n, p in protocols.items()}
            agreement = d.get("agreement")
            out.agreement = typed.read(Agreement, agreement, "agreement") if agreement else None
            if d.get("verdict") is not None:
                out.verdict = Verdict.from_dict(d["verdict"], "verdict")
            _check_sections(out)
        except (_Missing, typed.RecordError) as e:
            raise Mha2GqaError(f"{where}: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise Mha2GqaError(f"{where}: a field has the wrong type ({e})") from None
        out.path = path
        return out

    @classmethod
    def load(cls, path: Path) -> Results:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise Mha2GqaError(f"{path}: cannot read results JSON ({e})") from None
        return cls.from_dict(data, str(path))

    @property
    def original(self) -> ModelInfo:
        return self.models["original"]

    @property
    def converted(self) -> ModelInfo | None:
        return self.models.get("converted")

    @property
    def headline(self) -> Protocol:
        """The protocol tables lead with: ``disjoint`` when it ran, else the first."""
        return self.protocols.get("disjoint") or next(iter(self.protocols.values()))

    def judge(self) -> Verdict | None:
        """The recorded verdict, else one judged from the numbers (results written before verdicts
        existed); None for a model evaluated alone. Not valid (:attr:`invalid_because`) when the
        evaluation text overlaps what the conversion read, unless the run allowed it."""
        if self.verdict is not None:
            return self.verdict.judged_invalid(self.invalid_because)
        if self.converted is None or self.agreement is None:
            return None
        ratios = {n: p.ppl_ratio for n, p in self.protocols.items()}
        values = figures_of(ratios, self.agreement.kl["mean"], self.agreement.top1_agreement)
        verdict = judge(values, self.placement())
        return verdict.judged_invalid(self.invalid_because) if verdict is not None else None

    @property
    def invalid_because(self) -> str | None:
        """Why this comparison's figures do not measure the conversion (None: they do): the evaluation
        text is, or overlaps, its calibration or refit text and the run did not pass
        ``--allow-overlap``."""
        o = self.data.get("calibration_overlap")
        if not isinstance(o, dict) or not o.get("flagged") or self.settings.get("allow_overlap"):
            return None
        use = o.get("use", "calibration")
        if o.get("same"):
            return f"evaluated on the conversion's {use} text"
        return f"the evaluation text shares {float(o.get('share', 0)):.1%} of its lines with the {use} text"

    @property
    def overlap_warning(self) -> str | None:
        """The warning when the evaluation text is (or overlaps) the conversion's calibration text."""
        o = self.data.get("calibration_overlap")
        if not isinstance(o, dict) or not o.get("flagged"):
            return None
        what = "is" if o.get("same") else f"shares {float(o.get('share', 0)):.1%} of its lines with"
        return f"evaluation text {what} the conversion's {o.get('use', 'calibration')} text {o.get('text')}"

    def placement(self) -> str | None:
        """Where the conversion sits among the quantized yardsticks, by mean KL to the original:
        ``costs less than int4 weight quantization (KL 0.012 vs 0.034); more than int8 (vs 0.0004)``."""
        if not self.quantization or self.agreement is None:
            return None
        kl = self.agreement.kl["mean"]
        ranked = sorted(self.quantization.items(), key=lambda nq: nq[1].agreement.kl["mean"])
        less = [(n, q) for n, q in ranked if kl <= q.agreement.kl["mean"]]
        more = [(n, q) for n, q in ranked if kl > q.agreement.kl["mean"]]
        parts = []
        if less:
            n, q = less[0]
            parts.append(f"costs less than {n} weight quantization (KL {kl:.4g} vs {q.agreement.kl['mean']:.4g})")
        if more:
            n, q = more[-1]
            parts.append(f"costs more than {n} weight quantization (KL {kl:.4g} vs {q.agreement.kl['mean']:.4g})")
        return "; ".join(parts)

    @property
    def title(self) -> str:
        if self.converted is None:
            return Path(self.original.path).name
        return f"{Path(self.converted.path).name} vs {Path(self.original.path).name}"


def _check_schema(d: Any) -> None:
    """A results file of a version this mha2gqa reads (``mha2gqa.eval/N``, N at most ours)."""
    schema = d.get("schema") if isinstance(d, dict) else None
    if not isinstance(schema, str) or not schema.startswith("mha2gqa.eval/"):
        raise _Missing("not a results file of `mha2gqa eval --output`")
    version, ours = schema.rsplit("/", 1)[1], EVAL_SCHEMA.rsplit("/", 1)[1]
    if not version.isdigit():
        raise _Missing(f"schema {schema!r} is not one mha2gqa writes")
    if int(version) > int(ours):
        raise _Missing(f"written by a newer mha2gqa (schema {schema}; this one reads up to {EVAL_SCHEMA}): upgrade")


def _protocol(name: str, p: Any) -> Protocol:
    if not isinstance(p, dict):
        raise _Missing(f"protocols.{name} is not an object")
    out = typed.read(Protocol, {**p, "name": name}, f"protocols.{name}")
    for key in ("seq_len",):
        if not isinstance(out.settings.get(key), int):
            raise _Missing(f"protocols.{name}.settings.{key} is missing or not an integer")
    return out


# -- the nested sections the readers index into, checked once here ---------------------------------
@dataclass
class _Data:
    source: str
    documents: int
    stream_tokens: int


@dataclass
class _Device:
    type: str
    dtype: str


@dataclass
class _KL:
    mean: float
    median: float
    q90: float
    q95: float
    q99: float
    q99_9: float
    max: float


@dataclass
class _Stats(_KL):
    """llama.cpp's full statistics of a per-token figure (the KL report reads every one)."""

    std_error: float
    min: float
    q0_1: float
    q1: float
    q5: float
    q10: float


@dataclass
class _DeltaP(_Stats):
    rms: float
    rms_error: float


@dataclass
class _Report:
    """What the KL report needs beside the statistics (present whenever Δp and the reverse KL are)."""

    top1_error: float
    nll_delta_error: float
    nll_correlation: float


@dataclass
class _RestMass:
    mean: float
    max: float


@dataclass
class _Head:
    kl: float
    output_rel_error: float
    contribution_rel_error: float | None = None


@dataclass
class _Similarity:
    mean: float
    matrix: list[list[float]]
    within_groups: float | None = None
    across_groups: float | None = None


@dataclass
class _HeadSimilarity:
    original: _Similarity
    converted: _Similarity


@dataclass(kw_only=True)
class _Means:
    """The per-head means a layer and the whole model both report."""

    mean_kl: float
    mean_js: float
    mean_cosine: float
    mean_entropy_original: float
    mean_entropy_converted: float
    entropy_uniform: float
    mean_output_rel_error: float
    mean_contribution_rel_error: float | None = None


@dataclass(kw_only=True)
class _Layer(_Means):
    layer: int
    heads: list[_Head]
    hidden_cosine: float
    head_similarity: _HeadSimilarity | None = None


@dataclass(kw_only=True)
class _Summary(_Means):
    mean_hidden_cosine: float
    head_similarity_original_mean: float | None = None
    head_similarity_converted_mean: float | None = None
    head_similarity_converted_within_groups: float | None = None
    head_similarity_converted_across_groups: float | None = None


@dataclass
class _Attention:
    seq_len: int
    summary: _Summary
    layers: list[_Layer]


@dataclass
class _Check:
    name: str
    value: float
    limit: float
    op: str
    passed: bool


@dataclass
class _Gates:
    passed: bool
    checks: list[_Check]


@dataclass
class _Sample:
    prompt: str
    original: str = ""
    converted: str = ""


def _check_sections(r: Results) -> None:
    """The sections kept as plain dicts, checked against what the terminal, report and tables read."""
    if r.converted is None and (r.attention or r.agreement or r.quantization or r.samples or r.verdict):
        raise _Missing("models.converted is missing, but the file holds a comparison's sections")
    if r.converted is not None:  # a pair: every protocol scored both models
        for name, p in r.protocols.items():
            if p.converted is None or p.ppl_ratio is None:
                raise _Missing(f"protocols.{name}: a pair's protocol needs its converted score and ppl_ratio")
            if (p.original.bits_per_byte is None) != (p.converted.bits_per_byte is None):
                raise _Missing(f"protocols.{name}: bits_per_byte is given for one model only")
    for name, q in r.quantization.items():
        typed.read(_KL, q.agreement.kl, f"quantization.{name}.agreement.kl")
    typed.read(_Data, r.data, "data")
    typed.read(_Device, r.device, "device")
    a = r.agreement
    if a is not None:
        typed.read(_KL, a.kl, "agreement.kl")
        if a.kl_reverse is not None and a.delta_p is not None:  # the llama.cpp-style report
            typed.read(_Stats, a.kl, "agreement.kl")
            typed.read(_Stats, a.kl_reverse, "agreement.kl_reverse")
            typed.read(_DeltaP, a.delta_p, "agreement.delta_p")
            typed.read(_Report, asdict(a), "agreement")
        if a.reference_rest_mass is not None:
            typed.read(_RestMass, a.reference_rest_mass, "agreement.reference_rest_mass")
    if r.attention is not None:
        attention = typed.read(_Attention, r.attention, "attention")
        if not attention.layers or any(not layer.heads for layer in attention.layers):
            raise _Missing("attention.layers is empty, or a layer has no heads")
    if r.gates is not None:
        typed.read(_Gates, r.gates, "gates")
    for i, sample in enumerate(r.samples):
        typed.read(_Sample, sample, f"samples[{i}]")
    if r.tasks is not None:
        _check_tasks(r.tasks, r.converted is not None)
    overlap = r.data.get("calibration_overlap")
    if overlap is not None and not isinstance(overlap, dict):
        raise _Missing("data.calibration_overlap is not an object")


def _check_tasks(section: TasksSection, pair: bool) -> None:
    """Every task metric finite, a pair's with both models, and each paired test consistent with
    itself (McNemar's p recomputed from its discordant counts): an edited number is caught here."""
    if not section.rows:
        raise _Missing("tasks.rows is empty")
    for row in section.rows:
        for m in row.metrics:
            where = f"tasks.{row.task}.{m.metric}"
            scores = [m.original] + ([m.converted] if m.converted else [])
            if not all(math.isfinite(x.value) and (x.stderr is None or math.isfinite(x.stderr)) for x in scores):
                raise _Missing(f"{where}: a value or stderr is not a finite number")
            if pair and m.converted is None:
                raise _Missing(f"{where}: a pair's task metric needs the converted model's value")
            t = m.paired
            if t is None:
                continue
            if not 0 <= t.p_value <= 1 or t.significant != (t.p_value < t.alpha) or t.n < 1:
                raise _Missing(f"{where}.paired: p_value, alpha and significant disagree")
            if t.test == "mcnemar-exact":
                if t.only_original is None or t.only_converted is None:
                    raise _Missing(f"{where}.paired: McNemar's test needs its discordant counts")
                if not 0 <= t.only_original + t.only_converted <= t.n or min(t.only_original, t.only_converted) < 0:
                    raise _Missing(f"{where}.paired: discordant counts outside 0..n")
                if not math.isclose(mcnemar_exact(t.only_original, t.only_converted), t.p_value, rel_tol=1e-9):
                    raise _Missing(f"{where}.paired: p_value does not follow from its discordant counts")
            elif t.test != "paired-bootstrap":
                raise _Missing(f"{where}.paired.test {t.test!r} is not mcnemar-exact or paired-bootstrap")


__all__ = ["Agreement", "ModelInfo", "Protocol", "Quantized", "Results", "Score"]
