"""The tree passes ruff (ruff.toml at the repository root); CI runs it as part of the suite."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def test_the_tree_passes_ruff():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"ruff check . found problems (fix them, or mark a deliberate one with " \
                                 f"'# noqa: CODE - why'):\n{proc.stdout}{proc.stderr}"


#: The decision core: protocol -> encoding -> head/features -> answers, plus what they share. None
#: of it may import a backend, the server, vLLM's worker side or vLLM itself.
CORE = ("schema/protocol", "schema/dialects", "schema/openai_decisions", "schema/encoding", "model/head", "model/features",
        "schema/answers", "schema/errors", "schema/state_keys", "contract", "model/layout")
ABOVE = ("clef_vllm.backends", "clef_vllm.server", "clef_vllm.worker", "clef_vllm.api", "clef_vllm.bench", "clef_vllm.plugin",
         "vllm")


def _imports(path) -> set[str]:
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            names.add(f"clef_vllm.{node.module or ''}".rstrip("."))
    return names


def test_the_decision_core_imports_no_layer_above_it():
    package = REPO / "vllm_plugin" / "clef_vllm"
    for name in CORE:
        found = _imports(package / f"{name}.py")
        bad = sorted(m for m in found if any(m == a or m.startswith(a + ".") for a in ABOVE))
        assert not bad, f"clef_vllm/{name}.py imports {bad}: the core must not depend on backends, server or vLLM"


@functools.lru_cache(maxsize=None)
def _defined_names(path) -> frozenset[str]:
    """Names bound at the top level of a module (definitions, assignments, imports); each module parsed once."""
    import ast

    names = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
                names.update(ast.literal_eval(node.value))    # lazily provided names (module __getattr__)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.If, ast.Try)):
            names.update(_defined_names_in(node))
    return frozenset(names)


def _defined_names_in(node) -> set[str]:
    import ast

    out = set()
    for child in ast.walk(node):
        if isinstance(child, (ast.FunctionDef, ast.ClassDef)):
            out.add(child.name)
        elif isinstance(child, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in child.names)
        elif isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
            out.add(child.id)
    return out


def test_every_clef_vllm_import_in_the_repository_resolves():
    """Scripts outside the suite (long runners, GPU checks, benchmarks) import the package too, often
    inside functions: a module or name moved by a refactor must not leave one of them broken."""
    import ast

    package = REPO / "vllm_plugin"
    files = []
    for folder, dirs, names in os.walk(REPO):      # hidden folders (.git, .venv-quant) and build outputs not walked
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("build", "node_modules")]
        files += [Path(folder, n) for n in names if n.endswith(".py") and not n.startswith(".")]
    broken = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("clef_vllm"):
                modules, names = [node.module], [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                modules, names = [a.name for a in node.names if a.name.startswith("clef_vllm")], []
            else:
                continue
            for module in modules:
                base = package / module.replace(".", "/")
                source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
                if not source.exists():
                    broken.append(f"{path.relative_to(REPO)}:{node.lineno}: no module {module}")
                    continue
                defined = _defined_names(source)
                for name in names:
                    if name != "*" and name not in defined and not (base / name).with_suffix(".py").exists() \
                            and not (base / name).is_dir():
                        broken.append(f"{path.relative_to(REPO)}:{node.lineno}: {module} has no {name}")
    assert not broken, "\n".join(broken)


def test_runners_import_only_modules_on_their_own_path():
    """A script run as ``python DIR/x.py`` has DIR on sys.path, not tests/: a long runner or GPU check that
    imports a module of this repository from elsewhere (tests/fuzz/run_long.py imported ``test_fuzz``) only
    fails when someone runs it. Every import of a repository-local module resolves from where the file runs:
    a script (``__main__``) from its own folder, everything else under tests/ from tests/ or its folder."""
    import ast

    roots = [REPO / d for d in ("tests", "bench", "scripts")]
    files = [p for root in roots for p in root.rglob("*.py") if "__pycache__" not in p.parts]
    local = {p.stem for p in files} | {p.parent.name for p in files if p.name == "__init__.py"} | {
        d.name for root in roots for d in root.iterdir() if d.is_dir() and any(d.glob("*.py"))}
    broken = []
    for path in files:
        text = path.read_text()
        script = "__main__" in text and not path.name.startswith("test_")
        search = [path.parent] if script else [path.parent, REPO / "tests"]
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top not in local:
                    continue
                if not any((d / f"{top}.py").exists() or (d / top / "__init__.py").exists() or (d / top).is_dir()
                           for d in search):
                    broken.append(f"{path.relative_to(REPO)}:{node.lineno}: imports {module}, which is not on its "
                                  f"path when {'run as a script' if script else 'imported by the tests'}")
    assert not broken, "\n".join(broken)
