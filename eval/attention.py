"""Per-layer, per-head attention similarity between an original model and its conversion.

Both models read the same tokens, each end to end, seen through
:func:`mha2gqa.core.capture.capturing` (each layer's post-RoPE queries and keys and its values, as
the model applies its own projections, biases, q/k norms and partial rotary). The original's tensors
are kept per layer (``[B, heads, T, head_dim]``: layers x sequence, never sequence squared); when
the converted model reaches the same layer, attention rows are rebuilt for both in float32,
``chunk`` queries at a time, compared, and the original's layer is freed.

Statistics per query head, averaged over all query rows: KL(original || converted) and
Jensen-Shannon divergence of the attention rows, cosine of the rows, the entropy of each (and the
uniform distribution's, to expose collapse toward uniform), and the relative error of the head's
contribution to the residual stream, its output through its columns of the output projection,
``||o_conv W_conv^T - o_orig W_orig^T|| / ||o_orig W_orig^T||`` (``contribution_rel_error``): unlike
the raw output error ``||o_conv - o_orig|| / ||o_orig||`` (``output_rel_error``, also kept), it does
not change when a merge absorbs a basis change into ``q_proj``/``o_proj`` (``svd``, ``aligned``).
Per layer: cosine of the decoder layer's output hidden states, averaged over tokens, and head
diversity: the ``H x H`` cosine similarity of the heads' attention patterns (each head's rows over the
causal triangle as one vector, accumulated as a Gram matrix chunk by chunk) for both models, with its
mean off the diagonal and within and across the converted model's KV groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from mha2gqa.core.capture import capturing, soft_capped, softcap_of
from mha2gqa.core.conversion_record import Facts
from mha2gqa.core.signals import check as check_signals
from mha2gqa.eval.metrics import cosine, row_stats
from mha2gqa.eval.results import (
    Attention,
    AttentionLayer,
    AttentionSummary,
    HeadScore,
    HeadSimilarity,
    Similarity,
)


def _scores_mask(mask: torch.Tensor | None, rows: slice, t: int, sliding_window: int | None, device) -> torch.Tensor:
    """Boolean ``[B or 1, 1, C, T]`` of the keys each query row in ``rows`` may attend to."""
    if mask is not None:
        m = mask[..., rows, :t]
        return m if m.dtype == torch.bool else m == 0
    q = torch.arange(rows.start, rows.stop, device=device)[:, None]
    k = torch.arange(t, device=device)[None, :]
    allowed = k <= q
    if sliding_window:
        allowed &= k > q - sliding_window
    return allowed[None, None]


def _log_attention(
    q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor, scaling: float, softcap: float | None = None
) -> torch.Tensor:
    """float32 log-softmax of ``q k^T * scaling`` (soft-capped: ``cap * tanh(s / cap)``) over allowed
    keys. ``[B,H,C,d],[B,H,T,d] -> [B,H,C,T]``."""
    s = soft_capped(torch.matmul(q.float(), k.float().transpose(-1, -2)) * scaling, softcap)
    return torch.log_softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)


@dataclass
class HeadSums:
    """Running sums for one layer, one entry per query head."""

    heads: int
    rows: int = 0
    kl: torch.Tensor = field(init=False)
    js: torch.Tensor = field(init=False)
    cos: torch.Tensor = field(init=False)
    ent_orig: torch.Tensor = field(init=False)
    ent_conv: torch.Tensor = field(init=False)
    ent_uniform: float = 0.0
    err_sq: torch.Tensor = field(init=False)
    ref_sq: torch.Tensor = field(init=False)
    contrib_err_sq: torch.Tensor = field(init=False)
    contrib_ref_sq: torch.Tensor = field(init=False)
    contribution: bool = False  # whether both models' output projections were available
    gram_orig: torch.Tensor = field(init=False)  # [H, H] sums of <p_h, p_g> over every attention row
    gram_conv: torch.Tensor = field(init=False)
    kv_heads: int = 0  # the converted layer's KV heads (its groups)

    def __post_init__(self) -> None:
        for name in ("kl", "js", "cos", "ent_orig", "ent_conv", "err_sq", "ref_sq", "contrib_err_sq", "contrib_ref_sq"):
            setattr(self, name, torch.zeros(self.heads, dtype=torch.float64))
        self.gram_orig = torch.zeros(self.heads, self.heads, dtype=torch.float64)
        self.gram_conv = torch.zeros(self.heads, self.heads, dtype=torch.float64)

    def head_similarity(self) -> HeadSimilarity:
        """Head diversity of both models: per model, the ``H x H`` cosine similarity of the heads'
        attention patterns (all rows of the causal triangle, as one vector per head), its mean off
        the diagonal, and the means within and across the converted model's KV groups."""
        per = self.heads // max(self.kv_heads, 1)
        return HeadSimilarity(
            original=Similarity(**similarity_summary(self.gram_orig, per)),
            converted=Similarity(**similarity_summary(self.gram_conv, per)),
        )

    def scores(self) -> list[str]:
        """The per-head scores this layer has (the contribution error only where both models'
        output projections were available)."""
        names = ["kl", "js", "cosine", "entropy_original", "entropy_converted", "output_rel_error"]
        return names + (["contribution_rel_error"] if self.contribution else [])

    def result(self) -> list[HeadScore]:
        n = max(self.rows, 1)
        rel = (self.err_sq / self.ref_sq.clamp_min(1e-30)).sqrt()
        contrib = (self.contrib_err_sq / self.contrib_ref_sq.clamp_min(1e-30)).sqrt()
        return [
            HeadScore(
                kl=self.kl[h].item() / n,
                js=self.js[h].item() / n,
                cosine=self.cos[h].item() / n,
                entropy_original=self.ent_orig[h].item() / n,
                entropy_converted=self.ent_conv[h].item() / n,
                output_rel_error=rel[h].item(),
                contribution_rel_error=contrib[h].item() if self.contribution else None,
            )
            for h in range(self.heads)
        ]


def similarity_summary(gram: torch.Tensor, group_size: int) -> dict[str, Any]:
    """Cosine matrix of a Gram matrix ``[H, H]`` and its means: off the diagonal, within groups of
    ``group_size`` consecutive heads and across them (None where there is no such pair)."""
    norm = gram.diagonal().clamp_min(1e-300).sqrt()
    cos = gram / (norm[:, None] * norm[None, :])
    idx = torch.arange(cos.shape[0])
    off = idx[:, None] != idx[None, :]
    same = (idx[:, None] // group_size == idx[None, :] // group_size) & off

    def mean(mask: torch.Tensor) -> float | None:
        return cos[mask].mean().item() if mask.any() else None

    return {
        "mean": mean(off),
        "within_groups": mean(same),
        "across_groups": mean(off & ~same),
        "matrix": [[round(v, 6) for v in row] for row in cos.tolist()],
    }


def head_projections(w_o: torch.Tensor, heads: int) -> torch.Tensor:
    """The output projection ``[hidden, H*d]`` as one ``[H, hidden, d]`` block per query head."""
    hidden = w_o.shape[0]
    return w_o.float().reshape(hidden, heads, -1).permute(1, 0, 2)


def _contribution_sums(
    out_o: torch.Tensor,
    out_c: torch.Tensor,
    w_o: torch.Tensor,
    w_c: torch.Tensor,
    sums: HeadSums,
    heads_per_step: int = 4,
) -> None:
    """Add each head's contribution to the residual stream, ``o_h W_h^T`` (``[B, C, hidden]``), of
    both models to the error sums: invariant to any basis a merge absorbs into q/o projections.
    ``out_*`` ``[B, H, C, d]``, ``w_*`` ``[H, hidden, d]``; a few heads at a time bound the memory."""
    for h0 in range(0, out_o.shape[1], heads_per_step):
        hs = slice(h0, h0 + heads_per_step)
        ref = torch.einsum("bhcd,hnd->bhcn", out_o[:, hs], w_o[hs])
        diff = torch.einsum("bhcd,hnd->bhcn", out_c[:, hs], w_c[hs]) - ref
        sums.contrib_err_sq[hs] += diff.pow(2).sum((0, 2, 3)).double().cpu()
        sums.contrib_ref_sq[hs] += ref.pow(2).sum((0, 2, 3)).double().cpu()


def _add_gram(gram: torch.Tensor, p: torch.Tensor) -> None:
    """``gram[h, g] += <p_h, p_g>`` over every row and key of ``p`` ``[B, H, C, keys]``, one batch
    element at a time as a view ``[H, C*keys]`` (no copy of the chunk)."""
    for b in range(p.shape[0]):
        x = p[b].reshape(p.shape[1], -1)
        gram += (x @ x.T).double().cpu()


@dataclass(frozen=True)
class Scoring:
    """How a layer's attention scores are made: its ``mask``, ``scaling``, ``sliding_window`` and the
    family's attention-logit ``softcap`` (None: none)."""

    mask: torch.Tensor | None
    scaling: float
    sliding_window: int | None = None
    softcap: float | None = None


def compare_layer(
    orig: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scoring: Scoring,
    sums: HeadSums,
    chunk: int = 128,
    projections: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Add one layer's statistics to ``sums``, the scores made as ``scoring`` says.

    ``orig``/``conv``: ``(q [B,H,T,d], k [B,G,T,d], v [B,G,T,d])`` of each model; KV head ``j``
    serves query heads ``[j*H/G, (j+1)*H/G)`` as in ``repeat_kv``. ``projections``: both models'
    output projections as ``[H, hidden, d]`` (:func:`head_projections`), for the heads'
    contributions to the residual stream.
    """
    mask, scaling, sliding_window, softcap = scoring.mask, scoring.scaling, scoring.sliding_window, scoring.softcap
    sums.contribution = projections is not None
    sums.kv_heads = conv[1].shape[1]
    (qo, ko, vo), (qc, kc, vc) = orig, conv
    heads, t = qo.shape[1], qo.shape[2]
    ko, vo = (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (ko, vo))
    kc, vc = (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (kc, vc))
    dims = (0, 2)  # sum over batch and query rows, keep heads
    for s in range(0, t, chunk):
        rows = slice(s, min(s + chunk, t))
        # Decoders are causal: rows s..e-1 see no key past e-1, so the keys are cut there and only the
        # lower triangle is computed (the mask, causal or sliding, decides within it).
        keys = rows.stop
        allowed = _scores_mask(mask, rows, keys, sliding_window, qo.device)
        lo = _log_attention(qo[:, :, rows], ko[:, :, :keys], allowed, scaling, softcap)
        lc = _log_attention(qc[:, :, rows], kc[:, :, :keys], allowed, scaling, softcap)
        stats = row_stats(lo, lc, allowed)
        sums.kl += stats["kl"].sum(dims).double().cpu()
        sums.js += stats["js"].sum(dims).double().cpu()
        sums.cos += stats["cosine"].sum(dims).double().cpu()
        sums.ent_orig += stats["entropy_p"].sum(dims).double().cpu()
        sums.ent_conv += stats["entropy_q"].sum(dims).double().cpu()
        po, pc = lo.exp(), lc.exp()  # [B, H, C, keys], 0 where masked
        _add_gram(sums.gram_orig, po)
        _add_gram(sums.gram_conv, pc)
        out_o = torch.matmul(po, vo[:, :, :keys].float())
        out_c = torch.matmul(pc, vc[:, :, :keys].float())
        sums.err_sq += (out_c - out_o).pow(2).sum((0, 2, 3)).double().cpu()
        sums.ref_sq += out_o.pow(2).sum((0, 2, 3)).double().cpu()
        if projections is not None:
            _contribution_sums(out_o, out_c, *projections, sums)
        visible = allowed.expand(qo.shape[0], 1, -1, -1).sum(-1).clamp_min(1)
        sums.ent_uniform += visible.double().log().sum().item()
        sums.rows += qo.shape[0] * (rows.stop - rows.start)


def _output_projection_name(model: torch.nn.Module) -> str | None:
    """The attribute of the attention module that holds the output projection, from the model's
    family definition (``o_proj``, Phi's ``dense``...) or, for a re-targeted source class (GPT-J,
    OPT...), its re-targeting's; None for a family we do not describe."""
    from mha2gqa.core.architecture import resolve

    return resolve(model.config, strict=False).attention_output


def _output_weight(module: torch.nn.Module, name: str | None) -> torch.Tensor | None:
    """The attention module's output projection weight ``[hidden, H*d]``, if it has one we know
    (GPT-2's Conv1D stores it transposed)."""
    proj = getattr(module, name, None) if name else None
    weight = getattr(proj, "weight", None)
    if weight is None:
        return None
    return weight.detach().t() if type(proj).__name__ == "Conv1D" else weight.detach()


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    from mha2gqa.core.capture import decoder_layers

    return decoder_layers(model)[0]


class LayerStore(Protocol):
    """Where the original's per-layer tensors wait for the converted model: in memory when both
    models are loaded, on disk (:class:`mha2gqa.eval.reference.Reference`) when one is at a time."""

    def put(self, layer: int, tensors: dict[str, torch.Tensor], scaling: float, window: int | None) -> None: ...

    def take(self, layer: int, device: torch.device) -> tuple[dict[str, torch.Tensor], float, int | None]: ...


class MemoryStore(dict):
    """A :class:`LayerStore` in memory."""

    def put(self, layer: int, tensors: dict[str, torch.Tensor], scaling: float, window: int | None) -> None:
        self[layer] = (tensors, scaling, window)

    def take(self, layer: int, device: torch.device) -> tuple[dict[str, torch.Tensor], float, int | None]:
        tensors, scaling, window = self.pop(layer)
        return {k: v.to(device) for k, v in tensors.items()}, scaling, window


def _run_layers(model: torch.nn.Module, batch: torch.Tensor, recorder, after_layer) -> None:
    """Run ``model``'s decoder (no logits) on ``batch`` with ``recorder`` seeing every attention call
    and ``after_layer(layer, hidden [B, T, hidden])`` every decoder layer's output."""

    def hook(module, args, output):
        after_layer(module._mha2gqa_index, output[0] if isinstance(output, tuple) else output)

    handles = []
    for i, layer in enumerate(_decoder_layers(model)):
        layer._mha2gqa_index = i
        handles.append(layer.register_forward_hook(hook))
    try:
        with capturing(model, recorder):
            model.base_model(batch.to(next(model.parameters()).device))
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def record_attention(original: torch.nn.Module, batch: torch.Tensor, store: LayerStore) -> None:
    """Put each layer of ``original`` on ``batch`` ``[B, T]`` into ``store``: post-RoPE ``q``
    ``[B,H,T,d]``, ``k``/``v`` ``[B,G,T,d]``, the mask, the output projection ``o_weight``
    ``[hidden, H*d]`` (when the family names it) and the layer's output ``hidden`` ``[B,T,hidden]``."""
    name = _output_projection_name(original)
    pending: dict[int, tuple] = {}

    def keep(call):
        tensors = {"q": call.q, "k": call.k, "v": call.v}
        w_o = _output_weight(call.module, name)
        if w_o is not None:
            tensors["o_weight"] = w_o
        if call.mask is not None:
            tensors["mask"] = call.mask
        pending[call.layer] = (tensors, call.scaling, call.window)

    def done(layer, hidden):
        check_signals()
        tensors, scaling, window = pending.pop(layer)
        store.put(layer, {**tensors, "hidden": hidden}, scaling, window)

    _run_layers(original, batch, keep, done)


def reorder_heads(o: dict[str, torch.Tensor], order: list[int]) -> dict[str, torch.Tensor]:
    """The original's layer tensors with its KV heads in ``order`` (the source KV heads in the
    converted model's layout, from a similarity grouping) and each KV head's query heads moved with
    it: ``q``, ``k``, ``v`` along their head dimension and ``o_weight``'s columns per head."""
    heads, kv = o["q"].shape[1], o["k"].shape[1]
    per = heads // kv
    q_order = [k * per + i for k in order for i in range(per)]
    out = {**o, "q": o["q"][:, q_order], "k": o["k"][:, order], "v": o["v"][:, order]}
    if "o_weight" in o:
        w = o["o_weight"]
        out["o_weight"] = w.reshape(w.shape[0], heads, -1)[:, q_order].reshape(w.shape[0], -1)
    return out


@torch.no_grad()
def compare_attention(
    converted: torch.nn.Module,
    batch: torch.Tensor,
    store: LayerStore,
    chunk: int = 128,
    head_order: dict[int, list[int]] | None = None,
    progress: bool = False,
) -> Attention:
    """Compare ``converted`` on ``batch`` ``[B, T]`` with the original's layers in ``store`` (put
    there by :func:`record_attention` on the same batch); see the module doc. ``head_order``: per
    layer, the source KV heads in the converted model's order when the conversion moved heads
    (similarity grouping), so that each converted head is compared with the head it came from;
    ``progress``: a bar over the layers."""
    from mha2gqa.core.progress import bar as progress_bar

    name = _output_projection_name(converted)
    layer_count = getattr(converted.config, "num_hidden_layers", None)
    bar = progress_bar(total=layer_count, unit="layer", desc="attention similarity", disable=not progress)
    sums: dict[int, HeadSums] = {}
    hidden_cos: dict[int, float] = {}
    hidden_orig: dict[int, torch.Tensor] = {}

    def compare(call):
        check_signals()
        layer, q, k, v, module = call.layer, call.q, call.k, call.v, call.module
        o, scaling_o, window_o = store.take(layer, q.device)
        if head_order and head_order.get(layer):
            o = reorder_heads(o, head_order[layer])
        hidden_orig[layer] = o["hidden"]
        heads = o["q"].shape[1]
        w_o, w_c = o.get("o_weight"), _output_weight(module, name)
        projections = None
        if w_o is not None and w_c is not None:
            projections = (head_projections(w_o, heads), head_projections(w_c, heads).to(w_o.device))
        sums[layer] = HeadSums(heads)
        scoring = Scoring(o.get("mask"), scaling_o, window_o, softcap_of(module))
        compare_layer((o["q"], o["k"], o["v"]), (q, k, v), scoring, sums[layer], chunk, projections)
        bar.update(1)

    def done(layer, hidden):
        ref = hidden_orig.pop(layer)
        hidden_cos[layer] = cosine(ref.float(), hidden.float().to(ref.device)).mean().item()

    with bar:
        _run_layers(converted, batch, compare, done)
    layers = [_layer_section(layer, sums[layer], hidden_cos.get(layer, math.nan)) for layer in sorted(sums)]
    summary = _summary(layers, sums)
    return Attention(layers=layers, summary=summary, tokens=batch.numel(), seq_len=batch.shape[1], chunk=chunk)


def _summary(layers: list, sums: dict[int, HeadSums]) -> AttentionSummary:
    """The means over ``layers`` of every per-layer figure and head similarity."""
    means = {
        f"mean_{k}": sum(getattr(x, f"mean_{k}") for x in layers) / len(layers) for k in sums[layers[0].layer].scores()
    }
    similarity = {}
    for model in ("original", "converted"):
        for part in ("mean", "within_groups", "across_groups"):
            found = [getattr(getattr(x.head_similarity, model), part) for x in layers if x.head_similarity]
            values = [v for v in found if v is not None]
            similarity[f"head_similarity_{model}_{part}"] = sum(values) / len(values) if values else None
    summary = AttentionSummary(
        **means,
        **similarity,
        entropy_uniform=layers[0].entropy_uniform,
        mean_hidden_cosine=sum(x.hidden_cosine for x in layers) / len(layers),
    )
    return summary


def _layer_section(layer: int, s: HeadSums, hidden_cosine: float) -> AttentionLayer:
    """One layer's section: each head's scores, their means, and the heads' similarity."""
    heads = s.result()
    means = {f"mean_{k}": sum(getattr(h, k) for h in heads) / len(heads) for k in s.scores()}
    return AttentionLayer(
        layer=layer,
        hidden_cosine=hidden_cosine,
        entropy_uniform=s.ent_uniform / max(s.rows, 1),
        heads=heads,
        **means,
        head_similarity=s.head_similarity(),
    )


def head_order_of(conversion: Facts | None) -> dict[int, list[int]] | None:
    """Per layer, the source KV heads in the converted model's order, from the conversion record
    (similarity grouping); None when the conversion kept the heads in place."""
    groups = conversion.groups_by_layer() if conversion else {}
    return {layer: [h for g in gs for h in g] for layer, gs in groups.items()} or None


def attention_similarity(
    original: torch.nn.Module,
    converted: torch.nn.Module,
    batch: torch.Tensor,
    chunk: int = 128,
    head_order: dict[int, list[int]] | None = None,
) -> Attention:
    """Compare ``original`` and ``converted`` (both in memory) on ``batch`` ``[B, T]`` token ids:
    the original's layers are kept in memory until the converted model reaches them."""
    store = MemoryStore()
    record_attention(original, batch, store)
    return compare_attention(converted, batch, store, chunk, head_order)
