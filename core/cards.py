"""Model cards (README.md with YAML front matter) of converted checkpoints, rendered from their
record alone (``mha2gqa_conversion.json``; an uptrained model's card, :mod:`mha2gqa.uptrain.record`,
ends with this one)."""

from __future__ import annotations

import dataclasses
import json

import yaml

from mha2gqa.core.conversion_record import O_SOLVED, ConversionRecord, Facts, Refit, StageGuard
from mha2gqa.core.records import CONVERSION_RECORD

_PER_LAYER_NOTE = (
    "Each layer has its own KV-head count (`num_key_value_heads_per_layer` in `config.json`). Load it with "
    "mha2gqa's tools, or with transformers: `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)` "
    "(the class is in `modeling_mha2gqa.py`, written by mha2gqa).\n\n"
)


def _serving(conv: Facts) -> str:
    """The per-layer checkpoint's serving form, as the conversion wrote it."""
    form = conv.serving_form
    if not form:
        return ""
    runtimes = (
        "vLLM serves it as `DeciLMForCausalLM` (with `--trust-remote-code`, as for NVIDIA's Nemotron-NAS "
        "models) and llama.cpp's converter reads it as its `deci` architecture."
        if "also written" in form
        else "Serving engines that take one KV-head count for all layers cannot run it."
    )
    return f"Serving: {form[0].upper()}{form[1:]}. {runtimes}\n\n"


def _retargeted(conv: Facts) -> str:
    """The class the source was re-expressed in, and where that class runs."""
    moved, text = conv.retarget, ""
    if moved:
        text += (
            f"Re-targeted from `{moved.source_class}` to `{moved.target_class}` (exact at the same head "
            f"count): {moved.description}.\n\n"
        )
    if conv.runs_in:
        text += f"Runs in: {conv.runs_in}.\n\n"
    return text


def changes(conv: Facts) -> str:
    """What the conversion changed, in words: method, grouping, and every rewritten tensor."""
    if not conv.changed:
        return "The KV-head count did not change: every tensor is a byte-for-byte copy of the source."
    how = f"method `{conv.method}`" + (f" ({conv.method_summary})" if conv.method_summary else "")
    if conv.grouping != "contiguous":
        how += f", grouping `{conv.grouping}` ({conv.grouping_summary}; query heads move with their KV heads)"
    roles = conv.rewrites or ["k", "v"]
    scope = (
        "Only the attention K/V" if set(roles) <= {"k", "v"} else "The attention " + "/".join(r.upper() for r in roles)
    )
    listed = ", ".join(f"`{t}`" for t in conv.rewritten)
    return (
        f"Converted with {how}. {scope} projections changed ({listed}), and `num_key_value_heads` in "
        "`config.json`; every other tensor is a byte-for-byte copy of the source."
    )


def guard_summary(guard: StageGuard) -> str:
    """The stage guard in words: where it measured, and each stage kept or undone with its figures."""
    if not guard.stages:
        return guard.where
    stages = "; ".join(stage.line() for stage in guard.stages)
    where = guard.where + "".join(f", and {s}" for s in guard.sources or [])
    return f"next-token KL to the original and top-1 agreement on {where}, after each stage: {stages}"


def refit_summary(refit: Refit) -> str:
    """``--refit`` in words: what was fitted on what, and each layer's held-out error before -> after."""
    layers = "; ".join(
        f"layer {r.layer}: {r.loss_before:.3g} → {r.loss_after:.3g}"
        + (" (kept the merge)" if r.kept else "")
        + (f" ({O_SOLVED}, ridge {r.o_ridge:g})" if r.o_ridge is not None else "")
        for r in refit.layers
    )
    return (
        f"every changed layer's {'/'.join(refit.params)} refitted on {refit.tokens:,} tokens of `{refit.data}` "
        f"to reproduce the original's {refit.target} ({refit.windows} windows fitted, {refit.heldout_windows} "
        f"held out{BF16_REFIT if refit.precision == 'bf16' else ''}); held-out {refit.error} "
        f"before → after: {layers}"
    )


#: what the card adds to a refit run in bf16 (:attr:`Refit.precision`)
BF16_REFIT = ", calibration, Adam steps and stream passes (attention in float32) in bf16 autocast"


def _head_sharing(conv: Facts) -> str:
    """Which query heads share each KV head (per layer: how many, consecutive ones sharing)."""
    if conv.num_kv_heads_per_layer:
        return "; ".join(
            f"layer {i}: {conv.num_heads // g} query heads per KV head"
            for i, g in enumerate(conv.num_kv_heads_per_layer)
        )
    return "; ".join(
        f"KV {j}: q {g[0]}-{g[-1]}" if len(g) > 1 else f"KV {j}: q {g[0]}"
        for j, g in enumerate(conv.query_heads_per_kv_head)
    )


def _allocation_summary(allocation) -> str:
    """The model card's line for a ``--per-layer auto`` allocation."""
    uniform = ", ".join(f"G = {g}: {c:.4f}" for g, c in allocation.uniform_cost.items())
    how = f"{allocation.budget_kv_heads} KV heads in all ({allocation.average_kv_heads:g} per layer), chosen"
    return (
        f"{how} from calibration: cost {allocation.cost:.4f} ({allocation.cost_measure}); uniform "
        f"{uniform or 'not within the budget'}"
    )


def front_matter(base_model: str | None, tags: list[str]) -> str:
    """The card's YAML metadata: ``base_model`` only where it is a Hugging Face model id (a local
    folder's name would link to another model), the library and the tags."""
    front = {"base_model": base_model} if base_model else {}
    front |= {"library_name": "transformers", "tags": ["mha2gqa", "gqa", "grouped-query-attention", *tags]}
    return "---\n" + yaml.safe_dump(front, sort_keys=False) + "---\n\n"


def _calibration_row(calibration) -> str:
    """The calibration text by name (never a path), with its sha256 where it is a file."""
    sha = calibration.text.sha256 if calibration.text else None
    own = f"; {calibration.own.line()}" if calibration.own else ""
    named = f"`{calibration.data}`" + (f" (sha256 `{sha[:16]}`…)" if sha else "")
    return f"{named}, {calibration.tokens:,} tokens{own}"


def _without_sketches(conv: Facts) -> Facts:
    """``conv`` with its texts' line sketches left out: they are for ``eval``, in the record, not for a reader."""

    def bare(step):
        return dataclasses.replace(step, text=dataclasses.replace(step.text, lines="")) if step and step.text else step

    return dataclasses.replace(conv, calibration=bare(conv.calibration), refit=bare(conv.refit))


def model_card(record: ConversionRecord) -> str:
    """A Hugging Face model card describing the conversion in ``record``."""
    src, conv = record.source, record.conversion
    base = src.name
    rows = [
        ("source", f"`{base}`" + (f" @ `{src.revision}`" if src.revision else "")),
        ("family", record.family),
        ("recipe", f"`{conv.recipe}`"),
        ("method", f"`{conv.method}`"),
        ("grouping", f"`{conv.grouping}`"),
        ("query heads", conv.num_heads),
        ("KV heads", f"{conv.num_kv_heads_before} → {conv.kv_heads_after}"),
        ("head_dim", conv.head_dim),
        ("layers", conv.num_layers),
        (
            "KV cache per token",
            f"{conv.kv_cache_bytes_per_token_before:,} → {conv.kv_cache_bytes_per_token_after:,} bytes "
            f"({conv.kv_cache_dtype})",
        ),
        *([("KV cache a sequence", conv.windowed_cache.line())] if conv.windowed_cache else []),
        ("head sharing", _head_sharing(conv)),
        ("mha2gqa", record.mha2gqa_version),
    ]
    if conv.per_layer_allocation:
        rows.append(("per-layer allocation", _allocation_summary(conv.per_layer_allocation)))
    calibration = conv.calibration
    if calibration and calibration.data:
        rows.insert(4, ("calibration", _calibration_row(calibration)))
    if conv.refit:
        rows.append(("refit", refit_summary(conv.refit)))
    if conv.guard:
        rows.append(("stage guard", guard_summary(conv.guard)))
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    quality = (
        "Training-free conversions lose quality (mean pooling on RoPE decoders especially); "
        "evaluate with `mha2gqa eval` and uptrain before use."
        if not conv.refit
        else "Each changed layer was refitted after the merge to reproduce the original's layer outputs, which "
        "recovers most of a merge's loss; evaluate with `mha2gqa eval` (on text unlike the calibration text too) "
        "before use."
    )
    facts = _without_sketches(conv).to_dict()
    return (
        front_matter(src.repo_id, [record.family])
        + f"# {base} as grouped-query attention ({conv.kv_heads_after} KV heads)\n\n"
        + (_PER_LAYER_NOTE + _serving(conv) if conv.num_kv_heads_per_layer else "")
        + _retargeted(conv)
        + f"{changes(conv)}\n\n{quality}\n\n| setting | value |\n|---|---|\n{table}\n\n"
        f"Exact settings: `{CONVERSION_RECORD}`.\n\n```json\n{json.dumps(facts, indent=2)}\n```\n"
    )
