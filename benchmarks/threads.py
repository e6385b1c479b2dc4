"""Forward-pass time of the demo-sized model with 1 thread, 2 threads and mha2gqa's default, on an
idle machine and with every core but one kept busy by other processes.

torch uses every core by default; when other processes hold them, each parallel step waits for the
thread that shares a busy core. mha2gqa's default (``core/threads.py``) takes the cores other
processes leave idle, so it falls back to fewer threads under load.

    python benchmarks/threads.py [--tokens 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time
threads = sys.argv[1]
from mha2gqa.core.threads import use_threads
n = use_threads(None if threads == "default" else int(threads))
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=2048, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                                     num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512)).eval()
ids = torch.randint(0, 2048, (8, int(sys.argv[2])))
times = []
with torch.inference_mode():
    model(ids)
    for _ in range(int(sys.argv[3])):
        t = time.perf_counter(); model(ids); times.append(time.perf_counter() - t)
print(json.dumps({"threads": n, "times": times}))
"""


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(i * i for i in range(10_000))


def run(threads: str, tokens: int, repeats: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.check_output(
        [sys.executable, "-c", CHILD, threads, str(tokens), str(repeats)], env=env, stderr=subprocess.DEVNULL, text=True
    )
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    print(
        f"demo-sized Llama (4 layers, hidden 128), batch 8 x {args.tokens} tokens, {cores} cores, median of "
        f"{args.repeats} forward passes"
    )
    print(f"{'machine':<26} {'threads':>8} {'ms/forward':>11} {'vs 1 thread':>12}")
    for label, busy in (("idle", 0), (f"{cores - 1} other core(s) busy", cores - 1)):
        spinners = [multiprocessing.Process(target=_spin, args=(600,)) for _ in range(busy)]
        for s in spinners:
            s.start()
        if busy:
            time.sleep(2)
        try:
            rows = {t: run(t, args.tokens, args.repeats) for t in ("1", "2", "default")}
        finally:
            for s in spinners:
                s.terminate()
        base = statistics.median(rows["1"]["times"])
        for t, r in rows.items():
            med = statistics.median(r["times"])
            name = f"default ({r['threads']})" if t == "default" else t
            print(f"{label:<26} {name:>8} {med * 1e3:>11.1f} {med / base:>11.2f}x")
        if busy:
            time.sleep(1)


if __name__ == "__main__":
    main()
