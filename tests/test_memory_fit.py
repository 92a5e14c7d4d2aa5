"""The memory plan at the vLLM backend's start (clef_vllm.backends.memory_fit): the NVFP4 kernel chosen by memory,
features turned down where the KV cache would be too small (each change logged and reaching the engine's settings),
a refusal before anything loads, and the worker's reservation of the plugin's graphs."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from clef_vllm.backends.memory_fit import fit_options, options_for
from clef_vllm.backends.options import VllmOptions, backend_options, engine_args
from clef_vllm.contract import PrefillGraphs, WorkerSettings
from clef_vllm.plan.memory_plan import PlanDoesNotFit, PlanInputs

GIB = 1 << 30
HOPPER, BLACKWELL = (9, 0), (10, 0)


@pytest.fixture(scope="module")
def hybrid_9b(tmp_path_factory) -> Path:
    """A config-only 9B Hybrid folder (layers 0-16 FP8, 17-31 NVFP4), as ``bench/make_ckpt.py 9b DIR --hybrid 17``."""
    from clef_vllm.model.release import clef_flash_config, write_config_only_checkpoint
    from clef_vllm.quant.recipe import ignore_list, quantization_config

    config = clef_flash_config()
    config["quantization_config"] = quantization_config(config, 17, ignore_list(config))
    return write_config_only_checkpoint(tmp_path_factory.mktemp("ckpt") / "9b-hybrid",
                                        tmp_path_factory.mktemp("no-tokenizer"), layout="repacked", config=config)


def test_a_16gb_card_gets_the_packed_nvfp4_kernel_and_leaner_features_said_in_the_log(hybrid_9b, caplog):
    caplog.set_level(logging.INFO, logger="clef_vllm")
    opts = backend_options("vllm", {})
    fitted, plan = fit_options(hybrid_9b, opts, device=(int(15.92 * GIB), HOPPER))
    assert fitted.nvfp4_kernel == "vllm"
    assert plan.max_concurrency >= 2 and plan.changes
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("clef memory plan:")]
    assert any("--nvfp4-kernel auto chose vllm (packed weights" in line for line in lines)
    assert any("KV cache" in line and "GiB" in line for line in lines)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == len(plan.changes)                     # one line per change, saying what and why
    # what the plan changed reaches the engine: the options are the engine's settings
    kwargs = engine_args(fitted)
    cfg = WorkerSettings.of(SimpleNamespace(**kwargs))
    assert cfg.head_graph_records == plan.inputs.head_graph_records
    if plan.inputs.gemm_warmup_rows:
        assert cfg.gemm_warmup and cfg.gemm_warmup_rows == plan.inputs.gemm_warmup_rows
    assert kwargs["gpu_memory_utilization"] == 0.9


def test_a_large_card_keeps_the_defaults_and_dequantizes_nvfp4_on_hopper_only(hybrid_9b):
    opts = backend_options("vllm", {})
    fitted, plan = fit_options(hybrid_9b, opts, device=(80 * GIB, HOPPER))
    assert fitted.nvfp4_kernel == "bf16" and not plan.changes
    assert (fitted.head_graphs, fitted.head_graph_records, fitted.prefill_graphs) == (True, 16, True)
    assert fit_options(hybrid_9b, opts, device=(80 * GIB, BLACKWELL))[0].nvfp4_kernel == "vllm"   # native FP4
    # an explicit kernel is the user's: the plan counts it, the options keep it
    assert fit_options(hybrid_9b, backend_options("vllm", {"nvfp4_kernel": "bf16"}),
                       device=(80 * GIB, HOPPER))[0].nvfp4_kernel == "bf16"


def test_without_a_gpu_the_options_stay_as_given(hybrid_9b):
    opts = backend_options("vllm", {})
    assert fit_options(hybrid_9b, opts) == (opts, None)        # this machine: no CUDA GPU for NVML to size


def test_a_card_too_small_is_refused_before_anything_loads(hybrid_9b):
    with pytest.raises(PlanDoesNotFit, match="does not fit in a .* GiB budget.*--max-model-len"):
        fit_options(hybrid_9b, backend_options("vllm", {}), device=(8 * GIB, HOPPER))


def test_turning_a_switch_off_resets_its_sub_options():
    opts = backend_options("vllm", {"head_graph_records": 8, "state_cache_match": "block"})
    inputs = PlanInputs.from_options(opts, 10 * GIB, nvfp4_kernel="vllm", head_graph_records=0, state_cache_bytes=0,
                                     prefill_graphs=False, step_graphs=False, gemm_warmup=False)
    lean = options_for(opts, inputs)
    assert (lean.head_graphs, lean.state_cache, lean.prefill_graphs, lean.gemm_warmup) == (False, False, False, False)
    assert lean.head_graph_records == 16 and lean.state_cache_match == "unit"    # valid options again
    assert not WorkerSettings.of(SimpleNamespace(**engine_args(lean))).head_graphs
    scoped = options_for(opts, PlanInputs.from_options(opts, 10 * GIB, nvfp4_kernel="vllm", step_graphs=False))
    assert scoped.prefill_graphs and scoped.prefill_graph_scope == "core"


def test_the_worker_reserves_what_the_plugin_graphs_hold():
    from clef_vllm.plan.graph_costs import HEAD_GRAPH_BYTES, graph_reservation

    full = graph_reservation(hidden=4096, intermediate=12288, head_records=16,
                             prefill_buckets=[64, 4096], step_graphs=True)
    assert set(full) == {"head graphs", "GDN graphs", "step graphs"} and full["head graphs"] == HEAD_GRAPH_BYTES
    lean = graph_reservation(hidden=4096, intermediate=12288, head_records=0, prefill_buckets=[64, 2048])
    assert set(lean) == {"GDN graphs"} and lean["GDN graphs"] == full["GDN graphs"] // 2
    assert graph_reservation(hidden=4096, intermediate=12288, head_records=0) == {}


def test_the_16gb_plan_reaches_the_engine_as_a_leaner_step_lean_prefill_buckets_and_no_head_graphs(hybrid_9b):
    """Text only (--text-only), the 16 GB card keeps its 3.05 GiB of KV cache with prefill graphs up to 2,048 tokens
    and the state cache; seeing, the vision tower (0.85 GiB) and its encoder take them and images above 4 MP (413),
    and the KV cache still holds five 16k-token sequences."""
    from dataclasses import replace

    from clef_vllm.backends.vllm_backend import engine_kwargs

    fitted, plan = fit_options(hybrid_9b, backend_options("vllm", {"text_only": True}),
                               device=(int(15.92 * GIB), HOPPER))
    assert plan.kv_bytes >= 3.05 * GIB
    kwargs = engine_args(fitted)
    settings = WorkerSettings.of(SimpleNamespace(**kwargs))
    assert kwargs["max_num_batched_tokens"] == 4096 and not settings.head_graphs
    assert kwargs["max_num_seqs"] == 32 and fitted.gemm_warmup_rows == 4096 == settings.gemm_warmup_rows
    assert max(settings.prefill_graphs.buckets) == 2048 and settings.prefill_graphs.scope == "core"
    assert fitted.state_cache and fitted.largest_image_pixels is None

    seeing, plan = fit_options(hybrid_9b, backend_options("vllm", {}), device=(int(15.92 * GIB), HOPPER))
    assert plan.kv_bytes >= 3.05 * GIB
    parts = {p.name: p.bytes for p in plan.parts}
    assert parts["vision tower"] == 2 * 456_010_480
    assert seeing.largest_image_pixels == 4_194_304 and not seeing.prefill_graphs and not seeing.state_cache
    assert any("--max-image-pixels 16,777,216 -> 4,194,304" in line for line in plan.changes)
    image = engine_kwargs(hybrid_9b, replace(seeing, load_format="clef-dummy"))["limit_mm_per_prompt"]["image"]
    assert image["width"] == image["height"] == 2048         # vLLM profiles its encoder on the largest image


def test_what_the_operator_gave_is_kept_and_the_rest_turned_down(hybrid_9b, caplog, monkeypatch):
    """On a 16 GB card the seeing plan turns the state cache off; given (``--state-cache on``), it stays on, the
    plan turns down only the rest and says the KV cache holds fewer than five sequences because of it. The vLLM
    backend passes the options it was given (make_backend's keywords, the server's flags) as given."""
    card = (int(15.92 * GIB), HOPPER)
    caplog.set_level(logging.WARNING, logger="clef_vllm")
    opts = backend_options("vllm", {"state_cache": True})
    fitted, plan = fit_options(hybrid_9b, opts, device=card, given=frozenset({"state_cache"}))
    assert fitted.state_cache and not any("--state-cache off" in line for line in plan.changes)
    assert not fitted.prefill_graphs and not fitted.head_graphs       # the others are turned down as before
    assert 1 <= plan.max_concurrency < 5
    assert any("kept as given: --state-cache" in r.message for r in caplog.records)
    both, _ = fit_options(hybrid_9b, backend_options("vllm", {"max_num_batched_tokens": 8192}), device=card,
                          given=frozenset({"max_num_batched_tokens"}))
    assert both.max_num_batched_tokens == 8192 and not both.state_cache

    from clef_vllm.backends import make_backend, memory_fit, vllm_backend

    seen = []

    def stop_at_the_plan(model_dir, opts, device=None, given=frozenset()):
        seen.append(given)
        raise PlanDoesNotFit("stop here")

    monkeypatch.setattr(vllm_backend, "fit_options", stop_at_the_plan)
    with pytest.raises(PlanDoesNotFit, match="stop here"):
        make_backend(hybrid_9b, "vllm", state_cache=True, max_num_seqs=None, load_format="clef-dummy")
    assert seen == [frozenset({"state_cache", "load_format"})]
    assert memory_fit.PLAN_FIELDS.keys() <= {f.name for f in dataclasses.fields(VllmOptions)}


def test_the_vllm_backend_refuses_a_card_too_small_before_it_loads_anything(hybrid_9b, monkeypatch):
    """The server's load path: the plan runs in the backend's constructor, before the tokenizer, the engine or any
    weight; its message is what the server prints (exit 1)."""
    from clef_vllm.backends import memory_fit
    from clef_vllm.backends.vllm_backend import VllmBackend

    monkeypatch.setattr(memory_fit, "device_memory", lambda: (8 * GIB, HOPPER))
    with pytest.raises(PlanDoesNotFit, match=r"does not fit in a 7\.20 GiB budget.*Biggest consumers: .*To free memory"):
        VllmBackend(hybrid_9b, load_format="clef-dummy")


# --------------------------------------------------------------------------- the worker's budget (clef_vllm.worker.budget)


def _worker(monkeypatch, *, available_gib: float, used_gib: float | None, consumed_gib: float, estimate_gib: float,
            settings: WorkerSettings):
    """A ClefWorker whose vLLM parts are stand-ins: vLLM's KV figure, the driver's count, what vLLM measured."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu_worker import Worker

    from clef_vllm.worker import budget

    monkeypatch.setattr(Worker, "determine_available_memory", lambda self: int(available_gib * GIB))
    monkeypatch.setattr(budget, "process_memory", lambda: None if used_gib is None else int(used_gib * GIB))
    monkeypatch.setattr(budget.torch.cuda, "is_available", lambda: True)
    worker = budget.ClefWorker.__new__(budget.ClefWorker)
    text = SimpleNamespace(hidden_size=4096, intermediate_size=12288)
    worker.vllm_config = SimpleNamespace(additional_config=settings.to_config(), model_config=SimpleNamespace(
        hf_text_config=text, max_model_len=16384), scheduler_config=SimpleNamespace(max_num_batched_tokens=8192))
    worker.total_consumed, worker.cudagraph_memory_estimate = int(consumed_gib * GIB), int(estimate_gib * GIB)
    worker.model_runner = SimpleNamespace(max_num_tokens=8192, max_num_reqs=128, get_model=budget.torch.nn.Module)
    return worker


def test_the_worker_takes_what_vllms_profile_does_not_count_out_of_the_kv_cache(monkeypatch, caplog):
    from clef_vllm.plan.graph_costs import graph_reservation
    from clef_vllm.worker import memory

    caplog.set_level(logging.INFO, logger="clef_vllm")
    worker = _worker(monkeypatch, available_gib=4.51, used_gib=10.0, consumed_gib=9.13, estimate_gib=0.75,
                     settings=WorkerSettings(prefill_graphs=PrefillGraphs((64, 2048), "core")))
    kv = worker.determine_available_memory()
    gdn = graph_reservation(hidden=4096, intermediate=12288, head_records=0,
                            prefill_buckets=[2048])["GDN graphs"]
    context, growth, beyond, served = 0.87 * GIB, 0.3 * GIB, 0.4 * 0.75 * GIB, 0.6 * GIB
    assert abs(kv - (4.51 * GIB - context - growth - beyond - served - gdn)) < 1 << 20
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("clef memory budget:"))
    assert "vLLM's KV cache 4.51 GiB" in line and "CUDA context 0.87 GiB" in line and "GDN graphs" in line
    assert "a served step beyond the profile 0.60 GiB" in line
    assert "head graphs" not in line and line.endswith(f"KV cache {kv / GIB:.2f} GiB")
    assert memory.LEDGER.reserved_for_graphs == gdn
    # with the model's head: the memory rows of requests mid-prefill, their share of what is left
    model = torch.nn.Module()
    model.head = SimpleNamespace(config=SimpleNamespace(width=1024), dtype=torch.bfloat16)
    model.kv_bytes_per_token = 32768
    worker.model_runner.get_model = lambda: model
    rows = worker.determine_available_memory()
    assert abs(rows - kv * 32768 / (32768 + 2048)) < 1 << 20
    # without the driver's count for the process, the plan's figure for the context
    assert _worker(monkeypatch, available_gib=4.51, used_gib=None, consumed_gib=9.13, estimate_gib=0.75,
                   settings=WorkerSettings()).determine_available_memory() > 0


def test_the_worker_refuses_a_budget_the_plugin_leaves_nothing_of(monkeypatch):
    from clef_vllm.worker.budget import MemoryBudgetError

    worker = _worker(monkeypatch, available_gib=1.0, used_gib=10.0, consumed_gib=9.13, estimate_gib=0.75,
                     settings=WorkerSettings(head_graph_records=16))
    with pytest.raises(MemoryBudgetError, match=r"nothing is left.*--head-graphs off.*--gpu-memory-utilization"):
        worker.determine_available_memory()


def test_the_allocator_is_capped_at_the_budget_less_what_lives_outside_it(monkeypatch, caplog):
    from types import SimpleNamespace

    from clef_vllm.worker import budget

    caplog.set_level(logging.INFO, logger="clef_vllm")
    set_to = {}
    cuda = budget.torch.cuda
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * GIB))
    monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: 11 * GIB)
    monkeypatch.setattr(cuda, "set_per_process_memory_fraction", lambda f, device: set_to.update(fraction=f))
    monkeypatch.setattr(budget, "process_memory", lambda: 12 * GIB)          # 1 GiB outside the allocator
    fraction = budget.cap_allocator(int(14.33 * GIB), device="cuda:0")
    cap = 14.33 * GIB - GIB - budget.CAP_MARGIN_BYTES
    assert set_to["fraction"] == fraction and abs(fraction * 80 * GIB - cap) < 1 << 20
    assert "allocator capped at 13.03 GiB" in caplog.text
    # never below what the allocator already holds
    monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: 13.5 * GIB)
    monkeypatch.setattr(budget, "process_memory", lambda: 14.5 * GIB)
    assert budget.cap_allocator(int(14.33 * GIB), device="cuda:0") * 80 * GIB == 13.5 * GIB
