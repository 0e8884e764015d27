"""Every c10d op Accelerate and Transformers use, on 2 neuron ranks, 0-D..3-D x float32/bf16/int64.

Run with torchrun; argv: OUT_DIR. Expected values are computed on the host from the ranks' known
inputs (gloo on CPU itself refuses multi-dim flat outputs of all_gather_into_tensor, and has no
reduce_scatter_tensor). Each rank writes rank<N>.json listing the cases checked and any mismatch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

SHAPES = [(), (3,), (2, 3), (2, 3, 2)]
DTYPES = [torch.float32, torch.bfloat16, torch.int64]


def _value(shape: tuple[int, ...], dtype: torch.dtype, rank: int) -> torch.Tensor:
    return (torch.arange(max(1, torch.Size(shape).numel())).reshape(shape) + 10 * rank).to(dtype)


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("neuron")
    r, w = dist.get_rank(), dist.get_world_size()
    dev = torch.device("neuron", 0)
    checked, failed = [], []

    def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        checked.append(name)
        if got.device.type != "neuron" or not torch.equal(got.cpu(), want):
            failed.append(f"{name}: got {got}, want {want}")

    for shape in SHAPES:
        for dt in DTYPES:
            tag = f"{list(shape)}-{dt}"
            mine = _value(shape, dt, r)
            every = torch.stack([_value(shape, dt, k) for k in range(w)])
            x = mine.to(dev)
            t = x.clone()
            dist.all_reduce(t)
            check(f"all_reduce {tag}", t, every.sum(0).to(dt))
            t = x.clone()
            dist.broadcast(t, src=1)
            check(f"broadcast {tag}", t, _value(shape, dt, 1))
            outs = [torch.empty_like(x) for _ in range(w)]
            dist.all_gather(outs, x)
            check(f"all_gather {tag}", torch.stack(outs), every)
            flat = torch.empty(w * x.numel(), dtype=dt, device=dev)
            dist.all_gather_into_tensor(flat, x)
            check(f"all_gather_into_tensor flat {tag}", flat, every.flatten())
            stacked = torch.empty((w, *shape), dtype=dt, device=dev)
            dist.all_gather_into_tensor(stacked, x)
            check(f"all_gather_into_tensor stacked {tag}", stacked, every)
            big = torch.stack([mine * (k + 1) for k in range(w)])  # rank k gets the sum of chunk k
            part = torch.empty_like(x)
            dist.reduce_scatter_tensor(part, big.to(dev))
            check(f"reduce_scatter_tensor stacked {tag}", part, (every.sum(0) * (r + 1)).to(dt))
            part = torch.empty_like(x)
            dist.reduce_scatter_tensor(part, big.flatten().to(dev))
            check(f"reduce_scatter_tensor flat {tag}", part, (every.sum(0) * (r + 1)).to(dt))
            if shape:
                a2a_in = torch.stack([mine + k for k in range(w)])  # chunk k goes to rank k
                a2a_out = torch.empty_like(a2a_in).to(dev)
                dist.all_to_all_single(a2a_out, a2a_in.to(dev))
                check(f"all_to_all_single {tag}", a2a_out, torch.stack([_value(shape, dt, k) + r for k in range(w)]))
                outs = [torch.empty_like(x) for _ in range(w)]
                dist.all_to_all(outs, [(mine + k).to(dev) for k in range(w)])
                check(f"all_to_all {tag}", torch.stack(outs), torch.stack([_value(shape, dt, k) + r for k in range(w)]))
    dist.barrier()
    checked.append("barrier")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{r}.json").write_text(json.dumps({"checked": checked, "failed": failed}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
