"""A ``clef-systemone`` process from start to exit: the 503 "loading" state, a model or checkpoint that fails
to load (named), a load past ``--load-timeout``, the engine process dying while loading or serving, SIGTERM
while loading or after serving, and the forked children stopped at exit.

Servers (started together, once for this module):
* ``gated``: loading held by ``CLEF_VLLM_LOAD_GATE`` (server/faults.py) until the test creates the gate file,
  so the 503 "loading" state is observed deterministically, not by racing the loader;
* ``broken``: ``--model`` pointing at a folder without a head; it must exit non-zero and say why;
* ``dying`` / ``dying_load``: a stand-in engine process (``engine_pid_file``) that the tests kill while
  serving / while loading; ``slow_load``: ``--load-timeout 1`` with the load held; ``stopped_load``: SIGTERM
  while the load is held; ``slow_load`` and ``stopped_load`` have a stand-in engine too, which must not
  outlive them;
* ``corrupt-*``: checkpoints with a damaged file; the CLI must refuse to start and name the file;
* ``clean-1`` / ``clean-2``: plain servers that the SIGTERM test stops after a request (with ``gated``).

Nothing here asserts on durations: waits poll a state (``/health``, a pid file, a log line) with a bound that
only stops a hang.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from conftest import REQUEST, LiveServer
from support.server_calls import RawHttp, assert_error, health_code, held, metric, post, running, wait_until


def corrupt_variants(src: Path, root: Path) -> dict[str, tuple[Path, str]]:
    """Copies of ``src`` with one damaged file each -> (folder, the file the error must name)."""
    out = {}

    def variant(name, damage):
        folder = root / f"corrupt-{name}"
        shutil.copytree(src, folder)
        out[name] = (folder, str(damage(folder)))

    def truncate_shard(folder):
        shard = sorted(folder.glob("model-*.safetensors"))[0]
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        return shard

    def garbage_head(folder):
        (folder / "joint_head.safetensors").write_bytes(os.urandom(4096))
        return folder / "joint_head.safetensors"

    def broken_tokenizer(folder):
        (folder / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": ')
        return folder / "tokenizer.json"

    variant("shard", truncate_shard)
    variant("head", garbage_head)
    variant("tokenizer", broken_tokenizer)
    return out



@pytest.fixture(scope="module")
def servers(tiny_release, cache_dir, tmp_path_factory):
    """Start every server at once: they load in parallel."""
    tmp = tmp_path_factory.mktemp("servers")
    nohead = tmp / "no-head"
    shutil.copytree(tiny_release, nohead)
    (nohead / "joint_head.safetensors").unlink()
    (nohead / "joint_head_config.json").unlink()
    gate, never = tmp / "gate", tmp / "never"
    holds = tmp / "holds"
    holds.mkdir()
    model = ["--model", str(tiny_release), "--backend", "reference"]
    started = {
        "gated": LiveServer(model, env={"CLEF_VLLM_LOAD_GATE": str(gate)}),
        "broken": LiveServer(["--model", str(nohead), "--backend", "reference"]),
        "dying": LiveServer(model, env={"CLEF_VLLM_FAULTS": f"hold_dir={holds},engine_pid_file={tmp / 'engine.pid'}"}),
        "dying_load": LiveServer(model, env={"CLEF_VLLM_LOAD_GATE": str(never),
                                             "CLEF_VLLM_FAULTS": f"engine_pid_file={tmp / 'load-engine.pid'}"}),
        "slow_load": LiveServer(model + ["--load-timeout", "1"], env={
            "CLEF_VLLM_LOAD_GATE": str(never), "CLEF_VLLM_FAULTS": f"engine_pid_file={tmp / 'slow-engine.pid'}"}),
        "stopped_load": LiveServer(model, env={"CLEF_VLLM_LOAD_GATE": str(never),
                                               "CLEF_VLLM_FAULTS": f"engine_pid_file={tmp / 'stopped-engine.pid'}"}),
        "clean-1": LiveServer(model),
        "clean-2": LiveServer(model),
    }
    corrupt = corrupt_variants(tiny_release, tmp)
    for name, (folder, _) in corrupt.items():
        started[f"corrupt-{name}"] = LiveServer(["--model", str(folder), "--backend", "reference"])
    yield {**started, "gate": gate, "holds": holds, "tmp": tmp, "corrupt": corrupt}
    gate.touch()
    for server in started.values():              # signal all first: they shut down in parallel
        if server.proc.poll() is None:
            server.proc.terminate()
    for server in started.values():
        server.stop()
    for pid_file in tmp.glob("*.pid"):          # stand-in engines exit with their server; be sure
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


# --------------------------------------------------------------------------- loading


def test_503_while_loading_then_200(servers):
    gated: LiveServer = servers["gated"]
    deadline = time.monotonic() + 120
    while True:                                             # wait for the socket, not for the model
        assert gated.proc.poll() is None, gated.log()
        try:
            resp = httpx.get(gated.url + "/health", timeout=2)
            break
        except httpx.HTTPError:
            assert time.monotonic() < deadline, gated.log()
            time.sleep(0.1)
    assert resp.status_code == 503 and resp.json() == {"status": "loading"}
    assert_error(post(gated, REQUEST), 503, "model is not ready")
    assert httpx.get(gated.url + "/v1/models", timeout=5).status_code == 200
    assert httpx.get(gated.url + "/health", timeout=5).status_code == 503    # still held: deterministic
    servers["gate"].touch()
    gated.wait_ready()
    assert httpx.get(gated.url + "/health", timeout=5).json() == {"status": "ok"}
    assert post(gated, REQUEST).status_code == 200


def test_a_model_that_fails_to_load_exits_non_zero_and_says_why(servers):
    broken: LiveServer = servers["broken"]
    code = broken.proc.wait(timeout=120)
    assert code != 0
    log = broken.log()
    assert "could not load the model" in log and "no joint head found" in log
    assert "Traceback" not in log




def test_a_load_that_never_finishes_hits_the_load_timeout(servers):
    server: LiveServer = servers["slow_load"]
    assert server.proc.wait(timeout=120) == 1
    log = server.log()
    assert "the model did not load within 1 s (--load-timeout)" in log
    # the engine process the abandoned load had started does not outlive the server
    assert not running(int((servers["tmp"] / "slow-engine.pid").read_text())), log


def test_sigterm_while_loading_stops_the_engine_process_the_load_started(servers):
    """The stand-in is forked from the loading thread, as vLLM forks its engine cores, so it would
    inherit the server's drain handler and ignore SIGTERM: the server leaves no engine behind, and
    a plain SIGTERM is enough to stop it (no kill after the grace period)."""
    server: LiveServer = servers["stopped_load"]
    pid_file = servers["tmp"] / "stopped-engine.pid"
    wait_until(lambda: pid_file.exists() and health_code(server) == 503, "loading with an engine process")
    pid = int(pid_file.read_text())
    assert running(pid)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0
    log = server.log()
    assert not running(pid), log
    assert f"still running at exit: EngineCoreStandIn (pid {pid}); sending SIGTERM" in log
    assert "after SIGTERM: killed" not in log and "Traceback" not in log


@pytest.mark.parametrize("name", ["shard", "head", "tokenizer"])
def test_a_corrupted_checkpoint_file_refuses_to_start_naming_the_file(servers, name):
    server: LiveServer = servers[f"corrupt-{name}"]
    folder, damaged = servers["corrupt"][name]
    assert server.proc.wait(timeout=120) == 1
    log = server.log()
    assert "could not load the model" in log and "Traceback" not in log
    if name == "tokenizer":                            # the loader names the folder and the file names
        assert f"{folder}: cannot load the tokenizer (tokenizer.json" in log
    else:
        assert damaged in log and "unreadable safetensors file" in log




# --------------------------------------------------------------------------- engine death


def test_engine_death_while_serving_fails_requests_and_exits_non_zero(servers):
    dying: LiveServer = servers["dying"].wait_ready()
    pid = int((servers["tmp"] / "engine.pid").read_text())
    body = json.dumps(REQUEST).encode()
    slow = RawHttp(dying, "/v1/systemone", content_length=len(body))  # accepted, its body still arriving
    slow.send(body[:10])
    stop, sent = threading.Event(), [10]

    def trickle():                                    # an upload that makes progress keeps being read
        while not stop.is_set() and sent[0] < len(body) - 2:
            slow.send(body[sent[0]:sent[0] + 1])
            sent[0] += 1
            time.sleep(0.1)

    with ThreadPoolExecutor(2) as pool:
        in_engine = pool.submit(post, dying, held("x1"))
        wait_until(lambda: metric(dying, "clef_in_flight") == 1, "x1 in the engine")
        trickling = pool.submit(trickle)
        os.kill(pid, signal.SIGKILL)
        assert_error(in_engine.result(), 503, "engine failed", f"engine process {pid} exited")
        health = httpx.get(dying.url + "/health")
        assert health.status_code == 503 and health.json() == {"status": "failed"}
        assert httpx.get(dying.url + "/health/live").status_code == 503
        assert_error(post(dying, REQUEST), 503, "engine failed")
        assert dying.proc.poll() is None              # it answers what it accepted before it exits
        stop.set()
        trickling.result()
    slow.send(body[sent[0]:])
    status, err = slow.read_json_response()
    assert status == 503 and "engine failed" in err["error"]["message"]
    slow.close()
    assert dying.proc.wait(timeout=60) == 1
    log = dying.log()
    assert "the engine failed while serving" in log and "Traceback" not in log


def test_engine_death_while_loading_exits_non_zero(servers):
    server: LiveServer = servers["dying_load"]
    pid_file = servers["tmp"] / "load-engine.pid"
    wait_until(lambda: pid_file.exists() and health_code(server) == 503, "loading with an engine process")
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    assert server.proc.wait(timeout=60) == 1
    assert "could not load the model: engine process" in server.log()


# --------------------------------------------------------------------------- shutdown and children


def test_a_clean_sigterm_exits_0_every_time(servers):
    """The reference backend (torch on CPU) after a real request: SIGTERM drains and exits 0, never
    an abort in the interpreter's teardown (exit 134 in about one run in three before the server
    left with ``os._exit`` once it had closed its backend; seen in a venv made by README's demo
    command, 3 of 6 runs, not in the test venv, so this guards the exit status rather than
    reproducing that abort). Three servers: the gated one (once loaded) and two plain ones."""
    servers["gate"].touch()
    for name in ("gated", "clean-1", "clean-2"):
        server: LiveServer = servers[name].wait_ready()
        assert server.call("/v1/systemone", REQUEST)[0] == 200
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0, server.log()[-2000:]
        assert "terminate called" not in server.log()


CHILD_SIGNALS = """
import multiprocessing, signal, sys, time
from clef_vllm.server.children import default_signals_in_forked_children, stop_children
signal.signal(signal.SIGTERM, lambda *_: None)      # a handler that ignores SIGTERM, as a drain handler in a child
if sys.argv[1] == "reset":
    default_signals_in_forked_children()
child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), name="child")
child.start()
print(stop_children(grace_s=2)[0].split(": ")[1])
"""


@pytest.mark.parametrize("mode,outcome", [("reset", "exited (-15)"), ("inherit", "killed")])
def test_forked_children_start_with_default_signals_and_are_stopped_at_exit(mode, outcome):
    """With the reset a forked child dies of SIGTERM at once; without it, it keeps its parent's
    handler, ignores SIGTERM and is killed after the grace period. Either way none is left."""
    run = subprocess.run([sys.executable, "-c", CHILD_SIGNALS, mode], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == outcome
