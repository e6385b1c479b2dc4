"""Job files: one YAML that describes a conversion sweep, its evaluation, gates and report.

``mha2gqa run JOB.yaml`` converts ``source`` to every ``num_kv_heads`` x ``methods``, evaluates each
conversion against the source, renders one report over all of them and checks the gates. The
source ``demo`` is the embedded model (trained once, cached, from the ``demo`` section); its data
``demo-heldout`` is the held-out CPython pydoc topics and ``demo-train`` (calibration) the training
topics. With an ``uptrain`` section every conversion is also uptrained (the source as teacher, the
eval data held out), evaluated in turn, and the report gains the recovery curves. Unknown keys are
errors.

    source: demo                 # a folder, a hub id, or demo
    demo: {steps: 400, ...}      # DemoSettings fields (source: demo only)
    convert: {num_kv_heads: [4, 2, 1], methods: [mean, svd], calibration: demo-train, max_shard_size: 5GB}
    eval: {data: demo-heldout, protocols: [disjoint], seq_len: 128, batch_size: 8, ...}
    uptrain: {data: demo-train, max_steps: 100, lr: 1.0e-3, ...}  # optional: UptrainSettings fields
    gates: {max_ppl_ratio: 3.0, max_kl: 1.0, min_top1: 0.5}
    report: true
    output_dir: runs/demo        # relative to the job file's folder; demo: the cache folder
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from mha2gqa.demo import DemoSettings
from mha2gqa.errors import Mha2GqaError

_TOP = {"name", "source", "demo", "convert", "eval", "uptrain", "gates", "report", "output_dir"}
_CONVERT = {"num_kv_heads", "methods", "max_shard_size", "calibration", "calibration_tokens", "grouping"}
_EVAL = {"data", "text_field", "doc_split", "protocols", "seq_len", "stride", "max_tokens", "batch_size", "device",
         "dtype", "attention", "attention_seq_len"}  # fmt: skip
_GATES = {"max_ppl_ratio", "max_kl", "min_top1"}
#: UptrainSettings fields a job may set (output, teacher and eval data come from the job)
_UPTRAIN = {"data", "text_field", "doc_split", "objective", "kd_weight", "temperature", "train", "lora_rank",
            "lora_alpha", "lora_dropout", "max_steps", "max_tokens", "batch_size", "grad_accum", "seq_len", "lr",
            "min_lr_ratio", "warmup_steps", "weight_decay", "adam_beta2", "max_grad_norm", "seed", "eval_every",
            "eval_tokens", "eval_seq_len", "eval_batch_size", "save_every", "save_total_limit", "log_every", "device",
            "mixed_precision", "gradient_checkpointing"}  # fmt: skip


@dataclass
class Job:
    name: str
    source: str
    demo: DemoSettings
    num_kv_heads: tuple[int, ...]
    methods: tuple[str, ...]
    max_shard_size: str = "5GB"
    calibration: str | None = None
    calibration_tokens: int = 16384
    grouping: str = "contiguous"
    eval: dict[str, Any] = field(default_factory=dict)
    uptrain: dict[str, Any] = field(default_factory=dict)
    gates: dict[str, float] = field(default_factory=dict)
    report: bool = True
    output_dir: Path | None = None


def shipped_jobs() -> dict[str, Path]:
    """The job files that ship in ``configs/``, by name."""
    folder = resources.files("mha2gqa.configs")
    return {p.name.removesuffix(".yaml"): Path(str(p)) for p in folder.iterdir() if p.name.endswith(".yaml")}


def _check_keys(where: str, data: Any, allowed: set[str], path: Path) -> dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise Mha2GqaError(f"{path}: '{where}' must be a mapping")
    unknown = set(data) - allowed
    if unknown:
        raise Mha2GqaError(f"{path}: unknown keys in '{where}': {sorted(unknown)}; known: {sorted(allowed)}")
    return data


def load_job(path: Path) -> Job:
    """Read and validate a job file."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise Mha2GqaError(f"{path}: cannot read the job file: {e}") from None
    data = _check_keys("top level", data, _TOP, path)
    if "source" not in data:
        raise Mha2GqaError(f"{path}: 'source' is required (a folder, a hub id, or demo)")
    demo_fields = {f.name for f in dataclasses.fields(DemoSettings)}
    demo = DemoSettings(**_check_keys("demo", data.get("demo"), demo_fields, path))
    conv = _check_keys("convert", data.get("convert"), _CONVERT, path)
    ev = _check_keys("eval", data.get("eval"), _EVAL, path)
    gates = _check_keys("gates", data.get("gates"), _GATES, path)
    up = _check_keys("uptrain", data.get("uptrain"), _UPTRAIN, path)
    if up and "data" not in up:
        raise Mha2GqaError(f"{path}: uptrain.data is required (the training text)")
    g = conv.get("num_kv_heads", [])
    heads = tuple(g if isinstance(g, list) else [g])
    methods = tuple(conv.get("methods", ["mean"]))
    if not heads or not all(isinstance(x, int) and x > 0 for x in heads):
        raise Mha2GqaError(f"{path}: convert.num_kv_heads must be a positive integer or a list of them")
    from mha2gqa.convert.converter import ALL_METHODS

    bad = [m for m in methods if m not in ALL_METHODS]
    if bad:
        raise Mha2GqaError(f"{path}: unknown methods {bad}; choose from {', '.join(ALL_METHODS)}")
    if "data" not in ev:
        raise Mha2GqaError(f"{path}: eval.data is required")
    out = data.get("output_dir")
    return Job(
        name=str(data.get("name", path.stem)),
        source=str(data["source"]),
        demo=demo,
        num_kv_heads=heads,
        methods=methods,
        max_shard_size=str(conv.get("max_shard_size", "5GB")),
        calibration=conv.get("calibration"),
        calibration_tokens=int(conv.get("calibration_tokens", 16384)),
        grouping=str(conv.get("grouping", "contiguous")),
        eval=ev,
        uptrain=up,
        gates={k: float(v) for k, v in gates.items()},
        report=bool(data.get("report", True)),
        output_dir=(path.parent / out) if out else None,
    )


@dataclass
class RunResult:
    output_dir: Path
    results: list[Path]
    report: Path | None
    rows: list[dict[str, Any]]
    gates_passed: bool


def run_job(
    job: Job, output_dir: Path | None = None, log: Callable[[str], None] = print, progress: bool = False
) -> RunResult:
    """Convert, evaluate, report and gate as the job says; returns where everything went."""
    from mha2gqa.convert import convert_checkpoint
    from mha2gqa.demo import cache_root, demo_model, heldout_file, train_file
    from mha2gqa.eval.harness import EvalSettings
    from mha2gqa.eval.report import load_results, load_runs, render
    from mha2gqa.uptrain import UptrainSettings, uptrain

    if job.source == "demo":
        source = str(demo_model(job.demo, log=log))
        default_out = cache_root() / f"demo-{job.demo.key()}" / "run"
    else:
        source = job.source
        default_out = Path.cwd() / "mha2gqa-runs" / job.name
    out = Path(output_dir or job.output_dir or default_out)
    out.mkdir(parents=True, exist_ok=True)
    ev = dict(job.eval)
    if ev["data"] == "demo-heldout":
        ev["data"] = str(heldout_file(job.demo))
    calibration = str(train_file(job.demo)) if job.calibration == "demo-train" else job.calibration
    ev["protocols"] = tuple(ev.get("protocols", ("disjoint",)))
    settings = EvalSettings(**ev, progress=progress)
    up = dict(job.uptrain)
    if up.get("data") == "demo-train":
        up["data"] = str(train_file(job.demo))
    paths: list[Path] = []
    runs: list[Path] = []
    rows: list[dict[str, Any]] = []
    passed = True
    for method in job.methods:
        for g in job.num_kv_heads:
            tag = f"{method}-g{g}"
            model_dir = out / "models" / tag
            conv = convert_checkpoint(source, model_dir, g, method, max_shard_size=job.max_shard_size, overwrite=True,
                                      progress=progress, calibration=calibration,
                                      calibration_tokens=job.calibration_tokens, grouping=job.grouping)  # fmt: skip
            log(f"converted {tag}: {conv.summary()}")
            stages = [(tag, method, model_dir)]
            if up:
                up_dir = out / "models" / f"{tag}-uptrained"
                result = uptrain(str(model_dir), UptrainSettings(**up, output=str(up_dir), teacher=source,
                                 eval_data=ev["data"], overwrite=True, progress=progress),
                                 log=lambda m: None)  # fmt: skip
                log(f"uptrained {tag}: {result.summary()}")
                stages.append((f"{tag}-uptrained", f"{method}+uptrain", up_dir))
                runs.append(up_dir)
            for stage_tag, label, stage_dir in stages:
                path, row, ok = _evaluate_stage(source, stage_dir, stage_tag, label, g, conv, settings, job, out, log)
                paths.append(path)
                rows.append(row)
                passed &= ok
    report = None
    if job.report and paths:
        report = render(load_results(paths), out / "report.html", out / "report.md", load_runs(runs))["html"]
    return RunResult(out, paths, report, rows, passed)


def _evaluate_stage(source: str, model_dir: Path, tag: str, label: str, g: int, conv, settings, job: Job, out: Path,
                    log: Callable[[str], None]) -> tuple[Path, dict[str, Any], bool]:  # fmt: skip
    """Evaluate one converted (or uptrained) model against the source, gate it, write its results;
    returns the results path, the summary row and whether its gates passed."""
    from mha2gqa.eval.gates import check_gates, gates_record, verdict
    from mha2gqa.eval.harness import evaluate, write_results

    results = evaluate(source, str(model_dir), settings)
    gates = check_gates(results, **{k: job.gates.get(k) for k in ("max_ppl_ratio", "max_kl", "min_top1")})
    passed = True
    if gates:
        results["gates"] = gates_record(gates)
        passed = results["gates"]["passed"]
        log(f"  {tag}: {verdict(gates)}")
    path = out / "results" / f"{tag}.json"
    write_results(results, path)
    p = results["protocols"].get("disjoint") or next(iter(results["protocols"].values()))
    row = {"tag": tag, "method": label, "num_kv_heads": g, "original_ppl": p["original"]["ppl"],
           "converted_ppl": p["converted"]["ppl"], "ppl_ratio": p["ppl_ratio"],
           "kl_mean": results["agreement"]["kl"]["mean"], "top1": results["agreement"]["top1_agreement"],
           "kv_bytes_per_token": conv.kv_cache_bytes_per_token_after,
           "kv_bytes_per_token_before": conv.kv_cache_bytes_per_token_before}  # fmt: skip
    return path, row, passed
