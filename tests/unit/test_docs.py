"""The documentation stays honest: README.md and docs/*.md name only flags the
parser defines, document every flag it defines, name only `python -m` modules
that exist and `make` targets the Makefile has, link only to files that exist,
and the README stays a front door (at most README_MAX_LINES lines).

Plain text checks: no subprocess, nothing built."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

import pytest

from miles_plugins.optimizers.nvme_stream import add_arguments

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
# The README is the front door; everything else belongs in docs/ (issue "The house").
README_MAX_LINES = 250

# The streaming flags, as the docs spell them; a glob such as `--stream-optimizer-state-*`
# ends in "-*" and is not a flag.
STREAMING_FLAG = re.compile(
    r"--(?:no-)?stream-optimizer-state-[a-z0-9]+(?:-[a-z0-9]+)*(?![a-z0-9*-])"
    r"|--offload-train-disk-(?:dir|chunk-mb)(?![a-z0-9-])"
)
# `python -m X`, `python3 -m X`, `torchrun [...] -m X`: a module name, possibly wrapped onto the next line.
PYTHON_M = re.compile(r"\b(?:python3?|torchrun(?:\s+--[\w-]+(?:=\S+)?)*)\s+-m\s+([A-Za-z_][\w.]*[A-Za-z0-9_])")
MAKE_TARGET = re.compile(r"\bmake\s+([a-z][\w-]*)")
# Fenced blocks and inline code spans: where commands are written.
CODE = re.compile(r"```.*?```|`[^`]+`", re.DOTALL)
# [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def _code(page: Path) -> str:
    return "\n".join(CODE.findall(_text(page)))


def _parser_flags() -> set[str]:
    parser = add_arguments(argparse.ArgumentParser())
    return {flag for action in parser._actions for flag in action.option_strings if flag not in ("-h", "--help")}


def _makefile_targets() -> set[str]:
    targets: set[str] = set()
    for line in (ROOT / "Makefile").read_text(encoding="utf-8").splitlines():
        match = re.match(r"^([A-Za-z0-9_.\- ]+):(?!=)", line)
        if match and not line.startswith("\t"):
            targets.update(match.group(1).split())
    return targets


def test_the_pages_exist() -> None:
    assert README.is_file()
    assert DOCS, "docs/*.md: no pages"


def test_every_documented_flag_exists_in_the_parser() -> None:
    defined = _parser_flags()
    unknown = {
        f"{page.relative_to(ROOT)}: {flag}"
        for page in PAGES
        for flag in STREAMING_FLAG.findall(_text(page))
        if flag not in defined
    }
    assert not unknown, f"flags the docs name but add_arguments does not define: {sorted(unknown)}"


def test_every_parser_flag_is_documented() -> None:
    documented = {flag for page in PAGES for flag in STREAMING_FLAG.findall(_text(page))}
    missing = _parser_flags() - documented
    assert not missing, f"flags add_arguments defines that README.md and docs/ never name: {sorted(missing)}"


def test_every_python_m_command_names_an_importable_module() -> None:
    modules = {(page.relative_to(ROOT), module) for page in PAGES for module in PYTHON_M.findall(_code(page))}
    assert modules, "no `python -m` command found: the pattern no longer matches the docs"
    missing = sorted(
        f"{page}: python -m {module}" for page, module in modules if importlib.util.find_spec(module) is None
    )
    assert not missing, f"modules the docs run that cannot be found: {missing}"


def test_every_make_target_exists() -> None:
    targets = _makefile_targets()
    named = {(page.relative_to(ROOT), target) for page in PAGES for target in MAKE_TARGET.findall(_code(page))}
    assert {"demo", "test"} <= {target for _, target in named}
    missing = sorted(f"{page}: make {target}" for page, target in named if target not in targets)
    assert not missing, f"make targets the docs name that the Makefile lacks: {missing}"


def test_the_readme_is_a_front_door() -> None:
    lines = len(_text(README).splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    prose = re.sub(r"```.*?```", "", _text(page), flags=re.DOTALL)
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*$", prose, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_points_to_a_file(page: Path) -> None:
    broken = []
    for target in LINK.findall(_text(page)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        linked = (page.parent / path) if path else page
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to missing files or headings: {broken}"
