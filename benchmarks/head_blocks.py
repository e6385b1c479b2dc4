"""The model-level KL of the stage guard and ``--allocation-cost logits``
(:func:`mha2gqa.convert.engine.layers.next_token_kl`: the streams through the head together, a block of
tokens a call) against each stream's whole window at once (what it did), on a model head of
Qwen2-0.5B's shape (hidden 896, an untied 151,936-entry output layer; random weights, one decoder
layer that is never run).

    python benchmarks/head_blocks.py [--tokens 512 2048] [--candidates 6] [--rounds 3]

Printed: the median seconds of one window's KL for ``--candidates`` candidates (the two ways
alternating round by round in one process), the memory one call of each way added to the peak of a
process of its own, the ratios, and the largest relative difference of the figures (float32 sums in
another order).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def make_head(folder: Path, hidden: int, vocab: int) -> None:
    """A one-layer Llama of ``hidden`` x ``vocab`` with an untied output layer, in bf16."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=max(1, hidden // 64),
        vocab_size=vocab,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)


def whole_windows(head, as_tuple: bool, original, candidates):
    """What the guard did before: each stream's whole window through the head, one at a time, and the
    KL over the whole ``[T, vocab]`` log-probabilities (the original's computed once)."""
    import torch

    out = torch.zeros(len(candidates), 2, dtype=torch.float64)
    ref = torch.log_softmax(head(original, as_tuple), -1)
    probs, top = ref.exp(), ref.argmax(-1)
    for n, hidden in enumerate(candidates):
        got = torch.log_softmax(head(hidden, as_tuple), -1)
        out[n, 0] += float((probs * (ref - got)).sum())
        out[n, 1] += float((top == got.argmax(-1)).sum())
    return out


def child(folder: Path, tokens: int, candidates: int, rounds: int, way: str) -> dict:
    """``way`` ``time``: ``{"seconds": {way: median}, "kl": {way: sums}}`` of both ways, alternating
    round by round; ``whole`` or ``blocks``: ``{"peak_mib"}``, what one call of that way added to the
    process's peak."""
    import torch

    from mha2gqa.convert.engine.layers import model_head, next_token_kl, skeleton
    from mha2gqa.core.checkpoint import open_checkpoint

    ckpt = open_checkpoint(str(folder))
    head = model_head(skeleton(ckpt), ckpt, torch.device("cpu"))
    ways = {"whole": whole_windows, "blocks": next_token_kl}
    g = torch.Generator().manual_seed(1)
    original = torch.randn(1, tokens, ckpt.config["hidden_size"], generator=g)
    others = [original + 0.3 * torch.randn(original.shape, generator=g) for _ in range(candidates)]
    if way != "time":
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        ways[way](head, False, original, others)
        return {"peak_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024}
    times: dict[str, list[float]] = {name: [] for name in ways}
    kl = {}
    for _ in range(rounds):
        for name, kl_of in ways.items():
            start = time.perf_counter()
            kl[name] = kl_of(head, False, original, others).tolist()
            times[name].append(time.perf_counter() - start)
    return {"seconds": {name: statistics.median(t) for name, t in times.items()}, "kl": kl}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--candidates", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--child", nargs=3, metavar=("FOLDER", "TOKENS", "WAY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        folder, tokens, way = args.child
        print(json.dumps(child(Path(folder), int(tokens), args.candidates, args.rounds, way)))
        return
    from mha2gqa.core.memory import head_rows

    with tempfile.TemporaryDirectory() as tmp:
        make_head(Path(tmp), args.hidden, args.vocab)
        print(
            f"hidden {args.hidden}, vocabulary {args.vocab:,}, {args.candidates} candidates, "
            f"at most {head_rows(args.vocab)} tokens a call; median of {args.rounds}"
        )
        print(
            f"{'tokens':>7} {'whole s':>8} {'blocks s':>9} {'ratio':>6} {'whole MiB':>10} {'blocks MiB':>11} "
            f"{'ratio':>6} {'rel diff':>9}"
        )
        for tokens in args.tokens:
            print(_row(Path(tmp), tokens, args))


def _row(folder: Path, tokens: int, args: argparse.Namespace) -> str:
    """One window length's line: the times in one process, each way's memory in a process of its own."""
    runs = {}
    for way in ("time", "whole", "blocks"):
        cmd = [sys.executable, __file__, "--child", str(folder), str(tokens), way]
        cmd += ["--candidates", str(args.candidates), "--rounds", str(args.rounds)]
        runs[way] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    (w_s, b_s), (w, b) = runs["time"]["seconds"].values(), runs["time"]["kl"].values()
    pairs = [(x, y) for rw, rb in zip(w, b, strict=True) for x, y in zip(rw, rb, strict=True)]
    diff = max(abs(x - y) / max(abs(x), 1e-30) for x, y in pairs)
    w_mib, b_mib = runs["whole"]["peak_mib"], runs["blocks"]["peak_mib"]
    return (
        f"{tokens:>7} {w_s:>8.3f} {b_s:>9.3f} {b_s / w_s:>5.2f}x "
        f"{w_mib:>10.0f} {b_mib:>11.0f} {b_mib / max(w_mib, 1e-9):>5.2f}x {diff:>9.1e}"
    )


if __name__ == "__main__":
    main()
