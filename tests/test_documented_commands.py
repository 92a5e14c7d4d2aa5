"""Every shell and Python example in README.md and docs/*.md, run as written against the demo checkpoint.

Convention: a fenced block whose language is ``bash``, ``sh``, ``shell``, ``console`` or ``python``
carries a tag after the language:

* ```` ```bash run ```` / ```` ```python run ````: run here, in a scratch folder, with this venv's
  ``bin`` first on ``PATH``, against a demo server (``clef-systemone``, reference backend) that
  listens where the examples say, ``localhost:8000`` / ``127.0.0.1:8000`` (the one rewrite: to
  this server's port). Shell blocks run under ``bash -euo pipefail``. An example fails when it
  exits non-zero, or (shell) when it prints a JSON error body (``{"error": ...}`` or
  ``{"success": false, ...}``), so a ``curl -s`` answered 4xx fails too.
* ```` ```bash skip: REASON ````: not runnable here (a GPU, a real checkpoint, Docker, the
  reader's own values); collected and skipped with REASON.

A block with neither tag fails :func:`test_every_example_is_tagged`: a new example is either run
or says why not.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO, LiveServer

LANGUAGES = ("bash", "sh", "shell", "console", "python")
FENCE = re.compile(r"^```([A-Za-z]+)([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)
DOCUMENTED_PORT = re.compile(r"\b(?:localhost|127\.0\.0\.1):8000\b")


@dataclass(frozen=True)
class Example:
    path: Path
    line: int
    language: str
    tag: str            # "run" or "skip"
    reason: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def examples_in(path: Path) -> list[Example]:
    """The shell and Python blocks of one Markdown file, with their tags ("" when untagged)."""
    text = path.read_text()
    found = []
    for m in FENCE.finditer(text):
        language, info, code = m.group(1), m.group(2).strip(), m.group(3)
        if language not in LANGUAGES:
            continue
        tag, _, reason = info.partition(":")
        tag = tag.strip()
        known = tag in ("run", "skip")
        found.append(Example(path, text.count("\n", 0, m.start()) + 1, language, tag if known else "",
                             reason.strip() if tag == "skip" else "" if known else info, code))
    return found


DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
EXAMPLES = [e for path in DOCUMENTS for e in examples_in(path)]


def json_errors(output: str) -> list[str]:
    """JSON error bodies in ``output`` (the whole of it, or any line of it): OpenAI/SystemOne
    ``{"error": ...}`` and the hosted ``{"success": false, ...}``."""
    found = []
    for chunk in [output, *output.splitlines()]:
        try:
            value = json.loads(chunk)
        except ValueError:
            continue
        if isinstance(value, dict) and ("error" in value or value.get("success") is False):
            found.append(chunk.strip()[:300])
    return found


def run_example(example: Example, url: str, cwd: Path, timeout: float = 120) -> str | None:
    """Run one example against the server at ``url``; ``None`` when it worked, else what went wrong."""
    host = url.split("://", 1)[1]
    code = DOCUMENTED_PORT.sub(host, example.code)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "CLEF_API_KEY": ""}
    if example.language == "python":
        cmd = [sys.executable, "-c", code]
    else:
        cmd = ["bash", "-euo", "pipefail", "-c", code]
    try:
        done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"{example.name}: did not finish within {timeout:g} s"
    if done.returncode != 0:
        return f"{example.name}: exit status {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    if example.language != "python" and (errors := json_errors(done.stdout)):
        return f"{example.name}: printed an error body: {errors[0]}"
    return None


@pytest.fixture(scope="module")
def demo_server(cache_dir):
    """``clef-systemone`` as the README starts it (demo checkpoint; reference backend on this CPU)."""
    server = LiveServer(["--model", "demo", "--backend", "reference"]).wait_ready()
    yield server
    server.stop()


def test_every_example_is_tagged():
    untagged = [f"{e.name} ({e.language} {e.reason!r})" for e in EXAMPLES if not e.tag]
    assert not untagged, "tag each as 'run' or 'skip: REASON' (tests/test_documented_commands.py): " + ", ".join(untagged)
    assert all(e.reason for e in EXAMPLES if e.tag == "skip"), "a skipped example says why"
    assert sum(e.tag == "run" for e in EXAMPLES) >= 5


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_documented_example_runs(example: Example, request, tmp_path):
    if example.tag != "run":
        pytest.skip(example.reason or "untagged (see test_every_example_is_tagged)")
    server = request.getfixturevalue("demo_server")
    problem = run_example(example, server.url, tmp_path)
    assert problem is None, problem


def test_a_broken_example_fails(demo_server, tmp_path):
    """The runner notices what a reader would: a request the server refuses, a command that fails."""
    refused = Example(REPO / "README.md", 0, "bash", "run", "", """curl -s localhost:8000/v1/systemone \\
  -H 'Content-Type: application/json' -d '{"model": "clef-flash", "state": "x", "questions": {}}'""")
    assert "printed an error body" in run_example(refused, demo_server.url, tmp_path)
    hosted = Example(REPO / "README.md", 0, "bash", "run", "", """curl -s localhost:8000/client/v4/accounts/a/ai/run/nope \\
  -H 'Content-Type: application/json' -d '{}'""")
    assert "printed an error body" in run_example(hosted, demo_server.url, tmp_path)
    missing = Example(REPO / "README.md", 0, "bash", "run", "", "clef-systemone --no-such-flag")
    assert "exit status 2" in run_example(missing, demo_server.url, tmp_path)
    failing = Example(REPO / "README.md", 0, "python", "run", "", "from clef_vllm import Nope")
    assert "exit status 1" in run_example(failing, demo_server.url, tmp_path)


def test_tags_are_read_as_documented(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("```bash run\necho hi\n```\n\n```python skip: needs a GPU\nimport vllm\n```\n\n```json\n{}\n```\n"
                   "```bash\nuntagged\n```\n")
    found = examples_in(doc)
    assert [(e.language, e.tag, e.reason, e.line) for e in found] == [
        ("bash", "run", "", 1), ("python", "skip", "needs a GPU", 5), ("bash", "", "", 12)]
