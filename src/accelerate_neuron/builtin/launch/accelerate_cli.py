"""``accelerate config`` / ``accelerate launch`` on a Neuron host.

- ``accelerate config default`` writes MULTI_NEURON, one process per visible
  core and the ``NEURON`` dynamo backend (Neuron compiles graphs; eager mode
  compiles op by op), and the ``ACCELERATE_NEURON_*`` settings of its
  environment as ``neuron_config:``. Accelerate <= 1.12 wrote a CPU config.
- The questionnaire offers ``neuron`` as dynamo backend (preselected on a
  Neuron host); on accelerate <= 1.12 it also offers ``multi-NEURON``.
- ``accelerate launch``: ``--dynamo_backend neuron`` is accepted; on
  accelerate <= 1.12 a MULTI_NEURON config (or no config on a multi-core host)
  starts one process per core, and ``--gpu_ids`` selects Neuron cores.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from ... import device
from .state import MULTI_NEURON, distributed_type

logger = logging.getLogger(__name__)

DYNAMO_NEURON = "NEURON"


def neuron_is_the_accelerator() -> bool:
    """Whether torch's accelerator on this host is Neuron (not CUDA, XPU, ...)."""
    if not device.is_available():
        return False
    try:
        import torch

        return torch._C._get_accelerator().type == device.DEVICE_TYPE
    except Exception:
        return False


# ------------------------------------------------------------------ accelerate config default


def neuron_config_values(current: dict[str, Any]) -> dict[str, Any]:
    """What a basic config needs on a Neuron host, given what upstream wrote."""
    cores = device.device_count()
    values: dict[str, Any] = {
        "num_processes": cores,
        "use_cpu": False,
        "distributed_type": MULTI_NEURON if cores > 1 else "NO",
    }
    dynamo = dict(current.get("dynamo_config") or {})
    if not dynamo.get("dynamo_backend"):
        dynamo["dynamo_backend"] = DYNAMO_NEURON
    values["dynamo_config"] = dynamo
    return values


def wrap_write_basic_config(original: Any) -> Any:
    def write_basic_config(*args: Any, **kwargs: Any) -> Any:
        path = original(*args, **kwargs)
        if not path or not neuron_is_the_accelerator():
            return path
        from accelerate.commands.config.config_args import ClusterConfig

        config = ClusterConfig.from_json_file(json_file=str(path))  # upstream always writes JSON
        for key, value in neuron_config_values(config.to_dict()).items():
            setattr(config, key, distributed_type(value) if key == "distributed_type" else value)
        from .config_file import keep_environment_settings  # (it imports this module)

        keep_environment_settings(config)
        config.to_json_file(str(path))
        return path

    return write_basic_config


# ------------------------------------------------------------------ the questionnaire


def add_dynamo_neuron(original: list) -> list:
    return [*original, DYNAMO_NEURON]


def lists_dynamo_neuron(original: list) -> str | None:
    return "upstream offers NEURON" if DYNAMO_NEURON in original else None


class _Questionnaire(threading.local):
    """Whether the user picked the backfilled ``multi-NEURON`` machine type (accelerate <= 1.12)."""

    neuron = False


_questionnaire = _Questionnaire()
_STAND_IN = "MULTI_GPU"  # asks the same questions as 1.13+'s MULTI_NEURON flow: machines, processes, core ids


def wrap_ask_options(original: Any) -> Any:
    def _ask_options(input_text: str, options: Any = (), convert_value: Any = None, default: int = 0) -> Any:
        options = list(options)
        if not neuron_is_the_accelerator():
            return original(input_text, options, convert_value, default)
        lowered = [str(o).lower() for o in options]
        if "neuron" in lowered and "inductor" in lowered and default == lowered.index("inductor"):
            # The dynamo backend question: inductor does not target Neuron.
            default = lowered.index("neuron")
        elif "multi-gpu" in lowered and "multi-neuron" not in lowered:
            # The machine type question of a release without multi-NEURON.
            options = [*options, "multi-NEURON"]
            neuron_index = len(options) - 1
            convert = convert_value

            def convert_value(value: Any) -> Any:
                chosen = int(value) == neuron_index
                _questionnaire.neuron = chosen
                if chosen:
                    return distributed_type(_STAND_IN)
                return convert(value) if convert is not None else value

        return original(input_text, options, convert_value, default)

    return _ask_options


def wrap_get_cluster_input(original: Any) -> Any:
    def get_cluster_input() -> Any:
        _questionnaire.neuron = False
        try:
            config = original()
            if _questionnaire.neuron:
                picked = str(getattr(config.distributed_type, "value", config.distributed_type))
                if picked == "DEEPSPEED":
                    raise RuntimeError("DeepSpeed is not supported on Neuron devices.")
                if picked in ("FSDP", "MEGATRON_LM"):
                    raise NotImplementedError(f"{picked} is not currently supported on Neuron devices.")
                config.distributed_type = distributed_type(MULTI_NEURON if config.num_processes > 1 else "NO")
                config.enable_cpu_affinity = False  # NVIDIA-only option asked by the stand-in flow
            return config
        finally:
            _questionnaire.neuron = False

    return get_cluster_input


# ------------------------------------------------------------------ accelerate launch


def wrap_validate_launch_command(original: Any) -> Any:
    def _validate_launch_command(args: Any) -> Any:
        if neuron_is_the_accelerator() and not getattr(args, "cpu", False):
            _neuron_launch_defaults(args)
        return original(args)

    return _validate_launch_command


def _neuron_launch_defaults(args: Any) -> None:
    """What accelerate 1.13+ decides for Neuron before launching (MULTI_NEURON -> torchrun)."""
    from accelerate.commands.config import default_config_file, load_config_from_file

    explicit_mode = any(
        getattr(args, flag, False)
        for flag in ("multi_gpu", "tpu", "tpu_use_cluster", "use_deepspeed", "use_fsdp", "use_megatron_lm")
    )
    if explicit_mode:
        return
    if args.config_file is not None or os.path.isfile(default_config_file):
        defaults = load_config_from_file(args.config_file)
        if defaults.distributed_type == MULTI_NEURON:
            args.multi_gpu = True
        return
    if args.num_processes is None:
        args.num_processes = device.device_count()
        if args.num_processes > 1:
            logger.warning(
                "accelerate_neuron: %d Neuron cores visible, launching one process per core "
                "(pass --num_processes=1 for a single process)",
                args.num_processes,
            )
    if args.num_processes > 1:
        args.multi_gpu = True


def wrap_prepare_multi_gpu_env(original: Any) -> Any:
    def prepare_multi_gpu_env(args: Any) -> dict[str, str]:
        env = original(args)
        gpu_ids = getattr(args, "gpu_ids", None)
        if gpu_ids not in (None, "all") and neuron_is_the_accelerator() and "NEURON_RT_VISIBLE_CORES" not in env:
            env["NEURON_RT_VISIBLE_CORES"] = str(gpu_ids)
            if env.get("CUDA_VISIBLE_DEVICES") == str(gpu_ids):
                del env["CUDA_VISIBLE_DEVICES"]  # upstream's fallback when it finds no accelerator it knows
        return env

    return prepare_multi_gpu_env
