"""Every setting of an uptraining run, with its default and help: the one source for
:func:`~mha2gqa.uptrain.trainer.uptrain`, ``mha2gqa uptrain`` and job files."""

from __future__ import annotations

from dataclasses import dataclass

from mha2gqa.core.conversion_record import GUARD_MODES, GuardMode
from mha2gqa.core.devices import DEVICE_HELP, PRECISION_HELP, PRECISIONS, check_device_name
from mha2gqa.core.errors import SettingError
from mha2gqa.core.settings import names_where, setting, validate
from mha2gqa.core.text import DOC_SPLITS, check_text_source

OBJECTIVES = ("ce", "kd", "mix")
TRAINABLE = ("all", "attention", "kv")
SHARDING = ("none", "fsdp")
#: The training window when none is given (cut to the model's positions).
UPTRAIN_WINDOW = 1024


@dataclass
class UptrainSettings:
    """Every knob of an uptraining run (recorded verbatim in the log, checkpoints and output)."""

    data: str = setting(
        help="Training text (same sources as eval --data); packed into --seq-len windows.", identity=True
    )
    output: str = setting(help="Run folder: final model, checkpoints/, log.", job=False)
    data_tokens: int | None = setting(
        None,
        help="Train on the first N tokens of --data only (the rest held out) [default: all of it].",
        minimum=1,
        identity=True,
    )
    objective: str = setting(
        "ce",
        help="ce: next-token cross-entropy; kd: KL to --teacher's next-token distribution; mix: both.",
        choices=OBJECTIVES,
        identity=True,
    )
    teacher: str | None = setting(
        None, help="The MHA parent (folder or hub id): kd/mix target, and KL in evaluations.", identity=True, job=False
    )
    kd_weight: float = setting(0.5, help="mix: loss = (1 - w) * ce + w * kd.", minimum=0, maximum=1, identity=True)
    temperature: float = setting(1.0, help="Distillation temperature (loss scaled by T^2).", above=0, identity=True)
    train: str = setting(
        "all",
        help="What trains: every parameter, the attention projections, or only the K/V projections.",
        choices=TRAINABLE,
        identity=True,
    )
    lora_rank: int = setting(
        0, help="LoRA adapters of this rank (peft) on what --train names; 0: off.", minimum=0, identity=True
    )
    lora_alpha: float | None = setting(None, help="LoRA alpha [default: 2 x rank].", above=0, identity=True)
    lora_dropout: float = setting(0.0, help="LoRA dropout.", minimum=0, below=1, identity=True)
    max_steps: int | None = setting(
        None, help="Optimizer steps [default: --max-tokens, else one epoch].", minimum=1, identity=True
    )
    max_tokens: int | None = setting(
        None, help="Training tokens (steps = tokens / (batch x seq_len)).", minimum=1, identity=True
    )
    batch_size: int = setting(8, help="Sequences per optimizer step, over all processes.", minimum=1, identity=True)
    grad_accum: int = setting(1, help="Micro-batches per step (gradient accumulation).", minimum=1, identity=True)
    seq_len: int | None = setting(
        None, help=f"Window length [default: min({UPTRAIN_WINDOW}, the model's positions)].", minimum=2, identity=True
    )
    lr: float = setting(1e-4, help="Peak AdamW learning rate.", above=0, identity=True)
    lr_relative: bool = setting(
        False,
        help="--lr is relative: each parameter's learning rate is --lr times its RMS at the start (a bias's: "
        "the larger of its own and its weight's), so that a step is the same share of every weight on any "
        "model, whatever its scale.",
        identity=True,
    )
    min_lr_ratio: float = setting(0.1, help="Cosine decay ends at lr x this.", minimum=0, maximum=1, identity=True)
    warmup_steps: int = setting(0, help="Linear warm-up steps.", minimum=0, identity=True)
    weight_decay: float = setting(0.0, help="AdamW weight decay (matrices only).", minimum=0, identity=True)
    adam_beta2: float = setting(0.999, help="AdamW beta2.", minimum=0, below=1, identity=True)
    max_grad_norm: float = setting(1.0, help="Gradient clipping (0: off).", minimum=0, identity=True)
    seed: int = setting(0, help="Seed for data order and any randomness.", minimum=0, maximum=2**63 - 1, identity=True)
    text_field: str = setting("text", help="Field holding the text in .jsonl/.parquet/datasets sources.", identity=True)
    doc_split: str = setting(
        "file", help="How a .txt file is cut into documents.", choices=tuple(DOC_SPLITS), identity=True
    )
    eval_data: str | None = setting(
        None, help="Held-out text evaluated periodically (perplexity; KL with --teacher).", job=False
    )
    heldout_tokens: int | None = setting(
        None,
        help="Hold the last N tokens of --data out of training and evaluate on them instead of --eval-data (a "
        "validation text for --guard that is neither trained on nor the text you test on).",
        minimum=1,
        identity=True,
    )
    guard: str = setting(
        "undo",
        help="undo: the model published is the best of those the --eval-data evaluations scored by the run's "
        "objective (ce: perplexity; kd: KL to --teacher; mix: both, weighted; perplexity where no KL is measured): "
        "the student as given where the run did not lower it (undone), or an earlier step's; fail: a run that did "
        "not lower it fails; off: the last step's model, unchecked.",
        choices=GUARD_MODES,
    )
    eval_every: int | None = setting(None, help="Steps between evaluations [default: a tenth of the run].", minimum=1)
    eval_tokens: int | None = setting(
        None,
        help="Held-out tokens per evaluation [default: what keeps the evaluations near a fifth of the run's "
        "compute, whole windows, at most 65,536].",
        minimum=1,
    )
    eval_seq_len: int | None = setting(None, help="Evaluation window [default: --seq-len].", minimum=2)
    eval_batch_size: int | None = setting(
        None, help="Windows per evaluation forward [default: the micro-batch].", minimum=1
    )
    save_every: int | None = setting(None, help="Steps between checkpoints [default: --eval-every].", minimum=1)
    save_total_limit: int = setting(
        2, help="Checkpoints kept (the newest, and the one --guard scored best).", minimum=1
    )
    log_every: int = setting(10, help="Steps between train records in the log.", minimum=1)
    stop_after: int | None = setting(
        None,
        help="Stop after this many steps (checkpointed), e.g. for a time slot; continue with --resume.",
        minimum=1,
        job=False,
    )
    resume: bool = setting(
        False, help="Continue the run in --output from its last checkpoint (same settings).", job=False
    )
    overwrite: bool = setting(False, help="Delete a previous run in --output and start over.", job=False)
    device: str = setting("auto", help=f"{DEVICE_HELP} (accelerate launch picks each process's GPU)")
    mixed_precision: str = setting("auto", help=PRECISION_HELP, choices=PRECISIONS)
    gradient_checkpointing: bool = setting(False, help="Recompute activations in the backward pass.")
    sharding: str = setting(
        "none",
        help="none: every process holds the whole model (DDP); fsdp: parameters, gradients and optimizer "
        "state sharded per decoder layer across processes (torch FSDP2; run under torchrun or accelerate "
        "launch).",
        choices=SHARDING,
    )
    cpu_offload: bool = setting(False, help="--sharding fsdp: keep parameter shards and optimizer state in CPU memory.")
    data_cache: str | None = setting(
        None, help="Folder of tokenized --data shards, reused by content [default: the mha2gqa cache/tokens]."
    )
    teacher_top_k: int = setting(
        0,
        help="Distil from a cache of the teacher's top-K log-probabilities plus the remainder, written by one "
        "teacher pass before training (the student then trains alone); 0: the live teacher.",
        minimum=0,
        identity=True,
    )
    teacher_only: bool = setting(
        False,
        help="Only fill the --teacher-top-k cache (e.g. ahead of the training run, on other devices: the "
        "run with the same settings reads each chunk as it lands), then stop.",
        job=False,
    )
    teacher_cache: str | None = setting(
        None,
        help="Folder of teacher outputs for --teacher-top-k, reused by content [default: the mha2gqa cache/teacher].",
    )
    progress: bool = setting(True, help="Progress bars.", cli=False, job=False)

    @property
    def sharded(self) -> bool:
        """Parameters, gradients and optimizer state sharded across processes (``--sharding fsdp``)."""
        return self.sharding == "fsdp"

    def window(self, positions: int | None) -> int:
        """The training window: ``seq_len``, else :data:`UPTRAIN_WINDOW` cut to the ``positions``."""
        return self.seq_len or min(UPTRAIN_WINDOW, positions or UPTRAIN_WINDOW)

    def check(self) -> UptrainSettings:
        """Every value and combination checked before anything is loaded."""
        validate(self)
        check_device_name(self.device)
        check_text_source(self.data, "data")
        check_text_source(self.eval_data, "eval_data")
        if self.objective in ("kd", "mix") and not self.teacher:
            raise SettingError(
                "teacher", f"objective {self.objective} distils from a teacher: pass {{name}} ORIGINAL_MODEL"
            )
        if self.teacher_top_k and self.objective == "ce":
            raise SettingError("teacher_top_k", "{name} caches the teacher for --objective kd or mix, not ce")
        if self.teacher_only and not self.teacher_top_k:
            raise SettingError("teacher_only", "{name} fills the cache of --teacher-top-k K: give K")
        if self.cpu_offload and self.sharding != "fsdp":
            raise SettingError("cpu_offload", "{name} offloads FSDP shards: add --sharding fsdp")
        if self.guard == GuardMode.FAIL and not (self.eval_data or self.heldout_tokens):
            raise SettingError("guard", "{name} fail judges the run on held-out text: give --eval-data")
        if self.eval_data and self.heldout_tokens:
            raise SettingError("heldout_tokens", "{name} evaluates on --data's last tokens: give it or --eval-data")
        if self.max_steps and self.max_tokens:
            raise SettingError("max_steps", "give {name} or --max-tokens, not both")
        return self


#: settings that define the trajectory: a resumed run must use the same ones
RUN_FIELDS = names_where(UptrainSettings, "identity")
