"""Every setting of a conversion, with its default and help: the one source for
:func:`~mha2gqa.convert.converter.convert_checkpoint`, ``mha2gqa convert`` and job files."""

from __future__ import annotations

from dataclasses import dataclass

from mha2gqa.convert.methods import METHODS, get_method
from mha2gqa.convert.plan.groupings import GROUPINGS, get_grouping
from mha2gqa.core.conversion_record import GUARD_MODES, GuardMode
from mha2gqa.core.devices import DEVICE_HELP, PRECISION_HELP, PRECISIONS, check_device_name
from mha2gqa.core.dims import parse_kv_heads_list
from mha2gqa.core.errors import SettingError
from mha2gqa.core.ranks import under_launcher
from mha2gqa.core.settings import check_switched, setting, validate
from mha2gqa.core.text import check_text_source
from mha2gqa.core.units import parse_size

#: How ``--per-layer auto`` measures each layer's loss at each KV-head count (recorded as said here).
COST_MEASURES = {
    "output": "the layer's output error with only that layer merged, relative to its output",
    "residual": "mean merge residual of the layer's groups",
    "logits": "the model's next-token KL with only that layer merged (its error carried through the later layers)",
}
_METHODS_HELP = "; ".join(f"{m.name}: {m.summary}" for m in METHODS.values())


#: --refit's Adam learning rate, relative to each projection's RMS (SmolLM2-135M's projections, RMS 0.05-0.4,
#: median ~0.2, took an absolute 3e-3 well: docs/methods.md, "Steps sized to the model")
REFIT_LR = 0.015
#: held-out calibration windows the stage guard scores on (of the calibration window each)
GUARD_WINDOWS = 4

#: The calibration window when none is given (cut to the model's positions).
CALIBRATION_WINDOW = 512
#: tokens a --refit step reads by default (whole windows, at least one): at a fixed cost more steps of
#: fewer tokens fit better, down to about this many (docs/methods.md, "The fit")
REFIT_STEP_TOKENS = 1024


def calibration_window(given: int | None, positions: int | None) -> int:
    """``--calibration-seq-len``, else :data:`CALIBRATION_WINDOW`, cut to the model's ``positions``."""
    return min(given or CALIBRATION_WINDOW, positions or CALIBRATION_WINDOW)


def refit_windows(given: int | None, window: int) -> int:
    """Windows of ``window`` tokens a --refit step reads: ``--refit-batch``, else as many as make
    :data:`REFIT_STEP_TOKENS` tokens (at least one)."""
    return given or max(1, REFIT_STEP_TOKENS // window)


#: the settings that shape a conversion's output, which its recipe file holds (:mod:`~mha2gqa.core.recipe_file`);
#: the others are the machine's and the run's (device, progress, overwrite...)
RECIPE_FIELDS = (
    *("num_kv_heads", "num_kv_heads_per_layer", "per_layer", "allocation_cost", "kv_budget", "method", "grouping"),
    *("calibration", "calibration_sha256", "calibration_tokens", "calibration_seq_len", "self_text"),
    *("refit", "refit_params", "refit_steps", "refit_target", "refit_lr", "refit_batch", "refit_tokens"),
    "refit_precision",
    *("guard", "guard_data", "seed", "max_shard_size"),
)


@dataclass
class ConvertSettings:
    """How a checkpoint is converted (``convert_checkpoint(src, dst, **fields)``)."""

    num_kv_heads: int | None = setting(
        None, help="KV heads after conversion (a divisor of the current count).", short="-g"
    )
    num_kv_heads_per_layer: str | None = setting(
        None,
        help="KV heads of each layer instead of -g, comma-separated "
        "(e.g. 8,8,4,2 for 4 layers), each a divisor of the current count; "
        "the output loads with mha2gqa's tools, and with transformers "
        "through trust_remote_code.",
    )
    per_layer: str | None = setting(
        None,
        help="auto: choose each layer's KV heads from calibration (where "
        "merging loses least) within the budget of -g per layer on average, or "
        "--kv-budget.",
        choices=("auto",),
    )
    allocation_cost: str = setting(
        "logits",
        help="How --per-layer auto measures a layer's loss at each count: "
        "logits (the layer run again with only it merged, by the method's own merge, and that "
        "error carried through the later layers to the model's next-token distribution: its KL to "
        "the original's on 4 calibration windows; sees how errors grow with depth), output (the "
        "same merge's error at the layer's own output) or residual (the K/V energy a shared head "
        "cannot hold, from the statistics alone).",
        choices=tuple(COST_MEASURES),
    )
    kv_budget: float | None = setting(
        None, help="KV heads per layer on average for --per-layer auto (e.g. 1.5) [default: -g].", above=0
    )
    method: str = setting("mean", help=f"How heads merge. {_METHODS_HELP}.", choices=tuple(METHODS))
    grouping: str = setting(
        "contiguous",
        help="Which heads share a KV head: " + "; ".join(f"{g.name}: {g.summary}" for g in GROUPINGS.values()) + ".",
        choices=tuple(GROUPINGS),
    )
    calibration: str | None = setting(
        None,
        help="Calibration text for svd / aligned / similarity grouping "
        "(a file or a datasets name, as for eval --data).",
    )
    calibration_sha256: str | None = setting(
        None,
        help="The sha256 the --calibration file must have (a recipe file's: the text the model was made with).",
    )
    calibration_tokens: int = setting(
        32768, help="Calibration tokens (the first N of the text; 32,768: see docs/methods.md).", minimum=1
    )
    calibration_seq_len: int | None = setting(
        None, help=f"Calibration window [default: min({CALIBRATION_WINDOW}, the model's positions)].", minimum=2
    )
    self_text: float | None = setting(
        None,
        help="Share of the calibration text the source model writes itself (as `mha2gqa self-text` "
        "samples, seeded by --seed, cached): mixed into --calibration at this share of the characters "
        "(0.25: a quarter), it is what the statistics, the refit and --distill read; the stage guard scores "
        "--calibration's own last windows and a held-out sample the model writes apart, each on its own. "
        "None: --calibration alone.",
        above=0,
        below=1,
    )
    refit: bool = setting(
        False,
        help="After the merge, refit each changed layer's projections (--refit-params) so that, given the "
        "converted model's own hidden states, it reproduces the original layer's output (or the stream "
        "after its attention: --refit-target) on the --calibration text, the error as the next norm reads "
        "it (each token's stream over its RMS; hidden dimensions louder than average relative to their "
        "size); a layer keeps its merged weights when refitting does not lower its held-out error.",
    )
    refit_params: str = setting(
        "q,k,v,o", help="Projections --refit fits, comma-separated from q,k,v,o (biases included)."
    )
    refit_steps: int = setting(
        120, help="Adam steps per layer of --refit (fewer when held-out error stops falling).", minimum=1
    )
    refit_target: str = setting(
        "attention",
        help="What --refit reproduces: attention (the residual stream after the attention block, where the "
        "layer reads its input only through it, checked on each layer: the rest of the layer is not run "
        "while fitting; others fall back to the layer's output) or layer (the layer's output).",
        choices=("attention", "layer"),
    )
    refit_lr: float = setting(
        REFIT_LR,
        help="Adam learning rate of --refit, relative to each projection's RMS (a step moves each weight by "
        "about this share of the projection's typical size, whatever the model's scale).",
        above=0,
        maximum=1,
    )
    refit_batch: int | None = setting(
        None,
        help=f"Calibration windows per --refit step [default: {REFIT_STEP_TOKENS:,} tokens' worth, at least one: "
        f"{refit_windows(None, CALIBRATION_WINDOW)} windows of {CALIBRATION_WINDOW}].",
        minimum=1,
    )
    refit_tokens: int = setting(
        16384,
        help="Tokens --refit fits on (the first N of --calibration; fewer when the text or "
        "--calibration-tokens has fewer).",
        minimum=1,
    )
    refit_precision: str = setting(
        "auto",
        help="Arithmetic of --refit's calibration pass, Adam steps and the layers' passes over its hidden states "
        "outside the converted attention (the states themselves, that attention, the held-out checks and "
        "closed-form solve, and the guard, stay float32): " + PRECISION_HELP,
        choices=PRECISIONS,
    )
    refit_memory: str = setting(
        "4GB",
        help="Hidden states --refit keeps in memory (two streams, three with --refit-target attention, "
        "float32); beyond this they go to a "
        "memory-mapped file beside DST.",
    )
    guard: str = setting(
        "undo",
        help=f"The model-level stage guard: after the merge, the refit (prefix by prefix of layers) and "
        f"--distill, the model's next-token KL to the original on {GUARD_WINDOWS} windows of the calibration "
        "text that no stage reads; undo: a stage that does not lower it is not published (nor the refit of "
        "layers after the best prefix); fail: stop with an error when a stage as run made the model worse; "
        "off: not measured.",
        choices=GUARD_MODES,
    )
    guard_data: tuple[str, ...] = setting(
        (),
        help=f"A further held-out text for the stage guard (repeatable; a file or datasets name, like "
        f"--calibration): its first {GUARD_WINDOWS} windows are scored after every stage too, and a stage is "
        "kept only where it also leaves each of these texts' KL no more than 1% above what it was (give a "
        "sample of what the model will serve: chat, code, stories). Each is reported on its own.",
        empty=True,
    )
    device: str = setting("auto", help=f"Where calibration runs: {DEVICE_HELP}")
    seed: int = setting(0, help="Seed of --method random and of --refit's window order.", minimum=0, maximum=2**63 - 1)
    max_shard_size: str = setting("5GB", help="Largest output shard, HF style ('5GB', '500MB').")
    revision: str | None = setting(None, help="Hub revision (branch, tag or commit) when SRC is a hub id.")
    overwrite: bool = setting(False, help="Replace DST if it exists and is not empty.")
    allow_pickle: bool = setting(False, help="Read PyTorch .bin checkpoints (with torch.load(weights_only=True)).")
    fsync: bool = setting(False, help="Flush every shard to disk before the output is renamed into place.")
    check_finite: bool = setting(
        False,
        help="Read every source tensor first and refuse NaN/Inf anywhere (tensors "
        "the method reads are always checked, with a warning).",
    )
    remove_stale: bool = setting(
        False,
        help="Delete temporary outputs beside DST left by killed runs (reported otherwise), and a stopped "
        "--refit or --distill run's finished work (kept for --resume).",
    )
    resume: bool = setting(
        False,
        help="Continue a stopped --refit or --distill conversion into DST from the layers it fitted and the "
        "distillation's newest checkpoint (kept beside DST until DST is published); the source, the "
        "calibration text and the recipe must be the same. The output equals an uninterrupted run's.",
    )
    progress: bool = setting(True, help="Progress bars.", cli=False, job=False)

    def check(self) -> ConvertSettings:
        """Every value checked (types, ranges, choices, how settings combine), before any work."""
        validate(self)
        if self.per_layer == "auto":
            if self.num_kv_heads_per_layer is not None:
                raise SettingError("num_kv_heads_per_layer", "--per-layer auto chooses each layer's count: drop {name}")
            if self.num_kv_heads is None and self.kv_budget is None:
                raise SettingError(
                    "per_layer",
                    "{name} auto needs a budget: -g G (as many KV heads as uniform G) or --kv-budget AVERAGE",
                )
        elif self.kv_budget is not None:
            raise SettingError("kv_budget", "{name} is the budget of --per-layer auto: add --per-layer auto")
        elif (self.num_kv_heads is None) == (self.num_kv_heads_per_layer is None):
            raise SettingError(
                "num_kv_heads", "give {name} (every layer) or --num-kv-heads-per-layer (each layer), one of the two"
            )
        self.per_layer_heads()
        check_device_name(self.device)
        check_text_source(self.calibration, "calibration")
        self._check_calibration_sha256()
        if self.self_text is not None and not self.calibration:
            raise SettingError("self_text", "{name} is the model's share of the calibration text: give --calibration")
        if self.self_text is not None and under_launcher():
            raise SettingError(
                "self_text",
                "{name} is written by one process: write it first (mha2gqa self-text SRC MIX.txt --mix TEXT "
                "--share S) and give --calibration MIX.txt under the launcher",
            )
        try:
            parse_size(self.max_shard_size)
        except Exception as e:
            raise SettingError("max_shard_size", f"{{name}} {self.max_shard_size}: {e}") from None
        self._check_refit()
        for text in self.guard_data:
            check_text_source(text, "guard_data")
        if self.guard_data and self.guard == GuardMode.OFF:
            raise SettingError("guard_data", "{name} is scored by the stage guard: drop --guard off, or {name}")
        method, grouping = get_method(self.method), get_grouping(self.grouping)
        if self.calibration and not self.reads_calibration:
            raise SettingError(
                "calibration",
                f"--method {method.name} with --grouping {grouping.name} does not read {{name}}: did you mean "
                "--method svd (or --refit after the merge)? Otherwise drop {name}",
            )
        if grouping.reorders and method.fresh:
            raise SettingError(
                "grouping",
                f"{{name}} {grouping.name} does not apply to --method {method.name} (fresh K/V ignore the grouping)",
            )
        return self

    def _check_calibration_sha256(self) -> None:
        """``calibration_sha256`` (a recipe's): the --calibration file is that very text."""
        from mha2gqa.core.text_ref import text_sha256

        if self.calibration_sha256 is None:
            return
        if not self.calibration:
            raise SettingError("calibration_sha256", "{name} checks --calibration: pass the text it names")
        found = text_sha256(self.calibration)
        if found != self.calibration_sha256:
            what = f"has sha256 {found[:12]}..." if found else "is not a local file"
            raise SettingError(
                "calibration_sha256",
                f"--calibration {self.calibration} {what}, not the text {{name}} names "
                f"({self.calibration_sha256[:12]}..., the text the recipe was made with): pass that text",
            )

    def _check_refit(self) -> None:
        self.refit_roles()
        try:
            parse_size(self.refit_memory)
        except Exception as e:
            raise SettingError("refit_memory", f"{{name}} {self.refit_memory}: {e}") from None
        check_switched(self, "refit")
        if self.refit and not self.calibration:
            raise SettingError("calibration", "--refit fits each layer on calibration text: pass {name} DATA")

    @property
    def reads_calibration(self) -> bool:
        """The method, grouping, per-layer allocation or refit reads calibration text."""
        method, grouping = get_method(self.method), get_grouping(self.grouping)
        return method.calibration != "none" or grouping.calibration != "none" or self.per_layer == "auto" or self.refit

    def recipe(self) -> dict:
        """The settings that shape the output (:data:`RECIPE_FIELDS`), portable: a local calibration
        file by its name and sha256 (never the path of this machine; ``--recipe`` finds it in the
        current folder or beside the recipe file, and refuses a text of another sha256)."""
        from mha2gqa.core.text_ref import portable_name, text_sha256

        out = {name: getattr(self, name) for name in RECIPE_FIELDS}
        if self.calibration:
            out["calibration"] = portable_name(self.calibration)
            out["calibration_sha256"] = text_sha256(self.calibration)
        out["guard_data"] = [portable_name(text) for text in self.guard_data]
        return out

    def refit_arithmetic(self) -> str:
        """``--refit-precision`` as this machine runs it: ``bf16`` (autocast) or ``no`` (float32), for the
        calibration pass that starts the refit, its Adam steps and its stream passes outside the converted
        attention (:func:`~mha2gqa.core.models.resolve_precision`; ``no`` without ``--refit``)."""
        from mha2gqa.core.models import arithmetic

        return arithmetic(self.refit_precision, self.device) if self.refit else "no"

    def refit_roles(self) -> tuple[str, ...]:
        """``--refit-params`` as roles in q, k, v, o order."""
        roles = [r.strip() for r in self.refit_params.split(",")]
        if not all(roles) or set(roles) - set("qkvo") or len(set(roles)) != len(roles):
            raise SettingError("refit_params", f"{{name}} {self.refit_params!r}: give some of q,k,v,o, comma-separated")
        return tuple(sorted(roles, key="qkvo".index))

    def per_layer_heads(self) -> tuple[int, ...] | None:
        """``--num-kv-heads-per-layer`` as integers (None when not given)."""
        if self.num_kv_heads_per_layer is None:
            return None
        return parse_kv_heads_list(self.num_kv_heads_per_layer)

    def budget(self, num_layers: int) -> int:
        """KV heads in all for --per-layer auto: ``--kv-budget`` (else ``-g``) times the layers, rounded."""
        return round((self.kv_budget if self.kv_budget is not None else self.num_kv_heads) * num_layers)

    def check_calibration(self) -> None:
        """Calibration text must be given when the method or grouping needs it (checked once the
        conversion is known to change the head count: an equal count is a copy and needs none)."""
        method, grouping = get_method(self.method), get_grouping(self.grouping)
        if not self.calibration and "required" in (method.calibration, grouping.calibration):
            what = f"--grouping {grouping.name}" if grouping.calibration == "required" else f"--method {method.name}"
            raise SettingError("calibration", f"{what} needs calibration text: pass {{name}} DATA")
