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

A library is loaded only after it proves to be the one this user built: its folder is the user's own
(never one another user can write, nor one shared on purpose), and the file, opened without following
links and checked on that descriptor, has the size and SHA-256 recorded beside it when it was built
(written to disk with fsync before the rename that publishes it). The descriptor that was checked is
the one loaded (``/proc/self/fd/N``), so nothing can swap the file in between. A library that fails
the check (truncated by a host preempted mid-write, overwritten) is rebuilt, never loaded.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
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

from .. import files, logs, settings, trust

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = ("runtime.cpp", "kernels.cpp", "autocast.cpp")
_HEADERS = ("sim.h",)
_LIB_NAME = "libneuron_sim.so"
#: Beside each library: its size and SHA-256, written when it was built and checked before every load.
_RECORD_NAME = "libneuron_sim.json"
#: Far above the library (under 1 MiB; the ASan flavour a few MiB): anything larger is not ours.
_MAX_LIBRARY_BYTES = 256 * 2**20
_MISSING = "missing"
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
    """Where compiled simulator libraries are kept: the ``cache_dir`` setting when it is the user's own.

    A folder another user owns or may write, or one shared on purpose (``ACCELERATE_NEURON_SHARED_CACHE_DIRS``),
    never holds a library this process loads: the user's own default folder is used instead (once said why).
    Raises :class:`SimulatorBuildError` when neither can be used.
    """
    chosen = settings.cache_dir()
    shared = trust.is_shared(chosen)
    if shared:
        reason = f"{chosen} is shared on purpose ({trust.SHARED_ENV}), and no library is loaded from a shared folder"
    else:
        reason = trust.check_folder(chosen, shared=False)
        if reason is None:
            return chosen
    fallback = settings.default_cache_dir()
    fallback_reason = reason if fallback == chosen else trust.check_folder(fallback, shared=False)
    if fallback_reason is None and trust.is_shared(fallback):
        fallback_reason = f"{fallback} is shared on purpose ({trust.SHARED_ENV})"
    if fallback_reason is not None:
        raise SimulatorBuildError(
            f"no private folder for the simulated device's library: {reason}; {fallback_reason}. Set "
            f"{settings.env_name('cache_dir')} to a folder of your own (mode 0700)."
        )
    if shared:
        logs.once(
            logger,
            ("build.shared", str(chosen)),
            "accelerate_neuron: %s: it is built in %s",
            reason,
            fallback,
            level=logging.INFO,
        )
    else:
        trust.warn_refused(reason, f"the simulated device's library is built and loaded from {fallback} instead")
    return fallback


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
            cached = trust.read_file(cache_file, limit=64).decode(errors="replace").strip()
        except OSError:  # absent, or not this user's regular file: asked again, and rewritten
            cached = ""
        if cached in CXX_STANDARDS:
            return cached
    accepted = [std for std in CXX_STANDARDS if _run([compiler, f"-std={std}", "-fsyntax-only"], "").returncode == 0]
    failures: dict[str, str] = {}
    for std in accepted:
        proc = _run([compiler, f"-std={std}", "-fsyntax-only", "-w", *include_flags], _PROBE_SOURCE)
        if proc.returncode == 0:
            if cache_file is not None:
                files.make_folders(cache_file.parent)
                files.write_atomically(cache_file, std + "\n")
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
    """Build the library into ``out``, durably, with its size and SHA-256 recorded beside it."""
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
        _publish(work / _LIB_NAME, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _publish(built: Path, out: Path) -> None:
    """Copy ``built`` to ``out`` (fsync, then rename), then record its size and SHA-256 beside it."""
    digest = hashlib.sha256()
    size = 0
    with files.replacing(out) as tmp:
        with open(built, "rb") as src, open(tmp, "r+b") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
                size += len(chunk)
    record = {"file": _LIB_NAME, "size": size, "sha256": digest.hexdigest()}
    files.write_atomically(out.with_name(_RECORD_NAME), json.dumps(record, indent=1) + "\n")


def _open_checked(folder: Path) -> tuple[int | None, str]:
    """(descriptor of the library in ``folder``, "") when it matches its record, else (None, why not)."""
    library = folder / _LIB_NAME
    try:
        record = json.loads(trust.read_file(folder / _RECORD_NAME, limit=4096))
        size, sha256 = int(record["size"]), str(record["sha256"])
    except FileNotFoundError:
        if not os.path.lexists(library):
            return None, _MISSING
        return None, f"it has no {_RECORD_NAME} (its size and SHA-256): an interrupted build, or an older release's"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"its record is unusable ({exc})"
    try:
        fd, st = trust.open_file(library, limit=_MAX_LIBRARY_BYTES)
    except FileNotFoundError:
        return None, _MISSING
    except OSError as exc:
        return None, str(exc)
    if st.st_size != size:
        os.close(fd)
        return None, f"{st.st_size} bytes where {size} were built (truncated or overwritten)"
    digest = hashlib.sha256()
    while chunk := os.read(fd, 1 << 20):
        digest.update(chunk)
    if digest.hexdigest() != sha256:
        os.close(fd)
        return None, "its SHA-256 differs from the one recorded when it was built (overwritten or damaged)"
    return fd, ""


def _library_folder(torch_mod, compiler: str) -> Path:
    flavour = "-asan" if asan_enabled() else ""
    return cache_dir() / f"sim-{torch_mod.__version__}{flavour}-{_build_key(torch_mod, compiler)}"


def checked_library(torch_mod) -> tuple[int, Path]:
    """A descriptor of this torch's library, checked against its record (built or rebuilt when needed), and its path.

    The caller closes the descriptor.
    """
    compiler = _compiler()
    folder = _library_folder(torch_mod, compiler)
    target = folder / _LIB_NAME
    fd, why = _open_checked(folder)
    if fd is not None:
        return fd, target
    reason = trust.check_folder(folder, shared=False)
    if reason is not None:
        raise SimulatorBuildError(f"cannot use {folder} for the simulated device's library: {reason}")
    try:
        lock = trust.open_lock(folder / ".lock")
    except OSError as exc:
        raise SimulatorBuildError(f"cannot take the build lock of the simulated device: {exc}") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        fd, why = _open_checked(folder)  # another process may have built it while this one waited
        if fd is not None:
            return fd, target
        started = time.monotonic()
        if why == _MISSING:
            note = "building the simulated Neuron device for torch {} (first use only, about 20 s)..."
        else:
            note = f"the simulated device's library {target} fails its check ({why}): rebuilding it for torch {{}}..."
        sys.stderr.write(f"accelerate-neuron: {note.format(torch_mod.__version__)}\n")
        sys.stderr.flush()
        _compile(torch_mod, compiler, target)
        logger.info("built %s in %.1f s", target, time.monotonic() - started)
        fd, why = _open_checked(folder)
        if fd is None:
            raise SimulatorBuildError(f"the simulated device's library just built in {folder} fails its check: {why}")
        return fd, target
    finally:
        os.close(lock)


def library_path(torch_mod) -> Path:
    """Path of the checked library for this torch, building it when missing or failing its check."""
    fd, path = checked_library(torch_mod)
    os.close(fd)
    return path


def load(torch_mod) -> ctypes.CDLL:
    """Load the native library into this process (registers the kernels): the very file that passed the check."""
    fd, path = checked_library(torch_mod)
    try:
        # The descriptor, not the name: what was checked is what is loaded. (torch.ops.load_library would
        # resolve the name first; its only extra is RTLD_GLOBAL, given here.)
        by_descriptor = f"/proc/self/fd/{fd}"
        name = by_descriptor if os.path.exists(by_descriptor) else str(path)
        lib = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
    finally:
        os.close(fd)
    torch_mod.ops.loaded_libraries.add(str(path))
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
