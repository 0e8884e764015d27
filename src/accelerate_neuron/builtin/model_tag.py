"""A model's graph identity: same class and config, same graphs (weights are graph inputs).

The warm-up keys the shapes it claims by it, so every worker process (and every
rank) names a model's graphs alike; continuous batching's warm-up claims its
step shapes under it too.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Any

_tags: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def model_tag(model: Any) -> str:
    """``Class:hash-of-config``, stable across worker processes."""
    tag = _tags.get(model)
    if tag is None:
        try:
            text = model.config.to_json_string(use_diff=False)
        except Exception:
            text = repr(getattr(model, "config", None))
        tag = f"{type(model).__qualname__}:{hashlib.sha256(text.encode()).hexdigest()[:12]}"
        _tags[model] = tag
    return tag
