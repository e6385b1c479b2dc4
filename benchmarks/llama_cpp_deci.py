"""Does llama.cpp run a per-layer checkpoint in its Nemotron-NAS (``DeciLMForCausalLM``) form?

Builds a small random Llama (with a real sentencepiece tokenizer from the fixtures), converts it
with per-layer KV heads, turns both the source and the conversion into GGUF with llama.cpp's own
``convert_hf_to_gguf.py``, runs both in llama.cpp (the ``llama_cpp`` Python binding) and prints
llama.cpp's logits against transformers' (mha2gqa's loader) on the same tokens. The unconverted
source is the baseline: its difference is llama.cpp's own float error.

llama.cpp is not a dependency: give a llama.cpp source tree (e.g. the ``vendor/llama.cpp`` of the
``llama-cpp-python`` sdist) and two interpreters, one with torch + transformers + sentencepiece for
the converter, one with ``llama_cpp`` installed::

    python benchmarks/llama_cpp_deci.py --llama-cpp DIR --gguf-python PY1 --llama-python PY2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
IDS = [1, 5, 17, 33, 9, 60, 2, 41, 77, 12, 3, 90, 250, 7, 300, 11]
RUN = """
import sys, numpy as np
from llama_cpp import Llama
ids = [int(x) for x in sys.argv[2].split(",")]
m = Llama(sys.argv[1], logits_all=True, n_ctx=64, verbose=False)
m.eval(ids)
np.save(sys.argv[3], np.array(m.scores[: len(ids)]))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", required=True, help="a llama.cpp source tree (convert_hf_to_gguf.py, gguf-py)")
    ap.add_argument("--gguf-python", default=sys.executable, help="interpreter for convert_hf_to_gguf.py")
    ap.add_argument("--llama-python", default=sys.executable, help="interpreter with the llama_cpp binding")
    ap.add_argument("--kv-heads", default="8,4,2,1,2", help="per-layer KV heads (5 layers of 8 heads)")
    ap.add_argument("--tokenizer", default=str(FIXTURES / "stories260K"), help="folder with tokenizer.model")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, LlamaConfig

    from mha2gqa.convert import convert_checkpoint
    from mha2gqa.core.models import load_model

    tree = Path(args.llama_cpp)
    work = Path(tempfile.mkdtemp(prefix="mha2gqa-llamacpp-"))
    try:
        cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=5,
                          num_attention_heads=8, num_key_value_heads=8, head_dim=8, max_position_embeddings=512,
                          rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)  # fmt: skip
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
        model.save_pretrained(work / "src")
        for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
            shutil.copy(Path(args.tokenizer) / f, work / "src")
        out = convert_checkpoint(work / "src", work / "out", None, num_kv_heads_per_layer=args.kv_heads,
                                 progress=False).output  # fmt: skip
        arch = json.loads((out / "config.json").read_text())["architectures"]
        print(f"converted: KV heads {args.kv_heads} per layer, architectures {arch}")
        env = {**os.environ, "PYTHONPATH": str(tree / "gguf-py")}
        for name in ("src", "out"):
            subprocess.run([args.gguf_python, str(tree / "convert_hf_to_gguf.py"), str(work / name), "--outfile",
                            str(work / f"{name}.gguf"), "--outtype", "f32"], check=True, env=env,
                           capture_output=True)  # fmt: skip
            subprocess.run([args.llama_python, "-c", RUN, str(work / f"{name}.gguf"), ",".join(map(str, IDS)),
                            str(work / f"{name}.npy")], check=True, capture_output=True)  # fmt: skip
            ours = load_model(str(work / name), torch.device("cpu"), torch.float32).model
            with torch.no_grad():
                ref = ours(torch.tensor([IDS])).logits[0].numpy()
            got = np.load(work / f"{name}.npy")
            what = "source (Llama, MHA) " if name == "src" else "per-layer (deci)   "
            agree = (got.argmax(-1) == ref.argmax(-1)).mean()
            print(f"{what} llama.cpp vs transformers: max |dlogit| {np.abs(got - ref).max():.4f} "
                  f"(logits up to {np.abs(ref).max():.2f}), top-1 agreement {agree:.0%}")  # fmt: skip
        sys.path.insert(0, str(tree / "gguf-py"))
        from gguf import GGUFReader

        fields = GGUFReader(str(work / "out.gguf")).fields
        print("GGUF: general.architecture", fields["general.architecture"].contents(),
              "| deci.attention.head_count_kv", fields["deci.attention.head_count_kv"].contents())  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
