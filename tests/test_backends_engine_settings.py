"""The vLLM engine's settings as the backend builds them (clef_vllm/backends/vllm_backend.py ``engine_kwargs``):
the pooling runner with explicit defaults, typed options through one table, the prefill-graph buckets per
linear kernel, the warm-up lengths; resolved by vLLM's own ``AsyncEngineArgs`` on the CPU platform."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from clef_vllm.contract import WorkerSettings

pytest.importorskip("vllm")
pytestmark = pytest.mark.usefixtures("cpu_shims")


def ws(engine) -> WorkerSettings:
    """The worker settings of engine keywords (a dict), engine arguments or an engine config."""
    config = engine.get("additional_config") if isinstance(engine, dict) else engine.additional_config
    return WorkerSettings.of(SimpleNamespace(additional_config=config))


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
    assert ws(cfg).head_dtype == "float32"                                    # one typed object, checked again
    assert cfg.additional_config["gdn_prefill_backend"] == "triton"
    assert ws(cfg).prefill_graphs.buckets[-1] <= cfg.scheduler_config.max_num_batched_tokens
    assert ws(cfg).head_graph_records == 16                 # on by default, up to 16 requests a step
    # --prefill-graph-buckets: the graphs' padded sizes, vLLM's capture sizes with them (a comma list or ints)
    fine = engine_kwargs(tiny_release, max_model_len=16384, prefill_graph_buckets="448,416,64,16384")
    assert ws(fine).prefill_graphs.buckets == (64, 416, 448, 16384)
    assert {64, 416, 448} <= set(fine["compilation_config"]["cudagraph_capture_sizes"])
    assert 384 not in fine["compilation_config"]["cudagraph_capture_sizes"]           # not a bucket any more
    assert ws(engine_kwargs(tiny_release, prefill_graph_buckets=[128, 64])).prefill_graphs.buckets == (64, 128)
    one = AsyncEngineArgs(**engine_kwargs(tiny_release, max_model_len=2048, head_graph_records=1))
    # the state cache is on unless told: prefix caching matched in 16-token units (the reference stays exact)
    assert one.enable_prefix_caching is True and one.prefix_match_unit == 16
    assert ws(one).state_cache is True and ws(one).head_graph_records == 1
    # the scheduler's rules 4 and 5: vLLM's cleanup step only when asked; a 2 ms batch wait by default for one
    # engine in its own process, none with data parallelism or the engine thread, none when set to 0
    assert ws(one).idle_cleanup_step is False and ws(one).batch_wait_ms == 2.0
    asked = ws(engine_kwargs(tiny_release, idle_cleanup_step=True, batch_wait_ms=2.5))
    assert asked.idle_cleanup_step is True and asked.batch_wait_ms == 2.5
    for no_wait in ({"batch_wait_ms": 0}, {"data_parallel_size": 2}, {"engine_core": "thread"}):
        assert ws(engine_kwargs(tiny_release, **no_wait)).batch_wait_ms == 0, no_wait
    # the GDN metadata memo: on unless told
    assert ws(one).gdn_metadata_memo is True
    assert ws(engine_kwargs(tiny_release, gdn_metadata_memo=False)).gdn_metadata_memo is False
    # the GDN kernels tuned per shape class at start-up unless told (clef_vllm.worker.fast.gdn_tuning)
    assert ws(one).gdn_tuning is True
    assert ws(engine_kwargs(tiny_release, gdn_tuning=False)).gdn_tuning is False
    # NVFP4 layers: auto unless told (the worker's nvfp4_bf16.install resolves auto by its GPU); vLLM's own kernel
    # with --nvfp4-kernel vllm
    assert ws(one).nvfp4_kernel == "auto"
    assert ws(engine_kwargs(tiny_release, nvfp4_kernel="vllm")).nvfp4_kernel == "vllm"
    assert ws(engine_kwargs(tiny_release, nvfp4_kernel="bf16")).nvfp4_kernel == "bf16"
    assert ws(engine_kwargs(tiny_release, nvfp4_kernel="auto", linear_backend="emulation")
              ).nvfp4_kernel == "vllm"                                         # auto yields to the backend
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
    assert ws(off).prefill_graphs is None and not ws(off).head_graphs and not ws(off).state_cache


def test_default_buckets_follow_the_backbones_linear_kernels(tiny_release, tmp_path):
    """Unset ``--prefill-graph-buckets``: a BF16 backbone adds 400, online FP8 pads 321-480 tokens to 480 (the
    H200's cheap step sizes), a quantized checkpoint keeps the generic list; vLLM's capture sizes follow."""
    from clef_vllm.backends.vllm_backend import engine_kwargs
    from clef_vllm.worker.fast.prefill_graphs import DEFAULT_BUCKETS, LINEAR_BUCKETS

    def planned(model_dir, **opts):
        kwargs = engine_kwargs(model_dir, max_model_len=4096, **opts)
        return list(ws(kwargs).prefill_graphs.buckets), kwargs["compilation_config"][
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


def test_repacked_checkpoint_names_its_own_architecture(tiny_repacked):
    from clef_vllm.backends.vllm_backend import engine_kwargs

    assert json.loads((tiny_repacked / "config.json").read_text())["architectures"] == ["ClefFlashForDecision"]
    assert "hf_overrides" not in engine_kwargs(tiny_repacked)


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
    assert ws(engine_kwargs(tiny_release)).prefill_graphs.scope == "step"   # auto
    layer = ws(engine_kwargs(tiny_release, prefill_graph_scope="layer")).prefill_graphs
    assert layer.scope == "layer" and layer.buckets
    capped = warmup_lengths(engine_kwargs(tiny_release, max_model_len=1000, prefill_graphs=False))
    assert capped == [17, 64, 300, 1000]                                   # no buckets without prefill graphs
    from clef_vllm.backends.vllm_backend import warmup_batches

    assert warmup_batches(engine_kwargs(tiny_release, max_num_seqs=8)) == [[300] * 8, [97, 256, 411]]
    assert len(warmup_batches(engine_kwargs(tiny_release))[0]) == 32                  # at most 32 at once
