"""The uptraining loop: a converted GQA model trained on text by cross-entropy, distillation from
its MHA parent, or both, with ``accelerate`` for devices, processes and mixed precision.

``--batch-size`` is the *global* batch of one optimizer step (sequences); it is split over
``accelerate`` processes and ``--grad-accum`` micro-batches, so one command gives the same run on
one device or many. Which windows a step reads depends only on ``(seed, step)``, and checkpoints
hold the optimizer, scheduler and RNG state, so a resumed run continues the same trajectory.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from mha2gqa.core.cache import cache_root
from mha2gqa.core.conversion_record import read_conversion_record
from mha2gqa.core.dims import AttentionDims
from mha2gqa.core.dtypes import by_name
from mha2gqa.core.errors import Mha2GqaError, SettingError
from mha2gqa.core.models import resolve_device
from mha2gqa.core.per_layer import MODELING_FILE
from mha2gqa.core.records import CONVERSION_RECORD, UPTRAIN_LOG, UPTRAIN_RECORD, now
from mha2gqa.core.runlog import RunEnd, RunEval, RunLog, RunResume, RunStart, RunTrain, read_log
from mha2gqa.core.signals import check as check_signals
from mha2gqa.uptrain.checkpoints import (
    check_output,
    checkpoint_dirs,
    prepare_output,
    read_state,
    save_checkpoint,
    save_final,
    skip_model_weights,
)
from mha2gqa.uptrain.data import WindowOrder
from mha2gqa.uptrain.eval_budget import MAX_EVAL_TOKENS, WARN_SHARE, eval_budget
from mha2gqa.uptrain.objectives import combined
from mha2gqa.uptrain.params import adapters, apply_lora, lora_targets, param_groups, select_trainable
from mha2gqa.uptrain.record import UptrainRecord
from mha2gqa.uptrain.settings import RUN_FIELDS, UptrainSettings
from mha2gqa.uptrain.sharding import load_optimizer, save_optimizer, shard, zero_rows
from mha2gqa.uptrain.teacher_cache import (
    CachedTeacher,
    TeacherCache,
    chunk_steps,
    fill,
    producer_lock,
    producer_running,
)
from mha2gqa.uptrain.teacher_cache import key_material as teacher_key_material
from mha2gqa.uptrain.tokens import TokenStore, token_store


@dataclass
class UptrainResult:
    """What :func:`uptrain` did."""

    output: Path
    steps: int
    total_steps: int
    tokens: int
    complete: bool
    evals: list[RunEval] = field(default_factory=list)
    seconds: float = 0.0
    teacher_cache: Path | None = None  # set when the run was only the teacher pass (--teacher-only)
    processes: int = 1
    sharded: bool = False  # --sharding fsdp: parameters, gradients and optimizer state sharded over the processes

    def summary(self) -> str:
        if self.teacher_cache is not None:
            return f"teacher pass done in {self.seconds:.1f} s: {self.teacher_cache} (train with the same settings)"
        state = "done" if self.complete else f"stopped at step {self.steps} of {self.total_steps} (--resume continues)"
        how = f" on {self.processes} processes" if self.processes > 1 else ""
        how += (" (FSDP: sharded)" if self.processes > 1 else " (FSDP)") if self.sharded else ""
        line = (
            f"uptrain {state}: {self.steps:,} steps, {self.tokens:,} tokens{how} in {self.seconds:.1f} s -> "
            f"{self.output}"
        )
        if self.evals:
            first, last = self.evals[0], self.evals[-1]
            line += f"; held-out perplexity {first.ppl:.4f} (step {first.step}) -> {last.ppl:.4f}"
            if last.ppl_ratio is not None:
                line += f" (x{last.ppl_ratio:.3f} the teacher, KL {last.kl_mean:.4f})"
        return line


def _accelerator(s: UptrainSettings):
    from accelerate import Accelerator

    cpu = resolve_device(s.device).type == "cpu"
    mp = s.mixed_precision
    if mp == "auto":
        mp = "bf16" if not cpu and torch.cuda.is_bf16_supported() else "no"
    _forget_earlier_accelerator()
    return Accelerator(cpu=cpu, mixed_precision=mp, step_scheduler_with_optimizer=False)


def _forget_earlier_accelerator() -> None:
    """Let this run choose its own device and precision.

    Accelerate keeps its state process-wide: a second run in one process (a job's next stage, a library
    user's loop) with another precision is refused, and one asking for another device silently gets the
    first's. A single process forgets both; under a distributed launch the processes (and their devices)
    are the launcher's and stay, and only the precision state is forgotten.
    """
    from accelerate.state import AcceleratorState, DistributedType, PartialState

    single = bool(PartialState._shared_state) and PartialState().distributed_type == DistributedType.NO
    AcceleratorState._reset_state(reset_partial_state=single)


def _tokens(tokenizer, setting: str, s: UptrainSettings, max_tokens: int | None) -> torch.Tensor:
    """The token stream of the text in setting ``setting`` (``data`` or ``eval_data``)."""
    from mha2gqa.core.text import load_text, token_stream

    return token_stream(tokenizer, load_text(getattr(s, setting), s.text_field, s.doc_split, setting), max_tokens)


@dataclass
class _Resolved:
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


def _resolve(student: str, s: UptrainSettings, processes: int, log) -> _Resolved:
    """Resolve and check the sizes, the tokenizers and the text of a run (raises :class:`Mha2GqaError`)."""
    from mha2gqa.core.architecture import resolve
    from mha2gqa.core.checkpoint import read_config, resolve_folder
    from mha2gqa.core.models import check_same_tokenizer, load_tokenizer
    from mha2gqa.eval.perplexity import disjoint_windows

    student_folder, _, _ = resolve_folder(student)
    config = read_config(student_folder)
    arch = resolve(config) if s.train != "all" else None
    if arch is not None and arch.retarget is not None:  # trained in its own class, which has no KV-head setting
        raise Mha2GqaError(
            f"unsupported model family ({arch.name}) for --train {s.train}: train its conversion (a "
            f"{arch.converts_as}) instead, or use --train all"
        )
    family = arch.family if arch is not None else None
    max_pos = config.get("max_position_embeddings")
    seq_len = s.window(max_pos)
    eval_seq_len = s.eval_seq_len or seq_len
    for flag, n in (("--seq-len", seq_len), ("--eval-seq-len", eval_seq_len)):
        if max_pos and n > max_pos:
            raise Mha2GqaError(f"{flag} {n} is longer than the model's {max_pos} positions")
    per_step = s.grad_accum * processes
    if s.batch_size % per_step:
        raise SettingError(
            "batch_size", f"{{name}} {s.batch_size} must be a multiple of --grad-accum x processes = {per_step}"
        )

    tokenizer = load_tokenizer(student_folder)
    teacher_folder = None
    if s.teacher:
        teacher_folder, _, _ = resolve_folder(s.teacher)
        check_same_tokenizer(tokenizer, load_tokenizer(teacher_folder), student, s.teacher)
    root = Path(s.data_cache) if s.data_cache else cache_root() / "tokens"
    store = token_store(root, tokenizer, student_folder, s.data, s.text_field, s.doc_split, log)
    num_windows = store.num_windows(seq_len)
    if num_windows < 1:
        raise Mha2GqaError(
            f"--data {s.data}: {store.total} tokens, too little text for one training window of {seq_len} tokens; "
            "give more text or a smaller --seq-len"
        )
    tokens_per_step = s.batch_size * seq_len
    total = s.max_steps or (math.ceil(s.max_tokens / tokens_per_step) if s.max_tokens else None)
    total = total or math.ceil(num_windows / s.batch_size)
    if s.warmup_steps >= total:
        raise SettingError("warmup_steps", f"{{name}} {s.warmup_steps} must be fewer than the run's {total} steps")
    eval_every = s.eval_every or max(1, total // 10)
    eval_windows, eval_tokens = [], s.eval_tokens
    if s.eval_data:
        ids = _tokens(tokenizer, "eval_data", s, s.eval_tokens or MAX_EVAL_TOKENS)
        if ids.numel() < eval_seq_len:
            raise Mha2GqaError(
                f"--eval-data {s.eval_data}: {ids.numel()} tokens, fewer than one window of {eval_seq_len}; "
                "give more text or a smaller --eval-seq-len"
            )
        live_teacher = teacher_folder is not None and not s.teacher_top_k
        budget = eval_budget(
            total, tokens_per_step, eval_every, eval_seq_len,
            teacher_trains=live_teacher and s.objective != "ce", teacher_scores=live_teacher,
            asked=s.eval_tokens, available=ids.numel(),
        )  # fmt: skip
        if s.eval_tokens is None or budget.share > WARN_SHARE:
            log(budget.line(asked=s.eval_tokens is not None))
        eval_tokens = budget.tokens
        eval_windows = disjoint_windows(ids[:eval_tokens], eval_seq_len)
    run = {
        **asdict(s),
        "seq_len": seq_len,
        "max_steps": total,
        "max_tokens": None,
        "eval_seq_len": eval_seq_len,
        "eval_tokens": eval_tokens,
    }
    return _Resolved(
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


def _models(plan: _Resolved, s: UptrainSettings, acc, resume_from: Path | None):
    """The student in float32 (from the checkpoint being resumed, or with its LoRA adapters), what
    trains, and the frozen teacher on the device."""
    from mha2gqa.core.models import load_model

    lora = s.lora_rank > 0
    folder = resume_from if resume_from and not lora else plan.student_folder
    model = load_model(str(folder), torch.device("cpu"), torch.float32).model  # accelerate places it
    if s.gradient_checkpointing:
        _enable_checkpointing(model)
    trainable = select_trainable(model, plan.family, plan.dims, s.train)
    if lora:
        model = _with_lora(model, plan.family, plan.dims, s, resume_from)
        trainable = adapters(model)
    if s.sharded:
        shard(model, acc.device, acc.mixed_precision, s.cpu_offload)
        trainable = trainable.rebind(model)
    teacher = None
    if plan.teacher_folder is not None and not s.teacher_top_k:
        teacher = _load_teacher(plan, s, acc)
        check_vocabulary(_vocabulary(model), _vocabulary(teacher), s.teacher)
    return model, trainable, teacher


def _teacher_dtype(acc) -> torch.dtype:
    """Distillation's teacher runs in bfloat16 under bf16 mixed precision, else in float32."""
    return torch.bfloat16 if acc.mixed_precision == "bf16" else torch.float32


def _load_teacher(plan: _Resolved, s: UptrainSettings, acc) -> torch.nn.Module:
    """The frozen teacher in :func:`_teacher_dtype`, on this process's device, or sharded like the
    student under ``--sharding fsdp``."""
    from mha2gqa.core.models import load_model

    device = torch.device("cpu") if s.sharded else acc.device
    teacher = load_model(str(plan.teacher_folder), device, _teacher_dtype(acc)).model.requires_grad_(False)
    if s.sharded:
        shard(teacher, acc.device, "no", s.cpu_offload)
    return teacher


def _rank_rows(s: UptrainSettings, acc) -> slice:
    """This process's rows of every step's global batch (``--batch-size`` split over processes)."""
    per = s.batch_size // acc.num_processes
    return slice(acc.process_index * per, (acc.process_index + 1) * per)


def check_vocabulary(student: int, teacher: int, name: str) -> None:
    """Distillation compares distributions over one vocabulary: the output sizes must match."""
    if student != teacher:
        raise Mha2GqaError(
            f"--teacher {name}: its output vocabulary ({teacher}) differs from the student's ({student})"
        )


def _vocabulary(model) -> int:
    return model.get_output_embeddings().weight.shape[0]


def _cached_teacher(plan: _Resolved, s: UptrainSettings, acc, order: WindowOrder, say) -> CachedTeacher:
    """The teacher-cache entry of this run, its missing chunks filled first by a teacher pass here
    (the teacher alone in memory, then freed) unless another process is filling it: then training
    reads each chunk as that pass publishes it."""
    import gc

    from accelerate.utils import broadcast_object_list

    from mha2gqa.core.cache import model_identity
    from mha2gqa.core.memory import trim

    teacher_dtype = str(_teacher_dtype(acc)).removeprefix("torch.")
    steps = chunk_steps(s.batch_size, plan.seq_len)
    vocab = _config_vocabulary(plan.teacher_folder)
    check_vocabulary(_config_vocabulary(plan.student_folder), vocab, s.teacher)
    settings = {"top_k": min(s.teacher_top_k, vocab), "vocab_size": vocab, "temperature": s.temperature,
                "seq_len": plan.seq_len, "batch_size": s.batch_size, "seed": s.seed, "windows": plan.num_windows,
                "dtype": teacher_dtype, "chunk_steps": steps}  # fmt: skip
    material = teacher_key_material(plan.store.folder.name, model_identity(s.teacher, plan.teacher_folder), settings)
    root = Path(s.teacher_cache) if s.teacher_cache else cache_root() / "teacher"
    cache = TeacherCache.create(root, material, settings) if acc.is_main_process else None
    acc.wait_for_everyone()
    cache = cache or TeacherCache.create(root, material, settings)
    release = producer_lock(cache) if acc.is_main_process else None
    decision = [release is not None and bool(cache.missing(plan.total))]
    broadcast_object_list(decision)
    try:
        if decision[0]:
            missing = cache.missing(plan.total)
            say(f"teacher pass: {len(missing):,} chunks of {steps} steps into {cache.folder} (top {settings['top_k']})")
            teacher = _load_teacher(plan, s, acc)
            rows = _rank_rows(s, acc)

            def batch_rows(step: int) -> torch.Tensor:
                return plan.store.windows(order.batch(step)[rows], plan.seq_len)

            fill(cache, teacher, missing, plan.total, batch_rows, acc.process_index, acc.num_processes, plan.micro, say)
            del teacher
            gc.collect()
            trim()
        elif cache.missing(plan.total):
            say(f"teacher cache {cache.folder}: another process is filling it; training reads each chunk as it lands")
    finally:
        if release is not None:
            release()
    acc.wait_for_everyone()
    return CachedTeacher(cache, plan.total, lambda: producer_running(cache))


def _config_vocabulary(folder: Path) -> int:
    """The output vocabulary a checkpoint's config declares."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    return int(getattr(config.get_text_config(), "vocab_size", 0) or 0)


class _Trainer:
    """One run's state and its named stages: log records, evaluations, checkpoints, the step loop."""

    def __init__(self, student: str, s: UptrainSettings, log) -> None:
        from transformers import get_cosine_with_min_lr_schedule_with_warmup

        self.student, self.s, self.started = student, s, time.perf_counter()
        self.acc = acc = _accelerator(s)
        self.main = acc.is_main_process
        self.say = log if self.main else (lambda *_: None)
        self.output = Path(s.output)
        self.plan = plan = _resolve(student, s, acc.num_processes, self.say)
        self.tokens_per_step = s.batch_size * plan.seq_len
        inputs = {
            "the student model": plan.student_folder,
            "the --teacher model": plan.teacher_folder,
            "the --data text": s.data,
            "the --eval-data text": s.eval_data,
        }
        if not s.teacher_only:  # (a teacher pass writes only the cache)
            check_output(self.output, s.resume, s.overwrite, inputs)
        self.resume_from, self.start_step = _resume_point(self.output, s.resume and not s.teacher_only, plan.run)
        if self.resume_from is not None:  # its weights whole before anything loads
            _check_resume(self.resume_from)
        from accelerate.utils import set_seed

        set_seed(s.seed)
        self.order = WindowOrder(plan.num_windows, s.batch_size, s.seed)
        self.cached = _cached_teacher(plan, s, acc, self.order, self.say) if s.teacher_top_k else None
        if s.teacher_only:
            return
        teacher = f" and the teacher {s.teacher}" if s.teacher and not self.cached else ""
        self.say(f"loading the student {student}{teacher} ({plan.num_windows:,} training windows ready)")
        model, self.trainable, self.teacher = _models(plan, s, acc, self.resume_from)
        self.conv_record = read_conversion_record(plan.student_folder)
        if self.main:  # everything is checked: now the output folder may be written
            prepare_output(self.output, s.resume, s.overwrite)
        acc.wait_for_everyone()
        optimizer = torch.optim.AdamW(param_groups(self.trainable, s.weight_decay), lr=s.lr, betas=(0.9, s.adam_beta2))
        scheduler = get_cosine_with_min_lr_schedule_with_warmup(
            optimizer, s.warmup_steps, plan.total, min_lr_rate=s.min_lr_ratio
        )
        model.train()
        if s.sharded:  # FSDP already placed and wraps the model; the scheduler rides in accelerate's state
            self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
            acc.register_for_checkpointing(scheduler)
        else:
            self.model, self.optimizer, self.scheduler = acc.prepare(model, optimizer, scheduler)
        skip_model_weights(acc)
        if self.resume_from is not None:
            _load_state(acc, self.resume_from, (self.model, self.optimizer) if s.sharded else None)
        self.log = RunLog(self.output / UPTRAIN_LOG, self.main, self.start_step if self.resume_from else None)
        # every evaluation of the run so far (a resumed run's earlier ones come from its log)
        resumed = self.start_step and self.main
        self.evals = [r for r in read_log(self.output / UPTRAIN_LOG) if isinstance(r, RunEval)] if resumed else []

    def announce(self) -> None:
        """The start (or resume) record and the opening lines."""
        s, plan, acc = self.s, self.plan, self.acc
        total_params = sum(p.numel() for p in self.model.parameters())
        if self.resume_from is not None:
            self.say(f"resuming from {self.resume_from} (step {self.start_step:,})")
            self.log.write(RunResume(self.start_step, now(), str(self.resume_from)))
        else:
            if s.resume:
                self.say(f"--resume: no checkpoint in {self.output}; starting from step 0")
            self.log.write(
                RunStart(
                    created=now(),
                    student=self.student,
                    teacher=s.teacher,
                    settings=plan.run,
                    windows=plan.num_windows,
                    tokens_per_step=self.tokens_per_step,
                    total_steps=plan.total,
                    trainable_parameters=self.trainable.count,
                    parameters=total_params,
                    num_heads=plan.dims.num_heads,
                    num_kv_heads=plan.dims.num_kv_heads,
                    processes=acc.num_processes,
                    device=str(acc.device),
                    mixed_precision=acc.mixed_precision,
                    eval_seq_len=plan.eval_seq_len,
                )
            )
        self.say(
            f"uptrain: {self.trainable.count:,} of {total_params:,} parameters ({s.train}), objective "
            f"{s.objective}, {plan.num_windows:,} windows of {plan.seq_len}, {plan.total:,} steps x "
            f"{s.batch_size} on {acc.num_processes} x {acc.device} "
            f"({'full precision' if acc.mixed_precision == 'no' else acc.mixed_precision + ' mixed precision'})"
        )
        if plan.max_positions and plan.seq_len < plan.max_positions:
            self.say(
                f"note: training windows of {plan.seq_len} tokens do not reach positions {plan.seq_len}-"
                f"{plan.max_positions - 1}; evaluate at the model's full length (--eval-seq-len) to see "
                "them"
            )

    def evaluate(self, step: int) -> None:
        if not self.plan.eval_windows:
            return
        record = _evaluate(
            self.acc,
            self.model,
            self.teacher,
            self.plan.eval_windows,
            self.s.eval_batch_size or self.plan.micro,
            step=step,
            tokens=step * self.tokens_per_step,
            seq_len=self.plan.eval_seq_len,
        )
        self.evals.append(record)
        self.log.write(record)
        against = (
            f" (x{record.ppl_ratio:.3f} the teacher's, KL {record.kl_mean:.4f})" if record.ppl_ratio is not None else ""
        )
        self.say(f"step {step:,}/{self.plan.total:,}: held-out perplexity {record.ppl:.3f}{against}")

    def model_files(self, step: int) -> dict[str, str]:
        """Model card, uptraining record and conversion record of the model at ``step``."""
        s, evals = self.s, self.evals
        record = UptrainRecord(
            student=self.student,
            settings=self.plan.run,
            steps=step,
            tokens=step * self.tokens_per_step,
            warmup_steps=s.warmup_steps,
            trainable_parameters=self.trainable.count,
            processes=self.acc.num_processes,
            mixed_precision=str(self.acc.mixed_precision),
            first_eval=evals[0] if evals else None,
            last_eval=evals[-1] if evals else None,
        )
        files = {
            UPTRAIN_RECORD: record.to_json(),
            "README.md": record.card(self.conv_record),
        }
        if self.conv_record:
            files[CONVERSION_RECORD] = self.conv_record.to_json()
        modeling = self.plan.student_folder / MODELING_FILE
        if modeling.is_file():  # a per-layer student: its class travels with the weights
            files[MODELING_FILE] = modeling.read_text(encoding="utf-8")
        return files

    def checkpoint(self, step: int) -> None:
        state = {
            "step": step,
            "tokens": step * self.tokens_per_step,
            "settings": self.plan.run,
            "student": self.student,
            "source_dtype": self.plan.source_dtype,
            "created": now(),
        }
        save_checkpoint(
            self.acc,
            self.model,
            self.plan.tokenizer,
            self.output,
            step,
            state,
            self.model_files(step),
            self.s.save_total_limit,
            (lambda folder: save_optimizer(self.model, self.optimizer, folder)) if self.s.sharded else None,
        )

    def peak_memory(self) -> list[float]:
        """Each process's peak memory so far in MiB (CUDA allocations on a GPU, else resident memory),
        in rank order. Collective."""
        from accelerate.utils import gather_object

        from mha2gqa.core.memory import peak_memory

        mine = round(peak_memory(self.acc.device) / 2**20, 1)
        return gather_object([mine]) if self.acc.num_processes > 1 else [mine]

    def teacher_of(self, step: int) -> Callable[[int, torch.Tensor], Any] | None:
        """``(k, inputs) ->`` micro-batch k's teacher logits (live teacher) or its rows of the cache."""
        if self.cached is not None:
            micro = self.plan.micro
            first = _rank_rows(self.s, self.acc).start
            return lambda k, _: self.cached.targets(step - 1, slice(first + k * micro, first + (k + 1) * micro))
        if self.teacher is not None:
            return lambda k, inputs: self.teacher(input_ids=inputs, use_cache=False).logits
        return None

    def step(self, step: int) -> tuple[float, dict[str, float], Any]:
        """One optimizer step; returns its loss, the loss parts and the gradient norm."""
        s, micro, acc = self.s, self.plan.micro, self.acc
        batch = self.order.batch(step - 1)
        mine = batch[_rank_rows(s, acc)]
        fetch = lambda idx: self.plan.store.windows(idx, self.plan.seq_len)  # noqa: E731
        loss, parts = _accumulate(acc, self.model, self.teacher_of(step), fetch, mine.split(micro), s)
        if s.sharded:  # the fused query rows' hooks went with the unsharded parameters
            for name, rows in self.trainable.masked_rows.items():
                zero_rows(self.trainable.param(name), rows)
        grad_norm = acc.clip_grad_norm_(self.trainable.params, s.max_grad_norm) if s.max_grad_norm > 0 else None
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        stats = torch.tensor([loss, *parts.values()], device=acc.device)
        stats = acc.reduce(stats, "mean") if acc.num_processes > 1 else stats
        if not all(math.isfinite(float(x)) for x in stats):
            raise Mha2GqaError(
                f"uptrain: the loss became {float(stats[0])} at step {step}; lower --lr or check the "
                "data and the model (nothing after the last checkpoint was kept)"
            )
        return float(stats[0]), {k: float(stats[i + 1]) for i, k in enumerate(parts)}, grad_norm

    def train(self) -> int:
        """The step loop from the start (or resume) step to the end or ``stop_after``; returns the last step."""
        from mha2gqa.core.progress import bar as progress_bar

        s, plan = self.s, self.plan
        if self.start_step == 0:
            self.evaluate(0)
        stop = min(plan.total, self.start_step + s.stop_after) if s.stop_after else plan.total
        bar = progress_bar(
            total=plan.total,
            initial=self.start_step,
            unit="step",
            desc="uptrain",
            disable=not (s.progress and self.main),
        )
        window = _Window()
        step = self.start_step
        for step in range(self.start_step + 1, stop + 1):
            check_signals()
            t0 = time.perf_counter()
            loss, parts, grad_norm = self.step(step)
            window.add(loss, parts, time.perf_counter() - t0)
            bar.update(1)
            if step % s.log_every == 0 or step == stop:
                rec = window.record(
                    step,
                    self.tokens_per_step,
                    self.order.epoch(step),
                    self.scheduler.get_last_lr()[0],
                    grad_norm,
                    self.peak_memory(),
                )
                self.log.write(rec)
                bar.set_postfix(loss=f"{rec.loss:.4f}", tok_s=f"{rec.tokens_per_second:,.0f}")
            if step % plan.eval_every == 0 or step == plan.total:
                self.evaluate(step)
            if step % plan.save_every == 0 or step == stop:
                self.checkpoint(step)
        bar.close()
        return step

    def finish(self, step: int) -> UptrainResult:
        plan = self.plan
        complete = step >= plan.total
        result = UptrainResult(
            self.output,
            step,
            plan.total,
            step * self.tokens_per_step,
            complete,
            self.evals,
            time.perf_counter() - self.started,
            processes=self.acc.num_processes,
            sharded=self.s.sharded,
        )
        if complete:
            dtype = by_name(plan.source_dtype).torch if plan.source_dtype else None
            save_final(self.acc, self.model, plan.tokenizer, self.output, dtype, self.model_files(step), self.s.sharded)
            self.log.write(RunEnd(step, step * self.tokens_per_step, now(), result.seconds))
        return result


class _Window:
    """Loss and timing sums between two train records (evaluations and checkpoints not timed)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.count, self.seconds = 0, 0.0

    def add(self, loss: float, parts: dict[str, float], seconds: float) -> None:
        for k, v in {"loss": loss, **parts}.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.count += 1
        self.seconds += seconds

    def record(
        self, step: int, tokens_per_step: int, epoch: float, lr: float, grad_norm, peak_memory_mib: list[float]
    ) -> RunTrain:
        sums = {k: v / self.count for k, v in self.sums.items()}
        rec = RunTrain(
            step=step,
            tokens=step * tokens_per_step,
            epoch=round(epoch, 4),
            loss=sums.pop("loss"),
            lr=lr,
            grad_norm=float(grad_norm) if grad_norm is not None else None,
            tokens_per_second=self.count * tokens_per_step / max(self.seconds, 1e-9),
            step_seconds=self.seconds / self.count,
            peak_memory_mib=peak_memory_mib,
            parts=sums,
        )
        self.__init__()
        return rec


def _check_resume(folder: Path) -> None:
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


def _load_state(acc: Any, folder: Path, sharded: tuple[Any, Any] | None = None) -> None:
    """A resumed run's model, optimizer and scheduler state (accelerate's checkpoint), or one line
    saying which checkpoint cannot be read (truncated, damaged, or a pickle that is not plain data:
    torch's weights-only loading refuses it, and it is never loaded otherwise)."""
    import pickle

    from safetensors import SafetensorError

    try:
        acc.load_state(str(folder))
        if sharded is not None:  # (model, optimizer): each process's optimizer shard
            load_optimizer(*sharded, folder)
    except (pickle.UnpicklingError, SafetensorError, EOFError, OSError, RuntimeError, ValueError, KeyError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        if "weights_only" in first or isinstance(e, pickle.UnpicklingError):
            first = "it holds a pickle that is not plain tensors and data, refused as unsafe"
        raise Mha2GqaError(
            f"--resume: the checkpoint {folder} cannot be read ({first}); remove it to resume from the one "
            "before, or start again without --resume"
        ) from None


def uptrain(student: str, settings: UptrainSettings, log=print) -> UptrainResult:
    """Uptrain the model at ``student`` (folder or hub id) as ``settings`` say; see the module doc."""
    from mha2gqa.core.checkpoint import check_loadable, check_models
    from mha2gqa.core.signals import Terminated

    settings = settings.check()
    check_models(CONVERTED=student, **{"--teacher": settings.teacher})
    check_loadable("the student", student)
    if settings.teacher:
        check_loadable("--teacher", settings.teacher)
    trainer = _Trainer(student, settings, log)
    if settings.teacher_only:
        seconds = time.perf_counter() - trainer.started
        return UptrainResult(trainer.output, 0, trainer.plan.total, 0, False, [], seconds, trainer.cached.cache.folder)
    trainer.announce()
    try:
        steps = trainer.train()
    except Terminated as e:
        e.kept = (
            f"the checkpoints written so far stay in {settings.output} (no final model): run the same command "
            "with --resume to continue from the last one"
        )
        raise
    return trainer.finish(steps)


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


def _accumulate(acc, model, teacher, fetch, micro_batches, s: UptrainSettings):
    """Forward and backward over this process's micro-batches of one step (``[micro]`` window indices
    each, ``fetch`` gives their ``[micro, seq_len + 1]`` tokens), gradients synchronised on the last
    only; ``teacher(k, inputs)``: micro-batch k's teacher logits or cached top-K form. Returns the
    mean loss and parts."""
    loss_sum, parts_sum = 0.0, {}
    n = len(micro_batches)
    for k, idx in enumerate(micro_batches):
        chunk = fetch(idx).to(acc.device)
        inputs, targets = chunk[:, :-1], chunk[:, 1:]
        if s.sharded:
            model.set_requires_gradient_sync(k == n - 1)
            sync = contextlib.nullcontext()
        else:
            sync = contextlib.nullcontext() if k == n - 1 else acc.no_sync(model)
        with sync, acc.autocast():
            logits = model(input_ids=inputs, use_cache=False).logits
            target = None
            if s.objective != "ce":
                with torch.no_grad():
                    target = teacher(k, inputs)
                if isinstance(target, dict):
                    target = {name: v.to(acc.device) for name, v in target.items()}
            loss, parts = combined(s.objective, logits, targets, target, s.kd_weight, s.temperature)
            acc.backward(loss / n)
        loss_sum += float(loss.detach()) / n
        for name, v in parts.items():
            parts_sum[name] = parts_sum.get(name, 0.0) + v / n
    return loss_sum, parts_sum


@torch.no_grad()
def _evaluate(acc, model, teacher, windows, batch_size: int, *, step: int, tokens: int, seq_len: int | None) -> RunEval:
    """Held-out perplexity of the student (and the teacher's, with KL and top-1 agreement to it) at
    ``step`` (``tokens`` trained so far), windows split over processes; the harness's scoring pass."""
    from mha2gqa.eval.harness import scored_pass

    model.eval()
    try:
        with acc.autocast():
            models = [teacher, model] if teacher is not None else [model]
            res = scored_pass(models, windows, batch_size, progress=False, desc="eval")
    finally:
        model.train()
    nll = res.nll(len(models) - 1)
    scores = {"step": step, "tokens": tokens, "seq_len": seq_len, "nll": nll, "ppl": math.exp(nll)}
    if teacher is None:
        return RunEval(**scores, eval_tokens=res.tokens)
    teacher_ppl = math.exp(res.nll(0))
    return RunEval(
        **scores,
        eval_tokens=res.tokens,
        teacher_ppl=teacher_ppl,
        ppl_ratio=scores["ppl"] / teacher_ppl,
        kl_mean=res.agreement["kl"]["mean"],
        top1_agreement=res.agreement["top1_agreement"],
    )


def _with_lora(model, family, dims, s: UptrainSettings, resume_from: Path | None):
    """The student with fresh LoRA adapters, or with those of the checkpoint being resumed."""
    if resume_from is None:
        return apply_lora(
            model, lora_targets(family, dims, s.train), s.lora_rank, s.lora_alpha or 2 * s.lora_rank, s.lora_dropout
        )
    from peft import PeftModel

    return PeftModel.from_pretrained(model, resume_from, is_trainable=True)


def _dims(folder: Path) -> AttentionDims:
    """Head counts through transformers' config class (its attribute maps cover GPT-2's ``n_head``...)."""
    from transformers import AutoConfig

    from mha2gqa.core.architecture import dims_of

    return dims_of(AutoConfig.from_pretrained(folder))
