"""Running a decoder layer only as far as its attention block: the residual stream after it
(:func:`after_attention`), and whether a layer reads its input only through it
(:func:`reads_after_attention`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch


def layer_output(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


class _Stop(Exception):
    """Raised by the hook of :func:`after_attention` to skip the rest of the layer."""


@contextlib.contextmanager
def hooked(module: torch.nn.Module, hook: Callable) -> Iterator[None]:
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
        seen.append(layer_output(out))
        raise _Stop

    with hooked(attention, stop), contextlib.suppress(_Stop):
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
        seen.append(layer_output(out))

    with torch.no_grad():
        with hooked(attention, keep):
            y = layer_output(call(x))
        d = random_shift(x, x.std())

        def replace(module, args, out):
            return (seen[0] - d, *out[1:]) if isinstance(out, tuple) else seen[0] - d

        with hooked(attention, replace):
            moved = layer_output(call(x + d))
    return unmoved(moved - y, y)


def random_shift(like: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
    """A fixed random tensor shaped, typed and placed as ``like``, entries of standard deviation ``size``:
    the probe of :func:`reads_after_attention` and :func:`_moves_with`."""
    return torch.randn(like.shape, generator=torch.Generator().manual_seed(0)).to(like) * size


def unmoved(difference: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether ``difference`` is rounding next to ``reference`` (a norm within 1e-4 of its norm)."""
    return bool(difference.norm() <= 1e-4 * reference.norm())
