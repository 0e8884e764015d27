"""Text rendering of the dry-run report and of model placement (shared by ``simulate`` and ``demo``)."""

from __future__ import annotations

from typing import Any

from .. import costs
from ._common import duration, plural, size

MAX_PLACEMENT_LINES = 12
TOP_FALLBACK_OPS = 8
TOP_BREAKS = 6


def placement_lines(model: dict[str, Any], indent: str = "    ") -> list[str]:
    """Bytes per device, then which modules are where (``model.layers.0-11  core 0``)."""
    lines = []
    total = sum(model.get("bytes", {}).values())
    for device, n in model.get("bytes", {}).items():
        share = f" ({100 * n / total:.0f}%)" if total and len(model["bytes"]) > 1 else ""
        lines.append(f"{indent}{device:<10} {size(n)}{share}")
    entries = model.get("placement", [])
    if len(entries) > 1:
        width = min(48, max(len(p) for p, _ in entries))
        shown = entries[:MAX_PLACEMENT_LINES]
        lines.extend(f"{indent}  {p:<{width}}  {d}" for p, d in shown)
        hidden = len(entries) - len(shown) + model.get("placement_truncated", 0)
        if hidden:
            lines.append(f"{indent}  ... {hidden} more")
    elif entries:
        lines.append(f"{indent}  the whole model is on {entries[0][1]}")
    return lines


def _section(title: str) -> list[str]:
    return ["", title]


def _placement(report: dict[str, Any]) -> list[str]:
    lines = _section("Where the model landed")
    models = report["placement"]
    if not models:
        lines.append("  no model with weights was seen (models are tracked from `import torch` on)")
        return lines
    for model in models:
        alive = "" if model["alive_at_exit"] else ", as it was when freed"
        lines.append(f"  {model['model']} ({model['process']}, {model['parameters']:,} parameters{alive})")
        lines.extend(placement_lines(model))
    return lines


def _memory(report: dict[str, Any]) -> list[str]:
    mem = report["memory"]
    lines = _section(f"Memory per core (peak / at exit, of {size(mem['hbm_per_core'])} HBM)")
    if not mem["peak_per_core"]:
        lines.append("  no device memory was used")
    for core, peak in mem["peak_per_core"].items():
        who = ", ".join(mem["processes_per_core"][core])
        lines.append(f"  core {core:<3} {size(peak):>10} / {size(mem['at_exit_per_core'][core]):>10}   {who}")
    for core in mem["shared_cores"]:
        lines.append(
            f"  ! core {core} is used by {len(mem['processes_per_core'][str(core)])} processes: on Trainium a "
            "NeuronCore belongs to one process. Leave NEURON_RT_VISIBLE_CORES unset under torchrun/accelerate "
            "launch (each rank then gets the core of its LOCAL_RANK)."
        )
    for core in mem["over_budget_cores"]:
        lines.append(
            f"  ! core {core} needed more than its {size(mem['hbm_per_core'])}: this run would OOM on Trainium"
        )
    return lines


def _cache_tag(g: dict[str, Any]) -> str:
    """``[cache hit]``, ``[x2 processes: 1 compiled, 1 cache hit]``, or nothing for a plain compile."""
    hits, processes = g.get("cache_hits", 0), g["processes"]
    if processes > 1:
        return f"  [x{processes} processes: {processes - hits} compiled, {plural(hits, 'cache hit')}]"
    return "  [cache hit]" if hits else ""


def _graphs(report: dict[str, Any]) -> list[str]:
    hits = report.get("compile_cache_hits", 0)
    lines = _section(
        f"Compiled graphs: {report['compiles']} compiled, {hits} loaded from the NEFF cache "
        f"(one NEFF each; {report['distinct_graphs']} distinct across processes)"
    )
    for g in report["graphs"]:
        names = ", ".join(f"{i['name']}: {i['shape']}" for i in g["inputs"]) or "no inputs besides weights"
        weights = f" + {plural(g['weights'], 'weight')}" if g["weights"] else ""
        shared = _cache_tag(g)
        where = f" {g['function']}" if g.get("function") else ""
        lines.append(f"  {g['kind']:<9} frame {g['compile_id']}{where}: {names}{weights}{shared}")
    if report["graphs_truncated"]:
        lines.append(f"  ... {report['graphs_truncated']} more")
    regions = report.get("graphs_by_region") or []
    if len(regions) > 1:  # several compiled functions or cores: a model compiled per layer, or split
        lines.append("  per compiled function and core:")
        for r in regions:
            lines.append(f"    {r['function']} on {r['core']}: {r['compiled']} compiled, {r['loaded']} loaded")
    return lines


def _eager(report: dict[str, Any]) -> list[str]:
    eager = report["eager"]
    lines = _section(
        f"Eager signatures: {eager['distinct_signatures']} distinct (op, shapes, dtypes), "
        f"{eager['eager_ops']:,} eager op calls; {eager.get('compiles', eager['distinct_signatures'])} compiled, "
        f"{eager.get('cache_hits', 0)} loaded from the NEFF cache"
    )
    if eager["top_ops"]:
        lines.append("  most shapes: " + ", ".join(f"{o['op']} x{o['signatures']}" for o in eager["top_ops"]))
    return lines


_KIND_TEXT = {
    "module": "the same code ran for another module, with other weights (one graph per module)",
    "shape": "input shapes changed",
    "decode": "generate()'s prefill, then its decode step (one graph each, as intended)",
    "object": "the same code ran for another object (one graph per object)",
    "inputs": "the frame's inputs changed",
    "guard": "no input changed: a guard on something else failed (a Python value, a global, an attribute)",
}
MAX_INPUTS_PER_CAUSE = 3


def _causes(report: dict[str, Any]) -> list[str]:
    causes = report["recompile_causes"]
    lines = _section("Top causes of recompiles")
    if not causes:
        lines.append("  none: every compiled frame was compiled once")
        return lines
    for cause in causes:
        procs = f", in {cause['processes']} processes" if cause["processes"] > 1 else ""
        function = f" {cause['function']}" if cause.get("function") else ""
        lines.append(
            f"  frame {cause['frame']}{function}, {cause['compiles_of_frame']} compiles: "
            f"{plural(cause['recompiles'], 'recompile')}, {_KIND_TEXT[cause['kind']]}{procs}"
        )
        values = list(cause["values"].items())
        for name, seq in values[:MAX_INPUTS_PER_CAUSE]:
            lines.append(f"    {name}: {' -> '.join(seq)}")
        if len(values) > MAX_INPUTS_PER_CAUSE:
            lines.append(f"    ... {len(values) - MAX_INPUTS_PER_CAUSE} more input(s)")
    if any(cause["kind"] != "decode" for cause in causes):
        lines.append(
            "  Each new shape is a new NEFF on Neuron: pad to fixed lengths or buckets, use a static KV cache, "
            "keep growing tensors off the compiled graph."
        )
    return lines


def _breaks(report: dict[str, Any]) -> list[str]:
    breaks = report.get("graph_breaks") or []
    if not breaks:
        return []
    lines = _section("Graph breaks (each splits the code into one more compiled graph)")
    for b in breaks:
        lines.append(f"  {b['graphs']} x in {b['function'] or '?'}")
        lines.append(f"    {b['where']}")
    return lines


def _steps(report: dict[str, Any]) -> list[str]:
    rows = report.get("graphs_per_step") or []
    if not rows:
        return []
    lines = _section(
        "Graphs per step (each graph a NEFF launch; between two, a device->host->device hop, on every step)"
    )
    for row in rows:
        where = f", in {plural(row['processes'], 'process', 'processes')}" if row["processes"] > 1 else ""
        target = "forward + backward" if row["expected"] == 2 else "one graph"
        lines.append(
            f"  {row['phase']}, {row['function']}: {plural(row['graphs_per_step'], 'graph')} per step "
            f"({plural(row['steps'], 'step')}, {plural(row['shapes'], 'step shape')}{where})"
        )
        if row["extra"]:
            lines.append(
                f"    ! {row['extra']} more than {target}: {plural(row['extra'], 'extra launch', 'extra launches')} "
                "and host round trips per step"
            )
            lines.extend(f"    break: {b}" for b in row["breaks"][:TOP_BREAKS])
            if not row["breaks"]:
                lines.append("    pieces: " + " -> ".join(row["pieces"][:8]))
    return lines


def _fallbacks(report: dict[str, Any]) -> list[str]:
    fb = report.get("cpu_fallbacks") or {"calls": 0, "ops": []}
    if not fb["calls"]:
        return [*_section("CPU fallbacks: none (every op ran on the device)")]
    lines = _section(
        f"CPU fallbacks: {plural(fb['calls'], 'call')} of ops Neuron runs on the CPU, each a device->host->device "
        f"round trip ({size(fb['d2h_bytes'])} out, {size(fb['h2d_bytes'])} back in all)"
    )
    for op in fb["ops"][:TOP_FALLBACK_OPS]:
        procs = f", in {op['processes']} processes" if op["processes"] > 1 else ""
        lines.append(f"  {op['op']} x{op['calls']}{procs}")
    if len(fb["ops"]) > TOP_FALLBACK_OPS:
        lines.append(f"  ... {len(fb['ops']) - TOP_FALLBACK_OPS} more op(s)")
    listed = f" (ops as listed by {fb['source']})" if fb.get("source") else ""
    lines.append(
        "  On Trainium each call copies its inputs to the host and its results back: keep such ops out of hot "
        f"loops, or compute them another way{listed}."
    )
    return lines


def _host_op_graphs(report: dict[str, Any]) -> list[str]:
    held = report.get("host_op_graphs") or {"graphs": 0, "ops": []}
    if not held["graphs"]:
        return []
    lines = _section(
        f"Compiled graphs holding ops Neuron cannot compile: {held['graphs']} (the real backend fails such a "
        "graph, or splits it around the op; the simulator ran it whole)"
    )
    lines += [f"  {op['op']} in {plural(op['graphs'], 'graph')}" for op in held["ops"]]
    lines.append(
        "  MoE experts: leave experts_implementation unset so accelerate-neuron's static one runs "
        "(ACCELERATE_NEURON_MOE_EXPERTS)."
        if any("grouped_mm" in op["op"] or op["op"] == "aten::histc" for op in held["ops"])
        else "  Compute these another way, or keep them out of the compiled code."
    )
    return lines


def _padding(report: dict[str, Any]) -> list[str]:
    families = report.get("padding") or {}
    if not families:
        return []
    lines = _section("Padding: positions computed per real one (1.00: none; accelerate_neuron.padding_stats())")
    for family, entry in families.items():
        ratio = f"{entry['ratio']:.2f}" if entry.get("ratio") else "-"
        lines.append(f"  {family}: {ratio} ({entry['computed']:,} computed, {entry['real']:,} real)")
    return lines


#: Experts' FLOPs over a sparse dispatch's above which the report suggests the blockwise experts.
MOE_RATIO_HINT = 2.0


def _speculation(report: dict[str, Any]) -> list[str]:
    figures = report.get("speculation")
    if not figures:
        return []
    lines = _section("Speculative decoding (assisted generation, prompt lookup)")
    lines.append(
        f"  {plural(figures['calls'], 'generate() call')}: {figures['tokens']} tokens in "
        f"{figures['target_forwards']} target forwards ({figures['forwards_per_token']:.2f} per token), "
        f"{figures['accepted']} of {figures['candidates']} candidates accepted "
        f"({figures['accepted_per_forward']:.2f} per target forward), {figures['draft_forwards']} draft forwards"
    )
    if figures["tokens"] and figures["forwards_per_token"] >= 1.0:
        lines.append(
            "  One target forward per token or more: the draft's candidates are rejected; a closer draft (or "
            "fewer candidates, num_assistant_tokens) would pay off."
        )
    return lines


def _moe(report: dict[str, Any]) -> list[str]:
    shapes = report.get("moe") or []
    if not shapes:
        return []
    lines = _section(
        "MoE experts: FLOPs per token against a sparse dispatch (each token through its top-k experts only), "
        "per call shape"
    )
    for shape in shapes:
        seen = ", ".join(
            part
            for part in (
                "compiled" if shape.get("compiled") else "",
                plural(shape["calls"], "eager call") if shape.get("calls") else "",
            )
            if part
        )
        lines.append(
            f"  {shape['implementation']:<18} {shape['tokens']} tokens x top-{shape['top_k']} of "
            f"{shape['experts']} experts: {shape['ratio']:.2f}x ({shape['flops_per_token']:,.0f} FLOPs per token, "
            f"sparse {shape['sparse_flops_per_token']:,.0f}; {seen})"
        )
    if any(float(s["ratio"]) > MOE_RATIO_HINT for s in shapes):
        lines.append(
            "  Above 2x: dense experts (every expert on every token). ACCELERATE_NEURON_MOE_EXPERTS=auto runs "
            "prefill and training blockwise (see ACCELERATE_NEURON_MOE_BLOCK_SIZE)."
        )
    return lines


def _backend_line(report: dict[str, Any]) -> list[str]:
    backend = report.get("backend") or {}
    parts = []
    if backend.get("graphs_compiled") is not None:
        parts.append(f"{plural(backend['graphs_compiled'], 'graph')} ({backend['sources'].get('graphs')})")
    cache = backend.get("cache")
    if cache:
        parts.append(
            f"NEFF cache: {cache.get('compilations', 0)} compiled, {cache.get('persistent_hits', 0)} from disk, "
            f"{cache.get('in_memory_hits', 0)} from memory (torch_neuronx.metrics)"
        )
    if not parts:
        return []
    return ["  the backend's own metrics: " + "; ".join(parts)]


def cache_line(cache: dict[str, Any] | None) -> str:
    """Where the simulated NEFF cache is, or why it is off."""
    if not cache:
        return "NEFF cache not reported"
    if not cache.get("enabled"):
        return f"NEFF cache off: {cache.get('reason') or 'disabled'}"
    return f"simulated NEFF cache in {cache['dir']}"


def _estimate(report: dict[str, Any]) -> list[str]:
    est = report["estimate"]
    who = f" ({est['process']}; processes compile in parallel)" if report["processes_using_device"] > 1 else ""
    return [
        *_section("Estimated compile time on Trainium"),
        f"  this run:     ~{duration(est['seconds'])}{who}",
        f"  cold cache:   ~{duration(est['cold_seconds'])}; the NEFF cache saved ~{duration(est['saved_seconds'])} "
        f"({costs.describe_cache(report.get('compile_cache_hits', 0), report['eager'].get('cache_hits', 0))}"
        f"{'; a process loading what another is compiling waits for it' if who else ''})",
        f"  assumes {costs.describe(est)} compiled, 0 s per NEFF loaded from the cache "
        "(change with --compile-seconds / --eager-seconds)",
        f"  {cache_line(report.get('compile_cache'))} (TORCH_NEURONX_NEFF_CACHE_DIR moves it)",
    ]


def render_dryrun(report: dict[str, Any]) -> str:
    """The human-readable dry-run report."""
    started, used = report["processes_started"], report["processes_using_device"]
    lines = [
        "=" * 78,
        f"accelerate-neuron dry run on a simulated Neuron device: {plural(report['simulated_cores'], 'core')} x "
        f"{size(report['hbm_per_core'])} (no Trainium was used)",
        f"command: {' '.join(report['command'])}",
        f"exit code {report['exit_code']}; {plural(started, 'Python process', 'Python processes')} imported torch, "
        f"{used} used the device",
    ]
    if not started:
        lines.append(
            "  no process reported: the command started no Python process that imports torch with "
            "accelerate-neuron installed (or it was killed before it could exit)"
        )
        return "\n".join(lines)
    lines += _placement(report) + _memory(report) + _graphs(report) + _backend_line(report) + _eager(report)
    lines += _section(
        f"Transfers: host->device {size(report['h2d_bytes'])}, device->host {size(report['d2h_bytes'])}, "
        f"device->device {size(report['d2d_bytes'])}"
    )
    lines += _padding(report) + _fallbacks(report) + _host_op_graphs(report) + _moe(report) + _speculation(report)
    lines += _causes(report) + _steps(report) + _breaks(report)
    lines += _estimate(report)
    return "\n".join(lines)
