"""`accelerate-neuron precompile`, `accelerate_neuron.precompile()`: fill the NEFF cache, the real run compiles nothing.

The scripts in ``tests/scripts`` are stock scripts (no precompile in them). Each test runs
``precompile`` and then the script for real, in fresh processes sharing one cache folder, as a
user would on one host, and compares the cache keys of the graphs on both sides.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import accelerate_neuron
from accelerate_neuron import simulator, tiny
from accelerate_neuron.cli import precompile as cli_precompile
from helpers import REPO, clean_env, fresh_neff_cache_dir, last_json

SCRIPTS = REPO / "tests" / "scripts"
CLI = Path(sys.executable).with_name("accelerate-neuron")


def run(args: list[str], cache: str, timeout: float = 600) -> subprocess.CompletedProcess:
    command = [str(CLI)] if CLI.exists() else [sys.executable, "-m", "accelerate_neuron"]
    if args and args[0] == "python":
        command = [sys.executable]
        args = args[1:]
    return subprocess.run(
        [*command, *args],
        env=clean_env(TORCH_NEURONX_NEFF_CACHE_DIR=cache),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(REPO),
    )


def precompile(cache: str, *command: str, jobs: int = 1) -> dict:
    proc = run(["precompile", "--json", "--jobs", str(jobs), "--cores", "2", "--", *command], cache)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return last_json(proc.stdout)


def real_run(cache: str, *command: str) -> dict:
    proc = run(["simulate", "--cores", "2", "--json", "--", *command], cache)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # the script's own JSON line goes to stderr under --json; the report is stdout
    return last_json(proc.stderr)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tiny.save_pretrained(tmp_path_factory.mktemp("model") / "tiny-qwen3", "qwen3"))


@pytest.mark.one_pair
def test_generate_precompiled_then_run_compiles_nothing(qwen: str) -> None:
    cache = fresh_neff_cache_dir()
    script = ["python", str(SCRIPTS / "precompile_generate.py"), qwen]
    two = precompile(cache, *script, jobs=2)
    assert two["exit_codes"] == [0, 0] and not two["warnings"], two
    assert two["shapes_by_kind"] == {"generate": 5} and two["warmed"] == 5  # 6 calls, the last one's shapes seen
    assert two["graphs_compiled"] == two["distinct_graphs"] >= 8, two

    real = real_run(cache, *script)
    # 0 misses: every graph and every eager op of the real run was compiled by precompile
    assert (real["compiles"], real["eager_compiles"]) == (0, 0), real
    assert real["compile_cache_hits"] == len(real["graph_keys"])
    # and precompile compiled exactly the graphs the run needs: no more (no bucket the run never reaches), no fewer
    assert set(real["graph_keys"]) == set(two["graph_keys"])

    again = precompile(cache, *script, jobs=1)  # resumable: everything is cached already
    assert (again["graphs_compiled"], again["eager_compiled"]) == (0, 0), again
    assert again["graph_keys"] == two["graph_keys"]  # one worker reaches the same set as two
    assert again["shapes"] == two["shapes"]


@pytest.mark.one_pair
def test_training_precompiled_then_run_compiles_no_graph_and_writes_nothing(tmp_path: Path) -> None:
    cache = fresh_neff_cache_dir()
    out = tmp_path / "out"
    script = ["python", str(SCRIPTS / "precompile_train.py"), str(out)]
    warm = precompile(cache, *script)
    assert not out.exists(), "the warm-up wrote into the user's output folder"
    assert warm["shapes_by_kind"] == {"train": 2, "eval": 2}, warm  # length buckets 128 and 256; eval's last batch
    assert warm["graphs_compiled"] == 4, warm  # forward + backward per training bucket

    real = real_run(cache, *script)
    assert real["compiles"] == 0 and set(real["graph_keys"]) == set(warm["graph_keys"]), real
    assert real["steps"] == 6 and (out / "model.safetensors").is_file()
    # One eager op remains: Accelerate's gather_for_metrics concatenates the eval losses when the real eval
    # dataloader signals its end; the warm-up replays its batches without that signal.
    assert real["eager_compiles"] <= 1, real


@pytest.mark.one_pair
def test_a_failing_script_fails_precompile_with_its_output(qwen: str) -> None:
    proc = run(
        ["precompile", "--jobs", "1", "--", "python", str(SCRIPTS / "precompile_generate.py"), qwen, "--fail"],
        fresh_neff_cache_dir(),
    )
    assert proc.returncode == 1
    assert "precompile worker 0" in proc.stderr and "fails on purpose on its third prompt" in proc.stderr
    assert "worker 0 FAILED (exit code 1)" in proc.stdout


def _rank_results(stderr: str) -> list[dict]:
    """The JSON line each rank of a launched script printed (under simulate --json they go to stderr)."""
    return [json.loads(line) for line in stderr.splitlines() if line.startswith('{"compiles"')]


def _assert_each_graph_compiled_once(warm: dict, processes: int) -> None:
    assert warm["processes"] == processes and not any(warm["exit_codes"]), warm
    assert warm["shapes_by_kind"] == {"train": 2, "eval": 2} and warm["warmed"] == warm["shapes"], warm
    # Every rank's graphs are in the cache, each compiled by one process only (the others loaded it).
    assert warm["graphs_compiled"] == warm["distinct_graphs"] >= 4 and warm["graphs_cached"] > 0, warm


def _assert_the_real_launch_compiles_nothing(cache: str, warm: dict, *launch: str) -> None:
    proc = run(["simulate", "--cores", "2", "--json", "--", *launch], cache)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = _rank_results(proc.stderr)
    assert len(ranks) == 2 and all(r["steps"] > 0 for r in ranks), proc.stderr[-4000:]
    assert [(r["compiles"], r["eager_compiles"]) for r in ranks] == [(0, 0), (0, 0)], [r["missed"] for r in ranks]
    assert set().union(*(r["graph_keys"] for r in ranks)) == set(warm["graph_keys"])


@pytest.mark.slow
@pytest.mark.one_pair
def test_two_accelerate_launches_precompile_at_once_on_their_own_cores_and_ports(tmp_path: Path) -> None:
    """--jobs 2 with `accelerate launch` (2 processes each): two launches at once, each on half of the 4 cores and
    its own port, each warming every other shape; then the real launch compiles nothing. (The counterpart of
    neuron_parallel_compile: every rank of a DDP Trainer job warms the shapes of its own data shard. `accelerate
    launch` starts its ranks through torchrun's agent, torch.distributed.run: a plain torchrun launch is the same
    run, whose one difference, one worker by default, the launcher test below checks.)"""
    from accelerate.commands.config import default

    config = tmp_path / "config.yaml"
    default.write_basic_config(save_location=str(config))  # MULTI_NEURON, 2 processes (the session's 2 cores)
    cache = fresh_neff_cache_dir()
    launch = ["accelerate", "launch", "--config_file", str(config), str(SCRIPTS / "precompile_train.py")]
    proc = run(["precompile", "--json", "--jobs", "2", "--cores", "4", "--", *launch, str(tmp_path / "out")], cache)
    assert proc.returncode == 0, proc.stderr[-4000:]
    warm = last_json(proc.stdout)
    assert warm["jobs"] == 2 and warm["exit_codes"] == [0, 0], warm
    assert not (tmp_path / "out").exists()  # the warm-up of a launch writes nothing into its output folder
    _assert_each_graph_compiled_once(warm, processes=4)
    _assert_the_real_launch_compiles_nothing(cache, warm, *launch, str(tmp_path / "real"))


def test_a_launcher_is_one_worker_and_several_launches_get_their_own_cores_and_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    launcher = cli_precompile.launcher
    assert launcher(["torchrun", "--nproc-per-node", "2", "t.py"]) == "torchrun"
    assert launcher(["/venv/bin/python", "-m", "torch.distributed.run", "t.py"]) == "torchrun"
    assert launcher(["accelerate", "launch", "t.py"]) == launcher(["accelerate-launch", "t.py"]) == "accelerate launch"
    assert launcher(["python", "t.py"]) is None and launcher(["accelerate", "env"]) is None
    # A launch is one worker unless --jobs says otherwise: its ranks already take one core each.
    assert cli_precompile.worker_count(None, "torchrun") == 1 and cli_precompile.worker_count(2, "torchrun") == 2
    assert cli_precompile.worker_count(None, None) == cli_precompile.default_jobs()

    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES", raising=False)
    assert cli_precompile._worker_cores(2, 4) == ["0,1", "2,3"]
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "4-7")
    assert cli_precompile._worker_cores(4, 64) == ["4", "5", "6", "7"]
    with pytest.raises(cli_precompile.CliError, match=r"--jobs 5 with a launcher .* only 4 core\(s\) are visible"):
        cli_precompile._worker_cores(5, 64)

    accelerate = ["accelerate", "launch", "t.py"]
    assert cli_precompile._launch_command(accelerate, "accelerate launch", 2)[:4] == [
        "accelerate",
        "launch",
        "--main_process_port",
        "0",
    ]
    assert cli_precompile._launch_command(accelerate, "accelerate launch", 1) == accelerate
    mine = ["accelerate", "launch", "--main_process_port=29600", "t.py"]
    assert cli_precompile._launch_command(mine, "accelerate launch", 2) == mine


@pytest.mark.parametrize("value", ["0", "-2", "two", "1000"])
def test_bad_jobs_are_refused_naming_the_value(value: str) -> None:
    proc = run(["precompile", "--jobs", value, "--", "python", "-c", "pass"], fresh_neff_cache_dir(), timeout=120)
    assert proc.returncode == 2
    assert f"argument --jobs/-j: {value!r}" in proc.stderr or f"argument --jobs/-j: {value} " in proc.stderr
    assert f"from 1 to {cli_precompile.MAX_JOBS}" in proc.stderr


def test_python_api_for_generate_covers_the_calls_that_follow(sim: object) -> None:
    torch._dynamo.reset()
    model = tiny.model("qwen3").to("neuron")
    report = accelerate_neuron.precompile(model, prompt_lengths=[5, 40], batch_sizes=[1, 3], max_new_tokens=8)
    assert (report["shapes"], report["warmed"]) == (4, 4)  # 2 prompt buckets x 2 batch buckets
    shapes = [json.loads(s) for s in report["shape_list"]]
    prefills = {(s["prompt"], s["rows"], tuple(s["cache"])) for s in shapes}
    decodes = {(s["rows"], tuple(s["cache"])) for s in shapes}
    # one prefill graph per (prompt bucket, batch bucket, cache) and one decode graph per (batch bucket, cache)
    assert report["graphs_compiled"] == len(prefills) + len(decodes) == report["estimate"]["graphs"]
    simulator.reset_stats()
    # Same buckets, other lengths and sizes, in the API's order (batch sizes, then prompt lengths): upstream sizes
    # a static cache by the calls before it too (5.x keeps the largest length so far), so order matters.
    for length, batch in [(7, 1), (33, 1), (12, 3), (50, 4)]:
        ids = torch.randint(3, 500, (batch, length))
        out = model.generate(input_ids=ids.to("neuron"), attention_mask=torch.ones_like(ids), max_new_tokens=8)
        assert out.shape == (batch, length + 8)
    st = simulator.stats()
    assert (st["compiles"], st["eager_compiles"]) == (0, 0), st["graphs"]


def test_python_api_warm_up_returns_results_of_the_real_shape(sim: object) -> None:
    from accelerate_neuron.builtin.warmup import apply_patches, session

    model = tiny.model("qwen3").to("neuron")
    apply_patches()
    ids = torch.randint(3, 500, (2, 9))
    with session.warming_up() as warm:
        out = model.generate(input_ids=ids, max_new_tokens=12, num_return_sequences=2, do_sample=True)
        again = model.generate(input_ids=ids, max_new_tokens=12, num_return_sequences=2, do_sample=True)
        as_dict = model.generate(input_ids=ids[:1], max_new_tokens=5, return_dict_in_generate=True)
    assert out.shape == again.shape == (4, 21) and as_dict.sequences.shape == (1, 14)
    assert torch.equal(out[:, :9], ids.repeat_interleave(2, dim=0))  # the prompt, then pad tokens
    assert len(warm.seen) == 2  # the second call's shape was seen: it returned at once


def test_python_api_for_a_trainer_keeps_weights_and_output_folder(tmp_path: Path, sim: object) -> None:
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    out = tmp_path / "out"
    args = TrainingArguments(
        str(out), torch_compile=True, per_device_train_batch_size=4, report_to=[], save_strategy="no", use_cpu=False
    )
    model = tiny.model("llama", max_position_embeddings=256)
    rows = [{"input_ids": list(range(3, 3 + n))} for n in (10, 90, 30, 150, 20, 70, 100, 40)]
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=rows,
        data_collator=DataCollatorForLanguageModeling(tiny.tokenizer(), mlm=False),
    )
    before = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    report = accelerate_neuron.precompile(trainer)
    assert report["shapes"] >= 2 and report["graphs_compiled"] >= 4, report
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k].cpu()) for k in before)
    assert all(p.grad is None for p in model.parameters())
    assert not any(out.glob("checkpoint-*")) and not (out / "model.safetensors").exists()
    assert args.output_dir == str(out)
    json.dumps(report)


@pytest.mark.one_pair
def test_inference_calls_precompiled_then_run_compiles_nothing(tmp_path: Path) -> None:
    encoder = tiny.save_encoder(tmp_path / "encoder", "bert", "AutoModel")
    classifier = tiny.save_encoder(tmp_path / "classifier", "bert", "AutoModelForSequenceClassification", num_labels=2)
    cache = fresh_neff_cache_dir()
    script = ["python", str(SCRIPTS / "precompile_embed.py"), str(encoder), str(classifier)]
    two = precompile(cache, *script, jobs=2)
    assert two["exit_codes"] == [0, 0] and not two["warnings"], two
    # encode's batches of 4 (the last of 2) and the pipeline's one text at a time: 8 (rows, bucket) shapes over an
    # inference call's pow2-half buckets 16 to 64 (texts of 3-30 words)
    assert two["shapes_by_kind"] == {"forward": 8} and two["warmed"] == 8, two

    real = real_run(cache, *script)
    assert (real["compiles"], real["eager_compiles"]) == (0, 0), real
    assert set(real["graph_keys"]) == set(two["graph_keys"])
    unwarmed = real_run(fresh_neff_cache_dir(), *script)
    assert unwarmed["compiles"] == len(real["graph_keys"]) and unwarmed["checksum"] == real["checksum"]


def test_a_stray_precompile_variable_is_ignored_with_a_warning() -> None:
    """``ACCELERATE_NEURON_PRECOMPILE=1`` left in a shell made every generate() return pad tokens, silently.
    Only the command turns warm-up mode on now; the variable alone is ignored and said so on stderr."""
    from helpers import run_python

    code = """
        import torch
        from accelerate_neuron import tiny
        model = tiny.model("llama")
        prompt = torch.tensor([[1, 5, 7, 9]])
        cpu = model.generate(prompt, max_new_tokens=4, do_sample=False)[0].tolist()
        neuron = model.to("neuron").generate(prompt.to("neuron"), max_new_tokens=4, do_sample=False)[0].cpu().tolist()
        print("same tokens as the CPU:", cpu == neuron, cpu, neuron)
    """
    proc = run_python(code, ACCELERATE_NEURON_SIMULATE="1", ACCELERATE_NEURON_PRECOMPILE="1")
    assert "same tokens as the CPU: True" in proc.stdout, proc.stdout
    (said,) = [line for line in proc.stderr.splitlines() if "ACCELERATE_NEURON_PRECOMPILE=1 is ignored" in line]
    assert "not set by `accelerate-neuron precompile`" in said and "runs for real" in said


@pytest.mark.one_pair
def test_warm_up_mode_is_said_and_a_workers_environment_does_not_outlive_the_command(tmp_path: Path) -> None:
    """Under precompile a script's own output file holds the warm-up's stand-ins (documented), and the worker
    says it is warming up. Its environment, replayed after the command ended, turns nothing on."""
    cache = fresh_neff_cache_dir()
    script = str(SCRIPTS / "precompile_side_effects.py")
    precompile(cache, "python", script, str(tmp_path / "warm.json"))
    warm = json.loads((tmp_path / "warm.json").read_text())
    assert warm["warming_up"] is True and warm["neuron"] != warm["cpu"]  # stand-ins in the script's own file
    assert any("warm-up mode (accelerate-neuron precompile, worker 1 of 1)" in m for m in warm["heard"]), warm
    assert warm["env"]["ACCELERATE_NEURON_PRECOMPILE"] == "0/1" and warm["env"]["ACCELERATE_NEURON_PRECOMPILE_TOKEN"]

    replay = subprocess.run(
        [sys.executable, script, str(tmp_path / "real.json")],
        env=clean_env(**warm["env"]),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(REPO),
    )
    assert replay.returncode == 0, replay.stderr[-4000:]
    real = json.loads((tmp_path / "real.json").read_text())
    assert real["warming_up"] is False and real["neuron"] == real["cpu"]
    assert any("is ignored: the `accelerate-neuron precompile` run that set it has ended" in m for m in real["heard"])
