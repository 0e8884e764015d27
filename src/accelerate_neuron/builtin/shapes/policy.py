"""Which buckets are in force: each bucket setting through ``settings``' one precedence, and the model's limits.

A bucket setting's value is the environment's, else the ``neuron_config:``
block's, else the answer of the plugin hook that owns it, else ``pow2`` (the
capability's powers of two): :func:`accelerate_neuron.settings.resolve`. A
hook's answer is a dict of named bucket lists, checked here once for every
hook (:func:`hook_answer`); a list is parsed by the same parser as the user's
text, so a plugin cannot set what a user could not. The buckets then stop at
what the model can address (:meth:`.Buckets.capped`).

The prompt and batch buckets of ``generate()`` and of bucketed inference
calls are one policy (:class:`ShapePolicy`, the ``neuron_generation_shape_policy``
hook, asked with the call's ``purpose``: the built-in answers are ``pow2`` for
``generate()`` and ``pow2-half`` prompt buckets for inference calls); the
KV-cache, training and serving policies use the same lookup.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ... import settings
from .buckets import Buckets, pow2
from .record import fitted_buckets

PROMPT_BUCKETS_ENV = settings.env_name("prompt_buckets")
BATCH_BUCKETS_ENV = settings.env_name("batch_buckets")
#: Shortest ``pow2`` prompt bucket: shorter prefills cost next to nothing, and would each be a graph.
MIN_PROMPT_BUCKET = 16
#: Without a known context length, ``pow2`` length buckets stop here (a longer input runs at its own length).
DEFAULT_MAX_LENGTH = 8192
#: Largest ``pow2`` batch bucket; larger batches run at their own size.
MAX_BATCH_BUCKET = 256
#: Config attributes that bound the positions a model addresses, most common first.
_POSITION_LIMITS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
_GENERATION_KEYS = ("prompt_buckets", "batch_buckets")


def max_positions(model: Any) -> int | None:
    """The positions ``model`` (or a config) addresses: its text decoder's ``max_position_embeddings`` (or the
    same bound under another name); None if the config does not say."""
    config = getattr(model, "config", model)
    try:
        config = config.get_text_config(decoder=True)
    except Exception:
        pass
    for name in _POSITION_LIMITS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def hook_answer(hook: str, keys: Sequence[str], **kwargs: Any) -> Mapping[str, Any]:
    """The plugins' answer to the shape-policy hook ``hook`` ({} for none): a dict whose keys are among ``keys``,
    or a ValueError naming the hook, its answer and the keys allowed."""
    from ...plugins import call_hook

    answer = call_hook(hook, **kwargs)
    if answer is None:
        return {}
    if not isinstance(answer, Mapping) or set(answer) - set(keys):
        unknown = sorted(set(answer) - set(keys)) if isinstance(answer, Mapping) else []
        detail = f" (unknown key(s) {unknown})" if unknown else ""
        raise ValueError(f"{hook} returned {answer!r}{detail}: expected a dict with keys among {list(keys)}, or None")
    return answer


def buckets(
    setting: str,
    answer: Mapping[str, Any],
    key: str,
    default: Callable[[], Buckets],
    limit: int | None = None,
    record: str | None = None,
) -> Buckets:
    """Setting ``setting``'s buckets: environment > config file > ``answer[key]`` (a hook's) > ``pow2``, where
    ``pow2`` is ``default()`` and ``fit`` the buckets fitted to model ``record``'s recorded sizes (:mod:`.record`);
    capped at ``limit`` (the positions the model addresses) when given."""
    spec = settings.resolve(setting, hook=lambda: answer.get(key)).value
    return from_spec(spec, setting, default, record).capped(limit)


def from_spec(
    spec: settings.BucketSpec, setting: str, default: Callable[[], Buckets], record: str | None = None
) -> Buckets:
    """The buckets a resolved value of ``setting`` names: ``pow2`` is ``default()``, ``pow2-half`` those and their
    halfway points, ``fit`` the buckets fitted to model ``record``'s recorded sizes, a list itself."""
    if spec == settings.POW2:
        return default()
    if spec == settings.POW2_HALF:
        return default().halved()
    if spec == settings.FIT:
        return fitted_buckets(record, setting, default)
    return Buckets(spec, setting)


@dataclass(frozen=True)
class ShapePolicy:
    """The prompt-length and batch-size buckets of ``generate()`` and of bucketed inference calls."""

    prompt_buckets: Buckets
    batch_buckets: Buckets

    def __post_init__(self) -> None:  # plain lists are accepted (a test's, a plugin's): checked as buckets
        object.__setattr__(self, "prompt_buckets", Buckets(self.prompt_buckets, "prompt_buckets"))
        object.__setattr__(self, "batch_buckets", Buckets(self.batch_buckets, "batch_buckets"))

    def prompt_bucket(self, length: int) -> int | None:
        """The prompt bucket for ``length`` tokens, or None when none holds it (or bucketing is off)."""
        return self.prompt_buckets.at_least(length)

    def batch_bucket(self, size: int) -> int | None:
        """The batch bucket for ``size`` rows, or None when none holds it (or bucketing is off)."""
        return self.batch_buckets.at_least(size)


def pow2_prompt_buckets(max_position_embeddings: int | None) -> Buckets:
    """Powers of two from :data:`MIN_PROMPT_BUCKET` up to the context length (which is the last)."""
    return pow2(MIN_PROMPT_BUCKET, max_position_embeddings or DEFAULT_MAX_LENGTH, "prompt_buckets")


def pow2_batch_buckets() -> Buckets:
    return pow2(1, MAX_BATCH_BUCKET, "batch_buckets")


def resolve_policy(
    max_position_embeddings: int | None, record: str | None = None, purpose: str = "generate"
) -> ShapePolicy:
    """The prompt and batch buckets in force for a model of ``max_position_embeddings`` positions (``record``: the
    model's record key, for ``fit``), for ``generate()`` (``purpose="generate"``) or an inference call
    (``"forward"``)."""
    answer = hook_answer(
        "neuron_generation_shape_policy",
        _GENERATION_KEYS,
        max_position_embeddings=max_position_embeddings,
        purpose=purpose,
    )
    return ShapePolicy(
        buckets(
            "prompt_buckets",
            answer,
            "prompt_buckets",
            lambda: pow2_prompt_buckets(max_position_embeddings),
            max_position_embeddings,
            record,
        ),
        buckets("batch_buckets", answer, "batch_buckets", pow2_batch_buckets, record=record),
    )
