"""Built-in plugin ``serving``: Transformers' continuous batching on Neuron with a bounded set of compiled graphs.

``model.generate_batch(...)``, ``model.init_continuous_batching()`` and
``transformers serve --continuous-batching`` run many requests at once over a
paged KV cache. Stock, on Neuron, every batch composition is a new shape: the
step runs eagerly and compiles op after op forever. With this plugin, for a
model on Neuron:

- each step is padded to a (query tokens, KV tokens) bucket and compiled with
  the ``"neuron"`` backend (``dynamic=False``): :mod:`.plan` (the buckets, the
  cache's size), :mod:`.steps` (padding, the warm-up over the whole grid, a
  warning if a warm server still compiles);
- the per-request bookkeeping upstream does on the device is done on the host
  and sent once per step at the bucket's shape (:mod:`.staging`), and the paged
  cache's update, which upstream keeps out of the graph, runs the same eager
  shapes for every layer (:mod:`.cache_update`): the eager work is bounded by
  the buckets too;
- a sampling step's per-request warpers run without sorting the vocabulary and
  the draw uses the device's uniform random numbers instead of
  ``torch.multinomial``, inside the compiled step (:mod:`.sampling`);
- a request that cannot fit the KV cache gets a clear error (:mod:`.wrappers`);
  a prompt beyond the step's token budget is split across steps, as upstream does.

It is its own plugin rather than part of ``generation``: it patches another
upstream package (``generation.continuous_batching``, not ``generate()``'s
loop), has its own settings, and ``ACCELERATE_NEURON_DISABLE=serving`` turns it
off alone. Settings: ``serving_token_buckets``, ``serving_kv_buckets``,
``serving_kv_cache_tokens`` (``off`` buckets: upstream's eager path). Hooks with
built-in answers here: ``neuron_serving_shape_policy``,
``neuron_compile_config`` (purpose ``"serving"``). Documentation: docs/serving.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...hookspecs import hookimpl
from ...patching import Patch
from . import cache_update, plan, sampling, staging, steps, wrappers

CB = plan.CB
_LACKING = (
    "every release whose continuous batching has compile configs and padding (5.x); 4.57's earlier continuous "
    "batching has neither (no model_runner module), so these patches skip there"
)


def _continuous_batching(module: str, target: str, wrapper: Callable[[Any], Any], **details: Any) -> Patch:
    """A patch of ``transformers.generation.continuous_batching.<module>``: skipped where that continuous batching
    is missing (4.57) and while the step is not padded (``off`` buckets)."""
    return Patch(f"{CB}.{module}", target, wrapper, lacking=_LACKING, needed=plan.without_step_padding, **details)


@hookimpl
def neuron_patches() -> list[Patch]:
    return [
        _continuous_batching(
            "initialization",
            "resolve_continuous_batching_config",
            wrappers.wrap_resolve_config,
            reason="continuous batching on Neuron gets a token budget, a KV cache sized for the core, a request cap "
            "and the 'neuron' compile config of its step, where the caller set none",
            params=("config", "cb_config", "workload_hints", "device"),
            aliases=(f"{CB}.continuous_api.resolve_continuous_batching_config",),
            name="serving.config",
        ),
        _continuous_batching(
            "continuous_api",
            "ContinuousBatchingIOs",
            staging.wrap_io_class,
            reason="a step's inputs are built on the host and sent once per step at the bucket's shape, instead "
            "of request-sized device writes that compile eager ops for every batch composition",
            params=("cache", "config", "continuous_batching_config", "device", "model_dtype", "logit_processor"),
            name="serving.host_staging",
        ),
        _continuous_batching(
            "model_runner",
            "ModelRunner.maybe_pad_inputs",
            steps.wrap_maybe_pad_inputs,
            reason="a step is padded to (query-token, KV-token) buckets, so its compiled graphs and the eager cache "
            "update see a bounded set of shapes",
            params=("num_q_tokens", "max_kv_read", "use_decode_fast_path"),
            name="serving.buckets",
        ),
        _continuous_batching(
            "model_runner",
            "ModelRunner.warmup",
            steps.wrap_warmup,
            reason="the warm-up runs every bucket shape (upstream: the largest only), so a warm server compiles "
            "nothing; in precompile workers each shape is claimed, so --jobs splits them",
            params=("model",),
            name="serving.warmup",
        ),
        _continuous_batching(
            "model_runner",
            "ModelRunner.compute_batch",
            steps.wrap_compute_batch,
            reason="a step that compiles after the warm-up is warned about (a stall of minutes on Neuron)",
            params=("model", "batch_data"),
            name="serving.watchdog",
        ),
        _continuous_batching(
            "cache_allocators.full_attention",
            "FullAttentionCacheAllocator.update",
            cache_update.wrap_update,
            reason="the paged cache's eager update (kept out of the graph upstream) indexes the whole cache at "
            "shifted rows, so every layer runs the same eager shapes instead of one set per layer",
            params=("key_states", "value_states", "layer_idx", "read_index", "write_index"),
            name="serving.cache_update",
        ),
        _continuous_batching(
            "cache",
            "PagedAttentionCache.update",
            cache_update.wrap_paged_update,
            reason="the paged cache's update is traced into the step on Neuron (upstream wraps it in "
            "torch.compiler.disable: a graph break per layer, so a step was 2 x layers + 1 graphs with a host round "
            "trip between each); one graph per (query, KV) bucket",
            params=("self", "key_states", "value_states", "layer_idx", "kwargs"),
            name="serving.traced_cache_update",
        ),
        _continuous_batching(
            "cb_logits_processors",
            "ContinuousBatchingLogitsProcessorList.__call__",
            sampling.wrap_processor_list_call,
            reason="on Neuron a sampling step's warpers (temperature, top-k, top-p, per request) run without sorting "
            "the vocabulary: top-k on each row's best 256 tokens, top-p by bisection when there is no top-k",
            params=("input_ids", "scores", "logits_processor_args"),
            name="serving.sampling_warpers",
        ),
        _continuous_batching(
            "model_runner",
            "ModelRunner._sample",
            sampling.wrap_runner_sample,
            reason="on Neuron the next token is drawn from the device's random numbers with uniform draws (the "
            "exponential race) instead of torch.multinomial, inside the compiled step",
            params=("scores", "output_ids"),
            name="serving.sampling_draw",
        ),
        _continuous_batching(
            "model_runner",
            "ModelRunner.__init__",
            sampling.wrap_runner_init,
            reason="a sampling runner on Neuron says once how it samples (its top-k bound)",
            params=("logit_processor", "cb_config", "do_sample"),
            name="serving.sampling_announce",
        ),
        _continuous_batching(
            "continuous_api",
            "ContinuousBatchingManager.add_request",
            wrappers.wrap_add_request,
            reason="a request longer than the KV cache (the largest KV bucket) is refused with a clear error "
            "instead of never being scheduled",
            params=("input_ids", "request_id", "max_new_tokens"),
            name="serving.request_length",
        ),
        _continuous_batching(
            "continuous_api",
            "ContinuousMixin.generate_batch",
            wrappers.wrap_generate_batch,
            reason="generate_batch checks every input against the KV cache before any starts (upstream logs an "
            "error raised while adding requests and returns an empty result)",
            params=("inputs", "generation_config", "continuous_batching_config"),
            name="serving.batch_length",
        ),
        Patch(
            "transformers.cli.serving.utils",
            "CBGenerateManager.init_cb",
            wrappers.wrap_serve_init_cb,
            reason="transformers serve starts continuous batching at its first request without a warm-up: on Neuron "
            "the step grid is warmed before the manager starts, so no live request waits for a compile",
            lacking="transformers serve with a lazily started continuous batching manager (5.x up to 5.24)",
            needed=plan.without_step_padding,
            params=("model", "gen_config"),
            gone="this release's transformers serve warms continuous batching itself when the model loads",
            name="serving.serve_warmup",
        ),
    ]


@hookimpl
def neuron_compile_config(purpose: str) -> dict[str, Any] | None:
    if purpose != "serving":
        return None
    # Not fullgraph: upstream keeps the paged cache's update out of the graph (torch.compiler.disable).
    return {"backend": "neuron", "dynamic": False, "fullgraph": False, "mode": None}


@hookimpl
def neuron_serving_shape_policy(max_position_embeddings: int | None, kv_bytes_per_token: int) -> dict[str, Any] | None:
    return plan.default_policy()
