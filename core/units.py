"""Sizes: HF-style size strings (``"5GB"``, ``"24GiB"``) and human-readable byte counts. No torch."""

from __future__ import annotations

import math

from mha2gqa.core.errors import Mha2GqaError

_UNITS = {
    "TB": 10**12,
    "GB": 10**9,
    "MB": 10**6,
    "KB": 10**3,
    "TIB": 2**40,
    "GIB": 2**30,
    "MIB": 2**20,
    "KIB": 2**10,
    "B": 1,
}


#: The largest size (or rate, in bytes per second) taken: 2^63 bytes, 8 EiB, beyond any real memory or disk.
MAX_SIZE = 2**63


def parse_size(text: str | int) -> int:
    """``"80GB"`` -> 80e9, ``"80GiB"`` -> 80 * 2**30, ``"1024"`` -> 1024 bytes. Refuses zero,
    negative, NaN, infinite and unknown units."""
    if isinstance(text, int) and not isinstance(text, bool):
        number, unit = float(text), "B"
    else:
        t = str(text).strip().upper().replace(" ", "")
        for unit in sorted(_UNITS, key=len, reverse=True):
            if t.endswith(unit):
                number_text = t[: -len(unit)]
                break
        else:
            unit, number_text = "B", t
        try:
            number = float(number_text)
        except ValueError:
            raise Mha2GqaError(f"{text!r} is not a size; write e.g. 80GB, 24GiB or 500MB") from None
    if not math.isfinite(number) or number <= 0:
        raise Mha2GqaError(f"{text!r} is not a size; write a positive number with a unit, e.g. 80GB, 24GiB or 500MB")
    scaled = number * _UNITS[unit]
    if not scaled < MAX_SIZE:
        raise Mha2GqaError(
            f"{text!r} is beyond any real size (at most {MAX_SIZE:.3g} bytes); check the number and unit"
        )
    size = int(scaled)
    if size < 1:
        raise Mha2GqaError(f"{text!r} is less than one byte")
    return size


def format_bytes(n: float) -> str:
    """``1536 -> "1.50 KiB"``: binary units, two decimals, thousands separated."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"
