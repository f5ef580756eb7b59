"""The package's shape: sizes a reader can hold in mind, imports that run one way, and
code that says what and why rather than what was measured when (that lives in docs/
and bench/results/)."""

import ast
import pathlib
import re

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "miles_plugins"
MAX_MODULE_LINES, MAX_CLASS_LINES, MAX_FUNCTION_LINES = 400, 300, 60
# A date, a machine, a measurement or a belief: lab notes, which belong in the docs.
LAB_NOTE = re.compile(
    r"20\d\d-\d\d-\d\d|we believe|\bmeasured (on|in) |\bmeasured at \d|\bcall \d\b|\bH[12]00\b|\bin \d+ of \d+ (calls|runs)\b"
)


def _modules() -> dict[str, pathlib.Path]:
    """Dotted name -> file, for every module of the package."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _span(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def test_no_module_class_or_function_is_too_long_to_hold_in_mind():
    too_long = []
    for name, path in _modules().items():
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and _span(node) > MAX_CLASS_LINES:
                too_long.append(f"{name}.{node.name}: class of {_span(node)} lines")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _span(node) > MAX_FUNCTION_LINES:
                too_long.append(f"{name}.{node.name}: function of {_span(node)} lines")
    assert not too_long, "\n".join(too_long)


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The package's modules ``name`` imports, anywhere in its code (a function's import too)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def test_the_package_imports_one_way():
    """No import circle between the package's modules (``formats/fused.py`` and the
    codecs it serves were one: the kernels sit below the formats that use them)."""
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert not circles, f"import circles: {circles}"


def test_code_holds_no_lab_notes():
    notes = [
        f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
        for path in _modules().values()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if LAB_NOTE.search(line)
    ]
    assert not notes, "measurements, dates or machines in code (move them to docs/):\n" + "\n".join(notes)


def test_nothing_outside_tests_imports_them():
    """Tests may use the product; the product and the benches never use the tests."""
    root = PACKAGE.parent
    found = []
    for folder in ("miles_plugins", "megatron_hooks", "bench", "ci"):
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                found += [f"{path.relative_to(root)}: {n}" for n in names if n == "tests" or n.startswith("tests.")]
    assert not found, "\n".join(found)
