"""The tree passes ruff (ruff.toml at the repository root); CI runs it as part of the suite."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def test_the_tree_passes_ruff():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"ruff check . found problems (fix them, or mark a deliberate one with " \
                                 f"'# noqa: CODE - why'):\n{proc.stdout}{proc.stderr}"


#: The decision core: protocol -> encoding -> head/features -> answers, plus what they share. None
#: of it may import a backend, the server, vLLM's worker side or vLLM itself.
CORE = ("protocol", "encoding", "head", "features", "answers", "errors", "state_keys", "contract", "layout")
ABOVE = ("clef_vllm.backends", "clef_vllm.server", "clef_vllm.worker", "clef_vllm.api", "clef_vllm.bench", "vllm")


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
