"""How fast the model writes its own text (``mha2gqa self-text``, ``convert --self-text``): float32
weights against bfloat16 weights, in one process, on SmolLM2-135M.

    python benchmarks/self_text_speed.py [--tokens 4096] [--rounds 2] [--device cpu]

Writes one batch of the default settings' shape (64 documents, the default sampling) round by round
under each arithmetic, alternating (a busy machine slows both alike), and prints each one's tokens a
second, the ratio, and what :func:`~mha2gqa.core.self_text.writing_dtype` takes on this device. Needs
the SmolLM2 fixture.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _rate(model, tokenizer, tokens: int, seed: int) -> float:
    """Tokens a second ``model`` writes of one batch of ``tokens``."""
    import torch

    from mha2gqa.core.self_text import SelfTextSettings, Writing, starts, write_batch

    s = SelfTextSettings(tokens=tokens, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    _, lengths = write_batch(model, starts(tokenizer, False)[0], s, generator, None, Writing(tokens))
    return int(lengths.sum()) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(__file__))
    import torch
    from real_fixtures import Unavailable, smollm2

    from mha2gqa.core.models import load_model, load_tokenizer, resolve_device
    from mha2gqa.core.self_text import writing_dtype

    try:
        folder = smollm2()[0]
    except Unavailable as e:
        raise SystemExit(f"skipped: {e}") from None
    device = resolve_device(args.device)
    models = {"float32": load_model(str(folder), device, torch.float32).model}
    models["bfloat16"] = copy.deepcopy(models["float32"]).to(torch.bfloat16)
    tokenizer = load_tokenizer(folder)
    rates: dict[str, list[float]] = {name: [] for name in models}
    for r in range(args.rounds):
        for name, model in models.items():
            rates[name].append(_rate(model, tokenizer, args.tokens, r))
    median = {name: statistics.median(v) for name, v in rates.items()}
    for name, rate in median.items():
        print(f"{name:9s} {rate:8.0f} tokens/s  ({args.tokens:,} tokens, {args.rounds} rounds, {device})")
    print(f"bfloat16 / float32: x{median['bfloat16'] / median['float32']:.2f} the tokens a second; "
          f"this device writes in {str(writing_dtype(device)).removeprefix('torch.')}")  # fmt: skip


if __name__ == "__main__":
    main()
