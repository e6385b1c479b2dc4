"""The refit's generic fitter: Adam on a layer's projections against its targets, held-out checks,
the learning-rate probe and early stop (:func:`fit_layer`), and the output projection's closed-form
solve (:func:`solve_output`). Knows nothing of models: a ``forward(values, windows)`` and targets."""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from mha2gqa.convert.refit.objective import PLAIN, Objective
from mha2gqa.convert.refit.output_solve import RIDGES, NormalEquations
from mha2gqa.convert.refit.stops import hooked, random_shift, unmoved
from mha2gqa.core.errors import Mha2GqaError, first_line
from mha2gqa.core.ranks import ONE, Ranks
from mha2gqa.core.signals import check as check_signals
from mha2gqa.core.steps import step_size

#: one calibration window in this many is held out (at least one)
HELDOUT_EVERY = 8


#: held-out checks per layer (every ``steps / CHECKS`` steps)
CHECKS = 10


#: learning rates a layer's fit tries (times --refit-lr) for the steps of its first check, each from the
#: merge on the same windows; the one with the least held-out error goes on. The relative step a model
#: wants differs (SmolLM2-135M: about 0.015 of each projection's RMS; pydocs-mha-8h, whose projections
#: are 6x smaller: about 0.09): docs/methods.md, "Steps sized to the model"
PROBE = (1.0, 3.0, 9.0)


def probe_near(factor: float | None, probe: tuple[float, ...] = PROBE) -> tuple[float, ...]:
    """The factors of ``probe`` a layer tries after a layer that went on with ``factor``: that one and
    its neighbours in ``probe`` (all of them first, or after a layer that chose none). A model's
    layers mostly want the same relative step (SmolLM2-135M: x1 in every layer after the first), so
    the far end of the list is not run again; a layer whose best is at the edge of what it tried
    moves the next layer's choice along, one factor a layer."""
    if factor is None:
        return probe
    at = min(range(len(probe)), key=lambda j: abs(probe[j] - factor))
    return probe[max(0, at - 1) : at + 2]


#: checks without a lower held-out error (by at least MIN_GAIN of it) before a layer's fit stops
PATIENCE = 3


#: the share of the best held-out error a check must take off to count as progress
MIN_GAIN = 0.005


@dataclass(frozen=True)
class FitResult:
    values: dict[str, torch.Tensor]
    loss_before: float
    loss_after: float
    kept: bool
    steps: int
    ridge: float | None = None  # the closed-form o_proj's (:func:`solve_output`), None: not taken
    lr: float | None = None  # the relative learning rate the fit went on with (of those probed)


#: A held-out error at most this (the error relative to the stream's size, squared) is float rounding:
#: the merge is exact there, and the refit leaves it as it is (a lossy merge's is 1e-5 and more).
EXACT_ERROR = 1e-10


def is_exact(error: float) -> bool:
    """A merge whose held-out ``error`` is float rounding (:data:`EXACT_ERROR`): nothing to refit."""
    return error <= EXACT_ERROR


def chunks(indices: list[int], size: int) -> list[list[int]]:
    """``indices`` in consecutive runs of ``size`` (the last may be shorter)."""
    return [indices[j : j + size] for j in range(0, len(indices), size)]


def split_windows(n: int) -> tuple[list[int], list[int]]:
    """``(fitted, held out)`` window indices: the last one in :data:`HELDOUT_EVERY` (at least one)."""
    held = max(1, n // HELDOUT_EVERY)
    return list(range(n - held)), list(range(n - held, n))


@dataclass(frozen=True)
class FitData:
    """What a fit reads and how it scores: ``targets(windows)`` (``[len(windows), T, hidden]``) of the
    ``windows`` windows in all, ``per_call`` windows a forward, ``objective``'s error, summed over the
    processes ``ranks``."""

    targets: Callable[[list[int]], torch.Tensor]
    windows: int
    per_call: int = 1
    objective: Objective = PLAIN
    ranks: Ranks = ONE

    def scoring(self) -> dict[str, Any]:
        """The keywords :func:`heldout_error` takes."""
        return {"targets": self.targets, "per_call": self.per_call, "objective": self.objective, "ranks": self.ranks}


@dataclass(frozen=True)
class FitSteps:
    """How a fit steps: ``steps`` Adam steps of ``batch`` windows (their order from ``seed``), each
    tensor's rate ``lr`` times its RMS, the rates ``probe`` tries first, the forward under ``autocast``,
    the probe's best run kept in ``spill`` (None: in memory)."""

    steps: int
    lr: float
    batch: int
    seed: int
    probe: tuple[float, ...] = PROBE
    autocast: torch.dtype | None = None
    spill: Path | None = None


def fit_layer(
    forward: Callable[[dict[str, torch.Tensor], list[int]], torch.Tensor],
    start: dict[str, torch.Tensor],
    trainable: list[str],
    data: FitData,
    how: FitSteps,
) -> FitResult:
    """Fit the ``trainable`` entries of ``start`` so that ``forward(values, windows)`` (those windows'
    outputs ``[len(windows), T, hidden]``) matches ``targets(windows)``: Adam on ``objective``'s error
    (:mod:`~mha2gqa.convert.refit.objective`; each tensor's learning rate ``lr`` times its RMS:
    :func:`relative_steps`), over ``batch`` windows a step (``per_call`` windows per forward), early
    stopped on the held-out windows (:func:`split_windows`): a check that does not lower the best held-out error by
    :data:`MIN_GAIN` of it counts towards :data:`PATIENCE`, and the fit stops there once half its
    steps are done. The first check's steps run once for each learning rate ``lr x`` a factor of
    ``probe``, from ``start`` on the same windows, and the one with the least held-out error goes on.
    Returns the best values, or ``start`` itself when no check lowered the held-out error (``kept``).
    With ``autocast`` (a dtype) the steps' forward runs under that autocast, the checks in float32.
    ``spill``: a file the probe keeps its best run in while it tries the next (None: in memory).
    Several processes (``ranks``, each calling this) run their own windows (:meth:`Ranks.own`) of every
    step and check; gradients and held-out errors are summed, so every one takes the same steps."""
    fitted, held = split_windows(data.windows)
    heldout = partial(heldout_error, forward, windows=held, **data.scoring())
    before = heldout(start)
    if is_exact(before) or not trainable:  # exact (to float rounding), or nothing to fit: nothing moves
        return FitResult(start, before, before, True, 0)
    steps, lr = how.steps, how.lr
    every, batches = max(1, steps // CHECKS), _batches(fitted, how.batch, how.seed)
    train = partial(_train_step, forward, data=data, autocast=how.autocast)
    first = [next(batches) for _ in range(min(every, steps))]  # the first check's steps, for every rate tried
    now, factor, values, optimizer = _probe(start, trainable, lr, how.probe, first, train, heldout, how.spill)
    best, best_values, stale, done = before, None, 0, len(first)
    while True:
        gained = now < best * (1 - MIN_GAIN)
        if now < best:
            best, best_values = now, {r: t.detach().clone() for r, t in values.items()}
        stale = 0 if gained else stale + 1
        if done >= steps or (stale >= PATIENCE and done >= steps // 2):  # Adam may overshoot at first: half
            break
        for chosen in [next(batches) for _ in range(min(every, steps - done))]:
            train(values, optimizer, chosen)
            done += 1
        now = heldout(values)
    if best_values is None:
        return FitResult(start, before, before, True, done, lr=lr * factor)
    return FitResult(best_values, before, best, False, done, lr=lr * factor)


@dataclass
class _ProbeRun:
    """One learning rate's run in :func:`_probe`: its held-out error after the first check's steps,
    its factor of the probe, and its values and Adam (None while it waits in the spill file)."""

    error: float
    factor: float
    values: dict[str, torch.Tensor] | None
    optimizer: torch.optim.Adam | None


def _probe(
    start, trainable: list[str], lr: float, probe: tuple[float, ...], first: list[list[int]], train, heldout, spill
) -> tuple[float, float, dict[str, torch.Tensor], torch.optim.Adam]:
    """``(held-out error, factor, values, optimizer)`` of the best of the learning rates ``lr x`` each
    factor of ``probe``, each run from ``start`` on the batches ``first`` (the first best on a tie).
    A run (a layer's projections and Adam's two moments: ~0.6 GB for a 7B layer) is freed when it
    loses; the best so far waits in the file ``spill`` (None: in memory) while the next one runs, so
    one run is held at a time, and comes back exactly as it was if it wins."""
    best: _ProbeRun | None = None
    for n, factor in enumerate(probe):
        values, optimizer = _run(start, trainable, lr * factor)
        for chosen in first:
            train(values, optimizer, chosen)
        optimizer.zero_grad(set_to_none=True)
        error = heldout(values)
        if best is None or error < best.error:
            best = _ProbeRun(error, factor, values, optimizer)
            if spill is not None and n + 1 < len(probe):
                torch.save(
                    {"values": {r: values[r].detach() for r in trainable}, "adam": optimizer.state_dict()}, spill
                )
                best = _ProbeRun(error, factor, None, None)
        del values, optimizer  # a run that lost is freed before the next one starts (or the best comes back)
    if best.values is None:
        best.values, best.optimizer = _spilled_run(spill, start, trainable, lr * best.factor)
    return best.error, best.factor, best.values, best.optimizer


def _run(start, trainable: list[str], lr: float) -> tuple[dict[str, torch.Tensor], torch.optim.Adam]:
    """A fit's values (``start``'s, the ``trainable`` ones copied to be fitted) and its Adam at the
    relative learning rate ``lr`` (:func:`relative_steps`, from the start's sizes)."""
    values = {r: t.clone().requires_grad_() if r in trainable else t for r, t in start.items()}
    return values, torch.optim.Adam(relative_steps(values, trainable, lr), foreach=False)  # no temporaries


def _spilled_run(spill, start, trainable: list[str], lr: float) -> tuple[dict[str, torch.Tensor], torch.optim.Adam]:
    """The run :func:`_probe` left in the file ``spill`` (then removed), as it was: its values and
    its Adam (moments, step counts and the learning rates set from ``start``). A file that does not
    read back as that run (damaged, edited or removed while the conversion ran) is one error naming it."""
    values, optimizer = _run(start, trainable, lr)
    try:
        kept = torch.load(spill, weights_only=True)
        with torch.no_grad():
            for r in trainable:
                values[r].copy_(_checked_like(kept["values"][r], values[r]))
        optimizer.load_state_dict(kept["adam"])
        for param, state in optimizer.state.items():
            for moment in ("exp_avg", "exp_avg_sq"):
                _checked_like(state[moment], param)
    except (OSError, EOFError, RuntimeError, ValueError, KeyError, TypeError, IndexError, pickle.UnpicklingError) as e:
        raise Mha2GqaError(
            f"{spill}: the refit's scratch copy of a probe run does not read back "
            f"({type(e).__name__}: {first_line(e, 200)}); it was damaged or removed while the conversion ran: "
            "convert again"
        ) from None
    finally:
        spill.unlink(missing_ok=True)
    return values, optimizer


def _checked_like(kept: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``kept``, checked to be a finite tensor of ``like``'s shape and dtype (ValueError if not)."""
    if not isinstance(kept, torch.Tensor) or kept.shape != like.shape or kept.dtype != like.dtype:
        raise ValueError(f"a tensor is not {tuple(like.shape)} {like.dtype}")
    if not torch.isfinite(kept).all():
        raise ValueError("a tensor holds NaN or infinite values")
    return kept


def _train_step(forward, values, optimizer, chosen: list[int], *, data: FitData, autocast) -> None:
    """One Adam step on the windows ``chosen`` (``per_call`` windows' graph at a time; this rank's
    own, the gradients then summed over the ranks), the forward under ``autocast`` (a dtype; None: none)."""
    check_signals()
    optimizer.zero_grad(set_to_none=True)
    device = next(iter(values.values())).device.type
    ranks = data.ranks
    for c in chunks(ranks.own(chosen), data.per_call):
        with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
            out = forward(values, c)
        loss = torch.mean(data.objective.squares(out.float(), data.targets(c))) * (len(c) / len(chosen))
        loss.backward()
    if ranks.size > 1:
        _sum_gradients([p for group in optimizer.param_groups for p in group["params"]], ranks)
    optimizer.step()


def _sum_gradients(params: list[torch.Tensor], ranks: Ranks) -> None:
    """Each parameter's gradient summed over the ranks (one all-reduce; none here: zeros)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = ranks.sum(torch.cat([g.reshape(-1) for g in grads]))
    for p, piece in zip(params, flat.split([g.numel() for g in grads]), strict=True):
        p.grad = piece.view_as(p)


def relative_steps(values: Mapping[str, torch.Tensor], trainable: list[str], lr: float) -> list[dict[str, Any]]:
    """Adam's parameter groups with each projection's learning rate ``lr`` times its own size
    (:func:`~mha2gqa.core.steps.step_size`: its RMS; a bias's, the larger of its own and its
    weight's), so that the fit of a rescaled model is the fit rescaled (:mod:`mha2gqa.core.steps`)."""
    return [
        {"params": [values[role]], "lr": lr * step_size(values[role], values.get(role.removesuffix("_bias")))}
        for role in trainable
    ]


def heldout_error(
    forward: Callable[[dict[str, torch.Tensor], list[int]], torch.Tensor],
    values: dict[str, torch.Tensor],
    *,
    targets: Callable[[list[int]], torch.Tensor],
    windows: list[int],
    per_call: int,
    objective: Objective = PLAIN,
    ranks: Ranks = ONE,
) -> float:
    """``objective``'s error of ``forward(values, ...)`` against ``targets`` over ``windows``
    (``per_call`` at a time; each rank its own, summed), without gradients: what :func:`fit_layer` checks."""
    total, count = 0.0, 0
    with torch.no_grad():
        for c in chunks(ranks.own(windows), per_call):
            target = targets(c)
            total += float(objective.squares(forward(values, c), target).sum())
            count += target.numel()
    total, count = ranks.total(total, count)
    return total / count


def solve_output(
    result: FitResult,
    forward: Callable[[dict[str, torch.Tensor], list[int]], torch.Tensor],
    data: FitData,
    o_proj: torch.nn.Module,
) -> FitResult:
    """``result`` with the output projection (roles ``o``, ``o_bias``) solved in closed form given its
    other projections (:mod:`mha2gqa.convert.refit.output_solve`), where what ``forward`` (as in
    :func:`fit_layer`) gives is the rest plus ``o_proj``'s output, unscaled (the residual stream right
    after attention; a parallel layer's output, ``x + attn(x) + mlp(x)``), checked on the first call by
    :func:`_moves_with`: one pass over the fitted windows gathers the normal equations (each token
    weighted as ``objective`` weighs it to first order), each ridge of
    :data:`RIDGES` is solved and checked on the held-out windows, and the best is taken if it lowers
    ``result``'s held-out error. A bias of ``o_proj`` that ``result`` does not hold stays as it is.
    Several processes (``ranks``) gather the equations on their own windows and sum them."""
    has_bias = "o_bias" in result.values
    if is_exact(result.loss_before) or "o" not in result.values or type(o_proj) is not torch.nn.Linear:
        return result  # exact, not fitted, or not a plain linear map (a transposed Conv1D, a quantized one)
    if has_bias and o_proj.bias is None:
        return result
    fixed = o_proj.bias if o_proj.bias is not None and not has_bias else None  # a bias the refit does not fit
    targets, per_call, objective, ranks = data.targets, data.per_call, data.objective, data.ranks
    fitted, held = split_windows(data.windows)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    equations = NormalEquations(bias=has_bias)
    linear = True
    with torch.no_grad():
        for n, c in enumerate(chunks(ranks.own(fitted), per_call)):
            with hooked(o_proj, lambda module, args, out: seen.append((args[0], out))):
                stream = forward(result.values, c)
            # o_proj called once per call, and the output linear in its output with a unit slope
            linear = len(seen) == 1 and (n > 0 or _moves_with(forward, result.values, c, o_proj, stream))
            if not linear:
                break
            ((inputs, out),) = seen
            seen.clear()
            target = targets(c)
            wanted = target - stream + out  # stream - out: all the rest
            equations.add(inputs, wanted if fixed is None else wanted - fixed, objective.weights(target))
    if not ranks.all(linear):
        return result
    if ranks.size > 1:
        ranks.sum(equations.gram)
        ranks.sum(equations.rhs)
    best = result
    for ridge in RIDGES:
        w, b = equations.solve(result.values["o"], result.values.get("o_bias"), ridge)
        values = result.values | {"o": w} | ({"o_bias": b} if has_bias else {})
        error = heldout_error(
            forward, values, targets=targets, windows=held, per_call=per_call, objective=objective, ranks=ranks
        )
        if error < best.loss_after:
            best = FitResult(values, result.loss_before, error, False, result.steps, ridge, result.lr)
    return best


def _moves_with(
    forward: Callable[[dict[str, torch.Tensor], list[int]], torch.Tensor],
    values: dict[str, torch.Tensor],
    windows: list[int],
    o_proj: torch.nn.Module,
    output: torch.Tensor,
) -> bool:
    """Whether ``forward(values, windows)`` (which gave ``output``) moves by exactly ``d`` when
    ``o_proj``'s output moves by ``d`` (a random shift the size of ``output``): true of ``x + o(A)`` and
    ``x + o(A) + mlp(x)``, not of a layer whose MLP reads ``o``'s output or that scales or norms it."""
    shift: list[torch.Tensor] = []

    def move(module, args, out):
        d = random_shift(out, output.std().clamp_min(1))
        shift.append(d)
        return out + d

    with hooked(o_proj, move):
        moved = forward(values, windows)
    return len(shift) == 1 and unmoved(moved - output - shift[0], shift[0])


def _batches(windows: list[int], batch: int, seed: int) -> Iterator[list[int]]:
    """``batch`` of ``windows`` at a time, endlessly: each pass a new order drawn from ``seed``."""
    generator, order = torch.Generator().manual_seed(seed), []
    while True:
        if not order:
            order = torch.randperm(len(windows), generator=generator).tolist()
        yield [windows[j] for j in order[:batch]]
        order = order[batch:]
