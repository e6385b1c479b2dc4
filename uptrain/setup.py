"""Setting an uptraining run up: accelerate's state, the student (full, LoRA or sharded) and what of
it trains, the frozen teacher (live, or its top-K outputs cached by a teacher pass), and a resumed
run's state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mha2gqa.core.cache import cache_root
from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.models import resolve_device, resolve_precision
from mha2gqa.uptrain.data import WindowOrder
from mha2gqa.uptrain.params import adapters, apply_lora, lora_targets, select_trainable
from mha2gqa.uptrain.prepare import Uptraining
from mha2gqa.uptrain.settings import UptrainSettings
from mha2gqa.uptrain.sharding import fsdp_mesh, in_turns, load_optimizer, shard
from mha2gqa.uptrain.teacher_cache import (
    CachedTeacher,
    PassShare,
    StepWindows,
    TeacherCache,
    chunk_steps,
    fill,
    producer_lock,
    producer_running,
    teacher_key_material,
)


def accelerator(s: UptrainSettings):
    from accelerate import Accelerator

    device = resolve_device(s.device)
    mp = resolve_precision(s.mixed_precision, device)
    _forget_earlier_accelerator()
    return Accelerator(cpu=device.type == "cpu", mixed_precision=mp, step_scheduler_with_optimizer=False)


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


def load_models(up: Uptraining, s: UptrainSettings, acc, resume_from: Path | None):
    """The student in float32 (from the checkpoint being resumed, or with its LoRA adapters), what
    trains, and the frozen teacher on the device. Under ``--sharding fsdp`` the processes load in
    turns, each keeping its shard (:func:`~mha2gqa.uptrain.sharding.in_turns`): the host holds one
    whole model at a time, not one a process."""
    if s.sharded:
        grid = fsdp_mesh(acc.device)

        def student():
            model, trainable = _student(up, s, resume_from)
            shard(model, grid, acc.device, acc.mixed_precision, s.cpu_offload)
            return model, trainable.rebind(model)  # (the whole tensors go with their last references)

        model, trainable = in_turns(student)
    else:
        model, trainable = _student(up, s, resume_from)
    teacher = None
    if up.teacher_folder is not None and not s.teacher_top_k:
        teacher = load_teacher(up, s, acc)
        check_vocabulary(_vocabulary(model), _vocabulary(teacher), s.teacher)
    return model, trainable, teacher


def _student(up: Uptraining, s: UptrainSettings, resume_from: Path | None):
    """``(the student in float32 on the CPU, what trains)``: accelerate or FSDP places it."""
    from mha2gqa.core.models import load_model

    lora = s.lora_rank > 0
    folder = resume_from if resume_from and not lora else up.student_folder
    model = load_model(str(folder), torch.device("cpu"), torch.float32).model
    if s.gradient_checkpointing:
        _enable_checkpointing(model)
    trainable = select_trainable(model, up.family, up.dims, s.train)
    if lora:
        model = _with_lora(model, up.family, up.dims, s, resume_from)
        trainable = adapters(model)
    return model, trainable


def teacher_dtype(acc) -> torch.dtype:
    """Distillation's teacher runs in bfloat16 under bf16 mixed precision, else in float32."""
    return torch.bfloat16 if acc.mixed_precision == "bf16" else torch.float32


def load_teacher(up: Uptraining, s: UptrainSettings, acc) -> torch.nn.Module:
    """The frozen teacher in :func:`teacher_dtype`, on this process's device, or sharded like the
    student under ``--sharding fsdp``."""
    from mha2gqa.core.models import load_model

    if not s.sharded:
        return load_model(str(up.teacher_folder), acc.device, teacher_dtype(acc)).model.requires_grad_(False)
    grid = fsdp_mesh(acc.device)

    def teacher():
        model = load_model(str(up.teacher_folder), torch.device("cpu"), teacher_dtype(acc)).model
        return shard(model.requires_grad_(False), grid, acc.device, "no", s.cpu_offload)

    return in_turns(teacher)


def rank_rows(s: UptrainSettings, acc) -> slice:
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


def cached_teacher(up: Uptraining, s: UptrainSettings, acc, order: WindowOrder, say) -> CachedTeacher:
    """The teacher-cache entry of this run, its missing chunks filled first by a teacher pass here
    (the teacher alone in memory, then freed) unless another process is filling it: then training
    reads each chunk as that pass publishes it."""
    import gc

    from accelerate.utils import broadcast_object_list

    from mha2gqa.core.cache import model_identity
    from mha2gqa.core.memory import trim

    dtype = str(teacher_dtype(acc)).removeprefix("torch.")
    steps = chunk_steps(s.batch_size, up.seq_len)
    vocab = _config_vocabulary(up.teacher_folder)
    check_vocabulary(_config_vocabulary(up.student_folder), vocab, s.teacher)
    settings = {"top_k": min(s.teacher_top_k, vocab), "vocab_size": vocab, "temperature": s.temperature,
                "seq_len": up.seq_len, "batch_size": s.batch_size, "seed": s.seed, "windows": up.num_windows,
                "dtype": dtype, "chunk_steps": steps}  # fmt: skip
    material = teacher_key_material(up.store.folder.name, model_identity(s.teacher, up.teacher_folder), settings)
    root = Path(s.teacher_cache) if s.teacher_cache else cache_root() / "teacher"
    cache = TeacherCache.create(root, material, settings) if acc.is_main_process else None
    acc.wait_for_everyone()
    cache = cache or TeacherCache.create(root, material, settings)
    release = producer_lock(cache) if acc.is_main_process else None
    decision = [release is not None and bool(cache.missing(up.total))]
    broadcast_object_list(decision)
    try:
        if decision[0]:
            missing = cache.missing(up.total)
            say(f"teacher pass: {len(missing):,} chunks of {steps} steps into {cache.folder} (top {settings['top_k']})")
            teacher = load_teacher(up, s, acc)
            rows = rank_rows(s, acc)

            windows = StepWindows(
                lambda step: order.batch(step)[rows].tolist(), lambda ids: up.store.windows(ids, up.seq_len)
            )
            share = PassShare(acc.process_index, acc.num_processes, up.micro)
            fill(cache, teacher, missing, up.total, windows, share, say, s.progress and acc.is_main_process)
            del teacher
            gc.collect()
            trim()
        elif cache.missing(up.total):
            say(f"teacher cache {cache.folder}: another process is filling it; training reads each chunk as it lands")
    finally:
        if release is not None:
            release()
    acc.wait_for_everyone()
    return CachedTeacher(cache, up.total, lambda: producer_running(cache))


def _config_vocabulary(folder: Path) -> int:
    """The output vocabulary a checkpoint's config declares."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    return int(getattr(config.get_text_config(), "vocab_size", 0) or 0)


def load_state(acc: Any, folder: Path, sharded: tuple[Any, Any] | None = None) -> None:
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


def _enable_checkpointing(model) -> None:
    """Activation (gradient) checkpointing through transformers, non-reentrant."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _with_lora(model, family, dims, s: UptrainSettings, resume_from: Path | None):
    """The student with fresh LoRA adapters, or with those of the checkpoint being resumed."""
    if resume_from is None:
        return apply_lora(
            model, lora_targets(family, dims, s.train), s.lora_rank, s.lora_alpha or 2 * s.lora_rank, s.lora_dropout
        )
    from peft import PeftModel

    return PeftModel.from_pretrained(model, resume_from, is_trainable=True)


def optimizing(acc, model, trainable, s: UptrainSettings, total: int):
    """AdamW over the ``trainable`` parameters with a cosine schedule (warm-up, down to
    ``--min-lr-ratio``), the model in training mode, all three under accelerate: ``(model,
    optimizer, scheduler)``."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    from mha2gqa.uptrain.checkpoints import skip_model_weights
    from mha2gqa.uptrain.params import param_groups

    groups = param_groups(trainable, s.weight_decay, s.lr, s.lr_relative)
    optimizer = torch.optim.AdamW(groups, lr=s.lr, betas=(0.9, s.adam_beta2))
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, s.warmup_steps, total, min_lr_rate=s.min_lr_ratio
    )
    model.train()
    if s.sharded:  # FSDP already placed and wraps the model; the scheduler rides in accelerate's state
        acc.register_for_checkpointing(scheduler)
    else:
        model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
    skip_model_weights(acc)
    return model, optimizer, scheduler
