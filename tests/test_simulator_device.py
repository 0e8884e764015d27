"""The simulated device in this process: API surface, memory, counters, RNG, serialization."""

from __future__ import annotations

import io

import pytest
import torch

import accelerate_neuron.simulator as simulator

DEVICE_API = [
    "is_available", "device_count", "current_device", "set_device", "get_device_name", "get_device_properties",
    "is_initialized", "init", "device", "manual_seed", "manual_seed_all", "seed", "initial_seed",
    "get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all", "Stream", "Event",
    "current_stream", "synchronize", "memory_stats", "memory_allocated", "max_memory_allocated",
    "memory_reserved", "max_memory_reserved", "reset_peak_memory_stats", "empty_cache",
    "is_bf16_supported", "get_amp_supported_dtype",
]  # fmt: skip


def test_registration_and_api_surface() -> None:
    assert torch._C._get_privateuse1_backend_name() == "neuron"
    for name in DEVICE_API:
        assert callable(getattr(torch.neuron, name)), name
    # The real early builds have no mem_get_info: neither does the simulator.
    assert not hasattr(torch.neuron, "mem_get_info")
    assert torch.neuron.device_count() == 2 and torch.neuron.is_available()
    assert str(torch.accelerator.current_accelerator()) == "neuron"
    assert torch.device(0) == torch.device("neuron:0")
    t = torch.ones(2).neuron()
    assert t.is_neuron and t.device == torch.device("neuron:0")
    assert torch.nn.Linear(2, 2).neuron().weight.device.type == "neuron"
    props = torch.neuron.get_device_properties(1)
    assert props.total_memory == 24 * 2**30 and "NeuronCore" in props.name
    assert torch.neuron.get_device_name(0) == props.name


def test_upstream_gates_see_neuron() -> None:
    import importlib.util

    import accelerate.utils.imports as accelerate_imports
    from transformers.utils import import_utils

    assert importlib.util.find_spec("torch_neuronx") is not None
    for gate in (
        getattr(accelerate_imports, "is_neuron_available", None),
        getattr(import_utils, "is_torch_neuron_available", None),
    ):
        if gate is not None:
            assert gate() is True


def test_memory_tracks_storage_and_frees() -> None:
    before = torch.neuron.memory_allocated(1)
    torch.neuron.reset_peak_memory_stats(1)
    x = torch.empty(1000, dtype=torch.float32, device="neuron:1")
    assert torch.neuron.memory_allocated(1) - before == 4000
    view = x[10:20]  # views share storage: no new allocation
    assert torch.neuron.memory_allocated(1) - before == 4000
    del x
    assert torch.neuron.memory_allocated(1) - before == 4000  # the view keeps the storage alive
    del view
    assert torch.neuron.memory_allocated(1) == before
    assert torch.neuron.max_memory_allocated(1) - before == 4000
    assert torch.neuron.memory_reserved(1) == torch.neuron.memory_allocated(1)
    stats = torch.neuron.memory_stats(1)
    assert stats["allocated_bytes.all.current"] == before


def test_out_of_memory_names_core_and_sizes() -> None:
    free = 24 * 2**30 - torch.neuron.memory_allocated(1)
    with pytest.raises(torch.OutOfMemoryError) as err:
        torch.empty(25 * 2**30, dtype=torch.uint8, device="neuron:1")
    message = str(err.value)
    assert "out of memory" in message and "neuron:1" in message and "core index 1" in message
    assert f"{25 * 2**30} bytes" in message and f"({free} bytes) free" in message
    assert torch.neuron.memory_stats(1)["num_ooms"] >= 1


def test_eager_signatures_are_distinct_op_shape_dtype(sim) -> None:
    x = torch.ones(4, device="neuron")
    y = x + 1
    y = y * 2
    first = sim.stats()
    assert first["eager_signature_list"] == [
        "aten::fill_.Scalar(f32[4])",
        "aten::add.Tensor(f32[4], i64[])",
        "aten::mul.Tensor(f32[4], i64[])",
    ]
    z = torch.ones(4, device="neuron") + 1  # same ops, same shapes: nothing new to compile
    assert sim.stats()["eager_signatures"] == 3
    assert sim.stats()["eager_ops"] == 5
    z = torch.ones(8, device="neuron") + 1  # new shape: two new signatures
    assert sim.stats()["eager_signatures"] == 5
    assert "aten::fill_.Scalar(f32[8])" in sim.stats()["eager_signature_list"]
    z.to(torch.bfloat16)  # a cast on the device is an op too
    assert sim.stats()["eager_signature_list"][-1] == "aten::copy_(bf16[8], f32[8])"


def test_transfer_bytes(sim) -> None:
    host = torch.arange(10, dtype=torch.float32)
    dev = host.to("neuron")
    assert sim.stats()["h2d_bytes"] == 40 and sim.stats()["d2h_bytes"] == 0
    back = dev.cpu()
    assert sim.stats()["d2h_bytes"] == 40
    assert dev[3].item() == 3.0
    assert sim.stats()["d2h_bytes"] == 44
    assert dev.tolist() == host.tolist() and torch.equal(back, host)
    dev.to("neuron:1")
    assert sim.stats()["d2d_bytes"] == 40


def test_compile_backend_counts_graphs_per_shape(sim) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x @ x.T).sum(-1)

    compiled = torch.compile(f, backend="neuron", dynamic=False)
    a = torch.randn(4, 4, device="neuron")
    b = torch.randn(8, 4, device="neuron")
    sim.reset_stats()
    assert torch.allclose(compiled(a), f(a))
    eager_after_reference = sim.stats()["eager_signatures"]
    compiled(a)
    compiled(b)
    stats = sim.stats()
    assert stats["compiles"] == 2 and stats["dynamo_graphs"] == 2
    assert [g["kind"] for g in stats["graphs"]] == ["inference", "inference"]
    assert [g["inputs"][0]["shape"] for g in stats["graphs"]] == [[4, 4], [8, 4]]
    assert stats["graphs"][0]["dynamo_inputs"][0]["name"] == "L['x']"
    # Ops inside compiled graphs are not eager work: only the reference call counted.
    assert stats["eager_signatures"] == eager_after_reference


def test_compiled_training_step_is_forward_and_backward_graphs(sim) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).to("neuron")
    compiled = torch.compile(model, backend="neuron", dynamic=False)
    sim.reset_stats()
    loss = compiled(torch.randn(4, 8, device="neuron")).sum()
    loss.backward()
    kinds = [g["kind"] for g in sim.stats()["graphs"]]
    assert kinds == ["forward", "backward"]
    assert all(p.grad is not None and p.grad.device.type == "neuron" for p in model.parameters())


def test_rng_is_per_device_and_seedable() -> None:
    torch.manual_seed(123)  # calls torch.neuron.manual_seed_all: must not recurse
    a0 = torch.randn(5, device="neuron:0")
    a1 = torch.randn(5, device="neuron:1")
    torch.manual_seed(123)
    assert torch.equal(a0, torch.randn(5, device="neuron:0"))
    assert torch.equal(a1, torch.randn(5, device="neuron:1"))
    assert torch.neuron.initial_seed() == 123
    state = torch.neuron.get_rng_state(0)
    x = torch.rand(3, device="neuron:0")
    torch.neuron.set_rng_state(state, 0)
    assert torch.equal(x, torch.rand(3, device="neuron:0"))
    torch.neuron.manual_seed(7)  # current device only
    s0 = torch.randn(3, device="neuron:0")
    torch.neuron.manual_seed(7)
    assert torch.equal(s0, torch.randn(3, device="neuron:0"))
    gen = torch.Generator(device="neuron")
    gen.manual_seed(5)
    g1 = torch.randn(3, device="neuron", generator=gen)
    gen.manual_seed(5)
    assert torch.equal(g1, torch.randn(3, device="neuron", generator=gen))
    assert gen.device.type == "neuron"


def test_autocast_uses_the_accelerator_policy() -> None:
    lin = torch.nn.Linear(4, 4).to("neuron")
    x = torch.randn(2, 4, device="neuron")
    assert torch.neuron.get_amp_supported_dtype() == [torch.bfloat16, torch.float16]
    with torch.autocast("neuron", dtype=torch.bfloat16):
        y = lin(x)
        assert y.dtype == torch.bfloat16  # matmul in bf16
        assert torch.softmax(y, -1).dtype == torch.float32  # softmax in fp32
        assert (y + y.float()).dtype == torch.float32
    y.float().sum().backward()
    assert lin.weight.grad.dtype == torch.float32


def test_pinned_memory_and_non_blocking_copies() -> None:
    host = torch.randn(16).pin_memory()
    assert host.is_pinned()
    dev = host.to("neuron", non_blocking=True)
    assert torch.equal(dev.cpu(), host)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(4, 2)), batch_size=2, pin_memory=True
    )
    assert all(batch[0].is_pinned() for batch in loader)


def test_what_accelerate_and_transformers_do_to_device_tensors(tmp_path) -> None:
    import safetensors.torch

    weight = torch.nn.Parameter(torch.randn(3, 3, device="neuron"))
    rebuilt = type(weight)(weight.data * 2, requires_grad=weight.requires_grad)
    assert isinstance(rebuilt, torch.nn.Parameter) and type(rebuilt) is torch.nn.Parameter
    tied = weight.data.view(9)
    assert tied.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr() != 0
    other = torch.randn(3, 3, device="neuron")
    assert other.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()

    buffer = io.BytesIO()
    torch.save({"w": weight.data, "o": other}, buffer)
    assert b"accelerate_neuron" not in buffer.getvalue()  # no simulator class pickled
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded["w"].device == torch.device("neuron:0") and torch.equal(loaded["w"].cpu(), weight.data.cpu())
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True, map_location="cpu")["o"].device.type == "cpu"

    path = tmp_path / "w.safetensors"
    safetensors.torch.save_file({"w": weight.data.contiguous()}, str(path))
    back = safetensors.torch.load_file(str(path), device=0)
    assert back["w"].device == torch.device("neuron:0") and torch.equal(back["w"].cpu(), weight.data.cpu())


def test_mixing_devices_fails_like_an_accelerator() -> None:
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.ones(3, device="neuron") + torch.ones(3)
    with pytest.raises(RuntimeError, match="same device"):
        torch.ones(3, device="neuron:0") + torch.ones(3, device="neuron:1")
    # 0-dim host tensors are scalars, as on CUDA.
    assert torch.equal((torch.ones(3, device="neuron") * torch.tensor(2.0)).cpu(), torch.full((3,), 2.0))


def test_invalid_device_index_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match=r"Invalid neuron device index 5.*2 simulated Neuron core"):
        torch.empty(2, device="neuron:5")
    with pytest.raises(ValueError, match="invalid neuron device index 3"):
        torch.neuron.memory_allocated(3)


def test_stats_shape_and_reset(sim) -> None:
    torch.ones(3, device="neuron").cpu()
    stats = sim.stats()
    for key in ("compiles", "eager_signatures", "h2d_bytes", "d2h_bytes", "memory_allocated"):
        assert key in stats
    assert set(stats["memory_allocated"]) == {0, 1}
    assert stats["eager_signatures"] == 1 and stats["d2h_bytes"] == 12
    simulator.reset_stats()
    after = simulator.stats()
    assert after["eager_signatures"] == 0 and after["d2h_bytes"] == 0 and after["compiles"] == 0


def test_install_validates_arguments() -> None:
    # The runtime initialises at the first use of the device; before it a resize is allowed. Used here first, so
    # that this test refuses one wherever it runs in the session (first on a worker, it resized the worker's cores).
    torch.ones(1, device="neuron").cpu()
    with pytest.raises(ValueError, match="simulated cores 0"):
        simulator.install(cores=0)
    with pytest.raises(ValueError, match="'lots'"):
        simulator.install(cores=2, hbm="lots")
    simulator.install(cores=2)  # same configuration: a no-op
    with pytest.raises(simulator.SimulatorError, match="cannot be resized"):
        simulator.install(cores=4)


def test_module_to_keeps_parameters_and_tied_weights() -> None:
    from accelerate_neuron import tiny

    model = tiny.model("qwen3")
    head = model.lm_head.weight
    assert head is model.model.embed_tokens.weight
    model.to("neuron")
    assert model.lm_head.weight is head is model.model.embed_tokens.weight
    assert head.device == torch.device("neuron:0")


def test_streams_and_events_are_synchronous() -> None:
    stream = torch.neuron.current_stream()
    assert stream.device.type == "neuron" and stream.query()
    x = torch.ones(4, device="neuron")
    x.record_stream(stream)  # DDP does this when it moves inputs: a no-op here
    start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    start.record()
    y = x * 2
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) >= 0 and torch.equal(y.cpu(), torch.full((4,), 2.0))
    torch.neuron.synchronize()
    assert isinstance(start, torch.neuron.Event) and isinstance(stream, torch.neuron.Stream)
    assert not isinstance(torch.Event(device="cpu"), torch.neuron.Event)
