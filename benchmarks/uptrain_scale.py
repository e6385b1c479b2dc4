"""Uptraining past one device's memory, on this machine's 2 CPU cores and 24 GB: FSDP against DDP,
distillation from a cached teacher against the live teacher, and streamed data at two corpus sizes.

Every run is a real ``mha2gqa uptrain`` process (``torchrun --nproc_per_node 2`` with gloo for two
ranks); peak memory per rank comes from the run's own log (``peak_memory_mib``, the resident set of
each rank) or from ``ru_maxrss`` of the child, seconds per step from the log (``step_seconds``).

- ``fsdp``: a random Llama of ~1B parameters (hidden 2048, 16 layers, 16 query / 4 KV heads,
  vocabulary 32,000; AdamW, float32 master weights) trains 3 steps with ``--sharding fsdp`` on 2
  ranks. DDP is measured on a ~0.17B model (both ways) and its bytes per parameter carried to 1B
  (running it would take the machine past its memory).
- ``kd``: the ~0.17B student distils from its MHA parent, live (both models in memory) and from a
  top-64 cache (``--teacher-only`` pass, then training alone), one process each.
- ``data``: a 10 MB and a 1 GB text: building the token store and two training steps, peak RSS.

    python benchmarks/uptrain_scale.py --workdir /tmp/scale [--parts fsdp kd data]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"
TOKENIZER = FIXTURES / "pydocs-mha-8h"  # a real BPE tokenizer (4,096 tokens)
TEXT = FIXTURES / "text" / "pydocs_calibration.txt"
GIB = 2**30
#: Runs a command and reports its peak resident set (the largest of its processes) on stderr.
_PEAK = (
    "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
    "print('MAXRSS', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(r.returncode)"
)


def model(folder: Path, hidden: int, layers: int, inter: int, heads: int, kv_heads: int) -> Path:
    """A random bf16 Llama with the fixture's tokenizer (written once)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").is_file():
        return folder
    shape = {"hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers}
    heads_ = {"num_attention_heads": heads, "num_key_value_heads": kv_heads}
    config = LlamaConfig(vocab_size=32000, max_position_embeddings=2048, **shape, **heads_)
    torch.manual_seed(0)
    with torch.device("meta"):
        net = LlamaForCausalLM(config)
    net = net.to_empty(device="cpu").to(torch.bfloat16)
    for p in net.parameters():
        torch.nn.init.normal_(p, std=0.02)
    net.save_pretrained(folder)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(folder)
    print(f"wrote {folder} ({sum(p.numel() for p in net.parameters()) / 1e9:.2f}B parameters)", flush=True)
    return folder


def uptrain(student: Path, out: Path, ranks: int, *extra: str, data: Path = TEXT) -> dict:
    """One ``mha2gqa uptrain`` run; its log's train records, wall time and the child's peak RSS."""
    cli = ["-m", "mha2gqa.cli", "uptrain", str(student), "--data", str(data), "--output", str(out), "--overwrite"]
    cli += ["--seq-len", "128", "--device", "cpu", "-q", "--log-every", "1", *extra]
    launch = [sys.executable, *cli]
    if ranks > 1:
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), *cli]
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _PEAK, *launch], capture_output=True, text=True)
    wall = time.perf_counter() - start
    peak_child = int(done.stderr.rsplit("MAXRSS ", 1)[-1]) if "MAXRSS " in done.stderr else 0
    if done.returncode:
        tail = (done.stdout + done.stderr)[-3000:]
        return {"failed": tail, "wall": wall}
    log = out / "uptrain_log.jsonl"
    records = [json.loads(x) for x in log.read_text().splitlines()] if log.is_file() else []
    train = [r for r in records if r["type"] == "train"]
    return {
        "wall": wall,
        "train": train,
        "step_seconds": [r["step_seconds"] for r in train],
        "peak_rank_mib": max((r["peak_memory_mib"] for r in train), key=sum, default=None),
        "child_peak_mib": peak_child / 1024,
    }


def params(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(f, "pt") as h:
            for k in h.keys():  # noqa: SIM118 (safe_open has no __iter__)
                n = 1
                for d in h.get_slice(k).get_shape():
                    n *= d
                total += n
    return total


def part_fsdp(work: Path) -> None:
    small = model(work / "s170m", 1024, 8, 2816, 16, 4)
    big = model(work / "l1b", 2048, 16, 5632, 16, 4)
    base = ("--batch-size", "2", "--max-steps", "3", "--lr", "1e-5")
    rows = []
    for name, folder, mode in (("0.17B", small, "ddp"), ("0.17B", small, "fsdp"), ("1B", big, "fsdp")):
        extra = ("--sharding", "fsdp") if mode == "fsdp" else ()
        res = uptrain(folder, work / f"run-{name}-{mode}", 2, *base, *extra)
        if "failed" in res:
            print(f"{name} {mode}: FAILED\n{res['failed']}", flush=True)
            continue
        steps = res["step_seconds"][1:] or res["step_seconds"]
        first = res["train"][0]["peak_memory_mib"]  # logged before the first checkpoint
        rows.append((name, params(folder), mode, res["peak_rank_mib"], sum(steps) / len(steps), first))
        print(f"{name} {mode}: ranks {res['peak_rank_mib']} MiB, {rows[-1][4]:.1f} s/step", flush=True)
    print("\n| model | parameters | sharding | training: peak per rank, total | with checkpoints: per rank, total "
          "| s/step |")  # fmt: skip
    print("|---|---:|---|---:|---:|---:|")
    for name, n, mode, peaks, sec, first in rows:
        print(f"| {name} | {n / 1e9:.2f}B | {mode} | {max(first) / 1024:.2f}, {sum(first) / 1024:.2f} GiB "
              f"| {max(peaks) / 1024:.2f}, {sum(peaks) / 1024:.2f} GiB | {sec:.1f} |")  # fmt: skip
    ddp = [r for r in rows if r[0] == "0.17B" and r[2] == "ddp"]
    if ddp:
        _, n_small, _, _, _, peaks = ddp[0]
        n = params(big)
        measured = max(peaks) * 2**20 / n_small
        print(f"| 1B | {n / 1e9:.2f}B | ddp, estimated: {measured:.1f} B/parameter per rank as measured at 0.17B "
              f"| {measured * n / GIB:.1f} GiB | {2 * measured * n / GIB:.1f} GiB | - |")  # fmt: skip
        print(f"| 1B | {n / 1e9:.2f}B | ddp, floor: 16 B/parameter (float32 weights, gradients, AdamW moments) "
              f"| {16 * n / GIB:.1f} GiB | {32 * n / GIB:.1f} GiB | - |")  # fmt: skip


def part_kd(work: Path) -> None:
    student = model(work / "s170m", 1024, 8, 2816, 16, 4)
    teacher = model(work / "t170m", 1024, 8, 2816, 16, 16)
    base = ("--batch-size", "4", "--max-steps", "4", "--objective", "kd", "--teacher", str(teacher))
    cache = ("--teacher-top-k", "64", "--teacher-cache", str(work / "teacher-cache"))
    live = uptrain(student, work / "kd-live", 1, *base)
    only = uptrain(student, work / "kd-pass", 1, *base, *cache, "--teacher-only")
    cached = uptrain(student, work / "kd-cached", 1, *base, *cache)
    print("\n| distillation | peak RSS | s/step (after the first) | wall |")
    print("|---|---:|---:|---:|")
    for name, r in (("live teacher (both models in memory)", live), ("teacher pass (--teacher-only)", only),
                    ("from the top-64 cache (student alone)", cached)):  # fmt: skip
        if "failed" in r:
            print(f"| {name} | FAILED | | |\n{r['failed']}")
            continue
        steps = r["step_seconds"][1:] or r["step_seconds"]
        sec = f"{sum(steps) / len(steps):.2f}" if steps else "-"
        print(f"| {name} | {r['child_peak_mib'] or 0:,.0f} MiB | {sec} | {r['wall']:.1f} s |")
    size = sum(f.stat().st_size for f in (work / "teacher-cache").rglob("*") if f.is_file())
    print(f"cache: {size / 2**20:,.1f} MiB for {4 * 4 * 128:,} training tokens ({size / (4 * 4 * 128):,.0f} B/token)")


def corpus(path: Path, size: int) -> Path:
    if path.is_file() and path.stat().st_size >= size:
        return path
    block = TEXT.read_text(encoding="utf-8") + "\n\n"
    with open(path, "w", encoding="utf-8") as f:
        written, n = 0, 0
        while written < size:
            chunk = f"copy {n}\n\n" + block
            f.write(chunk)
            written += len(chunk.encode())
            n += 1
    return path


def part_data(work: Path) -> None:
    student = model(work / "tiny", 256, 2, 512, 4, 2)
    print("\n| text | tokens | store build + 2 steps (wall) | peak RSS |")
    print("|---|---:|---:|---:|")
    for label, size in (("10 MB", 10 * 10**6), ("1 GB", 10**9)):
        text = corpus(work / f"corpus-{label.replace(' ', '')}.txt", size)
        cache = work / f"tokens-{label.replace(' ', '')}"
        res = uptrain(student, work / f"data-{label}", 1, "--batch-size", "4", "--max-steps", "2", "--data-cache",
                      str(cache), data=text)  # fmt: skip
        if "failed" in res:
            print(f"| {label} | FAILED | | |\n{res['failed']}")
            continue
        manifest = json.loads(next(cache.glob("*/manifest.json")).read_text())
        print(
            f"| {label} | {manifest['tokens']:,} | {res['wall']:.0f} s | {res['child_peak_mib']:,.0f} MiB |", flush=True
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--parts", nargs="*", default=["fsdp", "kd", "data"], choices=["fsdp", "kd", "data"])
    args = p.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MHA2GQA_CACHE", str(args.workdir / "cache"))
    for part in args.parts:
        {"fsdp": part_fsdp, "kd": part_kd, "data": part_data}[part](args.workdir)


if __name__ == "__main__":
    main()
