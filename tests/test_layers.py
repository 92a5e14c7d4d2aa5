"""The package's layers: every ``clef_vllm`` import (read with ast, nothing imported) goes down the floors or
stays on its own floor, and no set of modules imports itself round in a circle.

The floors, bottom to top, follow a request's data path: small helpers, the wire contract, the model, its
quantization, the memory plan, the front-end/worker settings contract, the code that runs inside vLLM, the
plugin's registration, the backends, the HTTP server and the offline API, and the command-line tools.
Imports inside functions count: a lazy import is still a dependency. Imports under ``if TYPE_CHECKING:`` do
not: they name types for annotations and never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "vllm_plugin" / "clef_vllm"

#: Bottom to top: a module may import its own floor and the floors below it, never one above.
FLOORS = (
    ("version", "util"),
    ("schema",),
    ("model",),
    ("quant",),
    ("plan",),
    ("contract",),
    ("worker",),
    ("plugin",),
    ("backends",),
    ("api", "server"),
    ("tools", "bench", "testing"),
    ("",),                              # the package itself (clef_vllm/__init__.py): its public names
)
FLOOR = {part: level for level, parts in enumerate(FLOORS) for part in parts}

#: The package's root holds at most this many modules; no module is longer than MAX_LINES.
MAX_ROOT_MODULES, MAX_LINES = 8, 600


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def floor_of(module: str) -> int:
    part = module.split(".")[1] if "." in module else ""
    assert part in FLOOR, f"{module}: no floor for clef_vllm.{part} (add it to FLOORS in tests/test_layers.py)"
    return FLOOR[part]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str) -> set[str]:
    """The ``clef_vllm`` modules ``module`` imports (a name imported from a package counts as its module when
    one of that name exists, as the package otherwise)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                   for stmt in block.body for n in ast.walk(stmt)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "clef_vllm")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "clef_vllm":
                continue
            for alias in node.names:
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source)
    found.discard(module)
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def test_every_import_names_a_module_of_the_package():
    unknown = sorted(f"{m} -> {d}" for m, deps in GRAPH.items() for d in deps if d not in MODULES)
    assert not unknown, f"imports of modules that do not exist: {unknown}"


def test_every_module_has_a_floor():
    for module in MODULES:
        floor_of(module)


def test_no_floor_imports_one_above_it():
    upward = sorted(f"{m} (floor {floor_of(m)}) -> {d} (floor {floor_of(d)})"
                    for m, deps in GRAPH.items() for d in deps if floor_of(d) > floor_of(m))
    assert not upward, "lower floors import upper ones:\n" + "\n".join(upward)


def _circles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(GRAPH[node]):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    return out


def test_no_import_circle():
    circles = _circles()
    assert not circles, "modules that import each other round in a circle: " + "; ".join(" <-> ".join(c) for c in circles)


def test_the_model_class_reaches_the_speed_features_through_the_registry():
    fast = sorted(d for d in GRAPH["clef_vllm.worker.model"]
                  if d.startswith("clef_vllm.worker.fast") and d != "clef_vllm.worker.fast.registry")
    assert not fast, f"clef_vllm/worker/model.py imports {fast}: import them from clef_vllm.worker.fast.registry"


def test_the_package_root_stays_small_and_no_module_is_too_long():
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} modules at the package root: {root}"
    long = sorted(f"{module_name(p)}: {n} lines" for p in PACKAGE.rglob("*.py")
                  if (n := len(p.read_text().splitlines())) > MAX_LINES)
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_no_path_hacks():
    """Code finds the package as installed (or through PYTHONPATH), never by editing sys.path."""
    needle = "sys.path." + "insert"
    found = sorted(str(p.relative_to(REPO)) for top in ("vllm_plugin", "tests", "bench", "scripts")
                   for p in (REPO / top).rglob("*.py") if needle in p.read_text())
    assert not found, f"{needle} in {found}"
