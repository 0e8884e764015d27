"""Parsing of memory sizes and Neuron core lists given by users (env vars, flags)."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: str | int, *, what: str = "size") -> int:
    """Bytes in ``value``: an int, or a string such as ``"24GiB"``, ``"500MB"``, ``"1024"``.

    Units follow Accelerate: ``GB`` is 10**9 bytes, ``GiB`` is 2**30.
    """
    if isinstance(value, bool):
        raise ValueError(f"invalid {what} {value!r}: expected bytes or a string like '24GiB'")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"invalid {what} {value!r}: must not be negative")
        return value
    match = _SIZE.match(str(value))
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(
            f"invalid {what} {value!r}: expected bytes or a number with a unit "
            f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '24GiB'"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(n: int) -> str:
    """``25769803776`` -> ``'24.0 GiB'``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def parse_core_list(value: str, *, total: int | None = None, what: str = "NEURON_RT_VISIBLE_CORES") -> list[int]:
    """Core ids in ``"2"``, ``"0-3"``, ``"0,2"`` or ``"0-1,4"``: sorted, unique.

    ``total`` bounds the ids (cores 0..total-1 exist).
    """
    cores: set[int] = set()
    text = value.strip()
    if not text:
        raise ValueError(f"invalid {what}={value!r}: empty; expected e.g. '0', '0-3' or '0,2'")
    for part in text.split(","):
        part = part.strip()
        match = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)
        if not match:
            raise ValueError(
                f"invalid {what}={value!r}: {part!r} is not a core id or range; expected e.g. '0', '0-3' or '0,2'"
            )
        lo = int(match.group(1))
        hi = int(match.group(2)) if match.group(2) is not None else lo
        if hi < lo:
            raise ValueError(f"invalid {what}={value!r}: range {part!r} is descending")
        cores.update(range(lo, hi + 1))
    ordered = sorted(cores)
    if total is not None and ordered[-1] >= total:
        raise ValueError(
            f"invalid {what}={value!r}: core {ordered[-1]} does not exist; "
            f"this host has {total} Neuron core(s), ids 0-{total - 1}"
        )
    return ordered
