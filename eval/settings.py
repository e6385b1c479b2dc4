"""Every setting of an evaluation and of the decode benchmark, with defaults and help: the one source
for :func:`~mha2gqa.eval.harness.evaluate`, ``mha2gqa eval`` / ``bench`` and job files."""

from __future__ import annotations

from dataclasses import dataclass

from mha2gqa.core.devices import DEVICE_HELP, DTYPE_HELP, check_device_name, check_dtype_name
from mha2gqa.core.errors import Mha2GqaError, SettingError
from mha2gqa.core.settings import setting, validate
from mha2gqa.core.text import DOC_SPLITS, check_text_source
from mha2gqa.core.units import parse_size
from mha2gqa.eval.quantization import SCHEMES

#: The perplexity protocols (:mod:`mha2gqa.eval.perplexity` says what each is).
PROTOCOLS = ("disjoint", "stride", "rolling")
#: How the ``rolling`` protocol tokenizes documents, named for the lm-evaluation-harness it equals:
#: without special tokens (lm-eval <= 0.4.9, or 0.4.10+ with ``add_bos_token=False``), or with the
#: tokenizer's defaults (0.4.10+: a tokenizer that adds BOS gets a second, scored BOS; lm-eval #3333).
ROLLING_CONVENTIONS = ("lm-eval-0.4.9", "lm-eval-0.4.10")


#: The perplexity window when none is given (cut to the model's positions).
EVAL_WINDOW = 2048
#: The attention-similarity window when none is given (cut to the perplexity window).
ATTENTION_WINDOW = 1024


@dataclass
class EvalSettings:
    """Every knob of an evaluation run (recorded verbatim in the results)."""

    data: str = setting(help="Text: a .txt/.jsonl/.json/.parquet file or a datasets name 'name[:config]:split'.")
    text_field: str = setting("text", help="Field holding the text in .jsonl/.parquet/datasets sources.")
    doc_split: str = setting(
        "file", help="How a .txt file is cut into documents (the rolling protocol's unit).", choices=tuple(DOC_SPLITS)
    )
    protocols: tuple[str, ...] = setting(
        ("disjoint",), help="Perplexity protocols (repeatable).", choices=PROTOCOLS, flag="--protocol"
    )
    seq_len: int | None = setting(
        None,
        help=f"Window length [default: min({EVAL_WINDOW}, the model's positions); 'rolling': the model's "
        f"positions ({EVAL_WINDOW} when unknown), as lm-eval].",
        minimum=2,
    )
    stride: int | None = setting(None, help="Stride of the 'stride' protocol [default: seq_len // 2].", minimum=1)
    rolling_convention: str = setting(
        "lm-eval-0.4.9",
        help="How 'rolling' tokenizes documents: without special "
        "tokens and one BOS (else EOS) prefix, as lm-eval <= 0.4.9 (and 0.4.10+ with "
        "add_bos_token=False); or with the tokenizer's own, as lm-eval 0.4.10+'s "
        "default (a BOS-adding tokenizer then scores a second BOS).",
        choices=ROLLING_CONVENTIONS,
    )
    max_tokens: int | None = setting(None, help="Token budget (the first N tokens of the text).", minimum=2)
    batch_size: int = setting(1, help="Windows per forward pass.", minimum=1)
    device: str = setting("auto", help=DEVICE_HELP)
    dtype: str = setting("auto", help=DTYPE_HELP)
    device_map: str | None = setting(
        None, help="'auto' to spread a model too large for one GPU across devices.", choices=("auto",)
    )
    attention: bool = setting(True, help="Per-layer, per-head attention similarity (pairs only).")
    attention_seq_len: int | None = setting(
        None, help=f"Window for attention similarity [default: min(seq_len, {ATTENTION_WINDOW})].", minimum=2
    )
    attention_windows: int = setting(1, help="Windows the attention similarity averages over.", minimum=1)
    samples: int = setting(
        3, help="Greedy generations side by side in the results and report (pairs; 0: none).", minimum=0
    )
    sample_tokens: int = setting(32, help="New tokens per generation.", minimum=1)
    greedy_prompts: int = setting(
        32,
        help="The generative probe (pairs; 0: none): greedy continuations of this many prompts cut across "
        "the text, compared token by token with the original's (the share identical, the tokens before "
        "the first divergence).",
        minimum=0,
    )
    greedy_tokens: int = setting(32, help="Tokens each continuation of the generative probe runs.", minimum=1)
    attention_chunk: int = setting(128, help="Query rows per attention chunk (memory).", minimum=1, cli=False)
    load_both: bool = setting(
        False,
        help="Keep both models of a pair in memory and compare them directly, instead "
        "of one at a time with the original's scores cached on disk (same numbers).",
    )
    reference_cache: str | None = setting(
        None,
        help="Folder for the original's cached scores, reused by every "
        "conversion of it evaluated with the same text and settings [default: a "
        "temporary folder, removed afterwards].",
    )
    reference_block: str = setting(
        "2GiB",
        help="Most temporary disk the original's scores take at once when no --reference-cache is given: a "
        "pair whose scores are larger is scored block by block (each model loaded once a block, the same "
        "numbers), so the disk an evaluation needs does not grow with the text.",
    )
    reference_top_k: int = setting(
        0,
        help="Cache the original's next-token distributions as their top K tokens "
        "and one bucket for the rest (8K + 8 bytes a token instead of vocabulary x dtype): "
        "perplexity, Δp and same-top stay exact, both KLs become lower bounds. 0: exact "
        "logits.",
        minimum=0,
    )
    compare_quantization: tuple[str, ...] = setting(
        (),
        help="Also score round-to-nearest weight-quantized copies of the original against it (int8 per "
        "channel, int4 in groups of 128), one model at a time through the reference cache: a yardstick "
        "the verdict places the conversion against.",
        choices=tuple(SCHEMES),
        empty=True,
    )
    tasks: tuple[str, ...] = setting(
        (),
        help="lm-evaluation-harness tasks (names, groups, tags or globs; comma-separated or repeated), run on "
        "each model as loaded, the difference tested on the paired examples (needs mha2gqa[tasks]).",
        empty=True,
    )
    num_fewshot: int | None = setting(
        None, help="Few-shot examples per task prompt [default: each task's own].", minimum=0
    )
    limit: int | None = setting(
        None, help="The first N documents of each task (a quick look, not a release figure).", minimum=1
    )
    include_path: str | None = setting(None, help="A folder of extra task YAML files (local tasks, local data).")
    allow_overlap: bool = setting(
        False,
        help="Judge the verdict even when the evaluation text is (or overlaps) the text the conversion was "
        "calibrated or refitted on; otherwise such a verdict is NOT VALID and fails --strict and gates.",
    )
    revision: str | None = setting(None, help="Hub revision when a model is a hub id.")
    progress: bool = setting(True, help="Progress bars.", cli=False, job=False)

    def window(self, positions: int | None) -> int:
        """The disjoint/stride window: ``seq_len``, else :data:`EVAL_WINDOW` cut to the ``positions``."""
        return self.seq_len or min(EVAL_WINDOW, positions or EVAL_WINDOW)

    def rolling_window(self, positions: int | None) -> int:
        """lm-eval's rolling window: ``seq_len``, else the model's full length (2048 when unknown)."""
        return self.seq_len or positions or EVAL_WINDOW

    def attention_window(self, window: int) -> int:
        """The attention-similarity window, never longer than the perplexity ``window``."""
        return min(self.attention_seq_len or min(window, ATTENTION_WINDOW), window)

    def check(self) -> EvalSettings:
        validate(self)
        check_device_name(self.device)
        check_dtype_name(self.dtype)
        check_text_source(self.data, "data")
        try:
            parse_size(self.reference_block)
        except Mha2GqaError as e:
            raise SettingError("reference_block", f"{{name}} {self.reference_block}: {e}") from None
        if self.load_both and self.reference_top_k:
            raise SettingError(
                "reference_top_k",
                "{name} shapes the cached original's scores; with --load-both nothing is cached: drop one of them",
            )
        if self.load_both and self.compare_quantization:
            raise SettingError(
                "compare_quantization",
                "{name} scores the quantized copies one model at a time against the cached original: drop --load-both",
            )
        for name in ("num_fewshot", "limit", "include_path"):
            if getattr(self, name) is not None and not self.tasks:
                raise SettingError(name, "{name} shapes the downstream tasks: name the tasks too, or drop it")
        if self.tasks:
            from mha2gqa.eval.tasks import check_tasks

            check_tasks(self.include_path)
        if self.stride is not None and self.seq_len is not None and self.stride > self.seq_len:
            raise SettingError("stride", f"{{name}} {self.stride} must be between 1 and --seq-len {self.seq_len}")
        return self


@dataclass
class BenchSettings:
    """The decode benchmark: same prompt for each model, greedy generation, medians of repeats."""

    prompt_len: int | None = setting(
        None,
        help="Prompt tokens (seeded random ids, the same for both) [default: 512, or what fits the model's positions].",
        minimum=1,
    )
    new_tokens: int | None = setting(None, help="Tokens generated per run [default: 64, or what fits].", minimum=2)
    batch_size: int = setting(1, help="Sequences per run.", minimum=1)
    repeats: int = setting(5, help="Timed runs (median and min-max reported).", minimum=1)
    warmup: int = setting(1, help="Untimed runs first.", minimum=0)
    device: str = setting("auto", help=DEVICE_HELP)
    dtype: str = setting("auto", help=DTYPE_HELP)

    def check(self) -> BenchSettings:
        validate(self)
        check_device_name(self.device)
        check_dtype_name(self.dtype)
        return self

    def lengths(self, limit: int | None) -> tuple[int, int]:
        """Prompt and new tokens: as given, else 512 and 64 cut to fit the model's ``limit`` positions."""
        new = self.new_tokens or (min(64, max(2, limit // 4)) if limit else 64)
        prompt = self.prompt_len or (max(1, min(512, limit - new)) if limit else 512)
        if limit and prompt + new > limit:
            raise SettingError(
                "prompt_len", f"{{name}} + --new-tokens = {prompt + new} exceeds the model's {limit} positions"
            )
        return prompt, new
