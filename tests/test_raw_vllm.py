"""clef-bench's raw-vLLM baseline without vLLM: its engine settings and its profiler window
(``clef_vllm.bench.raw_vllm``); where the GPU idles in a profiled request (``clef_vllm.bench.gpu_timeline``,
``clef_vllm.util.trace.phased``)."""

from __future__ import annotations





def test_raw_vllm_engine_settings(tiny_release, tiny_repacked, tmp_path):
    from clef_vllm.bench.raw_vllm import raw_engine_kwargs
    from clef_vllm.model.release import clef_flash_config, write_config_only_checkpoint

    release = raw_engine_kwargs(tiny_release, max_model_len=4096)
    repacked = raw_engine_kwargs(tiny_repacked, extra={"max_num_seqs": 7})
    for kw in (release, repacked):
        assert kw["runner"] == "pooling" and kw["convert"] == "embed"
        assert kw["enable_prefix_caching"] is False and kw["gdn_prefill_backend"] == "triton"
        assert kw["pooler_config"] == {"seq_pooling_type": "LAST"}
        assert "additional_config" not in kw  # no head options, and so no batch wait (docs/bench.md)
        assert "worker_cls" not in kw         # vLLM's own worker: the plugin's memory budget is the server's
        assert kw["scheduler_cls"] == "clef_vllm.worker.scheduler.ClefScheduler"   # the scheduler's fixes stay
    # The release declares Qwen3_5ForConditionalGeneration: stock class, text only, real weights.
    assert "hf_overrides" not in release and release["language_model_only"] is True
    assert release["load_format"] == "auto" and release["max_model_len"] == 4096
    # Repacked (ClefFlashForDecision, int8 tables): stock text class on dummy weights.
    assert repacked["hf_overrides"] == {"architectures": ["Qwen3_5ForCausalLM"]}
    assert repacked["load_format"] == "dummy" and repacked["max_num_seqs"] == 7
    assert "language_model_only" not in repacked
    assert raw_engine_kwargs(tiny_release, arch="Qwen3_5ForCausalLM")["hf_overrides"] == {
        "architectures": ["Qwen3_5ForCausalLM"]}
    # A 9B-shaped config-only folder: nothing to load, so dummy weights.
    config_only = raw_engine_kwargs(write_config_only_checkpoint(tmp_path / "9b", tiny_release))
    assert config_only["load_format"] == "dummy" and config_only["language_model_only"] is True
    # ... and a quantized config-only folder gets the dummy weights whose scales are tame
    quantized = dict(clef_flash_config(), quantization_config={"quant_method": "compressed-tensors"})
    hybrid = write_config_only_checkpoint(tmp_path / "9b-hybrid", tiny_release, config=quantized)
    assert raw_engine_kwargs(hybrid)["load_format"] == "clef-dummy"


def test_the_raw_baseline_is_profiled_over_a_window_of_its_requests(tmp_path):
    """clef-bench --raw-vllm under CLEF_VLLM_PROFILE=DIR,START,COUNT: vLLM's profiler starts before raw request
    START and stops after START+COUNT-1, as in the server (every request sent counts, warm-up included), so a
    raw step's composition can be compared with the server's; a window the run leaves open is stopped at the
    end. A stand-in for AsyncLLM (vLLM does not run on CPU)."""
    import asyncio
    from array import array
    from types import SimpleNamespace

    from clef_vllm.bench.raw_vllm import RawVllmEngine
    from clef_vllm.bench.workloads import BenchRequest
    from clef_vllm.util import trace

    calls = []

    class StandIn:
        async def start_profile(self):
            calls.append("start")

        async def stop_profile(self):
            calls.append("stop")

        async def encode(self, prompt, params, request_id):
            calls.append(request_id)
            yield SimpleNamespace(prompt_token_ids=prompt["prompt_token_ids"])

        def shutdown(self):
            calls.append("shutdown")

    def run(window: str, n: int) -> list:
        raw = RawVllmEngine({})
        raw.engine, raw._params = StandIn(), object()
        raw._prompt = lambda ids: {"prompt_token_ids": ids}
        raw._profile = trace.ProfileWindow.from_env(window)
        req = BenchRequest("short", {}, b"", 1, 3, input_ids=array("l", [1, 2, 3]))

        async def go():
            outcomes = [await raw.send(req) for _ in range(n)]
            await raw.finish_profile()
            raw.close()
            return outcomes

        calls.clear()
        outcomes = asyncio.run(go())
        assert all(o.status == "200" and o.input_tokens == 3 for o in outcomes)
        return list(calls)

    assert run(f"{tmp_path},1,2", 4) == ["raw-0", "start", "raw-1", "raw-2", "stop", "raw-3", "shutdown"]
    assert run(f"{tmp_path},2,5", 3) == ["raw-0", "raw-1", "start", "raw-2", "stop", "shutdown"]   # left open


def test_the_gpu_timeline_splits_each_request_window_into_lead_busy_gaps_and_tail():
    from clef_vllm.bench.gpu_timeline import split_window, timeline, union_length

    assert union_length([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    kernels = [(3, 5), (4, 8), (10, 12), (13, 14),        # request 1: window 0..20
               (32, 40)]                                 # request 2: window 30..41
    assert split_window((0, 20), kernels) == {"lead": 3, "busy": 8, "gaps": 3, "tail": 6, "kernels": 4}
    assert split_window((30, 41), kernels) == {"lead": 2, "busy": 8, "gaps": 0, "tail": 1, "kernels": 1}
    assert split_window((50, 60), kernels)["lead"] == 10             # no kernel: all of it is lead
    assert timeline([(0, 20), (30, 41)], kernels, scale=1.0) == {"lead_ms": 2.5, "busy_ms": 8.0, "gaps_ms": 1.5,
                                                                 "tail_ms": 3.5, "kernels": 2.5}


def test_the_gpu_timeline_attributes_busy_and_idle_time_to_marked_phases():
    from clef_vllm.bench.gpu_timeline import phase_split, phase_timeline

    kernels = [(0, 2), (3, 5), (6, 7), (9, 10), (12, 14)]           # one request, window 0..20
    phases = {"gdn": [(2, 7.5)], "head": [(11, 14)], "elsewhere": [(40, 50)]}
    split = phase_split((0, 20), kernels, phases)
    assert split["gdn"] == {"span": 5.5, "busy": 3, "idle": 2.5}    # 3..5 and 6..7 inside 2..7.5
    assert split["head"] == {"span": 3, "busy": 2, "idle": 1}
    assert split["elsewhere"] == {"span": 0, "busy": 0, "idle": 0}  # outside this request
    assert split["other"] == {"span": 14 - 8.5, "busy": 3, "idle": 14 - 8.5 - 3}
    assert phase_split((30, 31), kernels, phases) == {}
    assert phase_timeline([(0, 20)], kernels, phases, scale=1.0)["head"] == {"span_ms": 3, "busy_ms": 2,
                                                                             "idle_ms": 1}


def test_profile_phases_wrap_only_when_switched_on(monkeypatch):
    from clef_vllm.util import trace

    def f(x):
        return x + 1

    monkeypatch.setattr(trace, "PHASES", False)
    assert trace.phased("clef_head", f) is f
    monkeypatch.setattr(trace, "PHASES", True)
    wrapped = trace.phased("clef_head", f)
    assert wrapped is not f and wrapped(1) == 2 and wrapped.__name__ == "f"
