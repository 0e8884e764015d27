"""The simulator's native build picks the C++ standard the installed torch's headers need."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from accelerate_neuron.simulator import _build

CXX = shutil.which("g++") or shutil.which("c++") or "g++"  # the simulator itself needs one to exist

TORCH_NEEDS_CXX20 = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14)


def _include_flags() -> list[str]:
    return [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]


def _wrapper(tmp_path: Path, body: str) -> str:
    """A compiler script: logs each call's arguments to calls.log, then runs ``body``."""
    script = tmp_path / "cxx-wrapper"
    log = tmp_path / "calls.log"
    script.write_text(f'#!/bin/sh\necho "$*" >> {log}\n{body}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def _calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


def test_the_standard_compiles_torchs_headers_and_is_remembered(tmp_path: Path) -> None:
    compiler = _wrapper(tmp_path, f'exec {CXX} "$@"')
    cache = tmp_path / "std.txt"
    standard = _build.cxx_standard(compiler, _include_flags(), cache)
    assert standard == "c++20"  # the newest one g++ 12 accepts, and every supported torch compiles under it
    assert cache.read_text().strip() == standard
    probes = _calls(tmp_path)
    assert probes, "the standard was found without asking the compiler"
    assert _build.cxx_standard(compiler, _include_flags(), cache) == standard
    assert _calls(tmp_path) == probes  # the second answer came from the cache file


def test_a_compiler_without_cxx20_gets_cxx17_or_a_clear_error(tmp_path: Path) -> None:
    # A compiler of the GCC 7 era: C++17, no -std=c++20.
    compiler = _wrapper(
        tmp_path,
        'case "$*" in *-std=c++20*) echo "error: unrecognized command-line option \'-std=c++20\'" >&2; exit 1;; '
        f'esac\nexec {CXX} "$@"',
    )
    if not TORCH_NEEDS_CXX20:
        assert _build.cxx_standard(compiler, _include_flags()) == "c++17"
        return
    with pytest.raises(_build.SimulatorBuildError) as info:
        _build.cxx_standard(compiler, _include_flags(), tmp_path / "std.txt")
    message = str(info.value)
    assert compiler in message and "-std=c++20" in message and "CXX" in message
    assert not (tmp_path / "std.txt").exists()  # a failure is not remembered


def test_headers_that_compile_under_no_standard_name_the_compiler_and_flags(tmp_path: Path) -> None:
    compiler = _wrapper(tmp_path, f'exec {CXX} "$@"')
    broken = tmp_path / "include" / "ATen" / "core"
    broken.mkdir(parents=True)
    (broken / "Tensor.h").write_text("#error this torch's headers are broken\n")
    with pytest.raises(_build.SimulatorBuildError) as info:
        _build.cxx_standard(compiler, [f"-I{tmp_path / 'include'}", *_include_flags()])
    message = str(info.value)
    assert compiler in message and "-std=c++20 or -std=c++17" in message and "broken" in message


# ------------------------------------------------------------------ what is loaded, and from where
#
# These run `import torch` in children with their own cache folders. Their "compiler" is a stand-in that
# links by copying the library this test process loaded (checked, the real one): the subject is what is
# loaded and when it is rebuilt, not the compile, which would cost a minute each time.

OTHER_UID = 65534  # "nobody": another user, as root (these tests' user) can make files of


def _good_library() -> Path:
    return _build.library_path(torch)  # the session installed the simulator: built and checked already


def _linker(tmp_path: Path) -> str:
    """A compiler that compiles nothing and links by copying the good library; ``FAIL_LINK=1`` makes it fail."""
    log = tmp_path / "links.log"
    return _wrapper(
        tmp_path,
        'out=""; prev=""\nfor a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done\n'
        'case " $* " in\n'
        f'  *" -shared "*) [ -n "$FAIL_LINK" ] && {{ echo "ld: cannot link here" >&2; exit 1; }}; '
        f'cp "{_good_library()}" "$out"; echo "$out" >> "{log}";;\n'
        '  *" -c "*) : > "$out";;\n'
        f'  *) exec {CXX} "$@";;\n'
        "esac",
    )


def _links(tmp_path: Path) -> list[str]:
    log = tmp_path / "links.log"
    return log.read_text().splitlines() if log.exists() else []


def _library_folder_name(compiler: str) -> str:
    """The folder a library for ``compiler`` is built in, under any cache folder."""
    flavour = "-asan" if _build.asan_enabled() else ""
    return f"sim-{torch.__version__}{flavour}-{_build._build_key(torch, compiler)}"


def _seed_standard(cache: Path, compiler: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Remember the C++ standard for the stand-in compiler, as a first build would (skips a 5 s header probe)."""
    with monkeypatch.context() as patch:
        patch.setenv("ACCELERATE_NEURON_CACHE_DIR", str(cache))
        file = _build._standard_cache_file(torch, compiler)
    file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    file.write_text("c++20\n" if TORCH_NEEDS_CXX20 else "c++17\n")


USE_DEVICE = """
import torch
print("device", torch.ones(2, device="neuron").sum().item() if hasattr(torch, "neuron") else None)
"""


def _import_torch(cache: Path, compiler: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    from helpers import run_python

    return run_python(
        USE_DEVICE,
        check=False,
        ACCELERATE_NEURON_SIMULATE="1",
        ACCELERATE_NEURON_CACHE_DIR=str(cache),
        XDG_CACHE_HOME=str(tmp_path / "home-cache"),
        CXX=compiler,
        **env,
    )


def test_a_truncated_library_is_rebuilt_or_refused_never_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host preempted while the library was written leaves it short: loading it killed every `import torch`
    with SIGBUS (exit 135, no message). It fails its size/SHA-256 check instead, and is rebuilt."""
    compiler = _linker(tmp_path)
    cache = tmp_path / "cache"
    _seed_standard(cache, compiler, monkeypatch)
    first = _import_torch(cache, compiler, tmp_path)
    assert (first.returncode, first.stdout.split()[-1]) == (0, "2.0"), first.stderr
    (library,) = cache.glob("sim-*/libneuron_sim.so")
    assert len(_links(tmp_path)) == 1

    with open(library, "r+b") as f:  # half of it on disk: dlopen maps past the end, SIGBUS
        f.truncate(library.stat().st_size // 2)
    rebuilt = _import_torch(cache, compiler, tmp_path)
    assert rebuilt.returncode == 0, f"exit {rebuilt.returncode}\n{rebuilt.stderr}"
    assert rebuilt.stdout.split()[-1] == "2.0"
    (said,) = [line for line in rebuilt.stderr.splitlines() if "fails its check" in line]
    assert str(library) in said and "truncated" in said and "rebuilding" in said
    assert len(_links(tmp_path)) == 2 and library.read_bytes() == _good_library().read_bytes()
    record = json.loads(library.with_name("libneuron_sim.json").read_text())
    assert record["size"] == library.stat().st_size and len(record["sha256"]) == 64
    assert stat.S_IMODE(library.parent.stat().st_mode) == 0o700  # created private

    with open(library, "r+b") as f:
        f.truncate(library.stat().st_size // 2)
    refused = _import_torch(cache, compiler, tmp_path, FAIL_LINK="1")  # and it cannot be rebuilt here
    assert refused.returncode == 0, f"exit {refused.returncode}\n{refused.stderr}"
    assert refused.stdout.split()[-1] == "None"  # no device, and import torch went on
    (said,) = [line for line in refused.stderr.splitlines() if "could not install the simulated" in line]
    assert "linking the simulator failed" in said  # why, in one line (the linker's output at debug level)


@pytest.mark.parametrize("folder", ["owned by another user", "writable by everyone"])
def test_a_library_planted_in_a_folder_others_can_write_is_never_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, folder: str
) -> None:
    """``ACCELERATE_NEURON_CACHE_DIR`` at a folder another user controls: their library (and its record) sits
    where ours would, and a symlinked build lock points at a file of ours. Nothing of it is loaded or
    followed: one warning names the folder and its owner, and the library is built in the user's own folder."""
    compiler = _linker(tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir()
    if folder == "owned by another user":
        os.chown(shared, OTHER_UID, OTHER_UID)
    else:
        shared.chmod(0o777)
    planted = shared / _library_folder_name(compiler)
    planted.mkdir()
    marker = tmp_path / "planted-code-ran"
    source = tmp_path / "planted.c"
    source.write_text(
        f'#include <stdio.h>\n__attribute__((constructor)) static void ran(void) {{ FILE *f = fopen("{marker}", '
        '"w"); if (f) { fputs("ran", f); fclose(f); } }\n'
    )
    subprocess.run(
        [CXX, "-x", "c", "-shared", "-fPIC", "-o", str(planted / "libneuron_sim.so"), str(source)], check=True
    )
    data = (planted / "libneuron_sim.so").read_bytes()
    record = {"file": "libneuron_sim.so", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (planted / "libneuron_sim.json").write_text(json.dumps(record))
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (planted / ".lock").symlink_to(victim)
    for path in (planted, *planted.iterdir()):
        os.chown(path, OTHER_UID, OTHER_UID, follow_symlinks=False)
    _seed_standard(tmp_path / "home-cache" / "accelerate_neuron", compiler, monkeypatch)

    proc = _import_torch(shared, compiler, tmp_path)
    assert not marker.exists(), "the planted library was loaded"
    assert victim.read_text() == "precious", "the planted lock link was followed"
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-1] == "2.0"  # the simulated device works, from the user's own build
    (said,) = [line for line in proc.stderr.splitlines() if "refused" in line]
    owner = {"owned by another user": "nobody (uid 65534), not by you", "writable by everyone": "mode 0777"}[folder]
    assert str(shared) in said and owner in said and "ACCELERATE_NEURON_SHARED_CACHE_DIRS" in said
    assert len(_links(tmp_path)) == 1
    (built,) = (tmp_path / "home-cache" / "accelerate_neuron").glob("sim-*/libneuron_sim.so")
    assert built.read_bytes() == _good_library().read_bytes() and built.parent.name == planted.name
    assert (planted / "libneuron_sim.so").read_bytes() == data  # theirs left alone

    # Shared on purpose: its entries may be read, but a library is still never loaded from it.
    on_purpose = _import_torch(shared, compiler, tmp_path, ACCELERATE_NEURON_SHARED_CACHE_DIRS=str(shared))
    assert on_purpose.returncode == 0 and on_purpose.stdout.split()[-1] == "2.0", on_purpose.stderr
    assert not marker.exists() and "refused" not in on_purpose.stderr


def test_a_planted_link_as_the_build_lock_is_refused_not_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiler = _linker(tmp_path)
    monkeypatch.setenv("CXX", compiler)
    monkeypatch.setenv("ACCELERATE_NEURON_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "cache" / _library_folder_name(compiler)
    folder.mkdir(parents=True)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (folder / ".lock").symlink_to(victim)
    with pytest.raises(_build.SimulatorBuildError, match=r"build lock.*\.lock is a symbolic link"):
        _build.library_path(torch)
    assert victim.read_text() == "precious" and _links(tmp_path) == []
