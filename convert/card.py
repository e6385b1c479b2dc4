"""The model card (README.md with YAML front matter) and the machine-readable conversion record."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

RECORD_NAME = "mha2gqa_conversion.json"


def model_card(record: dict[str, Any]) -> str:
    """A Hugging Face model card describing the conversion in ``record``."""
    src = record["source"]
    base = src.get("repo_id") or Path(src["path"]).name
    conv = record["conversion"]
    front = {
        "base_model": base,
        "library_name": "transformers",
        "tags": ["mha2gqa", "gqa", "grouped-query-attention", record["family"]],
    }
    groups = "; ".join(
        f"KV {j}: q {g[0]}-{g[-1]}" if len(g) > 1 else f"KV {j}: q {g[0]}"
        for j, g in enumerate(conv["query_heads_per_kv_head"])
    )
    rows = [
        ("source", f"`{base}`" + (f" @ `{src['revision']}`" if src.get("revision") else "")),
        ("family", record["family"]),
        ("method", f"`{conv['method']}`"),
        ("query heads", conv["num_heads"]),
        ("KV heads", f"{conv['num_kv_heads_before']} → {conv['num_kv_heads_after']}"),
        ("head_dim", conv["head_dim"]),
        ("layers", conv["num_layers"]),
        (
            "KV cache per token",
            f"{conv['kv_cache_bytes_per_token_before']:,} → {conv['kv_cache_bytes_per_token_after']:,} bytes "
            f"({conv['kv_cache_dtype']})",
        ),
        ("head sharing", groups),
        ("mha2gqa", record["mha2gqa_version"]),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    quality = (
        "Training-free conversions lose quality (mean pooling on RoPE decoders especially); "
        "evaluate with `mha2gqa eval` and uptrain before use."
    )
    return (
        "---\n" + yaml.safe_dump(front, sort_keys=False) + "---\n\n"
        f"# {base} as grouped-query attention ({conv['num_kv_heads_after']} KV heads)\n\n"
        f"Converted from multi-head to grouped-query attention with "
        f"mha2gqa (method `{conv['method']}`). Only the attention K/V projections "
        "and `num_key_value_heads` in `config.json` changed; every other tensor is a byte-for-byte "
        f"copy of the source.\n\n{quality}\n\n| setting | value |\n|---|---|\n{table}\n\n"
        f"Exact settings: `{RECORD_NAME}`.\n\n```json\n{json.dumps(conv, indent=2)}\n```\n"
    )
