"""What a model costs to serve, as ``mha2gqa inspect`` and ``mha2gqa plan`` report it: its shape and
KV-cache bytes, the plan for every KV-head count, the roofline throughput, and a measured
``bench --output`` file beside the estimate. Config only: no weights, no torch.

Each report is a value with its JSON form and its terminal lines, so the CLI only prints.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mha2gqa.core.bench_record import BenchRecord
from mha2gqa.core.dims import parse_kv_heads_list
from mha2gqa.core.dtypes import KV_DTYPES, by_name
from mha2gqa.core.errors import Mha2GqaError, SettingError
from mha2gqa.core.text_table import Table
from mha2gqa.core.units import format_bytes
from mha2gqa.serving.sizing import (
    Gpu,
    ModelShape,
    PlanRow,
    PlanSettings,
    capacity_rows,
    decode_step_seconds,
    describe,
    load_config,
    model_shape,
    throughput,
)


@dataclass(frozen=True)
class Report:
    """A report: ``data`` is its JSON form, ``lines`` what the terminal shows."""

    data: dict[str, Any]
    lines: list[str]


def attention_kind(shape: ModelShape) -> str:
    """``MHA``, ``MQA``, ``GQA`` or ``GQA per layer: 8,4,...``."""
    d = shape.dims
    if d.kv_heads_per_layer:
        return f"GQA per layer: {','.join(map(str, d.kv_heads_per_layer))}"
    return "MHA" if d.num_kv_heads == d.num_heads else ("MQA" if d.num_kv_heads == 1 else "GQA")


def inspect_model(model: str, seq_len: int | None, batch_size: int, revision: str | None = None) -> Report:
    """Family, head counts, exact parameters and KV-cache bytes of ``model`` (folder, config.json or
    hub id) for ``batch_size`` sequences of ``seq_len`` tokens."""
    from mha2gqa.core.settings import validate

    settings = validate(PlanSettings(seq_len=seq_len))
    shape = model_shape(load_config(model, revision))
    seq_len = settings.window(shape.max_positions)
    info = describe(shape)
    d = shape.dims
    info["kv_cache_bytes"] = {k: d.kv_cache_bytes(seq_len, None, by_name(k).bytes) * batch_size for k in KV_DTYPES}
    info.update(seq_len=seq_len, batch_size=batch_size)
    moved = f"converted as {shape.converts_as}, " if shape.converts_as else ""
    lines = [
        f"{model}: {shape.architecture} ({moved}family {shape.family}), {shape.parameters:,} parameters "
        f"({shape.weights_dtype})",
        f"  {d.num_layers} layers, hidden {d.hidden_size}, {d.num_heads} query heads, {d.num_kv_heads} KV "
        f"heads ({attention_kind(shape)}), head_dim {d.head_dim}",
    ]
    table = Table(["KV dtype", "bytes/token", f"KV cache @ {seq_len} x {batch_size}"])
    for name in KV_DTYPES:
        table.add(name, f"{info['kv_cache_bytes_per_token'][name]:,}", format_bytes(info["kv_cache_bytes"][name]))
    windows = [f"  {window_line(d)}"] if d.windowed else []
    return Report(info, lines + table.text(indent="  ") + windows + [f"  {n}" for n in shape.length_note(seq_len)])


def window_line(dims) -> str:
    """What the cache figures count for a model with sliding or cache-less layers."""
    return (
        f"{dims.window_note()}: the cache at N tokens counts each layer's tokens as transformers keeps "
        "them; bytes/token is a full-attention layer's rate"
    )


@dataclass(frozen=True)
class CapacityPlan:
    """``mha2gqa plan``'s answer for one model: rows per KV-head count, roofline throughput (empty
    without a bandwidth), and a measured benchmark beside the estimate when one was given."""

    model: str
    shape: ModelShape
    settings: PlanSettings
    gpu: Gpu
    rows: list[PlanRow]
    speed: list[Any]
    #: a measured benchmark beside the estimate (empty without one)
    bench_lines: tuple[str, ...] = ()
    #: where the throughput plot was written (None without ``plot_path``)
    plot: Path | None = None

    def to_dict(self) -> dict[str, Any]:
        s = self.settings
        return {
            "model": self.model,
            "gpu": dataclasses.asdict(self.gpu),
            "gpu_memory": self.gpu.memory,
            "seq_len": s.seq_len,
            "dtype": s.dtype,
            "utilization": s.utilization,
            "rows": [dataclasses.asdict(r) for r in self.rows],
            "throughput": [dataclasses.asdict(t) for t in self.speed],
        }

    def lines(self) -> list[str]:
        """The plan table and how throughput was estimated."""
        s, gpu, speed = self.settings, self.gpu, self.speed
        hw = f"{gpu.name}: {format_bytes(gpu.memory)}" + (f", {gpu.bandwidth / 1e12:.3g} TB/s" if gpu.bandwidth else "")
        head = f"{self.model}: {self.shape.dims.num_heads} query heads, {s.seq_len}-token sequences"
        out = [f"{head}, {hw}, {s.dtype} KV cache", *self.shape.length_note(s.seq_len)]
        if self.shape.dims.windowed:
            out.append(f"  {window_line(self.shape.dims)}")
        table = Table(
            ["KV heads", "KV bytes/token", "KV/sequence", "weights", "sequences that fit"]
            + (["tok/s @1", "tok/s/seq @max", "tok/s total @max", "prefill"] if speed else [])
        )
        for i, r in enumerate(self.rows):
            cells = [
                r.label,
                f"{r.kv_bytes_per_token:,}",
                format_bytes(r.kv_bytes_per_sequence),
                format_bytes(r.weights_bytes),
                f"{r.max_sequences:,}",
            ]
            if speed:
                t = speed[i]
                cells += [
                    f"{t.tokens_per_second_batch1:,.1f}",
                    f"{t.tokens_per_second_per_sequence_max:,.1f}" if t.max_batch else "-",
                    f"{t.tokens_per_second_aggregate_max:,.0f}" if t.max_batch else "-",
                    f"{t.prefill_seconds * 1e3:,.0f} ms" if t.prefill_seconds is not None else "-",
                ]
            table.add(*cells)
        out += table.text(indent="  ")
        if speed:
            prefill = "prefill: give --tflops"
            if gpu.bf16_flops:
                rate = f"{gpu.bf16_flops / 1e12:,.0f} TFLOP/s"
                prefill = f"prefill: one {s.seq_len:,}-token prompt at {s.utilization:.0%} of {rate}"
            out.append(
                f"  decode: bandwidth roofline, each step reads the weights and every sequence's KV cache at "
                f"the mean context ({s.seq_len // 2:,} tokens); {prefill}. Real decode is slower."
            )
        return out


def plan_capacity(
    model: str,
    settings: PlanSettings,
    revision: str | None = None,
    per_layer: str | None = None,
    bench_path: Path | None = None,
    plot_path: Path | None = None,
    overwrite: bool = False,
) -> CapacityPlan:
    """Plan ``model`` (config only) for every valid KV-head count, plus ``per_layer`` counts
    (comma-separated) when given, else the model's own when it is a per-layer checkpoint. A
    ``bench_path`` (a ``bench --output`` file) is checked to be of this model now, and ``plot_path``
    to be a destination this tool may write, so a mismatch is refused before anything prints; the
    plot (decode tokens/s against batch size) is written last."""
    from mha2gqa.core.output import check_destination, write_text
    from mha2gqa.core.settings import validate
    from mha2gqa.serving.sizing import throughput_plot

    s = validate(settings)
    gpu = s.hardware()
    inputs = {"MODEL": model, "--bench": bench_path}
    for option, given in (
        ("--bench compares with the estimate", bench_path),
        ("--plot draws decode throughput", plot_path),
    ):
        if given is not None and not gpu.bandwidth:
            raise SettingError("gpu", f"{option}: give {{name}} or --bandwidth")
    if plot_path is not None:
        check_destination(plot_path, overwrite, inputs, "--plot", folder=False)
    bench = BenchRecord.load(bench_path) if bench_path is not None else None
    shape = model_shape(load_config(model, revision))
    s = dataclasses.replace(s, seq_len=s.window(shape.max_positions))
    heads = shape.dims.kv_heads_per_layer  # a per-layer checkpoint is planned with its own counts too
    if per_layer is not None:
        heads = parse_kv_heads_list(per_layer)
        shape.dims.check_kv_heads_per_layer(heads)
    rows = capacity_rows(shape, gpu.memory, s.seq_len, s.dtype, by_name(s.weights_dtype or s.dtype).bytes, heads)
    speed = throughput(shape, rows, gpu, s.seq_len, s.utilization) if gpu.bandwidth else []
    result = CapacityPlan(model, shape, s, gpu, rows, speed)
    if bench is not None:  # refuses another model's benchmark before any output
        result = dataclasses.replace(result, bench_lines=tuple(bench_beside_estimate(bench, result)))
    if plot_path is not None:
        png = throughput_plot(result.rows, result.gpu, s.seq_len, Path(model).name or model)
        write_text(plot_path, png, "--plot", overwrite, inputs)
        result = dataclasses.replace(result, plot=plot_path)
    return result


def bench_beside_estimate(bench: BenchRecord, result: CapacityPlan) -> list[str]:
    """Each benchmarked model's measured decode tokens/s beside the roofline estimate for the same
    batch and context (refused when the benchmark is of another model)."""
    gpu = result.gpu
    settings = bench.settings
    by_heads = {r.num_kv_heads: r for r in result.rows}
    context = settings.prompt_len + settings.new_tokens / 2
    batch = settings.batch_size
    lines = [
        f"  bench ({settings.device_name or settings.device}, batch {batch}, mean context "
        f"{context:,.0f}) beside the estimate on {gpu.name}:"
    ]
    for name, m in bench.models.items():
        row = by_heads.get(m.num_kv_heads)
        if row is None or (m.parameters is not None and m.parameters != result.shape.parameters_at(row.num_kv_heads)):
            raise Mha2GqaError(
                f"--bench: its {name} model is not this model at {m.num_kv_heads} KV heads; "
                "benchmark this model, or plan the benchmarked one"
            )
        measured = m.decode_tokens_per_second.median
        estimate = batch / decode_step_seconds(row, batch, context, gpu.bandwidth)
        lines.append(
            f"    {name} ({row.num_kv_heads} KV heads): measured {measured:,.1f} tok/s, estimate "
            f"{estimate:,.1f} tok/s ({measured / estimate:.0%} of the roofline)"
        )
    return lines
