"""``neuron_config:`` in Accelerate's config file, through Accelerate's own commands.

- Reading: Accelerate refuses a config file with a key it does not know
  (``BaseConfig.from_yaml_file`` / ``from_json_file`` raise "had unknown
  keys"). ``process_config`` (which both call before that check) leaves the
  block out; the two readers check it (a bad key or value is an error naming
  the file, the key or value and what is allowed) and keep it on the config
  object as ``neuron_config``, so ``accelerate config update`` writes it back
  (``to_dict`` serialises the object's attributes).
- ``accelerate launch``: the block of the file it reads is handed to every
  process it starts (:func:`accelerate_neuron.accelerate_config.export`).
- ``accelerate config``: the questionnaire asks for the block on a Neuron host;
  ``accelerate config default`` keeps the ``ACCELERATE_NEURON_*`` settings set
  in its environment.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ... import accelerate_config, settings
from .accelerate_cli import neuron_is_the_accelerator

logger = logging.getLogger(__name__)

ATTR = accelerate_config.KEY


class _Launching(threading.local):
    """Whether this thread is inside ``accelerate launch`` (its config file's block is then handed on)."""

    active = False


_launching = _Launching()


# ------------------------------------------------------------------ reading


def wrap_process_config(original: Any) -> Any:
    def process_config(config_dict: Any) -> Any:
        if isinstance(config_dict, dict):
            config_dict.pop(ATTR, None)  # read by the file readers below, not by Accelerate
        return original(config_dict)

    return process_config


def wrap_reader(parameter: str, default_attr: str) -> Any:
    """``from_yaml_file(yaml_file=None)`` / ``from_json_file(json_file=None)``: the block checked and kept."""

    def wrap(original: Any) -> Any:
        def from_file(cls: Any, *args: Any, **kwargs: Any) -> Any:
            path = args[0] if args else kwargs.get(parameter)
            if path is None:
                from accelerate.commands.config import config_args

                path = getattr(config_args, default_attr)
            block = accelerate_config.read(path)  # a bad block: the error names the file and the key
            config = original(cls, *args, **kwargs)
            if block:
                setattr(config, ATTR, block)
            if _launching.active:
                accelerate_config.export(block, str(path))
            return config

        return from_file

    return wrap


# ------------------------------------------------------------------ accelerate launch


def wrap_launch_command(original: Any) -> Any:
    def launch_command(args: Any) -> Any:
        accelerate_config.export({}, "")  # an outer launch's block never reaches this launch's processes
        _launching.active = True
        try:
            return original(args)
        finally:
            _launching.active = False

    return launch_command


# ------------------------------------------------------------------ accelerate config


#: What the questionnaire asks for, in order (each also settable by hand in the file).
ASKED = ("static_cache", "prompt_buckets", "batch_buckets", "cache_buckets", "train_buckets", "disable")


def _answer(name: str) -> Any:
    """A converter for ``_ask_field``: Enter keeps the default (nothing written), else the parsed answer."""

    def convert(text: str) -> Any:
        if not text.strip():
            return None
        return settings.config_value(name, settings.parse(name, text, "your answer"))

    return convert


def ask_neuron_config() -> dict[str, Any]:
    """The questionnaire's Neuron questions: the ``neuron_config`` block to write (only what was answered)."""
    from accelerate.commands.config.config_utils import _ask_field, _convert_yes_no_to_bool

    wanted = _ask_field(
        "Do you want to set accelerate-neuron settings (length buckets, static KV cache, plugins to skip) in this "
        "config? They go to the processes `accelerate launch` starts. [yes/NO]: ",
        _convert_yes_no_to_bool,
        default=False,
        error_message="Please enter yes or no.",
    )
    if not wanted:
        return {}
    block = {}
    for name in ASKED:
        item = settings.setting(name)
        value = _ask_field(
            f"{item.name} ({item.choices.replace('`', '')}; Enter keeps the default, "
            f"{item.shown_default.replace('`', '')}): ",
            _answer(name),
            error_message=f"Please enter {item.choices.replace('`', '')}, or nothing for the default.",
        )
        if value is not None:
            block[name] = value
    return block


def wrap_get_user_input(original: Any) -> Any:
    def get_user_input() -> Any:
        config = original()
        if neuron_is_the_accelerator() and hasattr(config, "num_processes"):  # a cluster config, not SageMaker
            block = ask_neuron_config()
            if block:
                setattr(config, ATTR, block)
        return config

    return get_user_input


def keep_environment_settings(config: Any) -> None:
    """``accelerate config default``: the ``ACCELERATE_NEURON_*`` settings of its environment go in the file."""
    block = accelerate_config.from_environment()
    if block:
        setattr(config, ATTR, {**(getattr(config, ATTR, None) or {}), **block})
        logger.warning(
            "accelerate_neuron: wrote neuron_config %s (from the ACCELERATE_NEURON_* variables set here) into the "
            "config file",
            block,
        )
