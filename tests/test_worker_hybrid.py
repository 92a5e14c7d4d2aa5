"""The compressed-tensors Hybrid (FP8 W8A8 + NVFP4 W4A4) inside vLLM on CPU: one scheme per layer group, the
``clef-dummy`` load format, a 9B-shaped folder without weights, the refusal of fused NVFP4 shards with
different global scales and the fix it names, and ``--nvfp4-kernel bf16`` (clef_vllm/worker/fast/nvfp4_bf16.py)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from support import vllm_cpu

from clef_vllm.contract import SETTINGS_KEY, WorkerSettings

pytest.importorskip("vllm")
pytestmark = pytest.mark.usefixtures("cpu_shims")



@pytest.fixture(scope="module")
def hybrid_checkpoint(tiny_release, tmp_path_factory):
    """FP8 W8A8 layers 0-1 + NVFP4 W4A4 layers 2-3 (compressed-tensors), int8 tables: the tools'
    pipeline with the native exporter (llm-compressor's path is covered in test_scripts.py)."""
    from clef_vllm.testing.hybrid import build_tiny_hybrid

    return build_tiny_hybrid(tiny_release, tmp_path_factory.mktemp("hybrid-vllm"))


def test_hybrid_fp8_nvfp4_checkpoint_loads_with_one_scheme_per_layer_group(hybrid_checkpoint):
    from clef_vllm.worker.model import kernel_report

    m = vllm_cpu.load_model(hybrid_checkpoint)
    schemes = {}
    for name, module in m.named_modules():
        if hasattr(module, "scheme"):
            schemes[name] = type(module.scheme).__name__
    fp8 = {n for n, s in schemes.items() if s == "CompressedTensorsW8A8Fp8"}
    fp4 = {n for n, s in schemes.items() if s == "CompressedTensorsW4A4Fp4"}
    assert fp8 and all(".layers.0." in n or ".layers.1." in n for n in fp8)
    assert fp4 and all(".layers.2." in n or ".layers.3." in n for n in fp4)
    assert "model.layers.2.linear_attn.in_proj_qkvz" in fp4 and "model.layers.3.self_attn.qkv_proj" in fp4
    params = dict(m.named_parameters())
    assert "model.layers.2.linear_attn.in_proj_ba.weight" in params                # kept BF16
    assert params["model.layers.2.linear_attn.in_proj_ba.weight"].dtype == torch.bfloat16
    assert m.lm_table.weight.dtype == torch.int8
    report = kernel_report(m)
    assert any("CompressedTensorsW4A4Fp4" in line for line in report)
    assert report[-1].startswith("CUDA loads kernels ") and "CUDA_MODULE_LOADING=" in report[-1]
    assert any("CompressedTensorsW8A8Fp8" in line for line in report)


def test_clef_dummy_gives_a_quantized_layout_tame_scales_and_leaves_other_checkpoints_alone(hybrid_checkpoint,
                                                                                            tiny_release, caplog):
    """``--load-format clef-dummy``: vLLM's dummy fill, then the Hybrid's scales set to constants, before vLLM's
    processing. With vLLM's plain ``dummy`` the NVFP4 layers' output multiplier comes out in the millions (on a
    GPU, times whatever memory the packed weights held); with ``clef-dummy`` every quantized layer answers a
    random input with small finite values, and the packed weights are seeded random bytes. An unquantized
    checkpoint gets exactly vLLM's dummy weights."""
    from types import SimpleNamespace

    from clef_vllm.worker.dummy_loader import BLOCK_SCALE, checkpoint_quantized, is_dummy, register_loader

    register_loader()
    assert is_dummy("dummy") and is_dummy("clef-dummy") and not is_dummy("auto")
    # online quantization (--quantization fp8) computes its scales from the dummy values: they are kept
    online = SimpleNamespace(hf_config=SimpleNamespace(), hf_text_config=SimpleNamespace(), quantization="fp8")
    assert not checkpoint_quantized(online)
    assert checkpoint_quantized(SimpleNamespace(hf_config=SimpleNamespace(quantization_config={"quant_method": "x"})))

    def quantized_outputs(model):
        torch.manual_seed(0)
        out = {}
        for name, module in model.named_modules():
            if hasattr(module, "scheme"):
                x = torch.randn(4, module.input_size_per_partition, dtype=torch.bfloat16)
                out[name] = module.quant_method.apply(module, x).float()
        return out

    plain = vllm_cpu.load_model(hybrid_checkpoint, load_format="dummy")
    alphas = [float(p.max()) for n, p in plain.named_parameters() if n.endswith(".alpha")]
    assert alphas and min(alphas) > 1e4                                       # vLLM's dummy: a huge multiplier
    with caplog.at_level(logging.INFO, logger="clef_vllm"):
        tame = vllm_cpu.load_model(hybrid_checkpoint, load_format="clef-dummy")
    assert "clef-dummy: quantization parameters set to tame constants" in caplog.text
    assert "clef kernels in use: CompressedTensorsW4A4Fp4" in caplog.text          # said as for a real load
    params = dict(tame.named_parameters())
    outputs = quantized_outputs(tame)
    assert len(outputs) == 16 and all(torch.isfinite(y).all() and 0 < y.abs().max() < 2 for y in outputs.values())
    nvfp4 = "model.layers.2.mlp.gate_up_proj."
    assert float(params[nvfp4 + "alpha"]) == 1.0 and float(params[nvfp4 + "weight_global_scale"]) == 1.0
    assert params[nvfp4 + "weight_scale"].float().unique().tolist() == [BLOCK_SCALE]
    packed = params[nvfp4 + "weight"]
    assert packed.dtype == torch.uint8 and len(packed.unique()) > 200                # random bytes, not zeros
    again = dict(vllm_cpu.load_model(hybrid_checkpoint, load_format="clef-dummy").named_parameters())
    assert torch.equal(again[nvfp4 + "weight"], packed)                               # seeded
    fp8 = "model.layers.0.mlp.gate_up_proj."
    assert params[fp8 + "weight_scale"].float().unique().tolist() == [1.0]
    bf16 = dict(vllm_cpu.load_model(tiny_release, load_format="dummy").named_parameters())
    for name, value in vllm_cpu.load_model(tiny_release, load_format="clef-dummy").named_parameters():
        assert torch.equal(value, bf16[name]), name


def test_a_9b_shaped_hybrid_folder_resolves_like_the_release_and_needs_no_weights_with_clef_dummy(tmp_path):
    """``bench/make_ckpt.py 9b DIR --hybrid 17``: the 9B config with the Hybrid's compressed-tensors config
    (17 FP8 layers, 15 NVFP4, in_proj_ba BF16) and no weights; the engine settings take it with
    ``clef-dummy`` (the generic buckets: its kernels were not swept) and refuse it without a dummy format."""
    import subprocess
    import sys

    from support.vllm_cpu import REPO

    from clef_vllm.backends.vllm_backend import engine_kwargs
    from clef_vllm.model.checkpoint import CheckpointError
    from clef_vllm.quant.schemes import scheme_table, summarize_schemes
    from clef_vllm.worker.fast.prefill_graphs import DEFAULT_BUCKETS

    folder = tmp_path / "9b-hybrid"
    subprocess.run([sys.executable, str(REPO / "bench/make_ckpt.py"), "9b", str(folder), "--hybrid", "17"], check=True,
                   capture_output=True, text=True)
    assert summarize_schemes(scheme_table(folder)) == {"fp8_w8a8": 68, "nvfp4_w4a4": 60, "unquantized": 24}
    kwargs = engine_kwargs(folder, load_format="clef-dummy", max_model_len=4096)
    assert kwargs["load_format"] == "clef-dummy"
    assert WorkerSettings.from_plain(kwargs["additional_config"][SETTINGS_KEY]).prefill_graphs.buckets == tuple(
        DEFAULT_BUCKETS)
    with pytest.raises(CheckpointError):
        engine_kwargs(folder, max_model_len=4096)                    # real weights needed
    bad = subprocess.run([sys.executable, str(REPO / "bench/make_ckpt.py"), "tiny", str(tmp_path / "t"), "--hybrid",
                          "2"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--hybrid is for the 9b kind" in bad.stderr


def _with_mismatched_fused_scale(hybrid_checkpoint, tmp_path):
    """A copy of the Hybrid checkpoint whose in_proj_z NVFP4 global scale differs from in_proj_qkv's."""
    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / "ckpt"
    shutil.copytree(hybrid_checkpoint, ckpt)
    key = "model.language_model.layers.2.linear_attn.in_proj_z.weight_global_scale"
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shard = ckpt / index["weight_map"][key]
    tensors = load_file(str(shard))
    tensors[key] = tensors[key] * 2
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return ckpt


def test_refuses_nvfp4_fused_shards_with_different_global_scales(hybrid_checkpoint, tmp_path):
    """vLLM keeps the max divisor of a fused module and silently mis-scales the others: refused."""
    from clef_vllm.model.checkpoint import CheckpointError

    ckpt = _with_mismatched_fused_scale(hybrid_checkpoint, tmp_path)
    with pytest.raises(CheckpointError, match="different weight global scales.*in_proj_qkvz"):
        vllm_cpu.load_model(ckpt)


def test_fused_scale_fix_from_the_refusal_message_makes_the_checkpoint_load(hybrid_checkpoint, tmp_path):
    """The command the refusal names really repairs the checkpoint (fix b: shared min divisor)."""
    import subprocess
    import sys

    from clef_vllm.model.checkpoint import CheckpointError

    ckpt = _with_mismatched_fused_scale(hybrid_checkpoint, tmp_path)
    with pytest.raises(CheckpointError) as refusal:
        vllm_cpu.load_model(ckpt)
    assert "clef-load DIR --fix-fused-scales --out FIXED_DIR" in str(refusal.value)
    fixed = tmp_path / "fixed"
    proc = subprocess.run([str(Path(sys.executable).parent / "clef-load"), str(ckpt), "--fix-fused-scales",
                           "--out", str(fixed), "--capability", "9.0", "--quiet"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_nvfp4_kernel_bf16_dequantizes_the_hybrids_nvfp4_layers_once_at_load(hybrid_checkpoint, caplog):
    """``--nvfp4-kernel bf16`` (the engine's worker settings): every NVFP4 layer of the Hybrid gets the
    plugin's kernel, whose weight is the BF16 dequantization of what vLLM's scheme left for its own kernel
    (packed E2M1, FP8 block scales, the fused module's global multiplier) and whose forward is a BF16 GEMM;
    the FP8 layers keep theirs, the FP4-only parameters are freed, and a later load without the option gets
    vLLM's kernel again. The weights match the checkpoint's own NVFP4 tensors (W4A16) to BF16 rounding."""
    import torch.nn.functional as F
    from safetensors.torch import load_file

    from clef_vllm.quant.numerics import nvfp4_dequantize
    from clef_vllm.worker.fast.nvfp4_bf16 import install
    from clef_vllm.worker.model import kernel_report

    with caplog.at_level(logging.INFO, logger="clef_vllm"):
        bf16 = vllm_cpu.load_model(hybrid_checkpoint, settings=WorkerSettings(nvfp4_kernel="bf16"))
    assert "clef NVFP4 layers: BF16 GEMMs on weights dequantized at load" in caplog.text
    default = vllm_cpu.load_model(hybrid_checkpoint)                       # the option off: vLLM's choice again
    kernels = {name: type(m.scheme.kernel).__name__ for name, m in bf16.named_modules() if hasattr(m, "scheme")
               and type(m.scheme).__name__ == "CompressedTensorsW4A4Fp4"}
    assert len(kernels) == 8 and set(kernels.values()) == {"Bf16NvFp4LinearKernel"}
    assert {type(m.scheme.kernel).__name__ for n, m in default.named_modules() if n in kernels} == {
        "EmulationNvFp4LinearKernel"}
    assert sum(type(m.scheme).__name__ == "CompressedTensorsW8A8Fp8" for _, m in bf16.named_modules()
               if hasattr(m, "scheme")) == 8                                 # the FP8 layers keep their kernel
    old, new = dict(default.named_modules()), dict(bf16.named_modules())
    torch.manual_seed(0)
    for name in kernels:
        a, b = old[name], new[name]
        want = nvfp4_dequantize(a.weight.data, a.weight_scale.data, a.weight_global_scale.data, torch.bfloat16,
                                divisor=False)
        assert b.weight.dtype == torch.bfloat16 and torch.equal(b.weight.data, want), name
        assert not any(hasattr(b, p) for p in ("weight_scale", "weight_global_scale", "input_global_scale", "alpha"))
        x = torch.randn(3, b.input_size_per_partition, dtype=torch.bfloat16)
        assert torch.equal(b.quant_method.apply(b, x), F.linear(x, b.weight)), name
    # against the checkpoint's tensors: gate_up of layer 2 = gate and up, each q * s / g (g shared: fused)
    tensors = {}
    for f in sorted(hybrid_checkpoint.glob("*.safetensors")):
        tensors.update(load_file(f))
    prefix = next(k for k in tensors if k.endswith("layers.2.mlp.gate_proj.weight_packed")).rsplit("gate_proj", 1)[0]
    shards = [nvfp4_dequantize(tensors[prefix + f"{s}.weight_packed"], tensors[prefix + f"{s}.weight_scale"],
                               tensors[prefix + f"{s}.weight_global_scale"]) for s in ("gate_proj", "up_proj")]
    got = new["model.layers.2.mlp.gate_up_proj"].weight.float()
    assert torch.allclose(got, torch.cat(shards), rtol=2 ** -8, atol=0)
    assert any("Bf16NvFp4" in line and "x8" in line for line in kernel_report(bf16))
    assert any("dequantized at load" in line for line in kernel_report(bf16))
    with pytest.raises(ValueError):
        install("marlin")
    # auto decides by the GPU: with none (this CPU platform) vLLM's own kernel stays first; on a Hopper GPU
    # (vLLM's platform says so) the BF16 kernel goes first, on a Blackwell one vLLM's own stays
    from vllm.model_executor.kernels import linear
    from vllm.platforms import current_platform

    from clef_vllm.worker.fast.nvfp4_bf16 import kernel_class

    assert install("auto") is False
    for capability, first in (((9, 0), True), ((10, 0), False)):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(current_platform, "is_cuda", lambda: True, raising=False)
            mp.setattr(current_platform, "get_device_capability", lambda *a, c=capability: c, raising=False)
            assert install("auto") is first, capability
            assert (linear._POSSIBLE_NVFP4_KERNELS[current_platform._enum][0] is kernel_class()) is first
    install("vllm")
    auto = vllm_cpu.load_model(hybrid_checkpoint, settings=WorkerSettings(nvfp4_kernel="auto"))
    assert {type(m.scheme.kernel).__name__ for n, m in auto.named_modules() if n in kernels} == {
        "EmulationNvFp4LinearKernel"}
