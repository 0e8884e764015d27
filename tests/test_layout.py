"""The package's layering, read from the source: imports point down, the simulator stands alone.

Layers, top to bottom (a module may import its own layer and the layers below):
cli / status report -> plugin side (activation, plugins, builtin/...) -> simulator -> base.
The simulator imports only the base, so a reader (or a user of only the plugin) can skip it, and
the only plugin-side module that imports it is ``activation`` (installing it on request).

Inside ``builtin/``, a built-in plugin (a package named in ``BUILTIN_PLUGINS``) imports no other
plugin: what two plugins share lives in a shared layer beside them (the ``shapes`` package and the
other non-plugin modules under ``builtin/``), which imports no plugin. So no import circle can run
between plugins, and switching one off never breaks another's imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "accelerate_neuron"
BASE = {
    "device",
    "backend_metrics",
    "sizes",
    "import_hooks",
    "tiny",
    "costs",
    "settings",
    "logs",
    "files",
    "trust",
    "precompile_token",
    "records",
    "accelerate_config",
    "padding",
    "compile_cache",
    "moe_accounting",
    "speculation_accounting",
}
PLUGIN_SIDE = {"activation", "plugins", "hookspecs", "patching", "builtin", "_autoload"}
TOP = {"cli", "status_report", "__main__", "__init__"}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path) -> set[str]:
    """Dotted names (relative to the package) of the package modules ``name`` imports."""
    # names keep "__init__" (a/b/__init__.py is "a.b.__init__"), so the package is all but the last part
    package_parts = name.split(".")[:-1]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if not (node.module or "").startswith("accelerate_neuron"):
                    continue
                base = (node.module or "").split(".")[1:]
            else:
                keep = len(package_parts) - (node.level - 1)
                base = package_parts[:keep] + ((node.module or "").split(".") if node.module else [])
            if base:
                targets.add(".".join(base))
            for alias in node.names:
                targets.add(".".join([*base, alias.name]))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("accelerate_neuron."):
                    targets.add(alias.name.split(".", 1)[1])
    known = _modules()
    return {t for t in targets if t in known or f"{t}.__init__" in known}


def _layer(module: str) -> str:
    head = module.split(".")[0]
    if head in BASE:
        return "base"
    if head == "simulator":
        return "simulator"
    if head in PLUGIN_SIDE:
        return "plugin"
    if head in TOP:
        return "top"
    raise AssertionError(f"module {module!r} is in no layer: add it here and to the layout in docs/how-it-works.md")


_ORDER = {"base": 0, "simulator": 1, "plugin": 2, "top": 3}


@pytest.mark.parametrize("module", sorted(_modules()))
def test_imports_point_down(module: str) -> None:
    path = _modules()[module]
    layer = _layer(module)
    for target in _imports(module, path):
        target_layer = _layer(target)
        if layer == "plugin" and target_layer == "simulator":
            # activation installs the simulator on ACCELERATE_NEURON_SIMULATE: the one allowed edge
            assert module == "activation", f"{module} imports the simulator ({target}); only activation may"
            continue
        assert _ORDER[target_layer] <= _ORDER[layer], f"{module} ({layer}) imports {target} ({target_layer})"


def test_simulator_imports_only_the_base() -> None:
    outside = {
        (module, target)
        for module, path in _modules().items()
        if module.startswith("simulator")
        for target in _imports(module, path)
        if not target.startswith("simulator")
    }
    assert {target.split(".")[0] for _, target in outside} <= BASE, sorted(outside)


def test_builtin_plugins_are_packages() -> None:
    from accelerate_neuron.plugins import BUILTIN_PLUGINS

    for name, module in BUILTIN_PLUGINS.items():
        assert module == f"accelerate_neuron.builtin.{name}"
        assert (PACKAGE / "builtin" / name / "__init__.py").is_file(), name
    stray = [p.name for p in (PACKAGE / "builtin").glob("_*.py") if p.name != "__init__.py"]
    assert not stray, f"prefix-named helpers belong in their feature's package: {stray}"


def _plugin_of(module: str) -> str | None:
    """The built-in plugin ``module`` belongs to (``builtin.generation.call`` -> ``generation``), or None."""
    from accelerate_neuron.plugins import BUILTIN_PLUGINS

    parts = module.split(".")
    if parts[0] == "builtin" and len(parts) > 1 and parts[1] in BUILTIN_PLUGINS:
        return parts[1]
    return None


def _shared(module: str) -> bool:
    """A module of ``builtin/`` that belongs to no plugin: a shared layer (``builtin.shapes.*``, ``builtin.scope``)."""
    return module.startswith("builtin.") and _plugin_of(module) is None and module != "builtin.__init__"


def test_builtin_plugins_import_no_other_plugin() -> None:
    crossing = sorted(
        (module, target)
        for module, path in _modules().items()
        if _plugin_of(module) is not None
        for target in _imports(module, path)
        if _plugin_of(target) not in (None, _plugin_of(module))
    )
    assert not crossing, f"a built-in plugin imports another (move what they share to a shared layer): {crossing}"


def test_shared_layers_import_no_plugin() -> None:
    reaching = sorted(
        (module, target)
        for module, path in _modules().items()
        if _shared(module)
        for target in _imports(module, path)
        if _plugin_of(target) is not None
    )
    assert not reaching, f"a shared layer under builtin/ imports a plugin: {reaching}"


def _definitions(path: Path) -> set[str]:
    """Names a module defines at its top level (functions, classes, assigned names)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


#: What the shape layer (or another shared module) owns, and must be defined nowhere else.
_OWNED = {
    "PAD_VALUES": "builtin.shapes.pads",
    "pad_id": "builtin.shapes.pads",
    "Cut": "builtin.shapes.cut",
    "PER_ROW": "builtin.shapes.cut",
    "unpadded_cache": None,  # generation's copy of the static-cache cut
    "_smallest_at_least": None,  # serving's and generation's copies of "smallest bucket >= n"
    "warn_beyond_largest": "builtin.shapes.buckets",
    "make_room_for_buckets": "builtin.shapes.room",
    "max_positions": "builtin.shapes.policy",
    "compile_count": "builtin.compile_counter",
    "model_tag": "builtin.model_tag",
    "model_device": "builtin.model_devices",
    "_pad_id": None,
}


def test_the_shape_layer_is_shared() -> None:
    """Every capability that pads uses the one shape package; the copies it replaced are gone."""
    modules = _modules()
    users = {
        _plugin_of(m) or m for m, path in modules.items() for t in _imports(m, path) if t.startswith("builtin.shapes")
    }
    assert {"generation", "inference", "training", "serving", "warmup", "builtin.layer_regions"} <= users, users
    copies = sorted(
        (name, module)
        for module, path in modules.items()
        for name in _definitions(path) & set(_OWNED)
        if module != _OWNED[name] and not module.endswith("__init__")
    )
    assert not copies, f"defined outside the one place that owns it: {copies}"
    gone = ["generation/shapes.py", "inference/outputs.py", "regions/layers.py", "warmup/session.py"]
    assert not [g for g in gone if (PACKAGE / "builtin" / g).exists()], gone
