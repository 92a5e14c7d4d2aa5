# Source on the GPU machine after staging vLLM into /root/site: puts the staged vLLM and
# this working tree's plugin on PYTHONPATH and registers the plugin's entry points (a .dist-info
# next to the staged packages), so every vLLM process (engine cores, workers) loads it.
export PYTHONPATH=/root/site:$PWD/vllm_plugin VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# FlashInfer's GDN prefill on Hopper imports cutlass (nvidia-cutlass-dsl, staged only when asked for): its
# wheel's .pth file is not read from PYTHONPATH, so its package folder goes there itself
[ -d /root/site/nvidia_cutlass_dsl/dsl_packages ] && PYTHONPATH=$PYTHONPATH:/root/site/nvidia_cutlass_dsl/dsl_packages
export CLEF_VLLM_CACHE=/root/clef-cache TRITON_CACHE_DIR=/root/.triton/cache
python3 - <<'PY'
import pathlib, re
ver = re.search(r'__version__ = "([^"]+)"', pathlib.Path("vllm_plugin/clef_vllm/version.py").read_text()).group(1)
d = pathlib.Path(f"/root/site/clef_vllm-{ver}.dist-info"); d.mkdir(parents=True, exist_ok=True)
(d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: clef-vllm\nVersion: {ver}\n")
(d / "entry_points.txt").write_text("[vllm.general_plugins]\nclef = clef_vllm:register\n\n"
                                    "[console_scripts]\nclef-systemone = clef_vllm.server.cli:main\n")
(d / "RECORD").write_text("")
PY
