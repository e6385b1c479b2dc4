"""An evaluation decided before any model loads: :func:`prepare` reads the models' configs, the
tokenizer and the text, checks them, and cuts every protocol's windows into one frozen
:class:`Evaluation`, which :func:`mha2gqa.eval.harness.run` then scores (the counterpart of the
conversion's ``Conversion`` and uptraining's ``Uptraining``)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mha2gqa.core.checkpoint import TOKENIZER_FILES, read_config, resolve_folder
from mha2gqa.core.dims import max_positions
from mha2gqa.core.errors import Mha2GqaError, SettingError, config_errors, first_line
from mha2gqa.core.models import check_same_tokenizer, load_tokenizer
from mha2gqa.core.settings import check_window
from mha2gqa.core.text import TextData, document_tokens, load_text, prefix_token, token_stream
from mha2gqa.eval.greedy import probe_prompts
from mha2gqa.eval.perplexity import (
    Window,
    disjoint_windows,
    rolling_windows,
    stride_windows,
)
from mha2gqa.eval.settings import EvalSettings


@dataclass(frozen=True)
class Evaluation:
    """One evaluation, decided before any model is loaded (:func:`prepare`): settings, the models'
    folders, text, tokenizer, and the windows of every pass; :func:`~mha2gqa.eval.harness.run` runs
    it."""

    settings: EvalSettings
    paths: list[str]
    folders: list[Path]
    limit: int | None  # the models' smallest max_position_embeddings
    tokenizer: Any
    data: TextData
    ids: torch.Tensor  # [N] the token stream
    seq_len: int
    stride: int
    passes: dict[str, list[Window]]
    rolling_text: list[str]  # the documents the rolling protocol scored
    rolling_len: int  # the rolling protocol's window
    attention_batch: torch.Tensor | None  # [B, T] (pairs with attention similarity)
    prompts: list[torch.Tensor]  # sample prompts [1, P] (pairs)
    new_tokens: int
    #: the generative probe's prompts ``[n, P]`` (pairs; None: none) and the tokens each continuation runs
    probe: torch.Tensor | None = None
    probe_tokens: int = 0
    task_selection: Any = None  # eval.tasks.TaskSelection (--tasks)

    @property
    def names(self) -> list[str]:
        return ["original", "converted"][: len(self.paths)]

    @property
    def common(self) -> dict[str, Any]:
        s = self.settings
        return {"seq_len": self.seq_len, "max_tokens": s.max_tokens, "batch_size": s.batch_size}

    @property
    def stream(self) -> str:
        return "one BOS at the start" if self.tokenizer.bos_token_id is not None else "no BOS (tokenizer has none)"


def prepare(original: str, converted: str | None, s: EvalSettings) -> Evaluation:
    """Read the configs, tokenizer and text and cut every pass into windows (all checked, ``s``
    checked first), before any weights are loaded."""
    s = s.check()
    selection = _task_selection(s)
    data = load_text(s.data, s.text_field, s.doc_split)
    paths = [original] + ([converted] if converted else [])
    folders = [resolve_folder(p, s.revision)[0] for p in paths]
    tok = load_tokenizer(folders[0])
    if converted and any((folders[1] / f).is_file() for f in TOKENIZER_FILES):
        check_same_tokenizer(tok, load_tokenizer(folders[1]), original, converted)
    limits = [p for p in map(_max_positions, folders) if p]
    max_pos = min(limits) if limits else None
    seq_len = s.window(max_pos)
    check_window("seq_len", seq_len, max_pos)
    stride = s.stride or max(seq_len // 2, 1)
    if not 1 <= stride <= seq_len:
        raise SettingError("stride", f"{{name}} {stride} must be between 1 and --seq-len {seq_len}")
    ids = token_stream(tok, data, s.max_tokens)
    streamed = converted is not None or "disjoint" in s.protocols or "stride" in s.protocols
    if streamed and ids.numel() < seq_len:
        raise SettingError(
            "data",
            f"{{name}} {s.data}: {ids.numel()} tokens, fewer than one window of {seq_len}; "
            "give more text or a smaller --seq-len",
        )
    passes: dict[str, list[Window]] = {}
    if "disjoint" in s.protocols or converted:
        passes["disjoint"] = disjoint_windows(ids, seq_len)
    if "stride" in s.protocols:
        passes["stride"] = stride_windows(ids, seq_len, stride)
    used: list[str] = []
    rolling_len = s.rolling_window(max_pos)
    if "rolling" in s.protocols:
        special = s.rolling_convention == "lm-eval-0.4.10"
        docs, used = document_tokens(tok, data, s.max_tokens, special_tokens=special)
        prefix = prefix_token(tok)
        passes["rolling"] = [w for d in docs for w in rolling_windows(d, prefix, rolling_len)]
    batch = None
    if converted and s.attention and _attention_readable(folders):
        t = s.attention_window(seq_len)
        windows = [w for w, _ in disjoint_windows(ids, t) if w.numel() == t][: s.attention_windows]
        batch = torch.stack(windows) if windows else None
    # Samples: the first quarter of the first windows (at most 32 tokens), cut to the positions.
    prompt_len = max(1, min(32, seq_len // 4))
    prompts = [w[:prompt_len][None] for w, _ in disjoint_windows(ids, seq_len)[: s.samples]] if converted else []
    new = max(1, min(s.sample_tokens, (max_pos or 10**9) - prompt_len))
    probe_new = max(1, min(s.greedy_tokens, (max_pos or 10**9) - prompt_len))
    probe = probe_prompts(ids, s.greedy_prompts, seq_len, probe_new) if converted else None
    return Evaluation(s, paths, folders, max_pos, tok, data, ids, seq_len, stride, passes, used, rolling_len,
                batch, prompts, new, probe, probe_new, selection)  # fmt: skip


def _task_selection(s: EvalSettings) -> Any:
    """The downstream tasks resolved (None without ``--tasks``): one process only, as the harness
    takes a pre-loaded model only outside ``accelerate launch``."""
    if not s.tasks:
        return None
    from mha2gqa.core.ranks import launched
    from mha2gqa.eval.tasks import select_tasks

    if launched() > 1:
        raise SettingError("tasks", "{name} runs in one process: evaluate the tasks without accelerate launch")
    return select_tasks(s.tasks, s.include_path)


def _max_positions(folder: Path) -> int | None:
    from transformers import AutoConfig

    try:
        return max_positions(AutoConfig.from_pretrained(folder))
    except (OSError, *config_errors()) as e:
        raise Mha2GqaError(f"{folder}: cannot read its config: {first_line(e)}") from None


def _attention_readable(folders: list[Path]) -> bool:
    """Both models run their attention through transformers' attention interface, where the
    attention comparison reads it (Falcon's does not: then it is skipped, and said so)."""
    from mha2gqa.core.architecture import resolve

    for folder in folders:
        family = resolve(read_config(folder), strict=False).family
        if family is not None and not family.attention_interface:
            sys.stderr.write(
                f"note: {family.architectures[0]} computes attention outside the installed transformers' "
                f"attention interface{family.interface_hint}, so the per-layer attention comparison is skipped\n"
            )
            return False
    return True
