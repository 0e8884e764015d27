"""Activation on ``import torch``: cheap, never raising, inert without Neuron."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from helpers import last_json, run_python

REPORT = """
import json, sys
import accelerate_neuron
st = accelerate_neuron.status()
print(json.dumps({**st.as_dict(), "modules_after_import_torch": MODULES}))
"""


def _child(prelude: str = "", after: str = "", **env: str | None):
    code = (
        textwrap.dedent(prelude)
        + "\nimport sys\nimport torch\n"
        + "MODULES = sorted(m for m in ('transformers', 'accelerate') if m in sys.modules)\n"
        + textwrap.dedent(after)
        + REPORT
    )
    return run_python(code, **env)


def test_import_torch_activates_without_importing_hf() -> None:
    proc = _child(ACCELERATE_NEURON_SIMULATE="2")
    status = last_json(proc.stdout)
    assert status["activated_by"] == "import torch (torch.backends entry point)"
    assert status["neuron"] == "simulated" and status["active"]
    assert status["modules_after_import_torch"] == []
    assert {p["name"] for p in status["plugins"] if p["kind"] == "builtin"} >= {
        "placement",
        "generation",
        "training",
        "launch",
    }


def test_without_neuron_the_plugin_is_inert() -> None:
    status = last_json(_child().stdout)
    assert status["neuron"] is None and not status["active"]
    assert "no Neuron device" in status["inert_reason"]
    assert status["patches"] == [] and status["plugins"] == []
    assert status["modules_after_import_torch"] == []


def test_activation_that_raises_leaves_import_torch_working() -> None:
    # A broken `accelerate_neuron.device` makes activation itself fail.
    prelude = """
        import sys, types
        class _Broken(types.ModuleType):
            def __getattr__(self, name):
                if name.startswith("__"):
                    raise AttributeError(name)
                raise RuntimeError("device probing exploded")
        sys.modules["accelerate_neuron.device"] = _Broken("accelerate_neuron.device")
    """
    status = last_json(_child(prelude, ACCELERATE_NEURON_SIMULATE="2").stdout)
    assert "device probing exploded" in status["error"]
    assert status["inert_reason"] == "activation failed"


def test_autoload_that_raises_leaves_import_torch_working() -> None:
    prelude = """
        import sys, types
        broken = types.ModuleType("accelerate_neuron.activation")
        def activate(source=""):
            raise RuntimeError("activation exploded")
        broken.activate = activate
        sys.modules["accelerate_neuron.activation"] = broken
    """
    code = (
        textwrap.dedent(prelude) + "\nimport torch\nx = torch.ones(2)\nprint(json_ok := 'imported', x.sum().item())\n"
    )
    proc = run_python(code, ACCELERATE_NEURON_SIMULATE="2")
    assert "imported 2.0" in proc.stdout


def _fake_package(root: Path, name: str, init: str, extra: dict[str, str] | None = None) -> None:
    pkg = root / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(init))
    for rel, text in (extra or {}).items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_broken_torch_neuronx_does_not_break_import(tmp_path: Path) -> None:
    # PyPI's placeholder "torch-neuronx" raises on import.
    _fake_package(
        tmp_path, "torch_neuronx", 'raise ImportError("WRONG PACKAGE. Please install from the Neuron repository")'
    )
    inert = last_json(_child(PYTHONPATH=str(tmp_path)).stdout)
    assert inert["neuron"] is None and inert["error"] == ""
    proc = _child(
        after="import importlib.util; print('spec', importlib.util.find_spec('torch_neuronx').origin)",
        PYTHONPATH=str(tmp_path),
        ACCELERATE_NEURON_SIMULATE="2",
    )
    simulated = last_json(proc.stdout)
    assert simulated["neuron"] == "simulated"
    assert "spec accelerate_neuron simulator" in proc.stdout  # the stand-in shadows the placeholder
    assert "cannot be imported" in proc.stderr


@pytest.mark.parametrize("simulate", [None, "2"])
def test_a_broken_dependency_never_breaks_import_torch(tmp_path: Path, simulate: str | None) -> None:
    """A pluggy that raises on import, first on the path: ``import torch`` goes on (the package imports only the
    standard library until activation, and activation's failure is said once). Without Neuron nothing is said:
    pluggy is not even imported."""
    _fake_package(tmp_path, "pluggy", 'raise RuntimeError("this pluggy is broken")')
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    code = "import torch\nx = torch.ones(2)\nprint('imported', x.sum().item())\n"
    proc = run_python(code, PYTHONPATH=path, ACCELERATE_NEURON_SIMULATE=simulate)
    assert "imported 2.0" in proc.stdout
    said = [line for line in proc.stderr.splitlines() if "this pluggy is broken" in line]
    if simulate is None:
        assert said == [], proc.stderr
    else:
        assert said == [
            "accelerate_neuron: not activated (RuntimeError: this pluggy is broken); import torch goes on without "
            "the Neuron plugin"
        ], proc.stderr
    disabled = run_python(code, PYTHONPATH=path, ACCELERATE_NEURON_DISABLE="1", ACCELERATE_NEURON_SIMULATE=simulate)
    assert "imported 2.0" in disabled.stdout


def test_works_without_accelerate_installed() -> None:
    # None in sys.modules is how Python spells "not installed" to both
    # `import accelerate` (ModuleNotFoundError) and find_spec (None).
    prelude = """
        import sys
        sys.modules["accelerate"] = None
    """
    after = """
        import transformers
        from transformers import AutoModelForCausalLM
        from accelerate_neuron import tiny
        model = tiny.model("llama").to("neuron")
        out = model.generate(torch.tensor([[1, 5, 7]]), max_new_tokens=3, do_sample=False)
        print("generated", out.shape[-1], sys.modules.get("accelerate") is not None)
    """
    proc = _child(prelude, after, ACCELERATE_NEURON_SIMULATE="2")
    assert "generated 6 False" in proc.stdout
    assert last_json(proc.stdout)["active"]


def _third_party(root: Path) -> None:
    dist = root / "neuron_extra-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: neuron-extra\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[accelerate_neuron]\nbroken_import = neuron_extra_broken\nbudget = neuron_extra_budget\n"
    )
    (root / "neuron_extra_broken.py").write_text('raise RuntimeError("plugin import exploded")\n')
    (root / "neuron_extra_budget.py").write_text(
        textwrap.dedent(
            """
            from accelerate_neuron import hookimpl

            @hookimpl
            def neuron_memory_budget(index, total_memory, reserved, free):
                raise ValueError("budget hook exploded")

            @hookimpl
            def neuron_static_cache_length(requested, max_position_embeddings):
                return 4096
            """
        )
    )


def test_third_party_plugins_load_and_failures_are_contained(tmp_path: Path) -> None:
    _third_party(tmp_path)
    after = """
        from accelerate_neuron.plugins import call_hook
        print("length", call_hook("neuron_static_cache_length", requested=10, max_position_embeddings=None))
        print("budget", call_hook("neuron_memory_budget", index=0, total_memory=100, reserved=30, free=None))
    """
    proc = _child(after=after, PYTHONPATH=str(tmp_path), ACCELERATE_NEURON_SIMULATE="2")
    status = last_json(proc.stdout)
    plugins = {p["name"]: p for p in status["plugins"]}
    assert plugins["budget"]["active"] and plugins["budget"]["kind"] == "third-party"
    assert not plugins["broken_import"]["active"] and "plugin import exploded" in plugins["broken_import"]["detail"]
    assert "length 4096" in proc.stdout  # a third-party answer overrides the built-in default
    assert "budget hook exploded" in proc.stderr  # warned, then the built-in budget answered
    assert "budget 70" in proc.stdout


@pytest.mark.parametrize(
    ("value", "expect_active", "disabled"),
    [
        ("1", False, set()),
        ("all", False, set()),
        ("placement", True, {"placement"}),
        ("placement, generation", True, {"placement", "generation"}),
    ],
)
def test_disable_variants(value: str, expect_active: bool, disabled: set[str]) -> None:
    status = last_json(_child(ACCELERATE_NEURON_SIMULATE="2", ACCELERATE_NEURON_DISABLE=value).stdout)
    assert status["neuron"] == "simulated"  # the device registers even with patches disabled
    assert status["active"] is expect_active
    if expect_active:
        off = {p["name"] for p in status["plugins"] if not p["active"]}
        assert off == disabled
        assert all("ACCELERATE_NEURON_DISABLE" in p["detail"] for p in status["plugins"] if not p["active"])
    else:
        assert "ACCELERATE_NEURON_DISABLE" in status["inert_reason"]
        assert not [p for p in status["patches"] if p["status"] == "applied"]


def test_unknown_disable_name_warns_with_valid_names() -> None:
    proc = _child(ACCELERATE_NEURON_SIMULATE="2", ACCELERATE_NEURON_DISABLE="placment,training")
    status = last_json(proc.stdout)
    assert "'placment'" in proc.stderr
    valid = "valid names: generation, inference, launch, moe, placement, regions, serving, training, warmup"
    assert valid in proc.stderr
    assert {p["name"] for p in status["plugins"] if not p["active"]} == {"training"}


def test_plain_import_activates_when_autoload_is_off() -> None:
    code = """
        import json, sys
        import torch
        import transformers, accelerate.utils
        before = hasattr(torch, "neuron")
        import accelerate_neuron
        st = accelerate_neuron.status()
        print(json.dumps({"before": before, "after": hasattr(torch, "neuron"), **st.as_dict()}))
    """
    status = last_json(run_python(code, TORCH_DEVICE_BACKEND_AUTOLOAD="0", ACCELERATE_NEURON_SIMULATE="2").stdout)
    assert status["before"] is False and status["after"] is True
    assert status["activated_by"] == "import accelerate_neuron"
    assert status["active"]


def test_upstream_gates_are_not_frozen_by_an_early_call() -> None:
    # Releases without the gates (Accelerate < 1.13, Transformers 4.57) get an lru_cached stand-in
    # under the upstream name, so the refresh mechanism is exercised on every pair.
    code = """
        import functools, json
        import torch
        import accelerate.utils.imports as ai
        from transformers.utils import import_utils as ti
        def has_neuron():
            return hasattr(torch, "neuron") and torch.neuron.is_available()
        stand_ins = []
        for module, name in ((ai, "is_neuron_available"), (ti, "is_torch_neuron_available")):
            if not hasattr(module, name):
                setattr(module, name, functools.lru_cache(has_neuron))
                stand_ins.append(name)
        gates = [ai.is_neuron_available, ti.is_torch_neuron_available]
        early = [g() for g in gates]
        from accelerate_neuron import simulator
        simulator.install(cores=2)
        print(json.dumps({"stand_ins": stand_ins, "early": early, "late": [g() for g in gates]}))
    """
    result = last_json(run_python(code).stdout)
    assert result["early"] == [False, False], result
    assert result["late"] == [True, True], result


def test_torch_xla_beside_native_backend_is_kept_off_the_xla_path(tmp_path: Path) -> None:
    # A torch_xla that imports fine: stock accelerate would take its XLA path.
    _fake_package(
        tmp_path,
        "torch_xla",
        "__version__ = '2.9'\n",
        {
            "core/__init__.py": "",
            "core/xla_model.py": "def xla_device():\n    return 'xla'\n",
            "runtime.py": "",
            "amp.py": "",
            "distributed/__init__.py": "",
            "distributed/parallel_loader.py": "class MpDeviceLoader:\n    pass\n",
            "distributed/xla_multiprocessing.py": "",
        },
    )
    after = """
        import os
        import accelerate.utils as au
        print("xla", os.environ.get("USE_TORCH_XLA"), au.is_torch_xla_available())
    """
    stock = run_python(
        "import torch, accelerate.utils as au; print('xla', au.is_torch_xla_available())", PYTHONPATH=str(tmp_path)
    )
    assert "xla True" in stock.stdout
    proc = _child(after=after, PYTHONPATH=str(tmp_path), ACCELERATE_NEURON_SIMULATE="2")
    assert "xla 0 False" in proc.stdout
    assert any("USE_TORCH_XLA=0" in a for a in last_json(proc.stdout)["actions"])


def test_status_reads_well() -> None:
    proc = run_python(
        "import torch, accelerate_neuron; print(accelerate_neuron.status())", ACCELERATE_NEURON_SIMULATE="2"
    )
    text = proc.stdout
    assert text.startswith("accelerate-neuron ")
    assert "Neuron device : simulated, 2 visible core(s) x 24.0 GiB" in text
    assert "state         : active" in text
    assert "plugins on    : placement, generation, training, launch" in text
    json.dumps(__import__("accelerate_neuron").status().as_dict())  # serialisable


IMPORT_ORDER_PROBE = """
import json, sys
import accelerate_neuron
import accelerate.utils
import transformers.modeling_utils
from accelerate_neuron import activation, status
bindings = {}
for mod, name in [("accelerate.utils", "get_max_memory"), ("accelerate.utils.modeling", "get_max_memory"),
                  ("transformers.modeling_utils", "get_max_memory"),
                  ("transformers.integrations.accelerate", "accelerate_max_memory")]:
    obj = getattr(sys.modules.get(mod), name, None)
    if obj is not None:
        bindings[f"{mod}.{name}"] = getattr(obj, "__accelerate_neuron_patch__", None) is not None
st = status()
imported_pending = [p["target"] for p in st.patches
                    if p["status"] == "pending" and activation.state().scheduled[p["key"]][1].module in sys.modules]
print(json.dumps({"bindings": bindings, "imported_pending": imported_pending, "activated_by": st.activated_by,
                  "max_memory": sorted(map(str, accelerate.utils.get_max_memory()))}))
"""


def test_transformers_imported_before_or_after_the_plugin_ends_patched() -> None:
    before = "import torch, transformers, accelerate, accelerate.utils, transformers.modeling_utils\n"
    early = last_json(
        run_python(
            before + IMPORT_ORDER_PROBE, TORCH_DEVICE_BACKEND_AUTOLOAD="0", ACCELERATE_NEURON_SIMULATE="2"
        ).stdout
    )
    late = last_json(run_python("import torch\n" + IMPORT_ORDER_PROBE, ACCELERATE_NEURON_SIMULATE="2").stdout)
    assert early["activated_by"] == "import accelerate_neuron"
    assert late["activated_by"] == "import torch (torch.backends entry point)"
    for result in (early, late):
        assert result["imported_pending"] == []
        assert len(result["bindings"]) >= 3 and all(result["bindings"].values()), result["bindings"]
        assert result["max_memory"] == ["0", "1", "cpu"]
