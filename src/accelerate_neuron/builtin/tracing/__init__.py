"""Built-in plugin ``tracing``: one step, one graph. Upstream code Dynamo would split, made traceable on Neuron.

On Neuron every piece of a broken Dynamo graph is its own NEFF: its own compile,
its own launch, and a device->host->device hop between pieces. Each patch here
removes one cause of a graph break in stock Hugging Face code, without changing
what the code computes, and only while Dynamo traces (eager calls keep upstream's
path):

- :mod:`.hub_kernels`: the ``kernels`` package's per-call context (Transformers 5's
  attention classes) assigned a global object's attributes inside gradient
  checkpointing;
- :mod:`.input_grads`: ``enable_input_require_grads``' hook (PEFT, TRL with gradient
  checkpointing) called ``requires_grad_`` on the embeddings' output;
- :mod:`.fused_logprob`: TRL's fused LM head wrote tiles with ``out=`` into a
  non-contiguous view;
- :mod:`.warnings_once`: Transformers' ``logger.warning_once`` inside a forward
  (4.57's use_cache advice under gradient checkpointing);
- :mod:`.sliding_cache`: a static sliding-window cache layer counted its tokens in
  a Python int, so generate()'s decode step compiled again at every token;
- :mod:`.traced_fsdp`: FSDP2's hooks (``DistributedConfig(fsdp_size=N)``) run outside
  Dynamo by design, a graph boundary at every FSDP unit: parameters sharded as
  DTensors whose all-gathers and reduce-scatters are traced into the step instead.

The breaks that remain are named by ``accelerate-neuron simulate`` with the upstream
file and line and what they cost per step. ``ACCELERATE_NEURON_DISABLE=tracing``
turns these patches off (the stock baseline of ``benchmarks/graphs.py``).
"""

from __future__ import annotations

from ...hookspecs import hookimpl
from ...patching import Patch
from . import fused_logprob, hub_kernels, input_grads, sliding_cache, traced_fsdp, warnings_once

_KERNELS = "kernels._internals.layer.layer"
_SLIDING = "StaticSlidingWindowLayer"
_SLIDING_WHY = (
    "a static sliding-window cache layer sized within its window never slides: while Dynamo traces on Neuron it "
    "is updated and sized like a StaticLayer (tensor positions), instead of branching on a Python token count "
    "that recompiled the decode step at every token"
)


@hookimpl
def neuron_patches() -> list[Patch]:
    return [
        Patch(
            _KERNELS,
            "CompileableContextVar.set",
            hub_kernels.wrap_set,
            reason="while Dynamo traces, a kernelized module's forward that selects no hub kernel (none exists for "
            "Neuron) no longer assigns the global kernel context: under gradient checkpointing that assignment "
            "broke the graph at every decoder layer",
            lacking="kernels >= 0.10 with transformers 5",
            params=("self", "value"),
            needed=hub_kernels.needed,
        ),
        Patch(
            _KERNELS,
            "CompileableContextVar.reset",
            hub_kernels.wrap_reset,
            reason="the reset of a kernel context set() skipped while tracing is skipped too",
            lacking="kernels >= 0.10 with transformers 5",
            params=("self", "token"),
        ),
        Patch(
            "transformers.modeling_utils",
            "PreTrainedModel.enable_input_require_grads",
            input_grads.wrap_enable_input_require_grads,
            reason="the hook that makes the input embeddings' output require grad (PEFT/TRL with gradient "
            "checkpointing) is skipped while Dynamo traces: inside a compiled graph the adapters get their "
            "gradients without it, and requires_grad_ split the embedding into a graph of its own",
            lacking="every release",
            params=("self",),
        ),
        Patch(
            "trl.trainer.utils",
            "_ChunkedLogProbFunction",
            fused_logprob.wrap_function,
            reason="TRL's fused LM head is computed with traceable ops (chunks of tokens, recomputed in the "
            "backward) while Dynamo traces on Neuron: its out= writes into a non-contiguous tile split the "
            "training step into several graphs",
            lacking="trl >= 1.x (add_fused_lm_head)",
            needed=fused_logprob.needed,
        ),
        Patch(
            "transformers.utils.logging",
            "logging.Logger.warning_once",
            warnings_once.wrap_warning_once,
            reason="Transformers' logger.warning_once is skipped while Dynamo traces (it warns in eager calls): "
            "a call inside a compiled forward broke the graph (4.57: every decoder forward under gradient "
            "checkpointing)",
            lacking="every release (Dynamo cannot trace logging.Logger methods)",
            params=("self",),
        ),
        Patch(
            "transformers.cache_utils",
            f"{_SLIDING}.__init__",
            sliding_cache.wrap_init,
            reason="records whether the layer's cache fits its window (max_cache_len <= sliding_window)",
            lacking="every release with StaticSlidingWindowLayer",
            params=("self", "max_cache_len", "sliding_window"),
        ),
        *(
            Patch(
                "transformers.cache_utils",
                f"{_SLIDING}.{method}",
                wrap,
                reason=_SLIDING_WHY,
                lacking="every release with StaticSlidingWindowLayer",
                params=("self",),
            )
            for method, wrap in (
                ("update", sliding_cache.wrap_update),
                ("get_mask_sizes", sliding_cache.wrap_get_mask_sizes),
                ("get_seq_length", sliding_cache.wrap_get_seq_length),
            )
        ),
        Patch(
            "transformers.cache_utils",
            f"{_SLIDING}.crop",
            sliding_cache.wrap_crop,
            reason="crop() reads the token count: it is brought up to date first after traced updates",
            lacking="transformers 5 (4.57's sliding layers have no crop)",
            params=("self", "tokens_to_remove"),
        ),
        Patch(
            "transformers.distributed.mixin",
            "apply_fully_sharded_data_parallelism",
            traced_fsdp.wrap_apply_fsdp,
            reason="FSDP of DistributedConfig(fsdp_size) on Neuron shards each parameter as a DTensor gathered "
            "inside the compiled step (functional collectives): FSDP2's hooks run outside Dynamo by design and "
            "ended a graph at every FSDP unit",
            lacking="transformers >= 5 (DistributedConfig with fsdp_size)",
            params=("model", "mesh_manager", "fsdp_plan", "ep_plan"),
            name="tracing.traced_fsdp",
        ),
    ]
