"""The ``neuron_config:`` block of Accelerate's config file: read, checked, handed to launched processes.

Accelerate users keep settings in the YAML (or JSON) file ``accelerate config``
writes and ``accelerate launch`` reads (``--config_file``, else
``~/.cache/huggingface/accelerate/default_config.yaml``). accelerate-neuron's
settings live there too, under one key whose entries are the settings' names::

    neuron_config:
      prompt_buckets: [64, 256]
      static_cache: true
      disable: [placement]

When the file is read: by the ``accelerate launch`` process, which reads the
file anyway, and by ``accelerate-neuron env``. ``accelerate launch`` checks the
block (a bad key or value stops the launch before any process starts) and hands
it to every process it starts in one environment variable,
``ACCELERATE_NEURON_LAUNCH_CONFIG`` (JSON), the way Accelerate hands its own
config to its processes (``ACCELERATE_MIXED_PRECISION``, ...). A launched
process installs it as the settings' config layer when it activates, on
``import torch``: no file is opened there, and nothing is read in a process
``accelerate launch`` did not start, as Accelerate's own config applies only
to launched processes.

This module is part of the base layer: importing it costs nothing; YAML and
Accelerate are imported only to read a file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

from . import settings

#: The key of the block in Accelerate's config file.
KEY = "neuron_config"
#: The variable ``accelerate launch`` hands the block to its processes in.
LAUNCH_ENV = settings.env_name("launch_config")


def default_file() -> str:
    """The file ``accelerate launch`` reads when given no ``--config_file`` (it may not exist)."""
    from accelerate.commands.config.config_args import default_config_file

    return str(default_config_file)


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The whole config file as Accelerate reads it: JSON if the name ends in ``.json``, else YAML."""
    text = Path(path).read_text(encoding="utf-8")
    if str(path).endswith(".json"):
        import json

        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    return data if isinstance(data, dict) else {}


def block_of(data: Mapping[str, Any], origin: str) -> dict[str, Any]:
    """The checked ``neuron_config`` block of a loaded config (``{}`` if it has none)."""
    block = data.get(KEY)
    return {} if block is None else settings.check_config(block, origin)


def read(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checked ``neuron_config`` block of the config file at ``path`` (``{}`` if it has none)."""
    return block_of(load(path), str(path))


def export(block: Mapping[str, Any], origin: str, environ: MutableMapping[str, str] | None = None) -> None:
    """Hand ``block`` to the processes started from now on (``environ``: ``os.environ`` by default).

    An empty block removes a value inherited from an outer launch, so a process
    never sees a block its own config file does not have.
    """
    import json

    environ = os.environ if environ is None else environ
    if block:
        environ[LAUNCH_ENV] = json.dumps({"file": origin, KEY: dict(block)}, sort_keys=True)
    else:
        environ.pop(LAUNCH_ENV, None)


def install_from_environment() -> str | None:
    """Install the block ``accelerate launch`` handed to this process as the settings' config layer.

    Returns what went wrong (the layer then stays empty), or None. Never raises:
    activation calls it on ``import torch``.
    """
    try:
        handed = settings.get("launch_config")
    except ValueError as exc:
        return str(exc)
    if handed is None:
        return None
    origin, block = handed
    try:
        settings.use_config(block, origin)
    except ValueError as exc:  # checked by parse_launch_config already; kept for the contract
        return str(exc)
    return None


def writable(values: Mapping[str, Any]) -> dict[str, Any]:
    """Parsed setting values as a ``neuron_config:`` block writes them (YAML/JSON-friendly types)."""
    return {name: settings.config_value(name, value) for name, value in values.items()}


def from_environment() -> dict[str, Any]:
    """The ``ACCELERATE_NEURON_*`` settings set in the environment that a ``neuron_config:`` block may hold,
    ready to write (``accelerate config default`` keeps them in the file it writes)."""
    chosen = {}
    for item in settings.SETTINGS:
        if not item.config:
            continue
        value = settings.explicit(item.name)
        if value is not None and value.source == "environment":
            chosen[item.name] = value.value
    return writable(chosen)
