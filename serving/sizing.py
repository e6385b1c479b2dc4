"""KV-cache and memory planning from ``config.json`` alone (no weights, no torch): parameter
counts from the family's declared terms, KV bytes from :class:`~mha2gqa.core.dims.AttentionDims`.
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mha2gqa.core.architecture import dims_of, resolve
from mha2gqa.core.cache_layers import SIZING_WINDOW, cache_bytes, sizing_window
from mha2gqa.core.dims import AttentionDims, config_value, max_positions
from mha2gqa.core.dtypes import KV_DTYPES, by_name
from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.expressions import evaluate_expression
from mha2gqa.core.families import TERM_NAMES, Family
from mha2gqa.core.settings import setting


@dataclass(frozen=True)
class Gpu:
    """An accelerator as its datasheet gives it: memory (bytes, as marketed: 10^9), memory bandwidth
    (bytes/s) and dense bf16 tensor throughput (FLOP/s, without sparsity)."""

    name: str
    memory: int
    bandwidth: float
    bf16_flops: float


#: Tokens per sequence ``plan`` and ``inspect`` size for, when the model allows as many.
PLAN_WINDOW = SIZING_WINDOW

#: Presets for ``plan --gpu``; each figure is from the vendor's datasheet named beside it.
GPUS: dict[str, Gpu] = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5: 80 GB HBM3, 3.35 TB/s, BF16 1,979 TFLOPS with sparsity)
    "h100-sxm": Gpu("H100 SXM 80GB", 80 * 10**9, 3.35e12, 989e12),
    # same datasheet (PCIe: 80 GB HBM2e, 2.0 TB/s, BF16 1,513 TFLOPS with sparsity)
    "h100-pcie": Gpu("H100 PCIe 80GB", 80 * 10**9, 2.0e12, 756e12),
    # same datasheet (NVL: 94 GB HBM3, 3.9 TB/s, BF16 1,671 TFLOPS with sparsity)
    "h100-nvl": Gpu("H100 NVL 94GB", 94 * 10**9, 3.9e12, 835e12),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM: 141 GB HBM3e, 4.8 TB/s, BF16 1,979 TFLOPS with sparsity)
    "h200": Gpu("H200 SXM 141GB", 141 * 10**9, 4.8e12, 989e12),
    # NVIDIA A100 Tensor Core GPU datasheet (80GB SXM: 2,039 GB/s; BF16 312 TFLOPS dense)
    "a100-80gb": Gpu("A100 SXM 80GB", 80 * 10**9, 2.039e12, 312e12),
    # same datasheet (40GB: 1,555 GB/s; BF16 312 TFLOPS dense)
    "a100-40gb": Gpu("A100 40GB", 40 * 10**9, 1.555e12, 312e12),
    # NVIDIA L40S datasheet (48 GB GDDR6, 864 GB/s, BF16 362.05 TFLOPS dense)
    "l40s": Gpu("L40S 48GB", 48 * 10**9, 864e9, 362e12),
    # NVIDIA L4 datasheet (24 GB GDDR6, 300 GB/s, BF16 242 TFLOPS with sparsity)
    "l4": Gpu("L4 24GB", 24 * 10**9, 300e9, 121e12),
    # NVIDIA A10 datasheet (24 GB GDDR6, 600 GB/s, BF16 125 TFLOPS dense)
    "a10": Gpu("A10 24GB", 24 * 10**9, 600e9, 125e12),
    # NVIDIA Ada GPU architecture whitepaper, RTX 4090 (24 GB GDDR6X, 1,008 GB/s, BF16 165.2 TFLOPS FP32 accumulate)
    "rtx-4090": Gpu("GeForce RTX 4090", 24 * 10**9, 1.008e12, 165.2e12),
    # NVIDIA Ampere GA102 whitepaper, RTX 3090 (24 GB GDDR6X, 936 GB/s, BF16 71 TFLOPS FP32 accumulate)
    "rtx-3090": Gpu("GeForce RTX 3090", 24 * 10**9, 936e9, 71e12),
    # AMD Instinct MI300X datasheet (192 GB HBM3, 5.3 TB/s, BF16 1,307.4 TFLOPS dense)
    "mi300x": Gpu("Instinct MI300X", 192 * 10**9, 5.3e12, 1307.4e12),
}


@dataclass
class PlanSettings:
    """What ``mha2gqa plan`` sizes a model for."""

    gpu: str | None = setting(
        None, help="A GPU preset: its memory, bandwidth and bf16 throughput.", choices=tuple(GPUS)
    )
    gpu_memory: str | None = setting(
        None, help="Accelerator memory, e.g. 80GB, 24GiB [default: the --gpu preset's, else 80GB]."
    )
    bandwidth: str | None = setting(
        None,
        help="Memory bandwidth per second, e.g. 3.35TB, 900GB [default: the --gpu "
        "preset's; without either, no throughput estimate].",
    )
    tflops: float | None = setting(
        None,
        help="Dense bf16 TFLOP/s for the prefill estimate [default: the --gpu preset's].",
        above=0,
        maximum=1e6,  # an exaFLOP/s: far beyond any accelerator; anything more is a typing mistake
    )
    utilization: float = setting(
        0.5, help="Share of --tflops prefill reaches (model FLOPs utilisation).", above=0, maximum=1
    )
    seq_len: int | None = setting(
        None,
        help=f"Tokens per sequence (prompt + generation) [default: min({PLAN_WINDOW}, the model's positions)].",
        minimum=1,
    )
    dtype: str = setting("bf16", help="KV-cache dtype.", choices=KV_DTYPES)
    weights_dtype: str | None = setting(None, help="Weights dtype [default: --dtype].", choices=KV_DTYPES)

    def window(self, positions: int | None) -> int:
        """Tokens per sequence: ``seq_len``, else :data:`PLAN_WINDOW` cut to the model's ``positions``."""
        return self.seq_len or sizing_window(positions)

    def hardware(self) -> Gpu | None:
        """The GPU to plan for (preset, overridden by the explicit values), None for memory-only
        plans (no --gpu and no --bandwidth)."""
        from mha2gqa.core.errors import SettingError
        from mha2gqa.core.units import parse_size

        preset = GPUS.get(self.gpu) if self.gpu else None

        def size(name: str, text: str | None, default: float | None) -> float | None:
            if text is None:
                return default
            try:
                return parse_size(text.removesuffix("/s"))
            except Mha2GqaError as e:
                raise SettingError(name, f"{{name}}: {e}") from None

        memory = size("gpu_memory", self.gpu_memory, preset.memory if preset else 80 * 10**9)
        bandwidth = size("bandwidth", self.bandwidth, preset.bandwidth if preset else None)
        flops = self.tflops * 1e12 if self.tflops else preset.bf16_flops if preset else None
        name = preset.name if preset else "custom"
        return Gpu(name, int(memory), bandwidth or 0.0, flops or 0.0)


def load_config(model: str, revision: str | None = None) -> dict[str, Any]:
    """``config.json`` of a local folder or file, or of a hub id (only that file is downloaded)."""
    from mha2gqa.core.checkpoint import read_config

    path = Path(model).expanduser()
    if path.is_dir():
        return read_config(path)
    if path.is_file():
        return read_config(path.parent, path.name)
    from huggingface_hub import hf_hub_download

    try:
        return read_config(Path(hf_hub_download(model, "config.json", revision=revision)).parent)
    except Mha2GqaError:
        raise
    except Exception as e:
        known = known_config(model) if revision is None else None
        if known is not None:  # offline, or the hub unreachable: a well-known model's shipped copy
            sys.stderr.write(f"note: {model}: the hub cannot be reached; planning with mha2gqa's copy of its config\n")
            return known
        raise Mha2GqaError(
            f"{model}: no such folder, and its config.json cannot be fetched from the hub ({type(e).__name__})"
        ) from None


def known_config(model: str) -> dict[str, Any] | None:
    """mha2gqa's copy of a well-known hub model's ``config.json`` (``serving/known_configs.json``), or None."""
    import json
    from importlib import resources

    data = json.loads(resources.files("mha2gqa.serving").joinpath("known_configs.json").read_text(encoding="utf-8"))
    return data.get(model) if not model.startswith("_") else None


def count_parameters(config: dict[str, Any], family: Family, num_kv_heads: int | None = None) -> int | None:
    """Parameters of the model ``config`` describes (with ``num_kv_heads`` KV heads), from the
    family's declared terms; None when the family declares none or the config lacks a size."""
    if not family.parameter_terms:
        return None
    dims = dims_of(config)
    values: dict[str, int] = {}
    for short, key in TERM_NAMES.items():
        value = {"head_dim": dims.head_dim, "num_key_value_heads": dims.num_kv_heads}.get(key, config.get(key))
        if isinstance(value, bool) or not isinstance(value, int):
            return None
        values[short] = value
    if num_kv_heads is not None:
        values["G"] = num_kv_heads
    defaults = dict(family.parameter_defaults)
    total = 0
    for expression, condition in family.parameter_terms:
        if condition is not None:
            key = condition.lstrip("!")
            on = bool(config_value(config, key, defaults[key]))
            if on == condition.startswith("!"):
                continue
        total += evaluate_expression(expression, values)
    return total


@dataclass
class ModelShape:
    """What the planner needs to know about a model."""

    family: str
    architecture: str
    dims: AttentionDims
    parameters: int
    kv_parameters_per_head: int  # parameters that exist once per KV head (all layers)
    weights_dtype: str
    lookup_parameters: int = 0  # an untied input embedding: read per token, never multiplied
    converts_as: str | None = None  # the class a re-targeted source is converted in (GPT-2 -> GPTBigCode...)
    max_positions: int | None = None  # the positions the model was made for (None: its config does not say)

    def length_note(self, seq_len: int) -> list[str]:
        """A note when ``seq_len`` is longer than the model's positions (the sizes are then hypothetical)."""
        if self.max_positions and seq_len > self.max_positions:
            return [f"note: {seq_len:,}-token sequences are longer than the model's {self.max_positions:,} positions"]
        return []

    def parameters_at(self, num_kv_heads: float) -> float:
        return self.parameters - (self.dims.num_kv_heads - num_kv_heads) * self.kv_parameters_per_head


def model_shape(config: dict[str, Any]) -> ModelShape:
    """Family, head counts and parameter counts. Counts come from the family's declared terms (no
    torch); a family without them is counted exactly by building its model class on ``meta``."""
    arch = resolve(config)  # a re-targeted source is planned as the class it becomes
    source, config, family, dims = arch.source_config, arch.config, arch.family, arch.dims
    params = count_parameters(config, family)
    if params is not None:
        per_head = params - count_parameters(config, family, dims.num_kv_heads - 1)
        if dims.kv_heads_per_layer:  # the terms count the largest count; each layer holds only its own heads
            params -= sum(dims.num_kv_heads - g for g in dims.kv_heads_per_layer) * per_head // dims.num_layers
    else:  # the model class built on meta (per-layer counts included)
        params, per_head = _meta_counts(config, family, dims)
    if source is not config:  # but its own parameters are the source's (folded norms, Phi's lm_head bias differ)
        params = _meta_total(source)
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    converts_as = (config.get("architectures") or [None])[0] if source is not config else None
    tied = bool(config_value(config, "tie_word_embeddings", dict(family.parameter_defaults).get("tie_word_embeddings")))
    vocab = config_value(config, "vocab_size")
    lookup = 0 if tied or not isinstance(vocab, int) else vocab * dims.hidden_size
    positions = max_positions(source)
    return ModelShape(family.family, arch.name, dims, params, per_head, dtype, lookup, converts_as, positions)


def _meta_total(config: dict[str, Any]) -> int:
    """Parameters of the model class built on ``meta`` from ``config`` (tied ones once)."""
    from mha2gqa.core.expected_tensors import expected_tensors

    expected = expected_tensors(config)
    return sum(math.prod(shape) for name, shape in expected.shapes.items() if name not in expected.tied)


def _meta_counts(config: dict[str, Any], family: Family, dims: AttentionDims) -> tuple[int, int]:
    """``(parameters, parameters per KV head)`` from the model class built on ``meta``."""
    params = _meta_total(config)
    if dims.num_kv_heads == 1:
        return params, 0
    lower = 1 if family.flag_only else dims.num_kv_heads - 1  # GPTBigCode holds 1 or H
    fewer = {**config, **family.kv_config(lower)}
    return params, (params - _meta_total(fewer)) // (dims.num_kv_heads - lower)


@dataclass
class PlanRow:
    num_kv_heads: float  # KV heads per layer (on average, for a per-layer plan)
    kv_bytes_per_token: int  # every layer's K and V of one token (a full-attention layer's rate)
    kv_bytes_per_sequence: int  # the cache one sequence of the plan's length holds (sliding layers: their window)
    weights_bytes: int
    max_sequences: int
    kv_heads_per_layer: list[int] | None = None  # a per-layer plan's count of each layer
    #: each layer's K and V bytes of one token, and the most tokens it holds (None: all), for
    #: :meth:`kv_bytes` at any context
    layer_bytes: list[int] | None = None
    layer_spans: list[int | None] | None = None

    @property
    def label(self) -> str:
        return ",".join(map(str, self.kv_heads_per_layer)) if self.kv_heads_per_layer else str(self.num_kv_heads)

    def kv_bytes(self, tokens: float) -> float:
        """The KV cache one sequence holds at ``tokens`` of context (each layer up to its window)."""
        if not self.layer_bytes:
            return self.kv_bytes_per_token * tokens
        return cache_bytes(self.layer_bytes, self.layer_spans, tokens)


def capacity_rows(
    shape: ModelShape,
    gpu_memory: int,
    seq_len: int,
    kv_dtype: str,
    weights_bytes_per_param: int,
    per_layer: tuple[int, ...] | None = None,
) -> list[PlanRow]:
    """For every valid KV-head count G (the divisors of the current count), and ``per_layer`` counts
    when given: KV bytes per token and per sequence, weights, and how many sequences of ``seq_len``
    fit in ``gpu_memory`` (all memory not taken by weights counted as KV cache; activations and
    fragmentation not modelled)."""
    element = by_name(kv_dtype).bytes
    d = shape.dims
    options: list[tuple[float, int, list[int] | None]] = [
        (g, d.kv_cache_bytes_per_token(g, element), None) for g in d.valid_kv_heads()
    ]
    if per_layer:  # parameters and KV bytes are linear in the heads, so the mean count gives both
        options.append((sum(per_layer) / d.num_layers, d.kv_cache_bytes_per_token(per_layer, element), list(per_layer)))
    rows = []
    for g, per_token, heads in options:
        weights = round(shape.parameters_at(g)) * weights_bytes_per_param
        free = gpu_memory - weights
        counts = heads or [int(g)] * d.num_layers
        sequence = d.kv_cache_bytes(seq_len, counts, element)
        layer_bytes = [2 * c * d.head_dim * element for c in counts]
        spans = list(d.cache_spans) if d.cache_spans else None
        fit = max(free // sequence, 0) if sequence else 0
        rows.append(PlanRow(g, per_token, sequence, weights, fit, heads, layer_bytes if spans else None, spans))
    return rows


def describe(shape: ModelShape) -> dict[str, Any]:
    return {
        "family": shape.family,
        "architecture": shape.architecture,
        "converts_as": shape.converts_as,
        **asdict(shape.dims),
        "parameters": shape.parameters,
        "weights_dtype": shape.weights_dtype,
        "kv_cache_bytes_per_token": {
            name: shape.dims.kv_cache_bytes_per_token(None, by_name(name).bytes) for name in KV_DTYPES
        },
    }


@dataclass
class Throughput:
    """Estimated decode and prefill speed of one KV-head count on one GPU (bandwidth roofline)."""

    num_kv_heads: int
    max_batch: int
    step_seconds_batch1: float
    tokens_per_second_batch1: float
    step_seconds_max: float | None  # at the max batch (None when not even one sequence fits)
    tokens_per_second_per_sequence_max: float | None
    tokens_per_second_aggregate_max: float | None
    prefill_seconds: float | None  # one sequence of seq_len tokens, None without a FLOP rate


def decode_step_seconds(row: PlanRow, batch: int, mean_context: float, bandwidth: float) -> float:
    """One decode step reads every weight once and each sequence's KV cache at its context:
    ``(weights + batch x KV bytes at mean_context) / bandwidth`` (sliding layers read their window)."""
    return (row.weights_bytes + batch * row.kv_bytes(mean_context)) / bandwidth


def prefill_flops(shape: ModelShape, num_kv_heads: int, tokens: int) -> float:
    """FLOPs of one forward pass over ``tokens`` tokens: ``2 x`` the matmul parameters per token (an
    untied input embedding is a lookup, not counted; a tied one is the output projection) plus causal
    attention, ``2 x L x H x d x T^2`` (QK^T and PV over the lower triangle)."""
    d = shape.dims
    matmul = shape.parameters_at(num_kv_heads) - shape.lookup_parameters
    return 2.0 * matmul * tokens + 2.0 * d.num_layers * d.num_heads * d.head_dim * tokens**2


def throughput(shape: ModelShape, rows: list[PlanRow], gpu: Gpu, seq_len: int, utilization: float) -> list[Throughput]:
    """For each row: decode tokens/s at batch 1 and at the largest batch that fits, with the KV
    cache read at the mean context ``seq_len / 2`` (a sequence's average over its generation, or a
    server's sequences spread over their lifetimes), and prefill seconds of one ``seq_len`` prompt at
    ``utilization`` of the GPU's FLOP rate. A roofline: kernels, scheduling and activations are not
    modelled, so real decode is slower (typically 60-85% of it at batch 1)."""
    mean_context = seq_len / 2
    out = []
    for r in rows:
        one = decode_step_seconds(r, 1, mean_context, gpu.bandwidth)
        full = decode_step_seconds(r, r.max_sequences, mean_context, gpu.bandwidth) if r.max_sequences else None
        prefill = None
        if gpu.bf16_flops:
            prefill = prefill_flops(shape, r.num_kv_heads, seq_len) / (gpu.bf16_flops * utilization)
        out.append(
            Throughput(
                r.num_kv_heads,
                r.max_sequences,
                one,
                1 / one,
                full,
                1 / full if full else None,
                r.max_sequences / full if full else None,
                prefill,
            )
        )
    return out


def throughput_plot(rows: list[PlanRow], gpu: Gpu, seq_len: int, model: str) -> bytes:
    """Aggregate decode tokens/s against batch size (1 up to what fits), one line per KV-head count."""
    from mha2gqa.core.figures import OKABE_ITO, figure, png

    plt, fig = figure(6.4, 3.8)
    ax = fig.add_subplot()
    for i, r in enumerate(rows):
        if not r.max_sequences:
            continue
        batches = sorted({1, r.max_sequences, *(b for b in (2**k for k in range(20)) if b < r.max_sequences)})
        agg = [b / decode_step_seconds(r, b, seq_len / 2, gpu.bandwidth) for b in batches]
        ax.plot(
            batches,
            agg,
            "-",
            marker="o",
            ms=3,
            color=OKABE_ITO[i % len(OKABE_ITO)],
            label=f"{r.label} KV heads (max batch {r.max_sequences:,})",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent sequences (batch)")
    ax.set_ylabel("decode tokens/s (all sequences)")
    ax.set_title(f"{model} on {gpu.name}, {seq_len:,}-token sequences (bandwidth roofline)", fontsize=9)
    ax.legend(frameon=False, fontsize=8)
    return png(plt, fig)
