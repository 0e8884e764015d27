"""The simulator's native build picks the C++ standard the installed torch's headers need."""

from __future__ import annotations

import shutil
import stat
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
