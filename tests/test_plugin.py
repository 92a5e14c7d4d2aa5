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
