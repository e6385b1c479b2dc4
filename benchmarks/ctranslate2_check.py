"""Does CTranslate2 (CPU) run mha2gqa's uniform GQA outputs? Each source and its conversions, side by side.

CTranslate2's own ``TransformersConverter`` turns each Hugging Face folder into its model format and its
``Generator.forward_batch`` gives the logits of the same tokens transformers scores; printed per model:
the KV heads CTranslate2 runs (read from its converted spec: the fused QKV projection's rows and its
``num_heads_kv``), the largest logit difference against transformers, and top-1 agreement. The source
is the baseline (its difference is CTranslate2's own float error). Cases: the real MHA fixture
``pydocs-mha-8h`` (a Llama whose heads were really learned) converted to 4, 2 and 1 KV heads, and
small random models of the other families both CTranslate2 and mha2gqa support (the fixtures'
``stories260K`` tokenizer for their vocabulary)::

    pip install ctranslate2 && python benchmarks/ctranslate2_check.py
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_cpp_check import FIXTURES, _random  # the same random models

#: case -> (model_type, config, KV heads of each conversion); None: the real fixture pydocs-mha-8h
CASES = {
    "pydocs-llama": (None, {}, (4, 2, 1)),
    "mistral": ("mistral", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                                num_key_value_heads=8, max_position_embeddings=128), (2,)),
    "qwen2": ("qwen2", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                            num_key_value_heads=8, max_position_embeddings=128), (2,)),
    "gemma": ("gemma", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                            num_key_value_heads=8, head_dim=8, max_position_embeddings=128), (2,)),
    "phi3": ("phi3", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                          num_key_value_heads=8, max_position_embeddings=128, pad_token_id=0), (2,)),
    "falcon": ("falcon", dict(hidden_size=64, num_attention_heads=8, num_kv_heads=8, num_hidden_layers=2,
                              new_decoder_architecture=True, max_position_embeddings=128), (2,)),
    "gpt2-mqa": ("gpt2", dict(n_embd=64, n_head=8, n_layer=2, n_positions=128), (1,)),
}  # fmt: skip


def _ctranslate2(folder: Path, work: Path, tokens: list[str]) -> tuple[np.ndarray, int] | str:
    """CTranslate2's logits for ``tokens`` and the KV heads it runs (layer 0), or why it could not."""
    import ctranslate2
    from ctranslate2.converters import TransformersConverter

    try:
        converter = TransformersConverter(str(folder))
        spec = converter._load()  # the spec it writes: what its runtime will run
        attn = spec.decoder.layer[0].self_attention
        rows = attn.linear[0].weight.shape[0]
        heads, d = spec.decoder.num_heads, attn.linear[1].weight.shape[1] // spec.decoder.num_heads
        kv = (rows // d - heads) // 2
        written = getattr(attn, "num_heads_kv", None)  # set only when it differs from the heads
        written = None if written is None or isinstance(written, str) else int(np.asarray(written).item())
        if written is not None and written != kv:
            return f"spec says num_heads_kv {written}, fused QKV has {kv}"
        out = work / f"ct2-{folder.name}"
        converter.convert(str(out), force=True)
        generator = ctranslate2.Generator(str(out), device="cpu", compute_type="float32")
        return np.array(generator.forward_batch([tokens]))[0], kv
    except Exception as e:  # report CTranslate2's refusal as the case's result
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=str(FIXTURES / "stories260K"), help="the random models' tokenizer")
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from mha2gqa.convert import convert_checkpoint
    from mha2gqa.core.models import load_model

    work = Path(tempfile.mkdtemp(prefix="mha2gqa-ct2-"))
    try:
        print("| case | model | KV heads (written / CTranslate2 runs) | max abs dlogit vs transformers | top-1 |")
        print("|---|---|---|---|---|")
        for case in args.cases:
            model_type, config, targets = CASES[case]
            if model_type is None:
                src = FIXTURES / "pydocs-mha-8h"
                text = (FIXTURES / "text" / "pydocs_heldout.txt").read_text(encoding="utf-8")[:4000]
            else:
                src = work / f"{case}-source"
                model = _random(model_type, config)
                if case == "qwen2":  # CTranslate2's Qwen2 loader adds one token to the tokenizer's vocabulary
                    model.resize_token_embeddings(513)
                model.save_pretrained(src)
                for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
                    shutil.copy(Path(args.tokenizer) / f, src)
                text = "Once upon a time there was a little girl who liked to play in the park with her dog."
            tok = AutoTokenizer.from_pretrained(src)
            ids = tok(text).input_ids[:128]
            folders = [("source", src)] + [
                (f"mean -> {g}", convert_checkpoint(src, work / f"{case}-g{g}", g, "mean", progress=False).output)
                for g in targets
            ]
            for label, folder in folders:
                loaded = load_model(str(folder), torch.device("cpu"), torch.float32)
                with torch.no_grad():
                    ref = loaded.model(torch.tensor([ids])).logits[0].numpy()
                written = loaded.describe().num_kv_heads
                got = _ctranslate2(folder, work, tok.convert_ids_to_tokens(ids))
                if isinstance(got, str):
                    print(f"| {case} | {label} | {written} / - | does not run: {got} | |", flush=True)
                    continue
                logits, kv = got
                agree = (logits.argmax(-1) == ref.argmax(-1)).mean()
                print(
                    f"| {case} | {label} | {written} / {kv} | {np.abs(logits - ref).max():.2e} (logits up to "
                    f"{np.abs(ref).max():.1f}) | {agree:.0%} of {len(ids)} |",
                    flush=True,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
