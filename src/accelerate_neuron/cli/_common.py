"""Shared pieces of the ``accelerate-neuron`` commands: flag types, progress, formatting."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .. import costs, settings
from ..sizes import format_size, parse_size

#: Upper bound of ``--cores``: the simulator's own limit.
MAX_SIM_CORES = 128


class CliError(Exception):
    """A user-facing failure: printed as ``accelerate-neuron: error: ...``, exit code ``code`` (1)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


class ArgumentParser(argparse.ArgumentParser):
    """Every multi-word option also answers to its underscore spelling (``--max_new_tokens``), as ``accelerate``'s
    and ``torchrun``'s do; ``--help`` shows the dashed one. Subcommand parsers are of this class too."""

    def add_argument(self, *names: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*names, **kwargs)
        for name in names:
            if isinstance(name, str) and name.startswith("--") and "-" in name[2:]:
                alias = "--" + name[2:].replace("-", "_")
                hidden = {"dest": action.dest, "default": argparse.SUPPRESS, "help": argparse.SUPPRESS}
                super().add_argument(alias, **{**kwargs, **hidden})
        return action

    def _get_option_tuples(self, option_string: str) -> list[Any]:
        # An abbreviation (--max) matches both spellings of one option: one match, not an ambiguity. Each tuple
        # starts with the action on every Python version; if that changes, abbreviations only get stricter.
        found, seen = [], set()
        for candidate in super()._get_option_tuples(option_string):
            dest = getattr(candidate[0], "dest", None)
            if dest is None or dest not in seen:
                found.append(candidate)
                seen.add(dest)
        return found


def counting(what: str, most: int | None = None, too_many: str = "") -> Callable[[str], int]:
    """argparse type: a whole number from 1 (to ``most``); ``what`` names it in errors, ``too_many`` says why."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; expected {what}, e.g. 4") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{value} is not allowed; expected {what}, e.g. 4")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"{value} is too many; {too_many or f'at most {most}'}")
        return value

    return parse


positive_int = counting("a positive integer")
core_count = counting("a positive integer", MAX_SIM_CORES, f"the simulator models 1 to {MAX_SIM_CORES} cores")


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


#: Simulated memory per core by default: a trn2 logical core at LNC=2.
DEFAULT_HBM = settings.setting("sim_hbm").default


def add_device_options(parser: argparse.ArgumentParser, *, cores: int, cores_help: str) -> None:
    """``--cores`` and ``--hbm``: the simulated device a command starts when there is no Trainium."""
    parser.add_argument("--cores", type=core_count, default=cores, metavar="N", help=f"{cores_help} (default {cores})")
    parser.add_argument(
        "--hbm",
        type=memory_size,
        default=DEFAULT_HBM,
        metavar="SIZE",
        help=f"simulated memory per core, e.g. 24GiB, 16GiB, 512MiB (default {DEFAULT_HBM}); GB=10^9, GiB=2^30",
    )


def add_cost_options(parser: argparse.ArgumentParser) -> None:
    """``--compile-seconds`` and ``--eager-seconds``: the cost model a command prices compiles with."""
    parser.add_argument(
        "--compile-seconds",
        type=non_negative_seconds,
        default=costs.SECONDS_PER_GRAPH,
        metavar="S",
        help=f"assumed neuronx-cc time per compiled graph (default {costs.SECONDS_PER_GRAPH:g})",
    )
    parser.add_argument(
        "--eager-seconds",
        type=non_negative_seconds,
        default=costs.SECONDS_PER_EAGER_SIGNATURE,
        metavar="S",
        help=f"assumed compile time per eager op signature (default {costs.SECONDS_PER_EAGER_SIGNATURE:g})",
    )


def add_json_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--json", action="store_true", help=f"print {what} as one JSON line (stdout) instead of text")


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
