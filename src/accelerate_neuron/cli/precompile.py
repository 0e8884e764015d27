"""``accelerate-neuron precompile [--jobs N] -- CMD ...``: fill the NEFF cache before the job runs."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from .. import costs, precompile_token, settings
from ..compile_cache import keys
from ._children import Terminated, Tree, sigterm_raises
from ._common import (
    CliError,
    add_cost_options,
    add_device_options,
    add_json_option,
    counting,
    duration,
    plural,
    print_json,
)

DEFAULT_CORES = 4
#: More workers than this only multiply the host memory each one needs for its copy of the model.
MAX_JOBS = 64
_LOG_TAIL = 60

DESCRIPTION = """\
Run CMD in a warm-up mode that compiles every graph the plugin's bucket
policies make reachable for what CMD does, without generating or training for
real, so the real run finds them all in the NEFF cache:

  generate(): one prefill and one decode step per (prompt bucket, batch bucket,
    cache bucket) the script's calls reach; the call returns a stand-in of the
    real length (the prompt, then pad tokens);
  Trainer: the Trainer's own steps (forward, backward, optimizer) on one batch
    per length bucket the dataloaders reach, weights restored afterwards;
    evaluate() / predict() likewise; nothing is written to the output folder.

Everything else CMD does happens: a file it writes its results to gets the
stand-ins (guard it with accelerate_neuron.is_warming_up()).

--jobs N runs N copies of CMD; each compiles every N-th shape (in the order the
script meets them), so CMD must meet the same shapes in the same order every
time (fixed prompts, a seeded dataset). Shapes already in the cache are loaded,
not compiled: running precompile again compiles nothing new.

With a launcher as CMD (torchrun, accelerate launch: the counterpart of
neuron_parallel_compile), each rank warms up as it would run: it meets its own
shard of the data and warms the shapes it meets, and a graph the ranks share
compiles once (the other ranks load it from the NEFF cache). --jobs then
defaults to 1; --jobs N runs N launches at once (N x ranks processes), each on
its own 1/N of the visible cores and its own rendezvous port.

Without Trainium, CMD runs on the simulated Neuron device and fills the
simulated NEFF cache (TORCH_NEURONX_NEFF_CACHE_DIR); on a Trainium host it runs
on the real device and torch-neuronx fills its own cache. --target names the
chip the entries are for (trn1, trn2, trn3: part of every cache key). With a
remote cache (ACCELERATE_NEURON_REMOTE_CACHE), graphs another host compiled are
fetched instead of compiled, and what the workers compile is published for
the fleet; --manifest FILE lists the entries the job needs, for
`accelerate-neuron cache pull --manifest FILE` on the hosts that run it."""

EPILOG = """\
examples:
  accelerate-neuron precompile -- python generate.py
  accelerate-neuron precompile --jobs 4 -- python train.py --epochs 3
  accelerate-neuron precompile --json -- python serve.py > precompile.json
  accelerate-neuron precompile -- torchrun --nproc_per_node 2 train.py
  accelerate-neuron precompile -- accelerate launch train.py
  ACCELERATE_NEURON_REMOTE_CACHE=s3://bucket/neff \
    accelerate-neuron precompile --target trn2 --manifest job.json -- python train.py

CMD's output is kept out of the way (shown if a worker fails). The exit code is
0 when every worker succeeded, else the first failing worker's. SIGTERM or
Ctrl-C ends every worker and every process it started (a launcher's ranks too)."""


def default_jobs() -> int:
    """One worker per CPU this process may use, at most 8 (each worker holds its own copy of the model)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 8))


def worker_count(jobs: int | None, kind: str | None) -> int:
    """The workers a run starts: ``--jobs`` when given; else one for a launch (``kind``: its launcher), which
    already runs one process per core (a second launch at once needs as many cores again); else
    :func:`default_jobs`."""
    return jobs or (1 if kind else default_jobs())


_WORKERS = f"a number of worker processes from 1 to {MAX_JOBS}"
job_count = counting(_WORKERS, MAX_JOBS, f"expected {_WORKERS}")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "precompile",
        help="fill the NEFF cache ahead of a job: compile every shape its generate()/Trainer calls reach",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--jobs",
        "-j",
        type=job_count,
        default=None,
        metavar="N",
        help=f"workers compiling in parallel (default: the CPUs available, at most 8, here {default_jobs()}; "
        "1 when CMD is a launcher)",
    )
    p.add_argument(
        "--target",
        choices=keys.TARGETS,
        help=f"the chip the entries are compiled for (sets {keys.TARGET_ENV}; default: this host's, trn2 when "
        "simulated)",
    )
    p.add_argument(
        "--manifest",
        metavar="FILE",
        help="write the entries the job needs (keys and key inputs) to FILE, for `accelerate-neuron cache pull`",
    )
    add_device_options(p, cores=DEFAULT_CORES, cores_help="simulated NeuronCores per worker when there is no Trainium")
    add_cost_options(p)
    add_json_option(p, "the summary")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command to warm up")
    p.set_defaults(run=run, parser=p)


# ------------------------------------------------------------------ progress


@dataclass
class Progress:
    """What the workers reported so far (their JSON-lines file), and the bar drawn from it."""

    path: Path
    jobs: int
    seconds_per_graph: float
    offset: int = 0
    # Each process (worker, rank) numbers the shapes it meets: (shard, rank, index) -> event
    found: dict[tuple[int, int, int], dict[str, Any]] = field(default_factory=dict)
    by_shard: dict[int, list[tuple[int, int, str]]] = field(default_factory=dict)
    done: dict[tuple[int, int, str, int], float] = field(default_factory=dict)
    #: Each process's latest graph lookups by outcome (compiled / remote / disk / memory), from its done events.
    lookups: dict[tuple[int, int], dict[str, int]] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    bar: Any = None
    stream: TextIO = sys.stderr
    last_line: str = ""

    def read(self) -> None:
        try:
            with open(self.path, encoding="utf-8") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
        except FileNotFoundError:
            return
        complete, _, _ = chunk.rpartition("\n")  # a line is only read once it is whole
        if not complete:
            return
        self.offset += len(complete.encode()) + 1
        for line in complete.splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            self._take(event)

    def _take(self, event: dict[str, Any]) -> None:
        # Under a launcher a worker is several processes, told apart by their rank.
        index, kind = event.get("index"), event.get("kind", "")
        shard, rank = int(event.get("shard", 0)), int(event.get("rank", 0))
        if event.get("event") == "found" and isinstance(index, int):
            self.found.setdefault((shard, rank, index), event)
            self.by_shard.setdefault(shard, []).append((rank, index, json.dumps([kind, event.get("shape")])))
        elif event.get("event") == "done" and isinstance(index, int):
            self.done[(shard, rank, kind, index)] = float(event.get("seconds", 0.0))
            if isinstance(event.get("lookups"), dict):
                self.lookups[(shard, rank)] = {str(k): int(v) for k, v in event["lookups"].items()}

    def shapes(self) -> dict[str, dict[str, Any]]:
        """Distinct shapes met by any rank of any worker (ranks meeting one shape share its graphs)."""
        out: dict[str, dict[str, Any]] = {}
        for event in self.found.values():
            out.setdefault(json.dumps([event.get("kind", ""), event.get("shape")]), event)
        return out

    def warmed(self) -> set[str]:
        """The distinct shapes some process has warmed."""
        out = set()
        for shard, rank, _kind, index in self.done:
            event = self.found.get((shard, rank, index))
            if event is not None:
                out.add(json.dumps([event.get("kind", ""), event.get("shape")]))
        return out

    def pending_graphs(self) -> int:
        warmed = self.warmed()
        return sum(int(e.get("graphs", 1)) for sig, e in self.shapes().items() if sig not in warmed)

    def graphs(self) -> dict[str, int]:
        """Graphs compiled and fetched from the remote cache so far, over every process (simulated device)."""
        total = {"compiled": 0, "fetched": 0, "loaded": 0}
        for counts in self.lookups.values():
            total["compiled"] += counts.get("compiled", 0)
            total["fetched"] += counts.get("remote", 0)
            total["loaded"] += counts.get("disk", 0)
        return total

    def eta(self) -> str:
        """Compile time left on Trainium by the cost model (cold: every pending graph compiled), over the workers."""
        return duration(self.pending_graphs() * self.seconds_per_graph / self.jobs)

    def show(self) -> None:
        total, finished = len(self.shapes()), len(self.warmed())
        graphs = self.graphs()
        done = (
            f"graphs {graphs['compiled']} compiled, {graphs['fetched']} fetched, {graphs['loaded']} loaded, "
            f"~{self.pending_graphs()} remaining; "
            if self.lookups
            else ""
        )
        text = (
            f"{finished}/{total} shapes warmed; {done}Trainium compile left ~{self.eta()} (cost model, "
            f"{self.jobs} worker(s))"
        )
        if self.bar is not None:
            self.bar.total = max(total, 1)
            self.bar.n = finished
            graphs = self.graphs()
            self.bar.set_postfix_str(
                f"{graphs['compiled']} compiled, {graphs['fetched']} fetched, ~{self.pending_graphs()} left; "
                f"ETA on Trainium ~{self.eta()}",
                refresh=False,
            )
            self.bar.refresh()
        elif text != self.last_line and finished:
            print(f"accelerate-neuron: {text}", file=self.stream, flush=True)
        self.last_line = text

    def disagreement(self) -> str | None:
        """Workers that met different shapes (a script that is not deterministic): the split then misses shapes."""
        orders = {shard: sorted(items) for shard, items in self.by_shard.items()}
        if len({json.dumps(v) for v in orders.values()}) <= 1:
            return None
        sizes = ", ".join(f"worker {s}: {len(v)}" for s, v in sorted(orders.items()))
        return (
            f"the workers met different shapes ({sizes}): CMD does not meet the same shapes in the same order every "
            "run (random prompts or an unseeded shuffle?), so some shapes may not be compiled. Seed it, or use "
            "--jobs 1."
        )


def _bar(stream: TextIO) -> Any:
    """A progress bar on a terminal: huggingface_hub's tqdm, which HF_HUB_DISABLE_PROGRESS_BARS=1 turns off."""
    if not stream.isatty():
        return None
    from huggingface_hub.utils import are_progress_bars_disabled, tqdm

    if are_progress_bars_disabled():
        return None  # the progress lines instead
    return tqdm(total=1, desc="precompile", unit="shape", file=stream, dynamic_ncols=True)


# ------------------------------------------------------------------ workers


def _command(args: argparse.Namespace) -> list[str]:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        args.parser.error(
            "missing the command to warm up after '--', e.g. accelerate-neuron precompile -- python train.py"
        )
    if command[0].endswith(".py"):
        command = [sys.executable, *command]
    return command


def launcher(command: Sequence[str]) -> str | None:
    """``"torchrun"`` or ``"accelerate launch"`` when CMD is a launcher (each of its ranks then warms up), else None."""
    name = Path(command[0]).name
    module = command[command.index("-m") + 1] if name.startswith("python") and "-m" in command[:-1] else None
    if name == "torchrun" or module in ("torch.distributed.run", "torch.distributed.launch"):
        return "torchrun"
    if (name == "accelerate" and command[1:2] == ["launch"]) or name == "accelerate-launch":
        return "accelerate launch"
    if module == "accelerate.commands.launch" or (
        module == "accelerate.commands.accelerate_cli" and "launch" in command
    ):
        return "accelerate launch"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker_cores(jobs: int, cores: int) -> list[str]:
    """With a launcher and several workers: each worker's share of the visible cores (its ranks need their own)."""
    from ..sizes import parse_core_list

    listed = os.environ.get("NEURON_RT_VISIBLE_CORES", "").strip()
    visible = parse_core_list(listed) if listed else list(range(cores))
    per_worker = len(visible) // jobs
    if per_worker < 1:
        raise CliError(
            f"--jobs {jobs} with a launcher runs {jobs} launches at once, each of whose ranks needs its own Neuron "
            f"core, but only {len(visible)} core(s) are visible: use --jobs {max(1, len(visible))} or fewer"
        )
    shares = [visible[i * per_worker : (i + 1) * per_worker] for i in range(jobs)]
    return [",".join(map(str, share)) for share in shares]


def _launch_command(command: list[str], kind: str | None, jobs: int) -> list[str]:
    """CMD as each worker runs it: several ``accelerate launch`` at once each pick a free port (``--main_process_port
    0``) unless CMD names one. (torchrun gets its port from PET_MASTER_PORT, see :func:`_worker_env`.)"""
    if (
        kind != "accelerate launch"
        or jobs < 2
        or any(a.startswith(("--main_process_port", "--main-process-port")) for a in command)
    ):
        return command
    at = command.index("launch") + 1 if "launch" in command else 1
    return [*command[:at], "--main_process_port", "0", *command[at:]]


def _worker_env(
    args: argparse.Namespace,
    shard: int,
    jobs: int,
    folder: Path,
    simulated: bool,
    cores: str | None = None,
    token: str = "",
) -> dict[str, str]:
    env = dict(os.environ)
    env[settings.env_name("precompile")] = f"{shard}/{jobs}"
    env[settings.env_name("precompile_token")] = token  # without it a worker runs for real
    env[settings.env_name("precompile_progress")] = str(folder / "progress.jsonl")
    env[settings.env_name("precompile_scratch")] = str(folder / "scratch")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if args.target:
        env[keys.TARGET_ENV] = args.target
    if simulated:
        env[settings.env_name("simulate")] = str(args.cores)
        env[settings.env_name("sim_hbm")] = args.hbm
        env[settings.env_name("report_dir")] = str(folder / "records")
    if cores is not None:  # one of several launches at once: its own cores and rendezvous port
        env["NEURON_RT_VISIBLE_CORES"] = cores
        env["PET_MASTER_PORT"] = str(_free_port())  # torchrun's --master-port, unless CMD passes one
    return env


@dataclass
class Worker:
    shard: int
    proc: subprocess.Popen
    log: Path
    code: int | None = None


def _start(command: list[str], env: dict[str, str], shard: int, folder: Path) -> Worker:
    log = folder / f"worker-{shard}.log"
    with open(log, "wb") as out:
        try:
            proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            raise CliError(f"command not found: {command[0]!r} (precompile runs: {' '.join(command)})", 127) from None
        except PermissionError:
            raise CliError(f"cannot execute {command[0]!r}: permission denied", 126) from None
    return Worker(shard, proc, log)


def _tail(path: Path, lines: int = _LOG_TAIL) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _wait(workers: Sequence[Worker], tree: Tree, progress: Progress) -> None:
    try:
        while any(w.code is None for w in workers):
            for w in workers:
                if w.code is None and w.proc.poll() is not None:
                    w.code = w.proc.returncode
            tree.refresh()  # a launcher's ranks, learned while it runs
            progress.read()
            progress.show()
            time.sleep(0.2)
    except KeyboardInterrupt:
        tree.settle()  # the workers got the terminal's SIGINT too: a moment to end, then the rest is ended
        raise
    except Terminated:
        tree.end()
        raise
    finally:
        for w in workers:
            w.code = w.proc.poll() if w.code is None else w.code
    progress.read()
    progress.show()


# ------------------------------------------------------------------ summary


def _simulated_counts(records_dir: Path) -> dict[str, Any] | None:
    from ._dryrun import load_records

    records = load_records(records_dir)
    if not records:
        return None
    keys: dict[str, str] = {}
    out = {"graphs_compiled": 0, "graphs_cached": 0, "graphs_fetched": 0, "eager_compiled": 0, "eager_cached": 0}
    signatures: set[str] = set()
    for record in records:
        st = record.get("stats", {})
        out["graphs_compiled"] += int(st.get("compiles", 0))
        out["graphs_cached"] += int(st.get("compile_cache_hits", 0))
        out["eager_compiled"] += int(st.get("eager_compiles", 0))
        out["eager_cached"] += int(st.get("eager_cache_hits", 0))
        signatures.update(st.get("eager_signature_list", []))
        for graph in st.get("graphs", []):
            out["graphs_fetched"] += graph.get("cache_source") == "remote"
            key = graph.get("cache_key")
            if key:
                keys[key] = "compiled" if graph.get("cache") == "miss" or keys.get(key) == "compiled" else "cached"
    out["graph_keys"] = sorted(keys)
    out["distinct_graphs"] = len(keys)
    out["compile_cache"] = next((r["stats"].get("compile_cache") for r in records if "stats" in r), None)
    out["eager_signature_list"] = sorted(signatures)
    return out


def cache_manifest(counts: dict[str, Any] | None, env: dict[str, str], added: list[str]) -> dict[str, Any]:
    """The entries the job needs, as ``accelerate-neuron cache pull --manifest`` reads them.

    Simulated: every graph and eager op the workers looked up (compiled or found), keyed as the workers keyed
    them (their environment: --target included). Real: the NEFFs torch-neuronx added to its cache meanwhile
    (its keys are its own; a NEFF that was already cached is not listed).
    """
    simulated = counts is not None
    saved = {k: os.environ.get(k) for k in (keys.TARGET_ENV, keys.FLAGS_ENV, keys.LNC_ENV)}
    try:  # the key inputs as the workers saw them
        for name in saved:
            if env.get(name) is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = env[name]
        inputs = keys.key_inputs(simulated)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    if simulated:
        from ..simulator import graph_key

        entries = list(counts["graph_keys"]) + [graph_key.eager_key(s, inputs) for s in counts["eager_signature_list"]]
    else:
        entries = added
    return {"format": 1, "kind": "simulated" if simulated else "neff", "key_inputs": inputs, "entries": entries}


def summarize(
    progress: Progress, workers: Sequence[Worker], counts: dict[str, Any] | None, wall: float, args: argparse.Namespace
) -> dict[str, Any]:
    kinds: dict[str, int] = {}
    shapes = progress.shapes()
    for event in shapes.values():
        kinds[event.get("kind", "?")] = kinds.get(event.get("kind", "?"), 0) + 1
    summary: dict[str, Any] = {
        "jobs": len(workers),
        "shapes": len(shapes),
        "shapes_by_kind": kinds,
        "warmed": len(progress.warmed()),
        "processes": len({(e.get("shard"), e.get("rank", 0)) for e in progress.found.values()}),
        "failed_workers": [w.shard for w in workers if w.code],
        "exit_codes": [w.code for w in workers],
        "wall_seconds": round(wall, 3),
        "warnings": [m for m in [progress.disagreement()] if m],
        "simulated": counts is not None,
    }
    if counts is not None:
        paid = costs.estimate(
            counts["graphs_compiled"], counts["eager_compiled"], args.compile_seconds, args.eager_seconds
        )
        summary.update({k: v for k, v in counts.items() if k != "eager_signature_list"})
        summary["estimate"] = paid
    return summary


def render(summary: dict[str, Any]) -> str:
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(summary["shapes_by_kind"].items())) or "none"
    lines = [
        f"precompile: {plural(summary['shapes'], 'shape')} found ({kinds}), {summary['warmed']} warmed by "
        f"{plural(summary['jobs'], 'worker')} in {summary['wall_seconds']:.1f} s",
    ]
    if summary["simulated"]:
        est = summary["estimate"]
        lines += [
            f"  graphs: {summary['graphs_compiled']} compiled now, {summary['graphs_cached']} already cached "
            f"({summary['graphs_fetched']} of them fetched from the remote cache; {summary['distinct_graphs']} "
            "distinct)",
            f"  eager signatures: {summary['eager_compiled']} compiled now, {summary['eager_cached']} already cached",
            f"  estimated Trainium compile time paid now: ~{duration(est['seconds'])}, which the real run saves "
            f"({costs.describe(est)})",
        ]
        cache = summary.get("compile_cache") or {}
        if cache.get("dir"):
            lines.append(f"  simulated NEFF cache: {cache['dir']} (TORCH_NEURONX_NEFF_CACHE_DIR moves it)")
        if cache.get("remote"):
            remote = cache["remote"]
            state = (
                f"down: {remote['down']}"
                if remote.get("down")
                else "read-only"
                if remote["read_only"]
                else "read-write"
            )
            lines.append(f"  remote cache: {remote['url']} ({state}; the workers publish what they compiled at exit)")
    else:
        lines.append("  compiled by torch-neuronx into its own NEFF cache (TORCH_NEURONX_NEFF_CACHE_DIR)")
    for failed in summary["failed_workers"]:
        lines.append(f"  worker {failed} FAILED (exit code {summary['exit_codes'][failed]})")
    manifest = summary.get("cache_manifest")
    if manifest is not None:
        inputs = manifest["key_inputs"]
        lines.append(
            f"  cache manifest: {len(manifest['entries'])} entries for target {inputs['target']}, LNC {inputs['lnc']}"
            + (f", NEURON_CC_FLAGS {inputs['neuron_cc_flags']!r}" if inputs["neuron_cc_flags"] else "")
            + (f" (written to {summary['manifest_file']})" if summary.get("manifest_file") else "")
        )
    lines += [f"  warning: {w}" for w in summary["warnings"]]
    return "\n".join(lines)


def _real_entries() -> set[str]:
    """The keys in torch-neuronx's NEFF cache folder (to list what a precompile on Trainium added)."""
    from ..simulator import neff_cache

    root = Path(os.environ.get(neff_cache.CACHE_DIR_ENV, "").strip() or neff_cache.REAL_DEFAULT_DIR)
    return {p.stem for p in root.glob("??/??/*.neff") if not p.is_symlink()}


def run(args: argparse.Namespace) -> int:
    from .. import device

    command = _command(args)
    kind = launcher(command)
    jobs = worker_count(args.jobs, kind)
    simulated = device.kind() != "real"
    if simulated and device.torch_neuronx_installed():
        from ..simulator import _real_torch_neuronx_present

        if _real_torch_neuronx_present():
            # A real torch-neuronx without a device: its compile-only mode is the path, but no documented switch
            # for it is known here (see docs/compile-cache.md), and the simulator never shadows a real backend.
            raise CliError(
                "this host has a real torch-neuronx but no Neuron device: precompiling through torch-neuronx's "
                "compile-only mode is not supported yet, and the simulator does not run beside a real torch-neuronx. "
                "Run precompile in an environment without torch-neuronx (simulated entries), or on Trainium."
            )
    before = set() if simulated else _real_entries()
    shares: list[str | None] = [None] * jobs
    if kind and jobs > 1:
        shares = list(_worker_cores(jobs, args.cores if simulated else device.device_count()))
        command = _launch_command(command, kind, jobs)
    with tempfile.TemporaryDirectory(prefix="accelerate-neuron-precompile-") as tmp:
        folder = Path(tmp)
        (folder / "scratch").mkdir(mode=0o700)
        token = precompile_token.write(folder / "scratch")  # the proof a worker checks; gone when the run ends
        progress = Progress(folder / "progress.jsonl", jobs, args.compile_seconds)
        progress.bar = None if args.json else _bar(sys.stderr)
        started = time.perf_counter()
        workers: list[Worker] = []
        tree = Tree()
        try:
            with sigterm_raises():
                for shard in range(jobs):
                    env = _worker_env(args, shard, jobs, folder, simulated, shares[shard], token)
                    workers.append(_start(command, env, shard, folder))
                    tree.add(workers[-1].proc)
                _wait(workers, tree, progress)
        finally:
            if any(w.code is None for w in workers):
                tree.end(grace=0)
                for w in workers:
                    w.code = w.proc.wait() if w.code is None else w.code
            if progress.bar is not None:
                progress.bar.close()
        wall = time.perf_counter() - started
        counts = _simulated_counts(folder / "records") if simulated else None
        summary = summarize(progress, workers, counts, wall, args)
        added = [] if simulated else sorted(_real_entries() - before)
        if counts is not None or not simulated:
            summary["cache_manifest"] = cache_manifest(counts, _worker_env(args, 0, 1, folder, simulated), added)
            if args.manifest:
                from ..files import write_atomically

                write_atomically(args.manifest, json.dumps(summary["cache_manifest"], sort_keys=True) + "\n")
                summary["manifest_file"] = args.manifest
        failures = [(w, _tail(w.log)) for w in workers if w.code]
    for w, tail in failures:
        print(
            f"accelerate-neuron: precompile worker {w.shard} ({' '.join(command)}) exited with {w.code}:",
            file=sys.stderr,
        )
        print(tail, file=sys.stderr)
    if args.json:
        print_json(summary)
    else:
        print(render(summary))
    if failures:
        code = failures[0][0].code or 1
        return 128 + (-code) if code < 0 else code
    return 0
