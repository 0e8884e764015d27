"""Speculative decoding on Neuron: assisted generation and prompt lookup, compiled at bounded shapes.

Upstream's ``_assisted_decoding`` feeds the target model the prompt plus candidates, then the last token plus
each round's candidates, on a dynamic cache it crops after every round, and keeps the sequence on the model's
device: on Neuron every round is a new set of op shapes (hundreds of eager compiles per new prompt length). A
:class:`SpeculativeCall` runs the same algorithm with

- the target on a :class:`~.rollback.Runner`: a static cache rolled back by position, each forward right-padded
  to a width (:mod:`.widths`: the prompt buckets for the first forward, 1 + a candidate bucket for every
  verification) and compiled: one graph per (width, cache length);
- the draft, when there is one on Neuron, driven by upstream's own candidate generator, its forwards on a runner
  too (:mod:`.draft`); prompt lookup's candidate search stays on the host, as upstream does it;
- the sequence, the masks and every decision (which candidates the target accepts, the logits processors,
  speculative sampling, stopping criteria) on the host, so no op on the device depends on a length.

Greedy verification takes the target's argmax on the device (one id per position crosses), unless something on
the host needs the logits rows. The tokens are the unpadded call's: a padded position only ever writes KV slots
beyond the real tokens, which no real query attends to.

A call this cannot run at bounded shapes (an encoder-decoder, a sliding-window cache, a model split over cores,
attentions or hidden states asked for, inputs beyond ids and mask, early exit, batch > 1, ...) goes to
upstream's loop, its reason logged at debug level. Each call's acceptance (accepted candidates per target
forward, target forwards per token) is logged at debug level and added to the base layer's
:mod:`accelerate_neuron.speculation_accounting`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Iterator
from typing import Any

import torch

from ... import device as neuron_device
from ... import settings, speculation_accounting
from .. import layer_regions as regions
from .. import shapes
from . import devices, draft, rollback, widths

logger = logging.getLogger(__name__)

#: Candidate generators whose drafting this runs at bounded shapes (upstream's classes, by name).
_GENERATORS = frozenset(
    {
        "AssistedCandidateGenerator",
        "AssistedCandidateGeneratorDifferentTokenizers",
        "UniversalSpeculativeDecodingGenerator",
        "PromptLookupCandidateGenerator",
    }
)
#: Model inputs of a speculative call this knows how to carry: the ids (the sequence), the 2D mask and the positions
#: generate() derives from it (5.x passes them).
_KNOWN_TENSORS = frozenset({"attention_mask", "position_ids"})
_CACHE_NAMES = ("cache", "past_key_values")


class Declined(Exception):
    """This call runs in upstream's loop instead; the message says why."""


@functools.lru_cache(maxsize=1)
def _speculative_sampling() -> tuple[Any, bool]:
    """Upstream's speculative-sampling step, and whether it is the 4.x one (it takes ``is_done_candidate``; 4.x
    also accepts one fewer candidate when the candidates alone meet a stopping criterion, where 5.x crops the
    accepted tokens at the length budget and the first EOS)."""
    from transformers.generation.utils import _speculative_sampling as step

    return step, "is_done_candidate" in inspect.signature(step).parameters


def decline_reason(
    model: Any, input_ids: Any, generation_config: Any, synced_gpus: bool, assistant: Any, model_kwargs: dict
) -> str | None:
    """Why this assisted call cannot run at bounded shapes on Neuron (None: it can)."""
    if not settings.get_quietly("speculation"):
        return f"{settings.env_name('speculation')}=off"
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        return "not one row of token ids (upstream runs assisted decoding for a batch of 1 only)"
    if not model_kwargs.get("use_cache", True):
        return "use_cache=False"
    if getattr(generation_config, "assistant_early_exit", None) is not None:
        return "early exit (the draft is the target's own first layers)"
    if any(getattr(generation_config, k, False) for k in ("output_attentions", "output_hidden_states")):
        return "attentions or hidden states requested (their shapes would show the padding)"
    if synced_gpus:
        return "synced_gpus"
    others = sorted(
        k
        for k, v in model_kwargs.items()
        if isinstance(v, torch.Tensor) and k not in _KNOWN_TENSORS and k not in _CACHE_NAMES
    )
    if others:
        return f"model inputs {others} (only token ids and the attention mask are carried)"
    mask = model_kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and (mask.dim() != 2 or mask.shape[-1] != input_ids.shape[-1]):
        return "an attention mask that is not one 2D row per token"
    if not _derived_positions(model_kwargs.get("position_ids"), mask, input_ids.shape[-1]):
        return "position ids other than the attention mask's (the runner derives them from the mask)"
    for role, candidate in (("target", model), ("draft", assistant)):
        if candidate is None or devices.model_device(candidate) is None:
            continue  # a draft on the host runs there, as upstream runs it
        if devices.split_across_devices(candidate) or regions.enabled(candidate):
            return f"the {role} model is split over several cores"
        reason = rollback.unsupported_reason(candidate)
        if reason is not None:
            return f"the {role} model: {reason}"
    return None


def _derived_positions(positions: Any, mask: Any, length: int) -> bool:
    """Whether ``positions`` (None, or 5.x's own) are what the mask gives every real token: the runner's too."""
    if positions is None:
        return True
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2 or positions.shape != (1, length):
        return False
    positions = positions.to("cpu")
    real = torch.ones((1, length), dtype=torch.bool) if mask is None else mask.to("cpu").bool()
    expected = real.long().cumsum(-1) - 1
    return bool(torch.equal(positions[real], expected[real]))


def _schedule(generator: Any) -> tuple[str | None, Any]:
    """The draft's candidate schedule and the config holding it (5.x keeps a copy on the generator)."""
    config = getattr(generator, "assistant_generation_config", None)
    if config is None:
        config = getattr(getattr(generator, "assistant_model", None), "generation_config", None)
    return getattr(config, "num_assistant_tokens_schedule", None), config


def _candidate_limit(generator: Any) -> int:
    """How many candidates the generator proposes at most this round (0: unknown)."""
    for name in ("num_assistant_tokens", "num_output_tokens"):
        value = getattr(generator, name, None)
        if isinstance(value, int | float) and value > 0:
            return int(value)
    return 0


def _fixed_limit(generator: Any) -> int | None:
    """The candidate limit when it cannot change during the call (then it is a verification width of its own)."""
    if type(generator).__name__ == "PromptLookupCandidateGenerator":
        return _candidate_limit(generator) or None
    schedule, _ = _schedule(generator)
    return (_candidate_limit(generator) or None) if schedule == "constant" else None


class SpeculativeCall:
    """One assisted ``generate()`` call on Neuron, run at bounded shapes."""

    def __init__(self, model: Any, bound: dict[str, Any]) -> None:
        self.model = model
        self.device = model.device
        self.input_ids: torch.Tensor = bound["input_ids"].to("cpu")
        self.logits_processor = bound["logits_processor"]
        self.stopping_criteria = bound["stopping_criteria"]
        self.config = bound["generation_config"]
        self.streamer = bound.get("streamer")
        self.model_kwargs: dict[str, Any] = dict(bound.get("model_kwargs") or {})
        self.assistant = bound.get("assistant_model")
        self.bound = bound
        self.figures = speculation_accounting.Acceptance()
        self.generator: Any = None
        self.draft_runner: rollback.Runner | None = None
        self.cache_key = "cache" if "cache" in self.model_kwargs else "past_key_values"

    # ------------------------------------------------------------------ set-up

    def _build_generator(self) -> Any:
        b = self.bound
        kwargs = {k: v for k, v in self.model_kwargs.items()}
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            kwargs["attention_mask"] = mask.to("cpu")
        on_neuron = self.assistant is not None and devices.model_device(self.assistant) is not None
        generator = self.model._get_candidate_generator(
            generation_config=self.config,
            input_ids=self.input_ids,
            inputs_tensor=_to_host(b.get("inputs_tensor")),
            assistant_model=draft.HostView(self.assistant) if on_neuron else self.assistant,
            logits_processor=self.logits_processor,
            target_tokenizer=b.get("tokenizer"),
            assistant_tokenizer=b.get("assistant_tokenizer"),
            model_kwargs=kwargs,
        )
        if type(generator).__name__ not in _GENERATORS:
            raise Declined(f"candidate generator {type(generator).__name__}")
        assistant_kwargs = getattr(generator, "assistant_kwargs", None)
        if isinstance(assistant_kwargs, dict):
            for key, value in list(assistant_kwargs.items()):
                if isinstance(value, torch.Tensor):
                    assistant_kwargs[key] = value.to("cpu")
        return generator

    def _target_runner(self, fixed: int | None) -> rollback.Runner:
        w = widths.widths_for(shapes.max_positions(self.model), fixed)
        verify = w.width(2, first=False, floor=max(_candidate_limit(self.generator), 1))
        return rollback.Runner(
            self.model,
            self.model.forward,
            w,
            capacity_hint=int(self.config.max_length) + verify,
            compiled=not getattr(self.config, "disable_compile", False),
        )

    def _draft_runner(self) -> rollback.Runner | None:
        if self.assistant is None or devices.model_device(self.assistant) is None:
            return None
        w = widths.widths_for(shapes.max_positions(self.assistant))
        return rollback.Runner(
            self.assistant,
            draft.own_forward(self.assistant),
            w,
            capacity_hint=int(self.config.max_length) + w.width(2, first=False),
            compiled=not getattr(self.config, "disable_compile", False),
        )

    @contextlib.contextmanager
    def _drafting(self) -> Iterator[None]:
        if self.draft_runner is None:
            yield
            return
        self.generator.assistant_kwargs[self.cache_key] = rollback.position_cache(self.draft_runner)
        with draft.drafting(self.assistant):
            yield

    # ------------------------------------------------------------------ the loop

    def run(self) -> Any:
        self.generator = self._build_generator()
        fixed = _fixed_limit(self.generator)
        self.target = self._target_runner(fixed)
        self.draft_runner = self._draft_runner()
        try:
            with self._drafting():
                sequences, scores, raw_logits = self._loop()
        finally:
            self._restore_generator()
        self._report()
        if self.streamer is not None:
            self.streamer.end()
        if not self.config.return_dict_in_generate:
            return sequences
        return self._output(sequences, scores, raw_logits)

    def _pick_on_device(self) -> bool:
        """Whether verification may take the argmax on the device: nothing on the host needs the logits rows."""
        c = self.config
        if c.do_sample or getattr(c, "assistant_ensemble_weight", None) is not None:
            return False
        if c.output_scores or c.output_logits or len(self.logits_processor) != 0:
            return False
        target = devices.tensor_device("logits", self.device)
        return target is not None and target.type == neuron_device.DEVICE_TYPE

    def _loop(self) -> tuple[torch.Tensor, tuple | None, tuple | None]:
        c = self.config
        step, legacy = _speculative_sampling()
        keep = rollback.KEEP_ARGMAX if self._pick_on_device() else rollback.KEEP_ALL
        vocab = self.model.config.get_text_config().vocab_size
        scores = () if c.return_dict_in_generate and c.output_scores else None
        raw_logits = () if c.return_dict_in_generate and c.output_logits else None
        input_ids = self.input_ids
        mask = self.model_kwargs.get("attention_mask")
        mask = mask.to("cpu") if isinstance(mask, torch.Tensor) else None
        unfinished = torch.ones(1, dtype=torch.long)
        eos = getattr(c, "_eos_token_tensor", None)
        weight = getattr(c, "assistant_ensemble_weight", None)
        while True:
            cur_len = input_ids.shape[1]
            drafted_before = self.draft_runner.forwards if self.draft_runner else 0
            candidate_ids, candidate_logits = self.generator.get_candidates(input_ids)
            candidate_ids = candidate_ids.to("cpu")
            if candidate_logits is not None:
                candidate_logits = candidate_logits.to("cpu")
            k = candidate_ids.shape[1] - cur_len
            is_done_candidate = self.stopping_criteria(candidate_ids, None) if legacy else None

            # The target's forward: what its cache does not hold yet (the prompt, or the last accepted token),
            # and the candidates; rows cur_len - 1 ... cur_len - 1 + k are the ones that judge the candidates.
            start = self.target.length
            step_mask = _extend(mask, candidate_ids.shape[1])
            limit = _candidate_limit(self.generator)
            picked = self.target.forward(candidate_ids[:, start:], step_mask, keep, floor=limit)
            first = cur_len - 1 - start
            rows = picked[:, first : first + k + 1]
            if keep == rollback.KEEP_ARGMAX:
                selected = rows
                new_logits = _one_hot(rows, vocab)
            else:
                new_logits = rows.contiguous()
            next_token_logits = new_logits.clone() if raw_logits is not None else None
            if len(self.logits_processor) > 0:
                for i in range(k + 1):
                    new_logits[:, i, :] = self.logits_processor(candidate_ids[:, : cur_len + i], new_logits[:, i, :])

            if c.do_sample and candidate_logits is not None:
                extra = is_done_candidate if legacy else weight
                valid_tokens, n_matches = step(candidate_ids, candidate_logits, k, new_logits, extra)
            else:
                if c.do_sample:
                    probs = new_logits.softmax(dim=-1)
                    selected = torch.multinomial(probs[0, :, :], num_samples=1).squeeze(1)[None, :]
                elif keep != rollback.KEEP_ARGMAX:
                    if weight is not None and candidate_logits is not None:
                        target_probs = new_logits[:, :k, :].softmax(-1)
                        mixed = weight * target_probs + (1.0 - weight) * candidate_logits.softmax(-1)
                        selected = torch.cat([mixed.argmax(-1), new_logits[:, k:, :].argmax(-1)], dim=-1)
                    else:
                        selected = new_logits.argmax(dim=-1)
                candidates = candidate_ids[:, cur_len:]
                n_matches = int(((~(candidates == selected[:, :-1])).cumsum(dim=-1) < 1).sum())
                if legacy and bool(is_done_candidate) and n_matches == k:
                    n_matches -= 1
                valid_tokens = selected[:, : n_matches + 1]
            if not legacy:
                valid_tokens = _within_budget(valid_tokens, int(c.max_length) - cur_len, eos)
            n_matches = valid_tokens.shape[1] - 1

            input_ids = torch.cat((input_ids, valid_tokens.to(input_ids.dtype)), dim=-1)
            if self.streamer is not None:
                self.streamer.put(valid_tokens.cpu())
            # The target's cache keeps every accepted token but the last, which the next round feeds it.
            self.target.rollback(input_ids.shape[1] - 1)
            self.generator.update_candidate_strategy(input_ids, new_logits, n_matches)
            mask = _extend(mask, input_ids.shape[1])

            self.figures.target_forwards += 1
            self.figures.candidates += k
            self.figures.accepted += n_matches
            self.figures.tokens += n_matches + 1
            if self.draft_runner is not None:
                self.figures.draft_forwards += self.draft_runner.forwards - drafted_before
            if scores is not None:
                scores += tuple(new_logits[:, i, :] for i in range(n_matches + 1))
            if raw_logits is not None:
                raw_logits += tuple(next_token_logits[:, i, :] for i in range(n_matches + 1))
            unfinished = unfinished & ~self.stopping_criteria(input_ids, scores)
            if unfinished.max() == 0:
                return input_ids, scores, raw_logits

    # ------------------------------------------------------------------ the end

    def _restore_generator(self) -> None:
        generator = self.generator
        if isinstance(getattr(generator, "assistant_model", None), draft.HostView):
            generator.assistant_model = self.assistant
        schedule, _ = _schedule(generator)
        if self.assistant is not None and schedule == "heuristic" and hasattr(generator, "num_assistant_tokens"):
            # Upstream keeps the heuristic's count on the assistant between calls.
            self.assistant.generation_config.num_assistant_tokens = generator.num_assistant_tokens

    def _report(self) -> None:
        f = self.figures
        speculation_accounting.record(f)
        logger.debug(
            "accelerate_neuron: speculative generate() on Neuron: %d target forwards for %d tokens (%.2f per token), "
            "%d of %d candidates accepted (%.2f per target forward), %d draft forwards",
            f.target_forwards,
            f.tokens,
            f.forwards_per_token,
            f.accepted,
            f.candidates,
            f.accepted_per_forward,
            f.draft_forwards,
        )

    def _output(self, sequences: torch.Tensor, scores: tuple | None, raw_logits: tuple | None) -> Any:
        from dataclasses import fields

        from transformers.generation.utils import GenerateDecoderOnlyOutput

        names = {f.name for f in fields(GenerateDecoderOnlyOutput)}
        cache_field = "cache" if "cache" in names else "past_key_values"
        return GenerateDecoderOnlyOutput(
            sequences=sequences,
            scores=scores,
            logits=raw_logits,
            attentions=None,
            hidden_states=None,
            **{cache_field: self.target.returned_cache()},
        )


def _to_host(value: Any) -> Any:
    return value.to("cpu") if isinstance(value, torch.Tensor) else value


def _extend(mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """The 2D mask for ``length`` tokens: the caller's, then ones for every token generated or proposed since."""
    if mask is None or mask.shape[-1] == length:
        return mask
    if mask.shape[-1] > length:
        return mask[:, :length]
    return torch.cat([mask, mask.new_ones((mask.shape[0], length - mask.shape[-1]))], dim=-1)


def _one_hot(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Host rows whose argmax is ``ids``: what the candidate strategy reads when the device picked the tokens."""
    rows = torch.zeros((*ids.shape, vocab), dtype=torch.float32)
    return rows.scatter_(-1, ids.unsqueeze(-1), 1.0)


def _within_budget(tokens: torch.Tensor, budget: int, eos: Any) -> torch.Tensor:
    """5.x: accepted tokens cut at the length budget and after the first EOS."""
    if tokens.shape[1] > budget:
        tokens = tokens[:, : max(budget, 0)]
    if isinstance(eos, torch.Tensor) and tokens.numel():
        hits = torch.isin(tokens.squeeze(0), eos.to(tokens.device)).nonzero()
        if hits.numel() > 0:
            tokens = tokens[:, : int(hits[0]) + 1]
    return tokens


def decode(model: Any, bound: dict[str, Any]) -> Any:
    """Run ``_assisted_decoding``'s call (``bound``: its arguments by name) at bounded shapes; :class:`Declined`
    if it cannot."""
    reason = decline_reason(
        model,
        bound.get("input_ids"),
        bound.get("generation_config"),
        bool(bound.get("synced_gpus", False)),
        bound.get("assistant_model"),
        bound.get("model_kwargs") or {},
    )
    if reason is not None:
        raise Declined(reason)
    return SpeculativeCall(model, bound).run()
