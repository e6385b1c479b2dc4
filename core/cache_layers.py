"""What each decoder layer's KV cache holds, as transformers' ``DynamicCache`` keeps it, so that every
KV figure (``inspect``, ``plan``, ``convert``'s summary, the card, ``bench``'s planned bytes) is the
cache a user will hold, not every layer counted at full length.

A layer's attention is one of (transformers' ``layer_types``): ``full_attention`` (its cache holds
every token), ``sliding_attention`` (a window of ``sliding_window``: the cache keeps its last
``sliding_window - 1`` tokens), ``chunked_attention`` (``attention_chunk_size``, kept the same way), or
none (layers that read another layer's cache, or have no attention: ``dummy``, ``moe``, ``mlp``).
A config that lists ``layer_types`` is read as it says; one that does not gets its family's rule
(``cache_layers`` in ``core/architectures/<family>.json``: a ``gate`` that turns sliding on, and which
layers slide, an expression of the config and ``layer``), as the family's transformers config
computes it; without a rule, every layer slides when the config names a ``sliding_window``
(Mistral, Mixtral, Phi-3, StarCoder2), is chunked with ``attention_chunk_size``, else is full.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mha2gqa.core.errors import Mha2GqaError
from mha2gqa.core.expressions import evaluate_expression

SLIDING, CHUNKED, FULL = "sliding_attention", "chunked_attention", "full_attention"
#: Tokens per sequence the KV figures are given at when none is asked (cut to the model's positions):
#: ``plan``'s and ``inspect``'s default, and the length convert's summary and card size a windowed cache at
SIZING_WINDOW = 4096
#: layer types whose cache holds nothing of their own
NO_CACHE = ("dummy", "moe", "mlp")


def _window(config: Mapping[str, Any], key: str) -> int | None:
    value = config.get(key)
    if value is None or value == 0:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise Mha2GqaError(f"config.json: {key} must be a positive integer (found {value!r:.30})")
    return value


def layer_types(config: Mapping[str, Any], layers: int, rule: Mapping[str, str] | None = None) -> list[str]:
    """Each layer's attention type (see the module doc); ``rule``: the family's ``cache_layers``."""
    given = config.get("layer_types")
    if given is not None:
        if not isinstance(given, list) or len(given) != layers or not all(isinstance(t, str) for t in given):
            raise Mha2GqaError(f"config.json: layer_types must name one attention type per layer ({layers})")
        types = list(given)
    elif rule is not None:
        on = not rule.get("gate") or bool(evaluate_expression(rule["gate"], dict(config)))
        slides = [on and bool(evaluate_expression(rule["sliding"], {**config, "layer": i})) for i in range(layers)]
        types = [SLIDING if s and _window(config, "sliding_window") else FULL for s in slides]
    elif _window(config, "sliding_window"):
        types = [SLIDING] * layers
    elif _window(config, "attention_chunk_size"):
        types = [CHUNKED] * layers
    else:
        types = [FULL] * layers
    modes = config.get("kv_sharing_modes")
    if isinstance(modes, list) and len(modes) == layers:  # layers that reuse another layer's cache
        types = ["dummy" if m == "reuse" else t for t, m in zip(types, modes, strict=True)]
    return types


def cache_spans(
    config: Mapping[str, Any], layers: int, rule: Mapping[str, str] | None = None
) -> tuple[int | None, ...]:
    """Per layer, the most tokens its cache holds: None (every token), a window's ``w - 1``, or 0."""
    spans: list[int | None] = []
    for kind in layer_types(config, layers, rule):
        if kind in NO_CACHE:
            spans.append(0)
        elif kind in (SLIDING, CHUNKED):
            window = _window(config, "sliding_window" if kind == SLIDING else "attention_chunk_size")
            if window is None:
                raise Mha2GqaError(f"config.json: a layer is {kind} but the config gives no window for it")
            spans.append(window - 1)
        else:
            spans.append(None)
    return tuple(spans)


def sizing_window(positions: int | None) -> int:
    """The tokens per sequence KV figures are given at when none is asked: :data:`SIZING_WINDOW`, cut
    to the model's ``positions``."""
    return min(SIZING_WINDOW, positions or SIZING_WINDOW)


def cache_bytes(layer_bytes: Sequence[int], spans: Sequence[int | None] | None, tokens: float) -> float:
    """The KV cache a sequence holds after ``tokens`` tokens: each layer's bytes a token (``layer_bytes``)
    times the tokens it holds (all of them, or its span: :func:`cache_spans`; ``spans`` None: all)."""
    held = [tokens if not spans or spans[i] is None else min(tokens, spans[i]) for i in range(len(layer_bytes))]
    return sum(b * n for b, n in zip(layer_bytes, held, strict=True))


def bounded(spans: Sequence[int | None] | None) -> bool:
    """Some layer holds fewer than every token (a sliding, chunked or cache-less layer)."""
    return bool(spans) and any(s is not None for s in spans)
