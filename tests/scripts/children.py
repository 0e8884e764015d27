"""A job whose device work happens in the processes it starts, as `transformers serve` and Ray's do.

    python children.py

Run under ``accelerate-neuron simulate``. The parent uses the device too, then starts:

- a multiprocessing ``spawn`` child that compiles a function on the device, then waits to be stopped with
  ``Process.terminate()`` (SIGTERM), as ``transformers serve`` stops its model's process;
- a ``forkserver`` child that runs eager ops and returns (it then leaves through ``os._exit``);
- a ``subprocess`` child (a new interpreter) that runs eager ops and exits;
- an ``os.fork()`` child that exits through ``sys.exit`` (atexit): it shares its parent's counters and must
  not report them a second time.

Each child prints one JSON line with its pid and its own eager signature count.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time


def _say(**fields: object) -> None:
    # One write(2) per line: the children share the parent's pipe, and print() writes the text and its newline
    # separately, so two children's lines could interleave. A pipe write up to PIPE_BUF bytes is atomic.
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (json.dumps({"pid": os.getpid(), **fields}) + "\n").encode())


def _eager(width: int) -> int:
    import torch

    from accelerate_neuron import simulator

    x = torch.arange(width, dtype=torch.float32, device="neuron")
    (x * 2 + 1).sum().item()
    return simulator.stats()["eager_signatures"]


def compiled_then_wait(ready: multiprocessing.synchronize.Event) -> None:
    import torch

    from accelerate_neuron import simulator

    step = torch.compile(lambda x: (x * x).sum(dim=-1), backend="neuron")
    step(torch.ones(4, 8, device="neuron")).cpu()
    stats = simulator.stats()
    _say(kind="spawn", compiles=stats["compiles"] + stats["compile_cache_hits"], eager=stats["eager_signatures"])
    ready.set()
    time.sleep(600)  # until the parent terminates it


def eager_and_return() -> None:
    _say(kind="forkserver", eager=_eager(5))


def main() -> None:
    _say(kind="parent", eager=_eager(3))

    spawn = multiprocessing.get_context("spawn")
    ready = spawn.Event()
    waiting = spawn.Process(target=compiled_then_wait, args=(ready,))
    waiting.start()

    forkserver = multiprocessing.get_context("forkserver").Process(target=eager_and_return)
    forkserver.start()
    forkserver.join()

    code = "from children import _eager, _say; _say(kind='subprocess', eager=_eager(7))"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.abspath(__file__)))

    pid = os.fork()
    if pid == 0:
        _say(kind="fork")
        sys.exit(0)  # through atexit, with the parent's counters
    os.waitpid(pid, 0)

    assert ready.wait(300), "the spawn child did not compile in time"
    waiting.terminate()
    waiting.join(60)
    _say(kind="terminated", exitcode=waiting.exitcode)


if __name__ == "__main__":
    main()
