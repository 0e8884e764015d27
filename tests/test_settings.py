"""One registry for every ACCELERATE_NEURON_* setting: one parser per kind, one precedence, docs that cannot drift."""

from __future__ import annotations

import ast
import importlib
import itertools
import logging
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from accelerate_neuron import files, logs, plugins, settings, tiny
from accelerate_neuron.builtin import shapes as gshapes
from accelerate_neuron.builtin.generation import cache as gcache
from accelerate_neuron.builtin.generation import widths
from accelerate_neuron.builtin.serving import plan as serving_plan
from accelerate_neuron.builtin.training import shapes as tshapes
from accelerate_neuron.hookspecs import hookimpl
from helpers import REPO, run_python

PACKAGE = REPO / "src" / "accelerate_neuron"
BUCKET_SETTINGS = [s.name for s in settings.SETTINGS if s.parse in settings.BUCKET_PARSERS]


@pytest.fixture
def config_layer() -> Any:
    """Install a config-file layer for one test."""
    yield settings.use_config
    settings.use_config({}, "")


# ------------------------------------------------------------------ the registry and `env` (docs: tests/test_docs.py)


def test_every_setting_is_documented_and_named_alike() -> None:
    for item in settings.SETTINGS:
        assert item.env == "ACCELERATE_NEURON_" + item.name.upper()
        assert item.help and item.choices and item.section
        assert settings.setting(item.env) is item  # by variable name too
    with pytest.raises(KeyError, match="no accelerate-neuron setting named 'prompt_bucket'"):
        settings.setting("prompt_bucket")


def test_env_reports_each_setting_with_its_source(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate_neuron.cli import _checks, env

    monkeypatch.setenv("ACCELERATE_NEURON_TRAIN_BUCKETS", "128,512")
    monkeypatch.setenv("ACCELERATE_NEURON_PROMPT_BUCKETS", "64,32")
    monkeypatch.setenv("ACCELERATE_NEURON_PROMPT_BUCKET", "64")  # a typo: names no setting
    facts = env.collect(init=False)
    rows = {row["name"]: row for row in facts["accelerate_neuron_settings"]}
    assert list(rows) == [s.name for s in settings.SETTINGS]
    assert rows["train_buckets"]["value"] == (128, 512) and rows["train_buckets"]["source"] == "environment"
    assert rows["batch_buckets"]["source"] == "default" and rows["batch_buckets"]["error"] is None
    assert "ACCELERATE_NEURON_PROMPT_BUCKETS='64,32'" in rows["prompt_buckets"]["error"]
    problems = [p["problem"] for p in _checks.find_problems(facts)]
    assert any("ACCELERATE_NEURON_PROMPT_BUCKETS='64,32'" in p for p in problems)
    assert any(p.startswith("ACCELERATE_NEURON_PROMPT_BUCKET is set but names no") for p in problems)
    text = env.render(facts)
    assert "ACCELERATE_NEURON_TRAIN_BUCKETS" in text and "128,512 (environment)" in text


# ------------------------------------------------------------------ one parser, the same words everywhere


def _bucket_entry_points() -> dict[str, Any]:
    """Each bucket setting as the capability that reads it resolves it."""
    return {
        "prompt_buckets": lambda: gshapes.resolve_policy(256).prompt_buckets,
        "batch_buckets": lambda: gshapes.resolve_policy(256).batch_buckets,
        "cache_buckets": lambda: gcache.bucket_length(
            100, 256, settings.explicit("cache_buckets").value if settings.explicit("cache_buckets") else "pow2"
        ),
        "train_buckets": lambda: tshapes.resolve_policy(1024).buckets,
        "candidate_buckets": lambda: widths.candidate_buckets(),
        "serving_token_buckets": lambda: serving_plan.resolve(tiny.config("qwen3"), "cpu").token_buckets,
        "serving_kv_buckets": lambda: serving_plan.resolve(tiny.config("qwen3"), "cpu").kv_buckets,
    }


@pytest.mark.parametrize("name", BUCKET_SETTINGS)
@pytest.mark.parametrize("bad", ["512,128", "64,64", "0,64", "64,,128", "pow3", "-8", "1.5"])
def test_every_bucket_setting_rejects_the_same_values_the_same_way(
    name: str, bad: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    variable = settings.env_name(name)
    monkeypatch.setenv(variable, bad)
    with pytest.raises(ValueError) as info:
        _bucket_entry_points()[name]()
    message = str(info.value)
    assert message.startswith(
        f"invalid {variable}={bad!r}: expected 'pow2', 'pow2-half' (the powers of two and the points halfway between "
        "them), "
    ), message
    assert "'off', or strictly ascending positive integers" in message, message


@pytest.mark.parametrize("name", BUCKET_SETTINGS)
@pytest.mark.parametrize("off", ["off", "OFF", "0", "no", "none", "false"])
def test_every_bucket_setting_reads_off_alike(name: str, off: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(settings.env_name(name), off)
    value = _bucket_entry_points()[name]()
    assert value in ((), 100)  # no buckets; the cache length stays the request


@pytest.mark.parametrize("name", BUCKET_SETTINGS)
def test_every_bucket_setting_reads_lists_and_pow2_alike(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(settings.env_name(name), " 64, 192 ")
    value = _bucket_entry_points()[name]()
    assert value in ((64, 192), 192)
    monkeypatch.setenv(settings.env_name(name), "pow2")
    explicit = _bucket_entry_points()[name]()
    monkeypatch.delenv(settings.env_name(name))
    assert explicit == _bucket_entry_points()[name]()  # "pow2" is the default, spelled out


@pytest.mark.parametrize("name", BUCKET_SETTINGS)
def test_every_bucket_setting_reads_pow2_half_as_the_powers_of_two_and_their_halfway_points(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    powers = _bucket_entry_points()[name]()
    monkeypatch.setenv(settings.env_name(name), "Pow2-Half")
    halved = _bucket_entry_points()[name]()
    if name == "cache_buckets":  # an unbounded list: the entry point rounds 100 positions up
        assert (powers, halved) == (128, 128)  # 96 does not hold 100
        lengths = [gcache.bucket_length(n, 4096, "pow2-half") for n in (50, 64, 65, 97, 129, 3000)]
        assert lengths == [64, 64, 96, 128, 192, 3072]
        return
    assert halved == gshapes.Buckets(powers).halved() and len(halved) > len(powers)
    assert set(powers) <= set(halved) and halved[-1] == powers[-1]
    for low, high in itertools.pairwise(halved):  # two buckets an octave: steps of at most 1.5x
        assert 2 * high <= 3 * low or (low, high) == (1, 2), halved


def test_fit_is_refused_where_no_sizes_are_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_NEURON_CANDIDATE_BUCKETS", "fit")
    with pytest.raises(
        ValueError,
        match=r"invalid ACCELERATE_NEURON_CANDIDATE_BUCKETS='fit': expected 'pow2', .*"
        r"this setting's sizes are not recorded",
    ):
        widths.candidate_buckets()


def test_switches_and_counts_name_the_value() -> None:
    assert settings.parse("static_cache", "OFF") is False and settings.parse("static_cache", "yes") is True
    with pytest.raises(settings.SettingError, match=r"invalid ACCELERATE_NEURON_STATIC_CACHE='maybe': expected 1, on"):
        settings.parse("static_cache", "maybe")
    with pytest.raises(settings.SettingError, match=r"ACCELERATE_NEURON_RECOMPILE_WARMUP='-1': expected a number"):
        settings.parse("recompile_warmup", "-1")
    with pytest.raises(settings.SettingError, match=r"ACCELERATE_NEURON_SIM_HBM='lots': expected a positive size"):
        settings.parse("sim_hbm", "lots")
    assert settings.parse("precompile", "1/3") == (1, 3) and settings.parse("precompile", "off") is None
    with pytest.raises(settings.SettingError, match=r"ACCELERATE_NEURON_PRECOMPILE='3/3'"):
        settings.parse("precompile", "3/3")


# ------------------------------------------------------------------ one precedence


class _CacheLength:
    @hookimpl
    def neuron_static_cache_length(self, requested: int, max_position_embeddings: int | None) -> int:
        return 1000


def test_the_environment_beats_a_plugin_hook_for_the_cache_length(monkeypatch: pytest.MonkeyPatch) -> None:
    class Model:
        config = type("Config", (), {"max_position_embeddings": 4096})()

    with plugins.registered(_CacheLength(), "test-cache-length"):
        assert gcache.cache_length(Model(), 100) == 1000  # hook > default
        monkeypatch.setenv("ACCELERATE_NEURON_CACHE_BUCKETS", "256,512")
        assert gcache.cache_length(Model(), 100) == 256  # environment > hook (a plugin used to win here)
    monkeypatch.delenv("ACCELERATE_NEURON_CACHE_BUCKETS")
    assert gcache.cache_length(Model(), 100) == 128  # default: powers of two


class _Shapes:
    @hookimpl
    def neuron_generation_shape_policy(self, max_position_embeddings: int | None) -> dict[str, Any]:
        return {"prompt_buckets": [16, 48], "batch_buckets": [4]}

    @hookimpl
    def neuron_training_shape_policy(self, max_length: int | None) -> dict[str, Any]:
        return {"buckets": [96]}


def test_one_precedence_for_every_hooked_setting(monkeypatch: pytest.MonkeyPatch, config_layer: Any) -> None:
    with plugins.registered(_Shapes(), "test-shapes"):
        assert gshapes.resolve_policy(256) == gshapes.ShapePolicy((16, 48), (4,))  # hook > default
        assert tshapes.resolve_policy(512).buckets == (96,)
        config_layer({"prompt_buckets": [32, 64], "train_buckets": "off"}, "test.yaml")
        assert gshapes.resolve_policy(256) == gshapes.ShapePolicy((32, 64), (4,))  # config > hook
        policy = tshapes.resolve_policy(512)
        assert policy.buckets == () and policy.explicit and policy.source == "neuron_config in test.yaml"
        monkeypatch.setenv("ACCELERATE_NEURON_PROMPT_BUCKETS", "off")
        monkeypatch.setenv("ACCELERATE_NEURON_TRAIN_BUCKETS", "128")
        assert gshapes.resolve_policy(256) == gshapes.ShapePolicy((), (4,))  # environment > config
        assert tshapes.resolve_policy(512).buckets == (128,)
    value = settings.resolve("prompt_buckets")
    assert (value.value, value.source, value.explicit) == ((), "environment", True)


def test_a_plugin_cannot_set_what_a_user_could_not() -> None:
    class Broken:
        @hookimpl
        def neuron_training_shape_policy(self, max_length: int | None) -> dict[str, Any]:
            return {"buckets": [512, 128]}

    with plugins.registered(Broken(), "test-broken"), pytest.raises(ValueError, match="strictly ascending"):
        tshapes.resolve_policy(1024)


def test_the_config_layer_checks_keys_and_values(config_layer: Any) -> None:
    with pytest.raises(ValueError, match=r"unknown key 'prompt_bucket' in neuron_config \(f.yaml\) \(did you mean "):
        config_layer({"prompt_bucket": [64]}, "f.yaml")
    with pytest.raises(ValueError, match=r"'simulate' cannot be set in neuron_config .*ACCELERATE_NEURON_SIMULATE"):
        config_layer({"simulate": 2}, "f.yaml")
    with pytest.raises(settings.SettingError, match=r"invalid batch_buckets: \[4, 2\] \(neuron_config in f.yaml\)"):
        config_layer({"batch_buckets": [4, 2]}, "f.yaml")
    config_layer({"static_cache": False, "batch_buckets": [1, 8]}, "f.yaml")
    assert settings.get("static_cache") is False and settings.get("batch_buckets") == (1, 8)


# ------------------------------------------------------------------ capability code asks settings, never os.environ


def _env_reads(module: str, tree: ast.AST) -> list[tuple[int, str]]:
    """(line, variable) of every ``os.environ[...]`` / ``os.environ.get(...)`` / ``os.getenv(...)`` read whose
    key is a string or a module-level name (resolved in the imported module)."""
    namespace = vars(importlib.import_module(module))

    # Package modules a function imports locally (``from ..simulator import neff_cache``), by their last name.
    local = {name.rsplit(".", 1)[-1]: mod for name, mod in sys.modules.items() if name.startswith("accelerate_neuron.")}

    def key_of(node: ast.AST) -> str:
        try:
            value = eval(compile(ast.Expression(node), "<key>", "eval"), {**local, **namespace})
        except Exception:
            return ast.unparse(node)  # computed at run time (a loop variable): named as written
        return value if isinstance(value, str) else ast.unparse(node)

    def is_environ(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    reads = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
            reads.append((node.lineno, key_of(node.slice)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            func = node.func
            if (func.attr == "get" and is_environ(func.value)) or func.attr == "getenv":
                reads.append((node.lineno, key_of(node.args[0])))
    return reads


def test_only_the_settings_module_reads_accelerate_neuron_variables() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).with_suffix("")
        if relative.as_posix() in ("settings", "__main__") or relative.parts[0] == "simulator":
            continue  # the simulator may read its own; __main__ runs the command when imported
        module = ".".join(("accelerate_neuron", *relative.parts)).removesuffix(".__init__")
        for line, key in _env_reads(module, ast.parse(path.read_text())):
            if key.startswith(settings.PREFIX):
                offenders.append(f"{relative}.py:{line} reads {key}")
    assert not offenders, offenders


# ------------------------------------------------------------------ shared helpers


def test_said_once_until_forgotten(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("accelerate_neuron.test")
    with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
        assert logs.once(log, ("test.once", 1), "first %d", 1)
        assert not logs.once(log, ("test.once", 1), "first %d", 1)
        assert logs.once(log, ("test.once", 2), "second")
        logs.forget("test.once")
        assert logs.once(log, ("test.once", 1), "again")
    assert [r.getMessage() for r in caplog.records] == ["first 1", "second", "again"]


def test_log_level_setting_reaches_the_package_loggers() -> None:
    proc = run_python(
        """
        import logging, torch
        print(logging.getLogger("accelerate_neuron.builtin.generation.call").getEffectiveLevel())
        """,
        ACCELERATE_NEURON_SIMULATE="1",
        ACCELERATE_NEURON_LOG_LEVEL="debug",
    )
    assert proc.stdout.split()[-1] == str(logging.DEBUG)
    bad = run_python("import torch", ACCELERATE_NEURON_SIMULATE="1", ACCELERATE_NEURON_LOG_LEVEL="loud")
    assert "invalid ACCELERATE_NEURON_LOG_LEVEL='loud': expected 'debug'" in bad.stderr


def test_a_failed_write_leaves_the_old_file_and_no_debris(tmp_path: Path) -> None:
    target = files.write_atomically(tmp_path / "state.json", "old")
    with pytest.raises(RuntimeError), files.replacing(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed mid-write")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["state.json"]
    files.write_atomically(target, b"new")
    assert target.read_text() == "new"


def test_a_replaced_file_keeps_the_permissions_it_would_have_had(tmp_path: Path) -> None:
    import stat

    def mode(path: Path) -> int:
        return stat.S_IMODE(path.stat().st_mode)

    umask = os.umask(0o027)
    try:
        assert mode(files.write_atomically(tmp_path / "new.json", "{}")) == 0o640  # as open(path, "w") gives
        kept = tmp_path / "kept.pth"
        kept.write_bytes(b"old")
        kept.chmod(0o604)
        files.write_atomically(kept, b"new")
        assert mode(kept) == 0o604 and kept.read_bytes() == b"new"  # the replaced file's mode
    finally:
        os.umask(umask)
    assert mode(files.write_atomically(tmp_path / "chosen", "", mode=0o600)) == 0o600

    # Temporary names are unpredictable, and a planted link is never written through.
    names = {files.temporary_name(tmp_path / "x").name for _ in range(3)}
    assert len(names) == 3 and not any(str(os.getpid()) in name for name in names)
    victim = tmp_path / "victim"
    victim.write_text("intact")
    (tmp_path / "planted").symlink_to(victim)
    with pytest.raises(FileExistsError):
        files.create_new(tmp_path / "planted")
    assert victim.read_text() == "intact"


def test_sizes_are_parsed_exactly_and_refused_beyond_int64() -> None:
    from accelerate_neuron.sizes import parse_size

    MAX_SIZE = 2**63 - 1
    assert parse_size("9007199254740993") == 9007199254740993  # through a float: ...992
    assert parse_size("1.5GiB") == 3 * 2**29 and parse_size("0.1KB") == 100
    assert parse_size("8388607.999999999999TiB") == 8388607 * 2**40 + 2**40 - 2  # exact digits, then floored
    assert parse_size(str(MAX_SIZE)) == MAX_SIZE
    for beyond in (str(2**63), "8388608TiB", "9" * 5000 + "GiB", 2**63):
        with pytest.raises(ValueError, match=r"more than 9223372036854775807 bytes \(2\^63 - 1"):
            parse_size(beyond, what="simulated HBM per core")
    with pytest.raises(settings.SettingError, match=r"ACCELERATE_NEURON_SIM_HBM='8388608TiB'.*2\^63 - 1"):
        settings.parse("sim_hbm", "8388608TiB")


def test_a_simulated_memory_beyond_int64_is_refused_not_wrapped() -> None:
    """At 2^63 bytes the C++ runtime's int64 capacity wrapped to a negative size; now the value is refused."""
    from helpers import run_python

    proc = run_python(
        "import torch; print('memory', torch.neuron.get_device_properties(0).total_memory if hasattr(torch, 'neuron')"
        " and torch.neuron.is_available() else None)",
        ACCELERATE_NEURON_SIMULATE="1",
        ACCELERATE_NEURON_SIM_HBM="8388608TiB",
    )
    assert "memory None" in proc.stdout, proc.stdout
    assert "ACCELERATE_NEURON_SIM_HBM='8388608TiB'" in proc.stderr and "2^63 - 1" in proc.stderr


def test_core_lists_are_bounded_before_they_are_expanded() -> None:
    from accelerate_neuron import sizes
    from accelerate_neuron.sizes import parse_core_list

    with pytest.raises(ValueError, match=r"'0-5000000': core 5000000 is beyond the highest core id accepted \(4095\)"):
        parse_core_list("0-5000000")  # expanded first, this took 550 MB
    with pytest.raises(ValueError, match=r"NEURON_RT_VISIBLE_CORES='0-99999999999': core 99999999999 is beyond"):
        parse_core_list("0-99999999999")  # expanded first, this never returned
    with pytest.raises(ValueError, match=r"core 7 does not exist; this host has 4 Neuron core\(s\)"):
        parse_core_list("0-7", total=4)
    with pytest.raises(ValueError, match=r"is beyond the highest core id"):
        parse_core_list("0-" + "9" * 5000)
    assert parse_core_list(f"0-3,{sizes.MAX_CORE_ID}") == [0, 1, 2, 3, sizes.MAX_CORE_ID]
