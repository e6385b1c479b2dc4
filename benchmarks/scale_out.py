"""A conversion on one process against two (``torchrun --nproc_per_node 2``, gloo on this machine's
CPU cores): wall time, the peak resident memory of the largest process (``ru_maxrss`` of the run's
descendants: one rank), and whether the outputs agree.

Each part is a real ``mha2gqa convert`` of SmolLM2-135M's MHA form (9 KV heads -> 3, the real
fixture, built on first use) calibrated on the first half of WikiText-2 test in windows of 512:

- ``svd``: the statistics pass (split over the ranks, summed at each layer's end) and the merge; the
  stage guard off, so the figure is the part that scales.
- ``guard``: ``svd`` with the stage guard on (it scores on rank 0 alone).
- ``refit``: ``svd --refit`` (each rank fits on its share of the windows, gradients and held-out
  errors summed; the guard on rank 0; torchrun gives each rank one thread).
- ``distill``: ``svd --distill`` (guard off), the distillation on two ranks ``--sharding fsdp``
  (each holds a shard of the model and reads half of every step's windows).

The outputs' tensors are compared (largest difference relative to the tensor's largest value) and the
run's lines say which process count gave what. On this 2-core machine one process runs two threads
and each of two ranks one, so the figure is one process's threads against two processes' ranks.

    python benchmarks/scale_out.py --workdir /tmp/scale-out [--parts svd guard refit] [--tokens 32768]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_fixtures import DEFAULT_FIXTURES, Unavailable, smollm2, wikitext_split

#: runs a command and reports the peak resident set of the largest of its processes on stderr
_PEAK = (
    "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
    "print('MAXRSS', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(r.returncode)"
)
PARTS = {
    "svd": ["--method", "svd", "--guard", "off"],
    "guard": ["--method", "svd"],
    "refit": ["--method", "svd", "--refit"],
    "distill": ["--method", "svd", "--guard", "off", "--distill", "--distill-steps", "8"],
}
#: what a part adds on several processes
SHARDED = {"distill": ["--sharding", "fsdp"]}


def convert(src: Path, dst: Path, calib: Path, tokens: int, ranks: int, extra: list[str], port: int) -> dict:
    """One ``mha2gqa convert`` (``ranks`` processes); its wall seconds and the largest process's peak MiB."""
    cli = ["-m", "mha2gqa.cli", "convert", str(src), str(dst), "-g", "3", "--calibration", str(calib)]
    cli += ["--calibration-seq-len", "512", "--calibration-tokens", str(tokens), "--device", "cpu", "-q"]
    cli += ["--overwrite", *extra]
    launch = [sys.executable, *cli]
    if ranks > 1:
        run = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), f"--master_port={port}"]
        launch = [*run, *cli]
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _PEAK, *launch], capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{' '.join(launch)} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    peak = int(done.stderr.rsplit("MAXRSS ", 1)[-1]) / 1024 if "MAXRSS " in done.stderr else float("nan")
    return {"seconds": wall, "peak_mib": peak}


def difference(a: Path, b: Path) -> float:
    """The largest difference between the two outputs' tensors, relative to each tensor's largest value."""
    from safetensors.torch import load_file

    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    if x.keys() != y.keys():
        return float("inf")
    worst = 0.0
    for name, t in x.items():
        scale = float(t.float().abs().max()) or 1.0
        worst = max(worst, float((t.float() - y[name].float()).abs().max()) / scale)
    return worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--parts", nargs="+", choices=sorted(PARTS), default=["svd", "guard"])
    p.add_argument("--tokens", type=int, default=32768, help="calibration tokens [default: 32768]")
    p.add_argument("--fixtures", type=Path, default=DEFAULT_FIXTURES)
    args = p.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    try:
        _, mha = smollm2(args.fixtures)
    except Unavailable as e:
        raise SystemExit(f"scale_out: {e}") from None
    calib, _ = wikitext_split(args.fixtures, args.workdir)
    rows = []
    for n, part in enumerate(args.parts):
        one = convert(mha, args.workdir / f"{part}-1", calib, args.tokens, 1, PARTS[part], 29600 + n)
        two = convert(
            mha, args.workdir / f"{part}-2", calib, args.tokens, 2, PARTS[part] + SHARDED.get(part, []), 29600 + n
        )
        diff = difference(args.workdir / f"{part}-1", args.workdir / f"{part}-2")
        rows.append((part, one, two, diff))
        print(f"{part}: 1 process {one['seconds']:.1f} s, 2 ranks {two['seconds']:.1f} s", flush=True)
    print(f"\nSmolLM2-135M MHA 9 -> 3 KV heads, {args.tokens:,} calibration tokens in windows of 512, CPU")
    print("| part | 1 process: s | peak MiB | 2 ranks: s | peak MiB a rank | speed-up | largest difference |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for part, one, two, diff in rows:
        speed = one["seconds"] / two["seconds"]
        print(
            f"| {part} | {one['seconds']:.1f} | {one['peak_mib']:,.0f} | {two['seconds']:.1f} | "
            f"{two['peak_mib']:,.0f} | x{speed:.2f} | {diff:.1e} |"
        )


if __name__ == "__main__":
    main()
