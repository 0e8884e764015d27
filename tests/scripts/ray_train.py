"""Ray Train's TorchTrainer on the simulated Neuron device, as a Ray user writes it (nothing here knows Neuron).

    python ray_train.py [--two-nodes] OUT_DIR CASE...

``ray.init()`` without resources (Ray counts the cores itself), ``ScalingConfig(num_workers=2,
resources_per_worker={"neuron_cores": 1})``. With ``--two-nodes``, two Ray nodes on this machine instead (a head
and a second raylet, ``ray.cluster_utils.Cluster``: what ``ray start --head`` plus ``ray start --address`` make),
one Neuron core each, so the two workers run on different nodes. Cases, run in this order in one Ray session:

- ``trainer``: the HF Trainer with Ray's default ``TorchConfig()`` (Ray creates a gloo group before the
  function runs), dropout on the device, bf16, ``torch_compile``; Ray's ``RayTrainReportCallback`` reports
  a ``ray.train.Checkpoint`` at step 2 and 4; then FSDP2 (``fully_shard``) on the same group, against DDP
  on the CPU through that group's gloo part;
- ``resume``: the same job resumed from the step-2 ``ray.train.Checkpoint`` of ``trainer`` (handed over in
  the loop's config, Ray Train v2's way; ``ray.train.get_checkpoint()`` otherwise);
- ``accelerate``: ``accelerate_train.main`` (a plain Accelerate loop) with ``TorchConfig(backend="neuron")``.

Each worker writes OUT_DIR/CASE/rank<r>.json (where it ran, its losses, a digest of its final weights); the
driver writes OUT_DIR/driver.json (the cluster's neuron_cores, each fit's reported metrics and checkpoints).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import ray
from ray.train import CheckpointConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

SCRIPTS = str(Path(__file__).resolve().parent)
STEPS, SAVE_AT = 4, 2


def _group() -> str | None:
    """The backend of the process group Ray created before the loop."""
    import torch.distributed as dist

    return dist.get_backend() if dist.is_initialized() else None


def _where(report: dict, group: str | None) -> dict:
    """Where this worker ran: its device, physical core, the group Ray created."""
    import torch

    from accelerate_neuron import simulator

    stats = simulator.stats()
    index = torch.device(report["device"]).index or 0 if report["device"].startswith("neuron") else None
    report.update(
        rank=int(os.environ["RANK"]),
        local_rank=int(os.environ["LOCAL_RANK"]),
        visible_cores_env=os.environ.get("NEURON_RT_VISIBLE_CORES"),
        ray_torch_device=os.environ.get("ACCELERATE_TORCH_DEVICE"),
        physical_core=stats["visible_cores"][index] if index is not None else None,
        process_group=group,
        compiles=stats["compiles"] + stats["compile_cache_hits"],
        eager_signatures=stats["eager_signatures"],
    )
    return report


def _write(out: str, report: dict) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{report['rank']}.json"), "w") as f:
        json.dump(report, f)


def _digest(model) -> str:
    import hashlib

    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def trainer_loop(config: dict) -> None:
    """The HF Trainer as in tests/test_resume.py, reporting to Ray with Ray's own callback."""
    import torch
    from ray.train.huggingface.transformers import RayTrainReportCallback
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from accelerate_neuron import tiny

    group = _group()
    gen = torch.Generator().manual_seed(0)
    lengths = [9, 30, 17, 25, 12, 28, 21, 14, 31, 10, 19, 27, 8, 23, 16, 29]
    features = [{"input_ids": torch.randint(3, 300, (n,), generator=gen).tolist()} for n in lengths]
    args = TrainingArguments(
        output_dir=config["output_dir"],
        report_to=[],
        seed=0,
        max_steps=STEPS,
        save_strategy="steps",
        save_steps=SAVE_AT,
        logging_steps=1,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        bf16=True,
        torch_compile=True,
    )
    trainer = Trainer(
        model=tiny.model("gpt2", resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.0),
        args=args,
        train_dataset=features,
        data_collator=DataCollatorForLanguageModeling(tiny.tokenizer(), mlm=False),
        callbacks=[RayTrainReportCallback()],
    )
    # Ray Train v2's way to start from another run's checkpoint: hand it over in the loop's config.
    checkpoint = ray.train.get_checkpoint() or config.get("resume_from")
    if checkpoint is not None:
        torch.neuron.manual_seed(1234)  # whatever a previous worker's generator held is gone
        with checkpoint.as_directory() as folder:
            trainer.train(resume_from_checkpoint=os.path.join(folder, RayTrainReportCallback.CHECKPOINT_NAME))
    else:
        trainer.train()
    report = {
        "device": str(trainer.args.device),
        "param_device": str(next(trainer.model.parameters()).device),
        "wrapped_in": type(trainer.model_wrapped).__name__,
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "weights": _digest(trainer.model),
        "resumed": checkpoint is not None,
    }
    if checkpoint is None:
        report.update(fsdp2_against_cpu_ddp(config["scripts"]))
    _write(config["out"], _where(report, group))


def fsdp2_against_cpu_ddp(scripts: str) -> dict:
    """4 SGD steps of tests/scripts/rank_cases.py's model: FSDP2 on the Neuron core, DDP on the CPU, same group."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, scripts)
    import rank_cases

    def train(wrapped, device) -> None:
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        for x in rank_cases.batches(dist.get_rank()):
            wrapped(x.to(device)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    neuron = torch.device("neuron", 0)
    mesh = init_device_mesh("neuron", (dist.get_world_size(),))
    sharded = rank_cases.model(neuron)
    for layer in (sharded[0], sharded[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    train(sharded, neuron)
    cpu = rank_cases.model(torch.device("cpu"))
    train(DistributedDataParallel(cpu), torch.device("cpu"))
    return {
        "fsdp2": [p.full_tensor().detach().cpu().flatten().tolist() for p in sharded.parameters()],
        "cpu_ddp": [p.detach().flatten().tolist() for p in cpu.parameters()],
    }


def accelerate_loop(config: dict) -> None:
    sys.path.insert(0, config["scripts"])
    import accelerate_train

    group = _group()
    accelerate_train.main(config["out"])  # writes rank<r>.json itself
    path = os.path.join(config["out"], f"rank{int(os.environ['RANK'])}.json")
    with open(path) as f:
        report = json.load(f)
    _write(config["out"], _where(report, group))


def _fit(loop, out_dir: Path, case: str, torch_config: TorchConfig | None = None, **config) -> ray.train.Result:
    trainer = TorchTrainer(
        loop,
        train_loop_config={
            "out": str(out_dir / case),
            "output_dir": str(out_dir / "hf" / case),
            "scripts": SCRIPTS,
            **config,
        },
        torch_config=torch_config,
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"neuron_cores": 1}),
        run_config=RunConfig(
            name=case, storage_path=str(out_dir / "ray_results"), checkpoint_config=CheckpointConfig()
        ),
    )
    return trainer.fit()


def main() -> None:
    args = sys.argv[1:]
    two_nodes = args[0] == "--two-nodes"
    out_dir, cases = Path(args[two_nodes]), args[two_nodes + 1 :]
    cluster = None
    if two_nodes:
        from ray.cluster_utils import Cluster

        node = {"num_cpus": 1, "resources": {"neuron_cores": 1}}  # one core per node
        cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
        cluster.add_node(**node)
        ray.init(address=cluster.address)
    else:
        ray.init(include_dashboard=False)
    driver: dict = {
        "cluster_neuron_cores": ray.cluster_resources().get("neuron_cores"),
        "nodes": len([n for n in ray.nodes() if n["Alive"]]),
    }
    trained = None
    for case in cases:
        started = time.monotonic()
        if case == "trainer":
            trained = result = _fit(trainer_loop, out_dir, case)
        elif case == "resume":
            at_save = [c for c, metrics in trained.best_checkpoints if metrics.get("step") == SAVE_AT]
            result = _fit(trainer_loop, out_dir, case, resume_from=at_save[0])
        elif case == "accelerate":
            result = _fit(accelerate_loop, out_dir, case, torch_config=TorchConfig(backend="neuron"))
        else:
            raise SystemExit(f"unknown case {case!r}")
        driver[case] = {
            "error": repr(result.error) if result.error else None,
            "checkpoint_steps": [m.get("step") for _, m in result.best_checkpoints],
            "metrics_step": (result.metrics or {}).get("step"),
        }
        print(f"ray_train.py: {case} took {time.monotonic() - started:.0f} s", flush=True)
    (out_dir / "driver.json").write_text(json.dumps(driver))
    ray.shutdown()
    if cluster is not None:
        cluster.shutdown()


if __name__ == "__main__":
    main()
