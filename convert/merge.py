"""Activation-aware low-rank merging of K/V heads (``--method svd``), with the bases absorbed into
``q_proj`` and ``o_proj`` so the result is a stock GQA checkpoint.

For KV group ``j`` with source heads ``h`` (``s`` of them) and the query heads ``Q(h)`` that read each:

V
    The top-``d`` principal subspace ``U`` ``[s*d, d]`` of the group's stacked values (uncentred, from
    ``v_gram``) becomes the shared value projection ``U^T [W_v,h; ...]``; head ``h``'s values are
    ``U_h z`` (``U_h``: its ``d`` rows of ``U``), so ``U_h`` is absorbed into the ``o_proj`` columns of
    every query head in ``Q(h)``.
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

import torch

from mha2gqa.convert.calibration import LayerStats, top_eigvecs
from mha2gqa.errors import Mha2GqaError


def _complex_rows(w: torch.Tensor, start: int, half: int) -> torch.Tensor:
    """Rows ``start + [0, half)`` and ``start + half + [0, half)`` as complex ``[half, ...]``."""
    return torch.complex(w[start : start + half], w[start + half : start + 2 * half])


def svd_merge_layer(
    w: dict[str, torch.Tensor],
    stats: LayerStats,
    num_heads: int,
    num_kv_heads: int,
    groups: int,
    head_dim: int,
    rotary_dim: int,
    weighted: bool = True,
) -> dict[str, torch.Tensor]:
    """Merge one layer. ``w`` holds float32 (or float64) ``q``, ``k``, ``v`` ``[heads*d, hidden]``, ``o``
    ``[hidden, H*d]`` and optional biases ``q_bias``/``k_bias``/``v_bias``; returns the same keys with
    ``k``/``v`` (and biases) of ``groups`` heads and the adjusted ``q``/``o``."""
    d, rot, s = head_dim, rotary_dim, num_kv_heads // groups
    r = num_heads // num_kv_heads  # query heads per source KV head
    half, rest = rot // 2, head_dim - rotary_dim
    q, o = w["q"].clone(), w["o"].clone()
    qb = w.get("q_bias")
    qb = qb.clone() if qb is not None else None
    k_rows: list[torch.Tensor] = []
    kb_rows: list[torch.Tensor] = []
    v_rows: list[torch.Tensor] = []
    vb_rows: list[torch.Tensor] = []
    kb, vb = w.get("k_bias"), w.get("v_bias")
    if stats.value_row(0, d).shape[1] != s * d:
        raise Mha2GqaError("calibration statistics do not match this conversion (group size or head_dim)")
    for j in range(groups):
        members = list(range(j * s, (j + 1) * s))
        # ---- V: shared principal subspace, basis into o_proj
        u = stats.value_basis(j, d).to(w["v"].dtype)  # [s*d, d]
        v_stack = torch.cat([w["v"][h * d : (h + 1) * d] for h in members])
        v_rows.append(u.T @ v_stack)
        if vb is not None:
            vb_rows.append(u.T @ torch.cat([vb[h * d : (h + 1) * d] for h in members]))
        for m, h in enumerate(members):
            u_h = u[m * d : (m + 1) * d]  # [d, d]
            for i in range(h * r, (h + 1) * r):
                o[:, i * d : (i + 1) * d] = o[:, i * d : (i + 1) * d] @ u_h
        # ---- K rotary planes: weighted complex rank-1 per plane, coefficients into q_proj
        new_k = torch.zeros(d, w["k"].shape[1], dtype=w["k"].dtype)
        new_kb = torch.zeros(d, dtype=w["k"].dtype) if kb is not None else None
        if half:
            planes_k = torch.stack([_complex_rows(w["k"], h * d, half) for h in members])  # [s, half, hidden]
            planes_kb = torch.stack([_complex_rows(kb, h * d, half) for h in members]) if kb is not None else None
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
                        for mat in (q, qb):
                            if mat is None:
                                continue
                            re, im = mat[i * d + p].clone(), mat[i * d + p + half].clone()
                            mat[i * d + p] = beta[m].real * re - beta[m].imag * im
                            mat[i * d + p + half] = beta[m].real * im + beta[m].imag * re
        # ---- K non-rotary dimensions: real subspace, U_h^T into q_proj
        if rest:
            u = stats.rest_basis(j, rest).to(w["k"].dtype)  # [s*rest, rest]
            stack = torch.cat([w["k"][h * d + rot : (h + 1) * d] for h in members])
            new_k[rot:] = u.T @ stack
            if new_kb is not None:
                new_kb[rot:] = u.T @ torch.cat([kb[h * d + rot : (h + 1) * d] for h in members])
            for m, h in enumerate(members):
                u_h = u[m * rest : (m + 1) * rest]  # [rest, rest]
                for i in range(h * r, (h + 1) * r):
                    for mat in (q, qb):
                        if mat is not None:
                            mat[i * d + rot : (i + 1) * d] = u_h.T @ mat[i * d + rot : (i + 1) * d]
        k_rows.append(new_k)
        if new_kb is not None:
            kb_rows.append(new_kb)
    return _layer_out(q, qb, o, k_rows, kb_rows, v_rows, vb_rows)


def _layer_out(q, qb, o, k_rows, kb_rows, v_rows, vb_rows) -> dict[str, torch.Tensor]:
    """The merged layer as the role -> tensor dict the converter writes (biases only if present)."""
    out = {"q": q, "o": o, "k": torch.cat(k_rows), "v": torch.cat(v_rows)}
    for key, value in (("q_bias", qb), ("k_bias", kb_rows), ("v_bias", vb_rows)):
        if value is not None and (key == "q_bias" or len(value)):
            out[key] = value if key == "q_bias" else torch.cat(value)
    return out


def _procrustes(cross: torch.Tensor) -> torch.Tensor:
    """Orthogonal ``R`` maximising ``tr(R C^T)`` for ``C = sum_t a_t b_t^T`` (so ``R b ~ a``)."""
    u, _, vh = torch.linalg.svd(cross)
    return u @ vh


def aligned_merge_layer(
    w: dict[str, torch.Tensor],
    stats: LayerStats,
    num_heads: int,
    num_kv_heads: int,
    groups: int,
    head_dim: int,
    rotary_dim: int,
) -> dict[str, torch.Tensor]:
    """Align every head of a group to its first head, then take the mean (arXiv 2412.20677 style).

    K rotary planes are aligned by a rotation per plane (a unit complex number, which commutes with
    RoPE), non-rotary key dimensions and values by an orthogonal Procrustes matrix; each head's
    inverse alignment goes into the ``q_proj`` rows / ``o_proj`` columns of the query heads that read
    it. Same inputs and outputs as :func:`svd_merge_layer`.
    """
    d, rot, s = head_dim, rotary_dim, num_kv_heads // groups
    r = num_heads // num_kv_heads
    half, rest = rot // 2, head_dim - rotary_dim
    q, o = w["q"].clone(), w["o"].clone()
    qb = w["q_bias"].clone() if w.get("q_bias") is not None else None
    kb, vb = w.get("k_bias"), w.get("v_bias")
    out_k, out_kb, out_v, out_vb = [], [], [], []
    for j in range(groups):
        members = list(range(j * s, (j + 1) * s))
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
            # rotary planes: rotate head h's plane by the phase that best matches the reference
            if half:
                cross = stats.k_plane_gram[j, :, m, 0]  # sum_t z_h conj(z_ref), [P]
                unit = torch.where(cross.abs() > 0, cross.conj() / cross.abs().clamp_min(1e-300), 1.0 + 0j)
                planes = _complex_rows(w["k"], h * d, half)
                unit = unit.to(planes.dtype)
                planes = planes * unit[:, None]
                new_k[:half] += planes.real / s
                new_k[half:rot] += planes.imag / s
                if new_kb is not None:
                    pb = _complex_rows(kb, h * d, half) * unit
                    new_kb[:half] += pb.real / s
                    new_kb[half:rot] += pb.imag / s
                for i in range(h * r, (h + 1) * r):  # k_h ~ conj(u) z, so queries take u
                    for mat in (q, qb):
                        if mat is None:
                            continue
                        re, im = mat[i * d : i * d + half].clone(), mat[i * d + half : i * d + rot].clone()
                        z = torch.complex(re, im) * (unit if mat.dim() == 1 else unit[:, None])
                        mat[i * d : i * d + half], mat[i * d + half : i * d + rot] = z.real, z.imag
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
    return _layer_out(q, qb, o, out_k, out_kb, out_v, out_vb)


def weight_stats(w: dict[str, torch.Tensor], num_heads: int, num_kv_heads: int, groups: int, head_dim: int,
                 rotary_dim: int) -> LayerStats:  # fmt: skip
    """Calibration-free statistics from the weights alone (inputs taken as isotropic, biases as one
    more constant input): what ``aligned`` uses without ``--calibration``."""
    from mha2gqa.convert.calibration import CalibrationStats, accumulate

    def aug(name: str) -> torch.Tensor:
        t = w[name]
        b = w.get(f"{name}_bias")
        return torch.cat([t, (b if b is not None else torch.zeros(t.shape[0], dtype=t.dtype))[:, None]], 1)

    # each input dimension acts as one "token": [1, heads, tokens, d]
    q, k, v = (aug(x).T.reshape(1, -1, x_heads, head_dim).transpose(1, 2)
               for x, x_heads in (("q", num_heads), ("k", num_kv_heads), ("v", num_kv_heads)))  # fmt: skip
    stats = CalibrationStats(groups, head_dim, rotary_dim)
    accumulate(stats, 0, q, k, v)
    return stats.layers[0]


def permute_heads(
    w: dict[str, torch.Tensor], perm: list[int], num_heads: int, head_dim: int
) -> dict[str, torch.Tensor]:
    """Reorder the source KV heads as ``perm`` and, with each, the query heads that read it
    (``q``/``q_bias`` rows and ``o`` columns move together, so the layer computes the same thing)."""
    d, r = head_dim, num_heads // len(perm)

    def rows(heads: list[int]) -> torch.Tensor:
        return torch.cat([torch.arange(h * d, (h + 1) * d) for h in heads])

    kv_rows = rows(perm)
    q_rows = rows([i for h in perm for i in range(h * r, (h + 1) * r)])
    out = dict(w)
    for key in ("k", "k_bias", "v", "v_bias"):
        if key in w:
            out[key] = w[key][kv_rows]
    for key in ("q", "q_bias"):
        if key in w:
            out[key] = w[key][q_rows]
    out["o"] = w["o"][:, q_rows]
    return out


def pool_merge_layer(w: dict[str, torch.Tensor], groups: int, head_dim: int, reducer) -> dict[str, torch.Tensor]:
    """``mean``/``first`` on (already permuted) contiguous groups: K/V pooled, q/o as they are."""
    from mha2gqa.convert.pooling import reduce_rows

    out = dict(w)
    for key in ("k", "k_bias", "v", "v_bias"):
        if key in w:
            out[key] = reduce_rows(w[key], groups, head_dim, reducer)
    return out
