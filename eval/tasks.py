"""Downstream tasks through lm-evaluation-harness, each model handed over already loaded, and the
converted model's difference from the original tested on the paired per-example results.

:func:`select_tasks` resolves the task names before any model loads (a local ``--include-path``
alone when it holds every named task: the harness's full index takes ~10 s to build);
:func:`score_tasks` runs one model through ``lm_eval.simple_evaluate`` (its own seeds, prompts,
few-shot sampling and metrics, so the numbers are the ones ``lm_eval --model hf`` prints for the
same folder, dtype and batch size) and keeps each example's metric values; :func:`compare_tasks`
builds the results' ``tasks`` section: per task (and group) and metric both models' value ± stderr
and the paired test of :mod:`mha2gqa.eval.paired` on the same examples.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mha2gqa.core.errors import Mha2GqaError, SettingError
from mha2gqa.eval.paired import ALPHA, BOOTSTRAP_ITERS, PairedTest, paired_test

#: How to get the optional dependency.
INSTALL = "pip install 'mha2gqa[tasks]'"
#: lm-evaluation-harness's name for "no filter" in its ``metric,filter`` keys.
_NO_FILTER = "none"


def lm_eval_version() -> str:
    """The installed lm-evaluation-harness version; a one-line error naming the extra when absent."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        import lm_eval  # noqa: F401

        return version("lm_eval")
    except (ImportError, PackageNotFoundError):
        raise Mha2GqaError(f"--tasks runs lm-evaluation-harness, which is not installed: {INSTALL}") from None


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """lm-eval's info and warning logs (a pre-loaded model, seeds, dataset builders) kept out of the
    terminal; errors still show."""
    loggers = [logging.getLogger(n) for n in ("lm_eval", "lm-eval")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


@contextlib.contextmanager
def _no_git_probe() -> Iterator[None]:
    """``simple_evaluate`` records the git commit of the working directory by running ``git describe``,
    which prints "fatal: not a git repository" outside one; the results keep mha2gqa's own revision."""
    from lm_eval import evaluator

    probe = getattr(evaluator, "get_git_commit_hash", None)
    if probe is not None:
        evaluator.get_git_commit_hash = lambda: None
    try:
        yield
    finally:
        if probe is not None:
            evaluator.get_git_commit_hash = probe


def check_tasks(include_path: str | None) -> None:
    """What ``--tasks`` needs before anything loads: the harness installed, ``include_path`` a folder
    of task YAML files."""
    lm_eval_version()
    if include_path is not None:
        folder = Path(include_path)
        if not folder.is_dir():
            raise SettingError("include_path", f"{{name}} {include_path}: not a folder of task YAML files")
        if not any(folder.rglob("*.yaml")):
            raise SettingError("include_path", f"{{name}} {include_path}: holds no .yaml task files")


@dataclass
class TaskSelection:
    """The named tasks, resolved: what ``simple_evaluate`` gets, and the manager that knows them."""

    names: list[str]
    manager: Any  # lm_eval.tasks.TaskManager


def select_tasks(tasks: tuple[str, ...], include_path: str | None) -> TaskSelection:
    """Resolve ``tasks`` (names, groups, tags or globs) against ``include_path`` and, when it does not
    hold them all, the harness's own tasks; refuses an unknown name before any work."""
    check_tasks(include_path)
    from lm_eval.tasks import TaskManager

    with _quiet():
        manager = None
        if include_path is not None:
            local = TaskManager(include_path=include_path, include_defaults=False)
            if all(local.match_tasks([t]) for t in tasks):
                manager = local
        manager = manager or TaskManager(include_path=include_path)
        unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        where = f" (nor in --include-path {include_path})" if include_path else ""
        raise SettingError(
            "tasks",
            f"{{name}}: lm-evaluation-harness knows no task {unknown[0]!r}{where}; "
            "list them with `lm_eval ls tasks`, or give --include-path with its YAML",
        )
    names = list(dict.fromkeys(n for t in tasks for n in manager.match_tasks([t])))
    _check_task_data(manager, names)
    return TaskSelection(names, manager)


def _check_task_data(manager: Any, names: list[str]) -> None:
    """Load each task (its documents from the datasets cache, or the hub) before any model is scored:
    a task whose data cannot be had (offline and not cached, a dataset that is gone) is refused in
    one line naming it, instead of failing after the original has been scored."""
    load = getattr(manager, "load", None)
    for name in names:
        try:
            with _quiet():
                if load is not None:
                    load([name])
                else:  # an older harness
                    from lm_eval.tasks import get_task_dict

                    get_task_dict([name], manager)
        except (OSError, ValueError, ImportError) as e:  # ConnectionError is an OSError
            why = " ".join(str(e).split())[:200] or type(e).__name__
            raise SettingError(
                "tasks",
                f"{{name}}: the data of task {name!r} cannot be loaded ({why}); offline it must already be in the "
                "datasets cache (run once with network), or give --include-path with a task on local files",
            ) from None


@dataclass
class MetricScore:
    """One metric of one task for one model: the harness's value and stderr, and the per-example
    values (``None`` when the metric is not a mean of per-example numbers, e.g. corpus BLEU)."""

    value: float
    stderr: float | None
    examples: list[float] | None


@dataclass
class ModelTasks:
    """One model's task results: per row (task or group) and metric, and the rows' descriptions."""

    scores: dict[str, dict[str, MetricScore]]  # row -> metric -> score
    rows: dict[str, dict[str, Any]]  # row -> {group, top_level, version, num_fewshot, n, higher_is_better}
    keys: dict[str, list[tuple[str, int, str]]]  # row -> its examples' (task, doc_id, prompt hash)
    seconds: float


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _count(v: Any) -> int | None:
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) and float(v).is_integer() else None


def _leaves(row: str, subtasks: dict[str, list[str]]) -> list[str]:
    """The tasks under ``row`` (itself when it is a task), groups expanded recursively."""
    if row not in subtasks:
        return [row]
    return [leaf for sub in subtasks[row] for leaf in _leaves(sub, subtasks)]


def _ordered(rows: list[str], subtasks: dict[str, list[str]], children: set[str]) -> list[str]:
    """``rows`` with each group right before its own tasks (the harness lists subtasks first)."""
    out: list[str] = []

    def visit(row: str) -> None:
        if row in rows and row not in out:
            out.append(row)
        for sub in subtasks.get(row, []):
            visit(sub)

    for row in rows:
        if row not in children:
            visit(row)
    return out + [r for r in rows if r not in out]


def _metric_name(metric: str, filt: str) -> str:
    return metric if filt == _NO_FILTER else f"{metric}[{filt}]"


def score_tasks(
    selection: TaskSelection, model: Any, tokenizer: Any, num_fewshot: int | None, limit: int | None, batch_size: int
) -> ModelTasks:
    """Run the selected tasks on the already-loaded ``model`` (one process) and read its results."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    start = time.perf_counter()
    with _quiet(), _no_git_probe():
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        out = lm_eval.simple_evaluate(
            model=lm,
            tasks=selection.names,
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=selection.manager,
            log_samples=True,
        )
    seconds = time.perf_counter() - start
    if out is None:
        raise Mha2GqaError("lm-evaluation-harness returned no results (was this run under several processes?)")
    subtasks = {g: list(s) for g, s in (out.get("group_subtasks") or {}).items() if s}
    children = {s for subs in subtasks.values() for s in subs}
    scores: dict[str, dict[str, MetricScore]] = {}
    rows: dict[str, dict[str, Any]] = {}
    keys: dict[str, list[tuple[str, int, str]]] = {}
    samples = {task: sorted(docs, key=lambda s: s["doc_id"]) for task, docs in (out.get("samples") or {}).items()}
    for row in _ordered(list(out["results"]), subtasks, children):
        entry = out["results"][row]
        leaves = _leaves(row, subtasks)
        metrics: dict[str, MetricScore] = {}
        for key, value in entry.items():
            if "," not in key or "_stderr," in key or _number(value) is None:
                continue
            metric, filt = key.split(",", 1)
            examples = _examples(samples, leaves, metric, filt)
            stderr = _number(entry.get(f"{metric}_stderr,{filt}"))
            metrics[_metric_name(metric, filt)] = MetricScore(float(value), stderr, examples)
        scores[row] = metrics
        better = (out.get("higher_is_better") or {}).get(row) or {}
        n = sum(int((out.get("n-samples") or {}).get(leaf, {}).get("effective", 0)) for leaf in leaves)
        rows[row] = {
            "group": row in subtasks,
            "top_level": row not in children,
            "version": str((out.get("versions") or {}).get(row, "")),
            "num_fewshot": _count((out.get("n-shot") or {}).get(row)),
            "n": n,
            "higher_is_better": {
                name: better.get(name.split("[")[0]) for name in metrics if better.get(name.split("[")[0]) is not None
            },
        }
        first = next(iter(metrics), None)
        filt = first.split("[", 1)[1][:-1] if first and "[" in first else _NO_FILTER
        keys[row] = [
            (leaf, int(s["doc_id"]), str(s.get("prompt_hash", "")))
            for leaf in leaves
            for s in samples.get(leaf, [])
            if s.get("filter", _NO_FILTER) == filt
        ]
    return ModelTasks(scores, rows, keys, seconds)


def _examples(samples: dict[str, list[dict]], leaves: list[str], metric: str, filt: str) -> list[float] | None:
    """Each example's value of ``metric`` under filter ``filt``, over ``leaves`` in (task, doc) order
    (``samples``: each task's records sorted by doc); None unless every value is a number (a
    corpus-level metric keeps references, not scores)."""
    out: list[float] = []
    for leaf in leaves:
        for s in samples.get(leaf, []):
            if s.get("filter", _NO_FILTER) != filt:
                continue
            v = _number(s.get(metric))
            if v is None:
                return None
            out.append(v)
    return out or None


@dataclass
class TaskScore:
    value: float
    stderr: float | None = None


@dataclass
class TaskMetric:
    """One metric of one task: both models' values and the paired test (None where the metric has no
    per-example numbers, with ``note`` saying why)."""

    metric: str
    original: TaskScore
    converted: TaskScore | None = None
    higher_is_better: bool | None = None
    paired: PairedTest | None = None
    note: str | None = None


@dataclass
class TaskRow:
    """A task or a group (a group's paired tests pool its tasks' examples)."""

    task: str
    group: bool
    top_level: bool  # named (or reached through a tag), not a subtask of another row: what gates read
    n: int
    metrics: list[TaskMetric]
    version: str = ""
    num_fewshot: int | None = None


@dataclass
class TasksSection:
    """The results' ``tasks`` section."""

    settings: dict[str, Any]
    lm_eval_version: str
    rows: list[TaskRow]
    seconds: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare_tasks(
    selection: TaskSelection,
    settings: dict[str, Any],
    original: ModelTasks,
    converted: ModelTasks | None,
    alpha: float = ALPHA,
) -> TasksSection:
    """The ``tasks`` section: every row of the original's results with both models' metrics and,
    for a pair, the paired test of each metric on the examples both answered (checked the same)."""
    rows = []
    for name, info in original.rows.items():
        if converted is not None and original.keys[name] != converted.keys.get(name):
            raise Mha2GqaError(
                f"task {name}: the two models were not asked the same examples (different prompts or documents); "
                "evaluate both with the same tokenizer, --num-fewshot and --limit"
            )
        metrics = []
        for metric, score in original.scores[name].items():
            other = converted.scores[name].get(metric) if converted is not None else None
            better = info["higher_is_better"].get(metric)
            entry = TaskMetric(metric, TaskScore(score.value, score.stderr), higher_is_better=better)
            if other is not None:
                entry.converted = TaskScore(other.value, other.stderr)
                if score.examples is not None and other.examples is not None:
                    entry.paired = paired_test(score.examples, other.examples, better is not False, alpha)
                else:
                    entry.note = "no per-example values (a corpus-level metric): no paired test"
            metrics.append(entry)
        rows.append(
            TaskRow(name, info["group"], info["top_level"], info["n"], metrics, info["version"], info["num_fewshot"])
        )
    seconds = {"original": original.seconds, **({"converted": converted.seconds} if converted else {})}
    full = {**settings, "resolved": selection.names, "alpha": alpha, "bootstrap_iters": BOOTSTRAP_ITERS}
    return TasksSection(full, lm_eval_version(), rows, seconds)
