"""Aligned merging (``--method aligned``, arXiv 2412.20677 style): every head of a group is rotated
onto its first head with transforms that commute with RoPE, then the group is averaged; each head's
inverse rotation is absorbed into ``q_proj`` / ``o_proj``. Without calibration the alignment comes
from the weights alone (:func:`weight_stats`)."""

from __future__ import annotations

from dataclasses import astuple

import torch

from mha2gqa.convert.calibration.stats import CalibrationStats, LayerStats, accumulate
from mha2gqa.convert.methods import HeadShape
from mha2gqa.convert.methods.layer import Fold, complex_rows, layer_out
from mha2gqa.core.dims import contiguous_groups


def _procrustes(cross: torch.Tensor) -> torch.Tensor:
    """Orthogonal ``R`` maximising ``tr(R C^T)`` for ``C = sum_t a_t b_t^T`` (so ``R b ~ a``)."""
    u, _, vh = torch.linalg.svd(cross)
    return u @ vh


def aligned_merge_layer(w: dict[str, torch.Tensor], stats: LayerStats, *, shape: HeadShape) -> dict[str, torch.Tensor]:
    """Align every head of a group to its first head, then take the mean (arXiv 2412.20677 style).

    K rotary planes are aligned by a rotation per plane (a unit complex number, which commutes with
    RoPE), non-rotary key dimensions and values by an orthogonal Procrustes matrix; each head's
    inverse alignment goes into the ``q_proj`` rows / ``o_proj`` columns of the query heads that read
    it. Same inputs and outputs as :func:`svd_merge_layer`.
    """
    num_heads, num_kv_heads, groups, head_dim, rotary_dim = astuple(shape)
    d, rot, s = head_dim, rotary_dim, num_kv_heads // groups
    r = num_heads // num_kv_heads
    half, rest = rot // 2, head_dim - rotary_dim
    q, o = w["q"].clone(), w["o"].clone()
    qb = w["q_bias"].clone() if w.get("q_bias") is not None else None
    kb, vb = w.get("k_bias"), w.get("v_bias")
    out_k, out_kb, out_v, out_vb = [], [], [], []
    for j, members in enumerate(contiguous_groups(groups * s, groups)):
        new_k = torch.zeros(d, w["k"].shape[1], dtype=w["k"].dtype)
        new_kb = torch.zeros(d, dtype=w["k"].dtype) if kb is not None else None
        new_v = torch.zeros(d, w["v"].shape[1], dtype=w["v"].dtype)
        new_vb = torch.zeros(d, dtype=w["v"].dtype) if vb is not None else None
        for m, h in enumerate(members):
            # values: R_h v_h ~ v_ref; pooled mean; v_h ~ R_h^T z, so o_proj columns take R_h^T
            block = stats.value_row(j, d)[:, m * d : (m + 1) * d]  # sum_t v_ref v_h^T
            rv = _procrustes(block).to(w["v"].dtype)
            new_v += rv @ w["v"][h * d : (h + 1) * d] / s
            if new_vb is not None:
                new_vb += rv @ vb[h * d : (h + 1) * d] / s
            for i in range(h * r, (h + 1) * r):
                o[:, i * d : (i + 1) * d] = o[:, i * d : (i + 1) * d] @ rv.T
            if half:
                _align_rotary(w, stats.k_plane_gram[j, :, m, 0], h, Fold((new_k, new_kb), (q, qb), r, d), half, s)
            if rest:
                rows = slice(h * d + rot, (h + 1) * d)
                rk = _procrustes(stats.rest_row(j, rest)[:, m * rest : (m + 1) * rest]).to(w["k"].dtype)
                new_k[rot:] += rk @ w["k"][rows] / s
                if new_kb is not None:
                    new_kb[rot:] += rk @ kb[rows] / s
                for i in range(h * r, (h + 1) * r):  # k_h ~ R^T z: q . R^T z = (R q) . z
                    for mat in (q, qb):
                        if mat is not None:
                            mat[i * d + rot : (i + 1) * d] = rk @ mat[i * d + rot : (i + 1) * d]
        out_k.append(new_k)
        out_v.append(new_v)
        if new_kb is not None:
            out_kb.append(new_kb)
        if new_vb is not None:
            out_vb.append(new_vb)
    return layer_out(q, qb, o, out_k, out_kb, out_v, out_vb)


def _align_rotary(w, cross: torch.Tensor, h: int, fold: Fold, half: int, s: int) -> None:
    """Head ``h``'s key rotary planes rotated by the phase that best matches the group's first head
    (``cross``: ``sum_t z_h conj(z_ref)`` per plane, ``[P]``) and added, ``/ s``, into ``fold.new``
    (key rows, bias); its query heads in ``fold.queries`` take the same rotation."""
    (new_k, new_kb), queries, r, d = fold.new, fold.queries, fold.r, fold.d
    rot = 2 * half
    unit = torch.where(cross.abs() > 0, cross.conj() / cross.abs().clamp_min(1e-300), 1.0 + 0j)
    planes = complex_rows(w["k"], h * d, half)
    unit = unit.to(planes.dtype)
    planes = planes * unit[:, None]
    new_k[:half] += planes.real / s
    new_k[half:rot] += planes.imag / s
    if new_kb is not None:
        pb = complex_rows(w["k_bias"], h * d, half) * unit
        new_kb[:half] += pb.real / s
        new_kb[half:rot] += pb.imag / s
    for i in range(h * r, (h + 1) * r):  # k_h ~ conj(u) z, so queries take u
        for mat in (mat for mat in queries if mat is not None):
            re, im = mat[i * d : i * d + half].clone(), mat[i * d + half : i * d + rot].clone()
            z = torch.complex(re, im) * (unit if mat.dim() == 1 else unit[:, None])
            mat[i * d : i * d + half], mat[i * d + half : i * d + rot] = z.real, z.imag


def weight_stats(w: dict[str, torch.Tensor], *, shape: HeadShape) -> LayerStats:
    """Calibration-free statistics from the weights alone (inputs taken as isotropic, biases as one
    more constant input): what ``aligned`` uses without ``--calibration``."""
    num_heads, num_kv_heads, groups, head_dim, rotary_dim = astuple(shape)

    def aug(name: str) -> torch.Tensor:
        t = w[name]
        b = w.get(f"{name}_bias")
        return torch.cat([t, (b if b is not None else torch.zeros(t.shape[0], dtype=t.dtype))[:, None]], 1)

    # each input dimension acts as one "token": [1, heads, tokens, d]
    q, k, v = (
        aug(x).T.reshape(1, -1, x_heads, head_dim).transpose(1, 2)
        for x, x_heads in (("q", num_heads), ("k", num_kv_heads), ("v", num_kv_heads))
    )
    stats = CalibrationStats(groups, head_dim, rotary_dim)
    accumulate(stats, 0, q, k, v)
    return stats.layers[0]
