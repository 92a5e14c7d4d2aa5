"""Quantized checkpoints as vLLM 0.28 sees them, one module per job.

* :mod:`~clef_vllm.quant.schemes` — parse ``quantization_config`` (compressed-tensors) and resolve
  the scheme of every vLLM linear module with vLLM's matching rules; the fused modules and the
  HF->vLLM name mapping of the plugin's model class.
* :mod:`~clef_vllm.quant.kernels` — which scheme class and GEMM kernel vLLM picks on a GPU (the
  only part the server needs).
* :mod:`~clef_vllm.quant.fused_scales` — NVFP4 global scales of fused modules: check and fix.
* :mod:`~clef_vllm.quant.numerics` — NVFP4 / FP8 quantize, dequantize and fake-quant formulas.
* :mod:`~clef_vllm.quant.fake_quant` — :class:`FakeQuant`, those numerics applied to a live model.
* :mod:`~clef_vllm.quant.recipe` — the Hybrid recipe (FP8 below layer K, NVFP4 from K) as data.

No module here imports vLLM: the quantization tools run in a venv without it.
"""
