"""Every ``ACCELERATE_NEURON_*`` setting: one registry, one parser per kind, one precedence.

A setting's value comes from, in order:

1. the environment (``ACCELERATE_NEURON_PROMPT_BUCKETS=off``);
2. the ``neuron_config:`` block of Accelerate's config file (keys are the
   settings' names: ``prompt_buckets: [64, 256]``), once a config layer is
   installed with :func:`use_config` (a process ``accelerate launch`` started
   installs the block it was handed: :mod:`accelerate_neuron.accelerate_config`);
3. the plugin hook that answers it, if it has one (a third-party plugin's
   answer beats the built-in one);
4. the built-in default.

The same words mean the same thing everywhere: a bucket list is ``pow2``,
``pow2-half`` (the powers of two and the points halfway between them),
``fit`` (fitted to the sizes the job recorded), ``off`` (also
``0``/``no``/``none``/``false``) or strictly ascending positive integers; a
switch is ``1``/``on``/``true``/``yes`` or ``0``/``off``/``false``/``no``. A bad
value raises :class:`SettingError` naming the setting, the value, where it came
from and what is allowed.

This module is part of the base layer: it imports nothing heavy (it runs on
``import torch``) and the simulator may use it too.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .sizes import SizeTooLarge, parse_size

PREFIX = "ACCELERATE_NEURON_"
ON_WORDS = frozenset({"1", "on", "true", "yes"})
OFF_WORDS = frozenset({"0", "off", "false", "no", "none"})
POW2 = "pow2"
#: The capability's powers of two with the point halfway along each doubling: two buckets an octave.
POW2_HALF = "pow2-half"
#: A bucket list fitted to the sizes the job's calls recorded (``builtin/shapes/record.py``).
FIT = "fit"
#: The largest bucket a setting accepts: a Neuron shape's sizes are 32-bit (the compiler downcasts int64 to int32),
#: and a value past it fails deep inside torch instead of here.
MAX_BUCKET = 2**31 - 1

#: A bucket list: ``"pow2"`` (the capability's powers of two), ``"pow2-half"`` (and the halfway points),
#: ``"fit"`` (fitted to the recorded sizes) or
#: ascending ints; ``()`` is off.
BucketSpec = str | tuple[int, ...]


class SettingError(ValueError):
    """A setting has a value it does not accept."""

    def __init__(self, setting: Setting, value: Any, origin: str, detail: str = "") -> None:
        if setting.parse is parse_remote_url:  # a URL may carry credentials: never in a message
            from .compile_cache.urls import redact

            value = redact(str(value))
        shown = f"{setting.env}={value!r}" if origin == "environment" else f"{setting.name}: {value!r} ({origin})"
        choices = setting.choices.replace("`", "'")
        message = f"invalid {shown}: expected {choices}"
        super().__init__(f"{message}; {detail}" if detail else message)
        self.setting = setting
        self.value = value
        self.origin = origin


# ------------------------------------------------------------------ parsers (text from the environment, or
# a YAML value from a config file; each returns the typed value or raises ValueError with a detail)


def _words(value: Any) -> str:
    return str(value).strip().lower()


def parse_switch(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = _words(value)
    if text in ON_WORDS:
        return True
    if text in OFF_WORDS:
        return False
    raise ValueError("")


def parse_buckets(value: Any) -> BucketSpec:
    """``"pow2"``, ``"pow2-half"``, ``"fit"``, ``()`` for off, or a strictly ascending tuple of positive ints."""
    if value is False or value is None:
        return ()
    if isinstance(value, str):
        text = _words(value)
        if text in (POW2, POW2_HALF, FIT):
            return text
        if text in OFF_WORDS:
            return ()
        parts = [p.strip() for p in text.split(",")]
        if not all(p.isdigit() for p in parts):
            raise ValueError("")
        values: Sequence[Any] = [int(p) for p in parts]
    elif isinstance(value, Sequence):
        values = list(value)
    else:
        raise ValueError("")
    if any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in values):
        raise ValueError("")
    too_large = [v for v in values if v > MAX_BUCKET]
    if too_large:
        raise ValueError(f"{too_large[0]} is larger than {MAX_BUCKET}, the largest size a shape holds")
    if list(values) != sorted(set(values)):
        raise ValueError("these are out of order, or a bucket repeats")
    return tuple(values)


def parse_unrecorded_buckets(value: Any) -> BucketSpec:
    """As :func:`parse_buckets`, without ``fit``: a setting whose sizes no call records has nothing to fit to."""
    parsed = parse_buckets(value)
    if parsed == FIT:
        raise ValueError("this setting's sizes are not recorded, so there is nothing to fit buckets to")
    return parsed


#: The parsers of bucket lists (a setting whose parser is one of them is a bucket setting).
BUCKET_PARSERS = (parse_buckets, parse_unrecorded_buckets)


def parse_count(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("")
    text = str(value).strip()
    if not text.isdigit():
        raise ValueError("")
    return int(text)


def parse_positive_count(value: Any) -> int:
    count = parse_count(value)
    if count <= 0:
        raise ValueError("")
    return count


MAX_SAMPLING_TOPK = 4096


def parse_sampling_topk(value: Any) -> int:
    count = parse_positive_count(value)
    if count > MAX_SAMPLING_TOPK:
        raise ValueError(f"{count} candidates would sort more of each row than the anchors' 256 are meant to avoid")
    return count


def parse_text(value: Any) -> str:
    return str(value).strip()


def parse_remote_url(value: Any) -> Any:
    """``remote_cache``: a ``file://``, ``s3://`` or ``hf://`` URL (checked, not opened), or an off word -> None."""
    from .compile_cache import urls

    text = str(value).strip()
    if not text or _words(text) in OFF_WORDS:
        return None
    try:
        return urls.parse(text)
    except urls.RemoteURLError as exc:
        raise ValueError(str(exc)) from None


def parse_seconds(value: Any) -> float:
    """A positive, finite number of seconds."""
    if isinstance(value, bool):
        raise ValueError("")
    try:
        seconds = float(str(value).strip())
    except ValueError:
        raise ValueError("") from None
    if not 0 < seconds < float("inf"):
        raise ValueError("")
    return seconds


def parse_size_text(value: Any) -> str:
    text = str(value).strip()
    try:
        size = parse_size(text)
    except SizeTooLarge as exc:
        raise ValueError(str(exc).partition(": ")[2]) from None  # names the bound it passed
    except ValueError:
        raise ValueError("") from None
    if size <= 0:
        raise ValueError("")
    return text


def parse_folders(value: Any) -> tuple[str, ...]:
    """Absolute folder paths separated by ``os.pathsep`` (``:``), or a YAML list of them; empty: none."""
    items = [str(v) for v in value] if isinstance(value, list | tuple) else str(value).split(os.pathsep)
    folders = [os.path.expanduser(item.strip()) for item in items if item.strip()]
    relative = [f for f in folders if not os.path.isabs(f)]
    if relative:
        raise ValueError(f"{relative[0]!r} is not an absolute path")
    return tuple(folders)


_REGION_MODES = ("off", "layers", "auto")


def parse_regions(value: Any) -> str:
    """``compile_regions``: ``off``, ``layers`` or ``auto``."""
    text = _words(value)
    if text not in _REGION_MODES:
        raise ValueError("")
    return text


def parse_warmup_shapes(value: Any) -> str | int:
    """``serving_warmup_shapes``: ``auto``, ``all`` or a number of step shapes (0: no warm-up)."""
    if isinstance(value, bool):
        raise ValueError("")
    text = _words(value)
    if text in ("auto", "all"):
        return text
    return parse_count(text)


_LEVELS = ("debug", "info", "warning", "error", "critical")


def parse_level(value: Any) -> str:
    text = _words(value)
    if text not in _LEVELS:
        raise ValueError("")
    return text.upper()


def parse_fsdp_implementation(value: Any) -> str:
    text = _words(value)
    if text not in ("auto", "fully_shard"):
        raise ValueError("")
    return text


def parse_moe_experts(value: Any) -> str:
    text = _words(value)
    if text in OFF_WORDS:
        return "off"
    if text not in ("auto", "blockwise", "dense"):
        raise ValueError("")
    return text


#: The largest ``moe_block_size`` accepted (rows per block; NeuronX Distributed's default is 512).
MAX_MOE_BLOCK = 4096


def parse_moe_block_size(value: Any) -> int | None:
    """``auto`` -> None (chosen by the call's shape), or rows per block from 1 to :data:`MAX_MOE_BLOCK`."""
    if isinstance(value, str) and _words(value) == "auto":
        return None
    block = parse_positive_count(value)
    if block > MAX_MOE_BLOCK:
        raise ValueError(f"at most {MAX_MOE_BLOCK} rows per block")
    return block


def parse_capacity_factor(value: Any) -> float | None:
    """Off words -> None (dropless); else a finite factor > 0 (at most 64)."""
    if value is None or value is False:
        return None
    if isinstance(value, bool):
        raise ValueError("")
    if isinstance(value, str) and _words(value) in OFF_WORDS:
        return None
    try:
        factor = float(value)
    except (TypeError, ValueError):
        raise ValueError("") from None
    if not 0 < factor <= 64:  # also refuses nan and inf
        raise ValueError("")
    return factor


@dataclass(frozen=True)
class Plugins:
    """``ACCELERATE_NEURON_DISABLE``: every patch off (``all``), or the plugin names to skip."""

    all: bool
    names: frozenset[str]


def parse_plugins(value: Any) -> Plugins:
    if isinstance(value, bool):
        return Plugins(value, frozenset())
    if isinstance(value, Sequence) and not isinstance(value, str):
        return Plugins(False, frozenset(_words(v) for v in value if _words(v)))
    text = _words(value)
    if text in ON_WORDS or text == "all":
        return Plugins(True, frozenset())
    if text in OFF_WORDS or text == "":
        return Plugins(False, frozenset())
    # Names are checked against the plugins that exist when they load (unknown ones are reported then).
    return Plugins(False, frozenset(n.strip() for n in text.split(",") if n.strip()))


def parse_shard(value: Any) -> tuple[int, int] | None:
    """``"i/N"`` (0 <= i < N) -> (i, N); ``1`` means ``0/1``; off words -> None."""
    text = _words(value)
    if text in OFF_WORDS or text == "":
        return None
    if text in ON_WORDS:
        return 0, 1
    index, sep, count = text.partition("/")
    if not sep or not index.isdigit() or not count.isdigit() or not 0 <= int(index) < int(count):
        raise ValueError("")
    return int(index), int(count)


def parse_launch_config(value: Any) -> tuple[str, dict[str, Any]] | None:
    """``{"file": ..., "neuron_config": {...}}`` (JSON text) -> (file, checked block); off words -> None."""
    if isinstance(value, str):
        if _words(value) in OFF_WORDS or not value.strip():
            return None
        import json

        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(value, Mapping) or not isinstance(value.get("file"), str):
        raise ValueError("")
    block = value.get("neuron_config")
    return value["file"], check_config(block if block is not None else {}, value["file"])


# ------------------------------------------------------------------ the registry


@dataclass(frozen=True)
class Setting:
    """One ``ACCELERATE_NEURON_*`` setting."""

    name: str  # lowercase, the key in a ``neuron_config:`` block
    parse: Callable[[Any], Any]
    default: Any
    choices: str  # what is allowed, for errors and the reference table
    help: str
    section: str  # where the reference groups it
    default_text: str = ""  # the default as a user reads it, when ``default`` is not that
    hook: str = ""  # the plugin hook that answers it (precedence 3)
    config: bool = True  # may be set in ``neuron_config:`` (False: set by a command or for development)

    @property
    def env(self) -> str:
        return PREFIX + self.name.upper()

    @property
    def shown_default(self) -> str:
        if self.default_text:
            return self.default_text
        return "unset" if self.default in (None, "") else f"`{self.default}`"


_POWERS = "`pow2`, `pow2-half` (the powers of two and the points halfway between them)"
_LISTS = "`off`, or strictly ascending positive integers (at most 2147483647) separated by commas"
_BUCKETS = f"{_POWERS}, `fit` (fitted to the sizes this job's calls recorded), {_LISTS}"
_UNRECORDED_BUCKETS = f"{_POWERS}, {_LISTS}"
_SWITCH = "1, on, true or yes; 0, off, false or no"

SETTINGS: tuple[Setting, ...] = (
    # --- activation and the device
    Setting(
        "disable",
        parse_plugins,
        Plugins(False, frozenset()),
        "`1`/`all` (no patch), `0`/unset (every plugin), or plugin names separated by commas, e.g. "
        "`placement,generation`",
        "Apply no patch (`1`/`all`), or skip the named plugins (built-in or third-party). The simulated device "
        "still registers: it is a device, not a patch.",
        "activation",
        default_text="unset (every plugin on)",
    ),
    Setting(
        "simulate",
        parse_count,
        0,
        "a number of cores (`0`: off), e.g. `4`",
        "With no real Neuron device, register the simulated device with this many cores on `import torch`.",
        "activation",
        default_text="unset (no simulated device)",
        config=False,
    ),
    Setting(
        "sim_hbm",
        parse_size_text,
        "24GiB",
        "a positive size such as `24GiB`, `512MiB`, `300KB`",
        "Simulated memory per core (default: a trn2 logical core at LNC=2).",
        "activation",
        config=False,
    ),
    Setting(
        "cache_dir",
        parse_text,
        "",
        "a folder",
        "Where the simulated device's compiled library, the demo's toy model and (unless "
        "`TORCH_NEURONX_NEFF_CACHE_DIR` is set) the simulated NEFF cache are kept.",
        "activation",
        default_text="`$XDG_CACHE_HOME/accelerate_neuron` (`~/.cache/accelerate_neuron`)",
        config=False,
    ),
    Setting(
        "shared_cache_dirs",
        parse_folders,
        (),
        "absolute folder paths separated by `:`",
        "Cache folders that other users share on purpose (a team's `TORCH_NEURONX_NEFF_CACHE_DIR`): the plugin "
        "reads entries there that other users wrote, and writes its own readable by your group. Anywhere else, a "
        "folder or file owned by another user or writable by group/others is refused with a warning. A library is "
        "never loaded from a shared folder: the simulated device's is built in your own cache folder.",
        "activation",
        default_text="unset (no folder is shared)",
        config=False,
    ),
    Setting(
        "log_level",
        parse_level,
        "",
        "`debug`, `info`, `warning`, `error` or `critical`",
        "Level of the `accelerate_neuron` loggers (the messages a patch, a bucket or a recompile logs).",
        "activation",
        default_text="unset (Python's logging configuration decides; warnings show)",
    ),
    # --- generate()
    Setting(
        "static_cache",
        parse_switch,
        True,
        _SWITCH,
        "`generate()` on Neuron uses a static KV cache when the caller chose none (a dynamic cache changes shape "
        'every token); `0` keeps upstream\'s choice. `cache_implementation="dynamic"` opts one call out.',
        "generation",
        default_text="on",
    ),
    Setting(
        "cache_buckets",
        parse_buckets,
        POW2,
        _BUCKETS,
        "Static KV-cache lengths `generate()` rounds up to (`pow2`: powers of two from 64). A longer request gets "
        "its own length, with a warning.",
        "generation",
        hook="neuron_static_cache_length",
    ),
    Setting(
        "prompt_buckets",
        parse_buckets,
        POW2,
        _BUCKETS,
        "Prompt lengths `generate()` pads to, on the left (`pow2`: 16, 32, 64, ... up to `max_position_embeddings`); "
        "an encoder-decoder's encoder input is padded on the right. Inference calls (an encoder's forward, a "
        "pipeline, sentence-transformers) pad their sequence length on the right, to `pow2-half` when this is not "
        "set: a forward computes every padded position on every call, so two buckets an octave pay for their "
        "graphs there (`pow2` for the fewest graphs).",
        "generation",
        hook="neuron_generation_shape_policy",
        default_text="`pow2` (inference calls: `pow2-half`)",
    ),
    Setting(
        "batch_buckets",
        parse_buckets,
        POW2,
        _BUCKETS,
        "Batch sizes `generate()` and inference calls pad to with dummy rows (`pow2`: 1, 2, 4, ... 256).",
        "generation",
        hook="neuron_generation_shape_policy",
    ),
    Setting(
        "speculation",
        parse_switch,
        True,
        _SWITCH,
        "Assisted generation (`assistant_model=`, different tokenizers too) and prompt lookup "
        "(`prompt_lookup_num_tokens=`) on Neuron run the draft and the target compiled, each on a static KV cache "
        "rolled back by position, at a few bucketed widths; `0` leaves them to upstream's loop (a dynamic cache, "
        "eager, new op shapes every token).",
        "generation",
        default_text="on",
    ),
    Setting(
        "group_rows",
        parse_switch,
        True,
        _SWITCH,
        "Rows of one batch whose lengths fall in different length buckets run group by group, each group at its "
        "own bucket and batch bucket: `generate()`'s prefill (greedy and sampling calls; decode steps still run the "
        "batch together) and right-padded inference calls. More graphs (one per group shape) for fewer positions "
        "computed; `0` runs every row at its longest row's bucket.",
        "generation",
        default_text="on",
    ),
    Setting(
        "device_sampling",
        parse_switch,
        True,
        _SWITCH,
        "`generate()` and continuous batching on Neuron run the logits processors (temperature, top-k, top-p, "
        "min-p, repetition penalty, bans, ...) and the draw of the next token on the device, in a compiled graph, "
        "so one id per row crosses to the host instead of the logits row; the tokens are drawn from the device's "
        "random numbers (reproducible under a seed, not the CPU's tokens). `0`: upstream's host path.",
        "generation",
        default_text="on",
    ),
    Setting(
        "candidate_buckets",
        parse_unrecorded_buckets,
        POW2,
        _UNRECORDED_BUCKETS,
        "Candidate counts one speculative verification forward is padded to (`pow2`: 1, 2, 4, ... 64), plus the "
        "call's own `num_assistant_tokens` / `prompt_lookup_num_tokens` when it does not change during the call; "
        "more candidates than the largest bucket run at a prompt bucket. `off`: every count its own graph.",
        "generation",
    ),
    Setting(
        "sampling_topk",
        parse_sampling_topk,
        256,
        f"an integer from 1 to {MAX_SAMPLING_TOPK}",
        "Candidates of on-device sampling's fast path: the warpers and the draw run on each row's best K tokens, "
        "exact when `top_k` is at most K. A call with no `top_k`, or a larger one, samples over the whole "
        "vocabulary instead (exact too, no sort, a heavier graph); continuous batching caps a request's top_k "
        "at K (said once).",
        "generation",
    ),
    Setting(
        "bucket_forwards",
        parse_switch,
        True,
        _SWITCH,
        "Inference calls of a model on Neuron (`model(...)` without gradients, pipelines, sentence-transformers) "
        "pad their inputs to the prompt and batch buckets and run compiled; `0` leaves them as upstream runs them. "
        "`accelerate_neuron.disable_bucketing(model)` opts one model out.",
        "inference",
        default_text="on",
    ),
    Setting(
        "compile_regions",
        parse_regions,
        "auto",
        "`off`, `layers` or `auto`",
        "What `generate()` and bucketed inference calls compile. `layers`: each decoder layer (the model's "
        "repeated block) is its own compiled region, on the core holding its weights, and identical layers share "
        "one graph per shape; embeddings, mask, final norm and head run eagerly. `off`: the whole model is one "
        "graph on one core, and a model split over several cores runs eagerly. `auto`: `layers` for a model split "
        "over several cores, the whole model on one core.",
        "generation",
    ),
    Setting(
        "moe_experts",
        parse_moe_experts,
        "auto",
        "`auto`, `blockwise`, `dense` or `off`",
        "Mixture-of-experts layers on Neuron when the model did not ask for an `experts_implementation`: `auto` "
        "runs each call blockwise (the (token, expert) pairs sorted into blocks of one expert each: about the "
        "FLOPs of a sparse dispatch), or gathers each pair's expert weights when a call routes fewer pairs than "
        "there are experts (small decode batches); `blockwise` always the former; `dense` runs every expert on "
        "every token (`experts / top_k` times the FLOPs); `off` leaves upstream's default (`grouped_mm`, "
        "routing-dependent shapes). Every choice is exact and has shapes fixed by the call's shape, never by the "
        "routing.",
        "moe",
    ),
    Setting(
        "moe_block_size",
        parse_moe_block_size,
        None,
        f"`auto`, or rows per block from 1 to {MAX_MOE_BLOCK}",
        "Rows per block of the blockwise experts. `auto`: per call shape, the largest power of two (at most 512) "
        "whose worst-case padding is at most half the call's (token, expert) pairs (at most 1.5x a sparse "
        "dispatch's FLOPs). Larger blocks: larger matmuls and fewer expert-weight reads, more padded rows.",
        "moe",
        default_text="`auto`",
    ),
    Setting(
        "moe_capacity_factor",
        parse_capacity_factor,
        None,
        "`off`, or a factor > 0 up to 64, e.g. `1.25`",
        "Blockwise experts with a fixed capacity per expert, `min(tokens, ceil(tokens * top_k * factor / "
        "experts))` rows, as NeuronX Distributed's `capacity_factor`: pairs past an expert's capacity are "
        "**dropped** (results change; counted in `accelerate_neuron.moe_stats()`). Also the per-peer capacity of "
        "the expert-parallel exchange. `off`: dropless.",
        "moe",
        default_text="`off` (dropless)",
    ),
    # --- training
    Setting(
        "train_buckets",
        parse_buckets,
        POW2,
        _BUCKETS,
        "Lengths a compiled training batch is right-padded to (`pow2`: 64, 128, ... up to the model's maximum "
        "length). A resumed run adopts its checkpoint's buckets unless this is set.",
        "training",
        hook="neuron_training_shape_policy",
    ),
    Setting(
        "recompile_warmup",
        parse_count,
        1,
        "a number of calls (>= 0), e.g. `1`",
        "Calls of a compiled model before a new graph counts as a recompile and is warned about.",
        "training",
    ),
    Setting(
        "fsdp_implementation",
        parse_fsdp_implementation,
        "auto",
        "`auto` or `fully_shard`",
        "FSDP of `DistributedConfig(fsdp_size=N)` on Neuron: `auto` keeps each parameter sharded as a DTensor "
        "gathered inside the compiled step (all-gathers and reduce-scatters traced into it: one forward and one "
        "backward graph per step), where it applies (not with expert parallelism, HSDP, pipeline parallelism, CPU "
        "offload or FSDP's mixed-precision policy); `fully_shard`: upstream's FSDP2, whose hooks end a graph at "
        "every FSDP unit.",
        "training",
    ),
    # --- continuous batching (generate_batch, init_continuous_batching, `transformers serve --continuous-batching`)
    Setting(
        "serving_token_buckets",
        parse_buckets,
        POW2,
        _BUCKETS,
        "Query tokens a continuous-batching step on Neuron is padded to (`pow2`: 16, 32, ... 512); the largest is "
        "the step's token budget (a longer prompt is split across steps). `off` (here or in "
        "`ACCELERATE_NEURON_SERVING_KV_BUCKETS`): no padding and no compiled step, upstream's eager path (the KV "
        "cache keeps its Neuron size).",
        "serving",
        hook="neuron_serving_shape_policy",
    ),
    Setting(
        "serving_kv_buckets",
        parse_buckets,
        POW2,
        _BUCKETS,
        "KV-cache tokens one continuous-batching step reads (all its requests together), padded to (`pow2`: 512, "
        "1024, ... up to the cache's capacity, which is always the last bucket). `off`: as for "
        "`ACCELERATE_NEURON_SERVING_TOKEN_BUCKETS`.",
        "serving",
        hook="neuron_serving_shape_policy",
    ),
    Setting(
        "serving_kv_cache_tokens",
        parse_positive_count,
        16384,
        "a number of tokens (> 0), e.g. `32768`",
        "Tokens the paged KV cache of continuous batching holds on its core (16384: 2 GiB for a Llama-3.1-8B in "
        "bf16, 128 KiB a token). A request longer than this (prompt + max_new_tokens) is refused with an error. "
        "The default shrinks, with a warning, to what fits in 90% of the core's free memory; a value you set that "
        "does not fit is an error.",
        "serving",
        hook="neuron_serving_shape_policy",
    ),
    Setting(
        "serving_warmup_shapes",
        parse_warmup_shapes,
        "auto",
        "`auto`, `all`, or a number of step shapes (`0`: no warm-up)",
        "Which (query tokens, KV tokens) step shapes continuous batching's warm-up compiles, each a graph: `auto`, "
        "the shapes a step can reach (from the requests' number, longest prompt and max_new_tokens when "
        "generate_batch knows them; else the whole grid); `all`, the whole grid; N, at most N of the reachable "
        "ones, smallest first (the others compile when a step first needs them). The grid and its estimated "
        "compile time are logged before warming.",
        "serving",
    ),
    # --- the compile cache shared by a fleet
    Setting(
        "remote_cache",
        parse_remote_url,
        None,
        "a URL: `file:///shared/folder` (or an absolute path), `s3://bucket/prefix`, `hf://datasets/org/repo`; or "
        "`off`",
        "A compile cache shared by a fleet, behind the local NEFF cache: a local miss is looked up there before "
        "compiling, and what this host compiles is published there in the background. `s3://` needs `s3fs` "
        "(credentials from the standard AWS chain), `hf://` needs `huggingface_hub`. See Compile once.",
        "compile cache",
        default_text="unset (no remote tier)",
    ),
    Setting(
        "remote_cache_read_only",
        parse_switch,
        False,
        _SWITCH,
        "Fetch from `remote_cache` but never publish to it (serving hosts, consumers without write access).",
        "compile cache",
        default_text="off",
    ),
    Setting(
        "remote_cache_timeout",
        parse_seconds,
        60.0,
        "a positive number of seconds, e.g. `60`",
        "How long a process waits at exit for its entries to reach `remote_cache`; what is left stays in the "
        "local cache (`accelerate-neuron cache push` publishes it).",
        "compile cache",
        default_text="`60`",
    ),
    # --- set by the commands (children read them); listed so that `env` and the reference know them
    Setting(
        "report_dir",
        parse_text,
        "",
        "a folder",
        "Where simulated processes write their dry-run records (set by `accelerate-neuron simulate`).",
        "commands",
        config=False,
    ),
    Setting(
        "precompile",
        parse_shard,
        None,
        "`i/N` with 0 <= i < N, `1` (one worker), or `0`/unset",
        "Run the script in warm-up mode as worker i of N (set by `accelerate-neuron precompile`).",
        "commands",
        config=False,
    ),
    Setting(
        "precompile_progress",
        parse_text,
        "",
        "a file",
        "Where a warm-up worker reports its progress (set by `accelerate-neuron precompile`).",
        "commands",
        config=False,
    ),
    Setting(
        "precompile_token",
        parse_text,
        "",
        "a token",
        "Proves that `accelerate-neuron precompile` started this process (it must match the token file the "
        "command keeps in its scratch folder while it runs): without it, `ACCELERATE_NEURON_PRECOMPILE` is "
        "ignored with a warning (set by `accelerate-neuron precompile`).",
        "commands",
        config=False,
    ),
    Setting(
        "precompile_scratch",
        parse_text,
        "",
        "a folder",
        "Scratch folder of a warm-up worker (set by `accelerate-neuron precompile`).",
        "commands",
        config=False,
    ),
    # --- the simulated device's own (read by the simulator)
    Setting(
        "sim_cpu_fallback_ops",
        parse_text,
        "aten::histc",
        "ATen op names separated by commas (`aten::histc,aten::normal_`), or `none`",
        "Ops the simulated device runs on the host with a copy each way, as the real backend's CPU fallback does: "
        "counted per call, never compiled.",
        "simulator",
        config=False,
    ),
    Setting(
        "sim_mem_get_info",
        parse_switch,
        False,
        _SWITCH,
        "Offer `torch.neuron.mem_get_info` on the simulated device, as newer Neuron SDKs do.",
        "simulator",
        default_text="off",
        config=False,
    ),
    Setting(
        "launch_config",
        parse_launch_config,
        None,
        'a JSON object `{"file": ..., "neuron_config": {...}}`',
        "The `neuron_config:` block of the Accelerate config file `accelerate launch` read, handed to every "
        "process it starts (set by `accelerate launch` with accelerate-neuron active).",
        "commands",
        config=False,
    ),
    # --- development
    Setting(
        "sim_asan",
        parse_switch,
        False,
        _SWITCH,
        "Build and load the AddressSanitizer flavour of the simulated device (see Development).",
        "development",
        default_text="off",
        config=False,
    ),
    Setting(
        "test_raise_in_activation",
        parse_switch,
        False,
        _SWITCH,
        "Make activation raise, to test that `import torch` survives it.",
        "development",
        default_text="off",
        config=False,
    ),
)

_BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


def setting(name: str) -> Setting:
    """The registered setting ``name`` (``"prompt_buckets"``; its variable name is accepted too)."""
    key = name[len(PREFIX) :].lower() if name.startswith(PREFIX) else name
    try:
        return _BY_NAME[key]
    except KeyError:
        raise KeyError(f"no accelerate-neuron setting named {name!r}; known: {', '.join(_BY_NAME)}") from None


def env_name(name: str) -> str:
    return setting(name).env


# ------------------------------------------------------------------ layers


@dataclass(frozen=True)
class Value:
    """A setting's value and where it came from."""

    value: Any
    source: str  # "environment", "config", "hook" or "default"
    detail: str = ""  # e.g. "ACCELERATE_NEURON_PROMPT_BUCKETS=off", the config file, the hook's name

    @property
    def explicit(self) -> bool:
        """Chosen by the user (environment or config file), not by a plugin or the default."""
        return self.source in ("environment", "config")

    def describe(self) -> str:
        return self.detail or self.source


#: The config-file layer: setting name -> raw value, and where it was read. Empty until installed.
_config: tuple[Mapping[str, Any], str] = ({}, "")


def config_keys() -> list[str]:
    """The keys a ``neuron_config:`` block accepts: the settings' names."""
    return [s.name for s in SETTINGS if s.config]


def check_config(values: Any, origin: str) -> dict[str, Any]:
    """A ``neuron_config:`` block checked: a mapping whose keys name settings that may be set there, whose values
    those settings accept. Returns it as a plain dict; raises ValueError naming the bad key or value and what is
    allowed (``origin``: the file it came from)."""
    if not isinstance(values, Mapping):
        raise ValueError(
            f"neuron_config in {origin} must be a mapping of setting names to values (e.g. "
            f"'prompt_buckets: [64, 256]'), not {type(values).__name__} {values!r}"
        )
    checked = {}
    for key, raw in values.items():
        item = _BY_NAME.get(key) if isinstance(key, str) else None
        if item is None:
            raise ValueError(
                f"unknown key {key!r} in neuron_config ({origin}){_close(key)}; known keys: " + ", ".join(config_keys())
            )
        if not item.config:
            raise ValueError(f"{key!r} cannot be set in neuron_config ({origin}): set {item.env} in the environment")
        _parse(item, raw, f"neuron_config in {origin}")
        checked[key] = raw
    return checked


def _close(key: Any) -> str:
    import difflib

    text = str(key).lower().removeprefix(PREFIX.lower())
    match = difflib.get_close_matches(text, config_keys(), n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def use_config(values: Mapping[str, Any], origin: str) -> None:
    """Install the config-file layer (``neuron_config:`` of Accelerate's config): checked, then kept."""
    global _config
    _config = (check_config(values, origin), origin)


@contextlib.contextmanager
def config_layer(values: Mapping[str, Any], origin: str) -> Iterator[None]:
    """:func:`use_config` for the block only (``accelerate-neuron env --config_file``, tests); the previous layer
    is back afterwards."""
    global _config
    previous = _config
    use_config(values, origin)
    try:
        yield
    finally:
        _config = previous


def config_origin() -> str:
    """Where the installed config layer came from ("" if none is installed)."""
    return _config[1]


def config_value(name: str, value: Any) -> Any:
    """Setting ``name``'s parsed ``value`` as a ``neuron_config:`` block writes it (plain YAML/JSON types)."""
    item = setting(name)
    if isinstance(value, Plugins):
        return "all" if value.all else sorted(value.names)
    if item.parse in BUCKET_PARSERS:
        return "off" if value == () else value if isinstance(value, str) else list(value)
    if item.parse is parse_level:
        return str(value).lower()
    if item.parse is parse_remote_url:
        return "off" if value is None else value.url
    if item.parse is parse_moe_block_size and value is None:
        return "auto"
    if item.parse is parse_capacity_factor and value is None:
        return "off"
    return value


def _parse(item: Setting, raw: Any, origin: str) -> Any:
    try:
        return item.parse(raw)
    except ValueError as exc:
        raise SettingError(item, raw, origin, str(exc)) from None


def parse(name: str, raw: Any, origin: str = "environment") -> Any:
    """``raw`` as setting ``name`` reads it, or :class:`SettingError` (``origin``: where the value came from)."""
    return _parse(setting(name), raw, origin)


def _raw_env(item: Setting) -> str | None:
    raw = os.environ.get(item.env)
    return raw if raw is not None and raw.strip() != "" else None


def explicit(name: str) -> Value | None:
    """The user's own choice (environment, then config file), parsed; None if they made none."""
    item = setting(name)
    raw = _raw_env(item)
    if raw is not None:
        return Value(_parse(item, raw, "environment"), "environment", f"{item.env}={raw}")
    values, origin = _config
    if item.name in values:
        raw = values[item.name]
        return Value(_parse(item, raw, f"neuron_config in {origin}"), "config", f"neuron_config in {origin}")
    return None


def resolve(name: str, hook: Callable[[], Any] | None = None) -> Value:
    """The value in force: environment > config file > ``hook()`` (None: no answer) > default.

    A hook's answer is checked by the same parser as the user's text, so a plugin
    cannot set what a user could not.
    """
    chosen = explicit(name)
    if chosen is not None:
        return chosen
    item = setting(name)
    if hook is not None:
        answer = hook()
        if answer is not None:
            return Value(_parse(item, answer, f"plugin hook {item.hook}"), "hook", f"plugin hook {item.hook}")
    return Value(item.default, "default", "built-in default")


def get(name: str) -> Any:
    """The value in force of a setting no hook answers."""
    return resolve(name).value


def get_quietly(name: str) -> Any:
    """:func:`get`, with the default in place of a bad value (for code that must never raise)."""
    try:
        return get(name)
    except ValueError:
        return setting(name).default


def problems() -> list[str]:
    """Every set value that does not parse (``accelerate-neuron env`` reports these)."""
    out = []
    for item in SETTINGS:
        try:
            explicit(item.name)
        except ValueError as exc:
            out.append(str(exc))
    return out


def unknown_variables() -> list[str]:
    """``ACCELERATE_NEURON_*`` variables in the environment that name no setting (a typo, a removed one)."""
    known = {s.env for s in SETTINGS}
    return sorted(k for k in os.environ if k.startswith(PREFIX) and k not in known)


def raw(name: str) -> tuple[Any, str] | None:
    """The user's unparsed value of setting ``name`` and where it is set (``"environment"`` or the config file)."""
    item = setting(name)
    text = _raw_env(item)
    if text is not None:
        return text, "environment"
    values, origin = _config
    if item.name in values:
        return values[item.name], f"neuron_config in {origin}"
    return None


def effective() -> Iterator[tuple[Setting, Value | None, str]]:
    """Each setting with the user's value (None: not set) and an error text ("" if it parses)."""
    for item in SETTINGS:
        try:
            yield item, explicit(item.name), ""
        except ValueError as exc:
            yield item, None, str(exc)


#: Where docs/settings.md keeps the generated table (:func:`reference_block` prints it).
TABLE_START = "<!-- settings table: generated from accelerate_neuron.settings (reference_block()), do not edit -->"
TABLE_END = "<!-- end of settings table -->"


def cache_dir() -> Path:
    """The ``cache_dir`` setting, or :func:`default_cache_dir`."""
    chosen = get("cache_dir")
    if chosen:
        return Path(chosen).expanduser()
    return default_cache_dir()


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/accelerate_neuron`` (``~/.cache/accelerate_neuron``): the user's own."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "accelerate_neuron"


def reference_table(section: str | None = None) -> str:
    """The settings as a Markdown table (the reference in docs/settings.md is generated from this)."""
    rows = ["| variable | values | default | what it does |", "|---|---|---|---|"]
    for item in SETTINGS:
        if section is not None and item.section != section:
            continue
        hook = f" A plugin can answer it through `{item.hook}`." if item.hook else ""
        config = "" if item.config else " Environment only."
        rows.append(f"| `{item.env}` | {item.choices} | {item.shown_default} | {item.help}{hook}{config} |")
    return "\n".join(rows)


def reference_block() -> str:
    """docs/settings.md's generated settings block, markers included."""
    return f"{TABLE_START}\n{reference_table()}\n{TABLE_END}"
