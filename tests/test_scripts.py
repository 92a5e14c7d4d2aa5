"""scripts/ (the shells of clef_vllm.tools): the Hybrid checkpoint pipeline end to end on the tiny release checkpoint.

build_data --synthetic -> quantize_mixed --split 2 (llm-compressor in .venv-quant; the native
exporter when that venv is missing) -> shrink_tables -> clef_load -> the package's loaders.

``hybrid_pipeline`` (session scope) is the pipeline's output; reuse it for further load tests
(e.g. the vLLM plugin on CPU).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
SPLIT = 2


def quant_python() -> str | None:
    """The interpreter that has llm-compressor (``CLEF_QUANT_PYTHON`` or ``.venv-quant``)."""
    path = Path(os.environ.get("CLEF_QUANT_PYTHON") or REPO / ".venv-quant" / "bin" / "python")
    return str(path) if path.exists() else None


def run_script(name: str, *args, python: str | None = None, expect: int = 0) -> subprocess.CompletedProcess:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([python or sys.executable, str(SCRIPTS / name), *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=900)
    if proc.returncode != expect:
        raise AssertionError(f"{name} {' '.join(map(str, args))} exited {proc.returncode} (expected {expect})\n"
                             f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
    return proc


@dataclass
class HybridPipeline:
    source: Path          # tiny BF16 release checkpoint
    data: Path            # build_data output folder
    quantized: Path       # quantize_mixed output (release layout, compressed-tensors)
    checkpoint: Path      # shrink_tables output: the final repacked Hybrid checkpoint
    engine: str           # "llmcompressor" or "native"
    split: int
    report: dict          # clef_load --json
    outputs: dict         # stdout of each step


@pytest.fixture(scope="session")
def hybrid_pipeline(tmp_path_factory, tiny_release) -> HybridPipeline:
    base = tmp_path_factory.mktemp("hybrid")
    outputs = {}
    data = base / "data"
    outputs["build_data"] = run_script("build_data.py", "--out", data, "--synthetic", "--synthetic-count", 300).stdout
    python = quant_python()
    engine = "llmcompressor" if python else "native"
    quantized = base / "tiny-hybrid"
    outputs["quantize_mixed"] = run_script(
        "quantize_mixed.py", "--source", tiny_release, "--split", SPLIT, "--data", data, "--out", quantized,
        "--engine", engine, "--num-calibration-samples", 16, "--max-seq-length", 1024, python=python).stdout
    final = base / "tiny-hybrid-int8"
    outputs["shrink_tables"] = run_script("shrink_tables.py", quantized, "--out", final).stdout
    report_file = base / "clef_load.json"
    outputs["clef_load"] = run_script("clef_load.py", final, "--capability", "9.0", "--json", report_file).stdout
    return HybridPipeline(tiny_release, data, quantized, final, engine, SPLIT,
                          json.loads(report_file.read_text()), outputs)


def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    from clef_vllm.model.checkpoint import iter_backbone_tensors, locate_checkpoint

    return dict(iter_backbone_tensors(locate_checkpoint(path)))


# --------------------------------------------------------------------------- build_data


def test_build_data_records_are_systemone_requests(hybrid_pipeline, tmp_path):
    from clef_vllm.schema.dialects import parse_request
    from clef_vllm.schema.encoding import RequestEncoder
    from clef_vllm.schema.protocol import Dialect
    from clef_vllm.schema.records import load_request_file, read_records, request_body

    run_script("build_data.py", "--out", tmp_path, "--synthetic", "--synthetic-count", 300)
    for split in ("train", "heldout"):      # deterministic
        assert (tmp_path / f"{split}.jsonl").read_bytes() == (hybrid_pipeline.data / f"{split}.jsonl").read_bytes()
    train, held = read_records(tmp_path), read_records(tmp_path, split="heldout")
    assert len(train) + len(held) == 300 and held and not {r["id"] for r in train} & {r["id"] for r in held}
    encoder = RequestEncoder.from_pretrained(hybrid_pipeline.source)
    for record in train[:50] + held:
        request = parse_request(request_body(record), Dialect.WORKERS_AI)   # strict dialect: a clean body
        parse_request(record)                                               # reference: extra keys ignored
        encoded = encoder.encode(request)
        assert set(record["answer"]) == set(request.questions)
        for field in encoded.fields:
            assert record["answer"][field.question_id] in field.option_ids
    # the tools' reader (clef-bench / clef-parity --requests) sees the same bodies and answers
    loaded = load_request_file(tmp_path, split="heldout")
    assert [r.body for r in loaded] == [request_body(r) for r in held]
    assert [r.answer for r in loaded] == [r["answer"] for r in held] and loaded[0].source == held[0]["source"]
    assert "records" in hybrid_pipeline.outputs["build_data"] or "wrote" in hybrid_pipeline.outputs["build_data"]


def test_a_missing_checkpoint_is_named_with_the_tools_own_flag(tmp_path):
    for script, flag in (("quantize_mixed.py", "--source"), ("sensitivity_scan.py", "--model")):
        args = [flag, tmp_path / "tiny", "--out" if flag == "--source" else "--json", tmp_path / "out"]
        proc = run_script(script, *args, *(["--split", 2] if flag == "--source" else []), expect=2)
        assert f"{flag} {tmp_path / 'tiny'}: not a directory" in proc.stderr and "Traceback" not in proc.stderr


def test_quantization_tools_import_neither_vllm_nor_the_server():
    """clef-quantize-mixed runs in the llm-compressor venv, where clef-vllm has no dependencies
    installed: what it imports must not need vLLM (or the server's FastAPI stack)."""
    code = ("import sys, clef_vllm.tools.quantize_mixed, clef_vllm.quant.fused_scales, clef_vllm.quant.fake_quant, "
            "clef_vllm.quant.kernels, clef_vllm.schema.records, clef_vllm.backends.reference; "
            "bad = [m for m in ('vllm', 'fastapi', 'uvicorn', 'clef_vllm.server') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


# --------------------------------------------------------------------------- the pipeline


def test_pipeline_checkpoint_passes_clef_load(hybrid_pipeline):
    report = hybrid_pipeline.report
    assert report["ok"], [f for f in report["findings"] if f["level"] != "ok"]
    assert report["schemes"] == {"fp8_w8a8": 8, "nvfp4_w4a4": 8, "unquantized": 3}
    for entry in report["layers"]:
        want = "fp8_w8a8" if entry["layer"] < SPLIT else "nvfp4_w4a4"
        assert {k for m, k in entry["modules"].items() if m != "in_proj_ba"} == {want}
        assert entry["modules"].get("in_proj_ba", "unquantized") == "unquantized"
    kernels = {k["kind"]: k["kernel"] for k in report["kernels"]}
    # the server's default (--nvfp4-kernel auto) on SM90: the NVFP4 layers as BF16 GEMMs on weights dequantized
    # at load, FP8 on CUTLASS
    assert kernels == {"fp8_w8a8": "CutlassFP8ScaledMMLinearKernel", "nvfp4_w4a4": "Bf16NvFp4LinearKernel",
                       "unquantized": "torch/cuBLAS GEMM"}
    out = hybrid_pipeline.outputs
    assert "fused NVFP4 groups: 4, all sharing one weight global scale" in out["quantize_mixed"]
    assert "relative error" in out["shrink_tables"] and "requires_clef_vllm" in out["shrink_tables"]
    assert "PASS" in out["clef_load"] and "runs as BF16 GEMMs on weights dequantized at load" in out["clef_load"]
    vision = [f["message"] for f in report["findings"] if f["section"] == "vision"]    # the quantized build keeps it BF16
    assert len(vision) == 1 and vision[0].startswith("vision tower: 21 tensors, 92,864 parameters")
    # the prediction for clef-systemone --nvfp4-kernel vllm: Marlin W4A16 on Hopper, FP8 unchanged
    marlin = run_script("clef_load.py", hybrid_pipeline.checkpoint, "--capability", "9.0", "--config-only",
                        "--nvfp4-kernel", "vllm").stdout
    assert "MarlinNvFp4LinearKernel" in marlin and "CutlassFP8ScaledMMLinearKernel" in marlin and "PASS" in marlin
    assert "NVFP4 W4A4 runs as Marlin W4A16" in marlin


def test_pipeline_checkpoint_loads_with_package_loaders(hybrid_pipeline):
    from clef_vllm import ARCHITECTURE
    from clef_vllm.model.checkpoint import load_head, locate_checkpoint
    from clef_vllm.model.tables import load_int8_tables
    from clef_vllm.quant.fused_scales import fused_global_scales
    from clef_vllm.quant.schemes import read_quantization_config

    files = locate_checkpoint(hybrid_pipeline.checkpoint)
    assert files.layout == "repacked" and files.tables_file is not None
    assert files.config["architectures"] == [ARCHITECTURE]
    head = load_head(files)
    assert head.config.requires_clef_vllm
    tables = load_int8_tables(files.tables_file)
    assert tables["lm_head"].num_rows == files.text_config["vocab_size"]
    qc = read_quantization_config(files)       # compressed-tensors 0.17 (vLLM's pin) parses the output
    assert qc.format == "mixed-precision" and set(qc.config_groups) == {"group_0", "group_1"}
    if hybrid_pipeline.engine == "llmcompressor":
        assert files.quantization_config["version"] == "0.19.0"
    assert all(g.ok for g in fused_global_scales(files))
    assert len(fused_global_scales(files)) == 4


def test_quantization_keeps_16bit_parts_exact(hybrid_pipeline):
    src, out = tensors_of(hybrid_pipeline.source), tensors_of(hybrid_pipeline.checkpoint)
    kept = [k for k in src if not k.startswith("mtp.") and (k.startswith("model.visual.") or "norm" in k or "in_proj_a." in k or "in_proj_b." in k
            or "conv1d" in k or k.endswith(("A_log", "dt_bias")))]
    assert kept and all(torch.equal(src[k], out[k]) for k in kept)
    assert not [k for k in out if k.startswith("mtp.")]
    assert "lm_head.weight" not in out and "model.language_model.embed_tokens.weight" not in out
    assert out["model.language_model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert out["model.language_model.layers.3.self_attn.q_proj.weight_packed"].dtype == torch.uint8


def test_recipe_yaml_documents_the_config(hybrid_pipeline):
    import yaml

    recipe = yaml.safe_load((hybrid_pipeline.checkpoint / "recipe.yaml").read_text())
    modifier = recipe["default_stage"]["default_modifiers"]["QuantizationModifier"]
    config = json.loads((hybrid_pipeline.checkpoint / "config.json").read_text())["quantization_config"]
    assert {g: v["targets"] for g, v in modifier["config_groups"].items()} == \
        {g: v["targets"] for g, v in config["config_groups"].items()}
    assert modifier["ignore"] == ["lm_head", "re:.*visual.*"]
    assert all("language_model" not in t for g in config["config_groups"].values() for t in g["targets"])
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json",
                 "video_preprocessor_config.json", "processor_config.json"):    # the vision tower stays BF16 too
        assert (hybrid_pipeline.checkpoint / name).read_bytes() == (hybrid_pipeline.source / name).read_bytes()


def test_llmcompressor_and_native_exporter_agree(hybrid_pipeline, tmp_path):
    """The native exporter writes the same checkpoint as llm-compressor (bit for bit, except the
    calibrated input global scales: llm-compressor observes activations behind already-quantized layers)."""
    if hybrid_pipeline.engine != "llmcompressor":
        pytest.skip("llm-compressor venv (.venv-quant) not installed; run scripts/install-dev.sh")
    native = tmp_path / "native"
    run_script("quantize_mixed.py", "--source", hybrid_pipeline.source, "--split", SPLIT, "--data", hybrid_pipeline.data,
               "--out", native, "--engine", "native", "--num-calibration-samples", 16, "--max-seq-length", 1024)
    a, b = tensors_of(hybrid_pipeline.quantized), tensors_of(native)
    assert set(a) == set(b)
    for key in a:
        if key.endswith("input_global_scale"):
            assert abs(float(a[key]) / float(b[key]) - 1) < 0.05, key
        else:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key].view(torch.uint8) if a[key].dtype ==
                                                                torch.float8_e4m3fn else a[key],
                                                                b[key].view(torch.uint8) if b[key].dtype ==
                                                                torch.float8_e4m3fn else b[key]), key
    ca = json.loads((hybrid_pipeline.quantized / "config.json").read_text())["quantization_config"]
    cb = json.loads((native / "config.json").read_text())["quantization_config"]
    for key in ("config_groups", "ignore", "format", "quant_method", "quantization_status"):
        assert ca[key] == cb[key], key


def test_unfused_gdn_scales_are_refused(hybrid_pipeline, tmp_path):
    """Stock llm-compressor 0.14 (no FUSED_LAYER_NAMES patch) gives in_proj_qkv/in_proj_z different
    global scales (vLLM would keep the max and mis-scale the other): the script refuses to write that output."""
    python = quant_python()
    if python is None:
        pytest.skip("llm-compressor venv (.venv-quant) not installed")
    args = ["--source", hybrid_pipeline.source, "--split", 0, "--data", hybrid_pipeline.data,
            "--num-calibration-samples", 4, "--max-seq-length", 1024, "--no-fuse-gdn"]
    proc = run_script("quantize_mixed.py", *args, "--out", tmp_path / "stock", python=python, expect=1)
    assert "weight global scales differ" in proc.stderr and not (tmp_path / "stock").exists()
    assert not list(tmp_path.glob(".stock.tmp-*"))
    # the re-export itself (--fix-scales / fix_fused_global_scales) is covered by test_clef_load_flags_broken_checkpoints


def test_split_edges(tmp_path):
    """K=0: all NVFP4, K=num_layers: all FP8 (one config group each); K outside [0, L] is refused."""
    from clef_vllm.model.tiny import tiny_text_config
    from clef_vllm.quant.recipe import hybrid_config_groups
    from clef_vllm.quant.schemes import FP8_W8A8, NVFP4_W4A4, scheme_table, summarize_schemes
    from clef_vllm.tools import quantize_mixed

    source_config = tmp_path / "tiny_config.json"
    source_config.write_text(json.dumps({"architectures": ["Qwen3_5ForCausalLM"],
                                         **tiny_text_config({"<|endoftext|>": 0}, 1024)}))
    for split, kind in ((0, NVFP4_W4A4), (4, FP8_W8A8)):
        out = tmp_path / f"k{split}"
        quantize_mixed.emit_config_only(source_config, out, split, None, None)
        config = json.loads((out / "config.json").read_text())
        assert len(config["quantization_config"]["config_groups"]) == 1
        assert config["quantization_config"]["format"] == ("nvfp4-pack-quantized" if split == 0 else "float-quantized")
        assert summarize_schemes(scheme_table(config)) == {kind: 16, "unquantized": 3}
        # no head config given: the release head's shape on this backbone's hidden size, with the marker
        head = json.loads((out / "clef_head" / "joint_head_config.json").read_text())
        assert head["hidden_size"] == config["hidden_size"] and head["width"] == 1024 and head["layers"] == 4
        assert head["requires_clef_vllm"]
    with pytest.raises(ValueError):
        hybrid_config_groups(4, 5)


# --------------------------------------------------------------------------- shrink_tables


def test_shrink_tables_in_place_rerun_and_no_half_written(hybrid_pipeline, tmp_path):
    from clef_vllm.model.repack import repack_tables

    work = tmp_path / "ckpt"
    shutil.copytree(hybrid_pipeline.quantized, work)
    before = sorted(p.name for p in work.iterdir())

    def boom(_name):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        repack_tables(work, work, progress=boom)
    assert sorted(p.name for p in work.iterdir()) == before and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]

    out = run_script("shrink_tables.py", work).stdout
    assert "in place" in out and "mean row cosine" in out
    again = run_script("shrink_tables.py", work, "--marker", ">=0.1").stdout
    assert "already repacked" in again
    assert json.loads((work / "clef_head" / "joint_head_config.json").read_text())["requires_clef_vllm"] == ">=0.1"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert _check(work)[0]


# --------------------------------------------------------------------------- clef_load on broken checkpoints


def _rewrite(ckpt: Path, edit) -> None:
    """Apply ``edit(tensors)`` to every backbone file and re-index."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for name in sorted(set(index["weight_map"].values())):
        with safe_open(str(ckpt / name), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        edit(tensors)
        save_file(tensors, str(ckpt / name), metadata={"format": "pt"})
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != name} | {k: name for k in tensors}
    index_path.write_text(json.dumps(index))


def _check(path) -> tuple[bool, str]:
    from clef_vllm.tools.clef_load import check_checkpoint

    report = check_checkpoint(path, capability="9.0")
    return report.ok, "\n".join(report.errors())


def test_clef_load_flags_broken_checkpoints(hybrid_pipeline, tmp_path):
    from clef_vllm.quant.fused_scales import fix_fused_global_scales
    from clef_vllm.quant.numerics import nvfp4_dequantize, nvfp4_quantize

    z = "model.language_model.layers.2.linear_attn.in_proj_z."

    def copy(name):
        dst = tmp_path / name
        shutil.copytree(hybrid_pipeline.checkpoint, dst)
        return dst

    r1 = copy("r1")       # a stock-llm-compressor-like unshared GDN scale: re-export in_proj_z at its own divisor
    def own_divisor(t):
        w = nvfp4_dequantize(t[z + "weight_packed"], t[z + "weight_scale"], t[z + "weight_global_scale"])
        t[z + "weight_packed"], t[z + "weight_scale"], t[z + "weight_global_scale"] = nvfp4_quantize(
            w.to(torch.bfloat16) * 0.25)
    _rewrite(r1, own_divisor)
    ok, errors = _check(r1)
    assert not ok and "weight global scales differ" in errors and "vLLM keeps the max" in errors
    assert fix_fused_global_scales(r1)
    assert _check(r1)[0]

    missing = copy("missing")
    _rewrite(missing, lambda t: t.pop("model.language_model.layers.1.post_attention_layernorm.weight", None))
    ok, errors = _check(missing)
    assert not ok and "1 missing" in errors

    nan = copy("nan")
    _rewrite(nan, lambda t: t["model.language_model.norm.weight"].__setitem__(0, float("nan")))
    ok, errors = _check(nan)
    assert not ok and "non-finite" in errors

    anchored = copy("anchored")    # regex targets anchored on the checkpoint prefix match no vLLM module
    config = json.loads((anchored / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["targets"] = [t.replace("re:.*layers", r"re:model\.language_model\.layers") for t in group["targets"]]
    (anchored / "config.json").write_text(json.dumps(config))
    ok, errors = _check(anchored)
    assert not ok and "missing" in errors and "unexpected" in errors


# --------------------------------------------------------------------------- the root files


def test_root_files_are_generated_from_the_clef_flash_config(tmp_path):
    """README's command regenerates the three root files from the release's config.json, byte for byte."""
    from clef_vllm.tools.clef_load import check_config_only

    out = run_script("quantize_mixed.py", "--emit-config-only", "--out", tmp_path).stdout
    assert out.count("wrote ") == 3
    for name in ("config.json", "recipe.yaml", "clef_head/joint_head_config.json"):
        assert (tmp_path / name).read_bytes() == (REPO / name).read_bytes(), f"{name}: regenerate with quantize_mixed.py"

    report = check_config_only(REPO, capability="9.0")
    assert report.ok, report.errors()
    assert report.schemes == {"fp8_w8a8": 68, "nvfp4_w4a4": 60, "unquantized": 24}


# --------------------------------------------------------------------------- sensitivity scan


def test_sensitivity_scan_on_the_tiny_checkpoint(hybrid_pipeline, tmp_path):
    out = tmp_path / "scan.json"
    proc = run_script("sensitivity_scan.py", "--model", hybrid_pipeline.source, "--data", hybrid_pipeline.data,
                      "--records", 1, "--max-length", 1024, "--device", "cpu", "--json", out)   # 13 runs of one record
    result = json.loads(out.read_text())
    assert len(result["entries"]) == 2 * result["layers"] == 8
    assert {e["group"] for e in result["entries"]} == {"attn", "mlp"}
    assert all(e["kl"] >= 0 and 0 <= e["agreement"] <= 1 for e in result["entries"])
    assert [s["split"] for s in result["splits"]] == list(range(5)) and "kl" in result["splits"][0]
    assert 0 <= result["suggested_split"] <= 4
    assert (tmp_path / "scan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "cumulative damage" in proc.stdout and "suggested split: K =" in proc.stdout
