"""The simulated NEFF cache: compile once, across processes, runs and ranks; damaged entries recompiled.

In-process tests drive the ``"neuron"`` backend and the store directly (each on the cold
cache ``conftest`` gives every test); the ``slow`` tests run scripts twice in fresh
processes, under ``accelerate-neuron simulate``, ``torchrun`` and ``demo``, as a user would.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import filelock
import pytest
import torch

from accelerate_neuron import simulator
from accelerate_neuron.cli import _checks, demo, env
from accelerate_neuron.cli._common import duration
from accelerate_neuron.simulator import neff_cache
from helpers import REPO, clean_env, last_json, run_python

SCRIPT = Path(sys.executable).with_name("accelerate-neuron")
KEY = "0123abcd" * 4


def cli(*args: str, **env_vars: str) -> subprocess.CompletedProcess:
    command = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "accelerate_neuron"]
    return subprocess.run(
        [*command, *args], env=clean_env(**env_vars), capture_output=True, text=True, timeout=900, cwd=str(REPO)
    )


def entries(root: Path) -> list[Path]:
    return sorted(root.glob("??/??/*.neff"))


def compile_step(scale: float = 2.0, **options: object):
    """A small compiled function, as Dynamo hands it to the neuron backend."""
    return torch.compile(lambda x: torch.relu(x @ x.T) * scale, backend="neuron", dynamic=False, **options)


def as_new_process(root: Path) -> None:
    """A fresh view of ``root``: nothing in memory, as a new process would start (Dynamo too)."""
    neff_cache.use(root)
    torch._dynamo.reset()


# ------------------------------------------------------------------ the store


def test_entries_are_sharded_checksummed_and_found_by_a_later_process(tmp_path: Path) -> None:
    calls = []
    first = neff_cache.NeffCache(tmp_path)
    lookup = first.get_or_compile(KEY, lambda: calls.append(1) or {"what": "graph", "kind": "inference"})
    assert (lookup.status, lookup.source, calls) == ("miss", "compiled", [1])
    path = tmp_path / KEY[:2] / KEY[2:4] / f"{KEY}.neff"
    assert entries(tmp_path) == [path] and (tmp_path / neff_cache.MARKER).is_file()
    assert neff_cache.decode(KEY, path.read_bytes())["kind"] == "inference"
    assert first.get_or_compile(KEY, lambda: calls.append(2) or {}).source == "memory"

    later = neff_cache.NeffCache(tmp_path)
    assert later.contains(KEY) and not later.contains("f" * 32)
    assert later.get_or_compile(KEY, lambda: calls.append(3) or {}) == neff_cache.Lookup(KEY, "hit", "disk")
    assert calls == [1]  # a hit compiles nothing
    assert later.describe(usage=True) == {
        "enabled": True,
        "dir": str(tmp_path),
        "reason": None,
        "entries": 1,
        "bytes": path.stat().st_size,
    }


def _flip_a_byte(data: bytes) -> bytes:
    return data[:-3] + bytes([data[-3] ^ 0x20]) + data[-2:]


def _entry_of_another_key(data: bytes) -> bytes:
    return neff_cache.encode("f" * 32, {"what": "graph"})


DAMAGE = {
    "flipped byte": _flip_a_byte,
    "truncated (partial write)": lambda data: data[: len(data) // 2],
    "empty": lambda data: b"",
    "another key's entry": _entry_of_another_key,
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_entry_is_recompiled_with_a_warning(
    sim: object, tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    x = torch.randn(4, 4, device="neuron")
    as_new_process(tmp_path)
    compile_step()(x)
    (path,) = entries(tmp_path)
    key = simulator.stats()["graphs"][0]["cache_key"]
    assert path.name == f"{key}.neff"
    path.write_bytes(DAMAGE[damage](path.read_bytes()))

    as_new_process(tmp_path)
    simulator.reset_stats()
    with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
        out = compile_step()(x)
    st = simulator.stats()
    assert (st["compiles"], st["compile_cache_hits"], st["graphs"][0]["cache"]) == (1, 0, "miss")
    assert torch.allclose(out.cpu(), torch.relu(x.cpu() @ x.cpu().T) * 2)  # the run is not disturbed
    (warning,) = [r.getMessage() for r in caplog.records if "damaged NEFF cache entry" in r.getMessage()]
    assert str(path) in warning and "compiled again" in warning
    assert neff_cache.decode(key, path.read_bytes())["what"] == "graph"  # rewritten whole

    as_new_process(tmp_path)
    simulator.reset_stats()
    compile_step()(x)
    assert (simulator.stats()["compiles"], simulator.stats()["compile_cache_hits"]) == (0, 1)


def test_keys_follow_what_the_compiler_sees(sim: object) -> None:
    """Same code for another module of the same shapes: one NEFF. Shape, dtype, stride, constants, options: new."""
    first, second = torch.nn.Linear(8, 8).to("neuron"), torch.nn.Linear(8, 8).to("neuron")
    x = torch.randn(2, 8, device="neuron")
    torch.compile(first, backend="neuron", dynamic=False)(x)
    torch._dynamo.reset()  # Dynamo forgets; the cache does not
    torch.compile(second, backend="neuron", dynamic=False)(x)
    st = simulator.stats()
    assert [g["cache"] for g in st["graphs"]] == ["miss", "hit"]  # weights are graph inputs, not constants
    assert st["graphs"][0]["cache_key"] == st["graphs"][1]["cache_key"]
    assert (st["compiles"], st["compile_cache_hits"]) == (1, 1)

    simulator.reset_stats()
    base = torch.randn(6, 6, device="neuron")
    variants = [
        (compile_step(), base),
        (compile_step(), torch.randn(5, 6, device="neuron")),  # shape
        (compile_step(), base.to(torch.bfloat16)),  # dtype
        (compile_step(), base.T),  # strides
        (compile_step(scale=3.0), base),  # a constant of the graph
        (compile_step(options={"neuron_flag": 1}), base),  # backend options
    ]
    for step, value in variants:
        torch._dynamo.reset()
        step(value)
    keys = [g["cache_key"] for g in simulator.stats()["graphs"]]
    assert len(keys) == len(variants) and len(set(keys)) == len(variants)
    assert all(len(k) == 32 and int(k, 16) >= 0 for k in keys)


def test_disable_cache_keeps_the_memory_tier_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(neff_cache.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(neff_cache.DISABLE_ENV, "1")
    cache = neff_cache.from_environment()
    assert cache.describe() == {"enabled": False, "dir": None, "reason": "TORCH_NEURONX_NEFF_DISABLE_CACHE=1"}
    assert cache.get_or_compile(KEY, dict).status == "miss"
    assert cache.get_or_compile(KEY, dict).status == "hit"  # one process never compiles a graph twice
    assert list(tmp_path.iterdir()) == []


def test_bad_settings_are_named_with_what_is_allowed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(neff_cache.DISABLE_ENV, "maybe")
    monkeypatch.setenv(neff_cache.LOCK_TIMEOUT_ENV, "soon")
    with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
        cache = neff_cache.from_environment()
    text = caplog.text
    assert "invalid TORCH_NEURONX_NEFF_DISABLE_CACHE='maybe': expected 1/true/yes" in text
    assert "invalid TORCH_NEURONX_NEFF_CACHE_LOCK_TIMEOUT='soon': expected a positive number of seconds" in text
    assert cache.root is not None and cache.lock_timeout == neff_cache.DEFAULT_LOCK_TIMEOUT
    facts = {"compile_cache": env._cache("simulated")}
    problems = [p["problem"] for p in _checks.compile_cache(facts)]
    assert len(problems) == 2 and any("'maybe'" in p for p in problems) and any("'soon'" in p for p in problems)


def test_a_folder_that_may_be_a_real_neff_cache_is_never_written(
    sim: object, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    real = tmp_path / "neff_cache"
    (real / "ab" / "cd").mkdir(parents=True)
    (real / "ab" / "cd" / ("ab" * 16 + ".neff")).write_bytes(b"a real NEFF")
    before = sorted(p.relative_to(real) for p in real.rglob("*"))
    as_new_process(real)
    with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
        compile_step()(torch.randn(3, 3, device="neuron"))
        compile_step()(torch.randn(4, 3, device="neuron"))
    assert sorted(p.relative_to(real) for p in real.rglob("*")) == before
    (warning,) = [r.getMessage() for r in caplog.records if "may be a real torch-neuronx" in r.getMessage()]
    assert str(real) in warning and neff_cache.CACHE_DIR_ENV in warning  # once, with the fix
    st = simulator.stats()
    assert st["compiles"] == 2 and st["compile_cache"]["enabled"] is False


def test_a_cache_that_cannot_be_written_costs_the_entries_not_the_run(
    sim: object, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    x = torch.randn(4, 4, device="neuron")
    as_new_process(tmp_path)
    assert neff_cache.current().persistent
    # Where the graph's shard folders and the locks should go there are files: nothing can be created.
    for name in ("locks", *(f"{i:02x}" for i in range(256))):
        (tmp_path / name).write_text("in the way")
    with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
        out = compile_step()(x)
    assert torch.allclose(out.cpu(), torch.relu(x.cpu() @ x.cpu().T) * 2)
    assert simulator.stats()["compiles"] == 1 and entries(tmp_path) == []
    assert "cannot take the NEFF cache lock" in caplog.text and "cannot write to the NEFF cache" in caplog.text

    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    as_new_process(not_a_folder)
    with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
        compile_step()(x)
    assert simulator.stats()["compile_cache"]["enabled"] is False and "the simulated NEFF cache is off" in caplog.text


def test_a_held_lock_is_waited_for_then_reported(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = neff_cache.NeffCache(tmp_path, lock_timeout=0.2)
    assert cache.persistent
    holder = filelock.FileLock(str(tmp_path / "locks" / f"{KEY}.lock"))
    with holder, caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
        lookup = cache.get_or_compile(KEY, lambda: {"what": "graph"})
    assert lookup.status == "miss"
    assert "waited 0.2 s for the NEFF cache lock" in caplog.text and neff_cache.LOCK_TIMEOUT_ENV in caplog.text
    assert neff_cache.NeffCache(tmp_path).contains(KEY)  # the entry was still written, atomically


# ------------------------------------------------------------------ a shared host

OTHER_UID = 65534  # "nobody": another user (root, these tests' user, can make files of theirs)


def _planted_cache(root: Path, *, owner: int | None = None, mode: int | None = None) -> Path:
    """A cache folder holding a valid-looking marker and an entry for KEY that another user wrote."""
    entry = root / KEY[:2] / KEY[2:4] / f"{KEY}.neff"
    entry.parent.mkdir(parents=True)
    (root / neff_cache.MARKER).write_text("planted\n")
    entry.write_bytes(neff_cache.encode(KEY, {"what": "graph", "planted": True}))
    for path in (entry, root / neff_cache.MARKER):
        os.chown(path, OTHER_UID, OTHER_UID)
    if owner is not None:
        for path in (root, *root.rglob("*")):
            os.chown(path, owner, owner)
    if mode is not None:
        root.chmod(mode)
    return entry


@pytest.mark.parametrize(
    ("case", "owner", "mode", "why"),
    [
        ("folder of another user", OTHER_UID, None, "is owned by nobody (uid 65534), not by you"),
        ("world-writable folder", None, 0o777, "is writable by group and others (mode 0777)"),
        ("marker of another user", None, None, "is owned by nobody (uid 65534), not by you"),
    ],
)
def test_a_cache_another_user_can_plant_into_is_refused(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    case: str,
    owner: int | None,
    mode: int | None,
    why: str,
) -> None:
    root = tmp_path / "neff"
    _planted_cache(root, owner=owner, mode=mode)
    with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
        cache = neff_cache.NeffCache(root)
        assert not cache.contains(KEY)  # their entry is no hit
        assert cache.get_or_compile(KEY, lambda: {"what": "graph"}).status == "miss"
    assert cache.describe()["enabled"] is False
    (warning,) = [r.getMessage() for r in caplog.records if "the simulated NEFF cache is off" in r.getMessage()]
    named = root / neff_cache.MARKER if case == "marker of another user" else root
    assert f"{named} {why}" in warning and "ACCELERATE_NEURON_SHARED_CACHE_DIRS" in warning
    assert sorted(p.name for p in root.rglob("*")) == sorted([neff_cache.MARKER, KEY[:2], KEY[2:4], f"{KEY}.neff"])

    monkeypatch.setenv("ACCELERATE_NEURON_SHARED_CACHE_DIRS", str(root))  # shared on purpose: theirs is read
    shared = neff_cache.NeffCache(root)
    assert shared.contains(KEY) and shared.describe()["enabled"] is True


def test_entries_that_are_not_this_users_regular_files_are_refused_never_waited_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import threading

    cache = neff_cache.NeffCache(tmp_path / "neff")
    keys = {name: f"{i:02x}" * 16 for i, name in enumerate(("fifo", "link", "huge", "theirs"))}
    for key in keys.values():
        cache.store(key, {"what": "graph"})
    paths = {name: cache.entry_path(key) for name, key in keys.items()}
    paths["fifo"].unlink()
    os.mkfifo(paths["fifo"])  # read_bytes() on it waited for a writer forever
    paths["link"].unlink()
    paths["link"].symlink_to(paths["huge"])
    with open(paths["huge"], "r+b") as f:
        f.truncate(2**20 + 1)  # sparse: nothing is written; entries are capped at 1 MiB
    os.chown(paths["theirs"], OTHER_UID, OTHER_UID)

    found: dict[str, bool] = {}
    later = neff_cache.NeffCache(tmp_path / "neff")
    reader = threading.Thread(target=lambda: found.update({n: later.contains(k) for n, k in keys.items()}), daemon=True)
    with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
        reader.start()
        reader.join(timeout=60)
    try:
        assert not reader.is_alive(), "reading a FIFO planted as an entry hung"
    finally:
        if reader.is_alive():  # let the stuck reader go: a writer opens the FIFO and closes it
            os.close(os.open(paths["fifo"], os.O_WRONLY | os.O_NONBLOCK))
    assert found == dict.fromkeys(keys, False)
    (warning,) = [r.getMessage() for r in caplog.records if "refused NEFF cache entry" in r.getMessage()]
    assert "is not a regular file" in warning  # said once per cache, for the first refused entry

    for name in ("link", "huge", "theirs"):
        logs_before = len(caplog.records)
        with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
            assert neff_cache.NeffCache(tmp_path / "neff").load(keys[name]) is None
        message = " ".join(r.getMessage() for r in caplog.records[logs_before:])
        assert {"link": "is a symbolic link", "huge": "more than the 1048576 allowed", "theirs": "nobody"}[
            name
        ] in message

    assert later.get_or_compile(keys["theirs"], lambda: {"what": "graph"}).status == "miss"  # compiled again
    assert paths["theirs"].stat().st_uid == os.geteuid()  # and rewritten as this user's
    assert stat.S_IMODE((tmp_path / "neff").stat().st_mode) == 0o700  # the folders it creates are private
    assert stat.S_IMODE(cache.entry_path(keys["fifo"]).parent.stat().st_mode) == 0o700


def test_a_link_planted_as_a_lock_is_not_followed_and_the_floor_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """filelock before 3.20.1 opened a planted symbolic link and truncated its target (CVE-2025-68146; a related
    fix in 3.20.3): the declared floor excludes those releases, and the installed one refuses the link."""
    import importlib.metadata
    import tomllib

    from packaging.requirements import Requirement

    requirements = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (floor,) = [Requirement(r).specifier for r in requirements if Requirement(r).name == "filelock"]
    assert not floor.contains("3.20.2") and floor.contains("3.20.3")
    assert floor.contains(importlib.metadata.version("filelock"))

    cache = neff_cache.NeffCache(tmp_path / "neff")
    assert cache.persistent
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "neff" / "locks").mkdir()
    (tmp_path / "neff" / "locks" / f"{KEY}.lock").symlink_to(victim)
    with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
        assert cache.get_or_compile(KEY, lambda: {"what": "graph"}).status == "miss"
    assert victim.read_text() == "precious" and "cannot take the NEFF cache lock" in caplog.text
    assert neff_cache.NeffCache(tmp_path / "neff").contains(KEY)  # compiled without the lock, entry kept


RACER = """
    import json, logging, sys
    from pathlib import Path
    from accelerate_neuron.simulator import neff_cache

    root, rounds = Path(sys.argv[1]), int(sys.argv[2])
    damaged = []
    handler = logging.Handler()
    handler.emit = lambda record: damaged.append(record.getMessage())
    logging.getLogger("accelerate_neuron").addHandler(handler)
    keys = [f"{i:02x}" * 16 for i in range(8)]
    misses = 0
    for _ in range(rounds):
        cache = neff_cache.NeffCache(root)  # nothing in memory: every round asks the disk (and the lock)
        for key in keys:
            misses += cache.get_or_compile(key, lambda: {"what": "graph", "pad": "x" * 4096}).status == "miss"
            cache.store(key, {"what": "graph", "pad": "y" * 4096})  # rewrite it under the others' feet
            assert cache.load(key) is not None
    print(json.dumps({"misses": misses, "damaged": damaged}))
"""


@pytest.mark.slow
@pytest.mark.one_pair
def test_concurrent_writers_never_leave_a_damaged_entry(tmp_path: Path) -> None:
    script = tmp_path / "race.py"
    script.write_text(textwrap.dedent(RACER))
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "cache"), "25"],
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        results.append(last_json(out))
    assert sum(r["misses"] for r in results) == 8  # each key compiled once across 4 racing processes
    assert [r["damaged"] for r in results] == [[]] * 4  # no reader ever saw a partial entry
    found = entries(tmp_path / "cache")
    assert len(found) == 8 and not list((tmp_path / "cache").rglob(".*.tmp"))
    for path in found:
        neff_cache.decode(path.stem, path.read_bytes())


# ------------------------------------------------------------------ as a user runs it

GENERATE = """
    import json, sys
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from accelerate_neuron import simulator

    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], device_map="auto")
    for prompt in ["hello", "the neuron core runs"]:
        inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
        model.generate(**inputs, max_new_tokens=4, do_sample=False)
    print(json.dumps({"keys": [g["cache_key"] for g in simulator.stats()["graphs"]]}))
"""


@pytest.mark.slow
@pytest.mark.one_pair
def test_the_same_script_run_twice_compiles_nothing_the_second_time(tmp_path: Path) -> None:
    from accelerate_neuron import tiny

    model_dir = tiny.save_pretrained(tmp_path / "tiny-qwen3", "qwen3")
    script = tmp_path / "generate.py"
    script.write_text(textwrap.dedent(GENERATE))
    cache = tmp_path / "neff"
    runs = []
    for _ in range(2):
        proc = cli(
            "simulate", "--json", "--", "python", str(script), str(model_dir), TORCH_NEURONX_NEFF_CACHE_DIR=str(cache)
        )
        assert proc.returncode == 0, proc.stderr
        runs.append((json.loads(proc.stdout), last_json(proc.stderr)["keys"]))
    (cold, cold_keys), (warm, warm_keys) = runs

    assert cold["compiles"] >= 1 and cold["compile_cache_hits"] == 0
    assert cold["eager"]["compiles"] == cold["eager"]["distinct_signatures"] > 0
    assert cold["estimate"]["saved_seconds"] == 0 and cold["estimate"]["cold_seconds"] == cold["estimate"]["seconds"]
    assert len(entries(cache)) == cold["compiles"] + cold["eager"]["compiles"]

    assert warm_keys == cold_keys  # the key is stable across processes (no salted hash())
    assert warm["compiles"] == 0 and warm["compile_cache_hits"] == cold["compiles"]
    assert warm["eager"]["compiles"] == 0
    assert warm["eager"]["cache_hits"] == warm["eager"]["distinct_signatures"] == cold["eager"]["distinct_signatures"]
    assert warm["estimate"]["seconds"] == 0
    assert warm["estimate"]["saved_seconds"] == warm["estimate"]["cold_seconds"] == cold["estimate"]["seconds"]
    assert warm["compile_cache"] == {"enabled": True, "dir": str(cache), "reason": None}


TWO_RANKS = """
    import json
    import torch, torch.distributed as dist
    from accelerate_neuron import simulator

    dist.init_process_group(backend="neuron")
    x = torch.ones(4, 4, device="neuron")
    dist.barrier()  # both ranks reach the compiler together
    step = torch.compile(lambda t: torch.relu(t @ t.T) + 1, backend="neuron", dynamic=False)
    step(x)
    dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.one_pair
def test_two_ranks_compiling_one_graph_pay_one_compile(tmp_path: Path) -> None:
    script = tmp_path / "two_ranks.py"
    script.write_text(textwrap.dedent(TWO_RANKS))
    command = ["torchrun", "--standalone", "--nproc-per-node", "2", str(script)]
    proc = cli("simulate", "--json", "--cores", "2", "--compile-seconds", "60", "--eager-seconds", "0", "--", *command)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["processes_using_device"] == 2
    assert (report["compiles"], report["compile_cache_hits"]) == (1, 1)
    (graph,) = report["graphs"]
    assert (graph["processes"], graph["cache_hits"]) == (2, 1)
    assert sorted(p["compiles"] for p in report["processes"]) == [0, 1]
    # The rank that found the graph being compiled waited for it: the job still pays one compile.
    assert report["estimate"]["seconds"] == report["estimate"]["cold_seconds"] == 60
    assert report["estimate"]["saved_seconds"] == 0


@pytest.mark.slow
@pytest.mark.one_pair
def test_disabling_the_cache_compiles_every_run(tmp_path: Path) -> None:
    code = """
        import json, torch
        from accelerate_neuron import simulator
        torch.compile(lambda t: t * 2 + 1, backend="neuron", dynamic=False)(torch.ones(3, device="neuron"))
        st = simulator.stats()
        print(json.dumps({k: st[k] for k in ("compiles", "compile_cache_hits", "eager_cache_hits", "compile_cache")}))
    """
    cache = tmp_path / "neff"
    settings = {"ACCELERATE_NEURON_SIMULATE": "1", "TORCH_NEURONX_NEFF_CACHE_DIR": str(cache)}
    off = [last_json(run_python(code, TORCH_NEURONX_NEFF_DISABLE_CACHE="1", **settings).stdout) for _ in range(2)]
    assert [(r["compiles"], r["compile_cache_hits"], r["eager_cache_hits"]) for r in off] == [(1, 0, 0)] * 2
    assert off[0]["compile_cache"]["enabled"] is False and not cache.exists()
    on = [last_json(run_python(code, **settings).stdout) for _ in range(2)]
    assert [(r["compiles"], r["compile_cache_hits"]) for r in on] == [(1, 0), (0, 1)]


@pytest.mark.slow
@pytest.mark.one_pair
def test_demo_warm_start_and_env_show_the_cache(tmp_path: Path) -> None:
    cache = tmp_path / "neff"
    runs = []
    for _ in range(2):
        proc = cli("demo", "--json", "--max-new-tokens", "4", TORCH_NEURONX_NEFF_CACHE_DIR=str(cache))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        runs.append(last_json(proc.stdout))
    cold, warm = (r["first_generate"] for r in runs)
    assert cold["compiles"] >= 1 and cold["compile_cache_hits"] == 0 and cold["eager_cache_hits"] == 0
    assert (warm["compiles"], warm["compile_cache_hits"]) == (0, cold["compiles"])
    assert warm["eager_compiles"] == 0 and warm["eager_cache_hits"] == warm["eager_signatures"] > 0
    assert runs[1]["estimate"]["seconds"] == 0
    assert runs[1]["estimate"]["saved_seconds"] == runs[0]["estimate"]["seconds"] > 0

    text = demo._render(runs[1])
    assert f"the NEFF cache saved ~{duration(runs[0]['estimate']['seconds'])}" in text
    assert f"simulated NEFF cache in {cache}" in text

    count = len(entries(cache))
    shown = cli("env", "--no-init", ACCELERATE_NEURON_SIMULATE="2", TORCH_NEURONX_NEFF_CACHE_DIR=str(cache))
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert f"{cache} (simulated: {count} entries, " in shown.stdout
    real = cli("env", "--json", "--no-init", TORCH_NEURONX_NEFF_CACHE_DIR=str(tmp_path / "absent"))
    facts = last_json(real.stdout)["compile_cache"]["neff_cache"]
    assert facts["dir"] == str(tmp_path / "absent") and facts["simulated"] is False and facts["exists"] is False
