"""Run the patch series and the tripwire across the Megatron sources in ``matrix.toml``.

    python -m ci.matrix                          # wheel entries (package registry only)
    python -m ci.matrix --megatron-repo PATH ... # also the git entries, from local clones

For each source it records what the series does (applies, and then re-applying
is a no-op and reverting restores the file byte for byte; or the tree already
carries hooks; or it fails, changing nothing) and whether the tripwire passes,
prints a table, writes it as JSON (``--json``), and exits 1 when any outcome
differs from the expectation written in the matrix.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import sys
import tempfile
import tomllib
from pathlib import Path

from ci.megatron_sources import SourceError, find_commit, git_tree, wheel_tree
from megatron_hooks import fingerprint, patching
from miles_plugins.optimizers.megatron.pins import PINS

MATRIX = Path(__file__).resolve().parent / "matrix.toml"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def patch_outcome(root: Path) -> str:
    """What the series does on the tree at ``root``, exercising apply/re-apply/revert."""
    try:
        current = patching.status(root)
    except patching.PatchError:
        return "absent"
    if current.state != "unpatched":
        try:
            patching.apply(root)
        except patching.PatchError:
            return "already-applied"
        return "already-applied" if current.state == "patched" else f"broken: applied over {current.state} hooks"
    target = current.root / patching.TARGET
    original = _digest(target)
    try:
        patching.apply(root)
    except patching.PatchError:
        return "fail" if _digest(target) == original else "broken: a failed apply changed the file"
    patched = _digest(target)
    ast.parse(target.read_text())  # the patched file must still be valid Python
    if not patching.apply(root).startswith("already applied") or _digest(target) != patched:
        return "broken: re-applying changed the tree"
    patching.revert(root)
    if _digest(target) != original:
        return "broken: revert did not restore the original file"
    return "apply"


def tripwire_outcome(root: Path) -> tuple[str, list[str]]:
    findings = fingerprint.check_tree(PINS, str(root))
    drifted = [f"{f.pin.qualname} ({f.status})" for f in findings if not f.good]
    return ("fires" if drifted else "passes"), drifted


def run_entry(entry: dict, repos: list[str], workdir: Path) -> dict:
    result = {"name": entry["name"], "expected": {"patches": entry["patches"], "tripwire": entry["tripwire"]}}
    dest = workdir / entry["name"].replace(" ", "_").replace("/", "_")
    try:
        if "wheel" in entry:
            result["source"] = f"megatron-core=={entry['wheel']} (wheel)"
            wheel_tree(entry["wheel"], dest)
        else:
            result["source"] = entry["commit"][:12]
            repo = find_commit(repos, entry["commit"])
            if repo is None:
                result["skipped"] = (
                    "no given --megatron-repo holds this commit" if repos else "git entry: no --megatron-repo"
                )
                return result
            git_tree(repo, entry["commit"], dest)
    except SourceError as exc:
        result["error"] = str(exc)
        return result
    result["patches"] = patch_outcome(dest)
    result["tripwire"], result["drifted"] = tripwire_outcome(dest)
    result["ok"] = result["patches"] == entry["patches"] and result["tripwire"] == entry["tripwire"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.matrix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-repo", action="append", default=[], help="a local Megatron-LM clone (repeatable)")
    parser.add_argument("--matrix", default=str(MATRIX))
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    repos = args.megatron_repo + os.environ.get("MEGATRON_REPOS", "").split()
    entries = tomllib.loads(Path(args.matrix).read_text())["entry"]

    with tempfile.TemporaryDirectory(prefix="megatron-matrix-") as workdir:
        results = [run_entry(entry, repos, Path(workdir)) for entry in entries]

    failed = False
    print(f"{'source':<58} {'patches (expected)':<34} {'tripwire (expected)':<24} result")
    for r in results:
        label = f"{r['name']} [{r.get('source', '?')}]"
        if "skipped" in r:
            print(f"{label:<58} {'-':<34} {'-':<24} skipped: {r['skipped']}")
            failed |= bool(repos)  # a clone was given but lacks a commit the matrix names
            continue
        if "error" in r:
            print(f"{label:<58} {'-':<34} {'-':<24} ERROR: {r['error']}")
            failed = True
            continue
        patches = f"{r['patches']} ({r['expected']['patches']})"
        tripwire = f"{r['tripwire']} ({r['expected']['tripwire']})"
        print(f"{label:<58} {patches:<34} {tripwire:<24} {'ok' if r['ok'] else 'MISMATCH'}")
        if r["drifted"]:
            print(f"{'':<58} drifted: {', '.join(r['drifted'])}")
        failed |= not r["ok"]
    ran = sum(1 for r in results if "ok" in r)
    print(f"\n{ran} sources checked, {len(results) - ran} not run; {'FAILED' if failed else 'all as expected'}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
