"""Calibration statistics for activation-aware merging, collected from the model's own attention.

The original model reads calibration text once; a registered attention implementation
(:func:`mha2gqa.eval.attention.capturing`) sees every layer's post-RoPE queries, keys and values.
Only small second-moment matrices are kept per layer (float64), never the activations:

- ``v_gram[j]``: ``[s*d, s*d]`` Gram of the stacked values of the ``s`` source KV heads of group ``j``;
- ``k_plane_gram[j]``: ``[P, s, s]`` complex Gram of each rotary plane ``(i, i + R/2)`` of those heads'
  keys (RoPE multiplies every head's plane by the same ``e^{i theta t}``, which cancels in
  ``k_h conj(k_h')``, so post-RoPE keys give the pre-RoPE Gram);
- ``k_rest_gram[j]``: ``[s*(d-R), s*(d-R)]`` Gram of the non-rotary key dimensions (partial rotary);
- ``q_plane_energy``: ``[H, P]`` energy ``sum |q|^2`` of each query head on each rotary plane;
- ``o_gram``: ``[H, d, d]`` Gram ``O_i^T O_i`` of each query head's columns of the output projection
  (read from the weights, not the text): how much each value direction reaches the layer's output.

Here ``d`` is head_dim, ``R`` the rotary dims (``d * partial_rotary_factor``), ``P = R/2``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


def top_eigvecs(gram: torch.Tensor, k: int) -> torch.Tensor:
    """Eigenvectors of the ``k`` largest eigenvalues of a symmetric/Hermitian ``gram`` (columns), each
    with its canonical sign (:func:`canonical_sign`)."""
    _, vecs = torch.linalg.eigh(gram)
    return canonical_sign(vecs[..., -k:].flip(-1))


def canonical_sign(vecs: torch.Tensor) -> torch.Tensor:
    """``vecs`` ``[..., n, k]`` with each column's sign chosen so that its largest-magnitude entry has a
    positive real part. An eigenvector is defined up to its sign (LAPACK's Hermitian solvers leave
    exactly that free), and the solver's choice can flip under a change in the last bits of the matrix
    (statistics summed in another order: several processes, another thread count). A flipped column
    gives the same function with other weights; fixed this way, near-equal statistics give near-equal
    weights. A sign changes no result: the merge is exact under it, and so are Adam's steps and the
    output projection's solve (each flips with its coordinate)."""
    lead = vecs.gather(-2, vecs.abs().argmax(dim=-2, keepdim=True))  # [..., 1, k]
    lead = lead.real if lead.is_complex() else lead
    return vecs * torch.where(lead < 0, -1, 1).to(vecs.dtype)


@dataclass
class LayerStats:
    v_gram: torch.Tensor | None  # [G, s*d, s*d] float64 (None once compacted)
    k_plane_gram: torch.Tensor  # [G, P, s, s] complex128
    k_rest_gram: torch.Tensor | None  # [G, s*(d-R), s*(d-R)] float64 (None once compacted)
    q_plane_energy: torch.Tensor  # [H, P] float64
    tokens: int = 0
    perm: list[int] | None = None  # source KV heads in their new order (similarity grouping)
    o_gram: torch.Tensor | None = None  # [H, d, d] float64 (None: values weighted equally)
    #: the value code is the principal subspace even with ``o_gram`` (a refit's start); the output-weighted
    #: one (``svd`` alone's) is kept beside it, in ``weighted`` once compacted (:meth:`as_weighted`)
    plain_code: bool = False
    # What the merges read, kept instead of the Grams once a layer is done (see compact):
    v_basis: torch.Tensor | None = None  # [G, s*d, d] the shared value code's encoder (svd)
    v_decode: torch.Tensor | None = None  # [G, s*d, d] each head's values from the code (svd)
    v_row: torch.Tensor | None = None  # [G, d, s*d] first block-row, sum_t v_ref v_h^T (aligned)
    k_rest_basis: torch.Tensor | None = None
    k_rest_row: torch.Tensor | None = None
    weighted: tuple[torch.Tensor, torch.Tensor] | None = None  # the output-weighted code's, kept aside

    def sums(self) -> tuple[torch.Tensor, ...]:
        """The running sums :func:`accumulate` adds each batch to (the token count aside): what
        processes that each read a share of the windows add together."""
        return self.v_gram, self.k_plane_gram, self.k_rest_gram, self.q_plane_energy

    def compact(self, head_dim: int, rest: int) -> LayerStats:
        """Keep only what :mod:`mha2gqa.convert.methods` read, dropping the ``(s*d)^2`` Grams, so
        statistics of many layers fit in memory (64 MB -> 8 MB a layer for 64 heads at G = 8)."""
        if self.v_gram is not None:
            codes = [self.value_code(j, head_dim) for j in range(self.v_gram.shape[0])]
            self.v_basis = torch.stack([c[0] for c in codes])
            self.v_decode = torch.stack([c[1] for c in codes])
            if self.plain_code and self.o_gram is not None:
                aside = [self.weighted_code(j, head_dim) for j in range(self.v_gram.shape[0])]
                self.weighted = torch.stack([c[0] for c in aside]), torch.stack([c[1] for c in aside])
            self.v_row = self.v_gram[:, :head_dim].clone()
            self.k_rest_basis = top_eigvecs(self.k_rest_gram, rest) if rest else self.k_rest_gram[..., :0]
            self.k_rest_row = self.k_rest_gram[:, :rest].clone()
            self.v_gram = self.k_rest_gram = self.o_gram = None
        return self

    def value_code(self, j: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(encode, decode)``, each ``[s*d, d]``: group ``j``'s shared values are ``z = encode^T v``
        (``v``: its heads' values stacked) and head ``m``'s are approximated by ``decode_m z``
        (``decode_m``: its ``d`` rows), the code that loses least of the values as the output
        projection passes them on (:func:`output_weighted_code`; without ``o_gram``, the top
        principal directions, encode = decode)."""
        if self.v_basis is not None:  # compacted: both kept
            return self.v_basis[j], self.v_decode[j]
        if self.o_gram is None or self.plain_code:
            top = top_eigvecs(self.v_gram[j], d)
            return top, top
        return self.weighted_code(j, d)

    def weighted_code(self, j: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Group ``j``'s output-weighted value code (:func:`output_weighted_code`, from ``v_gram`` and ``o_gram``)."""
        s = self.v_gram.shape[-1] // d
        r = self.o_gram.shape[0] // (self.v_gram.shape[0] * s)
        per_head = self.o_gram[j * s * r : (j + 1) * s * r].reshape(s, r, d, d).sum(1)  # [s, d, d]
        return output_weighted_code(self.v_gram[j], per_head)

    def as_weighted(self) -> LayerStats | None:
        """These statistics with the output-weighted value code where the code is the plain one and
        the weighted one was kept aside (``plain_code``); None where there is none."""
        if not self.plain_code or (self.o_gram is None and self.weighted is None):
            return None
        if self.v_basis is None:  # not compacted: value_code weighs by o_gram
            return replace(self, plain_code=False)
        return replace(self, v_basis=self.weighted[0], v_decode=self.weighted[1], weighted=None, plain_code=False)

    def value_row(self, j: int, d: int) -> torch.Tensor:
        """``[d, s*d]``: ``sum_t v_ref v_h^T`` for every head ``h`` of group ``j``."""
        return self.v_row[j] if self.v_row is not None else self.v_gram[j][:d]

    def rest_basis(self, j: int, rest: int) -> torch.Tensor:
        return self.k_rest_basis[j] if self.k_rest_basis is not None else top_eigvecs(self.k_rest_gram[j], rest)

    def rest_row(self, j: int, rest: int) -> torch.Tensor:
        return self.k_rest_row[j] if self.k_rest_row is not None else self.k_rest_gram[j][:rest]


#: Ridge added to each head's output Gram, relative to its mean eigenvalue: keeps the weighting
#: invertible when an output projection leaves a value direction (almost) unused.
OUTPUT_RIDGE = 1e-3


def output_gram(o: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """``[H, d, d]`` float64: ``O_i^T O_i`` for each query head's columns ``O_i`` ``[hidden, d]`` of the
    output projection ``o`` ``[hidden, H*d]``."""
    cols = o.double().reshape(o.shape[0], num_heads, head_dim).permute(1, 0, 2)  # [H, hidden, d]
    return cols.transpose(1, 2) @ cols


def output_weighted_code(gram: torch.Tensor, per_head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(encode, decode)`` ``[s*d, d]`` minimising ``E sum_h |O_h (v_h - decode_h encode^T v)|^2``,
    where ``O_h^T O_h = per_head[h]`` ``[s, d, d]`` sums over the query heads reading head ``h`` and
    ``gram`` ``[s*d, s*d]`` is ``E v v^T`` of the stacked values: with ``M = blockdiag(M_h)``,
    ``M_h = (per_head[h] + ridge)^(1/2)``, the top-``d`` eigenvectors ``U`` of ``M gram M`` give
    ``encode = M U`` and ``decode = M^-1 U``, returned as ``encode = Q`` (orthonormal columns,
    ``M U = Q R``) and ``decode = M^-1 U R^T``: the same merge, with the shared value projection
    ``encode^T W_v`` on the scale of the source's (a refit's Adam steps are sized to it). Equal heads
    (values in a ``d``-dim subspace) are reconstructed exactly, as with the unweighted code."""
    d = per_head.shape[-1]
    eye = torch.eye(d, dtype=torch.float64)
    ridge = OUTPUT_RIDGE * per_head.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)  # [s]
    e, vec = torch.linalg.eigh(per_head.double() + ridge[:, None, None] * eye)
    root = vec @ torch.diag_embed(e.sqrt()) @ vec.transpose(1, 2)
    inverse_root = vec @ torch.diag_embed(e.rsqrt()) @ vec.transpose(1, 2)
    m, m_inv = torch.block_diag(*root), torch.block_diag(*inverse_root)
    u = top_eigvecs(m @ gram @ m, d)
    q, r = torch.linalg.qr(m @ u)
    return q, m_inv @ u @ r.T


@dataclass
class CalibrationStats:
    groups: int
    head_dim: int
    rotary_dim: int
    layers: dict[int, LayerStats] = field(default_factory=dict)
    tokens: int = 0
    source: str = ""

    def weighted(self) -> CalibrationStats | None:
        """These statistics with every layer's output-weighted value code (the merge ``svd`` publishes
        without ``--refit``) where a refit's plain code stands in them and the weighted one was kept
        aside (:meth:`LayerStats.as_weighted`); None where no layer has one."""
        layers = {i: layer.as_weighted() for i, layer in self.layers.items()}
        if all(layer is None for layer in layers.values()):
            return None
        swapped = {i: layer or self.layers[i] for i, layer in layers.items()}
        return replace(self, layers=swapped)


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
