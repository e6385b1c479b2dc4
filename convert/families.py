"""Model families as data: which tensors hold the attention heads of each architecture.

Each family is one JSON file in ``architectures/``. Weight names are templates with ``{layer}``
(and ``{head}`` for per-head modules); ``.weight`` / ``.bias`` are appended to projection names.
Definitions are validated strictly: an unknown key is an error, so a typo cannot silently drop a
tensor from the conversion.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from mha2gqa.errors import Mha2GqaError

_TOP_KEYS = {"family", "description", "architectures", "model_types", "attention", "k_norm", "q_norm"}
_ATTN_KEYS = {"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj"}
_NORM_KEYS = {"name", "layout"}
NORM_LAYOUTS = ("shared", "rows", "indexed")


@dataclass(frozen=True)
class NormSpec:
    """A per-head q or k normalisation weight.

    ``layout``: ``shared`` (one ``[head_dim]`` weight for all heads, untouched by pooling),
    ``rows`` (one ``[heads * head_dim]`` vector, head-major) or ``indexed`` (one tensor per head,
    ``{head}`` in the name).
    """

    name: str
    layout: str


@dataclass(frozen=True)
class Family:
    """Where one architecture keeps its attention projections (templates with ``{layer}``)."""

    family: str
    description: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    o_proj: str
    q_proj: str | None = None
    k_proj: str | None = None
    v_proj: str | None = None
    qkv_proj: str | None = None  # fused [q; k; v] rows, split by sizes from the config
    k_norm: NormSpec | None = None
    q_norm: NormSpec | None = None

    @property
    def fused(self) -> bool:
        return self.qkv_proj is not None

    def modules(self) -> tuple[str, ...]:
        """The projection-module templates of one layer."""
        names = (self.qkv_proj,) if self.fused else (self.q_proj, self.k_proj, self.v_proj)
        return (*(n for n in names if n), self.o_proj)


def parse_family(data: dict[str, Any], origin: str = "<dict>") -> Family:
    """Validate one family definition; raises ``ValueError`` naming ``origin`` on any problem."""

    def fail(msg: str) -> ValueError:
        return ValueError(f"family definition {origin}: {msg}")

    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise fail(f"unknown keys {sorted(unknown)}")
    for key in ("family", "description", "architectures", "model_types", "attention"):
        if key not in data:
            raise fail(f"missing key {key!r}")
    attn = data["attention"]
    if not isinstance(attn, dict) or set(attn) - _ATTN_KEYS:
        raise fail(f"'attention' takes only {sorted(_ATTN_KEYS)}")
    separate = {"q_proj", "k_proj", "v_proj"}
    if "qkv_proj" in attn and separate & set(attn):
        raise fail("give either 'qkv_proj' or 'q_proj'/'k_proj'/'v_proj', not both")
    if "qkv_proj" not in attn and not separate <= set(attn):
        raise fail("'attention' needs 'q_proj', 'k_proj' and 'v_proj' (or a fused 'qkv_proj')")
    if "o_proj" not in attn:
        raise fail("'attention' needs 'o_proj'")
    for key, template in attn.items():
        if "{layer}" not in template:
            raise fail(f"attention.{key} must contain '{{layer}}'")
    norms: dict[str, NormSpec] = {}
    for key in ("q_norm", "k_norm"):
        if key not in data:
            continue
        spec = data[key]
        if not isinstance(spec, dict) or set(spec) != _NORM_KEYS:
            raise fail(f"{key} needs exactly {sorted(_NORM_KEYS)}")
        if spec["layout"] not in NORM_LAYOUTS:
            raise fail(f"{key}.layout must be one of {NORM_LAYOUTS}")
        if (spec["layout"] == "indexed") != ("{head}" in spec["name"]):
            raise fail(f"{key}: '{{head}}' must appear in the name exactly when layout is 'indexed'")
        norms[key] = NormSpec(spec["name"], spec["layout"])
    return Family(
        family=data["family"],
        description=data["description"],
        architectures=tuple(data["architectures"]),
        model_types=tuple(data["model_types"]),
        o_proj=attn["o_proj"],
        q_proj=attn.get("q_proj"),
        k_proj=attn.get("k_proj"),
        v_proj=attn.get("v_proj"),
        qkv_proj=attn.get("qkv_proj"),
        **norms,
    )


@cache
def families() -> dict[str, Family]:
    """Every shipped family definition, by family name."""
    out: dict[str, Family] = {}
    for entry in sorted(resources.files("mha2gqa.convert").joinpath("architectures").iterdir(), key=str):
        if entry.name.endswith(".json"):
            fam = parse_family(json.loads(entry.read_text(encoding="utf-8")), entry.name)
            out[fam.family] = fam
    return out


def detect_family(config: dict[str, Any]) -> Family:
    """The family of a ``config.json`` (by ``architectures``, then ``model_type``)."""
    archs = config.get("architectures") or []
    model_type = config.get("model_type")
    for fam in families().values():
        if any(a in fam.architectures for a in archs):
            return fam
    for fam in families().values():
        if model_type in fam.model_types:
            return fam
    found = ", ".join(archs) or model_type or "unknown"
    supported = ", ".join(sorted(a for f in families().values() for a in f.architectures))
    raise Mha2GqaError(f"unsupported model family ({found}); supported: {supported}")


@dataclass(frozen=True)
class AttentionDims:
    """Head counts and sizes of a decoder, read from its config."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AttentionDims:
        try:
            layers = int(config["num_hidden_layers"])
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
        except (KeyError, TypeError, ValueError) as e:
            raise Mha2GqaError(f"config.json lacks a usable {e} field") from None
        kv = config.get("num_key_value_heads") or heads  # absent or null: MHA
        head_dim = config.get("head_dim") or hidden // heads
        if heads % kv:
            raise Mha2GqaError(
                f"config.json: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}"
            )
        return cls(layers, heads, int(kv), int(head_dim), hidden)

    def kv_cache_bytes_per_token(self, num_kv_heads: int, bytes_per_element: int) -> int:
        """K and V of every layer for one token: ``2 * layers * kv_heads * head_dim * bytes``."""
        return 2 * self.num_layers * num_kv_heads * self.head_dim * bytes_per_element
