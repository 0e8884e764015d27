"""Cost of the ``torch.backends`` entry point on ``import torch``.

Runs ``import torch`` in fresh interpreters, alternating with the entry point
(the default) and without it (``TORCH_DEVICE_BACKEND_AUTOLOAD=0``), and
reports the median import time of each and their ratio. Each child times its
own ``import torch`` (interpreter start-up excluded) and reports the
plugin's own activation time from ``accelerate_neuron.status()``.

    python benchmarks/import_overhead.py [--runs 30] [--simulate N]

``--simulate N`` measures a simulated-Neuron host instead (the plugin is
active there; the simulated device must already be built, which the script
ensures with a warm-up run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
activation = None
if "accelerate_neuron" in __import__("sys").modules:
    import accelerate_neuron
    activation = accelerate_neuron.status().activation_seconds
print(json.dumps({"import_torch": t1 - t0, "activation": activation}))
"""


def _run(autoload: bool, simulate: int | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_NEURON_SIMULATE")}
    if not autoload:
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    if simulate:
        env["ACCELERATE_NEURON_SIMULATE"] = str(simulate)
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="runs per variant (default 30)")
    parser.add_argument("--simulate", type=int, default=None, help="simulate N Neuron cores")
    args = parser.parse_args()
    if args.runs < 3:
        parser.error(f"--runs must be at least 3, got {args.runs}")
    _run(True, args.simulate)  # warm caches (and build the simulator once)
    _run(False, args.simulate)
    with_ep, without_ep, activation = [], [], []
    for _ in range(args.runs):
        a = _run(True, args.simulate)
        b = _run(False, args.simulate)
        with_ep.append(a["import_torch"])
        without_ep.append(b["import_torch"])
        if a["activation"] is not None:
            activation.append(a["activation"])
    med_with, med_without = statistics.median(with_ep), statistics.median(without_ep)
    med_act = statistics.median(activation) if activation else float("nan")
    result = {
        "scenario": f"simulated Neuron ({args.simulate} cores)" if args.simulate else "no Neuron device",
        "runs": args.runs,
        "import_torch_with_entry_point_s": round(med_with, 4),
        "import_torch_without_entry_point_s": round(med_without, 4),
        "ratio": round(med_with / med_without, 4),
        "activation_s": round(med_act, 5),
        "activation_share_of_import": round(med_act / med_with, 4),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
