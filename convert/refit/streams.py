"""The refit's streams of hidden states (the original's, the converted model's, the attention
targets), in memory or spilled to memory-mapped files reserved up front, and how many windows a
call runs on each device."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mha2gqa.convert.engine.layers import calibration_ids, first_layer_inputs
from mha2gqa.convert.prepare import Conversion
from mha2gqa.convert.refit.fit import chunks, split_windows
from mha2gqa.convert.refit.objective import normalized, scale_of
from mha2gqa.convert.settings import calibration_window, refit_windows
from mha2gqa.core.dims import max_positions
from mha2gqa.core.errors import SettingError
from mha2gqa.core.ranks import Ranks, ranks
from mha2gqa.core.signals import check as check_signals
from mha2gqa.core.units import parse_size

#: tokens per forward call of a layer (windows batched up to this), by device type: on a CPU a default
#: step (REFIT_STEP_TOKENS) in one call, its activations still small (pydocs-mha-8h: 0.91x the time of
#: 512-token calls); on a GPU a call that size is bound by kernel launches, so eight
#: windows go in one (SmolLM2-135M's shape on an H200: 8.8 ms a step, not 31.2)
CALL_TOKENS = {"cpu": 1024, "cuda": 8 * 512}


def call_tokens(device: torch.device) -> int:
    """Tokens per forward call of a layer on ``device`` (:data:`CALL_TOKENS`; a CPU's for others)."""
    return CALL_TOKENS.get(device.type, CALL_TOKENS["cpu"])


class HiddenStates:
    """``[windows, T, hidden]`` float32 hidden states, in memory or in a memory-mapped file, of the
    windows ``owned`` (indices of the whole list, in ``first``'s order; None: all), read and written
    by those indices."""

    def __init__(self, first: torch.Tensor, spill: Path | None, owned: list[int] | None = None) -> None:
        self.at = {w: j for j, w in enumerate(owned if owned is not None else range(len(first)))}
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
        return self.data[[self.at[w] for w in windows]]

    def __setitem__(self, windows: list[int], value: torch.Tensor) -> None:
        self.data[[self.at[w] for w in windows]] = value.detach().to("cpu", torch.float32)

    def advance(self, runs: list[list[int]], step: Callable[[torch.Tensor, list[int]], torch.Tensor], dev) -> None:
        """Replace the states by ``step(states, windows)`` (one layer), ``runs`` of windows at a time
        (stored in float32, whatever arithmetic the step ran in: :meth:`Streams.advance`)."""
        with torch.no_grad():
            for w in runs:
                check_signals()
                self[w] = step(self[w].to(dev), w)


@contextlib.contextmanager
def autocast_outside(dev: torch.device, dtype: torch.dtype | None, inside: torch.nn.Module | None) -> Iterator[None]:
    """Autocast to ``dtype`` (None: float32 throughout) except while the module ``inside`` runs: in
    float32 there, its floating inputs cast to float32 first."""
    if dtype is None:
        yield
        return
    exits: list[Any] = []

    def enter(module, args, kwargs):
        exits.append(torch.autocast(dev.type, enabled=False))
        exits[-1].__enter__()
        return tuple(_float32(a) for a in args), {k: _float32(v) for k, v in kwargs.items()}

    def leave(module, args, out) -> None:
        exits.pop().__exit__(None, None, None)

    hooks = [] if inside is None else [inside.register_forward_pre_hook(enter, with_kwargs=True),
                                       inside.register_forward_hook(leave, always_call=True)]  # fmt: skip
    try:
        with torch.autocast(dev.type, dtype=dtype):
            yield
    finally:
        for hook in hooks:
            hook.remove()


def _float32(x: Any) -> Any:
    return x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _reserve(path: Path, size: int) -> None:
    """Create ``path`` with ``size`` bytes of disk reserved up front: a memory-mapped file written
    into where the disk is full kills the process (SIGBUS), with no message and nothing cleaned up."""
    import errno
    import os

    from mha2gqa.core.errors import OutOfSpace, disk_full

    with open(path, "wb") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, size)
        except OSError as e:
            if disk_full(e):
                raise OutOfSpace(
                    f"disk full while writing {path}: --refit's hidden states need {size / 2**20:,.1f} MiB beside "
                    "DST; free space there, or raise --refit-memory to keep them in memory"
                ) from None
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            f.truncate(size)  # a filesystem that cannot reserve: a sparse file, as before


def dimension_scale(states: HiddenStates, windows: list[int], per_call: int, ranks: Ranks) -> torch.Tensor:
    """``[hidden]``: the refit's weight of each hidden dimension (:func:`~mha2gqa.convert.refit.objective.scale_of`)
    from its mean square in ``states`` over ``windows``, each token's vector over its RMS first. Each of
    ``ranks`` sums its own windows; the sums are summed."""
    total = states.data.new_zeros(states.data.shape[-1], dtype=torch.float64)
    for run in chunks(ranks.own(windows), per_call):
        total += normalized(states[run].double()).pow(2).sum((0, 1))
    ranks.sum(total)
    return scale_of(total / (len(windows) * states.data.shape[1]))


@dataclass
class Streams:
    """The refit's calibration windows and its two streams of hidden states, layer by layer."""

    ids: torch.Tensor  # [windows, seq_len] token ids
    kw: dict[str, Any]  # a decoder layer's keyword arguments for one window (masks, positions, RoPE)
    original: HiddenStates  # the original model's inputs to the current layer
    converted: HiddenStates  # the converted model's (the refitted layers before it)
    per_call: int  # windows per forward call
    batch: int  # windows per fit step
    dev: torch.device
    targets: HiddenStates | None  # --refit-target attention: the original's stream after the layer's attention
    ranks: Ranks  # the processes sharing the windows (each holds its own windows' states)
    mine: list[int]  # this process's windows
    precision: str  # the fit steps' (and the calibration's) arithmetic: bf16 (autocast) or no (float32)
    work: Path  # this process's scratch folder (spilled streams, the rate probe's best run)

    @property
    def autocast(self) -> torch.dtype | None:
        """The dtype the fit steps run under autocast in (None: float32)."""
        from mha2gqa.core.models import autocast_dtype

        return autocast_dtype(self.precision)

    def advance(self, stream: HiddenStates, step: Callable[[torch.Tensor, list[int]], torch.Tensor], exact) -> None:
        """``stream`` through one layer (``step(states, windows)``), its products in the fit steps' arithmetic
        (:attr:`autocast`) except inside ``exact``, the layer's attention block where the layer is converted
        (None: an unchanged layer), which runs in float32: the rest of a layer (its MLP, 3/4 of its
        products) has the same shapes and weights in the source's layer and the converted one, so two
        streams that an exact merge leaves equal stay equal (bf16 products of the source's and the
        converted attention's shapes round apart: such a layer's held-out error is then 0, and it is not
        fitted), and a layer's pass over the streams takes about 0.6 of float32's time (SmolLM2-135M)."""
        with autocast_outside(self.dev, self.autocast, exact):
            stream.advance(self.every, step, self.dev)

    @property
    def every(self) -> list[list[int]]:
        """This process's windows, ``per_call`` at a time."""
        return chunks(self.mine, self.per_call)


def open_streams(c: Conversion, model, work: Path) -> Streams:
    """The calibration windows (at least two) and the first layer's inputs in both streams (spilled
    to ``work`` beyond ``--refit-memory``). Under a launcher each process holds the streams of its
    share of the windows (:meth:`Ranks.own`), at least one fitted window each."""
    from mha2gqa.core.models import resolve_device

    s, dev = c.settings, resolve_device(c.settings.device)
    seq_len = calibration_window(s.calibration_seq_len, max_positions(model.config))
    ids = calibration_ids(c.ckpt.folder, c.text, min(s.refit_tokens, s.calibration_tokens), seq_len)
    if len(ids) < 2:
        raise SettingError(
            "refit_tokens", f"{{name}}: {ids.numel()} tokens make one window of {seq_len}; --refit needs two or more"
        )
    team = ranks()
    team.share(split_windows(len(ids))[0], "--refit's fitted calibration windows")  # one line if too few
    mine = team.own(range(len(ids)))
    with torch.no_grad():
        states = first_layer_inputs(model, c.ckpt, ids[mine].to(dev), dev)
    first = torch.cat([h.cpu() for h, _ in states])
    kw = states[0][1]  # the same for every window: equal lengths, no padding
    del states
    work.mkdir(parents=True, exist_ok=True)
    names = ("original", "converted", "targets") if s.refit_target == "attention" else ("original", "converted")
    spill = len(names) * first.numel() * 4 > parse_size(s.refit_memory)
    streams = {name: HiddenStates(first, work / f"{name}.f32" if spill else None, mine) for name in names}
    per_call = max(1, call_tokens(dev) // seq_len)
    batch = min(refit_windows(s.refit_batch, seq_len), len(split_windows(len(ids))[0]))  # at most every fitted one
    original, converted, targets = streams["original"], streams["converted"], streams.get("targets")
    return Streams(ids, kw, original, converted, per_call, batch, dev, targets, team, mine, s.refit_arithmetic(), work)
