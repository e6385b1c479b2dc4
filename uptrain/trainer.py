"""The uptraining loop: a converted GQA model trained on text by cross-entropy, distillation from
its MHA parent, or both, with ``accelerate`` for devices, processes and mixed precision.

``--batch-size`` is the *global* batch of one optimizer step (sequences); it is split over
``accelerate`` processes and ``--grad-accum`` micro-batches, so one command gives the same run on
one device or many. Which windows a step reads depends only on ``(seed, step)``, and checkpoints
hold the optimizer, scheduler and RNG state, so a resumed run continues the same trajectory.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from mha2gqa.errors import Mha2GqaError
from mha2gqa.eval.models import DTYPES
from mha2gqa.uptrain.checkpoints import (
    CONVERSION_RECORD,
    LOG_NAME,
    RECORD_NAME,
    check_output,
    checkpoint_dirs,
    conversion_record,
    prepare_output,
    read_state,
    save_checkpoint,
    save_final,
    skip_model_weights,
    uptrain_card,
)
from mha2gqa.uptrain.data import WindowOrder, pack_windows
from mha2gqa.uptrain.objectives import combined
from mha2gqa.uptrain.params import TRAINABLE, adapters, apply_lora, lora_targets, param_groups, select_trainable

OBJECTIVES = ("ce", "kd", "mix")
MIXED_PRECISION = ("auto", "no", "bf16")

#: settings that define the trajectory: a resumed run must use the same ones
RUN_FIELDS = ("data", "text_field", "doc_split", "objective", "teacher", "kd_weight", "temperature", "train",
              "lora_rank", "lora_alpha", "lora_dropout", "max_steps", "max_tokens", "batch_size", "grad_accum",
              "seq_len", "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "adam_beta2", "max_grad_norm",
              "seed")  # fmt: skip


@dataclass
class UptrainSettings:
    """Every knob of an uptraining run (recorded verbatim in the log, checkpoints and output)."""

    data: str
    output: str
    objective: str = "ce"  # ce | kd | mix
    teacher: str | None = None  # the MHA parent: kd/mix target, and KL in evaluations
    kd_weight: float = 0.5  # mix: (1 - w) * ce + w * kd
    temperature: float = 1.0
    train: str = "all"  # all | attention | kv
    lora_rank: int = 0  # > 0: LoRA adapters (peft) on what --train names, merged into the final model
    lora_alpha: float | None = None  # default: 2 * rank
    lora_dropout: float = 0.0
    max_steps: int | None = None  # default: --max-tokens, else one epoch
    max_tokens: int | None = None
    batch_size: int = 8  # sequences per optimizer step, over all processes and micro-batches
    grad_accum: int = 1
    seq_len: int | None = None  # default: min(1024, the model's positions)
    lr: float = 1e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * this
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta2: float = 0.999
    max_grad_norm: float = 1.0  # 0: no clipping
    seed: int = 0
    text_field: str = "text"
    doc_split: str = "file"
    eval_data: str | None = None
    eval_every: int | None = None  # default: a tenth of the run
    eval_tokens: int | None = 65536
    eval_seq_len: int | None = None  # default: --seq-len
    eval_batch_size: int | None = None  # default: the training micro-batch
    save_every: int | None = None  # default: as eval_every (and always at the end)
    save_total_limit: int = 2
    log_every: int = 10
    stop_after: int | None = None  # stop after this many steps (checkpointed); continue with resume
    resume: bool = False
    overwrite: bool = False
    device: str = "auto"
    mixed_precision: str = "auto"  # bf16 autocast on GPUs that support it
    gradient_checkpointing: bool = False
    progress: bool = True


@dataclass
class UptrainResult:
    """What :func:`uptrain` did."""

    output: Path
    steps: int
    total_steps: int
    tokens: int
    complete: bool
    evals: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        state = "done" if self.complete else f"stopped at step {self.steps} of {self.total_steps} (--resume continues)"
        line = f"uptrain {state}: {self.steps:,} steps, {self.tokens:,} tokens in {self.seconds:.1f} s -> {self.output}"
        if self.evals:
            first, last = self.evals[0], self.evals[-1]
            line += f"; held-out perplexity {first['ppl']:.4f} (step {first['step']}) -> {last['ppl']:.4f}"
            if "ppl_ratio" in last:
                line += f" (x{last['ppl_ratio']:.3f} the teacher, KL {last['kl_mean']:.4f})"
        return line


def _check(s: UptrainSettings) -> None:
    if s.objective not in OBJECTIVES:
        raise Mha2GqaError(f"--objective {s.objective}: choose {', '.join(OBJECTIVES)}")
    if s.objective in ("kd", "mix") and not s.teacher:
        raise Mha2GqaError(f"--objective {s.objective} distils from a teacher: pass --teacher ORIGINAL_MODEL")
    if s.train not in TRAINABLE:
        raise Mha2GqaError(f"--train {s.train}: choose {', '.join(TRAINABLE)}")
    if s.mixed_precision not in MIXED_PRECISION:
        raise Mha2GqaError(f"--mixed-precision {s.mixed_precision}: choose {', '.join(MIXED_PRECISION)}")
    positive = {"--batch-size": s.batch_size, "--grad-accum": s.grad_accum, "--log-every": s.log_every,
                "--eval-batch-size": s.eval_batch_size, "--max-steps": s.max_steps, "--max-tokens": s.max_tokens,
                "--eval-every": s.eval_every, "--save-every": s.save_every, "--stop-after": s.stop_after,
                "--eval-tokens": s.eval_tokens}  # fmt: skip
    for flag, value in positive.items():
        if value is not None and value < 1:
            raise Mha2GqaError(f"{flag} must be at least 1 (got {value})")
    if s.max_steps and s.max_tokens:
        raise Mha2GqaError("give --max-steps or --max-tokens, not both")
    if not (s.lr > 0 and math.isfinite(s.lr)):
        raise Mha2GqaError(f"--lr must be a positive number (got {s.lr})")
    if s.lora_rank < 0 or not 0 <= s.lora_dropout < 1:
        raise Mha2GqaError("--lora-rank must be >= 0 and --lora-dropout in [0, 1)")
    if not 0 <= s.kd_weight <= 1:
        raise Mha2GqaError(f"--kd-weight must be between 0 and 1 (got {s.kd_weight})")
    if not s.temperature > 0:
        raise Mha2GqaError(f"--temperature must be positive (got {s.temperature})")
    if not 0 <= s.min_lr_ratio <= 1:
        raise Mha2GqaError(f"--min-lr-ratio must be between 0 and 1 (got {s.min_lr_ratio})")
    if s.warmup_steps < 0 or s.weight_decay < 0 or s.max_grad_norm < 0 or not 0 <= s.adam_beta2 < 1:
        raise Mha2GqaError("--warmup-steps, --weight-decay and --max-grad-norm must be >= 0, --adam-beta2 in [0, 1)")


def _accelerator(s: UptrainSettings):
    from accelerate import Accelerator

    from mha2gqa.eval.models import resolve_device

    cpu = resolve_device(s.device).type == "cpu"
    mp = s.mixed_precision
    if mp == "auto":
        mp = "bf16" if not cpu and torch.cuda.is_bf16_supported() else "no"
    return Accelerator(cpu=cpu, mixed_precision=mp, step_scheduler_with_optimizer=False)


def _tokens(tokenizer, source: str, s: UptrainSettings, max_tokens: int | None) -> torch.Tensor:
    from mha2gqa.eval.data import load_text, token_stream

    return token_stream(tokenizer, load_text(source, s.text_field, s.doc_split), max_tokens)


class _Log:
    """The JSON-lines log (main process only); resumed runs drop records after their checkpoint."""

    def __init__(self, path: Path, main: bool, keep_until_step: int | None):
        self.path, self.main = path, main
        if main and keep_until_step is not None and path.is_file():
            kept = [line for line in path.read_text(encoding="utf-8").splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= keep_until_step]  # fmt: skip
            path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        elif main:
            path.unlink(missing_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        if self.main:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")


def read_log(path: Path) -> list[dict[str, Any]]:
    """The records of an ``uptrain_log.jsonl`` (or of the one in an output folder)."""
    path = Path(path)
    if path.is_dir():
        path = path / LOG_NAME
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise Mha2GqaError(f"{path}: cannot read the uptraining log ({e})") from None


@dataclass
class _Plan:
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
    windows: torch.Tensor  # [W, seq_len + 1]
    eval_windows: list
    total: int
    eval_every: int
    save_every: int
    run: dict[str, Any]  # the settings as resolved (recorded, and compared on resume)


def _plan(student: str, s: UptrainSettings, processes: int) -> _Plan:
    """Resolve and check the sizes, the tokenizers and the text of a run (raises :class:`Mha2GqaError`)."""
    from mha2gqa.convert.checkpoint import read_config, resolve_folder
    from mha2gqa.convert.families import detect_family
    from mha2gqa.eval.models import check_same_tokenizer, load_tokenizer
    from mha2gqa.eval.perplexity import disjoint_windows

    student_folder, _, _ = resolve_folder(student)
    config = read_config(student_folder)
    family = detect_family(config) if s.train != "all" else None
    max_pos = config.get("max_position_embeddings")
    seq_len = s.seq_len or min(1024, max_pos or 1024)
    eval_seq_len = s.eval_seq_len or seq_len
    for flag, n in (("--seq-len", seq_len), ("--eval-seq-len", eval_seq_len)):
        if max_pos and n > max_pos:
            raise Mha2GqaError(f"{flag} {n} is longer than the model's {max_pos} positions")
    per_step = s.grad_accum * processes
    if s.batch_size % per_step:
        raise Mha2GqaError(f"--batch-size {s.batch_size} must be a multiple of --grad-accum x processes = {per_step}")

    tokenizer = load_tokenizer(student_folder)
    teacher_folder = None
    if s.teacher:
        teacher_folder, _, _ = resolve_folder(s.teacher)
        check_same_tokenizer(tokenizer, load_tokenizer(teacher_folder), student, s.teacher)
    windows = pack_windows(_tokens(tokenizer, s.data, s, None), seq_len, f"--data {s.data}")
    eval_windows = []
    if s.eval_data:
        ids = _tokens(tokenizer, s.eval_data, s, s.eval_tokens)
        if ids.numel() < eval_seq_len:
            raise Mha2GqaError(
                f"--eval-data {s.eval_data}: {ids.numel()} tokens, fewer than one window of {eval_seq_len}; "
                "give more text or a smaller --eval-seq-len"
            )
        eval_windows = disjoint_windows(ids, eval_seq_len)
    tokens_per_step = s.batch_size * seq_len
    total = s.max_steps or (math.ceil(s.max_tokens / tokens_per_step) if s.max_tokens else None)
    total = total or math.ceil(len(windows) / s.batch_size)
    if s.warmup_steps >= total:
        raise Mha2GqaError(f"--warmup-steps {s.warmup_steps} must be fewer than the run's {total} steps")
    eval_every = s.eval_every or max(1, total // 10)
    run = {**asdict(s), "seq_len": seq_len, "max_steps": total, "max_tokens": None, "eval_seq_len": eval_seq_len}
    return _Plan(student_folder, teacher_folder, _dims(student_folder), family,
                 config.get("dtype") or config.get("torch_dtype") or "float32", max_pos, seq_len, eval_seq_len,
                 s.batch_size // per_step, tokenizer, windows, eval_windows, total, eval_every,
                 s.save_every or eval_every, run)  # fmt: skip


def _models(plan: _Plan, s: UptrainSettings, acc, resume_from: Path | None):
    """The student in float32 (from the checkpoint being resumed, or with its LoRA adapters), what
    trains, and the frozen teacher on the device."""
    from mha2gqa.eval.models import load_model

    lora = s.lora_rank > 0
    folder = resume_from if resume_from and not lora else plan.student_folder
    model = load_model(str(folder), torch.device("cpu"), torch.float32).model  # accelerate places it
    if s.gradient_checkpointing:
        _enable_checkpointing(model)
    trainable = select_trainable(model, plan.family, plan.dims, s.train)
    if lora:
        model = _with_lora(model, plan.family, plan.dims, s, resume_from)
        trainable = adapters(model)
    teacher = None
    if plan.teacher_folder is not None:
        teacher_dtype = torch.bfloat16 if acc.mixed_precision == "bf16" else torch.float32
        teacher = load_model(str(plan.teacher_folder), acc.device, teacher_dtype).model.requires_grad_(False)
        vs, vt = model.get_output_embeddings().weight.shape[0], teacher.get_output_embeddings().weight.shape[0]
        if vs != vt:
            raise Mha2GqaError(f"--teacher {s.teacher}: its output vocabulary ({vt}) differs from the student's ({vs})")
    return model, trainable, teacher


def uptrain(student: str, settings: UptrainSettings, log=print) -> UptrainResult:
    """Uptrain the model at ``student`` (folder or hub id) as ``settings`` say; see the module doc."""
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    started = time.perf_counter()
    s = settings
    _check(s)
    acc = _accelerator(s)
    main = acc.is_main_process
    say = log if main else (lambda *_: None)
    output = Path(s.output)
    plan = _plan(student, s, acc.num_processes)
    run, total, seq_len, micro = plan.run, plan.total, plan.seq_len, plan.micro
    windows, tokenizer, tokens_per_step = plan.windows, plan.tokenizer, s.batch_size * plan.seq_len
    student_folder, teacher_folder = plan.student_folder, plan.teacher_folder

    check_output(output, s.resume, s.overwrite, [student_folder] + ([teacher_folder] if teacher_folder else []))
    resume_from, start_step = _resume_point(output, s.resume, run)
    if resume_from is not None:
        say(f"resuming from {resume_from} (step {start_step:,})")
    elif s.resume:
        say(f"--resume: no checkpoint in {output}; starting from step 0")

    set_seed(s.seed)
    model, trainable, teacher = _models(plan, s, acc, resume_from)
    conv_record = conversion_record(student_folder)

    if main:  # everything is checked: now the output folder may be written
        prepare_output(output, s.resume, s.overwrite)
    acc.wait_for_everyone()

    optimizer = torch.optim.AdamW(param_groups(trainable, s.weight_decay), lr=s.lr, betas=(0.9, s.adam_beta2))
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(optimizer, s.warmup_steps, total,
                                                            min_lr_rate=s.min_lr_ratio)  # fmt: skip
    model.train()
    model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
    skip_model_weights(acc)
    if resume_from is not None:
        acc.load_state(str(resume_from))

    order = WindowOrder(len(windows), s.batch_size, s.seed)
    logf = _Log(output / LOG_NAME, main, start_step if resume_from is not None else None)
    if start_step == 0:
        logf.write({"type": "start", "created": _now(), "student": student, "teacher": s.teacher,
                    "settings": run, "windows": len(windows), "tokens_per_step": tokens_per_step,
                    "total_steps": total, "trainable_parameters": trainable.count,
                    "parameters": sum(p.numel() for p in model.parameters()), "num_heads": plan.dims.num_heads,
                    "num_kv_heads": plan.dims.num_kv_heads, "processes": acc.num_processes, "device": str(acc.device),
                    "mixed_precision": acc.mixed_precision, "eval_seq_len": plan.eval_seq_len})  # fmt: skip
    else:
        logf.write({"type": "resume", "step": start_step, "created": _now(), "from": str(resume_from)})
    say(f"uptrain: {trainable.count:,} of {sum(p.numel() for p in model.parameters()):,} parameters ({s.train}), "
        f"objective {s.objective}, {len(windows):,} windows of {seq_len}, {total:,} steps x {s.batch_size} on "
        f"{acc.num_processes} x {acc.device} ({acc.mixed_precision})")  # fmt: skip
    if plan.max_positions and seq_len < plan.max_positions:
        say(f"note: training windows of {seq_len} tokens do not reach positions {seq_len}-{plan.max_positions - 1}; "
            "evaluate at the model's full length (--eval-seq-len) to see them")  # fmt: skip

    # every evaluation of the run so far (a resumed run's earlier ones come from its log)
    evals = [r for r in read_log(output / LOG_NAME) if r.get("type") == "eval"] if start_step and main else []

    def evaluate(step: int) -> None:
        if not plan.eval_windows:
            return
        record = _evaluate(acc, model, teacher, plan.eval_windows, s.eval_batch_size or micro)
        record.update({"type": "eval", "step": step, "tokens": step * tokens_per_step, "seq_len": plan.eval_seq_len})
        evals.append(record)
        logf.write(record)

    def model_files(step: int) -> dict[str, str]:
        """Model card, uptraining record and conversion record of the model at ``step``."""
        record = {"uptrain": {"student": student, "settings": run, "steps": step, "tokens": step * tokens_per_step,
                              "warmup_steps": s.warmup_steps, "trainable_parameters": trainable.count,
                              "first_eval": evals[0] if evals else None, "last_eval": evals[-1] if evals else None,
                              "processes": acc.num_processes, "mixed_precision": acc.mixed_precision},
                  "mha2gqa_version": _version(), "created": _now()}  # fmt: skip
        files = {RECORD_NAME: json.dumps(record, indent=2) + "\n", "README.md": uptrain_card(record, conv_record)}
        if conv_record:
            files[CONVERSION_RECORD] = json.dumps(conv_record, indent=2) + "\n"
        return files

    def checkpoint(step: int) -> None:
        state = {"step": step, "tokens": step * tokens_per_step, "settings": run, "student": student,
                 "source_dtype": plan.source_dtype, "created": _now()}  # fmt: skip
        save_checkpoint(acc, model, tokenizer, output, step, state, model_files(step), s.save_total_limit)

    if start_step == 0:
        evaluate(0)
    stop = min(total, start_step + s.stop_after) if s.stop_after else total
    bar = tqdm(total=total, initial=start_step, unit="step", desc="uptrain", disable=not (s.progress and main))
    device = acc.device
    train_seconds = 0.0  # forward/backward/step time since the last train record (evals excluded)
    sums: dict[str, float] = {}
    count = 0
    step = start_step
    for step in range(start_step + 1, stop + 1):
        t0 = time.perf_counter()
        batch = order.batch(step - 1)
        mine = batch[acc.process_index * micro * s.grad_accum : (acc.process_index + 1) * micro * s.grad_accum]
        loss_sum, parts_sum = _accumulate(acc, model, teacher, windows, mine.split(micro), s)
        grad_norm = acc.clip_grad_norm_(trainable.params, s.max_grad_norm) if s.max_grad_norm > 0 else None
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        stats = torch.tensor([loss_sum, *parts_sum.values()], device=device)
        stats = acc.reduce(stats, "mean") if acc.num_processes > 1 else stats
        sums["loss"] = sums.get("loss", 0.0) + float(stats[0])
        for i, name in enumerate(parts_sum):
            sums[name] = sums.get(name, 0.0) + float(stats[i + 1])
        count += 1
        train_seconds += time.perf_counter() - t0
        bar.update(1)
        if step % s.log_every == 0 or step == stop:
            rec = {"type": "train", "step": step, "tokens": step * tokens_per_step,
                   "epoch": round(order.epoch(step), 4), **{k: v / count for k, v in sums.items()},
                   "lr": scheduler.get_last_lr()[0],
                   "grad_norm": float(grad_norm) if grad_norm is not None else None,
                   "tokens_per_second": count * tokens_per_step / max(train_seconds, 1e-9)}  # fmt: skip
            logf.write(rec)
            bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens_per_second']:,.0f}")
            sums, count, train_seconds = {}, 0, 0.0
        if step % plan.eval_every == 0 or step == total:
            evaluate(step)
        if step % plan.save_every == 0 or step == stop:
            checkpoint(step)
    bar.close()
    complete = step >= total
    result = UptrainResult(output, step, total, step * tokens_per_step, complete, evals,
                           time.perf_counter() - started)  # fmt: skip
    if complete:
        save_final(acc, model, tokenizer, output, DTYPES.get(plan.source_dtype), model_files(step))
        logf.write({"type": "end", "step": step, "tokens": step * tokens_per_step, "created": _now(),
                    "seconds": result.seconds})  # fmt: skip
    return result


def _enable_checkpointing(model) -> None:
    """Activation (gradient) checkpointing through transformers, non-reentrant."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _resume_point(output: Path, resume: bool, run: dict[str, Any]) -> tuple[Path | None, int]:
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


def _accumulate(acc, model, teacher, windows: torch.Tensor, micro_batches, s: UptrainSettings):
    """Forward and backward over this process's micro-batches of one step (``[micro, seq_len + 1]``
    window indices each), gradients synchronised on the last only. Returns the mean loss and parts."""
    loss_sum, parts_sum = 0.0, {}
    n = len(micro_batches)
    for k, idx in enumerate(micro_batches):
        chunk = windows[idx].to(acc.device)
        inputs, targets = chunk[:, :-1], chunk[:, 1:]
        sync = contextlib.nullcontext() if k == n - 1 else acc.no_sync(model)
        with sync, acc.autocast():
            logits = model(input_ids=inputs, use_cache=False).logits
            teacher_logits = None
            if s.objective != "ce":
                with torch.no_grad():
                    teacher_logits = teacher(input_ids=inputs, use_cache=False).logits
            loss, parts = combined(s.objective, logits, targets, teacher_logits, s.kd_weight, s.temperature)
            acc.backward(loss / n)
        loss_sum += float(loss.detach()) / n
        for name, v in parts.items():
            parts_sum[name] = parts_sum.get(name, 0.0) + v / n
    return loss_sum, parts_sum


@torch.no_grad()
def _evaluate(acc, model, teacher, windows, batch_size: int) -> dict[str, Any]:
    """Held-out perplexity of the student (and the teacher's, with KL and top-1 agreement to it),
    windows split over processes; the harness's scoring pass."""
    from mha2gqa.eval.harness import scored_pass

    model.eval()
    try:
        with acc.autocast():
            models = [teacher, model] if teacher is not None else [model]
            res = scored_pass(models, windows, batch_size, progress=False, desc="eval")
    finally:
        model.train()
    i = len(models) - 1
    out: dict[str, Any] = {"nll": res["nll_sum"][i] / res["tokens"], "eval_tokens": res["tokens"]}
    out["ppl"] = math.exp(out["nll"])
    if teacher is not None:
        out["teacher_ppl"] = math.exp(res["nll_sum"][0] / res["tokens"])
        out["ppl_ratio"] = out["ppl"] / out["teacher_ppl"]
        out["kl_mean"] = res["agreement"]["kl"]["mean"]
        out["top1_agreement"] = res["agreement"]["top1_agreement"]
    return out


def _with_lora(model, family, dims, s: UptrainSettings, resume_from: Path | None):
    """The student with fresh LoRA adapters, or with those of the checkpoint being resumed."""
    if resume_from is None:
        return apply_lora(model, lora_targets(family, dims, s.train), s.lora_rank, s.lora_alpha or 2 * s.lora_rank,
                          s.lora_dropout)  # fmt: skip
    from peft import PeftModel

    return PeftModel.from_pretrained(model, resume_from, is_trainable=True)


def _dims(folder: Path):
    """Head counts through transformers' config class (its attribute maps cover GPT-2's ``n_head``...)."""
    from transformers import AutoConfig

    from mha2gqa.convert.families import AttentionDims

    cfg = AutoConfig.from_pretrained(folder)
    keys = ("num_hidden_layers", "num_attention_heads", "hidden_size", "num_key_value_heads", "head_dim")
    return AttentionDims.from_config({k: getattr(cfg, k, None) for k in keys})


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _version() -> str:
    from mha2gqa import __version__

    return __version__
