"""The processes a command starts, and every process they start: ended together on SIGTERM or Ctrl-C.

``simulate`` and ``precompile`` run the user's command, often a launcher (``torchrun``,
``accelerate launch``) with ranks of its own. Stopping only the direct child can leave ranks
running, holding their Neuron cores and host memory. As ``accelerate launch`` does for its own
child, the whole tree is followed (:mod:`psutil`, so ranks in other sessions too) and ended:
SIGTERM first, SIGKILL for what is still alive after a grace period.

- SIGTERM to the command (a scheduler, ``timeout``, ``kill``): the tree is ended at once and the
  command exits 128 + 15 (:class:`Terminated`, handled by the CLI's ``main``).
- Ctrl-C: the terminal sent SIGINT to the whole foreground group, the command's children
  included, so they get :data:`GRACE_SECONDS` to stop by themselves (a launcher stops its ranks;
  a simulated process writes its record), then what is left is ended. A SIGINT sent to the
  command alone (``kill -INT``) ends the tree after the same wait.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
from collections.abc import Iterator

import psutil

#: How long processes get to stop by themselves before SIGTERM, and after SIGTERM before SIGKILL.
GRACE_SECONDS = 10.0


class Terminated(BaseException):
    """SIGTERM reached the command (a BaseException like KeyboardInterrupt: ``except Exception`` lets it by)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Inside the block, SIGTERM raises :class:`Terminated` in the main thread, so the command can end its tree."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise Terminated(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class Tree:
    """The command's children and, followed as they appear, every process they started."""

    def __init__(self) -> None:
        self.roots: list[subprocess.Popen] = []
        self.known: dict[int, psutil.Process] = {}

    def add(self, root: subprocess.Popen) -> None:
        self.roots.append(root)
        self.refresh()

    def refresh(self) -> None:
        """Learn the descendants started so far (before a parent exits, while its children can still be found)."""
        for root in self.roots:
            try:
                process = psutil.Process(root.pid)
                found = [process, *process.children(recursive=True)]
            except psutil.Error:
                continue
            for child in found:
                self.known.setdefault(child.pid, child)

    def alive(self) -> list[psutil.Process]:
        out = []
        for process in self.known.values():
            with contextlib.suppress(psutil.Error):
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    out.append(process)
        return out

    def end(self, grace: float = GRACE_SECONDS) -> None:
        """SIGTERM every process of the tree, SIGKILL what is still alive after ``grace`` seconds; reap the roots."""
        self.refresh()
        processes = self.alive()
        for process in processes:
            with contextlib.suppress(psutil.Error):
                process.terminate()
        _, left = psutil.wait_procs(processes, timeout=grace)
        for process in left:
            with contextlib.suppress(psutil.Error):
                process.kill()
        psutil.wait_procs(left, timeout=5)
        for root in self.roots:
            with contextlib.suppress(subprocess.TimeoutExpired):
                root.wait(timeout=5)

    def settle(self, grace: float = GRACE_SECONDS) -> None:
        """After Ctrl-C: give the tree ``grace`` seconds to stop by itself, then end what is left of it.

        A second Ctrl-C, or SIGTERM, during the wait ends it at once.
        """
        deadline = time.monotonic() + grace
        try:
            while time.monotonic() < deadline:
                self.refresh()
                if all(root.poll() is not None for root in self.roots) and not self.alive():
                    return
                time.sleep(0.1)
        except (KeyboardInterrupt, Terminated):
            self.end(grace=0)
            raise
        self.end(grace)
