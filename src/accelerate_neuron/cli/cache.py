"""``accelerate-neuron cache ls|du|pull|push|prune|verify``: the local and the remote compile caches."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._common import CliError, duration, print_json, size

DESCRIPTION = """\
Inspect and move compile cache entries between this host's NEFF cache and the
remote cache a fleet shares (ACCELERATE_NEURON_REMOTE_CACHE, or --remote URL:
file:///shared/folder, s3://bucket/prefix, hf://datasets/org/repo).

  ls      the entries: key, size, age, which job, model and bucket made them
  du      entries and bytes, local and remote
  pull    fetch entries into the local cache before a job (from a precompile
          manifest, named keys, or --all of this host's key inputs)
  push    publish local entries to the remote (all, a manifest's, or named keys)
  prune   remove entries older than --older-than, or the oldest beyond --max-size
  verify  check every entry's checksum; exit code 1 if one is damaged

Which local cache: the simulated device's (TORCH_NEURONX_NEFF_CACHE_DIR, default
~/.cache/accelerate_neuron/simulated-neff-cache) unless a real torch-neuronx is
installed, then torch-neuronx's (TORCH_NEURONX_NEFF_CACHE_DIR, default
/tmp/neff_cache); --kind chooses. Simulated entries are kept apart from real
NEFFs on the remote, and a real host never fetches them."""

EPILOG = """\
examples:
  accelerate-neuron cache ls
  accelerate-neuron cache du --json
  accelerate-neuron cache push --remote s3://my-bucket/neff
  accelerate-neuron cache pull --manifest precompile.json
  accelerate-neuron cache prune --remote s3://my-bucket/neff --older-than 30d --max-size 200GiB
  accelerate-neuron cache verify --remote file:///fsx/neff-cache"""

KINDS = ("simulated", "neff")
#: A file a publisher is still writing may look orphaned for a moment: only older ones are pruned.
ORPHAN_GRACE_SECONDS = 3600.0
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
#: A precompile manifest is a list of keys: larger than this it is not one.
MAX_MANIFEST_BYTES = 64 * 2**20


def age(text: str) -> float:
    """argparse type: ``30d``, ``12h``, ``90m``, ``3600`` (seconds)."""
    match = _DURATION.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration; expected e.g. 30d, 12h, 90m or 3600s")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def byte_size(text: str) -> int:
    from ..sizes import parse_size

    try:
        return parse_size(text, what="size")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "cache",
        help="the local and remote compile caches: ls, du, pull, push, prune, verify",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(run=lambda args: _usage(p), parser=p)
    actions = p.add_subparsers(title="actions", metavar="ACTION", dest="action")

    def action(name: str, help: str) -> argparse.ArgumentParser:
        sub = actions.add_parser(name, help=help, description=help)
        sub.add_argument("--remote", metavar="URL", help="the remote cache (default: ACCELERATE_NEURON_REMOTE_CACHE)")
        sub.add_argument("--local-dir", metavar="DIR", help="the local cache folder (default: the NEFF cache in use)")
        sub.add_argument("--kind", choices=KINDS, help="simulated entries or real NEFFs (default: what this host runs)")
        sub.add_argument("--json", action="store_true", help="print the result as one JSON line (stdout)")
        sub.set_defaults(parser=sub)
        return sub

    def where(sub: argparse.ArgumentParser, default: str) -> None:
        group = sub.add_mutually_exclusive_group()
        group.add_argument("--local", dest="where", action="store_const", const="local", help="the local cache only")
        group.add_argument("--remote-only", dest="where", action="store_const", const="remote", help="the remote only")
        sub.set_defaults(where=default)

    sub = action("ls", "list the entries: key, size, age, which job, model and bucket made them")
    where(sub, "both")
    sub.set_defaults(run=run_ls)
    sub = action("du", "entries and bytes of the local and remote caches")
    where(sub, "both")
    sub.set_defaults(run=run_du)
    sub = action("pull", "fetch entries from the remote into the local cache (verified)")
    sub.add_argument("keys", nargs="*", metavar="KEY", help="entries to fetch")
    sub.add_argument("--manifest", metavar="FILE", help="a precompile manifest (precompile --manifest, or --json)")
    sub.add_argument("--all", action="store_true", help="every entry made with this host's key inputs")
    sub.set_defaults(run=run_pull)
    sub = action("push", "publish local entries to the remote (default: all)")
    sub.add_argument("keys", nargs="*", metavar="KEY", help="entries to publish")
    sub.add_argument("--manifest", metavar="FILE", help="only the entries a precompile manifest lists")
    sub.set_defaults(run=run_push)
    sub = action("prune", "remove old entries, or the oldest beyond a size")
    where(sub, "remote")
    sub.add_argument("--older-than", type=age, metavar="AGE", help="remove entries older than this (30d, 12h, 90m)")
    sub.add_argument("--max-size", type=byte_size, metavar="SIZE", help="then remove the oldest until under SIZE")
    sub.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    sub.set_defaults(run=run_prune)
    sub = action("verify", "check every entry's checksum (exit code 1 if one is damaged)")
    where(sub, "both")
    sub.add_argument("--delete", action="store_true", help="remove the damaged entries")
    sub.set_defaults(run=run_verify)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


# ------------------------------------------------------------------ where the caches are


def _kind(args: argparse.Namespace) -> str:
    if args.kind:
        return args.kind
    from .. import device

    kind = device.kind()
    if kind == "real":
        return "neff"
    if kind is None and device.torch_neuronx_installed():
        from ..simulator import _real_torch_neuronx_present

        return "neff" if _real_torch_neuronx_present() else "simulated"
    return "simulated"


def _remote(args: argparse.Namespace, needed: bool = True) -> Any:
    from ..compile_cache.remote import Remote, open_filesystem
    from ..compile_cache.urls import RemoteURLError, parse

    text = args.remote
    if text is None:
        from .. import settings

        try:
            chosen = settings.get("remote_cache")
        except ValueError as exc:
            raise CliError(str(exc)) from None
        if chosen is None:
            if needed:
                raise CliError("no remote cache: pass --remote URL or set ACCELERATE_NEURON_REMOTE_CACHE")
            return None
        text = chosen.url
    try:
        url = parse(text)
        return Remote(url, open_filesystem(url))
    except RemoteURLError as exc:
        raise CliError(str(exc)) from None


@dataclass
class Local:
    """The local cache folder of one kind: ``root/ab/cd/<key>.neff``."""

    kind: str
    root: Path

    def path(self, key: str) -> Path:
        return self.root / key[:2] / key[2:4] / f"{key}.neff"

    def keys(self) -> Iterator[tuple[str, Path]]:
        """Entries, without following symlinks (``os.walk`` does not descend into symlinked folders)."""
        from ..compile_cache.remote import KEY

        if not self.root.is_dir():
            return
        for folder, _dirs, files in sorted(os.walk(self.root)):
            for name in sorted(files):
                path = Path(folder) / name
                if name.endswith(".neff") and KEY.match(name[:-5]) and path.parent.parent.parent == self.root:
                    yield name[:-5], path

    def describe(self, key: str, path: Path) -> dict[str, Any]:
        """What ``ls`` shows of a local entry; for a simulated one, its verified body."""
        st = path.lstat()
        row: dict[str, Any] = {"key": key, "size": st.st_size, "created": st.st_mtime, "where": "local"}
        if self.kind == "simulated":
            row.update(_simulated_body(key, path))
        return row


def _simulated_body(key: str, path: Path) -> dict[str, Any]:
    from ..compile_cache.remote import CorruptEntry, read_local
    from ..simulator import neff_cache
    from ..simulator.remote_tier import MAX_ENTRY_BYTES

    try:
        body = neff_cache.decode(key, read_local(path, MAX_ENTRY_BYTES))
    except (neff_cache.DamagedEntry, CorruptEntry, OSError) as exc:
        return {"error": str(exc)}
    out = {k: body[k] for k in ("what", "signature", "inputs", "made_by", "key_inputs", "created") if k in body}
    if "kind" in body:
        out["graph_kind"] = body["kind"]
    return out


def _local(args: argparse.Namespace, kind: str, writable: bool = False) -> Local:
    from ..simulator import neff_cache

    if args.local_dir:
        root = Path(args.local_dir).expanduser()
    elif kind == "simulated":
        cache = neff_cache.from_environment(warn=False)
        if cache.root is None:
            raise CliError(f"the simulated NEFF cache is off ({cache.off_reason}): pass --local-dir DIR")
        root = cache.root
    else:
        root = Path(os.environ.get(neff_cache.CACHE_DIR_ENV, "").strip() or neff_cache.REAL_DEFAULT_DIR)
    if writable and kind == "simulated":
        cache = neff_cache.NeffCache(root)
        if not cache.persistent:  # a folder that may be a real NEFF cache is never written by the simulator's side
            raise CliError(f"cannot write simulated entries into {root}: {cache.off_reason}")
    return Local(kind, root)


def _key_inputs(kind: str) -> dict[str, Any]:
    from ..compile_cache import keys

    return keys.key_inputs(kind == "simulated")


# ------------------------------------------------------------------ progress


class _Bar:
    """huggingface_hub's tqdm on a terminal (HF_HUB_DISABLE_PROGRESS_BARS=1 turns it off), else nothing."""

    def __init__(self, total: int, desc: str, quiet: bool) -> None:
        self.bar = None
        if not quiet and sys.stderr.isatty():
            from huggingface_hub.utils import are_progress_bars_disabled, tqdm

            if not are_progress_bars_disabled():
                self.bar = tqdm(total=total, desc=desc, unit="entry", file=sys.stderr, dynamic_ncols=True)

    def step(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def over(self, items: Iterable[Any]) -> Iterator[Any]:
        try:
            for item in items:
                yield item
                self.step()
        finally:
            self.close()


# ------------------------------------------------------------------ ls / du


def _remote_rows(remote: Any, kind: str, quiet: bool) -> list[dict[str, Any]]:
    rows = []
    for listed in _Bar(0, "listing", quiet).over(remote.entries(kind)):
        row: dict[str, Any] = {"key": listed.key, "where": "remote", "fingerprint": listed.fingerprint}
        if listed.manifest is None:
            row["error"] = listed.error
        else:
            m = listed.manifest
            row.update(
                {k: m[k] for k in ("size", "created", "what", "graph_kind", "signature", "inputs", "made_by") if k in m}
            )
            row["key_inputs"] = m.get("key_inputs")
            row["host"] = m.get("host")
        rows.append(row)
    return rows


def _made_by(row: dict[str, Any]) -> str:
    made = row.get("made_by") or {}
    parts = [str(made[k]) for k in ("job", "model") if made.get(k)]
    if made.get("shape"):
        parts.append(json.dumps(made["shape"], sort_keys=True, separators=(",", ":")))
    return " ".join(parts) or "-"


def _what(row: dict[str, Any]) -> str:
    if row.get("error"):
        return f"DAMAGED: {row['error']}"
    if row.get("what") == "eager":
        return f"eager {row.get('signature', '')}"
    if row.get("what") == "graph":
        shapes = ",".join(
            "x".join(map(str, i.get("shape", []))) for i in (row.get("inputs") or [])[:3] if isinstance(i, dict)
        )
        return f"graph {row.get('graph_kind', '')} [{shapes}{', ...' if len(row.get('inputs') or []) > 3 else ''}]"
    return "NEFF"


def run_ls(args: argparse.Namespace) -> int:
    kind = _kind(args)
    out: dict[str, Any] = {"kind": kind}
    if args.where in ("local", "both"):
        local = _local(args, kind)
        out["local_dir"] = str(local.root)
        out["local"] = [local.describe(k, p) for k, p in _Bar(0, "local", args.json).over(local.keys())]
    if args.where in ("remote", "both"):
        remote = _remote(args, needed=args.where == "remote")
        if remote is not None:
            out["remote_url"] = remote.url.shown
            out["remote"] = _remote_rows(remote, kind, args.json)
    if args.json:
        print_json(out)
        return 0
    now = time.time()
    for where in ("local", "remote"):
        if where not in out:
            continue
        rows = out[where]
        place = out["local_dir"] if where == "local" else out["remote_url"]
        print(f"{where} ({place}): {len(rows)} entries, {size(sum(r.get('size', 0) for r in rows))}")
        for row in rows:
            created = row.get("created")
            old = duration(now - created) if isinstance(created, int | float) else "?"
            print(f"  {row['key']}  {size(row.get('size')):>10}  {old:>12} ago  {_what(row)}  ({_made_by(row)})")
    return 0


def _totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by_what: dict[str, int] = {}
    for row in rows:
        what = row.get("what") or ("damaged" if row.get("error") else "neff")
        by_what[what] = by_what.get(what, 0) + 1
    return {"entries": len(rows), "bytes": sum(int(r.get("size") or 0) for r in rows), "by_what": by_what}


def run_du(args: argparse.Namespace) -> int:
    kind = _kind(args)
    out: dict[str, Any] = {"kind": kind}
    if args.where in ("local", "both"):
        local = _local(args, kind)
        rows = [local.describe(k, p) for k, p in _Bar(0, "local", args.json).over(local.keys())]
        out["local"] = {"dir": str(local.root), **_totals(rows)}
    if args.where in ("remote", "both"):
        remote = _remote(args, needed=args.where == "remote")
        if remote is not None:
            rows = _remote_rows(remote, kind, args.json)
            blobs = remote.blobs()
            out["remote"] = {
                "url": remote.url.shown,
                **_totals(rows),
                "blobs": len(blobs),
                "blob_bytes": sum(b["size"] for b in blobs.values()),
                "fingerprints": sorted({r["fingerprint"] for r in rows}),
            }
    if args.json:
        print_json(out)
        return 0
    for where in ("local", "remote"):
        if where in out:
            d = out[where]
            place = d.get("dir") or d.get("url")
            kinds = ", ".join(f"{n} {w}" for w, n in sorted(d["by_what"].items())) or "empty"
            extra = f"; {d['blobs']} blobs, {size(d['blob_bytes'])} stored" if where == "remote" else ""
            print(f"{where:<7} {place}: {d['entries']} entries ({kinds}), {size(d['bytes'])}{extra}")
    return 0


# ------------------------------------------------------------------ pull / push


def _manifest(path: str) -> dict[str, Any]:
    """A precompile manifest: ``precompile --manifest FILE``, or its ``--json`` summary (which holds one)."""
    from ..compile_cache.remote import KEY

    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_MANIFEST_BYTES + 1)
        text = data.decode().strip()
        try:
            doc = json.loads(text)
        except ValueError:  # precompile --json output captured with other lines: its summary is the last one
            doc = json.loads(text.splitlines()[-1] if text else "")
    except (OSError, ValueError, IndexError) as exc:
        raise CliError(f"cannot read the precompile manifest {path}: {exc}") from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise CliError(f"{path} is larger than {MAX_MANIFEST_BYTES} bytes: not a precompile manifest")
    if isinstance(doc, dict) and isinstance(doc.get("cache_manifest"), dict):
        doc = doc["cache_manifest"]
    entries = doc.get("entries") if isinstance(doc, dict) else None
    if (
        not isinstance(entries, list)
        or doc.get("kind") not in KINDS
        or not all(isinstance(k, str) and KEY.match(k) for k in entries)
        or not isinstance(doc.get("key_inputs"), dict)
    ):
        raise CliError(
            f"{path} is not a precompile manifest: expected a JSON object with 'kind', 'key_inputs' and 'entries' "
            "(written by accelerate-neuron precompile --manifest FILE, or its --json summary)"
        )
    return doc


def _keys_wanted(args: argparse.Namespace, kind: str) -> tuple[list[str], dict[str, Any]]:
    from ..compile_cache.remote import check_key

    inputs = _key_inputs(kind)
    keys: list[str] = []
    if args.manifest:
        doc = _manifest(args.manifest)
        if doc["kind"] != kind:
            raise CliError(
                f"{args.manifest} lists {doc['kind']} entries and this host's cache holds {kind} ones "
                "(--kind chooses); simulated entries are never served to a real backend"
            )
        keys, inputs = list(doc["entries"]), doc["key_inputs"]
    try:
        keys += [check_key(k) for k in args.keys]
    except ValueError as exc:
        raise CliError(str(exc)) from None
    return list(dict.fromkeys(keys)), inputs


def run_pull(args: argparse.Namespace) -> int:
    from ..compile_cache import keys as key_inputs
    from ..compile_cache.remote import CorruptEntry

    kind = _kind(args)
    remote = _remote(args)
    local = _local(args, kind, writable=True)
    wanted, inputs = _keys_wanted(args, kind)
    fingerprint = key_inputs.fingerprint(inputs)
    if args.all:
        wanted += [x.key for x in remote.entries(kind) if x.fingerprint == fingerprint and x.key not in wanted]
    if not wanted:
        raise CliError("nothing to pull: name keys, pass --manifest FILE (from precompile), or --all")
    result: dict[str, Any] = {"fetched": [], "already_local": [], "missing": [], "refused": {}}
    for key in _Bar(len(wanted), "pull", args.json).over(wanted):
        dest = local.path(key)
        if (
            dest.is_file()
            and not dest.is_symlink()
            and (kind != "simulated" or "error" not in _simulated_body(key, dest))
        ):
            result["already_local"].append(key)
            continue
        try:
            found = remote.fetch(kind, fingerprint, key, dest)
        except CorruptEntry as exc:
            result["refused"][key] = str(exc)
            continue
        except OSError as exc:
            raise CliError(f"cannot read the remote cache {remote.url.shown}: {exc}") from None
        result["fetched" if found else "missing"].append(key)
    summary = {
        "remote": remote.url.shown,
        "local_dir": str(local.root),
        "fingerprint": fingerprint,
        **{k: len(v) for k, v in result.items()},
        "refused_entries": result["refused"],
        "missing_entries": result["missing"],
    }
    if args.json:
        print_json(summary)
    else:
        print(
            f"pull from {remote.url.shown} into {local.root}: {summary['fetched']} fetched, "
            f"{summary['already_local']} already local, {summary['missing']} not in the remote, "
            f"{summary['refused']} refused (damaged)"
        )
        for key, why in result["refused"].items():
            print(f"  refused {key}: {why}")
    return 1 if result["refused"] else 0


def run_push(args: argparse.Namespace) -> int:
    from ..compile_cache import keys as key_inputs

    kind = _kind(args)
    remote = _remote(args)
    local = _local(args, kind)
    wanted, inputs = _keys_wanted(args, kind)
    present = dict(local.keys())
    keys = wanted or list(present)
    if remote.url.local:
        os.makedirs(remote.root, mode=0o755, exist_ok=True)  # push starts a shared folder; a job never creates one
    result: dict[str, Any] = {"published": 0, "already_there": 0, "not_local": [], "failed": {}}
    for key in _Bar(len(keys), "push", args.json).over(keys):
        path = present.get(key)
        if path is None:
            result["not_local"].append(key)
            continue
        meta: dict[str, Any] = {"key_inputs": inputs, "made_by": {"job": "accelerate-neuron cache push"}}
        if kind == "simulated":
            body = _simulated_body(key, path)
            if "error" in body:
                result["failed"][key] = body["error"]
                continue
            meta.update({k: v for k, v in body.items() if k != "created"})
            meta["made_by"] = {**(body.get("made_by") or {}), "job": (body.get("made_by") or {}).get("job", "push")}
        try:
            done = remote.publish(kind, key_inputs.fingerprint(meta["key_inputs"]), key, path, meta)
        except Exception as exc:  # one entry's failure is reported; the others are still pushed
            result["failed"][key] = f"{type(exc).__name__}: {exc}"
            continue
        result["published" if done else "already_there"] += 1
    summary = {
        "remote": remote.url.shown,
        "local_dir": str(local.root),
        "published": result["published"],
        "already_there": result["already_there"],
        "not_local": result["not_local"],
        "failed": result["failed"],
    }
    if args.json:
        print_json(summary)
    else:
        print(
            f"push from {local.root} to {remote.url.shown}: {result['published']} published, "
            f"{result['already_there']} already there, {len(result['not_local'])} not in the local cache, "
            f"{len(result['failed'])} failed"
        )
        for key, why in result["failed"].items():
            print(f"  failed {key}: {why}")
    return 1 if result["failed"] else 0


# ------------------------------------------------------------------ prune / verify


def _choose(rows: list[tuple[str, float, int]], older_than: float | None, max_size: int | None) -> list[str]:
    """Which of (id, created, bytes) to remove: older than ``older_than`` seconds, then oldest beyond ``max_size``."""
    now = time.time()
    doomed = [r[0] for r in rows if older_than is not None and now - r[1] > older_than]
    kept = sorted((r for r in rows if r[0] not in set(doomed)), key=lambda r: r[1])
    if max_size is not None:
        total = sum(r[2] for r in kept)
        for r in kept:
            if total <= max_size:
                break
            doomed.append(r[0])
            total -= r[2]
    return doomed


def run_prune(args: argparse.Namespace) -> int:
    if args.older_than is None and args.max_size is None:
        args.parser.error("say what to prune: --older-than AGE and/or --max-size SIZE")
    kind = _kind(args)
    out: dict[str, Any] = {"dry_run": args.dry_run}
    if args.where in ("local", "both"):
        local = _local(args, kind)
        rows = []
        for key, path in local.keys():
            st = path.lstat()
            rows.append((key, st.st_mtime, st.st_size))
        doomed = set(_choose(rows, args.older_than, args.max_size))
        for key in _Bar(len(doomed), "prune local", args.json).over(sorted(doomed)):
            if not args.dry_run:
                local.path(key).unlink(missing_ok=True)
        out["local"] = {
            "dir": str(local.root),
            "removed": len(doomed),
            "freed": sum(r[2] for r in rows if r[0] in doomed),
            "kept": len(rows) - len(doomed),
        }
    if args.where in ("remote", "both"):
        out["remote"] = _prune_remote(args, kind, _remote(args))
    if args.json:
        print_json(out)
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for where in ("local", "remote"):
        if where in out:
            d = out[where]
            extra = f", {d['orphans']} unreferenced blob(s) and temp file(s)" if where == "remote" else ""
            print(
                f"{where} {d.get('dir') or d.get('url')}: {verb} {d['removed']} entries{extra}, "
                f"{size(d['freed'])}; {d['kept']} kept"
            )
    return 0


def _prune_remote(args: argparse.Namespace, kind: str, remote: Any) -> dict[str, Any]:
    listed = list(remote.entries(kind))
    blobs = remote.blobs()
    rows = [
        (x.path, float(x.manifest.get("created") or 0), int(x.manifest["size"]))
        for x in listed
        if x.manifest is not None
    ]
    doomed = set(_choose(rows, args.older_than, args.max_size))
    keep = {x.manifest["sha256"] for x in listed if x.manifest is not None and x.path not in doomed}
    # Blobs are shared by both kinds: the other kind's are kept.
    keep |= {x.manifest["sha256"] for k in KINDS if k != kind for x in remote.entries(k) if x.manifest is not None}
    freed = {x.manifest["sha256"] for x in listed if x.manifest is not None and x.path in doomed}
    now = time.time()
    # An unreferenced blob may be a publish in flight (blob first, manifest next): only old ones are removed.
    orphans = [
        b["path"]
        for sha, b in blobs.items()
        if sha not in keep and (sha in freed or b["mtime"] is None or now - b["mtime"] > ORPHAN_GRACE_SECONDS)
    ]
    stale = [p for p, mtime in remote.temporaries() if mtime is not None and now - mtime > ORPHAN_GRACE_SECONDS]
    targets = sorted(doomed) + orphans + stale
    for path in _Bar(len(targets), "prune remote", args.json).over(targets):
        if not args.dry_run:
            try:
                remote.delete(path)
            except FileNotFoundError:
                pass
    return {
        "url": remote.url.shown,
        "removed": len(doomed),
        "orphans": len(orphans) + len(stale),
        "freed": sum(blobs[p.rsplit("/", 1)[-1]]["size"] for p in orphans if p.rsplit("/", 1)[-1] in blobs),
        "kept": len(rows) - len(doomed),
    }


def run_verify(args: argparse.Namespace) -> int:
    from ..compile_cache.remote import CorruptEntry

    kind = _kind(args)
    out: dict[str, Any] = {"kind": kind}
    bad = 0
    if args.where in ("local", "both"):
        local = _local(args, kind)
        damaged: dict[str, str] = {}
        entries = list(local.keys())
        for key, path in _Bar(len(entries), "verify local", args.json).over(entries):
            if kind == "simulated":
                error = _simulated_body(key, path).get("error")
            else:  # a NEFF carries no checksum of ours: an empty or non-regular file is all that shows damage
                st = path.lstat()
                error = None if st.st_size > 0 and path.is_file() else "empty or not a regular file"
            if error:
                damaged[key] = error
                if args.delete:
                    path.unlink(missing_ok=True)
        out["local"] = {
            "dir": str(local.root),
            "checked": len(entries),
            "damaged": damaged,
            "checksummed": kind == "simulated",
        }
        bad += len(damaged)
    if args.where in ("remote", "both"):
        remote = _remote(args, needed=args.where == "remote")
        if remote is not None:
            damaged = {}
            listed = list(remote.entries(kind))
            with tempfile.TemporaryDirectory(prefix="accelerate-neuron-verify-") as tmp:
                for x in _Bar(len(listed), "verify remote", args.json).over(listed):
                    error = x.error
                    if error is None:
                        try:
                            remote.fetch(kind, x.fingerprint, x.key, Path(tmp) / "entry")
                        except CorruptEntry as exc:
                            error = str(exc)
                    if error:
                        damaged[x.key] = error
                        if args.delete:
                            remote.delete(x.path)
                            if x.manifest is not None:  # a blob that does not match its name serves no one
                                with contextlib.suppress(FileNotFoundError):
                                    remote.delete(remote.blob_path(x.manifest["sha256"]))
            shutil.rmtree(tmp, ignore_errors=True)
            out["remote"] = {"url": remote.url.shown, "checked": len(listed), "damaged": damaged}
            bad += len(damaged)
    if args.json:
        print_json(out)
    else:
        for where in ("local", "remote"):
            if where in out:
                d = out[where]
                note = "" if d.get("checksummed", True) else " (real NEFFs carry no checksum: only emptiness is seen)"
                print(
                    f"{where} {d.get('dir') or d.get('url')}: {d['checked']} checked, {len(d['damaged'])} damaged{note}"
                )
                for key, why in d["damaged"].items():
                    print(f"  DAMAGED {key}: {why}{' (deleted)' if args.delete else ''}")
    return 1 if bad else 0
