"""Launched by tests/test_collectives.py with torchrun (2 ranks): a collective that finishes while rank 0 exits.

    torchrun --nproc_per_node=2 exit_during_collective.py OUT_DIR

Rank 0 starts an asynchronous ``all_gather_into_tensor``, drops the work and leaves. Its last exit
handler tells rank 1 to join, then keeps the GIL inside one C call (``sum`` over a range, no Python
frame after it), so rank 0's gloo thread completes and frees the work while the main thread holds the
GIL and goes on into finalization. A gloo thread that needs the GIL to free the work is then ended by
CPython inside the destructor: SIGABRT, "terminate called without an active exception" (what
``test_accelerate_launch_two_processes`` met under load). Rank 0 exits 0 only if freeing gloo's work
takes no GIL.

Before that, each rank writes OUT_DIR/rank<r>.json: the device bytes around a collective, to show
that what the simulator holds for gloo is given back by a later collective once gloo's thread let go
of it, and how many collectives' aliases it holds after 100 all_reduces and once gloo caught up.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time

OUT = sys.argv[1]
GO = os.path.join(OUT, "go")

if os.environ["RANK"] == "0":
    # atexit runs handlers last-registered first: these two run after every other one (torch's,
    # the simulator's), the GIL-holding C call last.
    atexit.register(sum, range(30_000_000))
    atexit.register(lambda: open(GO, "w").close())

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("neuron")
rank = dist.get_rank()
device = torch.device("neuron", 0)

from accelerate_neuron.simulator.distributed import held_aliases  # noqa: E402

baseline = torch.neuron.memory_allocated()
big = torch.ones(1 << 16, device=device)  # 256 KiB
dist.all_reduce(big)
del big
small = torch.ones(4, device=device)
small_bytes = small.numel() * small.element_size()
# gloo's thread frees the work a moment after wait() returns; a collective after that gives the bytes back.
# Every rank runs the same collectives (a rank that stopped early would leave its peer waiting in one).
given_back_after = None
for collectives_after in range(1, 21):
    dist.all_reduce(small)
    if given_back_after is None and torch.neuron.memory_allocated() - baseline == small_bytes:
        given_back_after = collectives_after
    time.sleep(0.01)
for _ in range(100):
    dist.all_reduce(small)
held_after_100 = len(held_aliases)
# gloo runs works on 2 threads, which may lag behind the main thread under load: the collectives they have
# not finished freeing stay held. Given time, only the newest remains.
held_settled = held_after_100
for _ in range(20):
    time.sleep(0.01)
    dist.all_reduce(small)
    held_settled = min(held_settled, len(held_aliases))
report = {
    "baseline": baseline,
    "after": torch.neuron.memory_allocated(),
    "small_bytes": small_bytes,
    "given_back_after": given_back_after,
    "held_after_100": held_after_100,
    "held_settled": held_settled,
}
with open(os.path.join(OUT, f"rank{rank}.json"), "w") as f:
    json.dump(report, f)

t = torch.full((4,), rank + 1.0, device=device)
out = torch.empty(8, device=device)
if rank == 0:
    work = dist.all_gather_into_tensor(out, t, async_op=True)
    del work
else:
    deadline = time.monotonic() + 60
    while not os.path.exists(GO):
        if time.monotonic() > deadline:
            raise SystemExit("rank 0 never reached its exit handlers")
        time.sleep(0.01)
    dist.all_gather_into_tensor(out, t)
    assert out.cpu().tolist() == [1.0] * 4 + [2.0] * 4, out
