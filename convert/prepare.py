"""A conversion, prepared: :func:`prepare` checks everything before any heavy work, without importing
torch (the source, folder or hub id, headers only; its family and dimensions; the KV-head counts; the
method and grouping against the family; the destination against the inputs; the layer count of the
config against the weights) and returns the frozen :class:`Conversion` that
:func:`mha2gqa.convert.converter.run` carries out. The CLI and job files prepare each conversion once,
so a mistake is reported before torch loads."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mha2gqa.convert.calibration.own_text import FINGERPRINT_KEY
from mha2gqa.convert.engine.retarget_view import RetargetedCheckpoint, retargeted
from mha2gqa.convert.methods import Method, get_method, incompatibility
from mha2gqa.convert.plan.groupings import Grouping, get_grouping
from mha2gqa.convert.plan.layer_plan import layer_plans
from mha2gqa.convert.settings import ConvertSettings
from mha2gqa.core.architecture import resolve
from mha2gqa.core.checkpoint import Checkpoint, open_checkpoint
from mha2gqa.core.conversion_record import LayerPlan
from mha2gqa.core.dims import AttentionDims, max_positions
from mha2gqa.core.errors import Mha2GqaError, SettingError
from mha2gqa.core.families import Family
from mha2gqa.core.output import check_destination
from mha2gqa.core.resume import ResumeFolder
from mha2gqa.core.retarget import find_retarget
from mha2gqa.core.settings import check_window


@dataclass(frozen=True)
class Conversion:
    """One conversion, checked: what is read, what is written, and how. ``targets`` holds the KV
    heads of each output layer (empty while ``--per-layer auto`` has not chosen:
    :meth:`with_targets` gives the chosen conversion)."""

    ckpt: Checkpoint
    dst: Path
    settings: ConvertSettings
    family: Family
    dims: AttentionDims
    method: Method
    grouping: Grouping
    targets: tuple[int, ...] = ()
    #: what each layer becomes (:meth:`planned`, once the calibration statistics are in; empty before)
    plans: tuple[LayerPlan, ...] = ()
    #: what a resumed refit must share with the stopped one (:func:`resume_fingerprint`), taken from the
    #: run as asked: ``--per-layer auto`` rewrites the settings once it has chosen
    fingerprint: dict | None = None
    #: ``--self-text``: the mix the stages read and the guard's sample of the model's own text, once
    #: written (:func:`~mha2gqa.convert.calibration.own_text.with_own_text`); None before, or without it
    own: Any = None
    #: where the stages' lines go (each refitted layer, the guard's decisions) when the caller hears
    #: them itself (a job's log); None: the terminal, with ``progress``
    log: Callable[[str], None] | None = dataclasses.field(default=None, compare=False, repr=False)

    def stage_log(self, default: Callable[[str], None]) -> Callable[[str], None] | None:
        """Who hears the stages' lines: :attr:`log`, else ``default`` with ``progress``, else nobody."""
        return self.log or (default if self.settings.progress else None)

    @property
    def text(self) -> str | None:
        """The calibration text the stages read: the ``--self-text`` mix once written, else ``--calibration``."""
        return str(self.own.mix) if self.own is not None else self.settings.calibration

    @property
    def per_layer(self) -> bool:
        """Layers end with different KV-head counts."""
        return len(set(self.targets)) > 1

    @property
    def changes(self) -> bool:
        """Some layer's KV-head count changes (otherwise the output is a copy); True while
        ``--per-layer auto`` has not chosen yet."""
        return not self.targets or any(t != self.dims.num_kv_heads for t in self.targets)

    @property
    def layered(self) -> bool:
        """q/k/v/o are rewritten together (a layer method, or heads regrouped)."""
        return self.method.layerwise or self.grouping.reorders

    @property
    def inputs(self) -> dict[str, Path | str | None]:
        """What this conversion reads, which its output may never replace."""
        return inputs_of(self.ckpt, self.settings)

    def with_targets(self, targets: tuple[int, ...]) -> Conversion:
        """This conversion with each layer's KV heads chosen (equal counts: the uniform one, exactly)."""
        settings = self.settings
        if len(set(targets)) == 1:
            settings = dataclasses.replace(settings, num_kv_heads=targets[0], num_kv_heads_per_layer=None)
        return dataclasses.replace(self, targets=tuple(targets), settings=settings, plans=())

    def planned(self, stats: Any) -> Conversion:
        """This conversion with each layer's plan (:func:`~mha2gqa.convert.plan.layer_plan.layer_plans`),
        from its calibration ``stats`` (None where the method reads none): made once, before any tensor
        is written; the writer, the refit and the record read it."""
        s = self.settings
        refit = s.refit_roles() if s.refit and self.changes else ()
        plans = layer_plans(self.dims, self.targets, self.method, stats, refit, s.refit_target)
        return dataclasses.replace(self, plans=plans)


def inputs_of(ckpt: Checkpoint, s: ConvertSettings) -> dict[str, Path | str | None]:
    """What a conversion reads, which its output may never replace."""
    return {"the source model": ckpt.folder, "the --calibration text": s.calibration}


def prepare(src: str | Path, dst: str | Path, s: ConvertSettings, later: dict | None = None) -> Conversion:
    """Check ``s``, open the source (headers only), check the destination and that the method
    applies; returns the conversion to :func:`~mha2gqa.convert.converter.run`. ``later``: the settings
    of a stage that follows the conversion into the same DST (``convert --distill``): they join the
    resume fingerprint, and the run keeps its work for ``--resume`` even without a refit."""
    s.check()
    dst = Path(dst)
    method, grouping = get_method(s.method), get_grouping(s.grouping)
    ckpt = open_checkpoint(str(src), revision=s.revision, allow_pickle=s.allow_pickle, check_config=resolve)
    check_destination(dst, s.overwrite, inputs_of(ckpt, s))
    if find_retarget(ckpt.config) is not None:  # held to its own class's checks: every tensor, every shape
        from mha2gqa.core.expected_tensors import check_tensors, expected_tensors  # (torch: only now)

        present = {name: info.shape for name, info in ckpt.tensors.items()}
        check_tensors(present, expected_tensors(ckpt.config), str(ckpt.folder))
    ckpt = retargeted(ckpt)  # GPT-NeoX -> Phi, GPT-2 -> GPTBigCode...: seen as the target class
    arch = ckpt.architecture if isinstance(ckpt, RetargetedCheckpoint) else resolve(ckpt.config)
    family, dims = arch.family, arch.dims
    if dims.kv_heads_per_layer:
        raise Mha2GqaError(
            f"{ckpt.folder}: its layers already have different KV-head counts; convert its MHA source instead"
        )
    targets = _targets(s, dims, family)
    if ckpt.format != "retargeted":  # a re-targeted view has checked its layers against the source
        _check_layers(ckpt, family, dims)
    if s.check_finite:
        ckpt.check_finite()
    conversion = Conversion(ckpt, dst, s, family, dims, method, grouping)
    conversion = conversion.with_targets(targets) if targets else conversion
    if conversion.changes:
        reason = incompatibility(method, grouping, family, ckpt.tensors)
        if reason:
            raise SettingError("method", reason)
        needs = "required" in (method.calibration, grouping.calibration) or s.per_layer == "auto" or s.refit
        if not family.attention_interface and (s.calibration or needs):
            raise SettingError(
                "calibration",
                f"{{name}}: {family.architectures[0]} does not run its attention through the installed "
                f"transformers' attention interface, where calibration reads q/k/v{family.interface_hint}; "
                "convert it without calibration (--method mean, first, random or aligned; contiguous groups)",
            )
        s.check_calibration()
        _check_windows(s, ckpt)
    if (s.refit and conversion.changes) or later is not None:  # a stopped run's work: continued, never dropped
        fingerprint = resume_fingerprint(ckpt, s) | ({"later stage": later} if later is not None else {})
        conversion = dataclasses.replace(conversion, fingerprint=fingerprint)
        # (the text the model writes: compared once it has, by ResumeFolder.open)
        ResumeFolder.check(dst, fingerprint, s.resume, s.remove_stale, later=(FINGERPRINT_KEY,))
    elif s.resume:
        raise SettingError(
            "resume", "{name}: this conversion keeps no work to continue (--refit and --distill do); drop {name}"
        )
    else:  # a stopped run's work beside DST: publishing another output into DST would strand it
        ResumeFolder.check(dst, {}, False, s.remove_stale)
    return conversion


def resume_fingerprint(ckpt: Checkpoint, s: ConvertSettings) -> dict:
    """What a resumed run must share with the stopped one: the source's weight files (names and
    sizes) and config, the calibration text (a local file's sha256), the recipe, mha2gqa's version
    and, with ``--refit``, the error the refit lowers and the arithmetic it runs in (calibration,
    steps) as this machine runs it (``auto`` is bf16 on one machine, float32 on
    another: a kept layer fitted otherwise would mix two objectives or two arithmetics in one model)."""
    import hashlib
    import json

    from mha2gqa.core.conversion_record import NORMALIZED_ERROR
    from mha2gqa.core.records import version
    from mha2gqa.core.text_ref import text_sha256

    text = s.calibration
    local = text is not None and Path(text).is_file()
    return {
        "source": {
            "files": {Path(f).name: Path(f).stat().st_size for f in getattr(ckpt, "files", [])},
            "config sha256": hashlib.sha256(json.dumps(ckpt.config, sort_keys=True).encode()).hexdigest(),
        },
        "calibration text": {"sha256": text_sha256(text)} if local else text,
        "recipe": s.recipe(),
        "mha2gqa version": version(),
    } | ({"refit error": NORMALIZED_ERROR, "refit arithmetic": s.refit_arithmetic()} if s.refit else {})


def _check_windows(s: ConvertSettings, ckpt: Checkpoint) -> None:
    """The calibration window fits the model's positions, and the text holds the windows the stages
    need (one; two with --refit), before any weight loads."""
    positions = max_positions(ckpt.config)
    if s.calibration_seq_len:
        check_window("calibration_seq_len", s.calibration_seq_len, positions)
    if s.refit:
        _check_refit_windows(s, positions)
    if s.calibration and s.reads_calibration and Path(s.calibration).expanduser().is_file():
        _check_text_length(s, ckpt, positions)


#: Characters of a local calibration text tokenized to count its first windows before any weight
#: loads (per token needed: far more than any tokenizer's tokens take); a text cut there that still
#: counts too few is left to the calibration pass, which tokenizes it whole.
CHARS_PER_TOKEN_BOUND = 64


def _check_text_length(s: ConvertSettings, ckpt: Checkpoint, positions: int | None) -> None:
    """A local calibration text too short for the stages' windows, refused in one line now, with the
    count the calibration pass would find (the same join and BOS: :func:`~mha2gqa.core.text.token_stream`)."""
    from mha2gqa.convert.settings import calibration_window
    from mha2gqa.core.models import load_tokenizer
    from mha2gqa.core.text import load_text

    window = calibration_window(s.calibration_seq_len, positions)
    need = window * (2 if s.refit else 1)
    text = load_text(s.calibration, setting="calibration").joined
    cut = text[: need * CHARS_PER_TOKEN_BOUND]
    tokenizer = load_tokenizer(ckpt.folder)
    count = len(tokenizer(cut, add_special_tokens=False, verbose=False)["input_ids"])
    count += tokenizer.bos_token_id is not None
    if count < need and len(cut) == len(text):
        windows = "two windows (--refit holds one out)" if s.refit else "one window"
        raise SettingError("calibration", f"{{name}} {s.calibration}: {count} tokens, fewer than {windows} of {window}")


def _check_refit_windows(s: ConvertSettings, positions: int | None) -> None:
    """The refit reads at least two calibration windows (one held out), before any work."""
    from mha2gqa.convert.settings import calibration_window

    window = calibration_window(s.calibration_seq_len, positions)
    if min(s.refit_tokens, s.calibration_tokens) < 2 * window:
        name = "refit_tokens" if s.refit_tokens <= s.calibration_tokens else "calibration_tokens"
        raise SettingError(
            name,
            f"{{name}} {getattr(s, name):,}: --refit needs two or more windows of {window} tokens "
            f"({2 * window:,} tokens, one held out); raise {{name}} or lower --calibration-seq-len",
        )


def _check_per_layer_family(family: Family, setting: str) -> None:
    from mha2gqa.core.families import families

    why = family.per_layer_refusal
    if why:
        able = ", ".join(name for name, f in families().items() if f.per_layer_refusal is None)
        raise SettingError(
            setting,
            f"{{name}}: {family.architectures[0]} {why}; per-layer counts support {able} "
            "(and the families re-targeted to them); use -g",
        )


def _targets(s: ConvertSettings, dims: AttentionDims, family: Family) -> tuple[int, ...]:
    """Each output layer's KV heads, checked (empty for --per-layer auto, which measures first); a
    per-layer list of equal values is the uniform conversion."""
    if s.per_layer == "auto":
        _check_per_layer_family(family, "per_layer")
        budget, layers = s.budget(dims.num_layers), dims.num_layers
        if not layers <= budget <= layers * dims.num_kv_heads:
            raise SettingError(
                "kv_budget",
                f"{{name}}: {budget / layers:g} KV heads per layer on average is outside "
                f"1..{dims.num_kv_heads} for this model",
            )
        if not s.calibration:
            raise SettingError(
                "calibration", "--per-layer auto measures each layer on calibration text: pass {name} DATA"
            )
        return ()
    per_layer = s.per_layer_heads()
    if per_layer is None:
        dims.check_kv_heads(s.num_kv_heads)
        return (s.num_kv_heads,) * dims.num_layers
    dims.check_kv_heads_per_layer(per_layer)
    if len(set(per_layer)) == 1:  # the uniform conversion, exactly (Conversion.with_targets)
        return per_layer
    _check_per_layer_family(family, "num_kv_heads_per_layer")
    return per_layer


def _check_layers(ckpt: Checkpoint, family: Family, dims: AttentionDims) -> None:
    """The weights hold exactly the config's layers (a cheap check by name, before anything heavy)."""
    name = family.o_proj + ".weight"
    for layer in range(dims.num_layers):
        if name.format(layer=layer) not in ckpt.tensors:
            missing = name.format(layer=layer)
            raise Mha2GqaError(
                f"{ckpt.folder}: config.json says {dims.num_layers} layers, but the weights have no "
                f"{missing} (layer {layer}); the config does not match the weights"
            )
    if name.format(layer=dims.num_layers) in ckpt.tensors:
        raise Mha2GqaError(f"{ckpt.folder}: the weights have more layers than the {dims.num_layers} config.json says")
