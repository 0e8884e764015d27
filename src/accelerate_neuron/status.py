"""``accelerate_neuron.status()``: what is active, what was patched, what was skipped and why."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
        return {
            "version": self.version,
            "neuron": self.neuron,
            "devices": self.devices,
            "active": self.active,
            "activated_by": self.activated_by,
            "inert_reason": self.inert_reason,
            "error": self.error,
            "plugins": self.plugins,
            "patches": self.patches,
            "actions": self.actions,
            "activation_seconds": self.activation_seconds,
        }

    def __str__(self) -> str:
        lines = [f"accelerate-neuron {self.version}"]
        lines.append(f"  Neuron device : {self.devices}")
        lines.append(f"  activated by  : {self.activated_by or 'not activated'}")
        if self.error:
            lines.append(f"  error         : {self.error} (the plugin stays inert)")
        if self.inert_reason:
            lines.append(f"  state         : inert - {self.inert_reason}")
        else:
            lines.append("  state         : active")
        if self.plugins:
            lines.append("  plugins:")
            for p in self.plugins:
                mark = "on " if p["active"] else "off"
                detail = f" - {p['detail']}" if p["detail"] else ""
                lines.append(f"    [{mark}] {p['name']:<11} {p['kind']}{detail}")
        if self.patches:
            lines.append("  patches:")
            for p in self.patches:
                lines.append(f"    {p['status']:<8} {p['target']}  [{p['plugin']}]")
                why = p["detail"] if p["status"] != "applied" else p["reason"]
                if why:
                    lines.append(f"             {why}")
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
