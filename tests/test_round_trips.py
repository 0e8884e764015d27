"""Round trips from the device: what is saved from Neuron cores reloads bit-identical, anywhere.

``save_pretrained`` of a model placed with ``device_map`` (one core, split over both cores, partly
offloaded to the CPU and to disk) writes the very tensors it loaded; ``torch.save`` / ``safetensors``
of neuron tensors name the device only as a storage location (``"neuron:N"``), never a class of the
simulator, so the file loads with ``map_location="cpu"`` where no Neuron (and no plugin) is installed.
"""

from __future__ import annotations

import pickletools
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from accelerate.utils import compute_module_sizes
from safetensors.torch import load_file, save_file

from accelerate_neuron import tiny
from helpers import last_json, run_python


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.save_pretrained(tmp_path_factory.mktemp("round-trip") / "qwen3", "qwen3")


def _placements(source: Path, offload: Path) -> dict[str, dict[str, Any]]:
    with torch.device("meta"):
        size = compute_module_sizes(tiny.model("qwen3"))[""]
    # Sizes found by hand for this model: Accelerate keeps room for its largest layer on the first core.
    return {
        "one core": {"device_map": "neuron:1"},
        "split over cores": {"device_map": "auto", "max_memory": {0: size * 95 // 100, 1: size * 95 // 100}},
        "split and offloaded to disk": {
            "device_map": "auto",
            "max_memory": {0: size * 2 // 3, 1: size * 2 // 3},
            "offload_folder": str(offload),
        },
        "offloaded to cpu": {"device_map": "auto", "max_memory": {0: size * 2 // 3, "cpu": size * 7 // 10}},
    }


WANT_DEVICES = {
    "one core": {"neuron:1"},
    "split over cores": {"0", "1"},
    "split and offloaded to disk": {"0", "1", "disk"},
    "offloaded to cpu": {"0", "cpu"},
}


@pytest.mark.parametrize("placement", list(WANT_DEVICES))
def test_save_pretrained_from_a_placed_model_reloads_bit_identical(
    sim: Any, source: Path, tmp_path: Path, placement: str
) -> None:
    kwargs = _placements(source, tmp_path / "offload")[placement]
    model = transformers.AutoModelForCausalLM.from_pretrained(source, **kwargs)
    if placement == "one core":
        placed = {str(t.device) for t in model.parameters()}
    else:
        placed = {str(v) for v in model.hf_device_map.values()}
    assert placed == WANT_DEVICES[placement], placed
    assert any(p.device.type == "neuron" for p in model.parameters())

    model.save_pretrained(tmp_path / "saved")
    want = load_file(source / "model.safetensors")
    got = load_file(tmp_path / "saved" / "model.safetensors")
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    original = transformers.AutoModelForCausalLM.from_pretrained(source)
    for (name, a), (_, b) in zip(reloaded.state_dict().items(), original.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def _pickled_globals(path: Path) -> set[str]:
    """Every ``module.name`` the pickle inside a ``torch.save`` zip refers to."""
    with zipfile.ZipFile(path) as archive:
        data = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "GLOBAL":
            found.add(arg.replace(" ", "."))
        elif op.name == "STACK_GLOBAL":
            found.add(".".join(strings[-2:]))
    return found


def _device_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(4, 6, generator=gen)
    return {
        "float32": base.to("neuron:0"),
        "bfloat16": base.to(torch.bfloat16).to("neuron:1"),
        "int64": torch.arange(10).to("neuron:0"),
        "view": base.to("neuron:1")[1:, 2:],  # a strided view of a larger storage
        "scalar": torch.tensor(3.5).to("neuron:0"),
    }


def test_torch_save_of_neuron_tensors_pickles_no_simulator_class(sim: Any, tmp_path: Path) -> None:
    tensors = _device_tensors()
    torch.save(tensors, tmp_path / "t.pt")
    torch.save({k: v.cpu() for k, v in tensors.items()}, tmp_path / "want.pt")

    names = _pickled_globals(tmp_path / "t.pt")
    assert names and not any(n.startswith("accelerate_neuron") for n in names), names
    assert all(n.startswith(("torch.", "collections.")) for n in names), names

    back = torch.load(tmp_path / "t.pt", weights_only=True)  # here: back on the same cores
    for key, tensor in tensors.items():
        assert back[key].device == tensor.device and torch.equal(back[key].cpu(), tensor.cpu()), key

    # Where no Neuron and no plugin are installed, map_location="cpu" loads it (the simulator stays off).
    child = run_python(
        f"""
        import json, sys, torch
        got = torch.load({str(tmp_path / "t.pt")!r}, map_location="cpu", weights_only=True)
        want = torch.load({str(tmp_path / "want.pt")!r}, weights_only=True)
        print(json.dumps({{
            "simulator_loaded": any(m.startswith("accelerate_neuron.simulator") for m in sys.modules),
            "equal": {{k: bool(torch.equal(got[k], want[k])) and got[k].device.type == "cpu" for k in want}},
        }}))
        """
    )
    result = last_json(child.stdout)
    assert result["simulator_loaded"] is False
    assert all(result["equal"].values()), result["equal"]


def test_safetensors_of_neuron_tensors_reload_bit_identical(sim: Any, tmp_path: Path) -> None:
    tensors = {k: v.contiguous() for k, v in _device_tensors().items()}
    save_file(tensors, tmp_path / "t.safetensors")
    back = load_file(tmp_path / "t.safetensors")
    assert back.keys() == tensors.keys()
    for key, tensor in tensors.items():
        assert back[key].device.type == "cpu" and torch.equal(back[key], tensor.cpu()), key
    # safetensors has no spelling of a Neuron device but an int (true on Trainium as well: its device list is fixed).
    on_core = load_file(tmp_path / "t.safetensors", device=1)
    assert all(t.device == torch.device("neuron", 1) for t in on_core.values())
