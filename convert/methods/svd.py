"""Activation-aware low-rank merging of K/V heads (``--method svd``), with the bases absorbed into
``q_proj`` and ``o_proj`` so the result is a stock GQA checkpoint.

For KV group ``j`` with source heads ``h`` (``s`` of them) and the query heads ``Q(h)`` that read each:

V
    A shared value code ``z = E^T v`` of the group's stacked values ``v`` becomes the shared value
    projection ``E^T [W_v,h; ...]``; head ``h``'s values are ``D_h z`` (``D_h``: its ``d`` rows of
    ``D``), so ``D_h`` is absorbed into the ``o_proj`` columns of every query head in ``Q(h)``. ``E``
    and ``D`` ``[s*d, d]`` minimise the values' error as the output projection passes it on,
    ``E sum_h |O_h (v_h - D_h z)|^2`` (from ``v_gram`` and ``o_gram``, see
    :func:`~mha2gqa.convert.calibration.stats.output_weighted_code`); without ``o_gram`` they are the
    top-``d`` principal subspace of the stacked values (``E = D``).
K, rotary planes
    Only transforms that commute with RoPE may be absorbed into ``q_proj``: one complex coefficient
    per plane ``(i, i + R/2)`` per head. Per plane, the best rank-1 approximation of the group's
    complex keys, weighted by the energy of the queries that read each head
    (``min sum_h w_h |k_h - c_h z|^2``), gives the shared key plane ``z = sum_h a_h k_h`` and each
    head's coefficient; the query planes of ``Q(h)`` are multiplied by ``conj(c_h)``.
K, non-rotary dimensions (partial rotary)
    An ordinary top-``(d-R)`` subspace of the stacked keys, absorbed into the queries with ``U_h^T``.

When the heads of a group are equal, every step is exact, so such a model converts without
changing its logits; with one head per group it reduces to a copy.
"""

from __future__ import annotations

from dataclasses import astuple

import torch

from mha2gqa.convert.calibration.stats import LayerStats, top_eigvecs
from mha2gqa.convert.methods import HeadShape
from mha2gqa.convert.methods.layer import Fold, complex_rows, layer_out
from mha2gqa.core.dims import contiguous_groups
from mha2gqa.core.errors import Mha2GqaError


def svd_merge_layer(
    w: dict[str, torch.Tensor], stats: LayerStats, *, shape: HeadShape, weighted: bool = True
) -> dict[str, torch.Tensor]:
    """Merge one layer. ``w`` holds float32 (or float64) ``q``, ``k``, ``v`` ``[heads*d, hidden]``, ``o``
    ``[hidden, H*d]`` and optional biases ``q_bias``/``k_bias``/``v_bias``; returns the same keys with
    ``k``/``v`` (and biases) of ``groups`` heads and the adjusted ``q``/``o``."""
    num_heads, num_kv_heads, groups, head_dim, rotary_dim = astuple(shape)
    d, s = head_dim, num_kv_heads // groups
    r = num_heads // num_kv_heads  # query heads per source KV head
    q, o = w["q"].clone(), w["o"].clone()
    qb = w.get("q_bias")
    qb = qb.clone() if qb is not None else None
    k_rows: list[torch.Tensor] = []
    kb_rows: list[torch.Tensor] = []
    v_rows: list[torch.Tensor] = []
    vb_rows: list[torch.Tensor] = []
    if stats.value_row(0, d).shape[1] != s * d:
        raise Mha2GqaError("calibration statistics do not match this conversion (group size or head_dim)")
    for j, members in enumerate(contiguous_groups(groups * s, groups)):
        v, vb = _merge_values(w, stats, j, members, o, r, d)
        v_rows.append(v)
        if vb is not None:
            vb_rows.append(vb)
        new_k = torch.zeros(d, w["k"].shape[1], dtype=w["k"].dtype)
        new_kb = torch.zeros(d, dtype=w["k"].dtype) if w.get("k_bias") is not None else None
        if rotary_dim // 2:
            _merge_rotary_keys(w, stats, j, members, Fold((new_k, new_kb), (q, qb), r, d), rotary_dim // 2, weighted)
        if rotary_dim < d:
            _merge_other_keys(w, stats, j, members, Fold((new_k, new_kb), (q, qb), r, d), rotary_dim)
        k_rows.append(new_k)
        if new_kb is not None:
            kb_rows.append(new_kb)
    return layer_out(q, qb, o, k_rows, kb_rows, v_rows, vb_rows)


def _merge_values(
    w: dict[str, torch.Tensor], stats: LayerStats, j: int, members: list[int], o: torch.Tensor, r: int, d: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Group ``j``'s shared value rows ``[d, hidden]`` (and bias) from its value code; each member's
    decoder folded into ``o`` (in place) for its ``r`` query heads."""
    encode, decode = (x.to(w["v"].dtype) for x in stats.value_code(j, d))  # [s*d, d] each
    v = encode.T @ torch.cat([w["v"][h * d : (h + 1) * d] for h in members])
    vb = w.get("v_bias")
    vb = encode.T @ torch.cat([vb[h * d : (h + 1) * d] for h in members]) if vb is not None else None
    for m, h in enumerate(members):
        decode_h = decode[m * d : (m + 1) * d]  # [d, d]
        for i in range(h * r, (h + 1) * r):
            o[:, i * d : (i + 1) * d] = o[:, i * d : (i + 1) * d] @ decode_h
    return v, vb


def _merge_rotary_keys(w, stats, j, members, fold: Fold, half: int, weighted: bool) -> None:
    """Group ``j``'s key rotary planes: a weighted complex rank-1 per plane into ``fold.new`` (key rows,
    bias), each member's coefficient folded into its query heads' planes in ``fold.queries``."""
    (new_k, new_kb), queries, r, d = fold.new, fold.queries, fold.r, fold.d
    kb, s = w.get("k_bias"), len(members)
    planes_k = torch.stack([complex_rows(w["k"], h * d, half) for h in members])  # [s, half, hidden]
    planes_kb = torch.stack([complex_rows(kb, h * d, half) for h in members]) if kb is not None else None
    energy = torch.stack([stats.q_plane_energy[h * r : (h + 1) * r].sum(0) for h in members])  # [s, P]
    for p in range(half):
        gram = stats.k_plane_gram[j, p].conj()  # K^H K for K = [tokens, s]
        wts = energy[:, p] if weighted else torch.ones(s, dtype=torch.float64)
        wts = wts / wts.mean() if wts.sum() > 0 else torch.ones(s, dtype=torch.float64)
        root = wts.clamp_min(1e-12).sqrt().to(torch.complex128)
        vec = top_eigvecs(root[:, None] * gram * root[None, :], 1)[:, 0]  # [s]
        alpha, beta = (root * vec).to(planes_k.dtype), (vec / root).to(planes_k.dtype)
        z = (alpha[:, None] * planes_k[:, p]).sum(0)
        new_k[p], new_k[p + half] = z.real, z.imag
        if new_kb is not None:
            zb = (alpha * planes_kb[:, p]).sum(0)
            new_kb[p], new_kb[p + half] = zb.real, zb.imag
        for m, h in enumerate(members):
            for i in range(h * r, (h + 1) * r):
                for mat in (mat for mat in queries if mat is not None):
                    re, im = mat[i * d + p].clone(), mat[i * d + p + half].clone()
                    mat[i * d + p] = beta[m].real * re - beta[m].imag * im
                    mat[i * d + p + half] = beta[m].real * im + beta[m].imag * re


def _merge_other_keys(w, stats, j, members, fold: Fold, rot: int) -> None:
    """Group ``j``'s key dimensions past the rotary ones: their shared real subspace into ``fold.new``,
    each member's basis ``U_h^T`` into its query heads' dimensions in ``fold.queries``."""
    (new_k, new_kb), queries, r, d = fold.new, fold.queries, fold.r, fold.d
    kb, rest = w.get("k_bias"), d - rot
    u = stats.rest_basis(j, rest).to(w["k"].dtype)  # [s*rest, rest]
    new_k[rot:] = u.T @ torch.cat([w["k"][h * d + rot : (h + 1) * d] for h in members])
    if new_kb is not None:
        new_kb[rot:] = u.T @ torch.cat([kb[h * d + rot : (h + 1) * d] for h in members])
    for m, h in enumerate(members):
        u_h = u[m * rest : (m + 1) * rest]  # [rest, rest]
        for i in range(h * r, (h + 1) * r):
            for mat in (mat for mat in queries if mat is not None):
                mat[i * d + rot : (i + 1) * d] = u_h.T @ mat[i * d + rot : (i + 1) * d]
