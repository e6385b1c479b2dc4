"""The house's structure, tested: core/ has no import circle, each conversion is prepared once, and
every record (conversion, run log, bench, uptraining, scored pass, sweep row) is read through its type alone."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import llama_with_tokenizer, story_text
from test_layering import imports

from mha2gqa.cli import main
from mha2gqa.core import bench_record, runlog
from mha2gqa.core import conversion_record as cr
from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.eval.perplexity import ScoredPass
from mha2gqa.eval.tables import SweepRow
from mha2gqa.uptrain.record import UptrainRecord

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("core", "convert", "eval", "uptrain", "serving", "pipeline", "mha2gqa")


def core_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """core module -> the core modules it imports (function-local imports too)."""
    graph = {}
    for path in sorted((root / "core").glob("*.py")):
        deps = set()
        for _, module in imports(path):
            parts = module.split(".")
            if parts[:2] == ["mha2gqa", "core"] and len(parts) > 2:
                deps.add(parts[2])
        graph[path.stem] = deps - {path.stem}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle (a path back to where it started), found by depth-first search."""
    found, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            found.append([*path[path.index(node) :], node])
            return
        if node in done:
            return
        for dep in sorted(graph.get(node, ())):
            visit(dep, [*path, node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
    return found


#: the house rule: no function of the library longer than this many lines (its docstring counted)
MAX_FUNCTION_LINES = 60


def library_functions(root: Path = ROOT):
    """``(path relative to root, function node)`` of every function of the library."""
    for package in LIBRARY:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield path.relative_to(root), node


def long_functions(root: Path = ROOT, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``path:line name (N lines)`` of every function of the library longer than ``limit`` lines."""
    found = []
    for path, node in library_functions(root):
        n = node.end_lineno - node.lineno + 1
        if n > limit:
            found.append(f"{path}:{node.lineno} {node.name} ({n} lines)")
    return found


def test_no_function_is_longer_than_the_house_rule(tmp_path):
    assert long_functions() == []
    long = tmp_path / "core" / "x.py"  # the check can fail
    long.parent.mkdir()
    long.write_text("def f():\n" + "    x = 1\n" * 70)
    assert long_functions(tmp_path) == ["core/x.py:1 f (71 lines)"]


#: the house rule: no function of the library takes more parameters than this (``self``/``cls`` not
#: counted; ``*args`` and ``**kwargs`` one each): group settings into values
MAX_PARAMETERS = 8


def many_parameters(root: Path = ROOT, limit: int = MAX_PARAMETERS) -> list[str]:
    """``path:line name (N parameters)`` of every function of the library taking more than ``limit``."""
    found = []
    for path, node in library_functions(root):
        a = node.args
        names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
        n = len(names) + (a.vararg is not None) + (a.kwarg is not None) - (names[:1] in (["self"], ["cls"]))
        if n > limit:
            found.append(f"{path}:{node.lineno} {node.name} ({n} parameters)")
    return found


def test_no_function_takes_more_parameters_than_the_house_rule(tmp_path):
    assert many_parameters() == []
    wide = tmp_path / "core" / "x.py"  # the check can fail, and counts as the rule says
    wide.parent.mkdir()
    nine = "def f(a, b, c, d, e, f, g, h, *, i):\n    pass\n"
    eight = "class C:\n    def m(self, a, b, c, d, e, f, g, h):\n        pass\n"
    wide.write_text(nine + "\n" + eight)
    assert many_parameters(tmp_path) == ["core/x.py:1 f (9 parameters)"]


def test_core_imports_in_one_direction():
    """dims <- families <- retarget <- architecture: no module of core/ reaches itself again."""
    assert circles(core_graph()) == []


def test_the_circle_check_finds_a_circle(tmp_path):
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "a.py").write_text("def f():\n    from mha2gqa.core.b import x\n")
    (tmp_path / "core" / "b.py").write_text("from mha2gqa.core.a import f\n")
    (tmp_path / "core" / "c.py").write_text("from mha2gqa.core.a import f\n")
    assert circles(core_graph(tmp_path)) == [["a", "b", "a"]]


#: every record that crosses a package or a file: its home module -> its types. Outside its home a
#: record is read through its type, never by key.
RECORDS = {
    "core/conversion_record.py": (
        cr.ConversionRecord,
        cr.Facts,
        cr.Allocation,
        cr.Calibration,
        cr.Retargeted,
        cr.Source,
        cr.Output,
    ),
    "core/runlog.py": (runlog.RunStart, runlog.RunTrain, runlog.RunEval, runlog.RunResume, runlog.RunEnd),
    "core/bench_record.py": (
        bench_record.Spread,
        bench_record.KvCache,
        bench_record.BenchModel,
        bench_record.BenchRun,
        bench_record.Speedup,
        bench_record.BenchRecord,
    ),
    "uptrain/record.py": (UptrainRecord,),
    "eval/perplexity.py": (ScoredPass,),
    "eval/tables.py": (SweepRow,),
}
#: field names other schemas share (settings dicts, eval results sections, cache manifests): a read
#: of one of these proves nothing
SHARED = {
    *("path", "files", "settings", "format", "data", "tokens", "seed", "schema", "created", "source", "output"),
    *("conversion", "total_size", "config_sha256", "repo_id", "revision", "description", "cost", "method"),
    *("calibration", "family", "num_layers", "num_heads", "head_dim", "rotary_dim", "costs", "lr", "parameters"),
    *("ppl", "ppl_ratio", "seconds", "seq_len", "teacher", "top1_agreement", "batch_size", "dtype", "max"),
    *("median", "models", "agreement", "verdict"),
}


def _record_keys() -> dict[str, set[str]]:
    """Each record home -> the field names only its records have."""
    return {home: {f.name for t in types for f in dataclasses.fields(t)} - SHARED for home, types in RECORDS.items()}


def record_lookups(root: Path = ROOT) -> list[str]:
    """``x["key"]`` reads and ``x.get("key")`` calls of a record-only key outside the record's home."""
    keys, found = _record_keys(), []
    for folder in LIBRARY:
        for path in sorted((root / folder).rglob("*.py")):
            outside = set().union(*(k for home, k in keys.items() if path != root / home))
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                key = None
                if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                    key = node.slice.value if isinstance(node.slice, ast.Constant) else None
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
                    first = node.args[0] if node.args else None
                    key = first.value if isinstance(first, ast.Constant) else None
                if key in outside:
                    found.append(f"{path.relative_to(root)}:{node.lineno} reads {key!r}")
    return found


def test_every_record_is_read_through_its_type():
    assert record_lookups() == []


def test_the_lookup_check_finds_a_key_lookup(tmp_path):
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "bad.py").write_text(
        "def f(r, log):\n    return r['num_kv_heads_after'], r.get('serving_form'), log[0]['tokens_per_step']\n"
    )
    assert len(record_lookups(tmp_path)) == 3


@pytest.fixture(scope="module")
def job_source(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepare-once")
    text = story_text(root / "t.txt")
    return llama_with_tokenizer(root / "mha", text, max_positions=64), text


def count_prepares(monkeypatch) -> dict[str, int]:
    """Count every :func:`prepare` and every opening of a checkpoint, wherever it happens."""
    import mha2gqa.convert.prepare as prepare_module
    import mha2gqa.core.checkpoint as checkpoint_module

    counts = {"prepare": 0, "open_checkpoint": 0}
    real_prepare, real_open = prepare_module.prepare, checkpoint_module.open_checkpoint

    def prepare(*args, **kwargs):
        counts["prepare"] += 1
        return real_prepare(*args, **kwargs)

    def open_checkpoint(*args, **kwargs):
        counts["open_checkpoint"] += 1
        return real_open(*args, **kwargs)

    monkeypatch.setattr(prepare_module, "prepare", prepare)
    monkeypatch.setattr(prepare_module, "open_checkpoint", open_checkpoint)
    monkeypatch.setattr(checkpoint_module, "open_checkpoint", open_checkpoint)
    return counts


def test_mha2gqa_convert_prepares_once(job_source, tmp_path, monkeypatch):
    counts = count_prepares(monkeypatch)
    src, _ = job_source
    result = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "out"), "-g", "2", "-q"])
    assert result.exit_code == 0, result.output
    assert counts == {"prepare": 1, "open_checkpoint": 1}


def test_a_job_prepares_each_conversion_once(job_source, tmp_path, monkeypatch):
    src, text = job_source
    job = tmp_path / "job.yaml"
    job.write_text(
        json.dumps(
            {
                "source": str(src),
                "convert": {"num_kv_heads": [2, 1], "methods": ["mean", "first"]},
                "eval": {"data": str(text), "seq_len": 32, "max_tokens": 128},
                "report": False,
            }
        )
    )
    counts = count_prepares(monkeypatch)
    result = CliRunner().invoke(main, ["run", str(job), "--output-dir", str(tmp_path / "run"), "-q"])
    assert result.exit_code == 0, result.output
    assert counts == {"prepare": 4, "open_checkpoint": 4}


def test_a_record_round_trips_and_a_damaged_one_is_one_line(job_source, tmp_path):
    from mha2gqa.convert import convert_checkpoint

    src, _ = job_source
    out = convert_checkpoint(src, tmp_path / "out", 2, progress=False)
    record = cr.read_conversion_record(out.output)
    assert record == out.record and record.schema == cr.CONVERSION_SCHEMA
    assert cr.ConversionRecord.from_dict(json.loads(record.to_json()), "x") == record
    assert record.conversion.kv_heads_after == "2" and record.conversion.changed
    path = out.output / "mha2gqa_conversion.json"
    data = json.loads(path.read_text())
    data["conversion"]["num_kv_heads_after"] = "two"
    path.write_text(json.dumps(data))
    with pytest.raises(
        Mha2GqaError,
        match=r"mha2gqa_conversion.json: damaged conversion record \(record.conversion"
        r".num_kv_heads_after is not an integer",
    ):
        cr.read_conversion_record(out.output)
    path.write_text("{")
    with pytest.raises(Mha2GqaError, match=r"mha2gqa_conversion\.json: not readable JSON"):
        cr.read_conversion_record(out.output)
    del data["conversion"]["method"]
    data["conversion"]["num_kv_heads_after"] = 2
    path.write_text(json.dumps(data))
    with pytest.raises(Mha2GqaError, match=r"record.conversion.method is missing"):
        cr.read_conversion_record(out.output)
