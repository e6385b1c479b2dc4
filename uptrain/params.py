"""Which parameters train: all of them, the attention projections, or only the K/V projections.

Names come from the model's family definition (``core/architectures/*.json``), the same data
the converter uses. For a fused ``qkv_proj`` (Phi-3, GPTBigCode, Falcon) with ``kv``, the whole
tensor trains but the query rows' gradient (wherever the family's layout puts them) is masked to
zero (and they get no weight decay), so they stay bit-exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mha2gqa.core.dims import AttentionDims
from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.families import Family
from mha2gqa.core.layer_tensors import norm_names, role_names
from mha2gqa.uptrain.settings import TRAINABLE


@dataclass
class Trainable:
    """The parameters that train, by name, and row masks for partially trained fused tensors."""

    names: list[str]
    params: list[torch.nn.Parameter]
    masked_rows: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> rows that must not change

    def rebind(self, model: torch.nn.Module) -> Trainable:
        """The same names bound to ``model``'s parameters now (FSDP replaces them by sharded ones;
        the row masks then apply to each process's shard, see :func:`~mha2gqa.uptrain.sharding.zero_rows`)."""
        params = dict(model.named_parameters())
        return Trainable(self.names, [params[n] for n in self.names], self.masked_rows)

    def param(self, name: str) -> torch.nn.Parameter:
        return self.params[self.names.index(name)]

    @property
    def count(self) -> int:
        """Parameters that can change (masked rows excluded)."""
        total = 0
        for name, p in zip(self.names, self.params, strict=True):
            total += p.numel()
            if name in self.masked_rows:
                total -= len(self.masked_rows[name]) * p[0].numel()
        return total


#: the roles (:func:`~mha2gqa.core.layer_tensors.role_names`) each ``--train`` choice trains, and its norms
#: (a per-head norm trains with its projection)
_ROLES = {
    "attention": (("q", "k", "v", "o", "qkv"), ("q_norm", "k_norm")),
    "kv": (("k", "v", "qkv"), ("k_norm",)),  # a fused qkv's query rows are masked (select_trainable)
}


def _layer_names(family: Family, dims: AttentionDims, which: str) -> tuple[set[str], set[str]]:
    """Full parameter names of ``which`` in every layer: the projections' (``.weight`` and ``.bias``,
    which a model may lack) and the per-head norms' (which a config of the family may leave out:
    StableLM 2 1.6B has none), by role from :mod:`~mha2gqa.core.layer_tensors`."""
    projections, norms = _ROLES[which]
    out: set[str] = set()
    norm_set: set[str] = set()
    for layer in range(dims.num_layers):
        roles = role_names(family, layer)
        out.update(name for role, name in roles.items() if role.removesuffix("_bias") in projections)
        heads = norm_names(family, layer, dims.num_heads, dims.num_kv_heads)
        norm_set.update(name for role in norms for name in heads.get(role, ()))
    return out, norm_set


def select_trainable(model: torch.nn.Module, family: Family | None, dims: AttentionDims, which: str) -> Trainable:
    """Freeze everything but ``which`` (``all``, ``attention``, ``kv``) and return what trains.
    ``family`` (where the projections live) may be None only for ``all``."""
    if which not in TRAINABLE:
        raise Mha2GqaError(f"--train {which}: choose {', '.join(TRAINABLE)}")
    if which == "kv" and dims.num_kv_heads == dims.num_heads:
        raise Mha2GqaError(
            f"--train kv: the student has {dims.num_heads} query heads and as many KV heads, so it is not "
            "GQA-shaped; convert it first (mha2gqa convert -g N) or use --train all/attention"
        )
    projections, norms = (None, set()) if which == "all" else _layer_names(family, dims, which)
    wanted = None if projections is None else projections | norms
    names, params = [], []
    for name, p in model.named_parameters():
        train = wanted is None or name in wanted
        p.requires_grad_(train)
        if train:
            names.append(name)
            params.append(p)
    if projections is not None:
        missing = sorted(n for n in projections if n.endswith(".weight") and n not in names)
        if missing:
            raise Mha2GqaError(f"--train {which}: the model has no parameter {missing[0]} (family {family.family})")
    masked: dict[str, torch.Tensor] = {}
    if which == "kv" and family.fused:
        q_rows = torch.tensor(family.q_rows(dims.num_heads, dims.num_kv_heads, dims.head_dim))
        for name, p in zip(names, params, strict=True):
            if name.startswith(tuple(family.qkv_proj.format(layer=i) for i in range(dims.num_layers))):
                masked[name] = q_rows
                p.register_hook(lambda g, rows=q_rows: _zero_rows(g, rows))
    return Trainable(names, params, masked)


def _zero_rows(grad: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad[rows] = 0
    return grad


def param_groups(trainable: Trainable, weight_decay: float, lr: float, relative: bool = False) -> list[dict]:
    """AdamW groups: decay on matrices only (not on norms, biases, or masked fused tensors); with
    ``relative`` one group a parameter, its learning rate ``lr`` times its size at the start
    (:func:`~mha2gqa.core.steps.step_size`)."""
    from mha2gqa.core.steps import step_size

    by_name = dict(zip(trainable.names, trainable.params, strict=True))
    decay, no_decay = [], []
    for name, p in by_name.items():
        (decay if p.ndim >= 2 and name not in trainable.masked_rows else no_decay).append(name)
    groups = []
    for names, wd in ((decay, weight_decay), (no_decay, 0.0)):
        if not relative:
            groups.append({"params": [by_name[n] for n in names], "weight_decay": wd, "lr": lr})
            continue
        for n in names:
            weight = by_name.get(n.removesuffix(".bias") + ".weight") if n.endswith(".bias") else None
            groups.append({"params": [by_name[n]], "weight_decay": wd, "lr": lr * step_size(by_name[n], weight)})
    return [g for g in groups if g["params"]]


def lora_targets(family: Family | None, dims: AttentionDims, which: str) -> list[str] | str:
    """peft ``target_modules`` for ``--train``: every linear layer but the output head (``all``),
    the attention projections, or the K/V projections (not separable in a fused ``qkv_proj``)."""
    if which == "all":
        return "all-linear"
    if which == "kv" and family.fused:
        raise Mha2GqaError(
            f"--train kv with --lora-rank: {family.family} fuses q, k and v in one projection, so a LoRA "
            "adapter cannot touch K/V alone; use --train kv without LoRA, or --train attention"
        )
    modules = family.modules() if which == "attention" else (family.k_proj, family.v_proj)
    return [m.format(layer=layer) for layer in range(dims.num_layers) for m in modules]


def apply_lora(model: torch.nn.Module, targets: list[str] | str, rank: int, alpha: float, dropout: float):
    """Wrap ``model`` with LoRA adapters (peft) on ``targets``; only the adapters train."""
    try:
        import peft
    except ImportError:
        raise Mha2GqaError("--lora-rank needs peft: pip install peft (or 'mha2gqa[lora]')") from None
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, task_type="CAUSAL_LM"
    )
    return peft.get_peft_model(model, config)


def adapters(model: torch.nn.Module) -> Trainable:
    """What trains in a peft-wrapped model: its adapter parameters."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return Trainable([n for n, _ in named], [p for _, p in named])
