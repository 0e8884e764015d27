"""What the installed upstream releases offer, probed once where several plugins ask the same question."""

from __future__ import annotations

import importlib.util
from typing import Any

#: Transformers' continuous batching package.
CB = "transformers.generation.continuous_batching"


def without_step_padding(_original: Any = None) -> str | None:
    """Feature probe of the patches: the release's continuous batching pads and compiles its step (``model_runner``).

    None when it does; otherwise why not (a patch's ``needed`` answer: the patch is skipped with that reason).
    """
    if importlib.util.find_spec(f"{CB}.model_runner") is None:
        return (
            f"this release's continuous batching has no {CB}.model_runner (no step padding or compile configs, "
            "e.g. 4.57): left as upstream has it"
        )
    return None
