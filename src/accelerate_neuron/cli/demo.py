"""``accelerate-neuron demo``: the main job, stock Hugging Face calls, on Trainium or the simulated device.

What runs is exactly what a user's script would do::

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, device_map="auto")
    inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
    output = model.generate(**inputs, max_new_tokens=n, do_sample=False)

and then it reports what actually happened: where the weights are, the text,
tokens/s and what was compiled. Nothing is faked: if the model stayed on the
CPU, the report says so.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path
from typing import Any

from .. import backend_metrics, costs
from ._common import (
    CliError,
    Progress,
    add_device_options,
    add_json_option,
    duration,
    plural,
    positive_int,
    print_json,
    size,
)
from ._render import cache_line, placement_lines

DEFAULT_PROMPT = "the neuron core"
DEFAULT_NEW_TOKENS = 16
#: One simulated core: the toy model fits, and the demo stays quick. --cores 4 models a whole
#: trn2 chip (LNC=2); "auto" keeps a model that fits on one core there, "balanced" spreads it.
DEFAULT_CORES = 1
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")

DESCRIPTION = """\
Load a small causal LM with from_pretrained(device_map="auto"), generate from
a prompt with model.generate(), and print where the weights landed, the text,
tokens/s and the compile figures. On a Trainium host it runs on the Neuron
cores; anywhere else on the simulated Neuron device (and says so).

Without --model it uses an embedded toy Qwen3 (built offline on the first run,
then cached); --model takes a local folder or a Hub model id (downloaded once
when the Hub is reachable, then read from the Hub cache). The first run on a machine also builds the simulated device (a
small C++ library, once per torch version). Progress goes to stderr."""

EPILOG = """\
examples:
  accelerate-neuron demo
  accelerate-neuron demo --prompt "a static cache" --max-new-tokens 16
  accelerate-neuron demo --model ./my-local-llm --json
  accelerate-neuron demo --model Qwen/Qwen3-0.6B --cores 4"""


#: What a causal LM and its tokenizer need from a Hub repository (not the other weight formats it may also hold).
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "tokenizer*"]


def _model(text: str) -> Path | str:
    """argparse type of ``--model``: a local folder written by ``save_pretrained()``, or a Hub model id."""
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise argparse.ArgumentTypeError(
                f"{text!r} has no config.json; expected a folder written by save_pretrained(), or a Hub model id"
            )
        return path
    if not text.startswith((".", "/", "~")) and _is_hub_id(text):
        return text  # fetched (or found in the Hub cache) when the demo runs
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a folder; expected a local model folder with config.json, or a Hub model id such as "
        "'Qwen/Qwen3-0.6B'"
    )


def _is_hub_id(text: str) -> bool:
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(text)
    except ValueError:  # HFValidationError
        return False
    return True


def _from_hub(repo_id: str, progress: Progress) -> Path:
    """The local folder of Hub model ``repo_id``: downloaded (Hub progress bars, which HF_HUB_DISABLE_PROGRESS_BARS
    turns off) or taken from the Hub cache; a clear error when neither can be."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    offline = bool(constants.HF_HUB_OFFLINE)
    where = "the local Hugging Face cache (HF_HUB_OFFLINE is set)" if offline else "the Hugging Face Hub"
    with progress.step(f"fetching {repo_id} from {where}"):
        try:
            folder = Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=offline))
        except GatedRepoError as exc:
            raise CliError(
                f"{repo_id!r} is gated on the Hugging Face Hub: accept its terms, then `hf auth login`"
            ) from exc
        except RepositoryNotFoundError as exc:
            raise CliError(
                f"{repo_id!r} is not a model on the Hugging Face Hub (or it is private: `hf auth login`)"
            ) from exc
        except LocalEntryNotFoundError as exc:
            why = "HF_HUB_OFFLINE is set" if offline else f"the Hub cannot be reached ({exc.__cause__ or exc})"
            raise CliError(
                f"{repo_id!r} is not in the local Hugging Face cache and {why}: run once where the Hub is reachable, "
                "or pass a local folder written by save_pretrained()"
            ) from exc
    if not (folder / "config.json").is_file():
        raise CliError(f"{repo_id!r} on the Hugging Face Hub has no config.json: not a Transformers model")
    return folder


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="start here: load a small LM with device_map='auto' and generate (Trainium or simulated)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        type=_model,
        metavar="PATH|ID",
        help="a local model folder, or a Hub model id when the Hub is reachable (default: the toy model)",
    )
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"the prompt (default {DEFAULT_PROMPT!r})")
    p.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=DEFAULT_NEW_TOKENS,
        metavar="N",
        help=f"tokens to generate (default {DEFAULT_NEW_TOKENS})",
    )
    p.add_argument(
        "--device-map",
        choices=DEVICE_MAPS,
        default="auto",
        help="the device_map strategy given to from_pretrained (default auto: the fewest cores that hold "
        "the model; balanced: spread over every core)",
    )
    add_device_options(p, cores=DEFAULT_CORES, cores_help="simulated cores without Trainium (4 = one trn2 chip)")
    add_json_option(p, "the result")
    p.set_defaults(run=run, parser=p)


def _device(args: argparse.Namespace, progress: Progress) -> str:
    """``"real"`` or ``"simulated"``: Trainium if present, else the simulator (installed here if needed)."""
    from .. import device, simulator

    kind = device.kind()
    if kind == "real":
        progress.note(f"running on Trainium: {device.device_count()} Neuron core(s)")
        return kind
    if kind == "simulated":
        progress.note("no Trainium here: using the simulated Neuron device from ACCELERATE_NEURON_SIMULATE")
        return kind
    with progress.step(
        f"no Trainium here: starting a simulated Neuron device ({plural(args.cores, 'core')} x {args.hbm})"
    ):
        try:
            simulator.install(cores=args.cores, hbm=args.hbm)
        except Exception as exc:
            raise CliError(f"cannot start the simulated Neuron device: {exc}") from exc
    return "simulated"


class _Counters:
    """What the device paid since the last reset: the backend's own metrics and Dynamo's graphs on any device,
    and the simulator's counters on the simulated one."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._dynamo = 0
        self._backend = backend_metrics.Snapshot()

    def reset(self) -> None:
        if self.kind == "simulated":
            from .. import simulator

            simulator.reset_stats()
        self._dynamo = self._dynamo_graphs()
        self._backend = backend_metrics.snapshot()

    @staticmethod
    def _dynamo_graphs() -> int:
        try:
            from torch._dynamo.utils import counters

            return int(counters["stats"]["unique_graphs"])
        except Exception:
            return 0

    def read(self) -> dict[str, Any]:
        """Cumulative since :meth:`reset` (eager signatures as a set: a repeat is not a new compile)."""
        out: dict[str, Any] = {
            "dynamo_graphs": self._dynamo_graphs() - self._dynamo,
            "backend": backend_metrics.since(backend_metrics.snapshot(), self._backend),
        }
        if self.kind == "simulated":
            from .. import simulator

            st = simulator.stats()
            keys = ("compiles", "compile_cache_hits", "eager_signatures", "eager_compiles", "eager_cache_hits")
            out.update({k: st[k] for k in (*keys, "h2d_bytes", "d2h_bytes", "d2d_bytes")})
            out["signatures"] = set(st["eager_signature_list"])
        return out


def _delta(later: dict[str, Any], earlier: dict[str, Any]) -> dict[str, Any]:
    """What the second generate() added on top of the first."""
    out = {k: later[k] - earlier[k] for k in later if k not in ("signatures", "backend")}
    if "signatures" in later:
        out["eager_signatures"] = len(later["signatures"] - earlier["signatures"])
    out["backend"] = backend_metrics.since(later["backend"], earlier["backend"]).as_dict()
    return out


def _public(counts: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in counts.items() if k not in ("signatures", "backend")}
    out["backend"] = counts["backend"].as_dict()
    return out


def _generate(model: Any, inputs: Any, n: int) -> tuple[Any, float]:
    started = time.perf_counter()
    output = model.generate(**inputs, max_new_tokens=n, do_sample=False)
    return output, time.perf_counter() - started


def _run_job(args: argparse.Namespace, kind: str, path: Path, progress: Progress) -> dict[str, Any]:
    from ..simulator.report import summarize_module

    with progress.step("importing transformers"):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our step lines say what is happening
    counters = _Counters(kind)
    counters.reset()
    with progress.step(f'loading {path.name} with from_pretrained(device_map="{args.device_map}")'):
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, device_map=args.device_map)
    load = counters.read()
    placement = summarize_module(model)
    inputs = tokenizer(args.prompt, return_tensors="pt").to(model.device)
    prompt_tokens = int(inputs["input_ids"].shape[-1])
    counters.reset()
    with progress.step(f"generating {args.max_new_tokens} tokens (first call: compiles)"):
        output, first_seconds = _generate(model, inputs, args.max_new_tokens)
    first = counters.read()
    with progress.step(f"generating {args.max_new_tokens} tokens again (what was compiled is reused)"):
        output, seconds = _generate(model, inputs, args.max_new_tokens)
    second = _delta(counters.read(), first)
    new_tokens = int(output.shape[-1]) - prompt_tokens
    return {
        "model": type(model).__name__,
        "model_path": str(path),
        "device_map": args.device_map,
        "parameters": placement["parameters"],
        "model_device": str(model.device),
        "hf_device_map": {k: str(v) for k, v in (getattr(model, "hf_device_map", None) or {}).items()},
        "placement": placement,
        "prompt": args.prompt,
        "prompt_tokens": prompt_tokens,
        "text": tokenizer.decode(output[0], skip_special_tokens=True),
        "output_device": str(output.device),
        "new_tokens": new_tokens,
        "first_generate_seconds": first_seconds,
        "generate_seconds": seconds,
        "tokens_per_second": new_tokens / seconds if seconds > 0 else None,
        "load": _public(load),
        "first_generate": _public(first),
        "second_generate": second,
    }


def _applied_patches() -> list[dict[str, str]]:
    import accelerate_neuron

    return [{"target": p["target"], "plugin": p["plugin"]} for p in accelerate_neuron.status().applied()]


def _backend_lines(first: dict[str, Any], second: dict[str, Any]) -> list[str]:
    """What the backend itself reported for each generate() call (its compile metrics, cache counters, fallbacks)."""
    if not first["sources"]:
        return ["backend     reports no metrics of its own (no get_dynamo_metrics / torch_neuronx.metrics here)"]

    def call(figures: dict[str, Any]) -> str:
        parts = []
        if figures["graphs_compiled"] is not None:
            seconds = f", {figures['compile_seconds']:.1f} s compiling" if figures["compile_seconds"] else ""
            parts.append(f"{plural(figures['graphs_compiled'], 'graph')}{seconds}")
        cache = figures["cache"]
        if cache is not None:
            parts.append(
                f"NEFF cache {cache.get('compilations', 0)} compiled / "
                f"{cache.get('persistent_hits', 0) + cache.get('in_memory_hits', 0)} loaded"
            )
        if figures["cpu_fallbacks"] is not None:
            ops = ", ".join(f"{op} x{n}" for op, n in figures["cpu_fallbacks"].items())
            parts.append(f"CPU fallbacks: {ops or 'none'}")
        return "; ".join(parts) or "nothing reported"

    where = ", ".join(dict.fromkeys(first["sources"].values()))
    return [
        f"backend     as the backend reports it ({where}):",
        f"            first call: {call(first)}",
        f"            second call: {call(second)}",
    ]


def _render(result: dict[str, Any]) -> str:
    if result["device"] == "simulated":
        where = (
            f"a simulated Neuron device ({plural(result['cores'], 'core')} x {size(result['hbm_per_core'])}; "
            "no Trainium found, the CPU stands in)"
        )
    else:
        where = f"Trainium ({result['cores']} Neuron cores)"
    lines = [f"accelerate-neuron demo on {where}", ""]
    lines.append(f"model       {result['model']}, {result['parameters']:,} parameters, from {result['model_path']}")
    on_neuron = any(d.startswith("neuron") for d in result["placement"]["bytes"])
    strategy = result["device_map"]
    verdict = "" if on_neuron else f"  (nothing landed on Neuron: device_map={strategy!r} kept every weight on the CPU)"
    lines.append(f'placement   from_pretrained(device_map="{strategy}") put the weights on:{verdict}')
    lines.extend(placement_lines(result["placement"], indent="    "))
    lines.append(f"prompt      {result['prompt']!r}")
    lines.append(f"output      {result['text']!r}")
    speed = result["tokens_per_second"]
    lines.append(
        f"speed       {result['new_tokens']} new tokens in {result['generate_seconds']:.2f} s = {speed:.1f} tokens/s "
        f"(second call; the first took {result['first_generate_seconds']:.2f} s)"
    )
    if result["device"] == "simulated":
        lines.append("            simulated device: this is CPU speed, not Trainium's")
    first, second = result["first_generate"], result["second_generate"]
    if result["device"] == "simulated":
        lines.append(
            f'compiles    first call: {plural(first["compiles"], "graph")} compiled with the "neuron" backend, '
            f"{first['compile_cache_hits']} loaded from the NEFF cache; "
            f"{plural(first['eager_compiles'], 'eager op signature')} compiled, {first['eager_cache_hits']} loaded"
        )
        lines.append(
            f"            second call: {second['compiles']} new graph(s), {second['eager_signatures']} new signature(s)"
        )
        est = result["estimate"]
        lines.append(f"            on Trainium: ~{duration(est['seconds'])} of compiling ({costs.describe(est)})")
        again = "" if est["saved_seconds"] else "; run the demo again for a warm start"
        lines.append(
            f"            cold cache ~{duration(est['cold_seconds'])}: the NEFF cache saved "
            f"~{duration(est['saved_seconds'])} ({cache_line(result['compile_cache'])}{again})"
        )
        lines.append(
            f"transfers   load: host->device {size(result['load']['h2d_bytes'])}; first generate: host->device "
            f"{size(first['h2d_bytes'])}, device->host {size(first['d2h_bytes'])}"
        )
    else:
        lines.append(
            f"compiles    first call: {first['dynamo_graphs']} Dynamo graph(s); second call: {second['dynamo_graphs']}"
        )
    lines.extend(_backend_lines(first["backend"], second["backend"]))
    per_plugin = Counter(p["plugin"] for p in result["patches_applied"])
    detail = ", ".join(f"{plugin} {n}" for plugin, n in per_plugin.items())
    lines.append(
        f"patches     {sum(per_plugin.values())} applied ({detail or 'none'}); `accelerate-neuron env -v` lists them"
    )
    if result["device"] == "simulated":
        hints = ["accelerate-neuron simulate -- python your_script.py   (dry-run your own script)"]
        if result["cores"] == 1:
            hints.insert(0, "accelerate-neuron demo --cores 4 --device-map balanced   (spread over a whole trn2 chip)")
        lines += ["", f"next        {hints[0]}", *(f"            {hint}" for hint in hints[1:])]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from .. import device
    from . import _demo_model

    progress = Progress(enabled=True)
    hub = _from_hub(args.model, progress) if isinstance(args.model, str) else None  # fail before the device starts
    kind = _device(args, progress)
    path = hub or args.model or _demo_model.ensure(progress)
    result = {"device": kind, "cores": device.device_count()}
    if kind == "simulated":
        from ..simulator.runtime import state

        result["hbm_per_core"] = state().hbm_bytes
    result.update(_run_job(args, kind, path, progress))
    if kind == "simulated":
        from .. import simulator

        first = result["first_generate"]
        result["estimate"] = costs.estimate(
            first["compiles"],
            first["eager_compiles"],
            cached_graphs=first["compile_cache_hits"],
            cached_signatures=first["eager_cache_hits"],
        )
        result["compile_cache"] = simulator.stats()["compile_cache"]
    result["patches_applied"] = _applied_patches()
    if args.json:
        print_json(result)
    else:
        print(_render(result))
    return 0
