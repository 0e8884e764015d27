"""Misconfigurations ``accelerate-neuron env`` looks for, each with its fix.

Every check reads the facts ``env`` collected (a plain dict) and returns
problems as ``{"severity": "error" | "warning", "problem": ..., "fix": ...}``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..sizes import parse_core_list

Problem = dict[str, str]
Facts = dict[str, Any]

#: Skip details that mean a patch failed (see patching.apply); other skips mean upstream already does it.
FAILURE_DETAILS = ("could not apply", "feature probe failed", "cannot read the signature", "signature changed")
NEURON_PIP_INDEX = "https://pip.repos.neuron.amazonaws.com"
_TRUE = ("1", "true", "yes", "on")


def _problem(severity: str, problem: str, fix: str) -> Problem:
    return {"severity": severity, "problem": problem, "fix": fix}


def activation(facts: Facts) -> list[Problem]:
    status = facts["status"]
    out = []
    if status.get("error"):
        out.append(
            _problem(
                "error",
                f"accelerate-neuron failed to activate ({status['error']}); it is inert in this environment",
                "run `accelerate-neuron env --json` and report the output at the project's issue tracker",
            )
        )
    for patch in status.get("patches", []):
        if str(patch.get("detail", "")).startswith(FAILURE_DETAILS):
            out.append(
                _problem(
                    "warning",
                    f"patch {patch['target']} [{patch['plugin']}] was skipped: {patch['detail']}",
                    "upgrade accelerate-neuron (upstream changed under it); what it fixes stays unfixed until then",
                )
            )
    for plugin in status.get("plugins", []):
        if str(plugin.get("detail", "")).startswith("failed to load"):
            out.append(
                _problem(
                    "error",
                    f"plugin {plugin['name']!r} {plugin['detail']}",
                    f"fix or uninstall the plugin, or skip it with ACCELERATE_NEURON_DISABLE={plugin['name']}",
                )
            )
    return out


def torch_neuronx(facts: Facts) -> list[Problem]:
    probe = facts["torch_neuronx"]
    if probe.get("importable") is False:
        placeholder = "WRONG PACKAGE" in str(probe.get("error", "")).upper()
        what = (
            "the installed `torch-neuronx` is PyPI's placeholder package, not the Neuron SDK's"
            if placeholder
            else f"torch_neuronx is installed but cannot be imported ({probe.get('error')})"
        )
        return [
            _problem(
                "error",
                what,
                f"pip uninstall -y torch-neuronx && pip install --extra-index-url {NEURON_PIP_INDEX} torch-neuronx "
                "(the Neuron SDK's package; it needs a Trainium instance with the Neuron driver)",
            )
        ]
    if probe.get("importable") and facts["device"]["kind"] != "real":
        return [
            _problem(
                "error",
                f"torch_neuronx imports but torch has no 'neuron' device (PrivateUse1 backend is "
                f"{facts['device'].get('privateuse1')!r})",
                "remove the other out-of-tree PyTorch backend, or import torch_neuronx before it registers",
            )
        ]
    return []


def torch_xla(facts: Facts) -> list[Problem]:
    if not facts["versions"].get("torch-xla"):
        return []
    if os.environ.get("USE_TORCH_XLA", "").strip().lower() in _TRUE:
        return [
            _problem(
                "error",
                "USE_TORCH_XLA is set: transformers and accelerate take the legacy torch_xla path, not the native "
                "Neuron backend",
                "unset USE_TORCH_XLA (and pip uninstall torch-xla: the native backend does not use it)",
            )
        ]
    return [
        _problem(
            "warning",
            "torch_xla is installed beside the native Neuron backend: transformers and accelerate check for it "
            "first (accelerate-neuron sets USE_TORCH_XLA=0 when it activates, tools that start without it do not)",
            "pip uninstall torch-xla, or export USE_TORCH_XLA=0",
        )
    ]


def async_load(facts: Facts) -> list[Problem]:
    if facts["device"]["kind"] is None or not facts.get("transformers_async_load"):
        return []
    if os.environ.get("HF_DEACTIVATE_ASYNC_LOAD", "").strip().lower() in _TRUE:
        return []
    return [
        _problem(
            "warning",
            "HF_DEACTIVATE_ASYNC_LOAD is unset: this transformers loads weights asynchronously, which is reported "
            "to hang on Neuron",
            "export HF_DEACTIVATE_ASYNC_LOAD=1",
        )
    ]


def visible_cores(facts: Facts) -> list[Problem]:
    out = []
    spec = os.environ.get("NEURON_RT_VISIBLE_CORES", "").strip()
    if spec:
        try:
            parse_core_list(spec)
        except ValueError as exc:
            out.append(_problem("error", str(exc), "use a core id, a range or a list: 0, 0-3 or 0,2"))
    num = os.environ.get("NEURON_RT_NUM_CORES", "").strip()
    if num and (not num.isdigit() or int(num) < 1):
        out.append(_problem("error", f"invalid NEURON_RT_NUM_CORES={num!r}", "use a positive number of cores, e.g. 4"))
    lnc = os.environ.get("NEURON_LOGICAL_NC_CONFIG", "").strip()
    if lnc and lnc not in ("1", "2"):
        out.append(
            _problem(
                "warning",
                f"NEURON_LOGICAL_NC_CONFIG={lnc!r}: logical NeuronCore configs are 1 or 2",
                "unset it (trn2 default: 2 physical cores per logical core) or set 1 or 2",
            )
        )
    return out


def launch_config(facts: Facts) -> list[Problem]:
    launch = facts.get("launch") or {}
    processes = launch.get("num_processes")
    out = []
    if not processes or processes < 2:
        return out
    source = launch.get("source", "the launch config")
    spec = os.environ.get("NEURON_RT_VISIBLE_CORES", "").strip()
    if spec:
        out.append(
            _problem(
                "warning",
                f"NEURON_RT_VISIBLE_CORES={spec} is exported while {source} starts {processes} processes: every "
                "process would see the same cores",
                "unset NEURON_RT_VISIBLE_CORES; the neuron process group gives each rank the core of its LOCAL_RANK",
            )
        )
    visible = facts["device"].get("visible_cores") or 0
    if facts["device"]["kind"] is not None and visible and processes > visible:
        out.append(
            _problem(
                "error",
                f"{source} starts {processes} processes but only {visible} Neuron core(s) are visible",
                f"set num_processes to at most {visible} (`accelerate config`), or make more cores visible",
            )
        )
    return out


def config_file(facts: Facts) -> list[Problem]:
    config = facts.get("config_file") or {}
    if not config.get("error"):
        return []
    return [
        _problem(
            "error",
            f"the Accelerate config file cannot be used: {config['error']}",
            "fix the file (`accelerate config` rewrites it); `accelerate launch` stops on the same error",
        )
    ]


def fp16(facts: Facts) -> list[Problem]:
    launch = facts.get("launch") or {}
    sources = []
    if os.environ.get("ACCELERATE_MIXED_PRECISION", "").strip().lower() == "fp16":
        sources.append("ACCELERATE_MIXED_PRECISION=fp16")
    if str(launch.get("mixed_precision", "")).lower() == "fp16":
        sources.append(f"mixed_precision: fp16 in {launch.get('source')}")
    if not sources:
        return []
    return [
        _problem(
            "warning",
            f"fp16 requested ({'; '.join(sources)}): fp16 training is refused on Neuron (no documented gradient "
            "scaler); Neuron trains in bf16",
            "use bf16: `accelerate config` -> mixed_precision: bf16, ACCELERATE_MIXED_PRECISION=bf16, "
            "or TrainingArguments(bf16=True)",
        )
    ]


def settings(facts: Facts) -> list[Problem]:
    from .. import settings as registry

    out = []
    values = {s["name"]: s for s in facts.get("accelerate_neuron_settings", [])}
    for row in values.values():
        if row["error"]:
            fix = f"fix {row['variable']} or unset it" if row["source"] == "environment" else f"fix {row['source']}"
            out.append(_problem("warning", row["error"], f"{fix}; `accelerate-neuron env -v` lists every setting"))
    for name in registry.unknown_variables():
        out.append(
            _problem(
                "warning",
                f"{name} is set but names no accelerate-neuron setting: it has no effect",
                "check the spelling against the settings reference (`accelerate-neuron env -v` lists them)",
            )
        )
    simulate = values.get("simulate")
    if simulate and not simulate["error"] and simulate["value"] and facts["device"]["kind"] == "real":
        out.append(
            _problem(
                "warning",
                f"{simulate['variable']} is set on a host with real Neuron cores: it is ignored",
                f"unset {simulate['variable']}",
            )
        )
    known = {p["name"] for p in facts["status"].get("plugins", [])}
    disable = values.get("disable")
    if known and disable and not disable["error"]:
        unknown = sorted(disable["value"].names - known)
        if unknown:
            out.append(
                _problem(
                    "warning",
                    f"{disable['variable']} names unknown plugin(s): {', '.join(unknown)}",
                    f"use names from: {', '.join(sorted(known))} (or 1/all to apply no patch)",
                )
            )
    return out


def compile_cache(facts: Facts) -> list[Problem]:
    cache = facts.get("compile_cache") or {}
    out = [
        _problem("warning", error, "fix the value or unset the variable") for error in cache.get("setting_errors", [])
    ]
    neff = cache.get("neff_cache") or {}
    if (
        neff.get("simulated")
        and not neff.get("enabled")
        and "TORCH_NEURONX_NEFF_DISABLE_CACHE" not in str(neff.get("reason"))
    ):
        out.append(
            _problem(
                "warning",
                f"the simulated NEFF cache is off: {neff.get('reason')}",
                "point TORCH_NEURONX_NEFF_CACHE_DIR at an empty folder (or unset it for the simulator's own)",
            )
        )
    out += [
        _problem("warning", error, "fix the value or unset the variable: it is part of every compile cache key")
        for error in cache.get("key_input_errors", [])
    ]
    remote = cache.get("remote") or {}
    if remote.get("missing_package"):
        out.append(
            _problem(
                "error",
                f"the remote compile cache {remote['url']} needs the {remote['missing_package']} package, which is "
                "not installed: jobs run without the remote",
                f"pip install {remote['missing_package']}",
            )
        )
    return out


CHECKS: tuple[Callable[[Facts], list[Problem]], ...] = (
    activation,
    torch_neuronx,
    torch_xla,
    async_load,
    visible_cores,
    launch_config,
    config_file,
    fp16,
    settings,
    compile_cache,
)


def find_problems(facts: Facts) -> list[Problem]:
    """Every misconfiguration found, errors first."""
    problems = [p for check in CHECKS for p in check(facts)]
    return sorted(problems, key=lambda p: p["severity"] != "error")
