"""Built-in plugin ``launch``: ``accelerate config`` / ``accelerate launch`` / ``torchrun`` on Neuron.

One process per Neuron core, rank ``r`` on its own core, collectives through
the ``"neuron"`` process group:

- ``_launch_cores``: which core a rank uses (``NEURON_RT_VISIBLE_CORES``
  narrowed per rank before the runtime starts), bound right after
  ``init_process_group``; DDP ``device_ids`` follow the module's core.
- ``_enum_backfill``: ``DistributedType.MULTI_NEURON`` / ``DynamoBackend.NEURON``
  for releases without them (the latter shared with ``training``).
- ``_launch_state``: ``PartialState`` / ``Accelerator`` device choice and the
  MULTI_NEURON branches of Accelerate 1.13+ for older releases.
- ``_launch_cli``: ``accelerate config default``, the questionnaire, ``accelerate launch``.
- ``_launch_tp``: Transformers ``DistributedConfig`` / ``tp_plan`` device binding.
"""

from __future__ import annotations

from ..hookspecs import hookimpl
from ..patching import Patch
from . import _launch_cli, _launch_cores, _launch_state, _launch_tp
from ._enum_backfill import distributed_type_multi_neuron, dynamo_backend_neuron


@hookimpl
def neuron_patches() -> list[Patch]:
    return [
        *_launch_cores.patches(),
        *distributed_type_multi_neuron(),
        *dynamo_backend_neuron(),
        *_launch_state.patches(),
        *_launch_cli.patches(),
        *_launch_tp.patches(),
    ]
