"""Mixture-of-experts models on Neuron (plugin ``moe``): shapes fixed by the token count, never by the routing.

Tiny random Qwen3-MoE and Mixtral (hidden 64, 2 layers, 4 experts, top-2), float32, against the same
weights on the CPU. On Transformers >= 5 the experts run through the implementation the plugin registers
in the experts interface; on 4.57 through the plugin's replacement of each sparse MoE block's forward.
What "static" means here is checked on what the simulator records: eager signatures (the same for two
prompts of one length whatever their routing), and the ops each compiled graph holds (``host_ops``: no
integer ``histc`` CPU fallback, no custom op with a Python body such as upstream's grouped-mm loop).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import accelerate_neuron
from accelerate_neuron import patching, tiny
from accelerate_neuron.builtin.moe import experts
from helpers import run_launcher

FAMILIES = tiny.MOE_FAMILIES
# Wide enough a spread that greedy output is not one repeated token.
INIT = {"initializer_range": 0.3}
INTERFACE = hasattr(__import__("transformers").PreTrainedModel, "set_experts_implementation")


@pytest.fixture(scope="module", autouse=True)
def _clean_dynamo() -> Any:
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("moe")
    return {family: tiny.save_pretrained(root / family, family, **INIT) for family in FAMILIES}


def _load(path: Any, **kwargs: Any) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def _on(device: Any, encoding: Any) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in encoding.items()}


def _eager_forward(sim: Any, model: Any, ids: list[int]) -> dict[str, Any]:
    sim.reset_stats()
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=model.device)).logits.cpu()
    return {**sim.stats(), "logits": logits}


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_matches_the_cpu_with_a_dense_models_graph_counts(sim: Any, saved: dict, family: str) -> None:
    tok = tiny.tokenizer()
    reference = _load(saved[family])
    model = _load(saved[family], device_map="auto")
    assert model.device.type == "neuron"
    if INTERFACE:  # nobody asked for an implementation: the plugin's (grouped_mm itself off Neuron)
        assert model.config._experts_implementation == experts.KEY == reference.config._experts_implementation
    torch._dynamo.reset()
    sim.reset_stats()
    # Three prompt lengths (one prompt bucket), then a batch of two: as for a dense model, one prefill and one
    # decode graph per batch bucket, and no eager growth from one length to the next.
    eager, generated = [], set()
    for prompts in (["the neuron core runs"], ["hello world , this is a tiny model"], ["trainium"], ["a", "b c d"]):
        enc = tok(prompts, return_tensors="pt", padding=True)
        expected = reference.generate(**enc, max_new_tokens=6, do_sample=False)
        out = model.generate(**_on(model.device, enc), max_new_tokens=6, do_sample=False)
        assert out.device.type == "neuron" and torch.equal(out.cpu(), expected), prompts
        generated |= set(expected[:, -6:].flatten().tolist())
        stats = sim.stats()
        eager.append(stats["eager_signatures"])
        if len(prompts) == 1:
            assert stats["compiles"] <= 2, stats["graphs"]
    assert len(generated) > 4, "degenerate reference output"
    assert eager[1] == eager[2] <= eager[0]  # the first call also sets up what later calls reuse
    assert stats["compiles"] <= 4 and {g["kind"] for g in stats["graphs"]} == {"inference"}
    assert [g["host_ops"] for g in stats["graphs"]] == [[]] * stats["compiles"]
    assert stats["cpu_fallbacks"] == 0


def test_eager_signatures_follow_shapes_not_routing(sim: Any, saved: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _load(saved["mixtral"]).to("neuron")
    accelerate_neuron.disable_bucketing(model)  # op by op: every eager signature is visible
    reference = _load(saved["mixtral"])
    first, second = [1, 5, 7, 9, 11, 13, 200, 310], [400, 3, 3, 77, 150, 9, 46, 501]  # one length, two routings
    with torch.no_grad():
        expected = [reference(torch.tensor([ids])).logits for ids in (first, second)]
    a, b = _eager_forward(sim, model, first), _eager_forward(sim, model, second)
    for run, want in zip((a, b), expected, strict=True):
        torch.testing.assert_close(run["logits"], want, rtol=1e-5, atol=1e-5)
        assert run["cpu_fallbacks"] == 0
    assert a["eager_signature_list"] == b["eager_signature_list"]

    # Upstream's path on the device (setting off): per-expert matmuls sized by the routing, and on >= 5 an
    # integer histc per layer through the host.
    monkeypatch.setenv("ACCELERATE_NEURON_MOE_EXPERTS", "off")
    stock_a, stock_b = _eager_forward(sim, model, first), _eager_forward(sim, model, second)
    torch.testing.assert_close(stock_a["logits"], expected[0], rtol=1e-5, atol=1e-5)
    assert stock_a["eager_signature_list"] != stock_b["eager_signature_list"]
    if INTERFACE:
        assert stock_a["cpu_fallback_ops"] == {"aten::histc": model.config.num_hidden_layers}


def test_the_users_choice_wins_and_the_patches_are_recorded(saved: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    records = {r.key: r for r in patching.records() if r.plugin == "moe"}
    if not INTERFACE:
        # 4.57: no experts interface to register in; the sparse MoE blocks are replaced instead.
        # (a patch whose module this release lacks is never attempted: it has no record)
        assert "transformers.integrations.moe.ExpertsInterface._global_mapping" not in records
        compilable = "transformers.models.mixtral.modeling_mixtral.MixtralPreTrainedModel._can_compile_fullgraph"
        assert records[compilable].status == "applied"
        assert records["transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock.forward"].status == (
            "applied"
        )
        pytest.skip("Transformers < 5 has no experts_implementation for a user to choose")
    assert records["transformers.integrations.moe.ExpertsInterface._global_mapping"].status == "applied"
    import transformers.distributed.expert_parallel  # noqa: F401  (patched on import)

    records = {r.key: r for r in patching.records() if r.plugin == "moe"}
    assert records["transformers.distributed.expert_parallel.AutoEP.__call__"].status == "applied"
    blocks = [r for k, r in records.items() if k.endswith("SparseMoeBlock.forward")]
    assert blocks and all(r.status == "skipped" and "experts interface" in r.detail for r in blocks)
    for chosen in ("grouped_mm", "batched_mm", "eager"):
        assert _load(saved["qwen3_moe"], experts_implementation=chosen).config._experts_implementation == chosen
    model = _load(saved["qwen3_moe"])
    model.set_experts_implementation("grouped_mm")
    assert model.config._experts_implementation == "grouped_mm"
    monkeypatch.setenv("ACCELERATE_NEURON_MOE_EXPERTS", "off")
    assert _load(saved["qwen3_moe"]).config._experts_implementation == "grouped_mm"
    monkeypatch.setenv("ACCELERATE_NEURON_MOE_EXPERTS", "sparse")
    with pytest.raises(ValueError, match=r"MOE_EXPERTS='sparse': expected 'auto', 'blockwise', 'dense'"):
        experts.mode()


def test_auto_runs_blockwise_unless_a_call_routes_fewer_pairs_than_experts() -> None:
    assert experts.choose(num_pairs=2, num_experts=4, chosen_mode="auto") == "gathered"  # a decode step, batch 1
    assert experts.choose(num_pairs=4, num_experts=4, chosen_mode="auto") == "blockwise"
    assert experts.choose(num_pairs=2, num_experts=4, chosen_mode="blockwise") == "blockwise"
    assert experts.choose(num_pairs=2, num_experts=4, chosen_mode="dense") == "dense"


# ---------------------------------------------------------------- training


def test_a_training_step_matches_the_cpu_and_its_shapes_do_not_follow_routing(sim: Any) -> None:
    import copy

    reference = tiny.model("mixtral", output_router_logits=True, **INIT).train()
    model = copy.deepcopy(reference).to("neuron")
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, 500, (2, 16), generator=generator) for _ in range(2)]  # one shape, two routings
    signatures = []
    for ids in batches:
        for m in (reference, model):
            m.zero_grad()
        expected = reference(input_ids=ids, labels=ids)
        expected.loss.backward()
        sim.reset_stats()
        out = model(input_ids=ids.to("neuron"), labels=ids.to("neuron"))
        out.loss.backward()
        signatures.append(sim.stats()["eager_signature_list"])
        assert sim.stats()["cpu_fallback_ops"] == {}
        # The router's auxiliary (load-balancing) loss is part of the loss, as on the CPU.
        assert out.aux_loss is not None and float(out.aux_loss) > 0
        torch.testing.assert_close(out.aux_loss.cpu(), expected.aux_loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.loss.cpu(), expected.loss, rtol=1e-5, atol=1e-6)
        grads = {n: p.grad for n, p in model.named_parameters()}
        for name, param in reference.named_parameters():
            assert grads[name] is not None, name
            # float32, different summation order than the CPU's sparse path: equal to 1e-5
            torch.testing.assert_close(grads[name].cpu(), param.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert signatures[0] == signatures[1]
    # generate() with the router's logits on (this training config): upstream's load-balancing loss raises on the
    # static cache's 4D mask generate() on Neuron passes (4.57's CPU raises on its decode steps' masks too).
    ids = batches[0][:, :8]
    expected = reference.eval().generate(input_ids=ids, max_new_tokens=4, do_sample=False, output_router_logits=False)
    out = model.eval().generate(input_ids=ids.to("neuron"), max_new_tokens=4, do_sample=False)
    assert torch.equal(out.cpu(), expected)


def test_trainer_compiles_once_per_length_bucket_and_matches_the_cpu(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import random

    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from accelerate_neuron import simulator
    from accelerate_neuron.simulator import neff_cache

    monkeypatch.setenv("ACCELERATE_NEURON_TRAIN_BUCKETS", "32,64")
    rng = random.Random(0)
    features = [{"input_ids": [rng.randrange(3, 500) for _ in range(n)]} for n in (5, 20, 12, 30, 23, 9, 37, 51)]

    def train(**kwargs: Any) -> tuple[float, dict[str, Any]]:
        torch._dynamo.reset()
        simulator.reset_stats()
        args = TrainingArguments(
            output_dir=str(tmp_path / "out"),
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            seed=0,
            per_device_train_batch_size=4,
            num_train_epochs=1,
            **kwargs,
        )
        trainer = Trainer(
            model=tiny.model("qwen3_moe", output_router_logits=True, **INIT),
            args=args,
            train_dataset=features,
            data_collator=DataCollatorForLanguageModeling(tiny.tokenizer(), mlm=False),
        )
        with neff_cache.temporary():
            return trainer.train().training_loss, simulator.stats()

    cpu_loss, _ = train(use_cpu=True)
    loss, stats = train(torch_compile=True)
    assert loss == pytest.approx(cpu_loss, rel=1e-4)
    # Two steps, two length buckets (32, 64): one forward and one backward graph each, whatever the routing.
    assert stats["compiles"] <= 4 and {g["kind"] for g in stats["graphs"]} <= {"forward", "backward"}
    assert all(g["host_ops"] == [] for g in stats["graphs"])
    assert stats["cpu_fallbacks"] == 0


# ---------------------------------------------------------------- expert parallelism


EP_SCRIPT = str(Path(__file__).parent / "scripts" / "ep_step.py")
EP_FIGURES = ("logits_sum", "loss0", "aux_loss0", "loss1", "aux_loss1")


@pytest.fixture(scope="module")
def ep_reference(saved: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The single-process run of ep_step.py on neuron:0 (both families) every EP launch is compared with."""
    import dataclasses

    import transformers

    fields = {f.name for f in dataclasses.fields(transformers.DistributedConfig)} if INTERFACE else set()
    if "ep_size" not in fields:
        pytest.skip(f"Transformers {transformers.__version__}: DistributedConfig has no ep_size")
    out = tmp_path_factory.mktemp("ep-single")
    run_launcher([sys.executable, EP_SCRIPT, str(out), "1", "1", "1", *(str(saved[f]) for f in FAMILIES)], cores=1)
    return json.loads((out / "rank0.json").read_text())["models"]


def _ep_launch(tmp_path: Any, saved: dict, families: tuple[str, ...], tp: int, fsdp: int, ep: int) -> list[dict]:
    nproc = tp * fsdp
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", EP_SCRIPT]
    run_launcher([*cmd, str(tmp_path), str(tp), str(fsdp), str(ep), *(str(saved[f]) for f in families)], cores=nproc)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]
    # Each rank on its own core: it sees one device, neuron:0, which is physical core <rank>.
    for report in reports:
        assert report["device"] == "neuron:0" and report["visible_cores"] == [report["physical_core"]], report
        assert report["world_size"] == nproc
    assert [r["physical_core"] for r in reports] == list(range(nproc))
    return reports


def _assert_ep_equals_one_process(reports: list[dict], reference: dict, family: str, local_experts: int) -> None:
    """Forward logits, greedy tokens and one training step (with the router's auxiliary loss) on every rank equal
    the single-process run: rel 1e-4 (the TP tests' tolerance; float32, other summation orders), tokens exactly."""
    want = reference[family]
    assert want["local_experts"][0] == 4 and want["aux_loss0"] > 0
    assert want["loss1"] < want["loss0"]  # the SGD step moved the weights: loss1 checks the gradients
    for report in reports:
        run = report["models"][family]
        assert run["experts_implementation"] == experts.KEY, run
        assert run["local_experts"][0] == local_experts and run["dtensor_params"] > 0, run
        for key in EP_FIGURES:
            assert run[key] == pytest.approx(want[key], rel=1e-4), (family, key, report["rank"])
        assert run["logits_head"] == pytest.approx(want["logits_head"], rel=1e-4, abs=1e-5)
        assert run["tokens"] == want["tokens"], (family, report["rank"])
        for phase, counted in run["counts"].items():
            assert counted["cpu_fallbacks"] == 0, (family, phase, counted["cpu_fallback_ops"])
        # The script's training step runs eagerly (no compile), as the single process's does.
        assert run["counts"]["train_step"]["graph_keys"] == []


@pytest.mark.slow
def test_expert_parallel_on_two_ranks_equals_one_process(saved: dict, ep_reference: dict, tmp_path: Any) -> None:
    """DistributedConfig(tp_size=2, ep_size=2) under torchrun, Qwen3-MoE and Mixtral in one launch: each rank on
    its own core holds half the experts (run by neuron_static); forward, generate() and a training step equal
    the single-process run. The EP group shares its batch, so upstream's all_reduce EP serves inference (the
    graphs each rank hands the compiler are the single process's: 2 for the forward, a prefill and a decode graph
    for generate()) and, with the plugin, training too."""
    reports = _ep_launch(tmp_path, saved, FAMILIES, tp=2, fsdp=1, ep=2)
    for family in FAMILIES:
        _assert_ep_equals_one_process(reports, ep_reference, family, local_experts=2)
        # After the SGD step the routing differs; on Neuron training also takes the all_reduce EP (plugin moe,
        # expert_parallel.py), whose shapes follow the token count only: the second training forward runs no
        # new eager signature, as in one process (upstream's all_to_all ran 13 to 28 new ones here).
        assert ep_reference[family]["counts"]["train_forward_again"]["eager_signatures"] == 0
        assert [r["models"][family]["counts"]["train_forward_again"]["eager_signatures"] for r in reports] == [0, 0]
        for phase in ("forward", "generate"):
            want = len(ep_reference[family]["counts"][phase]["graph_keys"])
            assert [len(r["models"][family]["counts"][phase]["graph_keys"]) for r in reports] == [want, want]


FSDP_HOOKS = "_fsdp_common.py"  # where torch's FSDP2 disables Dynamo on its hooks: every fully_shard'd module


def _assert_only_fsdp_breaks(reports: list[dict], family: str) -> None:
    """ep_size > tp_size runs the fixed-size exchange (all-gather, experts, reduce-scatter) inside the compiled
    graphs: the only graph breaks left are FSDP2's (torch runs its hooks outside Dynamo), the same on every rank."""
    pieces = []
    for report in reports:
        counted = report["models"][family]["counts"]
        for phase in ("forward", "generate"):
            breaks = counted[phase]["breaks"]
            assert breaks and all(FSDP_HOOKS in b for b in breaks), (phase, breaks)
        pieces.append([len(counted[phase]["graph_keys"]) for phase in ("forward", "generate")])
        # A new routing (after the SGD step) runs no new eager signature: no all-to-all sized by the routing.
        assert counted["train_forward_again"]["eager_signatures"] == 0
    assert all(p == pieces[0] for p in pieces), pieces


@pytest.mark.slow
def test_expert_parallel_on_four_ranks_one_expert_each_equals_one_process(
    saved: dict, ep_reference: dict, tmp_path: Any
) -> None:
    """DistributedConfig(tp_size=2, fsdp_size=2, ep_size=4) on 4 ranks, Qwen3-MoE: one expert per rank, FSDP
    over the dense weights; forward, generate() and a training step equal the single-process run.

    With ep_size > tp_size the EP group holds different batches: upstream would exchange tokens with all_to_all
    (split sizes read back to the host at every MoE layer; 20 pieces per rank of a compiled forward); the plugin
    exchanges fixed-size buffers inside the compiled graphs, leaving FSDP2's breaks only. (The same exchange at
    tp_size=1, fsdp_size=2, ep_size=2 is the compiled Trainer test's below.)"""
    reports = _ep_launch(tmp_path, saved, ("qwen3_moe",), tp=2, fsdp=2, ep=4)
    _assert_ep_equals_one_process(reports, ep_reference, "qwen3_moe", local_experts=1)
    _assert_only_fsdp_breaks(reports, "qwen3_moe")


EP_TRAINER = str(Path(__file__).parent / "scripts" / "ep_trainer.py")


@pytest.mark.slow
def test_a_compiled_trainer_step_with_expert_parallelism_equals_one_process(saved: dict, tmp_path: Any) -> None:
    """Trainer(torch_compile=True), 3 steps, DistributedConfig(tp_size=1, fsdp_size=2, ep_size=2) under torchrun
    against one process with both ranks' rows in its batch: the same losses and weights; every step (each another
    routing) runs the graphs the first compiled, and the only graph breaks are FSDP2's."""
    import dataclasses

    import transformers

    fields = {f.name for f in dataclasses.fields(transformers.DistributedConfig)} if INTERFACE else set()
    if "ep_size" not in fields:
        pytest.skip(f"Transformers {transformers.__version__}: DistributedConfig has no ep_size")
    model = str(saved["qwen3_moe"])
    run_launcher(
        [sys.executable, EP_TRAINER, str(tmp_path / "one"), "1", "1", "1", model], cores=1, REFERENCE_BATCHES="2"
    )
    want = json.loads((tmp_path / "one" / "rank0.json").read_text())
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node=2", EP_TRAINER]
    run_launcher([*cmd, str(tmp_path / "ep"), "1", "2", "2", model], cores=2)
    reports = [json.loads((tmp_path / "ep" / f"rank{r}.json").read_text()) for r in range(2)]
    assert want["train"]["breaks"] == [] and want["train"]["kinds"] == ["forward", "backward"]
    assert len(want["losses"]) == 3 and want["graphs_after_step"] == [2, 2, 2]
    for report in reports:
        # float32, other summation orders (FSDP's gradient reduction, the exchange's): the TP tests' tolerance.
        assert report["losses"] == pytest.approx(want["losses"], rel=1e-5)
        for key in ("experts_checksum", "others_checksum"):
            assert report[key] == pytest.approx(want[key], rel=1e-5, abs=1e-4), key
        train = report["train"]
        assert train["host_ops"] == [] and train["cpu_fallbacks"] == 0
        assert train["breaks"] and all(FSDP_HOOKS in b for b in train["breaks"]), train["breaks"]
        steps = report["graphs_after_step"]
        assert steps[0] == steps[-1] == len(train["graph_keys"]), steps  # nothing compiled after the first step


def test_the_dry_run_report_names_graphs_holding_ops_neuron_cannot_compile() -> None:
    from accelerate_neuron.cli import _dryrun, _render

    graphs = [
        {"host_ops": ["aten::histc", "transformers::grouped_mm_fallback"]},
        {"host_ops": []},
        {"host_ops": ["aten::histc"]},
    ]
    held = _dryrun.host_op_graphs([{"stats": {"graphs": graphs}}, {"stats": {}}])
    assert held == {
        "graphs": 2,
        "ops": [{"op": "aten::histc", "graphs": 2}, {"op": "transformers::grouped_mm_fallback", "graphs": 1}],
    }
    text = "\n".join(_render._host_op_graphs({"host_op_graphs": held}))
    assert "Compiled graphs holding ops Neuron cannot compile: 2" in text
    assert "aten::histc in 2 graphs" in text and "ACCELERATE_NEURON_MOE_EXPERTS" in text
    assert _render._host_op_graphs({"host_op_graphs": {"graphs": 0, "ops": []}}) == []
