"""Built-in plugin ``placement``: ``device_map="auto"`` and friends place models on Neuron cores.

Stock Accelerate enumerates no Neuron device, so on a Trainium host
``from_pretrained(..., device_map="auto")`` silently loads on the CPU. This
plugin teaches Accelerate's device enumeration about Neuron cores (per-core
budget: the ``neuron_memory_budget`` hook), backfills balancing where an
Accelerate release counts only CUDA devices, validates ``device_map`` /
``max_memory`` values against the visible cores, and fixes the upstream
regressions met on the same path. Each patch names the releases that lack the
behaviour and is skipped where upstream already has it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...hookspecs import hookimpl
from ...patching import Patch
from . import dispatch, memory
from .memory import PlacementError
from .pipeline import wrap_pipeline_init

__all__ = ["PlacementError", "neuron_memory_budget", "neuron_patches"]

PLAN_ALIASES = (
    "accelerate.utils.get_max_memory",
    "transformers.modeling_utils.get_max_memory",  # Transformers 4.x binds Accelerate's function
    "transformers.integrations.accelerate.accelerate_max_memory",  # Transformers 5.x wraps it
)
BALANCED_ALIASES = (
    "accelerate.utils.get_balanced_memory",
    "accelerate.big_modeling.get_balanced_memory",
    "accelerate.utils.bnb.get_balanced_memory",
    "transformers.modeling_utils.get_balanced_memory",
    "transformers.integrations.peft.get_balanced_memory",
)
DISPATCH_ALIASES = (
    "accelerate.dispatch_model",
    "accelerate.utils.bnb.dispatch_model",
    "transformers.modeling_utils.dispatch_model",
    "transformers.integrations.accelerate.dispatch_model",
    "transformers.integrations.peft.dispatch_model",
)
LOAD_ALIASES = (
    "accelerate.load_checkpoint_in_model",
    "accelerate.utils.load_checkpoint_in_model",
    "accelerate.big_modeling.load_checkpoint_in_model",
    "accelerate.utils.bnb.load_checkpoint_in_model",
)


def _device_map_wrapper(what: str, auto_policy: bool = False, returns_map: bool = False) -> Callable[[Any], Any]:
    return lambda original: dispatch.wrap_device_map_argument(
        original, what=what, auto_policy=auto_policy, returns_map=returns_map
    )


@hookimpl
def neuron_patches() -> list[Patch]:
    return [
        Patch(
            "accelerate.utils.modeling",
            "get_max_memory",
            memory.wrap_get_max_memory,
            reason="enumerate Neuron cores (per-core budget from neuron_memory_budget) and validate max_memory keys "
            "(an invisible core is planned for with a warning, as upstream does; placing there is refused)",
            lacking="every Accelerate release: no Neuron branch, device_map='auto' plans for the CPU only",
            params=("max_memory",),
            aliases=PLAN_ALIASES,
            needed=memory.upstream_reads_neuron_memory,
            name="placement.get_max_memory",
        ),
        Patch(
            "accelerate.utils.modeling",
            "get_balanced_memory",
            memory.wrap_get_balanced_memory,
            reason="balance a model over Neuron cores ('auto', 'balanced', 'balanced_low_0')",
            lacking="Accelerate releases that count only torch.device(d).type == 'cuda' devices (e.g. 1.10)",
            params=("model", "max_memory", "no_split_module_classes", "low_zero"),
            aliases=BALANCED_ALIASES,
            needed=memory.balances_int_devices,
            name="placement.get_balanced_memory",
        ),
        Patch(
            # from_pretrained looks it up here in every release (5.x imports it from integrations.accelerate)
            "transformers.modeling_utils",
            "_get_device_map",
            _device_map_wrapper("device_map", auto_policy=True, returns_map=True),
            reason="refuse invisible Neuron cores in device_map (given or planned); keep core indices (ints) "
            "on the loading path, safetensors accepts no string spelling of a Neuron device; 'auto' uses the "
            "fewest cores that hold the model",
            lacking="every Transformers release",
            params=("model", "device_map", "max_memory"),
            name="placement.get_device_map",
        ),
        Patch(
            "accelerate.utils.modeling",
            "load_checkpoint_in_model",
            _device_map_wrapper("load_checkpoint_in_model device_map"),
            reason="refuse invisible Neuron cores; safetensors accepts only ints as a Neuron device",
            lacking="every Accelerate release",
            params=("model", "checkpoint", "device_map"),
            aliases=LOAD_ALIASES,
            name="placement.load_checkpoint_in_model",
        ),
        Patch(
            "accelerate.utils.modeling",
            "safe_load_file",
            lambda original: dispatch.wrap_safetensors_device(original, position=1),
            reason="safetensors accepts only ints as a Neuron device; Accelerate >= 1.16 passes 'neuron:N'",
            lacking="every safetensors release (no string spelling of a Neuron device)",
            name="placement.safetensors_load_file",
        ),
        Patch(
            "accelerate.utils.modeling",
            "safe_open",
            lambda original: dispatch.wrap_safetensors_device(original, position=2),
            reason="safetensors accepts only ints as a Neuron device; Accelerate >= 1.16 passes 'neuron:N'",
            lacking="every safetensors release (no string spelling of a Neuron device)",
            name="placement.safetensors_open",
        ),
        Patch(
            # Accelerator.load_state on more than one process loads the model "on_device": str(device)
            "accelerate.checkpointing",
            "load_model",
            lambda original: dispatch.wrap_safetensors_device(original, position=3),
            reason="safetensors accepts only ints as a Neuron device; Accelerator.load_state with several "
            "processes passes 'neuron:N' (every multi-rank resume failed: 'device neuron:0 is invalid')",
            lacking="every safetensors release (no string spelling of a Neuron device)",
            name="placement.accelerate_load_state_model",
        ),
        Patch(
            "accelerate.big_modeling",
            "dispatch_model",
            dispatch.wrap_dispatch_model,
            reason="move a single-core model onto its core; refuse invisible Neuron cores",
            lacking="Accelerate releases whose single-device branch skips model.to() for int devices (e.g. 1.15)",
            params=("model", "device_map", "force_hooks"),
            aliases=DISPATCH_ALIASES,
            needed=dispatch.dispatch_leaves_single_device_model,
            name="placement.dispatch_model",
        ),
        Patch(
            "accelerate.hooks",
            "_accelerate_added_attributes",
            dispatch.add_neuron_attribute,
            reason="remove_hook_from_module also removes the model.neuron warning wrapper dispatch_model adds",
            lacking="Accelerate releases whose list lacks 'neuron' (1.10, 1.15)",
            needed=dispatch.added_attributes_need_neuron,
            gone="upstream marks the wrappers it adds (Accelerate >= 1.16), model.neuron included",
            name="placement.accelerate_added_attributes",
        ),
        Patch(
            "transformers.modeling_utils",
            "caching_allocator_warmup",
            dispatch.wrap_caching_allocator_warmup,
            reason="no warmup allocation on Neuron cores (no reusable pool; a model-sized allocation may OOM)",
            lacking="Transformers releases before huggingface/transformers#47029 (e.g. 4.57)",
            params=("model", "expanded_device_map", "hf_quantizer"),
            needed=dispatch.warmup_allocates_on_neuron,
            name="placement.caching_allocator_warmup",
        ),
        Patch(
            "transformers.integrations.hub_kernels",
            "kernelize",
            dispatch.wrap_kernelize,
            reason="hand hub-kernel kernelize a Neuron device, not the core index kept in device_map "
            "(upstream calls .type on it: AttributeError on every load placed off core 0)",
            lacking="Transformers releases whose kernelize reads device_map (5.25)",
            needed=dispatch.kernelize_reads_device_map,
            gone="upstream has no hub-kernels kernelize in this release (4.57): nothing to correct",
            aliases=(
                "transformers.modeling_utils.kernelize",
                "transformers.integrations.kernelize",
                "transformers.kernelize",
            ),
            name="placement.kernelize_device_map",
        ),
        Patch(
            "transformers.pipelines.base",
            "Pipeline.__init__",
            wrap_pipeline_init,
            reason="an integer pipeline device / hf_device_map entry means a Neuron core, not the CPU",
            lacking="every Transformers release (no Neuron branch in Pipeline.__init__)",
            params=("self", "model", "device"),
            name="placement.pipeline_device",
        ),
    ]


@hookimpl(trylast=True)
def neuron_memory_budget(index: int, total_memory: int, reserved: int, free: int | None) -> int | None:
    """The built-in budget: ``mem_get_info``'s free bytes where a build has it, else ``total - reserved``."""
    return memory.default_budget(total_memory, reserved, free)
