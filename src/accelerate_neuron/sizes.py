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
_SIZE = re.compile(r"^\s*(\d+)(?:\.(\d+))?\s*([A-Za-z]*)\s*$")
#: The largest size the runtime takes (a signed 64-bit byte count): beyond it a value would wrap in C++.
MAX_SIZE = 2**63 - 1
#: More digits than this is beyond ``MAX_SIZE`` whatever the unit (and stops a huge string early).
_MAX_DIGITS = 40


class SizeTooLarge(ValueError):
    """A size beyond :data:`MAX_SIZE`."""


def _beyond(what: str, value: object) -> SizeTooLarge:
    return SizeTooLarge(
        f"invalid {what} {value!r}: more than {MAX_SIZE} bytes (2^63 - 1, 8 EiB), the largest size the runtime takes"
    )


def parse_size(value: str | int, *, what: str = "size") -> int:
    """Bytes in ``value``: an int, or a string such as ``"24GiB"``, ``"500MB"``, ``"1.5GB"``, ``"1024"``.

    Units follow Accelerate: ``GB`` is 10**9 bytes, ``GiB`` is 2**30. Decimals are exact (integer
    arithmetic, never a float: ``"9007199254740993"`` stays that number), a fraction of a byte is
    dropped, and anything beyond :data:`MAX_SIZE` is refused.
    """
    if isinstance(value, bool):
        raise ValueError(f"invalid {what} {value!r}: expected bytes or a string like '24GiB'")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"invalid {what} {value!r}: must not be negative")
        if value > MAX_SIZE:
            raise _beyond(what, value)
        return value
    text = str(value)
    match = _SIZE.match(text)
    unit = match.group(3).upper() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(
            f"invalid {what} {value!r}: expected bytes or a number with a unit "
            f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '24GiB'"
        )
    # Digits past the 40th of a fraction are far below a byte (units reach 2**40): dropped.
    whole, fraction = match.group(1).lstrip("0"), (match.group(2) or "")[:_MAX_DIGITS].rstrip("0")
    if len(whole) > _MAX_DIGITS:
        raise _beyond(what, value)
    scale = 10 ** len(fraction)
    size = (int(whole or "0") * scale + int(fraction or "0")) * _UNITS[unit] // scale
    if size > MAX_SIZE:
        raise _beyond(what, value)
    return size


def format_size(n: int) -> str:
    """``25769803776`` -> ``'24.0 GiB'``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


#: The highest core id a core list may name: far above any host's (a trn2.48xlarge has 128 physical
#: cores), low enough that a typo such as ``0-99999999999`` is refused before anything is expanded.
MAX_CORE_ID = 4095


def parse_core_list(value: str, *, total: int | None = None, what: str = "NEURON_RT_VISIBLE_CORES") -> list[int]:
    """Core ids in ``"2"``, ``"0-3"``, ``"0,2"`` or ``"0-1,4"``: sorted, unique.

    ``total`` bounds the ids (cores 0..total-1 exist); without it, :data:`MAX_CORE_ID` does. Every
    bound is checked on the range's ends, before the range is expanded.
    """
    text = value.strip()
    if not text:
        raise ValueError(f"invalid {what}={value!r}: empty; expected e.g. '0', '0-3' or '0,2'")
    ranges: list[tuple[int, int]] = []
    for part in text.split(","):
        part = part.strip()
        match = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)
        if not match:
            raise ValueError(
                f"invalid {what}={value!r}: {part!r} is not a core id or range; expected e.g. '0', '0-3' or '0,2'"
            )
        if any(len(g.lstrip("0")) > 20 for g in match.groups() if g):  # no giant int is built from a typo
            raise ValueError(
                f"invalid {what}={value!r}: {part!r} is beyond the highest core id accepted ({MAX_CORE_ID})"
            )
        lo = int(match.group(1))
        hi = int(match.group(2)) if match.group(2) is not None else lo
        if hi < lo:
            raise ValueError(f"invalid {what}={value!r}: range {part!r} is descending")
        ranges.append((lo, hi))
    highest = max(hi for _, hi in ranges)
    if total is not None and highest >= total:
        raise ValueError(
            f"invalid {what}={value!r}: core {highest} does not exist; "
            f"this host has {total} Neuron core(s), ids 0-{total - 1}"
        )
    if highest > MAX_CORE_ID:
        raise ValueError(
            f"invalid {what}={value!r}: core {highest} is beyond the highest core id accepted ({MAX_CORE_ID})"
        )
    cores: set[int] = set()
    for lo, hi in ranges:
        cores.update(range(lo, hi + 1))
    return sorted(cores)
