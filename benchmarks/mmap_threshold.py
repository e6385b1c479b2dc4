"""glibc's mmap threshold for the steps a conversion trains, on SmolLM2-135M, in one process.

    python benchmarks/mmap_threshold.py [--rounds 5]

Times the refit step and the distillation step of ``benchmarks/bf16_steps.py`` (bf16 autocast where
the CPU computes it, as ``auto`` runs them) under two mmap thresholds, alternating round by round (a
busy machine slows both alike): 1 MiB (:func:`~mha2gqa.core.memory.map_large_allocations`' default,
which ``eval`` keeps) against :data:`~mha2gqa.core.memory.STEP_BLOCKS` (what the refit sets for itself
and the distillation after it). Prints each one's median seconds, its minor page faults a step and
the ratio. glibc only (elsewhere the knob does nothing). Needs the SmolLM2 fixture.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import torch
    from bf16_steps import _steps
    from real_fixtures import Unavailable, smollm2
    from transformers import AutoModelForCausalLM

    from mha2gqa.core.memory import STEP_BLOCKS, map_large_allocations
    from mha2gqa.core.models import computes_bf16

    try:
        folder, _ = smollm2()
    except Unavailable as e:
        sys.exit(f"mmap_threshold: {e}")
    device = torch.device("cpu")
    bf16 = computes_bf16(device)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    thresholds = {"1 MiB": 1 << 20, f"{STEP_BLOCKS >> 20} MiB": STEP_BLOCKS}
    print(f"{'bf16 autocast' if bf16 else 'float32'}; {torch.get_num_threads()} threads")
    print(f"{'step':<14} {'threshold':>9} {'s a step':>9} {'faults a step':>14} {'time ratio':>11}")
    for kind, step in _steps(model, device).items():
        if kind == "teacher forward":
            continue
        seconds: dict[str, list[float]] = {t: [] for t in thresholds}
        faults: dict[str, list[int]] = {t: [] for t in thresholds}
        for _ in range(args.rounds):
            for name, threshold in thresholds.items():
                map_large_allocations(threshold)
                step(bf16)  # the heap settles under this threshold
                f, t = _faults(), time.perf_counter()
                step(bf16)
                seconds[name].append(time.perf_counter() - t)
                faults[name].append(_faults() - f)
        base = statistics.median(seconds["1 MiB"])
        for name in thresholds:
            s = statistics.median(seconds[name])
            print(f"{kind:<14} {name:>9} {s:>9.3f} {statistics.median(faults[name]):>14,.0f} {s / base:>10.2f}x")
    map_large_allocations()


if __name__ == "__main__":
    main()
