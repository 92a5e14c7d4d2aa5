#!/usr/bin/env bash
# Install everything the test suite needs into the active Python environment (CPU machine):
# the plugin with its test extras, and vLLM 0.28.0 without its CUDA-only dependencies
# (enough to import vLLM, register the plugin and build/load models on CPU; vllm-notes §8).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --upgrade pip
python -m pip install -q -e "./vllm_plugin[test]"
python -m pip install -q --no-deps "vllm==0.28.0"
python -m pip install -q -r requirements/vllm-cpu.txt
