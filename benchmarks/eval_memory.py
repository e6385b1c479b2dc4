"""Peak memory of ``mha2gqa eval`` against the number of tokens scored: it must stay flat (one model,
one batch of logits), not grow with the text.

Each run is a fresh ``mha2gqa eval`` process (a pair, one model at a time through the reference
cache, every default on: attention similarity and samples) over the first N tokens of the text; its
peak RSS comes from ``getrusage`` of the child. The 128K/32K ratio is the figure (issue 23: <= 1.3).

    python benchmarks/eval_memory.py --original ../shared/fixtures/pydocs-mha-8h \
        --converted CONVERTED --data ../shared/fixtures/text/wikitext2_test.txt
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

#: Runs the evaluation as its child and prints that child's peak RSS (KiB): each measurement gets its
#: own parent, so one run's peak never hides another's (``RUSAGE_CHILDREN`` keeps the largest).
WRAPPER = (
    "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def peak_rss(args: argparse.Namespace, tokens: int) -> tuple[float, float]:
    """(peak RSS in MiB, seconds) of one evaluation of ``tokens`` tokens in its own process."""
    cmd = [sys.executable, "-m", "mha2gqa.cli", "eval", "--original", args.original, "--converted", args.converted,
           "--data", args.data, "--max-tokens", str(tokens), "-q", *args.extra]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", WRAPPER, *cmd], check=True, env=env, stdout=subprocess.PIPE, text=True)
    return int(out.stdout.split()[-1]) / 1024, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--original", required=True)
    p.add_argument("--converted", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("extra", nargs="*", help="further eval options, after --")
    args = p.parse_args()
    rows = []
    for n in sorted(args.tokens):
        mib, seconds = peak_rss(args, n)
        rows.append((n, mib, seconds))
        print(f"{n:>8,} tokens: peak RSS {mib:,.0f} MiB, {seconds:.1f} s", flush=True)
    first = rows[0][1]
    print("| tokens | peak RSS (MiB) | x the first | seconds |")
    print("|---:|---:|---:|---:|")
    for n, mib, seconds in rows:
        print(f"| {n:,} | {mib:,.0f} | {mib / first:.2f} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
