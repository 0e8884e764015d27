"""One ``generate()`` call on Neuron, in one object: what it pads, where its tensors live, what comes back.

The ``generate`` wrapper (:mod:`.wrappers`) opens a :class:`GenerateCall` for
every call on a model that is on Neuron and makes it the current one for the
duration (the shape owner of :mod:`..scope`: threads and nested calls each have
their own). Upstream's loop then calls the helpers this plugin wraps, and each
wrapper is a thin adapter that asks the current call:

- ``generate`` entered: :meth:`GenerateCall.open` brings the growing tensors
  to the host and notes the prompt length and the caller's device;
- ``_prepare_cache_for_generation``: :meth:`~GenerateCall.plan` decides the
  prompt bucket (``pad`` columns), whether dummy rows may be added and whether
  the prefill goes through upstream's compiled (chunked) path;
- ``_get_cache`` (4.x) / ``_prepare_static_cache`` (5.x):
  :meth:`~GenerateCall.cache_shape` picks the batch bucket (``dummy`` rows)
  and the cache length;
- ``prepare_inputs_for_generation``: :meth:`~GenerateCall.forward_inputs`
  gives every forward the padded layout (:mod:`.padding`);
- ``_sample``: :meth:`~GenerateCall.choose_greedy` decides whether the greedy
  token is picked on the device, :func:`.sampling.plan` whether a sampled one is
  (``sampling``; every forward's logits then go through it);
- ``get_compiled_call``: :meth:`~GenerateCall.compiled` cuts the dummy rows
  or picks the greedy token after the compiled forward;
- ``generate`` returns: :meth:`~GenerateCall.close` gives back the cache in
  the caller's layout and the result on the caller's device.

Upstream's loop itself works on the caller's own tensors throughout: stopping
criteria, logits processors, streamers and every returned field see what they
would without this plugin.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ... import device as neuron_device
from ... import logs, settings
from .. import layer_regions as regions
from .. import scope, shapes
from . import devices, encoder_decoder, padding
from . import groups as prefill_groups

logger = logging.getLogger(__name__)

#: Generation modes whose prompt may be bucketed, and those whose every forward runs through the compiled call.
_PAD_MODES = frozenset({"greedy_search", "sample", "beam_search", "beam_sample"})
_ROW_MODES = frozenset({"greedy_search", "sample"})
#: Model inputs the padded layout knows how to extend; a tensor under any other name turns bucketing off.
_KNOWN_TENSORS = frozenset({"input_ids", "attention_mask", "position_ids", "token_type_ids", "cache_position"})
_RETURNED_CACHE = ("past_key_values", "cache")


def current(model: Any = None) -> GenerateCall | None:
    """The ``generate()`` call running in this context (of ``model``, if given), or None."""
    call = scope.owner()
    if not isinstance(call, GenerateCall) or (model is not None and call.model is not model):
        return None
    return call


@dataclass
class GenerateCall:
    """The state of one ``generate()`` call on Neuron; ``pad``/``dummy`` are decided before its cache is built."""

    model: Any
    device: torch.device  # the model's Neuron device
    caller: torch.device | None = None  # where the result goes back (None: where upstream puts it)
    prompt: int | None = None  # a decoder-only call's token prompt length (None: no prompt buckets)
    policy: shapes.ShapePolicy | None = None
    batch: int = 0  # rows upstream generates (after num_beams / num_return_sequences expansion)
    pad: int = 0  # columns prepended to every forward
    dummy: int = 0  # rows appended to every forward
    filler: int = 0  # a valid token id for the pad columns (masked out: its value never matters)
    chunked: bool = False  # the prefill goes through upstream's chunked (compiled) path
    may_add_rows: bool = False  # every forward runs through the compiled call, where dummy rows are cut
    greedy: bool = False  # ``_sample`` picks the greedy token on the device
    sampling: Any = None  # ``_sample``'s tokens drawn on the device (a ``sampling.DeviceSampling``)
    forwards: int = 0  # forward inputs prepared so far (the first is the prefill's)
    regional: bool = False  # "compiled" means decoder layers compiled one by one (regions), not the whole model
    has_encoder: bool = False  # an encoder-decoder model (its first decoder step also runs compiled)
    compiled_forward: Callable[..., Any] | None = None  # what upstream's loop calls for a compiled forward
    first_step_routable: bool = False  # the first step is upstream's uncompiled ``self(...)`` (greedy, sampling)
    _unroute: Callable[[], None] | None = None  # undoes a first step routed to the compiled call, if it never ran
    record: str | None = None  # the model's shape record (the sizes its calls see, for fitted buckets)
    may_group: bool = False  # the prefill may run group by group (rows of different prompt buckets)
    groups: list[prefill_groups.Group] | None = None  # the groups the prefill runs as (None: one prefill)
    prefill_on_host: bool = False  # the prefill's inputs stay on the host, for the groups to take their share

    @property
    def padded(self) -> bool:
        return self.pad > 0 or self.dummy > 0

    # ------------------------------------------------------------------ generate() entered

    @classmethod
    def open(
        cls, model: Any, dev: torch.device, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[GenerateCall, tuple[Any, ...], dict[str, Any]]:
        """The call, and ``generate``'s arguments with the growing tensors where the hook wants them."""
        has_encoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
        call = cls(model, dev, regional=regions.enabled(model), has_encoder=has_encoder)
        # Assisted decoding too: it runs on the host's sequence (:mod:`.speculation`), or, when it cannot, its
        # tensors go back to the device for upstream's loop (``wrappers.wrap_assisted_decoding``).
        args, kwargs, call.caller = devices.bring_home(model, dev, args, kwargs)
        call.prompt = _prompt_length(model, args, kwargs)
        return call, args, kwargs

    @contextlib.contextmanager
    def running(self) -> Iterator[GenerateCall]:
        """This call owns the model calls of the block (:mod:`..scope`): no forward inside is padded again."""
        try:
            with scope.owned_by(self):
                yield self
        finally:
            if self._unroute is not None:
                self._unroute()

    # ------------------------------------------------------------------ _prepare_cache_for_generation

    def plan(self, generation_config: Any, model_kwargs: dict[str, Any], mode: str) -> None:
        """Decide ``pad``, whether rows may be added and the compiled prefill, before the cache is built."""
        # Only greedy and sampling (upstream's _sample) run their first step as an uncompiled ``self(...)`` and
        # the later ones through the compiled call; a caller's chunked prefill runs the compiled call itself.
        self.first_step_routable = mode in _ROW_MODES and getattr(generation_config, "prefill_chunk_size", None) is None
        if not self.prompt:
            return
        reason = self._unbucketed_reason(generation_config, model_kwargs, mode)
        if reason is not None:
            logger.debug("accelerate_neuron: generate() prompt/batch buckets off for this call: %s", reason)
            return
        self.record = shapes.record_key(self.model)
        policy = shapes.resolve_policy(shapes.max_positions(self.model), self.record)
        if not policy.prompt_buckets and not policy.batch_buckets:
            return
        self.policy = policy
        bucket = policy.prompt_buckets.pad_to(self.prompt, "generate()", "prompt length")
        if self.prompt > 1:  # a one-token prompt already has the decode step's shape
            self.pad = bucket - self.prompt
        # One chunk of the whole prompt: upstream then runs the prefill through the compiled call (both 4.x and
        # 5.x compile chunked prefills), one graph per bucket. 4.x prefills all but the last token there.
        # generate() works on its own copy of the generation config, so the caller's stays as it was.
        if self.prompt > 1 and hasattr(generation_config, "prefill_chunk_size"):
            generation_config.prefill_chunk_size = self.prompt
            self.chunked = True
        compiles = self.chunked and self.compiles(generation_config)
        self.may_add_rows = compiles and bool(policy.batch_buckets) and mode in _ROW_MODES
        # Greedy and sampling prefill through the compiled call on every release (4.x's beam search does not).
        self.may_group = compiles and bool(policy.prompt_buckets) and mode in _ROW_MODES and settings.get("group_rows")
        self.filler = shapes.pad_id(self.model.config, vocab=getattr(self.model.config, "vocab_size", None))

    def _unbucketed_reason(self, generation_config: Any, model_kwargs: dict[str, Any], mode: str) -> str | None:
        if getattr(generation_config, "cache_implementation", None) != "static":
            return "no static KV cache"
        if any(model_kwargs.get(k) is not None for k in ("cache", "past_key_values", "cache_params")):
            return "a cache passed by the caller"
        if mode not in _PAD_MODES or getattr(generation_config, "is_assistant", False):
            return f"generation mode {mode!r}"
        if getattr(generation_config, "prefill_chunk_size", None) is not None:
            return "prefill_chunk_size set by the caller"
        if padding.returns_padded_shapes(generation_config):
            return "attentions or hidden states requested (their shapes would show the padding)"
        others = sorted(k for k, v in model_kwargs.items() if isinstance(v, torch.Tensor) and k not in _KNOWN_TENSORS)
        if others:
            return f"model inputs {others} (only token ids, masks and positions are padded)"
        return None

    def compiles(self, generation_config: Any) -> bool:
        """Whether every forward will run through upstream's compiled call (where dummy rows are cut).

        Upstream's own test (``_valid_auto_compile_criteria``) needs the cache, which is not built yet; these
        are its conditions for a static cache. :meth:`rows_confirmed` checks the answer once the cache exists.
        """
        if getattr(generation_config, "disable_compile", False):
            return False
        if devices.split_across_devices(self.model) and not self.regional:
            return False
        quantizer = getattr(self.model, "hf_quantizer", None)
        if quantizer is not None and not getattr(quantizer, "is_compileable", False):
            return False
        device_map = getattr(self.model, "hf_device_map", None)
        if isinstance(device_map, dict):
            places = {str(d) for d in device_map.values()}
            if "disk" in places or ("cpu" in places and len(places) > 1):
                return False
        return True

    def rows_confirmed(self, model_kwargs: dict[str, Any], generation_config: Any) -> bool:
        """After the cache is built: False (and the rows given up) if upstream will not compile after all."""
        if not (self.dummy or self.may_group) or self.model._valid_auto_compile_criteria(
            model_kwargs, generation_config
        ):
            return True
        logger.debug("accelerate_neuron: generate() will not run compiled after all: batch buckets off for this call")
        self.may_group = False  # the groups' prefill runs in the compiled call too
        if not self.dummy:
            return True
        self.dummy = 0
        self.may_add_rows = False
        for key in ("cache", "past_key_values"):
            model_kwargs.pop(key, None)
        return False

    def announce(self) -> None:
        """One line, the first time a call is padded: what, and how to opt out."""
        if not self.padded or self.policy is None:
            return
        policy = self.policy
        logs.once(
            logger,
            "generation.buckets",
            "accelerate_neuron: generate() on Neuron pads prompts to length buckets (%s) and batches to size "
            "buckets (%s), and compiles the prefill, so varied prompts reuse a few compiled graphs (this call: "
            "prompt %d -> %d tokens, batch %d -> %d rows; results are the unpadded ones). Opt out with %s=off and "
            "%s=off.",
            policy.prompt_buckets.short(),
            policy.batch_buckets.short(),
            self.prompt,
            self.prompt + self.pad,
            self.batch,
            self.batch + self.dummy,
            settings.env_name("prompt_buckets"),
            settings.env_name("batch_buckets"),
        )

    # ------------------------------------------------------------------ the KV cache's shape

    def cache_shape(self, batch: Any, requested: Any) -> tuple[Any, Any]:
        """(batch, length) to allocate the static cache with: the batch bucket, and room for the pad slots."""
        if isinstance(batch, int):
            self.batch = batch
            if self.may_add_rows and self.policy is not None:
                bucket = self.policy.batch_buckets.pad_to(batch, "generate()", "batch size")
                self.dummy = bucket - batch
                batch = bucket
        if isinstance(requested, int):
            requested += self.pad
        return batch, requested

    # ------------------------------------------------------------------ each forward

    def forward_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict]:
        """``prepare_inputs_for_generation``'s arguments, in the padded layout when this call is bucketed."""
        first = self.forwards == 0
        self.forwards += 1
        if first and self.has_encoder and self.first_step_routable and self.compiled_forward and not self.regional:
            # Upstream runs the first step uncompiled; an encoder-decoder's differs from the later ones only by
            # filling the cross-attention cache: one graph more instead of every op of a step run eagerly.
            self._unroute = encoder_decoder.route_next_call(self.model, self.compiled_forward)
        if first:
            self._plan_prefill(args, kwargs)
        padding.count_positions(self, first, args, kwargs)
        if not (self.padded or self.chunked):
            return args, kwargs
        return padding.pad_forward_inputs(self, first, args, kwargs)

    def _plan_prefill(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Before the prefill: which groups it runs as (rows of different prompt buckets), and the sizes noted."""
        if self.policy is None or not self.prompt:
            return
        ids = args[0] if args else kwargs.get("input_ids")
        rows = int(ids.shape[0]) if isinstance(ids, torch.Tensor) else self.batch
        row_extents = self._extents(kwargs.get("attention_mask"), rows)
        self.groups = self._groups(row_extents, rows)
        self.prefill_on_host = self.groups is not None
        for extent in row_extents:  # the sizes the prompt buckets apply to: each row's, grouped
            shapes.note(self.record, "prompt_buckets", extent)
        for size in [len(g.rows) for g in self.groups] if self.groups else [rows]:
            shapes.note(self.record, "batch_buckets", size)

    def prefill_shapes(self, model_kwargs: dict[str, Any], rows: int) -> list[list[int]] | None:
        """The (rows, columns) of each group the prefill will run as, before it runs (the warm-up's keys)."""
        if self.policy is None or not self.prompt:
            return None
        return prefill_groups.shapes_of(self._groups(self._extents(model_kwargs.get("attention_mask"), rows), rows))

    def _extents(self, mask: Any, rows: int) -> list[int]:
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.device.type == "cpu" and mask.shape[0] == rows:
            return prefill_groups.extents(mask, self.prompt or 0)
        return [self.prompt or 0] * rows

    def _groups(self, row_extents: list[int], rows: int) -> list[prefill_groups.Group] | None:
        if not self.may_group or self.policy is None:
            return None
        return prefill_groups.plan(
            row_extents,
            self.prompt + self.pad,
            self.policy.prompt_buckets,
            self.policy.batch_buckets,
            rows + self.dummy,
        )

    def choose_greedy(self, input_ids: Any, logits_processor: Any, config: Any) -> bool:
        """Whether ``_sample`` may pick the argmax on the device and bring back one id per row.

        Only when nothing on the host needs the logits row: greedy, no logits
        processor, no scores/logits returned, and ids kept off the device.
        """
        self.greedy = False
        if config is None or getattr(config, "do_sample", True):
            return False
        if getattr(config, "output_scores", False) or getattr(config, "output_logits", False):
            return False
        if getattr(config, "is_assistant", False):
            return False
        if logits_processor is None or len(logits_processor) != 0:
            return False
        if not isinstance(input_ids, torch.Tensor) or input_ids.device.type == neuron_device.DEVICE_TYPE:
            return False
        target = devices.tensor_device("logits", self.device)
        self.greedy = target is not None and target.type == neuron_device.DEVICE_TYPE
        return self.greedy

    def regional_call(self) -> Callable[..., Any]:
        """What "compiled" means with regions: the model's own call, its decoder layers compiled one by one."""
        model = self.model

        def call_with_compiled_layers(*args: Any, **kwargs: Any) -> Any:
            with regions.compiled_layers(model):
                return model(*args, **kwargs)

        return call_with_compiled_layers

    def compiled(self, call: Callable[..., Any]) -> Callable[..., Any]:
        """Upstream's compiled forward (the prefill group by group when :attr:`groups` says so), followed by the
        greedy pick on the device or the dummy rows' cut."""
        if (self.padded or self.may_group) and not self.regional:
            shapes.make_room_for_buckets()
        greedy = self.greedy
        # Sampling on the device picks from the logits where they are (dummy rows included) afterwards.
        sampling = self.sampling is not None
        if not self.may_group and (sampling or (not greedy and not self.dummy)):
            self.compiled_forward = call
            return call
        rows = self.batch if self.dummy else None

        def compiled_then_select(*args: Any, **kwargs: Any) -> Any:
            if self.prefill_on_host:
                self.prefill_on_host = False
                if not args and self.groups and prefill_groups.groupable(kwargs):
                    outputs = prefill_groups.prefill(
                        call,
                        kwargs,
                        self.groups,
                        self.prompt + self.pad,
                        self.device,
                        greedy,
                        self.model.config,
                        keep_on_device=sampling,
                    )
                    if sampling:
                        return outputs
                    return shapes.last_logits_of_rows(outputs, self.batch, self.batch + self.dummy)
                self.groups = None  # not a prefill the groups can take apart: it runs as one, on the device
                args, kwargs = devices.move(args, self.device), devices.move(kwargs, self.device)
            outputs = call(*args, **kwargs)
            if sampling:
                return outputs
            if greedy:
                return devices.select_greedy(outputs, rows)
            if self.dummy:
                return shapes.last_logits_of_rows(outputs, self.batch, self.batch + self.dummy)
            return outputs

        self.compiled_forward = compiled_then_select
        return compiled_then_select

    # ------------------------------------------------------------------ generate() returns

    def close(self, result: Any) -> Any:
        """The result as the caller expects it: a returned cache in their layout, on their device."""
        if self.padded and isinstance(result, dict):
            # 5.x: "cache" (and "past_key_values" an alias of it, not a key); 4.x: the latter.
            for key in _RETURNED_CACHE:
                if key in result.keys() and result[key] is not None:
                    result[key] = shapes.unpadded_static_cache(result[key], self.pad, self.batch)
        return devices.send_back(result, self.caller)


def _prompt_length(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """Length of a decoder-only call's token prompt (None: nothing the prompt buckets apply to).

    An encoder-decoder model's encoder input is bucketed instead (:func:`.padding.encoder_pad`).
    """
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return None
    value = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.is_floating_point():
        return None
    if kwargs.get("inputs_embeds") is not None:
        return None
    return int(value.shape[1])
