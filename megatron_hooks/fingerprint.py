"""Normalized-AST fingerprints of upstream functions, and the table that pins them.

A fingerprint is the SHA-256 (first 16 hex digits) of a function's AST dumped
without positions, with docstrings removed: comments, docstrings, line breaks
and formatting do not change it; any change to what the code does does.

A plugin that reproduces or structurally relies on upstream code declares
:class:`Pin` s: the function, every fingerprint it was validated against (with
the commits and how), and what to recheck when it drifts. The same pins serve
two checks:

- live, at setup (:func:`check_live`): fingerprint the functions of the Megatron
  that is actually imported and refuse to run on an unknown fingerprint;
- static, over a source tree or an unpacked wheel (:func:`check_tree`, the
  ``drift`` command): what the CI matrix runs across Megatron commits.

Plugins register their pins under the ``megatron_hooks.pins`` entry-point group
(a callable or a sequence of :class:`Pin`). No torch here.
"""

from __future__ import annotations

import ast
import hashlib
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

PINS_ENTRY_POINT_GROUP = "megatron_hooks.pins"

# Opt-out for one pin after re-validating it by hand:
# MEGATRON_HOOKS_ALLOW_DRIFT="DistributedOptimizer.step_with_ready_grads,..." (or "*").
ALLOW_DRIFT_ENV = "MEGATRON_HOOKS_ALLOW_DRIFT"


def _strip_docstrings(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
                if isinstance(body[0].value.value, str):
                    node.body = body[1:] or [ast.Pass()]


def _normalized(node: object) -> str:
    """A dump of the AST that is stable across Python versions: fields that are
    empty or None are left out (3.12 added ``type_params=[]`` to every function,
    3.8 ``kind=None`` to every constant), positions are never included."""
    if isinstance(node, ast.AST):
        fields = []
        for name, value in ast.iter_fields(node):
            if value is None or value == [] or name == "type_comment":
                continue
            fields.append(f"{name}={_normalized(value)}")
        return f"{type(node).__name__}({','.join(fields)})"
    if isinstance(node, list):
        return "[" + ",".join(_normalized(v) for v in node) + "]"
    return repr(node)


def fingerprint_node(node: ast.AST) -> str:
    """The fingerprint of one parsed function (the node is not modified)."""
    copy = ast.parse(ast.unparse(node)).body[0]
    _strip_docstrings(copy)
    return hashlib.sha256(_normalized(copy).encode()).hexdigest()[:16]


def find_function(tree: ast.Module, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The definition of ``qualname`` ("Class.method" or "function") at module level."""
    scope: list[ast.stmt] = tree.body
    *outer, name = qualname.split(".")
    for part in outer:
        cls = next((n for n in scope if isinstance(n, ast.ClassDef) and n.name == part), None)
        if cls is None:
            return None
        scope = cls.body
    # The last definition wins, as at run time.
    found = None
    for node in scope:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            found = node
    return found


@dataclass(frozen=True)
class KnownShape:
    """One validated shape of a pinned function."""

    fingerprint: str
    validated_on: tuple[str, ...]  # "core_v0.19.0 5be9626709af (GPU tier)", ...


@dataclass(frozen=True)
class Pin:
    """An upstream function a plugin reproduces or relies on, and its validated shapes."""

    path: str  # relative to the tree root, e.g. "megatron/core/optimizer/distrib_optimizer.py"
    qualname: str  # "DistributedOptimizer._copy_main_params_to_model_params"
    known: tuple[KnownShape, ...]
    recheck: str  # what a person must re-validate when the function drifts
    owner: str = ""  # the plugin code that depends on it

    @property
    def module(self) -> str:
        return self.path[: -len(".py")].replace("/", ".")


@dataclass
class Finding:
    """The outcome of checking one pin against one tree."""

    pin: Pin
    status: str  # "ok", "drift", "missing", "allowed-drift"
    fingerprint: str | None = None
    file: str | None = None
    line: int | None = None
    validated_on: tuple[str, ...] = field(default_factory=tuple)

    @property
    def good(self) -> bool:
        return self.status in ("ok", "allowed-drift")

    def explain(self) -> str:
        pinned = "; ".join(f"{k.fingerprint} on {', '.join(k.validated_on)}" for k in self.pin.known)
        where = f"{self.file}:{self.line}" if self.line else str(self.file)
        if self.status == "missing":
            head = f"{self.pin.qualname} is not defined in {where}"
        else:
            head = f"{self.pin.qualname} at {where} has fingerprint {self.fingerprint}, validated ones: {pinned}"
        return f"{head}. Recheck: {self.pin.recheck}"


def _allowed(qualname: str) -> bool:
    allowed = {s.strip() for s in os.environ.get(ALLOW_DRIFT_ENV, "").split(",") if s.strip()}
    return "*" in allowed or qualname in allowed


def check_file(pin: Pin, file: str) -> Finding:
    """Check one pin against the source file that defines it."""
    try:
        with open(file, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=file)
    except FileNotFoundError:
        return Finding(pin, "missing", file=file)
    node = find_function(tree, pin.qualname)
    if node is None:
        return Finding(pin, "missing", file=file)
    fp = fingerprint_node(node)
    known = next((k for k in pin.known if k.fingerprint == fp), None)
    if known is not None:
        return Finding(pin, "ok", fp, file, node.lineno, known.validated_on)
    status = "allowed-drift" if _allowed(pin.qualname) else "drift"
    return Finding(pin, status, fp, file, node.lineno)


class TreeError(RuntimeError):
    """A directory that holds no Megatron sources."""


def source_root(directory: str | os.PathLike) -> str:
    """The directory holding ``megatron/`` (given it, or ``megatron/`` itself)."""
    given = os.path.abspath(directory)
    if os.path.isdir(os.path.join(given, "megatron", "core")):
        return given
    if os.path.basename(given) == "megatron" and os.path.isdir(os.path.join(given, "core")):
        return os.path.dirname(given)
    raise TreeError(f"no megatron/core under {given}: point --megatron-dir at a Megatron-LM tree or an unpacked wheel")


def check_tree(pins: Iterable[Pin], root: str) -> list[Finding]:
    """Check pins against a source tree or an unpacked wheel rooted at ``root``."""
    return [check_file(pin, os.path.join(root, pin.path)) for pin in pins]


def check_live(pins: Sequence[Pin]) -> list[Finding]:
    """Check pins against the modules actually imported; refuse on drift.

    Raises :class:`DriftError` naming every drifted function (file, line, pinned
    commits, what to recheck). A drift the user opted out of through
    ``MEGATRON_HOOKS_ALLOW_DRIFT`` is logged as an error and let through.
    """
    import importlib

    findings = []
    for pin in pins:
        module = importlib.import_module(pin.module)
        findings.append(check_file(pin, module.__file__))
    for f in findings:
        if f.status == "allowed-drift":
            logger.error(
                "UPSTREAM DRIFT ALLOWED BY %s: %s. Running on code nobody validated automatically.",
                ALLOW_DRIFT_ENV,
                f.explain(),
            )
    bad = [f for f in findings if not f.good]
    if bad:
        raise DriftError(bad)
    return findings


class DriftError(RuntimeError):
    """Upstream code the plugin relies on differs from every validated shape."""

    def __init__(self, findings: Sequence[Finding]) -> None:
        self.findings = list(findings)
        lines = "\n  - ".join(f.explain() for f in findings)
        super().__init__(
            "refusing to run: upstream Megatron code this plugin reproduces or relies on has drifted from "
            f"every validated version:\n  - {lines}\nAfter re-validating a function by hand, set "
            f"{ALLOW_DRIFT_ENV}=<qualname>[,<qualname>...] to run anyway."
        )


def registered_pins() -> list[Pin]:
    """Every pin declared by an installed plugin (entry-point group ``megatron_hooks.pins``)."""
    from importlib.metadata import entry_points

    pins: list[Pin] = []
    for ep in entry_points(group=PINS_ENTRY_POINT_GROUP):
        declared = ep.load()
        pins.extend(declared() if callable(declared) else declared)
    return pins
