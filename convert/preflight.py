"""Everything a conversion checks before any heavy work, without importing torch: the source
(folder or hub id, headers only), its family and dimensions, the KV-head count, the method and
grouping against the family, the destination against the inputs, and the layer count of the config
against the weights. The CLI runs it before loading the converter, so a mistake is reported at once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mha2gqa.convert.methods import Grouping, Method, get_grouping, get_method, refusal
from mha2gqa.convert.settings import ConvertSettings
from mha2gqa.core.checkpoint import Checkpoint, open_checkpoint
from mha2gqa.core.dims import AttentionDims
from mha2gqa.core.errors import Mha2GqaError, SettingError
from mha2gqa.core.families import Family, detect_family
from mha2gqa.core.output import check_destination


@dataclass
class Source:
    """A checked source and what it is converted with."""

    ckpt: Checkpoint
    family: Family
    dims: AttentionDims
    method: Method
    grouping: Grouping

    @property
    def layered(self) -> bool:
        """q/k/v/o are rewritten together (a layer method, or heads regrouped)."""
        return self.method.layerwise or self.grouping.reorders


def inputs_of(ckpt: Checkpoint, s: ConvertSettings) -> dict[str, Path | str | None]:
    """What this conversion reads, which its output may never replace."""
    return {"the source model": ckpt.folder, "the --calibration text": s.calibration}


def preflight(src: str | Path, dst: Path, s: ConvertSettings) -> Source:
    """Open the source (headers only), check the destination and that the method applies."""
    method, grouping = get_method(s.method), get_grouping(s.grouping)
    ckpt = open_checkpoint(str(src), revision=s.revision, allow_pickle=s.allow_pickle)
    check_destination(dst, s.overwrite, inputs_of(ckpt, s))
    family = detect_family(ckpt.config)
    dims = AttentionDims.from_config(ckpt.config)
    dims.check_kv_heads(s.num_kv_heads)
    _check_layers(ckpt, family, dims)
    if s.check_finite:
        ckpt.check_finite()
    source = Source(ckpt, family, dims, method, grouping)
    if s.num_kv_heads != dims.num_kv_heads:
        reason = refusal(method, grouping, family)
        if reason:
            raise SettingError("method", reason)
        s.check_calibration()
    return source


def _check_layers(ckpt: Checkpoint, family: Family, dims: AttentionDims) -> None:
    """The weights hold exactly the config's layers (a cheap check by name, before anything heavy)."""
    name = family.o_proj + ".weight"
    for layer in range(dims.num_layers):
        if name.format(layer=layer) not in ckpt.tensors:
            missing = name.format(layer=layer)
            raise Mha2GqaError(f"{ckpt.folder}: config.json says {dims.num_layers} layers, but the weights have no "
                               f"{missing} (layer {layer}); the config does not match the weights")  # fmt: skip
    if name.format(layer=dims.num_layers) in ckpt.tensors:
        raise Mha2GqaError(f"{ckpt.folder}: the weights have more layers than the {dims.num_layers} config.json says")
