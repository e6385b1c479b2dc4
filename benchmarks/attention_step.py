"""Causal attention's forward and backward on the CPU, by arithmetic, at the shape of a ``--refit``
step (SmolLM2-135M: 2 windows of 512 tokens, 9 heads of 64), in one process.

    python benchmarks/attention_step.py [--rounds 9] [--windows 2] [--heads 9] [--tokens 512] [--head-dim 64]

Times ``torch.nn.functional.scaled_dot_product_attention`` (the kernel transformers' ``sdpa`` calls)
on float32 and on bfloat16 inputs, and a bfloat16 forward whose backward runs in float32 (torch's CPU
flash kernels called directly: what a step under bf16 autocast could do instead), alternating round
by round (a busy machine slows all alike). Prints each one's median forward and backward
milliseconds, its step's ratio to float32's, and its gradients' largest difference from float32's
(relative to their largest value). On this repository's 2-core Xeon the bfloat16 backward is slower
than float32's (docs/benchmarks.md, "Where a refit step's time goes").
"""

from __future__ import annotations

import argparse
import math
import statistics
import time


def _flash_wide_backward(q, k, v, grad):
    """``(forward s, backward s, (dq, dk, dv))``: the CPU flash kernel's forward in ``q``'s dtype, its
    backward in float32 (inputs widened, gradients rounded back)."""
    import torch

    scale = 1 / math.sqrt(q.shape[-1])
    start = time.perf_counter()
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)[:2]
    middle = time.perf_counter()
    wide = [t.float() for t in (grad, q, k, v, out)]
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(*wide, lse, 0.0, True, scale=scale)
    grads = tuple(g.to(q.dtype) for g in grads)
    return middle - start, time.perf_counter() - middle, grads


def _sdpa(q, k, v, grad):
    """``(forward s, backward s, (dq, dk, dv))`` of torch's ``scaled_dot_product_attention``, causal."""
    import torch

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    start = time.perf_counter()
    out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
    middle = time.perf_counter()
    out.backward(grad)
    return middle - start, time.perf_counter() - middle, tuple(t.grad for t in leaves)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    import torch

    g = torch.Generator().manual_seed(0)
    shape = (args.windows, args.heads, args.tokens, args.head_dim)
    q, k, v, grad = (torch.randn(shape, generator=g) for _ in range(4))
    runs = {
        "float32": lambda: _sdpa(q, k, v, grad),
        "bfloat16": lambda: _sdpa(*(t.bfloat16() for t in (q, k, v, grad))),
        "bf16, f32 backward": lambda: _flash_wide_backward(*(t.bfloat16() for t in (q, k, v, grad))),
    }
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    grads = {}
    for _ in range(args.rounds + 1):  # the first round warms up and is not counted
        for name, run in runs.items():
            forward, backward, grads[name] = run()
            times[name].append((forward, backward))
    print(f"causal attention {list(shape)}; {torch.get_num_threads()} threads; median of {args.rounds} rounds")
    print(f"{'arithmetic':<20} {'forward ms':>11} {'backward ms':>12} {'step':>7} {'grad diff':>10}")
    base = statistics.median(f + b for f, b in times["float32"][1:])
    for name, measured in times.items():
        forward = statistics.median(f for f, _ in measured[1:])
        backward = statistics.median(b for _, b in measured[1:])
        step = statistics.median(f + b for f, b in measured[1:])
        pairs = zip(grads[name], grads["float32"], strict=True)
        diff = max(float((a.float() - b).abs().max() / b.abs().max()) for a, b in pairs)
        print(f"{name:<20} {forward * 1e3:>11.1f} {backward * 1e3:>12.1f} {step / base:>6.2f}x {diff:>10.1e}")


if __name__ == "__main__":
    main()
