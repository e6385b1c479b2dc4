"""The process's heap, kept bounded: glibc's allocator otherwise holds on to freed memory.

Two knobs, no-ops where the C library is not glibc: :func:`map_large_allocations` serves every large
block with its own ``mmap`` (freed at once), :func:`trim` hands freed heap pages back to the OS.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from collections.abc import Iterator
from functools import cache
from typing import Any


@cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    with contextlib.suppress(OSError):
        return ctypes.CDLL(name) if name else None
    return None


def heap_is_glibc() -> bool:
    """Whether this process's ``malloc`` is glibc's (not one preloaded over it, such as jemalloc or
    tcmalloc), so that the knobs here reach the allocator torch's CPU tensors come from."""
    libc = _libc()
    try:
        ours, linked = ctypes.CDLL(None).malloc, libc.malloc if libc is not None else None
    except (AttributeError, OSError):
        return False
    address = ctypes.c_void_p
    return linked is not None and ctypes.cast(ours, address).value == ctypes.cast(linked, address).value


def trim() -> None:
    """Give freed heap pages back to the OS (``malloc_trim``)."""
    libc = _libc()
    with contextlib.suppress(AttributeError):
        if libc is not None:
            libc.malloc_trim(0)


#: The mmap threshold for loops of small steps (a refit's Adam steps, the distillation after it): blocks
#: below it are reused from the heap instead of being mapped, zeroed by the kernel page by page and
#: unmapped at every step. SmolLM2-135M's refit step (activations of 2.4-6.3 MB): 3,462 page faults
#: under 1 MiB, 576 under this, 0.87x the time (benchmarks/mmap_threshold.py); the SmolLM2 recipe's
#: system time 179 -> 92 s, its page faults 79M -> 34M. A 7B layer's weights and most of its activations
#: (25 MB and up) stay mapped, as before.
STEP_BLOCKS = 8 << 20


#: Tokens a loss over ``[tokens, vocab]`` logits (the distillation's top-K KL, a teacher's top-K form)
#: takes at a time: its float32 temporaries are ``LOGIT_ROWS x vocab`` (6 MiB at a 49,152 vocabulary,
#: under :data:`STEP_BLOCKS`: reused from the heap), never copies of the whole logits (200 MB for two
#: windows of 512 tokens there). The distillation's loss and gradient: 0.40x the time of the formula
#: over the whole logits (benchmarks/distill_loss.py).
LOGIT_ROWS = 32


#: Bytes of the float32 logits of one call of the model's head in a model-level KL (the stage guard,
#: ``--allocation-cost logits``): the original's and the candidates' hidden states go through the head
#: together, a block of each one's tokens, up to this many logits a call: 1,365 tokens at a 49,152
#: vocabulary, 441 at Qwen2's 151,936, whatever the windows' length and the candidates' number. Wide
#: enough that the head's matrix product runs near its best (1.9 ms a token at 512-1,024 tokens a call
#: at Qwen2's shape on this CPU, 2.5 at 220, 3.5 at 55; benchmarks/head_blocks.py); whole windows, one
#: stream at a time, took about five ``[T, vocab]`` temporaries: 1,264 MiB added to the peak at Qwen2's
#: vocabulary and 512 tokens, 5,771 MiB at 2,048 (152 and 153 MiB now, 6 candidates).
HEAD_BLOCK = 256 << 20


def logit_rows(n: int, size: int = LOGIT_ROWS) -> Iterator[slice]:
    """The row slices of ``n`` tokens, ``size`` (:data:`LOGIT_ROWS`) at a time (the last one may be
    shorter)."""
    for start in range(0, n, size):
        yield slice(start, start + size)


def head_rows(vocab: int) -> int:
    """Tokens of a :data:`HEAD_BLOCK` of float32 logits ``vocab`` wide (at least one)."""
    return max(1, HEAD_BLOCK // (4 * vocab))


def map_large_allocations(threshold: int = 1 << 20) -> None:
    """Serve every allocation of ``threshold`` bytes or more with its own ``mmap`` (glibc), so a freed
    tensor goes back to the OS at once, and keep up to twice that free at the heap's top (glibc's own
    ratio) before giving it back. glibc otherwise raises that threshold to the largest block
    freed so far and keeps later large blocks on its heap, where short-lived activations and logits
    interleaved with small long-lived tensors fragment it. Measured: a 7B-shaped refit 2.67 -> 2.32 GB
    peak RSS; ``eval`` of a 23 MB model at 100K tokens 4.3 -> 0.64 GB. A loop of small steps passes
    :data:`STEP_BLOCKS`: mapping every one of its activations costs more in page faults than it saves."""
    libc = _libc()
    with contextlib.suppress(AttributeError):
        if libc is not None:
            libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD
            libc.mallopt(-1, 2 * threshold)  # M_TRIM_THRESHOLD


def peak_memory(device: Any = None) -> int:
    """This process's peak memory in bytes: allocated CUDA memory on a CUDA ``device``, else the
    peak resident set (``ru_maxrss``; memory-mapped pages it touched count)."""
    import resource

    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
