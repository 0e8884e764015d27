"""``neuron_config:`` in Accelerate's config file: read by Accelerate's commands, checked, handed to every rank.

In-process tests drive the functions ``accelerate config`` / ``accelerate launch`` call; the ``slow`` test runs
``accelerate launch`` as a user would and reads what each rank resolved.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from accelerate_neuron import accelerate_config, patching, settings
from helpers import REPO, run_launcher, run_python

SCRIPTS = REPO / "tests" / "scripts"
BIN = Path(sys.executable).parent


def _config(tmp_path: Path, block: Any, name: str = "config.yaml", **extra: Any) -> Path:
    """What `accelerate config default` writes, plus ``neuron_config: block`` (YAML or JSON by the file name)."""
    from accelerate.commands.config import default

    path = tmp_path / name
    default.write_basic_config(save_location=str(path))  # JSON, whatever the name
    data = {**json.loads(path.read_text()), **extra}
    if block is not None:
        data["neuron_config"] = block
    path.write_text(json.dumps(data) if name.endswith(".json") else yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("name", ["config.yaml", "config.json"])
def test_accelerate_reads_the_block_keeps_it_and_writes_it_back(tmp_path: Path, name: str, unpatched: Any) -> None:
    from accelerate.commands.config import load_config_from_file

    block = {"prompt_buckets": [64, 256], "static_cache": False, "disable": ["warmup"]}
    path = _config(tmp_path, block, name)
    config = load_config_from_file(str(path))
    assert config.neuron_config == block and config.distributed_type == "MULTI_NEURON"
    again = tmp_path / f"again-{name}"
    (config.to_json_file if name.endswith(".json") else config.to_yaml_file)(str(again))  # `accelerate config update`
    assert accelerate_config.read(again) == block
    with unpatched(), pytest.raises(ValueError, match=r"had unknown keys \(\['neuron_config'\]\)"):
        load_config_from_file(str(path))  # stock Accelerate refuses the key


@pytest.mark.parametrize(
    ("block", "message"),
    [
        (
            {"prompt_bucket": [64]},
            r"unknown key 'prompt_bucket' in neuron_config \(.*config.yaml\) \(did you mean 'prompt_buckets'\?\); "
            r"known keys: disable, log_level, static_cache, cache_buckets, prompt_buckets",
        ),
        ({"batch_buckets": [4, 2]}, r"invalid batch_buckets: \[4, 2\] \(neuron_config in .*config.yaml\): expected "),
        ({"static_cache": "maybe"}, r"invalid static_cache: 'maybe' .*expected 1, on, true or yes; 0, off"),
        ({"simulate": 2}, r"'simulate' cannot be set in neuron_config .*: set ACCELERATE_NEURON_SIMULATE"),
        ([64, 256], r"neuron_config in .*config.yaml must be a mapping of setting names to values"),
    ],
)
def test_a_bad_key_or_value_is_an_error_naming_it_and_the_choices(tmp_path: Path, block: Any, message: str) -> None:
    from accelerate.commands import launch
    from accelerate.commands.config import load_config_from_file

    path = _config(tmp_path, block)
    with pytest.raises(ValueError, match=message):
        load_config_from_file(str(path))
    parser = launch.launch_command_parser()
    with pytest.raises(ValueError, match=message):  # accelerate launch stops before starting anything
        launch.launch_command(parser.parse_args(["--config_file", str(path), "train.py"]))


def test_launch_hands_the_block_to_the_processes_it_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate.commands import launch

    path = _config(tmp_path, {"prompt_buckets": [64, 256]})
    monkeypatch.setenv(accelerate_config.LAUNCH_ENV, '{"file": "outer.yaml", "neuron_config": {"static_cache": 0}}')
    started = []
    monkeypatch.setattr(
        launch, "multi_gpu_launcher", lambda args: started.append(dict(launch.prepare_multi_gpu_env(args)))
    )
    launch.launch_command(launch.launch_command_parser().parse_args(["--config_file", str(path), "train.py"]))
    handed = json.loads(started[0][accelerate_config.LAUNCH_ENV])
    assert handed == {"file": str(path), "neuron_config": {"prompt_buckets": [64, 256]}}  # the outer block is gone

    plain = _config(tmp_path, None, "plain.yaml")
    started.clear()
    launch.launch_command(launch.launch_command_parser().parse_args(["--config_file", str(plain), "train.py"]))
    assert accelerate_config.LAUNCH_ENV not in started[0]


def test_a_launched_process_installs_the_block_on_import_torch() -> None:
    handed = json.dumps({"file": "/etc/my.yaml", "neuron_config": {"prompt_buckets": [64, 256], "disable": "warmup"}})
    code = """
        import json, torch, accelerate_neuron
        from accelerate_neuron import settings
        value = settings.resolve("prompt_buckets")
        print(json.dumps([value.value, value.source, value.detail, settings.resolve("batch_buckets").value,
                          [p["name"] for p in accelerate_neuron.status().plugins if not p["active"]]]))
    """
    proc = run_python(
        code,
        ACCELERATE_NEURON_SIMULATE="1",
        ACCELERATE_NEURON_LAUNCH_CONFIG=handed,
        ACCELERATE_NEURON_BATCH_BUCKETS="1,2",
    )
    value, source, detail, batch, off = json.loads(proc.stdout.splitlines()[-1])
    assert (value, source, detail) == ([64, 256], "config", "neuron_config in /etc/my.yaml")
    assert batch == [1, 2]  # the environment beats the block
    assert off == ["warmup"]  # disable: read before the plugins load

    bad = run_python(
        "import torch; print('imported')",
        ACCELERATE_NEURON_SIMULATE="1",
        ACCELERATE_NEURON_LAUNCH_CONFIG='{"file": "x.yaml", "neuron_config": {"prompt_bucket": 1}}',
    )
    assert bad.stdout.strip().endswith("imported")  # import torch never fails on it
    assert "neuron_config handed over by accelerate launch is ignored" in bad.stderr
    assert "unknown key 'prompt_bucket'" in bad.stderr


def test_env_shows_each_setting_and_where_it_came_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate_neuron.cli import env

    path = _config(tmp_path, {"prompt_buckets": [64, 256], "train_buckets": "off"})
    monkeypatch.setenv("ACCELERATE_NEURON_TRAIN_BUCKETS", "128")
    facts = env.collect(init=False, config_file=str(path))
    rows = {row["name"]: row for row in facts["accelerate_neuron_settings"]}
    assert rows["prompt_buckets"]["value"] == (64, 256)
    assert rows["prompt_buckets"]["source"] == f"neuron_config in {path}"
    assert rows["train_buckets"]["source"] == "environment"  # the environment beats the file
    assert rows["batch_buckets"]["source"] == "default"
    assert settings.config_origin() == ""  # env read the file; this process's settings are untouched
    text = env.render(facts)
    assert f"64,256 (neuron_config in {path})" in text and f"{path} (neuron_config: 2 setting(s);" in text

    broken = _config(tmp_path, {"prompt_buckets": "sometimes"}, "broken.yaml")
    problems = env.collect(init=False, config_file=str(broken))["problems"]
    assert any(p["severity"] == "error" and "invalid prompt_buckets: 'sometimes'" in p["problem"] for p in problems)


def test_the_questionnaire_asks_for_the_block_and_re_asks_a_bad_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from accelerate.commands.config import config as config_cli
    from accelerate.commands.menu import BulletMenu

    monkeypatch.setattr(BulletMenu, "run", lambda self, default_choice=0: default_choice)
    answers = iter(["yes", "", "64,32", "64,256", "off", "", "", "warmup"])
    asked = []

    def answer(prompt: str = "") -> str:
        asked.append(prompt)
        if "accelerate-neuron settings" in prompt or any(
            n in prompt for n in ("static_cache (", "_buckets (", "disable (")
        ):
            return next(answers)
        return ""

    monkeypatch.setattr("builtins.input", answer)
    path = tmp_path / "answers.yaml"
    config_cli.config_command(argparse.Namespace(config_file=str(path)))
    assert accelerate_config.read(path) == {"prompt_buckets": [64, 256], "batch_buckets": "off", "disable": ["warmup"]}
    assert sum("prompt_buckets (" in p for p in asked) == 2  # "64,32" was refused and asked again


def test_config_default_keeps_the_settings_of_its_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate.commands.config import default

    monkeypatch.setenv("ACCELERATE_NEURON_PROMPT_BUCKETS", "64,256")
    monkeypatch.setenv("ACCELERATE_NEURON_STATIC_CACHE", "off")
    monkeypatch.setenv("ACCELERATE_NEURON_SIMULATE", "2")  # the device, not a neuron_config setting
    path = tmp_path / "default_config.yaml"
    default.write_basic_config(save_location=str(path))
    assert json.loads(path.read_text())["neuron_config"] == {"prompt_buckets": [64, 256], "static_cache": False}


def test_the_patches_are_recorded() -> None:
    keys = {r.key: r.status for r in patching.records()}
    for target in ("BaseConfig.process_config", "BaseConfig.from_yaml_file", "BaseConfig.from_json_file"):
        assert keys.get(f"accelerate.commands.config.config_args.{target}") == "applied"


@pytest.mark.slow
def test_accelerate_launch_hands_neuron_config_to_every_rank(tmp_path: Path) -> None:
    """`accelerate launch --config_file F` with 2 processes: each rank resolves the file's block, names the file
    as the source, skips the plugin the block disables, and still lets the environment win."""
    block = {"prompt_buckets": [64, 256], "batch_buckets": [4], "disable": ["warmup"]}
    path = _config(tmp_path, block)
    out = tmp_path / "out"
    cmd = [str(BIN / "accelerate"), "launch", "--config_file", str(path), "--main_process_port", "0"]
    run_launcher([*cmd, str(SCRIPTS / "report_settings.py"), str(out)], cores=2, ACCELERATE_NEURON_BATCH_BUCKETS="1,2")
    reports = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == [0, 1]
    for report in reports:
        rows = report["settings"]
        assert rows["prompt_buckets"] == {"value": [64, 256], "source": "config", "detail": f"neuron_config in {path}"}
        assert rows["batch_buckets"]["source"] == "environment" and report["batch_buckets"] == [1, 2]
        assert report["prompt_buckets"] == [64, 256]  # what generate() pads to
        assert rows["disable"]["value"] == {"all": False, "names": ["warmup"]}
        assert "warmup" not in report["plugins_on"] and "generation" in report["plugins_on"]
