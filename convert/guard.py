"""The stage guard: every stage of a conversion (the per-layer allocation, the refit layer prefix by
layer prefix, and the distillation after it) must make the *model* better, measured where the user
will feel it: the converted model's next-token distribution against the original's (mean per-token
KL and top-1 agreement) on the last :data:`GUARD_WINDOWS` windows of the calibration text, which no
stage reads (the stages read the tokens before them). A stage whose held-out KL is not lower than
the stage before it is undone: its weights are not published, and the record, card and terminal say
so (``--guard fail`` stops instead).

Why at the model level: a layer-wise fit can lower every layer's own error while the model gets
worse (a real Qwen2-shaped model: each layer's held-out error fell, the model's perplexity rose
2.6x; docs/methods.md), and constants tuned on one model can wreck another. The guard is the
safety net under every recipe on a model the tool has never seen.

Streamed like the rest of the conversion: the original model is walked layer by layer
(:func:`~mha2gqa.convert.engine.layers.each_layer`), each candidate runs every layer through the source
module with its own tensors (:mod:`~mha2gqa.convert.engine.layer_view`), and candidates that agree on a
prefix of layers share its computation (one stream per distinct prefix). Memory: one layer, the
model's head, ``[T, hidden]`` float32 per window and live stream, and the logits of one call of the
head (:data:`~mha2gqa.core.memory.HEAD_BLOCK`, whatever the windows' length)."""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mha2gqa.convert.engine.layer_view import Loader, planned, source_view
from mha2gqa.convert.methods import HeadShape
from mha2gqa.convert.settings import GUARD_WINDOWS
from mha2gqa.convert.write.shard_writer import OutputTensor
from mha2gqa.core.conversion_record import (
    KEPT,
    KEPT_IN_PART,
    MEASURED,
    UNDONE,
    GuardMode,
    GuardScore,
    GuardStage,
    Refit,
    SourceScore,
    StageGuard,
)
from mha2gqa.core.dims import AttentionDims
from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.layer_tensors import attention_names
from mha2gqa.core.progress import bar as progress_bar
from mha2gqa.core.signals import check as check_signals

#: refit prefixes scored (the refitted layers in this many runs; each prefix ends one)
PREFIX_CHECKS = 4

#: how the record names the method's merge without the refit, where the refit starts from another
ALONE = "the merge without --refit (output-weighted value code)"


@dataclass(frozen=True)
class Weights:
    """One set of converted tensors a candidate model reads: ``load(name)`` gives a tensor of the
    output's (GQA) shapes for every name in ``names``; the layer's other tensors are the source's."""

    name: str
    load: Loader = field(compare=False, hash=False, repr=False)
    names: Container[str] = field(compare=False, hash=False, repr=False)
    targets: tuple[int, ...] = field(compare=False, hash=False)  # each layer's KV heads


#: a candidate model: each decoder layer's :class:`Weights` (None: the layer as the source has it)
Plan = Sequence[Weights | None]


def guard_windows(folder: Path, data: str, seq_len: int) -> tuple[torch.Tensor | None, int, str]:
    """``(ids [GUARD_WINDOWS, seq_len] or None, the tokens before them, where they are)``: the last
    windows of the calibration text ``data`` (tokenized as the stages tokenize it), which no stage may
    read: the stages read at most the tokens before them. None (and why) when the text cannot spare
    them and leave the stages one window."""
    from mha2gqa.core.models import load_tokenizer
    from mha2gqa.core.text import load_text, token_stream

    need = GUARD_WINDOWS * seq_len
    ids = token_stream(load_tokenizer(folder), load_text(data, setting="calibration"))
    if ids.numel() < need + seq_len:
        why = f"not measured: the calibration text has {ids.numel():,} tokens, fewer than {need + seq_len:,}"
        return None, ids.numel(), why
    rest = ids.numel() - need
    where = f"the calibration text's last {need:,} tokens ({GUARD_WINDOWS} windows of {seq_len})"
    return ids[rest:].reshape(GUARD_WINDOWS, seq_len), rest, where


@dataclass(frozen=True)
class HeldOut:
    """A further held-out text of the guard (``--guard-data``): its portable ``name``, its windows ``ids``
    ``[W, T]`` (its first :data:`GUARD_WINDOWS` at most) and ``where`` (in words, for the record)."""

    name: str
    ids: torch.Tensor = field(repr=False)
    where: str


def source_windows(folder: Path, data: str, seq_len: int) -> HeldOut:
    """The first :data:`GUARD_WINDOWS` windows of ``seq_len`` tokens of the text ``data`` (fewer where it
    has fewer: at least one, else refused in one line naming it)."""
    from mha2gqa.core.models import load_tokenizer
    from mha2gqa.core.text import load_text, token_stream
    from mha2gqa.core.text_ref import portable_name

    ids = token_stream(load_tokenizer(folder), load_text(data, setting="guard_data"))
    windows = min(GUARD_WINDOWS, ids.numel() // seq_len)
    if windows == 0:
        raise Mha2GqaError(
            f"--guard-data {data}: {ids.numel():,} tokens, fewer than one window of {seq_len}: give a longer text"
        )
    name = portable_name(data)
    where = f"{name}'s first {windows * seq_len:,} tokens ({windows} windows of {seq_len})"
    return HeldOut(name, ids[: windows * seq_len].reshape(windows, seq_len), where)


class Guard:
    """Scores candidate models (:data:`Plan`) against the original on the guard windows ``ids``
    ``[W, T]`` (and those of each further held-out text in ``sources``), streamed layer by layer from
    ``ckpt`` (see the module doc)."""

    def __init__(
        self, ckpt, family, dims: AttentionDims, ids: torch.Tensor, device, progress: bool = False,
        sources: Sequence[HeldOut] = (),
    ) -> None:  # fmt: skip
        from mha2gqa.convert.engine.layers import first_layer_inputs, skeleton

        self.ckpt, self.family, self.dims, self.device, self.progress = ckpt, family, dims, device, progress
        self.model = skeleton(ckpt)
        #: each text's name (None: the calibration text) and its windows' count, in the order of ``ids``
        self.segments = [(None, ids.shape[0]), *((s.name, s.ids.shape[0]) for s in sources)]
        self.ids = ids = torch.cat([ids, *(s.ids for s in sources)]) if sources else ids
        with torch.inference_mode():  # as calibration reads the source (a .bin's cached tensors are inference tensors)
            self.first = first_layer_inputs(self.model, ckpt, ids.to(device), device)
        self.reference: list[torch.Tensor] | None = None  # the original's last hidden states
        self.as_tuple = False
        self._head = None

    def score(self, plans: Mapping[str, Plan]) -> dict[str, GuardScore]:
        """Each plan's held-out KL and top-1 agreement against the original, in one walk over the
        layers (plans that agree on their first layers share those layers' computation)."""
        from mha2gqa.convert.engine.layers import each_layer

        n = self.dims.num_layers
        keys = {name: tuple(w.name if w else None for w in plan) for name, plan in plans.items()}
        if self.reference is None:
            keys[""] = (None,) * n  # the original, once
        streams: dict[tuple, list[torch.Tensor]] = {(): [h for h, _ in self.first]}
        kws = [kw for _, kw in self.first]
        by_name = {w.name: w for plan in plans.values() for w in plan if w}
        desc = f"guard: {len(plans)} candidate(s) on {self.ids.numel():,} held-out tokens"
        bar = progress_bar(total=n, unit="layer", desc=desc, disable=not self.progress)
        with torch.inference_mode(), bar:
            for i, layer, prefix in each_layer(self.model, self.ckpt, self.device, torch.float32):
                views: dict[str | None, dict[str, torch.Tensor]] = {None: {}}
                nxt: dict[tuple, list[torch.Tensor]] = {}
                for key in keys.values():
                    here = key[: i + 1]
                    if here in nxt:
                        continue
                    if here[-1] not in views:
                        views[here[-1]] = self._view(by_name[here[-1]], layer, i, prefix)
                    view = views[here[-1]]
                    nxt[here] = [self._run(layer, view, h, kw) for h, kw in zip(streams[key[:i]], kws, strict=True)]
                streams = nxt
                bar.update(1)
        if self.reference is None:
            self.reference = streams[keys.pop("")]
        return self._figures({name: streams[key] for name, key in keys.items()})

    def _view(self, weights: Weights, layer: torch.nn.Module, i: int, prefix: str) -> dict[str, torch.Tensor]:
        """Layer ``i``'s parameters from ``weights`` in the source module's shapes (:func:`source_view`)."""
        return source_view(
            weights.load, weights.names, self.family, HeadShape.of(self.dims, weights.targets[i]), layer, i, prefix
        )

    def _run(self, layer: torch.nn.Module, params: dict[str, torch.Tensor], h: torch.Tensor, kw: dict) -> torch.Tensor:
        check_signals()
        out = torch.func.functional_call(layer, params, (h,), kw) if params else layer(h, **kw)
        self.as_tuple = isinstance(out, tuple)
        return out[0] if self.as_tuple else out

    def _figures(self, candidates: Mapping[str, list[torch.Tensor]]) -> dict[str, GuardScore]:
        """Each candidate's mean per-token KL(original || candidate) and top-1 agreement over the guard
        windows, from its last hidden states (one ``[1, T, hidden]`` a window), through the model's
        head a block of tokens at a time (:func:`~mha2gqa.convert.engine.layers.next_token_kl`)."""
        from mha2gqa.convert.engine.layers import model_head, next_token_kl, skeleton

        if self._head is None:
            with torch.inference_mode():
                self._head = model_head(skeleton(self.ckpt), self.ckpt, self.device)
        names = list(candidates)
        sums = torch.zeros(len(self.segments), len(names), 2, dtype=torch.float64)  # per text: KL, top-1 matches
        tokens = [0] * len(self.segments)
        text = [n for n, (_, count) in enumerate(self.segments) for _ in range(count)]  # each window's text
        for w, ref_h in enumerate(self.reference):  # the head runs under no_grad
            sums[text[w]] += next_token_kl(self._head, self.as_tuple, ref_h, [candidates[n][w] for n in names])
            tokens[text[w]] += ref_h.shape[0] * ref_h.shape[1]
        scores = {}
        for i, name in enumerate(names):
            each = [score_of(*sums[n, i].tolist(), tokens[n]) for n in range(len(self.segments))]
            sources = [
                SourceScore(text, s.kl, s.top1) for (text, _), s in zip(self.segments[1:], each[1:], strict=True)
            ]
            scores[name] = dataclasses.replace(each[0], sources=sources or None)  # None: no further text
        return scores


def _better_merge(scores: Mapping[str, GuardScore]) -> tuple[str, GuardStage]:
    """``(which, the merge's GuardStage)``: the better of the refit's start (``merge``) and the
    method's merge without the refit (``alone``, where scored), which later stages must beat."""
    start, alone = scores["merge"], scores.get("alone")
    if alone is None:
        return "merge", GuardStage("merge", MEASURED, start, start)
    if alone.loss < start.loss:
        return "alone", GuardStage("merge", MEASURED, alone, alone, detail=f"{ALONE}; the refit's start: {start}")
    return "merge", GuardStage("merge", MEASURED, start, start, detail=f"the refit's start; {ALONE}: {alone}")


def score_of(kl: float, same: float, tokens: int) -> GuardScore:
    """The :class:`GuardScore` of ``kl`` summed over ``tokens`` tokens, ``same`` of them with the
    original's top token: a KL that is not finite (a candidate that overflowed) is recorded as None,
    which compares as infinite (never a NaN that compares false, nor ``Infinity`` in a JSON record)."""
    kl = kl / tokens
    return GuardScore(max(kl, 0.0) if math.isfinite(kl) else None, same / tokens)


def _computed(tensors: Sequence[OutputTensor]) -> tuple[dict[str, OutputTensor], set[str]]:
    """A planned conversion's tensors by name, and the names of those it computes (the rest are copies)."""
    by_name = {t.name: t for t in tensors}
    return by_name, {t.name for t in tensors if callable(t.source)}


def prefix_cuts(layers: Sequence[int], checks: int = PREFIX_CHECKS) -> list[int]:
    """The last layer of each refit prefix scored: ``layers`` (the refitted ones, in order) cut into
    ``checks`` runs as even as can be; the last cut is the whole refit."""
    n = len(layers)
    return sorted({layers[math.ceil(k * n / checks) - 1] for k in range(1, checks + 1)}) if n else []


@dataclass
class GuardRun:
    """The guard of one conversion (and its distillation): the held-out windows, found before any
    stage reads the text, the :class:`Guard` (built once the KV heads of each layer are known) and the
    stages seen so far."""

    mode: str
    ids: torch.Tensor | None
    before_windows: int  # tokens of the calibration text before the guard windows
    where: str
    guard: Guard | None = None
    stages: list[GuardStage] = field(default_factory=list)
    sources: list[HeldOut] = field(default_factory=list)  # --guard-data

    def record(self) -> StageGuard:
        ids = self.ids
        windows, tokens = (0, 0) if ids is None else (ids.shape[0], ids.numel())
        sources = [s.where for s in self.sources] or None
        return StageGuard(self.mode, windows, tokens, self.where, list(self.stages), sources)

    def _start(self, c) -> Guard:
        if self.guard is None:
            from mha2gqa.core.models import resolve_device

            dev = resolve_device(c.settings.device)
            self.guard = Guard(c.ckpt, c.family, c.dims, self.ids, dev, c.settings.progress, self.sources)
        return self.guard

    @staticmethod
    def _merged(c, tensors: list[OutputTensor], name: str) -> list[Weights | None]:
        """The plan of the conversion ``c`` planned as ``tensors`` (its changed layers read them)."""
        by_name, names = _computed(tensors)
        weights = Weights(name, planned(by_name, c.ckpt), names, tuple(c.targets))
        return [weights if t != c.dims.num_kv_heads else None for t in c.targets]

    def allocation(self, c, tensors: list[OutputTensor], uniform, uniform_tensors: list[OutputTensor], log) -> bool:
        """``--per-layer auto``: the merge at the allocated counts (``c``, ``tensors``) against the merge
        at uniform counts within the same budget (``uniform``, ``uniform_tensors``); whether the
        allocation stands (False: the uniform conversion is published)."""
        if self.ids is None:
            return True
        plans = {
            "allocated": self._merged(c, tensors, "allocated"),
            "uniform": self._merged(uniform, uniform_tensors, "uniform"),
        }
        scores = self._start(c).score(plans)
        mine, blind = scores["allocated"], scores["uniform"]
        kept = mine.beats(blind)
        detail = f"against {uniform.targets[0]} KV heads in every layer"
        stage = GuardStage("allocation", KEPT if kept else UNDONE, mine, mine if kept else blind, blind, detail)
        if not kept and self.mode == GuardMode.FAIL:
            self._fail(stage)
        self.stages.append(stage)
        self._say(log, stage)
        return kept

    def conversion(
        self,
        c,
        merged: list[OutputTensor],
        refitted: tuple[list[OutputTensor], Refit] | None,
        log,
        alone: list[OutputTensor] | None = None,
    ):
        """Score the merge and the method's merge without the refit where that is another (``alone``:
        ``svd``'s output-weighted code, where the refit starts from the plain one), then the refit at
        each prefix of :func:`prefix_cuts`, the layers after it from the better merge; returns the
        tensors to publish (the refit up to its best prefix, or the better merge) and the guard's
        record. The refit must beat the better merge."""
        if self.ids is None:
            return refitted[0] if refitted else merged, self.record()
        self._start(c)
        plans = {"merge": self._merged(c, merged, "merge")}
        if alone is not None and refitted:
            plans["alone"] = self._merged(c, alone, "alone")
        better, stage = _better_merge(self.guard.score(plans))
        self.stages.append(stage)
        self._say(log, stage)
        if not refitted:
            return merged, self.record()
        tensors, rec = refitted
        refit_by_name, refit_names = _computed(tensors)
        refit = Weights("refit", planned(refit_by_name, c.ckpt), refit_names, tuple(c.targets))
        fitted = [r.layer for r in rec.layers if not r.kept]
        cuts = prefix_cuts(fitted)
        n = c.dims.num_layers  # up to the cut, a layer the refit left merged is the merge later layers were fitted on
        prefixes = {
            cut: [refit if i in fitted and i <= cut else plans["merge" if i <= cut else better][i] for i in range(n)]
            for cut in cuts
        }
        scores = self.guard.score(prefixes) if prefixes else {}
        stage, published = self._refit_stage(scores, cuts, fitted, self.stages[-1].published)
        self.stages.append(stage)
        self._say(log, stage)
        start = alone if better == "alone" else merged
        if published < 0:  # undone, or no layer refitted: the better merge
            return start, self.record()
        changed = [i for i in range(published + 1, n) if plans["merge"][i] is not None]
        after = {name for i in changed for name in attention_names(refit_by_name, c.family, i).values()}
        start_by_name = _computed(start)[0]
        return [start_by_name[t.name] if t.name in after else t for t in tensors], self.record()

    def _refit_stage(
        self, scores: dict, cuts: list[int], fitted: list[int], before: GuardScore
    ) -> tuple[GuardStage, int]:
        """The refit's :class:`GuardStage` against the merge it must beat (``before``) and the last
        layer whose refit is published (-1: none)."""
        if not cuts:  # every layer kept its merge: the refit changed nothing
            return GuardStage("refit", KEPT, before, before, before, "no layer's refit lowered its error"), -1
        whole = scores[cuts[-1]]
        if self.mode == GuardMode.FAIL:
            if not whole.beats(before):
                self._fail(GuardStage("refit", UNDONE, whole, before, before))
            return GuardStage("refit", KEPT, whole, whole, before), cuts[-1]
        kept = [cut for cut in cuts if scores[cut].beats(before)]  # no held-out text made worse
        if not kept:
            return GuardStage("refit", UNDONE, whole, before, before), -1
        best = min(kept, key=lambda cut: (scores[cut].loss, cut))
        if best == cuts[-1]:
            return GuardStage("refit", KEPT, whole, whole, before), best
        n = sum(1 for i in fitted if i <= best)
        detail = f"published in layers up to {best}: {n} of {len(fitted)} refitted layers"
        return GuardStage("refit", KEPT_IN_PART, whole, scores[best], before, detail), best

    def distillation(
        self, folder: Path, targets: Sequence[int], log, detail: str = "", after: GuardScore | None = None
    ) -> bool:
        """Score the distilled model in ``folder`` (each layer's KV heads ``targets``; ``after``: its
        score, taken already) against the model it started from (what the stages before published);
        whether it is published (False: undone). ``detail``: how the distillation ran (its rate backoff),
        for the record and the terminal."""
        before = self.published
        if self.guard is None or before is None:
            return True
        after = after if after is not None else self.score_folder(folder, targets)
        kept = after.beats(before)
        stage = GuardStage("distill", KEPT if kept else UNDONE, after, after if kept else before, before, detail)
        if not kept and self.mode == GuardMode.FAIL:
            self._fail(stage)
        self.stages.append(stage)
        self._say(log, stage)
        return kept

    def score_folder(self, folder: Path, targets: Sequence[int]) -> GuardScore:
        """The held-out figures of a whole converted model (a Hugging Face folder, each layer's KV heads
        ``targets``: a distilled model)."""
        from mha2gqa.core.checkpoint import open_checkpoint

        ckpt = open_checkpoint(str(folder))
        weights = Weights("distill", ckpt.load, set(ckpt.tensors), tuple(targets))
        return self.guard.score({"distill": [weights] * len(targets)})["distill"]

    @property
    def published(self) -> GuardScore | None:
        """What the output holds now, as the guard measured it (None: not measured)."""
        return self.stages[-1].published if self.stages else None

    @staticmethod
    def _say(log, stage: GuardStage) -> None:
        if log is not None:
            log(f"guard: {stage.line()}")

    @staticmethod
    def _fail(stage: GuardStage) -> None:
        raise Mha2GqaError(
            f"--guard fail: {stage.line()}: the {stage.stage} made the model worse on held-out calibration "
            "windows; nothing written (--guard undo publishes the model before it)"
        )


def _own_sample(c, seq_len: int) -> HeldOut:
    """The guard's held-out sample of the model's own text (``--self-text``), named as such."""
    from mha2gqa.convert.calibration.own_text import SAMPLE_NAME

    found = source_windows(c.ckpt.folder, str(c.own.sample), seq_len)
    windows = found.ids.shape[0]
    first = f"first {windows * seq_len:,} tokens ({windows} windows of {seq_len})"
    where = f"{SAMPLE_NAME}, a sample no stage reads: {first}"
    return dataclasses.replace(found, name=SAMPLE_NAME, where=where)


def open_guard(c, data: str | None):
    """``(conversion, GuardRun or None)``: the guard windows cut from the end of ``data`` (the
    calibration text) and the conversion's stages held to the tokens before them (its
    ``calibration_tokens`` lowered where they reached in); None when the guard is off, there is no
    text, or nothing changes."""
    import dataclasses

    from mha2gqa.convert.settings import calibration_window
    from mha2gqa.core.dims import max_positions

    s = c.settings
    if s.guard == GuardMode.OFF or not data or not c.changes:
        return c, None
    seq_len = calibration_window(s.calibration_seq_len, max_positions(c.ckpt.config))
    ids, before, where = guard_windows(c.ckpt.folder, data, seq_len)
    sources = []
    if ids is not None:
        sources = [_own_sample(c, seq_len)] if c.own is not None and c.own.sample is not None else []
        sources += [source_windows(c.ckpt.folder, text, seq_len) for text in s.guard_data]
    run = GuardRun(s.guard, ids, before, where, sources=sources)
    if ids is None or s.calibration_tokens <= before or c.own is not None:  # (the mix holds none of them)
        return c, run
    read = before // seq_len * seq_len  # whole windows
    sys.stderr.write(
        f"warning: --calibration {data}: the stage guard holds out its last {ids.numel():,} tokens, so the "
        f"stages read the {read:,} before them ({read // seq_len} windows of {seq_len}) of the "
        f"{s.calibration_tokens:,} asked for: give more text, or lower --calibration-tokens to silence this\n"
    )
    return dataclasses.replace(c, settings=dataclasses.replace(s, calibration_tokens=read)), run
