"""Helpers every benchmark script shares (run as ``python benchmarks/NAME.py``: this folder is on ``sys.path``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

import torch


@contextlib.contextmanager
def environment(values: Mapping[str, str | None]) -> Iterator[None]:
    """``os.environ`` with ``values`` set (``None``: unset) for the block, then as it was."""
    saved = {key: os.environ.get(key) for key in values}
    try:
        _apply(values)
        yield
    finally:
        _apply(saved)


def _apply(values: Mapping[str, str | None]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def left_padded(batch: list[list[int]]) -> dict[str, torch.Tensor]:
    """Token-id prompts as one left-padded batch (pad id 0), as a decoder's tokenizer pads them."""
    width = max(map(len, batch))
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(batch):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return {"input_ids": ids, "attention_mask": mask}


def emit(text: str, output: str | None) -> None:
    """Print a markdown section, and append it to ``output`` when one is given."""
    print(text)
    if output:
        with open(output, "a", encoding="utf-8") as fh:
            fh.write(text + "\n")
