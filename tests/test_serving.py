"""Continuous batching on Neuron (generate_batch, the manager API, ``transformers serve``): a bounded set of graphs.

Every step of continuous batching is padded to a (query-token bucket, KV bucket) shape and compiled; the tests
use a small grid (query buckets 32 and 128, KV buckets 1024 and the cache's 4096) so a warm-up compiles in seconds.
Results are compared with the CPU (same weights, float32, ``generate()`` one request at a time); compiles and
eager signatures are what Neuron would compile (NEFF cache misses).
"""

from __future__ import annotations

import collections
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("transformers.generation.continuous_batching.model_runner") is None:
    pytest.skip(
        "this Transformers' continuous batching (4.57) has no step padding or compile configs "
        "(no transformers.generation.continuous_batching.model_runner): the serving plugin's patches skip there "
        "and nothing here applies",
        allow_module_level=True,
    )

from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching import model_runner

from accelerate_neuron import hookimpl, logs, plugins, settings, simulator, tiny
from accelerate_neuron.builtin import shapes
from accelerate_neuron.builtin.serving import plan as serving_plan
from helpers import REPO, clean_env, fresh_neff_cache_dir, last_json, serve_under_simulate

WORDS = tiny.CORPUS.split()
QWEN = {"initializer_range": 0.3}
#: Prompt lengths in words: 3 to 60 as in the issue, and one past the step's token budget (128), split across steps.
LENGTHS = [3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47, 51, 55, 60, 110]
NEW = 12
GRID_ENV = {
    "ACCELERATE_NEURON_SERVING_TOKEN_BUCKETS": "32,128",
    "ACCELERATE_NEURON_SERVING_KV_BUCKETS": "1024",
    "ACCELERATE_NEURON_SERVING_KV_CACHE_TOKENS": "4096",
}
GRID = {(q, kv) for q in (32, 128) for kv in (1024, 4096)}


def prompt(words: int, offset: int = 0) -> str:
    return " ".join(WORDS[(offset + i) % len(WORDS)] for i in range(words))


@pytest.fixture(scope="module", autouse=True)
def _clean_dynamo():
    yield
    torch._dynamo.reset()


@pytest.fixture
def grid(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in GRID_ENV.items():
        monkeypatch.setenv(key, value)


@pytest.fixture(scope="module")
def tok():
    return tiny.tokenizer()


@pytest.fixture(scope="module")
def reference():
    return tiny.model("qwen3", **QWEN)


@pytest.fixture(scope="module")
def model():
    return tiny.model("qwen3", **QWEN).to("neuron")


def config(new: int = NEW) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=2, pad_token_id=0)


def cpu_tokens(reference, ids: list[int], new: int = NEW) -> list[int]:
    out = reference.generate(torch.tensor([ids]), generation_config=config(new))
    return out[0, len(ids) :].tolist()


def requests(tok, offset: int) -> list[list[int]]:
    return [tok(prompt(n, offset + i))["input_ids"] for i, n in enumerate(LENGTHS)]


@pytest.fixture
def steps(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(query tokens, KV tokens read) of every step's model inputs, read at the compiled step's door."""
    seen: list[tuple[int, int]] = []
    original = model_runner.ModelRunner.compute_batch

    def compute_batch(self, model, batch_data):
        tokens = batch_data["input_ids"].shape[-1]
        seen.append((tokens, batch_data["read_index"][0].numel() - tokens))
        return original(self, model, batch_data)

    monkeypatch.setattr(model_runner.ModelRunner, "compute_batch", compute_batch)
    return seen


def misses_by_frame(stats: dict) -> dict[tuple, int]:
    """Graphs compiled (NEFF cache misses), per Dynamo frame (each piece between upstream's graph breaks)."""
    found: dict[tuple, int] = collections.Counter()
    for graph in stats["graphs"]:
        if graph.get("cache") == "miss":
            frame = graph.get("frame") or {}
            found[(frame.get("file"), frame.get("function"), frame.get("line"))] += 1
    return found


def generated(results: dict) -> list[list[int]]:
    assert all(r.error is None for r in results.values()), [r.error for r in results.values()]
    return [r.generated_tokens for r in results.values()]


def test_generate_batch_matches_cpu_and_compiles_only_the_buckets_it_touches(
    grid, sim, model, reference, tok, steps
) -> None:
    torch._dynamo.reset()
    first = requests(tok, 0)
    assert max(map(len, first)) > 128  # one prompt longer than the step's token budget: split across steps
    out = model.generate_batch(first, generation_config=config(), warmup=False)
    assert generated(out) == [cpu_tokens(reference, ids) for ids in first]
    touched = set(steps)
    assert touched <= GRID, touched - GRID
    stats = simulator.stats()
    # One graph per step shape: the paged cache's update is traced into the step (upstream breaks the graph there).
    assert stats["compiles"] == len(touched) and stats["graph_breaks"] == [], stats["graph_breaks"]
    assert {g["graphs_per_step"] for g in stats["steps"]} == {1}, stats["steps"]
    # Eager work: the cache update and the embedding lookup, a few ops per shape (the stock run: hundreds).
    assert stats["eager_signatures"] <= 5 * len(touched) + 8, stats["eager_signature_list"]

    steps.clear()
    second = requests(tok, 5)
    out = model.generate_batch(second, generation_config=config(), warmup=False)
    assert generated(out) == [cpu_tokens(reference, ids) for ids in second]
    new_shapes = set(steps) - touched
    after = simulator.stats()
    added = collections.Counter(misses_by_frame(after))
    added.subtract(misses_by_frame(stats))
    assert all(n <= len(new_shapes) for n in added.values()), (new_shapes, added)
    if not new_shapes:
        assert (after["compiles"], after["eager_signatures"]) == (stats["compiles"], stats["eager_signatures"])


def test_a_warm_server_compiles_nothing_new(grid, sim, model, reference, tok) -> None:
    torch._dynamo.reset()
    first = requests(tok, 1)
    out = model.generate_batch(first, generation_config=config())  # upstream's default: warm up first
    assert generated(out) == [cpu_tokens(reference, ids) for ids in first]
    warm = simulator.stats()
    assert all(n <= len(GRID) for n in misses_by_frame(warm).values())
    assert warm["eager_signatures"] <= 5 * len(GRID) + 8, warm["eager_signature_list"]

    second = requests(tok, 9)
    out = model.generate_batch(second, generation_config=config())
    assert generated(out) == [cpu_tokens(reference, ids) for ids in second]
    after = simulator.stats()
    assert after["compiles"] == warm["compiles"], misses_by_frame(after)
    new_ops = after["eager_signature_list"][warm["eager_signatures"] :]
    assert after["eager_signatures"] == warm["eager_signatures"], new_ops


def test_stock_continuous_batching_compiles_eager_ops_per_batch(sim, model, tok, unpatched) -> None:
    """The baseline: upstream on Neuron runs every step eagerly, and each new batch composition costs new ops."""
    torch._dynamo.reset()
    cb = ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=128)  # stock sizes the cache by host memory
    with unpatched():
        model.generate_batch(requests(tok, 0), generation_config=config(), continuous_batching_config=cb)
        first = simulator.stats()
        model.generate_batch(requests(tok, 5), generation_config=config(), continuous_batching_config=cb)
        second = simulator.stats()
    assert first["compiles"] == second["compiles"] == 0
    assert first["eager_signatures"] >= 200, first["eager_signatures"]
    assert second["eager_signatures"] - first["eager_signatures"] >= 30


def collect(manager, ids: list[str], timeout: float = 300) -> dict[str, list]:
    """Every output of the requests ``ids``, in the order the manager delivered them (one reader of its queue)."""
    outputs: dict[str, list] = {rid: [] for rid in ids}
    deadline = time.monotonic() + timeout
    while not all(o and o[-1].is_finished() for o in outputs.values()):
        assert time.monotonic() < deadline, {rid: [len(x.generated_tokens) for x in o] for rid, o in outputs.items()}
        result = manager.get_result(timeout=1)
        if result is not None:
            outputs[result.request_id].append(result)
    return outputs


def test_manager_streams_and_honours_each_requests_limits_and_eos(grid, sim, model, reference, tok) -> None:
    prompts = [tok(prompt(n, 4 * i))["input_ids"] for i, n in enumerate([5, 43, 17, 29, 9, 60])]
    limits = [3, 12, 7, 20, 1, 15]
    expected = [cpu_tokens(reference, ids, new) for ids, new in zip(prompts, limits, strict=True)]
    # The EOS path is exercised: some request ends on EOS before its limit.
    assert any(len(e) < n and e[-1] == 2 for e, n in zip(expected, limits, strict=True)), expected
    manager = model.init_continuous_batching(generation_config=config())
    manager.warmup()
    manager.start()
    try:
        ids = [
            manager.add_request(input_ids=p, max_new_tokens=n, streaming=i % 2 == 0)
            for i, (p, n) in enumerate(zip(prompts, limits, strict=True))
        ]
        outputs = collect(manager, ids)
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    for i, rid in enumerate(ids):
        seen = outputs[rid]
        assert seen and seen[-1].is_finished() and seen[-1].error is None
        assert seen[-1].generated_tokens == expected[i], i
        if i % 2 == 0:  # streamed: one output per token, each a prefix of the next
            assert [len(o.generated_tokens) for o in seen] == list(range(1, len(expected[i]) + 1)), i
        else:
            assert len(seen) == 1, i


def test_a_request_beyond_the_kv_cache_is_refused_naming_the_setting(grid, model, tok) -> None:
    ids = tok(prompt(20))["input_ids"]
    message = r"longer than continuous batching's KV cache on Neuron \(4096 tokens.*ACCELERATE_NEURON_SERVING_KV_CACHE"
    with pytest.raises(ValueError, match=message):
        model.generate_batch([ids, ids], generation_config=config(5000))
    manager = model.init_continuous_batching(generation_config=config())
    try:
        with pytest.raises(ValueError, match=message):
            manager.add_request(input_ids=ids, max_new_tokens=4090)
    finally:
        manager.destroy()


def test_buckets_off_is_upstreams_eager_path_with_the_cache_sized_for_the_core(
    monkeypatch, sim, model, reference, tok
) -> None:
    monkeypatch.setenv("ACCELERATE_NEURON_SERVING_TOKEN_BUCKETS", "off")
    monkeypatch.setenv("ACCELERATE_NEURON_SERVING_KV_CACHE_TOKENS", "4096")
    torch._dynamo.reset()
    first = requests(tok, 2)[:4]
    out = model.generate_batch(first, generation_config=config())
    assert generated(out) == [cpu_tokens(reference, ids) for ids in first]
    assert simulator.stats()["compiles"] == 0
    # Upstream would size the cache by the host's memory (it knows CUDA, XPU and MPS only): 16 pages of 256 here.
    manager = model.init_continuous_batching(generation_config=config())
    try:
        assert manager.continuous_batching_config.num_blocks == 16
        assert manager.continuous_batching_config.varlen_compile_config is None
    finally:
        manager.destroy()


def test_after_warm_up_a_compile_is_warned_about(grid, model, tok, caplog) -> None:
    manager = model.init_continuous_batching(generation_config=config())
    manager.warmup()
    torch._dynamo.reset()  # whatever the cause, the compiled step is gone: the next step compiles again
    manager.start()
    try:
        with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
            rid = manager.add_request(input_ids=tok(prompt(9))["input_ids"], max_new_tokens=2)
            assert collect(manager, [rid])[rid][-1].error is None
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    warned = [r.getMessage() for r in caplog.records if "compiled a new graph after its warm-up" in r.getMessage()]
    assert len(warned) == 1 and "Dynamo recompiled" in warned[0], warned


def test_the_warm_up_of_16_requests_compiles_only_the_shapes_they_can_reach(sim, model, reference, tok, caplog) -> None:
    """The default grid (6 query x 6 KV buckets): 16 requests of at most 188 prompt tokens and 12 new ones cannot
    read more than 3,200 KV tokens, so the warm-up compiles 6 x 4 shapes, one graph each (stock: 144 Dynamo
    graphs, 59 compiles + 85 loads), announced with its cost before it starts; 16 more requests compile nothing."""
    torch._dynamo.reset()
    logs.forget()
    first = requests(tok, 0)
    with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
        out = model.generate_batch(first, generation_config=config())
    assert generated(out) == [cpu_tokens(reference, ids) for ids in first]
    warm = simulator.stats()
    assert warm["compiles"] + warm["compile_cache_hits"] == warm["dynamo_graphs"] == 24, warm["dynamo_graphs"]
    assert {g["graphs_per_step"] for g in warm["steps"]} == {1} and warm["graph_breaks"] == []
    (announced,) = [r.getMessage() for r in caplog.records if "warms 24 step shape(s)" in r.getMessage()]
    assert "query tokens 16/32/64/128/256/512 x KV tokens 512/1024/2048/4096" in announced, announced
    assert "about 24 min of compiling" in announced and "ACCELERATE_NEURON_SERVING_WARMUP_SHAPES" in announced

    second = requests(tok, 16)
    out = model.generate_batch(second, generation_config=config())
    assert generated(out) == [cpu_tokens(reference, ids) for ids in second]
    after = simulator.stats()
    assert after["dynamo_graphs"] == warm["dynamo_graphs"] and after["compiles"] == warm["compiles"]
    assert after["compile_cache_hits"] == warm["compile_cache_hits"]


@pytest.mark.parametrize("cap", [1, 0])
def test_serving_warmup_shapes_caps_the_warm_up(grid, sim, model, tok, monkeypatch, caplog, cap) -> None:
    """A server's requests are unknown: every shape is reachable. The setting caps the warm-up (smallest first);
    the rest compile when a step first needs them."""
    monkeypatch.setenv("ACCELERATE_NEURON_SERVING_WARMUP_SHAPES", str(cap))
    torch._dynamo.reset()
    logs.forget()
    manager = model.init_continuous_batching(generation_config=config())
    try:
        with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
            manager.warmup()
    finally:
        manager.destroy()
    assert simulator.stats()["compiles"] == cap
    said = " ".join(r.getMessage() for r in caplog.records)
    if cap:
        assert "warms 1 step shape(s) before serving, 1 of the whole grid" in said, said
        assert "query tokens 32 x KV tokens 1024" in said, said
    else:
        assert "warms no step shape" in said, said


def test_reachable_shapes_follow_the_requests() -> None:
    from transformers.generation.continuous_batching.utils import WorkloadHints

    from accelerate_neuron.builtin.serving import warm_grid

    plan = serving_plan.ServingPlan((32, 64, 512), (512, 1024, 2048), 16384)
    grid = plan.grid(512, 16384)
    assert grid == [(q, kv) for q in (32, 64, 512) for kv in (512, 1024, 2048, 16384)]
    hints = WorkloadHints(max_prompt_length=40, max_generated_length=20, num_requests=16)
    reach = warm_grid.from_hints(hints)
    assert reach == warm_grid.Reach(query_tokens=640, kv_tokens=960)
    reachable = plan.grid(512, 16384, reach.query_tokens, reach.kv_tokens)
    assert reachable == [(q, kv) for q in (32, 64, 512) for kv in (512, 1024)]
    one = warm_grid.from_hints(WorkloadHints(max_prompt_length=10, max_generated_length=5, num_requests=1))
    assert plan.grid(512, 16384, one.query_tokens, one.kv_tokens) == [(32, 512)]
    server = warm_grid.from_hints(None)  # a server: everything
    assert server == warm_grid.Reach(None, None) and plan.grid(512, 16384, None, None) == grid
    shapes, why = warm_grid.choose(grid, reachable)
    assert shapes == sorted(reachable, key=lambda s: (s[1], s[0])) and "the 6 a step of these requests" in why


# --- the plan: buckets, settings, hook, the cache's size ----------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "budget", "expected"),
    [(1, 512, 32), (32, 512, 32), (33, 512, 64), (500, 512, 512), (100, 128, 128), (100, 96, 100)],
)
def test_token_bucket(tokens, budget, expected) -> None:
    # A step larger than its budget (upstream's scheduler never makes one) keeps its own size, as a size beyond the
    # largest bucket does everywhere: padding "up" to the smaller budget would cut its tokens.
    plan = serving_plan.ServingPlan(shapes.pow2(32, 512), (512, 1024), 4096)
    assert plan.token_bucket(tokens, budget) == expected


@pytest.mark.parametrize(("read", "expected"), [(0, 512), (1, 512), (513, 1024), (3000, 3000), (2999, 3000)])
def test_kv_bucket_ends_at_the_cache_capacity(read, expected) -> None:
    plan = serving_plan.ServingPlan((32,), shapes.pow2(512, 16384), 16384)
    assert plan.kv_bucket(read, capacity=3000) == expected
    assert plan.kv_grid(3000) == (512, 1024, 2048, 3000)


def test_hook_answers_unless_the_user_set_a_value(monkeypatch, model) -> None:
    class Plugin:
        @hookimpl
        def neuron_serving_shape_policy(self, max_position_embeddings, kv_bytes_per_token):
            assert kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # keys+values, 2 layers, 2 KV heads, head_dim 16, fp32
            return {"token_buckets": [64, 256], "kv_cache_tokens": 2048}

    text = model.config.get_text_config()
    with plugins.registered(Plugin()):
        plan = serving_plan.resolve(text, model.device)
        assert (plan.token_buckets, plan.kv_cache_tokens, plan.kv_buckets) == ((64, 256), 2048, (512, 1024, 2048))
        monkeypatch.setenv("ACCELERATE_NEURON_SERVING_TOKEN_BUCKETS", "16,32")
        assert serving_plan.resolve(text, model.device).token_buckets == (16, 32)
        monkeypatch.setenv("ACCELERATE_NEURON_SERVING_KV_BUCKETS", "off")
        off = serving_plan.resolve(text, model.device)
        assert not off.compiled and off.kv_cache_tokens == 2048


@pytest.mark.parametrize(
    ("name", "value"),
    [("ACCELERATE_NEURON_SERVING_TOKEN_BUCKETS", "64,32"), ("ACCELERATE_NEURON_SERVING_KV_CACHE_TOKENS", "0")],
)
def test_bad_setting_names_the_variable(monkeypatch, model, name, value) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(settings.SettingError, match=rf"invalid {name}='{value}'"):
        serving_plan.resolve(model.config.get_text_config(), model.device)


def test_the_default_cache_shrinks_to_the_core_a_chosen_one_does_not(monkeypatch, model, caplog) -> None:
    from accelerate_neuron import device as neuron_device

    real = neuron_device.core_memory(0)
    monkeypatch.setattr(neuron_device, "core_memory", lambda i: real.__class__(**{**vars(real), "free": 2**20}))
    text = model.config.get_text_config()
    with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
        plan = serving_plan.resolve(text, model.device)
    assert plan.kv_cache_tokens == int(2**20 * serving_plan.MEMORY_SHARE) // 512  # 512 bytes a token
    assert any("does not fit neuron:0" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("ACCELERATE_NEURON_SERVING_KV_CACHE_TOKENS", "16384")
    with pytest.raises(ValueError, match=r"ACCELERATE_NEURON_SERVING_KV_CACHE_TOKENS=16384 \(.*at most 1843 tokens"):
        serving_plan.resolve(text, model.device)


# --- precompile, and `transformers serve` on localhost -------------------------------------------------------------


def cli(args: list[str], cache: str, timeout: float = 900) -> subprocess.CompletedProcess:
    command = [str(Path(sys.executable).with_name("accelerate-neuron")), *args]
    return subprocess.run(
        command,
        env=clean_env(TORCH_NEURONX_NEFF_CACHE_DIR=cache, OMP_NUM_THREADS="1", **GRID_ENV),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(REPO),
    )


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tiny.save_pretrained(tmp_path_factory.mktemp("model") / "tiny-qwen3", "qwen3", **QWEN))


@pytest.mark.slow
def test_precompile_warms_generate_batch_then_the_run_compiles_nothing(qwen: str) -> None:
    cache = fresh_neff_cache_dir()
    script = [sys.executable, str(REPO / "tests" / "scripts" / "precompile_serving.py"), qwen]
    # One worker: parallel workers are test_precompile's; here what the serving warm-up reaches.
    proc = cli(["precompile", "--json", "--jobs", "1", "--cores", "2", "--", *script], cache)
    assert proc.returncode == 0, proc.stderr[-4000:]
    warm = last_json(proc.stdout)
    assert warm["exit_codes"] == [0] and not warm["warnings"], warm
    # The shapes these 8 requests can reach: at most 8 x (longest prompt + 10) KV tokens, under the 1024 bucket.
    reachable = len({(q, kv) for q, kv in GRID if kv == 1024})
    assert warm["shapes_by_kind"] == {"continuous_batching": reachable} and warm["warmed"] == reachable, warm
    assert warm["graphs_compiled"] > 0

    proc = cli(["simulate", "--cores", "2", "--json", "--", *script], cache)
    assert proc.returncode == 0, proc.stderr[-4000:]
    real = last_json(proc.stderr)
    missed = {k: real[k] for k in ("compiles", "eager_compiles", "missed")}
    assert (real["compiles"], real["eager_compiles"]) == (0, 0), json.dumps(missed)[:4000]
    assert set(real["graph_keys"]) <= set(warm["graph_keys"])
    assert all(len(t) == 10 or t[-1:] == [2] for t in real["tokens"]), real["tokens"]


def _serve_is_lazy() -> bool:
    """Whether this release's `transformers serve` loads the model in its own process and starts continuous batching
    at the first request (5.x up to 5.24), rather than in a model's process that warms it before serving (5.25+)."""
    try:
        from transformers.cli.serving import utils
    except ImportError:
        return False
    return hasattr(utils, "CBGenerateManager")


LAZY_SERVE = _serve_is_lazy()


def _post(port: int, body: dict, timeout: float = 120) -> tuple[int, str]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _streamed_text(payload: str) -> str:
    chunks = [line[len("data: ") :] for line in payload.splitlines() if line.startswith("data: {")]
    return "".join(c["text"] for chunk in chunks for c in json.loads(chunk)["choices"])


def _graphs_by_frame(cache: Path) -> collections.Counter:
    """Compiled graphs in the NEFF cache folder, per Dynamo frame (the record each entry holds)."""
    found: collections.Counter = collections.Counter()
    for entry in cache.rglob("*.neff"):
        record = json.loads(entry.read_text().split("\n", 2)[2])
        frame = record.get("frame") or {}
        found[(frame.get("file"), frame.get("function"), frame.get("line"))] += 1
    return found


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None,
    reason="`transformers serve` needs fastapi and uvicorn (the project's test extra installs them)",
)
def test_transformers_serve_answers_on_localhost_and_compiles_nothing_after_its_warm_up(qwen, reference, tok) -> None:
    """Run as a user dry-runs a server: `accelerate-neuron simulate -- transformers serve ...`, stopped with Ctrl-C.

    From 5.25 the model runs in a process serve starts with multiprocessing's spawn and stops with terminate()
    (SIGTERM), which warms continuous batching before the server answers: simulate's report holds that process's
    record, its graphs and the model's placement. Up to 5.24 serve loads the model itself and starts continuous
    batching at the first request, without upstream's warm-up: the plugin warms the grid then, before that request.
    """
    from openai import OpenAI

    cache = Path(fresh_neff_cache_dir())
    server, port = serve_under_simulate(qwen, 2, cache, GRID_ENV)
    try:
        if LAZY_SERVE:  # serve starts continuous batching at the first request: the grid is warmed then
            assert not _graphs_by_frame(cache)
            status, payload = _post(port, {"model": qwen, "prompt": prompt(3), "max_tokens": 2, "temperature": 0})
            assert status == 200, payload
        warmed = _graphs_by_frame(cache)  # the model's process warmed the grid before it reported loaded
        assert warmed and all(n <= len(GRID) for n in warmed.values()), warmed

        for round_ in range(2):
            for i, (words, new) in enumerate([(5, 8), (40, 3), (17, 12), (60, 6), (25, 10)]):
                text = prompt(words, 3 * i + round_)
                ids = tok(text)["input_ids"]
                expected = cpu_tokens(reference, ids, new)
                body = {"model": qwen, "prompt": text, "max_tokens": new, "temperature": 0}
                status, payload = _post(port, body)
                assert status == 200, payload
                answer = json.loads(payload)
                assert answer["usage"]["completion_tokens"] == len(expected)
                assert answer["choices"][0]["text"] == tok.decode(expected, skip_special_tokens=True)
                status, streamed = _post(port, {**body, "stream": True})
                assert status == 200 and streamed.count("data: {") >= min(len(expected), 2), streamed
                # serve's streaming detokenizer holds back a last token that ends inside a UTF-8 character
                full = answer["choices"][0]["text"]
                assert _streamed_text(streamed) in (full, full.rstrip("\ufffd")), (streamed, full)
            status, payload = _post(port, {"model": qwen, "prompt": prompt(30), "max_tokens": 5000, "temperature": 0})
            if LAZY_SERVE:  # 5.24's serve answers the engine's ValueError with a bare 500 (the message is in its log)
                assert status == 500, (status, payload)
            else:
                assert status == 400 and "ACCELERATE_NEURON_SERVING_KV_CACHE_TOKENS" in payload, (status, payload)
            assert _graphs_by_frame(cache) == warmed  # answering compiled no graph

        # The official client, as a user's application calls the server.
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        text = prompt(12, 5)
        expected = cpu_tokens(reference, tok(text)["input_ids"], 6)
        answer = client.completions.create(model=qwen, prompt=text, max_tokens=6, temperature=0)
        assert answer.usage.completion_tokens == len(expected)
        assert answer.choices[0].text == tok.decode(expected, skip_special_tokens=True)
        assert _graphs_by_frame(cache) == warmed
    finally:
        os.killpg(server.pid, signal.SIGINT)  # Ctrl-C: to simulate, serve and its model's process
        try:
            report_line, output = server.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            report_line, output = server.communicate()
    assert "compiled a new graph after its warm-up" not in output, output[-4000:]
    assert not LAZY_SERVE or "ACCELERATE_NEURON_SERVING_KV_CACHE_TOKENS" in output, output[-4000:]

    report = json.loads(report_line)
    assert report["exit_code"] == server.returncode
    # serve's own process (no device work) and its model's process, whose record alone used the device
    assert report["processes_started"] >= (1 if LAZY_SERVE else 2), report["processes"]
    assert report["processes_using_device"] == 1, report["processes"]
    model_process = report["processes"][0]
    assert model_process["compiles"] == sum(warmed.values()) > 0  # every graph in the cold cache is its
    # the graphs it handed the compiler: compiled, or loaded from the cache (a shape another frame compiled)
    assert report["distinct_graphs"] == model_process["compiles"] + model_process["compile_cache_hits"]
    placement = report["placement"][0]
    assert placement["model"] == "Qwen3ForCausalLM" and list(placement["bytes"]) == ["core 0"], placement
