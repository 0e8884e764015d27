"""TRL's fused LM head (per-token log-probabilities without the full logits), traced into the training step.

TRL's trainers (SFT, and the others through ``add_fused_lm_head``) score tokens with
``_ChunkedLogProbFunction``: an autograd.Function that writes each vocabulary tile
with ``torch.mm(..., out=tile)`` into a slice of a preallocated buffer and folds it
into running statistics in place. Dynamo cannot trace an ``out=`` into a
non-contiguous view, so on Neuron the step breaks there: the forward, the
function's own pieces and the rest of the step become separate graphs, with host
round trips between them.

While Dynamo traces on a Neuron device, the same quantities are computed with
plain tensor ops (:func:`chunked_logprob`): per chunk of tokens the logits are
formed, transformed exactly as TRL does (``logit_scale``, the soft cap, the
temperature), and reduced to the log-probability of the label, the entropy,
``log(sum p^2)``, the mean logit and whether the label is the (first) argmax.
Each chunk is wrapped in a non-reentrant ``torch.utils.checkpoint``, so the
backward recomputes a chunk's logits instead of keeping them: the memory bound
TRL's kernel gives, inside one graph. AOTAutograd derives the gradients; the
fields TRL marks non-differentiable are detached. Eager calls, and other devices
(TRL's Triton kernels on CUDA/XPU), keep upstream's function.
"""

from __future__ import annotations

from typing import Any

#: Elements of one chunk's logits (TRL's own tile is 4096 tokens x 32768 vocabulary entries).
CHUNK_ELEMENTS = 4096 * 32768
#: ``_ChunkedLogProbFunction.forward``'s parameters (after ``ctx``) this replacement computes.
PARAMS = (
    "hidden",
    "weight",
    "bias",
    "targets",
    "temperature",
    "chunk_size",
    "final_logit_softcapping",
    "logit_scale",
    "outputs",
)
_OPTIONAL = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _chunk_scores(
    hidden: Any,
    weight: Any,
    bias: Any,
    targets: Any,
    inv_t: float,
    softcap: float | None,
    logit_scale: float,
    compute_dtype: Any,
    outputs: tuple[str, ...],
) -> tuple[Any, ...]:
    import torch

    z = hidden.to(compute_dtype) @ weight.to(compute_dtype).t()
    if bias is not None:
        z = z + bias.to(compute_dtype)
    z = z.float() * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z * inv_t
    log_z = torch.logsumexp(z, dim=-1)
    target = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    logprobs = target - log_z
    log_p = z - log_z.unsqueeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1) if "entropy" in outputs else None
    sq = torch.logsumexp(2 * log_p, dim=-1).detach() if "log_sum_sq_probs" in outputs else None
    mean = (z.sum(-1) / z.shape[-1]).detach() if "mean_logits" in outputs else None
    # TRL: the label's logit reaches the maximum and no earlier entry does, i.e. argmax (first maximum) is the label.
    top1 = (z.argmax(-1) == targets) if "is_top1" in outputs else None
    return logprobs, entropy, sq, mean, top1


def chunked_logprob(
    hidden: Any,
    weight: Any,
    bias: Any,
    targets: Any,
    temperature: float,
    chunk_size: int,
    final_logit_softcapping: float | None = None,
    logit_scale: float = 1.0,
    outputs: tuple[str, ...] = _OPTIONAL,
) -> tuple[Any, ...]:
    """``_ChunkedLogProbFunction.apply``'s results, from traceable ops (see the module's docstring)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    device = hidden.device
    compute_dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else hidden.dtype
    vocab = weight.shape[0]
    rows = max(1, CHUNK_ELEMENTS // max(1, vocab))
    inv_t = 1.0 / temperature
    pieces = []
    for start in range(0, hidden.shape[0], rows):
        end = min(start + rows, hidden.shape[0])
        pieces.append(
            checkpoint(
                _chunk_scores,
                hidden[start:end],
                weight,
                bias,
                targets[start:end],
                inv_t,
                final_logit_softcapping,
                logit_scale,
                compute_dtype,
                tuple(outputs),
                use_reentrant=False,
            )
        )
    if len(pieces) == 1:
        return tuple(pieces[0])
    return tuple(None if parts[0] is None else torch.cat(parts) for parts in zip(*pieces, strict=True))


class TraceableChunkedLogProb:
    """Stands in for ``ChunkedLogProbFunction`` where TRL's fused forward looks it up: ``apply`` is upstream's
    autograd.Function in eager calls and :func:`chunked_logprob` while Dynamo traces on Neuron.

    The name is replaced rather than ``ChunkedLogProbFunction.apply``: Dynamo recognises an autograd.Function's
    ``apply`` and traces its ``forward`` whatever the attribute holds.
    """

    def __init__(self, original: Any) -> None:
        self.original = original

    def apply(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        hidden = args[0] if args else kwargs.get("hidden")
        if torch.compiler.is_compiling() and getattr(getattr(hidden, "device", None), "type", None) == "neuron":
            return chunked_logprob(*args, **kwargs)
        return self.original.apply(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "original":
            raise AttributeError(name)
        return getattr(self.original, name)


def wrap_function(original: Any) -> TraceableChunkedLogProb:
    return TraceableChunkedLogProb(original)


def needed(original: Any) -> str | None:
    """The replacement computes what ``forward`` computes: its parameters must be the ones known here."""
    import inspect

    found = list(inspect.signature(original.forward).parameters)[1:]
    if found != list(PARAMS):
        return f"ChunkedLogProbFunction.forward's parameters changed upstream: expected {list(PARAMS)}, found {found}"
    return None
