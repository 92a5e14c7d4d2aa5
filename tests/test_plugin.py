"""The vLLM plugin's registration (clef_vllm/plugin.py): found through vLLM's entry point, registered once
however often vLLM calls it, the dummy loader with it; importing it keeps vLLM's fork safe."""

from __future__ import annotations

import os
from importlib.metadata import entry_points

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.usefixtures("cpu_shims")


def test_entry_point_registers_the_architecture_idempotently():
    import clef_vllm

    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "clef"]
    assert len(eps) == 1 and eps[0].value == "clef_vllm:register"
    register = eps[0].load()
    register()
    register()  # idempotent
    from vllm import ModelRegistry
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    assert clef_vllm.ARCHITECTURE in ModelRegistry.get_supported_archs()
    # --load-format clef-dummy, in every process that loads the plugin
    assert type(get_model_loader(LoadConfig(load_format="clef-dummy"))).__name__ == "ClefDummyLoader"


def test_importing_the_plugin_keeps_cuda_checks_fork_safe():
    """torch.cuda.is_available() must go through NVML: cudaGetDeviceCount poisons vLLM's fork."""

    import clef_vllm  # noqa: F401

    assert os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") == "1"


def test_a_spawned_engine_process_logs_the_plugins_lines_as_the_server_does(monkeypatch):
    """vLLM spawns its engine core (no inherited handlers) once the front end holds a CUDA context: the server's
    level and format reach it through the environment, and register() sets the plugin's handler up there."""
    import json
    import subprocess
    import sys

    from clef_vllm import plugin
    from clef_vllm.util import logs

    child = ("import logging; from clef_vllm.util.logs import inherit_logging; print(inherit_logging()); "
             "logging.getLogger('clef_vllm.worker').info('clef memory budget: 1 GiB'); "
             "logging.getLogger('clef_vllm.worker').debug('not at info')")
    env = {k: v for k, v in os.environ.items() if k != logs.LOG_ENV}
    plain = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=60)
    assert plain.stdout.strip() == "False" and "clef memory budget" not in plain.stderr     # a library: no handler
    served = subprocess.run([sys.executable, "-c", child], env=env | {logs.LOG_ENV: "info:json"}, capture_output=True,
                            text=True, timeout=60)
    assert served.stdout.strip() == "True"
    lines = [json.loads(ln) for ln in served.stderr.splitlines() if ln.startswith("{")]
    assert [(ln["level"], ln["logger"], ln["message"]) for ln in lines] == \
        [("INFO", "clef_vllm.worker", "clef memory budget: 1 GiB")]

    calls = []
    monkeypatch.setattr(logs, "inherit_logging", lambda: calls.append(1))
    monkeypatch.setattr(plugin, "_registered", False)
    plugin.register()
    assert calls == [1]
