"""Mixture-of-experts models on (simulated) Neuron: the plugin's experts vs upstream's, in one run.

Sections (``--only`` picks some; default: all but ``ep``):

``flops``: one Qwen3-MoE block of the issue (64 experts, top-4, hidden 64, expert width 32) on 512 tokens, as a
prefill (no gradients) and as a training step (forward and backward), with the plugin's ``blockwise`` experts
(``auto``), its ``dense`` experts, and upstream's (``ACCELERATE_NEURON_MOE_EXPERTS=off``: ``grouped_mm``). FLOPs are
torch's ``FlopCounterMode`` (a FLOP formula is registered here for upstream's grouped matmuls, which torch does not
count), against a sparse dispatch (each token through its top-k experts, plus the router). Three routings per call
(random, another random, every token on the same 4 experts): eager op signatures across them, and the graphs a
``torch.compile(backend="neuron")`` of the block compiles, with those holding ops the Neuron compiler cannot lower.

``blocks``: the block-size trade on the same call: blocks, rows, the experts' FLOPs against a sparse dispatch, how
many copies of the layer's expert weights the blocks read, and the matmul each block is, for block sizes 1-512
(``*``: the size chosen by shape); also for a Qwen3-30B-A3B-like prefill (4,096 tokens, top-8 of 128).

``generate``: a varied-prompt job with stock calls only: ``--prompts`` prompts, one at a time, whose token counts
are drawn from a lognormal distribution (median 12 tokens, sigma 0.9, clipped to 3-120; seed ``--seed``, not one
the defaults were tuned on), each answered with greedy ``generate(max_new_tokens=8)`` on a tiny random Qwen3-MoE
and Mixtral (hidden 64, 2 layers, 4 experts, top-2) loaded with ``device_map="auto"``; then the same prompts
through an eager forward (``disable_bucketing``: op by op, where routing-dependent shapes show). Three modes, each
on a fresh model, Dynamo reset and a cold (memory-only) NEFF cache:

- ``patched``: accelerate-neuron as installed (experts ``auto``);
- ``experts_off``: the same with ``ACCELERATE_NEURON_MOE_EXPERTS=off`` (upstream's ``grouped_mm`` experts, every
  other patch on: bucketed prefill, static cache, compiled decode);
- ``stock``: every patch reverted in this process (stock ``device_map="auto"`` leaves the model on the CPU: it is
  then moved with ``model.to("neuron")``, as a user would).

Per mode: graphs compiled, eager signatures, the cost model's compile time on Trainium
(:mod:`accelerate_neuron.costs`), CPU fallbacks run (host round trips), graphs holding an op the compiler cannot
lower (``host_ops``), and prompts whose tokens differ from the CPU's.

``ep``: expert parallelism beyond tensor parallelism on 2 ranks (``torchrun``, ``DistributedConfig(tp_size=1,
fsdp_size=2, ep_size=2)``, tiny Qwen3-MoE with 8 experts, top-2): a compiled forward and a compiled training step
(forward, backward) on two routings of one shape, with the plugin's exchange (``ep_implementation="auto"``) and
upstream's ``all_to_all``: graphs compiled on the first routing and new ones on the second, and the graph breaks
that are not FSDP2's own.

    python benchmarks/moe.py [--only flops blocks generate ep] [--plot docs/moe-block-size.svg] [--prompts 24]
        [--seed 11]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import subprocess
import sys
import tempfile
from typing import Any

os.environ.setdefault("ACCELERATE_NEURON_SIMULATE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import transformers

import accelerate_neuron
from accelerate_neuron import activation, costs, simulator, tiny
from accelerate_neuron.simulator import neff_cache

WORDS = tiny.CORPUS.split()
SECTIONS = ("flops", "blocks", "generate", "ep")
MODES = {"blockwise": "auto", "dense": "dense", "upstream": "off"}  # ACCELERATE_NEURON_MOE_EXPERTS per row
TOKENS, TOP_K, EXPERTS, HIDDEN, INNER = 512, 4, 64, 64, 32


# ---------------------------------------------------------------- flops: one Qwen3-MoE block


def _count_grouped_matmuls() -> None:
    """FLOP formulas for upstream's grouped matmuls (torch's counter has none): 2 x rows x in x out."""
    from torch.utils.flop_counter import register_flop_formula

    def grouped(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return 2 * a_shape[0] * a_shape[1] * b_shape[-1]

    targets = [getattr(torch.ops.aten, "_grouped_mm", None)]
    targets.append(getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None))
    for op in targets:
        if op is not None:
            try:
                register_flop_formula(op)(grouped)
            except Exception:  # already registered (a second call), or an op the counter cannot key
                pass


def qwen3_block() -> Any:
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    from accelerate_neuron.builtin.moe import experts

    config = tiny.moe_config("qwen3_moe", num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=INNER)
    config._experts_implementation = experts.KEY  # what loading a model sets (grouped_mm off Neuron)
    torch.manual_seed(0)
    block = modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.1)
    return block


def _routings() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    same = torch.randn(1, 1, HIDDEN, generator=generator).expand(1, TOKENS, HIDDEN).contiguous()
    return [
        torch.randn(1, TOKENS, HIDDEN, generator=generator),
        torch.randn(1, TOKENS, HIDDEN, generator=generator),
        same,
    ]


def _output(result: Any) -> torch.Tensor:
    return result[0] if isinstance(result, tuple) else result


def _block_flops(block: Any, hidden: torch.Tensor, train: bool) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    hidden = hidden.clone().requires_grad_(train)
    with torch.set_grad_enabled(train), FlopCounterMode(display=False) as counter:
        out = _output(block(hidden))
        if train:
            out.square().sum().backward()
    return counter.get_total_flops()


def flops_rows() -> list[dict[str, Any]]:
    _count_grouped_matmuls()
    cpu = qwen3_block()
    routings = _routings()
    router = 2 * HIDDEN * EXPERTS
    per_pair = 2 * (2 * INNER * HIDDEN + HIDDEN * INNER)
    rows = []
    for train in (False, True):
        sparse = TOKENS * (router + TOP_K * per_pair) * (3 if train else 1)  # backward: 2x the forward's matmuls
        for name, setting in MODES.items():
            os.environ["ACCELERATE_NEURON_MOE_EXPERTS"] = setting
            block = copy.deepcopy(cpu).to("neuron")
            flops = _block_flops(block, routings[0].to("neuron"), train)
            signatures, differ = set(), 0
            for hidden in routings:
                simulator.reset_stats()
                with torch.set_grad_enabled(train):
                    out = _output(block(hidden.to("neuron")))
                    if train:
                        out.square().sum().backward()
                signatures.add(tuple(simulator.stats()["eager_signature_list"]))
                differ += not torch.allclose(out.detach().cpu(), _output(cpu(hidden)).detach(), rtol=1e-4, atol=1e-5)
            fallbacks = simulator.stats()["cpu_fallbacks"]
            torch._dynamo.reset()
            compiled = torch.compile(block, backend="neuron", dynamic=False)
            with neff_cache.temporary():
                simulator.reset_stats()
                for hidden in routings:
                    with torch.set_grad_enabled(train):
                        out = _output(compiled(hidden.to("neuron").requires_grad_(train)))
                        if train:
                            out.square().sum().backward()
                st = simulator.stats()
            rows.append(
                {
                    "call": "training step" if train else "prefill",
                    "experts": name,
                    "ratio": flops / sparse,
                    "distinct_eager": len(signatures),
                    "fallbacks": fallbacks,
                    "graphs": st["compiles"],
                    "host_op_graphs": sum(bool(g.get("host_ops")) for g in st["graphs"]),
                    "differ": differ,
                }
            )
    del os.environ["ACCELERATE_NEURON_MOE_EXPERTS"]
    return rows


def print_flops() -> None:
    print(
        f"\nOne Qwen3-MoE block, {EXPERTS} experts, top-{TOP_K}, hidden {HIDDEN}, expert width {INNER}, {TOKENS} "
        "tokens; three routings (random, random, every token on the same 4 experts)."
    )
    print(
        "| call | experts | FLOPs / sparse dispatch | eager signature sets over 3 routings | CPU fallbacks (last "
        "routing) | graphs compiled over 3 routings | graphs with host ops | routings != CPU |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in flops_rows():
        print(
            f"| {r['call']} | {r['experts']} | {r['ratio']:.2f}x | {r['distinct_eager']} | {r['fallbacks']} "
            f"| {r['graphs']} | {r['host_op_graphs']} | {r['differ']} |"
        )


# ---------------------------------------------------------------- blocks: the block-size trade


def block_rows(tokens: int, top_k: int, experts: int, hidden: int, inner: int, measure: bool) -> list[dict[str, Any]]:
    from torch.utils.flop_counter import FlopCounterMode

    from accelerate_neuron.builtin.moe import blockwise

    chosen = blockwise.choose_block(tokens * top_k, experts)
    block = qwen3_block().to("neuron") if measure else None
    hidden_states = _routings()[0].to("neuron") if measure else None
    rows = []
    for size in (1, 4, 8, 16, 32, 64, 128, 512):
        spec = blockwise.plan(tokens, top_k, experts, block=size)
        measured = None
        if measure:
            os.environ["ACCELERATE_NEURON_MOE_BLOCK_SIZE"] = str(size)
            with torch.no_grad(), FlopCounterMode(display=False) as counter:
                block(hidden_states)
            router = 2 * tokens * hidden * experts
            measured = (counter.get_total_flops() - router) / (tokens * top_k * 2 * (3 * inner * hidden))
            del os.environ["ACCELERATE_NEURON_MOE_BLOCK_SIZE"]
        rows.append(
            {
                "block": f"{size}{' *' if size == chosen else ''}",
                "blocks": spec.blocks,
                "rows": spec.rows,
                "ratio": spec.flops_ratio,
                "measured": measured,
                "weight_reads": spec.blocks / experts,
                "matmul": f"{size} x {hidden} x {2 * inner}",
            }
        )
    return rows


BLOCK_CALLS = (
    (f"{TOKENS} tokens, top-{TOP_K} of {EXPERTS}", (TOKENS, TOP_K, EXPERTS, HIDDEN, INNER), True),
    ("4096 tokens, top-8 of 128 (Qwen3-30B-A3B)", (4096, 8, 128, 2048, 768), False),
)


def plot_blocks(path: str) -> None:
    """The block-size trade as an SVG: the experts' FLOPs and the expert-weight reads against the block size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (flops, reads) = plt.subplots(1, 2, figsize=(9, 3.4))
    for label, shape, _ in BLOCK_CALLS:
        rows = block_rows(*shape, measure=False)
        sizes = [int(r["block"].split()[0]) for r in rows]
        flops.plot(sizes, [r["ratio"] for r in rows], marker="o", label=label)
        reads.plot(sizes, [r["weight_reads"] for r in rows], marker="o", label=label)
        chosen = next(r for r in rows if r["block"].endswith("*"))
        flops.annotate(
            "chosen",
            (int(chosen["block"].split()[0]), chosen["ratio"]),
            textcoords="offset points",
            xytext=(4, 8),
            fontsize=8,
        )
    for axis, title in ((flops, "experts' FLOPs / sparse dispatch"), (reads, "expert-weight reads (x the layer's)")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log", base=2)
        axis.set_xlabel("rows per block (B)")
        axis.set_title(title, fontsize=10)
        axis.grid(True, which="both", alpha=0.3)
    flops.legend(fontsize=8)
    figure.suptitle("Blockwise experts: the block-size trade (benchmarks/moe.py --only blocks)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, format="svg", metadata={"Date": None})
    print(f"wrote {path}")


def print_blocks() -> None:
    print(
        "\n| call | block size (* chosen) | blocks | rows | experts' FLOPs / sparse | measured (FlopCounterMode) "
        "| expert-weight reads (x the layer's) | matmul per block |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label, shape, measure in BLOCK_CALLS:
        for r in block_rows(*shape, measure=measure):
            measured = f"{r['measured']:.2f}x" if r["measured"] is not None else "-"
            print(
                f"| {label} | {r['block']} | {r['blocks']} | {r['rows']} | {r['ratio']:.2f}x | {measured} "
                f"| {r['weight_reads']:.2f} | {r['matmul']} |"
            )


# ---------------------------------------------------------------- ep: expert parallelism beyond TP, 2 ranks


FSDP_HOOKS = "_fsdp_common.py"


def ep_worker(model_dir: str, implementation: str) -> None:
    """One rank of ``--ep-worker``: compiled forward and training step on two routings; rank 0 prints JSON."""
    config = transformers.DistributedConfig(tp_size=1, fsdp_size=2, ep_size=2, ep_implementation=implementation)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, distributed_config=config)
    accelerate_neuron.disable_bucketing(model)  # the compile below is the only one: its graphs are the figure
    compiled = torch.compile(model, backend="neuron", dynamic=False)
    device = next(model.parameters()).device
    rank = torch.distributed.get_rank()
    result: dict[str, Any] = {}
    for phase in ("forward", "training step"):
        seen = []
        for routing in (0, 1):
            ids = torch.randint(3, 500, (2, 32), generator=torch.Generator().manual_seed(routing * 10 + rank))
            ids = ids.to(device)
            start = simulator.stats()
            if phase == "forward":
                with torch.no_grad():
                    model.eval()
                    compiled(input_ids=ids)
            else:
                model.train()
                compiled(input_ids=ids, labels=ids).loss.backward()
                model.zero_grad()
            graphs = simulator.stats()["graphs"][len(start["graphs"]) :]
            breaks = {(g.get("frame") or {}).get("graph_break") or "" for g in graphs} - {""}
            seen.append({"graphs": len(graphs), "other_breaks": sorted(b for b in breaks if FSDP_HOOKS not in b)})
        result[phase] = seen
    if rank == 0:
        print("EP-RESULT " + json.dumps(result), flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def print_ep() -> None:
    print(
        "\nExpert parallelism beyond TP: torchrun, 2 ranks, DistributedConfig(tp_size=1, fsdp_size=2, ep_size=2), "
        "tiny Qwen3-MoE (8 experts, top-2), batch 2 x 32 tokens per rank."
    )
    print("| exchange | call | graphs, first routing | new graphs, second routing | graph breaks not FSDP2's |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        config = tiny.moe_config("qwen3_moe", initializer_range=0.3)
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root)
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        for label, implementation in (("plugin (auto)", "auto"), ("upstream all_to_all", "all_to_all")):
            env = {**os.environ, "ACCELERATE_NEURON_SIMULATE": "2", "OMP_NUM_THREADS": "1"}
            env["TORCH_NEURONX_NEFF_CACHE_DIR"] = tempfile.mkdtemp()
            proc = subprocess.run(
                [torchrun, "--standalone", "--nproc_per_node=2", __file__, "--ep-worker", root, implementation],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            line = next((x for x in proc.stdout.splitlines() if x.startswith("EP-RESULT ")), None)
            if line is None:
                raise SystemExit(
                    f"the EP run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
                )
            for phase, (first, second) in json.loads(line[len("EP-RESULT ") :]).items():
                other = sorted({*first["other_breaks"], *second["other_breaks"]})
                shown = "; ".join(b.split(": ", 1)[-1][:90] for b in other) or "none"
                print(f"| {label} | {phase} | {first['graphs']} | {second['graphs']} | {len(other)}: {shown} |")


def prompts(count: int, seed: int, tokenizer: object) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        want = max(3, min(120, int(rng.lognormvariate(2.48, 0.9))))  # median e^2.48 ~ 12 tokens
        words: list[str] = []
        while len(tokenizer(" ".join(words))["input_ids"]) < want:
            words.append(rng.choice(WORDS))
        out.append(" ".join(words))
    return out


def run(path: str, texts: list[str], expected: list[torch.Tensor]) -> dict[str, object]:
    tok = tiny.tokenizer()
    torch._dynamo.reset()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, device_map="auto").eval()
    row: dict[str, object] = {"placed": model.device.type}
    if model.device.type != "neuron":  # stock device_map="auto" plans for the CPU only: move it as a user would
        model.to("neuron")
    with neff_cache.temporary():
        simulator.reset_stats()
        differ = 0
        for text, want in zip(texts, expected, strict=True):
            enc = tok([text], return_tensors="pt")
            out = model.generate(**{k: v.to(model.device) for k, v in enc.items()}, max_new_tokens=8, do_sample=False)
            differ += not torch.equal(out.cpu(), want)
        st = simulator.stats()
        row.update(
            graphs=st["compiles"],
            eager=st["eager_signatures"],
            fallbacks=st["cpu_fallbacks"],
            host_op_graphs=sum(bool(g.get("host_ops")) for g in st["graphs"]),
            differ=differ,
        )
        accelerate_neuron.disable_bucketing(model)
        simulator.reset_stats()
        with torch.no_grad():
            for text in texts:
                model(**{k: v.to(model.device) for k, v in tok([text], return_tensors="pt").items()})
        st = simulator.stats()
        row.update(forward_eager=st["eager_signatures"], forward_fallbacks=st["cpu_fallbacks"])
    row["seconds"] = costs.estimate(row["graphs"], row["eager"])["seconds"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=[s for s in SECTIONS if s != "ep"])
    parser.add_argument("--plot", metavar="SVG", help="also draw the block-size trade (e.g. docs/moe-block-size.svg)")
    parser.add_argument("--ep-worker", nargs=2, metavar=("MODEL_DIR", "IMPLEMENTATION"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ep_worker:
        return ep_worker(*args.ep_worker)
    print(f"Transformers {transformers.__version__}, torch {torch.__version__}")
    if "flops" in args.only:
        print_flops()
    if "blocks" in args.only:
        print_blocks()
        if args.plot:
            plot_blocks(args.plot)
    if "ep" in args.only:
        print_ep()
    if "generate" in args.only:
        generate_job(args)


def generate_job(args: argparse.Namespace) -> None:
    tok = tiny.tokenizer()
    texts = prompts(args.prompts, args.seed, tok)
    lengths = sorted(len(tok(t)["input_ids"]) for t in texts)
    print(
        f"Transformers {transformers.__version__}, torch {torch.__version__}; {len(texts)} prompts, tokens: "
        f"median {lengths[len(lengths) // 2]}, max {lengths[-1]}, distinct lengths {len(set(lengths))}"
    )
    print(
        "| model | mode | graphs | eager signatures | est. compile (s) | CPU fallbacks | graphs with host ops "
        "| eager forward: signatures | eager forward: CPU fallbacks | prompts != CPU |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        for family in tiny.MOE_FAMILIES:
            path = str(tiny.save_pretrained(f"{root}/{family}", family, initializer_range=0.3))
            reference = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
            expected = [
                reference.generate(**tok([t], return_tensors="pt"), max_new_tokens=8, do_sample=False) for t in texts
            ]
            rows = {"patched": run(path, texts, expected)}
            os.environ["ACCELERATE_NEURON_MOE_EXPERTS"] = "off"
            rows["experts_off"] = run(path, texts, expected)
            del os.environ["ACCELERATE_NEURON_MOE_EXPERTS"]
            with activation.unpatched():
                rows["stock"] = run(path, texts, expected)
            for mode, r in rows.items():
                print(
                    f"| {family} | {mode} | {r['graphs']} | {r['eager']} | {r['seconds']:.0f} | {r['fallbacks']} "
                    f"| {r['host_op_graphs']} | {r['forward_eager']} | {r['forward_fallbacks']} | {r['differ']} |"
                )


if __name__ == "__main__":
    main()
