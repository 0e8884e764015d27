"""Built-in plugin ``regions``: a model compiled one decoder layer at a time (regional compilation).

A NEFF runs on one NeuronCore, so a model that ``device_map="auto"`` spread
over several cores cannot be one compiled graph: without regions its
``generate()`` and inference calls run eagerly, op by op. Here every decoder
layer (the model's repeated block, the classes in ``_no_split_modules``) is
compiled on its own (:mod:`..layer_regions`, the shared module the calling
plugins install regions through):

- each layer runs compiled on the core holding its weights; Accelerate's hooks
  move the activations between cores at layer boundaries, outside the graphs;
- layers of one class share one compiled function, and their graphs are the
  same HLO (weights and cache tensors are graph inputs, devices are keyed by
  type), so a shape is compiled once and every other layer, on every core,
  loads it from the NEFF cache: compile cost no longer grows with depth;
- what is outside the layers (embeddings, attention mask, rotary tables, final
  norm, head, the greedy argmax) runs eagerly: a few ops at the bucketed
  shapes, so their eager signatures are bounded by the buckets too.

The ``compile_regions`` setting chooses (``off``, ``layers``, ``auto``: layers
for a model split over cores, the whole model on one core). The callers are
``generate()`` (:mod:`..generation`) and bucketed inference calls
(:mod:`..inference`); a model call already being compiled as a whole is never
compiled again region by region (:func:`..layer_regions.compiled_layers`).

Hook with a built-in answer here: ``neuron_compile_config`` (purpose ``"region"``);
no answer (this plugin disabled) turns regions off.
"""

from __future__ import annotations

from typing import Any

from ...hookspecs import hookimpl
from ...patching import Patch


@hookimpl
def neuron_patches() -> list[Patch]:
    return []  # regions are installed per call by the plugins that own the call, never patched in for good


@hookimpl
def neuron_compile_config(purpose: str) -> dict[str, Any] | None:
    if purpose != "region":
        return None
    # fullgraph stays False as for whole models: a graph break inside a layer costs a second graph, not a crash.
    return {"backend": "neuron", "dynamic": False, "fullgraph": False, "mode": None}
