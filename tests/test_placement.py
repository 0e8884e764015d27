"""device_map="auto" & co. on Neuron cores (issue #4), in the 2-core x 24 GiB test process.

1 and 4 cores and small HBM (spill, CPU/disk offload) run in subprocesses:
tests/test_placement_cores.py.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import accelerate
import pytest
import torch
import transformers
from accelerate.utils import modeling as acc_modeling

from accelerate_neuron import device, hookimpl, patching, plugins, tiny
from accelerate_neuron.builtin.placement.memory import PlacementError

FAMILIES = ("qwen3", "llama")
STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
IDS = torch.tensor([[1, 5, 7, 9, 11, 13]])
PLACEMENT_PATCHES = {
    "placement.get_max_memory",
    "placement.get_balanced_memory",
    "placement.get_device_map",
    "placement.load_checkpoint_in_model",
    "placement.safetensors_load_file",
    "placement.safetensors_open",
    "placement.accelerate_load_state_model",
    "placement.dispatch_model",
    "placement.accelerate_added_attributes",
    "placement.caching_allocator_warmup",
    "placement.pipeline_device",
    "placement.kernelize_device_map",
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("placement")
    return {family: tiny.save_pretrained(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="module")
def reference(checkpoints: dict[str, Path]) -> dict[str, torch.Tensor]:
    """CPU logits of each checkpoint: what every placement must reproduce."""
    out = {}
    for family, path in checkpoints.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
        with torch.no_grad():
            out[family] = model(IDS).logits
    return out


def bytes_per_device(model: torch.nn.Module) -> dict[str, int]:
    found: dict[str, int] = {}
    for tensor in model.parameters():
        key = str(tensor.device)
        found[key] = found.get(key, 0) + tensor.numel() * tensor.element_size()
    return found


def tensor_devices(model: torch.nn.Module) -> set[str]:
    return {str(t.device) for t in [*model.parameters(), *model.buffers()]}


def logits(model: torch.nn.Module) -> torch.Tensor:
    first = next(model.parameters()).device
    with torch.no_grad():
        return model(IDS.to(first)).logits.cpu()


def record(key: str) -> patching.PatchRecord:
    return next(r for r in patching.records() if r.key == key)


# --- enumeration ------------------------------------------------------------------------------------


def test_get_max_memory_lists_every_core_then_cpu() -> None:
    found = accelerate.utils.get_max_memory()
    assert list(found)[:2] == [0, 1] and list(found)[2:] == ["cpu"]
    for index in (0, 1):
        memory = device.core_memory(index)
        assert found[index] == memory.total - memory.reserved  # simulator: no mem_get_info
    # every name it is imported under is the patched function
    patched = acc_modeling.get_max_memory
    assert accelerate.utils.get_max_memory is acc_modeling.get_max_memory  # re-applied after the block
    assert accelerate.utils.get_max_memory.__wrapped__ is patched.__wrapped__
    import transformers.integrations.accelerate as ti
    import transformers.modeling_utils as mu

    for module, name in ((mu, "get_max_memory"), (ti, "accelerate_max_memory")):
        if hasattr(module, name):  # 4.x binds it in modeling_utils, 5.x in integrations.accelerate
            assert getattr(module, name) is patched, f"{module.__name__}.{name} not patched"


def test_stock_upstream_plans_for_the_cpu_only(unpatched, checkpoints: dict[str, Path]) -> None:
    """The bug: without the plugin, device_map="auto" silently loads on the CPU."""
    with unpatched():
        assert not [k for k in accelerate.utils.get_max_memory() if isinstance(k, int)]
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["qwen3"], device_map="auto")
    assert set(bytes_per_device(model)) == {"cpu"}


# --- the four strategies on 2 cores -------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_places_on_neuron_and_matches_cpu(
    strategy: str, family: str, checkpoints: dict[str, Path], reference: dict[str, torch.Tensor]
) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[family], device_map=strategy)
    per_device = bytes_per_device(model)
    assert set(per_device) <= {"neuron:0", "neuron:1"}, per_device
    core0, core1 = per_device.get("neuron:0", 0), per_device.get("neuron:1", 0)
    if strategy == "auto":  # on Neuron: the fewest cores that hold the model, here one
        assert core0 > 0 and core1 == 0
    elif strategy == "balanced":
        assert core0 > 0 and core1 > 0
    elif strategy == "balanced_low_0":
        assert core0 < core1
    else:  # sequential fills core 0 first: a tiny model fits there
        assert core1 == 0
    torch.testing.assert_close(logits(model), reference[family])


# --- max_memory ------------------------------------------------------------------------------------------


def test_user_max_memory_keys_normalised_and_sizes_converted_in_place() -> None:
    user = {"neuron:1": "2GiB", 0: "1GB", "cpu": "3GB", "disk": 10}
    found = accelerate.utils.get_max_memory(user)
    assert found == {0: 10**9, 1: 2 * 2**30, "cpu": 3 * 10**9, "disk": 10}
    assert list(found) == [0, 1, "cpu", "disk"]
    # Accelerate's contract (Transformers min()s the caller's values afterwards)
    assert user == {"neuron:1": 2 * 2**30, 0: 10**9, "cpu": 3 * 10**9, "disk": 10}


@pytest.mark.parametrize(
    ("max_memory", "named"),
    [
        ({-1: "1GB"}, "-1"),
        ({0: "-1GB"}, "'-1GB'"),
        ({0: -5}, "-5"),
        ({0: "lots"}, "'lots'"),
        ({"cuda:0": "1GB"}, "'cuda:0'"),
        ({"neuron": "1GB"}, "'neuron'"),
        ({0: "1GB", "neuron:0": "1GB"}, "'neuron:0'"),
    ],
)
def test_bad_max_memory_names_the_key_or_value(max_memory: dict, named: str) -> None:
    with pytest.raises(PlacementError) as info:
        accelerate.utils.get_max_memory(max_memory)
    assert named in str(info.value)


def test_planning_with_invisible_cores_is_as_permissive_as_upstream(caplog: pytest.LogCaptureFixture) -> None:
    # Upstream's get_max_memory only converts sizes (and warns) for an accelerator index it cannot see: a plan
    # may be made for another host. Placing is where an invisible core is refused (tests below).
    with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
        assert accelerate.utils.get_max_memory({0: 200, "neuron:2": "1KB"}) == {0: 200, 2: 1000}
        accelerate.utils.get_max_memory({2: 200})
    warned = [r.getMessage() for r in caplog.records if "core 2" in r.getMessage()]
    assert len(warned) == 1 and "sees 2 Neuron core(s): 0, 1" in warned[0]  # once, naming what is visible
    with torch.device("meta"):
        model = tiny.model("qwen3")
    size = acc_modeling.compute_module_sizes(model)[""]
    budget = {0: size // 3, 2: size // 3, "cpu": 10 * size}
    balanced = accelerate.utils.get_balanced_memory(model, max_memory=dict(budget))
    assert set(balanced) == {0, 2, "cpu"}
    plan = accelerate.infer_auto_device_map(model, max_memory=dict(budget))
    assert 2 in set(plan.values())  # planned for the core this process cannot see, as upstream would


def test_placing_on_an_invisible_core_from_max_memory_lists_visible_cores(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(PlacementError, match=r"core 7, which is not visible: this process sees 2 Neuron core\(s\)"):
        transformers.AutoModelForCausalLM.from_pretrained(
            checkpoints["qwen3"], device_map="auto", max_memory={"neuron:7": "1GB"}
        )


def test_max_memory_through_from_pretrained(checkpoints: dict[str, Path], reference: dict[str, torch.Tensor]) -> None:
    user = {"neuron:0": "300KB", "neuron:1": "50MB", "cpu": "1GB"}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoints["qwen3"], device_map="sequential", max_memory=user
    )
    per_device = bytes_per_device(model)
    assert 0 < per_device["neuron:0"] <= 300_000 and per_device["neuron:1"] > 0
    assert all(isinstance(v, int) for v in user.values())
    torch.testing.assert_close(logits(model), reference["qwen3"])
    with pytest.raises(PlacementError, match="7"):
        transformers.AutoModelForCausalLM.from_pretrained(
            checkpoints["qwen3"], device_map="auto", max_memory={7: "1GB"}
        )


# --- the per-core budget hook ---------------------------------------------------------------------------


class _Plugin:
    def __init__(self, answer) -> None:
        self.answer = answer
        self.seen: list[tuple] = []

    @hookimpl
    def neuron_memory_budget(self, index: int, total_memory: int, reserved: int, free: int | None) -> object:
        self.seen.append((index, total_memory, reserved, free))
        return self.answer(total_memory, reserved, free) if callable(self.answer) else self.answer


@pytest.fixture
def budget_plugin():
    pm = plugins.manager().pm
    registered = []

    def register(answer) -> _Plugin:
        plugin = _Plugin(answer)
        pm.register(plugin)
        registered.append(plugin)
        return plugin

    yield register
    for plugin in registered:
        pm.unregister(plugin)


def test_budget_hook_sets_each_core_budget(budget_plugin) -> None:
    plugin = budget_plugin(lambda total, reserved, free: (total - reserved) // 4)
    found = accelerate.utils.get_max_memory()
    memory = device.core_memory(1)
    assert found[1] == (memory.total - memory.reserved) // 4
    assert [s[0] for s in plugin.seen] == [0, 1] and plugin.seen[0][3] is None


def test_budget_uses_mem_get_info_where_the_build_has_it(monkeypatch: pytest.MonkeyPatch, budget_plugin) -> None:
    total = device.core_memory(0).total
    fake = lambda index=None: (12345 + int(index or 0), total)  # noqa: E731
    monkeypatch.setattr(torch.neuron, "mem_get_info", fake, raising=False)
    plugin = budget_plugin(None)  # defers to the built-in answer
    assert accelerate.utils.get_max_memory()[1] == 12346
    assert plugin.seen[1][3] == 12346


def test_bad_budget_hook_falls_back_with_a_warning(
    budget_plugin, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    budget_plugin(-1)
    with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
        found = accelerate.utils.get_max_memory()
    memory = device.core_memory(0)
    assert found[0] == memory.total - memory.reserved
    assert "neuron_memory_budget" in caplog.text


# --- device_map values ------------------------------------------------------------------------------------


@pytest.mark.parametrize("device_map", [{"": "neuron:7"}, "neuron:7", 7, {"model": 0, "lm_head": "neuron:5"}])
def test_invisible_core_in_device_map_is_a_clear_error(device_map: object, checkpoints: dict[str, Path], sim) -> None:
    gc.collect()
    before = sim.stats()["memory_allocated"]
    with pytest.raises(PlacementError, match=r"not visible: this process sees 2 Neuron core\(s\): 0, 1"):
        transformers.AutoModelForCausalLM.from_pretrained(checkpoints["llama"], device_map=device_map)
    assert sim.stats()["memory_allocated"] == before  # refused before loading anything


@pytest.mark.parametrize("device_map", [{"": "neuron:1"}, "neuron:1", torch.device("neuron", 1), 1])
def test_neuron_device_map_spellings_load_on_that_core(
    device_map: object, checkpoints: dict[str, Path], reference: dict[str, torch.Tensor]
) -> None:
    # Transformers 4.57 hands device_map[""] to safetensors, which rejects every string spelling of neuron
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["llama"], device_map=device_map)
    assert tensor_devices(model) == {"neuron:1"}
    torch.testing.assert_close(logits(model), reference["llama"])


# --- Accelerate's own entry points ---------------------------------------------------------------------------


def test_infer_auto_device_map_uses_cores(checkpoints: dict[str, Path]) -> None:
    config = transformers.AutoConfig.from_pretrained(checkpoints["qwen3"])
    with accelerate.init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.tie_weights()
    assert set(accelerate.infer_auto_device_map(model).values()) == {0}
    split = accelerate.infer_auto_device_map(
        model, max_memory={"neuron:0": "300KB", 1: "10MB"}, no_split_module_classes=model._no_split_modules
    )
    assert set(split.values()) == {0, 1}


@pytest.mark.parametrize("device_map", [{"": 0}, {"": "neuron:1"}, "auto", "balanced_low_0", "sequential"])
def test_init_empty_weights_load_checkpoint_and_dispatch(
    device_map: object, checkpoints: dict[str, Path], reference: dict[str, torch.Tensor], unpatched
) -> None:
    def load() -> torch.nn.Module:
        config = transformers.AutoConfig.from_pretrained(checkpoints["qwen3"])
        with accelerate.init_empty_weights():
            model = transformers.AutoModelForCausalLM.from_config(config)
        model.tie_weights()
        return accelerate.load_checkpoint_and_dispatch(
            model,
            str(checkpoints["qwen3"] / "model.safetensors"),
            device_map=device_map,
            no_split_module_classes=model._no_split_modules,
        )

    model = load()
    devices = tensor_devices(model)  # buffers too: the non-persistent rotary inv_freq is not in the checkpoint
    assert devices and all(d.startswith("neuron:") for d in devices), devices
    if device_map == {"": 0}:
        assert devices == {"neuron:0"}
        if record("placement.dispatch_model").status == "applied":
            with unpatched():  # the regression this patch fixes: buffers stay on the CPU
                assert "cpu" in tensor_devices(load())
    torch.testing.assert_close(logits(model), reference["qwen3"])


def test_dispatch_model_moves_a_cpu_model_to_its_core() -> None:
    model = tiny.model("llama")
    accelerate.dispatch_model(model, {"": 1})
    assert tensor_devices(model) == {"neuron:1"}
    with pytest.raises(PlacementError, match="neuron:9"):
        accelerate.utils.load_checkpoint_in_model(model, "unused.safetensors", device_map={"": "neuron:9"})


def test_remove_hook_from_module_removes_what_dispatch_model_added() -> None:
    # Behaviour, not upstream's bookkeeping: Accelerate <= 1.15 lists the names in
    # hooks._accelerate_added_attributes, 1.16 marks the added functions instead.
    from accelerate.hooks import remove_hook_from_module

    overridable = ("to", "cuda", "npu", "xpu", "neuron", "half", "float")
    model = tiny.model("llama")
    split = {"model.embed_tokens": 0, "model.layers": 1, "model.norm": 1, "model.rotary_emb": 1, "lm_head": 1}
    accelerate.dispatch_model(model, split)
    added = [a for a in overridable if a in model.__dict__]
    assert "to" in added
    knows_neuron = getattr(accelerate.utils, "is_neuron_available", lambda: False)()
    assert ("neuron" in added) == knows_neuron  # Accelerate >= 1.15 also wraps model.neuron
    remove_hook_from_module(model, recurse=True)
    assert not [a for a in overridable if a in model.__dict__]


def test_caching_allocator_warmup_allocates_nothing_on_neuron(sim, unpatched) -> None:
    from transformers import modeling_utils

    model = tiny.model("llama")
    expanded = {name: 0 for name, _ in model.named_parameters()}

    def peak_rise() -> int:
        sim.reset_stats()
        before = sim.stats()["memory_allocated"][0]
        modeling_utils.caching_allocator_warmup(model, expanded, None)
        return sim.stats()["max_memory_allocated"][0] - before

    assert peak_rise() == 0
    if record("placement.caching_allocator_warmup").status == "applied":
        with unpatched():  # stock 4.57 first allocates about the model's size on the core
            assert peak_rise() >= sum(p.numel() * p.element_size() for p in model.parameters()) // 2


# --- pipelines ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_text(checkpoints: dict[str, Path]) -> str:
    pipe = transformers.pipeline("text-generation", model=str(checkpoints["qwen3"]), device="cpu")
    return pipe("hello world", max_new_tokens=4, do_sample=False)[0]["generated_text"]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"device_map": "auto"}, "neuron:0"),
        ({"device_map": "sequential"}, "neuron:0"),
        ({"device": "neuron"}, "neuron:0"),
        ({"device": 1}, "neuron:1"),
        ({"device": "neuron:1"}, "neuron:1"),
    ],
)
def test_pipeline_runs_on_neuron(kwargs: dict, expected: str, checkpoints: dict[str, Path], cpu_text: str) -> None:
    pipe = transformers.pipeline("text-generation", model=str(checkpoints["qwen3"]), **kwargs)
    assert str(pipe.device) == expected
    assert all(d.startswith("neuron:") for d in tensor_devices(pipe.model))
    # disable_compile: compiled generation is the generation plugin's subject (tests/test_generation.py)
    text = pipe("hello world", max_new_tokens=4, do_sample=False, disable_compile=True)[0]["generated_text"]
    assert text == cpu_text


def test_pipeline_keeps_a_model_on_its_core_and_refuses_invisible_cores(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["qwen3"]
    model = transformers.AutoModelForCausalLM.from_pretrained(path).to("neuron:1")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
    assert str(pipe.device) == "neuron:1" and tensor_devices(model) == {"neuron:1"}
    with pytest.raises(PlacementError, match="pipeline device 7"):
        transformers.pipeline("text-generation", model=str(path), device=7)


# --- bookkeeping -----------------------------------------------------------------------------------------------


def test_every_placement_patch_is_applied_or_skipped_by_feature_detection(unpatched) -> None:
    import transformers.pipelines.base  # noqa: F401 - the last patch waits for this import

    records = {r.key: r for r in patching.records() if r.plugin == "placement"}
    assert set(records) == PLACEMENT_PATCHES
    for rec in records.values():
        assert rec.status in ("applied", "skipped"), (rec.key, rec.status, rec.detail)
        if rec.status == "skipped":  # upstream already does it; not "target not found"/"signature changed"
            assert rec.detail.startswith("upstream"), (rec.key, rec.detail)
    patched = accelerate.utils.get_max_memory
    with unpatched():
        assert accelerate.utils.get_max_memory is patched.__wrapped__
    assert accelerate.utils.get_max_memory is acc_modeling.get_max_memory  # re-applied after the block
    assert accelerate.utils.get_max_memory.__wrapped__ is patched.__wrapped__


def test_auto_uses_the_fewest_cores_that_hold_the_model() -> None:
    from accelerate_neuron.builtin.placement.auto import cores_needed

    assert cores_needed(100, [1000, 1000]) == 1
    assert cores_needed(950, [1000, 1000]) == 2  # 90 % headroom: 950 B does not fit one 1000 B core
    assert cores_needed(1700, [1000, 1000, 1000]) == 2
    assert cores_needed(5000, [1000, 1000]) is None  # spread over all and offload, as upstream


def test_planning_allocates_nothing_on_the_cores(sim) -> None:
    # Accelerate 1.16's own get_max_memory allocates a tensor on every core to probe it.
    sim.reset_stats()
    current = sim.stats()["memory_allocated"]
    plan = accelerate.utils.get_max_memory()
    assert set(plan) == {0, 1, "cpu"}
    assert sim.stats()["max_memory_allocated"] == current
