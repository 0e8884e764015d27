"""Graphs per step: how many compiled graphs one call of a ``torch.compile``'d function launches.

On Neuron every graph a step launches is a NEFF launch and, between two graphs, a
device->host->device hop: a step split by graph breaks pays them on every call,
long after the compiles are done. Here a *step* is one outermost call of a
function ``torch.compile`` returned (a compiled model's forward, generate()'s
compiled forward, continuous batching's step); the backward graphs a training
step launches after its forward returned (from the autograd engine's thread)
count for the step that ran the forward. Steps are grouped by their compiled
function and by the first graph they launch (one group per step shape: the
prefill and the decode step of generate() are two groups, each bucket another),
and each group keeps how many graphs its steps launched.

Every graph break Dynamo meets is noted too, with the upstream file and line
where it happened and Dynamo's reason, for the compiled function being traced:
some breaks leave no graph of their own to show them (a checkpointed layer that
falls back to eager, a hook that runs between two graphs).

The compiled function is seen by wrapping what ``torch._dynamo``'s compile
context returns, the breaks by wrapping its ``log_graph_break`` (private APIs:
without them, steps and breaks are simply not reported).
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
import threading
from collections import Counter
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: Pieces remembered per group (the functions of its latest step's graphs).
MAX_PIECES = 24
#: Groups kept (compiled function x step shape); later ones are counted together.
MAX_GROUPS = 200

_lock = threading.Lock()
_local = threading.local()
_groups: dict[tuple[str, str], dict[str, Any]] = {}
#: (compiled function or "", "file:line", reason) -> breaks met while tracing it.
_breaks: Counter[tuple[str, str, str]] = Counter()
MAX_BREAKS = 100
_last: _Step | None = None
_installed = False


class _Step:
    __slots__ = ("entry", "launches")

    def __init__(self, entry: str) -> None:
        self.entry = entry
        self.launches: list[tuple[int, str]] = []  # (graph record index, compile id)


def _label(fn: Any) -> str:
    """``Qwen3ForCausalLM`` for a compiled module, ``_forward_process_and_sample (x/model_runner.py:181)`` else."""
    import torch

    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        return f"{type(owner).__name__} (compiled module)"
    target = inspect.unwrap(fn)
    code = getattr(target, "__code__", None)
    name = getattr(target, "__name__", None) or type(target).__name__
    if code is None:
        return str(name)
    path = Path(code.co_filename)
    return f"{name} ({'/'.join(path.parts[-2:])}:{code.co_firstlineno})"


def _finish(step: _Step) -> None:
    if not step.launches:
        return
    shape = step.launches[0][1]
    with _lock:
        key = (step.entry, shape)
        if key not in _groups and len(_groups) >= MAX_GROUPS:
            key = (step.entry, "other")
        group = _groups.setdefault(key, {"steps": 0, "graphs": Counter(), "pieces": []})
        group["steps"] += 1
        group["graphs"][len(step.launches)] += 1
        group["pieces"] = [index for index, _ in step.launches[:MAX_PIECES]]


def _enter(entry: str) -> tuple[bool, _Step | None]:
    global _last
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    if depth:
        return False, None
    previous = getattr(_local, "step", None)
    if previous is not None:
        _finish(previous)
    step = _Step(entry)
    _local.step = step
    with _lock:
        _last = step
    return True, step


def _exit() -> None:
    _local.depth = getattr(_local, "depth", 1) - 1


def note_launch(index: int, compile_id: str | None, kind: str) -> None:
    """A compiled graph ran: count it for the step running on this thread (a backward: the latest step)."""
    step = getattr(_local, "step", None) if getattr(_local, "depth", 0) else None
    if step is None and kind == "backward":
        step = _last
    if step is not None:
        step.launches.append((index, compile_id or "?"))


def _reason(exc: Any, reason: str) -> str:
    kind = getattr(exc, "gb_type", None)
    text = str(kind) if kind else (str(reason) or str(exc))
    return " ".join(text.split())[:200]


def note_break(location: str, reason: str) -> None:
    """Dynamo had to break the graph at ``location`` (``file:line``) for ``reason``."""
    step = getattr(_local, "step", None) if getattr(_local, "depth", 0) else None
    key = (step.entry if step is not None else "", location, reason)
    with _lock:
        if key in _breaks or len(_breaks) < MAX_BREAKS:
            _breaks[key] += 1


def wrap_log_graph_break(original: Any) -> Any:
    @functools.wraps(original)
    def log_graph_break(self: Any, code_options: Any, reason: str, exc: Any) -> Any:
        if not getattr(exc, "logged", False):
            try:
                stack = getattr(exc, "real_stack", None)
                if stack is None:
                    import torch

                    stack = torch._guards.TracingContext.extract_stack()
                if stack:
                    location = f"{stack[-1].filename}:{stack[-1].lineno}"
                else:
                    location = f"{code_options['co_filename']}:{code_options['co_firstlineno']}"
                note_break(location, _reason(exc, reason))
            except Exception:  # the count is a report; the compile goes on whatever happens here
                pass
        return original(self, code_options, reason, exc)

    return log_graph_break


def wrap_context_call(original: Any) -> Any:
    @functools.wraps(original)
    def __call__(self: Any, fn: Any) -> Any:
        compiled = original(self, fn)
        if not inspect.isfunction(compiled) or compiled is fn:
            return compiled
        try:
            entry = _label(fn)
        except Exception:
            entry = "?"

        @functools.wraps(compiled)
        def step(*args: Any, **kwargs: Any) -> Any:
            _enter(entry)
            try:
                return compiled(*args, **kwargs)
            finally:
                _exit()

        return step

    return __call__


def install(_module: object = None) -> None:
    """Count steps of every function ``torch.compile`` returns from now on (once per process)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    try:
        from torch._dynamo import eval_frame

        context = eval_frame._TorchDynamoContext
        context.__call__ = wrap_context_call(context.__call__)
    except Exception as exc:  # a private API: the report then goes without graphs per step
        logger.debug("accelerate_neuron: graphs per step unavailable (%s)", exc)
    try:
        from torch._dynamo import symbolic_convert

        translator = symbolic_convert.InstructionTranslatorBase
        translator.log_graph_break = wrap_log_graph_break(translator.log_graph_break)
    except Exception as exc:
        logger.debug("accelerate_neuron: graph break locations unavailable (%s)", exc)


def breaks() -> list[dict[str, Any]]:
    """Every graph break met so far: the compiled function traced, where, why, how many times."""
    with _lock:
        found = list(_breaks.items())
    return [
        {"function": entry or None, "where": where, "reason": reason, "count": n}
        for (entry, where, reason), n in sorted(found, key=lambda kv: -kv[1])
    ]


def records(graphs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (compiled function, step shape): steps run and graphs each launched."""
    open_steps = [s for s in {id(s): s for s in (getattr(_local, "step", None), _last) if s is not None}.values()]
    with _lock:
        groups = {k: {**v, "graphs": Counter(v["graphs"])} for k, v in _groups.items()}
    for step in open_steps:  # the latest step still open: count it as it stands
        if step.launches:
            key = (step.entry, step.launches[0][1])
            group = groups.setdefault(key, {"steps": 0, "graphs": Counter(), "pieces": []})
            group["steps"] += 1
            group["graphs"][len(step.launches)] += 1
            group["pieces"] = [i for i, _ in step.launches[:MAX_PIECES]]
    out = []
    for (entry, shape), group in groups.items():
        counts = group["graphs"]
        typical = counts.most_common(1)[0][0] if counts else 0
        out.append(
            {
                "function": entry,
                "first_graph": shape,
                "steps": group["steps"],
                "graphs_per_step": typical,
                "max_graphs_per_step": max(counts) if counts else 0,
                "pieces": [_piece(graphs, i) for i in group["pieces"]],
            }
        )
    return sorted(out, key=lambda r: (r["function"], -r["steps"]))


_TOKENS = re.compile(r"(?:^|\['|\.)(?:decoder_)?input_ids(?:'\])?$")


def _tokens(record: dict[str, Any]) -> int | None:
    """The sequence length of the graph's token input (1: a decode step), if it has one."""
    for item in record.get("dynamo_inputs", []):
        shape = item.get("shape") or []
        if _TOKENS.search(str(item.get("name"))) and len(shape) >= 2 and isinstance(shape[-1], int):
            return shape[-1]
    return None


def _piece(graphs: list[dict[str, Any]], index: int) -> dict[str, Any]:
    record = graphs[index] if 0 <= index < len(graphs) else {}
    frame = record.get("frame") or {}
    return {
        "tokens": _tokens(record),
        "kind": record.get("kind"),
        "compile_id": record.get("compile_id"),
        "function": frame.get("function"),
        "file": frame.get("file"),
        "line": frame.get("line"),
        "graph_break": frame.get("graph_break"),
    }


def reset() -> None:
    global _last
    with _lock:
        _groups.clear()
        _breaks.clear()
        _last = None
    _local.__dict__.pop("step", None)
