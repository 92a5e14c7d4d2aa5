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
