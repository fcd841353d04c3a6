"""Sizes as people write them: ``500G``, ``1.5T``, ``800M``, ``123456`` (bytes).

A letter alone (``K M G T P``) and the IEC forms (``Ki``, ``KiB``, ...) are powers of 1024,
as ``df -h``, ``du -h``, ``dd`` and Slurm read them, so a figure copied from ``df -h`` means
what it says; ``KB MB GB TB PB`` are powers of 1000. Sizes shown back (:func:`show_size`)
use the IEC names, so ``500G`` is shown as ``500 GiB``.
"""

from __future__ import annotations

import re

_LETTERS = "KMGTP"
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(?:([KMGTP])(i?)(B?)|(B?))", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes in ``text`` (rounded down); ValueError with a one-line reason otherwise."""
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"expected a size such as 500G, 1.5T, 800M or a number of bytes, "
                         f"got {text!r}")
    number, letter, iec, b = m.group(1), m.group(2), m.group(3), m.group(4)
    if letter is None:
        if "." in number:
            raise ValueError(f"a number of bytes must be whole, got {text!r}")
        return int(number)
    power = _LETTERS.index(letter.upper()) + 1
    decimal = bool(b) and not iec  # "GB": 1000**3; "G", "Gi", "GiB": 1024**3
    unit = 1000**power if decimal else 1024**power
    whole, _, frac = number.partition(".")
    # exact arithmetic: 1.5T is 1649267441664 bytes, not a float's neighbour of it
    return (int(whole or "0") * unit) + (int(frac) * unit // 10 ** len(frac) if frac else 0)


def show_size(n: int) -> str:
    """``n`` bytes in IEC units with at most one decimal: ``512 B``, ``1.5 GiB``, ``500 GiB``."""
    if n < 1024:
        return f"{n} B"
    power = 1
    # the next unit as soon as one decimal would show 1024 of this one
    while power < len(_LETTERS) and round(n / 1024**power, 1) >= 1024:
        power += 1
    value = f"{n / 1024**power:.1f}".removesuffix(".0")
    return f"{value} {_LETTERS[power - 1]}iB"
