"""``accelerate_neuron.status()``: what is active, what was patched, what was skipped and why."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .records import as_dict


@dataclass
class Status:
    version: str
    neuron: str | None
    devices: str
    activated_by: str
    inert_reason: str
    error: str
    plugins: list[dict[str, Any]] = field(default_factory=list)
    patches: list[dict[str, Any]] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    activation_seconds: float = 0.0

    @property
    def active(self) -> bool:
        return self.neuron is not None and not self.inert_reason

    def applied(self) -> list[dict[str, Any]]:
        return [p for p in self.patches if p["status"] == "applied"]

    def skipped(self) -> list[dict[str, Any]]:
        return [p for p in self.patches if p["status"] == "skipped"]

    def as_dict(self) -> dict[str, Any]:
        return as_dict(self, "active")

    def __str__(self) -> str:
        return self.report()

    def report(self, verbose: bool = False) -> str:
        """A readable summary; ``verbose`` also lists the patches still waiting for an import."""
        lines = [f"accelerate-neuron {self.version}"]
        lines.append(f"  Neuron device : {self.devices}")
        lines.append(f"  activated by  : {self.activated_by or 'not activated'}")
        if self.error:
            lines.append(f"  error         : {self.error} (the plugin stays inert)")
        lines.append(f"  state         : {'inert - ' + self.inert_reason if self.inert_reason else 'active'}")
        if self.plugins:
            on = [p["name"] for p in self.plugins if p["active"]]
            off = [f"{p['name']} ({p['detail']})" for p in self.plugins if not p["active"]]
            lines.append(f"  plugins on    : {', '.join(on) or '-'}")
            if off:
                lines.append(f"  plugins off   : {'; '.join(off)}")
        if self.patches:
            waiting = [p for p in self.patches if p["status"] == "pending"]
            counts = {k: sum(p["status"] == k for p in self.patches) for k in ("applied", "skipped", "reverted")}
            summary = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
            if waiting:
                summary += (", " if summary else "") + f"{len(waiting)} waiting for an import"
            lines.append(f"  patches       : {summary}")
            for p in self.patches:
                if p["status"] == "pending" and not verbose:
                    continue
                lines.append(f"    {p['status']:<8} {p['target']}  [{p['plugin']}]")
                why = p["reason"] if p["status"] == "applied" else p["detail"]
                if why:
                    lines.append(f"             {why}")
            if waiting and not verbose:
                by_library: dict[str, int] = {}
                for p in waiting:
                    library = p["target"].split(".")[0]
                    by_library[library] = by_library.get(library, 0) + 1
                listed = ", ".join(f"{lib} ({n})" for lib, n in sorted(by_library.items()))
                lines.append(f"    waiting  {listed}: applied when your script imports them")
        if self.actions:
            lines.append("  actions:")
            lines.extend(f"    {a}" for a in self.actions)
        return "\n".join(lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # IPython
        printer.text(str(self))


def _devices(kind: str | None) -> str:
    if kind is None:
        return "none (no torch-neuronx device, simulator not installed)"
    from . import device

    count = device.device_count()
    if kind == "simulated":
        from .simulator.runtime import get_state_or_none
        from .sizes import format_size

        sim = get_state_or_none()
        hbm = f" x {format_size(sim.hbm_bytes)}" if sim is not None else ""
        return f"simulated, {count} visible core(s){hbm}"
    return f"torch-neuronx, {count} visible core(s)"


def collect() -> Status:
    from . import __version__, activation, patching

    st = activation.state()
    records = {r.key: r.as_dict() for r in patching.records()}
    patches = []
    for key, (plugin, patch) in st.scheduled.items():
        if key in records:
            patches.append(records.pop(key))
        else:
            patches.append(
                {
                    "key": key,
                    "target": patch.target,
                    "plugin": plugin,
                    "status": "pending",
                    "reason": patch.reason,
                    "lacking": patch.lacking,
                    "detail": f"waiting for `import {patch.module}`",
                    "aliases": [],
                }
            )
    patches.extend(records.values())
    plugins: list[dict[str, Any]] = []
    if st.neuron is not None:
        from .plugins import plugin_infos

        plugins = [p.as_dict() for p in plugin_infos()]
    return Status(
        version=__version__,
        neuron=st.neuron,
        devices=_devices(st.neuron),
        activated_by=st.source,
        inert_reason=st.inert_reason,
        error=st.error,
        plugins=plugins,
        patches=patches,
        actions=list(st.actions),
        activation_seconds=st.seconds,
    )
