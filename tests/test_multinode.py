"""Multi-node data parallelism (clef_vllm/backends/multinode.py, the data-parallel options): the flags reach vLLM's
engine config as vLLM reads them for a pooling model, the layouts that cannot work are refused by name, and a
headless node checks the checkpoint's version marker before it starts anything. No GPU: the engines themselves
start in the GPU run."""

from __future__ import annotations

import json
import shutil

import pytest

from clef_vllm.backends.multinode import REMOTE_RANKS_LOAD_TIMEOUT_S, headless_config, load_timeout, remote_ranks
from clef_vllm.backends.options import OptionError, backend_options, engine_args, given_options
from clef_vllm.backends.vllm_backend import StateAffinity
from clef_vllm.server.cli import build_parser, main

HEAD = ["--data-parallel-size", "4", "--data-parallel-size-local", "2", "--data-parallel-address", "10.0.0.1",
        "--data-parallel-rpc-port", "13400"]
HEADLESS = ["--headless", "--data-parallel-size", "4", "--data-parallel-size-local", "2",
            "--data-parallel-start-rank", "2", "--data-parallel-address", "10.0.0.1", "--data-parallel-rpc-port",
            "13400"]


def options(argv: list[str]):
    return backend_options("vllm", given_options(build_parser().parse_args(["--backend", "vllm", *argv])))


def test_the_flags_reach_the_engine_arguments_under_vllms_names():
    head = engine_args(options(HEAD))
    assert {k: head[k] for k in head if k.startswith("data_parallel")} == {
        "data_parallel_size": 4, "data_parallel_size_local": 2, "data_parallel_address": "10.0.0.1",
        "data_parallel_rpc_port": 13400}
    short = options(["-dp", "4", "-dpl", "2", "-dpa", "10.0.0.1", "-dpp", "13400", "-dpb", "ray"])
    assert engine_args(short)["data_parallel_backend"] == "ray"
    node = options(HEADLESS)
    assert node.headless and engine_args(node)["data_parallel_start_rank"] == 2
    assert "headless" not in engine_args(node)          # ours: it picks the command, not an engine setting


def test_a_head_node_leaves_the_other_ranks_to_headless_nodes_and_bounds_its_wait_for_them():
    head = options(HEAD)
    assert remote_ranks(head) == range(2, 4)
    assert load_timeout(head, None) == REMOTE_RANKS_LOAD_TIMEOUT_S
    assert load_timeout(head, 60.0) == 60.0
    assert remote_ranks(options(["--dp", "4"])) == range(0)
    assert load_timeout(options(["--dp", "4"]), None) is None
    assert remote_ranks(options(["--dp", "4", "-dpl", "1", "-dpb", "ray"])) == range(0)   # Ray places them


@pytest.mark.parametrize("argv, option", [
    (["--dp", "2", "-dpl", "3"], "data_parallel_size_local"),
    (["--dp", "4", "-dpl", "2"], "data_parallel_address"),                       # remote ranks need an address
    (["--dp", "4", "-dpa", "10.0.0.1"], "data_parallel_address"),               # all ranks here: no effect
    (["--dp", "4", "-dpp", "13400"], "data_parallel_rpc_port"),
    (["--dp", "4", "-dpl", "2", "-dpa", "10.0.0.1", "-dpr", "2"], "data_parallel_start_rank"),  # head: hybrid LB
    (["--headless", "--dp", "4", "-dpl", "2", "-dpa", "10.0.0.1"], "headless"),  # no start rank
    (["--headless", "--dp", "4", "-dpl", "2", "-dpr", "2"], "headless"),          # no head address
    (["--headless", "--dp", "4", "-dpl", "2", "-dpr", "3", "-dpa", "10.0.0.1"], "data_parallel_start_rank"),
    (["--headless", "--dp", "4", "-dpl", "2", "-dpr", "2", "-dpa", "10.0.0.1", "-dpb", "ray"], "headless"),
    (["--headless", "--dp", "4", "-dpl", "2", "-dpr", "2", "-dpa", "h", "--engine-core", "thread"], "engine_core"),
    (["-dpb", "ray"], "data_parallel_backend"),
])
def test_layouts_that_cannot_work_are_refused_naming_the_flag(argv, option):
    with pytest.raises(OptionError) as exc:
        options(argv)
    assert exc.value.option == option


def test_the_server_refuses_them_with_exit_status_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--backend", "vllm", "--data-parallel-size", "4", "--data-parallel-start-rank", "2"])
    assert exit_.value.code == 2
    assert "--data-parallel-start-rank" in capsys.readouterr().err


def test_a_headless_node_builds_the_engine_config_vllm_reads_for_its_ranks(tiny_release):
    """As vLLM's ``vllm serve --headless`` builds it: the node's engines are ranks 2 and 3 of 4, joining
    10.0.0.1:13400, with neither hybrid nor external load balancing (the head balances)."""
    parallel = headless_config(tiny_release, options(HEADLESS)).parallel_config
    assert (parallel.data_parallel_size, parallel.data_parallel_size_local, parallel.data_parallel_rank) == (4, 2, 2)
    assert (parallel.data_parallel_master_ip, parallel.data_parallel_rpc_port) == ("10.0.0.1", 13400)
    assert not parallel.data_parallel_hybrid_lb and not parallel.data_parallel_external_lb


def test_the_head_node_balances_every_rank_itself(tiny_release):
    from vllm import AsyncEngineArgs

    from clef_vllm.backends.vllm_backend import engine_kwargs

    parallel = AsyncEngineArgs(**engine_kwargs(tiny_release, options(HEAD))).create_engine_config().parallel_config
    assert (parallel.data_parallel_size, parallel.data_parallel_size_local, parallel.data_parallel_rank) == (4, 2, 0)
    assert not parallel.data_parallel_hybrid_lb and not parallel.data_parallel_external_lb
    assert parallel.data_parallel_master_ip == "10.0.0.1"
    # the head's client holds every rank, in rank order (core_client.py: local_engines_only is false), so the
    # state affinity's data_parallel_rank= reaches the headless nodes' ranks too
    assert not parallel.local_engines_only
    affinity = StateAffinity(int(engine_kwargs(tiny_release, options(HEAD))["data_parallel_size"]))
    homes = {affinity.pick(bytes([k]) * 8) for k in range(64)}
    assert homes == {0, 1, 2, 3}


def test_vllm_refuses_external_load_balancing_for_a_model_without_experts(tiny_release):
    """Why no flag offers it: one rank per front-end (``--data-parallel-rank``) is MoE-only in vLLM 0.28."""
    from vllm import AsyncEngineArgs

    from clef_vllm.backends.vllm_backend import engine_kwargs

    kwargs = engine_kwargs(tiny_release, options(["--dp", "2"]))
    with pytest.raises(ValueError, match="Non-MoE models do not support external data parallel mode"):
        AsyncEngineArgs(**kwargs, data_parallel_rank=1).create_engine_config()


def test_a_headless_node_refuses_a_checkpoint_for_another_plugin_version_before_starting(tiny_release, tmp_path,
                                                                                         capfd):
    ckpt = tmp_path / "newer"
    shutil.copytree(tiny_release, ckpt)
    configs = list(ckpt.rglob("joint_head*config*.json"))
    assert configs, "the tiny checkpoint has a head config"
    for path in configs:
        cfg = json.loads(path.read_text())
        cfg["requires_clef_vllm"] = ">=999"
        path.write_text(json.dumps(cfg))
    assert main(["--backend", "vllm", "--model", str(ckpt), *HEADLESS]) == 1
    err = capfd.readouterr().err
    assert "headless node" in err and "requires clef-vllm>=999" in err


HEADLESS_ALONE = """
import sys
from support import vllm_cpu
vllm_cpu.setup_env()
import multiprocessing
import vllm.v1.engine.core as core
import vllm.v1.engine.utils as engine_utils
core.HANDSHAKE_TIMEOUT_MINS = {minutes!r}    # vLLM's 5 minutes, shortened for the test (forked engines see it)
# vLLM's CPU platform starts engine processes by spawn (each imports vLLM again, seconds of CPU); a GPU node forks
# them (VLLM_WORKER_MULTIPROC_METHOD, CUDA not initialized in this process), and so does this one
engine_utils.get_mp_context = lambda: multiprocessing.get_context("fork")
make_socket = core.make_zmq_socket


def without_linger(*args, **kwargs):   # the hello no head took is not kept for vLLM's 5 s linger at the engine's exit
    kwargs["linger"] = 0
    return make_socket(*args, **kwargs)


core.make_zmq_socket = without_linger
from clef_vllm.server.cli import main
if __name__ == "__main__":
    sys.exit(main(["--backend", "vllm", "--model", {model!r}, "--headless", "-dp", "2", "-dpl", "1", "-dpr", "1",
                   "-dpa", "127.0.0.1", "-dpp", {port!r}]))
"""


def pythonpath_with_tests() -> str:
    """PYTHONPATH for a child that imports ``support`` from this folder, as pytest's own process does."""
    import os

    from conftest import REPO

    return os.pathsep.join(filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")]))


def test_a_headless_node_whose_head_never_answers_exits_1(tiny_release, tmp_path):
    """vLLM's engine manager starts the node's engine, which cannot join (nothing listens at the head's
    address): the engine gives up after vLLM's handshake timeout and the node exits 1, saying why."""
    import os
    import subprocess
    import sys

    from clef_vllm.testing.server import free_port

    script = tmp_path / "headless_alone.py"
    script.write_text(HEADLESS_ALONE.format(model=str(tiny_release), port=str(free_port()),
                                            minutes=0.05))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                         env={**os.environ, "VLLM_WORKER_MULTIPROC_METHOD": "fork", "PYTHONPATH": pythonpath_with_tests()})
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Did not receive response from front-end process" in out.stderr
    assert "headless node: an engine exited" in out.stderr


def test_a_headless_node_stops_on_sigterm_with_exit_0(tiny_release, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from clef_vllm.testing.server import free_port

    script = tmp_path / "headless_alone.py"
    script.write_text(HEADLESS_ALONE.format(model=str(tiny_release), port=str(free_port()),
                                            minutes=5))
    log = tmp_path / "headless.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=err,
                                env={**os.environ, "VLLM_WORKER_MULTIPROC_METHOD": "fork", "PYTHONPATH": pythonpath_with_tests()})
    try:
        deadline = time.monotonic() + 120
        while "headless node: data-parallel ranks 1-1 of 2" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(2)                                  # the engine is up and waiting for the head
        engines = psutil.Process(proc.pid).children(recursive=True)
        assert engines
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        gone, alive = psutil.wait_procs(engines, timeout=10)
        assert not alive, alive
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "headless node: stopped (SIGTERM)" in log.read_text()
