"""Convolutions on the simulated device: the CPU's results and gradients, counted like every other op.

PyTorch hands a convolution on an out-of-tree device to ``convolution_overrideable`` (its gradient to
``convolution_backward_overrideable``); the simulator implements both (csrc/kernels.cpp). The layers below are
the ones Transformers' vision, speech and hybrid models build: ViT/CLIP/SigLIP patch embeddings (Conv2d, stride =
kernel), Qwen2-VL's video patch embedding (Conv3d), Whisper's front end (Conv1d, stride 2), wav2vec2's feature
encoder and grouped positional conv (Conv1d, groups), Qwen3-Next's causal depthwise conv1d, upsamplers
(ConvTranspose).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from accelerate_neuron.simulator import cpu_fallback

LAYERS = {
    "patch_embed_2d": (lambda: torch.nn.Conv2d(3, 8, 4, stride=4), (2, 3, 16, 16)),
    "video_patch_embed_3d": (lambda: torch.nn.Conv3d(3, 8, (2, 4, 4), stride=(2, 4, 4), bias=False), (2, 3, 4, 8, 8)),
    "whisper_conv1d_stride2": (lambda: torch.nn.Conv1d(8, 6, 3, stride=2, padding=1), (2, 8, 20)),
    "grouped_conv1d_same": (lambda: torch.nn.Conv1d(8, 8, 5, padding=2, groups=2), (2, 8, 12)),
    "causal_depthwise_dilated": (lambda: torch.nn.Conv1d(6, 6, 3, padding=4, dilation=2, groups=6), (2, 6, 10)),
    "reflect_padding_2d": (lambda: torch.nn.Conv2d(3, 6, 3, padding=1, padding_mode="reflect", groups=3), (2, 3, 7, 9)),
    "circular_same_1d": (lambda: torch.nn.Conv1d(3, 4, 4, padding="same", padding_mode="circular"), (2, 3, 9)),
    "replicate_padding_3d": (lambda: torch.nn.Conv3d(2, 2, 3, padding=1, padding_mode="replicate"), (1, 2, 3, 4, 4)),
    "transposed_2d": (lambda: torch.nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2),
                      (2, 4, 5, 5)),
    "transposed_1d_dilated": (lambda: torch.nn.ConvTranspose1d(4, 3, 3, stride=3, dilation=2), (2, 4, 7)),
}  # fmt: skip


def _pair(name: str) -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    make, shape = LAYERS[name]
    torch.manual_seed(0)
    cpu = make()
    return cpu, copy.deepcopy(cpu).to("neuron"), torch.randn(shape)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_forward_and_gradients_equal_the_cpu(name: str, sim: Any) -> None:
    cpu, dev, x = _pair(name)
    x_cpu = x.clone().requires_grad_()
    x_dev = x.to("neuron").requires_grad_()
    y_cpu, y_dev = cpu(x_cpu), dev(x_dev)
    assert y_dev.device.type == "neuron" and y_dev.shape == y_cpu.shape
    assert torch.equal(y_dev.cpu(), y_cpu)  # the CPU's kernel on the same memory: bit for bit
    grad = torch.randn(y_cpu.shape, generator=torch.Generator().manual_seed(1))
    y_cpu.backward(grad)
    y_dev.backward(grad.to("neuron"))
    assert torch.equal(x_dev.grad.cpu(), x_cpu.grad)
    for (pname, p_cpu), p_dev in zip(cpu.named_parameters(), dev.parameters(), strict=True):
        assert p_dev.grad is not None and p_dev.grad.device.type == "neuron", pname
        assert torch.equal(p_dev.grad.cpu(), p_cpu.grad), pname
    signatures = sim.stats()["eager_signature_list"]
    assert [s for s in signatures if s.startswith("aten::convolution_overrideable(")]
    assert [s for s in signatures if s.startswith("aten::convolution_backward_overrideable(")]


def test_a_convolution_is_one_eager_signature_per_shape_and_geometry(sim: Any) -> None:
    conv = torch.nn.Conv2d(3, 8, 4, stride=4).to("neuron")
    with torch.no_grad():
        conv(torch.randn(2, 3, 16, 16, device="neuron"))
        conv(torch.randn(2, 3, 16, 16, device="neuron"))  # same shapes: nothing new to compile
        convs = [s for s in sim.stats()["eager_signature_list"] if "convolution" in s]
        assert convs == [
            "aten::convolution_overrideable(f32[2,3,16,16], f32[8,3,4,4], f32[8], "
            "stride=[4,4], padding=[0,0], dilation=[1,1], groups=1)"
        ]
        conv(torch.randn(4, 3, 16, 16, device="neuron"))  # a new batch size: a new program
        conv.stride = (2, 2)  # same shapes in, another geometry: another program
        conv(torch.randn(4, 3, 16, 16, device="neuron"))
    convs = [s for s in sim.stats()["eager_signature_list"] if "convolution" in s]
    assert len(convs) == 3 and "stride=[2,2]" in convs[-1]


def test_inside_a_compiled_graph_a_convolution_is_no_eager_op(sim: Any) -> None:
    cpu, dev, x = _pair("whisper_conv1d_stride2")
    compiled = torch.compile(dev, backend="neuron", dynamic=False, fullgraph=True)
    with torch.no_grad():
        y = compiled(x.to("neuron"))
        compiled(x.to("neuron"))
        assert torch.equal(y.cpu(), cpu(x))
    st = sim.stats()
    assert st["compiles"] == 1
    assert not [s for s in st["eager_signature_list"] if "convolution" in s]
    x_dev = x.to("neuron").requires_grad_()
    compiled(x_dev).sum().backward()  # forward and backward graphs; the gradient convolutions run inside
    x_cpu = x.clone().requires_grad_()
    cpu(x_cpu).sum().backward()
    assert torch.equal(x_dev.grad.cpu(), x_cpu.grad)
    st = sim.stats()
    assert st["compiles"] == 3
    assert not [s for s in st["eager_signature_list"] if "convolution" in s]


def test_under_bf16_autocast_a_convolution_runs_in_bf16_like_the_cpu(sim: Any) -> None:
    cpu, dev, x = _pair("patch_embed_2d")
    with torch.autocast("neuron", dtype=torch.bfloat16):
        y = dev(x.to("neuron"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = cpu(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y.cpu(), expected)
    assert [s for s in sim.stats()["eager_signature_list"] if s.startswith("aten::convolution_overrideable(bf16[")]


def test_inputs_on_two_devices_are_refused_with_the_argument_named() -> None:
    conv = torch.nn.Conv1d(2, 2, 3).to("neuron:0")
    with pytest.raises(RuntimeError, match=r"neuron:0 and neuron:1.*'input'|neuron:1 and neuron:0.*'weight'"):
        conv(torch.randn(1, 2, 5, device="neuron:1"))


@pytest.fixture
def fallback_ops() -> Any:
    previous = cpu_fallback.ops()
    yield cpu_fallback.set_ops
    cpu_fallback.set_ops(previous)


def test_listed_as_a_cpu_fallback_a_convolution_is_a_host_round_trip(sim: Any, fallback_ops: Any) -> None:
    fallback_ops(["convolution_overrideable"])
    cpu, dev, x = _pair("patch_embed_2d")
    with torch.no_grad():
        y = dev(x.to("neuron"))
    assert torch.equal(y.cpu(), cpu(x))
    st = sim.stats()
    assert st["cpu_fallback_ops"] == {"aten::convolution_overrideable": 1}
    assert st["cpu_fallback_d2h_bytes"] == (x.numel() + 8 * 3 * 4 * 4 + 8) * 4  # input, weight, bias out
    assert st["cpu_fallback_h2d_bytes"] == y.numel() * 4  # the result back
    assert not [s for s in st["eager_signature_list"] if "convolution" in s]
