"""``accelerate-neuron simulate [options] -- CMD ...``: dry-run a command on a simulated Neuron device."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .. import settings
from ._children import Terminated, Tree, sigterm_raises
from ._common import CliError, add_cost_options, add_device_options, add_json_option, print_json

DEFAULT_CORES = 4

DESCRIPTION = """\
Run CMD with a simulated Neuron device in every Python process it starts (a
script, `python -m ...`, `accelerate launch ...`, `torchrun ...`), then print a
dry-run report: where the model landed on each core, peak memory per core,
graphs compiled and their input shapes, eager op signatures, host/device
transfers, the top causes of recompiles and an estimate of the compile time
the run would pay on Trainium, cold and with what the simulated NEFF cache
(TORCH_NEURONX_NEFF_CACHE_DIR) already holds. No Trainium and no script change
needed.

The default device is one trn2 chip at LNC=2: 4 cores of 24 GiB.
The exit code is CMD's. SIGTERM or Ctrl-C ends CMD and every process it
started (a launcher's ranks too)."""

EPILOG = """\
examples:
  accelerate-neuron simulate -- python generate.py
  accelerate-neuron simulate --cores 2 -- torchrun --nproc-per-node 2 train.py
  accelerate-neuron simulate --json -- accelerate launch train.py > report.json

A bare `python`, `accelerate` or `torchrun` in CMD resolves to the environment
accelerate-neuron is installed in. With --json, stdout is only the report (one
JSON line); CMD's own stdout goes to stderr."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="dry-run a command on a simulated Neuron device and report placement, memory and compiles",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_device_options(p, cores=DEFAULT_CORES, cores_help="simulated NeuronCores (4 = one trn2 chip at LNC=2)")
    add_cost_options(p)
    add_json_option(p, "the report")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command to run")
    p.set_defaults(run=run, parser=p)


def _child_env(args: argparse.Namespace, report_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env[settings.env_name("simulate")] = str(args.cores)
    env[settings.env_name("sim_hbm")] = args.hbm
    env[settings.env_name("report_dir")] = str(report_dir)
    # The interpreter's own bin dir first: `python`, `accelerate`, `torchrun` are the ones
    # that have accelerate-neuron installed, even if the venv is not activated.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _command(args: argparse.Namespace) -> list[str]:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        args.parser.error("missing the command to run after '--', e.g. accelerate-neuron simulate -- python train.py")
    if command[0].endswith(".py"):
        command = [sys.executable, *command]
    return command


def _run_child(command: list[str], env: dict[str, str], json_mode: bool) -> int:
    tree = Tree()
    with sigterm_raises():
        try:
            # With --json, stdout carries only the report: the command's output goes to stderr.
            proc = subprocess.Popen(command, env=env, stdout=sys.stderr if json_mode else None)
        except FileNotFoundError:
            # 127 / 126: what a shell answers, since the exit code is the command's.
            raise CliError(f"command not found: {command[0]!r} (simulate runs: {' '.join(command)})", 127) from None
        except PermissionError:
            raise CliError(f"cannot execute {command[0]!r}: permission denied", 126) from None
        tree.add(proc)
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            # The child got the same SIGINT from the terminal: time to write its record, then the rest is ended.
            tree.settle()
            code = proc.wait()
        except Terminated:
            tree.end()
            raise
    return 128 + (-code) if code < 0 else code


def run(args: argparse.Namespace) -> int:
    from .. import device
    from ..sizes import parse_size
    from ._dryrun import build_report, load_records
    from ._render import render_dryrun

    command = _command(args)
    if device.kind() == "real":
        raise CliError(
            "this host has real Neuron cores (torch-neuronx): the simulator never shadows hardware. "
            "Run the command directly; `accelerate-neuron env` shows the device."
        )
    with tempfile.TemporaryDirectory(prefix="accelerate-neuron-simulate-") as tmp:
        report_dir = Path(tmp)
        code = _run_child(command, _child_env(args, report_dir), args.json)
        report = build_report(
            load_records(report_dir),
            command=command,
            exit_code=code,
            cores=args.cores,
            hbm=parse_size(args.hbm),
            seconds_per_graph=args.compile_seconds,
            seconds_per_signature=args.eager_seconds,
        )
    if args.json:
        print_json(report)
    else:
        sys.stdout.flush()
        print(render_dryrun(report))
    return code
