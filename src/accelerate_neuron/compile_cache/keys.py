"""What makes a NEFF differ besides its graph: the key inputs a fleet's hosts must share to share a compile.

A compiled graph is only the same program on another host if it was compiled by the same compiler, with
the same ``NEURON_CC_FLAGS``, for the same chip (``trn1`` / ``trn2`` / ``trn3``) and logical core size (LNC:
``NEURON_LOGICAL_NC_CONFIG``). optimum-neuron's Hub cache keyed by graph and compiler version only, and
served NEFFs built with other flags (its issue #457). Here the inputs go into every simulated key (a changed
flag or target misses) and name the remote folder an entry is published under (so a real host never fetches a
NEFF built with other inputs, whatever torch-neuronx's own key holds).

The target: ``NEURON_PLATFORM_TARGET_OVERRIDE`` (the name NeuronX Distributed and neuronx-cc use for compiling
on a host that is not the target; ``precompile --target`` sets it), else the instance family of a real host
(EC2's DMI product name, e.g. ``trn2.48xlarge``), else ``trn2`` on the simulator (it models a trn2 chip).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import shlex
from typing import Any

TARGETS = ("trn1", "trn2", "trn3")
TARGET_ENV = "NEURON_PLATFORM_TARGET_OVERRIDE"
FLAGS_ENV = "NEURON_CC_FLAGS"
LNC_ENV = "NEURON_LOGICAL_NC_CONFIG"
#: LNC when NEURON_LOGICAL_NC_CONFIG is unset: trn1 has no logical cores; trn2 defaults to 2 (trn3: assumed the same).
DEFAULT_LNC = {"trn1": 1, "trn2": 2, "trn3": 2}
SIMULATED_TARGET = "trn2"
_DMI_PRODUCT = "/sys/devices/virtual/dmi/id/product_name"


@functools.cache
def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def host_family() -> str | None:
    """The EC2 instance family of this host (``trn2`` for ``trn2.48xlarge``), or None if it is not a Trainium one."""
    try:
        with open(_DMI_PRODUCT, encoding="ascii", errors="replace") as fh:
            product = fh.read(64).strip().lower()
    except OSError:
        return None
    family = product.split(".")[0]
    for target in TARGETS:
        if family.startswith(target):  # trn1n.32xlarge -> trn1
            return target
    return None


def normalize_flags(flags: str) -> str:
    """``NEURON_CC_FLAGS`` with its spacing normalised (order kept: a later flag may override an earlier one)."""
    try:
        return " ".join(shlex.split(flags))
    except ValueError:  # unbalanced quotes: neuronx-cc sees the text as it is
        return " ".join(flags.split())


def target(simulated: bool) -> str:
    override = os.environ.get(TARGET_ENV, "").strip().lower()
    if override:
        return override
    if simulated:
        return SIMULATED_TARGET
    return host_family() or "unknown"


def key_inputs(simulated: bool) -> dict[str, Any]:
    """The inputs besides the graph: compiler, flags, target, LNC (read from the environment at each call)."""
    chip = target(simulated)
    lnc = os.environ.get(LNC_ENV, "").strip() or str(DEFAULT_LNC.get(chip, "default"))
    if simulated:
        compiler = f"simulated (accelerate-neuron {_version('accelerate-neuron') or 'unknown'})"
    else:
        compiler = f"neuronx-cc {_version('neuronx-cc') or 'unknown'}"
    return {
        "compiler": compiler,
        "torch_neuronx": None if simulated else _version("torch-neuronx"),
        "neuron_cc_flags": normalize_flags(os.environ.get(FLAGS_ENV, "")),
        "target": chip,
        "lnc": lnc,
    }


def fingerprint(inputs: dict[str, Any]) -> str:
    """16 hex digits naming a set of key inputs (the remote folder its entries are published under)."""
    text = json.dumps(inputs, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def problems(simulated: bool) -> list[str]:
    """Values of the key inputs' variables that neuronx-cc would not accept (``accelerate-neuron env`` lists them)."""
    out = []
    override = os.environ.get(TARGET_ENV, "").strip()
    if override and override.lower() not in TARGETS:
        out.append(f"invalid {TARGET_ENV}={override!r}: expected one of {', '.join(TARGETS)}")
    lnc = os.environ.get(LNC_ENV, "").strip()
    if lnc and lnc not in ("1", "2"):
        out.append(f"invalid {LNC_ENV}={lnc!r}: expected 1 or 2")
    flags = os.environ.get(FLAGS_ENV, "")
    try:
        shlex.split(flags)
    except ValueError as exc:
        out.append(f"{FLAGS_ENV}={flags!r} does not split into arguments ({exc})")
    return out
