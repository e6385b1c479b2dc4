"""One evaluation from request to verdict, the same for ``mha2gqa eval`` and job files: check the
paths before any model loads, evaluate, check the gates, write the results JSON (with its gates
record). Torch loads only when the evaluation starts."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.output import check_destination, check_overlap, write_json
from mha2gqa.eval.gates import Gate, GateSettings, check_gates, gates_record, verdict
from mha2gqa.eval.results import Results
from mha2gqa.eval.settings import EvalSettings


@dataclass
class Outcome:
    """An evaluation's results, as written, and its gates (empty when none were asked for)."""

    results: Results
    record: dict[str, Any] = field(repr=False)
    gates: list[Gate]
    path: Path | None = None

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.gates)

    @property
    def verdict(self) -> str | None:
        """``gates passed: ...`` / ``GATES FAILED: ...`` (None without gates)."""
        return verdict(self.gates) if self.gates else None


def check_request(
    original: str,
    converted: str | None,
    settings: EvalSettings,
    limits: GateSettings,
    output: Path | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Everything checked before a model loads: gates need a pair; ``output`` and the reference
    cache may not replace an input, and the cache must be a writable folder; both models resolve.
    Returns the run's inputs (label -> path), which no output may replace."""
    from mha2gqa.core.checkpoint import check_models

    if converted is None and limits.any:
        raise Mha2GqaError("gates compare a conversion with its original: pass --converted")
    inputs = {"the --data text": settings.data, "the original model": original, "the converted model": converted}
    if output is not None:
        check_destination(output, overwrite, inputs, "--output", folder=False)
    if settings.reference_cache is not None and converted is not None:
        cache = check_overlap(Path(settings.reference_cache), inputs, "--reference-cache")
        if cache.exists() and not cache.is_dir():
            raise Mha2GqaError(f"--reference-cache {cache} is a file: give a folder")
        existing = next(p for p in (cache, *cache.parents) if p.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            raise Mha2GqaError(f"--reference-cache {cache}: {existing} is not a writable folder; choose another")
    check_models(**{"--original": original, "--converted": converted})
    return inputs


def evaluate_and_gate(
    original: str,
    converted: str | None,
    settings: EvalSettings,
    limits: GateSettings,
    output: Path | None = None,
    overwrite: bool = True,
    inputs: dict[str, Any] | None = None,
    log: Callable[[str], None] | None = None,
) -> Outcome | None:
    """Evaluate ``converted`` against ``original``, check ``limits`` and write the results to
    ``output`` (when given); None on every process but the main one of a multi-process run."""
    from mha2gqa.eval.harness import evaluate, is_main_process

    record = evaluate(original, converted, settings, log=log)
    if not is_main_process():
        return None
    results = Results.from_dict(record, str(output) if output is not None else None)
    gates = check_gates(results, limits)
    if gates:
        record["gates"] = results.gates = gates_record(gates)
    if output is not None:
        write_json(output, record, "--output", overwrite, inputs)
    return Outcome(results, record, gates, output)
