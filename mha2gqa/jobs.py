"""Job files: one YAML that describes a conversion sweep, its evaluation, gates and report.

``mha2gqa run JOB.yaml`` converts ``source`` to every ``num_kv_heads`` x ``methods``, evaluates each
conversion against the source, renders one report over all of them and checks the gates. The
source ``demo`` is the embedded model (trained once, cached, from the ``demo`` section); its data
``demo-heldout`` is the held-out CPython pydoc topics and ``demo-train`` (calibration, uptraining)
the training topics. With an ``uptrain`` section every conversion is also uptrained (the source as
teacher), evaluated in turn, and the report gains the recovery curves. The uptraining's evaluations and
its guard read the last tokens of its own data (``heldout_tokens``, :data:`UPTRAIN_HELDOUT` unless the
section says; never trained on), not the job's eval text: that text stays for the job's scores alone.

Each section is the settings dataclass of its command (:class:`ConvertSettings`,
:class:`EvalSettings`, :class:`UptrainSettings`, :class:`GateSettings`, :class:`DemoSettings`), so
its keys, defaults and checks are those of the command line; the whole file is checked before
anything runs.

    source: demo                 # a folder, a hub id, or demo
    demo: {steps: 400, ...}      # DemoSettings fields (source: demo only)
    convert: {num_kv_heads: [4, 2, 1], methods: [mean, svd], calibration: demo-train, ...}
    eval: {data: demo-heldout, protocols: [disjoint], seq_len: 128, batch_size: 8, ...}
    uptrain: {data: demo-train, max_steps: 100, lr: 1.0e-3, ...}  # optional
    gates: {max_ppl_ratio: 3.0, max_kl: 1.0, min_top1: 0.5}
    report: true
    output_dir: runs/demo        # relative to the job file's folder; demo: the cache folder
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from mha2gqa.convert.methods import METHODS
from mha2gqa.convert.settings import ConvertSettings
from mha2gqa.core.errors import Mha2GqaError, SettingError, first_line
from mha2gqa.core.ranks import one_process
from mha2gqa.core.recipe_file import DISTILL, REFIT
from mha2gqa.core.settings import Spec, check_value, from_mapping, setting, validate
from mha2gqa.demo import DEMO_ARCHITECTURES, DemoSettings
from mha2gqa.eval.gates import GateSettings
from mha2gqa.eval.settings import EvalSettings
from mha2gqa.pipeline.distill import DistillSettings, split_options
from mha2gqa.pipeline.recipe import Recipe
from mha2gqa.uptrain.settings import UptrainSettings

if TYPE_CHECKING:
    from mha2gqa.eval.tables import SweepRow

#: What a job's ``methods`` may list: every method, alone, refitted, distilled or both.
RECIPES = tuple(m + r + d for r in ("", REFIT) for d in ("", DISTILL) for m in METHODS)
#: The recipe the README recommends (its "Which method to use"; shipped jobs of real models use it).
RECOMMENDED = "svd" + REFIT

_TOP = ("name", "source", "demo", "convert", "eval", "uptrain", "gates", "report", "output_dir")


#: tokens at the end of a job's uptraining data held out for its evaluations and guard, unless its
#: ``uptrain`` section gives ``heldout_tokens`` (or ``eval_tokens``: as many as an evaluation reads)
UPTRAIN_HELDOUT = 8192


@dataclass
class Job:
    name: str
    source: str
    demo: DemoSettings
    num_kv_heads: tuple[int | tuple[int, ...], ...]  # a count for every layer, or each layer's own
    methods: tuple[str, ...]  # recipes: a method, then REFIT and DISTILL where the recipe has them
    convert: dict[str, Any] = field(default_factory=dict)  # further ConvertSettings fields
    distill: dict[str, Any] = field(default_factory=dict)  # DistillSettings fields (steps, lr) of +distill recipes
    eval: EvalSettings | None = None
    uptrain: dict[str, Any] = field(default_factory=dict)  # UptrainSettings fields ({}: no uptraining)
    gates: GateSettings = field(default_factory=GateSettings)
    report: bool = True
    output_dir: Path | None = None

    def recipe(self, num_kv_heads: int | tuple[int, ...], name: str, calibration: str | None = None) -> Recipe:
        """The recipe of one conversion of the sweep (checked): ``name`` (a method, ``+refit``,
        ``+distill``) with the job's ``convert`` section (its ``distill_*`` keys for a distilled one);
        the sweep's calibration text goes to the recipes that read it (a distilled one distils on it)."""
        options = {**self.convert, **({"calibration": calibration} if calibration else {})}
        fixed = {**heads_settings(num_kv_heads), "overwrite": True, "progress": False}
        return Recipe.named(name, {**fixed, **options}, self.distill)


def shipped_jobs() -> dict[str, Path]:
    """The job files that ship in ``configs/``, by name."""
    folder = resources.files("mha2gqa.configs")
    return {p.name.removesuffix(".yaml"): Path(str(p)) for p in folder.iterdir() if p.name.endswith(".yaml")}


def _section(data: dict[str, Any], key: str) -> dict[str, Any]:
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SettingError(key, "'{name}' must be a mapping")
    return value


#: Texts a job may name that exist only once the demo model is built.
DEMO_TEXTS = ("demo-train", "demo-heldout")


def _checkable(section: dict[str, Any]) -> dict[str, Any]:
    """``section`` with the demo's text names as datasets-like names, so its checks pass them."""
    keys = ("data", "eval_data", "calibration")
    return {k: f"demo:{v}" if k in keys and v in DEMO_TEXTS else v for k, v in section.items()}


def _sweep(conv: dict[str, Any]) -> tuple[tuple[int, ...], tuple[str, ...], dict[str, Any]]:
    """``num_kv_heads`` and ``methods`` (one value or a list each) and the other convert settings."""
    conv = dict(conv)
    heads = conv.pop("num_kv_heads", None)
    per_layer = conv.pop("num_kv_heads_per_layer", None)
    methods = conv.pop("methods", [ConvertSettings.method])  # the command line's default method
    heads = [] if heads is None and per_layer is not None else heads if isinstance(heads, list) else [heads]
    uniform = check_value("convert.num_kv_heads", [h for h in heads if not isinstance(h, list | str)],
                          tuple[int, ...], Spec("", minimum=1, empty=True))  # fmt: skip
    lists = [h for h in heads if isinstance(h, list | str)]  # per-layer entries among the counts ...
    lists += per_layer if isinstance(per_layer, list) and any(isinstance(x, list | str) for x in per_layer) else (
        [per_layer] if per_layer is not None else [])  # fmt: skip
    each = tuple(_per_layer(x) for x in lists)  # ... and under num_kv_heads_per_layer
    if not uniform and not each:
        raise SettingError("convert.num_kv_heads", "{name} needs a value: a count, a list of them, or per-layer lists")
    heads = (*uniform, *each)
    methods = check_value(
        "convert.methods",
        methods if isinstance(methods, list) else [methods],
        tuple[str, ...],
        Spec("", choices=RECIPES),
    )
    return heads, methods, conv


def _per_layer(value: Any) -> tuple[int, ...]:
    """A per-layer entry of a sweep: ``"4,1,2"`` or ``[4, 1, 2]``."""
    from mha2gqa.core.dims import parse_kv_heads_list

    if isinstance(value, list):
        value = ",".join(str(v) for v in value)
    if not isinstance(value, str):
        raise SettingError("convert.num_kv_heads_per_layer", f"{{name}} {value!r}: give each layer's count, e.g. 4,1,2")
    return parse_kv_heads_list(value, "convert.num_kv_heads_per_layer")


def heads_tag(heads: int | tuple[int, ...], sep: str = "-") -> str:
    """A sweep entry in file names (``4``, or ``4-1-2`` for each layer's own count) and, with ``sep``
    ``,``, in tables."""
    return sep.join(map(str, heads)) if isinstance(heads, tuple) else str(heads)


def heads_settings(heads: int | tuple[int, ...]) -> dict[str, Any]:
    """The ConvertSettings fields of a sweep entry: one count, or each layer's own."""
    if isinstance(heads, tuple):
        return {"num_kv_heads": None, "num_kv_heads_per_layer": heads_tag(heads, ",")}
    return {"num_kv_heads": heads}


def load_job(path: Path) -> Job:
    """Read a job file and check every section (types, values, combinations) before anything runs."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise Mha2GqaError(f"{path}: cannot read the job file: {first_line(e)}") from None
    try:
        return _parse(path, data)
    except SettingError as e:
        raise Mha2GqaError(f"{path}: {e}") from None


def _parse(path: Path, data: Any) -> Job:
    if not isinstance(data, dict):
        raise SettingError("job", "a job file is a mapping of sections")
    unknown = sorted(set(data) - set(_TOP))
    if unknown:
        raise SettingError(unknown[0], f"unknown top-level key '{{name}}'; known: {', '.join(_TOP)}")
    if "source" not in data or not isinstance(data["source"], str):
        raise SettingError("source", "'{name}' is required (a folder, a hub id, or demo)")
    demo = from_mapping(DemoSettings, _section(data, "demo"), "demo")
    heads, methods, conv = _sweep(_section(data, "convert"))
    conv, distill = split_options(conv)
    # keys and types here; every cell of the sweep, with its own method, in _check_sweep
    fixed = {**heads_settings(heads[0]), "method": ConvertSettings.method, "overwrite": True, "progress": False}
    from_mapping(ConvertSettings, _checkable(conv), "convert", fixed=fixed)  # keys and types
    from_mapping(DistillSettings, distill, "convert", fixed={"distill": True})
    ev = _section(data, "eval")
    if "data" not in ev:
        raise SettingError("eval.data", "{name} is required")
    evaluation = from_mapping(EvalSettings, _checkable(ev), "eval")
    try:
        evaluation.check()
    except SettingError as e:
        raise SettingError(e.setting, e.render(f"eval.{e.setting}")) from None
    evaluation.data = ev["data"]
    up = _section(data, "uptrain")
    if up and "data" not in up:
        raise SettingError("uptrain.data", "{name} is required (the training text)")
    if up:
        fixed = {"output": "-", "teacher": data["source"]}  # the job's own
        from_mapping(UptrainSettings, _checkable(up), "uptrain", fixed=fixed).check()
    gates = from_mapping(GateSettings, _section(data, "gates"), "gates")
    if gates.on_tasks and not evaluation.tasks:
        key = "max_task_drop" if gates.max_task_drop is not None else "task_alpha"
        raise SettingError(f"gates.{key}", "{name} gates the downstream tasks: give eval.tasks too")
    for key, kind in (("report", bool), ("name", str), ("output_dir", str)):
        if key in data and not isinstance(data[key], kind):
            raise SettingError(key, f"'{{name}}' must be {'true or false' if kind is bool else 'a string'}")
    job = Job(
        name=str(data.get("name", path.stem)),
        source=data["source"],
        demo=demo,
        num_kv_heads=heads,
        methods=methods,
        convert=conv,
        distill=distill,
        eval=evaluation,
        uptrain=up,
        gates=gates,
        report=data.get("report", True),
        output_dir=(path.parent / data["output_dir"]) if data.get("output_dir") else None,
    )
    _check_sweep(job)
    return job


def _check_sweep(job: Job) -> None:
    """Every conversion of the job's sweep checked now (its settings, the calibration it reads), and
    a ``convert.calibration`` some method of the sweep reads."""
    calibration = _checkable(job.convert).get("calibration")
    readers = []
    for method in job.methods:
        for g in job.num_kv_heads:
            try:
                settings = job.recipe(g, method, calibration).convert
                settings.check_calibration()
            except SettingError as e:
                raise SettingError(e.setting, e.render(f"convert.{e.setting}")) from None
        readers += [method] if settings.calibration else []
    if calibration and not readers:
        raise SettingError(
            "convert.calibration",
            f"no method of the sweep ({', '.join(job.methods)}) reads '{{name}}': add one that does (svd, aligned) "
            "or refit: true, or drop it",
        )


@dataclass
class DemoRequest:
    """``mha2gqa demo``: a job file (the shipped demo by default) with a few of its values replaced."""

    config: str | None = setting(None, help="Job file [default: the shipped configs/demo.yaml].")
    num_kv_heads: tuple[int, ...] | None = setting(
        None, help="KV-head counts (repeatable) [default: the job's].", short="-g", minimum=1
    )
    methods: tuple[str, ...] | None = setting(
        None,
        help="Recipes (repeatable): a method, then +refit and +distill where wanted (svd+refit, "
        "svd+refit+distill) [default: the job's].",
        flag="--method",
        choices=RECIPES,
    )
    steps: int | None = setting(None, help="Training steps of the demo model [default: the job's].", minimum=1)
    uptrain_steps: int | None = setting(
        None, help="Uptraining steps per conversion [default: the job's]; 0: none.", minimum=0
    )
    architecture: str | None = setting(
        None,
        help="The demo model's class [default: the job's; llama]; gpt_neox "
        "trains a Pythia-style model, converted through PhiForCausalLM.",
        choices=DEMO_ARCHITECTURES,
    )
    rebuild: bool = setting(False, help="Retrain the cached demo model.")

    def __post_init__(self) -> None:
        for name in ("num_kv_heads", "methods"):  # a repeatable option given no times: the job's own
            if getattr(self, name) == ():
                setattr(self, name, None)

    def job(self) -> Job:
        """The job to run: the file's, with this request's values in place of its own (checked)."""
        validate(self)
        job = load_job(Path(self.config) if self.config else shipped_jobs()["demo"])
        replaced = {k: v for k, v in (("steps", self.steps), ("architecture", self.architecture)) if v is not None}
        if replaced:
            job.demo = validate(dataclasses.replace(job.demo, **replaced))
        job.num_kv_heads = self.num_kv_heads or job.num_kv_heads
        job.methods = self.methods or job.methods
        if self.uptrain_steps == 0:
            job.uptrain = {}
        elif self.uptrain_steps is not None:
            job.uptrain = {**job.uptrain, "max_steps": self.uptrain_steps}
        return job


@dataclass
class RunResult:
    output_dir: Path
    results: list[Path]
    report: Path | None
    rows: list[SweepRow]
    gates_passed: bool


def _source(job: Job, log: Callable[[str], None]) -> tuple[str, Path]:
    """The model to convert and the default output folder."""
    from mha2gqa.core.cache import cache_root
    from mha2gqa.demo import demo_model

    if job.source == "demo":
        return str(demo_model(job.demo, log=log)), cache_root() / f"demo-{job.demo.key()}" / "run"
    return job.source, Path.cwd() / "mha2gqa-runs" / job.name


def _demo_text(job: Job, name: str | None) -> str | None:
    """``demo-train`` / ``demo-heldout`` as the cached text files; other names as they are."""
    from mha2gqa.demo import heldout_file, train_file

    files = dict(zip(DEMO_TEXTS, (train_file, heldout_file), strict=True))
    return str(files[name](job.demo)) if name in files else name


def _check_heads(job: Job, source: str) -> None:
    """Every KV-head count of the sweep must divide the source's, checked before the first conversion."""
    from mha2gqa.core.architecture import resolve
    from mha2gqa.serving.sizing import load_config

    try:
        dims = resolve(load_config(source)).dims  # BLOOM, T5...: refused with the reason convert gives
    except Mha2GqaError as e:
        raise Mha2GqaError(f"source {source}: {e}") from None
    for g in job.num_kv_heads:
        try:
            if isinstance(g, tuple):
                dims.check_kv_heads_per_layer(g, "num_kv_heads_per_layer")
            else:
                dims.check_kv_heads(g)
        except SettingError as e:
            raise Mha2GqaError(e.render(f"convert.{e.setting}")) from None


def _claim_run_folder(out: Path, job: Job, source: str, overwrite: bool) -> Path:
    """The job's output folder, owned by this run: a previous run's folder (ours) is replaced
    wholly, in one exchange, so results of two runs never mix, and only with ``overwrite``; a folder
    we did not write, or one holding an input, is refused."""
    import json

    from mha2gqa.core.output import check_destination, staged_output
    from mha2gqa.core.records import RUN_RECORD, now

    inputs = {
        "the source model": source,
        "the eval data": job.eval.data,
        "the calibration text": job.convert.get("calibration"),
        "the uptraining data": job.uptrain.get("data"),
    }
    out = check_destination(out, overwrite, inputs, "--output-dir")
    with staged_output(out, overwrite=True, inputs=inputs, what="--output-dir") as tmp:
        (tmp / RUN_RECORD).write_text(json.dumps({"job": job.name, "source": source, "created": now()}) + "\n")
    return out


def run_job(
    job: Job,
    output_dir: Path | None = None,
    log: Callable[[str], None] = print,
    progress: bool = False,
    overwrite: bool = False,
) -> RunResult:
    """Convert, evaluate, report and gate as the job says; returns where everything went. An earlier
    run's folder is replaced only with ``overwrite``. One process: refused under a launcher. Every
    stage shows its progress: tqdm's bars on the terminal with ``progress``, else a plain line in
    ``log`` at most every :data:`~mha2gqa.core.progress.PLAIN_SECONDS` (and each bar's last)."""
    from mha2gqa.core.progress import lines_to

    one_process("mha2gqa run", "each of its commands (convert, eval, uptrain) takes torchrun on its own")
    sink = contextlib.nullcontext() if progress else lines_to(lambda line: log("  " + line))
    with _quiet_bars(not progress), sink:
        return _run_job(job, output_dir, log, True, overwrite)


class _NotesOnce:
    """A job's log that says each ``note:`` / ``warning:`` line once, however many stages repeat it."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self.log, self.seen = log, set()

    def __call__(self, message: str, prefix: str = "") -> None:
        if message.startswith(("note:", "warning:")):
            if message in self.seen:
                return
            self.seen.add(message)
        self.log(prefix + message)


@contextlib.contextmanager
def _quiet_bars(quiet: bool):
    """transformers' own progress bars (loading and writing shards) off while a job runs quietly: its
    output is our lines only."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _run_job(
    job: Job, output_dir: Path | None, log: Callable[[str], None], progress: bool, overwrite: bool
) -> RunResult:
    from mha2gqa.eval.report import load_results, load_runs, render

    log = _NotesOnce(log)  # a sweep repeats the same notes for every conversion: each is said once
    source, default_out = _source(job, log)
    _check_heads(job, source)
    out = _claim_run_folder(Path(output_dir or job.output_dir or default_out), job, source, overwrite)
    # Every stage is scored against one cached copy of the source's scores (one model in memory).
    cache = job.eval.reference_cache or str(out / ".reference")
    settings = dataclasses.replace(
        job.eval, data=_demo_text(job, job.eval.data), progress=progress, reference_cache=cache
    )
    calibration = _demo_text(job, job.convert.get("calibration"))
    up = {**job.uptrain, "data": _demo_text(job, job.uptrain.get("data"))} if job.uptrain else {}
    paths: list[Path] = []
    runs: list[Path] = []
    rows: list[SweepRow] = []
    passed = True
    for method in job.methods:
        for g in job.num_kv_heads:
            tag = f"{method}-g{heads_tag(g)}"
            model_dir = out / "models" / tag
            conv = _convert_stage(job, source, model_dir, g, method, calibration, progress, log)
            log(f"converted {tag}: {conv.summary()}")
            stages = [(tag, method, model_dir)]
            if up:
                up_dir = out / "models" / f"{tag}-uptrained"
                _uptrain_stage(model_dir, up_dir, up, source, settings, tag, log)
                stages.append((f"{tag}-uptrained", f"{method}+uptrain", up_dir))
                runs.append(up_dir)
            for stage_tag, label, stage_dir in stages:
                stage = _Stage(stage_tag, label, stage_dir, g, conv)
                path, row, ok = _evaluate_stage(source, stage, settings, job, out, log)
                paths.append(path)
                rows.append(row)
                passed &= ok
    if job.eval.reference_cache is None:
        shutil.rmtree(cache, ignore_errors=True)
    report = None
    if job.report and paths:
        log(f"rendering the report: {len(paths)} comparison(s)" + (f", {len(runs)} uptraining run(s)" if runs else ""))
        pages = render(load_results(paths), out / "report.html", out / "report.md", load_runs(runs), log=log)
        report = pages["html"]
    return RunResult(out, paths, report, rows, passed)


def _convert_stage(job: Job, source: str, dst: Path, g, recipe: str, calibration: str | None, progress: bool, log):
    """One conversion of the sweep, through the pipeline as ``mha2gqa convert`` runs it, so a job and the
    command line make the same model; each refitted layer and each guard decision in the job's log."""
    from mha2gqa.pipeline import prepare

    how = job.recipe(g, recipe, calibration).replace(progress=progress)
    return prepare(how, source, dst, log=lambda m: log(m, "  ")).run().conversion


def _uptrain_stage(
    student: Path, out: Path, up: dict[str, Any], teacher: str, settings: EvalSettings, tag: str, log
) -> None:
    """Uptrain a job's conversion ``student`` into ``out`` with ``up`` (distilling from the source,
    evaluated on the held-out tail of its data, which its guard chooses on: an undone run leaves the
    conversion as it was, and its results name it ``+uptrain(undone)``)."""
    from mha2gqa.pipeline import prepare_uptrain

    s = UptrainSettings(**up, output=str(out), teacher=teacher, overwrite=True, progress=settings.progress)
    s = dataclasses.replace(s, heldout_tokens=s.heldout_tokens or s.eval_tokens or UPTRAIN_HELDOUT)
    result = prepare_uptrain(str(student), s, log=lambda m: log(m, f"  {tag}: ")).run()
    log(f"uptrained {tag}: {result.summary()}")


@dataclass(frozen=True)
class _Stage:
    """One model of a sweep to evaluate: its ``tag`` (results name), ``label`` (the recipe where the
    model's records do not name one), folder, KV heads ``g`` and the conversion it came from."""

    tag: str
    label: str
    model_dir: Path
    g: Any
    conv: Any


def _evaluate_stage(
    source: str, stage: _Stage, settings, job: Job, out: Path, log: _NotesOnce
) -> tuple[Path, SweepRow, bool]:
    """Evaluate one converted (or uptrained) model against the source, gate it, write its results;
    returns the results path, the summary row and whether its gates passed."""
    tag, label, model_dir, g, conv = stage.tag, stage.label, stage.model_dir, stage.g, stage.conv
    from mha2gqa.eval.outcome import EvalRequest
    from mha2gqa.eval.tables import SweepRow, task_cell, verdict_cell

    log(f"evaluating {tag} against the original")
    path = out / "results" / f"{tag}.json"
    prepared = EvalRequest(source, str(model_dir), settings, job.gates, output=path).prepare(checked=True)
    outcome = prepared.run(log=lambda m: log(m, "  "))
    typed = outcome.results
    p = typed.headline
    row = SweepRow(
        tag=tag,
        method=typed.converted.recipe or label,
        num_kv_heads=heads_tag(g, ","),
        original_ppl=p.original.ppl,
        converted_ppl=p.converted.ppl,
        ppl_ratio=p.ppl_ratio,
        kl_mean=typed.agreement.kl.mean,
        top1=typed.agreement.top1_agreement,
        kv_bytes_per_token=conv.facts.kv_cache_bytes_per_token_after,
        kv_bytes_per_token_before=conv.facts.kv_cache_bytes_per_token_before,
        verdict=verdict_cell(typed),
        tasks=task_cell(typed) if typed.tasks is not None else None,
    )
    log(
        f"  {tag}: perplexity {row.converted_ppl:.3f} (x{row.ppl_ratio:.3f} the original's, "
        f"{p.original.tokens:,} tokens), KL {row.kl_mean:.4f}, top-1 {row.top1:.1%}"
    )
    for line in outcome.lines():  # the gates, then the verdict
        log(f"  {tag}: {line}")
    return path, row, outcome.passed
