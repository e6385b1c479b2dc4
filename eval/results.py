"""The results schema of ``mha2gqa eval`` (``mha2gqa.eval/1``), typed.

The harness builds :class:`Results` from its stages' typed sections and writes it with
:meth:`Results.to_dict`; everything that reads a file (the terminal summary, gates, the report, job
and demo tables) reads it through :meth:`Results.from_dict`, which checks the fields it needs and
names a missing one. Files written before a field existed stay readable: such fields are optional
here and derived where the numbers allow (e.g. a model's KV bytes per token from its dimensions).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from mha2gqa.core import typed
from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.model_info import ModelInfo
from mha2gqa.core.records import EVAL_SCHEMA
from mha2gqa.eval.agreement import Agreement, DeltaP, GreedyProbe, RestMass, Stats
from mha2gqa.eval.pair import Overlap
from mha2gqa.eval.paired import mcnemar_exact
from mha2gqa.eval.tasks import TasksSection
from mha2gqa.eval.verdict import Verdict, figures_of, judge


class _Missing(Mha2GqaError):
    pass


@dataclass
class HeadScore:
    """One query head of one layer: attention KL, and the error of its output (through ``o_proj``:
    ``contribution_rel_error``; files written before it was measured have the raw output error)."""

    kl: float
    output_rel_error: float
    contribution_rel_error: float | None = None
    js: float | None = None
    cosine: float | None = None
    entropy_original: float | None = None
    entropy_converted: float | None = None

    @property
    def error(self) -> float:
        return self.contribution_rel_error if self.contribution_rel_error is not None else self.output_rel_error


@dataclass
class Similarity:
    """Cosine of every pair of heads' attention patterns in one model's layer."""

    mean: float
    matrix: list[list[float]]
    within_groups: float | None = None
    across_groups: float | None = None


@dataclass
class HeadSimilarity:
    original: Similarity
    converted: Similarity


@dataclass(kw_only=True)
class AttentionMeans:
    """The per-head means a layer and the whole model both report."""

    mean_kl: float
    mean_js: float
    mean_cosine: float
    mean_entropy_original: float
    mean_entropy_converted: float
    entropy_uniform: float
    mean_output_rel_error: float
    mean_contribution_rel_error: float | None = None

    @property
    def head_error(self) -> float:
        """The mean per-head contribution error (the raw output error in files written before it)."""
        found = self.mean_contribution_rel_error
        return found if found is not None else self.mean_output_rel_error


@dataclass(kw_only=True)
class AttentionLayer(AttentionMeans):
    layer: int
    heads: list[HeadScore]
    hidden_cosine: float
    head_similarity: HeadSimilarity | None = None


@dataclass(kw_only=True)
class AttentionSummary(AttentionMeans):
    mean_hidden_cosine: float
    head_similarity_original_mean: float | None = None
    head_similarity_original_within_groups: float | None = None
    head_similarity_original_across_groups: float | None = None
    head_similarity_converted_mean: float | None = None
    head_similarity_converted_within_groups: float | None = None
    head_similarity_converted_across_groups: float | None = None


@dataclass
class Attention:
    """Attention similarity (``--attention``): the whole model's means and each layer's heads."""

    seq_len: int
    summary: AttentionSummary
    layers: list[AttentionLayer]
    tokens: int | None = None
    chunk: int | None = None
    seconds: float | None = None


@dataclass
class ReferenceInfo:
    """Where the original's scores came from: the reference cache entry (``folder`` None: a
    temporary one; its first block's key), its size (the largest block's) and ``form`` (``exact``, or
    ``top-K`` logits kept), and the ``blocks`` a temporary cache was built and replayed in (None:
    one)."""

    key: str
    folder: str | None
    bytes: int
    form: str
    blocks: int | None = None


@dataclass
class GateCheck:
    """One gate as recorded: ``value op limit`` and whether it held."""

    name: str
    value: float
    limit: float
    op: str
    passed: bool


@dataclass
class GatesRecord:
    passed: bool
    checks: list[GateCheck]


@dataclass
class Sample:
    """A greedy continuation of the same prompt by both models."""

    prompt: str
    original: str = ""
    converted: str = ""


@dataclass
class DataInfo:
    """The evaluation text: where it came from, how many documents and tokens, and how much of it
    the conversion read (``calibration_overlap``)."""

    source: str
    documents: int
    stream_tokens: int
    text_field: str | None = None
    doc_split: str | None = None
    characters: int | None = None
    sha256: str | None = None
    calibration_overlap: Overlap | None = None


@dataclass
class DeviceInfo:
    type: str
    dtype: str
    device_map: str | None = None
    processes: int | None = None
    name: str | None = None
    threads: int | None = None


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
    data: DataInfo
    protocols: dict[str, Protocol]
    device: DeviceInfo
    versions: dict[str, str] = field(default_factory=dict)
    tokenizer: dict[str, Any] = field(default_factory=dict)
    agreement: Agreement | None = None
    attention: Attention | None = None
    gates: GatesRecord | None = None
    verdict: Verdict | None = None
    quantization: dict[str, Quantized] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    greedy: GreedyProbe | None = None  # the generative probe (pairs: eval.greedy)
    tasks: TasksSection | None = None  # lm-evaluation-harness tasks (--tasks)
    reference: ReferenceInfo | None = None  # the original's cached scores (pairs scored one at a time)
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

    def checked(self) -> Results:
        """This value, its sections checked against each other (as :meth:`from_dict` checks a file's);
        raises :class:`Mha2GqaError` naming the section."""
        try:
            _check_sections(self)
        except _Missing as e:
            raise Mha2GqaError(f"results: {e}") from None
        return self

    def to_dict(self) -> dict[str, Any]:
        """The results file's JSON object (what :meth:`from_dict` reads back to an equal value)."""
        # a section that did not run (None, or empty) is left out, as the harness always wrote them
        out = {f.name: typed.plain(getattr(self, f.name)) for f in fields(self) if not typed.unset(self, f)}
        out.pop("path", None)
        out["protocols"] = {n: {k: v for k, v in p.items() if k != "name"} for n, p in out["protocols"].items()}
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
        values = figures_of(ratios, self.agreement.kl.mean, self.agreement.top1_agreement)
        verdict = judge(values, self.placement())
        return verdict.judged_invalid(self.invalid_because) if verdict is not None else None

    @property
    def invalid_because(self) -> str | None:
        """Why this comparison's figures do not measure the conversion (None: they do): the evaluation
        text is, or overlaps, its calibration or refit text and the run did not pass
        ``--allow-overlap``."""
        o = self.data.calibration_overlap
        if o is None or not o.flagged or self.settings.get("allow_overlap"):
            return None
        if o.same:
            return f"evaluated on the conversion's {o.use} text"
        return f"the evaluation text shares {o.share:.1%} of its lines with the {o.use} text"

    @property
    def overlap_warning(self) -> str | None:
        """The warning when the evaluation text is (or overlaps) the conversion's calibration text."""
        o = self.data.calibration_overlap
        if o is None or not o.flagged:
            return None
        what = "is" if o.same else f"shares {o.share:.1%} of its lines with"
        return f"evaluation text {what} the conversion's {o.use} text {o.text}"

    def placement(self) -> str | None:
        """Where the conversion sits among the quantized yardsticks, by mean KL to the original:
        ``costs less than int4 weight quantization (KL 0.012 vs 0.034); more than int8 (vs 0.0004)``."""
        if not self.quantization or self.agreement is None:
            return None
        kl = self.agreement.kl.mean
        ranked = sorted(self.quantization.items(), key=lambda nq: nq[1].agreement.kl.mean)
        less = [(n, q) for n, q in ranked if kl <= q.agreement.kl.mean]
        more = [(n, q) for n, q in ranked if kl > q.agreement.kl.mean]
        parts = []
        if less:
            n, q = less[0]
            parts.append(f"costs less than {n} weight quantization (KL {kl:.4g} vs {q.agreement.kl.mean:.4g})")
        if more:
            n, q = more[-1]
            parts.append(f"costs more than {n} weight quantization (KL {kl:.4g} vs {q.agreement.kl.mean:.4g})")
        return "; ".join(parts)

    @property
    def basis(self) -> tuple[str, str, int]:
        """What its figures are measured against: ``(the original, the evaluation text, its tokens)``;
        results of different bases are not comparable with each other."""
        text = self.data.sha256 or self.data.source
        return (self.original.config_sha256 or self.original.path, text, self.data.stream_tokens)

    @property
    def basis_line(self) -> str:
        """The basis in words: ``original X; data Y (N tokens)``."""
        return (
            f"original {Path(self.original.path).name}; data {Path(self.data.source).name} "
            f"({self.data.stream_tokens:,} tokens)"
        )

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


def _check_sections(r: Results) -> None:
    """What the types alone cannot say: a lone model holds no comparison's sections, a pair's every
    protocol scored both models, the llama.cpp-style report whole, the attention section not empty."""
    if r.converted is None and (r.attention or r.agreement or r.quantization or r.samples or r.verdict):
        raise _Missing("models.converted is missing, but the file holds a comparison's sections")
    if r.converted is not None:  # a pair: every protocol scored both models
        for name, p in r.protocols.items():
            if p.converted is None or p.ppl_ratio is None:
                raise _Missing(f"protocols.{name}: a pair's protocol needs its converted score and ppl_ratio")
            if (p.original.bits_per_byte is None) != (p.converted.bits_per_byte is None):
                raise _Missing(f"protocols.{name}: bits_per_byte is given for one model only")
    a = r.agreement
    if a is not None and a.kl_reverse is not None and a.delta_p is not None:  # the llama.cpp-style report
        for where, stats, extra in (
            ("agreement.kl", a.kl, ()),
            ("agreement.kl_reverse", a.kl_reverse, ()),
            ("agreement.delta_p", a.delta_p, ("rms", "rms_error")),
        ):
            for name in (*Stats.REPORT, *extra):
                if getattr(stats, name) is None:
                    raise _Missing(f"{where}.{name} is missing")
        for name in ("top1_error", "nll_delta_error", "nll_correlation"):
            if getattr(a, name) is None:
                raise _Missing(f"agreement.{name} is missing")
    if r.attention is not None and (not r.attention.layers or any(not x.heads for x in r.attention.layers)):
        raise _Missing("attention.layers is empty, or a layer has no heads")
    if r.tasks is not None:
        _check_tasks(r.tasks, r.converted is not None)
    _check_headline(r)


def _check_headline(r: Results) -> None:
    """The figures a verdict and the report's tables read are numbers eval can have written: every
    perplexity positive (infinite only where its mean NLL overflows ``exp``), every NLL and KL finite
    and not negative, top-1 agreement a share; a NaN, an infinity or a sign a person typed is caught."""

    def bad(where: str, value: float | None, low: float = 0.0, high: float = math.inf) -> None:
        if value is not None and not (math.isfinite(value) and low <= value <= high):
            raise _Missing(f"{where} is {value}, which eval never writes (the file is damaged or edited)")

    for name, p in r.protocols.items():
        for which, score in (("original", p.original), ("converted", p.converted)):
            if score is None:
                continue
            where = f"protocols.{name}.{which}"
            bad(f"{where}.nll", score.nll)
            bad(f"{where}.nll_sum", score.nll_sum)
            if not (score.ppl > 0 and (math.isfinite(score.ppl) or score.nll > 700)):
                raise _Missing(f"{where}.ppl is {score.ppl}, which eval never writes (the file is damaged or edited)")
        if p.ppl_ratio is not None and not p.ppl_ratio > 0:
            raise _Missing(f"protocols.{name}.ppl_ratio is {p.ppl_ratio}, which eval never writes")
    a = r.agreement
    if a is not None:
        for stat in ("mean", "median", "q99"):
            bad(f"agreement.kl.{stat}", getattr(a.kl, stat), low=-1e-6)
        bad("agreement.top1_agreement", a.top1_agreement, high=1.0)


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


__all__ = [
    "Agreement",
    "Attention",
    "AttentionLayer",
    "AttentionMeans",
    "AttentionSummary",
    "DataInfo",
    "DeltaP",
    "DeviceInfo",
    "GateCheck",
    "GatesRecord",
    "HeadScore",
    "HeadSimilarity",
    "ModelInfo",
    "Protocol",
    "Quantized",
    "ReferenceInfo",
    "RestMass",
    "Results",
    "Sample",
    "Score",
    "Similarity",
    "Stats",
]
