"""Apply, revert and inspect the patch series on a Megatron-LM tree.

A *tree* is any directory that holds ``megatron/training/checkpointing.py``: a
Megatron-LM git checkout, or a plain directory such as the site-packages (or
an unpacked copy) of a megatron-core >= 0.17 wheel. The ``megatron/`` directory
itself is accepted too. Patches go through ``git apply``, which needs no
repository and applies a whole series atomically: on a conflict nothing is
changed, and the report names the patch and the hunk that failed.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from megatron_hooks.checkpoint import HOOKS_NAME, PATCH_MARKER
from megatron_hooks.contract import HOOK_ABI_VERSION

TARGET = "megatron/training/checkpointing.py"
DEFAULT_PATCHES_DIR = Path(__file__).resolve().parent.parent / "patches"

# Other optimizer-state hooks a tree may carry: a name only they use -> where they come
# from. Patching over them would save the state twice or under the wrong name.
FOREIGN_HOOK_SIGNATURES = {"_nvme_state_store": "radixark/Megatron-LM #63 (attribute _nvme_state_store)"}


class PatchError(RuntimeError):
    """The series cannot be applied or reverted; nothing was changed."""


@dataclass
class Status:
    """What a tree carries."""

    root: Path
    state: str  # "unpatched", "patched", "other-abi", "partial", "foreign"
    abi: int | None = None
    hooks: dict[str, bool] = field(default_factory=dict)  # "save"/"load" -> call found in that function
    detail: str = ""

    def describe(self) -> str:
        text = {
            "unpatched": "not patched",
            "patched": f"patched (hook ABI {self.abi}; this version speaks {HOOK_ABI_VERSION})",
            "other-abi": f"patched for hook ABI {self.abi}, this version speaks {HOOK_ABI_VERSION}",
            "partial": "partially patched: " + self.detail,
            "foreign": "carries other optimizer-state hooks: " + self.detail,
        }[self.state]
        return f"{self.root / TARGET}: {text}"


def find_root(megatron_dir: str | os.PathLike) -> Path:
    """The directory that contains ``megatron/training/checkpointing.py``."""
    given = Path(megatron_dir).resolve()
    for root in (given, given.parent):
        if (root / TARGET).is_file() and (root == given or given.name == "megatron"):
            return root
    if (given / "megatron" / "core").is_dir() or (given.name == "megatron" and (given / "core").is_dir()):
        raise PatchError(
            f"{given} has megatron/core but no megatron/training: megatron-core wheels before 0.17 do not ship "
            "the training package the hooks go into; use a Megatron-LM checkout or a megatron-core >= 0.17 wheel"
        )
    raise PatchError(f"no {TARGET} under {given}: point --megatron-dir at a Megatron-LM tree")


def series(patches_dir: str | os.PathLike = DEFAULT_PATCHES_DIR) -> list[Path]:
    """The patch files in ``series`` order."""
    directory = Path(patches_dir)
    try:
        names = [line.strip() for line in (directory / "series").read_text().splitlines()]
    except FileNotFoundError:
        raise PatchError(f"no series file in {directory}") from None
    return [directory / name for name in names if name and not name.startswith("#")]


def _hook_calls(tree: ast.Module) -> dict[str, bool]:
    """Whether save_checkpoint / load_checkpoint call the hooks' save / load."""
    found = {"save": False, "load": False}
    wanted = {"save_checkpoint": "save", "load_checkpoint": "load"}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in wanted:
            for call in ast.walk(node):
                if (
                    isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Attribute)
                    and isinstance(call.func.value, ast.Name)
                    and call.func.value.id == HOOKS_NAME
                    and call.func.attr == wanted[node.name]
                ):
                    found[wanted[node.name]] = True
    return found


def _marker(tree: ast.Module) -> int | None:
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == PATCH_MARKER for t in node.targets)
            and isinstance(node.value, ast.Constant)
        ):
            return node.value.value
    return None


def status(megatron_dir: str | os.PathLike) -> Status:
    root = find_root(megatron_dir)
    try:
        source = (root / TARGET).read_text()
    except UnicodeDecodeError as exc:
        raise PatchError(f"{root / TARGET} is not UTF-8 text ({exc.reason}); is this a Megatron-LM tree?") from None
    tree = ast.parse(source, filename=str(root / TARGET))
    abi, hooks = _marker(tree), _hook_calls(tree)
    for signature, origin in FOREIGN_HOOK_SIGNATURES.items():
        if signature in source and abi is None:
            return Status(root, "foreign", hooks=hooks, detail=origin)
    if abi is None and not any(hooks.values()):
        return Status(root, "unpatched", hooks=hooks)
    missing = [f"no {PATCH_MARKER} marker"] if abi is None else []
    missing += [f"no {name} hook in {name}_checkpoint" for name, present in hooks.items() if not present]
    if missing:
        return Status(root, "partial", abi, hooks, "; ".join(missing))
    return Status(root, "patched" if abi == HOOK_ABI_VERSION else "other-abi", abi, hooks)


def _git_apply(root: Path, patches: list[Path], *flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # Never let git find an enclosing repository of a plain directory (it would then
    # resolve the patch's paths against that repository's root).
    env["GIT_CEILING_DIRECTORIES"] = str(root.parent)
    return subprocess.run(
        ["git", "apply", *flags, *map(str, patches)], cwd=root, env=env, capture_output=True, text=True
    )


def _hunks(patch: Path) -> list[str]:
    return [line for line in patch.read_text().splitlines() if line.startswith("@@")]


def _subject(patch: Path) -> str:
    match = re.search(r"^Subject: (?:\[PATCH[^\]]*\] )?(.*(?:\n .*)*)", patch.read_text(), re.MULTILINE)
    return " ".join(match.group(1).split()) if match else patch.name


def _explain_failure(root: Path, patches: list[Path], reverse: bool) -> str:
    """Find the first patch that does not apply (after the ones before it) and say why."""
    flags = ("--check", "-v") + (("-R",) if reverse else ())
    for count in range(1, len(patches) + 1):
        result = _git_apply(root, patches[:count], *flags)
        if result.returncode != 0:
            patch = patches[count - 1]
            failed = re.findall(r"error: while searching for:\n(.*?)(?:\nerror:|\Z)", result.stderr, re.DOTALL)
            where = re.findall(r"error: patch failed: (\S+)", result.stderr)
            detail = f"the context it expects was not found{' at ' + where[-1] if where else ''}:\n" + "\n".join(
                "      | " + line for line in (failed[-1].splitlines() if failed else [])
            )
            return (
                f"patch {patch.name} ({_subject(patch)}) does not apply; hunks: {', '.join(_hunks(patch))}\n"
                f"    {detail}\n    git apply said: {result.stderr.strip().splitlines()[-1]}"
            )
    return "git apply failed for the series as a whole"


def _apply_series(root: Path, patches: list[Path], reverse: bool) -> None:
    """Apply (or reverse) the whole series or nothing.

    ``git apply`` is atomic per patch file only, so the series is checked as a
    whole first, and the file is restored should the real run still fail.
    """
    flags = ("-R",) if reverse else ()
    for patch in patches:
        touched = set(re.findall(r"^\+\+\+ b/(\S+)$", patch.read_text(), re.MULTILINE))
        if touched != {TARGET}:
            raise PatchError(f"{patch} touches {sorted(touched)}; the series may touch only {TARGET}")
    what = "revert cleanly from" if reverse else "apply to"
    if _git_apply(root, patches, "--check", *flags).returncode != 0:
        raise PatchError(
            f"the patch series does not {what} {root}; nothing was changed.\n  "
            + _explain_failure(root, patches, reverse)
        )
    target = root / TARGET
    original = target.read_bytes()
    result = _git_apply(root, patches, *flags)
    if result.returncode != 0:
        try:
            if target.read_bytes() != original:  # a read-only tree: git changed nothing
                target.write_bytes(original)
        except OSError as exc:
            raise PatchError(
                f"git apply failed ({result.stderr.strip()}), and restoring {target} failed too "
                f"({exc.strerror}): check that file by hand"
            ) from exc
        raise PatchError(f"git apply failed after its check passed; {target} is unchanged: {result.stderr.strip()}")


def apply(megatron_dir: str | os.PathLike, patches_dir: str | os.PathLike = DEFAULT_PATCHES_DIR) -> str:
    """Apply the series; a tree already carrying it is left as it is. Returns what happened."""
    current = status(megatron_dir)
    if current.state == "patched":
        return f"already applied: {current.describe()}"
    if current.state != "unpatched":
        raise PatchError(
            f"{current.describe()}. Not applying on top of it: two sets of hooks would save the state twice "
            "or under the wrong name. Revert those hooks first (for this project's own series: "
            "`python -m megatron_hooks revert`)"
        )
    patches = series(patches_dir)
    _apply_series(current.root, patches, reverse=False)
    after = status(current.root)
    if after.state != "patched":
        raise PatchError(f"the series applied but the tree does not read as patched: {after.describe()}")
    return f"applied {len(patches)} patches: {after.describe()}"


def revert(megatron_dir: str | os.PathLike, patches_dir: str | os.PathLike = DEFAULT_PATCHES_DIR) -> str:
    """Remove the series; an unpatched tree is left as it is. Returns what happened."""
    current = status(megatron_dir)
    if current.state == "unpatched":
        return f"nothing to revert: {current.describe()}"
    if current.state == "foreign":
        raise PatchError(f"{current.describe()}: those hooks are not this series; revert them where they came from")
    patches = list(reversed(series(_series_dir_for(current, patches_dir))))
    _apply_series(current.root, patches, reverse=True)
    return f"reverted {len(patches)} patches: {status(current.root).describe()}"


def _series_dir_for(current: Status, patches_dir: str | os.PathLike) -> Path:
    """The series a tree was patched with: this version's, or for a tree patched for an
    earlier ABI, that ABI's (kept under ``abi<N>/`` so that an upgrade can revert it)."""
    earlier = Path(patches_dir) / f"abi{current.abi}"
    if current.state == "other-abi" and (earlier / "series").is_file():
        return earlier
    return Path(patches_dir)
