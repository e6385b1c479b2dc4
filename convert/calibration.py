"""Calibration statistics for activation-aware merging, collected from the model's own attention.

The original model reads calibration text once; a registered attention implementation
(:func:`mha2gqa.eval.attention.capturing`) sees every layer's post-RoPE queries, keys and values.
Only small second-moment matrices are kept per layer (float64), never the activations:

- ``v_gram[j]``: ``[s*d, s*d]`` Gram of the stacked values of the ``s`` source KV heads of group ``j``;
- ``k_plane_gram[j]``: ``[P, s, s]`` complex Gram of each rotary plane ``(i, i + R/2)`` of those heads'
  keys (RoPE multiplies every head's plane by the same ``e^{i theta t}``, which cancels in
  ``k_h conj(k_h')``, so post-RoPE keys give the pre-RoPE Gram);
- ``k_rest_gram[j]``: ``[s*(d-R), s*(d-R)]`` Gram of the non-rotary key dimensions (partial rotary);
- ``q_plane_energy``: ``[H, P]`` energy ``sum |q|^2`` of each query head on each rotary plane.

Here ``d`` is head_dim, ``R`` the rotary dims (``d * partial_rotary_factor``), ``P = R/2``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mha2gqa.errors import Mha2GqaError


def top_eigvecs(gram: torch.Tensor, k: int) -> torch.Tensor:
    """Eigenvectors of the ``k`` largest eigenvalues of a symmetric/Hermitian ``gram`` (columns)."""
    _, vecs = torch.linalg.eigh(gram)
    return vecs[..., -k:].flip(-1)


@dataclass
class LayerStats:
    v_gram: torch.Tensor | None  # [G, s*d, s*d] float64 (None once compacted)
    k_plane_gram: torch.Tensor  # [G, P, s, s] complex128
    k_rest_gram: torch.Tensor | None  # [G, s*(d-R), s*(d-R)] float64 (None once compacted)
    q_plane_energy: torch.Tensor  # [H, P] float64
    tokens: int = 0
    perm: list[int] | None = None  # source KV heads in their new order (similarity grouping)
    # What the merges read, kept instead of the Grams once a layer is done (see compact):
    v_basis: torch.Tensor | None = None  # [G, s*d, d] top eigenvectors (svd)
    v_row: torch.Tensor | None = None  # [G, d, s*d] first block-row, sum_t v_ref v_h^T (aligned)
    k_rest_basis: torch.Tensor | None = None
    k_rest_row: torch.Tensor | None = None

    def compact(self, head_dim: int, rest: int) -> LayerStats:
        """Keep only what :mod:`mha2gqa.convert.merge` reads, dropping the ``(s*d)^2`` Grams, so
        statistics of many layers fit in memory (64 MB -> 8 MB a layer for 64 heads at G = 8)."""
        if self.v_gram is not None:
            self.v_basis, self.v_row = top_eigvecs(self.v_gram, head_dim), self.v_gram[:, :head_dim].clone()
            self.k_rest_basis = top_eigvecs(self.k_rest_gram, rest) if rest else self.k_rest_gram[..., :0]
            self.k_rest_row = self.k_rest_gram[:, :rest].clone()
            self.v_gram = self.k_rest_gram = None
        return self

    def value_basis(self, j: int, d: int) -> torch.Tensor:
        """``[s*d, d]``: top principal directions of group ``j``'s stacked values."""
        return self.v_basis[j] if self.v_basis is not None else top_eigvecs(self.v_gram[j], d)

    def value_row(self, j: int, d: int) -> torch.Tensor:
        """``[d, s*d]``: ``sum_t v_ref v_h^T`` for every head ``h`` of group ``j``."""
        return self.v_row[j] if self.v_row is not None else self.v_gram[j][:d]

    def rest_basis(self, j: int, rest: int) -> torch.Tensor:
        return self.k_rest_basis[j] if self.k_rest_basis is not None else top_eigvecs(self.k_rest_gram[j], rest)

    def rest_row(self, j: int, rest: int) -> torch.Tensor:
        return self.k_rest_row[j] if self.k_rest_row is not None else self.k_rest_gram[j][:rest]


@dataclass
class CalibrationStats:
    groups: int
    head_dim: int
    rotary_dim: int
    layers: dict[int, LayerStats] = field(default_factory=dict)
    tokens: int = 0
    source: str = ""


def rotary_dim(config) -> int:
    """Rotary dimensions per head (``head_dim * partial_rotary_factor``, transformers' rule)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
    return int(head_dim * factor)


def _planes(x: torch.Tensor, rot: int) -> torch.Tensor:
    """``[..., d]`` -> complex ``[..., rot/2]``: plane ``i`` is ``x[i] + 1j * x[i + rot/2]``."""
    half = rot // 2
    return torch.complex(x[..., :half].double(), x[..., half:rot].double())


def accumulate(stats: CalibrationStats, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Add one batch of a layer's post-RoPE ``q [B,H,T,d]``, ``k``/``v`` ``[B,Gs,T,d]``."""
    g, d, rot = stats.groups, stats.head_dim, stats.rotary_dim
    heads, src = q.shape[1], k.shape[1]
    s = src // g
    tokens = q.shape[0] * q.shape[2]
    # [B, Gs, T, d] -> [G, B*T, s, d]
    kk = k.double().reshape(k.shape[0], g, s, k.shape[2], d).permute(1, 0, 3, 2, 4).reshape(g, tokens, s, d)
    vv = v.double().reshape(v.shape[0], g, s, v.shape[2], d).permute(1, 0, 3, 2, 4).reshape(g, tokens, s * d)
    kp = _planes(kk, rot).permute(0, 3, 1, 2)  # [G, P, N, s]
    kr = kk[..., rot:].reshape(g, tokens, s * (d - rot))
    qp = _planes(q.double(), rot).abs().pow(2).sum(dim=(0, 2))  # [H, P]
    entry = stats.layers.get(layer)
    if entry is None:
        p = rot // 2
        entry = stats.layers[layer] = LayerStats(
            torch.zeros(g, s * d, s * d, dtype=torch.float64),
            torch.zeros(g, p, s, s, dtype=torch.complex128),
            torch.zeros(g, s * (d - rot), s * (d - rot), dtype=torch.float64),
            torch.zeros(heads, p, dtype=torch.float64),
        )
    entry.v_gram += (vv.transpose(1, 2) @ vv).cpu()
    entry.k_plane_gram += (kp.transpose(2, 3) @ kp.conj()).cpu()  # sum_t z_t z_t^H as [s, s]: z[a] conj(z[b])
    entry.k_rest_gram += (kr.transpose(1, 2) @ kr).cpu()
    entry.q_plane_energy += qp.cpu()
    entry.tokens += tokens


class _Stop(Exception):
    """Raised by the stand-in first layer once it has seen its inputs."""


class _Catch(torch.nn.Module):
    """Stands in for the decoder layers: records the inputs of the first one, then stops."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.Tensor, dict]] = []

    def forward(self, hidden_states, *args, **kwargs):
        if args:
            raise RuntimeError("decoder layers are expected to be called with keyword arguments")
        self.calls.append((hidden_states, kwargs))
        raise _Stop


def _materialize(module: torch.nn.Module, ckpt, prefix: str, device: torch.device,
                 dtype: torch.dtype | None = torch.float32) -> None:  # fmt: skip
    """Give ``module``'s parameters (on ``meta``) their weights from the checkpoint on ``device``, in
    ``dtype`` (None: as stored); its buffers (real, computed at construction) move along."""
    from accelerate.utils import set_module_tensor_to_device

    for name, _ in module.named_parameters():
        value = ckpt.load(prefix + name)
        value = value if dtype is None else value.to(dtype=dtype)
        set_module_tensor_to_device(module, name, device, value=value, dtype=value.dtype)  # else it casts back
    for name, _ in module.named_buffers():
        set_module_tensor_to_device(module, name, device)


@contextlib.contextmanager
def _float32_on_call(layer: torch.nn.Module):
    """Run ``layer`` in float32 while its weights stay in their stored dtype: each submodule's own
    parameters are upcast just before it runs and given back after, so a bf16 layer costs its bf16
    size plus one float32 module (the largest projection) instead of twice its size. The values
    are those of a float32 copy (bf16 -> fp32 is exact), so the outputs are too."""
    stored: dict[torch.nn.Module, dict[str, torch.Tensor]] = {}

    def up(module, args):
        own = dict(module.named_parameters(recurse=False))
        stored[module] = {n: p.data for n, p in own.items()}
        for p in own.values():
            p.data = p.data.float()

    def down(module, args, output):
        for n, p in module.named_parameters(recurse=False):
            p.data = stored[module][n]
        del stored[module]

    handles = []
    for m in layer.modules():
        own = list(m.parameters(recurse=False))
        if own and any(p.dtype != torch.float32 for p in own):
            handles += [m.register_forward_pre_hook(up), m.register_forward_hook(down)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _release(module: torch.nn.Module) -> None:
    """Send ``module``'s parameters back to ``meta`` and hand the freed memory back to the OS
    (glibc keeps freed heap pages otherwise, and RSS would creep up layer after layer)."""
    from accelerate.utils import set_module_tensor_to_device

    for name, _ in module.named_parameters():
        set_module_tensor_to_device(module, name, "meta")
    _trim()


def _trim() -> None:
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(name).malloc_trim(0)


def calibration_ids(model_dir: Path, data: str, tokens: int, seq_len: int, text_field: str = "text") -> torch.Tensor:
    """``[windows, seq_len]``: the first ``tokens`` tokens of ``data`` as disjoint windows."""
    from mha2gqa.eval.data import load_text, token_stream
    from mha2gqa.eval.models import load_tokenizer

    ids = token_stream(load_tokenizer(model_dir), load_text(data, text_field), tokens)
    if ids.numel() < seq_len:
        raise Mha2GqaError(f"--calibration {data}: {ids.numel()} tokens, fewer than one window of {seq_len}")
    n = ids.numel() // seq_len
    return ids[: n * seq_len].reshape(n, seq_len)


@torch.inference_mode()
def collect(model_dir: Path, groups: int, data: str, tokens: int, seq_len: int | None = None, device: str = "auto",
            text_field: str = "text", grouping: str = "contiguous",
            allow_pickle: bool = False, compact: bool = True) -> CalibrationStats:  # fmt: skip
    """Gather :class:`CalibrationStats` for merging into ``groups`` KV heads from the first
    ``tokens`` tokens of ``data`` (disjoint windows of ``seq_len``), streaming the model layer by
    layer from its shards: the model is built on ``meta``; the embeddings run once (the inputs of
    the first decoder layer are caught, GPTQ-style), then each decoder layer in turn gets its
    weights, processes every window and is emptied again. Memory: one layer in float32 plus the
    calibration activations (``tokens x hidden``), never the whole model.

    With ``grouping="similarity"`` each layer's statistics are first gathered over all source KV
    heads, which then form the equal groups that lose least in the merge
    (:func:`least_residual_groups`), recorded as
    ``perm`` on the layer's statistics. With ``compact`` (the default) each finished layer keeps
    only what the merges read (:meth:`LayerStats.compact`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from mha2gqa.convert.checkpoint import open_checkpoint
    from mha2gqa.eval.attention import capturing
    from mha2gqa.eval.models import resolve_device

    dev = resolve_device(device)
    ckpt = open_checkpoint(str(model_dir), allow_pickle=allow_pickle)
    config = AutoConfig.from_pretrained(model_dir)
    config.use_cache = False
    seq_len = min(seq_len or 512, getattr(config, "max_position_embeddings", None) or 512)
    windows = calibration_ids(model_dir, data, tokens, seq_len, text_field).to(dev)
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):  # parameters on meta, buffers (RoPE, scales) real
        model = AutoModelForCausalLM.from_config(config).eval()
    base = model.base_model
    prefix = f"{model.base_model_prefix}."
    layers = base.layers
    others = [child for name, child in base.named_children() if name != "layers"]
    for name, child in base.named_children():
        if name != "layers":  # embeddings as stored (a lookup loses nothing); only the first layer's inputs are needed
            _materialize(child, ckpt, f"{prefix}{name}.", dev, dtype=None)
    catcher = _Catch()
    base.layers = torch.nn.ModuleList([catcher])
    for w in windows:
        with contextlib.suppress(_Stop):
            base(w[None], use_cache=False)
    base.layers = layers
    for child in others:
        _release(child)
    states = []
    for h, kw in catcher.calls:  # layers run in float32: hidden states and RoPE tables too
        h = h.float()
        if "position_embeddings" in kw and kw.get("position_ids") is not None:
            kw = {**kw, "position_embeddings": base.rotary_emb(h, kw["position_ids"])}
        states.append((h, kw))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    stats = CalibrationStats(groups, head_dim, rotary_dim(config), source=data)
    full = CalibrationStats(1, head_dim, rotary_dim(config)) if grouping == "similarity" else stats

    def record(layer, q, k, v, *_):
        accumulate(full, layer, q, k, v)

    with capturing(model, record):
        for i, layer in enumerate(layers):
            _materialize(layer, ckpt, f"{prefix}layers.{i}.", dev, dtype=None)  # as stored ...
            with _float32_on_call(layer):  # ... and each module in float32 only while it runs
                for n, (h, kw) in enumerate(states):
                    out = layer(h, **kw)
                    states[n] = (out[0] if isinstance(out, tuple) else out, kw)
            _release(layer)
            if full is not stats:  # choose this layer's groups, keep only their blocks
                layer_full = full.layers.pop(i)
                chosen = least_residual_groups(layer_full, groups)
                stats.layers[i] = regroup(layer_full, chosen, config.num_attention_heads)
            if compact:
                stats.layers[i].compact(head_dim, head_dim - stats.rotary_dim)
    stats.tokens = windows.numel()
    return stats


def merge_residual(full: LayerStats, heads: list[int]) -> float:
    """What one shared KV head cannot keep of ``heads`` (source KV heads), from single-group
    statistics: the share of the group's key energy outside the best complex rank-1 fit of each
    rotary plane, plus the share of its value energy (and non-rotary key energy) outside the top
    ``d``-dimensional subspace -- the quantities the ``svd`` merge gives up. 0 for identical heads."""
    src = full.k_plane_gram.shape[-1]
    d = full.v_gram.shape[-1] // src
    rest = full.k_rest_gram.shape[-1] // src

    def rows(width: int) -> torch.Tensor:
        return torch.cat([torch.arange(h * width, (h + 1) * width) for h in heads])

    def lost(gram: torch.Tensor, keep: int) -> float:
        ev = torch.linalg.eigvalsh(gram)
        return float(1 - ev[..., -keep:].sum() / ev.sum().clamp_min(1e-300))

    out = lost(full.v_gram[0][rows(d)][:, rows(d)], d) + lost(full.k_plane_gram[0][:, heads][:, :, heads], 1)
    if rest:
        out += lost(full.k_rest_gram[0][rows(rest)][:, rows(rest)], rest)
    return out


def least_residual_groups(full: LayerStats, groups: int) -> list[list[int]]:
    """Equal-size groups of source KV heads that lose least in the merge (:func:`merge_residual`):
    a greedy search (each group starts from the lowest unassigned head and adds, one at a time, the
    head that keeps the group's residual lowest), kept only if its total residual beats the
    contiguous ``repeat_kv`` grouping's -- so the choice is never worse than the default by this
    measure."""
    n = full.k_plane_gram.shape[-1]
    size = n // groups
    free = list(range(n))
    greedy = []
    while free:
        group = [free.pop(0)]
        while len(group) < size:
            best = min(free, key=lambda h: (merge_residual(full, [*group, h]), h))
            free.remove(best)
            group.append(best)
        greedy.append(sorted(group))
    contiguous = [list(range(j * size, (j + 1) * size)) for j in range(groups)]

    def cost(gs: list[list[int]]) -> float:
        return sum(merge_residual(full, g) for g in gs)

    return greedy if cost(greedy) < cost(contiguous) - 1e-12 else contiguous


def regroup(full: LayerStats, groups: list[list[int]], num_heads: int) -> LayerStats:
    """Group statistics for ``groups`` (lists of source KV heads) from single-group statistics,
    with ``perm`` (the source heads in their new order) recorded."""
    perm = [h for g in groups for h in g]
    src = len(perm)
    r = num_heads // src
    d = full.v_gram.shape[-1] // src
    rest = full.k_rest_gram.shape[-1] // src

    def rows(width: int, heads: list[int]) -> torch.Tensor:
        return (
            torch.cat([torch.arange(h * width, (h + 1) * width) for h in heads])
            if width
            else torch.zeros(0, dtype=torch.long)
        )

    v = torch.stack([full.v_gram[0][rows(d, g)][:, rows(d, g)] for g in groups])
    kr = torch.stack([full.k_rest_gram[0][rows(rest, g)][:, rows(rest, g)] for g in groups])
    kp = torch.stack([full.k_plane_gram[0][:, g][:, :, g] for g in groups])
    q = full.q_plane_energy[rows(r, perm)]
    return LayerStats(v, kp, kr, q, full.tokens, perm=perm)
