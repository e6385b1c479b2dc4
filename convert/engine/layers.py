"""The layer engine calibration, per-layer allocation and the refit share: the model is built on
``meta`` (:func:`skeleton`), the embeddings run once to catch the first decoder layer's inputs
(:func:`first_layer_inputs`), then each decoder layer in turn (:func:`each_layer`) gets its weights
from the shards (:func:`materialize`), runs every calibration window and is emptied again
(:func:`release`).
Memory: one layer plus the calibration activations, never the whole model."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mha2gqa.core.errors import SettingError
from mha2gqa.core.memory import head_rows, logit_rows, trim
from mha2gqa.core.next_token import log_probs_, same_top, token_kl
from mha2gqa.core.ranks import ONE, Ranks


@dataclass
class LayerRun:
    """One decoder layer while its weights are loaded: the module, the calibration windows it read
    (``inputs``) and what it gave (``outputs``, with each window's keyword arguments), and the name
    prefix of its tensors (``model.layers.3.``); ``team``: the processes whose windows, together, are
    the calibration's (each holds its share: a measure over the windows sums over ``team``)."""

    module: torch.nn.Module
    inputs: list[torch.Tensor]
    outputs: list[tuple[torch.Tensor, dict]]
    prefix: str
    team: Ranks = ONE


class _Stop(Exception):
    """Raised by the stand-in first layer once it has seen its inputs."""


class _Catch(torch.nn.Module):
    """Stands in for decoder layer ``index``: records what it is called with (every window's for
    the first layer, the first window's keyword arguments for the others), passes the hidden states
    on, and stops the model after the last layer. Carries the real layer's ``attention_type``, by
    which some families pick its mask."""

    def __init__(self, index: int, last: bool, like: torch.nn.Module) -> None:
        super().__init__()
        self.index, self.last = index, last
        self.calls: list[tuple[torch.Tensor, dict]] = []
        if hasattr(like, "attention_type"):
            self.attention_type = like.attention_type

    def forward(self, hidden_states, *args, **kwargs):
        if any(a is not None for a in args):  # GPTBigCode passes encoder_hidden_states=None by position
            raise RuntimeError("decoder layers are expected to be called with keyword arguments")
        if self.index == 0 or not self.calls:
            self.calls.append((hidden_states, kwargs))
        if self.last:
            raise _Stop
        return hidden_states


def materialize(
    module: torch.nn.Module,
    ckpt,
    prefix: str,
    device: torch.device,
    dtype: torch.dtype | None = torch.float32,
    model: torch.nn.Module | None = None,
) -> None:
    """Give ``module``'s parameters (on ``meta``) their weights from the checkpoint on ``device``, in
    ``dtype`` (None: as stored); its buffers (real, computed at construction) move along. Tensors the
    checkpoint stores in another layout (per-expert MoE weights) are converted as transformers
    loads them, through ``model``'s conversion mapping (:mod:`mha2gqa.core.stored_layout`)."""
    from accelerate.utils import set_module_tensor_to_device

    from mha2gqa.core.stored_layout import stored_tensors

    names = [name for name, _ in module.named_parameters()]
    other = {prefix + n for n in names if prefix + n not in ckpt.tensors}
    converted = stored_tensors(model, ckpt, prefix, other) if other and model is not None else {}
    for name in names:
        value = converted[prefix + name] if prefix + name in converted else ckpt.load(prefix + name)
        value = value if dtype is None else value.to(dtype=dtype)
        set_module_tensor_to_device(module, name, device, value=value, dtype=value.dtype)  # else it casts back
    for name, _ in module.named_buffers():
        set_module_tensor_to_device(module, name, device)


@contextlib.contextmanager
def float32_on_call(layer: torch.nn.Module):
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


def release(module: torch.nn.Module) -> None:
    """Send ``module``'s parameters back to ``meta`` and hand the freed memory back to the OS
    (glibc keeps freed heap pages otherwise, and RSS would creep up layer after layer)."""
    from accelerate.utils import set_module_tensor_to_device

    for name, _ in module.named_parameters():
        set_module_tensor_to_device(module, name, "meta")
    trim()


def each_layer(
    model: torch.nn.Module, ckpt, device: torch.device, dtype: torch.dtype | None = torch.float32
) -> Iterator[tuple[int, torch.nn.Module, str]]:
    """Every decoder layer of ``model`` (a :func:`skeleton`) in order, as ``(index, module, prefix)``
    with its weights loaded from ``ckpt`` on ``device`` (in ``dtype``; None: as stored) while the
    caller holds it, and released when the caller moves on (or stops): the one loop calibration and
    the refit walk the model by."""
    from mha2gqa.core.capture import decoder_layers

    layers, _, attr = decoder_layers(model)  # a native class: its base model holds them
    for i, layer in enumerate(layers):
        prefix = f"{model.base_model_prefix}.{attr}.{i}."
        materialize(layer, ckpt, prefix, device, dtype, model)
        try:
            yield i, layer, prefix
        finally:
            release(layer)


def calibration_ids(model_dir: Path, data: str, tokens: int, seq_len: int, text_field: str = "text") -> torch.Tensor:
    """``[windows, seq_len]``: the first ``tokens`` tokens of ``data`` as disjoint windows."""
    from mha2gqa.core.models import load_tokenizer
    from mha2gqa.core.text import load_text, token_stream

    ids = token_stream(load_tokenizer(model_dir), load_text(data, text_field, setting="calibration"), tokens)
    if ids.numel() < seq_len:
        raise SettingError("calibration", f"{{name}} {data}: {ids.numel()} tokens, fewer than one window of {seq_len}")
    n = ids.numel() // seq_len
    if n * seq_len < tokens:
        sys.stderr.write(
            f"warning: --calibration {data} gives {n * seq_len:,} tokens ({n} windows of {seq_len}) of the "
            f"{tokens:,} asked for: give more text, or lower --calibration-tokens to silence this\n"
        )
    return ids[: n * seq_len].reshape(n, seq_len)


def skeleton(ckpt):
    """The model of ``ckpt`` with its parameters on ``meta`` (buffers such as RoPE tables real); a
    re-targeted checkpoint's is the target class."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    if ckpt.format == "retargeted":
        config = AutoConfig.for_model(**ckpt.config)
    else:
        config = AutoConfig.from_pretrained(ckpt.folder)
    config.use_cache = False
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config).eval()


def _load_outside_layers(model, ckpt, device, dtype: torch.dtype | None) -> list[torch.nn.Module]:
    """Load every child of ``model``'s base model but its decoder layers (embeddings, final norm,
    rotary tables) from ``ckpt`` onto ``device`` (``dtype`` None: as stored); returns them."""
    from mha2gqa.core.capture import decoder_layers

    base, prefix = model.base_model, f"{model.base_model_prefix}."
    _, _, attr = decoder_layers(model)
    others = [(n, c) for n, c in base.named_children() if n != attr]
    for name, child in others:
        materialize(child, ckpt, f"{prefix}{name}.", device, dtype=dtype, model=model)
    return [c for _, c in others]


def first_layer_inputs(model, ckpt, windows: torch.Tensor, device) -> list[tuple[torch.Tensor, dict]]:
    """Run everything before the decoder layers once per window (embeddings as stored: a lookup
    loses nothing) and catch what the first layer receives, GPTQ-style; hidden states and RoPE
    tables in float32. What a later layer receives differently (the mask or rotary table of its
    layer type: Gemma 2/3's sliding and full layers) is installed on that layer, so every layer of
    ``model`` called with the first layer's arguments runs as in the model (:func:`_per_layer`)."""
    from mha2gqa.core.capture import decoder_layers

    base = model.base_model
    layers, holder, attr = decoder_layers(model)
    others = _load_outside_layers(model, ckpt, device, dtype=None)
    catchers = [_Catch(i, i == len(layers) - 1, layer) for i, layer in enumerate(layers)]
    setattr(holder, attr, torch.nn.ModuleList(catchers))
    try:
        for w in windows:
            with contextlib.suppress(_Stop):
                base(w[None], use_cache=False)
    finally:
        setattr(holder, attr, layers)
    for child in others:
        release(child)
    types = getattr(model.config, "layer_types", None) or [None] * len(layers)
    states = [(h.float(), _float_rotary(base, h.float(), kw, types[0])) for h, kw in catchers[0].calls]
    first = catchers[0].calls[0][1]
    for i, (layer, catcher) in enumerate(zip(layers, catchers, strict=True)):
        own = {k: v for k, v in catcher.calls[0][1].items() if v is not first.get(k)} if i else {}
        if "position_embeddings" in own:
            own = _float_rotary(base, states[0][0], {**first, **own}, types[i])
            own = {k: v for k, v in own.items() if v is not first.get(k)}
        _per_layer(layer, windows.shape[-1], own)
    return states


def _float_rotary(base, h: torch.Tensor, kw: dict, layer_type: str | None) -> dict:
    """``kw`` with its RoPE tables computed again in ``h``'s dtype (float32), as the model computed
    them (for ``layer_type``, where the model's rotary embedding differs by layer type: Gemma 3)."""
    import inspect

    if "position_embeddings" not in kw or kw.get("position_ids") is None:
        return kw
    rotary = base.rotary_emb
    by_type = layer_type is not None and "layer_type" in inspect.signature(rotary.forward).parameters
    extra = (layer_type,) if by_type else ()
    return {**kw, "position_embeddings": rotary(h, kw["position_ids"], *extra)}


def batched(kwargs: dict[str, Any], n: int) -> dict[str, Any]:
    """One window's layer keyword arguments for ``n`` windows at once: tensors with a batch dimension
    of one (masks, positions, RoPE tables) expanded to ``n``; the rest as they are."""

    def expand(x):
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[0] == 1:
            return x.expand(n, *x.shape[1:])
        if isinstance(x, tuple):
            return tuple(expand(y) for y in x)
        return x

    return {k: expand(v) for k, v in kwargs.items()}


def _per_layer(layer: torch.nn.Module, length: int, own: dict) -> None:
    """Make ``layer``, called with the first layer's keyword arguments for windows of ``length``
    tokens, receive ``own`` in their place (its mask and RoPE tables where they differ from the
    first layer's); a call with another length fails loudly rather than run with the wrong mask."""
    table = layer.__dict__.setdefault("_mha2gqa_own_inputs", {})
    table[length] = own
    if "_mha2gqa_own_hook" in layer.__dict__ or not own:
        return

    def hook(module, args, kwargs):
        h = args[0] if args else kwargs["hidden_states"]
        if h.shape[-2] not in table:
            raise RuntimeError(f"layer called on {h.shape[-2]} tokens, prepared for {sorted(table)}")
        return args, {**kwargs, **batched(table[h.shape[-2]], h.shape[0])}

    layer.__dict__["_mha2gqa_own_hook"] = layer.register_forward_pre_hook(hook, with_kwargs=True)


class _Emit(torch.nn.Module):
    """Stands in for the decoder layers: gives the hidden states it was handed, whatever comes in."""

    def __init__(self, hidden: torch.Tensor, as_tuple: bool, like: torch.nn.Module) -> None:
        super().__init__()
        self.hidden, self.as_tuple = hidden, as_tuple
        if hasattr(like, "attention_type"):  # the mask a model picks per layer (sliding-window families)
            self.attention_type = like.attention_type

    def forward(self, *args, **kwargs):
        return (self.hidden,) if self.as_tuple else self.hidden


@dataclass(frozen=True)
class ModelHead:
    """What turns the last decoder layer's output into logits (:func:`model_head`): called as
    ``head(hidden [1, T, hidden], as_tuple)`` -> logits ``[1, T, vocab]`` float32, a function of each
    token's hidden state alone; ``vocab``: the logits' width."""

    logits: Callable[[torch.Tensor, bool], torch.Tensor]
    vocab: int

    def __call__(self, hidden: torch.Tensor, as_tuple: bool) -> torch.Tensor:
        return self.logits(hidden, as_tuple)


def model_head(model, ckpt, device) -> ModelHead:
    """What turns the last decoder layer's output into logits: everything of ``model`` (a
    :func:`skeleton`) outside its decoder layers loaded from ``ckpt`` (the output projection tied to
    the embeddings where the config ties them), as a function of ``(hidden [1, T, hidden], as_tuple)``
    -> logits ``[1, T, vocab]`` float32 (``as_tuple``: the family's decoder layers return tuples). The
    model's own forward runs with its layers replaced, so its final norm, logit soft-capping and the
    like apply as they do in the model. Memory: the embeddings and the output projection."""
    from mha2gqa.core.capture import decoder_layers

    layers, holder, attr = decoder_layers(model)
    _load_outside_layers(model, ckpt, device, dtype=torch.float32)
    head = model.get_output_embeddings()
    head_name = next(n for n, m in model.named_modules() if m is head)
    if f"{head_name}.weight" in ckpt.tensors:
        materialize(head, ckpt, f"{head_name}.", device, dtype=torch.float32)
    elif getattr(model.config, "tie_word_embeddings", False):
        head.weight = model.get_input_embeddings().weight
    else:
        raise SettingError(
            "allocation_cost",
            f"{{name}} logits needs the output projection, and {ckpt.folder} has no {head_name}.weight: "
            "use --allocation-cost output",
        )

    @torch.no_grad()
    def logits(hidden: torch.Tensor, as_tuple: bool) -> torch.Tensor:
        setattr(holder, attr, torch.nn.ModuleList([_Emit(hidden, as_tuple, layers[-1])]))
        try:
            ids = torch.zeros(hidden.shape[:2], dtype=torch.long, device=hidden.device)
            # position 0 for every token: the tokens are rows of several windows (past a learned position
            # table's length, GPT-BigCode's); the layers they would reach are replaced
            return model(input_ids=ids, position_ids=ids, use_cache=False).logits.float()
        finally:
            setattr(holder, attr, layers)

    return ModelHead(logits, head.weight.shape[0])


def next_token_kl(
    head: ModelHead, as_tuple: bool, original: torch.Tensor, candidates: list[torch.Tensor]
) -> torch.Tensor:
    """``[len(candidates), 2]`` float64: each candidate's KL(original || candidate) summed over one
    window's tokens, and its tokens whose top-1 is the original's, from the last decoder layer's
    outputs (``original`` and each candidate ``[1, T, hidden]``) through ``head``. The streams go
    through the head together, a block of each one's tokens per call, at most
    :func:`~mha2gqa.core.memory.head_rows` tokens a call (more calls where even one token of every
    stream is more). Memory: one call's logits, turned into log-probabilities in place (and the
    original's block where a block takes more calls), never a window's whole logits."""
    streams = [original, *candidates]
    per_call = head_rows(head.vocab)
    rows = max(1, per_call // len(streams))  # each stream's tokens in a block
    size = max(1, per_call // rows)  # streams in a call
    out = torch.zeros(len(candidates), 2, dtype=torch.float64, device=original.device)
    for block in logit_rows(original.shape[1], rows):
        ref = None  # the original's log-probabilities [rows, vocab], from the block's first call
        for first in range(0, len(streams), size):
            part = [s[:, block] for s in streams[first : first + size]]
            ref = _block_kl(head, as_tuple, part, ref, out[max(first - 1, 0) :], size < len(streams))
    return out.cpu()


def _block_kl(
    head: ModelHead, as_tuple: bool, hidden: list[torch.Tensor], ref: torch.Tensor | None, out: torch.Tensor, keep: bool
) -> torch.Tensor:
    """One call of the head over ``hidden`` (each ``[1, rows, hidden]``; the original's first where
    ``ref`` is None): adds each candidate's KL and top-1 matches to its row of ``out`` (in order;
    :mod:`~mha2gqa.core.next_token`); returns ``ref``, a tensor of its own where ``keep`` (later calls
    read it: the logits are freed)."""
    lp = log_probs_(head(torch.cat(hidden, 1), as_tuple)[0])
    parts = lp.split(hidden[0].shape[1])
    if ref is None:
        ref, parts = parts[0].clone() if keep else parts[0], parts[1:]
    probs, top = ref.exp(), ref.argmax(-1)
    for n, got in enumerate(parts):
        out[n, 0] += token_kl(ref, got, probs).sum(dtype=torch.float64)
        out[n, 1] += same_top(ref, got, top).sum()
    return ref
