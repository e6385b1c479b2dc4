"""Uptraining decided before any model loads: :func:`prepare` resolves and checks a run's sizes,
tokenizers, text and steps into one frozen :class:`Uptraining` (the counterpart of the conversion's
``Conversion``), which :func:`~mha2gqa.uptrain.trainer.uptrain` then runs; and the checkpoint a
``--resume`` continues from."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from mha2gqa.core.cache import cache_root
from mha2gqa.core.dims import AttentionDims, max_positions
from mha2gqa.core.errors import Mha2GqaError, SettingError
from mha2gqa.core.settings import check_window
from mha2gqa.core.text import TextSource
from mha2gqa.uptrain.checkpoints import checkpoint_dirs, read_state
from mha2gqa.uptrain.eval_budget import MAX_EVAL_TOKENS, WARN_SHARE, eval_budget
from mha2gqa.uptrain.settings import RUN_FIELDS, UptrainSettings
from mha2gqa.uptrain.tokens import TokenStore, token_store


def _tokens(tokenizer, setting: str, s: UptrainSettings, max_tokens: int | None) -> torch.Tensor:
    """The token stream of the text in setting ``setting`` (``data`` or ``eval_data``)."""
    from mha2gqa.core.text import load_text, token_stream

    return token_stream(tokenizer, load_text(getattr(s, setting), s.text_field, s.doc_split, setting), max_tokens)


@dataclass(frozen=True)
class Uptraining:
    """Everything a run needs before any model is loaded, all of it checked."""

    student_folder: Path
    teacher_folder: Path | None
    dims: Any
    family: Any
    source_dtype: str
    max_positions: int | None
    seq_len: int
    eval_seq_len: int
    micro: int  # windows per forward pass
    tokenizer: Any
    store: TokenStore  # the training stream, windows of seq_len + 1 tokens read from disk
    num_windows: int
    eval_windows: list
    total: int
    eval_every: int
    save_every: int
    run: dict[str, Any]  # the settings as resolved (recorded, and compared on resume)


def _sizes(s: UptrainSettings, max_pos: int | None, processes: int) -> tuple[int, int, int]:
    """``(seq_len, eval_seq_len, windows per process and step)``, checked against the model's
    positions and the batch's split over ``--grad-accum`` and the processes."""
    seq_len = s.window(max_pos)
    eval_seq_len = s.eval_seq_len or seq_len
    for name, n in (("seq_len", seq_len), ("eval_seq_len", eval_seq_len)):
        check_window(name, n, max_pos)
    per_step = s.grad_accum * processes
    if s.batch_size % per_step:
        raise SettingError(
            "batch_size", f"{{name}} {s.batch_size} must be a multiple of --grad-accum x processes = {per_step}"
        )
    return seq_len, eval_seq_len, per_step


def prepare(student: str, s: UptrainSettings, processes: int, log) -> Uptraining:
    """Resolve and check the sizes, the tokenizers and the text of a run (raises :class:`Mha2GqaError`)."""
    from mha2gqa.core.checkpoint import read_config, resolve_folder
    from mha2gqa.core.models import load_tokenizer

    student_folder, _, _ = resolve_folder(student)
    config = read_config(student_folder)
    family = _trained_family(config, s.train)
    max_pos = max_positions(config)
    seq_len, eval_seq_len, per_step = _sizes(s, max_pos, processes)
    tokenizer = load_tokenizer(student_folder)
    teacher_folder = _teacher_folder(s, tokenizer, student)
    root = Path(s.data_cache) if s.data_cache else cache_root() / "tokens"
    vocab = config.get("vocab_size") if isinstance(config.get("vocab_size"), int) else len(tokenizer)
    text = TextSource(s.data, s.text_field, s.doc_split)
    store = token_store(root, tokenizer, student_folder, text, log, vocab_size=vocab)
    trainable = store.total - (s.heldout_tokens or 0)  # the held-out tail is never trained on
    available = min(trainable, s.data_tokens or trainable)
    num_windows = max((available - 1) // seq_len, 0)  # windows overlap by one token: none reads past `available`
    if num_windows < 1 and s.heldout_tokens:
        raise Mha2GqaError(
            f"--heldout-tokens {s.heldout_tokens:,} leaves {max(trainable, 0):,} of --data's {store.total:,} tokens, "
            f"too few for one training window of {seq_len}; hold out fewer or give more text"
        )
    if num_windows < 1:
        raise Mha2GqaError(
            f"--data {s.data}: {available} tokens, too little text for one training window of {seq_len} tokens; "
            "give more text or a smaller --seq-len"
        )
    total = _total_steps(s, seq_len, num_windows)
    eval_every = s.eval_every or max(1, total // 10)
    live_teacher = teacher_folder is not None and not s.teacher_top_k
    eval_windows, eval_tokens = _heldout(tokenizer, s, store, (eval_seq_len, total, eval_every), live_teacher, log)
    run = {
        **asdict(s),
        "seq_len": seq_len,
        "max_steps": total,
        "max_tokens": None,
        "eval_seq_len": eval_seq_len,
        "eval_tokens": eval_tokens,
    }
    return Uptraining(
        student_folder,
        teacher_folder,
        _dims(student_folder),
        family,
        config.get("dtype") or config.get("torch_dtype") or "float32",
        max_pos,
        seq_len,
        eval_seq_len,
        s.batch_size // per_step,
        tokenizer,
        store,
        num_windows,
        eval_windows,
        total,
        eval_every,
        s.save_every or eval_every,
        run,
    )


def _teacher_folder(s: UptrainSettings, tokenizer, student: str) -> Path | None:
    """The ``--teacher``'s folder, its tokenizer the student's (None without a teacher)."""
    from mha2gqa.core.checkpoint import resolve_folder
    from mha2gqa.core.models import check_same_tokenizer, load_tokenizer

    if not s.teacher:
        return None
    folder, _, _ = resolve_folder(s.teacher)
    check_same_tokenizer(tokenizer, load_tokenizer(folder), student, s.teacher)
    return folder


def _trained_family(config: dict[str, Any], train: str) -> Any:
    """The family layout ``--train`` (other than ``all``) selects parameters by; None for ``all``."""
    from mha2gqa.core.architecture import resolve

    arch = resolve(config) if train != "all" else None
    if arch is not None and arch.retarget is not None:  # trained in its own class, which has no KV-head setting
        raise Mha2GqaError(
            f"unsupported model family ({arch.name}) for --train {train}: train its conversion (a "
            f"{arch.converts_as}) instead, or use --train all"
        )
    return arch.family if arch is not None else None


def _total_steps(s: UptrainSettings, seq_len: int, num_windows: int) -> int:
    """``--max-steps``, else ``--max-tokens`` in steps, else one epoch; more than the warm-up."""
    tokens_per_step = s.batch_size * seq_len
    total = s.max_steps or (math.ceil(s.max_tokens / tokens_per_step) if s.max_tokens else None)
    total = total or math.ceil(num_windows / s.batch_size)
    if s.warmup_steps >= total:
        raise SettingError("warmup_steps", f"{{name}} {s.warmup_steps} must be fewer than the run's {total} steps")
    return total


def _heldout(
    tokenizer, s: UptrainSettings, store: TokenStore, sizes: tuple[int, int, int], live_teacher: bool, log
) -> tuple[list[torch.Tensor], int | None]:
    """The held-out windows (``[seq_len]`` token ids each) and how many tokens they hold: as many as
    ``--eval-tokens`` asks, else what keeps evaluation near its share of the run (said); none without
    ``--eval-data`` or ``--heldout-tokens`` (then ``store``'s last tokens). ``sizes``: the evaluation
    window, the run's steps and the steps between evaluations."""
    from mha2gqa.eval.perplexity import disjoint_windows

    seq_len, total, every = sizes
    if s.heldout_tokens:
        held = s.heldout_tokens
        ids = torch.from_numpy(store.tokens(store.total - held, min(held, s.eval_tokens or MAX_EVAL_TOKENS)))
        where = f"--heldout-tokens {held:,}"
    elif s.eval_data:
        ids, where = _tokens(tokenizer, "eval_data", s, s.eval_tokens or MAX_EVAL_TOKENS), f"--eval-data {s.eval_data}"
    else:
        return [], s.eval_tokens
    if ids.numel() < seq_len:
        raise Mha2GqaError(
            f"{where}: {ids.numel()} tokens, fewer than one window of {seq_len}; "
            "give more text or a smaller --eval-seq-len"
        )
    budget = eval_budget(
        total, s.batch_size * seq_len, every, seq_len,
        teacher_trains=live_teacher and s.objective != "ce", teacher_scores=live_teacher,
        asked=s.eval_tokens, available=ids.numel(),
    )  # fmt: skip
    if s.eval_tokens is None or budget.share > WARN_SHARE:
        log(budget.line(asked=s.eval_tokens is not None))
    return disjoint_windows(ids[: budget.tokens], seq_len), budget.tokens


def _dims(folder: Path) -> AttentionDims:
    """Head counts through transformers' config class (its attribute maps cover GPT-2's ``n_head``...)."""
    from transformers import AutoConfig

    from mha2gqa.core.architecture import dims_of

    return dims_of(AutoConfig.from_pretrained(folder))


def resume_point(output: Path, resume: bool, run: dict[str, Any]) -> tuple[Path | None, int]:
    """The newest checkpoint in ``output`` and its step when resuming (``None, 0`` otherwise);
    refuses one whose run-defining settings differ from ``run``."""
    found = checkpoint_dirs(output) if resume and output.is_dir() else []
    if not found:
        return None, 0
    step, folder = found[-1]
    saved = read_state(folder)["settings"]
    for k in RUN_FIELDS:
        if saved.get(k) != run.get(k):
            raise Mha2GqaError(
                f"--resume: {k} is {run.get(k)!r} here but {saved.get(k)!r} in the run being resumed ({folder}); "
                "resume with the same settings"
            )
    return folder, step


def check_resume(folder: Path) -> None:
    """A checkpoint to resume from, whole: a full model as any loaded model (its config and weights),
    LoRA adapters by their safetensors headers (a truncated file is found here, not mid-load)."""
    from mha2gqa.core.checkpoint import check_loadable
    from mha2gqa.core.safetensors_io import read_shard_index

    label = f"--resume: the checkpoint {folder}:"
    if (folder / "config.json").is_file():
        check_loadable(label, str(folder))
        return
    try:
        read_shard_index(sorted(folder.glob("*.safetensors")))
    except Mha2GqaError as e:
        raise Mha2GqaError(f"{label} {e}") from None
