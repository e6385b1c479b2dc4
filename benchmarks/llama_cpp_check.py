"""Which converted checkpoints does llama.cpp run? Each source and its conversion, side by side.

For each case a small random model is built (every weight, norm and bias random; the sentencepiece
tokenizer of the fixtures' ``stories260K``), converted by mha2gqa, turned into GGUF by llama.cpp's
own ``convert_hf_to_gguf.py`` and run by llama.cpp (the ``llama_cpp`` binding); its logits are
compared with transformers' on the same tokens. The unconverted source is the baseline: its
difference is llama.cpp's own float error. Cases:

- ``deci``: a per-layer Llama conversion in its Nemotron-NAS form (``DeciLMForCausalLM``);
- ``gpt2-mqa``: GPT-2 re-targeted to GPTBigCode with one KV head;
- ``falcon``: Falcon (new_decoder_architecture) regrouped from 4 to 2 KV heads;
- ``neox-phi``: GPT-NeoX re-targeted to Phi with 2 KV heads (llama.cpp's Phi converter writes KV
  heads = heads, so this one is expected to fail); ``neox-phi-mha``: the same at G = H, the control.

Only the model graph is checked: every class's GGUF gets the sentencepiece vocabulary (llama.cpp's
BPE classes would ask for a pre-tokenizer it recognises), which does not touch the logits of given
token ids. llama.cpp is not a dependency: give a llama.cpp source tree (e.g. ``vendor/llama.cpp`` of
the ``llama-cpp-python`` sdist) and two interpreters, one with torch + transformers + sentencepiece
for its converter, one with ``llama_cpp`` installed::

    python benchmarks/llama_cpp_check.py --llama-cpp DIR --gguf-python PY1 --llama-python PY2
"""

from __future__ import annotations

import argparse
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
CONVERT = """
import runpy, sys
tree = sys.argv[1]
sys.path[:0] = [tree, tree + "/gguf-py"]
from conversion.base import TextModel
TextModel._set_vocab_gpt2 = lambda self: self._set_vocab_sentencepiece()  # the graph is what is checked
sys.argv = [tree + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(tree + "/convert_hf_to_gguf.py", run_name="__main__")
"""
RUN = """
import sys, numpy as np
from llama_cpp import Llama
ids = [int(x) for x in sys.argv[2].split(",")]
m = Llama(sys.argv[1], logits_all=True, n_ctx=64, verbose=False)
m.eval(ids)
np.save(sys.argv[3], np.array(m.scores[: len(ids)]))
"""
#: the Pythia-style GPT-NeoX both NeoX cases convert (through Phi)
NEOX = dict(hidden_size=64, num_attention_heads=8, intermediate_size=256, num_hidden_layers=2, rotary_pct=0.25,
            max_position_embeddings=128, tie_word_embeddings=False)  # fmt: skip
#: case -> (model_type, config, conversion: ("-g", G) or per-layer list)
CASES = {
    "deci": ("llama", dict(hidden_size=64, intermediate_size=256, num_hidden_layers=5, num_attention_heads=8,
                           num_key_value_heads=8, head_dim=8, max_position_embeddings=512, rms_norm_eps=1e-5),
             {"num_kv_heads": None, "num_kv_heads_per_layer": "8,4,2,1,2"}),
    "gpt2-mqa": ("gpt2", dict(n_embd=64, n_head=8, n_layer=2, n_positions=128), {"num_kv_heads": 1}),
    "falcon": ("falcon", dict(hidden_size=64, num_attention_heads=8, num_kv_heads=4, num_hidden_layers=2,
                              new_decoder_architecture=True, max_position_embeddings=128), {"num_kv_heads": 2}),
    "neox-phi": ("gpt_neox", NEOX, {"num_kv_heads": 2}),
    "neox-phi-mha": ("gpt_neox", NEOX, {"num_kv_heads": 8}),
}  # fmt: skip


def _random(model_type: str, config: dict) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(model_type, vocab_size=512, bos_token_id=1, eos_token_id=2, **config)
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name or "ln" in name else 0.2 * torch.randn_like(p))
    return model.eval()


def _llama_cpp(folder: Path, args, work: Path) -> np.ndarray | str:
    """llama.cpp's logits for ``IDS`` from ``folder``, or the first line of why it could not."""
    gguf = work / f"{folder.name}.gguf"
    logits = work / f"{folder.name}.npy"
    steps = (
        [args.gguf_python, "-c", CONVERT, args.llama_cpp, str(folder), "--outfile", str(gguf), "--outtype", "f32"],
        [args.llama_python, "-c", RUN, str(gguf), ",".join(map(str, IDS)), str(logits)],
    )
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        if done.returncode:
            lines = [ln for ln in (done.stderr or done.stdout).splitlines() if ln.strip()]
            return (lines[-1] if lines else f"exit {done.returncode}")[:160]
    return np.load(logits)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", required=True, help="a llama.cpp source tree (convert_hf_to_gguf.py, gguf-py)")
    ap.add_argument("--gguf-python", default=sys.executable, help="interpreter for convert_hf_to_gguf.py")
    ap.add_argument("--llama-python", default=sys.executable, help="interpreter with the llama_cpp binding")
    ap.add_argument("--tokenizer", default=str(FIXTURES / "stories260K"), help="folder with tokenizer.model")
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    args = ap.parse_args()
    from mha2gqa.convert import convert_checkpoint
    from mha2gqa.core.models import load_model

    work = Path(tempfile.mkdtemp(prefix="mha2gqa-llamacpp-"))
    try:
        print("| case | model | class | llama.cpp vs transformers: max abs dlogit | top-1 agreement |")
        print("|---|---|---|---|---|")
        for case in args.cases:
            model_type, config, conversion = CASES[case]
            src = work / f"{case}-source"
            _random(model_type, config).save_pretrained(src)
            for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
                shutil.copy(Path(args.tokenizer) / f, src)
            out = convert_checkpoint(
                src, work / f"{case}-converted", conversion.pop("num_kv_heads"), progress=False, **conversion
            ).output
            for folder in (src, out):
                ours = load_model(str(folder), torch.device("cpu"), torch.float32).model
                with torch.no_grad():
                    ref = ours(torch.tensor([IDS])).logits[0].numpy()
                got = _llama_cpp(folder, args, work)
                cls = type(ours).__name__.removeprefix("Mha2GqaPerLayer")
                kind = "source" if folder == src else "converted"
                if isinstance(got, str):
                    print(f"| {case} | {kind} | {cls} | does not run: {got} | |", flush=True)
                    continue
                agree = (got.argmax(-1) == ref.argmax(-1)).mean()
                print(
                    f"| {case} | {kind} | {cls} | {np.abs(got - ref).max():.4f} (logits up to "
                    f"{np.abs(ref).max():.2f}) | {agree:.0%} |",
                    flush=True,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
