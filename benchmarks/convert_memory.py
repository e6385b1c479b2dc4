"""Peak RSS and wall time of ``mha2gqa convert`` against the naive route and a plain file copy.

Writes a random bf16 Llama MHA checkpoint (hidden 4096, 32 heads, 1 GB shards; ~2 GB at 4 layers),
then runs, each in its own process so that peak RSS is that process's own:

- copy:    ``shutil.copytree`` of the checkpoint (the floor for any tool that rewrites it);
- naive:   ``from_pretrained`` -> mean-pool K/V in memory -> ``save_pretrained``;
- mha2gqa: ``mha2gqa convert SRC DST -g 8``.

Run it again at twice the layers (``--layers 4 8``) to see memory stay flat.

    python benchmarks/convert_memory.py --workdir /tmp/bench --layers 4 8
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

NAIVE = r"""
import sys, torch
from transformers import AutoModelForCausalLM
src, dst, g = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
cfg = model.config
d = cfg.hidden_size // cfg.num_attention_heads
for layer in model.model.layers:
    for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
        w = proj.weight.data
        pooled = w.float().reshape(g, -1, d, w.shape[1]).mean(1).reshape(g * d, w.shape[1]).to(w.dtype)
        proj.weight = torch.nn.Parameter(pooled)
cfg.num_key_value_heads = g
model.save_pretrained(dst, max_shard_size="1GB")
"""


def make_checkpoint(folder: Path, layers: int, max_shard_size: str = "1GB") -> int:
    """A random bf16 Llama-2-7B-shaped MHA checkpoint with ``layers`` layers; returns its bytes."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        dtype="bfloat16",
    )
    with torch.device("meta"):
        meta = LlamaForCausalLM(config).to(torch.bfloat16).state_dict()
    split = split_torch_state_dict_into_shards(
        meta, max_shard_size=max_shard_size, filename_pattern="model{suffix}.safetensors"
    )
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    for filename, names in split.filename_to_tensors.items():
        shard = {n: (torch.randn(meta[n].shape, generator=gen) * 0.02).to(torch.bfloat16) for n in names}
        save_file(shard, folder / filename, metadata={"format": "pt"})
        del shard
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(folder)
    return sum(f.stat().st_size for f in folder.iterdir())


def measure(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS in MiB) of one child process.

    Linux carries the parent's RSS high-water mark into a forked child's ``ru_maxrss``, so this
    process stays small (no torch import here) and the checkpoint is generated in a child too.
    Dirty pages of the previous route are flushed first so routes do not pay for each other.
    """
    os.sync()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"command failed: {' '.join(cmd)}")
    return wall, usage.ru_maxrss / 1024


STEADY = r"""
import json, os, shutil, sys, time
from mha2gqa.convert import convert_checkpoint
src, work = sys.argv[1], sys.argv[2]
convert_checkpoint(src, work + "/gqa", 8, max_shard_size="1GB", progress=False)  # pay imports and first calls
shutil.rmtree(work + "/gqa")
os.sync(); t = time.perf_counter(); shutil.copytree(src, work + "/copy"); copy = time.perf_counter() - t
os.sync(); t = time.perf_counter()
convert_checkpoint(src, work + "/gqa", 8, max_shard_size="1GB", progress=False)
print(json.dumps({"copy": copy, "mha2gqa": time.perf_counter() - t}))
"""


def steady_state(src: Path, workdir: Path) -> tuple[float, float]:
    """(copy, convert) seconds in one warm process: the per-byte cost, start-up excluded."""
    for folder in ("copy", "gqa"):
        shutil.rmtree(workdir / folder, ignore_errors=True)
    warm(src)
    out = json.loads(
        subprocess.check_output([sys.executable, "-c", STEADY, str(src), str(workdir)], stderr=subprocess.DEVNULL)
    )
    for folder in ("copy", "gqa"):
        shutil.rmtree(workdir / folder, ignore_errors=True)
    return out["copy"], out["mha2gqa"]


def warm(folder: Path) -> None:
    for f in folder.iterdir():
        with open(f, "rb") as h:
            while h.read(64 << 20):
                pass


def run(workdir: Path, layers: int, repeats: int) -> dict[str, tuple[float, float]]:
    src = workdir / f"mha-{layers}L"
    if not src.exists():
        code = (
            "import sys; sys.path.insert(0, sys.argv[1]); import convert_memory as m; "
            "print(m.make_checkpoint(m.Path(sys.argv[2]), int(sys.argv[3])))"
        )
        size = int(
            subprocess.check_output([sys.executable, "-c", code, str(Path(__file__).parent), str(src), str(layers)])
        )
        print(f"wrote {src} ({size / 2**30:.2f} GiB)")
    out: dict[str, tuple[float, float]] = {}
    routes = {
        "copy": [
            sys.executable,
            "-c",
            "import shutil,sys; shutil.copytree(sys.argv[1], sys.argv[2])",
            str(src),
            str(workdir / "copy"),
        ],
        "naive": [sys.executable, "-c", NAIVE, str(src), str(workdir / "naive"), "8"],
        "mha2gqa": [
            sys.executable,
            "-m",
            "mha2gqa.cli",
            "convert",
            str(src),
            str(workdir / "gqa"),
            "-g",
            "8",
            "-q",
            "--max-shard-size",
            "1GB",
        ],
    }
    routes["copy+sync"] = [*routes["copy"][:2], routes["copy"][2] + "; import os; os.sync()", *routes["copy"][3:]]
    routes["mha2gqa --fsync"] = [*routes["mha2gqa"], "--fsync"]
    for name, cmd in routes.items():
        runs = []
        for _ in range(repeats):
            for folder in ("copy", "naive", "gqa"):
                shutil.rmtree(workdir / folder, ignore_errors=True)
            warm(src)
            runs.append(measure(cmd))
        walls = sorted(w for w, _ in runs)
        out[name] = (walls[len(walls) // 2], max(r for _, r in runs))
        spread = f"[{walls[0]:.2f}-{walls[-1]:.2f}]"
        print(
            f"  {layers}L {name:16s} wall {out[name][0]:6.2f} s {spread:14s} peak RSS {out[name][1]:6.0f} MiB",
            flush=True,
        )
    for name in ("copy", "naive", "gqa"):
        shutil.rmtree(workdir / name, ignore_errors=True)
    copy, conv = steady_state(src, workdir)
    out["steady"] = (conv / copy, 0.0)
    print(f"  {layers}L start-up excluded (one warm process): copy {copy:.2f} s, mha2gqa {conv:.2f} s", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("bench-out"))
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--repeats", type=int, default=3, help="runs per route; the median wall time is reported")
    parser.add_argument("--keep", action="store_true", help="keep the generated checkpoints")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    results = {n: run(args.workdir, n, args.repeats) for n in args.layers}
    print(
        "\nlayers  RSS mha2gqa/naive  wall mha2gqa/naive  wall mha2gqa/copy  wall durable mha2gqa/copy"
        "  start-up excluded mha2gqa/copy"
    )
    for n, r in results.items():
        print(
            f"{n:6d}  {r['mha2gqa'][1] / r['naive'][1]:16.2f}  {r['mha2gqa'][0] / r['naive'][0]:17.2f}  "
            f"{r['mha2gqa'][0] / r['copy'][0]:16.2f}  {r['mha2gqa --fsync'][0] / r['copy+sync'][0]:24.2f}"
            f"  {r['steady'][0]:30.2f}"
        )
    if len(results) > 1:
        lo, hi = min(results), max(results)
        growth = results[hi]["mha2gqa"][1] / results[lo]["mha2gqa"][1] - 1
        print(f"peak RSS of mha2gqa at {hi} layers vs {lo}: {growth:+.1%}")
    if not args.keep:
        for n in args.layers:
            shutil.rmtree(args.workdir / f"mha-{n}L", ignore_errors=True)


if __name__ == "__main__":
    main()
