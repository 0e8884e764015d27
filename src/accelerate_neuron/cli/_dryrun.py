"""Turn the per-process records of a simulated run into one dry-run report (a plain dict).

Each process of the run wrote ``process-<pid>.json``
(:mod:`accelerate_neuron.simulator.report`). Here they are merged: where the
models landed, memory per physical core, compiled graphs (and which the NEFF
cache supplied), recompile causes, eager signatures, transfers, the ops that
ran on the CPU, what the backend's own metrics say, and the compile-time
estimate, cold and with the cache the run found.
"""

from __future__ import annotations

import itertools
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

from .. import costs

#: How many entries of each list the report keeps.
TOP_CAUSES = 5
TOP_OPS = 5
MAX_GRAPHS_LISTED = 20

_DTYPES = {
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "float64": "f64",
    "int64": "i64",
    "int32": "i32",
    "int16": "i16",
    "int8": "i8",
    "uint8": "u8",
    "bool": "b8",
}
_WEIGHT = re.compile(r"\._(parameters|buffers)\[")


def load_records(directory: Path) -> list[dict[str, Any]]:
    """The records the run's processes wrote (unreadable ones are skipped)."""
    records = []
    for path in sorted(directory.glob("process-*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return records


def used_device(record: dict[str, Any]) -> bool:
    """Whether a process touched the device (a launcher parent does not)."""
    st = record.get("stats", {})
    return bool(
        st.get("initialized")
        or st.get("compiles")
        or st.get("eager_ops")
        or st.get("h2d_bytes")
        or any(int(v) for v in st.get("max_memory_allocated", {}).values())
    )


def describe_tensor(desc: dict[str, Any]) -> str:
    """``{"shape": [2, 4], "dtype": "float32"}`` -> ``f32[2,4]``; a symbolic int -> its value."""
    if "shape" in desc:
        dtype = _DTYPES.get(str(desc.get("dtype")), str(desc.get("dtype")))
        return f"{dtype}[{','.join(str(s) for s in desc['shape'])}]"
    if "value" in desc:
        return f"int {desc['value']}"
    return str(desc.get("type", "?"))


def _physical(record: dict[str, Any], device: str) -> str:
    """``neuron:0`` seen by a process with NEURON_RT_VISIBLE_CORES=3 -> ``core 3``."""
    match = re.fullmatch(r"neuron:(\d+)", device)
    if not match:
        return device
    visible = record.get("stats", {}).get("visible_cores") or []
    index = int(match.group(1))
    return f"core {visible[index]}" if index < len(visible) else f"core ?{index}"


def _process_label(record: dict[str, Any]) -> str:
    return f"rank {record['rank']}" if record.get("rank") is not None else f"pid {record.get('pid')}"


def _placement(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for record in records:
        for model in record.get("models", []):
            out.append(
                {
                    "process": _process_label(record),
                    "model": model["model"],
                    "parameters": model.get("parameters", 0),
                    "alive_at_exit": model.get("alive_at_exit", False),
                    "bytes": {_physical(record, d): n for d, n in model.get("bytes", {}).items()},
                    "placement": [[p, _physical(record, d)] for p, d in model.get("placement", [])],
                    "placement_truncated": model.get("placement_truncated", 0),
                }
            )
    return out


def _memory(records: list[dict[str, Any]], hbm: int) -> dict[str, Any]:
    peak: dict[int, int] = {}
    at_exit: dict[int, int] = {}
    users: dict[int, list[str]] = {}
    for record in records:
        st = record.get("stats", {})
        visible = st.get("visible_cores") or []
        for index_text, value in st.get("max_memory_allocated", {}).items():
            index = int(index_text)
            if index >= len(visible) or not int(value):
                continue
            core = int(visible[index])
            peak[core] = peak.get(core, 0) + int(value)
            at_exit[core] = at_exit.get(core, 0) + int(st.get("memory_allocated", {}).get(index_text, 0))
            users.setdefault(core, []).append(_process_label(record))
    cores = sorted(peak)
    return {
        "hbm_per_core": hbm,
        "peak_per_core": {str(c): peak[c] for c in cores},
        "at_exit_per_core": {str(c): at_exit[c] for c in cores},
        "processes_per_core": {str(c): users[c] for c in cores},
        "shared_cores": [c for c in cores if len(users[c]) > 1],
        "over_budget_cores": [c for c in cores if peak[c] > hbm],
    }


def _dynamo_graphs(graphs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per Dynamo graph (its AOT forward/backward records share the inputs)."""
    by_index: dict[Any, dict[str, Any]] = {}
    for g in graphs:
        entry = by_index.setdefault(
            g.get("dynamo_graph"),
            {
                "compile_id": g.get("compile_id"),
                "inputs": g.get("dynamo_inputs", []),
                "function": function_label(g.get("frame")),
                "frame_info": g.get("frame"),
                "kinds": [],
            },
        )
        entry["kinds"].append(g.get("kind"))
    return list(by_index.values())


def function_label(frame: dict[str, Any] | None) -> str | None:
    """``new_forward (accelerate/hooks.py:186)``: the Python function a Dynamo frame compiled."""
    if not frame:
        return None
    path = Path(str(frame.get("file", "?")))
    short = "/".join(path.parts[-2:]) if len(path.parts) > 1 else str(path)
    return f"{frame.get('function')} ({short}:{frame.get('line')})"


def _frame(compile_id: str | None) -> tuple[str, int]:
    """``"0/2"`` -> (``"0"``, 2); ``"!1/0/3"`` (compiled autograd) -> (``"!1/0"``, 3)."""
    if not compile_id or "/" not in compile_id:
        return (compile_id or "?", 0)
    frame, _, attempt = compile_id.rpartition("/")
    return frame, int(attempt) if attempt.isdigit() else 0


def _changes(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(input name, old, new) for every input whose shape, dtype or value differs, or that came or went."""

    def table(inputs: list[dict[str, Any]]) -> dict[str, str]:
        # Symbolic sizes (``x.size()[0]``) follow the tensor they come from.
        return {i["name"]: describe_tensor(i) for i in inputs if ".size()" not in str(i.get("name"))}

    old, new = table(before), table(after)
    changed = [(n, old[n], new[n]) for n in new if n in old and old[n] != new[n]]
    changed += [(n, "absent", new[n]) for n in new if n not in old]
    changed += [(n, old[n], "absent") for n in old if n not in new]
    return changed


_INDEX = re.compile(r"\d+")
# The token input of a generate() forward: its sequence length tells the prefill from the decode step.
_TOKENS = re.compile(r"(?:^|\['|\.)(?:decoder_)?input_ids(?:'\])?$")
_DIMS = re.compile(r"\[([\d,]*)\]$")


def _sequence_length(described: str) -> int | None:
    match = _DIMS.search(described)
    dims = match.group(1).split(",") if match and match.group(1) else []
    return int(dims[-1]) if len(dims) >= 2 else None


def _prefill_then_decode(changes: list[tuple[str, str, str]]) -> bool:
    """The frame compiled once for a prompt and once for one new token: generate()'s two graphs, by design."""
    for name, old, new in changes:
        if _TOKENS.search(name):
            before, after = _sequence_length(old), _sequence_length(new)
            return before is not None and before > 1 and after == 1
    return False


def _classify(changes: list[tuple[str, str, str]]) -> str:
    """Why a frame compiled again.

    ``module``: the same code ran for a module with other weights (one graph per module, e.g. a hook
    around every layer); ``shape``: same inputs, new shapes; ``object``: the same code entered for
    another object (``layers[0]`` -> ``layers[1]``); ``inputs``: other inputs; ``guard``: no input changed;
    ``decode``: the shapes changed from a prompt's to one token's (the prefill, then the decode step).
    """
    if not changes:
        return "guard"
    if any(_WEIGHT.search(name) for name, _, _ in changes):
        return "module"
    if all("absent" not in (old, new) for _, old, new in changes):
        return "decode" if _prefill_then_decode(changes) else "shape"
    gone = sorted(_INDEX.sub("#", n) for n, _, new in changes if new == "absent")
    came = sorted(_INDEX.sub("#", n) for n, old, _ in changes if old == "absent")
    if gone and gone == came and all("absent" in (old, new) for _, old, new in changes):
        return "object"
    return "inputs"


def recompile_causes(graphs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What changed between successive compiles of the same Dynamo frame, most frequent first."""
    frames: dict[str, list[tuple[int, list[dict[str, Any]]]]] = {}
    functions: dict[str, str | None] = {}
    for entry in _dynamo_graphs(graphs):
        frame, attempt = _frame(entry["compile_id"])
        frames.setdefault(frame, []).append((attempt, entry["inputs"]))
        functions.setdefault(frame, entry["function"])
    causes: dict[tuple[Any, ...], dict[str, Any]] = {}
    for frame, attempts in frames.items():
        attempts.sort(key=lambda a: a[0])
        for (_, before), (_, after) in itertools.pairwise(attempts):
            changes = _changes(before, after)
            kind = _classify(changes)
            # A shape change is told apart by input; other kinds are one cause per frame.
            names = sorted({n for n, _, _ in changes}) if kind in ("shape", "decode") else []
            cause = causes.setdefault(
                (frame, kind, tuple(names)),
                {
                    "frame": frame,
                    "function": functions.get(frame),
                    "kind": kind,
                    "recompiles": 0,
                    "compiles_of_frame": len(attempts),
                    "inputs": [n for n, _, _ in changes],
                    "values": {},
                },
            )
            cause["recompiles"] += 1
            for name, old, new in changes:
                seq = cause["values"].setdefault(name, [])
                for value in (old, new):
                    if not seq or seq[-1] != value:
                        seq.append(value)
    ranked = sorted(causes.values(), key=lambda c: (-c["recompiles"], c["frame"]))
    for cause in ranked:
        for name, seq in cause["values"].items():
            if len(seq) > 8:
                cause["values"][name] = [*seq[:4], "...", *seq[-3:]]
    return ranked


def _merge_causes(per_process: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for causes in per_process:
        for cause in causes:
            key = (cause["frame"], cause["kind"], json.dumps(cause["values"], sort_keys=True))
            if key in merged:
                merged[key]["processes"] += 1
                merged[key]["recompiles"] = max(merged[key]["recompiles"], cause["recompiles"])
            else:
                merged[key] = {**cause, "processes": 1}
    return sorted(merged.values(), key=lambda c: (-c["recompiles"], -c["processes"], c["frame"]))[:TOP_CAUSES]


def _graph_list(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """Distinct compiled graphs (deduplicated across processes) with their non-weight inputs."""
    seen: dict[tuple[Any, ...], dict[str, Any]] = {}
    for record in records:
        for g in record.get("stats", {}).get("graphs", []):
            inputs = [i for i in g.get("dynamo_inputs", []) if not _WEIGHT.search(str(i.get("name", "")))]
            weights = len(g.get("dynamo_inputs", [])) - len(inputs)
            key = (g.get("kind"), g.get("compile_id"), tuple(describe_tensor(i) for i in g.get("inputs", [])))
            hit = g.get("cache") == "hit"
            if key in seen:
                seen[key]["processes"] += 1
                seen[key]["cache_hits"] += hit
                continue
            seen[key] = {
                "kind": g.get("kind"),
                "compile_id": g.get("compile_id"),
                "function": function_label(g.get("frame")),
                "inputs": [{"name": i.get("name"), "shape": describe_tensor(i)} for i in inputs],
                "weights": weights,
                "graph_inputs": [describe_tensor(i) for i in g.get("inputs", [])],
                "num_nodes": g.get("num_nodes"),
                "processes": 1,
                "cache_hits": int(hit),
            }
    return list(seen.values()), len(seen)


def graphs_by_region(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Graphs per compiled function (a region: a decoder layer's forward, or a whole model) and per core.

    The core is the one device of a graph's inputs (``several`` would be a graph holding two cores' tensors).
    ``compiled`` and ``loaded`` split the graphs into NEFF cache misses and hits: identical layers compile a
    shape once and load it everywhere else.
    """
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for record in records:
        for g in record.get("stats", {}).get("graphs", []):
            devices = {i.get("device") for i in g.get("inputs", []) if str(i.get("device", "cpu")) != "cpu"}
            core = devices.pop() if len(devices) == 1 else ("several" if devices else "host")
            key = (function_label(g.get("frame")) or "?", str(core))
            row = rows.setdefault(key, {"function": key[0], "core": key[1], "compiled": 0, "loaded": 0})
            row["loaded" if g.get("cache") == "hit" else "compiled"] += 1
    return sorted(rows.values(), key=lambda r: (r["function"], r["core"]))


def _short_location(text: str) -> str:
    """``/venv/lib/site-packages/accelerate/hooks.py:50: why`` -> ``accelerate/hooks.py:50: why``."""
    match = re.match(r"^(.*?):(\d+): ", text)
    if not match:
        return text
    path = match.group(1)
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.rsplit(marker, 1)[1] + text[len(path) :]
    parts = Path(path).parts
    return "/".join(parts[-2:]) + text[len(path) :]


def _graph_breaks(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Where Dynamo had to end a graph (each break splits the code into more NEFFs), most frequent first.

    From the breaks the simulator saw Dynamo meet (every one, with the compiled function it was tracing), or for
    an older record, from the graphs that a break ended.
    """
    counts: Counter[tuple[str | None, str]] = Counter()
    for record in records:
        seen = record.get("stats", {}).get("graph_breaks")
        if seen is not None:
            for b in seen:
                counts[(b.get("function"), _short_location(f"{b['where']}: {b['reason']}"))] += int(b["count"])
            continue
        for entry in _dynamo_graphs(record.get("stats", {}).get("graphs", [])):
            graph_break = (entry.get("frame_info") or {}).get("graph_break")
            if graph_break:
                counts[(entry["function"], _short_location(graph_break))] += 1
    return [
        {"function": function, "where": where, "graphs": n} for (function, where), n in counts.most_common(TOP_CAUSES)
    ]


def _breaks_by_function(records: list[dict[str, Any]]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for record in records:
        for b in record.get("stats", {}).get("graph_breaks") or []:
            where = _short_location(f"{b['where']}: {b['reason']}")
            listed = found.setdefault(str(b.get("function")), [])
            if where not in listed:
                listed.append(where)
    return found


def _phase(function: str, pieces: list[dict[str, Any]]) -> str:
    """What a step of a compiled function is: a training step, a serving step, generate()'s prefill or decode."""
    if any(p.get("kind") == "backward" for p in pieces):
        return "training step"
    if function.startswith("_forward_process_and_sample"):
        return "serving step"
    tokens = next((p["tokens"] for p in pieces if p.get("tokens") is not None), None)
    if tokens == 1:
        return "decode step"
    return "prefill / forward" if tokens else "step"


def graphs_per_step(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per compiled function and kind of step: the graphs one step launches, and the breaks that split it.

    A step of inference is one graph at best; a training step two (its forward and its backward). Each graph
    beyond that is one more NEFF launch and one more device->host->device hop, on every step.
    """
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    traced = _breaks_by_function(records)
    for record in records:
        for group in record.get("stats", {}).get("steps", []):
            pieces = group.get("pieces") or []
            function = str(group.get("function"))
            phase = _phase(function, pieces)
            row = rows.setdefault(
                (function, phase),
                {
                    "function": function,
                    "phase": phase,
                    "expected": 2 if phase == "training step" else 1,
                    "graphs_per_step": 0,
                    "steps": 0,
                    "shapes": set(),
                    "processes": set(),
                    "pieces": [],
                    "breaks": [],
                },
            )
            row["steps"] += int(group.get("steps", 0))
            row["shapes"].add(str(group.get("first_graph")))
            row["processes"].add(_process_label(record))
            typical = int(group.get("graphs_per_step", 0))
            if typical > row["graphs_per_step"]:
                row["graphs_per_step"], row["pieces"] = typical, [function_label(p) or "?" for p in pieces]
            found = traced.get(function) or [_short_location(p["graph_break"]) for p in pieces if p.get("graph_break")]
            row["breaks"].extend(b for b in found if b not in row["breaks"])
    out = []
    for row in rows.values():
        out.append(
            {
                **row,
                "shapes": len(row["shapes"]),
                "processes": len(row["processes"]),
                "extra": max(0, row["graphs_per_step"] - row["expected"]),
            }
        )
    return sorted(out, key=lambda r: (-r["extra"], r["function"], r["phase"]))


def _eager(records: list[dict[str, Any]]) -> dict[str, Any]:
    distinct: set[str] = set()
    for record in records:
        distinct.update(record.get("stats", {}).get("eager_signature_list", []))
    per_op = Counter(sig.split("(", 1)[0] for sig in distinct)
    # Ties by name: the same run gives the same report (a set's order changes per process).
    ranked = sorted(per_op.items(), key=lambda kv: (-kv[1], kv[0]))
    return {
        "distinct_signatures": len(distinct),
        "compiles": sum(_eager_compiles(r.get("stats", {})) for r in records),
        "cache_hits": sum(int(r.get("stats", {}).get("eager_cache_hits", 0)) for r in records),
        "eager_ops": sum(int(r.get("stats", {}).get("eager_ops", 0)) for r in records),
        "top_ops": [{"op": op, "signatures": n} for op, n in ranked[:TOP_OPS]],
    }


def _eager_compiles(st: dict[str, Any]) -> int:
    """Eager signatures a process compiled (a record without cache figures compiled them all)."""
    return int(st.get("eager_compiles", st.get("eager_signatures", 0)))


def _cpu_fallbacks(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The ops that ran on the CPU (by the backend's get_fallback_ops()), with the host copies they cost."""
    calls: Counter[str] = Counter()
    processes: Counter[str] = Counter()
    source = None
    for record in records:
        backend = record.get("backend") or {}
        source = source or backend.get("sources", {}).get("cpu_fallbacks")
        ops = backend.get("cpu_fallbacks")
        if ops is None:  # a record from a process without the backend's op tracking
            ops = record.get("stats", {}).get("cpu_fallback_ops", {})
        calls.update({op: int(n) for op, n in ops.items()})
        processes.update(ops.keys())
    ranked = sorted(calls.items(), key=lambda kv: (-kv[1], kv[0]))
    stats = [r.get("stats", {}) for r in records]
    return {
        "calls": sum(calls.values()),
        "ops": [{"op": op, "calls": n, "processes": processes[op]} for op, n in ranked],
        "d2h_bytes": sum(int(st.get("cpu_fallback_d2h_bytes", 0)) for st in stats),
        "h2d_bytes": sum(int(st.get("cpu_fallback_h2d_bytes", 0)) for st in stats),
        "source": source,
    }


def host_op_graphs(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Compiled graphs holding ops the Neuron compiler cannot put in a NEFF (each graph record's ``host_ops``)."""
    ops: Counter[str] = Counter()
    graphs = 0
    for record in records:
        for graph in record.get("stats", {}).get("graphs", []):
            found = graph.get("host_ops") or []
            graphs += bool(found)
            ops.update(found)
    return {"graphs": graphs, "ops": [{"op": op, "graphs": n} for op, n in sorted(ops.items())]}


def moe_shapes(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The MoE experts' call shapes of every process (``moe_accounting``), merged: calls summed, compiled if any was."""
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for record in records:
        for shape in (record.get("moe") or {}).get("shapes", []):
            key = tuple(shape.get(k) for k in ("implementation", "tokens", "top_k", "experts", "rows"))
            entry = merged.setdefault(key, {**shape, "calls": 0, "compiled": False, "processes": 0})
            entry["calls"] += int(shape.get("calls", 0))
            entry["compiled"] = entry["compiled"] or bool(shape.get("compiled"))
            entry["processes"] += 1
    return sorted(merged.values(), key=lambda s: (-float(s.get("ratio") or 0), str(s.get("implementation"))))


def speculation(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Speculative generate() calls of every process (``speculation_accounting``), summed, with the two ratios."""
    keys = ("calls", "target_forwards", "draft_forwards", "candidates", "accepted", "tokens")
    totals = dict.fromkeys(keys, 0)
    for record in records:
        for key in keys:
            totals[key] += int((record.get("speculation") or {}).get(key, 0) or 0)
    if not totals["calls"]:
        return None
    forwards = totals["target_forwards"]
    return {
        **totals,
        "accepted_per_forward": round(totals["accepted"] / forwards, 4) if forwards else 0.0,
        "forwards_per_token": round(forwards / totals["tokens"], 4) if totals["tokens"] else 0.0,
    }


def _backend(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The backend's own compile figures, summed over the processes that report them."""
    backends = [r.get("backend") or {} for r in records]
    graphs = [b["graphs_compiled"] for b in backends if b.get("graphs_compiled") is not None]
    caches = [b["cache"] for b in backends if b.get("cache")]
    cache: dict[str, int] | None = None
    if caches:
        cache = {}
        for counters in caches:
            for name, value in counters.items():
                cache[name] = cache.get(name, 0) + int(value)
    sources: dict[str, str] = {}
    for b in backends:
        sources.update(b.get("sources", {}))
    return {"graphs_compiled": sum(graphs) if graphs else None, "cache": cache, "sources": sources}


def _compile_cache(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The NEFF cache the run's processes used (they inherit one environment)."""
    for record in records:
        cache = record.get("stats", {}).get("compile_cache")
        if cache:
            return cache
    return None


def _padding(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Positions computed and real per call family, summed over the processes, with their ratio."""
    total: dict[str, dict[str, Any]] = {}
    for record in records:
        for family, counts in (record.get("padding") or {}).items():
            entry = total.setdefault(family, {"computed": 0, "real": 0})
            entry["computed"] += int(counts.get("computed", 0))
            entry["real"] += int(counts.get("real", 0))
    for entry in total.values():
        entry["ratio"] = round(entry["computed"] / entry["real"], 3) if entry["real"] else None
    return {family: entry for family, entry in total.items() if entry["computed"]}


def build_report(
    records: list[dict[str, Any]],
    *,
    command: list[str],
    exit_code: int,
    cores: int,
    hbm: int,
    seconds_per_graph: float,
    seconds_per_signature: float,
) -> dict[str, Any]:
    """The dry-run report of a simulated run from its processes' records."""
    active = [r for r in records if used_device(r)]
    processes = []
    for r in active:
        st = r.get("stats", {})
        est = costs.estimate(
            int(st.get("compiles", 0)),
            _eager_compiles(st),
            seconds_per_graph,
            seconds_per_signature,
            cached_graphs=int(st.get("compile_cache_hits", 0)),
            cached_signatures=int(st.get("eager_cache_hits", 0)),
        )
        processes.append(
            {
                "process": _process_label(r),
                "pid": r.get("pid"),
                "rank": r.get("rank"),
                "local_rank": r.get("local_rank"),
                "visible_cores": st.get("visible_cores", []),
                "compiles": int(st.get("compiles", 0)),
                "compile_cache_hits": int(st.get("compile_cache_hits", 0)),
                "dynamo_graphs": int(st.get("dynamo_graphs", 0)),
                "eager_signatures": int(st.get("eager_signatures", 0)),
                "eager_compiles": est["eager_signatures"],
                "eager_cache_hits": est["cached_signatures"],
                "h2d_bytes": int(st.get("h2d_bytes", 0)),
                "d2h_bytes": int(st.get("d2h_bytes", 0)),
                "d2d_bytes": int(st.get("d2d_bytes", 0)),
                "estimated_compile_seconds": est["seconds"],
                "estimated_cold_compile_seconds": est["cold_seconds"],
            }
        )
    graphs, distinct_graphs = _graph_list(active)
    slowest = max(processes, key=lambda p: p["estimated_compile_seconds"], default=None)
    estimate = costs.estimate(
        slowest["compiles"] if slowest else 0,
        slowest["eager_compiles"] if slowest else 0,
        seconds_per_graph,
        seconds_per_signature,
        cached_graphs=slowest["compile_cache_hits"] if slowest else 0,
        cached_signatures=slowest["eager_cache_hits"] if slowest else 0,
    )
    estimate["process"] = slowest["process"] if slowest else None
    # Processes compile in parallel and a rank that finds a graph being compiled waits for it, so a
    # cold cache costs the slowest process's whole workload, and a warm one saves only the difference.
    estimate["cold_seconds"] = max((p["estimated_cold_compile_seconds"] for p in processes), default=0.0)
    estimate["saved_seconds"] = max(0.0, estimate["cold_seconds"] - estimate["seconds"])
    return {
        "command": command,
        "exit_code": exit_code,
        "simulated_cores": cores,
        "hbm_per_core": hbm,
        "processes_started": len(records),
        "processes_using_device": len(active),
        "processes": processes,
        "placement": _placement(active),
        "memory": _memory(active, hbm),
        "compiles": sum(p["compiles"] for p in processes),
        "compile_cache_hits": sum(p["compile_cache_hits"] for p in processes),
        "compile_cache": _compile_cache(active),
        "distinct_graphs": distinct_graphs,
        "graphs_by_region": graphs_by_region(active),
        "graphs": graphs[:MAX_GRAPHS_LISTED],
        "graphs_truncated": max(0, len(graphs) - MAX_GRAPHS_LISTED),
        "eager": _eager(active),
        "h2d_bytes": sum(p["h2d_bytes"] for p in processes),
        "d2h_bytes": sum(p["d2h_bytes"] for p in processes),
        "d2d_bytes": sum(p["d2d_bytes"] for p in processes),
        "padding": _padding(active),
        "cpu_fallbacks": _cpu_fallbacks(active),
        "host_op_graphs": host_op_graphs(active),
        "moe": moe_shapes(active),
        "speculation": speculation(active),
        "backend": _backend(active),
        "estimate": estimate,
        "graph_breaks": _graph_breaks(active),
        "graphs_per_step": graphs_per_step(active),
        "recompile_causes": _merge_causes([recompile_causes(r.get("stats", {}).get("graphs", [])) for r in active]),
    }
