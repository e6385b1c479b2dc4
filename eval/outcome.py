"""One evaluation from request to verdict, the same for ``mha2gqa eval`` and job files: check the
paths before any model loads, evaluate, check the gates, write the results JSON (with its gates
record); and one decode benchmark (``mha2gqa bench``) the same way. Torch loads only when the work
starts."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.output import check_destination, check_overlap, write_json
from mha2gqa.eval.gates import GATE_EXIT_CODE, Gate, GateSettings, check_gates, gates_record
from mha2gqa.eval.gates import verdict as gates_verdict
from mha2gqa.eval.results import Results
from mha2gqa.eval.settings import BenchSettings, EvalSettings


@dataclass
class Outcome:
    """An evaluation's results, as written, and its gates (empty when none were asked for)."""

    results: Results
    gates: list[Gate]

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.gates)

    @property
    def gates_line(self) -> str | None:
        """``gates passed: ...`` / ``GATES FAILED: ...`` (None without gates)."""
        return gates_verdict(self.gates) if self.gates else None

    @property
    def verdict_line(self) -> str | None:
        """``verdict: PASS (...)``: the recommended thresholds' verdict (None for one model alone)."""
        return self.results.verdict.sentence() if self.results.verdict else None

    def lines(self) -> list[str]:
        """The closing lines: the gates' result, then the verdict, last."""
        return [line for line in (self.gates_line, self.verdict_line) if line]

    def exit_code(self, strict: bool = False) -> int:
        """Non-zero (:data:`GATE_EXIT_CODE`) when a gate failed (a verdict that is not valid fails the
        gates), or with ``strict`` when the verdict is not a valid ``pass``."""
        verdict = self.results.verdict
        failed = not self.passed or (strict and verdict is not None and not verdict.passed)
        return GATE_EXIT_CODE if failed else 0


@dataclass(frozen=True)
class EvalRequest:
    """One evaluation asked for: ``converted`` against ``original`` (None: the original alone) under
    ``settings``, checked against ``limits``, written to ``output`` when given."""

    original: str
    converted: str | None
    settings: EvalSettings
    limits: GateSettings = field(default_factory=GateSettings)
    output: Path | None = None
    overwrite: bool = True

    @property
    def inputs(self) -> dict[str, Any]:
        """What the evaluation reads, which no output may replace."""
        return {
            "the --data text": self.settings.data,
            "the original model": self.original,
            "the converted model": self.converted,
        }

    def check(self) -> EvalRequest:
        """Everything checked before a model loads: gates need a pair; ``output`` and the reference
        cache may not replace an input, and the cache must be a writable folder; both models resolve."""
        from mha2gqa.core.checkpoint import check_loadable, check_models
        from mha2gqa.eval.pair import check_pair

        if self.converted is None and self.limits.any:
            raise Mha2GqaError("gates compare a conversion with its original: pass --converted")
        if self.limits.on_tasks and not self.settings.tasks:
            flag = "--max-task-drop" if self.limits.max_task_drop is not None else "--task-alpha"
            raise Mha2GqaError(f"{flag} gates the downstream tasks: give --tasks too")
        if self.limits.min_greedy_agreement is not None and not self.settings.greedy_prompts:
            raise Mha2GqaError("--min-greedy-agreement reads the generative probe: keep --greedy-prompts above 0")
        if self.output is not None:
            check_destination(self.output, self.overwrite, self.inputs, "--output", folder=False)
        if self.settings.reference_cache is not None and self.converted is not None:
            cache = check_overlap(Path(self.settings.reference_cache), self.inputs, "--reference-cache")
            if cache.exists() and not cache.is_dir():
                raise Mha2GqaError(f"--reference-cache {cache} is a file: give a folder")
            existing = next(p for p in (cache, *cache.parents) if p.exists())
            if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
                raise Mha2GqaError(f"--reference-cache {cache}: {existing} is not a writable folder; choose another")
        check_models(**{"--original": self.original, "--converted": self.converted})
        if self.converted is not None:
            check_pair(self.original, self.converted, self.settings.revision)
        elif self.settings.compare_quantization:
            raise Mha2GqaError(
                "--compare-quantization places a conversion among quantized copies of its original: pass --converted"
            )
        for label, model in (("--original", self.original), ("--converted", self.converted)):
            if model is not None:  # whole weights, the tensors their configs describe: before any scoring
                check_loadable(label, model, self.settings.revision)
        return self

    def prepare(self, checked: bool = False) -> PreparedEval:
        """Every check (:meth:`check`; ``checked``: the caller made them, as a job does for the models
        it wrote itself), then the evaluation decided (:func:`mha2gqa.eval.prepare.prepare`: configs,
        tokenizer, text, windows, tasks): bad input fails here, before any weights load."""
        from mha2gqa.eval.prepare import prepare

        if not checked:
            self.check()
        return PreparedEval(self, prepare(self.original, self.converted, self.settings))


@dataclass(frozen=True)
class PreparedEval:
    """An evaluation checked and decided (:meth:`EvalRequest.prepare`), its windows cut."""

    request: EvalRequest
    evaluation: Any  # mha2gqa.eval.prepare.Evaluation

    def run(self, log: Callable[[str], None] | None = None) -> Outcome | None:
        """Evaluate, check the gates and write the results (when the request's ``output`` is given);
        None on every process but the main one of a multi-process run."""
        from mha2gqa.eval.harness import run

        request = self.request
        results = run(self.evaluation, log=log)
        if results is None:  # not the main process
            return None
        results.path = str(request.output) if request.output is not None else None
        gates = check_gates(results, request.limits)
        if gates:
            results.gates = gates_record(gates)
        results.verdict = results.judge()
        if request.output is not None:
            write_json(request.output, results.to_dict(), "--output", request.overwrite, request.inputs)
        return Outcome(results, gates)


def benchmark(
    original: str,
    converted: str | None,
    settings: BenchSettings,
    output: Path | None = None,
    overwrite: bool = False,
) -> list[str]:
    """``mha2gqa bench``: check the settings, the destination and both models, benchmark them one at a
    time, write the record to ``output`` (when given); returns the terminal lines."""
    from mha2gqa.core.checkpoint import check_models

    settings = settings.check()
    inputs = {"the original model": original, "the converted model": converted}
    if output is not None:
        check_destination(output, overwrite, inputs, "--output", folder=False)
    check_models(**{"--original": original, "--converted": converted})
    from mha2gqa.eval.bench import bench_lines, run_bench

    results = run_bench(original, converted, settings)
    if output is not None:
        write_json(output, results.to_dict(), "--output", overwrite, inputs)
    return bench_lines(results)
