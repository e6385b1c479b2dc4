"""Model families as data: which tensors hold the attention heads of each architecture.

Each family is one JSON file in ``architectures/``. Weight names are templates with ``{layer}``
(and ``{head}`` for per-head modules); ``.weight`` / ``.bias`` are appended to projection names.
Definitions are validated strictly: an unknown key is an error, so a typo cannot silently drop a
tensor from the conversion.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from mha2gqa.core.errors import Mha2GqaError

_TOP_KEYS = {"family", "description", "architectures", "model_types", "attention", "k_norm", "q_norm", "parameters"}
_ATTN_KEYS = {"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj"}
_NORM_KEYS = {"name", "layout"}
NORM_LAYOUTS = ("shared", "rows", "indexed")
#: Names a parameter-count term may use: vocabulary, hidden, intermediate, layers, query heads,
#: KV heads, head_dim.
TERM_NAMES = {"V": "vocab_size", "h": "hidden_size", "I": "intermediate_size", "L": "num_hidden_layers",
              "H": "num_attention_heads", "G": "num_key_value_heads", "d": "head_dim"}  # fmt: skip
_TERM = re.compile(r"^[VhILHGd0-9+*() ]+$")


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
    #: parameter count as ``(expression, condition)`` terms (condition: a config key, ``!`` negates)
    parameter_terms: tuple[tuple[str, str | None], ...] = ()
    #: values of the condition keys when a config lacks them (the model class's defaults)
    parameter_defaults: tuple[tuple[str, bool], ...] = ()

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
    terms, defaults = _parse_parameters(data.get("parameters"), fail)
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
        parameter_terms=terms,
        parameter_defaults=defaults,
        **norms,
    )


def _parse_parameters(spec: Any, fail) -> tuple[tuple[tuple[str, str | None], ...], tuple[tuple[str, bool], ...]]:
    """The ``parameters`` section: ``{"defaults": {key: bool}, "terms": [[expr], [expr, cond]...]}``."""
    if spec is None:
        return (), ()
    if not isinstance(spec, dict) or set(spec) - {"defaults", "terms"} or "terms" not in spec:
        raise fail("'parameters' takes 'terms' (and 'defaults')")
    defaults = spec.get("defaults", {})
    if not isinstance(defaults, dict) or not all(isinstance(v, bool) for v in defaults.values()):
        raise fail("'parameters.defaults' maps config keys to true/false")
    terms = []
    for term in spec["terms"]:
        if not isinstance(term, list) or len(term) not in (1, 2) or not all(isinstance(t, str) for t in term):
            raise fail(f"parameter term {term!r} must be [expression] or [expression, condition]")
        if not _TERM.match(term[0]):
            raise fail(f"parameter term {term[0]!r} may use only {', '.join(TERM_NAMES)}, numbers, + * ( )")
        cond = term[1] if len(term) == 2 else None
        if cond is not None and cond.lstrip("!") not in defaults:
            raise fail(f"parameter condition {cond!r} needs a default in 'parameters.defaults'")
        terms.append((term[0], cond))
    return tuple(terms), tuple(sorted(defaults.items()))


@cache
def families() -> dict[str, Family]:
    """Every shipped family definition, by family name."""
    out: dict[str, Family] = {}
    for entry in sorted(resources.files("mha2gqa.core").joinpath("architectures").iterdir(), key=str):
        if entry.name.endswith(".json"):
            fam = parse_family(json.loads(entry.read_text(encoding="utf-8")), entry.name)
            out[fam.family] = fam
    return out


def split_fused_qkv(weight: Any, num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[Any, Any, Any]:
    """Split fused ``[(H + 2*G)*d, *rest]`` rows into q ``[H*d]``, k and v ``[G*d]`` with sizes
    from the config (never ``chunk(3)``, which is wrong as soon as ``G != H``)."""
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    if weight.shape[0] != sum(sizes):
        raise ValueError(f"fused qkv has {weight.shape[0]} rows, expected {sum(sizes)} = {sizes}")
    q, k, v = weight.split(sizes, dim=0)
    return q, k, v


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
