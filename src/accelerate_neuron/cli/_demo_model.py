"""The demo's embedded default model: a toy Qwen3 and tokenizer, built offline and cached.

Random weights would print noise, so the first run trains the toy model for a
few seconds on :data:`accelerate_neuron.tiny.CORPUS` (seven sentences) until
it recites them; the folder is then reused. Nothing is downloaded.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
from pathlib import Path

from ._common import Progress

FAMILY = "qwen3"
TRAIN_STEPS = 40
CONTEXT = 32
LEARNING_RATE = 1e-2
#: Bump when the recipe changes so stale cached folders are not reused.
RECIPE = 1


def folder() -> Path:
    """Where the demo model is cached (per transformers release: saved configs differ between them)."""
    from ..simulator._build import cache_dir

    try:
        transformers_version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        transformers_version = "unknown"
    return cache_dir() / f"demo-model-{FAMILY}-r{RECIPE}-transformers-{transformers_version}"


def _training_rows(tokenizer: object) -> list[list[int]]:
    """The corpus rotated to start at each sentence, so a prompt starting any sentence continues it."""
    from .. import tiny

    sentences = [s.strip() + " ." for s in tiny.CORPUS.split(" . ") if s.strip()]
    rows = []
    for i in range(len(sentences)):
        text = " ".join(sentences[i:] + sentences[:i])
        rows.append(tokenizer(text)["input_ids"][:CONTEXT])
    return rows


def build(target: Path) -> Path:
    """Train the toy model on the CPU and save it with its tokenizer to ``target``."""
    import torch
    from transformers.utils import logging as hf_logging

    from .. import tiny

    hf_logging.disable_progress_bar()  # the demo's step line says what is happening
    tokenizer = tiny.tokenizer()
    model = tiny.model(FAMILY, seed=0, vocab_size=len(tokenizer)).train()
    batch = torch.tensor(_training_rows(tokenizer))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    for _ in range(TRAIN_STEPS):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def ensure(progress: Progress) -> Path:
    """The cached demo model folder, building it on first use."""
    final = folder()
    if (final / "config.json").is_file() and (final / "tokenizer.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with progress.step(
        f"building the demo model (first run only): a toy {FAMILY} trained for {TRAIN_STEPS} steps, cached in {final}"
    ):
        staging = Path(tempfile.mkdtemp(prefix=final.name + ".building-", dir=final.parent))
        try:
            build(staging)
            if final.exists() and not (final / "config.json").is_file():
                shutil.rmtree(final, ignore_errors=True)  # an interrupted earlier build
            os.replace(staging, final)
        except OSError:
            if not (final / "config.json").is_file():  # not a concurrent run that finished first
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return final
