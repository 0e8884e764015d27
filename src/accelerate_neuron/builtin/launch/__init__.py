"""Built-in plugin ``launch``: ``accelerate config`` / ``accelerate launch`` / ``torchrun`` on Neuron.

One process per Neuron core, rank ``r`` on its own core, collectives through
the ``"neuron"`` process group. The patch table below, by concern:

- :mod:`.cores`: which core a rank uses (``NEURON_RT_VISIBLE_CORES``
  narrowed per rank before the runtime starts), bound right after
  ``init_process_group``; DDP ``device_ids`` follow the module's core.
- :mod:`..enum_backfill`: ``DistributedType.MULTI_NEURON`` / ``DynamoBackend.NEURON``
  for releases without them (the latter shared with ``training``).
- :mod:`.state`: ``PartialState`` / ``Accelerator`` device choice and the
  MULTI_NEURON branches of Accelerate 1.13+ for older releases.
- :mod:`.accelerate_cli`: ``accelerate config default``, the questionnaire, ``accelerate launch``.
- :mod:`.config_file`: ``neuron_config:`` in Accelerate's config file, read, asked for, handed to ranks.
- :mod:`.tp`: Transformers ``DistributedConfig`` / ``tp_plan`` device binding.
- :mod:`.ray_workers`: Ray Train workers (the core Ray assigned, the gloo group
  Ray creates), and Ray counting the simulated cores.
"""

from __future__ import annotations

from ...hookspecs import hookimpl
from ...patching import Patch
from ..enum_backfill import distributed_type_multi_neuron, dynamo_backend_neuron
from . import accelerate_cli, config_file, cores, ray_workers, state, tp

_STATE, _ACCELERATOR, _UTILS = "accelerate.state", "accelerate.accelerator", "accelerate.utils"
_CONFIG = "accelerate.commands.config"


@hookimpl
def neuron_patches() -> list[Patch]:
    return [
        # --- one core per rank
        Patch(
            "torch.distributed.distributed_c10d",
            "init_process_group",
            cores.wrap_init_process_group,
            reason="each rank uses its own Neuron core, also when NEURON_RT_VISIBLE_CORES lists the job's cores",
            lacking="torch-neuronx (ProcessGroupNeuron narrows only an unset NEURON_RT_VISIBLE_CORES)",
            params=("backend",),
            aliases=("torch.distributed.init_process_group", "torch.distributed.device_mesh.init_process_group"),
        ),
        Patch(
            "torch.nn.parallel.distributed",
            "DistributedDataParallel.__init__",
            cores.wrap_ddp_init,
            reason="DDP device_ids must name the module's core: accelerate passes the local rank, "
            "but each process sees only its own core (index 0)",
            lacking="accelerate (all releases: device_ids=[local_process_index] except on HPU)",
            params=("module", "device_ids", "output_device"),
        ),
        # --- Ray (ray_workers: the worker side is in cores.py, state.py and ..engines)
        Patch(
            "ray._private.accelerators.neuron",
            "NeuronAcceleratorManager.get_current_node_num_accelerators",
            ray_workers.wrap_node_core_count,
            reason="ray.init() on a host with the simulated device registers its cores as neuron_cores",
            lacking="every Ray release (a node's Neuron cores are counted with neuron-ls only)",
            needed=ray_workers.simulated_device_only,
        ),
        # --- enum members older Accelerate releases lack
        *distributed_type_multi_neuron(),
        *dynamo_backend_neuron(),
        # --- Accelerate's state and MULTI_NEURON branches
        Patch(
            _STATE,
            "PartialState.set_device",
            state.wrap_set_device,
            reason="rank r trains on its own Neuron core",
            lacking="accelerate 1.15 (torch.neuron.current_device(): core 0 for every rank when the job sees "
            "several cores); accelerate <= 1.12 (no neuron branch)",
            params=("self",),
        ),
        Patch(
            _STATE,
            "PartialState.wait_for_everyone",
            state.wrap_wait_for_everyone,
            reason="the barrier must name this process's core, not its local rank",
            lacking="accelerate (barrier(device_ids=[local_process_index])); <= 1.12: no barrier for MULTI_NEURON",
            params=("self",),
        ),
        Patch(
            _STATE,
            "PartialState._prepare_backend",
            state.wrap_prepare_backend,
            reason="under torchrun / accelerate launch, Neuron ranks use the 'neuron' process group (MULTI_NEURON)",
            lacking=state.LACKING_OLD + ": MULTI_CPU + gloo on a Neuron host",
            params=("cpu", "sagemaker_dp", "backend"),
            needed=state.upstream_has_multi_neuron,
        ),
        Patch(
            _STATE,
            "PartialState.default_device",
            state.wrap_default_device,
            reason="a single process uses the Neuron device",
            lacking=state.LACKING_OLD + ": cpu",
            needed=state.upstream_has_multi_neuron,
        ),
        Patch(
            _ACCELERATOR,
            "Accelerator.multi_device",
            state.wrap_multi_device,
            reason="prepare_model wraps the model in DDP (gradients all-reduced) under MULTI_NEURON",
            lacking=state.LACKING_OLD,
            needed=state.upstream_has_multi_neuron,
        ),
        Patch(
            f"{_UTILS}.constants",
            "TORCH_DISTRIBUTED_OPERATION_TYPES",
            state.add_multi_neuron,
            reason="accelerator.gather / reduce / broadcast / pad_across_processes use torch.distributed",
            lacking=state.LACKING_OLD,
            aliases=(
                f"{_UTILS}.operations.TORCH_DISTRIBUTED_OPERATION_TYPES",
                f"{_UTILS}.TORCH_DISTRIBUTED_OPERATION_TYPES",
            ),
            needed=state.lists_multi_neuron,
        ),
        Patch(
            f"{_UTILS}.modeling",
            "get_mixed_precision_context_manager",
            state.wrap_autocast,
            reason="bf16 mixed precision autocasts to bfloat16 under MULTI_NEURON",
            lacking=state.LACKING_OLD + " (autocast without dtype, i.e. the device default)",
            params=("native_amp", "autocast_kwargs"),
            aliases=(
                f"{_UTILS}.get_mixed_precision_context_manager",
                f"{_ACCELERATOR}.get_mixed_precision_context_manager",
            ),
            needed=state.upstream_has_multi_neuron,
        ),
        Patch(
            f"{_UTILS}.random",
            "synchronize_rng_state",
            state.wrap_synchronize_rng_state,
            reason="ranks shuffle data identically (rank 0's RNG state broadcast)",
            lacking=state.LACKING_OLD + ": no synchronisation",
            params=("rng_type", "generator"),
            aliases=(f"{_UTILS}.synchronize_rng_state",),
            needed=state.upstream_has_multi_neuron,
        ),
        # --- accelerate config / launch
        Patch(
            f"{_CONFIG}.default",
            "write_basic_config",
            accelerate_cli.wrap_write_basic_config,
            reason="`accelerate config default` on Neuron: MULTI_NEURON, one process per visible core, "
            "dynamo backend NEURON",
            lacking="accelerate <= 1.12 (a CPU config); 1.13+ (no dynamo backend)",
            params=("mixed_precision", "save_location"),
            aliases=("accelerate.utils.other.write_basic_config", "accelerate.utils.write_basic_config"),
        ),
        Patch(
            f"{_CONFIG}.config_utils",
            "DYNAMO_BACKENDS",
            accelerate_cli.add_dynamo_neuron,
            reason="the questionnaire and `accelerate launch --dynamo_backend` offer 'neuron'",
            lacking="accelerate (DynamoBackend.NEURON exists since 1.15 but is not offered)",
            aliases=(f"{_CONFIG}.cluster.DYNAMO_BACKENDS", "accelerate.commands.launch.DYNAMO_BACKENDS"),
            needed=accelerate_cli.lists_dynamo_neuron,
        ),
        Patch(
            f"{_CONFIG}.cluster",
            "_ask_options",
            accelerate_cli.wrap_ask_options,
            reason="the questionnaire preselects the neuron dynamo backend and offers multi-NEURON on a Neuron host",
            lacking="accelerate (inductor preselected); <= 1.12: no multi-NEURON machine type",
            params=("input_text", "options", "convert_value", "default"),
        ),
        Patch(
            f"{_CONFIG}.cluster",
            "get_cluster_input",
            accelerate_cli.wrap_get_cluster_input,
            reason="the questionnaire's multi-NEURON answer yields a MULTI_NEURON config",
            lacking=state.LACKING_OLD,
            aliases=(f"{_CONFIG}.config.get_cluster_input",),
            needed=state.upstream_has_multi_neuron,
        ),
        Patch(
            "accelerate.commands.launch",
            "_validate_launch_command",
            accelerate_cli.wrap_validate_launch_command,
            reason="`accelerate launch` starts one process per Neuron core for a MULTI_NEURON config "
            "(or, without a config, when several cores are visible)",
            lacking=state.LACKING_OLD + ": one process, or num_processes = torch.cuda.device_count()",
            params=("args",),
            needed=state.upstream_has_multi_neuron,
        ),
        Patch(
            "accelerate.utils.launch",
            "prepare_multi_gpu_env",
            accelerate_cli.wrap_prepare_multi_gpu_env,
            reason="`--gpu_ids` / `gpu_ids:` select Neuron cores (NEURON_RT_VISIBLE_CORES)",
            lacking=state.LACKING_OLD + ": CUDA_VISIBLE_DEVICES",
            params=("args",),
            aliases=("accelerate.utils.prepare_multi_gpu_env", "accelerate.commands.launch.prepare_multi_gpu_env"),
            needed=state.upstream_has_multi_neuron,
        ),
        # --- neuron_config: in Accelerate's config file
        Patch(
            f"{_CONFIG}.config_args",
            "BaseConfig.process_config",
            config_file.wrap_process_config,
            reason="Accelerate's config file may hold a neuron_config: block (Accelerate refuses unknown keys)",
            lacking="every release",
            params=("config_dict",),
        ),
        *(
            Patch(
                f"{_CONFIG}.config_args",
                f"BaseConfig.{reader}",
                config_file.wrap_reader(parameter, default),
                reason="the neuron_config: block of Accelerate's config file is checked and kept with the config",
                lacking="every release",
                params=(parameter,),
            )
            for reader, parameter, default in (
                ("from_yaml_file", "yaml_file", "default_yaml_config_file"),
                ("from_json_file", "json_file", "default_json_config_file"),
            )
        ),
        Patch(
            "accelerate.commands.launch",
            "launch_command",
            config_file.wrap_launch_command,
            reason="`accelerate launch` hands the neuron_config: block of its config file to every process",
            lacking="every release",
            params=("args",),
        ),
        Patch(
            f"{_CONFIG}.config",
            "get_user_input",
            config_file.wrap_get_user_input,
            reason="`accelerate config` asks for the neuron_config: block on a Neuron host",
            lacking="every release",
        ),
        # --- Transformers tensor parallelism
        Patch(
            "transformers.distributed.utils",
            "_bind_local_device",
            tp.wrap_bind_local_device,
            reason="DistributedConfig / tp_plan under torchrun: no device use before init_process_group, "
            "and each rank binds its own Neuron core",
            lacking="transformers 5.x (set_device_index(LOCAL_RANK) before init_process_group)",
            params=("device_type", "local_rank"),
        ),
        Patch(
            "transformers.integrations.tensor_parallel",
            "initialize_tensor_parallelism",
            tp.wrap_initialize_tensor_parallelism,
            reason="from_pretrained(tp_plan='auto') under torchrun uses the 'neuron' process group and "
            "each rank's own core",
            lacking="transformers 4.57 (no neuron backend; set_device(LOCAL_RANK))",
            params=("tp_plan", "tp_size"),
            aliases=("transformers.modeling_utils.initialize_tensor_parallelism",),
            needed=tp.binds_through_bind_local_device,
        ),
    ]
