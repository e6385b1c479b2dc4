"""A re-targeted source seen as a checkpoint of its target class (GPT-NeoX as Phi, GPT-2 as
GPTBigCode...): :class:`RetargetedCheckpoint` lists the target's tensors and computes each on demand
from the source tensors it needs (a layer's q/k/v together), so calibration, every method and the
writer run on it unchanged and memory stays at one layer. The re-targetings themselves are data
(:mod:`mha2gqa.core.retarget`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from mha2gqa.core.architecture import Architecture, resolve
from mha2gqa.core.checkpoint import Checkpoint
from mha2gqa.core.conversion_record import Retargeted
from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.expressions import evaluate_expression
from mha2gqa.core.retarget import find_retarget
from mha2gqa.core.safetensors_io import TensorInfo


def _rotate_half_order(head_dim: int, rotary: int) -> list[int]:
    """Row order within one head that turns interleaved rotary pairs ``(2i, 2i+1)`` (GPT-J) into
    rotate-half pairs ``(i, i + rotary/2)``: the even rotary dims, then the odd, then the rest."""
    return [*range(0, rotary, 2), *range(1, rotary, 2), *range(rotary, head_dim)]


@dataclass
class _Op:
    """One tensor operation, bound to a layer: computes its outputs together, hands them out once."""

    spec: dict[str, Any]
    view: RetargetedCheckpoint
    layer: int | None
    dtype_code: str = ""  # what it writes: its main source tensor's dtype (set while planning)
    ready: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def dtype(self) -> Any:
        from mha2gqa.core.dtypes import BY_CODE

        return BY_CODE[self.dtype_code].torch

    def name(self, template: str) -> str:
        return template.format(layer=self.layer) if self.layer is not None else template

    def get(self, name: str) -> Any:
        """``name``, computed with its siblings; each handed out once, so a second reader (the
        writer after calibration) computes them again rather than keeping them all."""
        if self.ready is None or name not in self.ready:
            self.ready = self.compute()
        return self.ready.pop(name)

    def compute(self) -> dict[str, Any]:
        import torch

        spec, view = self.spec, self.view
        op = spec["op"]
        if op in ("ones", "zeros"):  # the shape as planned
            name = self.name(spec["to"])
            return {name: getattr(torch, op)(view.tensors[name].shape, dtype=self.dtype)}
        if op == "copy":
            t = view.read(self.name(spec["from"]), spec.get("transpose", False))
            return {self.name(spec["to"]): t[spec.get("rows_from", 0) :].contiguous()}
        if op == "linear":
            w, b = view.read_linear(self.name(spec["from"]), spec.get("transpose", False))
            w, b = view.fold(w, b, self.name(spec["fold"]) if "fold" in spec else None)
            return view.emit(self.name(spec["to"]), w, b, spec.get("bias", True), self.dtype)
        return view.qkv(self)


class RetargetedCheckpoint(Checkpoint):
    """A source checkpoint seen as a checkpoint of the target class: ``config`` is the target's,
    ``tensors`` lists the target's tensors (shapes and dtypes, no byte ranges), ``load`` computes one
    from the source tensors it needs."""

    def __init__(self, source: Checkpoint, architecture: Architecture) -> None:
        """``architecture``: the source's config resolved (its re-targeting, target family and dims)."""
        config = architecture.config  # the target class's
        super().__init__(source.folder, config, {}, source.files, "retargeted", source.repo_id, source.revision)
        self.source, self.spec, self.architecture = source, architecture.retarget, architecture
        self.family, self.dims = architecture.family, architecture.dims
        self._ops: dict[str, _Op] = {}
        self._used: set[str] = set()
        self._plan()

    # the plan: every output name, its shape and dtype, and the operation that makes it
    def _plan(self) -> None:
        from mha2gqa.core.dtypes import BY_CODE

        src = self.source.tensors
        floating = [i for i in src.values() if BY_CODE[i.dtype].floating]
        if not floating:
            raise Mha2GqaError(f"{self.folder}: no floating-point weights")
        self.dtype_code = max({i.dtype for i in floating}, key=lambda c: sum(i.dtype == c for i in floating))
        layers = self.dims.num_layers
        for spec in self.spec.tensors:
            per_layer = "{layer}" in spec["to"] if isinstance(spec["to"], str) else "{layer}" in spec["to"][0]
            for layer in range(layers) if per_layer else [None]:
                op = _Op(spec, self, layer, self.dtype_code)  # ones/zeros: the checkpoint's dtype
                for name, shape in self._shapes(op).items():
                    self._ops[name] = op
                    self.tensors[name] = TensorInfo(name, op.dtype_code, shape, self.folder, None, None)
        unused = sorted(n for n in src if n not in self._used and not any(re.search(p, n) for p in self.spec.ignore))
        if unused:
            raise Mha2GqaError(
                f"{self.folder}: the {self.spec.source} -> {self.spec.target} re-targeting has no place "
                f"for {unused[0]}{f' and {len(unused) - 1} more' if len(unused) > 1 else ''}; "
                "this checkpoint is not the layout it expects"
            )

    def _source_name(self, name: str, optional: bool = False) -> str | None:
        """``name`` as the source stores it (GPT-2's hub files lack the ``transformer.`` prefix)."""
        for candidate in (name, name.removeprefix("transformer.")):
            if candidate in self.source.tensors:
                self._used.add(candidate)
                return candidate
        if optional:
            return None
        raise Mha2GqaError(
            f"{self.folder}: the {self.spec.source} checkpoint has no {name}; it is not the layout "
            f"the {self.spec.source} -> {self.spec.target} re-targeting expects"
        )

    def _shape(self, name: str, transpose: bool = False) -> tuple[int, ...]:
        shape = self.source.tensors[name].shape
        return tuple(reversed(shape)) if transpose else shape

    def _shapes(self, op: _Op) -> dict[str, tuple[int, ...]]:
        spec, kind = op.spec, op.spec["op"]
        if kind in ("ones", "zeros"):
            return {
                op.name(spec["to"]): tuple(int(evaluate_expression(str(e), self.source.config)) for e in spec["shape"])
            }
        transpose = spec.get("transpose", False)
        if kind == "copy":
            name = self._source_name(op.name(spec["from"]), spec.get("optional", False))
            if name is None:
                return {}
            shape = self._shape(name, transpose)
            op.dtype_code = self.source.tensors[name].dtype
            return {op.name(spec["to"]): (shape[0] - spec.get("rows_from", 0), *shape[1:])}
        if kind == "linear":
            w = self._source_name(op.name(spec["from"]) + ".weight")
            has_bias = self._source_name(op.name(spec["from"]) + ".bias", optional=True) is not None
            self._fold_names(op)
            op.dtype_code = self.source.tensors[w].dtype
            rows, cols = self._shape(w, transpose)
            out = {op.name(spec["to"]) + ".weight": (rows, cols)}
            if has_bias or spec.get("bias", True):
                out[op.name(spec["to"]) + ".bias"] = (rows,)
            return out
        # qkv
        d, heads = self.dims.head_dim, self.dims.num_heads
        for name in self._qkv_sources(op):
            op.dtype_code = self.source.tensors[self._source_name(name + ".weight")].dtype
            self._source_name(name + ".bias", optional=True)
        self._fold_names(op)
        hidden = self.dims.hidden_size
        if isinstance(spec["to"], list):
            out = {}
            for module in spec["to"]:
                out |= {op.name(module) + ".weight": (heads * d, hidden), op.name(module) + ".bias": (heads * d,)}
            return out
        return {
            op.name(spec["to"]) + ".weight": (3 * heads * d, hidden),
            op.name(spec["to"]) + ".bias": (3 * heads * d,),
        }

    def _qkv_sources(self, op: _Op) -> list[str]:
        src = op.spec["from"]
        return [op.name(m) for m in src] if isinstance(src, list) else [op.name(src)]

    def _fold_names(self, op: _Op) -> None:
        if "fold" in op.spec:
            self._source_name(op.name(op.spec["fold"]) + ".weight")
            self._source_name(op.name(op.spec["fold"]) + ".bias", optional=True)

    # reading and the algebra (float64, cast back to the stored dtype on the way out)
    def read(self, name: str, transpose: bool = False) -> Any:
        t = self.source.load(self._source_name(name))
        return t.t().contiguous() if transpose else t

    def read_linear(self, module: str, transpose: bool) -> tuple[Any, Any]:
        w = self.read(module + ".weight", transpose).double()
        bias = self._source_name(module + ".bias", optional=True)
        return w, (self.source.load(bias).double() if bias else None)

    def fold(self, w: Any, b: Any, norm: str | None) -> tuple[Any, Any]:
        """``W·diag(γ)`` and ``W·β + b`` for the norm ``γ⊙n(x) + β`` that feeds ``W``."""
        if norm is None:
            return w, b
        gamma = self.read(norm + ".weight").double()
        beta_name = self._source_name(norm + ".bias", optional=True)
        folded = w * gamma[None, :]
        if beta_name is None:
            return folded, b
        shift = w @ self.source.load(beta_name).double()
        return folded, shift if b is None else shift + b

    def emit(self, module: str, w: Any, b: Any, bias: bool, dtype: Any) -> dict[str, Any]:
        import torch

        out = {module + ".weight": w.to(dtype)}
        if b is not None or bias:
            out[module + ".bias"] = (b if b is not None else torch.zeros(w.shape[0], dtype=torch.float64)).to(dtype)
        return out

    def qkv(self, op: _Op) -> dict[str, Any]:
        """Split (or gather) the source's q, k, v; fold, permute rotary rows; write them separately
        or fused in the target family's layout."""
        import torch

        from mha2gqa.core.families import split_fused_qkv

        spec, dims = op.spec, self.dims
        heads, d = dims.num_heads, dims.head_dim
        sources = self._qkv_sources(op)
        transpose = spec.get("transpose", False)
        if len(sources) == 1:
            w, b = self.read_linear(sources[0], transpose)
            layout = spec.get("layout", "stacked")
            parts_w = split_fused_qkv(w, heads, heads, d, layout)
            parts_b = split_fused_qkv(b, heads, heads, d, layout) if b is not None else (None,) * 3
        else:
            pairs = [self.read_linear(m, transpose) for m in sources]
            parts_w, parts_b = tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
        norm = op.name(spec["fold"]) if "fold" in spec else None
        folded = [self.fold(w, b, norm) for w, b in zip(parts_w, parts_b, strict=True)]
        zeros = torch.zeros(heads * d, dtype=torch.float64)
        ws = [w for w, _ in folded]
        bs = [b if b is not None else zeros for _, b in folded]
        if spec.get("rotary") == "interleaved":  # q and k rows: interleaved pairs -> rotate-half
            order = torch.tensor(_rotate_half_order(d, dims.rotary))
            index = (torch.arange(heads)[:, None] * d + order[None, :]).reshape(-1)
            for i in (0, 1):
                ws[i], bs[i] = ws[i][index], bs[i][index]
        if isinstance(spec["to"], list):
            out = {}
            for module, w, b in zip(spec["to"], ws, bs, strict=True):
                out |= self.emit(op.name(module), w, b, True, op.dtype)
            return out
        fused_w = self.family.join_qkv(*ws, heads, heads, d)
        fused_b = self.family.join_qkv(*bs, heads, heads, d)
        return {
            op.name(spec["to"]) + ".weight": fused_w.to(op.dtype),
            op.name(spec["to"]) + ".bias": fused_b.to(op.dtype),
        }

    def load(self, name: str, warn: bool = True) -> Any:
        """Target tensor ``name``, computed from the source (its layer's q/k/v together, once)."""
        if name not in self._ops:
            raise KeyError(name)
        return self._ops[name].get(name)

    def check_finite(self) -> None:
        self.source.check_finite()


def retargeted(ckpt: Checkpoint) -> Checkpoint:
    """``ckpt`` as its re-targeting's target class (checked), or ``ckpt`` itself when its class
    needs none."""
    spec = find_retarget(ckpt.config)
    if spec is None:
        return ckpt
    why = spec.refusal(ckpt.config)
    if why:
        arch = (ckpt.config.get("architectures") or [spec.source])[0]
        raise Mha2GqaError(f"{ckpt.folder}: {arch} cannot be re-expressed as {spec.target} exactly: {why}")
    return RetargetedCheckpoint(ckpt, resolve(ckpt.config))


def retarget_record(ckpt: Checkpoint) -> Retargeted | None:
    """What the conversion record says about a re-targeting (None when there was none)."""
    if not isinstance(ckpt, RetargetedCheckpoint):
        return None
    archs = ckpt.source.config.get("architectures") or [ckpt.spec.source]
    return Retargeted(
        source_class=archs[0],
        target_class=ckpt.spec.target,
        definition=f"retargets/{ckpt.spec.source}.json",
        description=ckpt.spec.description,
    )
