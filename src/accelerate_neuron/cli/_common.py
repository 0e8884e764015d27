"""Shared pieces of the ``accelerate-neuron`` commands: flag types, progress, formatting."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..sizes import format_size, parse_size

#: Upper bound of ``--cores``: the simulator's own limit.
MAX_SIM_CORES = 128


class CliError(Exception):
    """A user-facing failure: printed as ``accelerate-neuron: error: ...``, exit code ``code`` (1)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number; expected a positive integer, e.g. 4"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not allowed; expected a positive integer, e.g. 4")
    return value


def core_count(text: str) -> int:
    """argparse type: a number of simulated cores, 1..MAX_SIM_CORES."""
    value = positive_int(text)
    if value > MAX_SIM_CORES:
        raise argparse.ArgumentTypeError(f"{value} is too many; the simulator models 1 to {MAX_SIM_CORES} cores")
    return value


def memory_size(text: str) -> str:
    """argparse type: a positive memory size such as ``24GiB`` (kept as text for the env var)."""
    try:
        value = parse_size(text, what="size")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; expected a positive size, e.g. 24GiB")
    return text.strip()


def non_negative_seconds(text: str) -> float:
    """argparse type: a number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; expected seconds >= 0, e.g. 60") from None
    if not value >= 0 or value == float("inf"):  # also rejects NaN
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; expected a finite number of seconds >= 0")
    return value


class Progress:
    """Step lines on stderr, so stdout stays the result (and valid JSON with ``--json``)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled

    def note(self, message: str) -> None:
        if self.enabled:
            print(f"accelerate-neuron: {message}", file=sys.stderr, flush=True)

    @contextmanager
    def step(self, message: str) -> Iterator[None]:
        """Announce a step that may take more than a second, then how long it took."""
        started = time.perf_counter()
        self.note(f"{message}...")
        yield
        seconds = time.perf_counter() - started
        if self.enabled and seconds >= 1.0:
            print(f"accelerate-neuron:   done in {seconds:.1f} s", file=sys.stderr, flush=True)


def print_json(data: Any) -> None:
    """One JSON document on one line of stdout."""
    print(json.dumps(data, default=str, sort_keys=False))


def size(n: int | float | None) -> str:
    return "-" if n is None else format_size(int(n))


def duration(seconds: float) -> str:
    """``4271`` -> ``'1 h 11 min'``, ``75`` -> ``'1 min 15 s'``."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, secs = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {secs} s" if secs else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"


def plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word if n == 1 else (many or word + 's')}"
