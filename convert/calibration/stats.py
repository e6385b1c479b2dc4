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

from dataclasses import dataclass, field

import torch


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
        """Keep only what :mod:`mha2gqa.convert.methods` read, dropping the ``(s*d)^2`` Grams, so
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
