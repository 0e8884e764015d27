"""Op parity: a Transformers forward + backward + AdamW step on neuron equals the CPU run."""

from __future__ import annotations

import copy

import pytest
import torch

from accelerate_neuron import tiny


@pytest.mark.parametrize("family", ["qwen3", "llama", "gpt2"])
def test_forward_backward_adamw_step_matches_cpu(family: str) -> None:
    cpu_model = tiny.model(family).train()
    dev_model = copy.deepcopy(cpu_model).to("neuron")
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding in the first row

    def step(model: torch.nn.Module, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.optim.Optimizer]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        out = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=ids.to(device))
        out.loss.backward()
        opt.step()
        return out.loss.detach().cpu(), out.logits.detach().cpu(), opt

    cpu_loss, cpu_logits, cpu_opt = step(cpu_model, "cpu")
    dev_loss, dev_logits, dev_opt = step(dev_model, "neuron")
    assert dev_logits.shape == cpu_logits.shape
    torch.testing.assert_close(dev_logits, cpu_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dev_loss, cpu_loss, rtol=1e-6, atol=1e-6)
    for (name, p_cpu), p_dev in zip(cpu_model.named_parameters(), dev_model.parameters(), strict=True):
        assert p_dev.device.type == "neuron", name
        torch.testing.assert_close(p_dev.grad.cpu(), p_cpu.grad, rtol=1e-4, atol=1e-6, msg=name)
        s_cpu, s_dev = cpu_opt.state[p_cpu], dev_opt.state[p_dev]
        torch.testing.assert_close(s_dev["exp_avg"].cpu(), s_cpu["exp_avg"], rtol=1e-4, atol=1e-7, msg=name)
        torch.testing.assert_close(s_dev["exp_avg_sq"].cpu(), s_cpu["exp_avg_sq"], rtol=1e-3, atol=1e-12, msg=name)
        # Adam divides by sqrt(v): where a gradient is float noise, so is the
        # update. Compare the step where the gradient carries signal.
        signal = p_cpu.grad.abs() > 1e-4 * p_cpu.grad.abs().max()
        torch.testing.assert_close(p_dev.detach().cpu()[signal], p_cpu.detach()[signal], rtol=1e-5, atol=1e-5, msg=name)


def test_sampling_and_beam_search_ops_match_cpu() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    dev = logits.to("neuron")
    torch.testing.assert_close(torch.topk(dev, 5).values.cpu(), torch.topk(logits, 5).values)
    torch.testing.assert_close(torch.log_softmax(dev, -1).cpu(), torch.log_softmax(logits, -1))
    torch.testing.assert_close(
        torch.cumsum(torch.softmax(dev, -1), -1).cpu(), torch.cumsum(torch.softmax(logits, -1), -1)
    )
    torch.manual_seed(0)
    cpu_draw = torch.multinomial(torch.softmax(logits, -1), 4, replacement=True)
    torch.neuron.manual_seed_all(0)
    dev_draw = torch.multinomial(torch.softmax(dev, -1), 4, replacement=True)
    assert dev_draw.device.type == "neuron" and dev_draw.shape == cpu_draw.shape
    assert torch.equal(torch.argmax(dev, -1).cpu(), torch.argmax(logits, -1))
    idx = torch.tensor([2, 0, 1])
    torch.testing.assert_close(dev.index_select(0, idx.to("neuron")).cpu(), logits.index_select(0, idx))
    torch.testing.assert_close(dev[idx].cpu(), logits[idx])  # host index tensor, as on CUDA
    sorted_dev, order_dev = torch.sort(dev, descending=True)
    sorted_cpu, order_cpu = torch.sort(logits, descending=True)
    torch.testing.assert_close(sorted_dev.cpu(), sorted_cpu)
    assert torch.equal(order_dev.cpu(), order_cpu)
    out = torch.empty(0, device="neuron")
    torch.cat([dev, dev], out=out)  # an out= kernel that grows its output
    torch.testing.assert_close(out.cpu(), torch.cat([logits, logits]))
