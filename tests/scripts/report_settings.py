"""Used by tests/test_accelerate_config.py: what a launched process sees of accelerate-neuron's settings.

    accelerate launch --config_file F report_settings.py OUT_DIR

Writes OUT_DIR/rank<RANK>.json: each setting's value and source as this process resolves it, the plugins
active, and the generate() bucket policy the generation plugin derives from them. Imports no model.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch  # noqa: F401 - activation: the block accelerate launch handed over is installed here

import accelerate_neuron
from accelerate_neuron import settings
from accelerate_neuron.builtin import shapes


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for item in settings.SETTINGS:
        value = settings.resolve(item.name)
        shown = value.value
        if isinstance(shown, settings.Plugins):
            shown = {"all": shown.all, "names": sorted(shown.names)}
        rows[item.name] = {"value": shown, "source": value.source, "detail": value.detail}
    status = accelerate_neuron.status()
    policy = shapes.resolve_policy(256)
    report = {
        "rank": int(os.environ.get("RANK", "0")),
        "settings": rows,
        "plugins_on": sorted(p["name"] for p in status.plugins if p["active"]),
        "prompt_buckets": list(policy.prompt_buckets),
        "batch_buckets": list(policy.batch_buckets),
    }
    (out / f"rank{report['rank']}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
