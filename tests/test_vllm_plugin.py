"""The vLLM 0.28 plugin on CPU: discovery, engine settings, model construction and weight loading
through vLLM's own loader (both layouts), the in-worker pooler across chunked prefill, and
refusals. A full backbone forward needs a GPU (tests/gpu/, bench/)."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import shutil
import struct
import threading
from pathlib import Path
from importlib.metadata import entry_points

import pytest
import torch

from support import vllm_cpu

pytest.importorskip("vllm")


@pytest.fixture(scope="module", autouse=True)
def _cpu_shims():
    vllm_cpu.setup()


@pytest.fixture(scope="module")
def release_model(tiny_release):
    return vllm_cpu.load_model(tiny_release)


@pytest.fixture(scope="module")
def repacked_model(tiny_repacked):
    return vllm_cpu.load_model(tiny_repacked)


@pytest.fixture(scope="module")
def encoder(tiny_release):
    from clef_vllm.schema.encoding import RequestEncoder

    return RequestEncoder.from_pretrained(tiny_release)


def _requests():
    from clef_vllm.schema.dialects import parse_request

    bodies = [
        {"model": "m", "state": "Checkout fails for every customer.",
         "questions": {"urgent": {"type": "noul", "instructions": "Is this urgent?"},
                       "team": {"type": "choice", "criteria": {"billing": "Payments", "technical": "Outages"}}}},
        {"model": "m", "state": {"invoice": {"total": 1250.0, "status": "overdue"}, "notes": ["late"] * 12},
         "questions": {"sev": {"type": "score", "criteria": ["none", "minor", "major", "critical"]}}},
        {"model": "m", "state": "short",
         "questions": {"a": {"type": "noul"}, "b": {"type": "choice", "criteria": {"x": None, "y": 1, "z": [2]}},
                       "c": {"type": "score", "criteria": ["lo", "hi"]}}},
    ]
    return [parse_request(b) for b in bodies]


# --------------------------------------------------------------------------- discovery and settings


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


def test_engine_settings_resolve_to_the_pooling_runner_with_explicit_defaults(tiny_release):
    from vllm import AsyncEngineArgs
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from clef_vllm.backends.vllm_backend import engine_kwargs

    kwargs = engine_kwargs(tiny_release, max_model_len=2048, head_dtype="float32", data_parallel_size=1, state_cache=True)
    assert kwargs["hf_overrides"] == {"architectures": ["ClefFlashForDecision"]}  # release config names the VL class
    cfg = AsyncEngineArgs(**kwargs).create_engine_config()
    assert cfg.model_config.architectures == ["ClefFlashForDecision"]
    assert cfg.model_config.runner_type == "pooling"
    assert cfg.cache_config.enable_prefix_caching is True          # the state cache
    assert cfg.cache_config.mamba_cache_mode == "align"
    assert cfg.scheduler_config.get_scheduler_cls().__name__ == "ClefScheduler"
    assert cfg.scheduler_config.enable_chunked_prefill is True
    assert cfg.cache_config.mamba_ssm_cache_dtype == "float32"
    assert cfg.additional_config["clef_head_dtype"] == "float32"
    assert cfg.additional_config["gdn_prefill_backend"] == "triton"
    assert cfg.additional_config["clef_prefill_graphs"]["buckets"][-1] <= cfg.scheduler_config.max_num_batched_tokens
    assert cfg.additional_config["clef_head_graphs"] == {"records": 16}    # on by default, up to 16 requests a step
    # --prefill-graph-buckets: the graphs' padded sizes, vLLM's capture sizes with them (a comma list or ints)
    fine = engine_kwargs(tiny_release, max_model_len=16384, prefill_graph_buckets="448,416,64,16384")
    assert fine["additional_config"]["clef_prefill_graphs"]["buckets"] == [64, 416, 448, 16384]
    assert {64, 416, 448} <= set(fine["compilation_config"]["cudagraph_capture_sizes"])
    assert 384 not in fine["compilation_config"]["cudagraph_capture_sizes"]           # not a bucket any more
    assert engine_kwargs(tiny_release, prefill_graph_buckets=[128, 64])["additional_config"][
        "clef_prefill_graphs"]["buckets"] == [64, 128]
    one = AsyncEngineArgs(**engine_kwargs(tiny_release, max_model_len=2048, head_graph_records=1))
    # the state cache is on unless told: prefix caching matched in 16-token units (the reference stays exact)
    assert one.enable_prefix_caching is True and one.prefix_match_unit == 16
    assert one.additional_config["clef_state_cache"] == {"on": True}
    assert one.additional_config["clef_head_graphs"] == {"records": 1}
    # the scheduler's rules 4 and 5: vLLM's cleanup step only when asked; a 2 ms batch wait by default for one
    # engine in its own process, none with data parallelism or the engine thread, none when set to 0
    assert "clef_idle_cleanup_step" not in one.additional_config
    assert one.additional_config["clef_batch_wait_ms"] == 2.0
    asked = engine_kwargs(tiny_release, idle_cleanup_step=True, batch_wait_ms=2.5)["additional_config"]
    assert asked["clef_idle_cleanup_step"] is True and asked["clef_batch_wait_ms"] == 2.5
    for no_wait in ({"batch_wait_ms": 0}, {"data_parallel_size": 2}, {"engine_core": "thread"}):
        assert "clef_batch_wait_ms" not in engine_kwargs(tiny_release, **no_wait)["additional_config"], no_wait
    # the GDN metadata memo: on unless told (the worker reads an explicit False)
    assert "clef_gdn_metadata_memo" not in one.additional_config
    assert engine_kwargs(tiny_release, gdn_metadata_memo=False)["additional_config"]["clef_gdn_metadata_memo"] is False
    # the GDN kernels tuned per shape class at start-up unless told (clef_vllm.worker.fast.gdn_tuning)
    assert one.additional_config["clef_gdn_tuning"] is True
    assert "clef_gdn_tuning" not in engine_kwargs(tiny_release, gdn_tuning=False)["additional_config"]
    # NVFP4 layers: auto unless told (the worker's nvfp4_bf16.install reads the key and resolves auto by its GPU);
    # vLLM's own kernel with --nvfp4-kernel vllm
    assert one.additional_config["clef_nvfp4_kernel"] == "auto"
    assert "clef_nvfp4_kernel" not in engine_kwargs(tiny_release, nvfp4_kernel="vllm")["additional_config"]
    assert engine_kwargs(tiny_release, nvfp4_kernel="bf16")["additional_config"]["clef_nvfp4_kernel"] == "bf16"
    assert "clef_nvfp4_kernel" not in engine_kwargs(tiny_release, nvfp4_kernel="auto", linear_backend="emulation"
                                                    ).get("additional_config", {})     # auto yields to the backend
    off = AsyncEngineArgs(**engine_kwargs(tiny_release, max_model_len=2048, state_cache=False,
                                          prefill_graphs=False, head_graphs=False)).create_engine_config()
    assert off.cache_config.enable_prefix_caching is False and off.cache_config.mamba_cache_mode == "none"
    assert off.scheduler_config.get_scheduler_cls().__name__ == "ClefScheduler"   # rule 0 holds for every request
    assert off.scheduler_config.async_scheduling is False
    # async scheduling: asked for explicitly, on our scheduler's async variant (vLLM's CPU platform turns it
    # off in create_engine_config, so the engine arguments are checked)
    overlapped = AsyncEngineArgs(**engine_kwargs(tiny_release, max_model_len=2048, async_scheduling=True))
    assert overlapped.async_scheduling is True
    assert resolve_obj_by_qualname(overlapped.scheduler_cls).__name__ == "ClefAsyncScheduler"
    # the worker beside the scheduler, with data parallelism too (vLLM's CPU platform swaps in "mp" here)
    assert engine_kwargs(tiny_release, data_parallel_size=2)["distributed_executor_backend"] == "uni"
    assert not {"clef_prefill_graphs", "clef_head_graphs", "clef_state_cache"} & set(off.additional_config)


def test_default_buckets_follow_the_backbones_linear_kernels(tiny_release, tmp_path):
    """Unset ``--prefill-graph-buckets``: a BF16 backbone adds 400, online FP8 pads 321-480 tokens to 480 (the
    H200's cheap step sizes), a quantized checkpoint keeps the generic list; vLLM's capture sizes follow."""
    from clef_vllm.backends.vllm_backend import engine_kwargs
    from clef_vllm.worker.fast.prefill_graphs import DEFAULT_BUCKETS, LINEAR_BUCKETS

    def planned(model_dir, **opts):
        kwargs = engine_kwargs(model_dir, max_model_len=4096, **opts)
        return kwargs["additional_config"]["clef_prefill_graphs"]["buckets"], kwargs["compilation_config"][
            "cudagraph_capture_sizes"]

    bf16, sizes = planned(tiny_release)
    assert bf16 == [b for b in LINEAR_BUCKETS["bf16"] if b <= 8192] and 400 in bf16 and 448 in bf16
    assert {400, 448} <= set(sizes)
    fp8, sizes = planned(tiny_release, quantization="fp8")
    assert 480 in fp8 and 448 not in fp8 and 480 in sizes and 448 not in sizes and 384 not in fp8
    assert set(fp8) ^ set(DEFAULT_BUCKETS) == {384, 448, 480}
    quantized = tmp_path / "quantized"
    shutil.copytree(tiny_release, quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors"}
    (quantized / "config.json").write_text(json.dumps(config))
    assert planned(quantized)[0] == list(DEFAULT_BUCKETS)
    assert planned(tiny_release, prefill_graph_buckets="64,400")[0] == [64, 400]    # given: as given


def test_the_plugins_graphs_need_the_backends_setting_and_a_cuda_device(monkeypatch, caplog):
    """One rule for both graph runners: off unless the backend set their key, and off (logged) on a
    machine without CUDA, where nothing could be captured."""
    import logging
    from types import SimpleNamespace

    from vllm.platforms import current_platform

    from clef_vllm.contract import GDN_TUNING_KEY, HEAD_GRAPHS_KEY, PREFILL_GRAPHS_KEY
    from clef_vllm.worker.model import ClefFlashForDecision

    caplog.set_level(logging.INFO, logger="clef_vllm")
    setting = ClefFlashForDecision._gpu_setting
    config = SimpleNamespace(additional_config={PREFILL_GRAPHS_KEY: {"buckets": [64]}, HEAD_GRAPHS_KEY: {"records": 4},
                                                GDN_TUNING_KEY: True})
    assert setting(SimpleNamespace(additional_config=None), HEAD_GRAPHS_KEY, "head graphs") is None
    assert setting(config, HEAD_GRAPHS_KEY, "head graphs") is None and "clef head graphs: off (no CUDA device)" in caplog.text
    assert setting(config, GDN_TUNING_KEY, "GDN tuning") is None and "clef GDN tuning: off (no CUDA device)" in caplog.text
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    assert setting(config, HEAD_GRAPHS_KEY, "head graphs") == {"records": 4}
    assert setting(config, PREFILL_GRAPHS_KEY, "prefill graphs") == {"buckets": [64]}
    assert setting(config, GDN_TUNING_KEY, "GDN tuning") is True
    assert setting(SimpleNamespace(additional_config={}), PREFILL_GRAPHS_KEY, "prefill graphs") is None
    # the runners that are on, by name: what the periodic log line and the trace's engine_done report
    prefill, step, head = object(), object(), object()
    runners = ClefFlashForDecision.graph_runners
    assert runners(SimpleNamespace(prefill_graphs=prefill, step_graphs=step, pooler=SimpleNamespace(head_graphs=head))) \
        == {"prefill": prefill, "step": step, "head": head}
    assert runners(SimpleNamespace(prefill_graphs=None, step_graphs=None,
                                   pooler=SimpleNamespace(head_graphs=head))) == {"head": head}


def test_engine_options_are_typed_and_reach_the_engine_through_one_table(tiny_release):
    """Each VllmOptions field says how it reaches AsyncEngineArgs; nothing untyped flows through."""
    from vllm import AsyncEngineArgs

    from clef_vllm.backends.options import OptionError
    from clef_vllm.backends.vllm_backend import FIXED_ENGINE_SETTINGS, engine_kwargs

    kwargs = engine_kwargs(tiny_release, gpu_memory_utilization=0.5, max_num_seqs=7, enforce_eager=True,
                           linear_backend="emulation", quantization="fp8")
    assert {k: kwargs[k] for k in ("gpu_memory_utilization", "max_num_seqs", "enforce_eager", "linear_backend",
                                   "quantization", "dtype", "max_num_batched_tokens")} == {
        "gpu_memory_utilization": 0.5, "max_num_seqs": 7, "enforce_eager": True, "linear_backend": "emulation",
        "quantization": "fp8", "dtype": "bfloat16", "max_num_batched_tokens": 16384}
    assert all(kwargs[k] == v for k, v in FIXED_ENGINE_SETTINGS.items())
    assert "warmup" not in kwargs and "head_dtype" not in kwargs        # ours, not the engine's
    known = set(AsyncEngineArgs.__dataclass_fields__)
    assert set(kwargs) <= known, set(kwargs) - known                       # every key is a real engine field
    for bad, match in (({"max_batch_size": 4}, "'max_batch_size' applies to the reference backend"),
                       ({"device": "cuda"}, "'device' applies to the reference backend"),
                       ({"max_num_seq": 4}, "unknown option 'max_num_seq'"),
                       ({"gpu_memory_utilization": 1.5}, "'gpu_memory_utilization' must be <= 1.0"),
                       ({"max_num_seqs": "8"}, "'max_num_seqs' must be int"),
                       ({"dtype": "float32"}, "head_dtype"),
                       ({"head_graph_records": 3}, "'head_graph_records' must be one of"),
                       ({"prefill_graph_scope": "model"}, "'prefill_graph_scope' must be one of"),
                       ({"prefill_graphs": False, "prefill_graph_scope": "layer"},
                        "'prefill_graph_scope' .* no effect with 'prefill_graphs' off"),
                       # a sub-option whose switch is off would be silently ignored: refused instead
                       ({"head_graphs": False, "head_graph_records": 4}, "no effect with 'head_graphs' off"),
                       ({"eager_batches": True}, "unknown option 'eager_batches'"),   # measured, no gain: removed
                       ({"prefill_graph_buckets": "64,100"}, "'prefill_graph_buckets': each bucket must be a multiple"),
                       ({"prefill_graph_buckets": "64;128"}, "'prefill_graph_buckets': expected token counts"),
                       ({"prefill_graphs": False, "prefill_graph_buckets": "64"}, "no effect with 'prefill_graphs' off"),
                       ({"state_cache": False, "state_cache_match": "block"}, "'state_cache_match' .* no effect with 'state_cache' off"),
                       ({"state_cache": False, "state_cache_admit": "first"}, "'state_cache_admit' .* no effect with 'state_cache' off"),
                       ({"engine_thread_switch_ms": 0.5}, "unknown option 'engine_thread_switch_ms'"),   # removed
                       ({"batch_wait_ms": 2, "data_parallel_size": 2}, "'batch_wait_ms' is for one engine in its own"),
                       ({"batch_wait_ms": 2, "engine_core": "thread"}, "'batch_wait_ms' is for one engine in its own"),
                       ({"batch_wait_ms": 60}, "'batch_wait_ms' must be <= 50"),
                       ({"batch_wait_mode": "refill"}, "unknown option 'batch_wait_mode'"),   # measured, no gain
                       ({"nvfp4_kernel": "marlin"}, "'nvfp4_kernel' must be one of"),
                       # --linear-backend filters vLLM's kernel list down to its own: the two cannot both choose
                       # (auto yields to it: below)
                       ({"nvfp4_kernel": "bf16", "linear_backend": "emulation"}, "'nvfp4_kernel' 'bf16' chooses")):
        with pytest.raises(OptionError, match=match):
            engine_kwargs(tiny_release, **bad)


def test_a_sub_option_without_its_switch_is_a_cli_error_naming_the_flag(tiny_release, capsys):
    from clef_vllm.server.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--model", str(tiny_release), "--backend", "vllm", "--prefill-graph-buckets", "64,100"])
    assert exit_.value.code == 2
    assert "--prefill-graph-buckets:" in capsys.readouterr().err

    with pytest.raises(SystemExit) as exit_:
        main(["--model", str(tiny_release), "--backend", "vllm", "--head-graphs", "off", "--head-graph-records", "4"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--head-graph-records:" in err and "no effect with 'head_graphs' off" in err


def test_repacked_checkpoint_names_its_own_architecture(tiny_repacked):
    from clef_vllm.backends.vllm_backend import engine_kwargs

    assert json.loads((tiny_repacked / "config.json").read_text())["architectures"] == ["ClefFlashForDecision"]
    assert "hf_overrides" not in engine_kwargs(tiny_repacked)


# --------------------------------------------------------------------------- loading


def _reference_state(checkpoint):
    """The checkpoint's text backbone tensors, by vLLM name, unfused."""
    from clef_vllm.model.checkpoint import iter_backbone_tensors, locate_checkpoint

    out = {}
    for name, t in iter_backbone_tensors(locate_checkpoint(checkpoint)):
        if name.startswith("model.language_model."):
            out["model." + name[len("model.language_model."):]] = t
    return out


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
    assert not any(n.startswith(("mtp", "visual", "model.visual")) for n in params)


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


# --------------------------------------------------------------------------- pooler


def _specs_and_hidden(encoder, hidden_size):
    from clef_vllm.model.features import HeadSpec

    specs = [HeadSpec.from_encoded(encoder.encode(r)) for r in _requests()]
    g = torch.Generator().manual_seed(3)
    hidden = [torch.randn(s.num_tokens, hidden_size, generator=g).to(torch.bfloat16) for s in specs]
    return specs, hidden


def _unchunked(model, specs, hidden):
    from clef_vllm.model.features import RecordAccumulator, accumulate, decide_records

    out = []
    for spec, h in zip(specs, hidden):
        acc = RecordAccumulator(spec)
        accumulate(model.head, h, [(acc, 0, spec.num_tokens, 0)])
        out.append(decide_records(model.head, model.lm_table, [acc])[0])
    return out


@torch.inference_mode()
def test_pooler_chunked_prefill_matches_single_pass(release_model, encoder):
    from vllm.v1.pool.metadata import PoolingStates

    m = release_model
    specs, hidden = _specs_and_hidden(encoder, m.config.hidden_size)
    expected = _unchunked(m, specs, hidden)
    la, lb, lc = (s.num_tokens for s in specs)
    states = [PoolingStates() for _ in specs]
    # step 1: A[0:40], B[0:100]       (both partial)
    # step 2: A[40:], B[100:150], C[0:] (A and C finish)
    # step 3: B[150:]                  (B finishes)
    steps = [
        ([0, 1], [(0, 40), (0, 100)]),
        ([0, 1, 2], [(40, la), (100, 150), (0, lc)]),
        ([1], [(150, lb)]),
    ]
    results = {}
    for step, (which, ranges) in enumerate(steps):
        x = torch.cat([hidden[i][a:b] for i, (a, b) in zip(which, ranges)])
        md = vllm_cpu.pooling_metadata([specs[i] for i in which], [b - a for a, b in ranges], [b for _, b in ranges],
                       [states[i] for i in which])
        out = m.pooler(x, md)
        for i, (_, b), o in zip(which, ranges, out):
            if b < specs[i].num_tokens:
                assert o is None, f"partial prefill of request {i} must return None (step {step})"
            else:
                assert o is not None and o.dtype == torch.float32 and o.shape == (specs[i].num_options,)
                results[i] = o
    for i in range(3):
        torch.testing.assert_close(results[i], expected[i], atol=2e-3, rtol=0)
        assert torch.all(results[i] > 0)


def test_the_pooler_marks_each_step_in_the_request_trace(release_model, encoder, tmp_path, monkeypatch):
    """With ``CLEF_VLLM_TRACE`` on, the model's forward writes ``step_forward``, the pooler ``step_head`` when
    it begins and ``step_pooled`` when it returns (request ``*``): the trace summary splits a one-step
    request's engine time with them."""
    import json

    from clef_vllm.util import trace
    from vllm.v1.pool.metadata import PoolingStates

    m = release_model
    specs, hidden = _specs_and_hidden(encoder, m.config.hidden_size)
    md = vllm_cpu.pooling_metadata(specs, [s.num_tokens for s in specs], [s.num_tokens for s in specs],
                                   [PoolingStates() for _ in specs])
    path = tmp_path / "trace.jsonl"
    monkeypatch.setattr(trace, "PATH", str(path))
    out = m.pooler(torch.cat(hidden), md)
    assert all(o is not None for o in out)
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(e["event"], e["request"]) for e in events] == [("step_head", "*"), ("step_pooled", "*")]
    assert events[0]["t"] <= events[1]["t"]
    # and the model's forward writes step_forward before the backbone runs (here a stand-in model)
    from types import SimpleNamespace

    from clef_vllm.worker.model import ClefFlashForDecision

    seen = []
    stand_in = SimpleNamespace(_steps=0, step_graphs=None, graph_runners=dict, _gdn_tuning=None,
                               model=lambda *a: seen.append(path.read_text().count("step_forward")) or "hidden")
    assert ClefFlashForDecision.forward(stand_in, torch.zeros(4, dtype=torch.long), torch.arange(4)) == "hidden"
    assert seen == [1]
    monkeypatch.setattr(trace, "PATH", None)
    m.pooler(torch.cat(hidden), md)
    ClefFlashForDecision.forward(stand_in, torch.zeros(4, dtype=torch.long), torch.arange(4))
    assert len(path.read_text().splitlines()) == 3                 # off: nothing written


def test_the_trace_marks_the_model_runners_input_preparation(tmp_path, monkeypatch, caplog):
    """``instrument_runner`` marks the start of vLLM's model-runner methods that prepare a step, in the order
    ``execute_model`` calls them; vLLM 0.28's runner has all of them; a second call wraps nothing twice;
    with tracing off it changes nothing."""
    import json

    from clef_vllm.util import trace
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    class Runner(GPUModelRunner):        # a subclass: the wrappers land on it, vLLM's class stays as it is
        pass

    monkeypatch.setattr(trace, "PATH", None)
    assert trace.instrument_runner(Runner) == [] and "execute_model" not in vars(Runner)
    path = tmp_path / "trace.jsonl"
    monkeypatch.setattr(trace, "PATH", str(path))
    methods = [m for _, m in trace.RUNNER_EVENTS]
    assert trace.instrument_runner(Runner) == methods and all(m in vars(Runner) for m in methods)
    wrapped = {m: vars(Runner)[m] for m in methods}
    assert trace.instrument_runner(Runner) == methods and {m: vars(Runner)[m] for m in methods} == wrapped

    class Stand:                          # a runner whose execute_model calls the others, as vLLM's does
        def execute_model(self, out):
            for m in methods[1:]:
                getattr(self, m)(out)
            return "done"

    for m in methods[1:]:
        setattr(Stand, m, lambda self, out, m=m: out.append(m))
    calls: list = []
    assert trace.instrument_runner(Stand) == methods
    assert Stand().execute_model(calls) == "done" and calls == methods[1:]
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(e["event"], e["request"]) for e in events] == [(name, "*") for name, _ in trace.RUNNER_EVENTS]

    class Old:                            # a vLLM without one of the methods: skipped, said once
        def execute_model(self):
            return 1

    with caplog.at_level("WARNING", logger="clef_vllm"):
        assert trace.instrument_runner(Old) == ["execute_model"]
    assert "no _prepare_inputs" in caplog.text


def test_the_trace_marks_an_output_where_the_engine_core_sends_it_and_where_the_server_decodes_it(tmp_path,
                                                                                                 monkeypatch):
    """vLLM's msgpack encoder (the engine core's output thread) and decoder (AsyncLLM's output socket), wrapped
    once per process with tracing on, write ``engine_sent`` / ``client_decoded`` for each finished request
    of the outputs they carry, and nothing for unfinished ones or other messages."""
    import inspect
    import json

    from clef_vllm.util import trace
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    for cls, attr in ((MsgpackEncoder, "encode_into"), (MsgpackDecoder, "decode")):   # vLLM's own, restored after
        monkeypatch.setattr(cls, attr, inspect.unwrap(getattr(cls, attr)))
    monkeypatch.setattr(trace, "PATH", None)
    assert not trace.instrument_output("engine")                     # off: nothing wrapped
    path = tmp_path / "trace.jsonl"
    monkeypatch.setattr(trace, "PATH", str(path))
    assert trace.instrument_output("engine") and trace.instrument_output("client")
    assert not trace.instrument_output("engine")                     # once per process
    outs = EngineCoreOutputs(outputs=[
        EngineCoreOutput(request_id="clef-1-aa-1234abcd", new_token_ids=[], pooling_output=torch.tensor([0.5, 0.5]),
                         finish_reason=FinishReason.STOP),
        EngineCoreOutput(request_id="clef-2-bb-99999999", new_token_ids=[])])
    frames = MsgpackEncoder().encode_into(outs, bytearray())
    back = MsgpackDecoder(EngineCoreOutputs).decode(frames)
    assert [o.request_id for o in back.outputs] == ["clef-1-aa-1234abcd", "clef-2-bb-99999999"]
    assert torch.equal(back.outputs[0].pooling_output, torch.tensor([0.5, 0.5]))
    MsgpackDecoder(dict).decode(MsgpackEncoder().encode({"not": "outputs"}))
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(e["event"], e["request"]) for e in events] == [("engine_sent", "clef-1-aa-1234abcd"),
                                                           ("client_decoded", "clef-1-aa-1234abcd")]


@torch.inference_mode()
@contextlib.contextmanager
def _float32_head(m):
    """``m``'s head in float32 inside (padding must then be exact up to float32 rounding), its dtype after."""
    dtype = m.head.dtype
    m.head.float()
    try:
        yield
    finally:
        m.head.to(dtype)


def _three_chunked_steps(m, specs, hidden) -> dict:
    """The three requests of :func:`_specs_and_hidden` through ``m``'s pooler in three chunked steps (step 1:
    A[0:40], B[0:100]; step 2: the rest of A, B[100:150], all of C; step 3: the rest of B): each answer by
    request index."""
    from vllm.v1.pool.metadata import PoolingStates

    la, lb, lc = (s.num_tokens for s in specs)
    steps = [([0, 1], [(0, 40), (0, 100)]), ([0, 1, 2], [(40, la), (100, 150), (0, lc)]), ([1], [(150, lb)])]
    states, results = [PoolingStates() for _ in specs], {}
    for which, ranges in steps:
        x = torch.cat([hidden[i][a:b] for i, (a, b) in zip(which, ranges)])
        md = vllm_cpu.pooling_metadata([specs[i] for i in which], [b - a for a, b in ranges],
                                       [b for _, b in ranges], [states[i] for i in which])
        results.update((i, o) for i, o in zip(which, m.pooler(x, md)) if o is not None)
    return results


def test_pooler_with_head_graphs_answers_chunked_steps_of_several_requests_like_the_eager_head(release_model,
                                                                                            encoder):
    """The real pooler, real encoded requests, chunked: step 2 finishes two requests, step 3 one. With a
    head-graph runner for up to 4 requests per step (a CPU stand-in for the CUDA graphs) every answer is
    the eager pooler's, and the runner graphed both finishing steps after one self-check per bucket. The
    head runs in float32 here, so padding must be exact up to float32 rounding (in bf16 the padded shapes
    round differently: tests/test_head_graphs.py bounds that)."""
    from support.graph_runner import CpuGraphRunner

    m = release_model
    specs, hidden = _specs_and_hidden(encoder, m.config.hidden_size)
    with _float32_head(m):
        eager = _three_chunked_steps(m, specs, hidden)
        runner = m.pooler.head_graphs = CpuGraphRunner(m.head, max_memory=2048, max_records=4)
        try:
            graphed = _three_chunked_steps(m, specs, hidden)
        finally:
            m.pooler.head_graphs = None
    assert sorted(graphed) == [0, 1, 2]
    for i in range(3):
        torch.testing.assert_close(graphed[i], eager[i], atol=1e-5, rtol=0)
    info = runner.describe()
    # 2 steps + one self-check per record bucket (1, 2, 4), all at the first finishing step
    assert info["replays"] == 2 + 3 and not info["failed"] and not info["fallbacks"]


@torch.inference_mode()
def test_pooler_with_the_row_grid_runs_every_gemm_at_a_grid_count_and_answers_as_without(release_model, encoder):
    """``--gemm-row-grid``: the real pooler over chunked steps of several requests with its row grid on (as after
    the GPU warm-up): every GEMM of the per-token stage and the eager head runs at a grid row count (recorded
    at the aten level), and each answer is the pooler's without the grid (float32 head: up to rounding)."""
    from clef_vllm.worker.fast.gemm_warmup import GridRows
    from support.gemm_shapes import GemmShapes

    m = release_model
    specs, hidden = _specs_and_hidden(encoder, m.config.hidden_size)
    with _float32_head(m):
        plain = _three_chunked_steps(m, specs, hidden)
        grid = m.pooler.row_grid = GridRows(1024)
        try:
            with GemmShapes() as seen:
                gridded = _three_chunked_steps(m, specs, hidden)
        finally:
            m.pooler.row_grid = None
    assert sorted(gridded) == [0, 1, 2] and grid.padded > 0
    assert seen.seen and all(rows in set(grid.grid) for *_, rows in seen.seen)
    for i in range(3):
        torch.testing.assert_close(gridded[i], plain[i], atol=1e-5, rtol=0)


def test_the_wire_spec_round_trips_packed_and_refuses_what_it_did_not_write(encoder):
    """A head spec crosses to the engine core as one int32 buffer (plus the state cache's limit and keys): it
    comes back equal, vLLM's deep copy of the parameters shares the buffer instead of copying ints one by
    one, and a damaged wire raises one of the errors the pooler turns into a NaN answer."""
    from clef_vllm.backends.vllm_backend import pooling_params
    from clef_vllm.contract import PARAMS_KEY
    from clef_vllm.model.features import HeadSpec

    for request in _requests():
        encoded = encoder.encode(request)
        for spec in (HeadSpec.from_encoded(encoded), HeadSpec.from_encoded(encoded, state_keys=True)):
            wire = spec.to_wire()
            assert HeadSpec.from_wire(wire) == spec
            assert set(wire) == ({"a", "r", "k"} if spec.reuse_limit else {"a"})
    assert spec.reuse_limit and spec.state_keys                               # the keyed case ran
    params = pooling_params(spec)
    copy = params.clone()
    assert copy.extra_kwargs[PARAMS_KEY]["a"] is params.extra_kwargs[PARAMS_KEY]["a"]
    assert HeadSpec.from_wire(copy.extra_kwargs[PARAMS_KEY]) == spec
    from vllm import PoolingParams
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    sent = MsgpackDecoder(PoolingParams).decode(MsgpackEncoder().encode(params))   # vLLM's IPC encoding
    assert HeadSpec.from_wire(sent.extra_kwargs[PARAMS_KEY]) == spec
    packed = spec.to_wire()["a"]
    header = struct.unpack("<4i", packed[:16])
    for damaged in ({"a": packed[:-2]}, {"a": packed[:-4]}, {"a": packed + packed[-4:]}, {"a": packed[:12]},
                    {"a": struct.pack("<4i", header[0], -1, 0, 0)}, {"a": "text"}, {"b": packed}):
        with pytest.raises((KeyError, TypeError, ValueError)):
            HeadSpec.from_wire(damaged)


@torch.inference_mode()
def test_pooler_handles_warmup_calls_without_params_and_bad_specs(release_model, encoder):
    from vllm.v1.pool.metadata import PoolingStates

    from clef_vllm.model.features import HeadSpec

    m = release_model
    # vLLM's dummy run: PoolingParams(task="plugin") only, many short requests
    n = [64, 64, 1, 200]
    md = vllm_cpu.pooling_metadata([None] * 4, n, n, [PoolingStates() for _ in n])
    out = m.pooler(torch.randn(sum(n), m.config.hidden_size).to(torch.bfloat16), md)
    assert [o.numel() for o in out] == [9, 9, 1, 9]  # synthetic 3-field spec; 1 value for a 1-token prompt
    # a malformed spec never crashes the worker: that request gets NaN
    spec = HeadSpec.from_encoded(encoder.encode(_requests()[0]))
    bad = HeadSpec(spec.num_tokens, spec.type_ids, ((0, spec.num_tokens + 5),), spec.option_spans,
                   spec.options_per_field, spec.lexical_ids)
    md = vllm_cpu.pooling_metadata([bad, spec], [bad.num_tokens, spec.num_tokens], [bad.num_tokens, spec.num_tokens],
                   [PoolingStates(), PoolingStates()])
    out = m.pooler(torch.randn(2 * spec.num_tokens, m.config.hidden_size).to(torch.bfloat16), md)
    assert torch.isnan(out[0]).all()
    assert out[1].shape == (spec.num_options,) and torch.isfinite(out[1]).all()


@torch.inference_mode()
def test_pooler_gives_the_head_graphs_every_step_that_finishes_client_requests(release_model, encoder):
    """The head-graph runner sees every step that finishes client requests (its answer is theirs; it
    picks the steps it can graph); a step with vLLM's own warm-up requests runs the eager head."""
    from vllm.v1.pool.metadata import PoolingStates

    class Runner:
        def __init__(self):
            self.options = []

        def decide(self, batch):
            self.options.append(len(batch.layout.option_field))
            return torch.full((len(batch.layout.option_field),), 7.0)

    m = release_model
    specs, hidden = _specs_and_hidden(encoder, m.config.hidden_size)
    runner = Runner()
    m.pooler.head_graphs = runner
    try:
        n = specs[0].num_tokens
        out = m.pooler(hidden[0], vllm_cpu.pooling_metadata([specs[0]], [n], [n], [PoolingStates()]))[0]
        assert runner.options == [specs[0].num_options] and torch.equal(out, torch.full_like(out, 7.0))
        md = vllm_cpu.pooling_metadata([None], [64], [64], [PoolingStates()])
        out = m.pooler(torch.randn(64, m.config.hidden_size).to(torch.bfloat16), md)[0]
        assert len(runner.options) == 1 and torch.isfinite(out).all() and (out < 1).all()
        lens = [s.num_tokens for s in specs[:2]]
        md = vllm_cpu.pooling_metadata(specs[:2], lens, lens, [PoolingStates(), PoolingStates()])
        out = m.pooler(torch.cat(hidden[:2]), md)
        assert runner.options[1:] == [specs[0].num_options + specs[1].num_options]
        assert [len(o) for o in out] == [specs[0].num_options, specs[1].num_options]
        assert all(torch.equal(o, torch.full_like(o, 7.0)) for o in out)
        md = vllm_cpu.pooling_metadata([specs[0], None], [n, 64], [n, 64], [PoolingStates(), PoolingStates()])
        out = m.pooler(torch.cat([hidden[0], torch.randn(64, m.config.hidden_size).to(torch.bfloat16)]), md)
        assert len(runner.options) == 2 and all((o < 1).all() for o in out)      # with a warm-up request: eager
    finally:
        m.pooler.head_graphs = None


@torch.inference_mode()
def test_pooler_restarts_a_preempted_request(release_model, encoder):
    from vllm.v1.pool.metadata import PoolingStates

    m = release_model
    specs, hidden = _specs_and_hidden(encoder, m.config.hidden_size)
    spec, h = specs[0], hidden[0]
    st = PoolingStates()
    assert m.pooler(h[:30], vllm_cpu.pooling_metadata([spec], [30], [30], [st]))[0] is None
    # preempted: the scheduler recomputes the prompt from position 0
    out = m.pooler(h, vllm_cpu.pooling_metadata([spec], [spec.num_tokens], [spec.num_tokens], [st]))[0]
    torch.testing.assert_close(out, _unchunked(m, [spec], [h])[0], atol=2e-3, rtol=0)


@torch.inference_mode()
def test_pooler_output_equals_reference_head_on_same_hidden_states(release_model, tiny_release, encoder):
    """The worker-side head and the reference backend's head are the same computation."""
    from clef_vllm.backends.reference import ReferenceBackend
    from clef_vllm.model.features import HeadSpec
    from vllm.v1.pool.metadata import PoolingStates

    ref = ReferenceBackend(tiny_release, device="cpu")
    encoded = [encoder.encode(r) for r in _requests()]
    hidden = [ref.hidden_states([e])[0] for e in encoded]
    want = ref.decide_batch(encoded)
    specs = [HeadSpec.from_encoded(e) for e in encoded]
    md = vllm_cpu.pooling_metadata(specs, [s.num_tokens for s in specs], [s.num_tokens for s in specs],
                   [PoolingStates() for _ in specs])
    got = release_model.pooler(torch.cat(hidden), md)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-3, rtol=0)


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


# --------------------------------------------------------------------------- compressed-tensors Hybrid


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
    assert kwargs["additional_config"]["clef_prefill_graphs"]["buckets"] == list(DEFAULT_BUCKETS)
    with pytest.raises(CheckpointError):
        engine_kwargs(folder, max_model_len=4096)                    # real weights needed
    bad = subprocess.run([sys.executable, str(REPO / "bench/make_ckpt.py"), "tiny", str(tmp_path / "t"), "--hybrid",
                          "2"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--hybrid is for the 9b kind" in bad.stderr


def _with_mismatched_fused_scale(hybrid_checkpoint, tmp_path):
    """A copy of the Hybrid checkpoint whose in_proj_z NVFP4 global scale differs from in_proj_qkv's."""
    from safetensors.torch import load_file, save_file

    ckpt = _copy(hybrid_checkpoint, tmp_path)
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
    assert "re-exported" in proc.stdout
    vllm_cpu.load_model(fixed)


def test_importing_the_plugin_keeps_cuda_checks_fork_safe():
    """torch.cuda.is_available() must go through NVML: cudaGetDeviceCount poisons vLLM's fork."""

    import clef_vllm  # noqa: F401

    assert os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") == "1"


def test_warmup_lengths_cover_every_bucket_both_alignments_and_a_chunked_prompt(tiny_release):
    """The server's warm-up lengths (also what tests/gpu/diag_hang.py --len server replays): every prefill-graph
    bucket, lengths that are and are not multiples of 16, one longer than a step (capped at max_model_len)."""
    from clef_vllm.backends.vllm_backend import engine_kwargs, warmup_lengths
    from clef_vllm.worker.fast.prefill_graphs import DEFAULT_BUCKETS

    lengths = warmup_lengths(engine_kwargs(tiny_release, prefill_graph_scope="core", max_model_len=8192,
                                           max_num_batched_tokens=2048))
    assert lengths == sorted(set(lengths)) and {17, 300, 2048 + 17} <= set(lengths)
    assert {b for b in DEFAULT_BUCKETS if b <= 2048} <= set(lengths)     # buckets up to the step's token budget
    assert any(n % 16 for n in lengths) and any(n % 16 == 0 for n in lengths)
    from clef_vllm.contract import PREFILL_GRAPHS_KEY

    assert engine_kwargs(tiny_release)["additional_config"][PREFILL_GRAPHS_KEY]["scope"] == "step"   # auto
    layer = engine_kwargs(tiny_release, prefill_graph_scope="layer")["additional_config"][PREFILL_GRAPHS_KEY]
    assert layer["scope"] == "layer" and layer["buckets"]
    capped = warmup_lengths(engine_kwargs(tiny_release, max_model_len=1000, prefill_graphs=False))
    assert capped == [17, 64, 300, 1000]                                   # no buckets without prefill graphs
    from clef_vllm.backends.vllm_backend import warmup_batches

    assert warmup_batches(engine_kwargs(tiny_release, max_num_seqs=8)) == [[300] * 8, [97, 256, 411]]
    assert len(warmup_batches(engine_kwargs(tiny_release))[0]) == 32                  # at most 32 at once


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


def test_the_engine_core_is_profiled_over_a_window_of_client_decisions(tmp_path, caplog):
    """``CLEF_VLLM_PROFILE=DIR[,START[,COUNT]]``: vLLM's profiler starts before client decision START and
    stops after decision START+COUNT-1; warm-up prompts do not count; a bad value names the variable."""
    import asyncio
    from types import SimpleNamespace

    from vllm.config import ProfilerConfig

    from clef_vllm.backends.vllm_backend import VllmBackend
    from clef_vllm.model.features import synthetic_spec
    from clef_vllm.util import trace

    assert trace.ProfileWindow.from_env("") is None
    window = trace.ProfileWindow.from_env(str(tmp_path))
    assert (window.directory, window.start, window.count) == (str(tmp_path), 8, 10)
    config = ProfilerConfig(**window.profiler_config())             # what the backend hands vLLM
    assert config.profiler == "torch" and config.torch_profiler_dir == str(tmp_path) and config.ignore_frontend
    assert not config.torch_profiler_with_stack
    stacked = trace.ProfileWindow.from_env(f"{tmp_path},8,3,stack")
    assert (stacked.start, stacked.count, stacked.stack) == (8, 3, True)
    assert ProfilerConfig(**stacked.profiler_config()).torch_profiler_with_stack
    for bad in ("d,x", "d,-1", "d,0,0", ",3", "d,8,3,stacks", "d,8,3,stack,1"):
        with pytest.raises(ValueError, match="CLEF_VLLM_PROFILE"):
            trace.ProfileWindow.from_env(bad)

    calls = []

    class StandIn:                                                   # AsyncLLM's encode and profiler switches
        async def start_profile(self):
            calls.append("start")

        async def stop_profile(self):
            calls.append("stop")

        async def encode(self, prompt, params, request_id):
            calls.append(request_id.split("-")[1])
            n = len(prompt["prompt_token_ids"])
            yield SimpleNamespace(num_cached_tokens=0, prompt_token_ids=list(range(n)), finished=True,
                                  outputs=SimpleNamespace(data=torch.zeros(synthetic_spec(n).num_options)))

    backend = VllmBackend.__new__(VllmBackend)
    backend.state_cache, backend.engine, backend._ids = False, StandIn(), itertools.count()
    backend._profile = trace.ProfileWindow.from_env(f"{tmp_path},1,2")

    async def run():
        ids = list(range(20))
        await backend._encode(ids, synthetic_spec(20), warmup=True)       # request 0: the warm-up's
        for _ in range(4):                                                # requests 1-4: client decisions 0-3
            await backend._encode(ids, synthetic_spec(20))

    with caplog.at_level(logging.INFO, logger="clef_vllm"):
        asyncio.run(run())
    assert calls == ["0", "1", "start", "2", "3", "stop", "4"]
    assert "vLLM's profiler started (client decisions 1..2" in caplog.text and "profiler stopped" in caplog.text

    async def broken():
        raise RuntimeError("Profiler is not enabled")

    backend.engine.start_profile = broken                             # a profiler that fails costs no decision
    backend._profile = trace.ProfileWindow.from_env(f"{tmp_path},0,1")
    calls.clear()
    with caplog.at_level(logging.WARNING, logger="clef_vllm"):
        probs, cached = asyncio.run(backend._encode(list(range(20)), synthetic_spec(20)))
    assert probs.numel() == synthetic_spec(20).num_options and calls == ["5"]          # nothing to stop
    assert "CLEF_VLLM_PROFILE: could not start vLLM's profiler (RuntimeError: Profiler is not enabled)" in caplog.text

    # a window longer than the traffic: the server's shutdown stops the profiler, so the files are still written
    # (a c=16 profile asking for decisions 24..71 of 68 once came back empty)
    engine = StandIn()
    engine.shutdown = lambda: calls.append("shutdown")
    backend.engine, backend._profile = engine, trace.ProfileWindow.from_env(f"{tmp_path},1,5")
    backend._loop = asyncio.new_event_loop()
    backend._thread = threading.Thread(target=backend._loop.run_forever, daemon=True)
    backend._thread.start()
    calls.clear()
    for _ in range(3):                                                # client decisions 0-2 of a window 1..5
        backend._submit(backend._encode(list(range(20)), synthetic_spec(20))).result(timeout=30)
    assert calls == ["6", "start", "7", "8"] and backend._profile.running
    with caplog.at_level(logging.WARNING, logger="clef_vllm"):
        backend.close()
    assert calls[-2:] == ["stop", "shutdown"] and not backend._profile.running
    assert "the engine stops after 2 of the window's 5 requests" in caplog.text
    assert not backend._thread.is_alive()
    backend.close()                                                   # closing twice is harmless


def test_nvfp4_kernel_bf16_dequantizes_the_hybrids_nvfp4_layers_once_at_load(hybrid_checkpoint, caplog):
    """``--nvfp4-kernel bf16`` (the engine's ``additional_config``): every NVFP4 layer of the Hybrid gets the
    plugin's kernel, whose weight is the BF16 dequantization of what vLLM's scheme left for its own kernel
    (packed E2M1, FP8 block scales, the fused module's global multiplier) and whose forward is a BF16 GEMM;
    the FP8 layers keep theirs, the FP4-only parameters are freed, and a later load without the option gets
    vLLM's kernel again. The weights match the checkpoint's own NVFP4 tensors (W4A16) to BF16 rounding."""
    import torch.nn.functional as F
    from safetensors.torch import load_file

    from clef_vllm.contract import NVFP4_KERNEL_KEY
    from clef_vllm.quant.numerics import nvfp4_dequantize
    from clef_vllm.worker.fast.nvfp4_bf16 import install
    from clef_vllm.worker.model import kernel_report

    with caplog.at_level(logging.INFO, logger="clef_vllm"):
        bf16 = vllm_cpu.load_model(hybrid_checkpoint, additional_config={NVFP4_KERNEL_KEY: "bf16"})
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
    auto = vllm_cpu.load_model(hybrid_checkpoint, additional_config={NVFP4_KERNEL_KEY: "auto"})
    assert {type(m.scheme.kernel).__name__ for n, m in auto.named_modules() if n in kernels} == {
        "EmulationNvFp4LinearKernel"}


def test_nvfp4_kernel_bf16_on_a_checkpoint_without_nvfp4_layers_says_it_changes_nothing(tiny_release, caplog,
                                                                                       monkeypatch):
    """The front end's kernel report (before the engine starts) warns that ``--nvfp4-kernel bf16`` has nothing to
    act on in a checkpoint without NVFP4 W4A4 layers, and stays quiet with the default."""
    from clef_vllm.backends.options import backend_options
    from clef_vllm.backends.vllm_backend import VllmBackend
    from clef_vllm.model.checkpoint import locate_checkpoint
    from clef_vllm.quant import kernels

    monkeypatch.setattr(kernels, "cuda_capability", lambda: (9, 0))      # as on an H200
    for choice, warned in (("bf16", True), ("vllm", False)):
        backend = object.__new__(VllmBackend)
        backend.options = backend_options("vllm", {"nvfp4_kernel": choice})
        backend.kwargs, backend.files = {}, locate_checkpoint(tiny_release)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="clef_vllm"):
            backend._report_kernels()
        assert ("--nvfp4-kernel bf16 changes nothing here" in caplog.text) is warned, choice
        assert "kernels: unquantized" in caplog.text and backend.kernels["capability"] == (9, 0)
