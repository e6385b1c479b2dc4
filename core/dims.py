"""Attention dimensions of a decoder, read from its config once: head counts, head_dim, rotary
dims, and the KV-cache arithmetic that follows from them. No torch.

KV cache per token = ``2 (K and V) x layers x KV heads x head_dim x bytes per element``; e.g.
Llama-2-7B (32 layers, 32 heads of 128) in fp16: 524,288 bytes as MHA, 131,072 with 8 KV heads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mha2gqa.core.errors import Mha2GqaError, SettingError


def config_value(config: Any, key: str, default: Any = None) -> Any:
    """``key`` of a ``config.json`` dict or a transformers config object (whose attribute maps turn
    e.g. GPT-2's ``n_head`` into ``num_attention_heads``)."""
    value = config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)
    return default if value is None else value


#: Config keys that give a model's positions, as families spell them (GPT-2 and GPT-BigCode: ``n_positions``).
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length")


def max_positions(config: Any) -> int | None:
    """The positions a model can read (a ``config.json`` dict or a config object), as its family spells
    them (:data:`POSITION_KEYS`); None when the config names none. OPT's table holds two rows more (its
    offset): ``max_position_embeddings`` is what it reads. Every window a stage cuts must fit this."""
    for key in POSITION_KEYS:
        value = config_value(config, key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _positive_int(config: Any, key: str) -> int:
    value = config_value(config, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        found = "missing" if value is None else f"{value!r}"
        raise Mha2GqaError(f"config.json: {key} must be a positive integer (found {found})")
    return value


def kv_bytes_per_token(kv_heads_by_layer: Sequence[int], head_dim: int, bytes_per_element: int) -> int:
    """The KV cache one token costs: a key and a value of ``head_dim`` elements per KV head per
    layer, ``2 * sum(kv_heads_by_layer) * head_dim * bytes_per_element``."""
    return 2 * sum(kv_heads_by_layer) * head_dim * bytes_per_element


@dataclass(frozen=True)
class AttentionDims:
    """Head counts and sizes of a decoder, read from its config."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    rotary_dim: int | None = None  # None: the whole head (or no rotary)
    #: KV heads of each layer when they differ (``num_key_value_heads_per_layer``); ``num_kv_heads``
    #: is then their largest
    kv_heads_per_layer: tuple[int, ...] | None = None
    #: the only counts the model's class can hold, when not every divisor (GPTBigCode: 1 or H),
    #: with the reason
    kv_choices: tuple[tuple[int, ...], str] | None = None
    #: per layer, the most tokens its KV cache holds (None: every token; a sliding window's ``w - 1``;
    #: 0: none of its own), where some layer holds fewer than all (:mod:`mha2gqa.core.cache_layers`)
    cache_spans: tuple[int | None, ...] | None = None

    @classmethod
    def from_config(cls, config: Any) -> AttentionDims:
        """From a config with the standard keys (a ``config.json`` dict or a transformers config;
        :func:`mha2gqa.core.architecture.resolve` gives any family's config these keys). ``head_dim``
        is the config's own when it has one (Gemma-7B: 256 with hidden 3072 and 16 heads), else
        ``hidden / heads``; rotary dims are ``head_dim x partial_rotary_factor`` (transformers' rule)."""
        layers = _positive_int(config, "num_hidden_layers")
        heads = _positive_int(config, "num_attention_heads")
        hidden = _positive_int(config, "hidden_size")
        kv = config_value(config, "num_key_value_heads", heads)  # absent or null: MHA
        if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1:
            raise Mha2GqaError(f"config.json: num_key_value_heads must be a positive integer (found {kv!r})")
        if heads % kv:
            raise Mha2GqaError(
                f"config.json: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}"
            )
        head_dim = config_value(config, "head_dim") or hidden // heads
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
            raise Mha2GqaError(f"config.json: head_dim must be a positive integer (found {head_dim!r})")
        params = config_value(config, "rope_parameters", {})
        factor = (params.get("partial_rotary_factor") if isinstance(params, dict) else None) or config_value(
            config, "partial_rotary_factor", 1.0
        )
        if not isinstance(factor, int | float) or not 0 < factor <= 1:
            raise Mha2GqaError(f"config.json: partial_rotary_factor must be in (0, 1] (found {factor!r})")
        per_layer = config_value(config, PER_LAYER_KEY)
        if per_layer is not None:
            per_layer = check_per_layer(per_layer, layers, heads, f"config.json: {PER_LAYER_KEY}")
            kv = max(per_layer)
        return cls(layers, heads, kv, head_dim, hidden, int(head_dim * factor), per_layer)

    def kv_heads_of(self, layer: int) -> int:
        """The KV heads of ``layer``."""
        return self.kv_heads_per_layer[layer] if self.kv_heads_per_layer else self.num_kv_heads

    @property
    def rotary(self) -> int:
        """Rotary dimensions per head (the whole head unless partial rotary)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def kv_cache_bytes_per_token(
        self, num_kv_heads: int | Sequence[int] | None = None, bytes_per_element: int = 2
    ) -> int:
        """K and V of every layer for one token (:func:`kv_bytes_per_token`); ``num_kv_heads`` is one
        count for every layer, each layer's, or None for the model's own."""
        if num_kv_heads is None:
            num_kv_heads = self.kv_heads_per_layer or self.num_kv_heads
        if isinstance(num_kv_heads, int):
            num_kv_heads = (num_kv_heads,) * self.num_layers
        return kv_bytes_per_token(num_kv_heads, self.head_dim, bytes_per_element)

    def kv_cache_bytes(
        self, tokens: int, num_kv_heads: int | Sequence[int] | None = None, bytes_per_element: int = 2
    ) -> int:
        """The KV cache one sequence of ``tokens`` tokens holds, as transformers' dynamic cache keeps it:
        each layer's K and V for the tokens it holds (all of them, or a sliding window's last ``w - 1``);
        ``num_kv_heads`` as for :meth:`kv_cache_bytes_per_token`."""
        if num_kv_heads is None:
            num_kv_heads = self.kv_heads_per_layer or self.num_kv_heads
        if isinstance(num_kv_heads, int):
            num_kv_heads = (num_kv_heads,) * self.num_layers
        from mha2gqa.core.cache_layers import cache_bytes

        layer_bytes = [2 * g * self.head_dim * bytes_per_element for g in num_kv_heads]
        return int(cache_bytes(layer_bytes, self.cache_spans, tokens))

    @property
    def windowed(self) -> bool:
        """Some layer's cache holds fewer than every token (sliding or chunked windows, shared caches)."""
        return self.cache_spans is not None

    def window_note(self) -> str:
        """In words, which layers hold fewer tokens: ``"15 of 18 layers keep their last 511 tokens"``."""
        if not self.cache_spans:
            return ""
        parts = {}
        for span in self.cache_spans:
            if span is not None:
                parts[span] = parts.get(span, 0) + 1
        said = [
            f"{n} of {self.num_layers} layers "
            + (f"keep their last {s:,} tokens" if s else "keep no cache of their own")
            for s, n in sorted(parts.items(), reverse=True)
        ]
        return "; ".join(said)

    def valid_kv_heads(self) -> list[int]:
        """The KV-head counts this model converts to: divisors of its current count, largest first."""
        cur = self.num_kv_heads
        return [g for g in range(cur, 0, -1) if cur % g == 0 and (not self.kv_choices or g in self.kv_choices[0])]

    def check_kv_heads(self, num_kv_heads: int, setting: str = "num_kv_heads") -> None:
        """``num_kv_heads`` must divide the current KV-head count (and not exceed it)."""
        cur = self.num_kv_heads
        if (
            isinstance(num_kv_heads, bool)
            or not isinstance(num_kv_heads, int)
            or num_kv_heads not in self.valid_kv_heads()
        ):
            valid = ", ".join(str(g) for g in sorted(self.valid_kv_heads()))
            if self.kv_choices:
                raise SettingError(
                    setting,
                    f"{{name}} {num_kv_heads} is not valid: {self.kv_choices[1]}; choose {valid.replace(', ', ' or ')}",
                )
            raise SettingError(
                setting,
                f"{{name}} {num_kv_heads} is not valid for a model with {cur} KV heads: "
                f"choose a divisor of {cur} ({valid})",
            )

    def check_kv_heads_per_layer(self, values: tuple[int, ...], setting: str = "num_kv_heads_per_layer") -> None:
        """One valid KV-head count (:meth:`check_kv_heads`) for each layer."""
        if len(values) != self.num_layers:
            raise SettingError(
                setting,
                f"{{name}} has {len(values)} values for a model with {self.num_layers} layers: give one per layer",
            )
        for g in values:
            self.check_kv_heads(g, setting)


def parse_kv_heads_list(text: str, setting: str = "num_kv_heads_per_layer") -> tuple[int, ...]:
    """``"8,4,2"`` -> ``(8, 4, 2)``: comma-separated positive integers, one per layer."""
    try:
        values = tuple(int(v) for v in str(text).split(","))
    except ValueError:
        raise SettingError(
            setting, f"{{name}} {text!r}: give comma-separated integers, one per layer, e.g. 8,8,4,2"
        ) from None
    if any(v < 1 for v in values):
        raise SettingError(setting, f"{{name}} {text}: every count must be at least 1")
    return values


#: The config key of a checkpoint whose layers have different KV-head counts (written by ``convert
#: --num-kv-heads-per-layer``; read by mha2gqa's loader and the modeling file beside the weights).
PER_LAYER_KEY = "num_key_value_heads_per_layer"


def check_per_layer(values: Any, layers: int, heads: int, what: str) -> tuple[int, ...]:
    """``values``: one positive KV-head count per layer, each dividing ``heads``."""
    if not isinstance(values, list | tuple) or len(values) != layers:
        raise Mha2GqaError(f"{what}: give one KV-head count for each of the {layers} layers (found {values!r})")
    for i, g in enumerate(values):
        if isinstance(g, bool) or not isinstance(g, int) or g < 1 or heads % g:
            raise Mha2GqaError(
                f"{what}: layer {i} has {g!r} KV heads; each must be a positive divisor of the {heads} query heads"
            )
    return tuple(values)


def contiguous_groups(n: int, groups: int) -> list[list[int]]:
    """``n`` heads in ``groups`` equal runs: group ``j`` holds ``[j*r, (j+1)*r)``, ``r = n // groups``.
    transformers' ``repeat_kv`` grouping (KV head ``j`` serves these query heads), and the default
    grouping of source KV heads pooled into one new KV head."""
    r = n // groups
    return [list(range(j * r, (j + 1) * r)) for j in range(groups)]
