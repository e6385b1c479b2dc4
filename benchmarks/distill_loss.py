"""The distillation's top-K loss, forward and backward, at the shapes ``convert --distill`` runs, in
one process.

    python benchmarks/distill_loss.py [--rounds 5] [--tokens 1024] [--vocab 49152] [--top-k 64]

Times :func:`mha2gqa.uptrain.objectives.distillation_top_k` (row by row, its analytic gradient)
against its formula over the whole logits differentiated by autograd (``tests/reference.py``, what it
replaced), alternating round by round (a busy machine slows both alike), on float32 logits (what a
step under accelerate's autocast hands the loss) and bfloat16 ones. Prints each one's median seconds,
the ratio and the largest difference of loss and gradient (glibc's mmap threshold set as the
distillation sets it). Needs no model: random logits and a teacher's top-K form at SmolLM2-135M's
vocabulary size (2 windows of 512 tokens).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _inputs(tokens: int, vocab: int, k: int):
    import torch

    g = torch.Generator().manual_seed(0)
    teacher = torch.log_softmax(torch.randn(tokens, vocab, generator=g) * 3, -1)
    values, indices = teacher.topk(k, -1)
    rest = torch.log1p(-values.exp().sum(-1).clamp(max=1 - 1e-7))
    return torch.randn(tokens, vocab, generator=g) * 3, values, indices.to(torch.int32), rest


def _timed(loss, student, teacher, rounds: int):
    """``(median seconds, loss, gradient)`` of ``rounds`` forward and backward passes."""
    times = []
    for _ in range(rounds):
        student.grad = None
        start = time.perf_counter()
        value = loss(student, *teacher)
        value.backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times), value.detach(), student.grad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--top-k", type=int, default=64)
    args = parser.parse_args()
    import torch
    from reference import top_k_distillation_formula

    from mha2gqa.core.memory import STEP_BLOCKS, map_large_allocations
    from mha2gqa.uptrain.objectives import distillation_top_k

    map_large_allocations(STEP_BLOCKS)
    logits, *teacher = _inputs(args.tokens, args.vocab, args.top_k)
    print(f"{args.tokens} tokens x {args.vocab} vocabulary, top {args.top_k}; {torch.get_num_threads()} threads")
    print(f"{'logits':<9} {'formula s':>10} {'row by row s':>13} {'ratio':>7} {'loss diff':>10} {'grad diff':>10}")
    for dtype in (torch.float32, torch.bfloat16):
        student = logits.to(dtype, copy=True).requires_grad_()
        runs = {"formula": [], "rows": []}
        for _ in range(args.rounds):  # alternating: one of each a round
            for name, loss in (("formula", top_k_distillation_formula), ("rows", distillation_top_k)):
                runs[name].append(_timed(loss, student, teacher, 1))
        (f_s, f_loss, f_grad), (r_s, r_loss, r_grad) = (
            (statistics.median(t for t, _, _ in runs[n]), runs[n][-1][1], runs[n][-1][2]) for n in ("formula", "rows")
        )
        loss_diff = float((f_loss - r_loss).abs())
        grad_diff = float((f_grad.float() - r_grad.float()).abs().max())
        name = str(dtype).removeprefix("torch.")
        print(f"{name:<9} {f_s:>10.3f} {r_s:>13.3f} {r_s / f_s:>6.2f}x {loss_diff:>10.1e} {grad_diff:>10.1e}")


if __name__ == "__main__":
    main()
