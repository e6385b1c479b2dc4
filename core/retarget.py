"""Re-targeting: an MHA checkpoint whose transformers class has no KV-head setting (GPT-NeoX/Pythia,
GPT-J, GPT-2, OPT) re-expressed exactly in a class that has one (Phi, GPTBigCode), as data.

Each re-targeting is one JSON file in ``retargets/``: the source class, the target class, the
target config as expressions over the source config, conditions the source must meet, and tensor
operations (renames, Conv1D transposes, fused-QKV splits and joins, LayerNorm folding, the rotary
permutation from interleaved pairs to rotate-half). The conversion reads a source through
:class:`mha2gqa.convert.engine.retarget_view.RetargetedCheckpoint`, which computes the target's tensors on
demand; planning and evaluation read only the definitions here.

LayerNorm folding (GPT-NeoX's two parallel norms read the same input): for a norm ``γ⊙n(x) + β``
feeding a linear layer ``W·y + b``, ``W' = W·diag(γ)`` and ``b' = W·β + b`` make the layer read the
plain ``n(x)``, so one identity-affine norm (the target's single parallel-block norm) serves both.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

from mha2gqa.core.expressions import check_expression, evaluate_expression, names_in
from mha2gqa.core.families import check_keys, load_definitions, match_definition

_TOP_KEYS = {
    "source",
    "description",
    "architectures",
    "model_types",
    "target",
    "requires",
    "config",
    "tensors",
    "ignore",
    "o_proj",
}
_OPS = {"copy", "linear", "qkv", "ones", "zeros"}
_OP_KEYS = {"op", "to", "from", "transpose", "rows_from", "optional", "fold", "bias", "layout", "rotary", "shape"}


@dataclass(frozen=True)
class Retarget:
    """One declared re-targeting (a ``retargets/*.json`` file)."""

    source: str
    description: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    target: str  # the target architecture (a family's class)
    requires: tuple[tuple[str, str], ...]  # (expression that must hold, reason)
    config: dict[str, Any]
    tensors: tuple[dict[str, Any], ...]
    ignore: tuple[str, ...] = ()  # regexes of source tensors no target tensor needs (buffers)
    o_proj: str | None = None  # the source attention module's output projection attribute (eval reads it)

    def target_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The target class's ``config.json`` for a source ``config``."""

        def build(spec: Any) -> Any:
            if isinstance(spec, str):
                return evaluate_expression(spec, config)
            if isinstance(spec, dict) and set(spec) == {"value"}:
                return spec["value"]
            if isinstance(spec, dict):
                return {k: build(v) for k, v in spec.items()}
            raise ValueError(f"re-targeting {self.source}: bad config value {spec!r}")

        return {k: v for k, v in ((k, build(s)) for k, s in self.config.items()) if v is not None}

    def source_fields(self, target_key: str) -> list[str]:
        """The source config keys the target's ``target_key`` (at any depth) is computed from."""

        def find(spec: Any) -> list[str]:
            if isinstance(spec, dict) and set(spec) != {"value"}:
                for k, v in spec.items():
                    if k == target_key and isinstance(v, str):
                        return names_in(v)
                    found = find(v)
                    if found:
                        return found
            return []

        return find(self.config)

    def explain(self, message: str, config: dict[str, Any]) -> str | None:
        """``message`` (an error about the target's config) said in terms of the user's own fields, or
        None when it names no computed field."""
        for key in sorted(_target_keys(self.config), key=len, reverse=True):
            if key in message and (fields := [f for f in self.source_fields(key) if f in config]):
                shown = ", ".join(f"{f} {config[f]!r:.30}" for f in fields)
                arch = (config.get("architectures") or [self.source])[0]
                said = message.removeprefix("config.json: ")
                return f"config.json: {shown} of this {arch}: as {self.target} ({key} from them) {said}"
        return None

    def refusal(self, config: dict[str, Any]) -> str | None:
        """Why this source cannot be re-expressed exactly, or None."""
        for expr, reason in self.requires:
            if not evaluate_expression(expr, config):
                return reason
        return None


def _target_keys(spec: dict[str, Any]) -> set[str]:
    """Every key of a target config definition, at any depth."""
    keys = set()
    for k, v in spec.items():
        keys.add(k)
        if isinstance(v, dict) and set(v) != {"value"}:
            keys |= _target_keys(v)
    return keys


def parse_retarget(data: dict[str, Any], origin: str = "<dict>") -> Retarget:
    """Validate one re-targeting definition; raises ``ValueError`` naming ``origin``."""

    def fail(msg: str) -> ValueError:
        return ValueError(f"re-targeting definition {origin}: {msg}")

    required = ("source", "description", "architectures", "model_types", "target", "config", "tensors")
    check_keys(data, _TOP_KEYS, required, fail)
    for op in data["tensors"]:
        if not isinstance(op, dict) or op.get("op") not in _OPS or set(op) - _OP_KEYS or "to" not in op:
            raise fail(
                f"tensor operation {op!r}: needs 'op' (one of {sorted(_OPS)}), 'to', and only {sorted(_OP_KEYS)}"
            )
        if op["op"] in ("copy", "linear", "qkv") and "from" not in op:
            raise fail(f"tensor operation {op!r} needs 'from'")

    def check_config(spec: Any) -> None:
        if isinstance(spec, str):
            check_expression(spec, fail)
        elif isinstance(spec, dict) and set(spec) != {"value"}:
            for v in spec.values():
                check_config(v)

    check_config(data["config"])
    requires = []
    for r in data.get("requires", []):
        if not isinstance(r, dict) or set(r) != {"expr", "reason"}:
            raise fail("each 'requires' entry needs exactly 'expr' and 'reason'")
        check_expression(r["expr"], fail)
        requires.append((r["expr"], r["reason"]))
    return Retarget(
        data["source"],
        data["description"],
        tuple(data["architectures"]),
        tuple(data["model_types"]),
        data["target"],
        tuple(requires),
        data["config"],
        tuple(data["tensors"]),
        tuple(data.get("ignore", [])),
        data.get("o_proj"),
    )


@cache
def retargets() -> dict[str, Retarget]:
    """Every shipped re-targeting, by source name."""
    return {spec.source: spec for spec in load_definitions("retargets", parse_retarget)}


def find_retarget(config: dict[str, Any]) -> Retarget | None:
    """The re-targeting for a source ``config.json`` (by ``architectures``, then ``model_type``)."""
    return match_definition(config, retargets().values())


def as_target(config: dict[str, Any]) -> dict[str, Any]:
    """The target class's config for a re-targeted source's ``config``; any other config as it is."""
    spec = find_retarget(config)
    return spec.target_config(config) if spec is not None else config
