"""``accelerate-neuron env``: what is installed, what the device looks like, and what is misconfigured."""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import platform
import sys
from collections import Counter
from typing import Any

from . import _checks
from ._common import Progress, print_json, size

DESCRIPTION = """\
Print versions (torch, torch-neuronx or "simulated", transformers, accelerate,
accelerate-neuron), the Neuron cores this process sees and their memory, the
LNC and NEURON_RT_* settings, the compile cache, which accelerate-neuron
plugins and patches are active (and why any was skipped), and the
misconfigurations found, each with its fix.

Reading the memory of each core initialises the Neuron runtime of this
process (as torch.neuron.get_device_properties() does); --no-init skips it.
The exit code is 1 when an error-level problem was found, else 0."""

EPILOG = """\
examples:
  accelerate-neuron env
  accelerate-neuron env --config_file my_config.yaml   # the settings `accelerate launch --config_file` would hand over
  accelerate-neuron env --json | jq .problems
  ACCELERATE_NEURON_SIMULATE=4 accelerate-neuron env   # as a simulated trn2 chip would look"""

#: Settings always shown (with what "unset" means); other NEURON_* variables are shown when set.
KEY_SETTINGS = {
    "NEURON_LOGICAL_NC_CONFIG": "unset (trn2 default: LNC=2)",
    "NEURON_RT_VISIBLE_CORES": "unset (all cores)",
    "NEURON_RT_NUM_CORES": "unset",
    "TORCH_NEURONX_NEFF_CACHE_DIR": "unset (the default, see Compile cache)",
    "TORCH_NEURONX_DEBUG_DIR": "unset (/tmp/neuron_backend)",
    "HF_DEACTIVATE_ASYNC_LOAD": "unset",
}
_SHOWN_PREFIXES = ("NEURON_", "TORCH_NEURONX_")
_STATE_ORDER = ("applied", "skipped", "absent", "pending", "reverted")
_SHOWN_NAMES = ("USE_TORCH_XLA", "ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "env",
        help="check the environment: versions, Neuron cores, settings, patches, misconfigurations",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (stdout) instead of text")
    p.add_argument(
        "--no-init", action="store_true", help="do not initialise the Neuron runtime (no per-core memory figures)"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="list every applied patch and why it exists")
    p.add_argument(
        "--config-file",
        metavar="FILE",
        help="the Accelerate config file whose neuron_config: block and launch settings to check (default: the one "
        "`accelerate launch` reads without --config_file)",
    )
    p.set_defaults(run=run, parser=p)


# ------------------------------------------------------------------ facts


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _probe_torch_neuronx(kind: str | None) -> dict[str, Any]:
    """Is a torch_neuronx installed, and does it import? (Never re-imports a working one.)"""
    spec = importlib.machinery.PathFinder.find_spec("torch_neuronx")
    probe: dict[str, Any] = {"installed": spec is not None, "version": _dist_version("torch-neuronx")}
    if spec is None:
        return probe
    probe["location"] = spec.origin
    if kind == "real":
        probe["importable"] = True
        return probe
    loaded = sys.modules.get("torch_neuronx")
    if loaded is not None and not getattr(loaded, "SIMULATED", False):
        probe["importable"] = True
        return probe
    try:
        # A private module object: the simulator's stand-in stays what `import torch_neuronx` gives.
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        probe["importable"] = True
    except Exception as exc:
        probe["importable"] = False
        probe["error"] = f"{type(exc).__name__}: {exc}"
    return probe


def _versions(kind: str | None, probe: dict[str, Any]) -> dict[str, str | None]:
    import torch

    from .. import __version__

    if kind == "simulated":
        neuronx = "simulated"
        if probe.get("importable") is False:
            installed = " ".join(filter(None, ["the installed torch-neuronx", probe.get("version")]))
            neuronx += f" ({installed} cannot be imported)"
    elif probe.get("installed"):
        neuronx = probe.get("version") or "installed (version unknown)"
        if probe.get("importable") is False:
            neuronx += " (cannot be imported)"
    else:
        neuronx = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch-neuronx": neuronx,
        "transformers": _dist_version("transformers"),
        "accelerate": _dist_version("accelerate"),
        "accelerate-neuron": __version__,
        "torch-xla": _dist_version("torch-xla") or _dist_version("torch_xla"),
        "neuronx-cc": _dist_version("neuronx-cc"),
    }


def _device(kind: str | None, init: bool) -> dict[str, Any]:
    import torch

    from .. import device

    info: dict[str, Any] = {
        "kind": kind,
        "privateuse1": torch._C._get_privateuse1_backend_name(),
        "visible_cores": device.device_count(),
        "runtime_initialised_by_env": False,
        "cores": [],
    }
    if kind is None or not init:
        return info
    try:
        for index in range(info["visible_cores"]):
            mem = device.core_memory(index)
            info["cores"].append(
                {"index": index, "total": mem.total, "free": mem.free, "allocated": mem.allocated, "source": mem.source}
            )
        info["runtime_initialised_by_env"] = True
    except Exception as exc:  # a broken runtime is a finding, not a crash
        info["error"] = f"{type(exc).__name__}: {exc}"
    return info


def _settings() -> dict[str, str | None]:
    shown = {name: os.environ.get(name) for name in KEY_SETTINGS}
    for name, value in sorted(os.environ.items()):
        if name.startswith(_SHOWN_PREFIXES) or name in _SHOWN_NAMES:
            shown.setdefault(name, value)
    return shown


def _plugin_settings() -> list[dict[str, Any]]:
    """Every accelerate-neuron setting: its value in force, where it came from, and an error if it is bad."""
    from .. import settings

    rows = []
    for item, chosen, error in settings.effective():
        given = settings.raw(item.name)
        rows.append(
            {
                "name": item.name,
                "variable": item.env,
                "value": chosen.value if chosen is not None else (given[0] if given else item.default),
                "source": given[1] if given else "default",
                "default": item.shown_default,
                "error": error or None,
            }
        )
    return rows


def _shown(value: Any) -> str:
    if isinstance(value, tuple) and value and all(isinstance(v, int) for v in value):
        return ",".join(map(str, value))
    if value == ():
        return "off"
    if hasattr(value, "names"):  # the disable setting
        return "all" if value.all else ",".join(sorted(value.names)) or "none"
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):  # the launch_config setting
        return f"the neuron_config of {value[0]}: {', '.join(value[1]) or 'empty'}"
    return str(value)


def _config_line(config: dict[str, Any]) -> str:
    if config.get("handed_over"):
        return f"{config['path']} (its neuron_config was handed to this process by accelerate launch)"
    if not config.get("path"):
        return "none (`accelerate config` writes one; its neuron_config: block holds these settings)"
    if config.get("error"):
        return f"{config['path']} (unreadable, see Problems)"
    block = config.get("neuron_config") or {}
    what = f"neuron_config: {len(block)} setting(s)" if block else "no neuron_config: block"
    return f"{config['path']} ({what}; handed by accelerate launch to the processes it starts)"


def _cache(kind: str | None) -> dict[str, Any]:
    """The NEFF cache this process would use: the simulator's own, or torch-neuronx's, with its size."""
    from ..simulator import neff_cache

    cache: dict[str, Any] = {
        "neff_cache_dir": os.environ.get(neff_cache.CACHE_DIR_ENV),
        "debug_dir": os.environ.get("TORCH_NEURONX_DEBUG_DIR") or "/tmp/neuron_backend",
    }
    if kind == "simulated":
        from ..simulator._build import cache_dir

        cache["neff_cache"] = {**neff_cache.from_environment(warn=False).describe(usage=True), "simulated": True}
        cache["simulator_build_cache"] = str(cache_dir())
    else:
        root = cache["neff_cache_dir"] or neff_cache.REAL_DEFAULT_DIR
        entries, size = neff_cache.disk_usage(root)
        disabled = os.environ.get(neff_cache.DISABLE_ENV, "").strip() == "1"  # torch-neuronx's own test
        cache["neff_cache"] = {
            "dir": root,
            "enabled": not disabled,
            "reason": f"{neff_cache.DISABLE_ENV}=1" if disabled else None,
            "exists": os.path.isdir(root),
            "entries": entries,
            "bytes": size,
            "simulated": False,
        }
    cache["setting_errors"] = neff_cache.setting_errors()
    cache.update(_fleet(kind))
    return cache


def _fleet(kind: str | None) -> dict[str, Any]:
    """The key inputs of this host (what else than the graph a compile cache key holds) and the remote cache."""
    from .. import settings
    from ..compile_cache import keys

    simulated = kind != "real"
    inputs = keys.key_inputs(simulated)
    out: dict[str, Any] = {
        "key_inputs": {**inputs, "fingerprint": keys.fingerprint(inputs)},
        "key_input_errors": keys.problems(simulated),
        "remote": None,
    }
    try:
        url = settings.get("remote_cache")
    except ValueError:  # reported with the other settings
        return out
    if url is not None:
        out["remote"] = {
            "url": url.shown,
            "read_only": settings.get_quietly("remote_cache_read_only"),
            "missing_package": url.missing_package(),
            "namespace": f"{'simulated' if simulated else 'neff'}/{out['key_inputs']['fingerprint']}",
        }
    return out


def _cache_lines(cache: dict[str, Any]) -> list[str]:
    from ..simulator.neff_cache import REAL_DEFAULT_DIR

    neff = cache["neff_cache"]
    where = neff["dir"] or "-"
    if not neff["enabled"]:
        state = f"off ({neff.get('reason')})"
    elif neff["simulated"]:
        state = f"simulated: {neff['entries']} entries, {size(neff['bytes'])}"
    elif not neff.get("exists"):
        state = "torch-neuronx's; not created yet"
    else:
        state = f"torch-neuronx's: {neff['entries']} entries, {size(neff['bytes'])}"
    lines = ["Compile cache", f"  {'NEFF cache':<30} {where} ({state})"]
    if neff["simulated"]:
        lines.append(
            f"  {'':<30} not torch-neuronx's {REAL_DEFAULT_DIR}: a simulated run never writes into a real cache"
        )
    inputs = cache.get("key_inputs") or {}
    if inputs:
        flags = inputs["neuron_cc_flags"] or "none"
        lines.append(
            f"  {'key inputs':<30} {inputs['compiler']}, target {inputs['target']}, LNC {inputs['lnc']}, "
            f"NEURON_CC_FLAGS {flags} (fingerprint {inputs['fingerprint']})"
        )
    remote = cache.get("remote")
    if remote:
        mode = "read-only" if remote["read_only"] else "read-write"
        missing = f"; needs `pip install {remote['missing_package']}`" if remote["missing_package"] else ""
        lines.append(f"  {'remote cache':<30} {remote['url']} ({mode}, entries under {remote['namespace']}{missing})")
    else:
        lines.append(f"  {'remote cache':<30} none (ACCELERATE_NEURON_REMOTE_CACHE shares compiles across a fleet)")
    if cache.get("simulator_build_cache"):
        lines.append(f"  {'simulator build cache':<30} {cache['simulator_build_cache']}")
    return lines


def _apply_pending_patches(progress: Progress) -> tuple[set[str], list[str]]:
    """Import the modules scheduled patches wait for, so the report shows applied/skipped, not pending.

    Returns (modules absent from this release, import failures).
    """
    from ..activation import state

    modules = sorted({patch.module for _plugin, patch in state().scheduled.values()} - set(sys.modules))
    absent, failed = set(), []
    if modules:
        with progress.step(f"checking {len(modules)} module(s) of transformers/accelerate against the patches"):
            for name in modules:
                try:
                    importlib.import_module(name)
                except ModuleNotFoundError as exc:
                    # A missing parent package (4.57 has continuous_batching but no cache_allocators) is absent too.
                    if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
                        absent.add(name)
                    else:
                        failed.append(f"{name}: {type(exc).__name__}: {exc}")
                except Exception as exc:
                    failed.append(f"{name}: {type(exc).__name__}: {exc}")
    return absent, failed


def _status(absent: set[str]) -> dict[str, Any]:
    """``status()`` as a dict, patches waiting for a module this release lacks marked as such."""
    import accelerate_neuron

    from ..activation import state

    status = accelerate_neuron.status().as_dict()
    module_of = {key: patch.module for key, (_plugin, patch) in state().scheduled.items()}
    for patch in status["patches"]:
        module = module_of.get(patch["key"])
        if patch["status"] == "pending" and module in absent:
            patch["status"] = "absent"
            patch["detail"] = f"{module} does not exist in this release: nothing to patch"
    return status


def _transformers_async_load() -> bool:
    """Whether the installed transformers loads asynchronously unless HF_DEACTIVATE_ASYNC_LOAD is set."""
    try:
        dist = importlib.metadata.distribution("transformers")
    except importlib.metadata.PackageNotFoundError:
        return False
    for relative in ("transformers/core_model_loading.py", "transformers/modeling_utils.py"):
        try:
            if "HF_DEACTIVATE_ASYNC_LOAD" in dist.locate_file(relative).read_text(encoding="utf-8"):
                return True
        except OSError:
            continue
    return False


def _config_file(explicit: str | None) -> dict[str, Any]:
    """The Accelerate config file this report reads: ``--config_file``, the block ``accelerate launch`` handed to
    this process, or the default file; its path, its ``neuron_config`` block and, if unreadable, why."""
    from .. import accelerate_config, settings

    if explicit is None and settings.config_origin():
        return {"path": settings.config_origin(), "handed_over": True, "neuron_config": None, "data": None}
    path = explicit
    if path is None:
        try:
            path = accelerate_config.default_file()
        except Exception:  # no accelerate: no config file
            return {"path": None}
        if not os.path.isfile(path):
            return {"path": None, "default": path}
    info: dict[str, Any] = {"path": path, "handed_over": False, "neuron_config": {}, "data": None}
    try:
        info["data"] = accelerate_config.load(path)
        info["neuron_config"] = accelerate_config.block_of(info["data"], path)
    except FileNotFoundError:
        info["error"] = f"{path} does not exist"
    except Exception as exc:  # a bad block or a broken file is a finding, not a crash
        info["error"] = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
    return info


def _launch_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """``num_processes`` / ``mixed_precision`` of the Accelerate config file, if there is one."""
    data = config.get("data")
    if not config.get("path") or config.get("handed_over"):
        return None
    if data is None:
        return {"source": config["path"], "error": config.get("error")}
    return {
        "source": config["path"],
        "num_processes": data.get("num_processes"),
        "mixed_precision": data.get("mixed_precision"),
    }


def collect(init: bool = True, progress: Progress | None = None, config_file: str | None = None) -> dict[str, Any]:
    """Every fact ``env`` reports, and the problems found in them (``config_file``: the Accelerate config file to
    read instead of the default one)."""
    from .. import device, settings

    progress = progress or Progress(False)
    kind = device.kind()
    probe = _probe_torch_neuronx(kind)
    absent, import_failures = _apply_pending_patches(progress)
    config = _config_file(config_file)
    if config.get("neuron_config") is not None and config.get("path"):
        with settings.config_layer(config["neuron_config"], config["path"]):
            rows = _plugin_settings()
    else:
        rows = _plugin_settings()
    facts: dict[str, Any] = {
        "versions": _versions(kind, probe),
        "torch_neuronx": probe,
        "device": _device(kind, init),
        "settings": _settings(),
        "config_file": {k: v for k, v in config.items() if k != "data"},
        "accelerate_neuron_settings": rows,
        "compile_cache": _cache(kind),
        "launch": _launch_config(config),
        "transformers_async_load": _transformers_async_load(),
        "status": _status(absent),
        "import_failures": import_failures,
    }
    facts["problems"] = _checks.find_problems(facts)
    return facts


# ------------------------------------------------------------------ text


def _device_lines(facts: dict[str, Any]) -> list[str]:
    dev = facts["device"]
    if dev["kind"] is None:
        return [
            "Neuron device      none: accelerate-neuron is inert here (nothing is patched)",
            "                   try `accelerate-neuron demo`, or `accelerate-neuron simulate -- python your_script.py`",
        ]
    what = "simulated (no Trainium; CPU memory stands in)" if dev["kind"] == "simulated" else "torch-neuronx"
    lines = [f"Neuron device      {what}, {dev['visible_cores']} visible core(s)"]
    totals = {c["total"] for c in dev["cores"]}
    if dev.get("error"):
        lines.append(f"  could not read core memory: {dev['error']}")
    elif len(totals) == 1 and not any(c["allocated"] for c in dev["cores"]):
        lines.append(f"  HBM per core     {size(totals.pop())} (runtime initialised to read it)")
    else:
        for core in dev["cores"]:
            lines.append(f"  core {core['index']:<3}        {size(core['total'])} total, {size(core['free'])} free")
    if not dev["cores"] and not dev.get("error"):
        lines.append("  HBM per core     not read (--no-init)")
    return lines


def _status_lines(status: dict[str, Any], verbose: bool) -> list[str]:
    lines = [f"accelerate-neuron  {'active' if status['active'] else 'inert: ' + status['inert_reason']}"]
    if status["plugins"]:
        lines.append("Plugins")
        for p in status["plugins"]:
            detail = f" - {p['detail']}" if p["detail"] else ""
            lines.append(f"  [{'on ' if p['active'] else 'off'}] {p['name']:<12} {p['kind']}{detail}")
    if not status["patches"]:
        return lines
    counts: dict[str, Counter[str]] = {}
    for p in status["patches"]:
        counts.setdefault(p["plugin"], Counter())[p["status"]] += 1
    lines.append(f"Patches ({sum(c['applied'] for c in counts.values())} applied of {len(status['patches'])})")
    for plugin, c in counts.items():
        order = sorted(c, key=lambda state: (_STATE_ORDER.index(state) if state in _STATE_ORDER else 99, state))
        lines.append(f"  {plugin:<12} " + ", ".join(f"{c[state]} {state}" for state in order))
    for p in status["patches"]:
        if verbose or _needs_attention(p):
            lines.append(f"  {p['status']:<8} {p['target']}  [{p['plugin']}]")
            why = p.get("detail") if p["status"] != "applied" else p.get("reason")
            if why:
                lines.append(f"           {why}")
    if not verbose:
        lines.append("  (-v lists every patch: why each applies, or why upstream did not need it)")
    return lines


def _needs_attention(patch: dict[str, Any]) -> bool:
    """A patch that failed, rather than one upstream did not need or a release does not have."""
    detail = str(patch.get("detail", ""))
    return patch["status"] not in ("applied", "skipped", "absent") or detail.startswith(_checks.FAILURE_DETAILS)


def render(facts: dict[str, Any], verbose: bool = False) -> str:
    v = facts["versions"]
    lines = [f"accelerate-neuron {v['accelerate-neuron']} environment", "", "Versions"]
    for name, value in v.items():
        if value is not None or name in ("torch-neuronx", "transformers", "accelerate"):
            lines.append(f"  {name:<18} {value or 'not installed'}")
    lines += ["", *_device_lines(facts), "", "Settings"]
    for name, value in facts["settings"].items():
        lines.append(f"  {name:<30} {value if value is not None else KEY_SETTINGS.get(name, 'unset')}")
    chosen = [s for s in facts["accelerate_neuron_settings"] if s["source"] != "default" or s["error"]]
    lines += ["", "accelerate-neuron settings" + ("" if chosen else ": all at their defaults (-v lists them)")]
    lines.append(f"  {'Accelerate config file':<42} {_config_line(facts['config_file'])}")
    for s in facts["accelerate_neuron_settings"]:
        if s in chosen or verbose:
            where = f"{s['source']}, invalid" if s["error"] else s["source"]
            shown = s["default"].replace("`", "") if s["source"] == "default" and not s["error"] else _shown(s["value"])
            lines.append(f"  {s['variable']:<42} {shown} ({where})")
    lines += ["", *_cache_lines(facts["compile_cache"])]
    lines += ["", *_status_lines(facts["status"], verbose)]
    for failure in facts["import_failures"]:
        lines.append(f"  could not import {failure}")
    problems = facts["problems"]
    lines.append("")
    if not problems:
        lines.append("No misconfiguration found.")
    else:
        lines.append(f"Problems ({len(problems)})")
        for p in problems:
            lines.append(f"  {p['severity'].upper()}: {p['problem']}")
            lines.append(f"    fix: {p['fix']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    facts = collect(init=not args.no_init, progress=Progress(enabled=True), config_file=args.config_file)
    if args.json:
        print_json(facts)
    else:
        print(render(facts, verbose=args.verbose))
    return 1 if any(p["severity"] == "error" for p in facts["problems"]) else 0
