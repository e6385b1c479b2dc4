"""Decode benchmark: prefill latency, decode tokens/s and the KV cache each model really allocates.

Each model gets the same prompt (seeded random token ids) and generates the same number of tokens
greedily with ``generate``; after warm-up runs, every figure is the median of ``repeats`` runs with
its min-max spread. Decode speed is ``(N - 1) / (t(N new tokens) - t(1 new token))``, so prefill
is not counted in it. The KV cache is measured on the cache object ``generate`` returns (the bytes
of every layer's key and value tensors), next to the planner's arithmetic.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from mha2gqa.core.architecture import dims_of
from mha2gqa.core.bench_record import BenchModel, BenchRecord, BenchRun, KvCache, Speedup, Spread
from mha2gqa.core.dims import max_positions
from mha2gqa.core.text_table import Table
from mha2gqa.eval.greedy import greedy_generate
from mha2gqa.eval.settings import BenchSettings


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_generate(model, prompt: torch.Tensor, new_tokens: int):
    device = prompt.device
    _sync(device)
    t = time.perf_counter()
    out = greedy_generate(model, prompt, new_tokens, model.config.eos_token_id or 0, return_dict_in_generate=True)
    _sync(device)
    return time.perf_counter() - t, out


def cache_bytes(cache) -> tuple[int, int]:
    """(bytes of all key and value tensors, the sequence's tokens) of a transformers cache (a sliding
    layer holds fewer tokens than the sequence: its length is the cache's, not the layer's)."""
    total = 0
    tokens = 0
    for layer in cache.layers:
        if layer.keys is None:  # a layer that keeps no cache of its own
            continue
        for t in (layer.keys, layer.values):
            total += t.numel() * t.element_size()
        tokens = max(tokens, layer.keys.shape[-2])
    return total, max(tokens, int(cache.get_seq_length()))


@torch.inference_mode()
def bench_model(
    model, prompt_len: int, new_tokens: int, repeats: int = 5, warmup: int = 1, batch_size: int = 1, seed: int = 0
) -> BenchModel:
    """Prefill and decode timings and the measured KV cache of one model."""
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (batch_size, prompt_len), generator=gen).to(device)
    for _ in range(warmup):
        _timed_generate(model, prompt, 2)
    prefill, full = [], []
    out = None
    for _ in range(repeats):
        prefill.append(_timed_generate(model, prompt, 1)[0])
        t, out = _timed_generate(model, prompt, new_tokens)
        full.append(t)
    decode = [(new_tokens - 1) * batch_size / max(f - p, 1e-9) for f, p in zip(full, prefill, strict=True)]
    # transformers renamed the output's `past_key_values` to `cache` (the old name warns from 5.2x on)
    cache = getattr(out, "cache", None) or out.past_key_values
    measured, tokens = cache_bytes(cache)
    dims = dims_of(model.config)
    element = next(iter(cache.layers)).keys.element_size()
    planned = dims.kv_cache_bytes(tokens, None, element) * batch_size  # per-layer counts and sliding windows too
    return BenchModel(
        num_kv_heads=dims.num_kv_heads,
        decode_tokens_per_second=Spread.of(decode),
        parameters=sum(p.numel() for p in model.parameters()),
        prefill_seconds=Spread.of(prefill),
        kv_cache=KvCache(measured, planned, tokens, measured / (tokens * batch_size), element),
    )


def run_bench(original: str, converted: str | None, s: BenchSettings) -> BenchRecord:
    """Benchmark ``original`` (and ``converted``), one model in memory at a time, with the same
    prompt; returns the ``bench --output`` record (schema :data:`~mha2gqa.core.records.BENCH_SCHEMA`)
    with ``converted_vs_original`` (decode speed-up, KV-cache ratio) for a pair."""
    from mha2gqa.core.models import load_model, resolve_device, resolve_dtype

    dev = resolve_device(s.device)
    dt = resolve_dtype(s.dtype, dev)
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    models: dict[str, BenchModel] = {}
    prompt = new = 0
    for name, path in (("original", original), ("converted", converted)):
        if path is None:
            continue
        loaded = load_model(path, dev, dt)
        prompt, new = s.lengths(max_positions(loaded.model.config))
        figures = bench_model(loaded.model, prompt, new, s.repeats, s.warmup, s.batch_size)
        models[name] = dataclasses.replace(figures, path=path)
        del loaded
    speedup = None
    if len(models) == 2:
        o, c = models["original"], models["converted"]
        speedup = Speedup(
            c.decode_tokens_per_second.median / o.decode_tokens_per_second.median,
            c.kv_cache.measured_bytes / o.kv_cache.measured_bytes,
        )
    run = BenchRun(prompt, new, s.batch_size, s.repeats, s.warmup, str(dev), str(dt), device_name)
    return BenchRecord(run, models, speedup)


def bench_lines(record: BenchRecord) -> list[str]:
    """The terminal's view of a :func:`run_bench` record: settings, one row per model, the ratios."""
    s = record.settings
    lines = [
        f"{s.prompt_len}-token prompt, {s.new_tokens} new tokens, batch {s.batch_size}, {s.device} "
        f"{s.dtype.removeprefix('torch.')}, median of {s.repeats} [min-max]"
    ]
    table = Table(["model", "KV heads", "prefill ms", "decode tok/s", "KV cache bytes/token", "vs planned"])
    for name, m in record.models.items():
        p, d, kv = m.prefill_seconds, m.decode_tokens_per_second, m.kv_cache
        table.add(
            name,
            m.num_kv_heads,
            f"{p.median * 1e3:.1f} [{p.min * 1e3:.1f}-{p.max * 1e3:.1f}]",
            f"{d.median:.1f} [{d.min:.1f}-{d.max:.1f}]",
            f"{kv.bytes_per_token:,.0f}",
            f"{kv.measured_bytes / kv.planned_bytes - 1:+.1%}",
        )
    lines += table.text()
    ratio = record.converted_vs_original
    if ratio:
        lines.append(
            f"converted: decode {ratio.decode_speedup:.2f}x, KV cache {ratio.kv_cache_ratio:.1%} of the original"
        )
    return lines
