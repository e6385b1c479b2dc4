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
from importlib import metadata, resources
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from mha2gqa.core.expressions import check_expression

_TOP_KEYS = {
    "family",
    "description",
    "architectures",
    "model_types",
    "attention",
    "k_norm",
    "q_norm",
    "parameters",
    "config_names",
    "kv_heads",
    "refuse_when",
    "serving",
    "attention_interface",
    "cache_layers",
}
_ATTN_KEYS = {"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "qkv_layout"}
#: Row layouts of a fused qkv projection: ``stacked`` ``[q (H·d); k (G·d); v (G·d)]`` (Phi-3, GPT-2's
#: c_attn transposed), ``grouped`` ``[G, H/G + 2, d]``: per KV head its query heads, then its key and
#: value (Falcon; GPT-NeoX and GPTBigCode-MHA are the case G = H, GPTBigCode-MQA the case G = 1).
QKV_LAYOUTS = ("stacked", "grouped")
#: The config keys mha2gqa reads, which a family may spell otherwise (``config_names``).
STANDARD_KEYS = (
    "num_hidden_layers",
    "num_attention_heads",
    "hidden_size",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "tie_word_embeddings",
)
_NORM_KEYS = {"name", "layout"}
NORM_LAYOUTS = ("shared", "rows", "indexed")
#: Names a parameter-count term may use: vocabulary, hidden, intermediate, layers, query heads,
#: KV heads, head_dim.
TERM_NAMES = {
    "V": "vocab_size",
    "h": "hidden_size",
    "I": "intermediate_size",
    "L": "num_hidden_layers",
    "H": "num_attention_heads",
    "G": "num_key_value_heads",
    "d": "head_dim",
}
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
    qkv_layout: str = "stacked"
    #: standard config key -> this family's spelling (GPT-2's ``n_head``...)
    config_names: tuple[tuple[str, str], ...] = ()
    #: how the config says the KV-head count: a count ``key`` (read when ``key_when`` is absent or
    #: true), else a boolean ``flag`` (true: one KV head; false: one per query head)
    kv_key: str = "num_key_value_heads"
    kv_key_when: str | None = None
    kv_flag: str | None = None
    #: ``(conditions, reason)``: configs of the family that no conversion applies to (every
    #: ``(key, value)`` condition holds; an absent key reads as false)
    refuse_when: tuple[tuple[tuple[tuple[str, Any], ...], str], ...] = ()
    #: where its checkpoints run (README and model card), as checked or read in those projects' code
    serving: str = ""
    #: the transformers versions in which its attention runs through transformers' attention
    #: interface, where calibration and the attention comparisons read q/k/v: a PEP 440 specifier
    #: ("": every version; None: none; Falcon's from 5.25)
    attention_interface_versions: str | None = ""
    #: which layers slide when the config lists no ``layer_types``, as its transformers config computes
    #: them: ``(("gate", expr), ("sliding", expr of the config and layer))`` (:mod:`~mha2gqa.core.cache_layers`)
    cache_layers: tuple[tuple[str, str], ...] = ()

    @property
    def attention_interface(self) -> bool:
        """The installed transformers runs this family's attention through its attention interface."""
        versions = self.attention_interface_versions
        return versions is not None and (not versions or installed_transformers() in SpecifierSet(versions))

    @property
    def interface_hint(self) -> str:
        """What runs this family's attention through the interface where the installed transformers
        does not ("" where none does)."""
        versions = self.attention_interface_versions
        return f" (transformers {versions} does: pip install 'transformers{versions}')" if versions else ""

    @property
    def fused(self) -> bool:
        return self.qkv_proj is not None

    @property
    def flag_only(self) -> bool:
        """The config can say only "one KV head" or "one per query head" (GPTBigCode's multi_query)."""
        return self.kv_flag is not None and self.kv_key == ""

    @property
    def per_layer_refusal(self) -> str | None:
        """Why this family's checkpoints cannot hold a KV-head count per layer (None: they can)."""
        if self.flag_only:
            return "holds one KV head or one per query head, as a flag of its config says, in every layer alike"
        if self.qkv_layout == "grouped":
            return "keeps K/V grouped per head inside one fused projection whose layout its class sizes by one count"
        if not self.attention_interface:
            return "does not run its attention through transformers' attention interface, which per-layer counts resize"
        return None

    def standard(self, config: dict[str, Any]) -> dict[str, Any]:
        """``config`` with the standard keys mha2gqa reads filled in from this family's spelling,
        ``num_key_value_heads`` included (Falcon's ``num_kv_heads``, GPTBigCode's ``multi_query``)."""
        out = dict(config)
        for key, spelled in self.config_names:
            if out.get(key) is None and spelled in config:
                out[key] = config[spelled]
        heads = out.get("num_attention_heads")
        use_key = self.kv_key and (self.kv_key_when is None or bool(config.get(self.kv_key_when)))
        if use_key and config.get(self.kv_key) is not None:
            out["num_key_value_heads"] = config[self.kv_key]
        elif self.kv_flag is not None:
            out["num_key_value_heads"] = 1 if config.get(self.kv_flag) else heads
        elif use_key and self.kv_key != "num_key_value_heads":
            out["num_key_value_heads"] = heads
        return out

    def kv_config(self, num_kv_heads: int) -> dict[str, Any]:
        """The config entries that give a checkpoint of this family ``num_kv_heads`` KV heads."""
        out: dict[str, Any] = {self.kv_key: num_kv_heads} if self.kv_key else {}
        if self.flag_only:  # GPTBigCode: multi_query, and the count transformers derives from it
            out |= {self.kv_flag: num_kv_heads == 1, "num_key_value_heads": num_kv_heads}
        return out

    def refusal(self, config: dict[str, Any]) -> str | None:
        """Why no conversion applies to a checkpoint with ``config``, or None."""
        for conditions, reason in self.refuse_when:
            if all(config.get(key, False) == value for key, value in conditions):
                return reason
        return None

    def split_qkv(self, weight: Any, num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[Any, Any, Any]:
        """A fused qkv tensor's q ``[H·d, ...]``, k and v ``[G·d, ...]`` rows (heads in order), by
        this family's layout, with sizes from the config (never ``chunk(3)``)."""
        return split_fused_qkv(weight, num_heads, num_kv_heads, head_dim, self.qkv_layout)

    def q_rows(self, num_heads: int, num_kv_heads: int, head_dim: int) -> list[int]:
        """The rows of the fused qkv tensor that hold the queries (in this family's layout)."""
        if self.qkv_layout == "stacked":
            return list(range(num_heads * head_dim))
        per = num_heads // num_kv_heads
        block = (per + 2) * head_dim
        return [g * block + r for g in range(num_kv_heads) for r in range(per * head_dim)]

    def join_qkv(self, q: Any, k: Any, v: Any, num_heads: int, num_kv_heads: int, head_dim: int) -> Any:
        """The inverse of :meth:`split_qkv`."""
        return join_fused_qkv(q, k, v, num_heads, num_kv_heads, head_dim, self.qkv_layout)

    def modules(self) -> tuple[str, ...]:
        """The projection-module templates of one layer."""
        names = (self.qkv_proj,) if self.fused else (self.q_proj, self.k_proj, self.v_proj)
        return (*(n for n in names if n), self.o_proj)


def parse_family(data: dict[str, Any], origin: str = "<dict>") -> Family:
    """Validate one family definition; raises ``ValueError`` naming ``origin`` on any problem."""

    def fail(msg: str) -> ValueError:
        return ValueError(f"family definition {origin}: {msg}")

    check_keys(data, _TOP_KEYS, ("family", "description", "architectures", "model_types", "attention"), fail)
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
    layout = attn.pop("qkv_layout", "stacked") if isinstance(attn, dict) else "stacked"
    if layout not in QKV_LAYOUTS:
        raise fail(f"attention.qkv_layout must be one of {QKV_LAYOUTS}")
    for key, template in attn.items():
        if "{layer}" not in template:
            raise fail(f"attention.{key} must contain '{{layer}}'")
    norms = {key: _parse_norm(key, data[key], fail) for key in ("q_norm", "k_norm") if key in data}
    terms, defaults = _parse_parameters(data.get("parameters"), fail)
    names = data.get("config_names", {})
    if not isinstance(names, dict) or set(names) - set(STANDARD_KEYS):
        raise fail(f"'config_names' maps some of {list(STANDARD_KEYS)} to this family's keys")
    kv = data.get("kv_heads", {"key": "num_key_value_heads"})
    if not isinstance(kv, dict) or set(kv) - {"key", "key_when", "flag"} or not (kv.get("key") or kv.get("flag")):
        raise fail("'kv_heads' takes 'key' (and 'key_when') and/or 'flag'")
    cache_layers = _parse_cache_layers(data.get("cache_layers", {}), fail)
    refuse = data.get("refuse_when", [])
    if not all(isinstance(r, dict) and set(r) == {"when", "reason"} and isinstance(r["when"], dict) for r in refuse):
        raise fail("each 'refuse_when' entry needs exactly 'when' ({config key: value}) and 'reason'")
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
        qkv_layout=layout,
        config_names=tuple(sorted(names.items())),
        kv_key=kv.get("key", ""),
        kv_key_when=kv.get("key_when"),
        kv_flag=kv.get("flag"),
        refuse_when=tuple((tuple(sorted(r["when"].items())), r["reason"]) for r in refuse),
        serving=data.get("serving", ""),
        attention_interface_versions=_parse_interface(data.get("attention_interface", True), fail),
        cache_layers=tuple(sorted(cache_layers.items())),
        **norms,
    )


def _parse_interface(value: Any, fail) -> str | None:
    """``attention_interface``: true, false or the transformers versions (a PEP 440 specifier)."""
    if isinstance(value, bool):
        return "" if value else None
    try:
        if isinstance(value, str) and value.strip():
            return str(SpecifierSet(value))
    except InvalidSpecifier:
        pass
    raise fail(f"'attention_interface' is true, false or transformers versions such as '>=5.25', not {value!r}")


@cache
def installed_transformers() -> Version:
    """The installed transformers' version (read from its package metadata, without importing it)."""
    return Version(metadata.version("transformers"))


def _parse_cache_layers(spec: Any, fail) -> dict[str, str]:
    """``cache_layers``: ``sliding`` (and ``gate``), expressions of the config (and ``layer``)."""
    keys = set(spec) if isinstance(spec, dict) else {None}
    if (
        keys - {"gate", "sliding"}
        or (keys and "sliding" not in keys)
        or not all(isinstance(e, str) for e in spec.values())
    ):
        raise fail("'cache_layers' takes 'sliding' (and 'gate'): expressions of the config (and 'layer')")
    for expr in spec.values():
        check_expression(expr, fail)
    return spec


def _parse_norm(key: str, spec: Any, fail) -> NormSpec:
    """A family's ``q_norm``/``k_norm``: a name template and its layout (``{head}`` when indexed)."""
    if not isinstance(spec, dict) or set(spec) != _NORM_KEYS:
        raise fail(f"{key} needs exactly {sorted(_NORM_KEYS)}")
    if spec["layout"] not in NORM_LAYOUTS:
        raise fail(f"{key}.layout must be one of {NORM_LAYOUTS}")
    if (spec["layout"] == "indexed") != ("{head}" in spec["name"]):
        raise fail(f"{key}: '{{head}}' must appear in the name exactly when layout is 'indexed'")
    return NormSpec(spec["name"], spec["layout"])


def check_keys(data: dict[str, Any], allowed: set[str], required: tuple[str, ...], fail) -> None:
    """A definition has only ``allowed`` keys and every ``required`` one (``fail(msg)`` builds the error)."""
    unknown = set(data) - allowed
    if unknown:
        raise fail(f"unknown keys {sorted(unknown)}")
    for key in required:
        if key not in data:
            raise fail(f"missing key {key!r}")


def load_definitions(folder: str, parse) -> list[Any]:
    """Every ``*.json`` definition shipped in ``folder`` (of this package), parsed by ``parse(data, name)``."""
    entries = sorted(resources.files("mha2gqa.core").joinpath(folder).iterdir(), key=str)
    return [parse(json.loads(e.read_text(encoding="utf-8")), e.name) for e in entries if e.name.endswith(".json")]


def match_definition(config: dict[str, Any], definitions: Any) -> Any:
    """The definition whose ``architectures`` hold the config's, else whose ``model_types`` hold its
    ``model_type``; None when none does."""
    archs = config.get("architectures") or []
    for d in definitions:
        if any(a in d.architectures for a in archs):
            return d
    return next((d for d in definitions if config.get("model_type") in d.model_types), None)


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
    return {fam.family: fam for fam in load_definitions("architectures", parse_family)}


def split_fused_qkv(
    weight: Any, num_heads: int, num_kv_heads: int, head_dim: int, layout: str = "stacked"
) -> tuple[Any, Any, Any]:
    """Split fused qkv rows (``[(H + 2·G)·d, *rest]``) into q ``[H·d]``, k and v ``[G·d]`` with sizes
    from the config (never ``chunk(3)``, which is wrong as soon as ``G != H``); ``layout`` as in
    :data:`QKV_LAYOUTS`."""
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    if weight.shape[0] != sum(sizes):
        raise ValueError(f"fused qkv has {weight.shape[0]} rows, expected {sum(sizes)} = {sizes}")
    if layout == "stacked":
        q, k, v = weight.split(sizes, dim=0)
        return q, k, v
    rest = weight.shape[1:]
    per = num_heads // num_kv_heads
    grouped = weight.reshape(num_kv_heads, per + 2, head_dim, *rest)
    q = grouped[:, :per].reshape(num_heads * head_dim, *rest)
    return q, grouped[:, per].reshape(-1, *rest), grouped[:, per + 1].reshape(-1, *rest)


def join_fused_qkv(
    q: Any, k: Any, v: Any, num_heads: int, num_kv_heads: int, head_dim: int, layout: str = "stacked"
) -> Any:
    """The inverse of :func:`split_fused_qkv`."""
    import torch

    if layout == "stacked":
        return torch.cat([q, k, v])
    rest = q.shape[1:]
    per = num_heads // num_kv_heads
    parts = [
        q.reshape(num_kv_heads, per, head_dim, *rest),
        k.reshape(num_kv_heads, 1, head_dim, *rest),
        v.reshape(num_kv_heads, 1, head_dim, *rest),
    ]
    return torch.cat(parts, dim=1).reshape(-1, *rest).contiguous()


def find_family(config: dict[str, Any]) -> Family | None:
    """The family of a ``config.json`` (by ``architectures``, then ``model_type``), or None."""
    return match_definition(config, families().values())


@dataclass(frozen=True)
class Refused:
    """Architectures no conversion can express exactly, and why (one entry of ``refused.json``)."""

    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    reason: str


@cache
def refused() -> list[Refused]:
    """Every entry of ``refused.json``."""
    entries = json.loads(resources.files("mha2gqa.core").joinpath("refused.json").read_text(encoding="utf-8"))
    return [Refused(tuple(e["architectures"]), tuple(e["model_types"]), e["reason"]) for e in entries]


def refused_reason(config: dict[str, Any]) -> str | None:
    """Why a model with ``config`` is refused outright (BLOOM, T5...), or None."""
    entry = match_definition(config, refused())
    if entry is None:
        return None
    return f"{(config.get('architectures') or [config.get('model_type')])[0]} is not supported: {entry.reason}"
