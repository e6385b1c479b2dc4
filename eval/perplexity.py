"""Perplexity under pinned protocols, and output agreement between two models on the same tokens.

A *window* is ``(inputs [T], targets [T])``: the model reads ``inputs`` and the logits at position
``t`` are scored against ``targets[t]`` (``-100``: not scored). The protocols differ only in how they
cut windows:

``disjoint``
    The token stream (tokenized once, one BOS at the start when the tokenizer has one) is cut into
    consecutive non-overlapping windows of ``seq_len``; each scores its own next tokens
    (``seq_len - 1`` per full window). Windows are not re-prefixed. The quantization literature's
    convention (Llama-2-7B fp16, WikiText-2 test, 2048: 5.47).
``stride``
    Hugging Face's sliding window ("Perplexity of fixed-length models"): windows of ``seq_len``
    starting every ``stride`` tokens; only the tokens not scored by the previous window are scored.
    With ``stride == seq_len`` it equals ``disjoint``.
``rolling``
    lm-evaluation-harness's ``loglikelihood_rolling``: per document, a prefix token (BOS, else EOS)
    then windows that score every token exactly once with as much left context as fits
    (``get_rolling_token_windows`` with ``context_len=1``). Reports word and byte perplexity and
    bits per byte, with words (``re.split(r"\\s+", doc)``) and UTF-8 bytes counted on the text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from mha2gqa.core.memory import head_rows, logit_rows
from mha2gqa.core.next_token import same_top, token_kl
from mha2gqa.core.progress import bar as progress_bar
from mha2gqa.core.signals import check as check_signals
from mha2gqa.eval.agreement import Agreement

IGNORE = -100
Window = tuple[torch.Tensor, torch.Tensor]


def _shifted(ids: torch.Tensor, scored: int) -> torch.Tensor:
    """Targets for ``ids``: ``ids[t + 1]``, with only the last ``scored`` of them kept."""
    targets = torch.full_like(ids, IGNORE)
    targets[:-1] = ids[1:]
    targets[: ids.numel() - 1 - scored] = IGNORE
    return targets


def disjoint_windows(ids: torch.Tensor, seq_len: int) -> list[Window]:
    """Consecutive ``[seq_len]`` slices of the 1-D ``ids``; a shorter last slice is kept if it
    predicts at least one token."""
    out = []
    for s in range(0, ids.numel(), seq_len):
        w = ids[s : s + seq_len]
        if w.numel() >= 2:
            out.append((w, _shifted(w, w.numel() - 1)))
    return out


def stride_windows(ids: torch.Tensor, seq_len: int, stride: int) -> list[Window]:
    """Hugging Face's strided sliding windows over the 1-D ``ids``."""
    out = []
    prev_end = 0
    for begin in range(0, ids.numel(), stride):
        end = min(begin + seq_len, ids.numel())
        w = ids[begin:end]
        scored = min(end - prev_end, w.numel() - 1)
        if scored > 0:
            out.append((w, _shifted(w, scored)))
        prev_end = end
        if end == ids.numel():
            break
    return out


def rolling_windows(tokens: Sequence[int], prefix_token: int, seq_len: int) -> list[Window]:
    """lm-evaluation-harness rolling windows for one document (``context_len=1``): every token of
    ``tokens`` is scored exactly once; the first window is preceded by ``prefix_token``."""
    tokens = list(tokens)
    out: list[Window] = []
    if not tokens:
        return out
    first = min(seq_len, len(tokens))
    seq = [prefix_token, *tokens[:first]]
    out.append((torch.tensor(seq[:-1]), torch.tensor(seq[1:])))
    predicted = first
    while predicted < len(tokens):
        n = min(len(tokens) - predicted, seq_len)
        end = predicted + n
        seq = tokens[max(end - seq_len - 1, 0) : end]
        inputs, targets = torch.tensor(seq[:-1]), torch.tensor(seq[1:])
        targets[: targets.numel() - n] = IGNORE
        out.append((inputs, targets))
        predicted = end
    return out


@dataclass
class AgreementSums:
    """Per-token agreement of a converted model with the original on the same scored tokens."""

    kl: list[torch.Tensor] = field(default_factory=list)  # per-token KL(original || converted)
    kl_reverse: list[torch.Tensor] = field(default_factory=list)  # per-token KL(converted || original)
    delta_p: list[torch.Tensor] = field(default_factory=list)  # p_converted - p_original of the correct token
    nll: list[torch.Tensor] = field(default_factory=list)  # [n, 2] per-token NLL of (original, converted)
    rest_mass: list[torch.Tensor] = field(default_factory=list)  # top-k reference: the mass outside the k tokens
    top1_same: int = 0
    nll_delta_sum: float = 0.0
    tokens: int = 0


@dataclass
class PassResult:
    """Sums of one pass over windows for each model, and their agreement when two were given."""

    nll_sum: list[float]
    tokens: int
    windows: int
    agreement: AgreementSums | None
    seconds: float = 0.0


@dataclass(frozen=True)
class ScoredPass:
    """One pass over windows with every process's sums reduced (what the protocols, the uptraining
    evaluations and the quantization yardstick read): ``nll_sum`` per model, the scored ``tokens``,
    the ``windows``, the slowest process's ``seconds`` and, for a pair, ``agreement`` (the results
    file's ``agreement`` section: :func:`~mha2gqa.eval.agreement.agreement_stats`)."""

    nll_sum: tuple[float, ...]
    tokens: int
    windows: int
    seconds: float
    agreement: Agreement | None = None

    def nll(self, model: int) -> float:
        """Mean negative log-likelihood per token of model ``model`` (0: the first given)."""
        return self.nll_sum[model] / self.tokens


def batch_count(windows: list[Window], batch_size: int) -> int:
    """How many forward passes :func:`score_windows` makes over ``windows``."""
    lengths: dict[int, int] = {}
    for w in windows:
        lengths[w[0].numel()] = lengths.get(w[0].numel(), 0) + 1
    return sum(-(-n // batch_size) for n in lengths.values())


def batches(windows: list[Window], batch_size: int) -> Iterator[list[Window]]:
    """Windows grouped into batches of equal length (order kept within a length)."""
    by_len: dict[int, list[Window]] = {}
    for w in windows:
        by_len.setdefault(w[0].numel(), []).append(w)
    for group in by_len.values():
        for i in range(0, len(group), batch_size):
            yield group[i : i + batch_size]


#: Saves the original's side of one batch: ``(batch index, {chunk start: (logits [n, vocab] at the
#: scored positions, their targets [n])})``.
Record = Callable[[int, dict[str, tuple[torch.Tensor, torch.Tensor]]], None]
#: Gives back what a :data:`Record` saved for a batch index: ``{chunk start: logits}`` (exact form)
#: or ``{chunk start + ":" + part: tensor}`` (top-k form, :func:`top_k_form`).
Replay = Callable[[int], dict[str, torch.Tensor]]


def top_k_form(logits: torch.Tensor, ids: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """The original's next-token distributions kept as their ``k`` most likely tokens and one bucket
    for the rest: ``values`` ``[n, k]`` float32 log-probabilities (sorted), ``indices`` ``[n, k]``,
    ``rest`` ``[n]`` the log of the remaining mass, and ``target`` ``[n]`` the exact log-probability
    of the correct token. 8k + 8 bytes per token instead of vocab x dtype bytes. Taken
    :data:`~mha2gqa.core.memory.LOGIT_ROWS` tokens at a time (each token's figures are its own row's)."""
    n, vocab = logits.shape
    k = min(k, vocab)
    out = {
        "values": torch.empty(n, k, device=logits.device),
        "indices": torch.empty(n, k, dtype=torch.int32, device=logits.device),
        "rest": torch.empty(n, device=logits.device),
        "target": torch.empty(n, device=logits.device),
    }
    for rows in logit_rows(n):
        lo = torch.log_softmax(logits[rows].float(), -1)
        values, indices = lo.topk(k, -1)
        out["values"][rows], out["indices"][rows] = values, indices
        out["target"][rows] = lo.gather(1, ids[rows, None])[:, 0]
        out["rest"][rows] = lo.scatter_(-1, indices, float("-inf")).logsumexp(-1)
    return out


def _compare_top_k(
    saved: dict[str, torch.Tensor], lc: torch.Tensor, ids: torch.Tensor, nll: list[float], agree: AgreementSums
) -> None:
    """:func:`_compare` against the original's top-k form: the target's log-probabilities, Δp, NLLs
    and same-top are exact; both KLs are computed over the k tokens plus one bucket for the rest,
    which (log-sum inequality) never exceeds the exact KL: the gap is ``p_rest x KL`` of the two
    tails, so the mass outside the k tokens is kept to show where it can matter."""
    values, indices, rest, target_o = (saved[k].to(lc.device) for k in ("values", "indices", "rest", "target"))
    indices = indices.long()
    lq_rest = lc.scatter(-1, indices, float("-inf")).logsumexp(-1)
    lp = torch.cat([values, rest[:, None]], 1)
    lq = torch.cat([lc.gather(1, indices), lq_rest[:, None]], 1)
    target_c = lc.gather(1, ids[:, None])[:, 0]
    nll[0] -= target_o.sum().item()
    nll[1] -= target_c.sum().item()
    agree.kl.append(token_kl(lp, lq).cpu())
    agree.kl_reverse.append(token_kl(lq, lp).cpu())
    agree.top1_same += int(same_top(lp, lc, indices[:, 0]).sum())
    agree.nll_delta_sum += (target_o - target_c).sum().item()
    agree.delta_p.append((target_c.exp() - target_o.exp()).cpu())
    agree.nll.append(torch.stack([-target_o, -target_c], 1).cpu())
    agree.rest_mass.append(rest.exp().cpu())
    agree.tokens += ids.numel()


def _compare(lo: torch.Tensor, lc: torch.Tensor, ids: torch.Tensor, nll: list[float], agree: AgreementSums) -> None:
    """Add one chunk of scored tokens, ``lo``/``lc`` ``[n, vocab]`` float32 log-probabilities of the
    original and the converted model and ``ids`` ``[n]`` their targets, to ``nll`` and ``agree``."""
    nll[0] += F.nll_loss(lo, ids, reduction="sum").item()
    nll[1] += F.nll_loss(lc, ids, reduction="sum").item()
    agree.kl.append(token_kl(lo, lc).cpu())
    agree.kl_reverse.append(token_kl(lc, lo).cpu())
    agree.top1_same += int(same_top(lo, lc).sum())
    target_o, target_c = lo.gather(1, ids[:, None])[:, 0], lc.gather(1, ids[:, None])[:, 0]
    agree.nll_delta_sum += (target_o - target_c).sum().item()
    agree.delta_p.append((target_c.exp() - target_o.exp()).cpu())
    agree.nll.append(torch.stack([-target_o, -target_c], 1).cpu())
    agree.tokens += ids.numel()


def chunk_positions(batch: int, vocab: int, most: int = 512) -> int:
    """Positions of a batch scored at a time: at most ``most``, and few enough that a chunk's float32
    temporaries (``batch x positions x vocab``) stay within :data:`~mha2gqa.core.memory.HEAD_BLOCK`
    (256 MiB: 256 positions of one window at a 262,144-token vocabulary), whatever the window."""
    return max(1, min(most, head_rows(vocab) // batch))


def new_pass(pair: bool) -> PassResult:
    """An empty pass's sums (one model, or a pair's with its agreement), for :func:`score_windows` to add to."""
    return PassResult([0.0] * (2 if pair else 1), 0, 0, AgreementSums() if pair else None)


@torch.no_grad()  # not inference_mode: a sharded (FSDP) model reuses its gather buffers in training
def score_windows(
    models: Sequence[torch.nn.Module],
    windows: list[Window],
    batch_size: int = 1,
    progress: str | None = None,
    record: Record | None = None,
    replay: Replay | None = None,
    padding: tuple[int, torch.Tensor] | None = None,
    into: PassResult | None = None,
) -> PassResult:
    """Run one or two models on every window; sum NLL per model and, for a pair, per-token KL,
    top-1 agreement and NLL delta (all from float32 log-softmax, :func:`chunk_positions` at a time),
    with a progress bar so described (``progress``; None: none).
    ``padding`` ``(forwards, inputs [1, T])``: run the models on ``inputs``, scoring nothing, until
    ``forwards`` passes are made (so that sharded models make the same collectives on every process).
    ``into``: the sums of the windows before these (:func:`new_pass`), added to in the same order, so a
    pass scored block after block returns exactly what one call over all its windows returns.

    A pair is either two ``models`` in memory, or one model at a time: a pass over the original
    with ``record`` (its logits at the scored positions are handed over, batch by batch, in the
    model's dtype) and a later pass over the converted model with ``replay`` giving them back. The
    log-softmax of the replayed logits is the same computation on the same values, so the replayed
    pass returns exactly what the two-model pass returns."""
    import time

    start = time.perf_counter()
    if len(models) not in (1, 2) or (len(models) == 2 and (record or replay)) or (record and replay):
        raise ValueError("score_windows scores one model, a pair, or one model against a replayed original")
    res = into if into is not None else new_pass(len(models) == 2 or replay is not None)
    total = sum(int((t != IGNORE).sum()) for _, t in windows)
    bar = progress_bar(total=total, unit="tok", unit_scale=True, desc=progress or "scoring", disable=not progress)
    for index, batch in enumerate(batches(windows, batch_size)):
        check_signals()
        inputs = torch.stack([w[0] for w in batch])
        targets = torch.stack([w[1] for w in batch])
        logits = [m(inputs.to(_device(m))).logits for m in models]
        saved = replay(index) if replay is not None else None
        kept = _score_batch(logits, targets, saved, res, keep=record is not None)
        bar.update(sum(int((t != IGNORE).sum()) for t in targets))
        del logits
        if record is not None:
            record(index, kept)
    bar.close()
    if padding is not None:
        forwards, inputs = padding
        for _ in range(forwards - batch_count(windows, batch_size)):
            for m in models:
                m(inputs.to(_device(m)))
    res.windows += len(windows)
    res.seconds += time.perf_counter() - start
    return res


def _score_batch(
    logits: list[torch.Tensor],
    targets: torch.Tensor,
    saved: dict[str, torch.Tensor] | None,
    res: PassResult,
    keep: bool,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Add one batch (``logits`` ``[B, T, V]`` per model, ``targets`` ``[B, T]``) to ``res``, a chunk of
    positions at a time; with ``keep``, the first model's logits at the scored positions, per chunk
    (a view where a single window's chunk is scored whole: no copy of the logits)."""
    kept: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    chunk = chunk_positions(*logits[0].shape[::2])
    for s in range(0, targets.shape[1], chunk):
        tgt = targets[:, s : s + chunk].to(logits[0].device)
        scored = tgt != IGNORE
        n = int(scored.sum())
        if n == 0:
            continue
        if keep:
            whole = tgt.shape[0] == 1 and n == tgt.numel()
            kept[str(s)] = (logits[0][0, s : s + chunk] if whole else logits[0][:, s : s + chunk][scored], tgt[scored])
        part = [x[:, s : s + chunk] for x in logits]
        _score_chunk(part, tgt, saved, f"{s}", res.nll_sum, res.agreement, fused=not keep)
        res.tokens += n
    return kept


def _score_chunk(
    logits: list[torch.Tensor],
    tgt: torch.Tensor,
    saved: dict[str, torch.Tensor] | None,
    key: str,
    nll: list[float],
    agree: AgreementSums | None,
    fused: bool,
) -> None:
    """Add one chunk of positions to the NLL sums and, for a pair, the agreement: ``logits`` ``[B, C,
    V]`` per model in memory, ``tgt`` ``[B, C]``; ``saved``: the replayed original's logits at the
    scored positions (``key``), or their top-k form (``key:values``...). One model with ``fused``: a
    fused cross-entropy, no log-probabilities kept."""
    keep = tgt != IGNORE
    if agree is None and fused:
        flat = logits[0].flatten(0, 1).float()
        nll[0] += F.cross_entropy(flat, tgt.flatten(), ignore_index=IGNORE, reduction="sum").item()
    elif agree is None:
        lo = torch.log_softmax(logits[0][keep].float(), -1)
        nll[0] += F.nll_loss(lo, tgt[keep], reduction="sum").item()
    elif saved is not None and f"{key}:values" in saved:
        lc = torch.log_softmax(logits[-1][keep].float(), -1)
        part = {k.split(":", 1)[1]: v for k, v in saved.items() if k.startswith(f"{key}:")}
        _compare_top_k(part, lc, tgt[keep].to(lc.device), nll, agree)
    else:
        original = saved[key].to(logits[0].device) if saved is not None else logits[0][keep]
        lo = torch.log_softmax(original.float(), -1)
        lc = torch.log_softmax(logits[-1][keep].float(), -1).to(lo.device)
        _compare(lo, lc, tgt[keep].to(lo.device), nll, agree)


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
