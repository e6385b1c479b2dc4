"""Peak memory and temporary disk of ``mha2gqa eval`` against the number of tokens scored: both must
stay flat (one model, one block of logits, one block of the original's cached scores), not grow with
the text.

Each run is a fresh ``mha2gqa eval`` process (a pair, one model at a time through the reference
cache, every default on: attention similarity, samples, the generative probe) over the first N tokens
of the text; its peak RSS comes from ``getrusage`` of the child, its temporary disk from polling the
size of a private ``TMPDIR`` every 50 ms. The last/first ratios are the figures (issue 23: RSS <= 1.3
from 32K to 128K tokens; issue 71: RSS and disk <= 1.2 from 2,048 to 16,384 tokens at a 262,144-token
vocabulary).

    python benchmarks/eval_memory.py --original ../shared/fixtures/pydocs-mha-8h \
        --converted CONVERTED --data ../shared/fixtures/text/wikitext2_test.txt
    python benchmarks/eval_memory.py --vocab 262144 --tokens 2048 16384 \
        --data ../shared/fixtures/text/wikitext2_test.txt     # a tiny model of Gemma 3's vocabulary
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

#: Runs the evaluation as its child and prints that child's peak RSS (KiB): each measurement gets its
#: own parent, so one run's peak never hides another's (``RUSAGE_CHILDREN`` keeps the largest).
WRAPPER = (
    "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def _size(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total


class DiskPeak:
    """The largest size a folder reached while the block ran (polled every 50 ms)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.peak, self._stop = folder, 0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, _size(self.folder))

    def __enter__(self) -> DiskPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def measure(args: argparse.Namespace, tokens: int) -> tuple[float, float, float]:
    """(peak RSS in MiB, peak temporary disk in MiB, seconds) of one evaluation of ``tokens`` tokens."""
    cmd = [sys.executable, "-m", "mha2gqa.cli", "eval", "--original", args.original, "--converted", args.converted,
           "--data", args.data, "--max-tokens", str(tokens), "-q", *args.extra]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="eval-memory-") as tmp:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": tmp}
        start = time.perf_counter()
        with DiskPeak(Path(tmp)) as disk:
            out = subprocess.run(
                [sys.executable, "-c", WRAPPER, *cmd], check=True, env=env, stdout=subprocess.PIPE, text=True
            )
    return int(out.stdout.split()[-1]) / 1024, disk.peak / 2**20, time.perf_counter() - start


def tiny_pair(vocab: int, folder: Path) -> tuple[str, str]:
    """A tiny Llama-shaped original with a ``vocab``-token head (the pydocs fixture's tokenizer, whose
    ids are all below it) and its 4 -> 2 KV-head mean conversion."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = Path(__file__).resolve().parents[1] / ".." / "shared" / "fixtures" / "pydocs-mha-8h"
    original, converted = folder / "original", folder / "converted"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(original)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, original / name)
    subprocess.run([sys.executable, "-m", "mha2gqa.cli", "convert", str(original), str(converted), "-g", "2",
                    "--method", "mean", "-q"], check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    return str(original), str(converted)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--original")
    p.add_argument("--converted")
    p.add_argument("--vocab", type=int, help="build a tiny pair with this vocabulary instead")
    p.add_argument("--data", required=True)
    p.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("extra", nargs="*", help="further eval options, after --")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="eval-memory-models-") as models:
        if args.vocab:
            args.original, args.converted = tiny_pair(args.vocab, Path(models))
        elif not (args.original and args.converted):
            p.error("give --original and --converted, or --vocab")
        rows = []
        for n in sorted(args.tokens):
            mib, disk, seconds = measure(args, n)
            rows.append((n, mib, disk, seconds))
            print(f"{n:>8,} tokens: peak RSS {mib:,.0f} MiB, temp disk {disk:,.1f} MiB, {seconds:.1f} s", flush=True)
    first = rows[0]
    print("| tokens | peak RSS (MiB) | x the first | temporary disk (MiB) | x the first | seconds |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n, mib, disk, seconds in rows:
        ratio = f"{disk / first[2]:.2f}" if first[2] else "-"
        print(f"| {n:,} | {mib:,.0f} | {mib / first[1]:.2f} | {disk:,.1f} | {ratio} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
