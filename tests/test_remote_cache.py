"""The remote compile cache: a fleet compiles once (file://, s3:// through moto's S3 server), keys that mean one graph,
damaged, partial and concurrent publishes, a remote that is down, and ``accelerate-neuron cache``.

"Two hosts" are two processes with separate local NEFF caches and one remote. The S3 tests run moto's standalone
server (``moto[server]``) on 127.0.0.1 and reach it through s3fs with the standard AWS variables, as a host would
reach S3. ``hf://`` cannot reach the Hub here: only its URL parsing and the missing-package error are tested.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from accelerate_neuron import settings, simulator, tiny
from accelerate_neuron.compile_cache import keys, tier, urls
from accelerate_neuron.compile_cache.remote import CorruptEntry, Remote, RemoteError
from accelerate_neuron.simulator import neff_cache
from helpers import REPO, clean_env, free_port, last_json

SCRIPT = REPO / "tests" / "scripts" / "fleet_generate.py"
CLI = Path(sys.executable).with_name("accelerate-neuron")
KEY = "0123abcd" * 4


def cli(*args: str, **env: str | None) -> subprocess.CompletedProcess:
    command = [str(CLI)] if CLI.exists() else [sys.executable, "-m", "accelerate_neuron"]
    return subprocess.run(
        [*command, *args], env=clean_env(**env), capture_output=True, text=True, timeout=600, cwd=str(REPO)
    )


def host(model: str, local: Path, remote: str, **env: str | None) -> tuple[dict, str]:
    """One host of the fleet: the generation script in a fresh process, its own local cache, the shared remote."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), model],
        env=clean_env(
            ACCELERATE_NEURON_SIMULATE="1",
            TORCH_NEURONX_NEFF_CACHE_DIR=str(local),
            ACCELERATE_NEURON_REMOTE_CACHE=remote,
            **env,
        ),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(REPO),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return last_json(proc.stdout), proc.stderr


def shared_folder(path: Path) -> Path:
    path.mkdir(mode=0o755)
    path.chmod(0o755)  # whatever the umask: a folder every user may write is refused
    return path


def entries(root: Path) -> list[Path]:
    return sorted(root.glob("??/??/*.neff"))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tiny.save_pretrained(tmp_path_factory.mktemp("model") / "tiny-qwen3", "qwen3"))


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, str]]:
    """moto's standalone S3 server on 127.0.0.1, a bucket in it, and the AWS variables a host would have."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = {
        "AWS_ACCESS_KEY_ID": "fleet-test-key",
        "AWS_SECRET_ACCESS_KEY": "fleet-test-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}",
    }
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "moto's S3 server did not start"
                time.sleep(0.2)
        import s3fs

        fs = s3fs.S3FileSystem(
            key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"], endpoint_url=env["AWS_ENDPOINT_URL_S3"]
        )
        fs.mkdir("fleet")
        yield env
    finally:
        server.terminate()
        server.wait(timeout=30)


# ------------------------------------------------------------------ URLs, settings, key inputs (in process)


@pytest.mark.one_pair
def test_urls_are_checked_and_never_show_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    assert urls.parse("/fsx/neff").path == "/fsx/neff" and urls.parse("file:///fsx/neff/").path == "/fsx/neff"
    assert urls.parse("s3://bucket/a/b").path == "bucket/a/b"
    assert urls.parse("hf://datasets/org/repo/neff").path == "datasets/org/repo/neff"
    assert urls.parse("hf://org/repo").path == "org/repo"
    for bad, says in [
        ("gs://bucket/x", "scheme 'gs://'"),
        ("file://otherhost/x", "not a host name"),
        ("file:///", "absolute folder other than /"),
        ("s3://", "valid bucket name"),
        ("hf://datasets/org", "hf://datasets/ORG/REPO"),
        ("s3://bucket/../x", "'..'"),
    ]:
        with pytest.raises(urls.RemoteURLError, match=says) as err:
            urls.parse(bad)
        assert repr(bad) in str(err.value)  # names the URL

    secret = urls.parse("s3://AKIAXXXX:topsecret@bucket/x")
    assert "topsecret" not in str(secret) and "topsecret" not in repr(secret) and "***@bucket" in str(secret)
    monkeypatch.setenv("ACCELERATE_NEURON_REMOTE_CACHE", "ftp://user:topsecret@host/x")
    with pytest.raises(settings.SettingError) as err:
        settings.get("remote_cache")
    assert "topsecret" not in str(err.value) and "ACCELERATE_NEURON_REMOTE_CACHE" in str(err.value)


@pytest.mark.one_pair
@pytest.mark.parametrize(
    ("url", "package"), [("s3://bucket/neff", "s3fs"), ("hf://datasets/org/repo", "huggingface_hub")]
)
def test_a_missing_backend_package_is_named_with_the_url(
    url: str, package: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, package, None)  # as if it were not installed: importing it fails
    with pytest.raises(urls.RemoteURLError) as err:
        Remote(url).fs  # noqa: B018
    assert url in str(err.value) and f"pip install {package}" in str(err.value)


@pytest.mark.one_pair
def test_settings_and_neuron_config_take_the_remote_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    with settings.config_layer({"remote_cache": "s3://bucket/neff", "remote_cache_read_only": True}, "cfg.yaml"):
        assert settings.get("remote_cache").url == "s3://bucket/neff" and settings.get("remote_cache_read_only")
        monkeypatch.setenv("ACCELERATE_NEURON_REMOTE_CACHE", "off")  # the environment wins
        assert settings.get("remote_cache") is None
    with pytest.raises(ValueError, match="remote_cache_timeout"):
        settings.check_config({"remote_cache_timeout": "-1"}, "cfg.yaml")
    assert tier.from_settings("simulated") is None


@pytest.mark.one_pair
def test_a_changed_flag_target_or_lnc_is_another_key(sim: object, monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(4, 4, device="neuron")
    variants = [{}, {keys.FLAGS_ENV: "--optlevel 1"}, {keys.TARGET_ENV: "trn1"}, {keys.LNC_ENV: "1"}]
    for env in [*variants, {keys.FLAGS_ENV: "  --optlevel   1 "}]:
        for name in (keys.FLAGS_ENV, keys.TARGET_ENV, keys.LNC_ENV):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        torch._dynamo.reset()
        torch.compile(lambda t: t @ t + 1, backend="neuron", dynamic=False)(x)
    graphs = simulator.stats()["graphs"]
    keyed = [g["cache_key"] for g in graphs]
    assert len(set(keyed[:4])) == 4  # flags, target and LNC each miss
    assert [g["cache"] for g in graphs] == ["miss"] * 4 + ["hit"]  # the same flags spaced otherwise: one key
    assert keyed[4] == keyed[1]
    monkeypatch.setenv(keys.TARGET_ENV, "trn9")
    assert "expected one of trn1, trn2, trn3" in keys.problems(True)[0]


@pytest.mark.one_pair
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["prune", "--remote", "/fsx/x"], "say what to prune: --older-than AGE and/or --max-size SIZE"),
        (["prune", "--older-than", "soon"], "argument --older-than: 'soon' is not a duration; expected e.g. 30d"),
        (["prune", "--max-size", "lots"], "argument --max-size: invalid size 'lots'"),
        (["pull", "--remote", "/fsx/x", "not/a/key"], "invalid compile cache key 'not/a/key'"),
        (["ls", "--local", "--remote-only"], "not allowed with argument"),
        (
            ["ls", "--remote", "gs://bucket/neff"],
            "'gs://bucket/neff' has scheme 'gs://': expected file://, s3:// or hf://",
        ),
        (["precompile", "--target", "inf9", "--", "python"], "argument --target: invalid choice: 'inf9'"),
    ],
)
def test_cache_command_refuses_bad_arguments_naming_them(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from accelerate_neuron.cli import main

    argv = argv if argv[0] == "precompile" else ["cache", *argv]
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    assert code in (1, 2) and message in capsys.readouterr().err


@pytest.mark.one_pair
def test_cache_progress_bar_is_huggingface_hubs_on_a_terminal_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from huggingface_hub.utils import tqdm

    from accelerate_neuron.cli import cache

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    bar = cache._Bar(3, "pull", quiet=False)
    assert isinstance(bar.bar, tqdm) and list(bar.over("abc")) == ["a", "b", "c"] and bar.bar.n == 3
    assert "pull" in sys.stderr.getvalue()
    assert cache._Bar(3, "pull", quiet=True).bar is None  # --json: stdout is the result, no bar
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert cache._Bar(3, "pull", quiet=False).bar is None  # not a terminal


@pytest.mark.one_pair
def test_env_shows_the_key_inputs_and_the_remote(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate_neuron.cli import _checks, env

    monkeypatch.setenv(keys.FLAGS_ENV, "--optlevel 1")
    monkeypatch.setenv(keys.TARGET_ENV, "trn3")
    monkeypatch.setenv("ACCELERATE_NEURON_REMOTE_CACHE", "hf://datasets/org/neff")
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # as if it were not installed
    facts = {"compile_cache": env._cache("simulated")}
    inputs = facts["compile_cache"]["key_inputs"]
    assert (inputs["neuron_cc_flags"], inputs["target"], inputs["lnc"]) == ("--optlevel 1", "trn3", "2")
    assert inputs["fingerprint"] == keys.fingerprint({k: v for k, v in inputs.items() if k != "fingerprint"})
    text = "\n".join(env._cache_lines(facts["compile_cache"]))
    assert "target trn3, LNC 2, NEURON_CC_FLAGS --optlevel 1" in text and "hf://datasets/org/neff (read-write" in text
    (problem,) = [p for p in _checks.compile_cache(facts) if p["severity"] == "error"]
    assert "hf://datasets/org/neff" in problem["problem"] and problem["fix"] == "pip install huggingface_hub"


# ------------------------------------------------------------------ the store: damaged, partial, planted entries


def _publish(remote: Remote, tmp_path: Path, data: bytes = b"a NEFF's bytes" * 10) -> Path:
    src = tmp_path / "entry.neff"
    src.write_bytes(data)
    assert remote.publish("neff", "0" * 16, KEY, src, {"made_by": {"job": "test"}})
    return src


def _blob(remote: Remote) -> Path:
    manifest = remote.read_manifest("neff", "0" * 16, KEY)
    return Path(remote.blob_path(manifest["sha256"]))


@pytest.mark.one_pair
def test_fetched_entries_are_verified_and_bad_ones_refused(tmp_path: Path) -> None:
    remote = Remote(f"file://{shared_folder(tmp_path / 'remote')}")
    src = _publish(remote, tmp_path)
    dest = tmp_path / "local" / f"{KEY}.neff"
    manifest = remote.fetch("neff", "0" * 16, KEY, dest)
    assert dest.read_bytes() == src.read_bytes() and manifest["made_by"] == {"job": "test"}
    assert not remote.publish("neff", "0" * 16, KEY, src, {})  # already there: nothing uploaded
    assert remote.fetch("neff", "0" * 16, "f" * 32, tmp_path / "absent") is None

    blob, good = _blob(remote), _blob(remote).read_bytes()
    damage = {
        "a flipped byte": good[:-1] + bytes([good[-1] ^ 1]),
        "truncated": good[: len(good) // 2],
        "longer than its manifest says": good + b"x",
    }
    for what, data in damage.items():
        blob.write_bytes(data)
        dest.unlink(missing_ok=True)
        with pytest.raises(CorruptEntry):
            remote.fetch("neff", "0" * 16, KEY, dest)
        assert not dest.exists(), what  # nothing unverified reaches the local cache
        assert not list(dest.parent.glob(".tmp.*")), what
    blob.unlink()  # a partial publish: a manifest whose blob never arrived
    with pytest.raises(CorruptEntry, match="missing"):
        remote.fetch("neff", "0" * 16, KEY, dest)
    blob.symlink_to(src)  # planted: a symlink is never followed
    with pytest.raises(CorruptEntry, match="symlink"):
        remote.fetch("neff", "0" * 16, KEY, dest)
    blob.unlink()
    manifest_path = Path(remote.manifest_path("neff", "0" * 16, KEY))
    for text, says in [("{not json", "not JSON"), (json.dumps({**manifest, "size": 2**40}), "invalid size")]:
        manifest_path.write_text(text)
        with pytest.raises(CorruptEntry, match=says):
            remote.fetch("neff", "0" * 16, KEY, dest)
    manifest_path.write_text(json.dumps({**manifest, "simulated": True}))  # a simulated entry among real NEFFs
    with pytest.raises(CorruptEntry, match="simulated"):
        remote.fetch("neff", "0" * 16, KEY, dest)
    assert remote.publish("neff", "0" * 16, KEY, src, {})  # a bad manifest is replaced by a good one
    assert remote.fetch("neff", "0" * 16, KEY, dest) is not None


@pytest.mark.one_pair
def test_a_folder_every_user_may_write_is_refused(tmp_path: Path) -> None:
    open_to_all = shared_folder(tmp_path / "remote")
    open_to_all.chmod(0o777)
    with pytest.raises(RemoteError, match="every user may write"):
        Remote(f"file://{open_to_all}").check_root()
    with pytest.raises(RemoteError, match="does not exist"):
        Remote(f"file://{tmp_path / 'not-mounted'}").check_root()


CONCURRENT = """
    import json, sys
    from pathlib import Path
    from accelerate_neuron.compile_cache.remote import Remote

    remote, me = Remote(sys.argv[1]), int(sys.argv[2])
    src = Path(sys.argv[3]) / f"entry-{me}.neff"
    src.write_bytes(f"host {me} ".encode() * 50000)  # each host's bytes differ (as simulated records do)
    published = 0
    for round in range(20):
        published += remote.publish("neff", "0" * 16, "KEY", src, {}, replace=True)
        manifest = remote.fetch("neff", "0" * 16, "KEY", Path(sys.argv[3]) / f"got-{me}")
        assert manifest is not None
    print(json.dumps({"published": published}))
""".replace("KEY", KEY)


@pytest.mark.slow
@pytest.mark.one_pair
def test_concurrent_publishes_of_one_key_never_pair_a_manifest_with_other_bytes(tmp_path: Path) -> None:
    root = shared_folder(tmp_path / "remote")
    script = tmp_path / "publish.py"
    script.write_text(textwrap.dedent(CONCURRENT))
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), f"file://{root}", str(i), str(tmp_path)],
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(3)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]  # every fetch in every round verified
        assert last_json(out)["published"] == 20
    remote = Remote(f"file://{root}")
    (listed,) = list(remote.entries("neff"))
    assert listed.manifest is not None and len(remote.blobs()) == 3 and not remote.temporaries()


# ------------------------------------------------------------------ two hosts, one remote


@pytest.mark.slow
@pytest.mark.one_pair
def test_two_hosts_on_a_shared_folder_compile_once(model: str, tmp_path: Path) -> None:
    remote = f"file://{shared_folder(tmp_path / 'fsx')}"
    a, _ = host(model, tmp_path / "host-a", remote)
    b, _ = host(model, tmp_path / "host-b", remote)
    assert a["compiles"] > 0 and a["eager_compiles"] > 0 and a["remote"]["fetched"] == 0
    assert (b["compiles"], b["eager_compiles"]) == (0, 0), b  # host B compiles nothing
    assert b["tokens"] == a["tokens"] and b["graph_keys"] == a["graph_keys"]
    assert b["compile_cache_hits"] == a["compiles"] and set(b["graph_sources"]) == {"remote"}
    assert b["eager_cache_hits"] == a["eager_signatures"]
    assert b["remote"]["fetched"] == a["compiles"] + a["eager_compiles"]
    assert len(entries(tmp_path / "host-b")) == len(entries(tmp_path / "host-a"))

    flags, _ = host(model, tmp_path / "host-c", remote, NEURON_CC_FLAGS="--optlevel 1")
    assert flags["compiles"] == a["compiles"] and flags["remote"]["fetched"] == 0  # other flags: other NEFFs
    assert flags["tokens"] == a["tokens"] and set(flags["graph_keys"]).isdisjoint(a["graph_keys"])

    # One of host A's graphs damaged on the remote: refused, compiled again, published again.
    target = a["graph_keys"][0]
    fingerprint = keys.fingerprint(keys.key_inputs(True))
    store = Remote(remote)
    manifest = store.read_manifest("simulated", fingerprint, target)
    blob = Path(store.blob_path(manifest["sha256"]))
    blob.write_bytes(blob.read_bytes()[:-2] + b"!}")
    d, err = host(model, tmp_path / "host-d", remote)
    assert d["compiles"] == 1 and d["tokens"] == a["tokens"]
    assert err.count(f"refused entry {target} of the remote compile cache") == 1 and "does not match" in err
    assert store.fetch("simulated", fingerprint, target, tmp_path / "repaired") is not None  # host D republished it


@pytest.mark.slow
@pytest.mark.one_pair
def test_two_hosts_through_s3_compile_once(model: str, tmp_path: Path, s3: dict[str, str]) -> None:
    remote = "s3://fleet/neff"
    a, err_a = host(model, tmp_path / "host-a", remote, **s3)
    b, _ = host(model, tmp_path / "host-b", remote, **s3)
    assert a["compiles"] > 0 and (b["compiles"], b["eager_compiles"]) == (0, 0), (a, b)
    assert b["tokens"] == a["tokens"] and b["graph_keys"] == a["graph_keys"]
    assert s3["AWS_SECRET_ACCESS_KEY"] not in err_a  # credentials never logged
    assert b["remote"]["fetched"] == a["compiles"] + a["eager_compiles"]
    listed = json.loads(cli("cache", "ls", "--remote-only", "--json", "--remote", remote, **s3).stdout)["remote"]
    assert {row["key"] for row in listed} >= set(a["graph_keys"])
    assert all(row["made_by"]["job"] == "fleet_generate.py" for row in listed)


@pytest.mark.slow
@pytest.mark.one_pair
def test_a_remote_that_is_down_costs_local_compiles_and_one_message(model: str, tmp_path: Path) -> None:
    down = {"AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{free_port()}", "AWS_ACCESS_KEY_ID": "k"}
    run, err = host(model, tmp_path / "host", "s3://fleet/neff", AWS_SECRET_ACCESS_KEY="s", **down)
    assert run["compiles"] > 0 and run["remote"]["down"]
    assert err.count("the remote compile cache s3://fleet/neff cannot be used") == 1, err
    assert "This job compiles locally" in err
    again, _ = host(model, tmp_path / "host", "s3://fleet/neff", AWS_SECRET_ACCESS_KEY="s", **down)
    assert again["compiles"] == 0  # the local cache still works


# ------------------------------------------------------------------ in process: the tier's own behaviour


@pytest.mark.one_pair
def test_publishing_never_blocks_a_failure_is_said_once_and_a_reader_never_publishes(
    sim: object, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = shared_folder(tmp_path / "remote")
    writer = tier.Tier(urls.parse(str(root)), kind="simulated")
    neff_cache.use(tmp_path / "a", remote=writer)
    x = torch.randn(3, 5, device="neuron")
    torch.compile(lambda t: t.sin() * 2, backend="neuron", dynamic=False)(x)
    assert writer.flush(60) == 0 and writer.counts["published"] == 1

    # The remote stops taking writes (where blobs go there is a file): the job goes on, and says so once.
    (root / "blobs").rename(root / "blobs.saved")
    (root / "blobs").write_text("in the way")
    try:
        neff_cache.use(tmp_path / "b", remote=tier.Tier(urls.parse(str(root)), kind="simulated"))
        broken = neff_cache.current().remote
        with caplog.at_level(logging.WARNING, logger="accelerate_neuron"):
            for n in (6, 7):
                torch._dynamo.reset()
                torch.compile(lambda t: t.cos() + 1, backend="neuron", dynamic=False)(
                    torch.randn(3, n, device="neuron")
                )
                broken.flush(60)
        assert broken.counts["not_published"] == 2 and broken.down
        assert caplog.text.count("cannot be used") == 1
    finally:
        (root / "blobs").unlink()
        (root / "blobs.saved").rename(root / "blobs")
    reader = tier.Tier(urls.parse(str(root)), kind="simulated", read_only=True)
    neff_cache.use(tmp_path / "c", remote=reader)
    simulator.reset_stats()
    torch._dynamo.reset()
    torch.compile(lambda t: t.sin() * 2, backend="neuron", dynamic=False)(x)
    st = simulator.stats()
    assert (st["compiles"], st["compile_cache_hits"]) == (0, 1) and st["graphs"][0]["cache_source"] == "remote"
    assert st["compile_cache"]["remote"]["fetched"] == 1
    before = len(Remote(reader.url).blobs())
    torch.compile(lambda t: t.tan(), backend="neuron", dynamic=False)(x)  # compiled here, never published
    assert reader.flush(60) == 0 and len(Remote(reader.url).blobs()) == before
    assert simulator.stats()["compiles"] == 1 and reader.counts["published"] == 0


@pytest.mark.one_pair
def test_on_a_real_host_the_neffs_a_process_added_are_published_at_exit(tmp_path: Path) -> None:
    """torch-neuronx's folder as indexed (``ab/cd/<key>.neff``); what the process found there is not republished."""
    from accelerate_neuron.compile_cache import real_neff

    local = tmp_path / "neff_cache"
    old, new = "a1" * 16, "b2" * 16
    for key in (old, new):
        path = local / key[:2] / key[2:4] / f"{key}.neff"
        path.parent.mkdir(parents=True)
        path.write_bytes(b"NEFF " + key.encode())
    os.utime(local / old[:2] / old[2:4] / f"{old}.neff", (1e9, 1e9))  # there before the process started
    (local / "cd" / "ef").mkdir(parents=True)
    (local / "cd" / "ef" / f"{'cd' * 16}.neff").symlink_to(tmp_path)  # never followed, never published
    remote = Remote(f"file://{shared_folder(tmp_path / 'fsx')}")
    real = tier.Tier(remote.url, kind="neff")
    assert real_neff.publish_since(real, local, since=time.time() - 60) == 1
    (listed,) = list(remote.entries("neff"))
    assert listed.key == new and listed.manifest["simulated"] is False and not list(remote.entries("simulated"))
    assert listed.fingerprint == keys.fingerprint(keys.key_inputs(simulated=False))
    assert listed.manifest["key_inputs"]["compiler"].startswith("neuronx-cc")


# ------------------------------------------------------------------ accelerate-neuron cache, and the fleet recipe


@pytest.mark.slow
@pytest.mark.one_pair
def test_cache_command_lists_pushes_pulls_verifies_and_prunes(model: str, tmp_path: Path) -> None:
    local = tmp_path / "ci"
    run, _ = host(model, local, "off")  # a host without a remote: entries stay local
    count = len(entries(local))
    folder = tmp_path / "fsx"  # push creates the shared folder
    remote = f"file://{folder}"
    env = {"TORCH_NEURONX_NEFF_CACHE_DIR": str(local)}

    pushed = json.loads(cli("cache", "push", "--json", "--remote", remote, **env).stdout)
    assert (pushed["published"], pushed["already_there"], pushed["failed"]) == (count, 0, {})
    du = json.loads(cli("cache", "du", "--json", "--remote", remote, **env).stdout)
    assert du["local"]["entries"] == du["remote"]["entries"] == count
    assert du["local"]["by_what"] == {"graph": run["compiles"], "eager": run["eager_compiles"]}
    listed = json.loads(cli("cache", "ls", "--json", "--remote", remote, **env).stdout)
    assert {r["key"] for r in listed["local"]} == {r["key"] for r in listed["remote"]}
    text = cli("cache", "ls", "--remote", remote, **env).stdout
    assert f"remote ({remote}): {count} entries" in text and "graph inference" in text

    other = {"TORCH_NEURONX_NEFF_CACHE_DIR": str(tmp_path / "serving")}
    pulled = json.loads(cli("cache", "pull", "--all", "--json", "--remote", remote, **other).stdout)
    assert (pulled["fetched"], pulled["refused"]) == (count, 0)

    (blob,) = [b for b in folder.glob("blobs/*/*")][:1]
    blob.write_bytes(b"garbage")
    verify = cli("cache", "verify", "--json", "--remote", remote, **other)
    report = json.loads(verify.stdout)
    assert verify.returncode == 1 and len(report["remote"]["damaged"]) == 1 and report["local"]["damaged"] == {}
    cli("cache", "verify", "--remote-only", "--delete", "--remote", remote, **other)
    pruned = json.loads(cli("cache", "prune", "--json", "--max-size", "1KB", "--remote", remote, **other).stdout)
    left = json.loads(cli("cache", "du", "--json", "--remote", remote, **other).stdout)["remote"]
    assert pruned["remote"]["removed"] == count - 1 - pruned["remote"]["kept"] and left["bytes"] <= 1000
    assert left["blobs"] == left["entries"]  # the pruned entries' blobs went too
    gone = json.loads(cli("cache", "prune", "--json", "--older-than", "0s", "--local", **other).stdout)
    assert gone["local"]["removed"] == count and entries(tmp_path / "serving") == []


@pytest.mark.slow
@pytest.mark.one_pair
def test_fleet_recipe_ci_precompiles_on_a_cpu_host_and_a_trainium_host_pulls(
    model: str, tmp_path: Path, s3: dict[str, str]
) -> None:
    remote = "s3://fleet/recipe"
    manifest = tmp_path / "job.json"
    ci = {"TORCH_NEURONX_NEFF_CACHE_DIR": str(tmp_path / "ci"), "ACCELERATE_NEURON_REMOTE_CACHE": remote, **s3}
    proc = cli(
        "precompile", "--target", "trn2", "--manifest", str(manifest), "--jobs", "1", "--cores", "1", "--json",
        "--", sys.executable, str(SCRIPT), model, **ci,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = last_json(proc.stdout)
    job = json.loads(manifest.read_text())
    assert job == summary["cache_manifest"] and job["kind"] == "simulated"
    assert job["key_inputs"]["target"] == "trn2" and job["key_inputs"]["lnc"] == "2"
    assert len(set(job["entries"])) == len(job["entries"]) and set(summary["graph_keys"]) < set(job["entries"])

    serving = {"TORCH_NEURONX_NEFF_CACHE_DIR": str(tmp_path / "trn"), **s3}
    pulled = json.loads(
        cli("cache", "pull", "--manifest", str(manifest), "--json", "--remote", remote, **serving).stdout
    )
    assert pulled["fetched"] == len(job["entries"]) and pulled["missing"] == 0, pulled
    run, _ = host(model, tmp_path / "trn", "off", **s3)  # no remote needed any more: everything is local
    assert (run["compiles"], run["eager_compiles"]) == (0, 0), run
    assert set(run["graph_keys"]) <= set(job["entries"])

    other = cli("cache", "pull", "--manifest", str(manifest), "--kind", "neff", "--remote", remote, **serving)
    assert other.returncode == 1 and "never served to a real backend" in other.stderr
