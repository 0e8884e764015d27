"""Which logits processors run on the device: one call's processor objects read into a program.

A :class:`Program` is the structure of the compiled sampling step (which processors, in which order,
which way the warpers run); it is hashable and interned, so equal programs share one compiled function.
The values (temperature, top-k, penalties, token masks, ...) are tensors next to it: a new value never
recompiles. :func:`translate` reads the processors of a ``generate()`` call (the exact Transformers
classes, never a subclass, whose ``__call__`` may differ) and either returns the program and its tensors,
or the name of the first processor that has no device version (that call then keeps the host path).

Every stage here computes, on the device, what its Transformers processor computes on the host, with
the same float32 operations; the step-dependent ones (minimum length, forced BOS/EOS, suppression at
the first step) read the current length from a device counter instead of ``input_ids.shape[-1]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .ops import NEG_INF

#: Transformers' warpers with a device version, in the order upstream appends them.
WARPER_ORDER = ("temperature", "top_k", "top_p", "min_p")
#: Shortest token history kept on the device (rounded up to a power of two, so few lengths compile).
MIN_HISTORY = 64

State = dict[str, torch.Tensor]
Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Context:
    """What building a stage's tensors needs: the vocabulary, the rows and the call's token ids (host)."""

    vocab: int
    input_ids: torch.Tensor  # [rows, length], the prompt as upstream's loop holds it

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])


class Unsupported(Exception):
    """A processor (or a value of one) has no device version: the call keeps the host path."""


def _ids(value: Any) -> list[int]:
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.flatten().tolist()]
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _mask(ids: Sequence[int], vocab: int) -> torch.Tensor:
    """``isin(arange(vocab), ids)`` as upstream builds it: ids outside the vocabulary match nothing."""
    return torch.isin(torch.arange(vocab), torch.tensor(list(ids), dtype=torch.long))


def _in_vocab(ids: Sequence[int], vocab: int, what: str) -> None:
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise Unsupported(f"{what} outside the vocabulary of {vocab}: {bad[:5]}")


def _scalar(value: int) -> torch.Tensor:
    return torch.tensor(int(value), dtype=torch.long)


# ------------------------------------------------------------------ stages (full-vocabulary processors)


@dataclass(frozen=True)
class Stage:
    """One full-vocabulary processor: its tensors (host, once per call) and its device arithmetic."""

    presence = False  # needs the tokens seen so far (state "presence", [rows, vocab])
    history = False  # needs the token history (state "history", [rows, length])

    def tensors(self, processor: Any, ctx: Context) -> Tensors:
        return {}

    def apply(self, scores: torch.Tensor, t: Tensors, state: State) -> torch.Tensor:
        raise NotImplementedError


@dataclass(frozen=True)
class RepetitionPenalty(Stage):
    presence = True

    def tensors(self, processor: Any, ctx: Context) -> Tensors:
        return {"penalty": torch.full((ctx.rows,), float(processor.penalty), dtype=torch.float32)}

    def apply(self, scores: torch.Tensor, t: Tensors, state: State) -> torch.Tensor:
        penalty = t["penalty"].unsqueeze(-1)
        penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
        return torch.where(state["presence"], penalised, scores)


@dataclass(frozen=True)
class NoRepeatNGram(Stage):
    size: int
    history = True

    def apply(self, scores: torch.Tensor, t: Tensors, state: State) -> torch.Tensor:
        history, length = state["history"], state["cur_len"]
        n, vocab = self.size, scores.shape[-1]
        windows = history.unfold(1, n, 1)  # [rows, L - n + 1, n]
        starts = torch.arange(windows.shape[1], device=scores.device)
        complete = starts + n <= length  # windows inside the sequence so far
        prefix = history.index_select(1, (length - (n - 1) + torch.arange(n - 1, device=scores.device)).clamp(min=0))
        matches = (windows[..., :-1] == prefix.unsqueeze(1)).all(dim=-1) & complete
        banned = torch.zeros((scores.shape[0], vocab + 1), dtype=torch.bool, device=scores.device)
        spare = torch.full_like(windows[..., -1], vocab)
        banned = banned.scatter(1, torch.where(matches, windows[..., -1].clamp(max=vocab), spare), True)
        return scores.masked_fill(banned[:, :vocab], NEG_INF)


@dataclass(frozen=True)
class SequenceBias(Stage):
    """``SequenceBiasLogitsProcessor`` and ``NoBadWordsLogitsProcessor`` (its biases are -inf)."""

    groups: tuple[int, ...]  # prefix length of each group of multi-token sequences, in upstream's order
    whole_sequence_fits: bool  # 4.x skips a sequence longer than the context; 5.x one whose prefix is

    @property
    def history(self) -> bool:  # type: ignore[override]
        return bool(self.groups)

    def tensors(self, processor: Any, ctx: Context) -> Tensors:
        return _bias_tensors(processor, ctx, self.groups)

    def apply(self, scores: torch.Tensor, t: Tensors, state: State) -> torch.Tensor:
        bias = torch.zeros_like(scores) + t["single"]
        for g, prefix_length in enumerate(self.groups):
            history, length = state["history"], state["cur_len"]
            positions = (length - prefix_length + torch.arange(prefix_length, device=scores.device)).clamp(min=0)
            suffix = history.index_select(1, positions)  # [rows, m]
            matching = (suffix.unsqueeze(1) == t[f"prefixes{g}"].unsqueeze(0)).all(dim=-1)  # [rows, sequences]
            fits = length >= (prefix_length + 1 if self.whole_sequence_fits else prefix_length)
            added = torch.where(matching & fits, t[f"biases{g}"], 0.0)
            bias = bias.index_add(1, t[f"last{g}"], added)
        return scores + bias


def _bias_groups(processor: Any) -> tuple[list[tuple[int, list[tuple[tuple[int, ...], float]]]], bool]:
    """The multi-token sequences grouped as upstream adds them: 5.x by prefix length, 4.x one by one."""
    sequences = [(tuple(int(i) for i in ids), float(b)) for ids, b in processor.sequence_bias.items() if len(ids) > 1]
    if hasattr(processor, "multi_token_biases"):  # 5.x: grouped by prefix length, in first-seen order
        groups: dict[int, list[tuple[tuple[int, ...], float]]] = {}
        for ids, b in sequences:
            groups.setdefault(len(ids) - 1, []).append((ids, b))
        return list(groups.items()), False
    return [(len(ids) - 1, [(ids, b)]) for ids, b in sequences], True


def _bias_tensors(processor: Any, ctx: Context, groups: tuple[int, ...]) -> Tensors:
    every = [int(i) for ids in processor.sequence_bias for i in ids]
    _in_vocab(every, ctx.vocab, "biased token ids")
    single = torch.zeros((ctx.vocab,), dtype=torch.float32)
    for ids, b in processor.sequence_bias.items():
        if len(ids) == 1:
            single[int(ids[0])] = float(b)
    out: Tensors = {"single": single}
    found, _ = _bias_groups(processor)
    for g, (_, members) in enumerate(found):
        out[f"prefixes{g}"] = torch.tensor([list(ids[:-1]) for ids, _ in members], dtype=torch.long)
        out[f"last{g}"] = torch.tensor([ids[-1] for ids, _ in members], dtype=torch.long)
        out[f"biases{g}"] = torch.tensor([b for _, b in members], dtype=torch.float32)
    assert tuple(m for m, _ in found) == groups
    return out


@dataclass(frozen=True)
class EosGuard(Stage):
    """``MinLengthLogitsProcessor`` and ``MinNewTokensLengthLogitsProcessor``: no EOS before a length."""

    def tensors(self, processor: Any, ctx: Context) -> Tensors:
        minimum = getattr(processor, "min_length", None)
        skip = 0
        if minimum is None:
            minimum, skip = processor.min_new_tokens, processor.prompt_length_to_skip
        return {"eos": _mask(_ids(processor.eos_token_id), ctx.vocab), "min": _scalar(minimum), "skip": _scalar(skip)}

    def apply(self, scores: torch.Tensor, t: Tensors, state: State) -> torch.Tensor:
        early = (state["cur_len"] - t["skip"]) < t["min"]
        return torch.where(early & t["eos"], NEG_INF, scores)


@dataclass(frozen=True)
class Suppress(Stage):
    def tensors(self, processor: Any, ctx: Context) -> Tensors:
        return {"mask": _mask(_ids(processor.suppress_tokens), ctx.vocab)}

    def apply(self, scores: torch.Tensor, t: Tensors, state: State) -> torch.Tensor:
        return torch.where(t["mask"], NEG_INF, scores)


@dataclass(frozen=True)
class SuppressAtBegin(Stage):
    def tensors(self, processor: Any, ctx: Context) -> Tensors:
        return {"mask": _mask(_ids(processor.begin_suppress_tokens), ctx.vocab), "at": _scalar(processor.begin_index)}

    def apply(self, scores: torch.Tensor, t: Tensors, state: State) -> torch.Tensor:
        return torch.where((state["cur_len"] == t["at"]) & t["mask"], NEG_INF, scores)


@dataclass(frozen=True)
class Forced(Stage):
    """``ForcedBOSTokenLogitsProcessor`` (at length 1) and ``ForcedEOSTokenLogitsProcessor`` (at max_length - 1)."""

    def tensors(self, processor: Any, ctx: Context) -> Tensors:
        if hasattr(processor, "bos_token_id"):
            ids, at = _ids(processor.bos_token_id), 1
        else:
            ids, at = _ids(processor.eos_token_id), int(processor.max_length) - 1
        _in_vocab(ids, ctx.vocab, "forced token ids")
        row = torch.full((ctx.vocab,), NEG_INF, dtype=torch.float32)
        row[ids] = 0.0
        return {"row": row, "at": _scalar(at)}

    def apply(self, scores: torch.Tensor, t: Tensors, state: State) -> torch.Tensor:
        return torch.where(state["cur_len"] == t["at"], t["row"].expand_as(scores), scores)


@dataclass(frozen=True)
class InfNanRemove(Stage):
    def apply(self, scores: torch.Tensor, t: Tensors, state: State) -> torch.Tensor:
        info = torch.finfo(scores.dtype)
        out = torch.where(scores != scores, 0.0, scores)
        out = torch.where(scores == math.inf, info.max, out)
        return torch.where(scores == -math.inf, info.min, out)


# ------------------------------------------------------------------ the program


@dataclass(frozen=True)
class Program:
    """The structure of one compiled sampling step."""

    stages: tuple[Stage, ...] = ()
    warpers: frozenset[str] = field(default_factory=frozenset)
    path: str = "vocabulary"  # "candidates", "vocabulary" (see ops) or "greedy" (argmax after the stages)
    candidates: int = 0  # K of the candidates path

    @property
    def presence(self) -> bool:
        return any(s.presence for s in self.stages)

    @property
    def history(self) -> bool:
        return any(s.history for s in self.stages)

    def describe(self) -> str:
        parts = [type(s).__name__ for s in self.stages] + [w for w in WARPER_ORDER if w in self.warpers]
        way = f"{self.path} ({self.candidates})" if self.path == "candidates" else self.path
        return f"{', '.join(parts) or 'no processor'}; {way}"


_interned: dict[Program, Program] = {}


def intern(program: Program) -> Program:
    """The one instance equal to ``program`` (compiled steps are kept per instance)."""
    return _interned.setdefault(program, program)


@dataclass
class Translation:
    """A call's program and its tensors (host): warper values per row, stage tensors, the initial state."""

    program: Program
    params: Tensors
    state: State


def _classes() -> dict[type, str]:
    from transformers.generation import logits_process as lp

    names = {
        "RepetitionPenaltyLogitsProcessor": "repetition",
        "NoRepeatNGramLogitsProcessor": "ngram",
        "SequenceBiasLogitsProcessor": "bias",
        "NoBadWordsLogitsProcessor": "bias",
        "MinLengthLogitsProcessor": "eos_guard",
        "MinNewTokensLengthLogitsProcessor": "eos_guard",
        "SuppressTokensLogitsProcessor": "suppress",
        "SuppressTokensAtBeginLogitsProcessor": "suppress_at_begin",
        "ForcedBOSTokenLogitsProcessor": "forced",
        "ForcedEOSTokenLogitsProcessor": "forced",
        "InfNanRemoveLogitsProcessor": "inf_nan",
        "TemperatureLogitsWarper": "temperature",
        "TopKLogitsWarper": "top_k",
        "TopPLogitsWarper": "top_p",
        "MinPLogitsWarper": "min_p",
    }
    return {getattr(lp, name): kind for name, kind in names.items() if hasattr(lp, name)}


def unsupported(processors: Sequence[Any]) -> str | None:
    """The name of the first processor with no device version (or out of order), or None: cheap, no tensors."""
    try:
        _structure(processors)
    except Unsupported as exc:
        return str(exc)
    return None


def _check_filter(processor: Any) -> None:
    name = type(processor).__name__
    if getattr(processor, "filter_value", NEG_INF) != NEG_INF:
        raise Unsupported(f"{name} (filter_value={processor.filter_value}, only -inf has a device version)")
    if getattr(processor, "min_tokens_to_keep", 1) != 1:
        raise Unsupported(f"{name} (min_tokens_to_keep={processor.min_tokens_to_keep}, only 1 has a device version)")


def _structure(processors: Sequence[Any]) -> tuple[list[tuple[Stage, Any]], dict[str, Any]]:
    classes = _classes()
    stages: list[tuple[Stage, Any]] = []
    warpers: dict[str, Any] = {}
    for processor in processors:
        kind = classes.get(type(processor))
        name = type(processor).__name__
        if kind is None:
            raise Unsupported(name)
        if kind in WARPER_ORDER:
            _check_filter(processor)
            if kind in warpers or any(WARPER_ORDER.index(w) > WARPER_ORDER.index(kind) for w in warpers):
                raise Unsupported(f"{name} (warpers in an order other than {', '.join(WARPER_ORDER)})")
            warpers[kind] = processor
            continue
        if warpers:
            raise Unsupported(f"{name} (after the warpers {', '.join(warpers)})")
        stage: Stage
        if kind == "repetition":
            if any(isinstance(s, RepetitionPenalty) for s, _ in stages):
                raise Unsupported(f"{name} (twice)")
            stage = RepetitionPenalty()
        elif kind == "ngram":
            stage = NoRepeatNGram(int(processor.ngram_size))
        elif kind == "bias":
            found, whole = _bias_groups(processor)
            stage = SequenceBias(tuple(m for m, _ in found), whole)
        elif kind == "eos_guard":
            stage = EosGuard()
        elif kind == "suppress":
            stage = Suppress()
        elif kind == "suppress_at_begin":
            stage = SuppressAtBegin()
        elif kind == "forced":
            stage = Forced()
        else:
            stage = InfNanRemove()
        stages.append((stage, processor))
    return stages, warpers


def translate(
    processors: Sequence[Any], ctx: Context, *, greedy: bool, candidates: int, max_length: int
) -> Translation:
    """The device program of ``processors`` for one call, with its tensors; :class:`Unsupported` if none.

    ``greedy``: the argmax after the full-vocabulary stages (warpers never change it). ``candidates``:
    the ``K`` of the candidates path (``ACCELERATE_NEURON_SAMPLING_TOPK``). ``max_length``: the longest
    sequence the call reaches (the token history's room).
    """
    stages, warpers = _structure(processors)
    params: Tensors = {}
    for i, (stage, processor) in enumerate(stages):
        for key, value in stage.tensors(processor, ctx).items():
            params[f"s{i}.{key}"] = value
    k = min(candidates, ctx.vocab)
    top_k = int(warpers["top_k"].top_k) if "top_k" in warpers else 0
    if greedy:
        path, names = "greedy", frozenset()
    elif (1 <= top_k <= k) or ctx.vocab <= k:
        # Every warper, the absent ones at values that change nothing (temperature 1, no top-k, top_p 1,
        # min_p 0): a call that sets temperature=1.0 (upstream then adds no warper) shares the graph.
        path, names = "candidates", frozenset(WARPER_ORDER)
    else:  # the bisections cost ~50 passes over the vocabulary each: only the ones asked for
        path, names = "vocabulary", frozenset(warpers) | {"temperature", "min_p"}
    if not greedy:
        params.update(_warper_values(warpers, names, ctx.rows))
    program = intern(Program(tuple(s for s, _ in stages), names, path, k if path == "candidates" else 0))
    return Translation(program, params, initial_state(program, ctx, stages, max_length))


def _warper_values(warpers: dict[str, Any], names: frozenset[str], rows: int) -> Tensors:
    """Per-row values of the warpers ``names``: the call's, or for one it lacks a value that changes nothing."""
    temperature = float(warpers["temperature"].temperature) if "temperature" in warpers else 1.0
    top_k = int(warpers["top_k"].top_k) if "top_k" in warpers else 0
    # Upstream compares with the Python float ``1 - top_p`` (double), rounded to float32 by the comparison.
    floor = 1 - float(warpers["top_p"].top_p) if "top_p" in warpers else 0.0
    min_p = float(warpers["min_p"].min_p) if "min_p" in warpers else 0.0
    values = {
        "temperature": torch.full((rows,), temperature, dtype=torch.float32),
        "top_k": torch.full((rows,), top_k, dtype=torch.long),
        "top_p_floor": torch.full((rows,), floor, dtype=torch.float32),
        "min_p": torch.full((rows,), min_p, dtype=torch.float32),
    }
    keys = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p_floor", "min_p": "min_p"}
    return {keys[name]: values[keys[name]] for name in names}


def initial_state(program: Program, ctx: Context, stages: list[tuple[Stage, Any]], max_length: int) -> State:
    ids = ctx.input_ids.to("cpu", torch.long)
    state: State = {"cur_len": _scalar(ids.shape[1])}
    if program.presence:
        penalty = next(p for s, p in stages if isinstance(s, RepetitionPenalty))
        state["presence"] = presence(ids, ctx.vocab, getattr(penalty, "prompt_ignore_length", None))
    if program.history:
        state["history"] = history(ids, max_length)
    return state


def presence(ids: torch.Tensor, vocab: int, ignore: int | torch.Tensor | None) -> torch.Tensor:
    """``[rows, vocab]``: the tokens upstream's repetition penalty sees in ``ids`` (its ``prompt_ignore_length``)."""
    if isinstance(ignore, int) and ignore:
        ids = ids[:, ignore:]
    elif isinstance(ignore, torch.Tensor):
        positions = torch.arange(ids.shape[1])
        ids = ids.masked_fill(positions.unsqueeze(0) < ignore.to("cpu").unsqueeze(1), vocab)
    seen = torch.zeros((ids.shape[0], vocab + 1), dtype=torch.bool)
    seen.scatter_(1, ids.clamp(0, vocab), True)
    return seen[:, :vocab].contiguous()


def history_length(max_length: int) -> int:
    """Room for the token history: a power of two (at least :data:`MIN_HISTORY`), so few lengths compile."""
    return max(MIN_HISTORY, 1 << (max(int(max_length), 1) - 1).bit_length())


def history(ids: torch.Tensor, max_length: int) -> torch.Tensor:
    room = history_length(max(max_length, ids.shape[1] + 1))
    out = torch.zeros((ids.shape[0], room), dtype=torch.long)
    out[:, : ids.shape[1]] = ids
    return out
