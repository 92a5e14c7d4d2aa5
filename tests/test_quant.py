"""clef_vllm.quant: vLLM 0.28 scheme resolution, fused NVFP4 global scales (check + fix), kernels, numerics."""

from __future__ import annotations

import re

import pytest
import torch

from clef_vllm.quant import fused_scales, kernels, numerics, recipe, schemes

TEXT = {"num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
PROJ = r"(mlp\.(gate_proj|up_proj|down_proj)|self_attn\.(q_proj|k_proj|v_proj|o_proj)|linear_attn\.(in_proj_qkv|in_proj_z|out_proj))$"
FP8 = {"weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
       "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}}
FP4 = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
       "scale_dtype": "torch.float8_e4m3fn"}
NVFP4 = {"weights": {**FP4, "dynamic": False}, "input_activations": {**FP4, "dynamic": "local"}}


def config(groups: dict, ignore=()) -> dict:
    return {"text_config": TEXT, "quantization_config": {
        "quant_method": "compressed-tensors", "format": "mixed-precision", "quantization_status": "compressed",
        "config_groups": {name: {"targets": targets, **scheme} for name, (targets, scheme) in groups.items()},
        "ignore": list(ignore)}}


def kinds(cfg, **kw) -> dict[str, str]:
    return {r.name: r.kind for r in schemes.scheme_table(cfg, **kw)}


def problems(cfg, **kw) -> list[str]:
    return [p for r in schemes.scheme_table(cfg, **kw) for p in r.problems]


HYBRID = config({"group_0": ([rf"re:.*layers\.([01])\.{PROJ}"], FP8), "group_1": ([rf"re:.*layers\.([23])\.{PROJ}"], NVFP4)},
                ignore=[f"model.language_model.layers.{i}.linear_attn.in_proj_{x}" for i in range(3) for x in "ba"]
                + ["lm_head"])


# --------------------------------------------------------------------------- resolution


def test_hybrid_resolves_per_layer_and_keeps_in_proj_ba():
    k = kinds(HYBRID)
    assert k["model.layers.0.linear_attn.in_proj_qkvz"] == schemes.FP8_W8A8
    assert k["model.layers.1.mlp.gate_up_proj"] == schemes.FP8_W8A8
    assert k["model.layers.2.linear_attn.in_proj_qkvz"] == schemes.NVFP4_W4A4
    assert k["model.layers.3.self_attn.qkv_proj"] == schemes.NVFP4_W4A4
    assert all(v == schemes.UNQUANTIZED for n, v in k.items() if n.endswith("in_proj_ba"))
    assert schemes.summarize_schemes(schemes.scheme_table(HYBRID)) == {"fp8_w8a8": 8, "nvfp4_w4a4": 8, "unquantized": 3}
    assert not problems(HYBRID)
    rows = {r.name: r for r in schemes.scheme_table(HYBRID)}
    assert rows["model.layers.3.self_attn.qkv_proj"].matched_by == "fused-shards"
    assert rows["model.layers.0.linear_attn.in_proj_ba"].matched_by == "ignore"   # renamed model.language_model. -> model.


def test_vl_class_prefix_and_mapper():
    k = kinds(HYBRID, prefix="language_model.model.", name_map=schemes.VL_NAME_MAP)
    assert k["language_model.model.layers.0.linear_attn.in_proj_ba"] == schemes.UNQUANTIZED
    assert k["language_model.model.layers.2.mlp.down_proj"] == schemes.NVFP4_W4A4


def test_anchored_regex_pitfall_matches_nothing_in_vllm():
    """Regex targets are never renamed: a target anchored on the checkpoint prefix misses vLLM's names."""
    anchored = config({"group_0": ([r"re:model\.language_model\.layers\.[0-1]\..*"], FP8)})
    assert set(kinds(anchored).values()) == {schemes.UNQUANTIZED}
    # ... while the same target written prefix-agnostic matches
    agnostic = config({"group_0": ([r"re:.*layers\.[0-1]\..*(proj|qkv|_z)$"], FP8)})
    assert kinds(agnostic)["model.layers.1.linear_attn.in_proj_qkvz"] == schemes.FP8_W8A8


def test_dotted_targets_are_renamed_like_vllm():
    cfg = config({"group_0": (["model.language_model.layers.0.mlp.down_proj"], FP8)})
    assert kinds(cfg)["model.layers.0.mlp.down_proj"] == schemes.FP8_W8A8


def test_suffix_regex_matches_fused_name_and_flags_shards():
    """re.match anchors at the start only: ``v_proj$`` also matches ``qkv_proj``; q/k are left out."""
    cfg = config({"group_0": ([r"re:.*layers\.3\..*v_proj$"], FP8)})
    rows = {r.name: r for r in schemes.scheme_table(cfg)}
    qkv = rows["model.layers.3.self_attn.qkv_proj"]
    assert qkv.kind == schemes.FP8_W8A8 and qkv.matched_by == "name"
    assert qkv.problems and "disagree" in qkv.problems[0] and "q_proj->unquantized" in qkv.problems[0]


def test_fused_shards_in_different_groups_are_reported():
    cfg = config({"group_0": ([r"re:.*layers\.3\.self_attn\.(q_proj|k_proj)$"], FP8),
                  "group_1": ([r"re:.*layers\.3\.self_attn\.v_proj$"], NVFP4)})
    row = next(r for r in schemes.scheme_table(cfg) if r.name.endswith("3.self_attn.qkv_proj"))
    assert row.kind == schemes.FP8_W8A8            # vLLM takes the first shard's target
    assert row.problems and "group_1" in row.problems[0]


def test_ignore_disagreement_is_an_error():
    cfg = config({"group_0": ([r"re:.*layers\.0\..*"], FP8)}, ignore=["model.language_model.layers.0.linear_attn.in_proj_b"])
    row = next(r for r in schemes.scheme_table(cfg) if r.name.endswith("0.linear_attn.in_proj_ba"))
    assert row.kind == "error" and "Found a different quantization schemes" in row.problems[0]


def test_class_name_fallback():
    cfg = config({"group_0": (["Linear"], FP8)}, ignore=["re:.*in_proj_[ab]$"])
    k = kinds(cfg)
    assert k["model.layers.0.linear_attn.out_proj"] == schemes.FP8_W8A8
    assert k["model.layers.0.linear_attn.in_proj_ba"] == schemes.UNQUANTIZED
    assert {r.matched_by for r in schemes.scheme_table(cfg) if r.kind == schemes.FP8_W8A8} == {"class"}


def test_read_quantization_config():
    assert schemes.read_quantization_config({"text_config": TEXT}) is None
    with pytest.raises(schemes.QuantConfigError):
        schemes.read_quantization_config({"quantization_config": {"quant_method": "gptq"}})
    cfg = config({"group_0": (["re:.*down_proj$"], FP8), "kv": (["Qwen3NextAttention"], FP8)})
    qc = schemes.read_quantization_config(cfg)
    assert list(qc.config_groups) == ["group_0"]       # Attention-only groups dropped, as vLLM does


def test_unquantized_configs_need_no_compressed_tensors(monkeypatch):
    """The demo install (pip install ./vllm_plugin) has no compressed-tensors: clef-load still checks
    16-bit checkpoints, and a quantized one says what to install."""
    import sys

    monkeypatch.setitem(sys.modules, "compressed_tensors", None)
    monkeypatch.setitem(sys.modules, "compressed_tensors.quantization", None)
    assert schemes.read_quantization_config({"text_config": TEXT}) is None
    with pytest.raises(schemes.QuantConfigError, match="needs compressed-tensors"):
        schemes.read_quantization_config(HYBRID)


@pytest.mark.parametrize("name", ["HYBRID", "pitfall", "suffix", "class"])
def test_agrees_with_vllm_matching_functions(name):
    """Our resolution picks the same target as vLLM 0.28's own find_matched_target / should_ignore_layer."""
    import os

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    utils = pytest.importorskip("vllm.model_executor.layers.quantization.compressed_tensors.utils")
    cfg = {"HYBRID": HYBRID, "pitfall": config({"g": ([r"re:model\.language_model\.layers\.[0-1]\..*"], FP8)}),
           "suffix": config({"g": ([r"re:.*layers\.3\..*v_proj$"], FP8)}),
           "class": config({"g": (["Linear"], FP8)}, ignore=["re:.*in_proj_[ab]$"])}[name]
    qc = schemes.read_quantization_config(cfg)
    ignore = [schemes._map_target(t, schemes.PLUGIN_NAME_MAP) for t in qc.ignore]
    targets = [schemes._map_target(t, schemes.PLUGIN_NAME_MAP) for g in qc.config_groups.values() for t in g.targets]
    fused = {k: list(v) for k, v in schemes.FUSED_MODULES.items()}
    for row in schemes.scheme_table(cfg):
        module = type(row.module.module_class, (torch.nn.Module,), {})()
        if utils.should_ignore_layer(row.name, ignore=ignore, fused_mapping=fused):
            assert row.kind == schemes.UNQUANTIZED and row.matched_by == "ignore"
            continue
        want = utils.find_matched_target(row.name, module, targets, fused)
        assert row.target == want, row.name


def test_layer_regex_matches_exactly():
    for layers in (range(17, 32), range(0, 17), [0, 1], [3], range(0, 32), [5, 7, 9, 10, 11, 99], range(8, 13)):
        rx = re.compile(recipe.layer_regex(layers))
        assert {i for i in range(120) if rx.fullmatch(str(i))} == set(layers)
    assert recipe.layer_regex(range(17, 32)) == "(1[7-9]|2[0-9]|3[01])"


# --------------------------------------------------------------------------- kernels


def test_kernel_prediction():
    hop = kernels.predict_kernel(schemes.NVFP4_W4A4, "9.0")
    assert hop.kernel == "MarlinNvFp4LinearKernel" and hop.numerics.startswith("W4A16")
    assert hop.description.startswith("NVFP4 W4A4 runs as Marlin W4A16 (weights only")
    assert "Hopper" in hop.description
    assert kernels.predict_kernel(schemes.FP8_W8A8, (9, 0)).kernel == "CutlassFP8ScaledMMLinearKernel"
    assert kernels.predict_kernel(schemes.FP8_W8A8, 89).kernel == "CutlassFP8ScaledMMLinearKernel"
    assert kernels.predict_kernel(schemes.FP8_W8A8, "8.0").kernel == "MarlinFP8ScaledMMLinearKernel"
    assert kernels.predict_kernel(schemes.NVFP4_W4A4, "10.0").numerics == "W4A4"
    assert kernels.predict_kernel(schemes.NVFP4_W4A4, "10.0", flashinfer=False).kernel == "CutlassNvFp4LinearKernel"
    assert kernels.predict_kernel(schemes.NVFP4_W4A4, "12.0").kernel == "FlashInferCutlassNvFp4LinearKernel"
    assert kernels.predict_kernel(schemes.NVFP4_W4A4, "9.0", linear_backend="emulation").kernel == "EmulationNvFp4LinearKernel"
    # --nvfp4-kernel bf16: the plugin's kernel for W4A4 layers on any GPU; weight-only NVFP4 keeps Marlin
    bf16 = kernels.predict_kernel(schemes.NVFP4_W4A4, "9.0", nvfp4_kernel="bf16")
    assert bf16.kernel == "Bf16NvFp4LinearKernel" and bf16.numerics == "W4A16 (weights dequantized to BF16)"
    assert kernels.predict_kernel(schemes.NVFP4_W4A4, "10.0", nvfp4_kernel="bf16").kernel == "Bf16NvFp4LinearKernel"
    assert kernels.predict_kernel(schemes.NVFP4_W4A16, "9.0", nvfp4_kernel="bf16").kernel == "MarlinNvFp4LinearKernel"
    # --nvfp4-kernel auto: the BF16 GEMMs where vLLM's own would be Marlin (SM75 up to Blackwell), vLLM's from there
    auto = kernels.predict_kernel(schemes.NVFP4_W4A4, "9.0", nvfp4_kernel="auto")
    assert auto.kernel == "Bf16NvFp4LinearKernel" and "(--nvfp4-kernel auto;" in auto.description
    assert kernels.predict_kernel(schemes.NVFP4_W4A4, "10.0", nvfp4_kernel="auto").kernel == \
        "FlashInferCuteDslNvFp4LinearKernel"
    assert kernels.predict_kernel(schemes.NVFP4_W4A4, "9.0", nvfp4_kernel="auto",
                                  linear_backend="emulation").kernel == "EmulationNvFp4LinearKernel"
    assert [kernels.resolve_nvfp4_kernel("auto", c) for c in (None, "7.0", "7.5", "8.9", "9.0", "10.0", "12.1")] == [
        "vllm", "vllm", "bf16", "bf16", "bf16", "vllm", "vllm"]
    assert kernels.resolve_nvfp4_kernel("bf16", "10.0") == "bf16" and kernels.resolve_nvfp4_kernel("vllm", 90) == "vllm"
    assert kernels.predict_kernel(schemes.UNQUANTIZED, "9.0").scheme_class == "UnquantizedLinearMethod"
    assert not kernels.predict_kernel(schemes.FP8_W8A8, "7.0").supported
    assert kernels.parse_capability("sm_90") == kernels.parse_capability(90) == kernels.parse_capability("9.0") == (9, 0)
    assert kernels.parse_capability("12.1") == (12, 1)


# --------------------------------------------------------------------------- numerics


def test_e2m1_rounding_and_packing():
    x = torch.tensor([0.0, 0.25, 0.26, 0.75, 1.25, 1.3, 1.75, 2.5, 2.6, 3.5, 5.0, 5.1, 9.0, -0.74, -3.0, -7.0])
    want = [0.0, 0.0, 0.5, 1.0, 1.0, 1.5, 2.0, 2.0, 3.0, 4.0, 4.0, 6.0, 6.0, -0.5, -3.0, -6.0]
    assert numerics.e2m1_round(x).tolist() == want
    grid = numerics.e2m1_round(torch.randn(8, 32) * 3)
    assert torch.equal(numerics.unpack_e2m1(numerics.pack_e2m1(grid)), grid)
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8

    assert torch.equal(numerics.pack_e2m1(grid), pack_fp4_to_uint8(grid))


def test_nvfp4_and_fp8_roundtrip_errors():
    torch.manual_seed(0)
    w = (torch.randn(64, 256) * 0.05).to(torch.bfloat16)
    packed, scale, g = numerics.nvfp4_quantize(w)
    assert packed.dtype == torch.uint8 and packed.shape == (64, 128)
    assert scale.dtype == torch.float8_e4m3fn and scale.shape == (64, 16) and g.dtype == torch.float32
    rel = float((numerics.nvfp4_dequantize(packed, scale, g) - w.float()).norm() / w.float().norm())
    assert 0.05 < rel < 0.12                             # NVFP4: ~9.4 % on Gaussian weights
    # vLLM keeps the global scale as a multiplier (1 / divisor) after loading: the same weights from it; with a
    # power-of-two multiplier every E2M1 value times its E4M3 block scale is exact in BF16
    m = (1.0 / g).float()
    assert torch.allclose(numerics.nvfp4_dequantize(packed, scale, m, divisor=False),
                          numerics.nvfp4_dequantize(packed, scale, g), rtol=1e-6, atol=0)
    exact = numerics.nvfp4_dequantize(packed, scale, torch.tensor([2.0 ** -3]), divisor=False)
    assert torch.equal(exact.to(torch.bfloat16).float(), exact)
    q, s = numerics.fp8_quantize_channel(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (64, 1)
    assert float((q.float() * s.float() - w.float()).norm() / w.float().norm()) < 0.04
    x = torch.randn(3, 5, 256)
    assert float((numerics.fp8_fake_quant_tokens(x) - x).norm() / x.norm()) < 0.04
    assert float((numerics.nvfp4_fake_quant_activation(x, numerics.nvfp4_global_scale(x.abs().amax(), torch.float32)) - x).norm()
                 / x.norm()) < 0.15


def _stock_pair(seed=0):
    """Two fused shards quantized with their own divisors, like stock llm-compressor 0.14 for the GDN."""
    torch.manual_seed(seed)
    prefix = "model.language_model.layers.4.linear_attn."
    weights = {"in_proj_qkv": (torch.randn(96, 64) * 0.12).to(torch.bfloat16),
               "in_proj_z": (torch.randn(32, 64) * 0.05).to(torch.bfloat16)}
    tensors = {}
    for leaf, w in weights.items():
        packed, scale, g = numerics.nvfp4_quantize(w)
        tensors.update({f"{prefix}{leaf}.weight_packed": packed, f"{prefix}{leaf}.weight_scale": scale,
                        f"{prefix}{leaf}.weight_global_scale": g,
                        f"{prefix}{leaf}.input_global_scale": torch.tensor([500.0])})
    return prefix, weights, tensors


def test_global_scale_check_and_fix_on_synthetic_tensors():
    prefix, weights, tensors = _stock_pair()
    (group,) = fused_scales.fused_global_scales(tensors)
    assert group.module == prefix + "in_proj_qkvz" and not group.weight_ok and group.input_ok
    factors = dict(zip(["qkv", "z"], group.vllm_factors()))
    assert factors["z"] == 1.0 and factors["qkv"] < 0.6        # vLLM keeps z's (larger) divisor
    assert "vLLM keeps the max" in group.describe()

    def as_vllm_uses(t, leaf):   # max divisor for every shard
        g = max(group.weight_global_scales)
        return numerics.nvfp4_dequantize(t[f"{prefix}{leaf}.weight_packed"], t[f"{prefix}{leaf}.weight_scale"], torch.tensor([g]))

    def err(a, w):
        return float((a - w.float()).norm() / w.float().norm())

    broken = err(as_vllm_uses(tensors, "in_proj_qkv"), weights["in_proj_qkv"])
    qkv_before = tensors[prefix + "in_proj_qkv.weight_packed"].clone()
    fixes = fused_scales.unify_fused_global_scales(tensors)
    assert [f.shard for f in fixes] == [prefix + "in_proj_z"]     # re-exported at the group's min divisor
    (fixed,) = fused_scales.fused_global_scales(tensors)
    assert fixed.ok and fixed.weight_global_scales[0] == min(group.weight_global_scales)
    assert torch.equal(tensors[prefix + "in_proj_qkv.weight_packed"], qkv_before)   # largest-amax shard untouched
    g = torch.tensor([fixed.weight_global_scales[0]])
    after = {leaf: err(numerics.nvfp4_dequantize(tensors[f"{prefix}{leaf}.weight_packed"],
                                          tensors[f"{prefix}{leaf}.weight_scale"], g), weights[leaf])
             for leaf in weights}
    assert broken > 0.4 and after["in_proj_qkv"] < 0.11 and after["in_proj_z"] < 0.12
    assert fixes[0].relative_change < 0.05
    assert fused_scales.unify_fused_global_scales(tensors) == []      # idempotent


def test_fix_fused_global_scales_on_disk(tmp_path):
    import json

    from safetensors.torch import save_file

    prefix, _, tensors = _stock_pair(1)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"text_config": TEXT}))
    (ckpt / "joint_head_config.json").write_text("{}")
    save_file({}, str(ckpt / "joint_head.safetensors"))
    save_file(tensors, str(ckpt / "model-00001-of-00001.safetensors"))
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors" for k in tensors}}))
    assert not fused_scales.fused_global_scales(ckpt)[0].ok
    copy = tmp_path / "fixed"
    assert len(fused_scales.fix_fused_global_scales(ckpt, copy)) == 1
    assert not fused_scales.fused_global_scales(ckpt)[0].ok and fused_scales.fused_global_scales(copy)[0].ok
    assert len(fused_scales.fix_fused_global_scales(ckpt)) == 1        # in place
    assert fused_scales.fused_global_scales(ckpt)[0].ok
    assert fused_scales.fix_fused_global_scales(ckpt) == []
    assert not list(ckpt.glob(".*tmp*")) and not list(tmp_path.glob(".*tmp*"))
