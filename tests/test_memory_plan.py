"""The GPU memory plan (clef_vllm.plan.memory_plan, clef_vllm.plan.shapes): weights from parameter shapes (the 9B Hybrid config and the
tiny checkpoints' real tensors), vLLM 0.28's KV arithmetic against its logged lines, the NVFP4 kernel
choice, fit() on a 16 GB card, the does-not-fit message and ``clef-load --gpu-memory``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from safetensors import safe_open

from clef_vllm.backends.memory_fit import plan_for_checkpoint
from clef_vllm.backends.options import VllmOptions
from clef_vllm.model.layout import NOT_TEXT_PREFIXES
from clef_vllm.plan import memory_plan as MP

GIB = MP.GIB
#: What vLLM gives a 16 GB card by default: 0.9 of its 15.92 GiB.
CARD_16 = int(15.92 * GIB)


@pytest.fixture(scope="module")
def hybrid_9b(tmp_path_factory) -> Path:
    """A config-only 9B Hybrid folder (repacked layout, layers 0-16 FP8, 17-31 NVFP4), as
    ``bench/make_ckpt.py 9b DIR --hybrid 17`` writes it (without a tokenizer)."""
    from clef_vllm.model.release import clef_flash_config, write_config_only_checkpoint
    from clef_vllm.quant.recipe import ignore_list, quantization_config

    config = clef_flash_config()
    config["quantization_config"] = quantization_config(config, 17, ignore_list(config))
    empty = tmp_path_factory.mktemp("no-tokenizer")
    return write_config_only_checkpoint(tmp_path_factory.mktemp("ckpt") / "9b-hybrid", empty, layout="repacked",
                                        config=config)


@pytest.fixture(scope="module")
def bf16_9b(tmp_path_factory) -> Path:
    from clef_vllm.model.release import write_config_only_checkpoint

    empty = tmp_path_factory.mktemp("no-tokenizer")
    return write_config_only_checkpoint(tmp_path_factory.mktemp("ckpt") / "9b", empty, layout="repacked")


def parts(plan: MP.MemoryPlan) -> dict[str, int]:
    return {p.name: p.bytes for p in plan.parts}


# --------------------------------------------------------------------------- weights


def test_weights_per_part_on_the_9b_hybrid(hybrid_9b):
    """Every weight part from the 9B's shapes, counted here by hand: h 4096, MLP 12288, attention q (gated)
    8192 + k 1024 + v 1024 + o 4096 rows, GDN qkv 8192 + z 4096 + out 4096 rows (b, a: 32 rows each,
    unquantized), 248,320-row tables; layers 0-16 FP8 (4 attention + 13 GDN), 17-31 NVFP4 (4 + 11)."""
    h, inter, vocab = 4096, 12288, 248320
    attn = (8192 + 1024 + 1024) * h + h * 4096
    gdn = (8192 + 4096) * h + h * 4096
    mlp = 2 * inter * h + h * inter
    attn_rows, gdn_rows, mlp_rows = 8192 + 1024 + 1024 + 4096, 8192 + 4096 + 4096, 2 * inter + h
    fp8 = 4 * (attn + mlp) + 13 * (gdn + mlp)
    fp8_rows = 4 * (attn_rows + mlp_rows) + 13 * (gdn_rows + mlp_rows)
    nvfp4 = 4 * (attn + mlp) + 11 * (gdn + mlp)
    nvfp4_modules = 4 * 4 + 11 * 4             # qkv, o, gate_up, down / in_proj_qkvz, out_proj, gate_up, down
    conv = 8192 * 4                            # conv1d: q, k, v channels x kernel 4
    rotary = 4 * 262144 * 64 * 2               # M-RoPE's cos/sin cache: 4 x max positions x 64 rotary dims
    leftovers = 2 * (h + 32 * (2 * h) + 24 * (conv + 32 + 128) + 8 * 2 * 256) + 24 * 32 * 4 + rotary
    model = MP.model_shape_for_checkpoint(hybrid_9b)
    bf16 = parts(MP.plan(model, MP.PlanInputs(budget_bytes=80 * GIB, nvfp4_kernel="bf16")))
    packed = parts(MP.plan(model, MP.PlanInputs(budget_bytes=80 * GIB, nvfp4_kernel="vllm")))
    assert bf16["FP8 W8A8 linears"] == fp8 + 4 * fp8_rows
    assert bf16["NVFP4 W4A4 linears (bf16)"] == 2 * nvfp4
    assert packed["NVFP4 W4A4 linears (vllm)"] == nvfp4 // 2 + nvfp4 // 16 + 16 * nvfp4_modules
    assert bf16["BF16 linears"] == 2 * 24 * (2 * 32 * h)
    assert bf16["BF16 leftovers"] == leftovers
    assert bf16["embedding"] == bf16["lm_head table"] == vocab * h + 4 * vocab
    assert bf16["vision tower"] == 2 * 456_010_480       # BF16 in every layout (counted against vLLM's: test_worker_model)
    assert bf16["joint head (bfloat16)"] == 2 * 121_762_820
    assert "vision encoder" in bf16
    text = MP.plan(model, MP.PlanInputs(budget_bytes=80 * GIB, vision=False))
    assert parts(text)["vision tower"] == 0 and "vision encoder" not in parts(text)
    assert "not loaded (--text-only)" in "\n".join(text.describe())
    fixed = lambda p: sum(x.bytes for x in p.parts if x.group != "plugin")    # noqa: E731 - shares of the KV room aside
    assert fixed(MP.plan(model, MP.PlanInputs(budget_bytes=80 * GIB))) - fixed(text) \
        == bf16["vision tower"] + bf16["vision encoder"]


def test_weights_against_vllm_model_loading(hybrid_9b, bf16_9b):
    """vLLM's "Model loading took" (BF16 embedding, the worker before its int8 embedding): 16.08 GiB for the
    BF16 9B, 12.85 GiB for the Hybrid with NVFP4 dequantized to BF16 (printed to 2 decimals). The Hybrid's
    figure holds 0.19 GiB more than its parameters: one FP8 block scale per 16 NVFP4 weights, which the
    BF16 kernel no longer reads. The int8 embedding saves 0.95 GiB. (Those engines were text only: no vision
    tower.)"""
    def weights(ckpt, **kw):
        return MP.plan(MP.model_shape_for_checkpoint(ckpt), MP.PlanInputs(budget_bytes=80 * GIB, vision=False,
                                                                           **kw)).bytes_of("weights") / GIB

    hybrid = MP.model_shape_for_checkpoint(hybrid_9b)
    assert weights(bf16_9b, int8_embedding=False) == pytest.approx(16.08, abs=0.005)
    block_scales = hybrid.nvfp4_weights / 16 / GIB
    hybrid_bf16 = weights(hybrid_9b, nvfp4_kernel="bf16", int8_embedding=False)
    assert hybrid_bf16 + block_scales == pytest.approx(12.85, abs=0.005)
    saved = weights(hybrid_9b, nvfp4_kernel="bf16", int8_embedding=False) - weights(hybrid_9b, nvfp4_kernel="bf16")
    assert saved == pytest.approx(0.946, abs=0.001)


def _tensor_bytes(files, skip=NOT_TEXT_PREFIXES) -> dict[str, int]:
    """Bytes of every backbone tensor in vLLM's dtypes (16-bit, A_log float32), by kind."""
    out = {"tables": 0, "rest": 0}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key.startswith(skip):
                    continue
                numel = 1
                for d in f.get_slice(key).get_shape():
                    numel *= d
                kind = "tables" if key.endswith(("embed_tokens.weight", "lm_head.weight")) else "rest"
                out[kind] += numel * (4 if key.endswith("A_log") else 2)
    return out


def test_weights_match_the_tiny_checkpoints_tensors(tiny_release, tiny_repacked):
    """A real (tiny, unquantized) checkpoint: the plan's weights are its tensors' bytes in vLLM's dtypes,
    plus the rotary cache; the repacked tables are the int8 file's bytes."""
    from clef_vllm.model.checkpoint import load_head_state, load_head_config, locate_checkpoint

    files = locate_checkpoint(tiny_release)
    model = MP.model_shape_for_checkpoint(tiny_release)
    plan = parts(MP.plan(model, MP.PlanInputs(budget_bytes=GIB)))
    text = files.text_config
    rope = 4 * text["max_position_embeddings"] * int(text["head_dim"] * 0.25) * 2     # M-RoPE's cos/sin cache
    found = _tensor_bytes(files.weight_files)
    assert plan["BF16 linears"] + plan["BF16 leftovers"] == found["rest"] + rope
    assert plan["embedding"] + plan["lm_head table"] == found["tables"]
    head = load_head_state(files, load_head_config(files))
    assert plan["joint head (bfloat16)"] == 2 * sum(t.numel() for t in head.values())

    repacked = locate_checkpoint(tiny_repacked)
    plan = parts(MP.plan(MP.model_shape_for_checkpoint(tiny_repacked), MP.PlanInputs(budget_bytes=GIB)))
    with safe_open(str(repacked.tables_file), framework="pt") as f:
        table_bytes = sum(f.get_tensor(k).nbytes for k in f.keys())
    assert plan["embedding"] + plan["lm_head table"] == table_bytes


# --------------------------------------------------------------------------- KV arithmetic


#: vLLM 0.28's lines for the 9B-shaped BF16 checkpoint, max_model_len 16384, state cache (prefix caching) on:
#: "Available KV cache memory: X GiB" -> "GPU KV cache size: N tokens, Maximum concurrency ...: C x".
MEASURED_KV = [(14.53, 388_473, "23.71"), (14.73, 394_078, "24.05"), (24.45, 654_066, "39.92"),
               (24.38, 651_910, "39.79")]


def test_kv_layout_of_the_9b(bf16_9b):
    kv = MP.model_shape_for_checkpoint(bf16_9b).kv
    assert kv.block_size == 528                   # 16 x ceil(GDN state 2,146,304 B / (16 x 4,096 B a token))
    assert kv.page_bytes == 528 * 2 * 4 * 256 * 2
    assert (kv.group_size, kv.attention_groups, kv.gdn_groups) == (8, 1, 3)
    assert kv.blocks_per_sequence(16384, prefix_caching=True) == 32 + 3 * 2
    assert kv.blocks_per_sequence(16384, prefix_caching=False) == 32 + 3


@pytest.mark.parametrize("gib_logged,tokens,concurrency", MEASURED_KV)
def test_kv_tokens_and_concurrency_as_vllm_logs_them(bf16_9b, gib_logged, tokens, concurrency):
    """The logged GiB is rounded to 2 decimals: some byte count in its rounding interval gives vLLM's line."""
    kv = MP.model_shape_for_checkpoint(bf16_9b).kv
    per_block = kv.page_bytes * kv.group_size
    low, high = kv.blocks(int((gib_logged - 0.005) * GIB)), kv.blocks(int((gib_logged + 0.005) * GIB))
    lines = {(kv.tokens(n * per_block, 16384, True), f"{kv.concurrency(n * per_block, 16384, True):.2f}")
             for n in range(low, high + 1)}
    assert (tokens, concurrency) in lines


# --------------------------------------------------------------------------- decisions


def test_nvfp4_kernel_by_memory(hybrid_9b):
    model = MP.model_shape_for_checkpoint(hybrid_9b)
    small = MP.PlanInputs(budget_bytes=int(0.9 * CARD_16), nvfp4_kernel="auto")
    large = MP.PlanInputs(budget_bytes=int(0.9 * 80 * GIB), nvfp4_kernel="auto")
    assert MP.choose_nvfp4_kernel(model, small) == "vllm"
    assert MP.choose_nvfp4_kernel(model, large) == "bf16"
    assert MP.choose_nvfp4_kernel(model, large, capability=(10, 0)) == "vllm"    # native W4A4 on Blackwell
    assert MP.choose_nvfp4_kernel(model, large, capability=(9, 0)) == "bf16"


def test_fit_on_a_16gb_card(hybrid_9b):
    """Default flags on a 16 GB card: the packed NVFP4 kernel, features turned down until five 16k-token
    sequences fit (3.05 GiB: what the Hybrid leaves for the KV cache on such a card), one line per change, in
    fit's order (the step's token budget first; the GEMM warm-up's row cap among them)."""
    plan = plan_for_checkpoint(hybrid_9b, device_total_bytes=CARD_16)
    assert plan.inputs.nvfp4_kernel == "vllm"
    assert plan.max_concurrency >= MP.MIN_SEQUENCES
    assert plan.kv_tokens >= 5 * 16384 and plan.kv_bytes >= 3.05 * GIB
    assert plan.changes and plan.changes[0].startswith("--max-num-batched-tokens 16,384 -> 8,192")
    assert any(line.startswith("GEMM warm-up capped at 4,096 rows") for line in plan.changes)
    assert all("GiB more for the KV cache" in line for line in plan.changes)
    before = MP.plan(plan.model, MP.PlanInputs.from_options(VllmOptions(), int(0.9 * CARD_16), nvfp4_kernel="vllm"))
    assert before.max_concurrency < MP.MIN_SEQUENCES < plan.max_concurrency
    assert plan.kv_bytes - before.kv_bytes > 0
    assert len(plan.describe()) == len(plan.parts) + 5 + len(plan.changes)
    # seeing, the largest image is lowered to 4 MP (the encoder vLLM profiles on it); text only, the vision tower
    # and its encoder leave room for the prefill graphs and the state cache
    assert any(line.startswith("--max-image-pixels 16,777,216 -> 4,194,304") for line in plan.changes)
    text = plan_for_checkpoint(hybrid_9b, device_total_bytes=CARD_16, vision=False)
    assert text.inputs.prefill_graphs and text.inputs.state_cache and not plan.inputs.prefill_graphs
    assert text.kv_bytes >= 3.05 * GIB and not any("image" in line for line in text.changes)
    # a stricter target turns more off; a large card changes nothing
    strict = plan_for_checkpoint(hybrid_9b, device_total_bytes=CARD_16, min_sequences=6, vision=False)
    assert len(strict.changes) > len(text.changes) and strict.kv_bytes > text.kv_bytes
    assert plan_for_checkpoint(hybrid_9b, device_total_bytes=80 * GIB).changes == ()


def test_from_options_reads_the_servers_settings():
    inputs = MP.PlanInputs.from_options(VllmOptions(), 10 * GIB)
    assert (inputs.max_model_len, inputs.max_num_batched_tokens, inputs.head_graph_records) == (16384, 16384, 16)
    assert inputs.state_cache and inputs.prefill_graphs and inputs.step_graphs and inputs.gemm_warmup
    lean = MP.PlanInputs.from_options(VllmOptions(head_graphs=False, state_cache=False, enforce_eager=True,
                                                  prefill_graph_scope="core", max_model_len=4096), GIB)
    assert (lean.head_graph_records, lean.state_cache_bytes, lean.cuda_graphs, lean.step_graphs) == (0, 0, False, False)
    assert lean.max_num_batched_tokens == 8192 and lean.warmup_rows == 8192


def test_does_not_fit_names_consumers_and_flags(hybrid_9b):
    with pytest.raises(MP.PlanDoesNotFit) as caught:
        plan_for_checkpoint(hybrid_9b, device_total_bytes=4 * GIB)
    message = str(caught.value)
    assert "\n" not in message and "Traceback" not in message
    assert "3.60 GiB budget" in message and "FP8 W8A8 linears 3.42 GiB" in message
    for flag in ("--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--state-cache off",
                 "--gpu-memory-utilization"):
        assert flag in message
    assert "--text-only (the vision tower and its encoder: 0.88 GiB less)" in message
    with pytest.raises(MP.PlanDoesNotFit, match=r"--nvfp4-kernel vllm \(4\.14 GiB less\)") as caught:
        plan_for_checkpoint(hybrid_9b, device_total_bytes=CARD_16, nvfp4_kernel="bf16", vision=False)
    assert "--text-only" not in str(caught.value)


@pytest.mark.parametrize("text,size", [("16GiB", 16 * GIB), ("15.92GiB", int(15.92 * GIB)), ("24GB", 24 * 10**9),
                                       ("16303MiB", 16303 << 20), ("17179869184", 16 * GIB), (" 8 gib ", 8 * GIB)])
def test_parse_size(text, size):
    assert MP.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "16XB", "-1GiB", "0"])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError, match="expected a size|must be positive"):
        MP.parse_size(text)


# --------------------------------------------------------------------------- clef-load --gpu-memory


def clef_load(capsys, *args) -> subprocess.CompletedProcess:
    """``clef-load ARGS`` (its console script's ``main``) in this process, reported as the finished command."""
    from clef_vllm.tools.clef_load import main

    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["clef-load", *args], code, out.out, out.err)


def test_clef_load_prints_the_plan(hybrid_9b, tmp_path, capsys):
    out = tmp_path / "plan.json"
    proc = clef_load(capsys, hybrid_9b, "--gpu-memory", "15.92GiB", "--json", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for text in ("GPU memory plan: budget 14.33 GiB", "FP8 W8A8 linears", "NVFP4 W4A4 linears (vllm)",
                 "vision tower", "BF16, 456,010,480 parameters", "vision encoder", "KV cache", "16,384-token sequences", "fit: GEMM warm-up", "PASS"):
        assert text in proc.stdout
    report = json.loads(out.read_text())
    assert report["ok"] and report["plan"]["kv_tokens"] >= 2 * 16384 and report["plan"]["block_size"] == 528
    blind = clef_load(capsys, hybrid_9b, "--gpu-memory", "15.92GiB", "--text-only").stdout     # the server's --text-only
    assert "not loaded (--text-only)" in blind and "vision encoder" not in blind and "--max-image-pixels" not in blind


def test_clef_load_exits_1_when_nothing_fits(hybrid_9b, capsys):
    proc = clef_load(capsys, hybrid_9b, "--gpu-memory", "4GiB", "--max-model-len", "32768")
    assert proc.returncode == 1
    assert "DOES NOT FIT: Clef-Flash does not fit" in proc.stdout and "32,768-token sequence" in proc.stdout
    assert "Traceback" not in proc.stderr
