"""Re-targeting: an MHA checkpoint whose transformers class has no KV-head setting (GPT-NeoX/Pythia,
GPT-J, GPT-2, OPT) re-expressed exactly in a class that has one (Phi, GPTBigCode), as data.

Each re-targeting is one JSON file in ``retargets/``: the source class, the target class, the
target config as expressions over the source config, conditions the source must meet, and tensor
operations (renames, Conv1D transposes, fused-QKV splits and joins, LayerNorm folding, the rotary
permutation from interleaved pairs to rotate-half). :class:`RetargetedCheckpoint` presents the
source as a checkpoint of the target class whose tensors are computed on demand, one at a time
(a layer's q/k/v together), so the conversion, calibration and writer run on it unchanged and
memory stays at one layer.

LayerNorm folding (GPT-NeoX's two parallel norms read the same input): for a norm ``γ⊙n(x) + β``
feeding a linear layer ``W·y + b``, ``W' = W·diag(γ)`` and ``b' = W·β + b`` make the layer read the
plain ``n(x)``, so one identity-affine norm (the target's single parallel-block norm) serves both.
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from mha2gqa.core.checkpoint import Checkpoint
from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.families import check_keys, load_definitions, match_definition
from mha2gqa.core.safetensors_io import TensorInfo

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
_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_CMPOPS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Is: operator.is_, ast.IsNot: operator.is_not}


def evaluate(expr: str, config: dict[str, Any]) -> Any:
    """A config expression: source keys (``rope_parameters.rope_theta`` reads into a dict; a missing
    key is None), numbers, strings, ``+ - * / //``, ``or``, ``and``, ``not``, ``== != is`` and
    ``x if c else y``. Nothing else parses, so a definition cannot run code."""

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return config.get(node.id)
        if isinstance(node, ast.Attribute):
            base = ev(node.value)
            return base.get(node.attr) if isinstance(base, dict) else None
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.BoolOp):
            values = [ev(v) for v in node.values]
            if isinstance(node.op, ast.Or):
                return next((v for v in values if v), values[-1])
            return next((v for v in values if not v), values[-1])
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return not ev(node.operand)
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _CMPOPS:
            return _CMPOPS[type(node.ops[0])](ev(node.left), ev(node.comparators[0]))
        if isinstance(node, ast.IfExp):
            return ev(node.body) if ev(node.test) else ev(node.orelse)
        raise ValueError(f"unsupported expression {ast.dump(node)[:60]}")

    return ev(ast.parse(expr, mode="eval"))


_ALLOWED = (
    ast.Expression,
    ast.Constant,
    ast.Name,
    ast.Load,
    ast.Attribute,
    ast.BinOp,
    ast.BoolOp,
    ast.And,
    ast.Or,
    ast.UnaryOp,
    ast.Not,
    ast.Compare,
    ast.IfExp,
    *_BINOPS,
    *_CMPOPS,
)


def check_expression(expr: str, fail) -> None:
    """``expr`` uses only what :func:`evaluate` reads; ``fail(msg)`` builds the error otherwise."""
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        raise fail(f"expression {expr!r} does not parse") from None
    bad = next((n for n in ast.walk(tree) if not isinstance(n, _ALLOWED)), None)
    if bad is not None:
        raise fail(f"expression {expr!r} uses {type(bad).__name__}, which definitions may not")


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
                return evaluate(spec, config)
            if isinstance(spec, dict) and set(spec) == {"value"}:
                return spec["value"]
            if isinstance(spec, dict):
                return {k: build(v) for k, v in spec.items()}
            raise ValueError(f"re-targeting {self.source}: bad config value {spec!r}")

        return {k: v for k, v in ((k, build(s)) for k, s in self.config.items()) if v is not None}

    def refusal(self, config: dict[str, Any]) -> str | None:
        """Why this source cannot be re-expressed exactly, or None."""
        for expr, reason in self.requires:
            if not evaluate(expr, config):
                return reason
        return None


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


# --- the checkpoint view -----------------------------------------------------------------------------


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

    def __init__(self, source: Checkpoint, spec: Retarget) -> None:
        from mha2gqa.core.dims import AttentionDims
        from mha2gqa.core.families import detect_family

        config = spec.target_config(source.config)
        super().__init__(source.folder, config, {}, source.files, "retargeted", source.repo_id, source.revision)
        self.source, self.spec = source, spec
        self.family, self.dims = detect_family(config), AttentionDims.from_config(config)
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
            return {op.name(spec["to"]): tuple(int(evaluate(str(e), self.source.config)) for e in spec["shape"])}
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
    return RetargetedCheckpoint(ckpt, spec)


def retarget_record(ckpt: Checkpoint) -> dict[str, Any] | None:
    """What the conversion record says about a re-targeting (None when there was none)."""
    if not isinstance(ckpt, RetargetedCheckpoint):
        return None
    archs = ckpt.source.config.get("architectures") or [ckpt.spec.source]
    return {
        "source_class": archs[0],
        "target_class": ckpt.spec.target,
        "definition": f"retargets/{ckpt.spec.source}.json",
        "description": ckpt.spec.description,
    }
