"""The processes of one run (``torchrun`` / ``accelerate launch``: gloo on CPUs, NCCL on GPUs), as every
stage sees them (the conversion's statistics and refit, ``eval``'s split and gather, uptraining's memory
report): this process's rank and the count, its share of a list of windows, sums, gathers and rank 0's
decisions across the processes. One process (no launcher) is rank 0 of 1 and every function is the
identity, so the code that calls them is the same for one process and many. The group itself is formed
by ``accelerate`` (:func:`mha2gqa.core.models.resolve_device`, or uptraining's ``Accelerator``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from mha2gqa.core.errors import Mha2GqaError

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    """This process's ``rank`` among ``size`` processes."""

    rank: int = 0
    size: int = 1

    @property
    def main(self) -> bool:
        """Whether this process writes (rank 0)."""
        return self.rank == 0

    def share(self, items: Sequence[T], what: str) -> Sequence[T]:
        """This rank's items (every ``size``-th from ``rank``); refused in one line when some rank
        would have none (``what`` names them)."""
        if len(items) < self.size:
            raise Mha2GqaError(
                f"{what}: {len(items)} window(s) for {self.size} processes; give each process at least one "
                "(more text, shorter windows) or run fewer processes"
            )
        return self.part(items)

    def part(self, items: Sequence[T]) -> Sequence[T]:
        """This rank's items (every ``size``-th from ``rank``), possibly none (a caller that pads
        its passes to the longest share: ``eval``)."""
        return items[self.rank :: self.size]

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` (picklable) of every process, in rank order, on every process (each must call this)."""
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def own(self, windows: Sequence[int]) -> list[int]:
        """Those of ``windows`` (indices of the whole list) that :meth:`share` gives this rank
        (``index % size == rank``), in their order."""
        return [w for w in windows if w % self.size == self.rank]

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over every process, in place (the same result on every rank); complex
        tensors are summed as their real and imaginary parts. Under NCCL (which reduces GPU tensors
        only) a CPU tensor goes through this process's GPU and back."""
        if self.size > 1:
            import torch
            import torch.distributed as dist

            on = tensor
            if dist.get_backend() == "nccl" and tensor.device.type != "cuda":
                on = tensor.to(torch.device("cuda", torch.cuda.current_device()))
            dist.all_reduce(torch.view_as_real(on) if on.is_complex() else on, op=dist.ReduceOp.SUM)
            if on is not tensor:
                tensor.copy_(on)
        return tensor

    def total(self, *values: float) -> list[float]:
        """Each of ``values`` summed over every process, in float64 (each must call this); one
        process: the values as they are."""
        if self.size == 1:
            return list(values)
        import torch

        return self.sum(torch.tensor(values, dtype=torch.float64)).tolist()

    def all(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every process (each must call this)."""
        return self.total(float(bool(flag)))[0] == self.size

    def decide(self, choose: Callable[[], Any]) -> Any:
        """``choose()`` run on rank 0 alone, its result (picklable) given to every process (each must
        call this): what rank 0 alone may know (the kept work it opened, a verdict it measured)."""
        if self.size == 1:
            return choose()
        import torch.distributed as dist

        box = [choose() if self.main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]


#: one process (no launcher): every sum the identity
ONE = Ranks()


def ranks() -> Ranks:
    """The processes of this run, as ``accelerate`` set them up (:func:`mha2gqa.core.models.resolve_device`
    forms the group under a launcher); one process when there is no group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return Ranks(dist.get_rank(), dist.get_world_size())
    return ONE


def launched() -> int:
    """How many processes the launcher (``torchrun``, ``accelerate launch``) started for this run, from
    its environment (``WORLD_SIZE``), before any process group is formed: 1 without a launcher."""
    try:
        return max(int(os.environ.get("WORLD_SIZE", "1")), 1)
    except ValueError:
        return 1


def under_launcher() -> bool:
    """Whether a launcher (``torchrun``, ``accelerate launch``) started this process, whatever the count."""
    return "WORLD_SIZE" in os.environ


def one_process(command: str, instead: str) -> None:
    """Refuse ``command`` in one line when a launcher started several processes for it (``instead``:
    what to do)."""
    if (n := launched()) > 1:
        raise Mha2GqaError(f"{command} runs in one process, not {n}: run it without torchrun ({instead})")
