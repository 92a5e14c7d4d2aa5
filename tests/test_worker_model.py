"""The model class inside vLLM (clef_vllm/worker/model.py) on CPU: its GPU-only runners off without CUDA, weight
loading through vLLM's own loader in both layouts (the int8 embedding and tables), the refusals of a damaged
or mismatched checkpoint, the dummy load format, and the prefill-graph wrappers on vLLM's real GDN layer. A
full backbone forward needs a GPU (tests/gpu/)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from support import vllm_cpu

pytest.importorskip("vllm")
pytestmark = pytest.mark.usefixtures("cpu_shims")



def test_the_plugins_graphs_need_the_backends_setting_and_a_cuda_device(monkeypatch, caplog):
    """One rule for the GPU-only features (graph runners, GDN tuning): off unless the worker settings ask for
    them, and off (logged) on a machine without CUDA, where nothing could be captured; the settings' plain form
    round-trips and an unknown or bad setting is refused, naming it."""
    import logging
    from types import SimpleNamespace

    from vllm.platforms import current_platform

    from clef_vllm.contract import PrefillGraphs, SettingsError, WorkerSettings
    from clef_vllm.worker.model import ClefFlashForDecision

    caplog.set_level(logging.INFO, logger="clef_vllm")
    on_gpu = ClefFlashForDecision._on_gpu
    settings = WorkerSettings(prefill_graphs=PrefillGraphs((64,)), head_graph_records=4, gdn_tuning=True)
    again = WorkerSettings.of(SimpleNamespace(additional_config=settings.to_config()))
    assert again == settings and again.prefill_graphs.buckets == (64,) and again.head_graph_records == 4
    assert WorkerSettings.of(SimpleNamespace(additional_config=None)) == WorkerSettings()   # none given: vLLM's own
    assert not on_gpu(WorkerSettings().head_graphs, "head graphs")
    assert not on_gpu(settings.head_graphs, "head graphs") and "clef head graphs: off (no CUDA device)" in caplog.text
    assert not on_gpu(settings.gdn_tuning, "GDN tuning") and "clef GDN tuning: off (no CUDA device)" in caplog.text
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    assert on_gpu(settings.head_graphs, "head graphs") and on_gpu(settings.gdn_tuning, "GDN tuning")
    assert not on_gpu(WorkerSettings().prefill_graphs is not None, "prefill graphs")
    for plain, name in (({"head_graphs": {"records": 4}}, "head_graphs"), ({"head_graph_records": 3}, "head_graph_records"),
                        ({"prefill_graphs": {"buckets": [64], "scope": "all"}}, "prefill_graphs"),
                        ({"batch_wait_ms": "2"}, "batch_wait_ms"), ({"nvfp4_kernel": "fp4"}, "nvfp4_kernel")):
        with pytest.raises(SettingsError) as refused:
            WorkerSettings.from_plain(plain)
        assert refused.value.name == name, plain
    # the runners that are on, by name: what the periodic log line and the trace's engine_done report
    prefill, step, head = object(), object(), object()
    runners = ClefFlashForDecision.graph_runners
    assert runners(SimpleNamespace(prefill_graphs=prefill, step_graphs=step, pooler=SimpleNamespace(head_graphs=head))) \
        == {"prefill": prefill, "step": step, "head": head}
    assert runners(SimpleNamespace(prefill_graphs=None, step_graphs=None,
                                   pooler=SimpleNamespace(head_graphs=head))) == {"head": head}


# --------------------------------------------------------------------------- loading


def _reference_state(checkpoint):
    """The checkpoint's text backbone and vision tower tensors, by vLLM name, unfused."""
    from clef_vllm.model.checkpoint import iter_backbone_tensors, locate_checkpoint

    out = {}
    for name, t in iter_backbone_tensors(locate_checkpoint(checkpoint)):
        for hf, ours in (("model.language_model.", "model."), ("model.visual.", "visual.")):
            if name.startswith(hf):
                out[ours + name[len(hf):]] = t
    return out


def _vision_loaded(model, ref) -> None:
    """Every vision tower parameter of vLLM's Qwen3.5 tower came from the checkpoint, BF16, bit for bit."""
    visual = {n: p for n, p in model.named_parameters() if n.startswith("visual.")}
    want = {n: t for n, t in ref.items() if n.startswith("visual.")}
    assert visual and set(visual) == set(want)
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, want[n]) for n, p in visual.items())


def test_release_layout_loads_every_tensor(release_model, tiny_release):
    from safetensors.torch import load_file

    m = release_model
    ref = _reference_state(tiny_release)
    params = dict(m.named_parameters())
    assert torch.equal(params["model.embed_tokens.weight"], ref["model.embed_tokens.weight"])
    assert torch.equal(params["model.norm.weight"], ref["model.norm.weight"])
    # GDN fused projection = cat(in_proj_qkv, in_proj_z); attention qkv = cat(q, k, v)
    qkvz = params["model.layers.0.linear_attn.in_proj_qkvz.weight"]
    assert torch.equal(qkvz, torch.cat([ref["model.layers.0.linear_attn.in_proj_qkv.weight"],
                                        ref["model.layers.0.linear_attn.in_proj_z.weight"]]))
    qkv = params["model.layers.3.self_attn.qkv_proj.weight"]
    assert torch.equal(qkv, torch.cat([ref[f"model.layers.3.self_attn.{p}_proj.weight"] for p in "qkv"]))
    # lm_head of the release goes to the dense lexical table; the head loads strictly
    lm = load_file(str(tiny_release / "model-00003-of-00003.safetensors")).get("lm_head.weight")
    if lm is None:
        from clef_vllm.model.checkpoint import find_backbone_tensor, locate_checkpoint

        lm = find_backbone_tensor(locate_checkpoint(tiny_release), ("lm_head.weight",))
    assert torch.equal(m.lm_table.weight, lm)
    head = load_file(str(tiny_release / "joint_head.safetensors"))
    assert all(torch.equal(m.head.state_dict()[k], v) for k, v in head.items())
    assert not any(n.startswith(("mtp", "model.visual")) for n in params)
    _vision_loaded(m, ref)


def test_an_engine_without_media_builds_no_vision_tower(tiny_release, tiny_repacked):
    """Media limits of 0 (what ``--text-only`` and a checkpoint without an image processor give the engine): no
    tower, its tensors skipped, nothing else changed; the repacked layout's tower loads like the release's."""
    text = vllm_cpu.load_model(tiny_release, limit_mm_per_prompt={"image": 0, "video": 0})
    assert text.visual is None and not any("visual" in n for n, _ in text.named_parameters())
    assert not text.takes_media
    seeing = vllm_cpu.load_model(tiny_repacked)
    _vision_loaded(seeing, _reference_state(tiny_repacked))
    assert seeing.takes_media
    # the memory plan's count of the tower's parameters is vLLM's
    import json

    from clef_vllm.plan.shapes import vision_parameters

    config = json.loads((tiny_repacked / "config.json").read_text())
    assert vision_parameters(config["vision_config"]) == sum(p.numel() for p in seeing.visual.parameters())


def test_repacked_layout_keeps_both_tables_int8(repacked_model, release_model, tiny_repacked):
    from clef_vllm.model.checkpoint import locate_checkpoint
    from clef_vllm.model.tables import load_int8_tables
    from clef_vllm.worker.embedding import Int8RowEmbedding

    a, b = repacked_model, release_model
    assert a.lm_table.weight.dtype == torch.int8
    emb = a.model.embed_tokens
    assert isinstance(emb, Int8RowEmbedding) and emb.weight.dtype == torch.int8 and emb.scale.dtype == torch.float32
    assert "model.embed_tokens.weight" not in dict(a.named_parameters())        # no 16-bit copy anywhere
    # the gathered rows are bit for bit the rows of the table dequantized whole (the former path)
    table = load_int8_tables(locate_checkpoint(tiny_repacked).tables_file)["embed_tokens"]
    ids = torch.tensor([[0, 1, 5, 77], [300, 5, 5, table.num_rows - 1]])
    dequantized = table.dequantize(torch.bfloat16)
    assert torch.equal(emb(ids), dequantized[ids])
    assert torch.equal(a.embed_input_ids(ids.flatten()), dequantized[ids.flatten()])
    # and close to the release's 16-bit embedding (per-row int8)
    ref = b.model.embed_tokens.weight
    err = (dequantized[: ref.shape[0]].float() - ref[: dequantized.shape[0]].float()).abs().max()
    assert 0 < err < 0.05 * ref.float().abs().max()
    rows = a.lm_table.rows(ids.flatten(), torch.float32)
    lm_ref = b.lm_table.rows(ids.flatten(), torch.float32)
    assert torch.nn.functional.cosine_similarity(rows, lm_ref, dim=1).min() > 0.999
    # the backbone layers are identical
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert torch.equal(pa["model.layers.2.mlp.down_proj.weight"], pb["model.layers.2.mlp.down_proj.weight"])


def test_int8_embedding_splits_the_vocabulary_as_vllm_does():
    from clef_vllm.worker.embedding import vocab_slice

    assert vocab_slice(248320, 0, 1) == (0, 248320)
    # vLLM pads 248,320 rows to a multiple of 64 (already one) and gives each of 4 ranks 62,080
    assert [vocab_slice(248320, r, 4) for r in range(4)] == [(0, 62080), (62080, 124160), (124160, 186240),
                                                             (186240, 248320)]
    # a vocabulary that needs padding: the last rank's slice ends at the real rows
    assert [vocab_slice(1000, r, 2) for r in range(2)] == [(0, 512), (512, 1000)]


# --------------------------------------------------------------------------- refusals


def _copy(src, tmp_path, name="ckpt"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _rewrite_shard(ckpt, edit):
    from safetensors.torch import load_file, save_file

    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.language_model.layers.0.mlp.down_proj.weight"]
    tensors = load_file(str(ckpt / shard))
    edit(tensors)
    save_file(tensors, str(ckpt / shard), metadata={"format": "pt"})
    return index, shard


def test_refuses_a_missing_backbone_tensor(tiny_release, tmp_path):
    from clef_vllm.model.checkpoint import CheckpointError

    ckpt = _copy(tiny_release, tmp_path)
    index, shard = _rewrite_shard(ckpt, lambda t: t.pop("model.language_model.layers.0.mlp.down_proj.weight"))
    del index["weight_map"]["model.language_model.layers.0.mlp.down_proj.weight"]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="not in the checkpoint.*layers.0.mlp.down_proj"):
        vllm_cpu.load_model(ckpt)


def test_refuses_an_unexpected_backbone_tensor(tiny_release, tmp_path):
    ckpt = _copy(tiny_release, tmp_path)
    index, shard = _rewrite_shard(ckpt, lambda t: t.__setitem__("model.language_model.layers.0.mlp.extra.weight",
                                                                 torch.zeros(2, 2, dtype=torch.bfloat16)))
    index["weight_map"]["model.language_model.layers.0.mlp.extra.weight"] = shard
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="mlp.extra"):
        vllm_cpu.load_model(ckpt)


def test_refuses_non_finite_tensors(tiny_release, tmp_path):
    from clef_vllm.model.checkpoint import CheckpointError

    ckpt = _copy(tiny_release, tmp_path)

    def poison(t):
        w = t["model.language_model.layers.0.mlp.down_proj.weight"].clone()
        w[0, 0] = float("nan")
        t["model.language_model.layers.0.mlp.down_proj.weight"] = w

    _rewrite_shard(ckpt, poison)
    with pytest.raises(CheckpointError, match="non-finite.*down_proj"):
        vllm_cpu.load_model(ckpt)


def test_refuses_a_missing_int8_table(tiny_repacked, tmp_path):
    from clef_vllm.model.checkpoint import CheckpointError

    ckpt = _copy(tiny_repacked, tmp_path)
    (ckpt / "clef_head" / "tables_int8.safetensors").unlink()
    with pytest.raises(CheckpointError, match="tables_int8"):
        vllm_cpu.load_model(ckpt)


def test_refuses_a_version_marker_mismatch_in_the_worker(tiny_repacked, tmp_path):
    from clef_vllm.model.checkpoint import CheckpointError

    ckpt = _copy(tiny_repacked, tmp_path)
    cfg_path = ckpt / "clef_head" / "joint_head_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["requires_clef_vllm"] = ">=9.0"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"requires clef-vllm>=9.0.*pip install"):
        vllm_cpu.load_model(ckpt)


def test_dummy_load_format_needs_only_configs(tiny_repacked, tmp_path):
    """9B-shaped benchmarks use load_format='dummy': config + head config, no weights."""
    ckpt = tmp_path / "dummy"
    ckpt.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_repacked / name, ckpt / name)
    (ckpt / "clef_head").mkdir()
    shutil.copy(tiny_repacked / "clef_head" / "joint_head_config.json", ckpt / "clef_head")
    m = vllm_cpu.load_model(ckpt, load_format="dummy")
    assert m.lm_table.weight.dtype == torch.int8


def test_prefill_graph_wrappers_fit_vllms_gdn_layer(tiny_release):
    """Both graph scopes wrap vLLM 0.28's real GDN layer: the methods and attributes they rely on exist
    (``_forward_core``, ``_forward_core_fused_norm_packed``, the split sizes, ``split_ba``, the gated norm),
    the split sizes match the layer's conv width, and a step without metadata (vLLM's warm-up) still
    reaches vLLM's own methods through both wrappers."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    from clef_vllm.worker.fast.prefill_graphs import GdnGraphRunner

    model = vllm_cpu.load_model(tiny_release)               # its own copy: the wrappers stay on it
    layers = [m for m in model.modules() if isinstance(m, QwenGatedDeltaNetAttention)]
    assert layers
    for layer in layers:
        assert (layer.key_dim * 2 + layer.value_dim) // layer.tp_size == layer.conv1d.weight.shape[0]
        assert callable(layer.split_ba) and callable(layer._rms_norm_gated_cuda)
    calls = []
    for layer in layers:                                    # stand-ins for vLLM's methods, to see who runs
        layer._forward_core = lambda **kw: calls.append("core")
        layer._forward_core_fused_norm_packed = lambda **kw: calls.append("packed")
    runner = GdnGraphRunner(scope="layer")
    assert runner.install(model) == len(layers) and runner.install(model) == 0   # idempotent
    import torch
    from vllm.forward_context import set_forward_context

    with set_forward_context(None, vllm_cpu.vllm_config_for(tiny_release)):
        layers[0]._forward_core_fused_norm_packed(torch.zeros(4, 8), torch.zeros(4, 2), torch.zeros(4, 1, 1))
        layers[0]._forward_core(torch.zeros(4, 8), torch.zeros(4, 1), torch.zeros(4, 1), torch.zeros(4, 1, 1))
    assert calls == ["packed", "core"]
    assert runner.describe()["fallbacks"] == {"no_metadata": 1} and runner.stats.replays == 0


def test_the_vision_tower_and_image_positions_equal_transformers(tiny_release):
    """vLLM's Qwen3.5 vision tower inside the Clef class (``embed_multimodal``: one feature row per image token, per
    image) against transformers' own on the tiny checkpoint, both BF16 on CPU; and the M-RoPE positions of a
    prompt with two images (``get_mrope_input_positions`` from vLLM's feature specs) against transformers'
    ``get_rope_index``, exactly."""
    from types import SimpleNamespace

    from PIL import Image
    from transformers import AutoImageProcessor, Qwen3_5ForConditionalGeneration
    from vllm.config import set_current_vllm_config

    from clef_vllm.schema.encoding import RequestEncoder
    from clef_vllm.schema.media_inputs import processor_backend

    model = vllm_cpu.load_model(tiny_release)
    processor = AutoImageProcessor.from_pretrained(str(tiny_release), backend=processor_backend())
    images = [Image.effect_noise((300, 120), 50).convert("RGB"), Image.effect_noise((64, 512), 50).convert("RGB")]
    pixels = processor(images=images, return_tensors="pt")
    grid = pixels["image_grid_thw"]
    with set_current_vllm_config(vllm_cpu.vllm_config_for(tiny_release)), torch.inference_mode():
        ours = model.embed_multimodal(pixel_values=pixels["pixel_values"], image_grid_thw=grid)
    release = Qwen3_5ForConditionalGeneration.from_pretrained(str(tiny_release), dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        want = release.model.get_image_features(pixels["pixel_values"].to(torch.bfloat16), grid).pooler_output
    counts = [int(g.prod()) // 4 for g in grid]
    assert [tuple(f.shape) for f in ours] == [(n, release.config.text_config.hidden_size) for n in counts]
    for got, ref in zip(ours, want):
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-3, rtol=0.02)

    # positions: prefix, two images' blocks, text (the encoder's layout), as vLLM's feature specs describe them
    media = RequestEncoder.from_pretrained(tiny_release).media
    prefix, tail = [11, 12, 13], [21, 22, 23, 24, 25]
    ids = prefix + media.block(counts) + tail
    pad = media.pad_id
    offsets = [i for i, t in enumerate(ids) if t == pad and ids[i - 1] != pad]
    features = [SimpleNamespace(modality="image", mm_position=SimpleNamespace(offset=o),
                                data={"image_grid_thw": SimpleNamespace(data=g)}) for o, g in zip(offsets, grid)]
    positions, delta = model.get_mrope_input_positions(ids, features)
    x = torch.tensor([ids])
    want, want_delta = release.model.get_rope_index(x, (x == pad).int(), image_grid_thw=grid,
                                                    attention_mask=torch.ones_like(x))
    assert torch.equal(positions, want[:, 0]) and delta == int(want_delta)
    text_positions, text_delta = model.get_mrope_input_positions(prefix + tail, [])
    assert torch.equal(text_positions, torch.arange(8).expand(3, -1)) and text_delta == 0
