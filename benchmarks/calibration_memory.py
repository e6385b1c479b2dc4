"""Peak RSS of ``mha2gqa convert --method svd`` (calibration streamed layer by layer) against the
model's size, on the random bf16 Llama MHA checkpoint of ``convert_memory.py`` (hidden 4096,
32 heads, 1 GB shards), at 4 and 8 layers.

    python benchmarks/calibration_memory.py --workdir /tmp/bench --layers 4 8
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from convert_memory import measure

TEXT = "\n\n".join(f"Section {i}: the quick brown fox {i % 13} jumps over {i % 7} lazy dogs." for i in range(4000))


def prepare(src: Path, layers: int) -> None:
    """The synthetic checkpoint plus a small byte-level tokenizer (ids below the 32,000 vocab)."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import convert_memory as m; "
        "m.make_checkpoint(m.Path(sys.argv[2]), int(sys.argv[3]))"
    )
    if not (src / "config.json").is_file():
        subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), str(src), str(layers)], check=True)
    from mha2gqa.demo import build_tokenizer

    build_tokenizer(TEXT, 1000).save_pretrained(src)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, default=Path("bench-out"))
    p.add_argument("--layers", type=int, nargs="+", default=[4, 8])
    p.add_argument("--tokens", type=int, default=2048)
    args = p.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    text = args.workdir / "calibration.txt"
    text.write_text(TEXT)
    for layers in args.layers:
        src = args.workdir / f"mha-{layers}L"
        prepare(src, layers)
        size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        out = args.workdir / "svd"
        shutil.rmtree(out, ignore_errors=True)
        cmd = [
            sys.executable,
            "-m",
            "mha2gqa.cli",
            "convert",
            str(src),
            str(out),
            "-g",
            "8",
            "--method",
            "svd",
            "--calibration",
            str(text),
            "--calibration-tokens",
            str(args.tokens),
            "--device",
            "cpu",
            "-q",
            "--max-shard-size",
            "1GB",
        ]
        wall, rss = measure(cmd)
        print(
            f"{layers} layers, {size / 2**30:.2f} GiB bf16: svd conversion with {args.tokens} calibration tokens "
            f"{wall:.1f} s, peak RSS {rss:,.0f} MiB = {rss * 2**20 / size:.0%} of the model",
            flush=True,
        )
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
