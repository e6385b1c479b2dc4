"""Loading models and tokenizers for evaluation: devices, dtypes, placement, and checks."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mha2gqa.core.architecture import dims_of
from mha2gqa.core.checkpoint import read_config, resolve_folder
from mha2gqa.core.conversion_record import Facts, read_conversion_record
from mha2gqa.core.devices import check_device_name, check_dtype_name
from mha2gqa.core.dims import PER_LAYER_KEY, max_positions
from mha2gqa.core.dtypes import by_name, from_torch
from mha2gqa.core.errors import Mha2GqaError, SettingError, config_errors, first_line
from mha2gqa.core.model_info import ModelInfo
from mha2gqa.core.records import UPTRAIN_RECORD
from mha2gqa.core.uptrain_guard import published_run

#: how long a process of several waits at a collective for the others (the group's timeout, gloo's
#: and NCCL's): rank 0 alone writes the checkpoint and scores the stage guard, and under FSDP the
#: processes load in turns, each minutes long at 70B (the defaults, 30 and 10 minutes, are too short)
GROUP_TIMEOUT_S = 3 * 3600


def resolve_device(device: str) -> torch.device:
    """``auto`` -> this process's accelerator from ``accelerate`` (CUDA when present), else CPU.

    Also sets up ``accelerate``'s process state, so that under ``accelerate launch`` / ``torchrun``
    the processes form a group (NCCL on GPUs, gloo on CPUs).
    """
    from accelerate import PartialState

    check_device_name(device)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SettingError("device", f"{{name}} {device}: CUDA is not available on this machine; use cpu")
    from datetime import timedelta

    cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    state = PartialState(cpu=cpu, timeout=timedelta(seconds=GROUP_TIMEOUT_S))  # (formed once: later calls reuse it)
    return state.device if device == "auto" else torch.device(device)


def computes_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 matrices natively, faster than float32: a GPU that supports
    bfloat16, or a CPU with AMX tiles or AVX512-BF16 (on this repository's 2-core Xeon a SmolLM2-135M
    training step takes 0.59x the time under bf16 autocast, its forward 0.29x in bfloat16:
    benchmarks/bf16_steps.py, docs/benchmarks.md); elsewhere bfloat16 is emulated, slower than float32."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")  # torch.cpu's (private: absent is no)
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def resolve_precision(precision: str, device: torch.device) -> str:
    """A :data:`~mha2gqa.core.devices.PRECISIONS` choice as run on ``device``: ``auto`` -> ``bf16`` where
    it :func:`computes_bf16`, else ``no``; the others as given."""
    return ("bf16" if computes_bf16(device) else "no") if precision == "auto" else precision


def arithmetic(precision: str, device: str) -> str:
    """:func:`resolve_precision` on the device named ``device`` (``auto``, ``cpu``, ``cuda:1``...): what a
    run on this machine computes in, which a resume fingerprint holds."""
    return resolve_precision(precision, resolve_device(device))


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a resolved precision: bfloat16 for ``bf16``, None (float32) for ``no``."""
    return torch.bfloat16 if precision == "bf16" else None


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` -> bfloat16 on GPU, float32 on CPU."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    check_dtype_name(dtype)
    return by_name(dtype).torch


@dataclass
class LoadedModel:
    path: str
    model: torch.nn.Module
    folder: Path

    def conversion(self) -> Facts | None:
        """What ``mha2gqa convert`` recorded about this model (None: not converted by it)."""
        record = read_conversion_record(self.folder)
        return record.conversion if record else None

    def describe(self) -> ModelInfo:
        """Config summary, hashes and the conversion record when the folder has one."""
        cfg = self.model.config
        dims = dims_of(cfg)
        dtype = next(self.model.parameters()).dtype
        config_file = self.folder / "config.json"
        stored = stored_dtype(config_file) or from_torch(dtype)  # the KV figures in the checkpoint's dtype, as convert
        run = published_run(self.folder)
        return ModelInfo(
            path=self.path,
            architecture=(getattr(cfg, "architectures", None) or [type(self.model).__name__])[0],
            num_layers=dims.num_layers,
            num_heads=dims.num_heads,
            num_kv_heads=dims.num_kv_heads,
            kv_heads_per_layer=list(dims.kv_heads_per_layer) if dims.kv_heads_per_layer else None,
            head_dim=dims.head_dim,
            max_positions=max_positions(cfg),
            parameters=sum(p.numel() for p in self.model.parameters()),
            dtype=str(dtype).removeprefix("torch."),
            kv_cache_bytes_per_token=dims.kv_cache_bytes_per_token(None, stored.bytes),
            kv_cache_dtype=stored.name,
            cache_spans=list(dims.cache_spans) if dims.cache_spans else None,
            config_sha256=hashlib.sha256(config_file.read_bytes()).hexdigest() if config_file.is_file() else None,
            conversion=self.conversion(),
            uptrained=(self.folder / UPTRAIN_RECORD).is_file(),
            uptrain_outcome=run.outcome if run is not None else None,
            uptrain_stage=run.stage if run is not None else None,
        )


def stored_dtype(config_file: Path):
    """The checkpoint's dtype as its ``config.json`` names it (``dtype``; ``torch_dtype`` before), or None."""
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
        named = config.get("dtype") or config.get("torch_dtype")
        return by_name(str(named)) if named else None
    except (OSError, ValueError, AttributeError, Mha2GqaError):
        return None


def load_model(
    path: str, device: torch.device, dtype: torch.dtype, device_map: str | None = None, revision: str | None = None
) -> LoadedModel:
    """A causal LM in eval mode on ``device`` (or spread by ``device_map='auto'`` across GPUs)."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    folder, _, _ = resolve_folder(path, revision)
    logging.disable_progress_bar()
    try:
        config = read_config(folder)
        # SDPA, except where the family soft-caps attention logits (Gemma 2): SDPA cannot, eager can
        capped = config.get("attn_logit_softcapping") is not None
        kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": "eager" if capped else "sdpa"}
        if device_map:
            kwargs["device_map"] = device_map
        cls = AutoModelForCausalLM
        if PER_LAYER_KEY in config:  # layers with their own KV-head counts
            from transformers import AutoConfig

            from mha2gqa.core.per_layer import causal_lm_class, per_layer_class

            cls = per_layer_class(causal_lm_class(AutoConfig.from_pretrained(folder)))
        model = cls.from_pretrained(folder, **kwargs)
    except (OSError, SafetensorError, *config_errors()) as e:
        raise Mha2GqaError(f"{path}: cannot be loaded as a causal LM: {first_line(e)}") from None
    if not device_map:
        model.to(device)
    return LoadedModel(path, model.eval(), folder)


def load_tokenizer(folder: Path):
    """The tokenizer of the model folder ``folder``, refused in one line when the folder has none (a
    checkpoint saved without its tokenizer) or transformers cannot build it."""
    from transformers import AutoTokenizer

    from mha2gqa.core.checkpoint import TOKENIZER_FILES

    if Path(folder).is_dir() and not any((Path(folder) / name).is_file() for name in TOKENIZER_FILES):
        raise Mha2GqaError(
            f"{folder}: no tokenizer ({', '.join(TOKENIZER_FILES)} absent): this step reads text, so copy the "
            "original model's tokenizer files into the folder (tokenizer.save_pretrained(folder))"
        )
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError) as e:
        why = " ".join(line.strip() for line in str(e).splitlines() if line.strip())[:300] or type(e).__name__
        raise Mha2GqaError(f"{folder}: no usable tokenizer: {why}") from None


def check_same_tokenizer(a, b, a_name: str, b_name: str) -> None:
    """Both models must read text the same way: same vocabulary and special tokens."""
    if a.get_vocab() != b.get_vocab() or (a.bos_token_id, a.eos_token_id) != (b.bos_token_id, b.eos_token_id):
        raise Mha2GqaError(
            f"tokenizer mismatch: {a_name} and {b_name} do not share a tokenizer (vocabulary or special "
            "tokens differ); compare a model with its own conversion"
        )


def tokenizer_info(tok) -> dict[str, Any]:
    vocab = tok.get_vocab()
    digest = hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()
    return {
        "name_or_path": str(tok.name_or_path),
        "class": type(tok).__name__,
        "vocab_size": len(vocab),
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "vocab_sha256": digest,
    }
