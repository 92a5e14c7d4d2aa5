"""What a new user meets first, each as they would meet it: missing optional packages said in one
line before any work, the API key honoured by every tool, failed runs exiting non-zero, truthful
messages, exit statuses in ``--help``, a clean start-up log, and README's sample response shaped
like a real one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from clef_vllm.bench.loadgen import parse_headers
from conftest import REPO, LiveServer

KEY = "first-use-key-0123456789"


def python(code: str, *args, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -c code args...`` in a child process, this venv's ``bin`` first on PATH."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PATH": path, **(env or {})})


#: Run a console script's ``main`` with some packages made unimportable (a venv without them).
WITHOUT = """import sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None
from importlib import import_module
module, _, func = sys.argv[2].partition(":")
sys.exit(getattr(import_module(module), func)(sys.argv[3:]))
"""


@pytest.fixture(scope="module")
def keyed_server(cache_dir):
    """``clef-systemone`` as the README starts it (no flags: the demo checkpoint, backend auto), with an
    API key from ``$CLEF_API_KEY`` as docs/operating.md sets one, and every Python warning shown."""
    server = LiveServer([], env={"CLEF_API_KEY": KEY, "PYTHONWARNINGS": "default"}).wait_ready()
    yield server
    server.stop()


def test_clef_load_without_compressed_tensors_is_one_line(tiny_release, tmp_path):
    quantized = tmp_path / "quantized"
    shutil.copytree(tiny_release, quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = json.loads((REPO / "config.json").read_text())["quantization_config"]
    (quantized / "config.json").write_text(json.dumps(config))
    done = python(WITHOUT, "compressed_tensors", "clef_vllm.tools.clef_load:main", quantized)
    assert done.returncode == 1 and done.stdout == "", done
    assert done.stderr.count("\n") == 1 and "compressed-tensors" in done.stderr and "pip install" in done.stderr
    # an unquantized checkpoint needs no compressed-tensors: checked as before
    done = python(WITHOUT, "compressed_tensors", "clef_vllm.tools.clef_load:main", tiny_release, "--skip-values")
    assert done.returncode == 0 and "PASS" in done.stdout, done


def test_sensitivity_scan_checks_matplotlib_before_the_scan(tiny_release, tmp_path):
    result = tmp_path / "scan.json"
    done = python(WITHOUT, "matplotlib", "clef_vllm.tools.sensitivity_scan:main", "--model", tiny_release,
                  "--json", result)
    assert done.returncode == 2 and "matplotlib" in done.stderr and "Traceback" not in done.stderr, done
    assert not result.exists() and "held-out records" not in done.stdout        # nothing was scanned


def test_a_checkpoint_without_tokenizer_json_is_told_so(tiny_release, tmp_path):
    from clef_vllm import Clef
    from clef_vllm.model.checkpoint import CheckpointError

    broken = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_release, broken)
    (broken / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError) as err:
        Clef(broken, backend="reference")
    assert f"no tokenizer.json in {broken} (the release ships the Qwen3.5 tokenizer.json" in str(err.value)
    assert "special token" not in str(err.value)


def test_help_names_every_exit_status():
    done = python("from clef_vllm.server.cli import main; main(['--help'])")
    text = " ".join(done.stdout.split())
    assert done.returncode == 0
    assert re.search(r"Exit status: 0 after a graceful shutdown.*1 when the model fails to load.*2 for bad flags; "
                     r"3 when the server cannot listen \(the port is in use", text), text


def test_a_busy_port_exits_3(keyed_server):
    port = keyed_server.url.rsplit(":", 1)[1]
    done = python("from clef_vllm.server.cli import main; main()", "--port", port, "--model", "demo",
                  "--backend", "reference")
    assert done.returncode == 3, done.stderr[-2000:]


def test_the_startup_example_sends_the_key_and_works(keyed_server):
    log = keyed_server.log()
    example = next(line.strip() for line in log.splitlines() if line.strip().startswith("curl "))
    assert '-H "Authorization: Bearer $CLEF_API_KEY"' in example
    done = subprocess.run(["bash", "-c", example], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "CLEF_API_KEY": KEY})
    assert done.returncode == 0 and set(json.loads(done.stdout)) == {"model", "answers", "usage"}, done.stdout
    # a clean start says nothing alarming (PYTHONWARNINGS=default shows every Python warning)
    assert not re.search(r"warning|Traceback|requires_grad", log, re.IGNORECASE), log


def test_tools_send_the_api_key_and_clef_parity_fails_on_failed_requests(keyed_server, tmp_path):
    assert parse_headers([], {"CLEF_API_KEY": "k1,k2"}) == {"Authorization": "Bearer k1"}
    assert parse_headers(["authorization: Bearer mine"], {"CLEF_API_KEY": "k1"}) == {"authorization": "Bearer mine"}
    assert parse_headers([], {}) == {}
    args = [keyed_server.url, keyed_server.url, "--synthetic", "2", "--synthetic-max-words", "20", "--noise-floor",
            "none", "--no-progress", "-o", tmp_path / "receipt.json"]
    parity = "import sys; from clef_vllm.bench.parity_cli import main; sys.exit(main(sys.argv[1:]))"
    ok = python(parity, *args, env={"CLEF_API_KEY": KEY})
    assert ok.returncode == 0, ok.stderr[-2000:]
    refused = python(parity, *args, env={"CLEF_API_KEY": "not-the-key"})
    assert refused.returncode == 1, refused.stderr[-2000:]
    assert "FAIL: A: 2 of 2 requests failed (first: 401" in refused.stderr
    assert (tmp_path / "receipt.json").exists()                      # the receipt is still written


def test_clef_bench_fails_when_nothing_was_answered(keyed_server, tmp_path):
    """Every request refused (a wrong key): exit 1 without --fail-on-error. (The key it sends is
    parse_headers', tested above; README's CPU sweep, run by test_documented_commands, is the run that works.)"""
    bench = "import sys; from clef_vllm.bench.bench_cli import main; sys.exit(main(sys.argv[1:]))"
    args = [keyed_server.url, "--tokenizer", "demo", "-c", "1", "-n", "2", "--warmup", "0", "--no-progress",
            "-o", tmp_path / "bench.json"]
    refused = python(bench, *args, env={"CLEF_API_KEY": "not-the-key"})
    assert refused.returncode == 1 and "FAIL: 1 point(s) without a single answer" in refused.stderr, refused.stderr


def test_readme_sample_response_has_the_real_shape(keyed_server):
    readme = (REPO / "README.md").read_text()
    section = readme.split("## The protocol in one request", 1)[1]
    request = json.loads(re.search(r"-d '(\{.*?\})'\n```", section, re.S).group(1))
    sample = json.loads(re.search(r"```json\n(.*?)```", section, re.S).group(1))
    real = httpx.post(keyed_server.url + "/v1/systemone", json=request, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}).json()

    def shape(value):
        if isinstance(value, dict):
            return {k: shape(v) for k, v in value.items()}
        return type(value).__name__ if not isinstance(value, (int, float)) or isinstance(value, bool) else "number"

    assert shape(sample) == shape(real)


def test_a_demo_folder_from_an_earlier_release_is_rebuilt(tmp_path):
    """A cached demo checkpoint without a file the current builder writes (a release before images) is rebuilt,
    so ``--model demo`` serves images after an upgrade; a complete one is kept as it is."""
    from clef_vllm.model.demo import DEMO_FILES, demo_checkpoint

    path = demo_checkpoint(tmp_path)
    assert all((path / name).is_file() for name in DEMO_FILES)
    built = (path / "config.json").stat().st_mtime_ns
    assert demo_checkpoint(tmp_path) == path and (path / "config.json").stat().st_mtime_ns == built
    (path / "preprocessor_config.json").unlink()                 # as the demo folders of earlier releases
    assert demo_checkpoint(tmp_path) == path and (path / "preprocessor_config.json").is_file()
