"""Faults at run time on the (simulated) device: out of memory mid-call, two threads on one model.

A core running out of memory inside ``generate()`` or a training step raises the clear
``torch.OutOfMemoryError`` (which core, how much, what to do); the failed call gives back everything it
allocated, and the model works for the next call with the same results as before. Two threads calling
``generate()`` on one model get the tokens each would get alone (on Transformers 4.x, which reuses one
static cache per model, only because the plugin makes such calls take turns) and compile nothing more.
A rank dying in a launch is in ``test_launch.py``.

The out-of-memory cases run in a child process whose cores have 64 MiB of HBM (the test process's cores
have 24 GiB, more than the host could hand out to fill them). The simulated core's HBM is exact
bookkeeping of PyTorch's allocations (no fragmentation, no runtime reserve, no NEFF scratch memory): the
byte counts here are what PyTorch asked for, which on Trainium is a lower bound of what the runtime needs.
"""

from __future__ import annotations

import copy
import gc
import threading
from typing import Any

import pytest
import torch

from accelerate_neuron import tiny
from helpers import REPO, run_python

CORE = 1
PROMPTS = [
    "one two three",
    "the quick brown fox jumps over the lazy dog again and again",
    "a b c d e f g",
    "we are testing the simulated neuron device with several prompts",
    "short",
    "twelve words in this prompt make it a little bit longer than most",
]


@pytest.fixture(scope="module")
def tok() -> Any:
    return tiny.tokenizer()


def _greedy(model: Any, tok: Any, prompt: str, new: int = 8) -> list[int]:
    inputs = tok(prompt, return_tensors="pt").to(model.device)
    out = model.generate(**inputs, do_sample=False, max_new_tokens=new, pad_token_id=tok.pad_token_id)
    return out[0].tolist()


def _in_use() -> int:
    gc.collect()
    return torch.neuron.memory_allocated(CORE)


def hog(free: int) -> torch.Tensor:
    """A tensor taking every byte of the core but ``free``."""
    total = torch.neuron.get_device_properties(CORE).total_memory
    return torch.empty(total - _in_use() - free, dtype=torch.uint8, device=f"neuron:{CORE}")


def _in_small_cores(case: str) -> None:
    """Run ``case`` (a function of this module) in a child whose two cores have 64 MiB each."""
    code = f"""
        import test_faults
        test_faults.{case}()
        print("case passed")
    """
    child = run_python(
        code, ACCELERATE_NEURON_SIMULATE="2", ACCELERATE_NEURON_SIM_HBM="64MiB", PYTHONPATH=str(REPO / "tests")
    )
    assert child.stdout.strip().endswith("case passed"), child.stdout[-2000:] + child.stderr[-4000:]


def _oom_message(call: Any, *args: Any) -> str:
    """``call(*args)`` must raise OutOfMemoryError; its message. Handled as a user's ``except`` does: the
    traceback (whose frames hold the failed call's tensors) is dropped when the block ends."""
    try:
        call(*args)
    except torch.OutOfMemoryError as exc:
        return str(exc)
    raise AssertionError(f"{call.__name__} did not run out of memory")


def _assert_clear_oom(message: str) -> None:
    assert f"neuron:{CORE}" in message and "out of memory" in message.lower(), message
    assert "smaller batch" in message  # says what to do


def test_out_of_memory_inside_generate_leaves_the_model_usable() -> None:
    _in_small_cores("oom_in_generate")


def oom_in_generate() -> None:
    tok = tiny.tokenizer()
    model = tiny.model("qwen3").to(f"neuron:{CORE}")
    want = _greedy(model, tok, PROMPTS[1])
    steady = _in_use()  # whatever the first call keeps (compiled graphs' constants, a kept cache)
    torch.neuron.reset_peak_memory_stats(CORE)
    assert _greedy(model, tok, PROMPTS[1]) == want
    need = torch.neuron.max_memory_allocated(CORE) - steady
    assert need > 0 and _in_use() == steady

    held = hog(need // 2)  # room for half of what one call needs: it fails part way
    taken = _in_use()
    _assert_clear_oom(_oom_message(_greedy, model, tok, PROMPTS[1]))
    assert _in_use() == taken  # the failed call gave back everything it took

    del held
    gc.collect()
    assert _greedy(model, tok, PROMPTS[1]) == want  # same tokens, same model, next call
    assert _greedy(model, tok, PROMPTS[0]) == _greedy(tiny.model("qwen3"), tok, PROMPTS[0])
    assert _in_use() == steady


def _forward_backward(model: Any, ids: torch.Tensor) -> float:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return float(loss.detach())


def _train_step(model: Any, opt: Any, ids: torch.Tensor) -> float:
    loss = _forward_backward(model, ids)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def test_out_of_memory_inside_a_training_step_leaves_the_model_usable() -> None:
    _in_small_cores("oom_in_training_step")


def oom_in_training_step() -> None:
    device = f"neuron:{CORE}"
    model = tiny.model("gpt2", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0).to(device).train()
    twin = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    first, big = (torch.randint(3, 300, shape, generator=gen).to(device) for shape in ((2, 16), (8, 64)))

    assert _train_step(model, opt, first) == _train_step(twin, twin_opt, first)  # optimizer state exists now
    del twin_opt
    steady = _in_use()
    torch.neuron.reset_peak_memory_stats(CORE)
    probe = copy.deepcopy(model)
    probe_opt = torch.optim.AdamW(probe.parameters(), lr=1e-2)
    probe_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # its own moments, not aliases of opt's
    base = _in_use()
    want_loss = _forward_backward(probe, big)  # what the step gives when it fits
    need = torch.neuron.max_memory_allocated(CORE) - base  # forward + backward
    probe_opt.step()
    want = {k: v.cpu() for k, v in probe.state_dict().items()}
    del probe, probe_opt
    assert _in_use() == steady and need > 0

    # A quarter of what forward + backward need: the step fails there, before the optimizer touches a
    # weight. (An OOM inside optimizer.step() can leave some parameters updated: PyTorch's behaviour on
    # every device, not something a wrapper can undo.)
    held = hog(need // 4)
    taken = _in_use()
    _assert_clear_oom(_oom_message(_train_step, model, opt, big))
    opt.zero_grad(set_to_none=True)  # what a training loop's handler does: drop the partial gradients
    assert _in_use() == taken

    del held
    gc.collect()
    assert _train_step(model, opt, big) == want_loss  # the failed step changed no weight, no optimizer state
    assert all(torch.equal(v.cpu(), want[k]) for k, v in model.state_dict().items())


def test_two_threads_generating_on_one_model_get_their_own_tokens(sim: Any, tok: Any) -> None:
    model = tiny.model("qwen3").to(f"neuron:{CORE}")
    want = {p: _greedy(model, tok, p) for p in PROMPTS}  # alone, one after the other (warms every shape)
    sim.reset_stats()
    assert {p: _greedy(model, tok, p) for p in PROMPTS} == want
    one_pass = sim.stats()
    sim.reset_stats()

    got: dict[int, list[tuple[str, list[int]]]] = {0: [], 1: []}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def worker(index: int) -> None:
        try:
            start.wait()
            for round_ in range(3):
                for prompt in PROMPTS[index::2] if round_ % 2 == 0 else PROMPTS[::-1][index::2]:
                    got[index].append((prompt, _greedy(model, tok, prompt)))
        except BaseException as exc:  # reported below, with the thread's traceback
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    assert all(not t.is_alive() for t in threads)
    calls = got[0] + got[1]
    assert len(calls) == 18
    wrong = [(p, tokens, want[p]) for p, tokens in calls if tokens != want[p]]
    assert not wrong, wrong[:2]
    stats = sim.stats()
    assert stats["compiles"] == 0  # every shape was compiled by the calls alone: threads add no graph
    assert stats["eager_compiles"] == 0
    for counter in ("eager_ops", "h2d_bytes", "d2h_bytes"):  # each prompt ran 3 times: no update lost
        assert stats[counter] == 3 * one_pass[counter], (counter, stats[counter], one_pass[counter])
