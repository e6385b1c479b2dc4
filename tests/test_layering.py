"""The house has a ground floor: every module's imports (function-local ones too) follow the layers.

core     <- convert, eval, uptrain, top      (core imports only core)
convert  <- top                              (convert imports core)
eval     <- uptrain, top                     (eval imports core)
uptrain  <- top                              (uptrain imports core and eval's scorer)
serving  <- top                              (serving imports core: plan, inspect, bench sizing)
pipeline <- top                              (pipeline imports core, convert, eval, uptrain)
top      = mha2gqa/ (CLI, jobs, demo), configs: anything below, but no stage's runner

The stages' runners (:data:`RUNNERS`: the conversion's prepare and run, the uptraining's) are the
pipeline's alone: the CLI, jobs and demo compose stages only through ``mha2gqa.pipeline``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: source folder -> layer
FOLDERS = {
    "core": "core",
    "convert": "convert",
    "eval": "eval",
    "uptrain": "uptrain",
    "serving": "serving",
    "pipeline": "pipeline",
    "mha2gqa": "top",
    "configs": "top",
}
ALLOWED = {
    "core": {"core"},
    "convert": {"core", "convert"},
    "eval": {"core", "eval"},
    "uptrain": {"core", "eval", "uptrain"},
    "serving": {"core", "serving"},
    "pipeline": {"core", "convert", "eval", "uptrain", "pipeline"},
    "top": {"core", "convert", "eval", "uptrain", "serving", "pipeline", "top"},
}
#: the modules that run a stage (prepare it, do it): imported above the stages by the pipeline alone
RUNNERS = ("mha2gqa.convert.converter", "mha2gqa.convert.prepare", "mha2gqa.uptrain", "mha2gqa.uptrain.trainer")


def layer_of(module: str) -> str | None:
    """The layer of an imported ``mha2gqa...`` module (None: not ours)."""
    parts = module.split(".")
    if parts[0] != "mha2gqa":
        return None
    if len(parts) == 1:
        return "root"
    return parts[1] if parts[1] in ("core", "convert", "eval", "uptrain", "serving", "pipeline") else "top"


def imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in the file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            if node.module == "mha2gqa":  # from mha2gqa import x: x may be a subpackage
                out += [(node.lineno, f"mha2gqa.{a.name}") for a in node.names]
    return out


def violations(root: Path = ROOT) -> list[str]:
    found = []
    for folder, layer in FOLDERS.items():
        for path in sorted((root / folder).rglob("*.py")):
            for line, module in imports(path):
                target = layer_of(module)
                if target is None or (target == "root" and layer == "top"):
                    continue
                if target == "root" or target not in ALLOWED[layer]:
                    found.append(f"{path.relative_to(root)}:{line} ({layer}) imports {module} ({target})")
                elif layer == "top" and module in RUNNERS:
                    where = f"{path.relative_to(root)}:{line}"
                    found.append(f"{where} (top) runs a stage ({module}): go through the pipeline")
    return found


def test_every_import_follows_the_layers():
    assert violations() == []


def test_calibration_imports_no_method():
    """Inside convert/, methods read calibration's statistics, never the other way round (per-layer
    allocation, which needs both, sits above them in convert/plan/allocation.py)."""
    found = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sorted((ROOT / "convert" / "calibration").rglob("*.py"))
        for line, module in imports(path)
        if module.startswith("mha2gqa.convert.methods")
    ]
    assert found == []


def test_the_check_catches_a_forbidden_import(tmp_path):
    for folder in FOLDERS:
        (tmp_path / folder).mkdir()
    (tmp_path / "convert" / "bad.py").write_text("def f():\n    from mha2gqa.eval.metrics import cosine\n")
    (tmp_path / "core" / "worse.py").write_text("import mha2gqa.uptrain.trainer\nfrom mha2gqa import cli\n")
    (tmp_path / "eval" / "fine.py").write_text("from mha2gqa.core.dims import AttentionDims\n")
    (tmp_path / "uptrain" / "up.py").write_text("from mha2gqa.pipeline import Recipe\n")  # below the pipeline
    (tmp_path / "mha2gqa" / "cli.py").write_text("def f():\n    from mha2gqa.convert.converter import run\n")
    (tmp_path / "mha2gqa" / "jobs.py").write_text("from mha2gqa.pipeline import prepare\n")  # the way
    found = violations(tmp_path)
    assert len(found) == 6, found  # the eval -> core import and the jobs -> pipeline one are allowed
    assert any("uptrain/up.py:1 (uptrain) imports mha2gqa.pipeline (pipeline)" in v for v in found)
    assert any("mha2gqa/cli.py:2 (top) runs a stage (mha2gqa.convert.converter)" in v for v in found)
    assert any("convert/bad.py:2 (convert) imports mha2gqa.eval.metrics (eval)" in v for v in found)
    assert any("core/worse.py:1" in v for v in found) and any("mha2gqa.cli (top)" in v for v in found)
    assert any("imports mha2gqa (root)" in v for v in found)  # the root package's names belong to the top
