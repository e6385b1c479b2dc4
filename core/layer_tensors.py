"""One decoder layer's attention tensors by role, read from the family's layout (data in
:mod:`mha2gqa.core.families`): which tensor is ``q``, ``k``, ``v``, ``o`` and their biases, the per-head
norms ``q_norm`` and ``k_norm`` (:func:`norm_names`), and a fused ``qkv`` split into its parts and joined
again. Every stage that reads or writes a layer's attention tensors goes through it: the merge
(:mod:`mha2gqa.convert.write.tensor_sources`), the layer seen through its source module
(:mod:`mha2gqa.convert.engine.layer_view`: the refit, the stage guard, the per-layer allocation's costs) and
what an uptraining run trains (:mod:`mha2gqa.uptrain.params`). A family's layout is read here."""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from mha2gqa.core.families import Family

#: the parts of a fused projection, in the order its layout stores them
PARTS = ("q", "k", "v")
#: a role and its bias's role (``k`` -> ``k_bias``)
_ROLE_SUFFIXES = ("", "_bias")


def role_names(family: Family, layer: int) -> dict[str, str]:
    """Role (``q``, ``k``, ``v``, ``o``, ``qkv``, their ``*_bias`` and ``o_bias``) -> the name ``layer``'s
    projection tensor has in the family's layout (a model may lack the biases)."""
    fill = partial(str.format, layer=layer)
    roles = {"o": fill(family.o_proj) + ".weight", "o_bias": fill(family.o_proj) + ".bias"}
    modules = {"qkv": family.qkv_proj} if family.fused else {"q": family.q_proj, "k": family.k_proj, "v": family.v_proj}
    for key, module in modules.items():
        roles |= {key: fill(module) + ".weight", f"{key}_bias": fill(module) + ".bias"}
    return roles


def attention_names(tensors: Container[str], family: Family, layer: int) -> dict[str, str]:
    """Role (``q``, ``k``, ``v``, ``o``, ``qkv`` and ``*_bias``) -> name of ``layer``'s projection
    tensors that are in ``tensors`` (the output projection's bias is never a role here: no head count
    shapes it)."""
    return {role: n for role, n in role_names(family, layer).items() if role != "o_bias" and n in tensors}


def norm_names(family: Family, layer: int, num_heads: int, kv_heads: int) -> dict[str, list[str]]:
    """Role (``q_norm``, ``k_norm``) -> the names of ``layer``'s per-head norm tensors, for the family's
    norms: one name (a ``shared`` weight, or ``rows``: every head's block in one tensor) or one per head
    (``indexed``: ``num_heads`` query norms, ``kv_heads`` key norms). A config of the family may leave
    them out (StableLM 2 1.6B has none): the caller checks which are present."""
    out = {}
    for role, norm, heads in (("q_norm", family.q_norm, num_heads), ("k_norm", family.k_norm, kv_heads)):
        if norm is None:
            continue
        if norm.layout == "indexed":
            out[role] = [norm.name.format(layer=layer, head=h) for h in range(heads)]
        else:
            out[role] = [norm.name.format(layer=layer)]
    return out


@dataclass(frozen=True)
class LayerTensors:
    """Layer ``layer``'s attention tensors: ``names`` (stored role -> tensor name, a fused layout's
    ``qkv`` among them) and how a fused tensor's rows split (``num_heads`` queries of ``head_dim``;
    the K/V head count is the caller's: the source's or the conversion's)."""

    family: Family
    names: Mapping[str, str]
    num_heads: int
    head_dim: int

    @classmethod
    def of(cls, tensors: Container[str], family: Family, layer: int, num_heads: int, head_dim: int) -> LayerTensors:
        """The layer's tensors among ``tensors`` (names of a checkpoint or of a planned conversion)."""
        return cls(family, attention_names(tensors, family, layer), num_heads, head_dim)

    def read(self, load: Callable[[str], Any], kv_heads: int) -> dict[str, Any]:
        """Role -> tensor as ``load(name)`` gives it, a fused ``qkv`` split into ``q``/``k``/``v``
        (``kv_heads`` K/V heads): ``q`` ``[H·d, ...]``, ``k``/``v`` ``[kv_heads·d, ...]``, ``o``."""
        return self.split({role: load(name) for role, name in self.names.items()}, kv_heads)

    def split(self, stored: Mapping[str, Any], kv_heads: int) -> dict[str, Any]:
        """Stored role -> tensor, into role -> tensor with each fused ``qkv`` (and its bias) split."""
        out = dict(stored)
        for suffix in _ROLE_SUFFIXES:
            if "qkv" + suffix in out:
                parts = self.family.split_qkv(out.pop("qkv" + suffix), self.num_heads, kv_heads, self.head_dim)
                out |= {role + suffix: p for role, p in zip(PARTS, parts, strict=True)}
        return out

    def join(self, values: Mapping[str, Any], kv_heads: int) -> dict[str, Any]:
        """The inverse of :meth:`split`: role -> tensor in the stored roles (``q``/``k``/``v`` joined
        into ``qkv`` where this layer stores them fused, ``kv_heads`` K/V heads)."""
        out = dict(values)
        for suffix in _ROLE_SUFFIXES:
            if "qkv" + suffix in self.names:
                parts = [out.pop(role + suffix) for role in PARTS]
                out["qkv" + suffix] = self.family.join_qkv(*parts, self.num_heads, kv_heads, self.head_dim)
        return out

    def named(self, values: Mapping[str, Any], kv_heads: int) -> dict[str, Any]:
        """Tensor name -> tensor, for ``values`` by role (joined as the layer stores them)."""
        return {self.names[role]: t for role, t in self.join(values, kv_heads).items() if role in self.names}

    def split_one(self, name: str, tensor: Any, kv_heads: int) -> tuple[Any, Any, Any]:
        """One fused tensor (``name``, the weight or its bias) as its ``q``, ``k``, ``v`` rows."""
        assert name in (self.names.get("qkv"), self.names.get("qkv_bias")), name
        return self.family.split_qkv(tensor, self.num_heads, kv_heads, self.head_dim)

    def join_one(self, q: Any, k: Any, v: Any, kv_heads: int) -> Any:
        """The inverse of :meth:`split_one`."""
        return self.family.join_qkv(q, k, v, self.num_heads, kv_heads, self.head_dim)
