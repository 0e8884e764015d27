"""Build and load the simulator's native library.

The simulated device is a small C++ library against the installed PyTorch
(allocator, device guard, hooks, kernels). It is compiled on first use, not at
``pip install`` time: compiling against torch at install time would need torch
inside pip's isolated build environment, which pulls a multi-GB CUDA wheel.
The result is cached per (sources, torch build, compiler), so later processes
load it in milliseconds. Concurrent first uses (``torchrun``) build once under
a file lock.

The C++ standard is the one the installed torch's headers compile under (torch
2.13's accept C++17, 2.14's need C++20): found by compiling a file that includes
them, newest standard first, and remembered per (torch, compiler) beside the
builds. torch's ``cpp_extension`` hard-codes its flag and offers no function
that says it, so asking the compiler is the one answer that holds for every torch.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .. import settings

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = ("runtime.cpp", "kernels.cpp", "autocast.cpp")
_HEADERS = ("sim.h",)
_LIB_NAME = "libneuron_sim.so"
#: Tried newest first: the first one the compiler accepts and torch's headers compile under is used.
CXX_STANDARDS = ("c++20", "c++17")
#: What the probe compiles: the headers every simulator source includes.
_PROBE_SOURCE = "#include <ATen/core/Tensor.h>\n#include <torch/library.h>\nint main() { return 0; }\n"

# ATen/autocast_mode.h macro -> policy of the boxed autocast kernel.
_POLICY_MACROS = {
    "AT_FORALL_LOWER_PRECISION_FP": "kLower",
    "AT_FORALL_FP32": "kFp32",
    "AT_FORALL_FP32_SET_OPT_DTYPE": "kFp32SetOptDtype",
    "AT_FORALL_PROMOTE": "kPromote",
}


def asan_enabled() -> bool:
    """``ACCELERATE_NEURON_SIM_ASAN=1``: build and load an AddressSanitizer flavour of the simulator.

    Python must then run with ``LD_PRELOAD=$(gcc -print-file-name=libasan.so)`` and
    ``ASAN_OPTIONS=detect_leaks=0`` (CPython and torch hold memory until exit by design).
    """
    return settings.get("sim_asan")


def _sanitizer_flags() -> list[str]:
    return ["-fsanitize=address", "-fno-omit-frame-pointer"] if asan_enabled() else []


class SimulatorBuildError(RuntimeError):
    """The native part of the simulated device could not be compiled."""


def cache_dir() -> Path:
    """Where compiled simulator libraries are kept (the ``cache_dir`` setting)."""
    return settings.cache_dir()


def _compiler() -> str:
    for candidate in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if candidate and shutil.which(candidate):
            return candidate
    raise SimulatorBuildError(
        "The simulated Neuron device needs a C++ compiler to build once per PyTorch "
        "version (none of $CXX, c++, g++, clang++ was found). Install one, e.g. "
        "`apt-get install g++` or Xcode's command line tools."
    )


def policy_table(torch_include: Path) -> str:
    """C++ initialisers for the autocast policy, read from the installed torch."""
    header = (torch_include / "ATen" / "autocast_mode.h").read_text()
    rows = []
    for macro, policy in _POLICY_MACROS.items():
        match = re.search(rf"#define {macro}\(_\)(.*?)(?:\n\s*\n|\n#)", header, re.S)
        if not match:
            logger.debug("autocast list %s not found in %s", macro, torch_include)
            continue
        for name, overload in re.findall(r"_\((\w+)(?:,\s*(\w+))?\)", match.group(1)):
            if overload == "deprecated":
                continue
            rows.append(f'{{"{name}", "{overload}", Policy::{policy}}},')
    if not rows:
        raise SimulatorBuildError(f"no autocast policy lists found in {torch_include}")
    return "\n".join(rows) + "\n"


def _run(command: list[str], source: str) -> subprocess.CompletedProcess:
    return subprocess.run([*command, "-x", "c++", "-"], input=source, capture_output=True, text=True)


def _compiler_version(compiler: str) -> str:
    proc = subprocess.run([compiler, "--version"], capture_output=True, text=True)
    first = (proc.stdout or proc.stderr).strip().splitlines()
    return first[0] if first else "unknown version"


def cxx_standard(compiler: str, include_flags: list[str], cache_file: Path | None = None) -> str:
    """The ``-std=`` value to build with: the newest of :data:`CXX_STANDARDS` that works here.

    "Works" means the compiler accepts the flag and torch's headers compile under it. The answer
    is kept in ``cache_file`` (keyed by the caller: torch build and compiler). Raises
    :class:`SimulatorBuildError` naming the compiler and the flag when none works.
    """
    if cache_file is not None:
        try:
            cached = cache_file.read_text().strip()
        except OSError:
            cached = ""
        if cached in CXX_STANDARDS:
            return cached
    accepted = [std for std in CXX_STANDARDS if _run([compiler, f"-std={std}", "-fsyntax-only"], "").returncode == 0]
    failures: dict[str, str] = {}
    for std in accepted:
        proc = _run([compiler, f"-std={std}", "-fsyntax-only", "-w", *include_flags], _PROBE_SOURCE)
        if proc.returncode == 0:
            if cache_file is not None:
                cache_file.parent.mkdir(parents=True, exist_ok=True)
                tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(std + "\n")
                os.replace(tmp, cache_file)
            return std
        failures[std] = proc.stderr.strip()[:1500]  # the first error says why; the rest follows from it
    version = _compiler_version(compiler)
    newest = CXX_STANDARDS[0]
    if newest not in accepted:
        tried = ", ".join(f"-std={std}" for std in failures) or "no -std= flag this builder knows"
        raise SimulatorBuildError(
            f"the C++ compiler {compiler!r} ({version}) does not accept -std={newest}, and torch's headers "
            f"do not compile with what it does accept ({tried}). The installed torch needs a compiler with "
            f"-std={newest} support (GCC >= 10 or clang >= 10): install one and point CXX at it."
            + (f"\n{failures[next(iter(failures))]}" if failures else "")
        )
    raise SimulatorBuildError(
        f"torch's headers do not compile with {compiler!r} ({version}) under "
        + " or ".join(f"-std={std}" for std in failures)
        + f"; set CXX to another compiler.\n{failures[newest]}"
    )


def _standard_cache_file(torch_mod, compiler: str) -> Path:
    """Where the standard found for this torch build and compiler is remembered."""
    digest = hashlib.sha256()
    for part in (torch_mod.__version__, str(Path(torch_mod.__file__).resolve()), compiler, _compiler_version(compiler)):
        digest.update(part.encode() + b"\0")
    return cache_dir() / f"cxx-standard-{digest.hexdigest()[:16]}.txt"


def _build_key(torch_mod, compiler: str) -> str:
    digest = hashlib.sha256()
    for name in _SOURCES + _HEADERS:
        digest.update((_CSRC / name).read_bytes())
    digest.update(torch_mod.__version__.encode())
    digest.update(str(Path(torch_mod.__file__).resolve()).encode())
    digest.update(str(torch_mod._C._GLIBCXX_USE_CXX11_ABI).encode())
    digest.update(compiler.encode())
    digest.update(sys.version.encode())
    digest.update(" ".join(_sanitizer_flags()).encode())
    return digest.hexdigest()[:16]


def _compile(torch_mod, compiler: str, out: Path) -> None:
    from torch.utils import cpp_extension

    include_flags = [f"-I{p}" for p in cpp_extension.include_paths()]
    include_flags.append(f"-I{sysconfig.get_paths()['include']}")
    standard = cxx_standard(compiler, include_flags, _standard_cache_file(torch_mod, compiler))
    torch_lib = Path(torch_mod.__file__).parent / "lib"
    work = Path(tempfile.mkdtemp(prefix="neuron_sim_build_"))
    try:
        for name in _SOURCES + _HEADERS:
            shutil.copy(_CSRC / name, work / name)
        (work / "policy_table.inc").write_text(policy_table(Path(cpp_extension.include_paths()[0])))
        common = [
            compiler,
            "-O1",
            f"-std={standard}",
            "-fPIC",
            "-w",
            *_sanitizer_flags(),
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch_mod._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-I{work}",
            *include_flags,
        ]

        def compile_one(name: str) -> Path:
            obj = work / (name + ".o")
            proc = subprocess.run(
                [*common, "-c", str(work / name), "-o", str(obj)],
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                raise SimulatorBuildError(f"compiling {name} failed:\n{proc.stderr[-4000:]}")
            return obj

        with ThreadPoolExecutor(max_workers=max(1, min(len(_SOURCES), os.cpu_count() or 1))) as pool:
            objects = list(pool.map(compile_one, _SOURCES))
        link = [compiler, "-shared", *_sanitizer_flags(), *map(str, objects), f"-L{torch_lib}", "-lc10", "-ltorch_cpu"]
        if sys.platform == "darwin":
            link += ["-undefined", "dynamic_lookup"]
        link += [f"-Wl,-rpath,{torch_lib}", "-o", str(work / _LIB_NAME)]
        proc = subprocess.run(link, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SimulatorBuildError(f"linking the simulator failed:\n{proc.stderr[-4000:]}")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        shutil.copy(work / _LIB_NAME, tmp)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def library_path(torch_mod) -> Path:
    """Path of the compiled library for this torch, building it when missing."""
    compiler = _compiler()
    key = _build_key(torch_mod, compiler)
    flavour = "-asan" if asan_enabled() else ""
    target = cache_dir() / f"sim-{torch_mod.__version__}{flavour}-{key}" / _LIB_NAME
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            started = time.monotonic()
            sys.stderr.write(
                f"accelerate-neuron: building the simulated Neuron device for torch "
                f"{torch_mod.__version__} (first use only, about 20 s)...\n"
            )
            sys.stderr.flush()
            _compile(torch_mod, compiler, target)
            logger.info("built %s in %.1f s", target, time.monotonic() - started)
    return target


def load(torch_mod) -> ctypes.CDLL:
    """Load the native library into this process (registers the kernels)."""
    path = library_path(torch_mod)
    torch_mod.ops.load_library(str(path))
    lib = ctypes.CDLL(str(path))
    _declare(lib)
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    i64, i32, u64 = ctypes.c_int64, ctypes.c_int, ctypes.c_uint64
    signatures = {
        "nsim_configure": ([i32, i64], None),
        "nsim_num_devices": ([], i32),
        "nsim_is_initialized": ([], i32),
        "nsim_mark_initialized": ([], None),
        "nsim_mark_bad_fork": ([], None),
        "nsim_in_bad_fork": ([], i32),
        "nsim_current_device": ([], i32),
        "nsim_set_device": ([i32], None),
        "nsim_memory": ([i32, i32], i64),
        "nsim_reset_peak": ([i32], None),
        "nsim_counter": ([i32], i64),
        "nsim_signature_count": ([], i64),
        "nsim_signatures": ([ctypes.c_char_p, i64], i64),
        "nsim_reset_stats": ([], None),
        "nsim_set_cpu_fallback_ops": ([ctypes.c_char_p], None),
        "nsim_cpu_fallback_counts": ([ctypes.c_char_p, i64], i64),
        "nsim_clear_cpu_fallback_counts": ([], None),
        "nsim_suspend_counting": ([i32], None),
        "nsim_manual_seed": ([i32, u64], None),
        "nsim_seed": ([i32], u64),
        "nsim_initial_seed": ([i32], u64),
        "nsim_get_rng_state": ([i32, ctypes.c_void_p, i64], i64),
        "nsim_set_rng_state": ([i32, ctypes.c_void_p, i64], None),
    }
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype
