"""One resolution of a model's config: which family converts it (a re-targeted source's target family,
GPT-NeoX as Phi), the re-targeting, and its attention dimensions. Made once by :func:`resolve` and
passed on, so no caller re-derives family or dimensions from the config.

``core/`` resolves in one direction: ``dims`` (plain numbers) <- ``families`` (layouts as data) <-
``retarget`` (re-targetings as data) <- ``architecture`` (all three for one config).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mha2gqa.core.cache_layers import bounded, cache_spans
from mha2gqa.core.dims import AttentionDims
from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.families import Family, families, find_family, refused_reason
from mha2gqa.core.retarget import Retarget, find_retarget, retargets


@dataclass(frozen=True)
class Architecture:
    """A config, resolved.

    ``source_config`` is the config as read; ``config`` the one of the class the model converts as
    (the target's for a re-targeted source, else the same); ``family`` is None only for a family
    mha2gqa does not describe (read leniently, for dimensions alone)."""

    source_config: dict[str, Any]
    config: dict[str, Any]
    family: Family | None
    retarget: Retarget | None
    dims: AttentionDims

    @property
    def name(self) -> str:
        """The source's class (``LlamaForCausalLM``, ``GPTNeoXForCausalLM``...)."""
        archs = self.source_config.get("architectures") or self.config.get("architectures")
        return archs[0] if archs else (self.family.architectures[0] if self.family else "unknown")

    @property
    def converts_as(self) -> str | None:
        """The class a re-targeted source is converted in (None for a native family)."""
        return self.retarget.target if self.retarget else None

    @property
    def attention_output(self) -> str | None:
        """The attribute of the source class's attention module that holds its output projection
        (``o_proj``, Phi's ``dense``, GPT-2's ``c_proj``...); None for a family not described."""
        if self.retarget is not None:
            return self.retarget.o_proj
        return self.family.o_proj.rsplit(".", 1)[-1] if self.family else None

    def standard(self) -> dict[str, Any]:
        """``config`` with the standard keys mha2gqa reads, whatever its family calls them."""
        return self.family.standard(self.config) if self.family else self.config


def _as_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, dict):
        archs, model_type = config.get("architectures"), config.get("model_type")
        if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
            raise Mha2GqaError(f"config.json: 'architectures' must be a list of class names (found {archs!r:.40})")
        if model_type is not None and not isinstance(model_type, str):
            raise Mha2GqaError(f"config.json: 'model_type' must be a name (found {model_type!r:.40})")
        return config
    if hasattr(config, "to_dict"):  # a transformers config object
        return config.to_dict()
    raise Mha2GqaError(f"config.json: expected a JSON object (found {type(config).__name__})")


def resolve(config: Any, strict: bool = True) -> Architecture:
    """Resolve ``config`` (a ``config.json`` dict or a transformers config). ``strict``: a refused
    architecture (BLOOM, T5, Falcon-RW...), an unsupported family or a source that cannot be
    re-expressed exactly raises with the reason; lenient: any decoder's dimensions are read."""
    source = _as_dict(config)
    why = refused_reason(source) if strict else None
    if why:
        raise Mha2GqaError(why)
    spec = find_retarget(source)
    if spec is not None and strict:
        why = spec.refusal(source)
        if why:
            raise Mha2GqaError(f"{_arch(source, spec.source)} cannot be re-expressed as {spec.target} exactly: {why}")
    try:
        return _resolved(source, spec, strict)
    except Mha2GqaError as e:  # a re-targeted source's derived config: said in the user's own fields
        explained = spec.explain(str(e), source) if spec is not None else None
        if explained is None:
            raise
        raise Mha2GqaError(explained) from None


def _resolved(source: dict[str, Any], spec: Retarget | None, strict: bool) -> Architecture:
    target = spec.target_config(source) if spec is not None else source
    family = find_family(target)
    if strict:
        if family is None:
            found = ", ".join(source.get("architectures") or []) or source.get("model_type") or "unknown"
            supported = ", ".join(sorted(a for f in families().values() for a in f.architectures))
            moved = ", ".join(sorted(a for r in retargets().values() for a in r.architectures))
            raise Mha2GqaError(f"unsupported model family ({found}); supported: {supported}; re-targeted: {moved}")
        why = family.refusal(target)
        if why:
            raise Mha2GqaError(f"{_arch(target, family.family)}: {why}")
    standard = family.standard(target) if family else target
    dims = AttentionDims.from_config(standard)
    spans = cache_spans(target, dims.num_layers, dict(family.cache_layers) if family and family.cache_layers else None)
    if bounded(spans):  # some layer holds fewer tokens than the sequence
        dims = dataclasses.replace(dims, cache_spans=spans)
    if family is not None and family.flag_only:  # GPTBigCode: its class holds 1 KV head or one per query head
        reason = f"{family.architectures[0]} holds one KV head ({family.kv_flag}) or one per query head"
        dims = dataclasses.replace(dims, kv_choices=(tuple(sorted({1, dims.num_kv_heads})), reason))
    return Architecture(source, target, family, spec, dims)


def dims_of(config: Any) -> AttentionDims:
    """The attention dimensions of any decoder's config (lenient :func:`resolve`)."""
    return resolve(config, strict=False).dims


def _arch(config: dict[str, Any], default: str) -> str:
    return (config.get("architectures") or [default])[0]
