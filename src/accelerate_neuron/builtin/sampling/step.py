"""One sampling step as a compiled graph: logits in, one token id per row out, the state carried along.

:func:`compiled` gives the compiled function of a :class:`~.program.Program` (one per program; Dynamo
then compiles one graph per input shape: rows, vocabulary, history length). The graph reads the
logits where the model left them (on the device), applies the program, draws from the device's random
number generator (``torch.manual_seed`` / ``torch.neuron.manual_seed`` seed it) and returns the ids
and the next state: the length counter, the tokens seen (repetition penalty) and the token history
(n-gram and multi-token bans), each updated with the drawn token.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from ...plugins import call_hook
from ..compile_options import compile_options
from . import ops
from .program import Program, State, Tensors

#: The compile settings of the step when no plugin answers ``neuron_compile_config("sampling")``.
DEFAULT_OPTIONS = {"backend": "neuron", "dynamic": False, "fullgraph": True}

_lock = threading.Lock()
_compiled: dict[Program, Callable[..., Any]] = {}


def processed(program: Program, logits: torch.Tensor, params: Tensors, state: State) -> torch.Tensor:
    """The scores after the program's full-vocabulary stages (upstream's processors before the warpers)."""
    scores = logits.to(torch.float32)
    for i, stage in enumerate(program.stages):
        prefix = f"s{i}."
        mine = {k[len(prefix) :]: v for k, v in params.items() if k.startswith(prefix)}
        scores = stage.apply(scores, mine, state)
    return scores


def distribution(program: Program, logits: torch.Tensor, params: Tensors, state: State) -> torch.Tensor:
    """``[rows, vocab]``: the probabilities the step draws from (greedy: its argmax, one-hot)."""
    scores = processed(program, logits, params, state)
    if program.path == "greedy":
        return torch.zeros_like(scores).scatter(-1, scores.argmax(dim=-1, keepdim=True), 1.0)
    if program.path == "candidates":
        probs, candidates = ops.on_candidates(scores, params, program.warpers, program.candidates)
        return torch.zeros_like(scores).scatter(-1, candidates, probs)
    return ops.on_vocabulary(scores, params, program.warpers)


def run(program: Program, logits: torch.Tensor, params: Tensors, state: State) -> tuple[torch.Tensor, State]:
    """The step itself (eager): ``logits`` ``[rows, vocab]`` -> (ids ``[rows]``, next state)."""
    scores = processed(program, logits, params, state)
    if program.path == "greedy":
        ids = scores.argmax(dim=-1)
    elif program.path == "candidates":
        probs, candidates = ops.on_candidates(scores, params, program.warpers, program.candidates)
        ids = candidates.gather(-1, ops.draw(probs).unsqueeze(-1)).squeeze(-1)
    else:
        ids = ops.draw(ops.on_vocabulary(scores, params, program.warpers))
    return ids, advance(state, ids)


def advance(state: State, ids: torch.Tensor) -> State:
    """The state after ``ids`` were appended (a finished row's history may differ from upstream's pad token:
    that row's tokens are never used again)."""
    length = state["cur_len"]
    out = {"cur_len": length + 1}
    if "presence" in state:
        out["presence"] = state["presence"].scatter(1, ids.unsqueeze(-1), True)
    if "history" in state:
        history = state["history"]
        at = length.clamp(max=history.shape[1] - 1).expand(history.shape[0], 1)
        out["history"] = history.scatter(1, at, ids.unsqueeze(-1))
    return out


def options() -> dict[str, Any]:
    """``torch.compile`` keyword arguments of the step (the ``neuron_compile_config("sampling")`` answer)."""
    answer = call_hook("neuron_compile_config", purpose="sampling")
    return compile_options(answer if answer is not None else DEFAULT_OPTIONS, "sampling")


def compiled(program: Program) -> Callable[[torch.Tensor, Tensors, State], tuple[torch.Tensor, State]]:
    """The compiled step of ``program`` (made once per program and kept)."""
    with _lock:
        step = _compiled.get(program)
        if step is None:

            def sampling_step(logits: torch.Tensor, params: Tensors, state: State) -> tuple[torch.Tensor, State]:
                return run(program, logits, params, state)

            step = torch.compile(sampling_step, **options())
            _compiled[program] = step
        return step


def reset() -> None:
    """Forget the compiled steps (tests that reset Dynamo)."""
    with _lock:
        _compiled.clear()
