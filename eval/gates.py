"""Regression gates for CI: compare evaluation results with limits and give a one-line verdict.

``mha2gqa eval ... --max-ppl-ratio R --max-kl K --min-top1 T [--tasks ... --max-task-drop D
--task-alpha A]`` exits with :data:`GATE_EXIT_CODE`
when any gate fails (1 is a user error, 2 a usage error), after writing the results.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.settings import setting
from mha2gqa.eval.results import GateCheck, GatesRecord, Results

GATE_EXIT_CODE = 3


@dataclass
class GateSettings:
    """The limits a conversion must meet (unset: not checked)."""

    max_ppl_ratio: float | None = setting(
        None, help="Gate: converted/original perplexity at most this (every protocol run).", above=0
    )
    max_kl: float | None = setting(None, help="Gate: mean per-token KL (nats) at most this.", minimum=0)
    min_top1: float | None = setting(None, help="Gate: top-1 agreement (0-1) at least this.", minimum=0, maximum=1)
    min_greedy_agreement: float | None = setting(
        None,
        help="Gate: the share (0-1) of the generative probe's greedy continuations identical to the original's "
        "at least this.",
        minimum=0,
        maximum=1,
    )
    max_task_drop: float | None = setting(
        None,
        help="Gate: every metric of every task named in --tasks (a group as a whole) drops by at most this, in "
        "the metric's units (0.01: one accuracy point).",
        minimum=0,
    )
    task_alpha: float | None = setting(
        None,
        help="Gate: no metric of a named task drops significantly at this level on the paired test (0.05: "
        "not significant at 5%); the gate's value is the drop's p-value (1 where the metric did not drop).",
        above=0,
        below=1,
    )

    @property
    def on_tasks(self) -> bool:
        return self.max_task_drop is not None or self.task_alpha is not None

    @property
    def any(self) -> bool:
        return any(getattr(self, f.name) is not None for f in fields(self))


@dataclass
class Gate:
    name: str
    value: float
    limit: float
    op: str  # "<=" or ">="

    @property
    def passed(self) -> bool:
        return self.value <= self.limit if self.op == "<=" else self.value >= self.limit

    def __str__(self) -> str:
        shown = ">" if self.op == "<=" else "<"
        return f"{self.name} {self.value:.4g} {self.op if self.passed else shown} {self.limit:.4g}"


def check_gates(results: Results, limits: GateSettings) -> list[Gate]:
    """The gates asked for, evaluated on ``results``: the perplexity ratio of every protocol run,
    the mean per-token KL, and top-1 agreement."""
    gates: list[Gate] = []
    if not limits.any:
        return gates
    if results.converted is None:
        raise Mha2GqaError("gates compare a conversion with its original: pass --converted")
    if results.invalid_because is not None:  # no figure of an invalid comparison may pass a gate
        o = results.data.calibration_overlap
        gates.append(Gate(f"{o.use}_text_overlap", o.share, 0.0, "<="))
    if limits.max_ppl_ratio is not None:
        for name, p in results.protocols.items():
            gates.append(Gate(f"ppl_ratio[{name}]", p.ppl_ratio, limits.max_ppl_ratio, "<="))
    if limits.max_kl is not None:
        gates.append(Gate("kl_mean", results.agreement.kl.mean, limits.max_kl, "<="))
    if limits.min_top1 is not None:
        gates.append(Gate("top1_agreement", results.agreement.top1_agreement, limits.min_top1, ">="))
    if limits.min_greedy_agreement is not None:
        if results.greedy is None:
            raise Mha2GqaError("--min-greedy-agreement reads the generative probe: keep --greedy-prompts above 0")
        gates.append(Gate("greedy_agreement", results.greedy.identical, limits.min_greedy_agreement, ">="))
    if limits.on_tasks:
        if results.tasks is None:
            raise Mha2GqaError("task gates read the downstream tasks: give --tasks")
        for row in (r for r in results.tasks.rows if r.top_level):
            for m in (m for m in row.metrics if m.paired is not None):
                name = f"{row.task}/{m.metric}"
                if limits.max_task_drop is not None:
                    gates.append(Gate(f"task_drop[{name}]", m.paired.drop, limits.max_task_drop, "<="))
                if limits.task_alpha is not None:
                    p = m.paired.p_value if m.paired.drop > 0 else 1.0
                    gates.append(Gate(f"task_drop_p[{name}]", p, limits.task_alpha, ">="))
    return gates


def verdict(gates: list[Gate]) -> str:
    """``gates passed: ...`` or ``GATES FAILED: <each violated gate>``."""
    failed = [g for g in gates if not g.passed]
    if failed:
        return "GATES FAILED: " + "; ".join(map(str, failed))
    return "gates passed: " + "; ".join(map(str, gates))


def gates_record(gates: list[Gate]) -> GatesRecord:
    """The gates as the results file records them."""
    return GatesRecord(all(g.passed for g in gates), [GateCheck(**asdict(g), passed=g.passed) for g in gates])
