"""Where the real fixtures are, and the real pretrained model built from its GGUF, for benchmarks and
tests alike (``../shared/fixtures``: a user's clone does not have them, so callers skip without).

``smollm2(fixtures)`` gives the two folders ``build.py`` beside the SmolLM2-135M GGUF makes (the model,
3 KV heads, and its MHA form, 9 KV heads), built once into mha2gqa's cache (``$MHA2GQA_CACHE``) under a
key of the GGUF's sha256, ``build.py``'s and the torch/transformers versions, and reused; the build
runs in a temporary folder renamed into place under the cache's lock, so a killed build leaves
nothing a later run would take for finished. ``wikitext_split`` cuts WikiText-2 test into the
calibration half and the held-out half as the fixture's README pins them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

#: ``$MHA2GQA_FIXTURES``, else ``shared/fixtures`` beside the checkout
FIXTURES_ENV = "MHA2GQA_FIXTURES"
DEFAULT_FIXTURES = Path(os.environ.get(FIXTURES_ENV) or Path(__file__).resolve().parents[2] / "shared" / "fixtures")
SMOLLM2_DIR = "smollm2-135m-gguf"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: the folder names build.py writes
SMOLLM2 = "smollm2-135m"
SMOLLM2_MHA = "smollm2-135m-mha-expanded"


class Unavailable(Exception):
    """The fixture or what building it needs is absent (callers skip, benchmarks exit with the reason)."""


def smollm2(fixtures: Path = DEFAULT_FIXTURES) -> tuple[Path, Path]:
    """``(model, mha_form)``: the SmolLM2-135M folders, built on first use (~1 min, ~3 GB of memory)."""
    import importlib.util

    from mha2gqa.core.cache import cache_root, computed_with, entry_name, file_sha256, locked

    here = fixtures / SMOLLM2_DIR
    gguf, build = here / SMOLLM2_GGUF, here / "build.py"
    if not (gguf.is_file() and build.is_file()):
        raise Unavailable(f"{here}: the SmolLM2 GGUF fixture is absent")
    if importlib.util.find_spec("gguf") is None:
        raise Unavailable("the gguf package is not installed (pip install -e '.[dev]')")
    material = {"gguf": file_sha256(gguf), "build": file_sha256(build), **computed_with()}
    material.pop("mha2gqa", None)  # the build does not run mha2gqa's code
    root = cache_root() / "fixtures"
    key = f"smollm2-{entry_name(material)}"
    entry = root / key
    with locked(root, key, "the SmolLM2 fixture cache"):
        if not (entry / SMOLLM2_MHA / "model.safetensors").is_file():
            if entry.exists():
                shutil.rmtree(entry)  # an earlier, unfinished layout: never a finished build
            tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
            try:
                env = {**os.environ, "HF_HUB_OFFLINE": "1"}
                subprocess.run([sys.executable, str(build), str(tmp)], check=True, env=env, capture_output=True)
                os.replace(tmp, entry)
            except subprocess.CalledProcessError as e:
                shutil.rmtree(tmp, ignore_errors=True)
                last = e.stderr.decode(errors="replace").strip().splitlines()[-1:]
                raise Unavailable(f"{build} failed: {last}") from None
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    return entry / SMOLLM2, entry / SMOLLM2_MHA


def wikitext_split(fixtures: Path, work: Path) -> tuple[Path, Path]:
    """``(calibration, held_out)`` files in ``work``: WikiText-2 test cut at the first article heading
    after its middle character (``text.index("\\n = ", len(text) // 2)``), as the SmolLM2 fixture's
    README pins it."""
    text = (fixtures / "text" / "wikitext2_test.txt").read_text(encoding="utf-8")
    cut = text.index("\n = ", len(text) // 2)
    calib, held = work / "wikitext_calibration.txt", work / "wikitext_heldout.txt"
    calib.write_text(text[:cut], encoding="utf-8")
    held.write_text(text[cut:], encoding="utf-8")
    return calib, held


def tail_text(path: Path, tokenizer_folder: Path, tokens: int, out: Path) -> Path:
    """``out``: the end of ``path``'s text holding its last ``tokens`` tokens (plus the few of a cut
    word), so scoring the first ``tokens`` of ``out`` scores the end of the text."""
    from transformers import AutoTokenizer

    text = path.read_text(encoding="utf-8")
    tok = AutoTokenizer.from_pretrained(tokenizer_folder)
    enc = tok(text, return_offsets_mapping=True, add_special_tokens=False)
    offsets = enc["offset_mapping"]
    start = offsets[max(0, len(offsets) - tokens)][0]
    out.write_text(text[start:], encoding="utf-8")
    return out
