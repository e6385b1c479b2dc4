"""Downstream tasks (``eval --tasks``): the paired tests against hand and scipy values, and a local
multiple-choice task run on the real MHA fixture and two conversions of it, equal to
``lm_eval --model hf`` run directly on the same folders."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import FIXTURES, eval_error, requires_fixtures

from mha2gqa.cli import main
from mha2gqa.eval import paired
from mha2gqa.eval.paired import mcnemar_exact, paired_bootstrap, paired_test
from mha2gqa.eval.results import Results


# -- the paired tests -----------------------------------------------------------------------------
def test_mcnemar_exact_equals_hand_values():
    assert mcnemar_exact(0, 0) == 1.0 and mcnemar_exact(4, 4) == 1.0
    assert mcnemar_exact(3, 0) == 2 * 1 / 8  # P[X <= 0], X ~ Bin(3, 1/2), doubled
    assert mcnemar_exact(1, 5) == 2 * (1 + 6) / 64  # C(6,0) + C(6,1) over 2^6, doubled
    assert mcnemar_exact(9, 1) == 2 * (1 + 10) / 1024
    assert mcnemar_exact(5, 4) == 1.0  # doubled tail past 1
    with pytest.raises(ValueError):
        mcnemar_exact(-1, 3)


@pytest.mark.parametrize("b,c", [(30, 7), (16, 8), (1, 4), (500, 430), (3000, 2800), (12, 0)])
def test_mcnemar_exact_equals_scipy(b, c):
    binomtest = pytest.importorskip("scipy.stats").binomtest
    assert mcnemar_exact(b, c) == pytest.approx(binomtest(min(b, c), b + c, 0.5).pvalue, rel=1e-10)


def test_mcnemar_log_space_equals_exact_integers(monkeypatch):
    exact = [mcnemar_exact(b, c) for b, c in ((700, 640), (60, 41), (2000, 1990))]
    monkeypatch.setattr(paired, "EXACT_UP_TO", 10)
    assert [mcnemar_exact(b, c) for b, c in ((700, 640), (60, 41), (2000, 1990))] == pytest.approx(exact, rel=1e-9)


def test_paired_test_calls_a_real_drop_significant_and_noise_not():
    rng = random.Random(0)
    original = [1.0] * 300 + [0.0] * 100
    # 40 examples lost, 8 gained: a drop (McNemar p < 1e-5)
    converted = [0.0 if i < 40 else 1.0 for i in range(300)] + [1.0 if i < 8 else 0.0 for i in range(100)]
    t = paired_test(original, converted)
    assert (t.test, t.only_original, t.only_converted) == ("mcnemar-exact", 40, 8)
    assert t.significant and t.drop == pytest.approx(32 / 400) and t.p_value == mcnemar_exact(40, 8)
    assert t.ci_low < -0.05 < t.ci_high < 0  # the interval of the difference excludes 0
    # 9 lost, 6 gained: not significant
    noise = [0.0 if i < 9 else 1.0 for i in range(300)] + [1.0 if i < 6 else 0.0 for i in range(100)]
    t = paired_test(original, noise)
    assert not t.significant and t.p_value == mcnemar_exact(9, 6) and t.ci_low < 0 < t.ci_high
    # a non-binary metric: the paired bootstrap; lower is better flips the drop's sign
    base = [rng.uniform(0, 1) for _ in range(500)]
    worse = [x + 0.05 + rng.gauss(0, 0.01) for x in base]
    t = paired_test(base, worse, higher_is_better=False)
    assert t.test == "paired-bootstrap" and t.significant and t.drop == pytest.approx(0.05, abs=0.003)
    assert t.ci_low < 0.05 < t.ci_high and t.only_original is None
    same = paired_test(base, [x + rng.gauss(0, 0.01) for x in base])
    assert not same.significant and same.ci_low < 0 < same.ci_high


def test_paired_bootstrap_is_seeded_and_refuses_bad_values():
    import torch

    a, b = torch.rand(200, generator=torch.Generator().manual_seed(1)), torch.rand(200)
    assert paired_bootstrap(a, b) == paired_bootstrap(a, b)
    with pytest.raises(ValueError):
        paired_test([1.0, 0.0], [1.0])
    with pytest.raises(ValueError):
        paired_test([1.0, math.nan], [1.0, 0.0])


# -- a local multiple-choice task on the real MHA fixture --------------------------------------------
TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

GROUP_YAML = """group: lastword
task: [lastword_a, lastword_b]
aggregate_metric_list:
  - metric: acc
    aggregation: mean
    weight_by_size: true
metadata:
  version: 1.0
"""


def last_word_task(folder: Path, text: Path, docs: int = 240) -> Path:
    """A cloze task from held-out text: each line without its last word, four choices (the true word
    and three other words of the text), split into two tasks under one group."""
    lines = [ln.strip() for ln in text.read_text(encoding="utf-8").splitlines() if len(ln.split()) >= 8]
    words = sorted({w for ln in lines for w in ln.split() if re.fullmatch(r"[a-z]{3,}", w)})
    rng, rows = random.Random(0), []
    for line in lines:
        *context, last = line.split()
        if re.fullmatch(r"[a-z]{3,}", last):
            choices = [last, *rng.sample([w for w in words if w != last], 3)]
            rng.shuffle(choices)
            rows.append({"context": " ".join(context), "choices": choices, "label": choices.index(last)})
        if len(rows) == docs:
            break
    folder.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(("lastword_a", "lastword_b")):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows[i::2]), encoding="utf-8")
        (folder / f"{name}.yaml").write_text(TASK_YAML.format(name=name, data=data), encoding="utf-8")
    (folder / "lastword.yaml").write_text(GROUP_YAML, encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def task_setup(tmp_path_factory):
    pytest.importorskip("lm_eval")
    if not (FIXTURES / "pydocs-mha-8h").exists():
        pytest.skip("real fixtures absent: pydocs-mha-8h")
    from mha2gqa.convert import convert_checkpoint

    root = tmp_path_factory.mktemp("tasks")
    src = FIXTURES / "pydocs-mha-8h"
    text = FIXTURES / "text" / "pydocs_heldout.txt"
    tasks = last_word_task(root / "tasks", text)
    mean1 = convert_checkpoint(src, root / "mean1", 1, "mean", progress=False).output
    mean4 = convert_checkpoint(src, root / "mean4", 4, "mean", progress=False).output
    return root, src, text, tasks, mean1, mean4


def run_eval(root, src, converted, text, tasks, out, *extra):
    argv = ["eval", "--original", src, "--converted", converted, "--data", text, "--seq-len", 128,
            "--max-tokens", 1024, "--no-attention", "--samples", 0, "--tasks", "lastword",
            "--include-path", tasks, "--reference-cache", root / "ref", "--output", out, *extra]  # fmt: skip
    return CliRunner().invoke(main, [str(a) for a in argv])


def lm_eval_directly(folder: Path, tasks: Path, out: Path) -> dict:
    """``lm_eval --model hf`` on ``folder`` (float32, CPU, batch 1), its results and per-example samples."""
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args", f"pretrained={folder}",
           "dtype=float32", "--tasks", "lastword", "--include_path", str(tasks), "--device", "cpu",
           "--batch_size", "1", "--output_path", str(out), "--log_samples"]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = {
        name: {s["doc_id"]: s for s in map(json.loads, next(out.rglob(f"samples_{name}_*.jsonl")).open())}
        for name in ("lastword_a", "lastword_b")
    }
    return {"results": results["results"], "samples": samples}


@requires_fixtures("pydocs-mha-8h", "text/pydocs_heldout.txt")
def test_tasks_equal_lm_eval_run_directly_and_a_real_drop_is_significant(task_setup):
    root, src, text, tasks, mean1, _ = task_setup
    out = root / "mean1.json"
    result = run_eval(root, src, mean1, text, tasks, out, "--max-task-drop", "0.01")
    assert result.exit_code == 3, result.output  # the drop gate fails
    r = Results.load(out)
    rows = {row.task: row for row in r.tasks.rows}
    assert set(rows) == {"lastword", "lastword_a", "lastword_b"}
    assert rows["lastword"].group and rows["lastword"].top_level and not rows["lastword_a"].top_level
    direct = {"original": lm_eval_directly(src, tasks, root / "direct-original"),
              "converted": lm_eval_directly(mean1, tasks, root / "direct-mean1")}  # fmt: skip
    for name, row in rows.items():
        for m in row.metrics:
            key = m.metric + ",none"
            for model in ("original", "converted"):
                ours = getattr(m, model)
                theirs = direct[model]["results"][name]
                assert ours.value == theirs[key], (name, m.metric, model)  # to the last digit
                stderr = theirs[key.replace(",", "_stderr,")]
                assert ours.stderr == (stderr if isinstance(stderr, float) else None)
    # the paired test from lm_eval's own per-example records, by scipy
    binomtest = pytest.importorskip("scipy.stats").binomtest
    for name in ("lastword_a", "lastword_b"):
        o, c = direct["original"]["samples"][name], direct["converted"]["samples"][name]
        b = sum(o[d]["acc"] == 1 and c[d]["acc"] == 0 for d in o)
        cc = sum(o[d]["acc"] == 0 and c[d]["acc"] == 1 for d in o)
        test = next(m for m in rows[name].metrics if m.metric == "acc").paired
        assert (test.only_original, test.only_converted) == (b, cc)
        assert test.p_value == pytest.approx(binomtest(min(b, cc), b + cc, 0.5).pvalue, rel=1e-10)
    group = next(m for m in rows["lastword"].metrics if m.metric == "acc")
    parts = [next(m for m in rows[n].metrics if m.metric == "acc").paired for n in ("lastword_a", "lastword_b")]
    assert group.paired.n == rows["lastword"].n == sum(p.n for p in parts) == 240  # pooled examples
    assert (group.paired.only_original, group.paired.only_converted) == (
        sum(p.only_original for p in parts),
        sum(p.only_converted for p in parts),
    )
    assert group.paired.significant and group.paired.drop > 0.03  # 1 KV head by mean pooling: a real drop
    assert "significant drop (McNemar p" in result.output and "GATES FAILED: task_drop[lastword/acc]" in result.output


@requires_fixtures("pydocs-mha-8h", "text/pydocs_heldout.txt")
def test_a_small_drop_is_not_significant_and_the_report_shows_tasks(task_setup):
    root, src, text, tasks, _, mean4 = task_setup
    out = root / "mean4.json"
    result = run_eval(root, src, mean4, text, tasks, out, "--task-alpha", "0.05")
    assert result.exit_code == 0, result.output  # a drop, but not a significant one: the gate passes
    r = Results.load(out)
    group = next(m for m in r.tasks.rows[0].metrics if m.metric == "acc")
    assert r.tasks.rows[0].task == "lastword" and group.paired.drop > 0 and not group.paired.significant
    assert "not significant (McNemar p" in result.output and "gates passed: task_drop_p[lastword/acc]" in result.output
    first = root / "mean1.json"
    paths = [p for p in (first, out) if p.exists()]
    report = CliRunner().invoke(main, ["report", *map(str, paths), "--html", str(root / "r.html")])
    assert report.exit_code == 0, report.output
    page = (root / "r.html").read_text()
    assert "Downstream tasks" in page and ">tasks</th>" in page and "n.s.: lastword acc" in page
    # a tampered p-value is refused, naming the file
    record = json.loads(out.read_text())
    record["tasks"]["rows"][0]["metrics"][0]["paired"]["p_value"] = 0.5
    bad = root / "tampered.json"
    bad.write_text(json.dumps(record))
    report = CliRunner().invoke(main, ["report", str(bad), "--html", str(root / "t.html")])
    assert report.exit_code == 1 and str(bad) in report.output and "p_value" in report.output


def test_task_options_are_refused_before_work(tmp_path, monkeypatch):
    from conftest import random_model, save, story_text, tiny_config

    model = save(random_model(tiny_config("llama")), tmp_path / "m")
    text = story_text(tmp_path / "t.txt")
    base = ("--original", model, "--data", text, "--seq-len", 16)
    assert "--num-fewshot shapes the downstream tasks" in eval_error(*base, "--num-fewshot", 5)
    assert "--limit shapes the downstream tasks" in eval_error(*base, "--limit", 5)
    assert "--limit must be at least 1" in eval_error(*base, "--tasks", "x", "--limit", 0)
    for empty in ("", " , "):  # asked for, and naming nothing: a usage error, as a bad choice is
        result = CliRunner().invoke(main, ["eval", *map(str, base), "--tasks", empty])
        assert result.exit_code == 2 and "'--tasks': names nothing" in result.output, result.output
    pair = (*base, "--converted", model)
    assert "--max-task-drop gates the downstream tasks: give --tasks" in eval_error(*pair, "--max-task-drop", 0.01)
    assert "--task-alpha must be less than 1" in eval_error(*pair, "--tasks", "x", "--task-alpha", 1)
    if importlib.util.find_spec("lm_eval") is not None:
        folder = tmp_path / "tasks"
        assert "not a folder" in eval_error(*base, "--tasks", "x", "--include-path", folder)
        folder.mkdir()
        assert "holds no .yaml" in eval_error(*base, "--tasks", "x", "--include-path", folder)
        (folder / "t.yaml").write_text(TASK_YAML.format(name="mine", data=tmp_path / "d.jsonl"))
        error = eval_error(*base, "--tasks", "mine,nosuchtask_xyz", "--include-path", folder)
        assert "knows no task 'nosuchtask_xyz'" in error
        # its data is not there (offline and not cached, or a local file gone): refused before any model is scored
        error = eval_error(*base, "--tasks", "mine", "--include-path", folder)
        assert "--tasks: the data of task 'mine' cannot be loaded" in error and "datasets cache" in error, error
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # not installed
    assert "pip install 'mha2gqa[tasks]'" in eval_error(*base, "--tasks", "hellaswag")


def test_job_files_take_tasks_and_their_gates(tmp_path):
    from mha2gqa.core.errors import Mha2GqaError
    from mha2gqa.jobs import load_job

    job = tmp_path / "job.yaml"
    job.write_text(
        "source: demo\nconvert: {num_kv_heads: [2], methods: [mean]}\n"
        "eval: {data: demo-heldout, tasks: [lastword, arc_easy], num_fewshot: 0, limit: 50}\n"
        "gates: {max_task_drop: 0.01, task_alpha: 0.05}\n"
    )
    if importlib.util.find_spec("lm_eval") is not None:
        parsed = load_job(job)
        assert parsed.eval.tasks == ("lastword", "arc_easy") and parsed.eval.limit == 50
        assert parsed.gates.max_task_drop == 0.01 and parsed.gates.task_alpha == 0.05
    head = "source: demo\nconvert: {num_kv_heads: [2]}\n"
    job.write_text(head + "eval: {data: demo-heldout}\ngates: {task_alpha: 0.05}\n")
    with pytest.raises(Mha2GqaError, match=re.escape("gates.task_alpha gates the downstream tasks: give eval.tasks")):
        load_job(job)
    job.write_text("source: demo\nconvert: {num_kv_heads: [2]}\neval: {data: demo-heldout, limit: 5}\n")
    with pytest.raises(Mha2GqaError, match=re.escape("eval.limit shapes the downstream tasks")):
        load_job(job)
