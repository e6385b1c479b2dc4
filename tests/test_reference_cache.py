"""The reference cache is read like user input: every file's checksum verified, a damaged entry refused
with its path (never a wrong number or a traceback), and evaluations sharing a cache build an entry once."""

import json
import subprocess
import sys

import pytest
from conftest import eval_argv

from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.eval.harness import evaluate
from mha2gqa.eval.settings import EvalSettings


def settings(text, cache, **kw):
    return EvalSettings(data=str(text), seq_len=64, max_tokens=600, samples=1, sample_tokens=4, progress=False,
                        reference_cache=str(cache), **kw)  # fmt: skip


@pytest.fixture
def entry(pair, tmp_path):
    """A complete cache entry of the tiny pair: (its folder, the first evaluation's results)."""
    src, conv, text = pair
    first = evaluate(str(src), str(conv), settings(text, tmp_path / "cache"))
    (folder,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    return folder, first


def again(pair, entry):
    src, conv, text = pair
    return evaluate(str(src), str(conv), settings(text, entry[0].parent))


def test_an_intact_entry_is_reused_with_the_same_numbers(pair, entry):
    second, first = again(pair, entry), entry[1]
    assert second.protocols["disjoint"].converted == first.protocols["disjoint"].converted
    assert second.agreement.kl == first.agreement.kl
    manifest = json.loads((entry[0] / "mha2gqa_reference.json").read_text())
    assert manifest["files"] and all(len(v) == 2 and len(v[1]) == 64 for v in manifest["files"].values())


def _logits_file(folder):
    return sorted((folder / "logits" / "disjoint").iterdir())[0]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda f: f.write_bytes(f.read_bytes()[:-1] + bytes([f.read_bytes()[-1] ^ 1])), "content changed"),
        (lambda f: f.write_bytes(f.read_bytes()[:100]), "truncated"),
        (lambda f: f.unlink(), "is missing"),
    ],
    ids=["altered", "truncated", "missing"],
)
def test_a_damaged_file_is_refused_with_its_path(pair, entry, damage, message):
    damage(_logits_file(entry[0]))
    with pytest.raises(Mha2GqaError, match=message) as e:
        again(pair, entry)
    assert str(entry[0]) in str(e.value) and "disjoint" in str(e.value)


def test_a_file_altered_to_the_same_size_is_refused_when_read(pair, entry):
    """Same size, other bytes: found when the file is read back, before any number comes of it."""
    f = sorted((entry[0] / "attention").iterdir())[0]
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(Mha2GqaError, match="content changed since it was written"):
        again(pair, entry)


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.pop("model"),
        lambda m: m.pop("files"),
        lambda m: m.update(files=[]),
        lambda m: m.update(samples=[1]),
        lambda m: m.update(samples=[]),
        lambda m: m.update(seconds={"disjoint": "fast"}),
        lambda m: m["files"].update({"../../etc/passwd": [1, "x"]}),
        lambda m: m.update(model=None),
    ],
    ids=["no-model", "no-files", "files-list", "samples-type", "samples-count", "seconds", "path-escape", "null"],
)
def test_a_manifest_missing_or_mistyping_a_key_is_refused(pair, entry, edit):
    path = entry[0] / "mha2gqa_reference.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(Mha2GqaError, match=r"mha2gqa_reference\.json") as e:
        again(pair, entry)
    assert "remove" in str(e.value)


def test_two_evaluations_sharing_a_cache_build_it_once(pair, tmp_path):
    src, conv, text = pair
    cache = tmp_path / "cache"
    argv = [sys.executable, "-m", "mha2gqa.cli", *eval_argv(src, conv, text, "64", "3000", "--reference-cache",
                                                             str(cache), "--samples", "0")]  # fmt: skip
    runs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [r.communicate(timeout=300)[0] for r in runs]
    assert [r.returncode for r in runs] == [0, 0], outputs
    assert sum("scoring the original once" in o for o in outputs) == 1
    assert sum("reusing" in o for o in outputs) == 1
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 1
