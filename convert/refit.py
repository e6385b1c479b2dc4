"""Layer-wise refitting after the merge (``--refit``): each changed decoder layer, in order, gets its
projections fitted so that, reading the *converted* model's own hidden states, it reproduces what
the *original* layer gives on the original's hidden states (so later layers also correct what
earlier ones lost). No training of the model as a whole: one small regression per layer.

Streamed like calibration, through the layer engine (:mod:`mha2gqa.convert.layers`): the model is built on
``meta``, the embeddings run once, then each layer is loaded once (float32), runs the original
stream (its outputs are the targets), is fitted on the converted stream and runs it again with the
fitted weights, and is emptied. Memory: one layer (plus Adam's two moments of the fitted
projections) and two streams of hidden states ``[windows, seq, hidden]`` float32 (three with the
attention target: the original's stream after attention), which go to memory-mapped files when they
exceed ``--refit-memory``.

The converted layer runs as the *source* layer class reading the new K/V heads each repeated over
the source heads it replaced (a GQA layer with ``G`` groups is exactly the MHA layer whose K/V heads
are equal within each group, :mod:`~mha2gqa.convert.layer_view`): separate K/V projections are swapped for
:class:`~mha2gqa.convert.layer_view.RepeatedHeads`,
which repeat their outputs; a fused projection gets repeated weights. So every family's own
attention, RoPE, biases and per-head norms run as transformers wrote them, and the gradient of a
shared K/V head is the sum over its group: tied parameters stay tied by construction. Per-head norms
and everything outside the projections stay as the merge left them.

What the fit reproduces (``--refit-target``): by default the residual stream after the attention
block, ``x + attn(x)``, where the layer reads its input only through it (a pre-norm layer; checked on
each layer by :func:`reads_after_attention`), so a step runs the layer only as far as its attention
(a hook stops it there) and neither runs nor differentiates the MLP; matching that stream matches
everything after it. Layers of other shapes (attention beside the MLP, normed after) are fitted on
their output, as is every layer with ``layer``.

The fit: Adam on the squared error of that target (each projection's step sized to its own RMS,
so that a rescaled model is fitted the same way: :func:`relative_steps`), each hidden dimension louder than the
average counted relative to its own mean square in the original's output (:func:`dimension_scale`:
a real model's few huge hidden dimensions would otherwise be nearly all of the error), over
``--refit-batch`` windows per step; one window in :data:`HELDOUT_EVERY` (at least one) is held out
and checked :data:`CHECKS` times per layer; the best held-out weights are kept, the fit stops after
:data:`PATIENCE` checks that took off less than :data:`MIN_GAIN` of it (not before half its steps),
and a layer whose held-out error did not fall keeps its merged weights (bit for bit). A layer whose
error starts at zero (an exact conversion) is not touched. Where what the fit matches is linear in the
output projection's output (the stream after attention; a parallel layer's output), that projection
then gets its closed-form solution given the fitted q/k/v (:func:`solve_output`), shrunk toward Adam's
and kept only where it lowers the held-out error.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from mha2gqa.convert.layer_view import LayerWeights, norm_overrides, planned
from mha2gqa.convert.layers import calibration_ids, each_layer, first_layer_inputs, skeleton
from mha2gqa.convert.methods import HeadShape
from mha2gqa.convert.output_solve import RIDGES, NormalEquations
from mha2gqa.convert.prepare import Conversion
from mha2gqa.convert.settings import calibration_window, refit_windows
from mha2gqa.convert.shard_writer import OutputTensor
from mha2gqa.convert.tensor_sources import attention_names
from mha2gqa.core.conversion_record import (
    ATTENTION_TARGET,
    LAYER_TARGET,
    LOUD_SCALED_ERROR,
    O_SOLVED,
    Refit,
    RefitLayer,
)
from mha2gqa.core.dtypes import BY_CODE
from mha2gqa.core.errors import Mha2GqaError, SettingError
from mha2gqa.core.memory import map_large_allocations
from mha2gqa.core.signals import check as check_signals
from mha2gqa.core.steps import step_size
from mha2gqa.core.units import parse_size

#: one calibration window in this many is held out (at least one)
HELDOUT_EVERY = 8
#: held-out checks per layer (every ``steps / CHECKS`` steps)
CHECKS = 10
#: learning rates a layer's fit tries (times --refit-lr) for the steps of its first check, each from the
#: merge on the same windows; the one with the least held-out error goes on. The relative step a model
#: wants differs (SmolLM2-135M: about 0.015 of each projection's RMS; pydocs-mha-8h, whose projections
#: are 6x smaller: about 0.09): docs/methods.md, "Steps sized to the model"
PROBE = (1.0, 3.0, 9.0)
#: checks without a lower held-out error (by at least MIN_GAIN of it) before a layer's fit stops
PATIENCE = 3
#: the share of the best held-out error a check must take off to count as progress
MIN_GAIN = 0.005
#: tokens per forward call of a layer (windows batched up to this), by device type: on a CPU a default
#: step (REFIT_STEP_TOKENS) in one call, its activations still small (pydocs-mha-8h: 0.91x the time of
#: 512-token calls); on a GPU a call that size is bound by kernel launches, so eight
#: windows go in one (SmolLM2-135M's shape on an H200: 8.8 ms a step, not 31.2)
CALL_TOKENS = {"cpu": 1024, "cuda": 8 * 512}


def call_tokens(device: torch.device) -> int:
    """Tokens per forward call of a layer on ``device`` (:data:`CALL_TOKENS`; a CPU's for others)."""
    return CALL_TOKENS.get(device.type, CALL_TOKENS["cpu"])


@dataclass(frozen=True)
class FitResult:
    values: dict[str, torch.Tensor]
    loss_before: float
    loss_after: float
    kept: bool
    steps: int
    ridge: float | None = None  # the closed-form o_proj's (:func:`solve_output`), None: not taken
    lr: float | None = None  # the relative learning rate the fit went on with (of those probed)


def chunks(indices: list[int], size: int) -> list[list[int]]:
    """``indices`` in consecutive runs of ``size`` (the last may be shorter)."""
    return [indices[j : j + size] for j in range(0, len(indices), size)]


def split_windows(n: int) -> tuple[list[int], list[int]]:
    """``(fitted, held out)`` window indices: the last one in :data:`HELDOUT_EVERY` (at least one)."""
    held = max(1, n // HELDOUT_EVERY)
    return list(range(n - held)), list(range(n - held, n))


def fit_layer(
    forward: Callable[[dict[str, torch.Tensor], list[int]], torch.Tensor],
    start: dict[str, torch.Tensor],
    trainable: list[str],
    targets: Callable[[list[int]], torch.Tensor],
    windows: int,
    *,
    steps: int,
    lr: float,
    batch: int,
    seed: int,
    per_call: int = 1,
    scale: torch.Tensor | None = None,
    probe: tuple[float, ...] = PROBE,
) -> FitResult:
    """Fit the ``trainable`` entries of ``start`` so that ``forward(values, windows)`` (those windows'
    outputs ``[len(windows), T, hidden]``) matches ``targets(windows)``: Adam on the mean squared
    error (each tensor's learning rate ``lr`` times its RMS: :func:`relative_steps`), each hidden
    dimension's squares times ``scale`` ``[hidden]`` (None: ones), over ``batch``
    windows a step (``per_call`` windows per forward), early stopped on the held-out windows
    (:func:`split_windows`): a check that does not lower the best held-out error by
    :data:`MIN_GAIN` of it counts towards :data:`PATIENCE`, and the fit stops there once half its
    steps are done. The first check's steps run once for each learning rate ``lr x`` a factor of
    ``probe``, from ``start`` on the same windows, and the one with the least held-out error goes on.
    Returns the best values, or ``start`` itself when no check lowered the held-out error (``kept``)."""
    fitted, held = split_windows(windows)
    heldout = partial(heldout_error, forward, targets=targets, windows=held, per_call=per_call, scale=scale)
    before = heldout(start)
    if before == 0.0 or not trainable:  # exact, or nothing to fit: nothing moves
        return FitResult(start, before, before, True, 0)
    every, batches = max(1, steps // CHECKS), _batches(fitted, batch, seed)
    train = partial(_train_step, forward, targets=targets, scale=scale, per_call=per_call)
    first = [next(batches) for _ in range(min(every, steps))]  # the first check's steps, for every rate tried
    tried = []
    for factor in probe:
        values = {r: t.clone().requires_grad_() if r in trainable else t for r, t in start.items()}
        optimizer = torch.optim.Adam(relative_steps(values, trainable, lr * factor), foreach=False)  # no temporaries
        for chosen in first:
            train(values, optimizer, chosen)
        tried.append((heldout(values), factor, values, optimizer))
    now, factor, values, optimizer = min(tried, key=lambda t: t[0])
    del tried
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


def _train_step(forward, values, optimizer, chosen: list[int], *, targets, scale, per_call: int) -> None:
    """One Adam step on the windows ``chosen`` (``per_call`` windows' graph at a time)."""
    check_signals()
    optimizer.zero_grad(set_to_none=True)
    for c in chunks(chosen, per_call):
        loss = torch.mean(_scaled_squares(forward(values, c), targets(c), scale)) * (len(c) / len(chosen))
        loss.backward()
    optimizer.step()


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
    scale: torch.Tensor | None,
) -> float:
    """The mean scaled squared error of ``forward(values, ...)`` against ``targets`` over ``windows``
    (``per_call`` at a time), without gradients: what :func:`fit_layer` checks."""
    with torch.no_grad():
        total = sum(
            float(_scaled_squares(forward(values, c), targets(c), scale).sum()) for c in chunks(windows, per_call)
        )
    return total / (len(windows) * targets(windows[:1]).numel())


def solve_output(
    result: FitResult,
    forward: Callable[[dict[str, torch.Tensor], list[int]], torch.Tensor],
    *,
    targets: Callable[[list[int]], torch.Tensor],
    windows: int,
    per_call: int,
    scale: torch.Tensor | None,
    o_proj: torch.nn.Module,
) -> FitResult:
    """``result`` with the output projection (roles ``o``, ``o_bias``) solved in closed form given its
    other projections (:mod:`mha2gqa.convert.output_solve`), where what ``forward`` (as in
    :func:`fit_layer`) gives is the rest plus ``o_proj``'s output, unscaled (the residual stream right
    after attention; a parallel layer's output, ``x + attn(x) + mlp(x)``), checked on the first call by
    :func:`_moves_with`: one pass over the fitted windows gathers the normal equations, each ridge of
    :data:`RIDGES` is solved and checked on the held-out windows, and the best is taken if it lowers
    ``result``'s held-out error. A bias of ``o_proj`` that ``result`` does not hold stays as it is."""
    has_bias = "o_bias" in result.values
    if result.loss_before == 0.0 or "o" not in result.values or type(o_proj) is not torch.nn.Linear:
        return result  # exact, not fitted, or not a plain linear map (a transposed Conv1D, a quantized one)
    if has_bias and o_proj.bias is None:
        return result
    fixed = o_proj.bias if o_proj.bias is not None and not has_bias else None  # a bias the refit does not fit
    fitted, held = split_windows(windows)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    equations = NormalEquations(bias=has_bias)
    with torch.no_grad():
        for n, c in enumerate(chunks(fitted, per_call)):
            with _hooked(o_proj, lambda module, args, out: seen.append((args[0], out))):
                stream = forward(result.values, c)
            if len(seen) != 1:  # o_proj not called once per call
                return result
            ((inputs, out),) = seen
            seen.clear()
            if n == 0 and not _moves_with(forward, result.values, c, o_proj, stream):
                return result  # the output is not linear in o_proj's, with a unit slope
            wanted = targets(c) - stream + out  # stream - out: all the rest
            equations.add(inputs, wanted if fixed is None else wanted - fixed)
    best = result
    for ridge in RIDGES:
        w, b = equations.solve(result.values["o"], result.values.get("o_bias"), ridge)
        values = result.values | {"o": w} | ({"o_bias": b} if has_bias else {})
        error = heldout_error(forward, values, targets=targets, windows=held, per_call=per_call, scale=scale)
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
        d = _random_shift(out, output.std().clamp_min(1))
        shift.append(d)
        return out + d

    with _hooked(o_proj, move):
        moved = forward(values, windows)
    return len(shift) == 1 and _unmoved(moved - output - shift[0], shift[0])


def _random_shift(like: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
    """A fixed random tensor shaped, typed and placed as ``like``, entries of standard deviation ``size``:
    the probe of :func:`reads_after_attention` and :func:`_moves_with`."""
    return torch.randn(like.shape, generator=torch.Generator().manual_seed(0)).to(like) * size


def _unmoved(difference: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether ``difference`` is rounding next to ``reference`` (a norm within 1e-4 of its norm)."""
    return bool(difference.norm() <= 1e-4 * reference.norm())


def _batches(windows: list[int], batch: int, seed: int) -> Iterator[list[int]]:
    """``batch`` of ``windows`` at a time, endlessly: each pass a new order drawn from ``seed``."""
    generator, order = torch.Generator().manual_seed(seed), []
    while True:
        if not order:
            order = torch.randperm(len(windows), generator=generator).tolist()
        yield [windows[j] for j in order[:batch]]
        order = order[batch:]


def _scaled_squares(out: torch.Tensor, target: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``(out - target)²``, each hidden dimension times ``scale`` ``[hidden]`` (None: ones)."""
    squares = (out - target) ** 2
    return squares if scale is None else squares * scale


def batched(kwargs: dict[str, Any], n: int) -> dict[str, Any]:
    """One window's layer keyword arguments for ``n`` windows at once: tensors with a batch dimension
    of one (masks, positions, RoPE tables) expanded to ``n``; the rest as they are."""

    def expand(x):
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[0] == 1:
            return x.expand(n, *x.shape[1:])
        if isinstance(x, tuple):
            return tuple(expand(y) for y in x)
        return x

    return {k: expand(v) for k, v in kwargs.items()}


class HiddenStates:
    """``[windows, T, hidden]`` float32 hidden states, in memory or in a memory-mapped file."""

    def __init__(self, first: torch.Tensor, spill: Path | None) -> None:
        if spill is None:
            self.data = first.clone()
        else:
            _reserve(spill, first.numel() * 4)
            self.data = torch.from_file(str(spill), shared=True, size=first.numel(), dtype=torch.float32)
            self.data = self.data.view(first.shape)
            self.data.copy_(first)

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, windows: list[int]) -> torch.Tensor:
        return self.data[windows]

    def __setitem__(self, windows: list[int], value: torch.Tensor) -> None:
        self.data[windows] = value.detach().to("cpu", torch.float32)

    def advance(self, runs: list[list[int]], step: Callable[[torch.Tensor, list[int]], torch.Tensor], dev) -> None:
        """Replace the states by ``step(states, windows)`` (one layer), ``runs`` of windows at a time."""
        with torch.no_grad():
            for w in runs:
                check_signals()
                self[w] = step(self[w].to(dev), w)


def _reserve(path: Path, size: int) -> None:
    """Create ``path`` with ``size`` bytes of disk reserved up front: a memory-mapped file written
    into where the disk is full kills the process (SIGBUS), with no message and nothing cleaned up."""
    import errno
    import os

    from mha2gqa.core.errors import disk_full

    with open(path, "wb") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, size)
        except OSError as e:
            if disk_full(e):
                raise Mha2GqaError(
                    f"disk full while writing {path}: --refit's hidden states need {size / 2**20:,.1f} MiB beside "
                    "DST; free space there, or raise --refit-memory to keep them in memory"
                ) from None
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            f.truncate(size)  # a filesystem that cannot reserve: a sparse file, as before


def dimension_scale(states: HiddenStates, windows: list[int], per_call: int) -> torch.Tensor:
    """``[hidden]``: 1 / max(each hidden dimension's mean square in ``states`` over ``windows``, their
    average). A few hidden dimensions of a real model are hundreds of times larger than the rest and
    carry drift from every earlier layer that attention cannot undo: unscaled, they are nearly all
    of the squared error. Scaled, each of them counts relative to its own size, and every other
    dimension as plain squared error (over the average size, a constant): a model without such
    dimensions is fitted as before."""
    total = None
    for run in chunks(windows, per_call):
        part = states[run].double().pow(2).sum((0, 1))
        total = part if total is None else total + part
    mean_square = total / (len(windows) * states.data.shape[1])
    return (1 / mean_square.clamp_min(float(mean_square.mean()))).float()


def _output(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


class _Stop(Exception):
    """Raised by the hook of :func:`after_attention` to skip the rest of the layer."""


@contextlib.contextmanager
def _hooked(module: torch.nn.Module, hook: Callable) -> Iterator[None]:
    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def after_attention(call: Callable[[torch.Tensor], Any], attention: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x + a``: the layer's input plus what its attention block ``attention`` returns when ``call(x)``
    runs the layer, which stops there (the rest of the layer is neither run nor differentiated)."""
    seen: list[torch.Tensor] = []

    def stop(module, args, out):
        seen.append(_output(out))
        raise _Stop

    with _hooked(attention, stop), contextlib.suppress(_Stop):
        call(x)
    return x + seen[0]


def reads_after_attention(call: Callable[[torch.Tensor], Any], attention: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether the layer ``call`` reads its input ``x`` ``[n, T, hidden]`` only through ``x + a`` (``a``:
    its attention block's output), as a pre-norm layer ``h = x + attn(norm(x)); y = h + mlp(norm(h))``
    does and a parallel (``x + attn(x) + mlp(x)``), sandwich-norm (``x + norm(attn(x))``) or scaled
    (``x + m * attn(x)``) one does not: the layer run on ``x + d`` with its attention output replaced
    by ``a - d`` must give the same output as on ``x``."""
    seen: list[torch.Tensor] = []

    def keep(module, args, out):
        seen.append(_output(out))

    with torch.no_grad():
        with _hooked(attention, keep):
            y = _output(call(x))
        d = _random_shift(x, x.std())

        def replace(module, args, out):
            return (seen[0] - d, *out[1:]) if isinstance(out, tuple) else seen[0] - d

        with _hooked(attention, replace):
            moved = _output(call(x + d))
    return _unmoved(moved - y, y)


def _spilled(path: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(name)


def _norm_overrides(c: Conversion, tensors: Mapping[str, OutputTensor], layer: int, shape: HeadShape, prefix: str):
    """The converted per-head key norm of ``layer`` in the source module's shape (:func:`norm_overrides`)."""
    return norm_overrides(c.family, planned(tensors, c.ckpt), tensors, layer, shape, prefix)


@dataclass
class _Streams:
    """The refit's calibration windows and its two streams of hidden states, layer by layer."""

    ids: torch.Tensor  # [windows, seq_len] token ids
    kw: dict[str, Any]  # a decoder layer's keyword arguments for one window (masks, positions, RoPE)
    original: HiddenStates  # the original model's inputs to the current layer
    converted: HiddenStates  # the converted model's (the refitted layers before it)
    per_call: int  # windows per forward call
    batch: int  # windows per fit step
    dev: torch.device
    targets: HiddenStates | None  # --refit-target attention: the original's stream after the layer's attention

    @property
    def every(self) -> list[list[int]]:
        """All windows, ``per_call`` at a time."""
        return chunks(list(range(len(self.ids))), self.per_call)


def _streams(c: Conversion, model, work: Path) -> _Streams:
    """The calibration windows (at least two) and the first layer's inputs in both streams (spilled
    to ``work`` beyond ``--refit-memory``)."""
    from mha2gqa.core.models import resolve_device

    s, dev = c.settings, resolve_device(c.settings.device)
    seq_len = calibration_window(s.calibration_seq_len, getattr(model.config, "max_position_embeddings", None))
    ids = calibration_ids(c.ckpt.folder, s.calibration, min(s.refit_tokens, s.calibration_tokens), seq_len)
    if len(ids) < 2:
        raise SettingError(
            "refit_tokens", f"{{name}}: {ids.numel()} tokens make one window of {seq_len}; --refit needs two or more"
        )
    with torch.no_grad():
        states = first_layer_inputs(model, c.ckpt, ids.to(dev), dev)
    first = torch.cat([h.cpu() for h, _ in states])
    kw = states[0][1]  # the same for every window: equal lengths, no padding
    del states
    work.mkdir(parents=True, exist_ok=True)
    names = ("original", "converted", "targets") if s.refit_target == "attention" else ("original", "converted")
    spill = len(names) * first.numel() * 4 > parse_size(s.refit_memory)
    streams = {name: HiddenStates(first, work / f"{name}.f32" if spill else None) for name in names}
    per_call = max(1, call_tokens(dev) // seq_len)
    batch = min(refit_windows(s.refit_batch, seq_len), len(split_windows(len(ids))[0]))  # at most every fitted one
    return _Streams(ids, kw, streams["original"], streams["converted"], per_call, batch, dev, streams.get("targets"))


def _attention_module(c: Conversion, by_name: Mapping[str, OutputTensor], i: int, prefix: str) -> str:
    """Layer ``i``'s attention block, relative to the layer (the module holding its output projection)."""
    o_proj = attention_names(by_name, c.family, i)["o"]
    return o_proj[len(prefix) : -len(".weight")].rpartition(".")[0]


def _advance_original(
    source_layer: Callable[[torch.Tensor, list[int]], torch.Tensor], st: _Streams, attention: torch.nn.Module | None
) -> None:
    """Run the original stream through the source layer (``source_layer(states, windows)``); with
    ``attention`` (its attention block), keep the residual stream after it, ``x + a``, in
    ``st.targets`` on the way."""
    if attention is None:
        st.original.advance(st.every, source_layer, st.dev)
        return
    seen: list[torch.Tensor] = []

    def step(x: torch.Tensor, w: list[int]) -> torch.Tensor:
        y = source_layer(x, w)
        st.targets[w] = x + seen.pop()
        return y

    with _hooked(attention, lambda module, args, out: seen.append(_output(out))):
        st.original.advance(st.every, step, st.dev)


def _refit_layer(
    c: Conversion,
    layer,
    i: int,
    prefix: str,
    st: _Streams,
    by_name: dict[str, OutputTensor],
    work: Path,
    attention: torch.nn.Module | None,
) -> FitResult:
    """Fit layer ``i``'s projections (its module ``layer``, materialized, the original stream already
    past it), write them to ``work`` and point ``by_name`` at them, and advance the converted stream
    through the layer as written. With ``attention`` (the layer's attention block) the fit reproduces
    the original's residual stream after it (``st.targets``) and runs the layer only that far."""
    from accelerate.utils import set_module_tensor_to_device

    s, dims, dev = c.settings, c.dims, st.dev
    shape = HeadShape.of(dims, c.targets[i])
    names = attention_names(by_name, c.family, i)
    weights = LayerWeights({n: planned(by_name, c.ckpt)(n).to(dev) for n in names.values()}, names, c.family, shape)
    norms = {k: v.to(dev) for k, v in _norm_overrides(c, by_name, i, shape, prefix).items()}
    for name in [*weights.module_view(weights.values, prefix), *norms]:  # replaced on every call: free them
        set_module_tensor_to_device(layer, name, "meta")
    weights.adapt(layer, prefix)

    def converted_layer(values, h, w):
        params = weights.module_view(values, prefix) | norms
        return _output(torch.func.functional_call(layer, params, (h,), batched(st.kw, len(w))))

    def fitted_part(values, w):
        x = st.converted[w].to(dev)
        if attention is None:
            return converted_layer(values, x, w)
        return after_attention(lambda h: converted_layer(values, h, w), attention, x)

    target = st.original if attention is None else st.targets
    fitted, _ = split_windows(len(st.ids))
    targets, scale = (lambda w: target[w].to(dev)), dimension_scale(target, fitted, st.per_call).to(dev)
    trainable = [r for r in weights.values if r[0] in s.refit_roles()]
    fit_kw = {"steps": s.refit_steps, "lr": s.refit_lr, "batch": st.batch, "seed": s.seed * 1_000_003 + i}
    result = fit_layer(
        fitted_part, weights.values, trainable, targets, len(st.ids), per_call=st.per_call, scale=scale, **fit_kw
    )
    if "o" in trainable:
        o_proj = layer.get_submodule(names["o"][len(prefix) : -len(".weight")])
        kw = {"targets": targets, "windows": len(st.ids), "per_call": st.per_call, "scale": scale}
        result = solve_output(result, fitted_part, o_proj=o_proj, **kw)
    out = weights.outputs(result.values, {n: BY_CODE[by_name[n].dtype].torch for n in names.values()})
    written = LayerWeights(out, names, c.family, shape).values  # as stored: what the next layer reads
    st.converted.advance(st.every, partial(converted_layer, written), dev)
    _spill_layer(out, work / f"layer-{i}.safetensors", by_name)
    return result


def _spill_layer(out: dict[str, torch.Tensor], path: Path, by_name: dict[str, OutputTensor]) -> None:
    """Write a refitted layer's tensors to ``path`` and point its rules in ``by_name`` at them."""
    from safetensors.torch import save_file

    save_file({n: t.cpu() for n, t in out.items()}, str(path))
    for n in out:
        rule = by_name[n]
        by_name[n] = OutputTensor(n, rule.dtype, rule.shape, partial(_spilled, path, n))


def refit(
    c: Conversion, tensors: list[OutputTensor], work: Path, log: Callable[[str], None] | None = None
) -> tuple[list[OutputTensor], Refit]:
    """Refit every changed layer of the planned conversion ``tensors`` (see the module doc); returns
    the plan with each refitted layer's projections read from ``work`` (safetensors written there,
    one file per layer) and the :class:`Refit` record."""
    from mha2gqa.core.progress import bar as progress_bar

    s = c.settings
    map_large_allocations()
    model = skeleton(c.ckpt)
    st = _streams(c, model, work)
    by_name = {t.name: t for t in tensors}
    records: list[RefitLayer] = []
    whole: list[int] = []  # layers fitted on their output although the target is attention's
    desc = f"refitting on {st.ids.numel():,} tokens"
    with progress_bar(total=c.dims.num_layers, unit="layer", desc=desc, disable=not s.progress) as bar:
        for i, layer, prefix in each_layer(model, c.ckpt, st.dev, torch.float32):
            layer.requires_grad_(False)

            def source_layer(h, w, layer=layer):
                return _output(layer(h, **batched(st.kw, len(w))))

            changed = c.targets[i] != c.dims.num_kv_heads
            attention = None
            if changed and s.refit_target == "attention":
                path = _attention_module(c, by_name, i, prefix)
                attention = layer.get_submodule(path) if path else None
                first = st.original[[0]].to(st.dev)
                if attention is None or not reads_after_attention(partial(source_layer, w=[0]), attention, first):
                    attention = None
                    whole.append(i)
            _advance_original(source_layer, st, attention)
            if not changed:  # an exact copy, run as it is
                st.converted.advance(st.every, source_layer, st.dev)
            else:
                t0 = time.perf_counter()
                result = _refit_layer(c, layer, i, prefix, st, by_name, work, attention)  # one layer at a time
                records.append(_layer_record(i, result, time.perf_counter() - t0, log))
                del result
            bar.update(1)
    fitted, held = split_windows(len(st.ids))
    record = Refit(
        data=s.calibration,
        tokens=st.ids.numel(),
        windows=len(fitted),
        heldout_windows=len(held),
        steps=s.refit_steps,
        lr=s.refit_lr,
        batch=st.batch,
        params=list(s.refit_roles()),
        seed=s.seed,
        layers=records,
        error=LOUD_SCALED_ERROR,
        target=_target(s.refit_target, whole, [r.layer for r in records]),
    )
    return [by_name[t.name] for t in tensors], record


def _layer_record(i: int, result, seconds: float, log: Callable[[str], None] | None) -> RefitLayer:
    """Layer ``i``'s refit as recorded (and logged)."""
    if log is not None:
        log(
            f"layer {i}: held-out error {result.loss_before:.4g} -> {result.loss_after:.4g}"
            + (" (kept the merged weights)" if result.kept else "")
            + f", {result.steps} steps"
            + (f" at lr {result.lr:g}" if result.lr is not None else "")
            + (f", {O_SOLVED} (ridge {result.ridge:g})" if result.ridge is not None else "")
            + f", {seconds:.1f} s"
        )
    return RefitLayer(
        i, result.loss_before, result.loss_after, result.kept, result.steps, round(seconds, 3), result.ridge, result.lr
    )


def _target(asked: str, whole: list[int], refitted: list[int]) -> str:
    """:attr:`Refit.target`: ``whole``: the refitted layers that were fitted on their output although
    ``asked`` was ``attention`` (they do not read their input only through the stream after it)."""
    if asked == "layer" or (whole and len(whole) == len(refitted)):
        return LAYER_TARGET
    if not whole:
        return ATTENTION_TARGET
    return f"{ATTENTION_TARGET} ({LAYER_TARGET} in layers {', '.join(map(str, whole))})"
