"""Shared fixtures: tiny random checkpoints of every supported family, built offline."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from real_fixtures import DEFAULT_FIXTURES, FIXTURES_ENV  # benchmarks and tests share it

#: Where the real small checkpoints and texts are: ``$MHA2GQA_FIXTURES``, else ``../shared/fixtures``
#: beside the checkout. Tests that need them skip (and the run says how many) when they are absent.
FIXTURES = DEFAULT_FIXTURES
FIXTURES_ABSENT = "real fixtures absent"

#: Llama-2-7B's config.json (planning and inspection need no weights)
LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 11008, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
             "vocab_size": 32000, "max_position_embeddings": 4096, "tie_word_embeddings": False}  # fmt: skip

#: family -> (model_type, extra config) for a tiny model; 4 query heads unless given.
FAMILY_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {"attention_bias": True}),
    "mistral": ("mistral", {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 4}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 8}),
    "gemma": ("gemma", {"head_dim": 16}),
    # sliding-window layers shorter than the tests' windows; caps low enough to bite on random weights
    "gemma2": (
        "gemma2",
        {
            "head_dim": 8,
            "sliding_window": 8,
            "query_pre_attn_scalar": 8,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 5.0,
        },
    ),
    "gemma3": (
        "gemma3_text",
        {
            "head_dim": 8,
            "sliding_window": 8,
            "query_pre_attn_scalar": 8,
            "layer_types": ["sliding_attention", "full_attention"],  # its 5:1 pattern, in 2 layers
        },
    ),
    "granite": ("granite", {"attention_multiplier": 0.3, "residual_multiplier": 0.5, "embedding_multiplier": 2.0}),
    "helium": ("helium", {"head_dim": 8}),
    "ministral": ("ministral", {"head_dim": 8, "sliding_window": 8}),
    "ernie4_5": ("ernie4_5", {"head_dim": 8}),
    "arcee": ("arcee", {"head_dim": 8}),
    "mixtral": ("mixtral", {"head_dim": 8, "num_local_experts": 2, "num_experts_per_tok": 1}),
    "qwen2_moe": (
        "qwen2_moe",
        {
            "num_experts": 2,
            "num_experts_per_tok": 1,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16,
        },
    ),
    "phi": ("phi", {"partial_rotary_factor": 0.5}),
    "phi3": ("phi3", {}),
    "stablelm": ("stablelm", {"qk_layernorm": True, "use_qkv_bias": True}),
    "olmo": ("olmo", {"clip_qkv": 8.0}),
    "olmo2": ("olmo2", {}),
    "starcoder2": ("starcoder2", {"use_bias": True}),
    "gpt_bigcode": ("gpt_bigcode", {"multi_query": False}),
    "falcon": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 4}),
}


@pytest.fixture(autouse=True, scope="session")
def _subprocess_temp(tmp_path_factory):
    """The processes the tests start (torchrun's agents leave ``torchelastic_*`` folders) use a
    temporary folder of this run's, which pytest removes with its old runs, not the machine's /tmp."""
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("subprocess-tmp"))
    yield
    if before is None:
        del os.environ["TMPDIR"]
    else:
        os.environ["TMPDIR"] = before


def tiny_config(family: str, **overrides):
    from transformers import AutoConfig

    model_type, extra = FAMILY_CONFIGS[family]
    kwargs = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    kwargs.update(extra)
    kwargs.update(overrides)
    return AutoConfig.for_model(model_type, **kwargs)


def random_model(config, seed: int = 0):
    """A model from ``config`` with every parameter random (biases and norms too), in fp32."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return model


def save(model, folder: Path, shard: str | None = None) -> Path:
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, **kwargs)
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(family, sharded=False, **config)`` -> folder, built once per session."""
    cache: dict[tuple, Path] = {}

    def build(family: str, sharded: bool = False, **overrides) -> Path:
        key = (family, sharded, tuple(sorted(overrides.items())))
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"{family}-src")
            save(random_model(tiny_config(family, **overrides)), folder, "20KB" if sharded else None)
            cache[key] = folder
        return cache[key]

    return build


@pytest.fixture(scope="module")
def calib_text(tmp_path_factory):
    """A small repetitive English calibration text (one per test module)."""
    path = tmp_path_factory.mktemp("cal") / "cal.txt"
    path.write_text("\n\n".join(f"the {i % 9} cats sat on {i % 4} mats while {i % 7} dogs ran" for i in range(400)))
    return path


def load(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def requires_fixtures(*names: str):
    """Skip a test unless ``names`` (paths under :data:`FIXTURES`) exist."""
    missing = [n for n in names if not (FIXTURES / n).exists()]
    return pytest.mark.skipif(bool(missing), reason=f"{FIXTURES_ABSENT}: {', '.join(missing)}")


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """One line saying how many real-model tests were skipped for want of the fixtures, and how to
    point the run at them."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if FIXTURES_ABSENT in str(r.longrepr)]
    if skipped:
        terminalreporter.write_line(
            f"{len(skipped)} real-model test(s) skipped: no fixtures at {FIXTURES} "
            f"(set {FIXTURES_ENV}=/path/to/shared/fixtures to run them)",
            yellow=True,
        )


def torchrun(processes: int = 2) -> list[str]:
    """``torchrun`` for ``processes`` local processes on a port free now (a fixed port is taken by any
    other suite running on the machine at the same time)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(processes),
        "--master_port",
        str(port),
    ]


def story_text(path: Path, lines: int = 300) -> Path:
    """A small repetitive English text for calibration and evaluation tests."""
    path.write_text("\n\n".join(f"the cat {i % 7} sat on the mat and ran {i % 5} times" for i in range(lines)))
    return path


def llama_with_tokenizer(folder: Path, text: Path, max_positions: int = 64) -> Path:
    """A tiny random Llama with a byte-level BPE tokenizer (300 tokens) trained on ``text``."""
    from mha2gqa.demo import build_tokenizer

    tok = build_tokenizer(text.read_text(), 300)
    save(random_model(tiny_config("llama", vocab_size=len(tok), max_position_embeddings=max_positions)), folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``(original, its mean 4 -> 2 conversion, text)``: a tiny Llama with a real tokenizer, per module."""
    from mha2gqa.convert import convert_checkpoint

    root = tmp_path_factory.mktemp("pair")
    text = story_text(root / "t.txt")
    src = llama_with_tokenizer(root / "mha", text, max_positions=128)
    conv = convert_checkpoint(src, root / "g2", 2, progress=False).output
    return src, conv, text


def eval_argv(original, converted, data, seq_len, max_tokens, *extra, options: str = "") -> list[str]:
    """``mha2gqa eval`` arguments comparing ``converted`` with ``original`` on ``data``; ``options``:
    more flags as one string (split on spaces)."""
    head = ["eval", "--original", original, "--converted", converted, "--data", data, "--seq-len", seq_len]
    return [str(a) for a in (*head, "--max-tokens", max_tokens, *extra, *options.split())]


def eval_error(*args) -> str:
    """The one ``Error:`` line of ``mha2gqa eval ARGS`` (exit 1, no traceback)."""
    from click.testing import CliRunner

    from mha2gqa.cli import main

    result = CliRunner().invoke(main, ["eval", *map(str, args)])
    assert result.exit_code == 1, result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith("Error:")]
    assert len(lines) == 1 and "Traceback" not in result.output
    return lines[0]


def bench_argv(original, converted, output, options: str = "") -> list[str]:
    """``mha2gqa bench`` arguments for ``original`` and ``converted``, figures to ``output``."""
    return [str(a) for a in ("bench", "--original", original, "--converted", converted, "--output", output)] + (
        options.split()
    )


def cached_heads(family: str, query_heads: int, kv_heads: int) -> int:
    """KV heads the installed transformers caches for ``family``: Falcon broadcast K/V to every query
    head before caching until 5.25, which caches the checkpoint's (measured: 5.24 holds H, 5.25 G)."""
    from packaging.version import Version

    from mha2gqa.core.families import installed_transformers

    broadcasts = family == "falcon" and installed_transformers() < Version("5.25")
    return query_heads if broadcasts else kv_heads


@pytest.fixture
def falcon_before_its_interface(monkeypatch):
    """Falcon as in a transformers version whose Falcon attention bypasses the attention interface
    (before 5.25), whatever version is installed: its family reads the interface from 999 on."""
    import dataclasses

    from mha2gqa.core.families import families

    falcon = dataclasses.replace(families()["falcon"], attention_interface_versions=">=999")
    monkeypatch.setitem(families(), "falcon", falcon)
    return falcon
