"""Device and dtype names as users type them, checked without importing torch."""

from __future__ import annotations

import re

from mha2gqa.core.dtypes import MODEL_DTYPES
from mha2gqa.core.errors import SettingError

DEVICE_HELP = "auto (CUDA when present), cpu, cuda or cuda:N."
#: the arithmetic of training steps (--mixed-precision, --refit-precision, --distill-precision)
PRECISIONS = ("auto", "no", "bf16")
PRECISION_HELP = (
    "auto: bf16 autocast where the device multiplies bfloat16 natively (GPUs that support it; CPUs with AMX or "
    "AVX512-BF16), float32 otherwise; no: float32; bf16: bf16 autocast."
)
DTYPE_HELP = "auto (bf16 on GPU, fp32 on CPU), " + ", ".join(MODEL_DTYPES) + "."


def check_device_name(device: str, setting: str = "device") -> None:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""
    if not isinstance(device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        raise SettingError(setting, f"{{name}} {device}: choose auto, cpu, cuda or cuda:N")


def check_dtype_name(dtype: str, setting: str = "dtype") -> None:
    """``auto`` or one of :data:`~mha2gqa.core.dtypes.MODEL_DTYPES`."""
    if dtype != "auto" and dtype not in MODEL_DTYPES:
        raise SettingError(setting, f"{{name}} {dtype}: choose auto, {', '.join(MODEL_DTYPES)}")
