"""bf16 autocast against float32 for the steps a conversion trains, on SmolLM2-135M, in one process.

    python benchmarks/bf16_steps.py [--rounds 5] [--device cpu]

Times, alternating the two arithmetics round by round (a busy machine slows both alike), the three
kinds of step that ``--refit-precision`` / ``--distill-precision`` / ``uptrain --mixed-precision``
choose the arithmetic of, at the shapes ``convert --refit --distill`` runs them:

- refit step: one layer's attention (its input norm, q/k/v/o) forward and backward on 2 windows of
  512 tokens, gradients for the projections only (what a ``--refit`` Adam step computes);
- distill step: the whole model forward and backward on 2 windows of 512, the attention projections
  trainable, a loss over the full vocabulary's log-probabilities (what a ``--distill`` step computes);
- teacher forward: the whole model's logits on 2 windows of 512, float32 weights against bfloat16
  weights (what the teacher pass computes under each arithmetic).

Prints each one's median seconds under each arithmetic and the ratio, and whether this device
:func:`~mha2gqa.core.models.computes_bf16` (what ``auto`` goes by). Needs the SmolLM2 fixture.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

WINDOWS, SEQ = 2, 512


def _timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _steps(model, device):
    """``{kind: (float32 step, bf16 step)}``: callables of the three kinds of step (the module doc)."""
    import torch

    model.requires_grad_(False)
    layer = model.model.layers[len(model.model.layers) // 2]
    attn = layer.self_attn
    for p in [*attn.parameters(), *(q for m in model.model.layers for q in m.self_attn.parameters())]:
        p.requires_grad_(True)
    ids = torch.randint(0, model.config.vocab_size, (WINDOWS, SEQ), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    hidden = torch.randn(WINDOWS, SEQ, model.config.hidden_size, device=device)
    positions = model.model.rotary_emb(hidden, torch.arange(SEQ, device=device)[None].expand(WINDOWS, -1))
    teacher = {"float32": model, "bf16": None}

    def autocast(on: bool):
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=on)

    def refit(on: bool) -> None:
        with autocast(on):
            out = attn(layer.input_layernorm(hidden), position_embeddings=positions, attention_mask=None)[0]
        ((hidden + out).float().square().mean()).backward()
        attn.zero_grad(set_to_none=True)

    def distill(on: bool) -> None:
        with autocast(on):
            logits = model(input_ids=ids).logits
        logits.float().log_softmax(-1)[..., 0].mean().backward()
        model.zero_grad(set_to_none=True)

    def forward(on: bool) -> None:
        if teacher["bf16"] is None:
            import copy

            teacher["bf16"] = copy.deepcopy(model).to(torch.bfloat16)
        with torch.no_grad():
            teacher["bf16" if on else "float32"](input_ids=ids).logits.float()

    return {"refit step": refit, "distill step": distill, "teacher forward": forward}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    import torch
    from real_fixtures import Unavailable, smollm2
    from transformers import AutoModelForCausalLM

    from mha2gqa.core.models import computes_bf16

    try:
        folder, _ = smollm2()
    except Unavailable as e:
        sys.exit(f"bf16_steps: {e}")
    device = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device)
    print(f"{device}: computes bf16 natively: {computes_bf16(device)}; {torch.get_num_threads()} threads")
    print(f"{'step':<16} {'float32 s':>10} {'bf16 s':>10} {'bf16 / float32':>15}")
    for kind, step in _steps(model, device).items():
        step(False), step(True)  # warm-up
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for on in (False, True):
                times[on].append(_timed(partial(step, on)))
        f32, bf16 = statistics.median(times[False]), statistics.median(times[True])
        print(f"{kind:<16} {f32:>10.3f} {bf16:>10.3f} {bf16 / f32:>14.2f}x", flush=True)


if __name__ == "__main__":
    main()
